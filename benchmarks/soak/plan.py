"""What both soaks run: the random plan of Buffers (*blocks*) and calls drawn from a seed, every
rank's inputs and expert outputs for a call, the bit-for-bit diff against ``ubep.reference`` and
rank 0's progress bar."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ubep import modes, routing
from ubep.buffer import BufferConfig
from ubep.testing import FIELDS, any_bits_payload, same_bits

__all__ = ["Block", "Call", "call_inputs", "dispatch_diffs", "draw_call", "expert_outputs",
           "make_blocks", "progress_bar"]


@dataclass(frozen=True)
class Call:
    tokens: tuple[int, ...]  # per rank
    routing: str  # uniform / zipf / hot / one
    seed: int


@dataclass(frozen=True)
class Block:
    engine: str
    sync: str
    layout: str
    dtype: str
    hidden: int
    num_topk: int
    num_experts: int
    max_tokens: int
    num_cores: int
    zero_copy: bool
    calls: tuple[Call, ...] = field(default=())

    def config(self, timeout_s: float = 60.0) -> BufferConfig:
        return BufferConfig(
            max_tokens_per_rank=self.max_tokens, hidden=self.hidden, num_topk=self.num_topk,
            num_experts=self.num_experts, dtype=self.dtype, layout=self.layout,
            engine=self.engine, sync=self.sync, num_cores=self.num_cores, timeout_s=timeout_s,
        )

    def mode(self) -> str:
        return f"{self.engine}:{self.sync}:{self.layout}:{self.dtype}"


def make_blocks(num_ranks: int, iterations: int, seed: int, calls_per_block: int = 12) -> list[
        Block]:
    """Random blocks totalling ``iterations`` calls (deterministic in ``seed``)."""
    rng = np.random.default_rng([seed, num_ranks])
    blocks: list[Block] = []
    left = iterations
    while left > 0:
        sync = str(rng.choice(list(modes.SYNCS)))
        dtypes = list(modes.dtypes_for(sync))
        local = int(rng.choice([1, 2, 4]))
        num_experts = local * num_ranks
        num_topk = int(rng.integers(1, min(8, num_experts) + 1))
        max_tokens = int(rng.choice([1, 4, 16, 33, 64]))
        n = int(min(left, calls_per_block))
        calls = [draw_call(rng, num_ranks, max_tokens) for _ in range(n)]
        blocks.append(Block(
            engine=str(rng.choice(list(modes.ENGINES))),
            sync=sync,
            layout=str(rng.choice(list(modes.LAYOUTS))),
            dtype=str(rng.choice(dtypes)),
            hidden=int(rng.choice([8, 56, 256, 520, 2048])),
            num_topk=num_topk,
            num_experts=num_experts,
            max_tokens=max_tokens,
            num_cores=int(rng.choice([1, 2, 3])),
            zero_copy=bool(rng.random() < 0.3),
            calls=tuple(calls),
        ))
        left -= n
    return blocks


def draw_call(rng: np.random.Generator, num_ranks: int, max_tokens: int) -> Call:
    """One call's tokens per rank, routing kind and payload seed."""
    tokens = rng.integers(0, max_tokens + 1, size=num_ranks)
    if rng.random() < 0.15:
        tokens[rng.integers(num_ranks)] = 0
    if rng.random() < 0.2:
        tokens[:] = max_tokens
    kind = str(rng.choice(["uniform", "zipf", "hot", "one"], p=[0.4, 0.25, 0.25, 0.1]))
    return Call(tuple(int(t) for t in tokens), kind, int(rng.integers(1 << 30)))


def _routing(call: Call, rank: int, tokens: int, num_experts: int, num_topk: int) -> np.ndarray:
    seed = call.seed * 1000 + rank
    if call.routing == "zipf":
        return routing.zipf_topk(tokens, num_experts, num_topk, alpha=1.2, seed=seed,
                                 mask_prob=0.05)
    if call.routing == "hot" and num_experts > 1:
        hot = max(1, min(num_experts - 1, 2))
        return routing.hot_experts_topk(tokens, num_experts, num_topk, hot_experts=hot,
                                        hot_share=0.7, seed=seed, mask_prob=0.05)
    if call.routing == "one":
        idx = np.full((tokens, num_topk), -1, np.int64)
        idx[:, 0] = call.seed % num_experts
        return idx
    return routing.uniform_topk(tokens, num_experts, num_topk, seed=seed, mask_prob=0.1)


def call_inputs(block: Block, call: Call) -> tuple[list[np.ndarray], list[np.ndarray],
                                               list[np.ndarray]]:
    xs, idxs, ws = [], [], []
    for r, t in enumerate(call.tokens):
        rng = np.random.default_rng([call.seed, r])
        xs.append(any_bits_payload(rng, block.dtype, t, block.hidden))
        idxs.append(_routing(call, r, t, block.num_experts, block.num_topk))
        ws.append((rng.standard_normal((t, block.num_topk)) * 2).astype(np.float32))
    return xs, idxs, ws


def expert_outputs(block: Block, refs: list[Any], seed: int) -> list[np.ndarray]:
    """Expert outputs: recv_x itself (float payloads; NaN/Inf included) or seeded bf16."""
    if block.dtype in modes.FLOAT_DTYPE_NAMES:
        return [np.ascontiguousarray(ref.recv_x) for ref in refs]
    outs = []
    for q, ref in enumerate(refs):
        rng = np.random.default_rng([seed, q, 7])
        outs.append(any_bits_payload(rng, "bf16", ref.recv_x.shape[0], block.hidden))
    return outs


def dispatch_diffs(res: Any, ref: Any) -> list[str]:
    """The dispatch fields of ``res`` that differ from the reference's, bit for bit."""
    return [f for f in FIELDS if not same_bits(getattr(res, f), getattr(ref, f))]


def progress_bar(group: Any, total: int, desc: str) -> Any:
    """A tqdm bar on rank 0 (None elsewhere or without tqdm)."""
    if group.rank != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # a thread lock: tqdm's default multiprocessing lock leaks a semaphore per rank
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, unit="call", desc=f"{desc} {group.num_ranks} ranks",
                file=sys.stderr, mininterval=0.5)


