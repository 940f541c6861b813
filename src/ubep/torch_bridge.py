"""The one door from ubep's core to its optional torch layer.

``import ubep`` must work without torch, and the core must not depend on ``ubep.torch``; but a
caller may hand the core a torch tensor or a ``torch.distributed`` group. Both can only exist
if torch is already imported, so each is detected through ``sys.modules`` (never importing
torch) and only then handed to the torch layer, imported lazily here and nowhere else.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .errors import Unviewable

__all__ = [
    "Unviewable", "as_process_group", "is_torch_group", "is_torch_tensor", "on_host",
    "tensor_to_numpy", "torch_door",
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


def torch_door(**plans: Any) -> Any:
    """A Buffer's torch door (:class:`ubep.torch._convert.TorchDoor`: tensors in and out at
    the numpy call's cost), made once per Buffer on its first torch call."""
    from .torch._convert import TorchDoor

    return TorchDoor(**plans)


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
