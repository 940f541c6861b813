"""DeepEP V2's value types on ubep (``ubep.torch.deep_ep_v2``): ``EPHandle``,
``BufferAllocator`` and the ``get_num_*_alignment`` helpers (DeepEP 2.5's constants)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidArgumentError

__all__ = [
    "BufferAllocator", "EPHandle", "get_num_allocation_alignment", "get_num_rdma_alignment",
    "get_num_tma_alignment",
]

_ALLOCATION_ALIGNMENT_BYTES = 2 * 1024 * 1024  # DeepEP's symmetric-memory granule
_TMA_ALIGNMENT_BYTES = 32
_RDMA_ALIGNMENT_BYTES = 64


def get_num_allocation_alignment() -> int:
    """Bytes every buffer size and LB allocation is aligned to (DeepEP's 2 MiB)."""
    return _ALLOCATION_ALIGNMENT_BYTES


def get_num_tma_alignment() -> int:
    """DeepEP's TMA alignment (32 bytes); an ``lb_prefetch_weights`` expert payload is a
    multiple of it, as DeepEP requires."""
    return _TMA_ALIGNMENT_BYTES


def get_num_rdma_alignment() -> int:
    """DeepEP's RDMA alignment (64 bytes), kept for programs that size with it."""
    return _RDMA_ALIGNMENT_BYTES


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class BufferAllocator:
    """DeepEP 2.5's allocation plan for an ``EPBuffer``'s load-balancing (LB) region: tensors
    planned before the buffer exists (``allocate`` returns a meta-device placeholder), placed
    back to back at ``get_num_allocation_alignment()`` boundaries; the buffer's constructor
    (``lb_allocation_plan_or_num_bytes=plan``) materialises them in its LB region, which every
    peer maps (shared memory), so the placeholders become views of it."""

    def __init__(self) -> None:
        self.alignment = get_num_allocation_alignment()
        self.allocations: list[tuple[torch.Tensor, int]] = []
        self.num_bytes = 0
        self.materialized = False

    def allocate(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        if self.materialized:
            raise InvalidArgumentError("BufferAllocator", "materialized",
                                       "a materialized allocation plan cannot be changed")
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        offset = _align(self.num_bytes, self.alignment)
        self.allocations.append((tensor, offset))
        self.num_bytes = _align(offset + tensor.nbytes, self.alignment)
        return tensor

    def materialize(self, storage: torch.Tensor) -> None:
        """Make every planned tensor a view of ``storage`` (uint8, ``num_bytes`` long)."""
        if self.materialized:
            raise InvalidArgumentError("BufferAllocator", "materialized",
                                       "an allocation plan can only be materialized once")
        if storage.dtype != torch.uint8 or storage.dim() != 1 or storage.numel() != self.num_bytes:
            raise InvalidArgumentError("storage", tuple(storage.shape),
                                       f"must be {self.num_bytes} uint8 bytes")
        for tensor, offset in self.allocations:
            value = storage.narrow(0, offset, tensor.nbytes).view(tensor.dtype).view(tensor.shape)
            torch.utils.swap_tensors(tensor, value)
        self.materialized = True


class _MadeWhenRead:
    """A tensor of an :class:`EPHandle`, made by its maker (``EPHandle._makers``) on the first
    read and the same tensor after."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, handle: Any, owner: type | None = None) -> Any:
        return self if handle is None else handle._field(self.name)


class EPHandle:
    """What V2's ``dispatch`` returns as ``handle``; ``combine`` and a cached dispatch take it.

    The fields are DeepEP's (``deep_ep/buffers/ep.py``); what they hold on ubep:

    Attributes:
        do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the
            dispatch's settings (``num_sms`` as passed or ``get_theoretical_num_sms``'s).
        topk_idx: the caller's ``topk_idx``, held by reference (a private clone with ElasticBuffer's
            ``do_handle_copy=True``); reading it after the caller modified it in place raises, as
            DeepEP 2.5's (the tensor's version counter; tensors made in inference mode have none
            and are not checked).
        num_recv_tokens: received rows (the worst case ``num_ranks * num_max_tokens_per_rank``
            without a CPU sync; the valid count is ``psum_num_recv_tokens_per_scaleup_rank[-1]``).
        num_expanded_tokens: rows of the expanded layout (its worst case without a CPU sync).
        num_recv_tokens_per_expert_list: rows per local expert, each rounded up to
            ``expert_alignment`` (empty without a CPU sync, as DeepEP).
        psum_num_recv_tokens_per_scaleup_rank: ``[num_ranks]`` int32 inclusive prefix sum of the
            rows from each source rank (ubep's logical domain is one scale-up domain).
        psum_num_recv_tokens_per_expert: ``[num_local_experts]`` int32; compact: inclusive
            prefix sum of the aligned counts; expanded: each expert's first row plus its count.
        num_unaligned_recv_tokens_per_expert: ``[num_local_experts]`` int32 actual counts.
        recv_src_metadata: ``[num_recv_tokens, num_topk + 2]`` int32: ``[:, 0]``
            ``src_rank * num_max_tokens_per_rank + src_token``, ``[:, 1]`` the row's index among
            the rows of its source rank, ``[:, 2:]`` (expanded) the expanded row of each local
            slot, -1 elsewhere; rows past the valid prefix are -1.
        dst_buffer_slot_idx: ``[num_tokens, num_topk]`` int32, the row of ``recv_x`` on the
            rank owning ``topk_idx[t, k]`` that holds token ``t``, -1 if masked.
        recv_expert_ids: 2.5's ``emit_expert_ids``: ``[num_expanded_tokens]`` int32 local expert
            of each expanded row, -1 on padding; else None.
        token_metadata_at_forward, channel_linked_list: None (DeepEP's hybrid mode only).
        dispatch_route: ubep's addition, what its combine needs of the dispatch (the receive
            side's rows, the sources' routing, the Buffer the rows went through).
    """

    def __init__(self, *, do_expand: bool, num_experts: int,
                 expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int,
                 topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list[int], num_valid_recv_tokens: int,
                 psum_num_recv_tokens_per_scaleup_rank: Callable[[], torch.Tensor],
                 psum_num_recv_tokens_per_expert: Callable[[], torch.Tensor],
                 num_unaligned_recv_tokens_per_expert: Callable[[], torch.Tensor],
                 recv_src_metadata: Callable[[], torch.Tensor],
                 dst_buffer_slot_idx: Callable[[], torch.Tensor],
                 recv_expert_ids: Callable[[], torch.Tensor | None], route: Any) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self._num_valid_recv_tokens = num_valid_recv_tokens
        # the tensors, each made when first read (a decode step reads none of them), then the
        # same tensor
        self._makers: dict[str, Callable[[], torch.Tensor | None]] = {
            "psum_num_recv_tokens_per_scaleup_rank": psum_num_recv_tokens_per_scaleup_rank,
            "psum_num_recv_tokens_per_expert": psum_num_recv_tokens_per_expert,
            "num_unaligned_recv_tokens_per_expert": num_unaligned_recv_tokens_per_expert,
            "recv_src_metadata": recv_src_metadata,
            "dst_buffer_slot_idx": dst_buffer_slot_idx, "recv_expert_ids": recv_expert_ids}
        self._made: dict[str, torch.Tensor | None] = {}
        self.token_metadata_at_forward: torch.Tensor | None = None
        self.channel_linked_list: torch.Tensor | None = None
        self.dispatch_route = route  # ubep's addition: what its combine needs of the dispatch
        self._topk_idx = topk_idx
        self._topk_idx_version = None if topk_idx.is_inference() else topk_idx._version

    # DeepEP's tensors of the handle, each made on its first read (_makers), then the same
    psum_num_recv_tokens_per_scaleup_rank = _MadeWhenRead()
    psum_num_recv_tokens_per_expert = _MadeWhenRead()
    num_unaligned_recv_tokens_per_expert = _MadeWhenRead()
    recv_src_metadata = _MadeWhenRead()
    dst_buffer_slot_idx = _MadeWhenRead()
    recv_expert_ids = _MadeWhenRead()  # None without emit_expert_ids

    def _field(self, name: str) -> torch.Tensor | None:
        made = self._made
        if name not in made:
            made[name] = self._makers[name]()
        return made[name]

    @property
    def topk_idx(self) -> torch.Tensor:
        self.check_topk_idx()
        return self._topk_idx

    def check_topk_idx(self) -> None:
        """Raise if the caller modified ``topk_idx`` since the dispatch (DeepEP 2.5's check)."""
        if self._topk_idx_version is not None and (
            self._topk_idx._version != self._topk_idx_version
        ):
            raise InvalidArgumentError(
                "topk_idx", "modified",
                "was modified in place after the dispatch that made this handle; the handle holds "
                "it by reference (dispatch again, or pass a clone to dispatch)")

    @property
    def num_valid_recv_tokens(self) -> int:
        """ubep's addition: the received rows (the valid prefix of every per-row output)."""
        return self._num_valid_recv_tokens
