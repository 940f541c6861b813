"""Adapter from the real runtime (``ubep.Buffer`` on a ``ubep`` process group) to
:class:`~ubep.torch.backend.EPBackend`.

The runtime's ``combine(expert_out, handle)`` weights the expert layout with the weights the
handle recorded at dispatch; :mod:`ubep.torch` sometimes needs other weights (unit weights for the
backward of dispatch, the weights a DeepEP-style caller passes to ``low_latency_combine``). The
handle is a frozen dataclass of plain arrays, so a copy with other ``topk_weights`` is exactly the
handle of a dispatch that had carried those weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..dtypes import dtype_of
from ..errors import InvalidArgumentError
from ..modes import Layout
from ._convert import TorchDispatchResult, from_numpy_as, on_host

__all__ = ["RuntimeBackend", "buffer_config", "host_bookkeeping", "make_backend",
           "ubep_dtype_name"]

def ubep_dtype_name(dtype: torch.dtype) -> str:
    """The ``ubep.dtypes`` name of a torch payload dtype (``torch.bfloat16`` -> ``"bf16"``;
    FP8 types -> ``"uint8"``)."""
    return dtype_of(dtype, argument="dtype").name


class RuntimeBackend:
    """A ``ubep.Buffer`` seen through the :class:`~ubep.torch.backend.EPBackend` protocol."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        group = buffer.group
        config = buffer.config
        self.group = group
        self.rank = int(group.rank)
        self.num_ranks = int(group.num_ranks)
        self.num_experts = int(config.num_experts)
        self.layout = str(config.layout)
        self.hidden = int(config.hidden)

    def dispatch(self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
                 x_scales: np.ndarray | None = None) -> Any:
        return _host_result(self.buffer.dispatch(
            x, topk_idx, np.asarray(topk_weights, dtype=np.float32), x_scales=x_scales))

    def combine(
        self, expert_out: np.ndarray, handle: Any, topk_weights: np.ndarray | None = None
    ) -> np.ndarray:
        return np.asarray(on_host(self.buffer.combine(expert_out,
                                                      self._weighted(handle, topk_weights))))

    def dispatch_tensor(self, x: torch.Tensor, topk_idx: np.ndarray,
                        topk_weights: np.ndarray) -> tuple[Any, torch.Tensor]:
        """:meth:`dispatch` of a tensor ``x``, handed to the Buffer as it is (its torch door
        views it in C; an engine that takes tensors gets it as it came): the result with its
        fields on the host (what the facade reads) and ``recv_x`` an owned tensor of ``x``'s
        dtype on the engine's device (a copy of the region's rows: a later dispatch refills
        them)."""
        got = self.buffer.dispatch(x, topk_idx, topk_weights)
        recv_x = got.recv_x
        if type(recv_x) is not torch.Tensor:  # an engine's numpy rows
            return got, from_numpy_as(np.array(recv_x), x.dtype)
        return host_bookkeeping(got), recv_x.clone()

    def combine_tensor(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """:meth:`combine` of a tensor's rows (``handle``: the numpy result's own), ``y`` a
        tensor of ``expert_out``'s dtype: through the Buffer's torch door, which views both in
        C (the facade's decode step: no numpy conversion on either side)."""
        y = self.buffer.combine(expert_out, handle)
        if type(y) is torch.Tensor and y.dtype is expert_out.dtype:
            return y
        return from_numpy_as(on_host(y), expert_out.dtype)

    def dispatch_async(self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
                       x_scales: np.ndarray | None = None) -> Any:
        """:meth:`dispatch` with ``return_recv_hook=True``: a ``ubep.PendingCall``."""
        call = self.buffer.dispatch(x, topk_idx, np.asarray(topk_weights, dtype=np.float32),
                                    return_recv_hook=True, x_scales=x_scales)
        call.map_result(_host_result)
        return call

    def combine_async(
        self, expert_out: np.ndarray, handle: Any, topk_weights: np.ndarray | None = None
    ) -> Any:
        """:meth:`combine` with ``return_recv_hook=True``: a ``ubep.PendingCall``."""
        call = self.buffer.combine(expert_out, self._weighted(handle, topk_weights),
                                   return_recv_hook=True)
        call.map_result(on_host)
        return call

    def _weighted(self, handle: Any, topk_weights: np.ndarray | None) -> Any:
        if topk_weights is None:
            return handle
        if self.layout == "rank":
            raise InvalidArgumentError(
                "topk_weights", "given", "the rank layout combines without weights"
            )
        w = np.ascontiguousarray(topk_weights, dtype=np.float32)
        return dataclasses.replace(handle, topk_weights=w)

    def allgather(self, value: Any) -> list[Any]:
        return list(self.group.allgather(value))

    def close(self) -> None:
        close = getattr(self.buffer, "close", None)
        if close is not None:
            close()


def _host_result(res: Any) -> Any:
    """A dispatch result with every field on the host as numpy storage: what the facade
    reads (an engine's results may be tensors of its device: ``BufferConfig.transport``)."""
    if type(res) is TorchDispatchResult:  # the torch door's: the numpy result it wraps
        host = res.host_result()
        if host is not None:
            return host
    elif type(res.recv_x) is np.ndarray and type(res.recv_src_token) is np.ndarray:
        return res  # a host engine's: its fields are numpy arrays already
    return _on_host_but(res, None)


def host_bookkeeping(res: Any) -> Any:
    """A device dispatch's result with every field but ``recv_x`` on the host (the routing
    the facade keeps in its handle, read on the host), ``recv_x`` the engine's tensor."""
    return _on_host_but(res, "recv_x")


def _on_host_but(res: Any, kept: str | None) -> Any:
    """``res`` with every field but ``kept`` as numpy storage on the host (``on_host``)."""
    return type(res)(**{f.name: getattr(res, f.name) if f.name == kept else on_host(
        getattr(res, f.name)) for f in dataclasses.fields(res)})


def buffer_config(
    *,
    hidden: int,
    num_topk: int,
    num_experts: int,
    dtype: torch.dtype,
    max_tokens_per_rank: int = 4096,
    layout: Layout = "expert",
    **options: Any,
) -> Any:
    """The ``ubep.BufferConfig`` of one shape (``options``: any other BufferConfig field)."""
    from ..buffer import BufferConfig

    return BufferConfig(
        max_tokens_per_rank=max_tokens_per_rank,
        hidden=hidden,
        num_topk=num_topk,
        num_experts=num_experts,
        dtype=ubep_dtype_name(dtype),
        layout=layout,
        **options,
    )


def make_backend(group: Any, **shape_and_options: Any) -> RuntimeBackend:
    """Create a ``ubep.Buffer`` on ``group`` for this shape (collective: every rank calls it);
    the keywords are :func:`buffer_config`'s."""
    from ..buffer import Buffer

    return RuntimeBackend(Buffer(group, buffer_config(**shape_and_options)))
