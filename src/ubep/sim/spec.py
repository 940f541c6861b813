"""What the executors time: the transfers of a Plan and the operator spec built from all plans.

:func:`transfers` is the simulator's reading of one :class:`~ubep.sched.Plan`: which bytes go to
which slot of which rank, in which core's issue order. The runtime reads the same Plan; a test
checks both against an oracle built from ``topk_idx`` alone.

:class:`OpSpec` gathers the transfers of every rank plus the count/flag chunks and the receive
items (rows to reorder, or tokens to reduce) of one operator call, so that the event-driven and
the analytic executor consume exactly the same input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..modes import ENGINES
from ..sched.plan import Plan
from ..topology import Topology
from .fabric import FabricModel, sync_costs
from .order import lex_order
from .syncs import SW, sync_mode

__all__ = ["OPS", "OpSpec", "RowCosts", "Transfers", "build_spec", "core_rx_wait_ns", "meet_ns",
           "receiver_drain_ns",
           "transfers", "vouch_ns"]

OPS = ("dispatch", "combine")
#: cores per rank the ASP model needs: a send core and a count core (the runtime's one-core
#: engine, which does both on one thread, has no model here)
ASP_MIN_CORES = 2


@dataclass(frozen=True)
class Transfers:
    """Every row a plan moves, in issue order grouped by core; ``[U]`` arrays.

    ``(dst_rank, expert, slot)`` names the destination row: ``slot`` is the row inside the
    receive region ``(src_rank, expert)`` (layout "expert") or ``(src_rank,)`` (layout "rank",
    where ``expert`` is the token's first expert on that rank). ``nbytes`` are wire bytes.
    """

    src_rank: int
    dst_rank: np.ndarray
    expert: np.ndarray
    slot: np.ndarray
    src_token: np.ndarray
    src_k: np.ndarray
    core: np.ndarray
    hop: np.ndarray
    nbytes: np.ndarray


def transfers(
    plan: Plan, *, row_bytes: int, sync: str = SW, block_bytes: int = 512, flag_bytes: int = 32
) -> Transfers:
    """The ``(dst_rank, slot, src_token, nbytes)`` rows that ``plan`` sends, in issue order.

    ``row_bytes = hidden * itemsize``. Under a mode whose flag rides in every block (TFF,
    :attr:`SyncMode.flag_in_block`) every row travels as ``ceil(row_bytes / (block_bytes -
    flag_bytes))`` blocks of ``block_bytes``; the other modes move the raw row (their flags and
    checksums are separate, smaller messages).
    """
    if not isinstance(plan, Plan):
        raise InvalidArgumentError("plan", type(plan).__name__, "must be a ubep.sched.Plan")
    if not isinstance(row_bytes, (int, np.integer)) or row_bytes < 1:
        raise InvalidArgumentError("row_bytes", row_bytes, "must be a positive integer")
    mode = sync_mode(sync)
    if not 8 <= flag_bytes < block_bytes:
        raise InvalidArgumentError("flag_bytes", flag_bytes, f"must be in [8, {block_bytes})")
    if mode.flag_in_block:
        wire = -(-int(row_bytes) // (block_bytes - flag_bytes)) * block_bytes
    else:
        wire = int(row_bytes)
    return Transfers(
        src_rank=plan.rank,
        dst_rank=np.asarray(plan.send_dst_rank, dtype=np.int64),
        expert=np.asarray(plan.send_expert, dtype=np.int64),
        slot=np.asarray(plan.send_slot, dtype=np.int64),
        src_token=np.asarray(plan.send_token, dtype=np.int64),
        src_k=np.asarray(plan.send_k, dtype=np.int64),
        core=np.asarray(plan.send_core, dtype=np.int64),
        hop=np.asarray(plan.send_hop, dtype=np.int64),
        nbytes=np.full(plan.num_units, wire, dtype=np.int64),
    )


@dataclass(frozen=True)
class RowCosts:
    """Per-row core costs that replace the fabric's formulas (the host model, docs/SIMULATOR.md
    section 6): a fabric whose row costs were measured rather than derived.

    ``send_ns[h]``: sender core time for one row of hop class ``h`` (0 = own rank, 1 = a peer;
    the last entry serves every higher class); ``consume_ns[h]``: receiver core time for one row
    that arrived over hop class ``h``; ``send_wait_ns[h]``: the sender core's own wait after the
    row (a stall, outside the shared send machinery; default none). Everything else (batches,
    flags, barriers, waits, the executors) is the model as for any fabric.
    """

    send_ns: tuple[float, ...]
    consume_ns: tuple[float, ...]
    send_wait_ns: tuple[float, ...] = (0.0,)

    def __post_init__(self) -> None:
        for name in ("send_ns", "consume_ns", "send_wait_ns"):
            values = getattr(self, name)
            if not values or any(not (v >= 0) for v in values):
                raise InvalidArgumentError(name, values, "must be a non-empty tuple of >= 0")

    def per_hop(self, name: str, hop: np.ndarray) -> np.ndarray:
        values = np.asarray(getattr(self, name), dtype=np.float64)
        return values[np.minimum(hop, values.size - 1)]


@dataclass(frozen=True)
class OpSpec:
    """One operator call on every rank, as the executors need it.

    Cores are physical core ids ``[0, cores_per_rank)``. Send core ``j`` of a plan is physical
    core ``j``; ASP count core ``c`` is physical core ``num_send_cores + c``; BSP runs every
    phase on all ``cores_per_rank`` cores.

    Units (``[U]``, sorted by ``(src, core, issue order)``): ``unit_src, unit_core, unit_hop,
    unit_dst, unit_wire_bytes, unit_work_ns`` (core work before contention, sync extras and the
    DC checksum message included), ``unit_stall_ns`` (the issuing core's own wait after the
    unit, outside the shared send machinery: its exposed wait and ASP SW's fence), ``unit_batch``
    (``(src, core, dst)``: the DC checksum / ASP SW flag batch) and ``unit_item`` (receive item
    it feeds).
    ``core_ptr [num_ranks * num_send_cores + 1]``: units of ``(rank r, send core j)`` are
    ``core_ptr[r*n_s + j] : core_ptr[r*n_s + j + 1]``.

    Chunks (the same cores and destinations on every rank): core ``chunk_core[i]`` writes one
    flag/count word to rank ``chunk_dst[i]``; on rank ``r`` that write completes
    ``chunk_offset_ns[r, i]`` after the rank's count/flag phase starts (counting, the SW fence
    round trip and the store, cumulated over the core's chunks).
    ``poll_cores``: receivers poll their entries on physical cores ``[poll_first, poll_first +
    poll_cores)``.

    Items (``[I]``): ``item_rank, item_core`` (static consumer core), ``item_cost_ns``.

    ``row_bytes``: a row's payload (``hidden * itemsize``; the wire bytes above add blocks'
    flags and metadata), what a traced span's ``size_bytes`` counts.
    """

    op: str
    engine: str
    sync: str
    num_ranks: int
    cores_per_rank: int
    num_send_cores: int
    num_count_cores: int
    num_local_experts: int
    unit_src: np.ndarray
    unit_core: np.ndarray
    unit_hop: np.ndarray
    unit_dst: np.ndarray
    unit_wire_bytes: np.ndarray
    unit_work_ns: np.ndarray
    unit_stall_ns: np.ndarray
    unit_batch: np.ndarray
    unit_item: np.ndarray
    core_ptr: np.ndarray
    chunk_core: np.ndarray
    chunk_dst: np.ndarray
    chunk_offset_ns: np.ndarray
    poll_first: int
    poll_cores: int
    cumsum_ns: float
    item_rank: np.ndarray
    item_core: np.ndarray
    item_cost_ns: np.ndarray
    row_bytes: int = 0

    @property
    def num_units(self) -> int:
        return int(self.unit_src.size)

    @property
    def num_items(self) -> int:
        return int(self.item_rank.size)

    @property
    def consume_cores(self) -> int:
        """Physical cores that consume items (all BSP cores; ASP send + count cores)."""
        if self.engine == "bsp":
            return self.cores_per_rank
        return min(self.cores_per_rank, self.num_send_cores + self.num_count_cores)


def _check_plans(plans: Sequence[Plan], topology: Topology) -> tuple[int, int]:
    if len(plans) != topology.num_ranks:
        raise InvalidArgumentError(
            "plans", len(plans), f"needs one plan per rank ({topology.num_ranks})"
        )
    n_s, n_c = plans[0].num_send_cores, plans[0].num_count_cores
    for r, plan in enumerate(plans):
        if not isinstance(plan, Plan):
            raise InvalidArgumentError("plans", type(plan).__name__, "must hold ubep.sched.Plan")
        if plan.rank != r or plan.num_ranks != topology.num_ranks:
            raise InvalidArgumentError("plans", (r, plan.rank), "plans[r] must be rank r's plan")
        if (plan.num_send_cores, plan.num_count_cores) != (n_s, n_c):
            raise InvalidArgumentError(
                "plans", (plan.num_send_cores, plan.num_count_cores),
                f"every rank must use the same core split as rank 0 ({n_s}, {n_c})",
            )
        if plan.num_units and int(plan.send_hop.max()) >= topology.num_hops:
            raise InvalidArgumentError("topology", topology.num_hops, "has too few hop classes")
    if n_s > topology.cores_per_rank:
        raise InvalidArgumentError("plans", n_s, "more send cores than topology.cores_per_rank")
    return n_s, n_c


def build_spec(
    plans: Sequence[Plan],
    topology: Topology,
    fabric: FabricModel,
    *,
    engine: str,
    sync: str,
    row_bytes: int,
    op: str = "dispatch",
    row_costs: RowCosts | None = None,
) -> OpSpec:
    """Gather every rank's transfers and the engine's chunks and items into an :class:`OpSpec`.

    For ``op="combine"`` pass the combine plans (:func:`ubep.sched.combine.combine_plans`): each
    unit sends one expert output row back to ``send_dst_rank``, and a receive item is one token
    ``(dst, send_token)`` reduced over all of its rows.

    ``row_costs`` replaces the per-row send and consume formulas with measured costs (the host
    model); it also lets BSP run any sync mode, whose extra passes the measured costs carry.
    """
    if engine not in ENGINES:
        raise InvalidArgumentError("engine", engine, f"must be one of {ENGINES}")
    if op not in OPS:
        raise InvalidArgumentError("op", op, f"must be one of {OPS}")
    mode = sync_mode(sync)
    if engine == "bsp" and not mode.bsp_after_barrier and row_costs is None:
        raise InvalidArgumentError(
            "sync", sync, f"the BSP engine publishes counts and flags after a barrier: use {SW!r}"
        )
    n_s, n_c = _check_plans(plans, topology)
    n = topology.cores_per_rank
    if engine == "asp" and n_s + n_c > n:
        raise InvalidArgumentError(
            "plans", (n_s, n_c), f"ASP needs send + count cores <= cores_per_rank ({n})"
        )
    num_ranks = topology.num_ranks
    num_experts = plans[0].num_experts
    epr = num_experts // num_ranks
    costs = sync_costs(sync, row_bytes, fabric)
    lay = _layout(plans, topology, sync=sync, row_bytes=row_bytes,
                  block_bytes=fabric.atomic_bytes, flag_bytes=fabric.tff_flag_bytes)
    src, core, hop, dst = lay.src, lay.core, lay.hop, lay.dst
    wire, counts, core_ptr = lay.wire, lay.counts, lay.core_ptr
    if engine == "asp" and op == "dispatch" and row_costs is None:
        wire = wire * (1.0 + fabric.metadata_ratio)  # metadata and flags ride with the rows

    if row_costs is None:
        work = fabric.unit_work_ns(wire, hop, topology) + costs.sender_extra_ns
        # Window wait: the core's own stall per row, its round trip over its store window.
        stall = fabric.window_wait_ns(wire, hop, work, topology)
    else:
        work = row_costs.per_hop("send_ns", hop)
        stall = row_costs.per_hop("send_wait_ns", hop)
    # Batches: one core's rows to one destination. DC ends each with a checksum message; ASP's
    # SW ends each with a fence -- the core stalls for the round trip of its last store -- and a
    # flag. (BSP's SW flags come after the barrier instead; its batches are unused.)
    batch, last = lay.batch, lay.last
    if mode.batch_signal == "checksum":
        work = work + np.where(last, fabric.flag_ns, 0.0)
    elif mode.batch_signal == "fence" and engine == "asp":
        # The fence is the core's own wait for its acknowledgement: it holds no share of the
        # rank's send machinery (a stall, not work), then the flag is one more store.
        lat = np.asarray(topology.latency_ns, dtype=np.float64)[hop]
        bw = np.asarray(topology.bandwidth_gbps, dtype=np.float64)[hop]
        fence = fabric.fence_rtt_fraction * (2 * lat + wire / bw)
        if mode.meet and fabric.sw_meet:  # the rank's sending AIVs meet before each flag
            meet = meet_ns(counts, fabric)
            fence = fence + meet[src]
            fence = fence + np.where(_first_batch_end(last, src, core),
                                     vouch_ns(num_ranks, meet, fabric)[src], 0.0)
        stall = stall + np.where(last, fence, 0.0)
        work = work + np.where(last, fabric.flag_ns, 0.0)

    consume = n if engine == "bsp" else min(n, n_s + n_c)
    # Consuming a row is a local copy (a hop-0 move of its wire bytes) plus the sync checks.
    row_cost = float(
        fabric.unit_work_ns(np.array([costs.wire_bytes]), np.zeros(1, np.int64), topology)[0]
    ) + costs.receiver_extra_ns
    item, item_rank, item_core, item_hop, item_of_rows = _items(lay, plans[0].layout, op,
                                                                num_ranks, consume)
    per_row = (np.full(item_hop.size, row_cost) if row_costs is None
               else row_costs.per_hop("consume_ns", item_hop))
    # Dispatch: one item per row; combine: a token's reduction over all of its rows.
    item_cost = (per_row if item_of_rows is None
                 else np.bincount(item_of_rows, weights=per_row, minlength=item_rank.size))
    chunk_core, chunk_dst, chunk_experts, poll_first, poll_cores = _chunks(
        op, engine, num_ranks, num_experts, n, n_s, n_c, plans[0].count_expert_ptr
    )
    # Only BSP's words signal that data is complete (SW: after a fence); ASP's count words are
    # data in their own right, published with one atomic store.
    fenced = engine == "bsp" and mode.batch_signal == "fence"
    # Counting one expert scans every (token, k) pick of the rank once (a vector count).
    picks = max(int(p.num_units) for p in plans) if op == "dispatch" else 0
    chunk_offset = _chunk_offsets(chunk_core, chunk_dst, chunk_experts, fabric, topology, fenced,
                                  picks)
    cumsum_ns = fabric.cumsum_entry_ns * num_ranks * epr if op == "dispatch" else 0.0
    if op == "dispatch" and engine == "asp":
        # The count group's partial sums are handed to the publishing core one by one.
        cumsum_ns += fabric.cumsum_group_sync_ns * n_c
    return OpSpec(
        op=op, engine=engine, sync=sync, num_ranks=num_ranks, cores_per_rank=n,
        num_send_cores=n_s, num_count_cores=n_c, num_local_experts=epr,
        unit_src=src, unit_core=core, unit_hop=hop, unit_dst=dst, unit_wire_bytes=wire,
        unit_work_ns=work, unit_stall_ns=stall, unit_batch=batch,
        unit_item=item, core_ptr=core_ptr,
        chunk_core=chunk_core, chunk_dst=chunk_dst, chunk_offset_ns=chunk_offset,
        poll_first=poll_first, poll_cores=poll_cores, cumsum_ns=cumsum_ns,
        item_rank=item_rank, item_core=item_core, item_cost_ns=item_cost,
        row_bytes=int(row_bytes),
    )


@dataclass(frozen=True)
class _Layout:
    """The fabric-independent part of a spec: every rank's transfers gathered, the batches
    and the receive items. A fit re-times the same plans hundreds of times, so it is cached
    per plan set (:func:`_layout`)."""

    src: np.ndarray
    core: np.ndarray
    hop: np.ndarray
    dst: np.ndarray
    expert: np.ndarray
    slot: np.ndarray
    token: np.ndarray
    wire: np.ndarray
    counts: np.ndarray
    core_ptr: np.ndarray
    batch: np.ndarray
    last: np.ndarray
    items: dict[tuple[str, str, int], Any] = field(default_factory=dict, compare=False)


_LAYOUTS: dict[tuple[Any, ...], tuple[Sequence[Plan], _Layout]] = {}
_LAYOUT_CACHE_SIZE = 64


def _layout(plans: Sequence[Plan], topology: Topology, *, sync: str, row_bytes: int,
            block_bytes: int, flag_bytes: int) -> _Layout:
    key = (id(plans), topology, sync, row_bytes, block_bytes, flag_bytes)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is plans:  # the same plan objects, not a reused id
        return hit[1]
    n, num_ranks = topology.cores_per_rank, topology.num_ranks
    n_s = plans[0].num_send_cores
    trs = [transfers(p, row_bytes=row_bytes, sync=sync, block_bytes=block_bytes,
                     flag_bytes=flag_bytes) for p in plans]
    src = np.concatenate([np.full(t.dst_rank.size, t.src_rank, dtype=np.int64) for t in trs])
    core = np.concatenate([t.core for t in trs])
    dst = np.concatenate([t.dst_rank for t in trs])
    counts = np.stack([np.bincount(t.core, minlength=n_s)[:n_s] for t in trs])
    core_ptr = np.zeros(num_ranks * n_s + 1, dtype=np.int64)
    np.cumsum(counts.ravel(), out=core_ptr[1:])
    # Batches: one core's rows to one destination.
    batch = (src * n + core) * num_ranks + dst
    lay = _Layout(
        src=src, core=core, hop=np.concatenate([t.hop for t in trs]), dst=dst,
        expert=np.concatenate([t.expert for t in trs]),
        slot=np.concatenate([t.slot for t in trs]),
        token=np.concatenate([t.src_token for t in trs]),
        wire=np.concatenate([t.nbytes for t in trs]).astype(np.float64), counts=counts,
        core_ptr=core_ptr, batch=batch, last=_last_of_group(batch))
    for a in (lay.src, lay.core, lay.hop, lay.dst, lay.wire, lay.counts, lay.core_ptr,
              lay.batch, lay.last):
        a.flags.writeable = False  # shared by every spec of these plans
    if len(_LAYOUTS) >= _LAYOUT_CACHE_SIZE:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    _LAYOUTS[key] = (plans, lay)
    return lay


def _items(lay: _Layout, layout: str, op: str, num_ranks: int,
           consume: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                  np.ndarray | None]:
    """``(unit_item, item_rank, item_core, item_hop, item_of_rows)``: the receive items
    (cached with the layout). Dispatch: one item per row, in output order (dst, expert, src,
    slot) -- (dst, src, slot) in the rank layout; row p of rank d goes to core p mod
    ``consume``, a static split fixed before any data lands; ``item_hop`` is each item's
    row's hop, ``item_of_rows`` None. Combine: one item per (receiving rank, token), reduced
    over all of its rows; ``item_hop`` the rows' hops, ``item_of_rows`` each row's item."""
    memo = lay.items
    key = (layout, op, consume)
    if key in memo:
        return memo[key]
    src, dst, hop = lay.src, lay.dst, lay.hop
    out: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]
    if op == "dispatch":
        if layout == "rank":
            order = lex_order((lay.slot, src, dst))
        else:
            order = lex_order((lay.slot, src, lay.expert, dst))
        item = np.empty_like(order)
        item[order] = np.arange(order.size)
        item_rank = dst[order]
        first = np.searchsorted(item_rank, np.arange(num_ranks))
        item_core = (np.arange(order.size) - first[item_rank]) % consume
        out = (item.astype(np.int64), np.asarray(item_rank, dtype=np.int64),
               np.asarray(item_core, dtype=np.int64), hop[order], None)
    else:
        key_ = dst * (int(lay.token.max(initial=0)) + 1) + lay.token
        uniq, item = np.unique(key_, return_inverse=True)
        item_rank = _first_of(dst, item, uniq.size)
        item_tok = _first_of(lay.token, item, uniq.size)
        out = (item.astype(np.int64), np.asarray(item_rank, dtype=np.int64),
               np.asarray(item_tok % consume, dtype=np.int64), hop, item)
    for a in out:
        if a is not None:
            a.flags.writeable = False
    memo[key] = out
    return out


def vouch_ns(num_ranks: int, meet: np.ndarray, fabric: FabricModel) -> np.ndarray:
    """``[R]`` stop-and-wait's cross-AIV work beyond the meeting, which grows with the
    destinations: a per-destination flag may follow only when *every* sending AIV of the rank
    has vouched for that destination at its counter, and an AIV cannot know which destinations
    its peers wrote (a static protocol: a destination without rows still gets its flag, count
    0), so each sending AIV adds to the counter of every other rank, ``R - 1`` adds of
    ``flag_ns``. Each AIV starts at its own destination, so the adds spread over the counters
    and overlap the meeting's ``P`` serialised adds (``meet``): before its first flag a core
    waits ``max(P, R - 1) x flag_ns`` in all, ``max(0, (R - 1) x flag_ns - meet)`` beyond the
    meeting (docs/SIMULATOR.md 1.4). Equal to the meeting up to 49 ranks; past the 48 AIVs
    it keeps growing with the destinations, where ``P`` stops."""
    own = float(max(num_ranks - 1, 0)) * float(fabric.flag_ns)
    return np.maximum(own - np.asarray(meet, dtype=np.float64), 0.0)


def _first_batch_end(last: np.ndarray, src: np.ndarray, core: np.ndarray) -> np.ndarray:
    """Mask of the units that end each ``(rank, core)``'s first batch (units in issue order)."""
    out = np.zeros(last.shape, dtype=bool)
    idx = np.flatnonzero(last)
    if idx.size:
        cell = src[idx].astype(np.int64) * (int(core.max()) + 1) + core[idx]
        _, first = np.unique(cell, return_index=True)
        out[idx[first]] = True
    return out


def meet_ns(core_rows: np.ndarray, fabric: FabricModel) -> np.ndarray:
    """``[R]`` stop-and-wait's cross-AIV meeting before one per-destination flag: ``P x
    flag_ns`` for the ``P`` AIVs of the rank that send (``core_rows [R, n_s]``: rows per send
    core), whose adds to one counter serialise (:class:`~ubep.sim.syncs.SyncMode` ``meet``)."""
    return (np.asarray(core_rows) > 0).sum(axis=1) * float(fabric.flag_ns)


def core_rx_wait_ns(spec: OpSpec, topology: Topology, land: np.ndarray,
                    depart: np.ndarray) -> np.ndarray:
    """``[R, n_s]`` the mean, over each send core's rows, of the row's wait at its receiver's
    port: ``land - depart - L[h]`` (0 for a hop-0 row)."""
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    wait = np.where(spec.unit_hop > 0, land - depart - lat[spec.unit_hop], 0.0)
    size = spec.num_ranks * spec.num_send_cores
    cell = spec.unit_src * spec.num_send_cores + spec.unit_core
    total = np.bincount(cell, weights=np.maximum(wait, 0.0), minlength=size)
    rows = np.bincount(cell, minlength=size)
    return (total / np.maximum(rows, 1)).reshape(spec.num_ranks, spec.num_send_cores)


def receiver_drain_ns(spec: OpSpec, topology: Topology) -> np.ndarray:
    """``[R]``: the time each rank's port needs to take in its remote rows,
    ``sum_{u: dst_u = d, h_u > 0} b_u / B[h_u]``.

    A port is work-conserving (docs/SIMULATOR.md 1.3): whatever the senders' core mappings and
    issue orders, the last remote row into ``d`` lands no earlier than the first one's
    arrival plus this drain, so every mapping's largest acknowledged per-core send time is at
    least ``drain + 2 L`` plus the first row's own work (Figure 9's floor)."""
    remote = spec.unit_hop > 0
    bw = np.asarray(topology.bandwidth_gbps, dtype=np.float64)[spec.unit_hop[remote]]
    return np.bincount(spec.unit_dst[remote], weights=spec.unit_wire_bytes[remote] / bw,
                       minlength=spec.num_ranks)


def _first_of(values: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    out = np.zeros(num_groups, dtype=np.int64)
    out[group[::-1]] = values[::-1]  # the last write wins: the first occurrence
    return out


def _last_of_group(key: np.ndarray) -> np.ndarray:
    """True at the last position of each key (positions are issue order within a core)."""
    last = np.zeros(key.size, dtype=bool)
    if key.size:
        _, rev_first = np.unique(key[::-1], return_index=True)
        last[key.size - 1 - rev_first] = True
    return last


def _chunks(
    op: str, engine: str, num_ranks: int, num_experts: int, n: int, n_s: int, n_c: int,
    count_expert_ptr: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Flag/count words every rank writes: ``(core, dst, experts counted first)`` in each core's
    order, and the receivers' poll cores ``(first, how many)``."""
    epr = num_experts // num_ranks
    empty = np.zeros(0, np.int64)
    if op == "combine":
        if engine == "asp":  # Data-as-Flag or per-pair SW flags: no count phase at all
            return empty, empty, empty, 0, 1
        every = np.arange(num_ranks, dtype=np.int64)  # BSP: one flag per destination
        order = np.lexsort((every, every % n))
        return (every % n)[order], every[order], np.zeros(num_ranks, np.int64), 0, n
    if engine == "bsp":
        ptr = (np.arange(n + 1, dtype=np.int64) * num_experts) // n
        first_core, poll_first, poll_cores = 0, 0, n
    else:
        ptr = np.asarray(count_expert_ptr, dtype=np.int64)
        first_core, poll_first, poll_cores = n_s, n_s, n_c
    cores: list[np.ndarray] = [empty]
    dsts: list[np.ndarray] = [empty]
    sizes: list[np.ndarray] = [empty]
    for c in range(len(ptr) - 1):
        experts = np.arange(ptr[c], ptr[c + 1])
        if not experts.size:
            continue
        owner = experts // epr
        ends = np.flatnonzero(np.append(owner[1:] != owner[:-1], True))
        cores.append(np.full(ends.size, first_core + c, dtype=np.int64))
        dsts.append(owner[ends])
        sizes.append(np.diff(np.append(-1, ends)))
    return (np.concatenate(cores), np.concatenate(dsts), np.concatenate(sizes),
            poll_first, poll_cores)


def _chunk_offsets(core: np.ndarray, dst: np.ndarray, experts: np.ndarray, fabric: FabricModel,
                   topology: Topology, fenced: bool, picks: int = 0) -> np.ndarray:
    """``[R, C]`` completion offsets of each rank's chunk writes: per chunk, count its experts,
    (``fenced``: BSP + SW) wait one round trip for the earlier writes to that rank to complete,
    then store the word; a core's chunks run back to back."""
    R = topology.num_ranks
    if core.size == 0:
        return np.zeros((R, 0))
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    hops = topology.hop_matrix().astype(np.int64)
    fence = (2.0 * fabric.fence_rtt_fraction * lat[hops[:, dst]] if fenced
             else np.zeros((R, dst.size)))
    per_expert = fabric.count_expert_ns + picks * fabric.count_pick_ns
    cost = experts * per_expert + fabric.flag_ns + fence
    # Chunks are grouped by core (consecutive): cumulative sum that restarts at each core.
    total = np.cumsum(cost, axis=1)
    starts = np.flatnonzero(np.concatenate(([True], core[1:] != core[:-1])))
    before = np.concatenate((np.zeros((R, 1)), total[:, :-1]), axis=1)[:, starts]
    return total - np.repeat(before, np.diff(np.append(starts, core.size)), axis=1)
