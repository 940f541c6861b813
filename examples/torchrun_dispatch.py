"""Dispatch and combine under torchrun: a torch.distributed group is all ubep needs.

    torchrun --nproc-per-node 2 examples/torchrun_dispatch.py

Every rank builds the same BF16 tokens and routing for every rank (seeded), so each can check
its own result against ``ubep.reference`` (the single-process oracle) bit for bit; a mismatch
exits non-zero. The torch group carries only set-up (pids, segment names); rows move through
shared memory.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

import ubep
from ubep import reference, routing

TOKENS, HIDDEN, TOP_K, EXPERTS_PER_RANK = 64, 1024, 4, 4


def inputs(rank: int, num_experts: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Rank ``rank``'s tokens (torch BF16), top-k expert ids (-1 = masked) and weights."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = routing.uniform_topk(TOKENS, num_experts, TOP_K, seed=rank, mask_prob=0.1)
    topk_weights = torch.rand(TOKENS, TOP_K, generator=g).numpy()
    return x, topk_idx, topk_weights


def run(group: dist.ProcessGroup) -> bool:
    """Dispatch and combine on ``group``; whether this rank's results equal the reference's."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    num_experts = EXPERTS_PER_RANK * world
    cfg = ubep.BufferConfig(
        max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOP_K, num_experts=num_experts,
        dtype=torch.bfloat16, layout="expert",
    )
    everyone = [inputs(r, num_experts) for r in range(world)]
    with ubep.Buffer(group, cfg) as buf:
        x, topk_idx, topk_weights = everyone[rank]
        res = buf.dispatch(x, topk_idx, topk_weights)  # torch in: torch out, BF16 as BF16
        # Your experts here: one output row per received row (same order). Identity for the
        # check; real experts would write into buf.get_combine_buffer(res.handle).
        y = buf.combine(res.recv_x, res.handle)  # a torch.bfloat16 [TOKENS, HIDDEN] tensor
        # the oracle works on numpy: BF16 as its uint16 bits
        recv_bits = res.recv_x.view(torch.uint16).numpy()
        got = {f: getattr(res, f).numpy() for f in
               ("num_recv_tokens_per_expert", "recv_src_rank", "recv_src_token")}
    xs = [x.view(torch.uint16).numpy() for x, _, _ in everyone]
    ref = reference.dispatch(xs, [e[1] for e in everyone], [e[2] for e in everyone], num_experts)
    ref_y = reference.combine([r.recv_x for r in ref], ref)[rank]
    ok = np.array_equal(recv_bits, ref[rank].recv_x)
    ok = ok and np.array_equal(y.view(torch.uint16).numpy(), ref_y)
    ok = ok and all(np.array_equal(v, getattr(ref[rank], f)) for f, v in got.items())
    print(f"rank {rank}/{world}: received {recv_bits.shape[0]} rows, combined "
          f"{tuple(y.shape)} {y.dtype}; equal to ubep.reference: {ok}")
    return ok


def main() -> int:
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    ok = run(dist.group.WORLD)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
