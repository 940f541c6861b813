"""Token scheduling: Plan, the baselines and the hierarchical scheduler, quaternary search,
objective (1), MILP optimum.

* :func:`schedule` turns one rank's ``topk_idx`` into a :class:`Plan` with policy
  ``expert_contiguous`` (CANN-EP baseline), ``balanced`` (UBEP w/o mapping) or ``hierarchical``
  (UBEP: equal loads and equal hop mix on every core).
* :func:`quaternary_search` / :func:`quaternary_search_many`: the paper's Algorithm 1.
* :func:`objective_ns` / :func:`core_times_ns`: objective (1) of a plan.
* :func:`optimal`: exact optimum of (1) by MILP (scipy / HiGHS).
* :func:`partition` / :func:`partition_sweep`: Appendix A's count/send core split.
* :func:`combine_plans`: every rank's combine plan, the dispatch plans reversed.
"""

from ..modes import LAYOUTS, POLICIES
from .combine import combine_plans
from .cost import core_times_ns, hop_costs_ns, objective_ns
from .hierarchical import HierarchicalSlices, hierarchical_slices, hop_quotas, remapped_expert_order
from .optimal import OptimalResult, optimal, optimal_classes, optimal_units
from .partition import CorePartition, PartitionSweep, partition, partition_sweep
from .plan import CoreSplit, Plan, ScheduleSpec
from .policies import core_split, schedule, schedule_spec
from .search import SearchResult, prefix_from_expert_list, quaternary_search, quaternary_search_many
from .units import SendUnits, hop_row, send_units

__all__ = [
    "LAYOUTS",
    "POLICIES",
    "CorePartition",
    "CoreSplit",
    "HierarchicalSlices",
    "OptimalResult",
    "PartitionSweep",
    "Plan",
    "ScheduleSpec",
    "SearchResult",
    "SendUnits",
    "combine_plans",
    "core_split",
    "core_times_ns",
    "hierarchical_slices",
    "hop_costs_ns",
    "hop_quotas",
    "hop_row",
    "objective_ns",
    "optimal",
    "optimal_classes",
    "optimal_units",
    "partition",
    "partition_sweep",
    "prefix_from_expert_list",
    "quaternary_search",
    "quaternary_search_many",
    "remapped_expert_order",
    "schedule",
    "schedule_spec",
    "send_units",
]
