"""ubep: expert-parallel dispatch/combine for MoE, re-architected after the UBEP paper.

Re-exports only; nothing heavy is imported here (torch stays optional).
"""

from .buffer import Buffer, DispatchResult
from .config import BufferConfig
from .dtypes import BF16, FP16, FP32, INT8, UINT8, DType
from .errors import (
    CallLostError,
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RankMaskedError,
    RemoteError,
    TimeoutError,
    UbepError,
)
from .expert_map import ExpertMap
from .handle import DispatchHandle
from .routing import DispatchLayout, get_dispatch_layout
from .runtime import Group, launch
from .sched import Plan, schedule
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "FP16",
    "FP32",
    "INT8",
    "UINT8",
    "Buffer",
    "BufferConfig",
    "CallLostError",
    "DType",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchResult",
    "ExpertMap",
    "Group",
    "InvalidArgumentError",
    "OutOfStepError",
    "PeerLostError",
    "Plan",
    "RankMaskedError",
    "RemoteError",
    "TimeoutError",
    "Topology",
    "UbepError",
    "__version__",
    "get_dispatch_layout",
    "launch",
    "schedule",
]
