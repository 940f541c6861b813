"""The fit of UBEP's unknown costs to the training set (``ubep sim calibrate``).

The fabric and the baseline (CANN EP) are calibrated on their own rows (:mod:`ubep.sim.calib`).
What no row measures are the constants of kind ``assumed`` in :data:`ASSUMED`: the AIV's clock
and vector instruction latency (they price every count, check and prefix sum of UBEP),
CalCumSum's hand-off per count core, the store window and the skewed set-ups' hot share. Each has a
first-principles value and a documented plausible range. :func:`fit` sets them by bounded least
squares in log space to the seven UBEP results of docs/CALIBRATION.md's training set
(:func:`training_set`), each residual ``log(model / paper)`` over ``log(1 + tolerance)``, and
reports a value at a bound as such (a missing mechanism, not a range to move).
:func:`leave_one_out` refits without each training point and predicts it: the fit's own estimate
of its error. The spread of the leave-one-out values is the interval of every prediction
(:func:`ubep.sim.calib.fabric_variants`).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .assumed import (
    ASSUMED,
    BASELINE_FREE,
    apply_assumed,
    bound_side,
    value_range,
)
from .calib import topology_for
from .fabric import FabricModel
from .syncs import DATA_AS_FLAG, SW
from .workload import CANN_EP, FIG9_SEEDS, UBEP, UBEP_NO_MAPPING, Workload, run_case

__all__ = [
    "ASSUMED",
    "BASELINE_FREE",
    "BOUND_STIFFNESS",
    "STIFF_BAND",
    "WORKERS",
    "FitResult",
    "TrainingPoint",
    "apply_assumed",
    "baseline_rows",
    "calibrate",
    "fit",
    "leave_one_out",
    "pmap",
    "stiff",
    "stiff_slope",
    "training_set",
]

@dataclass(frozen=True)
class TrainingPoint:
    """One UBEP result of the training set: ``evaluate(fabric)`` is the model's latency ratio
    (a latency in us, or UBEP / CANN EP for an improvement), ``paper`` the same quantity from
    the paper, ``tolerance`` the relative latency error the point allows."""

    name: str
    source: str
    shown: str
    paper: float
    tolerance: float
    evaluate: Callable[[FabricModel], float]
    bound: bool = False  # a baseline row: the fit treats its tolerance as a bound (stiff)

    def residual(self, fabric: FabricModel) -> float:
        """``log(model / paper) / log(1 + tolerance)``: within tolerance iff ``|r| <= 1``."""
        return float(np.log(self.value(fabric) / self.paper) / np.log1p(self.tolerance))

    def value(self, fabric: FabricModel) -> float:
        """``evaluate(fabric)``, remembered while :func:`calibrate` runs (its points are
        :func:`training_set` and :func:`baseline_rows`, one per name): every leave-one-out
        refit starts where the full fit ended, and a fit asks again for the point it
        evaluated last."""
        if not _MEMO[0]:
            return float(self.evaluate(fabric))
        key = (self.name, self.paper, fabric)
        if key not in _VALUES:
            if len(_VALUES) >= 4096:
                _VALUES.clear()
            _VALUES[key] = float(self.evaluate(fabric))
        return _VALUES[key]


_VALUES: dict[tuple[str, float, FabricModel], float] = {}
_MEMO = [False]

# The Jacobian's columns and the leave-one-out refits are independent evaluations of the model:
# :func:`calibrate` runs them on a pool of this many forked processes, which inherit the parent's
# cached routings and plans (a fit re-times the same plans). 1 = in this process.
WORKERS = 2
_TASK: list[Callable[[Any], Any]] = []
_IN_POOL = [False]


def _pool_start() -> None:
    _IN_POOL[0] = True  # a pool's worker runs its tasks serially (no pool inside a pool)


def _pool_task(item: Any) -> Any:
    return _TASK[0](item)


def pmap(fun: Callable[[Any], Any], items: Iterable[Any], workers: int = 1) -> list[Any]:
    """``[fun(i) for i in items]``, on ``workers`` forked processes when more than one is
    asked for, the platform forks and this is not already a pool's worker; in order.
    ``fun`` need not be picklable (the workers inherit it); its results must be."""
    todo = list(items)
    if (workers <= 1 or len(todo) < 2 or _IN_POOL[0]
            or "fork" not in multiprocessing.get_all_start_methods()):
        return [fun(i) for i in todo]
    _TASK[:] = [fun]
    try:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(min(workers, len(todo)), initializer=_pool_start) as pool:
            return pool.map(_pool_task, todo, chunksize=1)
    finally:
        _TASK.clear()


# A baseline row is a constraint as well as a target: CANN EP's calibration bounds (5 %) are the
# precondition of every improvement the training set states, so the fit may not buy a training
# point by moving a baseline row past its bound. Beyond it the row's residual grows this much
# faster. The slope rises from 1 to BOUND_STIFFNESS over +-STIFF_BAND tolerances around the
# bound (a quadratic blend): with a kink there, a fit that ends on it would hand every refit a
# linear model that is wrong on one side of the bound, and the refit would reject its steps
# until the step tolerance stopped it where it started.
BOUND_STIFFNESS = 10.0
STIFF_BAND = 0.05


def stiff(r: float) -> float:
    """``r`` within ``[-1 + b, 1 - b]`` (``b`` = :data:`STIFF_BAND`); beyond ``1 + b`` in
    magnitude, ``sign(r) (1 + BOUND_STIFFNESS (|r| - 1))``; in between the quadratic that
    joins them with a continuous slope."""
    a, k, b = abs(r), BOUND_STIFFNESS, STIFF_BAND
    if a <= 1 - b:
        return r
    out = 1 + k * (a - 1) if a >= 1 + b else a + (k - 1) * (a - 1 + b) ** 2 / (4 * b)
    return float(np.sign(r)) * out


def stiff_slope(r: float) -> float:
    """``d stiff / d r``: 1 inside the band, :data:`BOUND_STIFFNESS` beyond it."""
    a, k, b = abs(r), BOUND_STIFFNESS, STIFF_BAND
    if a <= 1 - b:
        return 1.0
    return k if a >= 1 + b else 1 + (k - 1) * (a - 1 + b) / (2 * b)


@lru_cache(maxsize=64)
def _case(w: Workload, system: Any, ranks: int, fabric: FabricModel) -> tuple[float, float]:
    # Several training points share a case (Table 4 EP64 is Figure 8's batch 128): time it
    # once, and keep only its two numbers: ``(latency_ns, aiv_sum_ns)``.
    res = run_case(w, system, topology_for("cm384", ranks), fabric)
    return res.latency_ns, res.aiv_sum_ns()


def _case_ns(w: Workload, system: Any, ranks: int, fabric: FabricModel) -> float:
    return _case(w, system, ranks, fabric)[0]


def _latency_us(w: Workload, ranks: int, system: Any = UBEP) -> Callable[[FabricModel], float]:
    return lambda f: _case_ns(w, system, ranks, f) / 1e3


def _ratio(w: Workload, ranks: int) -> Callable[[FabricModel], float]:
    """UBEP / CANN EP of the operator latency (Figure 13: "average and P99 latency")."""
    return lambda f: _case_ns(w, UBEP, ranks, f) / _case_ns(w, CANN_EP, ranks, f)


def _aiv_ratio(w: Workload, ranks: int) -> Callable[[FabricModel], float]:
    """UBEP / CANN EP of the per-AIV time (:meth:`SimResult.aiv_sum_ns`): what Figures 7 and
    8 plot (docs/SIMULATOR.md 1.9)."""
    return lambda f: _case(w, UBEP, ranks, f)[1] / _case(w, CANN_EP, ranks, f)[1]


def _fig8_worst_ratio(f: FabricModel) -> float:
    return max(_aiv_ratio(Workload(tokens_per_rank=b), 64)(f) for b in (32, 64, 128))


FIG9_WORKLOAD = Workload(tokens_per_rank=64, experts_per_rank=4, routing="hot", hot_experts=8)


def fig9_max_core_us(system: Any, fabric: FabricModel) -> float:
    """Figure 9's maximum per-AIV token-send latency (``until="sent"``, docs/SIMULATOR.md
    1.8): program (1) of the core's own rows (issue time and farthest round trip: its hop mix)
    plus the mean wait of its rows at the receivers' ports (the contention every core sending
    there shares), the largest over every send core; the median over the seeded hot-expert
    placements :data:`FIG9_SEEDS`."""
    topo = topology_for("cm384", 64)
    return float(np.median([run_case(FIG9_WORKLOAD.with_(seed=s), system, topo, fabric)
                            .send_latency_ns(until="sent").max() for s in FIG9_SEEDS])) / 1e3


FIG10_SIZES = (10, 32, 100, 320, 1000, 3200, 10000)


def fig10_best_ratio(fabric: FabricModel, ranks: int = 16) -> float:
    """Figure 10: the best Data-as-Flag variant's latency over SW's, best over granularities."""
    from .experiments import exchange_latency_ns

    topo = topology_for("cm384", ranks)
    best = np.inf
    for size in FIG10_SIZES:
        sw = exchange_latency_ns(topo, fabric, SW, size)
        best = min(best, *(exchange_latency_ns(topo, fabric, s, size) / sw
                           for s in DATA_AS_FLAG))
    return float(best)


def training_set() -> list[TrainingPoint]:
    """docs/CALIBRATION.md's training set: eight values of seven UBEP results."""
    t4 = "UBEP paper Table 4, UBEP dispatch (training set)"
    gain = "improvement over CANN EP as UBEP / CANN EP latency"
    aiv_gain = "improvement over CANN EP as UBEP / CANN EP per-AIV time"
    return [
        TrainingPoint("table4_ubep_ep16", t4, "73 us", 73.0, 0.10,
                      _latency_us(Workload(), 16)),
        TrainingPoint("table4_ubep_ep64", t4, "101 us", 101.0, 0.10,
                      _latency_us(Workload(), 64)),
        TrainingPoint("fig7a_ep128_batch128", f"Figure 7(a), 128 ranks, batch 128 ({aiv_gain})",
                      "35.9 %", 1 - 0.359, 0.05 / (1 - 0.359),
                      _aiv_ratio(Workload(tokens_per_rank=128), 128)),
        TrainingPoint("fig8_ep64_smallest", f"Figure 8, EP64, smallest over batch 32/64/128 "
                      f"({aiv_gain})", "34.7 %", 1 - 0.347, 0.05 / (1 - 0.347), _fig8_worst_ratio),
        TrainingPoint("fig9_cann_max_core", "Figure 9, CANN EP, maximum per-AIV send latency",
                      "62.2 us", 62.2, 0.10, lambda f: fig9_max_core_us(CANN_EP, f)),
        TrainingPoint("fig9_balanced_max_core", "Figure 9, UBEP w/o mapping, maximum per-AIV "
                      "send latency", "48.1 us", 48.1, 0.10,
                      lambda f: fig9_max_core_us(UBEP_NO_MAPPING, f)),
        TrainingPoint("fig10_ep16_best", "Figure 10, 16 ranks: best Data-as-Flag reduction "
                      "against SW (as latency over SW's)", "31.0 %", 1 - 0.31, 0.07 / (1 - 0.31),
                      fig10_best_ratio),
        TrainingPoint("fig13_top2", "Figure 13, top-2 (128 ranks, batch 64 assumed; " + gain
                      + ")", "29 %", 1 - 0.29, 0.05 / (1 - 0.29),
                      _ratio(Workload(tokens_per_rank=64, num_topk=2), 128)),
    ]


def baseline_rows() -> list[TrainingPoint]:
    """The baseline rows the assumed constants also move (CANN EP counts, sums and fences
    with the same AIV): Table 4's CANN EP rows and CloudMatrix's fused dispatch, within the
    baseline fit's stated 5 %. They stay in every fit, never in the leave-one-out."""
    t4 = "UBEP paper Table 4, CANN EP on CM384 (baseline row)"
    out = [TrainingPoint(f"table4_cann_ep{r}", t4, f"{v:g} us", v, 0.05,
                         _latency_us(Workload(), r, CANN_EP), bound=True)
           for r, v in zip((16, 32, 64, 128, 256), (103.0, 120.0, 139.0, 144.0, 151.0),
                           strict=True)]
    cmi = "CloudMatrix384 serving paper, fused dispatch (baseline row)"
    out.append(TrainingPoint("cloudmatrix_ep8", cmi, "116 us", 116.0, 0.05,
                             _latency_us(Workload(), 8, CANN_EP), bound=True))
    out.append(TrainingPoint("cloudmatrix_ep256", cmi, "152 us", 152.0, 0.10,
                             _latency_us(Workload(), 256, CANN_EP), bound=True))
    # The SyncAll share (Section 2.3, ~15 %) is no row of the fit: the SyncAll's cost is
    # derived from the die (fabric.syncall_atomic_ns), and the share is its check (calib.py,
    # a validation row).
    return out


@dataclass(frozen=True)
class FitResult:
    """The fitted assumed constants, which of them sit at a bound, and the residuals."""

    values: dict[str, float]
    at_bound: dict[str, str]
    residuals: dict[str, float]
    model: dict[str, float]
    cost: float
    jac: np.ndarray  # of the plain residuals (before :func:`stiff`), rows: points
    converged: bool = True  # scipy's tolerances met (False: stopped at max_nfev)
    nfev: int = 0  # residual evaluations (without the finite differences)


def _bounds(names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    return np.log([value_range(n)[0] for n in names]), np.log([value_range(n)[1] for n in names])


def fit(base: FabricModel, points: Sequence[TrainingPoint] | None = None, *,
        start: dict[str, float] | None = None, max_nfev: int = 12, tol: float = 1e-3,
        jac: np.ndarray | None = None, jac0: np.ndarray | None = None, baseline: bool = True,
        progress: Callable[[str], None] | None = None, workers: int = 1) -> FitResult:
    """Bounded least squares over the log of every assumed constant (scipy's trust-region
    reflective method), starting from ``start`` (default: the first-principles values), and
    with ``baseline`` over CANN EP's fitted constants too (:data:`BASELINE_FREE`, starting
    from ``base``'s values).

    ``jac``: a fixed Jacobian (rows: ``points``; columns: :data:`ASSUMED` in log space), as
    the quick leave-one-out steps use; by default forward differences of
    :data:`DIFF_STEP` in log space (the model is piecewise smooth: core splits and port
    orders switch). ``jac0``: the Jacobian of the plain residuals at the start, used for the
    first step in place of its finite differences (a warm refit that starts where that
    Jacobian was taken, as a leave-one-out refit does from the full fit). ``max_nfev``
    counts evaluations of the residuals, not those of the finite differences; ``workers``
    processes evaluate the finite differences' columns (:func:`pmap`)."""
    from scipy.optimize import least_squares

    pts = list(points if points is not None else training_set() + baseline_rows())
    if not pts:
        raise InvalidArgumentError("points", len(pts), "needs at least one training point")
    names = list(ASSUMED) + (list(BASELINE_FREE) if baseline else [])
    lo, hi = _bounds(names)
    first = {**{n: a["value"] for n, a in ASSUMED.items()},
             **{n: getattr(base, n) for n in BASELINE_FREE}}
    x0 = np.log([float((start or {}).get(n, first[n])) for n in names])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)

    def values_of(x: np.ndarray) -> dict[str, float]:
        return {n: float(np.exp(v)) for n, v in zip(names, x, strict=True)}

    raw = np.zeros(len(pts))  # the plain residuals of the last evaluation

    def plain(x: np.ndarray) -> np.ndarray:
        fab = apply_assumed(base, values_of(x))
        return np.array([p.residual(fab) for p in pts])

    def resid(x: np.ndarray) -> np.ndarray:
        raw[:] = plain(x)
        out = np.array([stiff(r) if p.bound else r for p, r in zip(pts, raw, strict=True)])
        if progress is not None:
            progress(f"cost {0.5 * float(out @ out):.4f} residuals "
                     + " ".join(f"{v:+.2f}" for v in out) + " at "
                     + " ".join(f"{k}={v:.4g}" for k, v in values_of(x).items()))
        return out

    initial_jac: list[np.ndarray | None] = [jac0]

    def jacobian(x: np.ndarray) -> np.ndarray:
        # The Jacobian is of the plain residuals: each bound row's slope is applied at the
        # point evaluated last (least_squares asks for the Jacobian where it last evaluated).
        slopes = _slopes(pts, raw)[:, None]
        if jac is not None:
            return jac * slopes
        if initial_jac[0] is not None and np.array_equal(x, x0):
            j, initial_jac[0] = initial_jac[0], None
            return j * slopes
        return forward_jacobian(plain, x, raw.copy(), lo, hi, workers) * slopes

    sol = least_squares(resid, x0, bounds=(lo, hi), max_nfev=max_nfev, xtol=tol, ftol=tol,
                        jac=jacobian)
    values = values_of(sol.x)
    fab = apply_assumed(base, values)
    resid(sol.x)  # raw = the plain residuals at the solution
    at_bound = {}
    for n, x in zip(names, sol.x, strict=True):
        side = bound_side(n, float(np.exp(x)))
        if side:
            at_bound[n] = side
    return FitResult(values, at_bound, {p.name: p.residual(fab) for p in pts},
                     {p.name: p.evaluate(fab) for p in pts}, float(sol.cost),
                     np.asarray(sol.jac, dtype=np.float64) / _slopes(pts, raw)[:, None],
                     converged=bool(sol.status > 0), nfev=int(sol.nfev))


# Forward-difference step of the Jacobian, in log space, relative to ``max(1, |log value|)``
# (scipy's ``diff_step`` rule): wide enough to step over the model's small discontinuities.
DIFF_STEP = 0.05


def forward_jacobian(fun: Callable[[np.ndarray], np.ndarray], x: np.ndarray, f0: np.ndarray,
                     lo: np.ndarray, hi: np.ndarray, workers: int = 1) -> np.ndarray:
    """``d fun / d x`` at ``x`` (``f0 = fun(x)``) by forward differences of
    :data:`DIFF_STEP`, stepping backwards where a forward step would leave the bounds; the
    columns on ``workers`` processes (:func:`pmap`)."""
    steps = []
    for j in range(x.size):
        h = DIFF_STEP * max(1.0, abs(float(x[j])))
        if x[j] + h > hi[j]:
            h = -h
        xh = x.copy()
        xh[j] += h
        steps.append(xh)
    cols = pmap(fun, steps, workers)
    out = np.empty((f0.size, x.size))
    for j, (xh, col) in enumerate(zip(steps, cols, strict=True)):
        out[:, j] = (col - f0) / (xh[j] - x[j])
    return out


def _slopes(pts: Sequence[TrainingPoint], raw: np.ndarray) -> np.ndarray:
    """d objective / d residual of each point at the plain residuals ``raw``."""
    return np.array([stiff_slope(float(r)) if p.bound else 1.0
                     for p, r in zip(pts, raw, strict=True)])


def leave_one_out(base: FabricModel, full: FitResult,
                  points: Sequence[TrainingPoint] | None = None, *, refit: bool = True,
                  max_nfev: int | None = None, tol: float = 1e-3, cold: bool = False,
                  progress: Callable[[str], None] | None = None,
                  workers: int = 1) -> list[dict[str, Any]]:
    """Refit without each training point and predict it.

    ``refit=True`` (default): each refit is the full fit's own problem without the point --
    the same objective, bounds and baseline constraints -- warm-started at the full fit's
    values, its first step on the full fit's Jacobian rows of the other points, every later
    step on fresh finite differences, run until scipy's tolerances ``tol`` are met (or
    ``max_nfev`` residual evaluations, default 12; the row says whether it converged).
    ``cold``: each refit starts where the full fit starts without ``start`` -- the
    first-principles values and ``base``'s baseline constants -- so that nothing of the
    left-out point is in its start. A warm refit cannot leave the full fit when the point's
    residual is near 0: the full fit is then already stationary for the other points (the
    point adds ``r_i * J_i ~ 0`` to the gradient), and the refit stops within the
    tolerances where it started, whatever the other points leave undetermined.

    ``refit=False``: the quick estimate -- Gauss-Newton steps that keep the full fit's
    Jacobian (at most ``max_nfev`` evaluations, default 4) on the plain residuals (a
    baseline row the full fit left at its bound would otherwise reject every step of a fixed
    linear model that cannot see the stiff side). It cannot see how the other points' slopes
    change away from the full fit, so it understates the error of a point that alone sets a
    constant."""
    given = list(points if points is not None else training_set() + baseline_rows())
    pts = given if refit else [replace(p, bound=False) for p in given]
    held = len(training_set()) if points is None else len(pts)
    budget = max_nfev if max_nfev is not None else (12 if refit else 4)
    base_free = set(full.values) > set(ASSUMED)

    def without(i: int) -> dict[str, Any]:
        p = pts[i]
        if progress is not None:
            progress(f"leave-one-out: without {p.name}")
        rows = np.delete(full.jac, i, axis=0)
        others = pts[:i] + pts[i + 1:]
        if refit and cold:
            res = fit(base, others, max_nfev=budget, tol=tol, baseline=base_free,
                      progress=progress)
        elif refit:
            res = fit(base, others, start=full.values, max_nfev=budget, tol=tol, jac0=rows,
                      baseline=base_free, progress=progress)
        else:
            res = fit(base, others, start=full.values, max_nfev=budget, tol=tol, jac=rows,
                      baseline=base_free)
        fab = apply_assumed(base, res.values)
        return {"name": p.name, "paper": p.paper, "predicted": p.evaluate(fab),
                "residual": p.residual(fab), "values": res.values,
                "converged": res.converged, "nfev": res.nfev}

    # The refits are independent: one per worker process at a time (:func:`pmap`).
    out = pmap(without, range(held), workers)
    return out


def calibrate(path: Any = None, *, loo: bool = True, max_nfev: int = 12, warm: bool = False,
              loo_refit: bool = True, loo_max_nfev: int | None = None, loo_cold: bool = False,
              progress: Callable[[str], None] | None = None,
              workers: int = WORKERS) -> dict[str, Any]:
    """Fit the assumed constants, run the leave-one-out refits and write calib.json (``path``,
    default: the packaged file): the fitted values into ``constants`` (kind ``assumed``,
    value fitted), and a ``fit`` section with each constant's first-principles value, range,
    fitted value, bound status and source rows, the residuals and the leave-one-out table.
    ``warm``: start from the values of the fit stored in ``path`` (clipped into the ranges)
    rather than from the first-principles values: a refit after a change of the model.
    ``loo_refit``: each leave-one-out point is a full refit (:func:`leave_one_out`); the
    quick Gauss-Newton estimate is stored beside it (``loo_quick_*``) for comparison;
    ``loo_cold``: the refits start from the first-principles values, not the full fit's.
    ``workers``: processes that evaluate the finite differences and the refits (:func:`pmap`).

    The assumed constants also price CANN EP's counts, sums and fences, so CANN EP's own
    fitted constants are fitted with them, to the baseline rows and the training set."""
    import json
    from pathlib import Path

    from .calib import CALIB_PATH, _kinds, _read, load_calibration, to_entry, use_fit

    use_fit(False)
    try:
        from .calib import load_fabric

        # the stored baseline constants, with the assumed ones at first principles
        base = load_fabric("cm384", Path(path) if path else None)
    finally:
        use_fit(True)
    start = None
    if warm:
        stored = load_calibration(Path(path) if path else None)["fabrics"]["cm384"]
        start = dict(stored.get("fit", {}).get("values", {})) or None
    _MEMO[0] = True
    try:
        full = fit(base, start=start, max_nfev=max_nfev, progress=progress, workers=workers)
        rows = leave_one_out(base, full, refit=loo_refit, max_nfev=loo_max_nfev, cold=loo_cold,
                             progress=progress, workers=workers) if loo else []
        quick = (leave_one_out(base, full, refit=False, progress=progress, workers=workers)
                 if loo and loo_refit else [{}] * len(training_set()))
    finally:
        _MEMO[0] = False
        _VALUES.clear()
    loo_rows = rows
    fab = apply_assumed(base, full.values)
    data = load_calibration(Path(path) if path else None)
    entry = data["fabrics"]["cm384"]
    kinds = _kinds("cm384")
    new_entry = to_entry(fab, kinds, "cm384")
    pts = training_set()
    names = [p.name for p in pts + baseline_rows()]
    new_entry["assumptions"] = entry.get("assumptions", {})
    new_entry["fit"] = {
        "about": "ubep sim calibrate: bounded least squares in log space of the assumed "
                 "constants to the UBEP training set (docs/CALIBRATION.md); residual = "
                 "log(model / paper) / log(1 + tolerance), |residual| <= 1 is within tolerance",
        "values": full.values,
        "constants": {
            **{n: {"first_principles": a["value"], "range": a["range"], "kind": "assumed",
                   "value": full.values[n], "at_bound": full.at_bound.get(n, ""),
                   "source": a["source"], "source_rows": names}
               for n, a in ASSUMED.items()},
            **{n: {"first_principles": float(getattr(base, n)), "range": b["range"],
                   "kind": "fitted", "value": full.values[n],
                   "at_bound": full.at_bound.get(n, ""), "source": b["source"],
                   "source_rows": names}
               for n, b in BASELINE_FREE.items() if n in full.values}},
        "training": [
            {"name": p.name, "source": p.source, "paper": p.shown, "paper_value": p.paper,
             "model_value": round(full.model[p.name], 4), "tolerance": round(p.tolerance, 4),
             "residual": round(full.residuals[p.name], 3),
             "loo_predicted": round(r["predicted"], 4) if loo else None,
             "loo_residual": round(r["residual"], 3) if loo else None,
             "loo_converged": r.get("converged"), "loo_nfev": r.get("nfev"),
             **({"loo_quick_predicted": round(q["predicted"], 4),
                 "loo_quick_residual": round(q["residual"], 3)} if q else {})}
            for p, r, q in zip(pts, loo_rows or [{}] * len(pts), quick, strict=True)],
        "loo_method": (("full refit per point from the first-principles values, as the "
                        "fit itself" if loo_cold else "full refit per point (warm start at the "
                        "full fit, to convergence)") if loo_refit
                       else "Gauss-Newton steps on the full fit's Jacobian"),
        "baseline": [
            {"name": p.name, "source": p.source, "paper": p.shown, "paper_value": p.paper,
             "model_value": round(full.model[p.name], 4), "tolerance": p.tolerance,
             "residual": round(full.residuals[p.name], 3)} for p in baseline_rows()],
        "loo_spread": {n: sorted({round(r["values"][n], 6) for r in rows} | {full.values[n]})
                       for n in full.values} if rows else {n: [v] for n, v in
                                                         full.values.items()},
    }
    data["fabrics"]["cm384"] = new_entry
    out = Path(path or CALIB_PATH)
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    _read.cache_clear()
    return new_entry["fit"]
