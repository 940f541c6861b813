"""The routing and checksum AIVs of an ASP rank: their work, timed (docs/SIMULATOR.md 1.6).

At large rank counts an ASP rank gives ``aux`` of its cores (:func:`ubep.sim.workload.aux_cores`)
to preprocessing that the baseline runs between its global barriers and UBEP pipelines with
the data path: routing (for each of the ``R`` destination ranks, which of the rank's ``T K``
picks go there: one vector count over the picks per destination, the TokenCnt instruction's
cost) and the global checksum (a vector sum over the ``R L`` count words the rank receives,
at the prefix sum's cost per entry, which cannot end before the last count word has arrived).
Both grow with the rank count; the ``aux`` cores share them evenly. They take cores from
sending (the plan's core split) and add AIV time (:meth:`SimResult.aiv_sum_ns`); they do not
delay the data path, which they run beside.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import InvalidArgumentError
from .fabric import FabricModel
from .timeline import TASKS, SimResult, TaskTimeline

__all__ = ["preprocess_ns", "with_preprocess"]


def preprocess_ns(fabric: FabricModel, *, num_ranks: int, num_local_experts: int,
                  picks: int) -> tuple[float, float]:
    """``(route_ns, checksum_ns)``: one rank's routing and checksum work, before it is shared
    by the aux cores: ``R (count_expert_ns + picks count_pick_ns)`` and ``R L
    cumsum_entry_ns``."""
    if num_ranks < 1 or num_local_experts < 1 or picks < 0:
        raise InvalidArgumentError("num_ranks", (num_ranks, num_local_experts, picks),
                                   "ranks and local experts must be >= 1, picks >= 0")
    route = num_ranks * (fabric.count_expert_ns + picks * fabric.count_pick_ns)
    checksum = num_ranks * num_local_experts * fabric.cumsum_entry_ns
    return float(route), float(checksum)


def with_preprocess(result: SimResult, fabric: FabricModel, *, aux_cores: int, first_core: int,
                    num_local_experts: int, picks: int) -> SimResult:
    """``result`` with the routing and checksum tasks of ``aux_cores`` cores per rank,
    physical cores ``[first_core, first_core + aux_cores)``: after Init, each routes its share
    of the destinations, then sums its share of the count words, ending no earlier than the
    last count word's check on its rank (the count cores' last ``verify``)."""
    if aux_cores <= 0:
        return result
    tl = result.timeline
    num_ranks = int(result.rank_end_ns.size)
    route, checksum = preprocess_ns(fabric, num_ranks=num_ranks,
                                    num_local_experts=num_local_experts, picks=picks)
    verify_end = np.zeros(num_ranks)
    m = tl.task == TASKS.index("verify")
    np.maximum.at(verify_end, tl.rank[m], tl.end_ns[m])
    ranks = np.repeat(np.arange(num_ranks), aux_cores)
    cores = np.tile(np.arange(first_core, first_core + aux_cores), num_ranks)
    init_end = np.full(ranks.size, float(fabric.init_ns))
    route_end = init_end + route / aux_cores
    check_end = np.maximum(route_end + checksum / aux_cores, verify_end[ranks])
    parts = [(TASKS[t], tl.rank[tl.task == t], tl.core[tl.task == t],
              tl.start_ns[tl.task == t], tl.end_ns[tl.task == t])
             for t in np.unique(tl.task)]
    parts += [("init", ranks, cores, np.zeros(ranks.size), init_end),
              ("route", ranks, cores, init_end, route_end),
              ("checksum", ranks, cores, route_end, check_end)]
    return replace(result, timeline=TaskTimeline.build(parts))
