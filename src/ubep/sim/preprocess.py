"""The routing and checksum AIVs of an ASP rank: their work, timed (docs/SIMULATOR.md 1.6).

At large rank counts an ASP rank gives ``aux`` of its cores (:func:`ubep.sim.workload.aux_cores`)
to preprocessing that the baseline runs between its global barriers and UBEP pipelines with
the data path: routing (for each of the ``R`` destination ranks, which of the rank's ``T K``
picks go there: one vector count over the picks per destination, the TokenCnt instruction's
cost) and the global checksum over the ``R L`` count words the rank receives. The checksum is
pipelined: the aux cores poll the count words themselves as they land, in the count cores'
static order and at their cost (``poll_ns`` per poll of ``poll_lanes`` words), word ``e`` on
aux core ``e mod aux``, and then sum their share (the prefix sum's cost per entry). So an aux
core ends when the last source's count words it checks have arrived plus its own share of the
``R L`` checks, not when the count cores have verified them. Both parts grow with the rank
count; the ``aux`` cores share them evenly. They take cores from sending (the plan's core
split) and add AIV time (:meth:`SimResult.aiv_sum_ns`); they do not delay the data path, which
they run beside.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import InvalidArgumentError
from ..topology import Topology
from .analytic import chunk_entries, poll_scan
from .fabric import FabricModel
from .timeline import TASKS, SimResult, TaskTimeline

__all__ = ["preprocess_ns", "with_preprocess"]


def preprocess_ns(fabric: FabricModel, *, num_ranks: int, num_local_experts: int,
                  picks: int) -> tuple[float, float]:
    """``(route_ns, checksum_ns)``: one rank's routing and checksum-summing work, before it is
    shared by the aux cores: ``R (count_expert_ns + picks count_pick_ns)`` and ``R L
    cumsum_entry_ns`` (the polls of the count words are timed by :func:`with_preprocess`)."""
    if num_ranks < 1 or num_local_experts < 1 or picks < 0:
        raise InvalidArgumentError("num_ranks", (num_ranks, num_local_experts, picks),
                                   "ranks and local experts must be >= 1, picks >= 0")
    route = num_ranks * (fabric.count_expert_ns + picks * fabric.count_pick_ns)
    checksum = num_ranks * num_local_experts * fabric.cumsum_entry_ns
    return float(route), float(checksum)


def with_preprocess(result: SimResult, fabric: FabricModel, topology: Topology, *,
                    aux_cores: int, first_core: int, num_local_experts: int,
                    picks: int) -> SimResult:
    """``result`` with the routing and checksum tasks of ``aux_cores`` cores per rank,
    physical cores ``[first_core, first_core + aux_cores)``: after Init, each routes its share
    of the destinations, then polls its share of the rank's count words as they land (a
    stop-and-wait scan, ``v = max(v, last land of the poll's words) + poll_ns``), then sums
    them (``R L cumsum_entry_ns / aux``)."""
    if aux_cores <= 0:
        return result
    spec = result.spec
    if spec is None or spec.engine != "asp":
        raise InvalidArgumentError("result", None, "needs the spec of an ASP simulation")
    tl = result.timeline
    num_ranks = int(result.rank_end_ns.size)
    route, checksum = preprocess_ns(fabric, num_ranks=num_ranks,
                                    num_local_experts=num_local_experts, picks=picks)
    ranks = np.repeat(np.arange(num_ranks), aux_cores)
    cores = np.tile(np.arange(first_core, first_core + aux_cores), num_ranks)
    init_end = np.full(ranks.size, float(fabric.init_ns))
    route_end = init_end + route / aux_cores
    # The count words land as the executors time them (the count phase starts after Init);
    # the aux cores scan them as the count cores do, on their own cores.
    aux_spec = replace(spec, poll_first=first_core, poll_cores=aux_cores)
    recv, poll, land = chunk_entries(aux_spec, topology,
                                     np.full(num_ranks, float(fabric.init_ns)))
    start = np.zeros((num_ranks, spec.cores_per_rank))
    start[ranks, cores] = route_end
    polled = poll_scan(aux_spec, recv, poll, land, start, fabric.poll_ns, fabric.poll_lanes)
    check_end = polled[ranks, cores] + checksum / aux_cores
    parts = [(TASKS[t], tl.rank[tl.task == t], tl.core[tl.task == t],
              tl.start_ns[tl.task == t], tl.end_ns[tl.task == t])
             for t in np.unique(tl.task)]
    parts += [("init", ranks, cores, np.zeros(ranks.size), init_end),
              ("route", ranks, cores, init_end, route_end),
              ("checksum", ranks, cores, route_end, check_end)]
    return replace(result, timeline=TaskTimeline.build(parts))
