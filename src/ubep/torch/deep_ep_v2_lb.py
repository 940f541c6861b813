"""DeepEP 2.5's redundant experts on ubep: ``EPBuffer.lb_prefetch_weights`` and
``lb_reduce_grads`` over the buffer's load-balancing (LB) region (:class:`LoadBalancePath`,
held by :class:`ubep.torch.deep_ep_v2.EPBuffer` and ``ElasticBuffer``).

The LB region is one shared-memory segment per rank that every peer maps (the facade's raw
buffers, :mod:`ubep.torch.deep_ep_memory`), planned with a ``BufferAllocator`` or sized in
bytes. ``redundancy_mapping[r, c]`` names the expert (in ``[0, num_ranks * num_local_experts)``)
whose copy lives in redundant slot ``c`` of rank ``r``, -1 for an empty slot; it must be the
same on every rank, as DeepEP requires.

* ``lb_prefetch_weights``: after a barrier (every slot is free), each rank writes its local
  experts' bytes into the slots of every rank that asked for them (a peer's region, as DeepEP's
  NVLink push), then a barrier makes them visible.
* ``lb_reduce_grads``: after a barrier (every rank wrote its redundant gradients), each rank
  adds into ``expert_grads`` the FP32 gradients of its experts' copies, in a fixed order: ranks
  ascending, then slots ascending, one FP32 add each; a last barrier keeps the slots until every
  rank has read them.

Like DeepEP's (NVLink only), both need the ranks on one host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._convert import to_numpy
from .deep_ep_types import EventHandle, EventOverlap
from .deep_ep_v2_types import get_num_tma_alignment

if TYPE_CHECKING:
    from .deep_ep_core import FacadeCore
    from .deep_ep_memory import RawBuffers

__all__ = ["LoadBalancePath"]


class LoadBalancePath:
    """The LB pair, held by a V2 buffer (its ``lb_*`` calls hand theirs to this one's) over the
    core of its V1 ``Buffer`` (:class:`.deep_ep_core.FacadeCore`: the group's exchanges) and
    its LB region (``lb``: None without one); ``check_alive`` raises once the buffer was
    destroyed."""

    def __init__(self, core: FacadeCore, lb: RawBuffers | None,
                 check_alive: Callable[[], None]) -> None:
        self.rank_idx = core.rank
        self.num_ranks = core.group_size
        self.exchange = core.exchange
        self.lb = lb
        self._check_alive = check_alive

    def prefetch_weights(self, redundant_expert_weights: Sequence[torch.Tensor] | torch.Tensor,
                         expert_weights: Sequence[torch.Tensor] | torch.Tensor,
                         redundancy_mapping: torch.Tensor, previous_event: Any) -> EventOverlap:
        """``lb_prefetch_weights`` (the buffer's docstring)."""
        dst = ([redundant_expert_weights] if isinstance(redundant_expert_weights, torch.Tensor)
               else list(redundant_expert_weights))
        src = [expert_weights] if isinstance(expert_weights, torch.Tensor) else list(expert_weights)
        plan, _ = self.exchange.agree(
            lambda: self._check_prefetch(dst, src, redundancy_mapping), lambda _: None)
        if previous_event is not None:
            previous_event.current_stream_wait()
        mapping, offsets = plan
        local = int(src[0].shape[0])
        self._barrier()  # every rank's slots are free to overwrite
        for r in range(self.num_ranks):
            peer = self._region(r)
            for c, expert in enumerate(mapping[r].tolist()):
                if expert < 0 or expert // local != self.rank_idx:
                    continue
                for i, (d, s) in enumerate(zip(dst, src, strict=True)):
                    slot_bytes = d.nbytes // d.shape[0]
                    begin = offsets[i] + c * slot_bytes
                    row = s[expert - self.rank_idx * local].contiguous().view(torch.uint8)
                    peer[begin: begin + slot_bytes] = to_numpy(row.reshape(-1))
        self._barrier()  # every slot written before anyone reads it
        return EventOverlap(EventHandle())

    def reduce_grads(self, redundant_expert_grads: torch.Tensor, expert_grads: torch.Tensor,
                     redundancy_mapping: torch.Tensor, previous_event: Any) -> EventOverlap:
        """``lb_reduce_grads`` (the buffer's docstring)."""
        plan, _ = self.exchange.agree(
            lambda: self._check_grads(redundant_expert_grads, expert_grads, redundancy_mapping),
            lambda _: None)
        if previous_event is not None:
            previous_event.current_stream_wait()
        mapping, offset = plan
        local = int(expert_grads.shape[0])
        slots, hidden = redundant_expert_grads.shape
        self._barrier()  # every rank wrote its redundant gradients
        for r in range(self.num_ranks):
            peer = self._region(r)[offset: offset + redundant_expert_grads.nbytes]
            grads = torch.from_numpy(np.array(peer)).view(torch.float32).view(slots, hidden)
            for c, expert in enumerate(mapping[r].tolist()):
                if expert >= 0 and expert // local == self.rank_idx:
                    expert_grads[expert - self.rank_idx * local] += grads[c]
        self._barrier()  # every rank read the slots before they may change
        return EventOverlap(EventHandle())

    # ------------------------------------------------------------------ internals
    def _barrier(self) -> None:
        self.exchange.allgather(None)

    def _region(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s LB region (bytes): this rank's, or a peer's mapped view."""
        assert self.lb is not None  # _offset_in_region checked it
        view: torch.Tensor = self.lb.tensor(torch.uint8, None, 0, False,
                                             rank=None if rank == self.rank_idx else rank)
        return view.numpy()

    def _offset_in_region(self, t: torch.Tensor, name: str) -> int:
        self._check_alive()
        if self.lb is None:
            raise InvalidArgumentError(
                name, "no LB region",
                "this buffer has none: pass lb_allocation_plan_or_num_bytes to EPBuffer")
        base = self._region(self.rank_idx)
        start = int(base.ctypes.data)
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise InvalidArgumentError(name, type(t).__name__, "must be a contiguous CPU tensor")
        offset = int(t.data_ptr()) - start
        if not 0 <= offset <= base.size - t.nbytes:
            raise InvalidArgumentError(
                name, "outside", "must reside in this buffer's LB region (a tensor of the "
                "BufferAllocator plan given as lb_allocation_plan_or_num_bytes)")
        return offset

    def _check_mapping(self, mapping: Any, slots: int) -> np.ndarray:
        if not isinstance(mapping, torch.Tensor) or mapping.dtype != torch.int32 or (
            tuple(mapping.shape) != (self.num_ranks, slots)
        ):
            raise InvalidArgumentError(
                "redundancy_mapping", getattr(mapping, "shape", mapping),
                f"must be [num_nvlink_ranks={self.num_ranks}, num_redundant_experts={slots}] "
                "torch.int32")
        return np.asarray(to_numpy(mapping, argument="redundancy_mapping"), dtype=np.int64)

    def _check_prefetch(self, dst: list[torch.Tensor], src: list[torch.Tensor],
                        mapping: Any) -> tuple[np.ndarray, list[int]]:
        if not dst or len(dst) != len(src):
            raise InvalidArgumentError(
                "expert_weights", len(src),
                f"needs one source per redundant tensor ({len(dst)}), at least one")
        offsets = [self._offset_in_region(d, "redundant_expert_weights") for d in dst]
        slots = int(dst[0].shape[0]) if dst[0].dim() else 0
        local = int(src[0].shape[0]) if src[0].dim() else 0
        for d, s in zip(dst, src, strict=True):
            if not isinstance(s, torch.Tensor) or s.dim() < 1 or s.shape[0] != local or local < 1:
                raise InvalidArgumentError("expert_weights", getattr(s, "shape", s),
                                           "each must be [num_local_experts > 0, ...], alike")
            if d.dim() < 1 or d.shape[0] != slots:
                raise InvalidArgumentError("redundant_expert_weights", tuple(d.shape),
                                           f"each must have {slots} slots")
            per_expert = s.nbytes // local
            if d.nbytes // max(slots, 1) != per_expert or per_expert % get_num_tma_alignment():
                raise InvalidArgumentError(
                    "expert_weights", per_expert,
                    "bytes per expert must equal its destination's bytes per slot and be a "
                    f"multiple of {get_num_tma_alignment()} (deep_ep.get_num_tma_alignment())")
        table = self._check_mapping(mapping, slots)
        if table.size and (table.min() < -1 or table.max() >= self.num_ranks * local):
            raise InvalidArgumentError("redundancy_mapping", "out of range",
                                       f"entries must be -1 or in [0, {self.num_ranks * local})")
        return table, offsets

    def _check_grads(self, redundant: Any, grads: Any, mapping: Any) -> tuple[np.ndarray, int]:
        offset = self._offset_in_region(redundant, "redundant_expert_grads")
        if redundant.dtype != torch.float32 or redundant.dim() != 2:
            raise InvalidArgumentError("redundant_expert_grads", redundant.dtype,
                                       "must be [num_redundant_experts, hidden] torch.float32")
        if not isinstance(grads, torch.Tensor) or grads.dtype != torch.float32 or (
            grads.dim() != 2 or grads.shape[1] != redundant.shape[1] or grads.shape[0] < 1
        ):
            raise InvalidArgumentError("expert_grads", getattr(grads, "shape", grads),
                                       f"must be [num_local_experts, {redundant.shape[1]}] "
                                       "torch.float32")
        table = self._check_mapping(mapping, int(redundant.shape[0]))
        if table.size and (table.min() < -1 or table.max() >= self.num_ranks * grads.shape[0]):
            raise InvalidArgumentError("redundancy_mapping", "out of range",
                                       "entries must be -1 or a valid expert id")
        return table, offset
