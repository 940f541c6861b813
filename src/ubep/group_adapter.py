"""Turn whatever group a caller hands ubep into a :class:`ubep.runtime.group.ProcessGroup`.

``ubep.Buffer(group, ...)`` accepts a ubep group (``ubep.launch``, ``group_from_env``,
``ubep.mpi.init``) or a ``torch.distributed.ProcessGroup`` (``dist.group.WORLD``,
``dist.new_group(ranks)``). The torch case is detected without importing torch: a torch group
can only exist if ``torch.distributed`` is already imported, so ``import ubep`` stays torch-free.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["as_process_group", "is_torch_group"]


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
