"""Two-batch overlap with FP8 dispatch: DeepEP's decode schedule on ubep's split-phase calls.

    python examples/two_batch_overlap.py

Each rank holds two micro-batches. Batch A's dispatch is issued (``return_recv_hook=True``:
the call returns once this rank's local work is done) and batch B's attention runs while A's
rows travel; A's hook then collects them, B's dispatch is issued, A's experts run while B's
rows travel, and so on for the combines. Dispatch quantises each token to FP8 E4M3 inside the
engine (``BufferConfig(quant="e4m3")``: one float32 scale per 128 channels, half the bytes of
BF16); combine returns BF16.

Every result is compared with the single-process oracle: the received rows with
``ubep.quant.quantize`` of ``ubep.reference.dispatch``'s, the combined rows with
``ubep.reference.combine`` of the same expert outputs. A mismatch exits non-zero.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import ubep
from ubep import quant, reference, routing
from ubep.runtime import Group, launch

TOKENS, HIDDEN, TOP_K, NUM_EXPERTS, RANKS = 32, 2048, 8, 16, 2


def batch(rank: int, which: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Micro-batch ``which`` of ``rank``: BF16 tokens (as uint16 bits), routing, weights."""
    rng = np.random.default_rng([rank, which])
    x = rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32)
    x_bf16 = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # truncated to BF16
    idx = routing.uniform_topk(TOKENS, NUM_EXPERTS, TOP_K, seed=10 * rank + which)
    return x_bf16, idx, rng.random((TOKENS, TOP_K), dtype=np.float32)


def attention(x: np.ndarray) -> np.ndarray:
    """Stand-in for attention: some local compute on the batch (its result is not sent)."""
    h = x[:, :256].astype(np.float32)
    return h @ h.T


def experts(recv_x: np.ndarray, recv_scales: np.ndarray, rank: int) -> np.ndarray:
    """Stand-in experts: dequantise the FP8 rows, scale them by the rank's id + 1, BF16 out."""
    rows = quant.dequantize(recv_x, recv_scales, "e4m3") * np.float32(rank + 1)
    return (rows.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def run(group: Group) -> bool:
    rank = group.rank
    cfg = ubep.BufferConfig(max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOP_K,
                            num_experts=NUM_EXPERTS, dtype="bf16", quant="e4m3")
    a, b = batch(rank, 0), batch(rank, 1)
    with ubep.Buffer(group, cfg) as buf:
        attention(a[0])
        pending_a = buf.dispatch(*a, return_recv_hook=True)   # A's rows travel ...
        attention(b[0])                                        # ... while B's attention runs
        res_a = pending_a.hook()
        pending_b = buf.dispatch(*b, return_recv_hook=True)    # B's rows travel ...
        out_a = experts(res_a.recv_x, res_a.recv_x_scales, rank)  # ... while A's experts run
        comb_a = buf.combine(out_a, res_a.handle, return_recv_hook=True)
        res_b = pending_b.hook()
        out_b = experts(res_b.recv_x, res_b.recv_x_scales, rank)  # A's outputs travel meanwhile
        comb_b = buf.combine(out_b, res_b.handle, return_recv_hook=True)
        y_a, y_b = comb_a.hook(), comb_b.hook()
        got = [(res_a, out_a, y_a), (res_b, out_b, y_b)]
        ok = all(check(rank, which, *g) for which, g in enumerate(got))
    print(f"rank {rank}: two micro-batches of {TOKENS} tokens overlapped, FP8 dispatch, BF16 "
          f"combine; equal to ubep.reference: {ok}")
    return ok


def check(rank: int, which: int, res: Any, out: np.ndarray, y: np.ndarray) -> bool:
    """This rank's results against the oracle run over every rank's inputs."""
    everyone = [batch(r, which) for r in range(RANKS)]
    refs = reference.dispatch(*(list(t) for t in zip(*everyone, strict=True)), NUM_EXPERTS)
    values, scales = quant.quantize(refs[rank].recv_x, "e4m3")
    outs = [experts(*quant.quantize(ref.recv_x, "e4m3"), q) for q, ref in enumerate(refs)]
    y_ref = reference.combine(outs, refs)[rank]
    return (np.array_equal(res.recv_x, values) and np.array_equal(res.recv_x_scales, scales)
            and np.array_equal(out, outs[rank]) and np.array_equal(y, y_ref))


if __name__ == "__main__":
    sys.exit(0 if all(launch(run, RANKS, timeout_s=120)) else 1)
