"""ubep: expert-parallel dispatch/combine for MoE, re-architected after the UBEP paper.

Re-exports only; nothing heavy is imported here (torch stays optional).
"""

from .errors import InvalidArgumentError, PeerLostError, RemoteError, TimeoutError, UbepError
from .routing import DispatchLayout, get_dispatch_layout
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "DispatchLayout",
    "InvalidArgumentError",
    "PeerLostError",
    "RemoteError",
    "TimeoutError",
    "Topology",
    "UbepError",
    "__version__",
    "get_dispatch_layout",
]
