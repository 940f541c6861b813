"""ubep's Triton engine: UBEP's ASP dispatch and combine as Triton kernels (docs/TRITON.md).

``import ubep.triton`` needs neither Triton nor torch; building an engine needs both, and says
so clearly when one is missing. On a CPU the kernels run under Triton's interpreter over
shared memory; on a GPU they are compiled, over device buffers shared by CUDA IPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._require import INSTALL_HINT, triton_available
from .config import TritonConfig, from_buffer_config
from .sync import SYNC_TABLE, SyncRow, sync_row

if TYPE_CHECKING:
    from .engine import TritonEngine

__all__ = ["INSTALL_HINT", "SYNC_TABLE", "SyncRow", "TritonConfig", "TritonEngine",
           "from_buffer_config", "open_engine", "sync_row", "triton_available"]


def open_engine(group: Any, config: TritonConfig) -> TritonEngine:
    """Build this rank's Triton engine on ``group`` (collective)."""
    from .engine import TritonEngine

    return TritonEngine(group, config)


def __getattr__(name: str) -> Any:
    if name == "TritonEngine":
        from .engine import TritonEngine

        return TritonEngine
    raise AttributeError(name)
