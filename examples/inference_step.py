"""Expert-parallel MoE inference on 2 ranks, checked against the same layer run densely.

    python examples/inference_step.py

BF16 end to end: activations travel as their uint16 bits (no conversion, no copy); the
``"expert"`` layout reproduces the dense layer bit for bit (same rows per expert, same
float32 accumulation order).
"""

from __future__ import annotations

import torch

import ubep
from ubep.torch import MoELayer

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 128, 64, 16, 4, 8


def infer(group: ubep.runtime.Group) -> torch.Tensor:
    buffer = ubep.Buffer(
        group,
        ubep.BufferConfig(
            max_tokens_per_rank=TOKENS,
            hidden=HIDDEN,
            num_topk=TOP_K,
            num_experts=EXPERTS,
            dtype="bf16",
            layout="expert",
        ),
    )
    layer = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, buffer, seed=7, dtype=torch.bfloat16)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(group.rank))
    with torch.inference_mode():
        y = layer(x.to(torch.bfloat16))
    buffer.close()
    return y


if __name__ == "__main__":
    ys = ubep.launch(infer, 2, timeout_s=120)
    dense = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, None, seed=7, dtype=torch.bfloat16)
    xs = [
        torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
        for r in range(2)
    ]
    with torch.inference_mode():
        ref = dense.forward_dense(xs)
    for r in range(2):
        print(
            f"rank {r}: output {tuple(ys[r].shape)} {ys[r].dtype}, "
            f"bit-exact vs dense: {torch.equal(ys[r], ref[r])}"
        )
