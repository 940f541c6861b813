"""Zero-copy conversion between torch tensors and the numpy arrays the runtime moves.

numpy has no bfloat16, so ubep stores BF16 payloads as ``uint16`` bit patterns (see
:mod:`ubep.dtypes`). A CPU tensor shares its memory with ``Tensor.numpy()`` and
``torch.from_numpy``; a BF16 tensor is first reinterpreted as ``torch.uint16`` (same bytes), so
no element is converted or copied on either side. Only non-contiguous tensors are copied
(``contiguous()``), because the runtime reads rows as flat byte ranges.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError

__all__ = [
    "PAYLOAD_DTYPES", "dispatch_result_to_torch", "from_numpy", "from_numpy_as",
    "quant_values_dtype", "to_numpy",
]

#: torch dtypes ubep moves, and the numpy storage dtype each travels in.
PAYLOAD_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype(np.uint16),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),  # only the in-process fake backend accepts it
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
}


def to_numpy(t: torch.Tensor, *, argument: str = "x") -> np.ndarray:
    """The numpy storage view of a CPU tensor (BF16 as ``uint16`` bits); no copy if contiguous.

    Autograd is bypassed (``detach``): callers that need gradients wrap this in a Function.
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(argument, type(t).__name__, "must be a torch.Tensor")
    if t.device.type != "cpu":
        raise InvalidArgumentError(argument, str(t.device), "must be a CPU tensor")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def on_host(obj: Any) -> Any:
    """A result field as a numpy array on the host: a tensor of any device as its storage
    (BF16 as uint16 bits; a device tensor copied to the host), anything else as it is."""
    if not isinstance(obj, torch.Tensor):
        return obj
    return to_numpy(obj.cpu() if obj.device.type != "cpu" else obj, argument="result")


def from_numpy(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor sharing ``a``'s memory; ``dtype=torch.bfloat16`` reinterprets ``uint16`` bits.

    Read-only arrays (the runtime may hand out views of its receive buffer) are wrapped
    without copying too; torch warns about that once, which is silenced here because ubep
    never writes through such a tensor.
    """
    arr = np.asarray(a)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if not arr.flags.writeable:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
    else:
        t = torch.from_numpy(arr)
    if dtype is torch.bfloat16:
        if arr.dtype != np.uint16:
            raise InvalidArgumentError("a", arr.dtype, "bfloat16 needs uint16 storage")
        return t.view(torch.bfloat16)
    if dtype is not None and t.dtype != dtype:
        raise InvalidArgumentError("a", arr.dtype, f"does not store {dtype}")
    return t


def from_numpy_as(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over ``a``'s memory (``a`` holds its storage: ``uint16`` bits for
    BF16, ``uint8`` bytes for an FP8 type); no copy. A tensor (an engine's result on its
    device) is viewed as ``dtype`` where it is not one already."""
    t = a if isinstance(a, torch.Tensor) else from_numpy(a)
    if t.dtype == dtype:
        return t
    if t.element_size() != torch.empty((), dtype=dtype).element_size():
        raise InvalidArgumentError("a", a.dtype, f"does not store {dtype}")
    return t.view(dtype)


def quant_values_dtype(quant: str) -> torch.dtype:
    """The torch dtype of a quantised dispatch's ``recv_x`` values (``BufferConfig.quant``)."""
    return {"e4m3": torch.float8_e4m3fn, "int8": torch.int8}[quant]


def dispatch_result_to_torch(res: Any, values: torch.dtype) -> Any:
    """A ``DispatchResult`` with every array field a tensor over the same memory, ``recv_x``
    of ``values``; the handle stays as it is (it is the Buffer's, read by combine)."""
    import dataclasses

    fields: dict[str, Any] = {}
    for f in dataclasses.fields(res):
        v = getattr(res, f.name)
        if isinstance(v, np.ndarray):
            v = from_numpy_as(v, values) if f.name == "recv_x" else from_numpy(v)
        fields[f.name] = v
    return type(res)(**fields)
