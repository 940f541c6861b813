"""Moved: combine plans are scheduling, so they live in :mod:`ubep.sched.combine` (this name
stays importable)."""

from ..sched.combine import combine_plans

__all__ = ["combine_plans"]
