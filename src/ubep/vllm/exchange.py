"""The expert-parallel exchange vLLM's all2all manager runs on: ubep Buffers on one group.

vLLM's MoE layer hands its all2all manager a rank's tokens after routing (``hidden_states``,
``topk_weights``, global ``topk_ids``) and expects back what its experts kernel runs on, then
hands the kernel's output to ``combine`` and expects the rank's own tokens' sums. Here:

* **dispatch** sends each token once to every rank that holds one of its experts (ubep's rank
  layout: a row per (token, destination rank), never to a rank with none of its experts), and
  returns the received rows with this rank's *local* expert ids: vLLM's CPU experts kernel
  indexes its weights by them directly (it does not read the layer's expert map). A slot whose
  expert lives elsewhere gets the row's own local expert and weight 0: the kernel takes every
  id as valid, so a placeholder must be one of this rank's experts, and weight 0 adds nothing
  (the expert's output of a finite row is finite).
* **combine** sends each row's partial sum (this rank's experts, already weighted by the
  kernel) back to the token's rank, which adds the ranks' rows: ``y[t] = sum_k w[t,k] *
  expert_k(x[t])``.

Experts are placed as vLLM's ``linear`` placement (and DeepEP) places them: rank ``r`` holds
``[r * E / R, (r + 1) * E / R)``. A Buffer is built on first use per payload shape (``hidden``,
dtype, ``num_topk``): every rank meets the same layers in the same order, so the collective
construction lines up.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..buffer import Buffer
from ..closing import Closing
from ..config import BufferConfig
from ..errors import InvalidArgumentError, UbepError
from ..handle import DispatchHandle

__all__ = ["EpExchange", "ExchangeStats", "local_topk"]

# torch dtype -> (ubep payload name, numpy storage dtype); bf16 travels as its uint16 bits
_PAYLOADS: dict[torch.dtype, tuple[str, np.dtype]] = {
    torch.float32: ("fp32", np.dtype(np.float32)),
    torch.bfloat16: ("bf16", np.dtype(np.uint16)),
    torch.float16: ("fp16", np.dtype(np.float16)),
}


@dataclass
class ExchangeStats:
    """Time spent inside ubep's calls (benchmarks read it: the MoE layer's share)."""

    dispatch_ns: int = 0
    combine_ns: int = 0
    calls: int = 0
    recv_rows: int = 0  # rows dispatch delivered here (combine sends as many back)


def _storage(t: torch.Tensor, argument: str) -> np.ndarray:
    """The numpy storage view of a CPU tensor (bf16 as uint16 bits), contiguous."""
    if t.device.type != "cpu":
        raise InvalidArgumentError(argument, str(t.device), "must be a CPU tensor")
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy()


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``a``'s memory (read-only receive views included: nothing writes them)."""
    arr = np.ascontiguousarray(a)
    if not arr.flags.writeable:
        # torch warns on a read-only array; the kernel only reads the rows, and a writable
        # copy would cost a memcpy of every received row
        arr = np.asarray(_Writable(arr))
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class _Writable:
    """A read-only array's memory as a writable array interface (a Buffer's receive view;
    torch shares only writable arrays' memory). It holds the array, so the memory stays."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr
        iface = dict(arr.__array_interface__)
        iface["data"] = (iface["data"][0], False)
        self.__array_interface__ = iface


def local_topk(recv_topk_idx: np.ndarray, recv_topk_weights: np.ndarray,
               ids_dtype: torch.dtype, weights_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-layout ``recv_topk_idx`` (local ids, -1 where the expert lives elsewhere) as the
    ids and weights vLLM's experts kernel takes: every -1 becomes the row's largest local id
    (a row comes here only for an expert it holds, so there is one), its weight 0."""
    idx = torch.from_numpy(np.ascontiguousarray(recv_topk_idx))
    weights = torch.from_numpy(np.ascontiguousarray(recv_topk_weights))
    if idx.numel():
        held = idx.max(dim=1, keepdim=True).values
        idx = torch.where(idx < 0, held, idx)
    return idx.to(ids_dtype), weights.to(weights_dtype)


class EpExchange(Closing):
    """dispatch/combine of one expert-parallel group, as vLLM's all2all manager calls them.

    Args:
        group: the group the Buffers run on (vLLM's EP group: a ``torch.distributed`` gloo
            group, its ubep group from :func:`ubep.vllm.hosts.ep_group`, or any group
            ``ubep.Buffer`` takes).
        num_experts: global experts of the model (a multiple of the group's ranks).
        max_tokens_per_rank: most tokens a rank dispatches in one call (vLLM's
            ``max_num_batched_tokens``).
        timeout_s: deadline of every wait inside one call (a lost peer raises instead).
        num_cores: threads per rank of each Buffer (1: vLLM's own threads do the compute).
    """

    def __init__(self, group: Any, *, num_experts: int, max_tokens_per_rank: int,
                 timeout_s: float = 60.0, num_cores: int = 1) -> None:
        self.group = group
        self.num_experts = int(num_experts)
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.timeout_s = float(timeout_s)
        self.num_cores = int(num_cores)
        if self.max_tokens_per_rank < 1:
            raise InvalidArgumentError("max_tokens_per_rank", max_tokens_per_rank, "must be >= 1")
        self.stats = ExchangeStats()
        self._buffers: dict[tuple[int, torch.dtype, int], Buffer] = {}
        self._pending: tuple[Buffer, DispatchHandle, torch.dtype] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _buffer(self, hidden: int, dtype: torch.dtype, num_topk: int) -> Buffer:
        key = (hidden, dtype, num_topk)
        buf = self._buffers.get(key)
        if buf is None:
            # across hosts (ubep's MPI engine) DC: rows and their record in one put, no flush
            # round trip per destination (docs/MULTIHOST.md); one host: the CPU default
            across_hosts = int(getattr(self.group, "num_hosts", 1)) > 1
            cfg = BufferConfig(
                max_tokens_per_rank=self.max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
                num_experts=self.num_experts, dtype=_PAYLOADS[dtype][0], layout="rank",
                sync="dc" if across_hosts else "auto", num_cores=self.num_cores,
                timeout_s=self.timeout_s)
            buf = self._buffers[key] = Buffer(self.group, cfg)
        return buf

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Send each token to the ranks of its experts (collective); returns the received rows,
        their weights and local expert ids (see the module's docstring)."""
        if self._closed:
            raise UbepError("the ubep exchange is closed")
        if hidden_states.dtype not in _PAYLOADS:
            raise InvalidArgumentError(
                "hidden_states", str(hidden_states.dtype),
                f"must be one of {sorted(str(d) for d in _PAYLOADS)} (quantised dispatch is "
                "not served)")
        if hidden_states.dim() != 2 or topk_ids.dim() != 2:
            raise InvalidArgumentError(
                "hidden_states", tuple(hidden_states.shape),
                "must be [num_tokens, hidden] with topk_ids [num_tokens, num_topk]")
        num_tokens, hidden = hidden_states.shape
        if num_tokens > self.max_tokens_per_rank:
            raise InvalidArgumentError(
                "hidden_states", num_tokens,
                f"more tokens than max_tokens_per_rank={self.max_tokens_per_rank} (vLLM's "
                "max_num_batched_tokens when the exchange was built)")
        with self._lock:
            buf = self._buffer(hidden, hidden_states.dtype, topk_ids.shape[1])
            x = _storage(hidden_states, "hidden_states")
            ids = topk_ids.detach().to(torch.int64).contiguous().numpy()
            weights = topk_weights.detach().to(torch.float32).contiguous().numpy()
            start = time.perf_counter_ns()
            res = buf.dispatch(x, ids, weights)
            self.stats.dispatch_ns += time.perf_counter_ns() - start
            self.stats.recv_rows += int(res.recv_x.shape[0])
            self._pending = (buf, res.handle, hidden_states.dtype)
        recv_ids, recv_weights = local_topk(res.recv_topk_idx, res.recv_topk_weights,
                                            topk_ids.dtype, topk_weights.dtype)
        return _tensor(res.recv_x, hidden_states.dtype), recv_weights, recv_ids

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Bring each received row's partial sum back to its token's rank (collective);
        returns ``[num_tokens, hidden]`` of the last dispatch's tokens."""
        with self._lock:
            if self._pending is None:
                raise UbepError("combine without a dispatch before it on this rank")
            buf, handle, dtype = self._pending
            self._pending = None
            out = _storage(expert_out.to(dtype), "expert_out")
            start = time.perf_counter_ns()
            y = buf.combine(out, handle)
            self.stats.combine_ns += time.perf_counter_ns() - start
            self.stats.calls += 1
        return _tensor(y, dtype)

    def close(self) -> None:
        """Close every Buffer (local; idempotent)."""
        self._closed = True
        buffers, self._buffers = list(self._buffers.values()), {}
        self._pending = None
        for buf in buffers:
            buf.close()
