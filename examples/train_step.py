"""One training step of an expert-parallel MoE layer on 2 ranks (copy and adapt).

Each rank owns half of the experts and its own batch; dispatch/combine are differentiable, so
``loss.backward()`` sends gradients back through ubep (the backward of dispatch is a combine,
the backward of combine a dispatch). The router is replicated: its gradients are averaged across
ranks here with a small allgather, as data-parallel training would.

    python examples/train_step.py
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import Group, launch
from ubep.torch import MoELayer

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 64, 32, 8, 2, 16


def train(group: Group, steps: int) -> list[float]:
    torch.manual_seed(1234 + group.rank)  # each rank: its own data
    buffer = Buffer(
        group,
        BufferConfig(
            max_tokens_per_rank=TOKENS,
            hidden=HIDDEN,
            num_topk=TOP_K,
            num_experts=EXPERTS,
            dtype="fp32",
            layout="expert",
        ),
    )
    layer = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, buffer, seed=0)  # same seed on every rank
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(TOKENS, HIDDEN)
    target = torch.randn(TOKENS, HIDDEN)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(x), target)
        loss.backward()  # collective: every rank runs it
        # Replicated router: average its gradient over ranks (experts are rank-local).
        grads = group.allgather(layer.router.grad.tolist())  # small, JSON-able
        layer.router.grad.copy_(torch.tensor(np.mean(grads, axis=0)))
        opt.step()
        losses.append(loss.item())
    buffer.close()
    return losses


if __name__ == "__main__":
    for rank, losses in enumerate(launch(train, 2, 5, timeout_s=120)):
        print(f"rank {rank}: loss " + " -> ".join(f"{v:.4f}" for v in losses))
