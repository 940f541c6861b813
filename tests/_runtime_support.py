"""Shared pieces of the runtime tests: case matrix, seeded inputs, and the per-rank checker that
compares a Buffer with ``ubep.reference`` field by field (bit for bit).

Every rank regenerates all ranks' inputs from the same seed, so each can compute the reference
on its own and compare only its own result; a launch runs many cases to amortise start-up.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ubep import modes, testing
from ubep.buffer import Buffer, BufferConfig

# One implementation of the seeded payloads and of the bit-exact comparison (ubep.testing)
# serves the runtime tests, the benchmarks and `python -m ubep.tools.mpi_selftest`.
from ubep.testing import FIELDS, bits, compare, expert_outputs
from ubep.testing import payload as random_payload

__all__ = [
    "FIELDS",
    "Case",
    "bits",
    "compare",
    "expert_outputs",
    "make_inputs",
    "pairwise_cases",
    "random_payload",
    "run_case",
]


@dataclass(frozen=True)
class Case:
    engine: str
    sync: str
    layout: str
    dtype: str
    ranks: int
    hidden: int
    routing: str  # "uniform" or "hot"

    def config(self, max_tokens: int, **extra: Any) -> BufferConfig:
        experts = 8 * self.ranks if self.routing == "uniform" else 4 * self.ranks
        return BufferConfig(
            max_tokens_per_rank=max_tokens, hidden=self.hidden, num_topk=4, num_experts=experts,
            dtype=self.dtype, layout=self.layout, engine=self.engine, sync=self.sync,
            **({"timeout_s": 60.0} | extra),
        )


AXES: dict[str, tuple[Any, ...]] = {
    "engine": modes.ENGINES,
    "sync": modes.SYNCS,
    "layout": modes.LAYOUTS,
    "dtype": modes.DTYPE_NAMES,
    "ranks": (2, 4),
    "hidden": (2048, 7168),
    "routing": ("uniform", "hot"),
}


def pairwise_cases() -> list[Case]:
    """A deterministic greedy pairwise cover of AXES (every valid pair of values of two axes
    appears in some case), far smaller than the full product."""
    names = list(AXES)
    rest = list(AXES)[4:]  # the axes beyond the mode's (engine, sync, layout, dtype)
    candidates = [
        {"engine": m.engine, "sync": m.sync, "layout": m.layout, "dtype": m.dtype}
        | dict(zip(rest, v, strict=True))
        for m in modes.enumerate_modes()
        for v in itertools.product(*(AXES[a] for a in rest))
    ]

    def pairs(c: dict[str, Any]) -> set[tuple[str, Any, str, Any]]:
        return {(a, c[a], b, c[b]) for a, b in itertools.combinations(names, 2)}

    uncovered: set[tuple[str, Any, str, Any]] = set()
    for c in candidates:
        uncovered |= pairs(c)
    chosen: list[Case] = []
    while uncovered:
        best = max(candidates, key=lambda c: len(pairs(c) & uncovered))
        uncovered -= pairs(best)
        chosen.append(Case(**best))
    return chosen


def make_inputs(
    case: Case, num_experts: int, tokens: list[int], seed: int, kind: str
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per-rank inputs of ``case`` (``ubep.testing.inputs``, top-4)."""
    return testing.inputs(case.dtype, num_experts, 4, case.hidden, tokens, seed, kind)


def run_case(group: Any, case: Case, *, max_tokens: int, steps: list[tuple[list[int], str]],
             seed: int, zero_copy: bool = False, **extra: Any) -> list[str]:
    """Run ``steps`` (tokens per rank, routing kind) on one Buffer; return the mismatches."""
    cfg = case.config(max_tokens, **extra)
    errors: list[str] = []
    with Buffer(group, cfg) as buf:
        for i, (tokens, kind) in enumerate(steps):
            s = seed * 100 + i
            xs, idxs, ws = make_inputs(case, cfg.num_experts, tokens, s, kind)
            errors += [f"{case} step {i}: {e}"
                       for e in testing.check_call(buf, xs, idxs, ws, s, zero_copy=zero_copy)]
    return errors


def kill_self_later(delay_s: float, stamp: str) -> None:
    """SIGKILL this process from a thread after ``delay_s``, first writing the monotonic time of
    death to the file ``stamp`` (what a test measures the survivors' reaction from)."""

    def die() -> None:
        time.sleep(delay_s)
        Path(stamp).write_text(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die, daemon=True).start()
