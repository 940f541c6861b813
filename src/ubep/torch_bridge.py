"""The one door from ubep's core to its optional torch layer.

``import ubep`` must work without torch, and the core must not depend on ``ubep.torch``; but a
caller may hand the core a torch tensor or a ``torch.distributed`` group. Both can only exist
if torch is already imported, so each is detected through ``sys.modules`` (never importing
torch) and only then handed to the torch layer, imported lazily here and nowhere else.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, UbepError

__all__ = [
    "Unviewable", "as_process_group", "combine_in_torch", "dispatch_in_torch", "is_torch_group",
    "is_torch_tensor", "on_host", "tensor_to_numpy",
]


def is_torch_tensor(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.Tensor`` (never imports torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def tensor_to_numpy(tensor: Any, argument: str) -> np.ndarray:
    """A CPU tensor as a numpy array without a copy (BF16 as its uint16 bits)."""
    from .torch._convert import to_numpy

    return to_numpy(tensor, argument=argument)


def on_host(obj: Any) -> Any:
    """A result field as a numpy array on the host: a tensor of any device as its storage
    (BF16 as uint16 bits; a device tensor copied to the host), anything else as it is. What
    a reader of results takes from an engine whose results are tensors of its device."""
    if not is_torch_tensor(obj):
        return obj
    if obj.device.type != "cpu":
        obj = obj.cpu()
    return tensor_to_numpy(obj, "result")


class Unviewable:
    """What the bridge hands a Buffer's call for a tensor numpy cannot view (a GPU tensor, a
    ``meta`` one): not a tensor, so the call does not come back to the bridge, and its checks
    (``ubep.buffer.checks.to_array``) raise ``error`` inside the call, where the rejection
    reaches every rank."""

    __slots__ = ("error",)

    def __init__(self, error: UbepError) -> None:
        self.error = error


def _storage_or_same(obj: object, argument: str) -> object:
    """A torch tensor's numpy storage view, a numpy argument as it is; a tensor numpy cannot
    view as :class:`Unviewable`, an error naming ``argument`` and the tensor's device."""
    if not is_torch_tensor(obj):
        return obj
    try:
        return tensor_to_numpy(obj, argument)
    except UbepError as exc:  # the device is looked at only here: nothing on the hot path
        error = exc
    device = getattr(obj, "device", None)
    if getattr(device, "type", "cpu") != "cpu":
        error = InvalidArgumentError(
            argument, device, f"must be a CPU tensor (it is on device {device}): this "
            "Buffer's engine moves host memory")
    return Unviewable(error)


def dispatch_in_torch(
    dispatch: Callable[..., Any], x: Any, topk_idx: object, topk_weights: object,
    x_scales: object, quant: str | None, **options: Any,
) -> Any:
    """``dispatch`` (a Buffer's) run on the numpy views of a torch ``x`` and the other tensor
    arguments, its result handed back in torch: every array field a tensor over the same
    memory, ``recv_x`` of ``x``'s dtype (with ``quant``: ``torch.float8_e4m3fn`` or
    ``torch.int8`` values). A split-phase call's hook returns the torch result."""
    from .torch._convert import dispatch_result_to_torch, quant_values_dtype

    values = x.dtype if quant is None else quant_values_dtype(quant)
    got = dispatch(_storage_or_same(x, "x"), _storage_or_same(topk_idx, "topk_idx"),
                   _storage_or_same(topk_weights, "topk_weights"),
                   x_scales=_storage_or_same(x_scales, "x_scales"), **options)
    return _settled_in_torch(got, lambda res: dispatch_result_to_torch(res, values))


def combine_in_torch(combine: Callable[..., Any], expert_out: Any, handle: object,
                     **options: Any) -> Any:
    """``combine`` (a Buffer's) run on the numpy view of a torch ``expert_out``; ``y`` handed
    back as a tensor of ``expert_out``'s dtype over the same memory."""
    from .torch._convert import from_numpy_as

    dtype = expert_out.dtype
    got = combine(_storage_or_same(expert_out, "expert_out"), handle, **options)
    return _settled_in_torch(got, lambda y: from_numpy_as(y, dtype))


def _settled_in_torch(got: Any, convert: Callable[[Any], Any]) -> Any:
    from .handle import PendingCall

    if isinstance(got, PendingCall):
        got.map_result(convert)
        return got
    return convert(got)


def is_torch_group(group: Any) -> bool:
    """Whether ``group`` is a ``torch.distributed.ProcessGroup`` (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    pg_type = getattr(dist, "ProcessGroup", None)
    return pg_type is not None and isinstance(group, pg_type)


def as_process_group(group: Any) -> Any:
    """``group`` itself, or for a torch.distributed group its ubep group
    (:func:`ubep.torch.group.from_torch`: collective the first time, cached after)."""
    if is_torch_group(group):
        from .torch.group import from_torch

        return from_torch(group)
    return group
