"""``BufferConfig``: the shape and behaviour of a :class:`ubep.Buffer`, fixed at construction.

A frozen dataclass, validated in ``__post_init__`` (every error an ``InvalidArgumentError``
naming the field), its fields grouped by section: the shape of a call (what the model gives),
the transport (how rows move and how receivers learn they arrived), the execution (cores,
threads, scheduler), the deadline, and the sync formats' geometry. Per-call options are keyword
arguments of ``dispatch``/``combine``, not fields here. ``ubep.buffer`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import dtypes as _dt
from .errors import InvalidArgumentError
from .expert_map import ExpertMap
from .modes import (
    BUFFER_LAYOUTS,
    ENGINES,
    INTEGRITY,
    PEER_LOSS,
    POLICIES,
    QUANTS,
    SYNCS,
    Engine,
    Integrity,
    Layout,
    PeerLoss,
    Policy,
    Quant,
    SyncChoice,
)

__all__ = ["AUTO_SYNC", "BufferConfig"]

# sync="auto": on CPUs a stop-and-wait flag is one ordinary store after the rows (x86 keeps
# store order; Arm needs only a release store), so the paper's reason for Data-as-Flag -- a
# fence round trip per batch across the fabric -- does not exist, and SW moves the fewest bytes
# (TFF adds an 8 B epoch word per 480 B, DC reads every row again for its checksum, SP re-arms
# the regions). The peers benchmark's full runs over its 16 BF16 shapes (benchmarks/results/
# peers.*) measured dispatch medians relative to asp+sw of 1.08 and 0.98 for asp+tff (rows in
# place), 1.14 and 1.04 for asp+sp, 1.96 and 1.75 for asp+dc: none is faster beyond noise, so
# SW. The simulator keeps the paper's modes.
AUTO_SYNC = "sw"


def check_expert_ranks(expert_ranks: object, num_experts: int) -> tuple[int, ...]:
    """``expert_ranks`` as a tuple of ints, refused (naming it) when empty, with a repeated or
    negative rank, or when ``num_experts`` does not divide evenly over it. Ranks beyond the
    group are refused by :func:`m2n_expert_map` (the group size is known there)."""
    if isinstance(expert_ranks, (str, bytes)) or not isinstance(
            expert_ranks, (Sequence, np.ndarray)):
        raise InvalidArgumentError("expert_ranks", expert_ranks,
                                   "must be None or a sequence of rank numbers")
    ranks = []
    for r in expert_ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
            raise InvalidArgumentError("expert_ranks", list(expert_ranks),
                                       "rank numbers must be integers >= 0")
        ranks.append(int(r))
    if not ranks:
        raise InvalidArgumentError("expert_ranks", ranks, "needs at least one expert rank")
    if len(set(ranks)) != len(ranks):
        raise InvalidArgumentError("expert_ranks", ranks, "names a rank twice")
    if num_experts % len(ranks):
        raise InvalidArgumentError(
            "expert_ranks", ranks, f"num_experts={num_experts} is not a multiple of its "
            f"{len(ranks)} expert ranks")
    return tuple(ranks)



@dataclass(frozen=True)
class BufferConfig:
    """Shape and behaviour of a :class:`~ubep.Buffer` (identical on every rank).

    Shape of a call:
        max_tokens_per_rank: most tokens one rank dispatches in one call.
        hidden: elements per token row.
        num_topk: experts per token (``topk_idx`` columns).
        num_experts: global experts, a multiple of the number of ranks.
        dtype: payload type, a ``ubep.dtypes`` name (``"bf16"``, ``"fp16"``, ``"fp32"``,
            ``"int8"``, ``"uint8"``) or a numpy dtype / array of it.
        combine_dtype: type of the expert outputs combine takes and returns; ``None`` = ``dtype``
            for float payloads, ``"bf16"`` for 1-byte ones (W8A8 dispatch, BF16 combine).
        quant: ``None``, ``"e4m3"`` or ``"int8"``: dispatch quantises each token of the float
            ``x`` (one float32 scale per 128 channels, ``ubep.quant``) and the receivers get
            ``recv_x`` 1-byte and ``recv_x_scales`` float32; combine stays in ``dtype``.
            Needs ``hidden`` a multiple of 128 and a sync other than SP.
        quant_round_scale: UE8M0 scales (powers of two, rounded up) with ``quant``.
        expert_map: ``None`` or a :class:`~ubep.expert_map.ExpertMap` (or a sequence of
            sequences of slot ids, made one): redundant experts. ``num_experts`` then counts
            physical slots, ``topk_idx`` names logical experts ``[-1, expert_map.num_logical)``
            and dispatch sends each pick to one live replica (``ubep.expert_map``'s rule).
        expert_ranks: ``None`` (every rank holds ``num_experts // num_ranks`` experts) or the
            ranks that hold all the experts (M2N, ``ubep.m2n``, docs/M2N.md): ``num_experts``
            logical experts spread over them in that order, ``num_experts //
            len(expert_ranks)`` each; the other ranks only send and combine. Not with
            ``expert_map`` (an M2N placement is a map of its own) nor ``on_peer_loss="mask"``.
            The engine runs the physical config (``ubep.m2n.physical_config``); ``buf.config``
            stays this one, and received ids are logical experts.

    Transport (``ubep.modes``):
        layout: ``"expert"`` (one row per (token, expert)), ``"rank"`` (one per (token,
            rank)) or ``"expert_padded"``: the rows of ``"expert"`` at DeepEP's low-latency
            places, ``recv_x`` ``[num_local_experts * max_tokens_per_rank * num_ranks,
            hidden]`` (a ``[num_local_experts, slots, hidden]`` view costs nothing), expert
            ``e``'s rows the first ``num_recv_tokens_per_expert[e]`` of its block; the call
            leaves the slots after them as they were (undefined, as DeepEP's; their metadata
            reads -1, weight 0). Combine takes ``expert_out`` in the same places. Not with
            ``on_peer_loss="mask"``.
        engine: ``"asp"`` (UBEP task graph) or ``"bsp"`` (CANN-EP-style phases and barriers).
        sync: ``"sw"``, ``"tff"``, ``"dc"`` or ``"sp"`` (docs/FORMATS.md; SP needs a float
            payload: 1-byte types have no free sentinel), or ``"auto"`` (the default): the
            fastest on this kind of machine, resolved at construction (:data:`AUTO_SYNC`).
        transport: the engine's registry row (``ubep.plane.open_engine``): ``"shm"`` (the
            native engine, one host), ``"mpi"`` (the MPI RMA engine) or a registered one;
            ``None`` (the default): the group's memory's own (``"shm"`` where every peer is
            load/store reachable).
        integrity: ``"off"`` (the default) or ``"checksum"``: every row's sender writes a
            64-bit checksum of it (with the call and the row's position) beside the row, its
            receiver checks it, in dispatch (the rows in ``recv_x``) and in combine (the expert
            outputs it pulls), and every rank waits for every other's check before it returns:
            a row changed between send and receive fails the call on every rank, which then
            needs ``resync()`` (docs/INTEGRITY.md). The one-host engine only.

    Execution:
        num_cores: cores (threads) per rank; ``None`` = the group topology's ``cores_per_rank``.
        threads: run cores as threads (``True``) or all on the calling thread (``False``);
            ``None`` = threads when ``num_cores * num_ranks`` fits the hardware threads.
        policy: token scheduler of the ASP send cores (``ubep.sched.schedule``).
        background: split-phase calls (``return_recv_hook``) run their sends and waits on a
            background core while the caller computes (``True``), or the caller sends at the
            call and receives in the hook (``False``); ``None`` = background when the host has
            a hardware thread to spare for it on every rank (``(num_cores + 1) * num_ranks``
            fits): on a CPU the background core competes with the caller's compute otherwise.

    Tracing:
        trace: every core records each task it runs (kind, unit, peer, rows, bytes, start and
            end on the host's monotonic clock) into a ring of the engine's own memory, and
            every call its span; ``ubep.trace.spans_of(buffer)`` reads them, and
            ``ubep.trace.record(path)`` turns tracing on for every Buffer in its block and
            writes one Chrome trace file (docs/TRACING.md). Off by default: off costs one
            predictable branch per task.

    Deadline and peer loss:
        timeout_s: deadline of every wait inside one call.
        on_peer_loss: ``"raise"`` (a dead or silent peer fails the call on every rank and the
            Buffer refuses until resynced) or ``"mask"`` (the survivors agree on the lost ranks,
            complete the call without them and keep serving: ``ubep.buffer.elastic``).
        min_live_ranks: the quorum of a masking Buffer on an MPI group: the survivors of a
            loss serve on only when at least this many of the group's ranks agreed, else each
            raises ``PeerLostError`` naming the quorum; ``None`` = more than half of them
            (docs/ELASTIC.md, "The quorum").

    Sync formats:
        tff_block_bytes, tff_flag_bytes: TFF block geometry (default 512 = 480 + 32).
        sp_check_bytes: SP arms and polls the last ``sp_check_bytes`` of each row, which the
            writer stores after the rest behind a release fence (docs/FORMATS.md); ``0`` arms
            and polls every element of the row, the paper's SP, which needs no store order.
    """

    # --- shape of a call
    max_tokens_per_rank: int
    hidden: int
    num_topk: int
    num_experts: int
    dtype: Any
    combine_dtype: Any = None
    quant: Quant | None = None
    quant_round_scale: bool = False
    expert_map: ExpertMap | None = None
    expert_ranks: tuple[int, ...] | None = None
    # --- transport
    layout: Layout = "expert"
    engine: Engine = "asp"
    sync: SyncChoice = "auto"
    integrity: Integrity = "off"
    transport: str | None = None
    # --- execution
    num_cores: int | None = None
    threads: bool | None = None
    policy: Policy = "hierarchical"
    background: bool | None = None
    trace: bool = False
    # --- deadline
    timeout_s: float = 60.0
    on_peer_loss: PeerLoss = "raise"
    min_live_ranks: int | None = None
    # --- sync formats
    tff_block_bytes: int = 512
    tff_flag_bytes: int = 32
    sp_check_bytes: int = 32

    def __post_init__(self) -> None:
        self._check_shape()
        self._check_transport()
        self._check_execution()
        if not isinstance(self.trace, bool):
            raise InvalidArgumentError("trace", self.trace, "must be True or False")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise InvalidArgumentError("timeout_s", self.timeout_s, "must be > 0")
        if self.on_peer_loss not in PEER_LOSS:
            raise InvalidArgumentError("on_peer_loss", self.on_peer_loss,
                                       f"must be one of {PEER_LOSS}")
        if self.min_live_ranks is not None and (
                isinstance(self.min_live_ranks, bool)
                or not isinstance(self.min_live_ranks, (int, np.integer))
                or self.min_live_ranks < 1):
            raise InvalidArgumentError("min_live_ranks", self.min_live_ranks,
                                       "must be None or a positive integer")
        self._check_formats()
        if self.layout == "expert_padded" and self.on_peer_loss == "mask":
            # a masking Buffer re-orders a call's rows over the survivors: packed rows only
            raise InvalidArgumentError(
                "layout", self.layout, "cannot be combined with on_peer_loss='mask': use "
                "layout='expert'")
        if self.expert_ranks is not None and self.on_peer_loss == "mask":
            # a masking Buffer re-routes over an expert map of its own, and an M2N placement
            # is one already; a lost expert rank would also take all of its experts with it
            raise InvalidArgumentError(
                "expert_ranks", list(self.expert_ranks), "cannot be combined with "
                "on_peer_loss='mask' (M2N is an expert map, and masking runs its own): use "
                "on_peer_loss='raise' (docs/M2N.md, Limits)")

    def _check_shape(self) -> None:
        for name in ("max_tokens_per_rank", "hidden", "num_topk", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidArgumentError(name, value, "must be a positive integer")
            object.__setattr__(self, name, int(value))
        self._check_expert_map()
        if self.expert_ranks is not None:
            if self.expert_map is not None:
                raise InvalidArgumentError(
                    "expert_ranks", self.expert_ranks, "cannot be combined with expert_map (an "
                    "M2N placement is an expert map of its own)")
            object.__setattr__(self, "expert_ranks",
                               check_expert_ranks(self.expert_ranks, self.num_experts))
        if self.expert_map is None and self.num_topk > self.num_experts:
            raise InvalidArgumentError(
                "num_topk", self.num_topk, f"must be <= num_experts={self.num_experts}"
            )
        dt = _dt.dtype_of(self.dtype, argument="dtype")
        object.__setattr__(self, "dtype", dt.name)
        cdt_raw = self.combine_dtype
        if cdt_raw is None:
            cdt_raw = dt.name if dt.is_float else "bf16"
        cdt = _dt.dtype_of(cdt_raw, argument="combine_dtype")
        if not cdt.is_float:
            raise InvalidArgumentError("combine_dtype", cdt.name, "must be bf16, fp16 or fp32")
        if dt.is_float and cdt != dt:
            raise InvalidArgumentError(
                "combine_dtype", cdt.name, f"must equal dtype ({dt.name}) for a float payload"
            )
        object.__setattr__(self, "combine_dtype", cdt.name)
        self._check_quant(dt)

    def _check_expert_map(self) -> None:
        m = self.expert_map
        if m is None:
            return
        if not isinstance(m, ExpertMap):
            m = ExpertMap(m)  # validates, naming expert_map
            object.__setattr__(self, "expert_map", m)
        m.check_shape(self.num_experts, self.num_topk)

    def _check_quant(self, dt: _dt.DType) -> None:
        if not isinstance(self.quant_round_scale, bool):
            raise InvalidArgumentError("quant_round_scale", self.quant_round_scale,
                                       "must be True or False")
        if self.quant is None:
            return
        _choice("quant", self.quant, QUANTS)
        if not dt.is_float:
            raise InvalidArgumentError("dtype", dt.name, "quant needs a float x (bf16, fp16, fp32)")
        if self.hidden % 128:
            raise InvalidArgumentError(
                "hidden", self.hidden, "must be a multiple of 128 with quant (one scale per "
                "128 channels)")

    def _check_transport(self) -> None:
        _choice("layout", self.layout, BUFFER_LAYOUTS)
        _choice("engine", self.engine, ENGINES)
        _choice("sync", self.sync, (*SYNCS, "auto"))
        _choice("integrity", self.integrity, INTEGRITY)
        if self.transport is not None and not (isinstance(self.transport, str) and
                                               self.transport):
            raise InvalidArgumentError("transport", self.transport,
                                       "must be None or a registered engine's name")
        if self.sync == "auto":
            object.__setattr__(self, "sync", AUTO_SYNC)
        if self.sync == "sp" and self.quant is not None:
            raise InvalidArgumentError(
                "sync", "sp", f"quantised rows ({self.quant} values and float32 scales) have "
                "no bit pattern free for a sentinel: use sync='sw', 'tff' or 'dc'")
        if self.sync == "sp" and _dt.dtype_of(self.dtype).sentinel is None:
            raise InvalidArgumentError(
                "sync", "sp",
                f"{self.dtype} payloads have no bit pattern free for a sentinel: use "
                "sync='tff' or sync='dc'",
            )

    def _check_execution(self) -> None:
        _choice("policy", self.policy, POLICIES)
        if self.num_cores is not None and (
            isinstance(self.num_cores, bool) or not isinstance(self.num_cores, int)
            or not 1 <= self.num_cores <= 256
        ):
            raise InvalidArgumentError("num_cores", self.num_cores, "must be None or in [1, 256]")
        if self.threads is not None and not isinstance(self.threads, bool):
            raise InvalidArgumentError("threads", self.threads, "must be None, True or False")
        if self.background is not None and not isinstance(self.background, bool):
            raise InvalidArgumentError("background", self.background,
                                       "must be None, True or False")

    def _check_formats(self) -> None:
        flag = self.tff_flag_bytes
        if not isinstance(flag, int) or flag < 8 or flag % 8:
            raise InvalidArgumentError("tff_flag_bytes", flag, "must be >= 8, a multiple of 8")
        block = self.tff_block_bytes
        if not isinstance(block, int) or block % 64 or block <= flag:
            raise InvalidArgumentError(
                "tff_block_bytes", block, f"must be a multiple of 64 larger than {flag}"
            )
        check = self.sp_check_bytes
        if isinstance(check, bool) or not isinstance(check, int) or check < 0 or check % 8:
            raise InvalidArgumentError("sp_check_bytes", check, "must be >= 0, a multiple of 8")


def _choice(name: str, value: object, options: tuple[str, ...]) -> None:
    if value not in options:
        raise InvalidArgumentError(name, value, f"must be one of {options}")
