"""The paper's experiments, one function each, on the calibrated fabric models.

Every function returns an :class:`ExperimentResult`: a printable table, a JSON-ready payload and
notes that state the assumptions. Baseline numbers (CANN EP) are the calibrated model; every UBEP
number is a prediction (see docs/SIMULATOR.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..modes import SYNCS
from .assumed import ASSUMED
from .calib import fabric_variants, load_fabric, topology_for
from .fabric import FabricModel
from .presets import PRESETS
from .spec import build_spec, receiver_drain_ns
from .syncs import DATA_AS_FLAG, SW
from .timeline import TASKS
from .workload import (
    CANN_EP,
    FIG9_SEEDS,
    UBEP,
    UBEP_NO_MAPPING,
    System,
    Workload,
    partition_constants,
    plans_for,
    run_case,
)

__all__ = ["EXPERIMENTS", "ExperimentResult", "run_experiment"]

# CALIBRATION.md, Table 4 baseline rows (for side-by-side display only).
CANN_TABLE4_US = {16: 103.0, 32: 120.0, 64: 139.0, 128: 144.0, 256: 151.0}
MAX_RANKS = {name: row.max_ranks for name, row in PRESETS.items()}
INTERVAL_NOTE = ("interval: the fitted constants at the ends of their leave-one-out spread "
                 "(`--no-fit`: the assumed constants over their ranges); the hull with the "
                 "nominal value")


@dataclass(frozen=True)
class ExperimentResult:
    """A table (``columns`` x ``rows``), notes, and the JSON payload ``data``."""

    name: str
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    notes: tuple[str, ...] = ()
    data: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        cells = [[_fmt(v) for v in row] for row in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]
        lines = [f"# {self.title}"]
        lines.append("  ".join(c.rjust(w) for c, w in zip(self.columns, widths, strict=True)))
        for r in cells:
            lines.append("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
        lines.extend(f"# {n}" for n in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"experiment": self.name, "title": self.title,
                               "notes": list(self.notes)}
        out.update(self.data)
        if "rows" not in out:
            out["rows"] = [dict(zip(self.columns, row, strict=True)) for row in self.rows]
        return out


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return f"{v:.3f}" if abs(float(v)) < 10 else f"{v:.1f}"
    return str(v)


def _us(ns: float) -> float:
    return round(float(ns) / 1e3, 3)


def _family_note(family: str) -> tuple[str, ...]:
    note = PRESETS[family].note
    return (note,) if note else ()


def _eps(family: str, eps: Sequence[int]) -> list[int]:
    return [r for r in eps if r <= MAX_RANKS[family]]


def _latency(workload: Workload, system: System, topology: Any, fabric: FabricModel) -> float:
    return run_case(workload, system, topology, fabric).latency_ns


def _aiv_sum(workload: Workload, system: System, topology: Any, fabric: FabricModel) -> float:
    return run_case(workload, system, topology, fabric).aiv_sum_ns()


def _band(fn: Callable[[FabricModel], float], family: str,
          fabric: FabricModel | None) -> tuple[float, float, float]:
    """``(nominal, low, high)`` of a UBEP prediction over the box of assumed constants (exact
    bounds: every latency is monotone in every derived cost, see calib.fabric_variants)."""
    if fabric is not None:
        v = fn(fabric)
        return v, v, v
    var = fabric_variants(family)
    nominal, low, high = fn(var["nominal"]), fn(var["low"]), fn(var["high"])
    # Appendix A re-partitions the cores at each corner, and that choice is not monotone in
    # the costs: a corner can land on the other side of the nominal. The interval is the hull,
    # so that it always holds its point.
    return nominal, min(nominal, low, high), max(nominal, low, high)


def _sensitivity(fn: Callable[[FabricModel], float], family: str) -> list[dict[str, Any]]:
    """One-at-a-time swings of a UBEP prediction: each assumption at the two ends of its range,
    the others nominal, sorted by the size of the swing."""
    var = fabric_variants(family)
    if family != "cm384":
        return []
    nominal = fn(var["nominal"])
    out = []
    for name, a in ASSUMED.items():
        lo, hi = fn(var[f"{name}:low"]), fn(var[f"{name}:high"])
        out.append({"constant": name, "range": a["range"], "kind": a["kind"],
                    "nominal_us": _us(nominal), "at_cheap_end_us": _us(lo),
                    "at_costly_end_us": _us(hi),
                    "swing_pct": round(100 * (hi - lo) / nominal, 2)})
    return sorted(out, key=lambda r: -r["swing_pct"])


def _sens_at(label: str, fn: Callable[[FabricModel], float], family: str,
             fabric: FabricModel | None) -> dict[str, list[dict[str, Any]]]:
    """The sensitivity table at one representative point (none for a caller's own fabric)."""
    return {} if fabric is not None else {label: _sensitivity(fn, family)}


def provenance(family: str, assumed_workload: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Which constants of ``family`` are calibrated, derived and assumed (calib.json), plus the
    experiment's own assumed workload parameters."""
    from .calib import load_calibration

    entry = load_calibration()["fabrics"][family]
    if "same_as" in entry:
        entry = load_calibration()["fabrics"][entry["same_as"]]
    kinds: dict[str, list[str]] = {"calibrated": [], "derived": [], "assumed": []}
    for name, c in entry["constants"].items():
        kind = {"fitted": "calibrated", "tied": "calibrated", "borrowed": "assumed"}.get(
            c["kind"], c["kind"])
        kinds[kind].append(name)
    for name, a in entry.get("assumptions", {}).items():
        kinds["assumed"].append(f"{name} in {a['range']} (nominal {a['value']})")
    kinds["assumed"].extend(assumed_workload)
    return kinds


# ----------------------------------------------------------------------------------------------


def table4(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Dispatch latency/bandwidth, EP 16-256, 128 tokens, hidden 7168, 1 B, top-8, 1 expert/rank."""
    fab = fabric or load_fabric(family)
    w = Workload()
    rows, data, sens = [], [], {}
    for r in _eps(family, (16, 32, 64, 128, 256)):
        topo = topology_for(family, r)
        cann = run_case(w, CANN_EP, topo, fab).latency_ns

        def ubep_of(f: FabricModel, topo: Any = topo) -> float:
            return run_case(w, UBEP, topo, f).latency_ns

        ubep, lo, hi = _band(ubep_of, family, fabric)
        bw_c, bw_u = w.payload_bytes() / cann, w.payload_bytes() / ubep
        measured = CANN_TABLE4_US.get(r) if family == "cm384" else None
        rows.append((r, measured if measured is not None else "-", _us(cann), _us(ubep),
                     _us(lo), _us(hi), round(bw_c, 1), round(bw_u, 1),
                     f"{w.payload_bytes() / hi:.1f}-{w.payload_bytes() / lo:.1f}",
                     round(cann / ubep, 2), f"{cann / hi:.2f}-{cann / lo:.2f}"))
        data.append({"ep": r, "cann_latency_us": _us(cann), "ubep_latency_us": _us(ubep),
                     "ubep_latency_interval_us": [_us(lo), _us(hi)],
                     "cann_bandwidth_gbps": round(bw_c, 2), "ubep_bandwidth_gbps": round(bw_u, 2),
                     "ubep_bandwidth_interval_gbps": [round(w.payload_bytes() / hi, 2),
                                                      round(w.payload_bytes() / lo, 2)],
                     "cann_measured_latency_us": measured})
        if fabric is None and r in (16, 256):
            sens[f"EP{r}"] = _sensitivity(ubep_of, family)
    return ExperimentResult(
        "table4", f"Table 4: dispatch latency and bandwidth ({family})",
        ("ep", "cann_paper_us", "cann_model_us", "ubep_pred_us", "ubep_lo_us", "ubep_hi_us",
         "cann_gbps", "ubep_gbps", "ubep_gbps_interval", "speedup", "speedup_interval"),
        tuple(rows),
        ("bandwidth = tokens x top-k x hidden x bytes / latency = 7.34 MB / latency, per rank",
         "CANN EP = bsp + expert_contiguous + sw (calibrated); UBEP = asp + hierarchical + sp "
         "(its assumed constants fitted to the training set, EP16 and EP64 among it)",
         INTERVAL_NOTE, *_family_note(family)),
        {"rows": data, "family": family, "sensitivity": sens,
         "provenance": provenance(family)},
    )


def _split_rows(panel: str, x: int, workload: Workload, family: str, ranks: int,
                fab: FabricModel, fabric: FabricModel | None) -> list[tuple[Any, ...]]:
    """One bar pair of Figures 7 / 12: per system, the per-AIV time (the sum over the slowest
    rank's AIVs of each AIV's time, :meth:`SimResult.aiv_sum_ns`) split into all-to-all work
    and the rest, the operator latency beside it, and UBEP's improvement of both."""
    topo = topology_for(family, ranks)
    out = []
    cann = run_case(workload, CANN_EP, topo, fab)
    for system in (CANN_EP, UBEP):
        res = cann if system is CANN_EP else run_case(workload, system, topo, fab)
        a2a, other = res.aiv_split_ns()
        total = a2a + other
        row: tuple[Any, ...] = (panel, x, system.name, _us(res.latency_ns), _us(total))
        gain: tuple[Any, ...] = ("-", "-", "-")
        lo = hi = total
        if system.engine == "asp":  # UBEP: the interval over the assumed constants
            _, lo, hi = _band(partial(_aiv_sum, workload, UBEP, topo), family, fabric)
            c = cann.aiv_sum_ns()
            gain = (round(100 * (1 - total / c), 1), f"{100 * (1 - hi / c):.1f}-"
                    f"{100 * (1 - lo / c):.1f}",
                    round(100 * (1 - res.latency_ns / cann.latency_ns), 1))
        out.append((*row, _us(lo), _us(hi), _us(a2a), _us(other), round(other / total, 3),
                    *gain))
    return out


SPLIT_COLUMNS = ("panel", "x", "system", "latency_us", "aiv_sum_us", "aiv_lo_us", "aiv_hi_us",
                 "all_to_all_us", "other_us", "other_share", "improvement_pct",
                 "improvement_interval", "latency_improvement_pct")
SPLIT_NOTE = ("aiv_sum = per-AIV time, the sum over the slowest rank's AIVs of each AIV's time "
              "(call start to the end of its last task; UBEP's routing and checksum AIVs run "
              "until their own poll of the count words ends); all_to_all = the AIVs' work "
              "moving and ordering data (init, send, count, cumsum, routing, reorder), summed; "
              "other = aiv_sum - all_to_all (barriers, flags, verification, the global "
              "checksum, waiting); improvement = 1 - UBEP / CANN EP of "
              "aiv_sum, latency_improvement the same of the operator latency")


def fig7(family: str = "cm384", fabric: FabricModel | None = None, *,
         hot_share: float | None = None) -> ExperimentResult:
    """All-to-all vs synchronisation time vs batch size, ranks and experts (EXPERIMENTS.md).

    ``hot_share`` of panel c: ``None`` = the calibrated share (fitted to Figure 9)."""
    fab = fabric or load_fabric(family)
    share = fab.hot_share if hot_share is None else hot_share
    rows = []
    ranks_a = min(128, MAX_RANKS[family])
    for batch in (8, 16, 32, 64, 128):
        rows += _split_rows(f"a: batch (EP{ranks_a})", batch, Workload(tokens_per_rank=batch),
                            family, ranks_a, fab, fabric)
    for r in _eps(family, (64, 128, 256)):
        rows += _split_rows("b: ranks (batch 64)", r, Workload(tokens_per_rank=64), family, r,
                            fab, fabric)
    for experts, eps in ((128, (64, 128)), (256, (64, 128, 256))):
        for r in _eps(family, eps):
            w = Workload(tokens_per_rank=64, experts_per_rank=experts // r, routing="hot",
                         hot_experts=8, hot_share=hot_share)
            rows += _split_rows(f"c: E={experts}, 8 hot", r, w, family, r, fab, fabric)
    return ExperimentResult(
        "fig7", f"Figure 7: per-AIV time split into all-to-all and synchronisation ({family})",
        SPLIT_COLUMNS, tuple(rows),
        (SPLIT_NOTE,
         "defaults (EXPERIMENTS.md): 128 ranks, batch 64, 1 expert per NPU; panel c: x = ranks",
         f"panel c: 8 hot experts take {share:.0%} of the picks (the paper does not state the "
         "skew: " + ("fitted to Figure 9's two maxima" if hot_share is None else "ASSUMED")
         + "; `ubep sim hotshare` sweeps 25-75 %)",
         "aiv_lo/hi: " + INTERVAL_NOTE + " (CANN EP is calibrated: lo = hi)",
         *_family_note(family)),
        {"provenance": provenance(family, (f"panel c hot_share {share:.3g} (range 0.1-0.75)",)),
         "sensitivity": _sens_at(f"EP{ranks_a}, batch 64", partial(
             _latency, Workload(tokens_per_rank=64), UBEP, topology_for(family, ranks_a)),
             family, fabric)},
    )


def hotshare(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """How the unstated hot-expert share moves Figures 7c and 9 (EP64, 256 experts, 8 hot)."""
    fab = fabric or load_fabric(family)
    ranks = min(64, MAX_RANKS[family])
    topo = topology_for(family, ranks)
    rows = []
    for share in sorted({0.25, round(fab.hot_share, 3), 0.5, 0.75}):
        w = Workload(tokens_per_rank=64, experts_per_rank=256 // ranks, routing="hot",
                     hot_experts=8, hot_share=share)
        cann = run_case(w, CANN_EP, topo, fab)
        a2a, sync = cann.aiv_split_ns()
        ubep, lo, hi = _band(partial(_latency, w, UBEP, topo), family, fabric)
        nomap = run_case(w, UBEP_NO_MAPPING, topo, fab)
        hier = run_case(w, UBEP, topo, fab)
        rows.append((share, _us(cann.latency_ns), round(sync / (a2a + sync), 3), _us(ubep),
                     _us(lo), _us(hi), round(cann.latency_ns / ubep, 2),
                     _us(cann.send_latency_ns(until="sent").max()),
                     _us(nomap.send_latency_ns(until="sent").max()),
                     _us(hier.send_latency_ns(until="sent").max())))
    return ExperimentResult(
        "hotshare", f"Unstated skew: hot-expert share of the picks, EP{ranks}, 256 experts "
        f"({family})",
        ("hot_share", "cann_us", "cann_sync_share", "ubep_us", "ubep_lo_us", "ubep_hi_us",
         "speedup", "fig9_cann_max_core_us", "fig9_nomap_max_core_us", "fig9_ubep_max_core_us"),
        tuple(rows),
        ("the paper states 8 hot experts but not their share; the other skewed experiments "
         f"use {fab.hot_share:.3g}, fitted to Figure 9's two maxima (calib.json hot_share)",
         "batch 64, top-8; the fig9_* columns: one hot-expert draw (the first of Figure 9's "
         "8, where two hot experts share a CANN EP core), not Figure 9's median",
         *_family_note(family)),
        {"provenance": provenance(family, ("hot_share swept 0.25-0.75",)),
         "sensitivity": _sens_at(f"hot share {fab.hot_share:.3g}", partial(
             _latency, Workload(tokens_per_rank=64, experts_per_rank=256 // ranks,
                                routing="hot", hot_experts=8, hot_share=fab.hot_share), UBEP,
             topo), family, fabric)},
    )


# Figure 8's AIV groups (EXPERIMENTS.md): UBEP shows AIVs 0-41 (average), 42-45, 46, 47; CANN EP
# 0-44 (average), 45, 46, 47.
AIV_GROUPS = {"asp": ((0, 42), (42, 46), (46, 47), (47, 48)),
              "bsp": ((0, 45), (45, 46), (46, 47), (47, 48))}
PHASES = {"Init": ("init",), "Token-Sending": ("send",),
          "SendFlag & Verification": ("flag", "verify", "count", "barrier"),
          "CalCumSum": ("cumsum",), "Token-Reordering": ("consume",),
          "Routing & Checksum": ("route", "checksum")}


def _phase_rows(batch: int, system: System, fab: FabricModel, family: str,
                ranks: int) -> tuple[list[tuple[Any, ...]], Any]:
    """Per AIV group of the paper and per task: the mean time a core of the group spends in
    the task on the slowest rank (task spans include waits for data inside the task)."""
    res = run_case(Workload(tokens_per_rank=batch), system, topology_for(family, ranks), fab)
    tl, r = res.timeline, res.slowest_rank
    n = topology_for(family, ranks).cores_per_rank
    rows = []
    for lo, hi in AIV_GROUPS[system.engine]:
        if hi > n:
            continue
        label = f"{lo}-{hi - 1}" if hi - lo > 1 else str(lo)
        cores = np.arange(lo, hi)
        for phase, tasks in PHASES.items():
            m = np.zeros(len(tl), dtype=bool)
            for t in tasks:
                m |= tl.mask(rank=r, task=t)
            m &= np.isin(tl.core, cores)
            busy = float(np.sum(tl.end_ns[m] - tl.start_ns[m])) / cores.size
            if busy > 0:
                rows.append((batch, system.name, label, phase, _us(busy),
                             _us(res.latency_ns)))
    return rows, res


def fig8(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Figure 8: task-wise breakdown per AIV group at EP64, batch 32/64/128, both engines."""
    fab = fabric or load_fabric(family)
    ranks = min(64, MAX_RANKS[family])
    rows: list[tuple[Any, ...]] = []
    gantt: dict[str, Any] = {}
    improvement = {}
    for batch in (32, 64, 128):
        lat, aiv = {}, {}
        for s in (CANN_EP, UBEP):
            got, res = _phase_rows(batch, s, fab, family, ranks)
            rows.extend(got)
            lat[s.engine], aiv[s.engine] = res.latency_ns, res.aiv_sum_ns()
            r = res.slowest_rank
            m = res.timeline.mask(rank=r)
            gantt[f"{s.name}|{batch}"] = {
                "core": res.timeline.core[m].tolist(),
                "task": [TASKS[t] for t in res.timeline.task[m]],
                "start_us": (res.timeline.start_ns[m] / 1e3).round(3).tolist(),
                "end_us": (res.timeline.end_ns[m] / 1e3).round(3).tolist(),
            }
        w, topo = Workload(tokens_per_rank=batch), topology_for(family, ranks)
        _, lo, hi = _band(partial(_aiv_sum, w, UBEP, topo), family, fabric)
        improvement[batch] = {
            "improvement_pct": round(100 * (1 - aiv["asp"] / aiv["bsp"]), 1),
            "interval_pct": [round(100 * (1 - hi / aiv["bsp"]), 1),
                             round(100 * (1 - lo / aiv["bsp"]), 1)],
            "aiv_sum_us": {"cann_ep": _us(aiv["bsp"]), "ubep": _us(aiv["asp"])},
            "latency_us": {"cann_ep": _us(lat["bsp"]), "ubep": _us(lat["asp"])},
            "latency_improvement_pct": round(100 * (1 - lat["asp"] / lat["bsp"]), 1)}
    return ExperimentResult(
        "fig8", f"Figure 8: task-wise breakdown at EP{ranks} ({family})",
        ("batch", "system", "aiv_group", "task", "mean_us_per_core", "latency_us"),
        tuple(rows),
        ("per AIV group of the paper (UBEP 0-41 avg, 42-45, 46, 47; CANN EP 0-44 avg, 45, 46, "
         "47), on the slowest rank: mean time per core of the group in each task",
         "SendFlag & Verification = barriers + flags + verification (BSP) or TokenCnt + count "
         "polling (ASP); which cores count is the model's Appendix A partition; Routing & "
         "Checksum = UBEP's routing and checksum AIVs (3 at EP64, the cores after the "
         "partition's send and count cores)",
         "UBEP improvement over CANN EP per batch, of the per-AIV time (the sum over the "
         "slowest rank's AIVs of each AIV's time, as Figure 7; interval: the leave-one-out "
         "spread), and of the operator latency: "
         + "; ".join(f"batch {b}: {v['improvement_pct']} % [{v['interval_pct'][0]}, "
                     f"{v['interval_pct'][1]}], latency {v['latency_improvement_pct']} %"
                     for b, v in improvement.items()),
         *_family_note(family)),
        {"gantt": gantt, "improvement": improvement, "provenance": provenance(family)},
    )


FIG9_NAMES = {"cann_ep": "CANN EP", "balanced": "UBEP w/o mapping", "hierarchical": "UBEP"}


def fig9(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Per-AIV token-send latency: 64 ranks (4 x 16), 256 experts, top-8, 8 hot, 48 cores."""
    fab = fabric or load_fabric(family)
    ranks = min(64, MAX_RANKS[family])
    w = Workload(tokens_per_rank=64, experts_per_rank=256 // ranks, routing="hot",
                 hot_experts=8).resolved(fab)
    topo = topology_for(family, ranks)
    rows, profile, maxima, by_seed, readings = [], {}, {}, {}, {}
    for key, s in (("cann_ep", CANN_EP), ("balanced", UBEP_NO_MAPPING),
                   ("hierarchical", UBEP)):
        draws = [_fig9_stats(w.with_(seed=seed), s, topo, fab) for seed in FIG9_SEEDS]
        stats = np.array([d[0] for d in draws])
        med = np.median(stats, axis=0)
        by_seed[key] = stats[:, 0].round(2).tolist()
        # The slowest rank's cores, slowest first: the k-th slowest core's latency is the
        # median over the placements, so the profile's first point is the table's maximum.
        profile[key] = np.median(np.array([d[1] for d in draws]), axis=0).round(3).tolist()
        maxima[key] = round(float(med[0]), 2)
        readings[key] = {c: round(float(v), 2) for c, v in zip(FIG9_READINGS, med[3:7],
                                                                 strict=True)}
        rows.append((s.name, key, len(draws[0][1]), round(float(med[0]), 1),
                     f"{stats[:, 0].min():.1f}-{stats[:, 0].max():.1f}",
                     *(round(float(v), 2 if i == 2 else 1) for i, v in enumerate(med[1:], 1))))
    return ExperimentResult(
        "fig9", f"Figure 9: per-AIV token-send latency, EP{ranks}, 256 experts, 8 hot ({family})",
        ("system", "key", "send_cores", "max_core_us", "max_core_range_us", "median_core_us",
         "max/mean", "max_core_ack_us", "max_core_program1_us", "max_core_issue_us",
         "max_core_rx_wait_us", "hot_port_drain_us", "dispatch_us"),
        tuple(rows),
        ("per-AIV token-send latency (max_core_us, the fitted quantity; docs/SIMULATOR.md 1.8) "
         "= program (1) of the paper for the core's own rows (its issue time: the rows' work "
         "and its window waits, plus its farthest row's round trip through the rank's link: "
         "both grow with its hop mix) + the mean wait of its rows at their receivers' ports "
         "(the queues every core sending there shares), the largest over every send core",
         "the other readings, each the largest over the cores: max_core_ack_us until the "
         "core's last store is acknowledged (the hottest receiver's drain ends every core "
         "that sends there: no mapping can lower it); max_core_program1_us without the "
         "receivers' waits; max_core_issue_us the issue time alone; max_core_rx_wait_us the "
         "largest mean receiver wait of a core; hot_port_drain_us = the hottest receiver's "
         "remote bytes / its port bandwidth",
         "each system uses its own core split (CANN EP: all 48 cores send; UBEP: Appendix A "
         "partition)",
         f"every column: the median over {len(FIG9_SEEDS)} seeded hot-expert placements (the "
         "paper does not say which experts are hot); max_core_range_us: min-max of the "
         "maximum over them",
         f"batch 64 (EXPERIMENTS.md default); the 8 hot experts take {w.hot_share:.1%} of "
         "the picks (unstated by the paper: fitted to this figure's two maxima, calib.json "
         "hot_share; `ubep sim hotshare` sweeps 25-75 %); no interval is computed",
         *_family_note(family)),
        {"max_core_latency_us": maxima, "max_core_latency_by_placement_us": by_seed,
         "max_core_readings_us": readings, "names": FIG9_NAMES,
         "slowest_rank_core_profile_us": profile,
         "provenance": provenance(family, (f"hot_share {w.hot_share:.3g} (fitted; range "
                                           "0.1-0.75)",))},
    )


FIG9_READINGS = ("ack", "program1", "issue", "rx_wait")


def _fig9_stats(w: Workload, system: System, topo: Any,
                fab: FabricModel) -> tuple[list[float], list[float]]:
    """One hot-expert placement of Figure 9: ``([largest per-AIV send latency, the median
    core's, max / mean, the largest of each of FIG9_READINGS, the hottest receiver's drain,
    the dispatch latency] (us), the slowest rank's cores' latencies, slowest first (us))``."""
    res = run_case(w, system, topo, fab)
    spec = build_spec(plans_for(w, system, topo, fab), topo, fab, engine=system.engine,
                      sync=system.sync, row_bytes=w.row_bytes)
    lat = res.send_latency_ns(until="sent")
    busy = lat[lat > 0]
    worst = int(np.argmax(lat.max(axis=1)))
    profile = np.sort(lat[worst])[::-1] / 1e3
    return ([_us(busy.max()), _us(np.median(busy)), float(busy.max() / busy.mean()),
             _us(res.send_latency_ns(until="ack").max()),
             _us(res.send_latency_ns(until="rtt").max()),
             _us(res.send_latency_ns(until="issue").max()),
             _us(float(res.core_rx_wait_ns.max())),
             _us(float(receiver_drain_ns(spec, topo).max())), _us(res.latency_ns)],
            profile.tolist())


def _exchange_plans(topology: Any, num_send_cores: int) -> list[Any]:
    """Figure 10's microbenchmark: every rank writes one message to every other rank. The
    messages are dealt round robin over the send cores in hop-class order (the hierarchical
    mix), farthest first inside a core; message (r -> d) lands in slot 0 of d's region r."""
    from ..sched.plan import Plan

    R = topology.num_ranks
    hops = topology.hop_matrix().astype(np.int64)
    plans = []
    for r in range(R):
        dst = np.array([d for d in range(R) if d != r], dtype=np.int64)
        hop = hops[r, dst]
        seq = np.lexsort((dst, hop))
        core = np.empty(dst.size, dtype=np.int64)
        core[seq] = np.arange(dst.size) % num_send_cores
        order = np.lexsort((dst, -hop, core))
        dst, hop, core = dst[order], hop[order], core[order]
        ptr = np.zeros(num_send_cores + 1, dtype=np.int64)
        np.cumsum(np.bincount(core, minlength=num_send_cores), out=ptr[1:])
        plans.append(Plan(
            rank=r, num_ranks=R, num_experts=R, layout="rank", policy="hierarchical",
            num_send_cores=num_send_cores, num_count_cores=0,
            send_token=np.zeros(dst.size, dtype=np.int64), send_k=np.zeros(dst.size, np.int64),
            send_expert=dst, send_dst_rank=dst, send_hop=hop,
            send_slot=np.zeros(dst.size, dtype=np.int64), send_core=core.astype(np.int32),
            core_ptr=ptr, count_expert_ptr=np.zeros(1, dtype=np.int64)))
    return plans


def exchange_latency_ns(topology: Any, fabric: FabricModel, sync: str, size_bytes: int) -> float:
    """Transfer plus synchronisation of one ``size_bytes`` message per rank pair (no Init, no
    counting, no reordering): the sender's store and the sync mode's own work (SW: fence round
    trip + flag; TFF: 32 B of flag per 512 B block; DC: checksum steps + a checksum message;
    SP: sentinel checks + the reset), the receiver's checks, until every message is verified."""
    from .analytic import run_analytic
    from .fabric import sync_costs
    from .spec import RowCosts, build_spec

    n_s = topology.cores_per_rank
    plans = _exchange_plans(topology, n_s)
    costs = sync_costs(sync, size_bytes, fabric)
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    send = tuple(float(fabric.issue_ns + costs.wire_bytes / fabric.core_bandwidth_gbps
                       + fabric.latency_exposure * lat[h] + costs.sender_extra_ns)
                 for h in range(topology.num_hops))
    wait = tuple(float(w) for w in fabric.window_wait_ns(
        np.full(topology.num_hops, costs.wire_bytes), np.arange(topology.num_hops),
        np.asarray(send), topology))
    row_costs = RowCosts(send_ns=send, consume_ns=(costs.receiver_extra_ns,), send_wait_ns=wait)
    fab = fabric.with_values(init_ns=0.0)
    spec = build_spec(plans, topology, fab, engine="asp", sync=sync, row_bytes=size_bytes,
                      row_costs=row_costs)
    return float(run_analytic(spec, topology, fab).latency_ns)


def fig10(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Figure 10: SW vs TFF vs DC vs SP, transfer + synchronisation at 10 B - 10 KB, 16/32/64
    ranks (a microbenchmark, not a MoE dispatch)."""
    fab = fabric or load_fabric(family)
    rows = []
    for r in _eps(family, (16, 32, 64)):
        topo = topology_for(family, r)
        for size in (10, 32, 100, 320, 1000, 3200, 10000):
            sw = exchange_latency_ns(topo, fab, SW, size)
            for sync in SYNCS:
                nom, lo, hi = _band(partial(exchange_latency_ns, topo, sync=sync,
                                            size_bytes=size), family, fabric)
                rows.append((r, size, sync, _us(nom), _us(lo), _us(hi),
                             round(100 * (1 - nom / sw), 1)))
    return ExperimentResult(
        "fig10", f"Figure 10: synchronisation mechanisms vs granularity ({family})",
        ("ranks", "granularity_bytes", "sync", "latency_us", "lo_us", "hi_us",
         "reduction_vs_sw_pct"),
        tuple(rows),
        ("microbenchmark (EXPERIMENTS.md): every rank writes one message of `granularity` "
         "bytes to every other rank, spread over its 48 cores in hop-class order; timed until "
         "every receiver has verified every message; no Init, counting or reordering",
         "ASSUMED: one message per rank pair (the paper states the data size, not the pattern)",
         f"SW = CANN EP's stop-and-wait (store, fence = one round trip, flag); TFF carries "
         f"{fab.tff_flag_bytes} B of flag per {fab.atomic_bytes} B block; DC a checksum step per "
         "block and a checksum message per batch; SP a sentinel check per block and the reset",
         "lo/hi: " + INTERVAL_NOTE,
         *_family_note(family)),
        {"provenance": provenance(family, ("one message per rank pair",)),
         "sensitivity": _fig10_sensitivity(family, fabric)},
    )


def _fig10_sensitivity(family: str,
                       fabric: FabricModel | None) -> dict[str, list[dict[str, Any]]]:
    r = max(_eps(family, (16, 32, 64)))
    topo = topology_for(family, r)
    out: dict[str, list[dict[str, Any]]] = {}
    for sync in DATA_AS_FLAG:
        out.update(_sens_at(f"{sync.upper()}, {r} ranks, 10 KB", partial(
            exchange_latency_ns, topo, sync=sync, size_bytes=10000), family, fabric))
    return out


def fig12(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Appendix C.1 (Figure 12): all-to-all vs other time over ranks and batch sizes."""
    fab = fabric or load_fabric(family)
    rows = []
    for batch in (32, 128):
        for r in _eps(family, (64, 128, 256)):
            rows += _split_rows(f"{'a' if batch == 32 else 'b'}: batch {batch}", r,
                                Workload(tokens_per_rank=batch), family, r, fab, fabric)
    for r in _eps(family, (64, 256)):
        for batch in (8, 16, 32, 64, 128):
            rows += _split_rows(f"{'c' if r == 64 else 'd'}: EP{r}", batch,
                                Workload(tokens_per_rank=batch), family, r, fab, fabric)
    return ExperimentResult(
        "fig12", f"Figure 12: all-to-all vs other per-AIV time ({family})",
        SPLIT_COLUMNS, tuple(rows),
        ("panels a/b: x = ranks; c/d: x = batch; 1 expert per NPU, top-8, hidden 7168, 1 B",
         SPLIT_NOTE + " (as Figure 7)", "aiv_lo/hi: UBEP, " + INTERVAL_NOTE,
         *_family_note(family)),
        {"provenance": provenance(family),
         "sensitivity": _sens_at("EP64, batch 32", partial(
             _latency, Workload(tokens_per_rank=32), UBEP,
             topology_for(family, min(64, MAX_RANKS[family]))), family, fabric)},
    )


def topk(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Figure 13: top-k 2/4/8 (rank count and batch unstated: 128 ranks, batch 64 assumed, and
    64 / 256 ranks to show how the assumption moves the result)."""
    fab = fabric or load_fabric(family)
    rows = []
    for r in _eps(family, (128, 64, 256)):
        topo = topology_for(family, r)
        for k in (2, 4, 8):
            w = Workload(tokens_per_rank=64, num_topk=k)
            cann = run_case(w, CANN_EP, topo, fab).latency_ns
            ubep, lo, hi = _band(partial(_latency, w, UBEP, topo), family, fabric)
            rows.append((r, "assumed default" if r == 128 else "range", k, _us(cann),
                         _us(ubep), _us(lo), _us(hi), round(100 * (1 - ubep / cann), 1),
                         f"{100 * (1 - hi / cann):.1f}-{100 * (1 - lo / cann):.1f}"))
    return ExperimentResult(
        "fig13", f"Figure 13: top-k sensitivity ({family})",
        ("ranks", "ranks_role", "topk", "cann_us", "ubep_us", "ubep_lo_us", "ubep_hi_us",
         "improvement_pct", "improvement_interval_pct"), tuple(rows),
        ("batch 64, hidden 7168, 1 B, 1 expert/rank; the paper does not state this figure's "
         "rank count or batch: 128 ranks / batch 64 are ASSUMED (EXPERIMENTS.md defaults), 64 and "
         "256 ranks show how that assumption moves the result",
         "average latency of one seeded routing; the paper's P99 (over calls) is not modelled",
         *_family_note(family)),
        {"provenance": provenance(family, ("rank count 128 (range 64-256)", "batch 64")),
         "sensitivity": _sens_at("EP128, top-2", partial(
             _latency, Workload(tokens_per_rank=64, num_topk=2), UBEP,
             topology_for(family, min(128, MAX_RANKS[family]))), family, fabric)},
    )


def partition(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Appendix C.3 (Figure 14): extra latency of each CalCumSum group size over the best."""
    from ..sched.partition import partition as model_partition

    fab = fabric or load_fabric(family)
    rows = []
    trend: dict[str, int] = {}
    for r in _eps(family, (64, 128, 256)):
        topo = topology_for(family, r)
        n = topo.cores_per_rank
        for batch in (8, 16, 32, 64, 128):
            w = Workload(tokens_per_rank=batch)
            alpha, beta, b_count = partition_constants(topo, fab, w.row_bytes, r,
                                                       batch * w.num_topk)
            pick = model_partition(n, r, w.num_topk, batch, alpha=alpha, beta=beta,
                                   b_count=b_count)
            sweep = sorted({1, 2, 4, 8, 16, pick.num_count_cores})
            lat = {}
            for n_c in sweep:
                s = UBEP.with_(num_send_cores=n - n_c, num_count_cores=n_c)
                lat[n_c] = run_case(w, s, topo, fab).latency_ns
            best = min(lat, key=lambda c: lat[c])
            trend[f"EP{r}/batch{batch}"] = best
            for n_c in sweep:
                rows.append((r, batch, n_c, _us(lat[n_c]), _us(lat[n_c] - lat[best]),
                             "model" if n_c == pick.num_count_cores else "",
                             "sim best" if n_c == best else ""))
    return ExperimentResult(
        "fig14", f"Figure 14 (Appendix C.3): CalCumSum group size vs ranks and batch "
        f"({family})",
        ("ranks", "batch", "count_cores", "ubep_us", "extra_over_best_us", "appendix_a_pick",
         "simulated_best"),
        tuple(rows),
        ("group sizes 1, 2, 4, 8, 16 and Appendix A's pick; one expert per NPU die; "
         "extra_over_best = latency - the best size's latency at that grid point",
         "Appendix A model constants from the fabric (ubep.sim.workload.partition_constants)",
         "best size per point: " + ", ".join(f"{k}: {v}" for k, v in trend.items()),
         "nominal constants only (no interval: the grid is 90 plans)", *_family_note(family)),
        {"best_group_size": trend, "provenance": provenance(family)},
    )


# Table 3 of the paper (CALIBRATION.md) and Figure 11's deployments (EXPERIMENTS.md): name,
# hidden, top-k, routed experts, payload bytes/element, ranks, experts per rank. GLM-4.7's 160
# routed experts on 128 ranks "with one expert per rank" cannot all be placed: the model routes
# over 128 experts there (an assumption, stated in the notes).
MODELS = (
    ("Qwen3-30B", 2048, 8, 128, 2, 16, 8),
    ("GLM-4.7", 5120, 8, 160, 2, 128, 1),
    ("GLM-4.7", 5120, 8, 160, 2, 160, 1),
    ("DeepSeek-R1", 7168, 8, 256, 1, 128, 2),
    ("DeepSeek-V3.2", 7168, 8, 256, 1, 128, 2),
)


def tpot(family: str = "cm384", fabric: FabricModel | None = None, *, batch: int = 64,
         comm_share: float = 0.5, hw_share: float = 0.2) -> ExperimentResult:
    """Figure 11: predicted TPOT change from simulated dispatch + combine latencies."""
    if not 0 < hw_share <= comm_share < 1:
        raise InvalidArgumentError("comm_share", (hw_share, comm_share),
                                   "need 0 < hw_share <= comm_share < 1")
    fab = fabric or load_fabric(family)
    rows = []
    sens: dict[str, list[dict[str, Any]]] = {}
    for index, (name, hidden, k, _experts, itemsize, ranks, epr) in enumerate(MODELS):
        if ranks > MAX_RANKS[family]:
            continue
        w = Workload(tokens_per_rank=batch, hidden=hidden, itemsize=itemsize, num_topk=k,
                     experts_per_rank=epr, seed=index)
        topo = topology_for(family, ranks)
        t_c = sum(run_case(w, CANN_EP, topo, fab, op=op).latency_ns
                  for op in ("dispatch", "combine"))

        def ubep_of(f: FabricModel, w: Workload = w, topo: Any = topo) -> float:
            return sum(run_case(w, UBEP, topo, f, op=op).latency_ns
                       for op in ("dispatch", "combine"))

        t_u, lo, hi = _band(ubep_of, family, fabric)
        if name == "DeepSeek-R1":
            sens = _sens_at(f"{name}, EP{ranks}, dispatch + combine", ubep_of, family, fabric)

        def cut(share: float, t: float, t_c: float = t_c) -> float:
            return round(100 * share * (1 - t / t_c), 1)

        rows.append((name, ranks, epr, _us(t_c), _us(t_u), _us(lo), _us(hi),
                     cut(comm_share, t_u), f"{cut(comm_share, hi)}-{cut(comm_share, lo)}",
                     cut(hw_share, t_u)))
    return ExperimentResult(
        "fig11", f"Figure 11: predicted TPOT change ({family})",
        ("model", "ep", "experts_per_rank", "cann_disp+comb_us", "ubep_disp+comb_us",
         "ubep_lo_us", "ubep_hi_us", f"tpot_cut_pct_s{comm_share}",
         f"tpot_cut_interval_s{comm_share}", f"tpot_cut_pct_s{hw_share}"),
        tuple(rows),
        ("TPOT_ubep / TPOT_cann = (1 - s) + s * T_ubep / T_cann, T = dispatch + combine of one "
         "MoE layer; the profile (EXPERIMENTS.md) gives MoE communication s = 50 % of per-token "
         f"latency but ~20 % of hardware execution time: s = {comm_share} if the stalls that "
         f"the communication causes shrink with it, s = {hw_share} if only its execution does",
         f"decode batch {batch} tokens per rank (ASSUMED: unstated); rank counts and experts per "
         "rank as EXPERIMENTS.md; GLM-4.7 at 128 ranks routes over 128 experts (ASSUMED: 160 "
         "do not fit one per rank); shared experts are local and move no data; combine BF16",
         "the paper's P99 over per-token samples is not modelled (one seeded routing per model)",
         *_family_note(family)),
        {"sensitivity": sens,
         "provenance": provenance(family, (f"decode batch {batch}",
                                           f"communication share s in [{hw_share}, {comm_share}]",
                                           "GLM-4.7 at EP128: 128 experts routed"))},
    )


EXPERIMENTS: dict[str, Callable[..., ExperimentResult]] = {
    "table4": table4,
    "fig7": fig7,
    "fig8": fig8,
    "fig9": fig9,
    "fig10": fig10,
    "fig11": tpot,
    "fig12": fig12,
    "fig13": topk,
    "fig14": partition,
    "hotshare": hotshare,
}


# Earlier names of three experiments, still accepted.
ALIASES = {"tpot": "fig11", "topk": "fig13", "partition": "fig14"}


def run_experiment(name: str, family: str = "cm384", **kwargs: Any) -> ExperimentResult:
    name = ALIASES.get(name, name)
    if name not in EXPERIMENTS:
        raise InvalidArgumentError("experiment", name, f"must be one of {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[name](family, **kwargs)
