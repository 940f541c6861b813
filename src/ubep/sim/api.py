"""One call from routing to a timed operator: build every rank's plan, then run an executor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..expert_map import ExpertMap
from ..sched.plan import Plan
from ..topology import Topology
from .analytic import run_analytic
from .events import run_events
from .fabric import FabricModel
from .replicas import physical_topk
from .spec import build_spec
from .timeline import SimResult

__all__ = ["MODES", "make_plans", "simulate"]

MODES = ("analytic", "events")


def make_plans(
    topk_per_rank: Sequence[np.ndarray],
    topology: Topology,
    *,
    num_experts: int,
    policy: str,
    num_send_cores: int | None = None,
    num_count_cores: int | None = None,
    layout: str = "expert",
    expert_map: ExpertMap | None = None,
    masked_ranks: Sequence[int] = (),
) -> list[Plan]:
    """``ubep.sched.schedule`` for every rank (``topk_per_rank[r]`` is rank r's ``topk_idx``).

    With ``expert_map`` (redundant experts) ``topk_per_rank`` holds logical ids and
    ``num_experts`` is the physical slot count: each pick goes to one live replica by
    ``ubep.expert_map``'s rule before planning; ``masked_ranks`` send nothing and receive
    nothing (their experts' picks go to replicas, or are dropped without one)."""
    from ..sched.policies import schedule

    if len(topk_per_rank) != topology.num_ranks:
        raise InvalidArgumentError(
            "topk_per_rank", len(topk_per_rank), f"needs {topology.num_ranks} arrays (one per rank)"
        )
    topk_per_rank = physical_topk(topk_per_rank, topology, num_experts=num_experts,
                                  expert_map=expert_map, masked_ranks=masked_ranks)
    return [
        schedule(idx, topology, rank=r, num_experts=num_experts, policy=policy,
                 num_send_cores=num_send_cores, num_count_cores=num_count_cores, layout=layout)
        for r, idx in enumerate(topk_per_rank)
    ]


def simulate(
    plans: Sequence[Plan],
    topology: Topology,
    fabric: FabricModel,
    *,
    engine: str,
    sync: str,
    row_bytes: int,
    op: str = "dispatch",
    mode: str = "analytic",
) -> SimResult:
    """Time one operator call of every rank's ``plans`` on ``topology`` with ``fabric``."""
    if mode not in MODES:
        raise InvalidArgumentError("mode", mode, f"must be one of {MODES}")
    spec = build_spec(plans, topology, fabric, engine=engine, sync=sync, row_bytes=row_bytes, op=op)
    runner = run_analytic if mode == "analytic" else run_events
    return runner(spec, topology, fabric)
