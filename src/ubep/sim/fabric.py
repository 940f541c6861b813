"""The fabric model: every cost the simulator charges, as one frozen dataclass of constants.

The topology (:class:`ubep.topology.Topology`) gives what is structural: ranks, cores per rank,
hop classes, one-way latency and per-rank bandwidth per hop class. :class:`FabricModel` adds what
a core does with them. The equations are written out in docs/SIMULATOR.md; in short:

* a send unit of ``b`` wire bytes and hop class ``h`` is ``w = issue_ns + b / core_bandwidth +
  latency_exposure * latency_ns[h]`` nanoseconds of work for the core that issues it, then the
  core's own window wait ``max(0, rtt[h] / store_window - w)`` (Little's law: a core with
  ``store_window`` stores in flight sends at most ``store_window / rtt[h]`` rows per ns, with
  ``rtt[h] = 2 latency_ns[h] + b / bandwidth_gbps[h]``; a stall: the core's alone);
* ``k`` cores of one rank sending at once each progress at ``speed(k)`` work-ns per ns
  (processor sharing; Figure 3b's per-core efficiency is ``speed(k) / speed(8)``);
* a unit then crosses the source port (FIFO at ``bandwidth_gbps[h]``), flies ``latency_ns[h]``
  and enters the destination port (cut-through FIFO at ``bandwidth_gbps[h]``);
* barriers, flags, polls, counts, prefix sums and the per-block checks of the sync modes cost the
  constants below.

Constants come from ``calib.json`` through :mod:`ubep.sim.calib`; nothing here is tuned.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..topology import Topology
from .syncs import sync_mode

__all__ = ["FabricModel", "SyncCosts", "dissemination_ns", "sync_costs", "syncall_atomic_ns"]


def syncall_atomic_ns(cores: int, local_latency_ns: float) -> float:
    """The intrinsic cost of a SyncAll of one die's ``cores`` AIVs through global memory
    (docs/SIMULATOR.md 1.6): every AIV's arrival is an atomic add on one word of the die's HBM;
    the adds to one word serialise, one local access (``local_latency_ns``, Table 2's
    intra-NPU 218 ns on CM384) apart, and the last AIV learns of the release by one more read:
    ``(cores + 1) x local_latency_ns``. On a 48-AIV die, 49 x 218 = 10 682 ns: two of them are
    ~15 % of CANN EP's dispatch, the paper's SyncAll share, predicted rather than fitted."""
    if cores < 1 or local_latency_ns < 0:
        raise InvalidArgumentError("cores", (cores, local_latency_ns),
                                   "needs >= 1 core and a latency >= 0")
    return float((cores + 1) * local_latency_ns)


@dataclass(frozen=True)
class FabricModel:
    """Per-core and per-operation costs of one fabric family (ns, GB/s = bytes/ns).

    Attributes:
        name: preset family ("cm384", "nvl72", "host", ...).
        init_ns: kernel launch and Init phase (tokens staged into core-local buffers).
        issue_ns: fixed core time per send unit (descriptor, local staging, store issue).
        core_bandwidth_gbps: bytes per ns one core moves when it runs alone.
        latency_exposure: share of a unit's one-way latency for which the unit holds the
            rank's shared send machinery (its outstanding-store slots; processor-shared work).
        contention_cores, contention_sharpness: ``speed(k) = (1 + (k/k_sat)^p)^(-1/p)``.
        barrier_ns: intrinsic cost of one SyncAll (on top of waiting for the slowest core);
            on CM384 derived from the die's structure (:func:`syncall_atomic_ns`).
        flag_ns: core time to write one flag / count / checksum word to a peer.
        poll_ns: core time to check one flag entry once it has landed.
        count_expert_ns: fixed core time to count one expert's tokens (one vector count
            instruction's issue latency).
        count_pick_ns: core time per (token, k) pick scanned while counting one expert (the
            vector count reads every pick of the rank once per expert it counts).
        cumsum_entry_ns: prefix-sum time per (source rank, local expert) entry.
        vector_op_ns: one vector compare / checksum step over one atomic block.
        atomic_bytes: atomic write granularity of the fabric (UB: 512 B); the TFF block size.
        tff_flag_bytes: flag bytes inside a TFF block (32 B on UB).
        fence_rtt_fraction: share of a store's round trip a stop-and-wait fence waits before
            the flag may follow (1 = the full acknowledgement; less where the fabric reports
            completion before the acknowledgement is back at the core).
        metadata_ratio: UBEP's extra wire bytes per dispatched row over the payload (metadata
            and flags carried with the data), as a fraction of the row.
        aux_cores_at_256: cores an ASP rank gives to routing and checksum work at 256 ranks,
            taken from sending (scaled with the rank count, ``workload.aux_cores``).
        poll_lanes: count / flag words one poll reads and checks at once (a vector load of
            the words that lie side by side in the receive area; 1 = one word per poll).
        cumsum_group_sync_ns: CalCumSum's hand-off per core of the count group: each count
            core's partial prefix sums reach the core that publishes the offsets through
            shared memory (one write, flag and read), one core after another.
        store_window: stores one core keeps in flight (its MTE queue of outstanding writes).
            By Little's law a core whose rows take ``rtt`` each sends at most
            ``store_window / rtt`` rows per ns: after each unit it stalls ``max(0, rtt /
            store_window - w)`` (:meth:`window_wait_ns`), a wait of that core alone, so a core
            whose rows cross tier 2 finishes later than one whose rows stay near, for the same
            row count. 0 = no window (the core never waits for its own stores).
        check_lanes: atomic blocks whose markers one vector compare / checksum step covers
            (a strided copy gathers the 32 B marker of each block side by side: one 256 B
            vector holds 8); 1 = one step per block.
        hot_share: the hot experts' share of the picks of a skewed (``routing="hot"``)
            workload that does not state it (``Workload.hot_share=None``). Not a property of
            the fabric but a set-up unknown of the paper's skewed experiments: it is carried
            here so that the fit to the training set (Figure 9 measures it), its
            leave-one-out spread and the prediction intervals treat it like the other
            assumed constants.
        syncall_global: 1 if a BSP SyncAll is a barrier of every rank's cores (the paper's
            "global barriers": Phase 3's SyncAll ensures all token data of every rank has
            been written, Phase 4's confirms global completion), 0 if it joins the cores of
            one rank only. A global SyncAll ends when the last core of the last rank has
            arrived (and, the first, when every rank's stores are acknowledged), plus its
            intrinsic ``barrier_ns`` and the flag rounds of a tier-aware dissemination
            barrier (:func:`dissemination_ns`).
        sw_meet: 1 if an ASP stop-and-wait rank's sending AIVs meet at one counter before
            each per-destination flag (the sync table's ``meet``: ``P x flag_ns`` for ``P``
            sending AIVs); 0 where the family's kernels flag per core.
    """

    name: str
    init_ns: float
    issue_ns: float
    core_bandwidth_gbps: float
    latency_exposure: float
    contention_cores: float
    contention_sharpness: float
    barrier_ns: float
    flag_ns: float
    poll_ns: float
    count_expert_ns: float
    cumsum_entry_ns: float
    vector_op_ns: float
    atomic_bytes: int = 512
    tff_flag_bytes: int = 32
    count_pick_ns: float = 0.0
    fence_rtt_fraction: float = 1.0
    metadata_ratio: float = 0.0
    aux_cores_at_256: float = 0.0
    cumsum_group_sync_ns: float = 0.0
    poll_lanes: int = 1
    store_window: float = 0.0
    check_lanes: int = 1
    hot_share: float = 0.5
    syncall_global: int = 0
    sw_meet: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
                raise InvalidArgumentError(f.name, value, "must be a finite number")
            if value < 0:
                raise InvalidArgumentError(f.name, value, "must be >= 0")
        for name in ("core_bandwidth_gbps", "contention_cores", "contention_sharpness"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(name, getattr(self, name), "must be > 0")
        for name in ("poll_lanes", "check_lanes"):
            lanes = getattr(self, name)
            if lanes < 1 or int(lanes) != lanes:
                raise InvalidArgumentError(name, lanes, "must be an integer >= 1")
        if self.fence_rtt_fraction > 1:
            raise InvalidArgumentError("fence_rtt_fraction", self.fence_rtt_fraction,
                                       "must be <= 1")
        if 0 < self.store_window < 1:
            raise InvalidArgumentError("store_window", self.store_window,
                                       "must be 0 (no window) or >= 1 store")
        if self.syncall_global not in (0, 1):
            raise InvalidArgumentError("syncall_global", self.syncall_global, "must be 0 or 1")
        if self.sw_meet not in (0, 1):
            raise InvalidArgumentError("sw_meet", self.sw_meet, "must be 0 or 1")
        if not 0 < self.hot_share < 1:
            raise InvalidArgumentError("hot_share", self.hot_share, "must lie in (0, 1)")
        if self.latency_exposure > 1:
            raise InvalidArgumentError("latency_exposure", self.latency_exposure, "must be <= 1")
        if not 8 <= self.tff_flag_bytes < self.atomic_bytes:
            raise InvalidArgumentError(
                "tff_flag_bytes", self.tff_flag_bytes,
                f"must be in [8, atomic_bytes={self.atomic_bytes})",
            )

    def speed(self, active_cores: np.ndarray | float) -> np.ndarray:
        """Work-ns per ns of each of ``k`` cores of one rank sending at once (1 at k -> 0)."""
        k = np.asarray(active_cores, dtype=np.float64)
        ratio = k / self.contention_cores
        p = self.contention_sharpness
        return np.asarray((1.0 + ratio**p) ** (-1.0 / p))

    def efficiency(self, active_cores: np.ndarray | float, reference: float = 8.0) -> np.ndarray:
        """Figure 3b's per-core efficiency of ``k`` cores relative to ``reference`` cores."""
        return self.speed(active_cores) / self.speed(reference)

    def unit_work_ns(self, wire_bytes: np.ndarray, hop: np.ndarray,
                     topology: Topology) -> np.ndarray:
        """Core work of send units before contention: issue + bytes / core rate + the share of
        the latency a row holds the rank's shared send machinery (its outstanding-store
        slots)."""
        lat = np.asarray(topology.latency_ns, dtype=np.float64)[hop]
        return self.issue_ns + np.asarray(wire_bytes) / self.core_bandwidth_gbps + (
            self.latency_exposure * lat
        )

    def syncall_ns(self, topology: Topology) -> float:
        """What a SyncAll adds after its last arrival: ``barrier_ns``, plus, for a global
        SyncAll, the flag rounds between the ranks (:func:`dissemination_ns`)."""
        rounds = dissemination_ns(topology) if self.syncall_global else 0.0
        return float(self.barrier_ns) + rounds

    def window_wait_ns(self, wire_bytes: np.ndarray, hop: np.ndarray, work_ns: np.ndarray,
                       topology: Topology) -> np.ndarray:
        """The issuing core's own wait after each send unit (Little's law over its store
        window): ``max(0, (2 L[h] + b / B[h]) / store_window - work_ns)``. A core keeps
        ``store_window`` stores in flight; each holds its slot for its round trip, so in steady
        state a unit costs the core ``rtt / store_window``, of which its issue work covers
        ``work_ns``. The wait is the core's (a stall, docs/SIMULATOR.md 1.2), which no other
        core's early finish shortens: two cores with the same rows but different hop mixes
        finish apart by the difference of their rows' round trips over the window. 0 without
        a window (``store_window == 0``)."""
        hop = np.asarray(hop)
        if self.store_window == 0:
            return np.zeros(hop.shape)
        lat = np.asarray(topology.latency_ns, dtype=np.float64)[hop]
        bw = np.asarray(topology.bandwidth_gbps, dtype=np.float64)[hop]
        rtt = 2.0 * lat + np.asarray(wire_bytes, dtype=np.float64) / bw
        return np.maximum(0.0, rtt / self.store_window - np.asarray(work_ns))

    def with_values(self, **values: float) -> FabricModel:
        """A copy with some constants replaced (validated)."""
        changes: dict[str, Any] = dict(values)
        return replace(self, **changes)

    def as_dict(self) -> dict[str, float | str]:
        return asdict(self)


@dataclass(frozen=True)
class SyncCosts:
    """What one row of ``row_bytes`` costs under a sync mode (see docs/SIMULATOR.md).

    Attributes:
        wire_bytes: bytes that cross the fabric for the row (TFF adds a flag per block).
        sender_extra_ns: extra sender core work per row (DC accumulates a checksum).
        receiver_extra_ns: extra receiver core work per row (flag / checksum / sentinel checks,
            sentinel reset).
        blocks: atomic blocks per row.
    """

    wire_bytes: int
    sender_extra_ns: float
    receiver_extra_ns: float
    blocks: int


def sync_costs(sync: str, row_bytes: int, fabric: FabricModel) -> SyncCosts:
    """Per-row costs of the sync mode ``sync`` (a row of :data:`ubep.sim.syncs.SYNC_MODES`)
    for rows of ``row_bytes``."""
    mode = sync_mode(sync)
    if not isinstance(row_bytes, (int, np.integer)) or row_bytes < 1:
        raise InvalidArgumentError("row_bytes", row_bytes, "must be a positive integer")
    blocks = -(-int(row_bytes) // fabric.atomic_bytes)
    lanes = int(fabric.check_lanes)
    # One vector step checks the markers of ``check_lanes`` blocks at once.
    steps = -(-blocks // lanes)
    if mode.flag_in_block:
        payload = fabric.atomic_bytes - fabric.tff_flag_bytes
        flagged = -(-int(row_bytes) // payload)
        # Receiver checks one flag per block; the flag rides inside the block the sender stages.
        return SyncCosts(flagged * fabric.atomic_bytes, 0.0,
                         -(-flagged // lanes) * fabric.vector_op_ns, flagged)
    # DC: the sender accumulates the leading bytes of every block into the checksum and the
    # receiver recomputes it; SP: the receiver compares every block against the sentinel, then
    # resets the row to it.
    send = steps * fabric.vector_op_ns if mode.sender_block_steps else 0.0
    recv = steps * fabric.vector_op_ns if mode.receiver_block_steps else 0.0
    if mode.receiver_reset:
        recv += row_bytes / fabric.core_bandwidth_gbps
    return SyncCosts(int(row_bytes), send, recv, blocks)


def dissemination_ns(topology: Topology) -> float:
    """The flag rounds of a tier-aware dissemination barrier over every rank: in round ``k``
    each rank writes a flag to a partner ``2^k`` away and waits for the flag of the rank
    ``2^k`` behind it, first among the ranks of its node (``ceil(log2(ranks_per_node))``
    rounds of one one-hop latency ``L[1]``), then among the same-position ranks of the nodes
    (``ceil(log2(num_nodes))`` rounds of the farthest latency ``L[H-1]``). 0 for one rank."""
    lat = np.asarray(topology.latency_ns, dtype=np.float64)
    if topology.num_ranks <= 1:
        return 0.0
    per_node = min(topology.ranks_per_node, topology.num_ranks)
    inner = math.ceil(math.log2(per_node)) if per_node > 1 else 0
    outer = math.ceil(math.log2(topology.num_nodes)) if topology.num_nodes > 1 else 0
    return float(inner * lat[min(1, lat.size - 1)] + outer * lat[-1])
