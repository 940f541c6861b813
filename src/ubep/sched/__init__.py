"""Token scheduling: Plan, the three policies, quaternary search, objective (1), MILP optimum."""

from .plan import LAYOUTS, POLICIES, Plan

__all__ = ["LAYOUTS", "POLICIES", "Plan"]
