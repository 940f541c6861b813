"""Simulator check for the peers benchmark: ``ubep.sim`` with ``topology.host()`` predicts the
ubep rows just measured; prints predicted vs measured and the relative error.

Until ``ubep.sim`` offers a prediction entry point this prints why it could not compare.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

__all__ = ["sim_report"]


def sim_report(rows: Sequence[Any]) -> str:
    """A table of predicted vs measured ubep medians, or the reason there is none."""
    try:
        importlib.import_module("ubep.sim")
    except ImportError as exc:
        return f"simulator: not available ({exc})"
    ubep_rows = [r for r in rows if str(r.system).startswith("ubep-")]
    if not ubep_rows:
        return "simulator: no ubep rows measured, nothing to predict"
    return "simulator: ubep.sim has no prediction entry point yet"
