"""The paper's experiments, one function each, on the calibrated fabric models.

Every function returns an :class:`ExperimentResult`: a printable table, a JSON-ready payload and
notes that state the assumptions. Baseline numbers (CANN EP) are the calibrated model; every UBEP
number is a prediction (see docs/SIMULATOR.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .calib import load_fabric, topology_for
from .fabric import SYNC_MODES, FabricModel
from .timeline import TASKS
from .workload import (
    CANN_EP,
    UBEP,
    UBEP_NO_MAPPING,
    System,
    Workload,
    partition_constants,
    run_case,
)

__all__ = ["EXPERIMENTS", "ExperimentResult", "run_experiment"]

# CALIBRATION.md, Table 4 baseline rows (for side-by-side display only).
CANN_TABLE4_US = {16: 103.0, 32: 120.0, 64: 139.0, 128: 144.0, 256: 151.0}
MAX_RANKS = {"cm384": 384, "nvl72": 72, "nvl576": 576, "host": 64}


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
    if family == "nvl576":
        return ("NVL576 is an EXTRAPOLATION: no published measurement; NVL72 constants on a "
                "two-tier topology.",)
    return ()


def _eps(family: str, eps: Sequence[int]) -> list[int]:
    return [r for r in eps if r <= MAX_RANKS[family]]


# ----------------------------------------------------------------------------------------------


def table4(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Dispatch latency/bandwidth, EP 16-256, 128 tokens, hidden 7168, 1 B, top-8, 1 expert/rank."""
    fab = fabric or load_fabric(family)
    w = Workload()
    rows, data = [], []
    for r in _eps(family, (16, 32, 64, 128, 256)):
        topo = topology_for(family, r)
        cann = run_case(w, CANN_EP, topo, fab).latency_ns
        ubep = run_case(w, UBEP, topo, fab).latency_ns
        bw_c, bw_u = w.payload_bytes() / cann, w.payload_bytes() / ubep
        measured = CANN_TABLE4_US.get(r) if family == "cm384" else None
        rows.append((r, measured if measured is not None else "-", _us(cann), _us(ubep),
                     round(bw_c, 1), round(bw_u, 1), round(cann / ubep, 2)))
        data.append({"ep": r, "cann_latency_us": _us(cann), "ubep_latency_us": _us(ubep),
                     "cann_bandwidth_gbps": round(bw_c, 2), "ubep_bandwidth_gbps": round(bw_u, 2),
                     "cann_measured_latency_us": measured})
    return ExperimentResult(
        "table4", f"Table 4: dispatch latency and bandwidth ({family})",
        ("ep", "cann_paper_us", "cann_model_us", "ubep_pred_us", "cann_gbps", "ubep_gbps",
         "speedup"),
        tuple(rows),
        ("bandwidth = tokens x top-k x hidden x bytes / latency = 7.34 MB / latency, per rank",
         "CANN EP = bsp + expert_contiguous + sw (calibrated); UBEP = asp + hierarchical + sp "
         "(predicted, never fitted)", *_family_note(family)),
        {"rows": data, "family": family},
    )


def _split_row(panel: str, x: int, system: System, workload: Workload, family: str,
               ranks: int, fab: FabricModel) -> tuple[Any, ...]:
    res = run_case(workload, system, topology_for(family, ranks), fab)
    a2a, sync = res.sync_split_ns()
    return (panel, x, system.name, _us(res.latency_ns), _us(a2a), _us(sync),
            round(sync / (a2a + sync), 3))


def fig7(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """All-to-all vs synchronisation time vs batch size, ranks and experts."""
    fab = fabric or load_fabric(family)
    rows = []
    systems = (CANN_EP, UBEP)
    ranks_a = min(128, MAX_RANKS[family])
    for batch in (8, 16, 32, 64, 128):
        for s in systems:
            rows.append(_split_row(f"a: batch (EP{ranks_a})", batch, s,
                                   Workload(tokens_per_rank=batch), family, ranks_a, fab))
    for r in _eps(family, (64, 128, 256)):
        for s in systems:
            rows.append(_split_row("b: ranks (batch 128)", r, s, Workload(), family, r, fab))
    ranks_c = min(64, MAX_RANKS[family])
    for experts in (128, 256):
        w = Workload(experts_per_rank=experts // ranks_c, routing="hot", hot_experts=8)
        for s in systems:
            rows.append(_split_row(f"c: experts (EP{ranks_c}, 8 hot)", experts, s, w, family,
                                   ranks_c, fab))
    return ExperimentResult(
        "fig7", f"Figure 7: latency split into all-to-all and synchronisation ({family})",
        ("panel", "x", "system", "latency_us", "all_to_all_us", "sync_us", "sync_share"),
        tuple(rows),
        ("all_to_all = mean core time moving/ordering data (init, send, count, cumsum, "
         "reorder) on the slowest rank; sync = latency - all_to_all (barriers, flags, "
         "verification, waiting)",
         "panel c: 8 hot experts get half of all picks (ubep.routing.hot_experts_topk)",
         *_family_note(family)),
    )


def _phase_rows(batch: int, system: System, fab: FabricModel, family: str,
                ranks: int) -> tuple[list[tuple[Any, ...]], Any]:
    res = run_case(Workload(tokens_per_rank=batch), system, topology_for(family, ranks), fab)
    tl, r = res.timeline, res.slowest_rank
    groups = {"Init": ("init",), "Token-Sending": ("send",),
              "SendFlag & Verification": ("flag", "verify", "count", "barrier"),
              "CalCumSum": ("cumsum",), "Token-Reordering": ("consume",)}
    rows = []
    for label, tasks in groups.items():
        m = np.zeros(len(tl), dtype=bool)
        for t in tasks:
            m |= tl.mask(rank=r, task=t)
        if not m.any():
            continue
        start, end = float(tl.start_ns[m].min()), float(tl.end_ns[m].max())
        rows.append((batch, system.name, label, _us(start), _us(end), _us(end - start),
                     _us(res.latency_ns)))
    return rows, res


def fig8(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Task-wise breakdown at EP64, batch 32/64/128, both engines."""
    fab = fabric or load_fabric(family)
    ranks = min(64, MAX_RANKS[family])
    rows: list[tuple[Any, ...]] = []
    gantt: dict[str, Any] = {}
    for batch in (32, 64, 128):
        for s in (CANN_EP, UBEP):
            got, res = _phase_rows(batch, s, fab, family, ranks)
            rows.extend(got)
            r = res.slowest_rank
            m = res.timeline.mask(rank=r)
            gantt[f"{s.name}|{batch}"] = {
                "core": res.timeline.core[m].tolist(),
                "task": [TASKS[t] for t in res.timeline.task[m]],
                "start_us": (res.timeline.start_ns[m] / 1e3).round(3).tolist(),
                "end_us": (res.timeline.end_ns[m] / 1e3).round(3).tolist(),
            }
    return ExperimentResult(
        "fig8", f"Figure 8: task-wise breakdown at EP{ranks} ({family})",
        ("batch", "system", "task", "start_us", "end_us", "span_us", "latency_us"),
        tuple(rows),
        ("spans on the slowest rank: first start to last end over its cores; ASP tasks overlap",
         "SendFlag & Verification = barriers + flags + verification (BSP) or TokenCnt + count "
         "polling (ASP)", *_family_note(family)),
        {"gantt": gantt},
    )


def fig9(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Per-core token-send latency: 64 ranks (4 x 16), 256 experts, top-8, 8 hot, 48 cores."""
    fab = fabric or load_fabric(family)
    ranks = min(64, MAX_RANKS[family])
    w = Workload(experts_per_rank=256 // ranks, routing="hot", hot_experts=8)
    topo = topology_for(family, ranks)
    rows, per_core, maxima, land_maxima = [], {}, {}, {}
    for key, s in (("cann_ep", CANN_EP), ("balanced", UBEP_NO_MAPPING),
                   ("hierarchical", UBEP)):
        res = run_case(w, s, topo, fab)
        lat = res.send_latency_ns()
        land = res.send_latency_ns(until="land")
        busy = lat[lat > 0]
        worst = int(np.argmax(lat.max(axis=1)))
        per_core[key] = (lat[worst] / 1e3).round(3).tolist()
        maxima[key] = _us(busy.max())
        land_maxima[key] = _us(land.max())
        rows.append((s.name, key, lat.shape[1], _us(busy.max()), _us(np.median(busy)),
                     round(float(busy.max() / busy.mean()), 2), _us(land.max()),
                     _us(res.latency_ns)))
    return ExperimentResult(
        "fig9", f"Figure 9: per-core token-send latency, EP{ranks}, 256 experts, 8 hot ({family})",
        ("system", "key", "send_cores", "max_core_us", "median_core_us", "max/mean",
         "max_core_to_land_us", "dispatch_us"),
        tuple(rows),
        ("per-core token-send latency = a send core's Token-Sending time (first issue to last "
         "issue), statistics over every send core of every rank; max_core_to_land_us runs to "
         "the landing of the core's last unit (adds queueing at hot receivers' ports)",
         "each system uses its own core split (CANN EP: all 48 cores send; UBEP: Appendix A "
         "partition)", *_family_note(family)),
        {"max_core_latency_us": maxima, "max_core_to_land_latency_us": land_maxima,
         "slowest_rank_core_latency_us": per_core},
    )


def fig10(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """SW vs TFF vs DC vs SP across sync granularity (row size 10 B - 10 KB), 16/32/64 ranks."""
    fab = fabric or load_fabric(family)
    rows = []
    for r in _eps(family, (16, 32, 64)):
        topo = topology_for(family, r)
        for size in (10, 32, 100, 320, 1000, 3200, 10000):
            w = Workload(hidden=size, itemsize=1)
            for sync in SYNC_MODES:
                res = run_case(w, UBEP.with_(sync=sync, name=f"UBEP/{sync}"), topo, fab)
                rows.append((r, size, sync, _us(res.latency_ns)))
    return ExperimentResult(
        "fig10", f"Figure 10: synchronisation mechanisms vs granularity ({family})",
        ("ranks", "granularity_bytes", "sync", "latency_us"),
        tuple(rows),
        ("ASP engine + hierarchical scheduler, 128 tokens, top-8; granularity = bytes of one "
         "synchronised row",
         f"TFF carries {fab.tff_flag_bytes} B of flag per {fab.atomic_bytes} B block; "
         "SP pays a per-block compare and a row reset on the receiver; DC a checksum per "
         "(core, destination) batch; SW a flag per (source, destination) after a round trip",
         *_family_note(family)),
    )


def topk(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Top-k 2/4/8 at EP 64 and 256."""
    fab = fabric or load_fabric(family)
    rows = []
    for r in _eps(family, (64, 256)):
        topo = topology_for(family, r)
        for k in (2, 4, 8):
            w = Workload(num_topk=k)
            cann = run_case(w, CANN_EP, topo, fab).latency_ns
            ubep = run_case(w, UBEP, topo, fab).latency_ns
            rows.append((r, k, _us(cann), _us(ubep), round(cann / ubep, 2)))
    return ExperimentResult(
        "topk", f"Top-k sensitivity ({family})",
        ("ranks", "topk", "cann_us", "ubep_us", "speedup"), tuple(rows),
        ("128 tokens/rank, hidden 7168, 1 B, 1 expert/rank", *_family_note(family)),
    )


def partition(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Appendix C.3: simulated latency vs count-core group size, against Appendix A's pick."""
    from ..sched.partition import partition as model_partition

    fab = fabric or load_fabric(family)
    rows = []
    for r in _eps(family, (64, 128, 256)):
        topo = topology_for(family, r)
        n = topo.cores_per_rank
        for batch in (32, 64, 128):
            w = Workload(tokens_per_rank=batch)
            alpha, beta, b_count = partition_constants(topo, fab, w.row_bytes, r)
            pick = model_partition(n, r, w.num_topk, batch, alpha=alpha, beta=beta,
                                   b_count=b_count)
            sweep = sorted({1, 2, 4, 8, 16, pick.num_count_cores})
            lat = {}
            for n_c in sweep:
                s = UBEP.with_(num_send_cores=n - n_c, num_count_cores=n_c)
                lat[n_c] = run_case(w, s, topo, fab).latency_ns
            best = min(lat, key=lambda c: lat[c])
            for n_c in sweep:
                rows.append((r, batch, n_c, _us(lat[n_c]), "model" if n_c ==
                             pick.num_count_cores else "", "sim best" if n_c == best else ""))
    return ExperimentResult(
        "partition", f"Appendix C.3: count-core group size vs ranks and batch ({family})",
        ("ranks", "batch", "count_cores", "ubep_us", "appendix_a_pick", "simulated_best"),
        tuple(rows),
        ("Appendix A model constants from the fabric (ubep.sim.workload.partition_constants)",
        *_family_note(family)),
    )


# Table 3 of the paper (CALIBRATION.md): hidden, top-k, routed experts, payload bytes/element.
MODELS = (
    ("Qwen3-30B", 2048, 8, 128, 2),
    ("GLM-4.7", 5120, 8, 160, 2),
    ("DeepSeek-R1", 7168, 8, 256, 1),
    ("DeepSeek-V3.2", 7168, 8, 256, 1),
)


def tpot(family: str = "cm384", fabric: FabricModel | None = None, *, batch: int = 64,
         comm_share: float = 0.5) -> ExperimentResult:
    """Predicted TPOT change from simulated dispatch + combine latencies."""
    if not 0 < comm_share < 1:
        raise InvalidArgumentError("comm_share", comm_share, "must be in (0, 1)")
    fab = fabric or load_fabric(family)
    rows = []
    for index, (name, hidden, k, experts, itemsize) in enumerate(MODELS):
        ranks = min(experts, MAX_RANKS[family])
        while experts % ranks:
            ranks -= 1
        w = Workload(tokens_per_rank=batch, hidden=hidden, itemsize=itemsize, num_topk=k,
                     experts_per_rank=experts // ranks, seed=index)
        topo = topology_for(family, ranks)
        t_c = sum(run_case(w, CANN_EP, topo, fab, op=op).latency_ns
                  for op in ("dispatch", "combine"))
        t_u = sum(run_case(w, UBEP, topo, fab, op=op).latency_ns
                  for op in ("dispatch", "combine"))
        ratio = (1 - comm_share) + comm_share * t_u / t_c
        rows.append((name, ranks, _us(t_c), _us(t_u), round(100 * (1 - ratio), 1)))
    return ExperimentResult(
        "tpot", f"Predicted TPOT change ({family})",
        ("model", "ep", "cann_dispatch+combine_us", "ubep_dispatch+combine_us",
         "tpot_reduction_pct"),
        tuple(rows),
        (f"assumes MoE communication is {comm_share:.0%} of per-token latency under CANN EP "
         "(CALIBRATION.md, Section 5.5) and that nothing else changes: "
         "TPOT_ubep / TPOT_cann = (1 - s) + s * T_ubep / T_cann",
         f"decode batch {batch} tokens per rank; EP = routed experts (one expert per rank, "
         "capped at the fabric size); shared experts are local and move no data; "
         "combine payload BF16",
         "UBEP combine uses the same ASP graph without count cores (no prefix sums)",
         *_family_note(family)),
    )


EXPERIMENTS: dict[str, Callable[..., ExperimentResult]] = {
    "table4": table4,
    "fig7": fig7,
    "fig8": fig8,
    "fig9": fig9,
    "fig10": fig10,
    "topk": topk,
    "partition": partition,
    "tpot": tpot,
}


def run_experiment(name: str, family: str = "cm384", **kwargs: Any) -> ExperimentResult:
    if name not in EXPERIMENTS:
        raise InvalidArgumentError("experiment", name, f"must be one of {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[name](family, **kwargs)
