"""The host model's inputs for a case of bench_dispatch's matrix (shared by
bench_host_validation and bench_host_tasks): its routing and rows, its ``HostCase``, the
timer of its row passes over host_micro, the fixed cost from the same call with
64-element rows, and the error summaries both print."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from benchmarks import bench_dispatch as bd
from benchmarks.host_micro import Micro
from ubep.env import wait_yield_us_from_env
from ubep.sim.host import HostCase, combine_row_map, predict_host
from ubep.sim.host_sched import Doorbells

# The fixed-cost microbenchmark: the same call with 64-element rows. It has the case's
# tokens, routing, layout, engine, sync and ranks, so every per-call, per-token and per-row
# cost of the Python layer and the native engine (validation, counting, metadata, outputs,
# flags, barriers, waits) is in it, and almost none of the payload's.
TINY_HIDDEN = 64


def itemsize(dtype: str) -> int:
    return 2 if dtype == "bf16" else 1


def routing_of(case: bd.Case, ranks: int) -> list[np.ndarray]:
    return [bd.inputs(case, r)[1] for r in range(ranks)]


def rows_per_rank(idxs: list[np.ndarray], layout: str, num_experts: int) -> float:
    epr = num_experts // len(idxs)
    if layout == "expert":
        return float(np.mean([(idx >= 0).sum() for idx in idxs]))
    return float(np.mean([sum(len(set((row[row >= 0] // epr).tolist())) for row in idx)
                          for idx in idxs]))


def host_case(case: bd.Case, ranks: int, op: str) -> HostCase:
    return HostCase(ranks=ranks, tokens=case.tokens, hidden=case.hidden,
                    itemsize=itemsize(case.dtype), layout=case.layout, engine=case.engine,
                    sync=case.sync, op=op, num_experts=bd.NUM_EXPERTS, num_topk=bd.NUM_TOPK)


def case_timer(micro: Micro, case: bd.Case, ranks: int, op: str,
               idxs: list[np.ndarray]) -> Any:
    """Per-row pass costs at this case's working set (host_micro, cold, the runtime's kernels):
    rows per rank for the send and receive passes, tokens for SP's scan of x; the combine's
    reduction reads every rank's rows where the runtime's combine reads them
    (``combine_row_map``) and is priced per row reduced."""
    hc = host_case(case, ranks, op)
    rows = round(rows_per_rank(idxs, case.layout, bd.NUM_EXPERTS))
    rowmap = combine_row_map(idxs, bd.NUM_EXPERTS, case.layout) if op == "combine" else None

    def timer(writer: str, reader: str, terms: int) -> tuple[float, float]:
        b, n = hc.row_bytes, rows
        if reader.startswith("reduce"):
            return micro.per_row_ns(ranks, hc.hidden * 2, case.tokens, writer, reader, terms,
                                    rowmap=rowmap)
        if writer in ("scan", "tail"):  # SP's sentinel check of x: once per token
            n = case.tokens
        return micro.per_row_ns(ranks, b, n, writer, reader, terms)

    return timer


def rank_scale(ratios: tuple[float, ...], ranks: int) -> tuple[float, ...]:
    """Each rank's factor on its row work: the send pass's processes' times over their median
    (``Micro.process_ratios``, slowest first), rank ``r`` the ``r``-th (cyclically). Which
    rank's memory is the slow one is the host's draw; the spread is what it measured."""
    if not ratios:
        return (1.0,) * ranks
    return tuple(ratios[r % len(ratios)] for r in range(ranks))


def recv_meta_kernel(layout: str) -> str:
    """host_micro's receive-metadata pass of ``layout`` (dispatch.c recv_metadata's two
    paths: a row per pick that lands, or one per token with its K picks)."""
    return "recvmeta" if layout == "expert" else "recvmeta_rank"


def dispatch_terms(micro: Micro, case: bd.Case, ranks: int, cpus: int,
                   bells: Doorbells | None = None) -> dict[str, Any]:
    """The task model's terms of an untraced dispatch of ``case`` beyond its row passes, as
    bench_host_tasks prices them (``ubep.sim.host.predict_host``'s keywords): the receive's
    metadata per source token (``route``, then ``recvmeta`` / ``recvmeta_rank`` with this
    rank's experts), each rank's speed (the send pass's processes over their median,
    ``Micro.process_ratios``) and the doorbells (:func:`doorbells`, measured once by the
    caller, or here). No per-row bookkeeping: host_micro's ``rowmeta`` is a traced call's
    (span records); an untraced one's is in the fixed cost of its 64-element call, which has
    the same rows."""
    from ubep.sim.host import kernel_passes

    hc = host_case(case, ranks, "dispatch")
    idxs = routing_of(case, ranks)
    rows = round(rows_per_rank(idxs, case.layout, bd.NUM_EXPERTS))
    recv_meta = micro.per_row_ns(ranks, hc.row_bytes, case.tokens, "route",
                                 recv_meta_kernel(case.layout), hc.num_topk, cold=False,
                                 turns=cpus < ranks,
                                 local_experts=hc.num_experts // ranks)[1]
    w, r, _ = kernel_passes(hc, 1)["send"]
    scale = rank_scale(micro.process_ratios(ranks, hc.row_bytes, rows, w, r, 1), ranks)
    return {"recv_meta_ns": recv_meta, "rank_scale": scale,
            "doorbells": bells if bells is not None else doorbells(micro)}


def tiny_case(case: bd.Case) -> bd.Case:
    return bd.Case(case.tokens, TINY_HIDDEN, case.dtype, case.layout, case.engine, case.sync,
                   case.routing)


def case_of(row: dict[str, Any]) -> bd.Case:
    return bd.Case(**{k: row[k] for k in ("tokens", "hidden", "dtype", "layout", "engine",
                                          "sync", "routing")})


def doorbells(micro: Micro) -> Doorbells:
    """The cost of a wait past its yield window (``ubep.sim.host_sched.Doorbells``): the
    runtime's yield window (``UBEP_WAIT_YIELD_US``, as the ranks run with it), the ring and the
    wake-up measured by benchmarks/host_wake.c (at the priority of the caller)."""
    ring_sleep, wake, ring_armed = micro.wake_ns()
    return Doorbells(yield_ns=wait_yield_us_from_env() * 1e3, wake_ns=wake,
                     ring_sleep_ns=ring_sleep, ring_armed_ns=ring_armed)


def fixed_cost(micro: Micro, flags: dict[int, float], tiny_row: dict[str, Any],
               op: str, cpus: int, cpu_share: float = 1.0,
               recv_meta_ns: float = 0.0, **terms: Any) -> dict[str, float]:
    """From the 64-element-row call: the fixed cost (a rank's per call) with which the model's
    small call lasts what it measured, at least 0 (its own row passes priced by host_micro at
    its 128-byte rows). The model's latency grows by one fixed cost per rank that runs before
    the slowest rank's end on its CPU (``cpus`` CPUs for the call's ranks): the secant from 0
    to the measured latency gives that slope. ``recv_meta_ns``: the receive's metadata per
    source token, priced in the small call as in the full one (same tokens and routing);
    ``terms``: the full call's other terms (``ubep.sim.host.predict_host``'s per-row
    bookkeeping, doorbells), so that the small call is priced by the same model."""
    case, r = case_of(tiny_row), tiny_row["ranks"]
    idxs = routing_of(case, r)
    measured = tiny_row[op]["median_us"] * 1e3
    timer = case_timer(micro, case, r, op, idxs)

    def model(fixed_ns: float) -> float:
        return predict_host(host_case(case, r, op), idxs, fixed_ns=fixed_ns,
                            flag_oneway_ns=flags[r], timer=timer, cpus=cpus,
                            cpu_share=cpu_share, recv_meta_ns=recv_meta_ns, **terms)

    model0 = model(0.0)
    probe = max(measured, 1.0)
    slope = max((model(probe) - model0) / probe, 1e-9)
    return {"tiny_measured_ns": measured, "tiny_model_ns": model0, "fixed_slope": slope,
            "fixed_ns": max(0.0, (measured - model0) / slope)}


def error_stats(errors_pct: Iterable[float]) -> dict[str, float]:
    """How many errors, and the median and worst of their magnitudes (percent)."""
    errs = np.abs(np.asarray(list(errors_pct), dtype=np.float64))
    return {"n": int(errs.size), "median_abs_error_pct": float(np.median(errs)),
            "worst_abs_error_pct": float(np.max(errs))}


def error_lines(summary: dict[str, dict[str, float]], first: str) -> list[str]:
    """``summary`` (:func:`error_stats` by name) as a markdown table whose first column is
    ``first``, after a blank line."""
    lines = ["", f"| {first} | n | median abs error % | worst abs error % |", "|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['n']} | {s['median_abs_error_pct']:.1f} | "
                     f"{s['worst_abs_error_pct']:.1f} |")
    return lines
