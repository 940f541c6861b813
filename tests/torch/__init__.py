"""The torch layer's tests. A process that imports them (a rank ``ubep.launch`` started, a
torchrun worker) takes torch's default dtype from ``DEFAULT_DTYPE_ENV`` where the test that
started it set one (tests/torch/conftest.py: the facade tests' BF16 run)."""

from __future__ import annotations

import os

DEFAULT_DTYPE_ENV = "TESTS_TORCH_DEFAULT_DTYPE"

if os.environ.get(DEFAULT_DTYPE_ENV):
    import torch

    torch.set_default_dtype(getattr(torch, os.environ[DEFAULT_DTYPE_ENV]))
