"""UBEP's unknown costs: the constants of kind ``assumed`` and how they set the fabric.

The AIV's vector costs follow from its width, clock and instruction latency
(:func:`aiv_costs`); the clock, the instruction latency, CalCumSum's hand-off per count
core, the stores a core keeps in
flight and the hot experts' share of the picks in the paper's skewed set-ups (not a
cost, a set-up unknown) are not measured by any row:
each has a first-principles value and a documented plausible range (:data:`ASSUMED`), and
:mod:`ubep.sim.fit` fits them, together with CANN EP's own fitted constants
(:data:`BASELINE_FREE`), to the training set. :func:`apply_assumed` makes the fabric of a set of
values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .fabric import FabricModel

__all__ = [
    "AIV_ASSUMPTIONS",
    "AIV_VECTOR_BYTES",
    "ASSUMED",
    "BASELINE_FREE",
    "COST_SIGN",
    "aiv_costs",
    "apply_assumed",
    "bound_side",
    "value_range",
]

# Public Ascend 910-class figures. DaVinci vector unit: 2048 bit = 256 B per cycle (Liao et al.,
# "DaVinci: A Scalable Architecture for Neural Network Computing", Hot Chips 31, 2019). Clock:
# Ascend 910 runs its DaVinci cores at 1.0 GHz (256 TFLOPS FP16 = 32 cores x 16^3 MACs x 2 x
# 1 GHz, Huawei Ascend 910 announcement, 2019); later 910B/910C parts are reported at up to
# ~1.8 GHz: the clock is an assumed range. The fixed issue-to-result latency of one vector
# instruction (scalar unit dispatch, UB access, pipeline drain) is not public: assumed range.
AIV_VECTOR_BYTES = 256


def _assumed(value: float, lo: float, hi: float, source: str) -> dict[str, Any]:
    """One assumed constant: its first-principles ``value``, plausible range and source."""
    return {"value": value, "range": [lo, hi], "kind": "assumed", "source": source}


AIV_ASSUMPTIONS: dict[str, dict[str, Any]] = {
    "aiv_clock_ghz": _assumed(
        1.4, 1.0, 1.8,
        "Ascend 910 DaVinci cores at 1.0 GHz (2019 announcement: 256 TFLOPS FP16 = 32 "
        "cores x 4096 MACs x 2 x 1 GHz); 910B/910C reported up to ~1.8 GHz; nominal "
        "= midpoint"),
    "vector_instr_cycles": _assumed(
        24.0, 8.0, 64.0,
        "fixed latency of one vector instruction (dispatch by the scalar unit, UB "
        "read, pipeline): not public; range from a short SIMD pipeline (8) to one "
        "with a UB round trip per instruction (64); nominal ~ geometric mean"),
}


def aiv_costs(clock_ghz: float, instr_cycles: float) -> dict[str, float]:
    """UBEP's per-operation vector costs (ns) from the AIV clock and instruction latency.

    * ``vector_op_ns``: one compare / checksum step over the 32 B markers of up to
      ``check_lanes`` = 8 atomic blocks gathered side by side (256 B): one vector instruction
      (``instr_cycles``) plus 1 cycle of data;
    * ``count_expert_ns`` + ``count_pick_ns`` per pick: a VectorCount of one expert id over the
      rank's ``T x K`` int32 picks: one instruction plus ``4 T K / 256`` cycles;
    * ``cumsum_entry_ns``: a prefix sum over ``R x L`` int32 counts in 64-lane vectors takes
      ``log2(64) = 6`` dependent instructions per 64 entries.
    """
    if not clock_ghz > 0 or not instr_cycles >= 0:
        raise InvalidArgumentError("clock_ghz", (clock_ghz, instr_cycles), "must be > 0, >= 0")
    cycle = 1.0 / clock_ghz
    lanes = AIV_VECTOR_BYTES // 4
    return {
        "vector_op_ns": (instr_cycles + 1.0) * cycle,
        "count_expert_ns": instr_cycles * cycle,
        "count_pick_ns": 4.0 / AIV_VECTOR_BYTES * cycle,
        "cumsum_entry_ns": 6.0 * instr_cycles / lanes * cycle,
    }


ASSUMED: dict[str, dict[str, Any]] = {
    **AIV_ASSUMPTIONS,
    "cumsum_group_sync_ns": _assumed(
        654.0, 218.0, 5000.0,
        "one partial-sum hand-off between AIVs through HBM: a write, a flag and a "
        "read, 3 x the intra-NPU access of 218 ns (CALIBRATION.md Table 2); up to a "
        "scalar-unit synchronisation of a few microseconds"),
    "store_window": _assumed(
        8.0, 1.0, 64.0,
        "stores one AIV keeps in flight (its MTE queue of outstanding writes; UBEP "
        "paper Sections 2.3 and 3.3: each token costs its core a share of its hop's "
        "round trip, Little's law): not public; from one store at a time (1) to a "
        "queue deep enough that no row waits (64); nominal = geometric mean"),
    "hot_share": _assumed(
        0.5, 0.1, 0.75,
        "the hot experts' share of the picks in the paper's skewed set-ups (Figure "
        "9, Figure 7(c)): the paper states eight hot experts, not their share "
        "(EXPERIMENTS.md); nominal an even split; range from 0.1 (three times the "
        "uniform share of 8 of 256 experts, 3.1 %) to 0.75; Figure 9's two maxima "
        "measure it"),
}
# CANN EP's own fitted constants (ubep.sim.calib.FREE): fitted together with the assumed ones,
# since both price the baseline rows and the training set's CANN EP numbers.
_BASE_SRC = ("fit: Table 4 CANN EP rows, CloudMatrix dispatch rows, SyncAll share and the "
             "training set (CANN EP's Figure 9 maximum, the improvements over CANN EP)")
BASELINE_FREE: dict[str, dict[str, Any]] = {
    "init_ns": {"range": [5_000.0, 60_000.0], "source": _BASE_SRC},
    "issue_ns": {"range": [10.0, 2_000.0], "source": _BASE_SRC + "; flag_ns tied to it"},
    "latency_exposure": {"range": [0.01, 1.0], "source": _BASE_SRC},
}
# Which way each constant makes a latency longer (+1: larger is costlier; -1: a faster clock).
COST_SIGN = {"aiv_clock_ghz": -1, "vector_instr_cycles": 1,
             "cumsum_group_sync_ns": 1, "store_window": -1, "hot_share": 1, "init_ns": 1,
             "issue_ns": 1, "latency_exposure": 1}


def apply_assumed(base: FabricModel, values: dict[str, float]) -> FabricModel:
    """``base`` with the assumed constants ``values`` (missing ones at their first-principles
    value) and the costs derived from them; baseline constants in ``values``
    (:data:`BASELINE_FREE`) replace those of ``base`` (``flag_ns`` tied to ``issue_ns``)."""
    v = {k: float(values.get(k, a["value"])) for k, a in ASSUMED.items()}
    fixed = {k: float(values[k]) for k in BASELINE_FREE if k in values}
    if "issue_ns" in fixed:
        fixed["flag_ns"] = fixed["issue_ns"]
    return base.with_values(**aiv_costs(v["aiv_clock_ghz"], v["vector_instr_cycles"]),
                            cumsum_group_sync_ns=v["cumsum_group_sync_ns"],
                            store_window=v["store_window"],
                            hot_share=v["hot_share"], **fixed)


def value_range(name: str) -> list[float]:
    return list(ASSUMED[name]["range"] if name in ASSUMED else BASELINE_FREE[name]["range"])



def bound_side(name: str, value: float) -> str:
    """``"lower"`` / ``"upper"`` when ``value`` lies within 1 % of the log-range of a bound of
    ``name``'s range, else ``""``."""
    a, b = np.log(value_range(name))
    x = np.log(value)
    if x - a < 0.01 * (b - a):
        return "lower"
    if b - x < 0.01 * (b - a):
        return "upper"
    return ""
