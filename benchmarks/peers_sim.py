"""Simulator check for the peers benchmark: ``ubep.sim`` predicts the ubep rows just measured.

For every measured ``ubep-<engine>-<sync>`` row the simulator gets the very routing the runtime
ran (same seeded ``topk_idx`` per rank), the plans the runtime's Buffer builds by default
(``policy="hierarchical"`` on ``topology.host(num_ranks)``, whose ``cores_per_rank`` is the
Buffer's default too; :func:`predict` says what happens with one core per rank), the host fabric
of ``ubep/sim/calib.json`` and the row bytes of the op (BF16 for combine). It prints predicted vs
measured median and the relative error: this is the one machine where the simulator can be
checked against a measurement. The simulator does not model oversubscription: at 4 ranks on
this 2-core host the ranks time-share the cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["predict", "sim_report"]

ITEMSIZE = {"bf16": 2, "uint8": 1}


def predict(
    topk_idxs: Sequence[np.ndarray], *, num_experts: int, hidden: int, dtype: str, layout: str,
    engine: str, sync: str, op: str,
) -> float:
    """The simulator's latency in us for one call on this host (analytic executor)."""
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
    row_bytes = hidden * ITEMSIZE[dtype]
    res = simulate(plans, topo, load_fabric("host"), engine=engine, sync=sync,
                   row_bytes=row_bytes, op=op)
    return float(res.latency_ns) / 1e3


def _not_modelled(system: str) -> bool:
    _, engine, sync = system.split("-")
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
    cells, out = [], []
    skipped = sorted({r.system for r in ubep_rows if _not_modelled(r.system)})
    for r in ubep_rows:
        _, engine, sync = r.system.split("-")
        if _not_modelled(r.system):
            continue
        pred = predict(
            by_shape[r.shape].topk_idxs, num_experts=num_experts, hidden=r.shape.hidden,
            dtype=r.dtype, layout=r.layout, engine=engine, sync=sync, op=r.op,
        )
        err = 100.0 * (pred - r.stats.median_us) / r.stats.median_us
        cells.append([r.system, r.layout, r.shape.label, r.op, r.stats.median_us, pred, err])
        out.append({**r.to_json(), "predicted_us": pred, "error_pct": err})
    lines = ["simulator (ubep.sim, host fabric, analytic) vs measured ubep medians:"]
    for ranks in sorted({o["ranks"] for o in out}):
        errs = np.abs([o["error_pct"] for o in out if o["ranks"] == ranks])
        lines.append(f"  {ranks} ranks: |error| median {float(np.median(errs)):.0f} %, max "
                     f"{float(np.max(errs)):.0f} % over {len(errs)} rows")
    if skipped:
        lines.append(f"  not modelled: {', '.join(skipped)} (the simulator's BSP is the paper's "
                     "baseline, BSP+SW)")
    cols = ["system", "layout", "shape", "op", "measured_us", "predicted_us", "error_pct"]
    lines.append(format_table(cols, cells, float_digits=1))
    return "\n".join(lines), out
