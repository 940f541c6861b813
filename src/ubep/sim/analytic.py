"""Vectorised executor: times an :class:`~ubep.sim.spec.OpSpec` with whole-array numpy passes.

Every stage of the model in docs/SIMULATOR.md has a closed form that numpy evaluates for all
ranks at once:

* processor sharing of a rank's send cores: all active cores progress equally, so the work level
  ``L(t)`` is piecewise linear with a break each time a core runs out of work; a unit ends when
  ``L`` reaches its core's cumulative work (:func:`_ps_times`);
* FIFO ports and in-order consumers are max-plus recurrences ``d_i = max(a_i, d_{i-1}) + s_i``,
  solved by ``d_i = S_i + max_{k<=i}(a_k - S_{k-1})`` with a grouped running maximum
  (:func:`_fifo`, :func:`_cut_through`);
* barriers, flags and polls are maxima and sums over the same arrays.

:mod:`ubep.sim.events` walks the same model one event at a time; a test checks they agree.
"""

from __future__ import annotations

import numpy as np

from ..topology import Topology
from .events import TIE_NS
from .fabric import FabricModel
from .order import lex_order
from .spec import OpSpec, core_rx_wait_ns
from .syncs import sync_mode
from .timeline import SimResult, TaskTimeline

__all__ = ["chunk_entries", "poll_scan", "run_analytic"]


def _tie(times: np.ndarray) -> np.ndarray:
    """Sort key that treats times closer than ``TIE_NS`` as equal (as the event mode does)."""
    return np.round(times / TIE_NS)


def _dense(group: np.ndarray) -> np.ndarray:
    """Dense 0.. ids of a sorted group array."""
    if group.size == 0:
        return group.astype(np.int64)
    return np.concatenate(([0], np.cumsum(group[1:] != group[:-1])))


def _grouped_cummax(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Running maximum of ``values`` that restarts at every new (sorted) group."""
    if values.size == 0:
        return values.copy()
    dense = _dense(group).astype(np.float64)
    span = float(values.max() - values.min()) + 1.0
    return np.maximum.accumulate(values + dense * span) - dense * span


def _grouped_cumsum(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    total = np.cumsum(values)
    if values.size == 0:
        return total
    starts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    before = np.concatenate(([0.0], total[:-1]))[starts]
    return total - np.repeat(before, np.diff(np.append(starts, values.size)))


def _fifo(group: np.ndarray, arrive: np.ndarray, service: np.ndarray,
          free_at: np.ndarray | None = None) -> np.ndarray:
    """Store-and-forward FIFO per group (rows sorted by group, then by service order):
    ``d_i = max(a_i, d_{i-1}) + s_i`` with ``d_{-1} = free_at`` of the row's group (or -inf)."""
    s_cum = _grouped_cumsum(group, service)
    key = arrive - (s_cum - service)
    if free_at is not None:
        key = np.maximum(key, free_at)
    return s_cum + _grouped_cummax(group, key)


def _cut_through(group: np.ndarray, arrive: np.ndarray, service: np.ndarray) -> np.ndarray:
    """Cut-through port per group: ``d_i = max(a_i, d_{i-1} + s_i)`` (first bytes already
    serialised upstream; the port only delays rows that queue behind others)."""
    s_cum = _grouped_cumsum(group, service)
    return s_cum + _grouped_cummax(group, arrive - s_cum)


def _ps_times(spec: OpSpec, fabric: FabricModel, t0: float) -> tuple[np.ndarray, np.ndarray]:
    """Unit end times and ``[R, n_s]`` core end times under processor sharing per rank."""
    R, n_s = spec.num_ranks, spec.num_send_cores
    total = np.concatenate(([0.0], np.cumsum(spec.unit_work_ns)))
    core_total = (total[spec.core_ptr[1:]] - total[spec.core_ptr[:-1]]).reshape(R, n_s)
    unit_cell = spec.unit_src * n_s + spec.unit_core
    cum = total[1:] - total[spec.core_ptr[:-1]][unit_cell]
    levels = np.sort(core_total, axis=1)
    active = n_s - np.arange(n_s)
    rate = fabric.speed(active)
    dt = np.diff(levels, axis=1, prepend=0.0) / rate[None, :]
    tau = t0 + np.cumsum(dt, axis=1)
    # Map cumulative work to time: find the segment of the rank's sorted levels that holds it.
    big = float(levels.max(initial=0.0)) + 1.0
    flat_levels = (levels + big * np.arange(R)[:, None]).ravel()
    seg = np.searchsorted(flat_levels, cum + big * spec.unit_src, side="left")
    i = seg - spec.unit_src * n_s  # index of the segment inside the rank
    prev_level = np.where(i > 0, levels.ravel()[np.maximum(seg - 1, 0)], 0.0)
    prev_tau = np.where(i > 0, tau.ravel()[np.maximum(seg - 1, 0)], t0)
    unit_end = prev_tau + (cum - prev_level) / rate[np.minimum(i, n_s - 1)]
    # A core ends at the time its own level is reached (t0 for a core without work).
    order = np.argsort(core_total, axis=1, kind="stable")
    core_end = np.empty_like(core_total)
    np.put_along_axis(core_end, order, np.where(levels > 0, tau, t0), axis=1)
    # A core's own stalls (fences) delay its later units by their running sum; the shared work
    # above is timed as if the core kept its share meanwhile (docs/SIMULATOR.md 1.2).
    if spec.unit_stall_ns.any():
        stalls = np.concatenate(([0.0], np.cumsum(spec.unit_stall_ns)))
        unit_end = unit_end + stalls[1:] - stalls[spec.core_ptr[:-1]][unit_cell]
        core_stall = (stalls[spec.core_ptr[1:]] - stalls[spec.core_ptr[:-1]]).reshape(R, n_s)
        core_end = core_end + core_stall
    return unit_end, core_end


def _fly(spec: OpSpec, topology: Topology,
         unit_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Landing times and departure times (a hop-0 unit departs when issued): source port FIFO,
    flight latency, cut-through destination port."""
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    bw = np.asarray(topology.bandwidth_gbps, dtype=np.float64)
    hop = spec.unit_hop
    land = unit_end + lat[hop]
    depart_all = unit_end.copy()
    remote = np.flatnonzero(hop > 0)
    if remote.size:
        service = spec.unit_wire_bytes[remote] / bw[hop[remote]]
        src, end = spec.unit_src[remote], unit_end[remote]
        order = lex_order((remote, _tie(end), src))
        depart = np.empty(remote.size)
        depart[order] = _fifo(src[order], end[order], service[order])
        depart_all[remote] = depart
        arrive = depart + lat[hop[remote]]
        dst = spec.unit_dst[remote]
        order = lex_order((remote, _tie(arrive), dst))
        got = np.empty(remote.size)
        got[order] = _cut_through(dst[order], arrive[order], service[order])
        land[remote] = got
    return land, depart_all


def core_round_trip_ns(spec: OpSpec, topology: Topology, unit_end: np.ndarray,
                       unit_depart: np.ndarray) -> np.ndarray:
    """``[R, n_s]`` the largest round trip of each send core's rows, program (1)'s
    ``max_i RTT_i``: a row's round trip is its occupancy of the rank's link (the wait behind
    the other cores' rows in the source port, plus its own serialisation: ``depart - end``)
    plus the flight out and the acknowledgement back, ``2 L[h]``. No receiver queueing."""
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    rtt = unit_depart - unit_end + 2.0 * lat[spec.unit_hop]
    out = np.zeros(spec.num_ranks * spec.num_send_cores)
    np.maximum.at(out, spec.unit_src * spec.num_send_cores + spec.unit_core, rtt)
    return out.reshape(spec.num_ranks, spec.num_send_cores)


def _group_max(group: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    out = np.full(size, -np.inf)
    np.maximum.at(out, group, values)
    return out


def chunk_entries(spec: OpSpec, topology: Topology, start: np.ndarray) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """Every (source, chunk) word as a receiver entry: ``(receiver, poll core, land)``,
    sorted by (receiver, poll core, scan order)."""
    R, C = spec.num_ranks, spec.chunk_core.size
    if C == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    hops = topology.hop_matrix().astype(np.int64)
    src = np.repeat(np.arange(R), C)
    chunk = np.tile(np.arange(C), R)
    dst = spec.chunk_dst[chunk]
    land = start[src] + spec.chunk_offset_ns[src, chunk] + lat[hops[src, dst]]
    # Scan order on the receiver: by source, then chunk; entry e goes to poll core e mod P.
    order = lex_order((chunk, src, dst))
    dst_o = dst[order]
    first = np.searchsorted(dst_o, np.arange(R))
    entry = np.arange(order.size) - first[dst_o]
    poll = spec.poll_first + entry % spec.poll_cores
    order2 = lex_order((entry, poll, dst_o))
    return dst_o[order2], poll[order2], land[order][order2]


def poll_scan(spec: OpSpec, recv: np.ndarray, poll: np.ndarray, land: np.ndarray,
               core_start: np.ndarray, poll_ns: float, lanes: int = 1) -> np.ndarray:
    """``[R, n]`` when each poll core has seen all of its entries: a stop-and-wait scan in
    static order, ``lanes`` entries per poll (``v = max(v, last land of the block) +
    poll_ns``), starting at ``core_start [R, n]``."""
    done = core_start.copy()
    if recv.size:
        cell = recv * spec.cores_per_rank + poll
        if lanes > 1:  # entries of a cell are consecutive: cut them into blocks of `lanes`
            starts = np.flatnonzero(np.concatenate(([True], cell[1:] != cell[:-1])))
            index = np.arange(cell.size) - np.repeat(starts, np.diff(np.append(starts,
                                                                               cell.size)))
            block = _dense(cell * (cell.size + 1) + index // lanes)
            size = int(block[-1]) + 1
            land = _group_max(block, land, size)
            cell = _first_of_block(cell, block, size)
        fin = _fifo(cell, land, np.full(land.size, poll_ns), core_start.ravel()[cell])
        flat = done.ravel()
        np.maximum.at(flat, cell, fin)
        done = flat.reshape(done.shape)
    return done


def _first_of_block(values: np.ndarray, block: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=values.dtype)
    out[block[::-1]] = values[::-1]
    return out


def run_analytic(spec: OpSpec, topology: Topology, fabric: FabricModel) -> SimResult:
    """Time ``spec`` on ``topology`` with ``fabric`` (see module docstring)."""
    R, n, n_s = spec.num_ranks, spec.cores_per_rank, spec.num_send_cores
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    t0 = float(fabric.init_ns)
    ranks = np.arange(R)
    parts: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    used = n if spec.engine == "bsp" else spec.consume_cores
    rr, cc = np.meshgrid(ranks, np.arange(used), indexing="ij")
    parts.append(("init", rr.ravel(), cc.ravel(), np.zeros(rr.size), np.full(rr.size, t0)))

    unit_end, core_end = _ps_times(spec, fabric, t0)
    land, depart = _fly(spec, topology, unit_end)
    ack = land + lat[spec.unit_hop]
    core_units = np.diff(spec.core_ptr).reshape(R, n_s)
    has = core_units > 0
    sr, sc = np.nonzero(has)
    parts.append(("send", sr, sc, np.full(sr.size, t0), core_end[sr, sc]))
    cell = spec.unit_src * n_s + spec.unit_core
    flat_land = np.zeros(R * n_s)
    np.maximum.at(flat_land, cell, land)
    core_land = flat_land.reshape(R, n_s)
    flat_ack = np.zeros(R * n_s)
    np.maximum.at(flat_ack, cell, ack)

    avail = np.full((R, n), t0)  # when each core may start consuming items
    offsets_ready = np.full(R, -np.inf)
    if spec.engine == "bsp":
        arrive = np.full((R, n), t0)
        arrive[:, :n_s] = core_end
        data_done = _group_max(spec.unit_src, ack, R)
        b1 = _syncall(np.maximum(arrive.max(axis=1), data_done), fabric, topology)
        parts.append(("barrier", rr.ravel(), cc.ravel(), arrive.ravel(), np.repeat(b1, n)))
        flag_end = _phase_ends(spec, b1)
        parts.append(("flag", rr.ravel(), cc.ravel(), np.repeat(b1, n), flag_end.ravel()))
        recv, poll, eland = chunk_entries(spec, topology, b1)
        ver_end = poll_scan(spec, recv, poll, eland, flag_end, fabric.poll_ns,
                             fabric.poll_lanes)
        parts.append(("verify", rr.ravel(), cc.ravel(), flag_end.ravel(), ver_end.ravel()))
        b2 = _syncall(ver_end.max(axis=1), fabric, topology)
        parts.append(("barrier", rr.ravel(), cc.ravel(), ver_end.ravel(), np.repeat(b2, n)))
        cum_end = b2 + spec.cumsum_ns
        if spec.cumsum_ns > 0:
            parts.append(("cumsum", rr.ravel(), cc.ravel(), np.repeat(b2, n),
                          np.repeat(cum_end, n)))
        avail[:] = cum_end[:, None]
        ready = land
    else:
        avail[:, :n_s] = np.where(has, core_end, t0)
        if spec.chunk_core.size:
            starts = np.full(R, t0)
            count_end = _phase_ends(spec, starts)
            cores = np.arange(n_s, n_s + spec.num_count_cores)
            cr, ccore = np.meshgrid(ranks, cores, indexing="ij")
            parts.append(("count", cr.ravel(), ccore.ravel(), np.full(cr.size, t0),
                          count_end[:, cores].ravel()))
            recv, poll, eland = chunk_entries(spec, topology, starts)
            ver_end = poll_scan(spec, recv, poll, eland, count_end, fabric.poll_ns,
                                 fabric.poll_lanes)
            parts.append(("verify", cr.ravel(), ccore.ravel(), count_end[:, cores].ravel(),
                          ver_end[:, cores].ravel()))
            cum_start = ver_end[:, cores].max(axis=1)
            offsets_ready = cum_start + spec.cumsum_ns
            parts.append(("cumsum", ranks, np.full(R, n_s), cum_start, offsets_ready))
            avail[:, cores] = ver_end[:, cores]
            avail[:, n_s] = offsets_ready
        ready = _asp_ready(spec, topology, unit_end, land)

    item_ready = np.maximum(_group_max(spec.unit_item, ready, spec.num_items),
                            offsets_ready[spec.item_rank])
    item_end, consume_first = _consume(spec, item_ready, avail)
    rank_end = np.maximum(avail.max(axis=1), _group_max(spec.item_rank, item_end, R))
    if spec.engine == "asp":
        rank_end = np.maximum(rank_end, core_land.max(axis=1, initial=t0))
    cr2, cc2 = np.nonzero(np.isfinite(consume_first))
    cell_end = _group_max(spec.item_rank * n + spec.item_core, item_end, R * n).reshape(R, n)
    parts.append(("consume", cr2, cc2, consume_first[cr2, cc2], cell_end[cr2, cc2]))
    consume_work = np.bincount(spec.item_rank, weights=spec.item_cost_ns, minlength=R)
    return SimResult(
        op=spec.op, engine=spec.engine, sync=spec.sync, mode="analytic",
        latency_ns=float(rank_end.max(initial=t0)), rank_end_ns=rank_end,
        timeline=TaskTimeline.build(parts), unit_end_ns=unit_end, unit_land_ns=land,
        unit_ready_ns=ready, core_send_end_ns=np.where(has, core_end, 0.0),
        core_land_end_ns=core_land, item_end_ns=item_end, consume_work_ns=consume_work,
        core_ack_end_ns=flat_ack.reshape(R, n_s),
        core_rtt_ns=core_round_trip_ns(spec, topology, unit_end, depart),
        core_rx_wait_ns=core_rx_wait_ns(spec, topology, land, depart),
        cores_per_rank=n, spec=spec,
    )


def _syncall(arrived: np.ndarray, fabric: FabricModel, topology: Topology) -> np.ndarray:
    """``[R]`` when each rank's SyncAll releases, from when the rank's last core arrived: a
    per-rank SyncAll waits for its own cores, a global one for every rank's."""
    if fabric.syncall_global:
        arrived = np.full(arrived.shape, arrived.max(initial=0.0))
    return arrived + fabric.syncall_ns(topology)


def _phase_ends(spec: OpSpec, start: np.ndarray) -> np.ndarray:
    """``[R, n]`` end of each core's chunk writes (count + flag words) from ``start [R]``."""
    R = spec.num_ranks
    busy = np.zeros((R, spec.cores_per_rank))
    if spec.chunk_core.size:
        rows = np.repeat(np.arange(R), spec.chunk_core.size)
        cols = np.tile(spec.chunk_core, R)
        np.maximum.at(busy, (rows, cols), spec.chunk_offset_ns.ravel())
    return start[:, None] + busy


def _asp_ready(spec: OpSpec, topology: Topology, unit_end: np.ndarray,
               land: np.ndarray) -> np.ndarray:
    """When the receiver may consume each unit under the sync mode (ASP)."""
    lat = np.asarray(topology.latency_ns, dtype=np.float64)[spec.unit_hop]
    if not sync_mode(spec.sync).batch_signal:
        return land  # the data is the flag: usable as soon as it has landed
    # DC / SW: the checksum or flag leaves when the batch's last unit ends (for SW that unit's
    # work includes the fence) and the batch is usable once it and every row have landed.
    size = int(spec.unit_batch.max(initial=0)) + 1
    signal = _group_max(spec.unit_batch, unit_end + lat, size)
    rows = _group_max(spec.unit_batch, land, size)
    return np.maximum(signal, rows)[spec.unit_batch]


def _consume(spec: OpSpec, item_ready: np.ndarray, avail: np.ndarray) -> tuple[
        np.ndarray, np.ndarray]:
    """Each core consumes its items in order of readiness (a non-idling FIFO server)."""
    n = spec.cores_per_rank
    cell = spec.item_rank * n + spec.item_core
    order = lex_order((np.arange(spec.num_items), _tie(item_ready), cell))
    c = cell[order]
    fin = np.empty(spec.num_items)
    fin[order] = _fifo(c, item_ready[order], spec.item_cost_ns[order], avail.ravel()[c])
    start = np.full(avail.size, np.inf)
    begin = np.maximum(item_ready, avail.ravel()[cell])
    np.minimum.at(start, cell, begin)
    return fin, start.reshape(avail.shape)
