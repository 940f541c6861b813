"""DeepEP's V2 API on ubep: ``ElasticBuffer`` (DeepEP 2.1's keywords) and ``EPBuffer`` (2.5's)
over one implementation, so a V2 program runs on CPUs by changing its import::

    from deep_ep import ElasticBuffer, EPHandle   ->  from ubep.deep_ep import ElasticBuffer, ...
    from deep_ep import EPBuffer, BufferAllocator ->  from ubep.deep_ep import EPBuffer, ...

``group`` is a ``torch.distributed`` process group, a ubep group (``ubep.launch``,
``ubep.mpi``), or ``None`` with ``comm=`` an mpi4py communicator, as for the V1 ``Buffer``
(:mod:`ubep.torch.deep_ep`), over whose core (``Buffer.core``) this facade reaches ubep's
engines (the rows of every call go through ubep Buffers, :mod:`ubep.torch.deep_ep_v2_calls`;
the load-balancing pair's through its region, :mod:`ubep.torch.deep_ep_v2_lb`).

Semantics are DeepEP's (its reference in ``deep_ep/utils/refs.py`` and its tests): the compact
and expanded layouts (:mod:`ubep.torch.deep_ep_v2_layout`), the combine's sum without router
weights in a fixed FP32 order, bias before the one final cast. Keywords that only tune GPU
resources (``num_sms``, ``num_qps``, ``num_allocated_qps``, ``sl_idx``,
``num_gpu_timeout_secs``, ``prefer_overlap_with_compute``, streams) are accepted without effect;
``num_cpu_timeout_secs`` is ubep's ``timeout_s``. Calls run on the caller's thread: events are
complete when returned, except ``defer_epilogue=True``'s, whose first wait finishes the call
(ubep's split-phase dispatch underneath). docs/PORTING.md lists every keyword.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .deep_ep import Buffer
from .deep_ep_memory import RawBuffers
from .deep_ep_types import EventHandle, EventOverlap
from .deep_ep_v2_calls import DEFAULT_NUM_SMS, V2Path
from .deep_ep_v2_lb import LoadBalancePath
from .deep_ep_v2_types import (
    BufferAllocator,
    EPHandle,
    get_num_allocation_alignment,
)
from .group import held

__all__ = [
    "EPBuffer",
    "ElasticBuffer",
    "get_logical_domain_size",
    "get_physical_domain_size",
]

_NOT_IMPLEMENTED = (
    "engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv",
    "create_agrs_session", "destroy_agrs_session", "agrs_new_session", "agrs_set_config",
    "agrs_get_inplace_tensor", "all_gather",
)


def _group_size(group: Any) -> int:
    size = getattr(group, "size", None)
    return int(size()) if callable(size) else int(group.num_ranks)


def get_physical_domain_size(group: Any) -> tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)``: ubep's hosts and ranks per host (a torch group
    or a one-host ubep group is one host)."""
    size = _group_size(group)
    hosts = getattr(group, "host_of", None)
    num_hosts = 1 if hosts is None else len(set(int(h) for h in hosts))
    return num_hosts, size // num_hosts


def get_logical_domain_size(group: Any) -> tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)`` = ``(1, num_ranks)``: ubep sends every row
    straight to its destination (DeepEP's direct mode), one logical scale-up domain."""
    return 1, _group_size(group)


def _check_int(name: str, value: Any, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(name, value, f"must be an int >= {low}")
    return value


class _V2Buffer:
    """The implementation both V2 classes share (see the module docstring): their calls run in
    the paths it holds (:class:`.deep_ep_v2_calls.V2Path`,
    :class:`.deep_ep_v2_lb.LoadBalancePath`), over the core of a V1 ``Buffer``."""

    _uids = itertools.count()

    def __init__(self, group: Any, *, num_bytes: int | None, num_max_tokens_per_rank: int,
                 hidden: int, num_topk: int, use_fp8_dispatch: bool, deterministic: bool,
                 allow_hybrid_mode: bool, allow_multiple_reduction: bool,
                 prefer_overlap_with_compute: bool, sl_idx: int | None, num_allocated_qps: int,
                 num_cpu_timeout_secs: float, num_gpu_timeout_secs: float,
                 explicitly_destroy: bool, lb_plan: BufferAllocator | None, num_lb_bytes: int,
                 comm: Any, ubep_options: dict[str, Any]) -> None:
        _check_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
        _check_int("num_allocated_qps", num_allocated_qps)
        _check_int("num_lb_bytes", num_lb_bytes)
        if num_bytes is not None:
            _check_int("num_bytes", num_bytes)
        if not num_cpu_timeout_secs > 0:
            raise InvalidArgumentError("num_cpu_timeout_secs", num_cpu_timeout_secs, "must be > 0")
        options = dict(ubep_options)
        options.setdefault("timeout_s", float(num_cpu_timeout_secs))
        # The V1 facade reaches ubep's engines and creates ubep Buffers per call shape.
        self._v1 = Buffer(group, comm=comm, explicitly_destroy=True,
                          max_tokens_per_rank=max(num_max_tokens_per_rank, 1), **options)
        core = self._v1.core
        self._calls = V2Path(core, num_max_tokens_per_rank, allow_multiple_reduction)
        self._group = held(group if group is not None else comm)  # torch's to free
        self.rank_idx, self.num_ranks = self._v1.rank, self._v1.group_size
        if num_bytes is None:  # informational, as the hint (ubep sizes per call shape)
            num_bytes = self.get_buffer_size_hint(
                core.ep, max(num_max_tokens_per_rank, 1), hidden, num_topk,
                use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.sl_idx = sl_idx
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        if num_allocated_qps == 0:  # DeepEP's default (no fast RDMA atomics on a CPU)
            num_allocated_qps = 129 if allow_hybrid_mode else 17
        self.num_allocated_qps = num_allocated_qps
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        hosts = core.host_of
        self.num_rdma_ranks = len(set(hosts.tolist()))
        self.num_nvlink_ranks = self.num_ranks // self.num_rdma_ranks
        self.num_lb_bytes = num_lb_bytes
        self._lb: RawBuffers | None = None
        if num_lb_bytes:
            self._lb = RawBuffers(core.ep, {False: num_lb_bytes, True: 0})
            region = self._lb.tensor(torch.uint8, None, 0, False)  # maps it (collective)
            if lb_plan is not None:
                lb_plan.materialize(region)
            self.lb_storage = region
        self._load_balance = LoadBalancePath(core, self._lb, self._calls.check_alive)
        self.runtime: Any = self  # DeepEP's C++ runtime; None once destroyed
        # as DeepEP, every rank constructed before any call; and the same
        # allow_multiple_reduction everywhere: where a combine's rows lie follows it
        # (deep_ep_v2_calls._BackPlan), and a combine carries no signature that would catch it
        everyone = core.exchange.allgather(bool(allow_multiple_reduction))
        if len(set(everyone)) != 1:
            if self._lb is not None:
                self._lb.close()
            self._v1.destroy()
            raise InvalidArgumentError(
                "allow_multiple_reduction", allow_multiple_reduction,
                f"differs between ranks (by rank: {everyone}): pass the same on every rank")

    # ------------------------------------------------------------------ DeepEP's calls
    @property
    def group(self) -> Any:
        """The ``group`` (or ``comm``) given, as DeepEP keeps it; a torch group is held weakly
        (``None`` once ``dist.destroy_process_group`` freed it: docs/PORTING.md, teardown)."""
        return self._group()

    def destroy(self) -> None:
        """Release the ubep Buffers and regions (collective; needs ``explicitly_destroy``)."""
        if not self.explicitly_destroy:
            raise InvalidArgumentError("explicitly_destroy", False,
                                       "must be set at construction to call destroy()")
        if self._calls.destroyed:
            return
        self._calls.flush()
        if self._lb is not None:
            self._lb.close()
        self._v1.destroy()
        self._calls.close()  # earlier handles are refused from now on, later calls raise
        self.runtime = None

    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Informational: bytes of the receive rows ubep's dispatch and combine of this shape
        use per rank, rounded up to 2 MiB (ubep sizes its memory per call; ``num_bytes`` is not
        a limit)."""
        ranks = _group_size(group)
        topk = max(num_topk, 1)
        row = hidden + 4 * -(-hidden // 128) if use_fp8_dispatch else 2 * hidden
        dispatch = ranks * num_max_tokens_per_rank * (row + 12 * topk)
        # a combine row holds a dispatched row's bytes as BF16 values (the rows go back through
        # the dispatch Buffer's own combine), and the weights' rows go back in float32
        combine = ranks * num_max_tokens_per_rank * (2 * row + 4 * topk)
        step = get_num_allocation_alignment()
        return -(-(dispatch + combine) // step) * step

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False,
                sequential: bool = True) -> None:
        """Every rank of the group reaches it (the keywords tune GPU streams: no effect)."""
        self._v1.core.exchange.allgather(None)

    @staticmethod
    def capture() -> EventHandle:
        """An event of the caller's stream (complete: calls run on the caller's thread)."""
        return EventHandle()

    def get_comm_stream(self) -> Any:
        return torch.cpu.current_stream()

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int,
                                num_scaleout_topk: int = 0, rdma_gbs: float = 0,
                                nvlink_gbs: float = 0, sm_read_gbs: float = 0,
                                sm_write_gbs: float = 0) -> int:
        """20 on CPU: DeepEP's bandwidth model picks GPU SMs, which ubep has none of; the count
        travels in the handle and every call accepts and ignores it."""
        if num_scaleout_topk != 0:
            raise InvalidArgumentError("num_scaleout_topk", num_scaleout_topk,
                                       "must be 0 (as DeepEP)")
        return DEFAULT_NUM_SMS

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's formula (QPs have no meaning on ubep): ``min(num_sms, 9)``, or ``num_sms *
        16 + 1`` with ``allow_hybrid_mode``, capped by ``num_allocated_qps``."""
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 8 + 1)
        return min(num_qps, self.num_allocated_qps)

    def __getattr__(self, name: str) -> Any:
        if name in _NOT_IMPLEMENTED:
            raise InvalidArgumentError(
                name, "called", "DeepEP's Engram, pipeline-parallel and all-gather/reduce-scatter "
                "calls are not implemented on ubep (its expert-parallel pair is)")
        raise AttributeError(name)

    # ------------------------------------------------------------------ redundant experts
    def lb_get_theoretical_num_sms(self) -> int:
        """20: accepted and ignored by both calls (the copies run on the caller's thread)."""
        return 20

    def lb_prefetch_weights(self, redundant_expert_weights: Sequence[torch.Tensor] | torch.Tensor,
                            expert_weights: Sequence[torch.Tensor] | torch.Tensor,
                            redundancy_mapping: torch.Tensor, num_sms: int = 0,
                            previous_event: Any = None) -> EventOverlap:
        """Fill every rank's redundant slots with the weights of the experts its row of
        ``redundancy_mapping`` names (collective; :mod:`ubep.torch.deep_ep_v2_lb`)."""
        return self._load_balance.prefetch_weights(redundant_expert_weights, expert_weights,
                                                   redundancy_mapping, previous_event)

    def lb_reduce_grads(self, redundant_expert_grads: torch.Tensor, expert_grads: torch.Tensor,
                        redundancy_mapping: torch.Tensor, num_sms: int = 0,
                        previous_event: Any = None) -> EventOverlap:
        """Add the FP32 gradients of this rank's experts' redundant copies (held by any rank)
        into ``expert_grads`` (collective; order in :mod:`ubep.torch.deep_ep_v2_lb`)."""
        return self._load_balance.reduce_grads(redundant_expert_grads, expert_grads,
                                               redundancy_mapping, previous_event)

    @staticmethod
    def num_lb_experts(t: torch.Tensor) -> int:
        return int(t.shape[0])


class ElasticBuffer(_V2Buffer):
    """DeepEP 2.1's ``ElasticBuffer`` on ubep (constructor and calls with 2.1's keywords).

    ``num_cpu_bytes`` (Engram's CPU storage) is accepted without effect; ubep's own keyword-only
    options: ``comm=`` (an mpi4py communicator, with ``group=None``) and any
    ``ubep.BufferConfig`` field that is not a shape (``engine``, ``sync``, ...).
    """

    def __init__(self, group: Any, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False, *,
                 comm: Any = None, **ubep_options: Any) -> None:
        _check_int("num_cpu_bytes", num_cpu_bytes)
        self.num_cpu_bytes = num_cpu_bytes
        super().__init__(
            group, num_bytes=num_bytes, num_max_tokens_per_rank=num_max_tokens_per_rank,
            hidden=hidden, num_topk=num_topk, use_fp8_dispatch=use_fp8_dispatch,
            deterministic=deterministic, allow_hybrid_mode=allow_hybrid_mode,
            allow_multiple_reduction=allow_multiple_reduction,
            prefer_overlap_with_compute=prefer_overlap_with_compute, sl_idx=sl_idx,
            num_allocated_qps=num_allocated_qps, num_cpu_timeout_secs=num_cpu_timeout_secs,
            num_gpu_timeout_secs=num_gpu_timeout_secs, explicitly_destroy=explicitly_destroy,
            lb_plan=None, num_lb_bytes=0, comm=comm, ubep_options=ubep_options)

    def dispatch(self, x: Any, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Any = None, previous_event_before_epilogue: Any = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False
                 ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``. With
        ``do_handle_copy`` (2.1's default) the handle holds a clone of ``topk_idx``."""
        if do_handle_copy and handle is None and isinstance(topk_idx, torch.Tensor):
            topk_idx = topk_idx.clone()
        result: tuple[Any, Any, Any, EPHandle, EventOverlap] = self._calls.dispatch(
            x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
            num_max_tokens_per_rank, expert_alignment, num_sms, previous_event,
            previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream,
            handle, do_cpu_sync, do_expand, do_zero_padding, False,
            use_tma_aligned_col_major_sf, False)
        return result

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                num_sms: int = 0, num_qps: int = 0, previous_event: Any = None,
                previous_event_before_epilogue: Any = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """``(combined_x, combined_topk_weights, event)``: the rows summed back at each token's
        source (no router weights applied), ``bias`` added before the final cast."""
        result: tuple[torch.Tensor, torch.Tensor | None, EventOverlap] = self._calls.combine(
            x, handle, topk_weights, bias, previous_event, previous_event_before_epilogue,
            async_with_compute_stream, allocate_on_comm_stream, False)
        return result

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
        """DeepEP's arithmetic (Engram itself is not implemented on ubep)."""
        step, entry = get_num_allocation_alignment(), -(-hidden * dtype.itemsize // 32) * 32
        return (-(-entry * num_max_tokens_per_rank // step) * step,
                -(-entry * num_entries // step) * step)


class EPBuffer(_V2Buffer):
    """DeepEP 2.5's ``EPBuffer`` on ubep (constructor and calls with 2.5's keywords), with the
    redundant-expert pair ``lb_prefetch_weights`` / ``lb_reduce_grads``
    (:mod:`ubep.torch.deep_ep_v2_lb`). ``lb_allocation_plan_or_num_bytes``: a
    :class:`~ubep.torch.deep_ep_v2_types.BufferAllocator` plan (materialised in the LB region)
    or a byte count (a multiple of ``get_num_allocation_alignment()``), 0 for none."""

    def __init__(self, group: Any, num_bytes: int | None = None,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False,
                 lb_allocation_plan_or_num_bytes: BufferAllocator | int = 0,
                 deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int | None = None, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, comm: Any = None,
                 **ubep_options: Any) -> None:
        plan = lb_allocation_plan_or_num_bytes
        if isinstance(plan, BufferAllocator):
            if plan.materialized:
                raise InvalidArgumentError("lb_allocation_plan_or_num_bytes", "materialized",
                                           "this plan already belongs to a buffer")
            num_lb_bytes, lb_plan = plan.num_bytes, plan
        else:
            num_lb_bytes, lb_plan = _check_int("lb_allocation_plan_or_num_bytes", plan), None
            if num_lb_bytes % get_num_allocation_alignment():
                raise InvalidArgumentError(
                    "lb_allocation_plan_or_num_bytes", num_lb_bytes,
                    "must be a multiple of deep_ep.get_num_allocation_alignment() (2 MiB)")
        super().__init__(
            group, num_bytes=num_bytes, num_max_tokens_per_rank=num_max_tokens_per_rank,
            hidden=hidden, num_topk=num_topk, use_fp8_dispatch=use_fp8_dispatch,
            deterministic=deterministic, allow_hybrid_mode=allow_hybrid_mode,
            allow_multiple_reduction=allow_multiple_reduction,
            prefer_overlap_with_compute=prefer_overlap_with_compute, sl_idx=sl_idx,
            num_allocated_qps=num_allocated_qps, num_cpu_timeout_secs=num_cpu_timeout_secs,
            num_gpu_timeout_secs=num_gpu_timeout_secs, explicitly_destroy=explicitly_destroy,
            lb_plan=lb_plan, num_lb_bytes=num_lb_bytes, comm=comm, ubep_options=ubep_options)

    def dispatch(self, x: Any, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Any = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: EPHandle | None = None,
                 do_handle_copy: bool = False, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False,
                 emit_expert_ids: bool = False, use_tma_aligned_col_major_sf: bool = False,
                 defer_epilogue: bool = False) -> Any:
        """``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``; with
        ``defer_epilogue`` the event alone, whose first ``wait()`` returns the first four. The
        handle holds ``topk_idx`` by reference (``do_handle_copy`` must be False, as 2.5)."""
        refused = None
        if do_handle_copy:
            refused = InvalidArgumentError(
                "do_handle_copy", True, "must be False (DeepEP 2.5 no longer copies topk_idx; "
                "pass a clone of topk_idx if the caller will modify it)")
        return self._calls.dispatch(
            x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
            num_max_tokens_per_rank, expert_alignment, num_sms, previous_event, None,
            async_with_compute_stream, allocate_on_comm_stream, handle, do_cpu_sync, do_expand,
            do_zero_padding, emit_expert_ids, use_tma_aligned_col_major_sf, defer_epilogue,
            refused)

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                num_sms: int = 0, num_qps: int = 0, previous_event: Any = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                defer_epilogue: bool = False) -> Any:
        """``(combined_x, combined_topk_weights, event)``; with ``defer_epilogue`` the event
        alone, whose first ``wait()`` returns the first two."""
        return self._calls.combine(x, handle, topk_weights, bias, previous_event, None,
                                async_with_compute_stream, allocate_on_comm_stream,
                                defer_epilogue)
