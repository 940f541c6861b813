"""Keep ``torch.distributed.nn.functional`` from pinning the default process group for life.

That torch module writes ``group=group.WORLD`` as the default argument of ten functions
(``all_gather``, ``all_reduce``, ...): Python evaluates defaults once, at import, so a program
that imports it *after* ``dist.init_process_group`` holds the default group in those functions
until the process exits. Nothing in a training script names it: the first optimizer built
imports ``torch._dynamo``, which imports it. ``dist.destroy_process_group`` then cannot free the
group, a gloo group's worker threads outlive it, and one still releasing the tensors of a
finished collective when the interpreter shuts down cannot take the GIL: the thread is unwound
through C++ code that may not throw and the rank aborts ("terminate called without an active
exception") after the program succeeded. Imported before ``init_process_group`` the defaults
are ``None`` (the default group, looked up at call time), which is what ``import ubep.torch``
does here.
"""

from __future__ import annotations

import importlib
import sys

import torch.distributed as dist

__all__ = ["import_before_init"]

MODULE = "torch.distributed.nn.functional"


def import_before_init() -> bool:
    """Import :data:`MODULE` now if no default group exists yet (its defaults stay ``None``);
    after ``init_process_group`` importing it would pin the group, so leave it to whoever
    needs it. Returns whether the module is loaded with defaults that pin nothing."""
    if MODULE in sys.modules:
        return not _pins_a_group()
    if not dist.is_available() or dist.is_initialized():
        return False
    importlib.import_module(MODULE)
    return True


def _pins_a_group() -> bool:
    """Whether a function of the loaded module holds a process group as a default."""
    module = sys.modules[MODULE]
    return any(
        isinstance(value, dist.ProcessGroup)
        for fn in vars(module).values() if callable(fn)
        for value in (getattr(fn, "__defaults__", None) or ())
    )
