"""The vLLM plugin: ``vllm.general_plugins`` entry point ``ubep = "ubep.vllm:register"``.

vLLM loads general plugins in each of its processes (the API server, the engine core, every
worker) before it builds its distributed groups. With ``UBEP_VLLM_ALL2ALL=1`` the plugin wraps
the constructor of vLLM's CPU communicator: once vLLM has set up the communicator of its EP
group (and its all-gather / reduce-scatter manager, which cannot run on CPU), the manager is
replaced by :class:`~ubep.vllm.manager.UbepAll2AllManager`. Nothing of vLLM is edited; without
the variable, nothing is patched.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..env import vllm_all2all_from_env

__all__ = ["is_patched", "register"]

_log = logging.getLogger("ubep.vllm")
_MARK = "_ubep_all2all"


def register() -> None:
    """vLLM's entry point: patch the CPU communicator when ``UBEP_VLLM_ALL2ALL=1``."""
    if not vllm_all2all_from_env():
        return
    from vllm.distributed.device_communicators import cpu_communicator

    cls = cpu_communicator.CpuCommunicator
    if getattr(cls.__init__, _MARK, False):
        return  # loaded twice in one process
    cls.__init__ = _wrap(cls.__init__)


def is_patched() -> bool:
    """Whether this process's vLLM CPU communicator takes ubep's manager."""
    from vllm.distributed.device_communicators import cpu_communicator

    return bool(getattr(cpu_communicator.CpuCommunicator.__init__, _MARK, False))


def _wrap(init: Any) -> Any:
    @functools.wraps(init)
    def init_then_ubep(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not self.use_all2all:
            return
        from .manager import UbepAll2AllManager

        if self.all2all_manager is not None:
            self.all2all_manager.destroy()
        self.all2all_manager = UbepAll2AllManager(self.cpu_group)

    setattr(init_then_ubep, _MARK, True)
    return init_then_ubep
