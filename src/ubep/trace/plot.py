"""Per-core bars of one or more traces side by side (the paper's Figures 8 and 9 as pictures):
a row per (rank, core), a bar per task coloured by kind, time in microseconds. Panels of one
source (measured beside measured, ASP beside BSP) share a time axis so the eye compares lengths;
a measured and a predicted panel each get their own (a host call and a superpod prediction are
orders of magnitude apart: on one axis the shorter is a sliver)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import InvalidArgumentError
from .spans import TASK_KINDS, Trace

__all__ = ["plot_traces", "time_axes_us"]

_COLOURS = dict(zip(TASK_KINDS, (
    "#bbbbbb", "#4477aa", "#66ccee", "#aa3377", "#228833", "#ccbb44", "#ee6677", "#000000",
    "#ee7733", "#0077bb", "#999933", "#882255", "#44aa99", "#dddddd"), strict=True))


def _rows(trace: Trace, ranks: Sequence[int] | None, max_cores: int) -> list[tuple[int, int]]:
    return [key for key in trace.by_core() if ranks is None or key[0] in ranks][:max_cores]


def _extent_us(trace: Trace, rows: list[tuple[int, int]]) -> float:
    """From the first task's start to the last task's end over ``rows``, in microseconds."""
    spans = trace.by_core()
    starts = [s.start_ns for key in rows for s in spans[key]]
    ends = [s.end_ns for key in rows for s in spans[key]]
    return (max(ends) - min(starts)) / 1e3 if starts else 0.0


def time_axes_us(traces: Sequence[Trace], *, ranks: Sequence[int] | None = None,
                 max_cores: int = 64) -> list[float]:
    """Each panel's time axis length in microseconds: the longest extent among the panels of
    its source (``"runtime"``, measured; anything else, predicted)."""
    extents = [_extent_us(t, _rows(t, ranks, max_cores)) for t in traces]
    longest: dict[str, float] = {}
    for trace, extent in zip(traces, extents, strict=True):
        longest[trace.source] = max(longest.get(trace.source, 0.0), extent)
    return [longest[t.source] for t in traces]


def plot_traces(traces: Sequence[Trace], out: str | Path, *, ranks: Sequence[int] | None = None,
                max_cores: int = 64, title: str | None = None) -> Path:
    """Draw ``traces`` (one panel each) to ``out`` (PNG); ``ranks``: the ranks to show (default:
    every rank, up to ``max_cores`` rows a panel, first ranks first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not traces:
        raise InvalidArgumentError("traces", [], "needs at least one trace")
    fig, axes = plt.subplots(1, len(traces), figsize=(6.5 * len(traces), 4.8), squeeze=False)
    used: set[str] = set()
    limits = time_axes_us(traces, ranks=ranks, max_cores=max_cores)
    for ax, trace, limit in zip(axes[0], traces, limits, strict=True):
        rows = _rows(trace, ranks, max_cores)
        spans = trace.by_core()
        origin = min((s.start_ns for key in rows for s in spans[key]), default=0.0)
        for y, key in enumerate(rows):
            bars: dict[str, list[tuple[float, float]]] = {}  # one call per (row, kind): a
            for s in spans[key]:  # measured dispatch has a span per row sent
                bars.setdefault(s.task, []).append(((s.start_ns - origin) / 1e3,
                                                    (s.end_ns - s.start_ns) / 1e3))
            for task, xs in bars.items():
                ax.broken_barh(xs, (y - 0.4, 0.8), color=_COLOURS[task], linewidth=0)
                used.add(task)
        ax.set_yticks(range(len(rows)), [f"r{r} c{c}" for r, c in rows],
                      fontsize=max(4, 9 - len(rows) // 12))
        ax.invert_yaxis()
        ax.set_xlim(0.0, limit * 1.02 or 1.0)
        ax.set_xlabel("time since the first task (us)")
        ax.set_title(f"{trace.label} ({'measured' if trace.source == 'runtime' else 'predicted'})",
                     fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLOURS[t]) for t in TASK_KINDS if t in used]
    fig.legend(handles, [t for t in TASK_KINDS if t in used], loc="lower center",
               ncol=min(len(handles), 8), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    target = Path(out)
    fig.savefig(target, dpi=130)
    plt.close(fig)
    return target
