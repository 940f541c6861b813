"""Exact optimum of objective (1) under (1a)-(1c), by mixed-integer programming (HiGHS).

Units of the same hop class have the same ``l`` and ``RTT`` (uniform token size), so the program
only needs *how many* units of each class a core gets. With classes sorted by RTT ascending
(``g = 0..G-1``, empty classes dropped) and ``cap = ceil(m/n)`` the aggregated program is::

    min T
    s.t. sum_j y[g,j] = V_g                          every unit assigned       (1a)
         sum_g y[g,j] <= cap                          load balance              (1b)
         y[g,j] <= min(V_g, cap) * u[g,j]             a class-g unit needs u[g,j] = 1
         u[g,j] >= u[g+1,j]                           u[g,j] = "core j's farthest class >= g"
         T >= sum_g l_g y[g,j] + sum_g (RTT_g - RTT_{g-1}) u[g,j]   (telescoping max RTT)
         y integer >= 0, u binary                                                 (1c)

The telescoping sum equals ``max RTT`` of the core's classes because RTT is ascending in ``g``;
setting a ``u`` higher than needed only costs, so an optimum never does. Symmetry breaking
(valid because cores are identical): cores are ordered by farthest class, ``u[g,j] >=
u[g,j+1]``, and cores with the same farthest class by load, ``load_j - load_{j+1} >= -cap *
sum_g (u[g,j] - u[g,j+1])``.

That per-core program (``method="cores"``) is symmetric in a way no ordering fully breaks: when
many cores hold one or two units HiGHS proves optimality only after seconds (10 s+ at 64 units on
48 cores). The default (``"auto"`` -> ``"configurations"``, see ``_solve_configurations``) drops
the core index altogether: a binary search over makespans ``T``, each step a covering program
over *core contents* (at most ``cap`` units, cost ``<= T``) with ``G + 1`` rows, started between
a pigeonhole lower bound and the equal-quota assignment as upper bound. Both are exact; tests
check both against brute force.

:func:`optimal_units` solves the unaggregated program (one class per unit, arbitrary ``l_i`` and
``RTT_i``); it is meant for tiny instances.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from ..topology import Topology
from .cost import hop_costs_ns
from .hierarchical import hop_quotas
from .plan import Plan

__all__ = ["METHODS", "OptimalResult", "optimal", "optimal_classes", "optimal_units"]

METHODS = ("auto", "configurations", "cores")
# Above this many core configurations "auto" uses the per-core program instead.
MAX_CONFIGURATIONS = 200_000


@dataclass(frozen=True)
class OptimalResult:
    """Result of the MILP.

    Attributes:
        objective_ns: objective (1) of the best assignment found.
        bound_ns: proven lower bound (equals ``objective_ns`` when ``status == "optimal"``).
        status: ``"optimal"`` or ``"time_limit"`` (best found, not proven).
        y: ``[num_send_cores, num_classes]`` int64 units of class ``c`` on core ``j`` (classes
            are hop classes for :func:`optimal`, single units for :func:`optimal_units`).
        solve_time_s: wall time of the solve.
    """

    objective_ns: float
    bound_ns: float
    status: str
    y: np.ndarray
    solve_time_s: float

    @property
    def gap(self) -> float:
        """Relative gap between the assignment and the bound (0 when optimal)."""
        return 0.0 if self.objective_ns <= 0 else (self.objective_ns - self.bound_ns) / (
            self.objective_ns
        )


def _vector(name: str, value: object, size: int | None, nonneg: bool = True) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgumentError(name, value, "must be a 1-D array of numbers") from None
    if arr.ndim != 1 or (size is not None and arr.size != size):
        raise InvalidArgumentError(name, arr.shape, f"must be a 1-D array of {size} numbers")
    if not np.all(np.isfinite(arr)) or (nonneg and np.any(arr < 0)):
        raise InvalidArgumentError(name, value, "entries must be finite and >= 0")
    return arr


def _check_common(num_send_cores: object, time_limit_s: object) -> tuple[int, float]:
    if isinstance(num_send_cores, bool) or not isinstance(num_send_cores, (int, np.integer)) or (
        num_send_cores < 1
    ):
        raise InvalidArgumentError("num_send_cores", num_send_cores, "must be an integer >= 1")
    if not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise InvalidArgumentError("time_limit_s", time_limit_s, "must be a number > 0")
    return int(num_send_cores), float(time_limit_s)


def optimal(
    units: Plan | np.ndarray,
    topology: Topology,
    num_send_cores: int | None = None,
    *,
    token_bytes: float,
    issue_ns: float = 0.0,
    latency_exposure: float = 0.0,
    time_limit_s: float = 10.0,
    method: str = "auto",
) -> OptimalResult:
    """Optimum of (1) for a rank's units on ``num_send_cores`` cores.

    ``units`` is a :class:`Plan` (its ``send_hop``; ``num_send_cores`` defaults to the plan's) or
    a ``[U]`` array of hop classes (e.g. ``send_units(...).hop``). ``y`` is ``[n, num_hops]``.
    """
    if isinstance(units, Plan):
        hops = units.send_hop
        if num_send_cores is None:
            num_send_cores = units.num_send_cores
    else:
        hops = np.asarray(units)
        if hops.ndim != 1 or (hops.size and hops.dtype.kind not in "iu"):
            raise InvalidArgumentError("units", hops.shape, "must be a Plan or 1-D hop classes")
    if hops.size and (hops.min() < 0 or hops.max() >= topology.num_hops):
        raise InvalidArgumentError(
            "units", hops, f"hop classes must be in [0, {topology.num_hops})"
        )
    if num_send_cores is None:
        raise InvalidArgumentError("num_send_cores", None, "required when units is not a Plan")
    l_ns, rtt_ns = hop_costs_ns(
        topology, token_bytes=token_bytes, issue_ns=issue_ns, latency_exposure=latency_exposure
    )
    counts = np.bincount(hops.astype(np.int64), minlength=topology.num_hops)
    return optimal_classes(counts, l_ns, rtt_ns, num_send_cores, time_limit_s=time_limit_s,
                           method=method)


def optimal_classes(
    units_per_class: object,
    l_ns: object,
    rtt_ns: object,
    num_send_cores: int,
    *,
    time_limit_s: float = 10.0,
    method: str = "auto",
) -> OptimalResult:
    """Aggregated MILP (module docstring) for ``V_c`` identical units of each class ``c``.

    ``method``: ``"configurations"``, ``"cores"`` or ``"auto"`` (configurations unless there
    are more than ``MAX_CONFIGURATIONS`` of them).
    """
    if method not in METHODS:
        raise InvalidArgumentError("method", method, f"must be one of {METHODS}")
    n, limit = _check_common(num_send_cores, time_limit_s)
    counts = np.asarray(units_per_class)
    if counts.ndim != 1 or (counts.size and counts.dtype.kind not in "iu") or np.any(counts < 0):
        raise InvalidArgumentError("units_per_class", counts, "must be 1-D non-negative integers")
    counts = counts.astype(np.int64)
    l_arr = _vector("l_ns", l_ns, counts.size)
    rtt_arr = _vector("rtt_ns", rtt_ns, counts.size)
    total = int(counts.sum())
    y_out = np.zeros((n, counts.size), dtype=np.int64)
    if total == 0:
        return OptimalResult(0.0, 0.0, "optimal", y_out, 0.0)
    cap = -(-total // n)
    classes = np.flatnonzero(counts)
    classes = classes[np.argsort(rtt_arr[classes], kind="stable")]
    v, l_g, rtt_g = counts[classes], l_arr[classes], rtt_arr[classes]
    configs = None
    if method != "cores":
        configs = _configurations(v, cap, MAX_CONFIGURATIONS if method == "auto" else None)
    if configs is None:
        y, objective, bound, status, secs = _solve_aggregated(v, l_g, rtt_g, n, cap, limit)
    else:
        y, objective, bound, status, secs = _solve_configurations(
            configs, v, l_g, rtt_g, n, cap, limit
        )
    y_out[:, classes] = y
    return OptimalResult(objective, bound, status, y_out, secs)


def _configurations(v: np.ndarray, cap: int, limit: int | None) -> np.ndarray | None:
    """``[C, G]`` every core content ``y`` with ``y_g <= V_g`` and ``sum y <= cap``.

    Returns ``None`` when there would be more than ``limit`` of them.
    """
    configs = np.zeros((1, 0), dtype=np.int64)
    for g in range(v.size):
        ks = np.arange(min(int(v[g]), cap) + 1, dtype=np.int64)
        grown = np.concatenate(
            [np.repeat(configs, ks.size, axis=0), np.tile(ks, configs.shape[0])[:, None]], axis=1
        )
        configs = grown[grown.sum(axis=1) <= cap]
        if limit is not None and configs.shape[0] > limit:
            return None
    return configs


def _solve_configurations(
    configs: np.ndarray,
    v: np.ndarray,
    l_g: np.ndarray,
    rtt_g: np.ndarray,
    n: int,
    cap: int,
    limit: float,
) -> tuple[np.ndarray, float, float, str, float]:
    """Exact optimum over core *configurations* (cores are identical, so only how many cores
    hold each content matters).

    A configuration ``y`` costs ``l.y + max RTT of its classes``. For a candidate makespan ``T``
    the question "can at most ``n`` cores, each with a configuration of cost ``<= T``, cover
    ``V``?" is a small integer program (``G + 1`` rows): ``sum_c x_c y_c >= V``,
    ``sum_c x_c <= n``, ``x`` integer. Covering more than ``V`` is harmless (dropping units
    never raises a configuration's cost), and feasibility is monotone in ``T``, so a binary
    search over the distinct configuration costs finds the optimum; the largest cost is always
    feasible (``n * cap >= m``). This formulation has no core symmetry, which is what makes the
    per-core program slow when many cores hold one or two units.
    """
    start = time.perf_counter()
    has = configs > 0
    top_rtt = np.max(np.where(has, rtt_g[None, :], 0.0), axis=1, initial=0.0)
    cost = configs @ l_g + top_rtt
    # Cost of adding one more unit of class g to each configuration (inf where not allowed).
    grow = cost[:, None] + l_g[None, :] + np.maximum(0.0, rtt_g[None, :] - top_rtt[:, None])
    full = (configs.sum(axis=1, keepdims=True) >= cap) | (configs >= v[None, :])
    grow[full] = np.inf
    cheapest_growth = grow.min(axis=1)
    levels = np.unique(cost)
    # Start from the equal-quota assignment (what ``hierarchical`` does): feasible, an upper
    # bound, and often already optimal; and from a pigeonhole lower bound.
    y_best = hop_quotas(v, n)
    upper = _objective(y_best, l_g, rtt_g)
    lo = int(np.searchsorted(levels, _pigeonhole_bound(v, l_g, rtt_g, n) - 1e-9))
    hi = int(np.searchsorted(levels, upper - 1e-9))  # levels[hi] == upper: feasible
    proven_below = lo - 1  # every level <= levels[proven_below] is proven infeasible
    timed_out = False
    while lo < hi:
        mid = (lo + hi) // 2
        # Only maximal configurations at this level: growing one by a unit would pass T. A
        # cover that uses a smaller one can use a maximal superset of it instead.
        cols = np.flatnonzero((cost <= levels[mid]) & (cheapest_growth > levels[mid]))
        remaining = limit - (time.perf_counter() - start)
        x, verdict = _cover(configs[cols], v, n, max(remaining, 1e-3))
        if x is not None:
            hi, y_best = mid, _expand(configs[cols], x, v, n)
        else:
            lo = mid + 1
            if verdict == "infeasible":
                proven_below = max(proven_below, mid)
            else:
                timed_out = True
    objective = _objective(y_best, l_g, rtt_g)
    status = "time_limit" if timed_out else "optimal"
    bound = objective if status == "optimal" else float(levels[proven_below + 1])
    y = y_best
    return y, objective, bound, status, time.perf_counter() - start


def _objective(y: np.ndarray, l_g: np.ndarray, rtt_g: np.ndarray) -> float:
    """Objective (1) of per-core class counts ``y [n, G]``."""
    return float(np.max(y @ l_g + np.max(np.where(y > 0, rtt_g[None, :], 0.0), axis=1)))


def _pigeonhole_bound(v: np.ndarray, l_g: np.ndarray, rtt_g: np.ndarray, n: int) -> float:
    """Valid lower bound: the ``S_g`` units of classes ``>= g`` (RTT ascending) put at least
    ``ceil(S_g/n)`` of them on one core, which then costs at least ``RTT_g`` plus that many of
    the cheapest ``l`` among those classes."""
    tail_units = np.cumsum(v[::-1])[::-1]
    tail_l = np.minimum.accumulate(l_g[::-1])[::-1]
    per_core = -(-tail_units // n)
    return float(np.max(np.where(per_core > 0, rtt_g + per_core * tail_l, 0.0)))


def _cover(
    configs: np.ndarray, v: np.ndarray, n: int, limit: float
) -> tuple[np.ndarray | None, str]:
    """Integer ``x >= 0`` with ``configs.T @ x >= v`` and ``sum x <= n``, if one exists."""
    # scipy is imported here, not at module level: `import ubep` stays light.
    from scipy.optimize import Bounds, LinearConstraint, milp

    num = configs.shape[0]
    a = np.vstack([configs.T, np.ones((1, num))])
    lower = np.concatenate([v.astype(float), [0.0]])
    upper = np.concatenate([np.full(v.size, np.inf), [float(n)]])
    # Zero objective: any feasible cover ends the search.
    res = milp(np.zeros(num), constraints=LinearConstraint(a, lower, upper),
               integrality=np.ones(num), bounds=Bounds(0, n), options={"time_limit": limit})
    if res.x is not None and res.status in (0, 1):
        return np.rint(res.x).astype(np.int64), "feasible"
    return None, "infeasible" if res.status == 2 else "unknown"


def _expand(configs: np.ndarray, x: np.ndarray, v: np.ndarray, n: int) -> np.ndarray:
    """``[n, G]`` core contents from configuration counts, trimmed to exactly ``V``."""
    y = np.zeros((n, v.size), dtype=np.int64)
    rows = np.repeat(configs, x, axis=0)
    y[: rows.shape[0]] = rows
    excess = y.sum(axis=0) - v
    for g in np.flatnonzero(excess > 0):  # drop surplus units; costs can only fall
        for j in range(n):
            take = min(int(excess[g]), int(y[j, g]))
            y[j, g] -= take
            excess[g] -= take
            if not excess[g]:
                break
    return y


def _solve_aggregated(
    v: np.ndarray, l_g: np.ndarray, rtt_g: np.ndarray, n: int, cap: int, limit: float
) -> tuple[np.ndarray, float, float, str, float]:
    # scipy is imported here, not at module level: `import ubep` stays light.
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    g_num = v.size
    # Variable layout: y[g, j] at g*n + j, then u[g, j] at G*n + g*n + j, then T last.
    ny = g_num * n
    num_vars = 2 * ny + 1
    t_var = num_vars - 1

    def yv(g: int, j: np.ndarray | int) -> np.ndarray | int:
        return g * n + j

    def uv(g: int, j: np.ndarray | int) -> np.ndarray | int:
        return ny + g * n + j

    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []
    r = 0
    j = np.arange(n)

    def add(row_cols: list[np.ndarray | int], row_vals: list[float], low: float, high: float,
            count: int) -> None:
        # Adds `count` rows at once; each entry of row_cols is an array over the rows (or int).
        nonlocal r
        for c, val in zip(row_cols, row_vals, strict=True):
            rows.append(r + np.arange(count))
            cols.append(np.broadcast_to(np.asarray(c), (count,)))
            vals.append(np.full(count, val))
        lo.extend([low] * count)
        hi.extend([high] * count)
        r += count

    for g in range(g_num):  # (1a): every unit of class g on some core
        rows.append(np.full(n, r))
        cols.append(np.asarray(yv(g, j)))
        vals.append(np.ones(n))
        lo.append(float(v[g]))
        hi.append(float(v[g]))
        r += 1
    # (1b) load cap, and T >= sum_g l_g y + sum_g dRTT_g u, one row per core.
    drtt = np.diff(np.concatenate(([0.0], rtt_g)))
    add([yv(g, j) for g in range(g_num)], [1.0] * g_num, -np.inf, float(cap), n)
    add([t_var] + [yv(g, j) for g in range(g_num)] + [uv(g, j) for g in range(g_num)],
        [1.0] + [-float(x) for x in l_g] + [-float(x) for x in drtt], 0.0, np.inf, n)
    for g in range(g_num):  # y <= M u
        add([yv(g, j), uv(g, j)], [1.0, -float(min(v[g], cap))], -np.inf, 0.0, n)
    for g in range(g_num - 1):  # u[g] >= u[g+1]
        add([uv(g, j), uv(g + 1, j)], [1.0, -1.0], 0.0, np.inf, n)
    if n > 1:
        jj = np.arange(n - 1)
        for g in range(g_num):  # cores ordered by farthest class
            add([uv(g, jj), uv(g, jj + 1)], [1.0, -1.0], 0.0, np.inf, n - 1)
        # Same farthest class => non-increasing load (relaxed by cap when the classes differ).
        add([yv(g, jj) for g in range(g_num)] + [yv(g, jj + 1) for g in range(g_num)]
            + [uv(g, jj) for g in range(g_num)] + [uv(g, jj + 1) for g in range(g_num)],
            [1.0] * g_num + [-1.0] * g_num + [float(cap)] * g_num + [-float(cap)] * g_num,
            0.0, np.inf, n - 1)
    a = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                   shape=(r, num_vars)).tocsr()
    c = np.zeros(num_vars)
    c[t_var] = 1.0
    upper = np.concatenate([np.repeat(np.minimum(v, cap).astype(float), n), np.ones(ny), [np.inf]])
    integrality = np.concatenate([np.ones(2 * ny), [0]])
    start = time.perf_counter()
    res = milp(c, constraints=LinearConstraint(a, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(num_vars), upper), options={"time_limit": limit})
    secs = time.perf_counter() - start
    if res.x is None:
        # The program is always feasible (cap * n >= m): the time limit came before the
        # solver's first incumbent. Report the equal-quota assignment (feasible, what the
        # hierarchical policy does) with the best lower bound known, never an error.
        y = hop_quotas(v, n)
        dual = float(getattr(res, "mip_dual_bound", None) or 0.0)
        bound = max(_pigeonhole_bound(v, l_g, rtt_g, n), dual if np.isfinite(dual) else 0.0)
        return y, _objective(y, l_g, rtt_g), bound, "time_limit", secs
    y = np.rint(res.x[:ny]).astype(np.int64).reshape(g_num, n).T
    # Re-evaluate (1) on the integer solution instead of trusting the solver's float T.
    has = y > 0
    objective = float(np.max(y @ l_g + np.max(np.where(has, rtt_g[None, :], 0.0), axis=1)))
    status = "optimal" if res.status == 0 else "time_limit"
    bound = objective if status == "optimal" else float(getattr(res, "mip_dual_bound", 0.0))
    return y, objective, bound, status, secs


def optimal_units(
    l_ns: object, rtt_ns: object, num_send_cores: int, *, time_limit_s: float = 10.0
) -> OptimalResult:
    """Unaggregated MILP for arbitrary per-unit ``l_i`` and ``RTT_i`` (tiny instances).

    ``y`` is ``[n, U]`` 0/1: unit ``i`` runs on the core ``j`` with ``y[j, i] == 1``.
    """
    # scipy is imported here, not at module level: `import ubep` stays light.
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n, limit = _check_common(num_send_cores, time_limit_s)
    l_arr = _vector("l_ns", l_ns, None)
    rtt_arr = _vector("rtt_ns", rtt_ns, l_arr.size)
    m = l_arr.size
    if m == 0:
        return OptimalResult(0.0, 0.0, "optimal", np.zeros((n, 0), dtype=np.int64), 0.0)
    cap = -(-m // n)
    # Variables: x[i, j] at i*n + j, then R_j, then T.
    nx = m * n
    num_vars = nx + n + 1
    i_idx, j_idx = np.divmod(np.arange(nx), n)
    blocks = []
    # (1a) sum_j x[i, j] = 1
    blocks.append((i_idx, np.arange(nx), np.ones(nx), np.ones(m), np.ones(m)))
    # (1b) sum_i x[i, j] <= cap
    blocks.append((j_idx, np.arange(nx), np.ones(nx), np.full(n, -np.inf), np.full(n, cap)))
    # R_j >= RTT_i x[i, j]
    rr = np.arange(nx)
    blocks.append((np.concatenate([rr, rr]), np.concatenate([nx + j_idx, np.arange(nx)]),
                   np.concatenate([np.ones(nx), -rtt_arr[i_idx]]),
                   np.zeros(nx), np.full(nx, np.inf)))
    # T >= sum_i l_i x[i, j] + R_j
    blocks.append((np.concatenate([j_idx, np.arange(n), np.arange(n)]),
                   np.concatenate([np.arange(nx), nx + np.arange(n), np.full(n, num_vars - 1)]),
                   np.concatenate([-l_arr[i_idx], -np.ones(n), np.ones(n)]),
                   np.zeros(n), np.full(n, np.inf)))
    rows, cols, vals, lo, hi = [], [], [], [], []
    offset = 0
    for b_rows, b_cols, b_vals, b_lo, b_hi in blocks:
        rows.append(b_rows + offset)
        cols.append(b_cols)
        vals.append(b_vals)
        lo.append(b_lo)
        hi.append(b_hi)
        offset += b_lo.size
    a = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                   shape=(offset, num_vars)).tocsr()
    c = np.zeros(num_vars)
    c[-1] = 1.0
    integrality = np.concatenate([np.ones(nx), np.zeros(n + 1)])
    upper = np.concatenate([np.ones(nx), np.full(n + 1, np.inf)])
    start = time.perf_counter()
    res = milp(c, constraints=LinearConstraint(a, np.concatenate(lo), np.concatenate(hi)),
               integrality=integrality, bounds=Bounds(np.zeros(num_vars), upper),
               options={"time_limit": limit})
    secs = time.perf_counter() - start
    if res.x is None:  # pragma: no cover - always feasible
        raise RuntimeError(f"MILP found no solution: {res.message}")
    x = np.rint(res.x[:nx]).astype(np.int64).reshape(m, n).T
    load = x @ l_arr
    far = np.max(np.where(x > 0, rtt_arr[None, :], 0.0), axis=1)
    objective = float(np.max(load + far))
    status = "optimal" if res.status == 0 else "time_limit"
    bound = objective if status == "optimal" else float(getattr(res, "mip_dual_bound", 0.0))
    return OptimalResult(objective, bound, status, x, secs)
