"""``ubep trace plot``'s time axes: a measured and a predicted panel each get their own, panels
of one source share one (the extents are computed here from the spans, the oracle)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ubep.trace import Span, Trace
from ubep.trace.plot import plot_traces, time_axes_us


def _trace(source: str, label: str, spans: list[tuple[int, int, float, float]]) -> Trace:
    return Trace(source, label, tuple(Span(rank=r, core=c, task="send", start_ns=s, end_ns=e)
                                      for r, c, s, e in spans))


MEASURED_A = _trace("runtime", "asp", [(0, 0, 5_000.0, 900_000.0), (1, 0, 6_000.0, 20_000.0)])
MEASURED_B = _trace("runtime", "bsp", [(0, 0, 0.0, 400_000.0)])
PREDICTED = _trace("sim", "cm384", [(0, 0, 100.0, 2_100.0), (0, 1, 300.0, 1_100.0)])


def test_measured_and_predicted_panels_get_their_own_time_axis() -> None:
    axes = time_axes_us([MEASURED_A, PREDICTED, MEASURED_B])
    # measured: the longer of A (900 000 - 5 000 ns) and B (400 000 ns); predicted: its own
    assert axes == [895.0, 2.0, 895.0]
    assert time_axes_us([PREDICTED]) == [2.0]
    assert time_axes_us([MEASURED_A], ranks=[1]) == [14.0]  # only the rows drawn count


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="no matplotlib")
def test_the_plot_draws_each_panel_on_its_axis(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    seen: list[tuple[float, float]] = []
    save = plt.Figure.savefig

    def spy(fig: plt.Figure, *args: object, **kw: object) -> None:
        seen.extend(ax.get_xlim() for ax in fig.axes)
        save(fig, *args, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    out = plot_traces([MEASURED_A, PREDICTED], tmp_path / "t.png")
    assert out.stat().st_size > 0
    assert seen[0][1] == pytest.approx(895.0 * 1.02) and seen[1][1] == pytest.approx(2.0 * 1.02)
