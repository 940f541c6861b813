"""What a :class:`~ubep.buffer.Buffer` holds, declared once for the modules that act on it.

The Buffer's behaviour is split by job (the calls, the calls in flight, keeping step, argument
checks); each job is a mixin over this state, so every module sees the same typed attributes.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import BufferConfig
from ..dtypes import DType
from ..plane.layout import SegmentLayout
from ..plane.protocol import Engine, GlobalMemory, ProcessGroup

if TYPE_CHECKING:
    from ..sched import CoreSplit, ScheduleSpec
    from .inflight import InFlight
    from .replicas import LogicalRouting

__all__ = ["BufferState"]

# stages of a call, for StepKeeping._failed: before the data plane, inside it, after it returned
BEFORE, NATIVE, AFTER = 0, 1, 2


class BufferState:
    """The attributes of one rank's Buffer (set in ``Buffer.__init__`` / ``_setup``)."""

    group: ProcessGroup
    config: BufferConfig  # the caller's (M2N: logical experts and expert_ranks)
    _cfg: BufferConfig  # the one the engine runs (M2N: physical slots, ubep.m2n)
    rank: int
    num_ranks: int
    num_cores: int
    num_local_experts: int
    layout: SegmentLayout
    _uid: int
    _epoch: int  # sequence number of the last call (every rank agrees on it)
    _num_dispatches: int
    _generation: int  # resyncs so far
    _lock: threading.Lock  # one call at a time (a second thread is refused)
    _dead: str | None  # a peer died: refused for good
    _lost: str | None  # out of step: refused until resync()
    _closed: bool
    _memory: GlobalMemory | None
    _engine: Engine | Any
    _in_flight: list[InFlight]  # split-phase calls awaiting their hook, in issue order
    _fast: Any  # the engine, when it takes blocking calls' arrays unchecked (else None)
    _one_call: bool  # every blocking call may take it (no M2N translation)
    _planned: bool  # ASP on several cores: a call carries its cores' tasks (Buffer._core_split)
    _splits: dict[int, CoreSplit | ScheduleSpec | None]  # per batch size
    _route: LogicalRouting | None  # expert_map: logical topk_idx -> physical slots
    _dtype: DType
    _cdtype: DType
    _recv_views: list[np.ndarray]
    _scale_views: list[np.ndarray]
    _comb_regions: list[np.ndarray]
