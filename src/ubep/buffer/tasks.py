"""What each core of a rank does in a call (ASP on several cores): Appendix A's count/send
split and, with several send cores, the scheduler's tables, cached per batch size."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from ..config import BufferConfig
from ..sched import CoreSplit, ScheduleSpec, core_split, schedule_spec
from ..topology import Topology
from ..torch_bridge import is_torch_tensor

__all__ = ["NO_SPLIT", "CoreTasks"]

NO_SPLIT = object()  # CoreTasks.for_x: the call needs the Buffer's general path


class CoreTasks:
    """The cores' tasks of one rank's calls (held by the Buffer as ``buf._tasks``).

    Args:
        config: the config the engine runs; ``num_cores`` the rank's cores; ``topology`` and
            ``rank`` place the destinations (hop classes) for the scheduler's tables.
    """

    def __init__(self, config: BufferConfig, num_cores: int, topology: Topology,
                 rank: int) -> None:
        self.config, self.num_cores, self.topology, self.rank = config, num_cores, topology, rank
        # ASP on several cores: a call carries its cores' tasks
        self.planned = config.engine == "asp" and num_cores >= 2
        self._splits: dict[int, CoreSplit | ScheduleSpec | None] = {}

    def for_idx(self, idx: np.ndarray) -> object:
        """What each core of this rank does (one core validates, counts and sends in one pass):
        :meth:`split`'s answer for this batch (a whole ``ubep.sched`` Plan where a caller
        replaces this method)."""
        return self.split(idx.shape[0])

    def for_x(self, x: object) -> object:
        """The plan of a blocking call offered to the engine unchecked (:meth:`split`), or
        :data:`NO_SPLIT` when ``x`` is not a 2-D array (which the engine would refuse): the
        general path."""
        if type(x) is np.ndarray or is_torch_tensor(x):  # a tensor: the engine views it
            shape = cast(Any, x).shape
            if len(shape) == 2:
                return self.split(int(shape[0]))
        return NO_SPLIT

    def split(self, num_tokens: int) -> CoreSplit | ScheduleSpec | None:
        """The cores' tasks for a batch of ``num_tokens`` (cached per batch size): None (one
        core, BSP, or no tokens: one pass does everything); Appendix A's count/send split; with
        two or more send cores, the split and the scheduler's tables (``ScheduleSpec``): the
        engine builds the Plan of ``config.policy`` itself from the routing it validates, the
        Plan ``ubep.sched.schedule`` would give, with no Python per call."""
        got = self._splits.get(num_tokens, NO_SPLIT)
        if got is not NO_SPLIT:
            return cast("CoreSplit | ScheduleSpec | None", got)
        cfg = self.config
        split: CoreSplit | ScheduleSpec | None = None
        if self.planned and num_tokens > 0:
            split = core_split(self.num_cores, cfg.num_experts, cfg.num_topk, num_tokens)
            if split.num_send_cores >= 2:
                split = schedule_spec(split, self.topology, rank=self.rank,
                                      num_experts=cfg.num_experts, policy=cfg.policy)
        self._splits[num_tokens] = split
        return split
