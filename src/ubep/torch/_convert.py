"""Zero-copy conversion between torch tensors and the numpy arrays the runtime moves.

numpy has no bfloat16, so ubep stores BF16 payloads as ``uint16`` bit patterns (see
:mod:`ubep.dtypes`). A CPU tensor shares its memory with ``Tensor.numpy()`` and
``torch.from_numpy``; a BF16 tensor is first reinterpreted as ``torch.uint16`` (same bytes), so
no element is converted or copied on either side. Only non-contiguous tensors are copied
(``contiguous()``), because the runtime reads rows as flat byte ranges.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgumentError

__all__ = ["PAYLOAD_DTYPES", "from_numpy", "to_numpy"]

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
