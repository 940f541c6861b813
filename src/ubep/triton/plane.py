"""The Triton engine behind ``ubep.Buffer``: the registry row ``"triton"`` of ``ubep.plane``
(``BufferConfig(transport="triton")``).

:func:`memory_bytes` sizes the engine's memory (its own layout, ``ubep.triton.layout``) and
refuses, by the field, a config the engine does not serve
(:func:`ubep.triton.config.from_buffer_config`), before anything is mapped. The engine brings
its own memory: :func:`open_triton_memory` opens the arena of the engine's device
(:func:`engine_device`: the current CUDA device where torch sees one, else the CPU) over the
Buffer's group (``ubep.triton.memory.open_arena``: CUDA IPC handles on a GPU, shared memory
on a CPU), so the Buffer maps nothing for it; :func:`open_triton` runs it on memory a caller
mapped instead. Either builds a :class:`~ubep.triton.engine.TritonEngine` with the Buffer's
agreement (its uid; the Buffer's barrier follows) and wraps it in :class:`TritonPlane`, which
keeps the
``ubep.plane.Engine`` protocol through the engine's public methods: every call comes checked
and names the Buffer's epoch, dispatch index and generation, its exceptions become error
records, and each call is a span of the trace's call ring (``ubep.trace``).

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
from ..plane.protocol import CallOptions, EngineSpec, GlobalMemory, ProcessGroup
from ..plane.records import E_INTERNAL, ErrorRecord
from ..trace.ring import SpanRing
from .config import TritonConfig, from_buffer_config
from .layout import arena_bytes

__all__ = ["TritonPlane", "engine_device", "memory_bytes", "open_triton", "open_triton_memory"]


def _config(config: Any, num_cores: int, device: str = "cpu") -> TritonConfig:
    # The Buffer routes logical expert ids to their slots before the engine sees them
    # (ubep.buffer.replicas; M2N is such a map): the engine moves slot ids, as for a config
    # without a map.
    if config.expert_map is not None:
        config = dataclasses.replace(config, expert_map=None)
    return from_buffer_config(config, num_send_programs=num_cores, device=device)


def memory_bytes(config: Any, num_ranks: int, num_cores: int) -> int:
    """Bytes of one rank's region (the registry row's size)."""
    return arena_bytes(_config(config, num_cores), num_ranks)


def engine_device(config: Any) -> str:
    """The row's device for a config: the current CUDA device where torch sees one (and
    Triton compiles for it), else ``"cpu"`` (Triton's interpreter)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{torch.cuda.current_device()}"


def _engine_of(spec: EngineSpec, cfg: TritonConfig, arena: Any) -> TritonPlane:
    from .engine import TritonEngine

    # what the engine asks of a group: its place, no collective (the Buffer agreed on the uid
    # and meets its peers after the engine armed its regions)
    group = SimpleNamespace(rank=spec.rank, num_ranks=spec.num_ranks)
    return TritonPlane(TritonEngine(group, cfg, arena=arena, uid=spec.uid))


def open_triton_memory(group: ProcessGroup, spec: EngineSpec) -> TritonPlane:
    """The registry row's opener (collective over the Buffer's ``group``): the arena of
    ``spec.device`` and the engine on it, which owns and closes it."""
    from .memory import open_arena

    cfg = _config(spec.config, spec.num_cores, spec.device)
    arena = open_arena(group, arena_bytes(cfg, spec.num_ranks), spec.device, cfg.timeout_s)
    try:
        return _engine_of(spec, cfg, arena)
    except BaseException:
        arena.close()
        raise


def open_triton(memory: GlobalMemory, spec: EngineSpec) -> TritonPlane:
    """The engine on one-host memory its caller mapped, owns and closes (shared memory under
    Triton's interpreter)."""
    from .memory import ShmArena

    return _engine_of(spec, _config(spec.config, spec.num_cores), ShmArena.over(memory))


class TritonPlane:
    """A :class:`~ubep.triton.engine.TritonEngine` as a ``ubep.plane.Engine`` (module
    docstring)."""

    takes_unchecked = False
    takes_tensors = True  # a call of tensors reaches the kernels as it came (on the device)

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._done: dict[int, Any] = {}  # split-phase calls run whole: epoch -> result
        self.spans = SpanRing(1)  # one ring of the engine's launches, one of its calls

    def _run(self, epoch: int, opts: CallOptions | None, kind: str, unit: int, call: Any, /,
             *args: Any, **call_of: Any) -> Any:
        t_call = self.spans.t0()
        try:
            got = call(*args, **call_of)
        except UbepError as exc:
            return ErrorRecord.of(exc)
        except Exception as exc:  # mid-call: the peers learn it, the ranks are out of step
            self.engine.lose_step(epoch, exc)
            return ErrorRecord(E_INTERNAL, -1, 0, "", f"{type(exc).__name__}: {exc}", "")
        self.spans.rec(1, kind, t_call, unit=unit, epoch=epoch)
        if opts is not None and opts.split:
            self._done[epoch] = got
            return None
        return got

    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, epoch: int, index: int,
                 generation: int, plan: Any, opts: CallOptions | None = None, /) -> Any:
        return self._run(epoch, opts, "dispatch", index, self.engine.dispatch, x, topk_idx,
                         topk_weights, epoch=epoch, index=index, generation=generation,
                         plan=plan)

    def combine(self, expert_out: Any, handle: Any, epoch: int, generation: int,
                num_dispatches: int, opts: CallOptions | None = None, /) -> Any:
        return self._run(epoch, opts, "combine", int(getattr(handle, "dispatch_index", -1)),
                         self.engine.combine, expert_out, handle, epoch=epoch,
                         generation=generation)

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
        self.engine.publish_failure(epoch, code, message)
        return 0

    def set_signature(self, word: int) -> None:
        self.engine.set_signature(word)

    def resync(self, base_epoch: int) -> None:
        self._done.clear()
        self.engine.restart(base_epoch)

    def reset_all(self) -> None:
        self.engine.arm()

    def close(self) -> None:
        self._done.clear()
        self.engine.close()

    def trace_enable(self, capacity: int) -> bool:
        self.spans.trace_enable(capacity)
        return True

    def trace_spans(self) -> tuple[bytes, tuple[int, ...], int]:
        return self.spans.trace_spans()
