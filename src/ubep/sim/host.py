"""The host model: the simulator's executor on this machine, with constants from microbenchmarks.

This is the one fabric the simulator can be checked against (docs/SIMULATOR.md, section 6).
Nothing here is read from ubep's own dispatch timings: the constants are

* ``fixed_ns``: the latency of the same call with 64-element rows (same tokens, routing,
  engine, sync mode, layout and rank count) -- the per-call cost of the Python layer and the
  native engine that does not scale with the payload (validation, counting, metadata, output
  arrays, flags, waits), with the model's own share of that small call taken out;
* ``flag_oneway_ns``: half the cross-process flag round trip (spin, then yield) with as many
  processes as ranks (oversubscribed at 4 ranks on 2 cores);
* per-row pass costs (``kernel_ns``): one memory pass of the runtime's algorithm per row
  (copy into a peer's slot, TFF blocks, SP tail / full check and refill, DC word sums, the
  combine reduction), timed by benchmarks/host_micro.c at the working-set size (the rows of the
  case) with as many processes as ranks, writer and reader on different cores as in the runtime.

The runtime on this host runs one core per rank (2 CPUs), so each rank's plan is the engine's
canonical one (:func:`canonical_plans`: destinations ``r+1, r+2, ..., r``, rows in token order)
with one send core and no count core: counting is part of the call's fixed cost. Which passes a
row costs follows the runtime's algorithm (docs/FORMATS.md): ASP lands SW/DC/SP rows in
``recv_x`` itself and TFF rows in place with their epoch words apart; BSP stages every row and
reorders after its barriers. A call's ranks run on the CPUs they get, each until it must wait
(:mod:`ubep.sim.host_sched`): :func:`predict_host` is the slowest rank's call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from ..modes import LAYOUTS, Engine, Layout, Sync
from ..sched.plan import Plan
from .host_sched import Doorbells, RankWork, SchedSpan, back_to_back, serialize
from .spec import RowCosts
from .syncs import sync_mode

__all__ = ["HostCase", "KernelTimer", "call_latency_ns", "canonical_plans", "combine_row_map",
           "kernel_passes", "predict_host", "predict_host_tasks", "rank_works",
           "send_positions", "send_regions", "writer_positions"]

# (writer kernel, reader kernel, terms) -> ns per row of the working set, measured (for the
# combine's reduce: ns per row reduced, the rows read where the runtime reads them).
KernelTimer = Callable[[str, str, int], tuple[float, float]]


@dataclass(frozen=True)
class HostCase:
    """One cell of bench_dispatch's matrix."""

    ranks: int
    tokens: int
    hidden: int
    itemsize: int
    layout: Layout
    engine: Engine
    sync: Sync
    op: str
    num_experts: int = 64
    num_topk: int = 8

    def __post_init__(self) -> None:
        if self.op not in ("dispatch", "combine"):
            raise InvalidArgumentError("op", self.op, "must be 'dispatch' or 'combine'")
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError("layout", self.layout, f"must be one of {LAYOUTS}")

    @property
    def row_bytes(self) -> int:
        return self.hidden * (self.itemsize if self.op == "dispatch" else 2)


def canonical_plans(topk_idxs: Sequence[np.ndarray], num_experts: int,
                    layout: str) -> list[Plan]:
    """Each rank's send order with one core and no plan (the engine's ``send_canonical``):
    destinations ``(r + 1 + i) % R``, every destination's rows in token (then k) order, slots
    numbered per expert (layout "expert") or per destination (layout "rank")."""
    R = len(topk_idxs)
    epr = num_experts // R
    plans = []
    for r, idx in enumerate(topk_idxs):
        idx = np.asarray(idx, dtype=np.int64)
        t_all, k_all = np.nonzero(idx >= 0)
        e_all = idx[t_all, k_all]
        d_all = e_all // epr
        if layout == "rank":  # one row per (token, destination): its first k there
            key = t_all * R + d_all
            _, first = np.unique(key, return_index=True)
            t_all, k_all, e_all, d_all = (a[first] for a in (t_all, k_all, e_all, d_all))
        order_d = (d_all - r - 1) % R
        order = np.lexsort((k_all, t_all, order_d))
        t, k, e, d = t_all[order], k_all[order], e_all[order], d_all[order]
        group = e if layout == "expert" else d
        slot = np.zeros(t.size, dtype=np.int64)
        for g in np.unique(group):
            m = group == g
            slot[m] = np.arange(int(m.sum()))
        hop = (d != r).astype(np.int64)
        plans.append(Plan(
            rank=r, num_ranks=R, num_experts=num_experts, layout=layout, policy="balanced",
            num_send_cores=1, num_count_cores=0, send_token=t, send_k=k, send_expert=e,
            send_dst_rank=d, send_hop=hop, send_slot=slot,
            send_core=np.zeros(t.size, dtype=np.int32),
            core_ptr=np.array([0, t.size], dtype=np.int64),
            count_expert_ptr=np.zeros(1, dtype=np.int64),
        ))
    return plans


def combine_row_map(topk_idxs: Sequence[np.ndarray], num_experts: int,
                    layout: str) -> np.ndarray:
    """Where the combine of each rank reads each of its tokens' rows: ``[R, T, M, 2]`` int32
    ``(rank d, row p of d's expert outputs)``, ``-1`` where a token has fewer rows, in the
    order combine.c reduces them (k = 0..K-1 for layout "expert", d = 0..R-1 for "rank").

    Rank ``d``'s expert outputs are its received rows in receive order (docs/PORTING.md): by
    local expert, then source rank, then slot (layout "expert"); by source rank, then slot
    ("rank"); slots are the senders' (:func:`canonical_plans`, token order). Which rows a
    token's reduction reads, and how far apart, is what the reduce microbenchmark must
    reproduce: reading the same bytes in another order costs up to 3x more on this host
    (docs/SIMULATOR.md, 6)."""
    if layout not in LAYOUTS:
        raise InvalidArgumentError("layout", layout, f"must be one of {LAYOUTS}")
    R = len(topk_idxs)
    T = max((np.asarray(i).shape[0] for i in topk_idxs), default=0)
    K = max((np.asarray(i).shape[1] for i in topk_idxs), default=0)
    plans = canonical_plans(topk_idxs, num_experts, layout)
    first = _recv_first(plans, num_experts, layout)
    width = K if layout == "expert" else R
    out = np.full((R, T, width, 2), -1, dtype=np.int32)
    for p in plans:
        key = p.send_expert if layout == "expert" else p.send_dst_rank
        col = p.send_k if layout == "expert" else p.send_dst_rank
        out[p.rank, p.send_token, col, 0] = p.send_dst_rank
        out[p.rank, p.send_token, col, 1] = first[key, p.rank] + p.send_slot
    return out


def _recv_first(plans: Sequence[Plan], num_experts: int, layout: str) -> np.ndarray:
    """``[group, src]``: the first row of (group, source) in the group's rank's received rows
    (groups: experts, layout "expert"; destination ranks, "rank"), groups of one rank back to
    back, each group's sources in rank order."""
    R = len(plans)
    epr = num_experts // R
    groups = num_experts if layout == "expert" else R
    sent = np.zeros((groups, R), dtype=np.int64)  # rows every source sends to each group
    for p in plans:
        key = p.send_expert if layout == "expert" else p.send_dst_rank
        sent[:, p.rank] = np.bincount(key, minlength=groups)
    first = np.zeros_like(sent)
    for d in range(R):
        gs = np.arange(d * epr, (d + 1) * epr) if layout == "expert" else np.array([d])
        block = sent[gs].ravel()
        first[gs] = (np.cumsum(block) - block).reshape(len(gs), R)
    return first


def send_positions(topk_idxs: Sequence[np.ndarray], num_experts: int, layout: str,
                   engine: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per rank, in its canonical send order: each row's destination rank and the slot it is
    written to in that destination's receive region. ASP writes the row's final place in
    ``recv_x`` (rank ``d``'s received rows by local expert, source rank, slot; or by source
    rank, slot); BSP its staging slot, ``src * cap_src_rows`` + the row's rank in its
    (source, destination) batch, by expert then slot (layout "expert") or by slot ("rank";
    ``cap_src_rows``: ``T * min(K, experts per rank)``, or ``T``, plane/layout.py). In the
    expert layout a call's rows to one destination land in every local expert's block, a
    page apart or more, where a copy of the same rows back to back streams: the send pass is
    timed at these positions (host_micro.c's WPOS)."""
    if layout not in LAYOUTS:
        raise InvalidArgumentError("layout", layout, f"must be one of {LAYOUTS}")
    if engine not in ("asp", "bsp"):
        raise InvalidArgumentError("engine", engine, "must be 'asp' or 'bsp'")
    plans = canonical_plans(topk_idxs, num_experts, layout)
    R = len(plans)
    out = []
    if engine == "asp":
        first = _recv_first(plans, num_experts, layout)
        for p in plans:
            key = p.send_expert if layout == "expert" else p.send_dst_rank
            out.append((p.send_dst_rank.copy(), first[key, p.rank] + p.send_slot))
        return out
    T = max((np.asarray(i).shape[0] for i in topk_idxs), default=0)
    K = max((np.asarray(i).shape[1] for i in topk_idxs), default=0)
    cap_src = T if layout == "rank" else T * min(K, num_experts // R)
    for p in plans:
        slot = np.zeros(p.send_dst_rank.size, dtype=np.int64)
        for d in range(R):
            m = np.nonzero(p.send_dst_rank == d)[0]
            # the batch's rows by expert, then slot: a row's rank in that order
            order = m[np.lexsort((p.send_slot[m], p.send_expert[m]))]
            slot[order] = np.arange(order.size)
        out.append((p.send_dst_rank.copy(), p.rank * cap_src + slot))
    return out


def send_regions(engine: str) -> int:
    """The receive regions a dispatch's send pass writes in turn, one a call: a slot is
    written again that many calls later (host_micro's COPIES for the pass, and its
    HOST_MICRO_GAP_US: that many calls' time asleep before each pass, so that whatever runs on
    the host between two writes of a slot runs, and the pass finds the slot's lines where the
    runtime finds them). ASP writes its rows into ``recv_x`` itself (or TFF's rows in place),
    in one of two regions that alternate (plane/layout.py ``num_regions``), and nothing reads
    a row before its slot is written again. BSP stages into one region per destination, every
    call (``num_land_regions``), which its receiver reads right after the barrier (the pass's
    reader). Measured at load 6-15, the runtime's ASP sends cost what the pass into a flushed
    region costs, and the pass with the gap measures the same; on a quiet host the lines stay
    nearer (docs/SIMULATOR.md 6)."""
    if engine not in ("asp", "bsp"):
        raise InvalidArgumentError("engine", engine, "must be 'asp' or 'bsp'")
    return 2 if engine == "asp" else 1


def writer_positions(topk_idxs: Sequence[np.ndarray], num_experts: int, layout: str,
                     engine: str, rows: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The send pass's WPOS for host_micro: rank 0's rows in send order, each destination's
    region one after another (``slots`` per region: the largest slot written, plus one), and
    the token each row is read from (x's row: a token is read once per destination expert or
    rank), cut or repeated to ``rows`` rows (the pass's working set, rows per rank)."""
    per_rank = send_positions(topk_idxs, num_experts, layout, engine)
    region = 1 + max((int(pos.max(initial=0)) for _, pos in per_rank), default=0)
    dst, pos = per_rank[0]
    tokens = canonical_plans(topk_idxs, num_experts, layout)[0].send_token
    R = len(per_rank)
    flat = ((dst - 1) % R) * region + pos  # destination r+1+i: region i
    if flat.size == 0:
        flat, tokens = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    n = max(1, int(rows))
    return (R * region, np.resize(flat, n).astype(np.int64),
            np.resize(tokens, n).astype(np.int64) % n)


def kernel_passes(case: HostCase, terms: int) -> dict[str, tuple[str, str, int]]:
    """Which microbenchmark pass prices which row cost of ``case``: the runtime's own kernels,
    called as dispatch.c / dispatch_bsp.c / combine.c call them (docs/SIMULATOR.md, 6)."""
    if case.op == "combine":  # zero-copy pull: the home rank reads and reduces every row
        # REDUCE[bf16] weighted by topk_weights (expert layout), a plain sum (rank layout)
        return {"consume": ("-", "reduce" if case.layout == "expert" else "reduce_rank", terms)}
    # writer of a peer row: SP = body, fence, element-safe tail (put_sp_row); TFF = in place
    # with epoch words (ASP, put_tff_in_place) or staged 512 B blocks (BSP)
    # (the mode's row of sim/syncs.py names them); SP's reader checks the tail, then re-arms it
    # for the next use of the region; TFF's reads the words
    mode = sync_mode(case.sync)
    writer = mode.host_pass("writer", case.engine)
    reader = mode.host_pass("reader", case.engine)
    out = {"send": (writer, reader, 1)}
    if case.engine == "asp":
        out = {"own": ("copy", "-", 1), **out}
    if mode.host_checksum:
        out["checksum"] = (mode.host_checksum, "-", 1)  # the sender's word sums over its own rows
    if mode.host_validate:
        out["validate"] = ("tail", "-", 1)  # every token's polled tail checked for the sentinel
    return out


def _row_costs(case: HostCase, timer: KernelTimer, terms: int) -> tuple[RowCosts, float]:
    """Per-hop row costs and the per-call extra (SP's sentinel scan of ``x``)."""
    passes = kernel_passes(case, terms)
    if case.op == "combine":
        # ns per row reduced, the rows read where combine.c reads them (combine_row_map)
        _, per_row = timer(*passes["consume"])
        return RowCosts(send_ns=(0.0,), consume_ns=(per_row,)), 0.0
    w, r = timer(*passes["send"])
    extra = 0.0
    if "validate" in passes:
        extra = timer(*passes["validate"])[0] * case.tokens
    checksum = timer(*passes["checksum"])[0] if "checksum" in passes else 0.0
    if case.engine == "asp":
        own, _ = timer(*passes["own"])
        # own rows: copied straight into recv_x, nobody polls them
        return RowCosts(send_ns=(own, w + checksum), consume_ns=(0.0, r)), extra
    # BSP: every row is staged and reordered; the DC sender pass is folded into the row's
    # receive-side work (one core per rank runs both, back to back)
    return RowCosts(send_ns=(w,), consume_ns=(r + checksum,)), extra


def combine_terms(topk_idxs: Sequence[np.ndarray], case: HostCase) -> int:
    """Rows reduced per token: its top-k (layout "expert") or its destination ranks ("rank")."""
    if case.layout == "expert":
        return case.num_topk
    epr = case.num_experts // case.ranks
    per_token = [np.mean([len(set((row[row >= 0] // epr).tolist())) for row in idx])
                 for idx in topk_idxs]
    return max(1, round(float(np.mean(per_token))))


def predict_host(case: HostCase, topk_idxs: Sequence[np.ndarray], *, fixed_ns: float,
                 flag_oneway_ns: float, timer: KernelTimer, cpus: int,
                 row_meta_ns: float = 0.0, cpu_share: float = 1.0, calls: int = 1,
                 recv_meta_ns: float = 0.0, rank_scale: Sequence[float] | None = None,
                 doorbells: Doorbells | None = None, loop_gap_ns: float = 0.0) -> float:
    """The model's latency (ns) of one call of ``case`` on this host: the spans of
    :func:`predict_host_tasks` (the same arguments: one model gives a call's tasks and its
    latency), and the call lasts as long as its slowest rank, from that rank's first task to
    the end of its last (:func:`call_latency_ns`: bench_dispatch times each rank's own call
    and takes the slowest)."""
    return call_latency_ns(predict_host_tasks(case, topk_idxs, fixed_ns=fixed_ns,
                                              flag_oneway_ns=flag_oneway_ns, timer=timer,
                                              cpus=cpus, row_meta_ns=row_meta_ns,
                                              cpu_share=cpu_share, calls=calls,
                                              recv_meta_ns=recv_meta_ns,
                                              rank_scale=rank_scale, doorbells=doorbells,
                                              loop_gap_ns=loop_gap_ns))


def call_latency_ns(spans: Sequence[SchedSpan]) -> float:
    """The slowest rank's call: per rank, from the start of its first span to the end of its
    last (its waits included: they are inside its call), the largest over ranks."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for s in spans:
        first[s.rank] = min(first.get(s.rank, s.start_ns), s.start_ns)
        last[s.rank] = max(last.get(s.rank, s.end_ns), s.end_ns)
    return max((last[r] - first[r] for r in first), default=0.0)


def rank_works(case: HostCase, topk_idxs: Sequence[np.ndarray], costs: RowCosts, *,
               init_ns: float, row_meta_ns: float = 0.0, recv_meta_ns: float = 0.0,
               rank_scale: Sequence[float] | None = None) -> list[RankWork]:
    """Each rank's own work in one call (ns), from its own rows. A dispatch: ``init_ns`` (the call's
    fixed cost: in a loop of calls a rank's Python exit of one call and entry of the next run
    back to back on its CPU before its sends); per destination in canonical order, its rows
    times the row's send cost (own rows: hop 0) plus ``row_meta_ns`` a row (ASP's per-row
    bookkeeping, host_micro's ``rowmeta``: a row's position and unit logged, and with
    tracing on its span recorded); its received rows times their consume cost; the receive's
    metadata, ``recv_meta_ns`` per token of every source (itself included: dispatch.c reads
    every source's routing record, checks it and writes the origin of each of its rows that
    lands here, host_micro's ``recvmeta``), ASP's own ``cumsum`` task after its sends, BSP's
    part of its reorder (dispatch_bsp.c fills the metadata of each source's rows as it copies
    them out). A combine: ``init_ns``, then its reduction of the rows of its own tokens, no
    sends. ``rank_scale``: each rank's row work (sends, receive, metadata; not its set-up)
    times its factor: the same pass runs that much slower or faster in one process than in
    another on this host (host_micro's processes, slowest first), and the faster rank of a
    call waits for the slower one where it needs it."""
    if len(topk_idxs) != case.ranks:
        raise InvalidArgumentError("topk_idxs", len(topk_idxs), f"needs {case.ranks} arrays")
    scale = [1.0] * case.ranks if rank_scale is None else [float(f) for f in rank_scale]
    if len(scale) != case.ranks or not all(f > 0 for f in scale):
        raise InvalidArgumentError("rank_scale", rank_scale,
                                   f"needs {case.ranks} factors > 0")
    plans = canonical_plans(topk_idxs, case.num_experts, case.layout)
    R = len(plans)
    if case.op == "combine":
        # the zero-copy pull: a rank sends nothing; it reduces its own tokens' rows, one per
        # row it sent in the dispatch (per (token, k), or per (token, destination rank)),
        # from the peers' segments (_row_costs: the reduce's ns per row reduced)
        per_row = float(costs.consume_ns[-1])
        return [RankWork(init_ns=float(init_ns), send_dst=(), send_ns=(),
                         reorder_ns=float(p.send_token.size) * per_row * scale[p.rank])
                for p in plans]
    meta = float(row_meta_ns) if case.engine == "asp" else 0.0
    # every source's routing record is read by every rank, whatever lands there
    cumsum = float(recv_meta_ns) * sum(int(np.asarray(i).shape[0]) for i in topk_idxs)
    recv = np.zeros((R, 2))  # [rank, hop]: rows received
    for p in plans:
        np.add.at(recv, (p.send_dst_rank, p.send_hop.clip(0, 1)), 1.0)
    out = []
    for p in plans:
        rows_to = np.bincount(p.send_dst_rank, minlength=R)
        order = [(p.rank + 1 + i) % R for i in range(R)]
        dst = tuple(d for d in order if rows_to[d])
        f = scale[p.rank]
        send = tuple(f * float(rows_to[d]) * (float(costs.per_hop("send_ns", np.array([int(
            d != p.rank)]))[0]) + meta) for d in dst)
        consume = costs.per_hop("consume_ns", np.array([0, 1]))
        reorder = f * float(recv[p.rank] @ consume)
        if case.engine == "asp":
            out.append(RankWork(init_ns=float(init_ns), send_dst=dst, send_ns=send,
                                reorder_ns=reorder, cumsum_ns=f * cumsum))
        else:
            out.append(RankWork(init_ns=float(init_ns), send_dst=dst, send_ns=send,
                                reorder_ns=reorder + f * cumsum))
    return out


def predict_host_tasks(case: HostCase, topk_idxs: Sequence[np.ndarray], *, fixed_ns: float,
                       flag_oneway_ns: float, timer: KernelTimer, cpus: int,
                       row_meta_ns: float = 0.0, cpu_share: float = 1.0,
                       calls: int = 1, recv_meta_ns: float = 0.0,
                       rank_scale: Sequence[float] | None = None,
                       doorbells: Doorbells | None = None,
                       loop_gap_ns: float = 0.0) -> list[SchedSpan]:
    """The model's spans of one call of ``case``: every rank's tasks timed from its own rows
    (:func:`rank_works`; ``timer`` gives a pass's own time, not shared: the sharing of CPUs is
    the schedule), run on ``cpus`` CPUs until each must wait
    (:func:`ubep.sim.host_sched.serialize`; a barrier costs one flag latency), each CPU
    giving them ``cpu_share`` of its time (:func:`ubep.sim.host_sched.cpu_share`: other
    processes take the rest). ``calls`` > 1: the last of that many calls back to back, each
    rank's call starting when it ended its last (:func:`ubep.sim.host_sched.back_to_back`:
    the ranks' skew at entry, from their unequal ends); 1: the ranks start together (after a
    barrier, as bench_dispatch times them). ``recv_meta_ns``: the receive's metadata per
    token of a source; ``rank_scale``: each rank's factor on its row work
    (:func:`rank_works`); ``doorbells``: what a wait past its yield window costs, its
    sleeper and its waker (:class:`ubep.sim.host_sched.Doorbells`; ``None``: nothing);
    ``loop_gap_ns`` (``calls`` > 1): the caller's own work between two calls, on each rank's
    CPU before its next call (:func:`ubep.sim.host_sched.back_to_back`). A combine's ranks
    only wait for a CPU: each reduces as soon as it runs."""
    if calls < 1:
        raise InvalidArgumentError("calls", calls, "must be >= 1")
    costs, extra = _row_costs(case, timer, combine_terms(topk_idxs, case))
    works = rank_works(case, topk_idxs, costs, init_ns=fixed_ns + extra,
                       row_meta_ns=row_meta_ns, recv_meta_ns=recv_meta_ns,
                       rank_scale=rank_scale)
    engine = case.engine if case.op == "dispatch" else "asp"
    if calls > 1:
        return back_to_back(works, engine, cpus, barrier_ns=flag_oneway_ns, share=cpu_share,
                            calls=calls, doorbells=doorbells, loop_gap_ns=loop_gap_ns)
    return serialize(works, engine, cpus, barrier_ns=flag_oneway_ns, share=cpu_share,
                     doorbells=doorbells)
