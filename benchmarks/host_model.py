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
from ubep.sim.host import HostCase, combine_row_map, predict_host

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


def tiny_case(case: bd.Case) -> bd.Case:
    return bd.Case(case.tokens, TINY_HIDDEN, case.dtype, case.layout, case.engine, case.sync,
                   case.routing)


def case_of(row: dict[str, Any]) -> bd.Case:
    return bd.Case(**{k: row[k] for k in ("tokens", "hidden", "dtype", "layout", "engine",
                                          "sync", "routing")})


def fixed_cost(micro: Micro, flags: dict[int, float], tiny_row: dict[str, Any],
               op: str, cpus: int, cpu_share: float = 1.0,
               recv_meta_ns: float = 0.0) -> dict[str, float]:
    """From the 64-element-row call: the fixed cost (a rank's per call) with which the model's
    small call lasts what it measured, at least 0 (its own row passes priced by host_micro at
    its 128-byte rows). The model's latency grows by one fixed cost per rank that runs before
    the slowest rank's end on its CPU (``cpus`` CPUs for the call's ranks): the secant from 0
    to the measured latency gives that slope. ``recv_meta_ns``: the receive's metadata per
    source token, priced in the small call as in the full one (same tokens and routing)."""
    case, r = case_of(tiny_row), tiny_row["ranks"]
    idxs = routing_of(case, r)
    measured = tiny_row[op]["median_us"] * 1e3
    timer = case_timer(micro, case, r, op, idxs)

    def model(fixed_ns: float) -> float:
        return predict_host(host_case(case, r, op), idxs, fixed_ns=fixed_ns,
                            flag_oneway_ns=flags[r], timer=timer, cpus=cpus,
                            cpu_share=cpu_share, recv_meta_ns=recv_meta_ns)

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
