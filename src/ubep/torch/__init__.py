"""PyTorch integration: dispatch/combine on tensors with autograd, a MoE layer, HF experts.

``import ubep.torch`` needs torch (the ``torch`` extra: ``pip install -e '.[torch]'``);
``import ubep`` does not.

* :func:`dispatch` / :func:`combine`: torch tensors in and out without copies (BF16 travels as
  its uint16 bits), differentiable (the backward of dispatch is a combine, the backward of
  combine a dispatch).
* :class:`MoELayer`: router -> dispatch -> grouped SwiGLU experts -> combine.
* :mod:`ubep.torch.hf`: a Hugging Face transformers experts implementation named ``"ubep"``.
* :mod:`ubep.torch.group`: a ubep process group over a ``torch.distributed`` group (what
  ``ubep.Buffer(dist.group.WORLD, cfg)`` builds under torchrun).
* :class:`LocalWorld`: N ranks as threads of one process (float64-capable), for tests.
"""

from __future__ import annotations

from ._world_pin import import_before_init
from .backend import EPBackend, LocalBackend, LocalWorld, as_backend, run_threads
from .moe import MoELayer, route
from .ops import DispatchResult, Handle, combine, dispatch

# Before init_process_group, or a later optimizer pins the default group for life (_world_pin).
import_before_init()

__all__ = [
    "DispatchResult",
    "EPBackend",
    "Handle",
    "LocalBackend",
    "LocalWorld",
    "MoELayer",
    "as_backend",
    "combine",
    "dispatch",
    "route",
    "run_threads",
]
