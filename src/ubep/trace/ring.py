"""Task spans recorded from Python (the MPI RMA engine): the native rings' interface and packed
records (:data:`ubep.trace.recorder.SPAN_DTYPE`), so one reader serves both engines."""

from __future__ import annotations

import time

import numpy as np

from ..errors import InvalidArgumentError
from .spans import TASK_KINDS

__all__ = ["SpanRing"]

#: the kinds as the engines number them: the tasks', then the calls'
KIND = {k: i for i, k in enumerate((*TASK_KINDS, "dispatch", "combine"))}


class SpanRing:
    """Per-core rings of ``num_cores`` cores and one of calls (the last). Off until
    :meth:`trace_enable`; off, :meth:`t0` and :meth:`rec` only test one attribute."""

    def __init__(self, num_cores: int) -> None:
        self.num_cores = num_cores
        self.on = False
        self.capacity = 0
        self._rings: list[list[tuple[int, ...]]] = []
        self._written: list[int] = []
        self._last_end: list[int] = []

    def trace_enable(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError("capacity", capacity, "must be an integer >= 0")
        self.capacity = capacity
        self.on = capacity > 0
        self._rings = [[] for _ in range(self.num_cores + 1)]
        self._written = [0] * (self.num_cores + 1)
        self._last_end = [0] * (self.num_cores + 1)

    def t0(self) -> int:
        """A span's start: 0 when off (no clock read)."""
        return time.monotonic_ns() if self.on else 0

    def rec(self, core: int, kind: str, start_ns: int, *, unit: int = -1, peer: int = -1,
            rows: int = 0, size_bytes: int = 0, epoch: int = 0, after_last: bool = False) -> int:
        """One span of ``core`` (``num_cores``: the call ring) ending now; its end (0 when off:
        spans back to back start where the last ended, as the native ones). ``after_last``: it
        encloses spans recorded meanwhile (a barrier inside a combine) and starts after the
        last of them, so spans of one core never overlap."""
        if not self.on:
            return 0
        ring = self._rings[core]
        end = time.monotonic_ns()
        if after_last:
            start_ns = max(start_ns, self._last_end[core])
        self._last_end[core] = end
        rec = (start_ns, end, KIND[kind], unit, peer, epoch & 0x7FFFFFFF, rows, size_bytes)
        n = self._written[core]
        if len(ring) < self.capacity:
            ring.append(rec)
        else:
            ring[n % self.capacity] = rec
        self._written[core] = n + 1
        return end

    def trace_spans(self) -> tuple[bytes, tuple[int, ...], int]:
        """As the native engine's: (packed records ring by ring, oldest first; counts; dropped);
        the rings are emptied."""
        from .recorder import SPAN_DTYPE

        if not self.on:
            return b"", (), 0
        out, counts, dropped = [], [], 0
        for ring, n in zip(self._rings, self._written, strict=True):
            k = n % self.capacity if n > self.capacity else 0
            ordered = ring[k:] + ring[:k]
            out += ordered
            counts.append(len(ordered))
            dropped += max(0, n - self.capacity)
        self.trace_enable(self.capacity)
        return np.array(out, SPAN_DTYPE).tobytes(), tuple(counts), dropped
