"""Training steps of an expert-parallel MoE block, data parallel, under torchrun (copy and adapt).

    torchrun --nproc-per-node 2 examples/train_step.py

Every rank trains on its own batch (data parallel) and holds a replica of every *non-expert*
parameter (here an input projection and the router) but only its own 1/R of the experts (expert
parallel). dispatch/combine are differentiable, so ``loss.backward()`` sends gradients back
through ubep (the backward of dispatch is a combine, the backward of combine a dispatch). After
backward, with the global loss = the mean of the ranks' losses:

* **non-expert gradients must be all-reduced** (averaged) over the data-parallel ranks: each rank
  only saw its own batch, and without the all-reduce the replicas drift apart;
* **expert gradients are already complete**: combine's backward brought every rank's tokens'
  gradients to the rank that owns the expert, as a sum over the ranks' losses, so they only need
  the same ``1 / R`` as the mean.

The run checks at the end that the replicas are still identical on every rank.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import ubep
from ubep.torch import MoELayer

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS, STEPS = 64, 32, 8, 2, 16, 5
EXPERT_PARAMS = ("moe.gate_up_proj", "moe.down_proj")  # rank-local (MoELayer's experts)


class Block(nn.Module):
    """A projection (replicated) followed by an expert-parallel MoE layer."""

    def __init__(self, buffer: ubep.Buffer) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same replica on every rank
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, buffer, seed=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(torch.tanh(self.proj(x)))


def train(steps: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ubep.BufferConfig(max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOP_K,
                            num_experts=EXPERTS, dtype=torch.float32, layout="expert")
    buffer = ubep.Buffer(dist.group.WORLD, cfg)
    model = Block(buffer)
    replicated = [p for n, p in model.named_parameters() if n not in EXPERT_PARAMS]
    experts = [p for n, p in model.named_parameters() if n in EXPERT_PARAMS]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1234 + rank)  # each rank: its own data
    x, target = torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()  # collective: every rank runs it (dispatch/combine inside)
        for p in replicated:  # data parallel: average the non-expert gradients
            assert p.grad is not None
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world
        for p in experts:  # already summed over every rank's tokens by combine's backward
            assert p.grad is not None
            p.grad /= world
        opt.step()
        losses.append(loss.item())
    # The replicas stayed identical: every rank holds the same non-expert weights.
    mine = torch.cat([p.detach().flatten() for p in replicated])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(mine, other) for other in everyone), "replicas diverged"
    print(f"rank {dist.get_rank()}: replica check passed: the {mine.numel()} non-expert weights "
          f"are identical on all {world} ranks")
    buffer.close()
    return losses


def main() -> int:
    dist.init_process_group("gloo")
    losses = train(STEPS)
    print(f"rank {dist.get_rank()}: loss " + " -> ".join(f"{v:.4f}" for v in losses))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
