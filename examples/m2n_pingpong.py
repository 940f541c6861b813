"""M2N ping-pong: two attention ranks feed two expert ranks, two micro-batches in flight.

    python examples/m2n_pingpong.py

Ranks 0 and 1 run attention and hold no expert; ranks 2 and 3 hold all the experts
(``BufferConfig(expert_ranks=(2, 3))``) and no tokens. Every rank makes the same calls (they
are collective); a rank without tokens passes empty arrays, a sender gets an empty ``recv_x``.

Per layer, micro-batch A's dispatch is issued with ``return_recv_hook=True`` and the attention
ranks compute B's attention while A's rows travel; the expert ranks then run A's experts while
B's rows travel, and A's outputs travel back while they run B's. The next layer's A is issued
before B's combine is collected, so both pools always have a micro-batch to work on: at most
two calls in flight per Buffer, as split-phase calls allow.

Every result is checked against the single-process oracle given the same roles
(``ubep.reference.dispatch(..., expert_ranks=)``); a mismatch exits non-zero.
"""

from __future__ import annotations

import sys

import numpy as np

import ubep
from ubep import reference, routing
from ubep.runtime import Group, launch

RANKS, EXPERT_RANKS = 4, (2, 3)
TOKENS, HIDDEN, TOP_K, NUM_EXPERTS, LAYERS = 32, 1024, 4, 16, 2


def batch(rank: int, which: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Micro-batch ``which`` of ``rank`` at ``layer``: BF16 tokens (as uint16 bits), logical
    routing, weights; empty on an expert rank."""
    tokens = 0 if rank in EXPERT_RANKS else TOKENS
    rng = np.random.default_rng([rank, which, layer])
    x = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
    x_bf16 = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # truncated to BF16
    idx = routing.uniform_topk(tokens, NUM_EXPERTS, TOP_K, seed=1000 * rank + 10 * which + layer)
    return x_bf16, idx, rng.random((tokens, TOP_K), dtype=np.float32)


def attention(x: np.ndarray) -> np.ndarray:
    """Stand-in for attention on a sender: some local compute (its result is not sent)."""
    h = x[:, :256].astype(np.float32)
    return h @ h.T


def experts(recv_x: np.ndarray, rank: int) -> np.ndarray:
    """Stand-in experts: the rows scaled by the rank's id + 1, BF16 out (0 rows on a sender)."""
    rows = (recv_x.astype(np.uint32) << np.uint32(16)).view(np.float32) * np.float32(rank + 1)
    return (rows.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def run(group: Group) -> bool:
    rank = group.rank
    cfg = ubep.BufferConfig(max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOP_K,
                            num_experts=NUM_EXPERTS, dtype="bf16", expert_ranks=EXPERT_RANKS)
    ok = True
    with ubep.Buffer(group, cfg) as buf:
        a = batch(rank, 0, 0)
        pending_a = buf.dispatch(*a, return_recv_hook=True)       # A's rows travel ...
        for layer in range(LAYERS):
            b = batch(rank, 1, layer)
            attention(b[0])                                         # ... B's attention runs
            res_a = pending_a.hook()
            pending_b = buf.dispatch(*b, return_recv_hook=True)     # B's rows travel ...
            out_a = experts(res_a.recv_x, rank)                     # ... A's experts run
            comb_a = buf.combine(out_a, res_a.handle, return_recv_hook=True)
            res_b = pending_b.hook()
            out_b = experts(res_b.recv_x, rank)                     # A's outputs travel back
            comb_b = buf.combine(out_b, res_b.handle, return_recv_hook=True)
            y_a = comb_a.hook()
            # res_a.recv_x is a view of a receive region the next dispatch but one reuses
            ok &= check(rank, 0, layer, res_a, y_a)
            if layer + 1 < LAYERS:  # the next layer's A travels while B's outputs come back
                a_next = batch(rank, 0, layer + 1)
                attention(a_next[0])
                pending_a = buf.dispatch(*a_next, return_recv_hook=True)
            y_b = comb_b.hook()
            ok &= check(rank, 1, layer, res_b, y_b)
    role = "expert" if rank in EXPERT_RANKS else "attention"
    print(f"rank {rank} ({role}): {LAYERS} layers x two micro-batches of {TOKENS} tokens "
          f"pipelined; equal to ubep.reference: {ok}")
    return ok


def check(rank: int, which: int, layer: int, res: ubep.DispatchResult, y: np.ndarray) -> bool:
    """This rank's results against the oracle run over every rank's inputs with the roles."""
    everyone = [batch(r, which, layer) for r in range(RANKS)]
    xs, idxs, ws = (list(t) for t in zip(*everyone, strict=True))
    refs = reference.dispatch(xs, idxs, ws, NUM_EXPERTS, expert_ranks=EXPERT_RANKS)
    outs = [experts(ref.recv_x, q) for q, ref in enumerate(refs)]
    y_ref = reference.combine(outs, refs)[rank]
    sender_empty = rank in EXPERT_RANKS or (
        res.recv_x.shape[0] == 0 and res.num_recv_tokens_per_expert.shape == (0,))
    return (sender_empty and np.array_equal(res.recv_x, refs[rank].recv_x)
            and np.array_equal(res.recv_topk_idx, refs[rank].recv_topk_idx)
            and np.array_equal(res.num_recv_tokens_per_expert,
                               refs[rank].num_recv_tokens_per_expert)
            and np.array_equal(y, y_ref))


if __name__ == "__main__":
    sys.exit(0 if all(launch(run, RANKS, timeout_s=120)) else 1)
