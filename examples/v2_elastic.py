"""DeepEP V2's ``ElasticBuffer`` on ubep: a dispatch, identity experts and the combine.

    .venv/bin/python examples/v2_elastic.py      # ubep.launch starts the 2 ranks

With identity experts each token comes back as its row times the ranks it visited (V2's combine
sums the rows at their source without router weights): ``run`` checks that bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

import ubep
from ubep.deep_ep import ElasticBuffer

TOKENS, HIDDEN, EXPERTS, TOPK, RANKS = 16, 256, 8, 2, 2


def run(group: Any) -> bool:
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=TOKENS, explicitly_destroy=True)
    g = torch.Generator().manual_seed(group.rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx, num_experts=EXPERTS)
    y, _, _ = buffer.combine(recv_x, handle)                 # the experts: identity
    buffer.destroy()
    owners = topk_idx // (EXPERTS // group.num_ranks)
    visits = torch.tensor([[len(set(row))] for row in owners.tolist()])
    return torch.equal(y, (x.float() * visits).to(torch.bfloat16))


if __name__ == "__main__":
    print(ubep.launch(run, RANKS))                           # [True, True]
