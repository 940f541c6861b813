"""Triton is optional: the engine refuses with a clear error when it is missing, and on a CPU
it runs Triton's interpreter (``TRITON_INTERPRET=1``), which has to be chosen before the
kernels are defined."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from ..errors import UbepError

__all__ = ["INSTALL_HINT", "kernels", "triton_available"]

INSTALL_HINT = ("pip install 'ubep[triton]' (or 'torch==2.13.0' triton: keep torch pinned on "
                "that command so pip never pulls another torch)")
_KERNEL_MODULES = ("ubep.triton.kernels_dispatch", "ubep.triton.kernels_combine")


def triton_available() -> bool:
    """Whether ``triton`` and ``torch`` can be imported (without importing them)."""
    return all(importlib.util.find_spec(m) is not None for m in ("triton", "torch"))


def kernels(device: str) -> tuple[ModuleType, ModuleType]:
    """The dispatch and combine kernel modules, for ``device`` (``"cpu"``: interpreted)."""
    if not triton_available():
        raise UbepError(f"the Triton engine needs triton and torch, which are not installed: "
                        f"{INSTALL_HINT}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not device.startswith("cuda") and not interpret:
        if any(m in sys.modules for m in _KERNEL_MODULES):
            raise UbepError("the Triton engine on a CPU runs Triton's interpreter, but its "
                            "kernels were compiled for a GPU in this process: set "
                            "TRITON_INTERPRET=1 before the first import of ubep.triton's kernels")
        os.environ["TRITON_INTERPRET"] = "1"  # kernels are defined as interpreted from here on
    if device.startswith("cuda") and interpret:
        raise UbepError(f"device={device!r} with TRITON_INTERPRET=1: the interpreter runs on "
                        "host memory only; unset it to run the kernels on the GPU")
    from . import kernels_combine, kernels_dispatch

    return kernels_dispatch, kernels_combine
