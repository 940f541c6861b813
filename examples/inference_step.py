"""Expert-parallel MoE inference on 2 ranks, checked against the same layer run densely.

    python examples/inference_step.py

BF16 end to end: activations travel as their uint16 bits (no conversion, no copy); the
``"expert"`` layout reproduces the dense layer bit for bit (same rows per expert, same
float32 accumulation order).
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import Group, launch
from ubep.torch import MoELayer

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 128, 64, 16, 4, 8


def infer(group: Group) -> np.ndarray:
    buffer = Buffer(
        group,
        BufferConfig(
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
    # Return plain arrays from a rank (a tensor would be shared through a file descriptor that
    # dies with the process); float32 holds every bf16 value exactly.
    return y.float().numpy()


if __name__ == "__main__":
    ys = [torch.from_numpy(y).to(torch.bfloat16) for y in launch(infer, 2, timeout_s=120)]
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
