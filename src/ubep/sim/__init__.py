"""Superpod simulator: time the Plan that ``ubep.sched`` produces on a modelled fabric.

See docs/SIMULATOR.md for the model and its calibration. The names below load on first use, so
that ``ubep.sim.presets`` (a fabric and its constants) loads without the executors.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "MODES": "api", "make_plans": "api", "simulate": "api",
    "FabricModel": "fabric", "SyncCosts": "fabric", "sync_costs": "fabric",
    "FAMILIES": "presets", "Family": "presets",
    "OpSpec": "spec", "Transfers": "spec", "build_spec": "spec", "transfers": "spec",
    "TASKS": "timeline", "SimResult": "timeline", "TaskSpan": "timeline",
    "TaskTimeline": "timeline",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ubep.sim' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
