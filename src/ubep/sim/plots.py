"""PNG figures of the experiments (matplotlib, Agg backend, imported only when plotting)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .experiments import ExperimentResult
from .m2n import draw as m2n_draw
from .syncs import SYNC_MODES

__all__ = ["plot", "save"]

TASK_COLORS = {"init": "#bbbbbb", "send": "#1f77b4", "barrier": "#d62728", "flag": "#ff7f0e",
               "verify": "#9467bd", "count": "#8c564b", "cumsum": "#e377c2",
               "consume": "#2ca02c", "route": "#17becf", "checksum": "#bcbd22"}
SYNC_COLORS = {name: mode.colour for name, mode in SYNC_MODES.items()}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: ExperimentResult, path: str | Path) -> Path:
    """Write ``result``'s figure to ``path`` (PNG) and return the path."""
    drawers = {"table4": _table4, "fig7": _fig7, "fig8": _fig8, "fig9": _fig9,
               "fig10": _fig10, "fig11": _tpot, "fig12": _fig7, "fig13": _topk,
               "fig14": _partition, "hotshare": _hotshare, "m2n": m2n_draw}
    if result.name not in drawers:
        raise InvalidArgumentError("result", result.name, f"no plot for {result.name}")
    plt = _pyplot()
    fig = drawers[result.name](plt, result)
    fig.suptitle(result.title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1) if result.name == "fig8" else (0, 0, 1, 1))
    return save(plt, fig, path, dpi=80)


def save(plt: Any, fig: Any, path: str | Path, *, dpi: int) -> Path:
    """Write ``fig`` (laid out) to ``path`` (PNG, its folder made), close it; the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def _col(result: ExperimentResult, name: str) -> list[Any]:
    i = result.columns.index(name)
    return [row[i] for row in result.rows]


def _table4(plt: Any, r: ExperimentResult) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    eps = _col(r, "ep")
    x = np.arange(len(eps))
    paper = [v if isinstance(v, float) else np.nan for v in _col(r, "cann_paper_us")]
    a.bar(x - 0.27, paper, 0.27, label="CANN EP (paper)", color="#999999")
    a.bar(x, _col(r, "cann_model_us"), 0.27, label="CANN EP (model)", color="#d62728")
    ub = np.array(_col(r, "ubep_pred_us"), dtype=float)
    err = [ub - np.array(_col(r, "ubep_lo_us"), dtype=float),
           np.array(_col(r, "ubep_hi_us"), dtype=float) - ub]
    a.bar(x + 0.27, ub, 0.27, yerr=err, capsize=3, label="UBEP (predicted, interval)",
          color="#2ca02c")
    a.set_xticks(x, [str(e) for e in eps])
    a.set_xlabel("EP ranks")
    a.set_ylabel("dispatch latency (us)")
    a.legend(fontsize=7)
    b.plot(eps, _col(r, "cann_gbps"), "o-", color="#d62728", label="CANN EP (model)")
    b.plot(eps, _col(r, "ubep_gbps"), "s-", color="#2ca02c", label="UBEP (predicted)")
    b.fill_between(eps, [7.34e6 / (v * 1e3) for v in _col(r, "ubep_hi_us")],
                   [7.34e6 / (v * 1e3) for v in _col(r, "ubep_lo_us")], color="#2ca02c",
                   alpha=0.25, label="UBEP interval")
    b.set_xscale("log", base=2)
    b.set_xlabel("EP ranks")
    b.set_ylabel("bandwidth (GB/s per rank)")
    b.legend(fontsize=7)
    return fig


def _fig7(plt: Any, r: ExperimentResult) -> Any:
    panels: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in r.rows:
        panels[row[0]].append(row)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.4))
    for ax, (panel, rows) in zip(np.atleast_1d(axes), panels.items(), strict=True):
        xs = sorted({row[1] for row in rows})
        systems = sorted({row[2] for row in rows})
        width = 0.8 / len(systems)
        for i, sname in enumerate(systems):
            got = {row[1]: row for row in rows if row[2] == sname}
            pos = np.arange(len(xs)) + (i - (len(systems) - 1) / 2) * width
            # columns: experiments.SPLIT_COLUMNS (the per-AIV time, summed over the AIVs)
            a2a = [got[x][7] for x in xs]
            sync = [got[x][8] for x in xs]
            aiv = np.array([got[x][4] for x in xs], dtype=float)
            err = [aiv - np.array([got[x][5] for x in xs]), np.array([got[x][6] for x in xs])
                   - aiv]
            ax.bar(pos, a2a, width, color="#1f77b4" if i == 0 else "#2ca02c",
                   label=f"{sname} all-to-all")
            ax.bar(pos, sync, width, bottom=a2a, color="#d62728" if i == 0 else "#ff7f0e",
                   label=f"{sname} sync", alpha=0.8, yerr=err, capsize=2)
        ax.set_xticks(np.arange(len(xs)), [str(x) for x in xs])
        ax.set_title(panel, fontsize=8)
        ax.set_ylabel("per-AIV time, sum over the AIVs (us)")
    np.atleast_1d(axes)[0].legend(fontsize=6)
    return fig


def _fig8(plt: Any, r: ExperimentResult) -> Any:
    gantt = r.data["gantt"]
    keys = list(gantt)
    systems = sorted({k.split("|")[0] for k in keys})
    batches = sorted({int(k.split("|")[1]) for k in keys})
    fig, axes = plt.subplots(len(systems), len(batches), figsize=(3.3 * len(batches), 5.2),
                             sharex=True)
    axes = np.atleast_2d(axes)
    for i, sname in enumerate(systems):
        for j, batch in enumerate(batches):
            ax = axes[i, j]
            g = gantt[f"{sname}|{batch}"]
            for core, task, s, e in zip(g["core"], g["task"], g["start_us"], g["end_us"],
                                        strict=True):
                ax.barh(core, e - s, left=s, height=0.9, color=TASK_COLORS[task], linewidth=0)
            ax.set_title(f"{sname}, batch {batch}", fontsize=8)
            ax.set_ylabel("core")
            ax.set_xlabel("time (us)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in TASK_COLORS.values()]
    fig.legend(handles, list(TASK_COLORS), fontsize=7, loc="lower center",
               ncol=len(TASK_COLORS))
    fig.subplots_adjust(bottom=0.16)
    return fig


def _fig9(plt: Any, r: ExperimentResult) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"cann_ep": "#d62728", "balanced": "#ff7f0e", "hierarchical": "#2ca02c"}
    names = r.data["names"]
    for key, lat in r.data["slowest_rank_core_profile_us"].items():
        a.plot(np.arange(len(lat)), lat, ".-", color=colors[key], label=names[key])
    a.set_xlabel("send core of the slowest rank, slowest first")
    a.set_ylabel("per-AIV token-send latency (us)")
    a.set_title("k-th slowest core: median over the hot-expert placements\n"
                "(its first point is the table's max_core_us)", fontsize=7)
    a.legend(fontsize=7)
    keys = list(r.data["max_core_latency_us"])
    x = np.arange(len(keys))
    reads = r.data["max_core_readings_us"]
    b.bar(x - 0.2, [r.data["max_core_latency_us"][k] for k in keys], 0.4,
          color=[colors[k] for k in keys], label="program (1) + receivers' wait (fitted)")
    b.bar(x + 0.2, [reads[k]["ack"] for k in keys], 0.4, color=[colors[k] for k in keys],
          alpha=0.45, hatch="//", label="until acknowledged")
    b.set_xticks(x, [names[k] for k in keys], fontsize=7)
    b.set_ylabel("max per-AIV latency (us), median")
    b.legend(fontsize=6, loc="upper right")
    bal, hier = reads["balanced"], reads["hierarchical"]
    side = ("below" if r.data["max_core_latency_us"]["hierarchical"]
            < r.data["max_core_latency_us"]["balanced"] else "not below")
    b.set_title(f"UBEP {side} w/o mapping. Program (1), its cores' even hop mixes: "
                f"{hier['program1']:.1f} vs {bal['program1']:.1f} us;\nlargest mean wait of "
                f"a core's rows at the receivers: {hier['rx_wait']:.1f} vs "
                f"{bal['rx_wait']:.1f} us.\nUntil acknowledged, the hottest receiver's "
                "drain ends every core: no mapping lowers it.", fontsize=6)
    fig.tight_layout()
    return fig


def _fig10(plt: Any, r: ExperimentResult) -> Any:
    def draw(ax: Any, n: int) -> None:
        for sync, color in SYNC_COLORS.items():
            pts = [row for row in r.rows if row[0] == n and row[2] == sync]
            ax.plot([p[1] for p in pts], [p[3] for p in pts], "o-", color=color,
                    label=sync.upper(), ms=3)
            ax.fill_between([p[1] for p in pts], [p[4] for p in pts], [p[5] for p in pts],
                            color=color, alpha=0.2)

    return _rank_panels(plt, r, draw, base=10, sharey=True,
                        xlabel="data size (bytes per message)",
                        ylabel="transfer + sync latency (us)")


def _rank_panels(plt: Any, r: ExperimentResult, draw: Any, *, base: int, sharey: bool,
                 xlabel: str, ylabel: str) -> Any:
    """One panel per rank count (column ``ranks``), ``draw(ax, ranks)`` filling each, on a
    log x axis; the first panel carries the y label and the legend."""
    ranks = sorted(set(_col(r, "ranks")))
    fig, axes = plt.subplots(1, len(ranks), figsize=(3.3 * len(ranks), 3.3), sharey=sharey)
    for ax, n in zip(np.atleast_1d(axes), ranks, strict=True):
        draw(ax, n)
        ax.set_xscale("log", base=base)
        ax.set_xlabel(xlabel)
        ax.set_title(f"{n} ranks", fontsize=8)
    np.atleast_1d(axes)[0].set_ylabel(ylabel)
    np.atleast_1d(axes)[0].legend(fontsize=7)
    return fig


def _topk(plt: Any, r: ExperimentResult) -> Any:
    fig, ax = plt.subplots(figsize=(5, 3.3))
    labels = [f"EP{row[0]}/k{row[2]}" for row in r.rows]
    x = np.arange(len(labels))
    ub = np.array(_col(r, "ubep_us"), dtype=float)
    err = [ub - np.array(_col(r, "ubep_lo_us"), dtype=float),
           np.array(_col(r, "ubep_hi_us"), dtype=float) - ub]
    ax.bar(x - 0.2, _col(r, "cann_us"), 0.4, color="#d62728", label="CANN EP (model)")
    ax.bar(x + 0.2, ub, 0.4, yerr=err, capsize=2, color="#2ca02c",
           label="UBEP (predicted, interval)")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("dispatch latency (us)")
    ax.legend(fontsize=7)
    return fig


def _partition(plt: Any, r: ExperimentResult) -> Any:
    def draw(ax: Any, n: int) -> None:
        for batch in sorted({row[1] for row in r.rows if row[0] == n}):
            pts = [row for row in r.rows if row[0] == n and row[1] == batch]
            ax.plot([p[2] for p in pts], [p[4] for p in pts], "o-", ms=3, label=f"batch {batch}")
            for p in pts:
                if p[5]:
                    ax.plot(p[2], p[4], "k*", ms=9)

    return _rank_panels(plt, r, draw, base=2, sharey=False,
                        xlabel="count cores (* = Appendix A pick)",
                        ylabel="extra latency over the best size (us)")


def _tpot(plt: Any, r: ExperimentResult) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.3))
    labels = [f"{row[0]}\nEP{row[1]}" for row in r.rows]
    x = np.arange(len(labels))
    hi_s, lo_s = r.columns[7], r.columns[9]
    mid = np.array(_col(r, hi_s), dtype=float)
    band = [tuple(float(v) for v in s.split("-", 1)) if s.count("-") == 1 else (m, m)
            for s, m in zip(_col(r, r.columns[8]), mid, strict=True)]
    err = [mid - np.array([b[0] for b in band]), np.array([b[1] for b in band]) - mid]
    ax.bar(x - 0.2, mid, 0.4, yerr=err, capsize=3, color="#2ca02c", label=hi_s)
    ax.bar(x + 0.2, _col(r, lo_s), 0.4, color="#98df8a", label=lo_s)
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("predicted TPOT reduction (%)")
    ax.legend(fontsize=7)
    return fig


def _hotshare(plt: Any, r: ExperimentResult) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.3))
    x = _col(r, "hot_share")
    a.plot(x, _col(r, "cann_us"), "o-", color="#d62728", label="CANN EP (model)")
    a.plot(x, _col(r, "ubep_us"), "s-", color="#2ca02c", label="UBEP (predicted)")
    a.fill_between(x, _col(r, "ubep_lo_us"), _col(r, "ubep_hi_us"), color="#2ca02c", alpha=0.25)
    a.set_xlabel("hot experts' share of picks (unstated in the paper)")
    a.set_ylabel("dispatch latency (us)")
    a.legend(fontsize=7)
    for key, color in (("fig9_cann_max_core_us", "#d62728"), ("fig9_nomap_max_core_us",
                                                                "#ff7f0e"),
                       ("fig9_ubep_max_core_us", "#2ca02c")):
        b.plot(x, _col(r, key), "o-", color=color, label=key.replace("_us", ""))
    b.set_xlabel("hot share")
    b.set_ylabel("max per-core send latency (us)")
    b.legend(fontsize=6)
    return fig
