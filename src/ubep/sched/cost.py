"""Objective (1) of the paper: the completion time of a rank's slowest send core.

Model. Unit ``i`` of hop class ``h`` costs
``l_i = token_bytes / bandwidth_gbps[h] + issue_ns + latency_exposure * latency_ns[h]`` to issue
(bytes / (GB/s) = ns) and completes ``RTT_i = 2 * latency_ns[h]`` later. ``latency_exposure`` is
the share of a unit's one-way latency its core waits before it can issue the next one (bounded
outstanding stores on a load/store fabric); with the default 0 the transfer term is
hop-independent and only the RTT term sees the topology, which is the paper's reading of (1).
``ubep.sim`` fits ``issue_ns`` and ``latency_exposure`` per fabric from docs/CALIBRATION.md. A
core ``j`` with unit set ``M_j`` finishes at::

    T_j = sum_{i in M_j} l_i + max_{i in M_j} RTT_i          (0 for an empty core)

and objective (1) is ``max_j T_j``. This is order-free: it charges the slowest RTT after the last
issue. ``ordered=True`` instead charges each unit its own RTT after its own issue time,
``T_j = max_i (S_i + RTT_i)`` with ``S_i`` the issue time up to and including ``i`` in the core's
issue order; it is never larger than (1) and is what farthest-hop-first issue minimises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidArgumentError
from ..topology import Topology
from .plan import Plan

__all__ = ["core_times_ns", "hop_costs_ns", "objective_ns"]

if TYPE_CHECKING:  # typing's Required and Unpack are 3.11's; the checker alone reads them
    from typing import Required, TypedDict, Unpack

    class CoreCost(TypedDict, total=False):
        """The keyword arguments of :func:`core_times_ns` after the plan and the topology."""

        token_bytes: Required[float]
        issue_ns: float
        latency_exposure: float
        ordered: bool


def hop_costs_ns(
    topology: Topology,
    *,
    token_bytes: float,
    issue_ns: float = 0.0,
    latency_exposure: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """``(l_ns [H], rtt_ns [H])`` per hop class for units of ``token_bytes`` bytes."""
    if not isinstance(token_bytes, (int, float, np.number)) or not token_bytes > 0:
        raise InvalidArgumentError("token_bytes", token_bytes, "must be a number > 0")
    if not isinstance(issue_ns, (int, float, np.number)) or not issue_ns >= 0:
        raise InvalidArgumentError("issue_ns", issue_ns, "must be a number >= 0")
    if not isinstance(latency_exposure, (int, float, np.number)) or not (
        0.0 <= latency_exposure <= 1.0
    ):
        raise InvalidArgumentError("latency_exposure", latency_exposure, "must be in [0, 1]")
    bw = np.asarray(topology.bandwidth_gbps, dtype=np.float64)
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    l_ns = float(token_bytes) / bw + float(issue_ns) + float(latency_exposure) * lat
    rtt_ns = 2.0 * lat
    return l_ns, rtt_ns


def core_times_ns(
    plan: Plan,
    topology: Topology,
    *,
    token_bytes: float,
    issue_ns: float = 0.0,
    latency_exposure: float = 0.0,
    ordered: bool = False,
) -> np.ndarray:
    """``[num_send_cores]`` completion time of every send core (see module docstring)."""
    if not isinstance(plan, Plan):
        raise InvalidArgumentError("plan", type(plan).__name__, "must be a ubep.sched.Plan")
    if plan.num_ranks != topology.num_ranks:
        raise InvalidArgumentError(
            "topology", topology.num_ranks, f"plan was made for {plan.num_ranks} ranks"
        )
    if plan.num_units and int(plan.send_hop.max()) >= topology.num_hops:
        raise InvalidArgumentError("topology", topology.num_hops, "has fewer hop classes than plan")
    l_ns, rtt_ns = hop_costs_ns(
        topology, token_bytes=token_bytes, issue_ns=issue_ns, latency_exposure=latency_exposure
    )
    n = plan.num_send_cores
    out = np.zeros(n)
    if plan.num_units == 0:
        return out
    core = plan.send_core.astype(np.int64)
    l_i = l_ns[plan.send_hop]
    rtt_i = rtt_ns[plan.send_hop]
    if ordered:
        # Issue time S_i = cumulative l inside the core: global cumsum minus the core's start.
        cum = np.cumsum(l_i)
        before_core = np.concatenate(([0.0], cum))[plan.core_ptr[:-1]]
        np.maximum.at(out, core, cum - before_core[core] + rtt_i)
        return out
    np.maximum.at(out, core, rtt_i)
    return out + np.bincount(core, weights=l_i, minlength=n)


def objective_ns(plan: Plan, topology: Topology, **cost: Unpack[CoreCost]) -> float:
    """Objective (1): ``max_j T_j`` over the plan's send cores; ``cost`` as for
    :func:`core_times_ns` (``ordered``: see module doc)."""
    times = core_times_ns(plan, topology, **cost)
    return float(times.max()) if times.size else 0.0
