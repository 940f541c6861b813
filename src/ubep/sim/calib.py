"""Calibration: the fabric constants, where each comes from, and the fit that sets the free ones.

``calib.json`` (next to this module, versioned with the code) holds, per fabric family, every
constant of :class:`~ubep.sim.fabric.FabricModel` with its kind and source:

* ``fitted``: set by :func:`fit` (scipy least squares) to the rows of docs/CALIBRATION.md
  listed in :func:`targets` with ``fitted=True``;
* ``derived``: a closed-form reading of one CALIBRATION.md row (e.g. a poll is a local read, so
  it costs Table 2's intra-NPU latency);
* ``assumed``: no row constrains it; the value is a stated engineering guess, and the docs say
  which predictions depend on it.

Only baseline facts are targets (CANN EP, CloudMatrix's fused dispatch, DeepEP-free NVL72
TensorRT-LLM rows, Figure 3b, the SyncAll share). Nothing about UBEP itself is: the ASP engine,
the hierarchical scheduler and Data-as-Flag are what the simulator predicts. Rows marked
``fitted=False`` are validation: their residuals are printed but never minimised.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..topology import host
from .assumed import AIV_ASSUMPTIONS, ASSUMED, COST_SIGN, aiv_costs, apply_assumed
from .fabric import FabricModel, syncall_atomic_ns
from .presets import (
    CALIB_PATH,
    FAMILIES,
    _read,
    fabric_for,
    fit_in_use,
    load_calibration,
    load_fabric,
    topology_for,
    use_fit,
)
from .syncs import SW
from .workload import CANN_EP, System, Workload, run_case

__all__ = [
    "AIV_ASSUMPTIONS",
    "CALIB_PATH",
    "FAMILIES",
    "Residual",
    "Target",
    "aiv_costs",
    "fabric_for",
    "fabric_variants",
    "fit",
    "load_calibration",
    "load_fabric",
    "residuals",
    "targets",
    "topology_for",
    "use_fit",
]

# TensorRT-LLM's one-sided NVL72 all-to-all, as the ASP graph with per-pair stop-and-wait flags:
# every token goes once to each destination rank (DeepEP's normal layout), BF16 payload.
TRTLLM = System("TRT-LLM all-to-all", "asp", "balanced", SW, layout="rank")
TABLE4_EPS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Target:
    """One calibration fact: a CALIBRATION.md number and how the model computes it."""

    name: str
    family: str
    source: str
    value: float
    unit: str
    fitted: bool
    weight: float
    evaluate: Callable[[FabricModel], float]


@dataclass(frozen=True)
class Residual:
    """Model vs fact for one target."""

    name: str
    source: str
    unit: str
    measured: float
    model: float
    fitted: bool
    weight: float

    @property
    def rel_error(self) -> float:
        return (self.model - self.measured) / self.measured


# ----------------------------------------------------------------------------------------------
# UBEP's own vector work, derived from the AIV's width and clock (docs/SIMULATOR.md, 3.1)

def fabric_variants(family: str = "cm384") -> dict[str, FabricModel]:
    """The fabric at the nominal assumed constants and at the two ends of their spread.

    Keys: ``nominal``, ``low`` (every assumed constant at its cheap end), ``high`` (every one
    at its costly end) and, per constant ``a``, ``a:low`` / ``a:high`` (that one moved alone)
    for the sensitivity tables. After ``ubep sim calibrate`` the nominal values are the fitted
    ones and the ends are the spread of the leave-one-out fits (the fit's own uncertainty);
    without a fit (or under ``use_fit(False)``) they are the first-principles values and the
    documented ranges. Every cost grows with each constant in its cost direction, and every
    latency the model computes is non-decreasing in every cost, so ``low`` / ``high`` bound
    the prediction over the box (up to Appendix A's re-partition, which is not monotone).
    """
    base = load_fabric(family)
    if family != "cm384":
        return {"nominal": base, "low": base, "high": base}
    fitted = load_calibration()["fabrics"]["cm384"].get("fit") if fit_in_use() else None
    if fitted:
        # (a constant the fit no longer moves, since derived, keeps its calib.json value)
        nominal = {k: float(v) for k, v in fitted["values"].items() if k in COST_SIGN}
        ends = {k: (float(min(v)), float(max(v))) for k, v in fitted["loo_spread"].items()
                if k in COST_SIGN}
    else:
        nominal = {k: float(a["value"]) for k, a in ASSUMED.items()}
        ends = {k: (float(a["range"][0]), float(a["range"][1])) for k, a in ASSUMED.items()}

    def end(name: str, costly: bool) -> float:
        lo, hi = ends[name]
        return hi if (COST_SIGN[name] > 0) == costly else lo

    out = {"nominal": apply_assumed(base, nominal)}
    out["low"] = apply_assumed(base, {k: end(k, False) for k in nominal})
    out["high"] = apply_assumed(base, {k: end(k, True) for k in nominal})
    for k in nominal:
        out[f"{k}:low"] = apply_assumed(base, {**nominal, k: end(k, False)})
        out[f"{k}:high"] = apply_assumed(base, {**nominal, k: end(k, True)})
    return out


def _latency_us(family: str, num_ranks: int, workload: Workload, system: System,
                op: str = "dispatch") -> Callable[[FabricModel], float]:
    def evaluate(fabric: FabricModel) -> float:
        res = run_case(workload, system, topology_for(family, num_ranks), fabric, op=op)
        return res.latency_ns / 1e3
    return evaluate


def _syncall_share(fabric: FabricModel) -> float:
    # Intrinsic SyncAll cost (two barriers per BSP dispatch) over the dispatch latency, averaged
    # over the Table 4 sizes.
    shares = [2 * fabric.barrier_ns / (_latency_us("cm384", r, Workload(), CANN_EP)(fabric) * 1e3)
              for r in TABLE4_EPS]
    return float(np.mean(shares))


def _skewed_sync_share(fabric: FabricModel) -> float:
    w = Workload(experts_per_rank=4, routing="hot", hot_experts=8)
    res = run_case(w, CANN_EP, topology_for("cm384", 64), fabric)
    a2a, other = res.aiv_split_ns()  # Figure 7(c)'s bars: the per-AIV time's split
    return other / (a2a + other)


def _efficiency(k: int) -> Callable[[FabricModel], float]:
    return lambda fabric: float(fabric.efficiency(k))


def targets(family: str) -> list[Target]:
    """Every calibration fact of ``family`` (see module docstring)."""
    out: list[Target] = []
    if family == "cm384":
        fig3b = "UBEP paper Figure 3b: Token-Sending per-AIV efficiency relative to 8 AIVs"
        for k, eff in zip((16, 24, 32, 48), (0.767, 0.576, 0.456, 0.311), strict=True):
            out.append(Target(f"fig3b_efficiency_{k}_cores", family, fig3b, eff, "ratio", True,
                              1.0, _efficiency(k)))
        t4 = "UBEP paper Table 4, CANN EP on CM384 (bsp + expert_contiguous + sw)"
        for r, lat in zip(TABLE4_EPS, (103.0, 120.0, 139.0, 144.0, 151.0), strict=True):
            out.append(Target(f"table4_cann_ep{r}_dispatch", family, t4, lat, "us", True, 1.0,
                              _latency_us(family, r, Workload(), CANN_EP)))
        cmi = "CloudMatrix384 serving paper (arXiv 2506.12708), fused dispatch/combine"
        for r, lat in ((8, 116.0), (256, 152.0)):
            out.append(Target(f"cloudmatrix_ep{r}_dispatch", family, cmi, lat, "us", True, 0.5,
                              _latency_us(family, r, Workload(), CANN_EP)))
        for r, lat in ((8, 118.0), (256, 149.0)):
            out.append(Target(f"cloudmatrix_ep{r}_combine", family, cmi, lat, "us", False, 0.5,
                              _latency_us(family, r, Workload(), CANN_EP, op="combine")))
        out.append(Target("syncall_share", family,
                          "UBEP paper Section 2.3: SyncAll ~15% of dispatch time (a check: the "
                          "SyncAll is derived from the die, syncall_atomic_ns)", 0.15, "ratio",
                          False, 1.0, _syncall_share))
        out.append(Target("cann_sync_share_skewed", family,
                          "UBEP paper Section 5.2 on Figure 7c: ~70% of CANN EP runtime in sync "
                          "with many experts and skew (EP64, 256 experts, 8 hot)", 0.70, "ratio",
                          False, 1.0, _skewed_sync_share))
    elif family == "nvl72":
        blog = "TensorRT-LLM tech blog 18, GB200 NVL72 one-sided all-to-all (BF16, hidden 7168)"
        def trt(r: int, tokens: int) -> Workload:
            return Workload(tokens_per_rank=tokens, itemsize=2, experts_per_rank=256 // r)
        out.append(Target("trtllm_dispatch_floor_ep8_batch1", family, blog + ": 18-20 us floor",
                          19.0, "us", True, 0.5, _latency_us(family, 8, trt(8, 1), TRTLLM)))
        for r, lat in zip((8, 16, 32, 64), (31.7, 34.6, 37.8, 41.6), strict=True):
            out.append(Target(f"trtllm_dispatch_ep{r}_batch128", family, blog, lat, "us", True,
                              1.0, _latency_us(family, r, trt(r, 128), TRTLLM)))
        for r, lat in zip((8, 16, 32, 64), (38.1, 39.9, 41.1, 44.5), strict=True):
            out.append(Target(f"trtllm_combine_ep{r}_batch128", family, blog, lat, "us", False,
                              1.0, _latency_us(family, r, trt(r, 128), TRTLLM, op="combine")))
    elif family == "host":
        out.append(Target("memcpy_two_processes", family,
                          "CALIBRATION.md host: memcpy two processes ~20 GB/s aggregate", 20.0,
                          "GB/s", True, 1.0,
                          lambda f: float(2 * f.speed(2) * f.core_bandwidth_gbps)))
        out.append(Target("flag_round_trip", family,
                          "CALIBRATION.md host: cross-process flag round trip, pure spin ~0.4 us",
                          0.4, "us", False, 1.0,
                          lambda f: 2 * (f.flag_ns + host(2).latency_ns[1] + f.poll_ns) / 1e3))
    elif family != "nvl576":
        raise InvalidArgumentError("family", family, f"must be one of {FAMILIES}")
    return out


# ----------------------------------------------------------------------------------------------
# The data file


def residuals(family: str, fabric: FabricModel | None = None) -> list[Residual]:
    """Evaluate every target of ``family`` with ``fabric`` (default: the stored calibration)."""
    fab = fabric or load_fabric(family)
    return [Residual(t.name, t.source, t.unit, t.value, t.evaluate(fab), t.fitted, t.weight)
            for t in targets(family)]


# ----------------------------------------------------------------------------------------------
# The fit

# Free constants per family; "flag_ns" is tied to "issue_ns" (a flag is a store issue without
# payload), and the contention shape is fitted to Figure 3b alone, before everything else.
FREE = {
    "cm384": ("init_ns", "issue_ns", "latency_exposure"),
    "nvl72": ("init_ns", "issue_ns", "latency_exposure", "contention_cores"),
}
BOUNDS = {
    "init_ns": (0.0, 60_000.0),
    "issue_ns": (0.0, 5_000.0),
    "latency_exposure": (0.0, 1.0),
    "barrier_ns": (0.0, 40_000.0),
    "count_expert_ns": (0.0, 3_000.0),
    "contention_cores": (1.0, 200.0),
}


def _fit_contention(fabric: FabricModel) -> FabricModel:
    from scipy.optimize import least_squares

    ks = np.array([16.0, 24.0, 32.0, 48.0])
    eff = np.array([0.767, 0.576, 0.456, 0.311])

    def resid(x: np.ndarray) -> np.ndarray:
        f = fabric.with_values(contention_cores=float(x[0]), contention_sharpness=float(x[1]))
        return np.asarray(f.efficiency(ks)) - eff

    sol = least_squares(resid, [12.0, 2.0], bounds=([1.0, 0.5], [200.0, 20.0]))
    return fabric.with_values(contention_cores=float(sol.x[0]),
                              contention_sharpness=float(sol.x[1]))


def fit(family: str, start: FabricModel, *, max_nfev: int = 80,
        progress: Callable[[str], None] | None = None) -> FabricModel:
    """Fit the free constants of ``family`` to its ``fitted`` targets (weighted relative error).

    ``start`` supplies the derived/assumed constants and the initial guess.
    """
    from scipy.optimize import least_squares

    fabric = _fit_contention(start) if family == "cm384" else start
    free = FREE.get(family, ())
    if not free:
        return fabric
    rows = [t for t in targets(family) if t.fitted and not t.name.startswith("fig3b")]

    def make(x: np.ndarray) -> FabricModel:
        values = {name: float(v) for name, v in zip(free, x, strict=True)}
        values["flag_ns"] = values["issue_ns"]
        return fabric.with_values(**values)

    def resid(x: np.ndarray) -> np.ndarray:
        f = make(x)
        out = np.array([t.weight * (t.evaluate(f) - t.value) / t.value for t in rows])
        if progress is not None:
            progress(f"cost {0.5 * float(out @ out):.5f}")
        return out

    x0 = np.array([getattr(fabric, name) for name in free])
    lo = np.array([BOUNDS[name][0] for name in free])
    hi = np.array([BOUNDS[name][1] for name in free])
    sol = least_squares(resid, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale=np.maximum(hi / 10,
                        1e-3), diff_step=0.02, max_nfev=max_nfev)
    return make(sol.x)


def to_entry(fabric: FabricModel, kinds: dict[str, tuple[str, str]],
             family: str) -> dict[str, Any]:
    """A calib.json entry: every constant with its kind and source, plus current residuals."""
    constants = {}
    for name, value in fabric.as_dict().items():
        if name == "name" or name not in kinds:  # a mechanism the family leaves at its default
            continue
        kind, source = kinds[name]
        constants[name] = {"value": value, "kind": kind, "source": source}
    return {
        "constants": constants,
        "residuals": [
            {"name": r.name, "measured": r.measured, "model": round(r.model, 4),
             "rel_error": round(r.rel_error, 4), "fitted": r.fitted, "weight": r.weight,
             "source": r.source}
            for r in residuals(family, fabric)
        ],
    }


# ----------------------------------------------------------------------------------------------
# Starting points: every constant's kind and source (the fit replaces the "fitted" values)

_FIT_CM = "fit: Table 4 CANN EP rows, CloudMatrix dispatch rows (weight 0.5)"
_FIG3B = "fit: Figure 3b per-AIV efficiency (8/16/24/32/48 AIVs)"
_TIED = "tied: equal to issue_ns (a flag is a store issue without payload)"
_FIT_NV = "fit: TensorRT-LLM NVL72 dispatch rows (batch 128, EP8-64) and the 18-20 us floor"

_AIV = aiv_costs(AIV_ASSUMPTIONS["aiv_clock_ghz"]["value"],
                 AIV_ASSUMPTIONS["vector_instr_cycles"]["value"])
_AIV_SRC = ("derived from the AIV (256 B vector, Hot Chips 2019 DaVinci) at the assumed clock "
            "and vector instruction latency (calib.json 'assumptions', ubep.sim.assumed.aiv_costs)")



def _assumed(name: str, what: str = "") -> tuple[float, str, str]:
    """The START row of an assumed constant: its first-principles value (the fit replaces it)."""
    return (ASSUMED[name]["value"], "assumed", f"ubep.sim.assumed.ASSUMED: {what}fitted to the "
            "UBEP training set by `ubep sim calibrate`")


# A stop-and-wait fence waits until the store is complete as far as the NPU can tell: the part
# of its path inside the NPU (Table 2: intra-NPU 218 ns of a one-hop access's 929 ns, 1 : 4.3),
# the same share of every hop class's round trip.
_FENCE = 218.0 / 929.0
_FENCE_SRC = ("derived from Table 2 (CALIBRATION.md): a fence waits for the store's completion "
              "inside the NPU, the intra-NPU access over the one-hop access (218 / 929 = 1 / "
              "4.3), as a share of the store's round trip on every hop class")

# A SyncAll of one die's 48 AIVs through global memory: each AIV's arrival is an atomic add
# on one word of the die's HBM, the adds serialise there one local access apart, and the
# release is read by a poll (ubep.sim.fabric.syncall_atomic_ns): (48 + 1) x 218 ns. Two of them
# are 15.4 % of CANN EP's EP64 dispatch: the paper's ~15 % SyncAll share is predicted, not fitted.
_SYNCALL_SRC = ("derived from the die's structure and Table 2 (CALIBRATION.md): a SyncAll's 48 "
                "AIV arrivals are atomic adds on one HBM word, serialised one intra-NPU access "
                "(218 ns) apart, and the release is one poll: (48 + 1) x 218 ns "
                "(ubep.sim.fabric.syncall_atomic_ns); the ~15 % SyncAll share is its check")

START: dict[str, dict[str, tuple[float, str, str]]] = {
    "cm384": {
        "init_ns": (30_000.0, "fitted", _FIT_CM),
        "issue_ns": (100.0, "fitted", _FIT_CM),
        "core_bandwidth_gbps": (49.0, "derived",
                                "UB ~392 GB/s per NPU (Table 2 text) / 8: Figure 3b's reference "
                                "is 8 AIVs at full per-AIV efficiency"),
        "latency_exposure": (0.17, "fitted", _FIT_CM),
        "contention_cores": (12.0, "fitted", _FIG3B),
        "contention_sharpness": (2.0, "fitted", _FIG3B),
        "barrier_ns": (syncall_atomic_ns(48, 218.0), "derived", _SYNCALL_SRC),
        "flag_ns": (300.0, "tied", _TIED),
        "poll_ns": (218.0, "derived", "Table 2 intra-NPU latency 218 ns: a poll is a local read"),
        "count_expert_ns": (_AIV["count_expert_ns"], "derived", _AIV_SRC + ": one VectorCount "
                            "instruction per expert"),
        "cumsum_entry_ns": (_AIV["cumsum_entry_ns"], "derived", _AIV_SRC + ": 6 dependent "
                            "vector adds per 64 int32 entries"),
        "vector_op_ns": (_AIV["vector_op_ns"], "derived", _AIV_SRC + ": one vector compare / "
                         "checksum instruction over a block's 32 B marker"),
        "atomic_bytes": (512, "derived", "UBEP paper Section 3.4: 512 B atomic UB writes"),
        "tff_flag_bytes": (32, "derived", "UBEP paper Section 3.4: 32 B flag + 480 B payload"),
        "count_pick_ns": (_AIV["count_pick_ns"], "derived", _AIV_SRC + ": 4 B per pick over a "
                          "256 B vector per cycle"),
        "fence_rtt_fraction": (_FENCE, "derived", _FENCE_SRC),
        "metadata_ratio": (0.132, "derived", "UBEP paper evaluation text (CALIBRATION.md): "
                           "UBEP's communication volume is 13.2 % above the baseline's"),
        "aux_cores_at_256": (12.0, "derived", "UBEP paper evaluation text (CALIBRATION.md): at "
                             "256 ranks 12 AIVs go to routing and checksum work"),
        "cumsum_group_sync_ns": _assumed("cumsum_group_sync_ns"),
        "poll_lanes": (1, "derived", "one poll per count / flag word: each source publishes "
                       "its word with its own atomic store, which the receiver observes and "
                       "checks on its own (UBEP paper evaluation text on Figure 14, "
                       "CALIBRATION.md: more experts mean more verification work; Appendix A's "
                       "beta prices one poll per expert)"),
        "check_lanes": (8, "derived", "one 256 B vector (Hot Chips 2019 DaVinci) holds the 32 B "
                        "markers of 8 atomic blocks, gathered by one strided copy (UBEP paper "
                        "Section 3.4: a 32 B flag / marker per 512 B DataBlock)"),
        "store_window": _assumed("store_window"),
        "hot_share": _assumed("hot_share", "the skewed set-ups' unstated hot share (Figure 9), "),
        "sw_meet": (1, "derived", "UBEP paper evaluation text on Figure 10 (CALIBRATION.md): "
                    "Data-as-Flag gains by removing the stop-and-wait pattern and reducing "
                    "cross-AIV synchronisation, whose overhead grows with the rank count: CANN "
                    "EP's AIVs meet at a counter before each per-destination flag"),
        "syncall_global": (0, "derived", "Ascend's SyncAll joins the cores of one kernel (one "
                           "rank); cross-rank completion comes from the flags. The paper's "
                           "'global barriers' (Figure 2) read as a barrier of every rank "
                           "(1: a tier-aware dissemination barrier) is a what-if: refitted, it "
                           "fits the training set worse, with four constants at a bound "
                           "(docs/SIMULATOR.md 3.2)"),
    },
    "nvl72": {
        "init_ns": (14_000.0, "fitted", _FIT_NV),
        "issue_ns": (20.0, "fitted", _FIT_NV),
        "core_bandwidth_gbps": (112.5, "derived",
                                "NVL72 900 GB/s unidirectional per GPU / 8 (the CM384 rule)"),
        "latency_exposure": (0.05, "fitted", _FIT_NV),
        "contention_cores": (40.0, "fitted", _FIT_NV),
        "contention_sharpness": (0.0, "borrowed", "CM384 Figure 3b shape (no GPU measurement)"),
        "barrier_ns": (0.0, "borrowed", "CM384 value (no NVL72 row: the fitted ASP graph has no "
                       "barrier)"),
        "flag_ns": (100.0, "tied", _TIED),
        "poll_ns": (218.0, "derived", "nvl72 preset hop-0 latency: a poll is a local read"),
        "count_expert_ns": (0.0, "borrowed", "CM384 value (no NVL72 row constrains it)"),
        "cumsum_entry_ns": (2.0, "assumed", "as CM384"),
        "vector_op_ns": (10.0, "assumed", "as CM384"),
        "atomic_bytes": (128, "derived", "NCCL LL128: 128 B lines written in order on NVLink "
                         "(CALIBRATION.md NCCL tuner constants: LL128 bandwidth factor 0.92)"),
        "tff_flag_bytes": (8, "derived", "NCCL LL128: 8 B flag per 128 B line"),
        "count_pick_ns": (0.0, "borrowed", "CM384 value (no NVL72 row constrains it)"),
    },
    "host": {
        "init_ns": (2_000.0, "assumed", "waking a thread pool; the peers benchmark measures it"),
        "issue_ns": (50.0, "assumed", "per-row call overhead: a compiled copy loop runs near "
                     "memcpy rate (CALIBRATION.md host: 11-16 GB/s vs 12.7 GB/s)"),
        "core_bandwidth_gbps": (12.7, "derived", "CALIBRATION.md host: memcpy one process "
                                "~12.7 GB/s"),
        "latency_exposure": (0.0, "derived", "MEMORY-MODEL.md: ordinary x86 stores are posted; "
                             "a core never waits for a store to land"),
        "contention_cores": (2.0, "fitted", "fit: memcpy two processes ~20 GB/s aggregate"),
        "contention_sharpness": (0.0, "borrowed", "CM384 Figure 3b shape"),
        "barrier_ns": (1_300.0, "derived", "CALIBRATION.md host: spin + sched_yield round trip "
                       "~1.3 us; a barrier costs at least one"),
        "flag_ns": (10.0, "assumed", "one release store"),
        "poll_ns": (10.0, "assumed", "one acquire load that hits"),
        "count_expert_ns": (20.0, "assumed", "np.bincount-like count per expert"),
        "cumsum_entry_ns": (1.0, "assumed", "a prefix sum over int64"),
        "vector_op_ns": (20.0, "assumed", "compare / checksum of one 512 B block"),
        "atomic_bytes": (512, "derived", "FORMATS.md TFF block_bytes default 512"),
        "tff_flag_bytes": (32, "derived", "FORMATS.md TFF flag_bytes default 32"),
        "count_pick_ns": (0.0, "assumed", "counting is part of the call's fixed cost on a CPU "
                          "(the host model of ubep.sim.host measures it)"),
    },
}


def start_fabric(family: str, borrowed_from: FabricModel | None = None) -> FabricModel:
    """The starting :class:`FabricModel` of ``family``; ``borrowed`` constants come from
    ``borrowed_from`` (the fitted CM384 model)."""
    if family not in START:
        raise InvalidArgumentError("family", family, f"must be one of {sorted(START)}")
    values: dict[str, Any] = {}
    for name, (value, kind, _source) in START[family].items():
        if kind == "borrowed":
            if borrowed_from is None:
                raise InvalidArgumentError("borrowed_from", None, f"{family} borrows {name}")
            value = getattr(borrowed_from, name)
        values[name] = value
    return FabricModel(name=family, **values)


def _fit_host(fabric: FabricModel) -> FabricModel:
    from scipy.optimize import brentq

    target = 20.0 / (2 * fabric.core_bandwidth_gbps)  # per-process speed with two at once
    k = brentq(lambda x: float(fabric.with_values(contention_cores=x).speed(2)) - target,
               0.05, 1000.0)
    return fabric.with_values(contention_cores=float(k))


def calibrate(*, max_nfev: int = 80, progress: Callable[[str], None] | None = None,
              path: Path | None = None) -> dict[str, Any]:
    """Run every fit and write calib.json (``path``, default: the packaged file)."""
    cm = fit("cm384", start_fabric("cm384"), max_nfev=max_nfev, progress=progress)
    nv = fit("nvl72", start_fabric("nvl72", cm), max_nfev=max_nfev, progress=progress)
    ho = _fit_host(start_fabric("host", cm))
    data: dict[str, Any] = {
        "version": 1,
        "about": "Fabric constants of ubep.sim, fitted only to docs/CALIBRATION.md. "
                 "Regenerate with `ubep sim calibrate --write`. kinds: fitted | derived | "
                 "assumed | tied | borrowed.",
        "fabrics": {
            "cm384": {**to_entry(cm, _kinds("cm384"), "cm384"), "assumptions": AIV_ASSUMPTIONS},
            "nvl72": to_entry(nv, _kinds("nvl72"), "nvl72"),
            "nvl576": {"same_as": "nvl72",
                       "note": "EXTRAPOLATION: no NVL576 measurement exists; NVL72 constants "
                               "on the two-tier nvl576 topology preset."},
            "host": to_entry(ho, _kinds("host"), "host"),
        },
    }
    out = Path(path or CALIB_PATH)
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    _read.cache_clear()
    return data


def _kinds(family: str) -> dict[str, tuple[str, str]]:
    return {name: (kind, source) for name, (_v, kind, source) in START[family].items()}
