"""The peers benchmark's rows and what is printed of them: system names, the table with its
two ratios, the byte formula, the floors, the exchange-alone and FP8 reports, machine info and
the plot. Pure functions of measured rows: nothing here launches a process."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Stats, format_table
from benchmarks.peers.workload import (
    Shape,
)
from ubep import modes

__all__ = ["MPI_SYSTEMS", "Row", "floor_report", "table_rows", "write_plot"]

MPI_SYSTEMS = ("impi", "openmpi", "mpich")
PEER_SYSTEMS = (*MPI_SYSTEMS, "gloo")
# A peer's local work (pack, reorder, reduce): torch ops (torch_kernels.py, what an MoE user
# writes) and numpy (kernels.py, the extra row). Its rows are "<peer>-<variant>".
VARIANTS = ("torch", "numpy")
# FP8 shapes only: torch local work that quantises BF16 x itself first (the whole FP8 dispatch,
# as ubep's "+q" rows); the plain variants move rows the caller quantised already.
QUANT_VARIANT = "torch+q"
ALL_VARIANTS = (*VARIANTS, QUANT_VARIANT)
QUANT_SUFFIX = "+q"  # ubep-<engine>-<sync>+q: the engine quantises BF16 x (FP8 shapes)
# every engine x sync mode (SP only where the payload has a sentinel: ubep.modes.supports)
UBEP_MODES = tuple((e, s) for e in modes.ENGINES for s in modes.SYNCS)
LAYOUTS = modes.LAYOUTS
OPS = ("dispatch", "combine")
# Diagnostic rows (system = the bare peer name): the payload exchange alone, the already-packed
# rows' Alltoallv / all_to_all_single, for dispatch and for combine's send-back.
EXCHANGE_OPS = {"dispatch": "dispatch_exchange", "combine": "combine_exchange"}


def transport(system: str) -> str:
    """The peer a row's system runs on (``openmpi-torch`` -> ``openmpi``); others unchanged."""
    head, _, tail = system.rpartition("-")
    return head if tail in ALL_VARIANTS and head in PEER_SYSTEMS else system


def quantises(system: str) -> bool:
    """A row whose dispatch includes quantising BF16 x (``ubep-...+q``, ``<peer>-torch+q``)."""
    return system.endswith(QUANT_SUFFIX)


def is_mpi(system: str) -> bool:
    """Any MPI peer variant (the ``best_mpi`` of the ratios and floors is the fastest of them)."""
    return transport(system) in MPI_SYSTEMS and system not in MPI_SYSTEMS


@dataclass(frozen=True)
class Row:
    """One measured (system, layout, shape, op); ``to_json`` gives its JSON row."""

    system: str
    layout: str
    shape: Shape
    op: str
    bytes_per_rank: float
    stats: Stats

    @property
    def dtype(self) -> str:
        return self.shape.dtype if self.op == "dispatch" else self.shape.combine_dtype

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "layout": self.layout,
            "ranks": self.shape.num_ranks,
            "tokens_per_rank": self.shape.tokens_per_rank,
            "hidden": self.shape.hidden,
            "dtype": self.dtype,
            "payload": self.shape.dtype,  # the shape's dispatch payload (tells fp8 from bf16)
            "routing": self.shape.routing,
            "op": self.op,
            "bytes_per_rank": self.bytes_per_rank,
            "min_us": self.stats.min_us,
            "median_us": self.stats.median_us,
            "max_us": self.stats.max_us,
            "repeats": self.stats.repeats,
        }


SYSTEM_ORDER = (
    [f"ubep-{e}-{s}" for e, s in UBEP_MODES]
    + [f"ubep-{e}-{s}{QUANT_SUFFIX}" for e, s in UBEP_MODES]
    + [f"{p}-{v}" for p in PEER_SYSTEMS for v in ALL_VARIANTS]
    + [*PEER_SYSTEMS, "memcpy"]  # the bare peer names: exchange-alone rows
)
TABLE_COLUMNS = [
    "layout", "routing", "system", "ranks", "tokens", "hidden", "dtype", "op", "bytes",
    "min_us", "median_us", "max_us", "algbw_gbps", "ratio_vs_best_mpi", "ratio_vs_floor",
]


def _key(row: Row) -> tuple[Any, ...]:
    return (row.layout, row.shape, row.op)


def table_rows(rows: Sequence[Row]) -> list[list[object]]:
    """Table cells, grouped by (layout, shape, op), with the two ratios filled in."""
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for row in rows:
        groups.setdefault(_key(row), []).append(row)
    out: list[list[object]] = []
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    for key in sorted(groups, key=lambda k: (k[0], k[1].routing, k[1].num_ranks,
                                              k[1].tokens_per_rank, k[1].hidden, OPS.index(k[2]),
                                              k[1].dtype)):
        members = sorted(groups[key], key=lambda r: order.get(r.system, 99))
        # A quantising row (FP8, "+q") is compared with the quantising MPI rows, the others
        # with the MPI rows that move the caller's rows as they are: the same work each.
        best_mpi = {
            q: min((r.stats.median_us for r in members
                    if is_mpi(r.system) and quantises(r.system) == q), default=float("nan"))
            for q in (False, True)
        }
        floor = next((r.stats.median_us for r in members if r.system == "memcpy"), float("nan"))
        for r in members:
            med = r.stats.median_us
            # combine after a 1-byte / FP8 dispatch: "uint8>bf16", "fp8>bf16"
            dtype = r.dtype if r.dtype == r.shape.dtype else f"{r.shape.dtype}>{r.dtype}"
            out.append([
                r.layout, r.shape.routing, r.system, r.shape.num_ranks, r.shape.tokens_per_rank,
                r.shape.hidden, dtype, r.op, round(r.bytes_per_rank), r.stats.min_us, med,
                r.stats.max_us, r.bytes_per_rank / (med * 1e3),
                med / best_mpi[quantises(r.system)], med / floor,
            ])
    return out


BYTE_FORMULA = """\
bytes = payload bytes one rank sends (mean over ranks), the same for every system:
  layout=expert: tokens x top-k x hidden x bytes/elem      (one row per valid (token, expert))
  layout=rank:   sum_d num_tokens_per_rank[d] x hidden x bytes/elem  (one row per (token, dst rank))
  dispatch moves x's type; combine moves BF16 rows back (a 1-byte dispatch combines in BF16;
  its dtype reads uint8>bf16 / fp8>bf16).
  e.g. expert, 128 tokens, top-8, hidden 2048, BF16: 128 x 8 x 2048 x 2 = 4,194,304 B
  fp8: x is BF16 and travels quantised, E4M3 values + a float32 scale per 128 channels:
  hidden + hidden/32 bytes per row (ubep.quant.row_bytes; 0.52x BF16's).
<peer>-torch: local work in torch ops, <peer>-numpy: in numpy, the same exchanges.
fp8 dispatch: ubep-<engine>-<sync> and <peer>-torch/-numpy move rows the caller quantised
  (x_scales= / packed values+scales rows); ubep-...+q (the engine quantises) and
  <peer>-torch+q (torch quantises first) are the whole FP8 dispatch from BF16 x.
algbw_gbps = bytes / median; ratio_vs_best_mpi = median / min over the MPI variants' medians
  ({impi, openmpi, mpich} x {torch, numpy}; for a +q row the MPI torch+q rows);
ratio_vs_floor = median / memcpy median, memcpy = every rank's process copying its bytes at
  once (np.copyto). Time = max over ranks per iteration (barrier before)."""


@dataclass(frozen=True)
class Floor:
    """One floor: ``system``'s median over ``versus``'s median must be <= ``limit``
    (a NaN limit: reported for information only)."""

    name: str
    system: str
    versus: str  # a system, "best_mpi" or "memcpy"
    shape: Shape
    layout: str
    op: str
    limit: float


def floors_for(shapes: Sequence[Shape]) -> list[Floor]:
    """The floors that the measured shapes allow checking."""
    small2 = Shape(2, 128, 2048, "bf16", "uniform")
    small4 = Shape(4, 128, 2048, "bf16", "uniform")
    # Against the fastest MPI variant (torch or numpy local work), and gloo's fastest variant.
    out = [
        Floor("dispatch vs best MPI", "ubep-asp-sp", "best_mpi", small2, "rank", "dispatch", 0.6),
        Floor("dispatch vs gloo", "ubep-asp-sp", "gloo", small2, "rank", "dispatch", 0.12),
        Floor("combine vs best MPI", "ubep-asp-sp", "best_mpi", small2, "rank", "combine", 0.5),
        Floor("combine vs gloo", "ubep-asp-sp", "gloo", small2, "rank", "combine", 0.12),
        Floor("4 ranks dispatch vs best MPI", "ubep-asp-sp", "best_mpi", small4, "rank",
              "dispatch", 0.5),
        Floor("4 ranks combine vs best MPI", "ubep-asp-sp", "best_mpi", small4, "rank",
              "combine", 0.5),
    ]
    for r in (2, 4):
        big = Shape(r, 512, 7168, "uint8", "uniform")
        for layout in LAYOUTS:
            # asp+sp cannot carry 1-byte payloads: the fastest ASP mode that can stands in.
            out.append(Floor("dispatch vs memcpy", "ubep-asp-best", "memcpy", big, layout,
                             "dispatch", 1.25))
        hot = Shape(r, 128, 2048, "bf16", "hot")
        for layout in LAYOUTS:
            # The engines compared alone (kernel decomposition: same sync mode, SW, the one
            # both must run), then the whole of ubep against the baseline for information.
            out.append(Floor("asp vs bsp, hot experts", "ubep-asp-sw", "ubep-bsp-sw", hot,
                             layout, "dispatch", 0.8))
            out.append(Floor("asp+sp vs bsp+sw, hot", "ubep-asp-sp", "ubep-bsp-sw", hot,
                             layout, "dispatch", float("nan")))
    present = set(shapes)
    return [f for f in out if f.shape in present]


def floor_report(rows: Sequence[Row], shapes: Sequence[Shape]) -> str:
    """PASS/FAIL per floor (medians of the measured sweep); a missing system reads ``n/a``."""
    med = {(r.system, r.layout, r.shape, r.op): r.stats.median_us for r in rows}
    lines = []
    for f in floors_for(shapes):
        if f.system == "ubep-asp-best":
            asp = [v for (s, lay, sh, op), v in med.items()
                   if s.startswith("ubep-asp-") and (lay, sh, op) == (f.layout, f.shape, f.op)]
            mine = min(asp) if asp else None
        else:
            mine = med.get((f.system, f.layout, f.shape, f.op))
        if f.versus == "best_mpi" or f.versus in PEER_SYSTEMS:
            # The fastest variant: any MPI flavour (or this peer) x torch/numpy local work.
            known = [v for (s, lay, sh, op), v in med.items()
                     if (is_mpi(s) if f.versus == "best_mpi"
                         else transport(s) == f.versus and s != f.versus)
                     and (lay, sh, op) == (f.layout, f.shape, f.op)]
            other = min(known) if known else None
        else:
            other = med.get((f.versus, f.layout, f.shape, f.op))
        if mine is None or other is None:
            verdict, ratio = "n/a", float("nan")
        else:
            ratio = mine / other
            verdict = "info" if math.isnan(f.limit) else "PASS" if ratio <= f.limit else "FAIL"
        lines.append([f.name, f.system, f.versus, f.shape.label, f.layout, f.op, ratio,
                      f.limit, verdict])
    if not lines:
        return "floors: none of the floor shapes was measured"
    cols = ["floor", "system", "versus", "shape", "layout", "op", "ratio", "limit", "verdict"]
    return ("floors (medians; best_mpi / gloo = the fastest variant):\n"
            + format_table(cols, lines, float_digits=3))


def exchange_report(rows: Sequence[Row], exchange_rows: Sequence[Row]) -> str:
    """Transport vs bookkeeping per peer: the payload exchange alone beside the whole op of each
    local-work variant (medians); ``xchg_pct`` is the exchange's share of the fastest variant."""
    if not exchange_rows:
        return ""
    whole = {(r.system, r.layout, r.shape, r.op): r.stats.median_us for r in rows}
    op_of = {xop: op for op, xop in EXCHANGE_OPS.items()}
    cells = []
    for r in sorted(exchange_rows, key=lambda r: (r.layout, r.shape.routing, r.shape.num_ranks,
                                                   r.shape.tokens_per_rank, r.shape.hidden,
                                                   SYSTEM_ORDER.index(r.system), r.op)):
        op = op_of[r.op]
        per_variant = [whole.get((f"{r.system}-{v}", r.layout, r.shape, op), float("nan"))
                       for v in VARIANTS]
        fastest = np.nanmin(per_variant) if not np.isnan(per_variant).all() else float("nan")
        cells.append([r.layout, r.system, r.shape.label, op, r.stats.median_us, *per_variant,
                      100.0 * r.stats.median_us / fastest,
                      r.bytes_per_rank / (r.stats.median_us * 1e3)])
    cols = ["layout", "peer", "shape", "op", "exchange_us",
            *[f"{v}_us" for v in VARIANTS], "xchg_pct", "xchg_gbps"]
    return ("peers' payload exchange alone (the packed rows' Alltoallv / all_to_all_single) vs "
            "their whole op per local-work variant; the rest is counts, pack, metadata, reorder, "
            "reduce:\n" + format_table(cols, cells, float_digits=1))


def _fastest(rows: Sequence[Row], pick: Any) -> Row | None:
    chosen = [r for r in rows if pick(r.system)]
    return min(chosen, key=lambda r: r.stats.median_us) if chosen else None


FP8_CLASSES = (
    # (label, which fp8 rows, which bf16 rows it is set against)
    ("ubep, caller-quantised rows", lambda s: s.startswith("ubep-") and not quantises(s),
     lambda s: s.startswith("ubep-")),
    ("ubep+q, engine quantises", lambda s: s.startswith("ubep-") and quantises(s),
     lambda s: s.startswith("ubep-")),
    ("best MPI, packed rows", lambda s: is_mpi(s) and not quantises(s), is_mpi),
    ("best MPI torch+q", lambda s: is_mpi(s) and quantises(s), is_mpi),
)


def fp8_report(rows: Sequence[Row]) -> str:
    """FP8 dispatch against BF16 dispatch of the same shape (ranks, tokens, hidden, routing),
    fastest row of each kind (medians): bytes ratio and time ratio; n/a where that BF16 shape
    was not measured."""
    fp8 = [r for r in rows if r.shape.quantised and r.op == "dispatch"]
    if not fp8:
        return ""
    by_key: dict[tuple[str, Shape], list[Row]] = {}
    for r in rows:
        if r.op == "dispatch":
            by_key.setdefault((r.layout, r.shape), []).append(r)
    cells = []
    for layout, shape in sorted({(r.layout, r.shape) for r in fp8},
                                key=lambda k: (k[0], k[1].num_ranks, k[1].hidden)):
        bf16_shape = Shape(shape.num_ranks, shape.tokens_per_rank, shape.hidden, "bf16",
                           shape.routing)
        for label, pick, pick_bf16 in FP8_CLASSES:
            mine = _fastest(by_key[(layout, shape)], pick)
            if mine is None:
                continue
            base = _fastest([r for r in by_key.get((layout, bf16_shape), [])
                             if not quantises(r.system)], pick_bf16)
            nan = float("nan")
            cells.append([
                layout, shape.label, label, mine.system, mine.stats.median_us,
                base.system if base else "n/a", base.stats.median_us if base else nan,
                mine.bytes_per_rank / base.bytes_per_rank if base else nan,
                mine.stats.median_us / base.stats.median_us if base else nan,
            ])
    cols = ["layout", "shape", "kind", "fp8_system", "fp8_us", "bf16_system", "bf16_us",
            "bytes_ratio", "time_ratio"]
    return ("FP8 dispatch vs BF16 dispatch of the same shape (fastest row of each kind, "
            "medians; ratio = fp8 / bf16):\n" + format_table(cols, cells, float_digits=3))


def machine_info(versions: dict[str, str], load_at_start: float) -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "load_average_1m_at_start": load_at_start,
        "load_average_1m_at_end": os.getloadavg()[0],
        "hostname": platform.node(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "versions": versions,
    }


def _style(system: str) -> tuple[Any, str]:
    """ubep's ASP modes in blues (circles), its BSP modes in oranges (squares), the peers in
    their own colours (triangles up: torch local work, down: numpy): the series stay tellable
    apart."""
    import matplotlib

    syncs = modes.SYNCS
    q = quantises(system)  # FP8 with quantisation included: diamonds
    base = system.removesuffix(QUANT_SUFFIX)
    for engine, cmap, marker in (("asp", "Blues", "o"), ("bsp", "Oranges", "s")):
        prefix = f"ubep-{engine}-"
        if base.startswith(prefix):
            shade = 0.45 + 0.5 * syncs.index(base[len(prefix):]) / (len(syncs) - 1)
            return matplotlib.colormaps[cmap](shade), "D" if q else marker
    peers = {"impi": "tab:green", "openmpi": "tab:red", "mpich": "tab:purple", "gloo": "tab:gray"}
    # torch local work: filled up-triangles; numpy (the extra rows): down-triangles.
    marker = "d" if q else "v" if system.endswith("-numpy") else "^"
    return peers.get(transport(system), "k"), marker


def write_plot(rows: Sequence[Row], path: Path) -> None:
    """Median latency per system and shape (min-max bars), log scale, memcpy floor as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {r.layout for r in rows}
    panels = [(layout, op) for layout in LAYOUTS if layout in present for op in OPS]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.2 * len(panels)), squeeze=False)
    for ax, (layout, op) in zip(axes[:, 0], panels, strict=True):
        sel = [r for r in rows if r.layout == layout and r.op == op]
        shapes = sorted({r.shape for r in sel}, key=lambda s: (s.routing, s.num_ranks,
                                                                s.tokens_per_rank, s.hidden))
        xs = {s: i for i, s in enumerate(shapes)}
        systems = [s for s in SYSTEM_ORDER if any(r.system == s for r in sel)]
        width = 0.8 / max(1, len(systems) - 1)
        for j, system in enumerate(s for s in systems if s != "memcpy"):
            pts = sorted((xs[r.shape], r.stats) for r in sel if r.system == system)
            x = np.array([p[0] for p in pts]) - 0.4 + (j + 0.5) * width
            med = np.array([p[1].median_us for p in pts])
            err = [med - [p[1].min_us for p in pts], [p[1].max_us for p in pts] - med]
            color, marker = _style(system)
            ax.errorbar(x, med, yerr=err, fmt=marker, ms=4, capsize=2, label=system,
                        color=color)
        floor = sorted((xs[r.shape], r.stats.median_us) for r in sel if r.system == "memcpy")
        if floor:
            fx = np.array([f[0] for f in floor], dtype=float)
            fy = np.array([f[1] for f in floor])
            ax.hlines(fy, fx - 0.45, fx + 0.45, colors="k", linewidth=2, label="memcpy floor")
        ax.set_yscale("log")
        ax.set_xticks(range(len(shapes)), [s.label for s in shapes], rotation=20, ha="right",
                      fontsize=8)
        ax.set_ylabel("latency, us (median, min-max)")
        ax.set_title(f"{op}, layout={layout}")
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # off the data
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


