"""Simulator check for the peers benchmark: ``ubep.sim`` predicts the ubep rows just measured.

For every measured ``ubep-<engine>-<sync>`` row the simulator gets the very routing the runtime
ran (same seeded ``topk_idx`` per rank), the plans the runtime's Buffer builds by default
(``policy="hierarchical"`` on ``topology.host(num_ranks)``, whose ``cores_per_rank`` is the
Buffer's default too; :func:`predict` says what happens with one core per rank), the host fabric
of ``ubep/sim/calib.json`` and the row bytes of the op (BF16 for combine). It prints predicted vs
measured median and the relative error: this is the one machine where the simulator can be
checked against a measurement. The simulator does not model oversubscription: at 4 ranks on
this 2-core host the ranks time-share the cores, so its 4-rank predictions run low by up to
ranks / cores.

Two predictions per row: the host fabric of calib.json as shipped (its copy rate is
docs/CALIBRATION.md's 256 MiB memcpy, a DRAM rate), and the same model with the copy rate of
the memcpy floor measured beside the peers at the same bytes (the rows here are
cache-resident). The second isolates the model's structure (task graph, flags, barriers) from
that one constant; nothing is fitted to ubep's own timings.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["predict", "sim_report"]


def predict(
    topk_idxs: Sequence[np.ndarray], *, num_experts: int, hidden: int, dtype: str, layout: str,
    engine: str, sync: str, op: str, core_bandwidth_gbps: float | None = None,
) -> float:
    """The simulator's latency in us for one call on this host (analytic executor); the host
    fabric of calib.json, or with its copy rate replaced by ``core_bandwidth_gbps``."""
    from benchmarks.peers.workload import row_bytes as workload_row_bytes
    from ubep.sim import make_plans, simulate
    from ubep.sim.calib import load_fabric
    from ubep.topology import host

    topo = host(len(topk_idxs))
    cores: dict[str, int] = {}
    if engine == "asp" and topo.cores_per_rank < 2:
        # The runtime's single core runs the count and send tasks back to back; the simulator's
        # ASP graph needs one core of each, so it models 1 count + 1 send core (an overlap the
        # runtime cannot have: expect the prediction to be low).
        topo = host(len(topk_idxs), cores_per_rank=2)
        cores = {"num_send_cores": 1, "num_count_cores": 1}
    plans = make_plans(list(topk_idxs), topo, num_experts=num_experts, policy="hierarchical",
                       layout=layout, **cores)
    row_bytes = workload_row_bytes(dtype, hidden)
    fabric = load_fabric("host")
    if core_bandwidth_gbps is not None:
        fabric = fabric.with_values(core_bandwidth_gbps=core_bandwidth_gbps)
    res = simulate(plans, topo, fabric, engine=engine, sync=sync, row_bytes=row_bytes, op=op)
    return float(res.latency_ns) / 1e3


def _engine_sync(system: str) -> tuple[str, str]:
    _, engine, sync = system.split("-")
    return engine, sync


def _not_modelled(system: str) -> bool:
    if system.endswith("+q"):
        return True  # the engine's quantisation is no task of the simulator's graph
    engine, sync = _engine_sync(system)
    return engine == "bsp" and sync != "sw"


def sim_report(
    rows: Sequence[Any], inputs_list: Sequence[Any], num_experts: int
) -> tuple[str, list[dict[str, Any]]]:
    """Predicted vs measured ubep medians as a table and as JSON rows (or why there are none)."""
    from benchmarks.harness import format_table

    ubep_rows = [r for r in rows if str(r.system).startswith("ubep-")]
    if not ubep_rows:
        return "simulator: no ubep rows measured, nothing to predict", []
    try:
        import ubep.sim  # noqa: F401
        from ubep.sim.calib import load_fabric

        load_fabric("host")
    except (ImportError, ValueError, KeyError) as exc:
        return f"simulator: not available ({type(exc).__name__}: {exc})", []
    by_shape = {inp.shape: inp for inp in inputs_list}
    # The memcpy floor measured beside the peers at the same bytes: the copy rate the ranks
    # actually see (cache-resident at these sizes), where calib.json's is docs/CALIBRATION.md's
    # 256 MiB memcpy.
    # The floor spans all ranks' copies; with more ranks than cores they took turns, and the
    # simulator, which runs every rank at once, needs the rate of one copy while it runs.
    cores = os.cpu_count() or 1
    floor_gbps = {
        (r.layout, r.shape, r.op): r.bytes_per_rank / (r.stats.median_us * 1e3)
        * max(1.0, r.shape.num_ranks / cores)
        for r in rows if r.system == "memcpy" and r.stats.median_us > 0
    }
    cells, out = [], []
    skipped = sorted({r.system for r in ubep_rows if _not_modelled(r.system)})
    for r in ubep_rows:
        if _not_modelled(r.system):
            continue
        engine, sync = _engine_sync(r.system)
        row_predict = functools.partial(
            predict, by_shape[r.shape].topk_idxs, num_experts=num_experts, hidden=r.shape.hidden,
            dtype=r.dtype, layout=r.layout, engine=engine, sync=sync, op=r.op,
        )
        pred = row_predict()
        err = 100.0 * (pred - r.stats.median_us) / r.stats.median_us
        bw = floor_gbps.get((r.layout, r.shape, r.op))
        pred_bw = row_predict(core_bandwidth_gbps=bw) if bw else float("nan")
        err_bw = 100.0 * (pred_bw - r.stats.median_us) / r.stats.median_us
        cells.append([r.system, r.layout, r.shape.label, r.op, r.stats.median_us, pred, err,
                      pred_bw, err_bw])
        out.append({**r.to_json(), "predicted_us": pred, "error_pct": err,
                    "predicted_run_copy_rate_us": pred_bw, "error_run_copy_rate_pct": err_bw})
    lines = ["simulator (ubep.sim, host fabric, analytic) vs measured ubep medians; "
             "'calib' = calib.json as shipped, 'run' = its copy rate replaced by the measured "
             "memcpy floor at the same bytes:"]
    for ranks in sorted({o["ranks"] for o in out}):
        for key, label in (("error_pct", "calib"), ("error_run_copy_rate_pct", "run")):
            errs = np.abs([o[key] for o in out if o["ranks"] == ranks and o[key] == o[key]])
            if len(errs):
                lines.append(f"  {ranks} ranks, {label}: |error| median "
                             f"{float(np.median(errs)):.0f} %, max {float(np.max(errs)):.0f} % "
                             f"over {len(errs)} rows")
    if skipped:
        lines.append(f"  not modelled: {', '.join(skipped)} (the simulator's BSP is the paper's "
                     "baseline, BSP+SW; it has no quantisation task for '+q')")
    cols = ["system", "layout", "shape", "op", "measured_us", "calib_us", "calib_err_pct",
            "run_us", "run_err_pct"]
    lines.append(format_table(cols, cells, float_digits=1))
    return "\n".join(lines), out
