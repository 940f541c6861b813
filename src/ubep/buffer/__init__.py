"""``ubep.Buffer``: expert-parallel dispatch and combine between the ranks of a group.

The package is cut by job: :mod:`.buffer` the public class and its calls, :mod:`.inflight` the
split-phase calls in flight, :mod:`.step` keeping step with the peers and ``resync``,
:mod:`.checks` argument checking, :mod:`.regions` where results live, :mod:`.state` the state
they share, :mod:`.elastic` the Buffer that masks lost peers. The data-plane contract the
Buffer drives is :mod:`ubep.plane`.
"""

from ..config import BufferConfig
from ..modes import ENGINES, SYNCS
from ..plane.results import DispatchResult, RuntimeHandle
from .buffer import Buffer
from .elastic import MaskingBuffer  # registers itself: Buffer(on_peer_loss="mask") builds one

__all__ = ["ENGINES", "SYNCS", "Buffer", "BufferConfig", "DispatchResult", "MaskingBuffer",
           "RuntimeHandle"]
