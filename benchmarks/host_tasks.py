"""Host validation task by task: a case's measured task spans (``BufferConfig(trace=True)``)
beside the host model's timeline of the same call (``ubep.sim.host``, the constants
bench_host_validation measured), per task kind: the time a rank's cores spend in it per call.

The host model runs every rank on one core with the canonical plans (ubep.sim.host); the
runtime at one core per rank does the same, so the kinds line up: ``init`` (the call's set-up:
validation, counting, publication), ``send``, ``reorder`` (the simulator's ``consume``: rows
placed), ``barrier``, ``flag``, ``verify``, ``cumsum``, ``wait`` (the model's: a core's wait
for rows inside its reordering, ``SimResult.consume_wait_ns``), and the model's ``init`` is a
call's whole fixed cost (the Python entry and exit too), the runtime's its native prepare
phase.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

import numpy as np

__all__ = ["measured_tasks", "predicted_tasks", "task_rows"]


def _per_rank_kind(trace: Any, calls: int) -> dict[str, float]:
    """``kind -> median over ranks of (ns a rank's cores spent in it) / calls``."""
    per: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (rank, _core, kind), ns in trace.busy_ns().items():
        per[kind][rank] += ns / calls
    ranks = trace.ranks()
    return {k: statistics.median([v.get(r, 0.0) for r in ranks]) for k, v in per.items()}


def _rank_main(group: Any, case: Any, warmup: int, calls: int, combine: bool = True) -> Any:
    """``warmup + calls`` traced calls of ``case`` on one core a rank, the warm-up's spans
    dropped: dispatches, each followed by its zero-copy combine unless ``combine`` is False
    (back-to-back dispatches: what ``bench_host_tasks`` times)."""
    from benchmarks import bench_dispatch as bd
    from ubep.buffer import Buffer
    from ubep.trace import spans_of

    cfg = bd._config(case)
    cfg = cfg.__class__(**{**cfg.__dict__, "trace": True, "num_cores": 1})
    x, idx, w = bd.inputs(case, group.rank)
    with Buffer(group, cfg) as buf:
        for i in range(warmup + calls):
            if i == warmup:
                spans_of(buf)  # the warm-up's spans dropped
            res = buf.dispatch(x, idx, w)
            if combine:
                buf.combine(buf.get_combine_buffer(res.handle), res.handle)  # zero-copy
        return spans_of(buf)


def measured_tasks(case: Any, ranks: int, warmup: int = 5, calls: int = 20) -> dict[str, float]:
    """The runtime's dispatch of ``case`` on ``ranks`` ranks (one core each), traced."""
    from ubep.runtime import launch
    from ubep.trace import Trace

    per_rank = launch(_rank_main, ranks, case, warmup, calls, timeout_s=600)
    calls_d = [c for t in per_rank for c in t.calls if c.name == "dispatch"]
    # the dispatches' tasks only (each rank's combines ran between them)
    spans = tuple(s for t in per_rank for s in t.spans
                  if any(c.rank == s.rank and c.start_ns <= s.start_ns <= c.end_ns
                         for c in calls_d))
    return _per_rank_kind(Trace("runtime", "measured", spans, tuple(calls_d)), calls)


def predicted_tasks(host_case: Any, idxs: list[np.ndarray], *, fixed_ns: float,
                    flag_oneway_ns: float, timer: Any) -> dict[str, float]:
    """The host model's timeline of the call ``ubep.sim.host.predict_host`` times, per kind."""
    from ubep.sim.analytic import run_analytic
    from ubep.sim.host import _row_costs, canonical_plans, combine_terms, host_fabric, host_topology
    from ubep.sim.spec import build_spec
    from ubep.trace import from_sim

    plans = canonical_plans(idxs, host_case.num_experts, host_case.layout)
    topo = host_topology(host_case.ranks, flag_oneway_ns)
    costs, extra = _row_costs(host_case, timer, combine_terms(idxs, host_case))
    fabric = host_fabric(fixed_ns + extra, flag_oneway_ns)
    spec = build_spec(plans, topo, fabric, engine=host_case.engine, sync=host_case.sync,
                      row_bytes=host_case.row_bytes, op="dispatch", row_costs=costs)
    res = run_analytic(spec, topo, fabric)
    kinds = _per_rank_kind(from_sim(res, "predicted"), 1)
    # A core's wait for rows (before its first row and between rows, which the executors fold
    # into its reordering span) is the runtime's "wait"; its reordering is the rows' own work.
    # Medians over ranks (SimResult.consume_wait_ns, consume_work_ns).
    wait = statistics.median(res.consume_wait_ns().sum(axis=1).tolist())
    if wait > 0:
        kinds["wait"] = wait
    if "reorder" in kinds:
        kinds["reorder"] = statistics.median(res.consume_work_ns.tolist())
    return kinds


def task_rows(label: list[Any], measured: dict[str, float],
              predicted: dict[str, float]) -> list[list[Any]]:
    """Table rows: ``label + [kind, measured us, predicted us, predicted / measured]``."""
    out = []
    for kind in sorted(set(measured) | set(predicted)):
        m, p = measured.get(kind, 0.0) / 1e3, predicted.get(kind, 0.0) / 1e3
        out.append([*label, kind, m, p, f"{p / m:.2f}" if m > 0 else "-"])
    return out
