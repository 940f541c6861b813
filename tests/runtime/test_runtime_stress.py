"""1,000 calls in one launch across random shapes, on four Buffers at once, all bit-exact.

Every rank draws the same random sequence (shared seed): which Buffer, how many tokens each rank
sends (0 included), the routing (uniform with masked slots, hot experts, everything to one expert,
everything masked) and whether combine goes through ``get_combine_buffer``. Row sizes are chosen
to hit the odd paths: rows that are not a multiple of 64 bytes (strided ``recv_x``), of 8 bytes
(DC padding) and rows spanning several TFF blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests._runtime_support import bits, compare, random_payload
from ubep import reference, routing
from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import launch

CONFIGS = [
    dict(hidden=96, dtype="bf16", engine="asp", sync="sp", layout="expert"),   # 192 B rows
    dict(hidden=300, dtype="bf16", engine="asp", sync="tff", layout="rank"),   # 2 TFF blocks
    dict(hidden=37, dtype="int8", engine="asp", sync="dc", layout="expert"),   # 37 B rows
    dict(hidden=150, dtype="fp32", engine="bsp", sync="sw", layout="rank"),    # 600 B rows
    dict(hidden=64, dtype="fp16", engine="bsp", sync="sp", layout="expert"),
    dict(hidden=48, dtype="uint8", engine="bsp", sync="tff", layout="expert"),
]
MAX_TOKENS = 24
NUM_EXPERTS = 8
NUM_TOPK = 3


def _routing(rng: np.random.Generator, kind: str, tokens: int, seed: int) -> np.ndarray:
    if kind == "uniform":
        return routing.uniform_topk(tokens, NUM_EXPERTS, NUM_TOPK, seed=seed, mask_prob=0.2)
    if kind == "hot":
        return routing.hot_experts_topk(tokens, NUM_EXPERTS, NUM_TOPK, hot_experts=1,
                                        hot_share=0.9, seed=seed)
    idx = np.full((tokens, NUM_TOPK), -1, dtype=np.int64)
    if kind == "one":
        idx[:, int(rng.integers(NUM_TOPK))] = int(rng.integers(NUM_EXPERTS))
    return idx


def _worker_stress(group: Any, iterations: int) -> list[str]:
    R, r = group.num_ranks, group.rank
    bufs = [Buffer(group, BufferConfig(max_tokens_per_rank=MAX_TOKENS, num_topk=NUM_TOPK,
                                       num_experts=NUM_EXPERTS, **c))  # type: ignore[arg-type]
            for c in CONFIGS]
    rng = np.random.default_rng(2024)  # the same draws on every rank
    errors: list[str] = []
    try:
        for it in range(iterations):
            which = int(rng.integers(len(bufs)))
            buf, cfg = bufs[which], bufs[which].config
            tokens = [int(rng.integers(0, MAX_TOKENS + 1)) for _ in range(R)]
            kind = str(rng.choice(["uniform", "uniform", "hot", "one", "none"]))
            zero_copy = bool(rng.integers(2))
            seed = int(rng.integers(2**31))
            xs, idxs, ws = [], [], []
            for q in range(R):
                qrng = np.random.default_rng([seed, q])
                xs.append(random_payload(qrng, cfg.dtype, tokens[q], cfg.hidden))
                idxs.append(_routing(qrng, kind, tokens[q], seed + q))
                ws.append(qrng.random((tokens[q], NUM_TOPK), dtype=np.float32))
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            refs = reference.dispatch(xs, idxs, ws, NUM_EXPERTS, layout=cfg.layout)
            errors += [f"iteration {it} ({CONFIGS[which]}, {kind}): {e}"
                       for e in compare(res, refs[r])]
            if cfg.combine_dtype == cfg.dtype:
                outs = [np.ascontiguousarray(ref.recv_x) for ref in refs]
            else:
                outs = [random_payload(np.random.default_rng([seed, q, 1]), cfg.combine_dtype,
                                       ref.recv_x.shape[0], cfg.hidden)
                        for q, ref in enumerate(refs)]
            eo: np.ndarray = outs[r]
            if zero_copy:
                eo = buf.get_combine_buffer(res.handle)
                eo[...] = outs[r]
            y = buf.combine(eo, res.handle)
            y_ref = reference.combine(outs, refs)[r]
            if y.dtype != y_ref.dtype or not np.array_equal(bits(y), bits(y_ref)):
                errors.append(f"iteration {it} ({CONFIGS[which]}, {kind}): combine differs")
            if len(errors) > 20:
                break
    finally:
        for b in bufs:
            b.close()
    return errors


@pytest.mark.slow
def test_stress_1000_calls_random_shapes() -> None:
    results = launch(_worker_stress, 2, 1000, timeout_s=900)
    errors = [e for res in results for e in res]
    assert not errors, "\n".join(errors[:20])


def test_stress_four_ranks_oversubscribed() -> None:
    # four ranks on this 2-core host: yielding waits must keep it correct (if slow)
    results = launch(_worker_stress, 4, 80, timeout_s=600)
    errors = [e for res in results for e in res]
    assert not errors, "\n".join(errors[:20])
