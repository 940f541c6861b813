"""The data-plane contract every engine keeps, in one small package.

* :mod:`.protocol`: the :class:`Engine` a Buffer drives, the :class:`ProcessGroup` and
  :class:`GlobalMemory` it runs on, the call records and :class:`EngineSpec`;
* :mod:`.records`: the error codes, the typed :class:`ErrorRecord` an engine returns instead of
  a result, and the control records' offsets;
* :mod:`.layout`: where each record and region lies in a rank's memory;
* :mod:`.results`: :class:`DispatchResult`, the handles, :class:`PendingCall`;
* :mod:`.registry`: one row per transport, :func:`open_engine`;
* :mod:`.host`: what engines on host memory share (a row kernel made an engine that builds
  its results);
* :mod:`.control`, :mod:`.liveness`: the control plane's bounded wait, its agreement's
  :class:`Decision`, process liveness.

It imports only the bottom floors (``errors``, ``modes``, ``dtypes``, ``sched``, ``topology``);
every transport (``ubep.runtime`` on one host, ``ubep.mpi``) imports it, never the reverse.
"""

from .layout import SegmentLayout, compute_layout
from .protocol import (
    PLAIN,
    CallOptions,
    CombineCall,
    DispatchCall,
    Engine,
    EngineSpec,
    GlobalMemory,
    ProcessGroup,
)
from .records import ErrorRecord
from .registry import memory_bytes, open_engine, register_engine, transports
from .results import DispatchHandle, DispatchResult, PendingCall, RuntimeHandle

__all__ = [
    "PLAIN", "CallOptions", "CombineCall", "DispatchCall", "DispatchHandle", "DispatchResult",
    "Engine", "EngineSpec", "ErrorRecord", "GlobalMemory", "PendingCall", "ProcessGroup",
    "RuntimeHandle", "SegmentLayout", "compute_layout", "memory_bytes", "open_engine",
    "register_engine", "transports",
]
