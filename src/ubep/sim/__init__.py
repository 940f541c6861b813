"""Superpod simulator: time the Plan that ``ubep.sched`` produces on a modelled fabric.

See docs/SIMULATOR.md for the model and its calibration.
"""

from .api import MODES, make_plans, simulate
from .fabric import FAMILIES, FabricModel, Family, SyncCosts, sync_costs
from .spec import OpSpec, Transfers, build_spec, transfers
from .timeline import TASKS, SimResult, TaskSpan, TaskTimeline

__all__ = [
    "FAMILIES",
    "MODES",
    "TASKS",
    "FabricModel",
    "Family",
    "OpSpec",
    "SimResult",
    "SyncCosts",
    "TaskSpan",
    "TaskTimeline",
    "Transfers",
    "build_spec",
    "make_plans",
    "simulate",
    "sync_costs",
    "transfers",
]
