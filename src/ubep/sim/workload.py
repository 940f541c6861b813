"""Workloads and systems: a call's routing and shape, and the engine/policy/sync that runs it.

``run_case(workload, system, topology, fabric)`` is what every experiment and the calibration
call: it draws each rank's seeded ``topk_idx``, plans every rank with ``ubep.sched.schedule``,
builds the combine plans when asked, and runs an executor. Routing and plans are cached (they do
not depend on the fabric constants), so a calibration fit re-times the same plans cheaply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal, get_args

import numpy as np

from ..errors import InvalidArgumentError
from ..expert_map import ExpertMap
from ..modes import ENGINES, LAYOUTS, SYNCS, Engine, Layout, Policy, Sync
from ..routing import hot_experts_topk, uniform_topk, zipf_topk
from ..sched.combine import combine_plans
from ..sched.plan import Plan
from ..topology import Topology
from .api import make_plans, simulate
from .fabric import FabricModel
from .preprocess import with_preprocess
from .syncs import SP, SW
from .timeline import SimResult

__all__ = [
    "CANN_EP",
    "FIG9_SEEDS",
    "ROUTINGS",
    "UBEP",
    "UBEP_NO_MAPPING",
    "System",
    "Workload",
    "appendix_a_split",
    "aux_cores",
    "clear_plans",
    "core_split",
    "hot_ids_for",
    "partition_constants",
    "plans_for",
    "routing_for",
    "run_case",
]

Routing = Literal["uniform", "zipf", "hot"]
# The paper does not say which 8 of Figure 9's 256 experts are hot. One seeded draw decides
# whether two hot experts share a receiving rank (its port drains twice the rows) or one CANN EP
# send core (expert_contiguous: twice the rows on that core), and the maximum over cores follows
# that accident: Figure 9's maxima are the median over these seeded placements.
FIG9_SEEDS: tuple[int, ...] = tuple(range(8))
ROUTINGS: tuple[Routing, ...] = get_args(Routing)


@dataclass(frozen=True)
class Workload:
    """One MoE layer call on every rank.

    Attributes:
        tokens_per_rank: tokens each rank dispatches (the batch size).
        hidden, itemsize: ``row_bytes = hidden * itemsize`` (1 = W8A8, 2 = BF16).
        num_topk: experts per token.
        experts_per_rank: ``num_experts = num_ranks * experts_per_rank``.
        routing: "uniform", "zipf" (``alpha``) or "hot" (``hot_experts`` get ``hot_share`` of
            the picks; the hot set is the same on every rank). ``hot_share=None``: the share
            the paper leaves unstated, taken from the fabric's calibration
            (``FabricModel.hot_share``, fitted to Figure 9) by :func:`run_case` and
            :func:`plans_for`.
        combine_itemsize: bytes per element of the combine payload (expert outputs, BF16).
        seed: base seed; rank ``r`` uses ``seed + r``.
        expert_map: redundant experts (``ubep.expert_map``): the routing draws logical ids
            ``[0, expert_map.num_logical)`` and each pick goes to one live replica among the
            ``num_ranks * experts_per_rank`` physical slots. ``None``: one slot per expert.
        masked_ranks: ranks out of service (lost peers): they send nothing and no pick goes
            to their slots (``ubep.sim.replicas``).
    """

    tokens_per_rank: int = 128
    hidden: int = 7168
    itemsize: int = 1
    num_topk: int = 8
    experts_per_rank: int = 1
    routing: Routing = "uniform"
    alpha: float = 1.0
    hot_experts: int = 8
    hot_share: float | None = None
    combine_itemsize: int = 2
    seed: int = 0
    expert_map: ExpertMap | None = None
    masked_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tokens_per_rank", "hidden", "itemsize", "num_topk", "experts_per_rank",
                     "combine_itemsize"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidArgumentError(name, value, "must be a positive integer")
        if self.hot_share is not None and not 0 < self.hot_share < 1:
            raise InvalidArgumentError("hot_share", self.hot_share, "must lie in (0, 1) or be None")
        if self.routing not in ROUTINGS:
            raise InvalidArgumentError("routing", self.routing, f"must be one of {ROUTINGS}")
        if self.expert_map is not None and not isinstance(self.expert_map, ExpertMap):
            raise InvalidArgumentError("expert_map", type(self.expert_map).__name__,
                                       "must be a ubep.ExpertMap")
        object.__setattr__(self, "masked_ranks", tuple(self.masked_ranks))

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.itemsize

    def num_experts(self, num_ranks: int) -> int:
        """Physical expert slots."""
        return num_ranks * self.experts_per_rank

    def num_logical(self, num_ranks: int) -> int:
        """Experts the routing picks from (the map's logical experts, else the slots)."""
        if self.expert_map is None:
            return self.num_experts(num_ranks)
        return self.expert_map.num_logical

    def payload_bytes(self) -> int:
        """Table 4's byte count: tokens x top-k x hidden x itemsize (per rank)."""
        return self.tokens_per_rank * self.num_topk * self.row_bytes

    def with_(self, **changes: object) -> Workload:
        return replace(self, **changes)  # type: ignore[arg-type]

    def resolved(self, fabric: FabricModel | None) -> Workload:
        """This workload with an unstated hot share (``None``) set from ``fabric``'s
        calibration (0.5 without a fabric: ``FabricModel``'s default)."""
        if self.routing != "hot" or self.hot_share is not None:
            return self
        return self.with_(hot_share=fabric.hot_share if fabric is not None else
                          FabricModel.hot_share)


@dataclass(frozen=True)
class System:
    """How a call runs: engine, scheduler policy, sync mode, receive layout, core split.

    ``num_send_cores`` / ``num_count_cores`` of ``None`` take ``ubep.sched``'s defaults
    (ASP: Appendix A's partition with :func:`partition_constants`); ``"all"`` means every core
    of the rank (what BSP does: every core counts, then every core sends).
    """

    name: str
    engine: Engine
    policy: Policy
    sync: Sync
    layout: Layout = "expert"
    num_send_cores: int | str | None = None
    num_count_cores: int | str | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidArgumentError("engine", self.engine, f"must be one of {ENGINES}")
        if self.sync not in SYNCS:
            raise InvalidArgumentError("sync", self.sync, f"must be one of {SYNCS}")
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError("layout", self.layout, f"must be one of {LAYOUTS}")

    def with_(self, **changes: object) -> System:
        return replace(self, **changes)  # type: ignore[arg-type]


CANN_EP = System("CANN EP", "bsp", "expert_contiguous", SW, num_send_cores="all",
                 num_count_cores="all")
UBEP = System("UBEP", "asp", "hierarchical", SP)
UBEP_NO_MAPPING = System("UBEP w/o mapping", "asp", "balanced", SP)


def routing_for(workload: Workload, num_ranks: int) -> tuple[np.ndarray, ...]:
    """Every rank's seeded ``topk_idx`` (read-only arrays; logical ids with an expert map).
    The map and the mask do not change the draw: one cache entry serves every map."""
    base = workload.resolved(None).with_(expert_map=None, masked_ranks=())
    return _routing(base, num_ranks, workload.num_logical(num_ranks))


def hot_ids_for(workload: Workload, num_ranks: int) -> np.ndarray:
    """The (logical) hot experts of a ``routing="hot"`` workload, sorted."""
    return _hot_ids(workload.seed, workload.num_logical(num_ranks), workload.hot_experts)


def _hot_ids(seed: int, num_experts: int, hot_experts: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 10_007)
    return np.sort(rng.choice(num_experts, hot_experts, replace=False))


@lru_cache(maxsize=64)
def _routing(workload: Workload, num_ranks: int, num_experts: int) -> tuple[np.ndarray, ...]:
    if workload.num_topk > num_experts:
        raise InvalidArgumentError("num_topk", workload.num_topk, f"exceeds {num_experts} experts")
    hot_ids = None
    if workload.routing == "hot":
        hot_ids = _hot_ids(workload.seed, num_experts, workload.hot_experts)
    if workload.routing == "zipf":
        # One draw for all ranks, so that every rank shares the same popular experts.
        every = zipf_topk(workload.tokens_per_rank * num_ranks, num_experts, workload.num_topk,
                          alpha=workload.alpha, seed=workload.seed)
        parts = np.split(every, num_ranks)
    out = []
    for r in range(num_ranks):
        seed = workload.seed + r
        if workload.routing == "uniform":
            idx = uniform_topk(workload.tokens_per_rank, num_experts, workload.num_topk, seed=seed)
        elif workload.routing == "zipf":
            idx = np.ascontiguousarray(parts[r])
        else:
            share = workload.resolved(None).hot_share
            assert share is not None  # resolved: a hot workload always has a share
            idx = hot_experts_topk(workload.tokens_per_rank, num_experts, workload.num_topk,
                                   hot_experts=workload.hot_experts, hot_share=share,
                                   hot_ids=hot_ids, seed=seed)
        idx.flags.writeable = False
        out.append(idx)
    return tuple(out)


def partition_constants(topology: Topology, fabric: FabricModel, row_bytes: int,
                        num_experts: int, picks: int = 0) -> tuple[float, float, float]:
    """``(alpha, beta, b_count)`` of Appendix A's model from the fabric constants.

    alpha: time per (token, k) unit of one send core when the rank's cores all send (mean hop);
    beta: count (a vector count over the rank's ``picks`` (token, k) pairs) + publish + poll
    per expert; b_count: the receiver's prefix sum.
    """
    n = topology.cores_per_rank
    mean_lat = float(np.mean(topology.latency_of_hops(topology.hop_matrix()[0])))
    work = (fabric.issue_ns + row_bytes / fabric.core_bandwidth_gbps
            + fabric.latency_exposure * mean_lat)
    alpha = work / float(fabric.speed(n))
    beta = fabric.count_expert_ns + picks * fabric.count_pick_ns + fabric.flag_ns + fabric.poll_ns
    b_count = fabric.cumsum_entry_ns * num_experts
    return alpha, beta, b_count


def _cores(value: int | str | None, topology: Topology) -> int | None:
    if value == "all":
        return topology.cores_per_rank
    if isinstance(value, str):
        raise InvalidArgumentError("num_send_cores", value, "must be an int, 'all' or None")
    return value


def appendix_a_split(num_cores: int, num_experts: int, num_topk: int, batch_size: int,
                     aux: int, *, alpha: float, beta: float,
                     b_count: float = 0.0) -> tuple[int, int, int]:
    """``(num_send_cores, num_count_cores, num_aux_cores)`` of an ASP rank, as the paper writes
    it: Appendix A partitions **all** ``n`` AIVs into ``n_count`` counting and ``n_token = n -
    n_count`` communicating ones (the exact min-max of eqs. 2-4, :func:`ubep.sched.partition`),
    and the evaluation text takes the routing and checksum AIVs *from communication* ("the 12
    cores given to routing and checksum work are taken from communication, so fewer cores send
    more data"): ``n_send = n_token - aux``. The count group is Appendix A's whatever the
    routing and checksum AIVs take; ``aux`` is cut to leave at least one send core."""
    from ..sched.partition import partition

    part = partition(num_cores, num_experts, num_topk, batch_size, alpha=alpha, beta=beta,
                     b_count=b_count)
    n_c = part.num_count_cores
    aux = max(0, min(int(aux), num_cores - n_c - 1))
    return num_cores - n_c - aux, n_c, aux


def core_split(workload: Workload, system: System, topology: Topology,
               fabric: FabricModel | None = None) -> tuple[int | None, int | None]:
    """``(num_send_cores, num_count_cores)`` of ``system`` (``None``: ubep.sched's default).

    ASP's default is :func:`appendix_a_split` with :func:`partition_constants` of ``fabric``:
    Appendix A's partition of every core, less the routing / checksum cores that large rank
    counts take from sending (:func:`aux_cores`)."""
    n_s = _cores(system.num_send_cores, topology)
    n_c = _cores(system.num_count_cores, topology)
    if system.engine == "asp" and n_s is None and n_c is None and fabric is not None \
            and topology.cores_per_rank >= 2:
        num_experts = workload.num_experts(topology.num_ranks)
        aux = aux_cores(topology.num_ranks, fabric, topology.cores_per_rank)
        alpha, beta, b_count = partition_constants(
            topology, fabric, workload.row_bytes, num_experts,
            workload.tokens_per_rank * workload.num_topk)
        n_s, n_c, _ = appendix_a_split(topology.cores_per_rank, num_experts,
                                       workload.num_topk, workload.tokens_per_rank, aux,
                                       alpha=alpha, beta=beta, b_count=b_count)
    return n_s, n_c


def aux_cores(num_ranks: int, fabric: FabricModel, cores_per_rank: int | None = None) -> int:
    """Cores an ASP rank gives to routing and checksum work (taken from sending):
    ``round(aux_cores_at_256 * num_ranks / 256)``, the paper's 12 AIVs at 256 ranks scaled
    with the rank count (the routing and checksum work grows with the destinations).

    With ``cores_per_rank`` given, at most ``cores_per_rank - cores_per_rank // 4``: a rank
    keeps a quarter of its cores to count and send. The cap binds only beyond 768 ranks of 48
    cores (EP 1024, an extrapolation: 36 of 48 cores), where the linear scaling alone would
    leave no core to send."""
    aux = round(fabric.aux_cores_at_256 * num_ranks / 256)
    if cores_per_rank is not None:
        aux = min(aux, cores_per_rank - cores_per_rank // 4)
    return aux


# An EP256 plan set is ~20 MB: keep the cache small, but large enough for a fit's cases (Figure 9
# alone takes 3 systems x 8 hot-expert placements of small EP64 sets).
@lru_cache(maxsize=48)
def _plans(workload: Workload, system: System, topology: Topology, n_s: int | None,
           n_c: int | None) -> tuple[Plan, ...]:
    routing = routing_for(workload, topology.num_ranks)
    return tuple(make_plans(list(routing), topology,
                            num_experts=workload.num_experts(topology.num_ranks),
                            policy=system.policy, num_send_cores=n_s, num_count_cores=n_c,
                            layout=system.layout, expert_map=workload.expert_map,
                            masked_ranks=workload.masked_ranks))


def clear_plans() -> None:
    """Forget the cached plans (a benchmark of planning)."""
    _plans.cache_clear()


def plans_for(workload: Workload, system: System, topology: Topology,
              fabric: FabricModel | None = None) -> tuple[Plan, ...]:
    """Every rank's dispatch plan (cached by core split, so that a fit re-times cached plans).
    ``fabric`` sets the ASP default core split (:func:`core_split`) and an unstated hot share
    (:meth:`Workload.resolved`)."""
    workload = workload.resolved(fabric)
    n_s, n_c = core_split(workload, system, topology, fabric)
    return _plans(workload, system.with_(name=""), topology, n_s, n_c)


# (label, result) of every run_case call while recording() is open (None: not recording)
_RECORDING: list[tuple[str, SimResult]] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, SimResult]]]:
    """Keep ``(label, SimResult)`` of every :func:`run_case` call made inside (in call order):
    what ``ubep sim EXPERIMENT --trace`` exports."""
    global _RECORDING
    previous, _RECORDING = _RECORDING, []
    try:
        yield _RECORDING
    finally:
        _RECORDING = previous


def run_case(
    workload: Workload,
    system: System,
    topology: Topology,
    fabric: FabricModel,
    *,
    op: str = "dispatch",
    mode: str = "analytic",
) -> SimResult:
    """Simulate one dispatch (or combine) call of ``workload`` under ``system``; an ASP
    dispatch with routing and checksum cores (:func:`aux_cores`) times their work too
    (:func:`ubep.sim.preprocess.with_preprocess`)."""
    plans = plans_for(workload, system, topology, fabric)
    row_bytes = workload.row_bytes
    dispatch = plans
    if op == "combine":
        plans = combine_plans(plans, topology, policy=system.policy)
        row_bytes = workload.hidden * workload.combine_itemsize
    res = simulate(plans, topology, fabric, engine=system.engine, sync=system.sync,
                   row_bytes=row_bytes, op=op, mode=mode)
    if op == "dispatch" and system.engine == "asp" and system.num_send_cores is None \
            and system.num_count_cores is None:
        aux = aux_cores(topology.num_ranks, fabric, topology.cores_per_rank)
        first = dispatch[0].num_send_cores + dispatch[0].num_count_cores
        aux = min(aux, topology.cores_per_rank - first)
        res = with_preprocess(res, fabric, topology, aux_cores=aux, first_core=first,
                              num_local_experts=workload.num_experts(topology.num_ranks)
                              // topology.num_ranks,
                              picks=workload.tokens_per_rank * workload.num_topk)
    if _RECORDING is not None:  # ubep sim ... --trace: the calls an experiment times
        _RECORDING.append((f"{system.name} {op} {topology.num_ranks} ranks", res))
    return res
