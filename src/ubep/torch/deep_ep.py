"""DeepEP's ``Buffer`` on ubep: a DeepEP program runs on CPUs by changing its import.

::

    import deep_ep                   ->  from ubep import deep_ep
    from deep_ep import Buffer       ->  from ubep.deep_ep import Buffer

(``ubep.deep_ep`` re-exports this module, ``ubep.torch.deep_ep``; the value types live in
``ubep.torch.deep_ep_types``, the FP8 casts in ``ubep.torch.fp8``.)

    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True, ...)

The API is DeepEP's V1 ``Buffer`` as DeepEP's head has it (``deep_ep/buffers/legacy.py``,
formerly ``deep_ep/buffer.py``): the constructor with its parameter names and positional order,
every method of the intranode, internode and low-latency paths, the same defaults and the same
returned tuples. ``group`` is a ``torch.distributed`` process group (as in DeepEP), a ubep group
(``ubep.launch``, ``ubep.mpi``), or ``None`` with ``comm=`` an mpi4py communicator (ubep's MPI
engine, across hosts too); :class:`ubep.torch.LocalBackend` (threads as ranks) is accepted for
tests.

Normal-mode ``dispatch``/``combine`` (and the internode pair, :mod:`.deep_ep_internode`) run on
ubep buffers with ``layout="rank"`` (one row per (token, destination rank), DeepEP's normal
mode); the low-latency pair on ``layout="expert"`` (one row per (token, expert), packed per
local expert). The data always moves through ubep's engines, never through the torch backend.
ubep buffers are created on first use per shape; that first call is collective, as every call
is. With ``enable_shrink`` the low-latency pair runs on masking Buffers and a lost rank is
masked as DeepEP's shrink mode masks it (:mod:`.deep_ep_shrink`). Calls are synchronous, so
events and receive hooks have nothing left to wait for. Handles are frozen dataclasses that
index and unpack like DeepEP's tuples and hold the same values where a CPU has the same meaning.

docs/PORTING.md lists what still differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..trace.recorder import recording, traced_work
from . import deep_ep_checks as checks
from ._convert import to_numpy
from .backend import LocalBackend
from .deep_ep_checks import (
    check_ubep_options,
    facade_group,
)
from .deep_ep_core import Backends, Exchange, FacadeCore
from .deep_ep_internode import InternodePath, hosts_of
from .deep_ep_layouts import LayoutMemo, dispatch_layout
from .deep_ep_lowlatency import LowLatencyPath
from .deep_ep_m2n import M2NRoles, check_facade_expert_ranks
from .deep_ep_memory import RawBuffers
from .deep_ep_normal import NormalPath
from .deep_ep_shrink import MaskBuffer, open_shrink_group
from .deep_ep_types import (
    Config,
    EventHandle,
    EventOverlap,
    InternodeHandle,
    LowLatencyHandle,
    NormalHandle,
    _event,
    _Layout,
    topk_idx_t,
)
from .group import held

__all__ = [
    "Buffer",
    "Config",
    "EventHandle",
    "EventOverlap",
    "InternodeHandle",
    "LowLatencyHandle",
    "NormalHandle",
    "topk_idx_t",
]

# BufferConfig fields the facade sets itself from each call's shapes.
_SHAPE_FIELDS = (
    "max_tokens_per_rank", "hidden", "num_topk", "num_experts", "dtype", "layout", "combine_dtype"
)


# --------------------------------------------------------------------------- the Buffer
class Buffer:
    """DeepEP's ``Buffer`` on ubep (see the module docstring and docs/PORTING.md).

    Arguments as DeepEP's, in its order. ``num_nvl_bytes`` and ``num_rdma_bytes`` size the raw
    buffers of :meth:`get_local_buffer_tensor` (ubep sizes its own memory from the calls'
    shapes); ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl`` and
    keyword-only ``use_fabric`` (DeepEP v1.2's, before ``explicitly_destroy``) configure
    NVLink/RDMA/NVSHMEM and are kept as attributes. ``explicitly_destroy`` allows
    :meth:`destroy`. ``enable_shrink``: DeepEP's shrink mode (the mask buffer; a lost rank is
    masked, ``ubep.torch.deep_ep_shrink``). ubep's own keyword-only options:
    ``max_tokens_per_rank`` (normal-mode capacity per rank; the low-latency pair uses its
    ``num_max_dispatch_tokens_per_rank``) and any ``ubep.BufferConfig`` field that is not a
    shape (``engine``, ``sync``, ``timeout_s``, ...), checked here.

    ``expert_ranks=(...)``: the low-latency pair's M2N mode (:mod:`.deep_ep_m2n`).

    Attributes (DeepEP's): ``num_sms``, ``rank``, ``group_size``, ``group``, ``num_nvl_bytes``,
    ``num_rdma_bytes``, ``low_latency_mode``, ``explicitly_destroy``, ``enable_shrink``; ubep's
    ``core``, what its call paths share (:class:`.deep_ep_core.FacadeCore`; the V2 buffers are
    built over it). Each mode's calls run in a path the Buffer holds (low-latency, internode,
    the mask buffer: ``ubep.torch.deep_ep_lowlatency``, ``deep_ep_internode``,
    ``deep_ep_shrink``); its methods of those modes hand each call to it.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
        *,
        use_fabric: bool = False,
        max_tokens_per_rank: int = 4096,
        expert_ranks: Any = None,
        **ubep_options: Any,
    ) -> None:
        check_ubep_options(ubep_options, _SHAPE_FIELDS)
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(name, value, "must be an int >= 0 (bytes)")
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or (
            max_tokens_per_rank < 1
        ):
            raise InvalidArgumentError(
                "max_tokens_per_rank", max_tokens_per_rank, "must be a positive integer"
            )
        ep = facade_group(group, comm)
        self._group = held(group if group is not None else comm)  # torch's to free
        self.rank = int(ep.rank)
        self.group_size = int(ep.num_ranks)
        gate = checks.CallGate(ep, self.rank)  # calls in step across Buffers
        self.expert_ranks = check_facade_expert_ranks(
            expert_ranks, self.group_size, enable_shrink, isinstance(ep, LocalBackend))
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.max_tokens_per_rank = max_tokens_per_rank
        roles = {} if self.expert_ranks is None else {"expert_ranks": self.expert_ranks}
        self.ubep_options = ubep_options | roles  # M2N's roles reach each call's BufferConfig
        self._raw = RawBuffers(ep, {False: num_nvl_bytes, True: num_rdma_bytes})
        # the MPI group this facade made from comm= is its own to close (destroy)
        self._own_group = ep if group is None else None
        shrink = open_shrink_group(ep, self.ubep_options) if enable_shrink else None
        self.core = FacadeCore(
            ep=ep, rank=self.rank, group_size=self.group_size,
            host_of=hosts_of(ep, self.group_size), max_tokens_per_rank=max_tokens_per_rank,
            options=self.ubep_options,
            roles=M2NRoles(self.rank, self.group_size, self.expert_ranks), shrink=shrink,
            gate=gate, backends=Backends(ep, self.ubep_options, gate, shrink, self.group_size),
            exchange=Exchange(ep, self.rank))  # the calls' exchanges: opened by the first
        self._low_latency = LowLatencyPath(self.core)
        self._internode = InternodePath(self.core)
        self._mask = MaskBuffer(self.core)
        self._layouts = LayoutMemo()  # the last get_dispatch_layout, for the dispatch after it
        self._normal = NormalPath(self.core, self._layouts, self.rank, self.group_size,
                                  self.max_tokens_per_rank)
        # whether a normal-mode decode step may take the one-call path (_decode_dispatch): one
        # host, ubep's host engines (their results numpy), no shrink mode, no M2N roles
        self._host_decode = (self._low_latency.padded and self.core.num_hosts == 1
                             and self.core.roles.expert_ranks is None)

    # ------------------------------------------------------------------ static helpers
    @property
    def group(self) -> Any:
        """The ``group`` (or ``comm``) given, as DeepEP keeps it; a torch group is held weakly
        (``None`` once ``dist.destroy_process_group`` freed it: docs/PORTING.md, teardown)."""
        return self._group()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 (e4m3) payloads work, the capability DeepEP's SM90 build gates."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Kept for DeepEP code (ubep's cores are threads, see ``BufferConfig.num_cores``)."""
        if new_num_sms % 2:
            raise InvalidArgumentError("new_num_sms", new_num_sms, "must be even (as DeepEP)")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A default :class:`Config` for any rank count (DeepEP: a table of tuned ones)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of BF16 receive rows a rank may need in low-latency mode (informational)."""
        return int(num_max_dispatch_tokens_per_rank * num_ranks * hidden * 2 * 2)

    def get_comm_stream(self) -> Any:
        """The CPU stream (calls run on the caller's thread; there is no communication stream)."""
        return torch.cpu.current_stream()

    def destroy(self) -> None:
        """Release every ubep buffer of this facade, and the MPI group it made from ``comm``
        (needs ``explicitly_destroy=True``, as DeepEP's; collective then)."""
        if not self.explicitly_destroy:
            raise InvalidArgumentError("explicitly_destroy", False, "must be set to call destroy()")
        self.core.backends.close()  # later calls raise: this Buffer was destroyed
        self._low_latency.close()
        self._raw.close()
        self.core.exchange.close()
        if self.core.shrink is not None:
            self.core.shrink.close()
        if self._own_group is not None:
            self._own_group.close()  # frees its MPI windows (collective, as DeepEP's destroy)

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """This rank's raw buffer as a ``dtype`` tensor (DeepEP's): the NVL buffer of
        ``num_nvl_bytes``, or with ``use_rdma_buffer`` the RDMA one of ``num_rdma_bytes``, from
        byte ``offset``; the first ``size.numel()`` elements shaped ``size`` when given. The
        memory is this rank's region of the group's shared memory, mapped by every peer; the
        first request of each buffer maps it and is collective (``ubep.torch.deep_ep_memory``)."""
        self.core.check_alive()
        return self._raw.tensor(dtype, size, offset, use_rdma_buffer)

    def get_peer_buffer_tensor(
        self,
        rank: int,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """ubep's addition: :meth:`get_local_buffer_tensor` of peer ``rank``, the memory DeepEP's
        kernels reach through NVLink (one host; a view, so writes go both ways)."""
        self.core.check_alive()
        return self._raw.tensor(dtype, size, offset, use_rdma_buffer, rank=rank)

    # ------------------------------------------------------------------ internals
    def _check_normal_mode(self) -> None:
        self.core.roles.check_no_m2n()
        if self.core.shrink is not None:
            raise InvalidArgumentError(
                "enable_shrink", True, "normal-mode dispatch/combine do not mask ranks (DeepEP's "
                "shrink mode is its low-latency pair's): use a Buffer without enable_shrink")

    # ------------------------------------------------------------------ normal mode
    @traced_work("deep_ep.get_dispatch_layout")
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
        is_token_in_rank, event)``; counts are int32 like DeepEP's. ``num_tokens_per_rdma_rank``
        (tokens per host) is None when the group is on one host, as DeepEP's intranode one."""
        idx = to_numpy(topk_idx, argument="topk_idx")
        lay = dispatch_layout(idx, num_experts, self.group_size)
        per_host = None
        if self.core.num_hosts > 1:
            per_host = torch.from_numpy(
                self.core.tokens_per_host(lay.is_token_in_rank).sum(axis=0).astype(np.int32))
        # the counts are the caller's; the routing the memo reads (is_token_in_rank) its own
        outputs = (torch.from_numpy(lay.num_tokens_per_rank), per_host,
                   torch.from_numpy(lay.num_tokens_per_expert),
                   torch.from_numpy(lay.is_token_in_rank.copy()))
        self._layouts.remember(idx, lay, outputs)
        return (*outputs, _event(async_finish))

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: NormalHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any, EventOverlap]:
        """Normal-mode dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)``.

        Rows go to the ranks marked in ``is_token_in_rank`` (computed from ``topk_idx`` when only
        that is given); without ``topk_idx``/``topk_weights``, ``recv_topk_idx`` and
        ``recv_topk_weights`` are None, as in DeepEP. With ``handle`` (cached mode, e.g. the
        backward of combine) the rows follow the handle and only ``recv_x`` is returned. With
        ``num_worst_tokens > 0`` the outputs have that many rows (the received ones first,
        ``recv_topk_idx`` -1 after them) and the per-expert list is empty.
        """
        if (handle is None and num_worst_tokens == 0 and not async_finish
                and previous_event is None and self._host_decode and not recording()):
            # a decode step's call goes straight to its Buffer, whose errors reach every rank
            # (nothing before it raises: the gate has nothing to tell)
            got = self._normal.decode_dispatch(
                x, _Layout(num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                           num_tokens_per_expert), topk_idx, topk_weights, expert_alignment)
            if got is not None:
                return got
        return self._checked_dispatch(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            config, previous_event, async_finish, allocate_on_comm_stream)

    @traced_work("deep_ep.dispatch")
    def _checked_dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: NormalHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any, EventOverlap]:
        """:meth:`dispatch` through the facade's checks and its call gate."""
        self._check_normal_mode()
        if isinstance(handle, InternodeHandle) or (self.core.num_hosts > 1 and handle is None):
            # the group spans hosts: DeepEP's internode path (it refuses num_worst_tokens there)
            if num_worst_tokens:
                raise InvalidArgumentError("num_worst_tokens", num_worst_tokens,
                                           "internode dispatch does not support it (as DeepEP)")
            return self.internode_dispatch(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, config,
                previous_event, async_finish, allocate_on_comm_stream)
        return self._normal.dispatch(
            x, handle, _Layout(num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                               num_tokens_per_expert), topk_idx=topk_idx,
            topk_weights=topk_weights, expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens, async_finish=async_finish)

    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Normal-mode combine (sum without weights): ``(combined_x, combined_topk_weights,
        event)``; ``topk_weights [rows, num_topk]`` are summed the same way (float32). ``x`` has
        one row per received row (or ``num_worst_tokens`` rows, the padding ignored). An
        :class:`InternodeHandle` goes to :meth:`internode_combine`, as in DeepEP."""
        if (bias is None and not async_finish and previous_event is None and self._host_decode
                and not recording()):
            # a decode step's call goes straight to its Buffer (nothing before it raises)
            got = self._normal.decode_combine(x, handle, topk_weights)
            if got is not None:
                return got
        return self._checked_combine(x, handle, topk_weights, bias, config, previous_event,
                                     async_finish, allocate_on_comm_stream)

    @traced_work("deep_ep.combine")
    @checks.gated
    def _checked_combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
        config: Config | None,
        previous_event: EventOverlap | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """:meth:`combine` through the facade's checks and its call gate."""
        self._check_normal_mode()
        if isinstance(handle, InternodeHandle):
            return self.internode_combine(x, handle, topk_weights, bias, config, previous_event,
                                          async_finish, allocate_on_comm_stream)
        return self._normal.combine(x, handle, topk_weights, bias, async_finish)

    # ------------------------------------------------------------------ internode pair
    def internode_dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: InternodeHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any,
               EventOverlap]:
        """DeepEP's internode dispatch: what ``dispatch`` returns, with an
        :class:`InternodeHandle` (cached with ``handle``: only ``recv_x``).
        ``num_tokens_per_rdma_rank`` (``[num_hosts]``, as ``get_dispatch_layout`` gives it) is
        checked against the routing when given."""
        return self._internode.dispatch(
            self._normal.dispatch, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
            is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
            async_finish)

    def internode_combine(
        self,
        x: torch.Tensor,
        handle: InternodeHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """DeepEP's internode combine (the sum without weights, as ``combine``)."""
        return self._internode.combine(self._normal.combine, x, handle, topk_weights, bias,
                                       async_finish)

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """``(recv_x, recv_count, handle, event, hook)``. ``recv_x`` is
        ``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]`` BF16, or
        with ``use_fp8`` a tuple (FP8 e4m3 values, ``[..., hidden // 128]`` float32 scales, or
        with ``use_ue8m0`` ``[..., hidden // 512]`` int32 packed UE8M0 exponents); only the first
        ``recv_count[e]`` rows of expert ``e`` are valid (the rest are zero).

        ``return_recv_hook``: the call returns once this rank's rows are sent, with ``hook``
        (else None), which receives: ``recv_x``, ``recv_count`` and ``handle`` hold the data
        only after it ran (as DeepEP). ``async_finish``: the same, received by
        ``event.current_stream_wait()`` (DeepEP refuses both at once, so does ubep)."""
        if not (async_finish or return_recv_hook or recording()):
            # a decode step's call goes straight to its Buffer, whose errors reach every rank
            # (nothing before it raises: the gate has nothing to tell)
            got = self._low_latency.decode_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0)
            if got is not None:
                return got
        return _checked_low_latency_dispatch(
            self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
            round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Reduce **with weights**: ``(combined_x [num_tokens, hidden], event, hook)``; ``x`` is
        the packed ``[num_local_experts, slots, hidden]`` expert output (ignored with
        ``zero_copy``: the rows come from :meth:`get_next_low_latency_combine_buffer`).
        ``topk_idx`` is the dispatch's, where a slot may be set to -1 to drop it.
        ``return_recv_hook`` / ``async_finish``: as :meth:`low_latency_dispatch`; the combined
        ``x`` holds the sums once the hook (or the event's wait) ran."""
        if not (zero_copy or async_finish or return_recv_hook or out is not None
                or recording()):
            # a decode step's call goes straight to its Buffer, whose errors reach every rank
            # (nothing before it raises: the gate has nothing to tell)
            y = self._low_latency.decode_combine(x, topk_idx, topk_weights, handle)
            if y is not None:
                return y, EventOverlap(None), None
        return _checked_low_latency_combine(
            self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The tensor ``low_latency_combine(..., zero_copy=True)`` reads the expert outputs from:
        ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` BF16, to
        fill in place. Not collective. That combine packs the valid rows straight into ubep's
        combine buffer in shared memory (``ubep.Buffer.get_combine_buffer``), which the reduce
        then reads without another copy; ``x`` is ignored, as DeepEP."""
        return self._low_latency.next_combine_buffer(handle)

    # ------------------------------------------------------------------ shrink mode
    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Nothing to clean (every ubep flag carries its call's epoch, so buffers never need
        it). In shrink mode a barrier of the members, as DeepEP's clean is: a rank that does
        not come is masked."""
        self._mask.clean()

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask ``rank_to_mask`` (``mask=True``): later calls neither send to nor receive from
        it. Collective over the members, unlike DeepEP's: every member calls it (as every
        DeepEP rank must, or its kernels wait for the rank) and the members agree; the masked
        rank, if it takes part, learns it is masked (its next call raises). Unmasking a rank
        that is not masked does nothing; a masked rank comes back only as a new process
        (``ubep.Buffer.rejoin``, docs/ELASTIC.md), so unmasking it is refused."""
        self._mask.update(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Fill ``mask_status`` (``[num_ranks]`` int32, as DeepEP) with 1 for a masked rank, 0
        else: the same on every member. Local."""
        self._mask.query(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Does nothing. DeepEP zeroes its mask, and its next calls mask the lost ranks again
        after a timeout; here a masked rank is lost or was told it is masked, so it stays
        masked (the state DeepEP returns to, without the wait)."""
        self._mask.clean_mask()


# The facade's checked calls (what a call that is not a decode step's goes through): a named
# span while a Recorder records, and the call gate, which fails a bad argument on every rank.
@traced_work("deep_ep.low_latency_dispatch")
@checks.gated
def _checked_low_latency_dispatch(
    self: Buffer, *args: Any,
) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
    return self._low_latency.dispatch(*args)


@traced_work("deep_ep.low_latency_combine")
@checks.gated
def _checked_low_latency_combine(
    self: Buffer, *args: Any,
) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
    return self._low_latency.combine(*args)
