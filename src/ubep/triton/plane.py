"""The Triton engine behind ``ubep.Buffer``: the registry row ``"triton"`` of ``ubep.plane``
(``BufferConfig(transport="triton")``).

:func:`memory_bytes` sizes the memory a Buffer maps for it (the engine's own layout,
``ubep.triton.layout``) and refuses, by the field, a config the engine does not serve
(:func:`ubep.triton.config.from_buffer_config`), before anything is mapped. :func:`open_triton`
builds a :class:`~ubep.triton.engine.TritonEngine` on that memory with the Buffer's agreement
(its uid; the Buffer's barrier follows) and wraps it in :class:`TritonPlane`, which keeps the
``ubep.plane.Engine`` protocol: every call comes checked, the engine's counters follow the
Buffer's, its exceptions become error records.

Results are the engine's: torch tensors on its device, fresh ones (``recv_x`` is a copy out
of the receive region), so no result is a view a later dispatch could refill. A split-phase
call runs whole at issue (the engine does not split its sequence of launches yet) and its hook
hands the result out: right, with nothing overlapped.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..errors import UbepError
from ..plane.protocol import CallOptions, EngineSpec, GlobalMemory
from ..plane.records import E_INTERNAL, ErrorRecord
from .config import TritonConfig, from_buffer_config
from .layout import arena_bytes

__all__ = ["TritonPlane", "memory_bytes", "open_triton"]


def _config(config: Any, num_cores: int) -> TritonConfig:
    # The Buffer routes logical expert ids to their slots before the engine sees them
    # (ubep.buffer.replicas; M2N is such a map): the engine moves slot ids, as for a config
    # without a map.
    if config.expert_map is not None:
        config = dataclasses.replace(config, expert_map=None)
    return from_buffer_config(config, num_send_programs=num_cores)


def memory_bytes(config: Any, num_ranks: int, num_cores: int) -> int:
    """Bytes of one rank's region (the registry row's size)."""
    return arena_bytes(_config(config, num_cores), num_ranks)


def open_triton(memory: GlobalMemory, spec: EngineSpec) -> TritonPlane:
    """The registry row's opener: the engine on the Buffer's memory (one host: shared memory
    under Triton's interpreter)."""
    from ..topology import host
    from .engine import TritonEngine
    from .memory import ShmArena

    # what the engine asks of a group: no collective (the Buffer agreed on the uid and meets
    # its peers after the engine armed its regions); the topology only steers the Plan's
    # unit order, never the results
    group = SimpleNamespace(rank=spec.rank, num_ranks=spec.num_ranks,
                            topology=host(spec.num_ranks, spec.num_cores))
    engine = TritonEngine(group, _config(spec.config, spec.num_cores),
                          arena=ShmArena.over(memory), uid=spec.uid)
    return TritonPlane(engine)


class TritonPlane:
    """A :class:`~ubep.triton.engine.TritonEngine` as a ``ubep.plane.Engine`` (module
    docstring)."""

    takes_unchecked = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._done: dict[int, Any] = {}  # split-phase calls run whole: epoch -> result

    def _run(self, epoch: int, opts: CallOptions | None, call: Any, *args: Any) -> Any:
        try:
            got = call(*args)
        except UbepError as exc:
            return ErrorRecord.of(exc)
        except Exception as exc:  # mid-call: the peers learn it, the ranks are out of step
            self.engine._lose_step(epoch, exc)
            return ErrorRecord(E_INTERNAL, -1, 0, "", f"{type(exc).__name__}: {exc}", "")
        if opts is not None and opts.split:
            self._done[epoch] = got
            return None
        return got

    def _follow(self, epoch: int, generation: int) -> None:
        """The engine's next call is the Buffer's call ``epoch`` of resync ``generation``."""
        self.engine.epoch = epoch - 1
        self.engine.generation = generation

    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, epoch: int, index: int,
                 generation: int, plan: Any, opts: CallOptions | None = None, /) -> Any:
        self._follow(epoch, generation)
        self.engine.num_dispatches = index  # the routing record's parity
        return self._run(epoch, opts, self.engine.dispatch, x, topk_idx, topk_weights)

    def combine(self, expert_out: Any, handle: Any, epoch: int, generation: int,
                num_dispatches: int, opts: CallOptions | None = None, /) -> Any:
        self._follow(epoch, generation)
        return self._run(epoch, opts, self.engine.combine, expert_out, handle)

    def complete(self, epoch: int) -> Any:
        return self._done.pop(epoch)

    def combine_buffer(self, index: int, rows: int) -> Any:
        # the combine pushes expert outputs from wherever they lie: a fresh array copies
        # nothing more than one in the arena would
        cfg = self.engine.config
        return np.empty((rows, cfg.hidden), self.engine.out_dt.storage)

    def stale_view(self, array: Any, dispatch_index: int, num_dispatches: int) -> None:
        return None  # results are fresh tensors: none is a view of the receive region

    def recv_valid(self, dispatch_index: int, num_dispatches: int) -> bool:
        return True  # the rows are a fresh array the engine never writes again

    def abandon(self, epoch: int, message: str) -> None:
        self._done.pop(epoch, None)  # it ran whole: the peers wait for nothing of it

    def fail(self, epoch: int, code: int, message: str, finished: int,
             timeout_s: float) -> int | ErrorRecord:
        if timeout_s <= 0:
            # the notice slot is one: it may still hold the notice peers read for the call
            # that failed, which this one must not overwrite
            return 1
        self.engine._notice(epoch, code, message)
        return 0

    def set_signature(self, word: int) -> None:
        self.engine.signature = int(word) & (2**64 - 1)

    def resync(self, base_epoch: int) -> None:
        self._done.clear()
        self.engine.restart(base_epoch)

    def reset_all(self) -> None:
        self.engine._arm_all()

    def close(self) -> None:
        self._done.clear()
        self.engine.close()
