"""The Triton engine's tests need triton (and torch): skipped, with the reason, without."""

from __future__ import annotations

import pytest

from ubep.triton import INSTALL_HINT, triton_available

needs_triton = pytest.mark.skipif(
    not triton_available(), reason=f"triton (or torch) is not installed: {INSTALL_HINT}")
