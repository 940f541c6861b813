"""Torch views the engine works on: payloads as their integer bits, regions of the arena."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import dtype_of
from ..errors import InvalidArgumentError

__all__ = ["bits_dtype", "to_bits", "to_host", "torch_dtype", "view"]


def torch_dtype(name: str) -> Any:
    """The torch type of a ``ubep.dtypes`` name (what results carry)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
            "int8": torch.int8, "uint8": torch.uint8}[name]


def bits_dtype(name: str) -> Any:
    """The integer torch type the kernels move a ``name`` element as (its bits)."""
    import torch

    return {1: torch.int8 if name == "int8" else torch.uint8, 2: torch.int16,
            4: torch.int32}[dtype_of(name).itemsize]


def to_bits(value: Any, name: str, argument: str, device: Any) -> Any:
    """``value`` (numpy storage array or torch tensor of ``name``'s type, 2-D) as a contiguous
    tensor of its bits on ``device``, 8-byte aligned."""
    import torch

    want = dtype_of(name)
    if isinstance(value, torch.Tensor):
        if value.dtype != torch_dtype(name) and not (
                want.itemsize == 1 and value.dtype.itemsize == 1 and value.is_floating_point()):
            raise InvalidArgumentError(argument, value.dtype, f"must be {torch_dtype(name)}")
        t = value.detach()
    else:
        a = np.asarray(value)
        if a.dtype != want.storage:
            raise InvalidArgumentError(argument, a.dtype, f"must be {want.storage} ({name})")
        t = torch.from_numpy(np.ascontiguousarray(a))
    if t.ndim != 2:
        raise InvalidArgumentError(argument, tuple(t.shape), "must be 2-D [rows, hidden]")
    t = t.view(bits_dtype(name)) if t.dtype.itemsize == want.itemsize else t
    t = t.to(device).contiguous()
    if t.data_ptr() % 8:
        t = t.clone()
    return t


def view(local: Any, offset: int, count: int, dtype: Any) -> Any:
    """``count`` elements of ``dtype`` at byte ``offset`` of the region ``local`` (uint8)."""
    import torch

    size = torch.empty(0, dtype=dtype).element_size()
    return local[offset:offset + count * size].view(dtype)


def to_host(t: Any) -> np.ndarray:
    """``t`` read back to the host as a numpy array: on a GPU a synchronisation (the host waits
    for every launch before it). The engine reads its device through this function alone, once
    per call when nothing fails (a test counts the calls)."""
    return np.asarray(t.detach().cpu().numpy())
