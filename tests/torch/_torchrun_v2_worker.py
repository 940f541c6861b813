"""The per-rank program of test_deep_ep_v2_programs.py's torchrun test:

    torchrun --standalone --nproc-per-node N -m tests.torch._torchrun_v2_worker OUT_DIR

Each rank joins torch.distributed (gloo), builds ``ubep.deep_ep.ElasticBuffer`` and ``EPBuffer``
on ``dist.group.WORLD``, dispatches (compact and expanded) and combines, and checks the compact
dispatch against DeepEP's own reference algorithm (``deep_ep/utils/refs.py``'s ``dispatch``)
written here on ``torch.distributed.all_to_all_single``; it saves the combine outputs for the
test, which compares them with the single-process oracle.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from tests.torch import _deepep_v2_oracle as oracle
from tests.torch._deepep_v2_oracle import Case, Shape

CASE = Case(expert_alignment=2, num_bias=2, seed=5)


def a2a_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, shape: Shape
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepEP's reference dispatch on all_to_all_single: ``(recv_x, recv_topk_idx (local),
    src_token_global_idx)`` sorted by source rank, then token."""
    rank, R, L = dist.get_rank(), dist.get_world_size(), shape.local
    send_rows, send_idx, send_src, counts = [], [], [], []
    for dst in range(R):
        owned = (topk_idx >= dst * L) & (topk_idx < (dst + 1) * L)
        tokens = owned.any(dim=1).nonzero(as_tuple=True)[0]
        counts.append(tokens.numel())
        send_rows.append(x[tokens].float())  # gloo has no BF16; BF16 -> FP32 -> BF16 is exact
        send_idx.append(topk_idx[tokens])
        send_src.append(tokens + rank * shape.num_max_tokens_per_rank)
    send_counts = torch.tensor(counts, dtype=torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    out_split, in_split = recv_counts.tolist(), counts
    n = sum(out_split)
    recv_x = torch.empty(n, x.shape[1], dtype=torch.float32)
    recv_idx = torch.empty(n, topk_idx.shape[1], dtype=torch.int64)
    recv_src = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(recv_x, torch.cat(send_rows), out_split, in_split)
    dist.all_to_all_single(recv_idx, torch.cat(send_idx), out_split, in_split)
    dist.all_to_all_single(recv_src, torch.cat(send_src), out_split, in_split)
    mine = (recv_idx >= rank * L) & (recv_idx < (rank + 1) * L)
    local = torch.where(mine, recv_idx - rank * L, -1)
    return recv_x.to(torch.bfloat16), local, recv_src


def run(out: str) -> None:
    from ubep.deep_ep import ElasticBuffer, EPBuffer

    rank, R = dist.get_rank(), dist.get_world_size()
    shape = Shape(num_ranks=R)
    inp = oracle.inputs(shape, CASE, rank)
    saved: dict[str, np.ndarray] = {}
    checks: dict[str, bool] = {}
    ref_x, ref_idx, ref_src = a2a_dispatch(inp["x"], inp["topk_idx"], shape)
    for name, cls in (("elastic", ElasticBuffer), ("ep", EPBuffer)):
        buf = cls(dist.group.WORLD, num_max_tokens_per_rank=shape.num_max_tokens_per_rank,
                  explicitly_destroy=True)
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
            inp["x"], inp["topk_idx"], inp["topk_weights"], num_experts=shape.num_experts,
            expert_alignment=CASE.expert_alignment)
        checks[f"{name}.dispatch"] = bool(
            torch.equal(recv_x.view(torch.int16), ref_x.view(torch.int16))
            and torch.equal(recv_idx, ref_idx)
            and torch.equal(handle.recv_src_metadata[:, 0].long(), ref_src))
        y = oracle.local_partial(ref_src, ref_idx, shape.hidden)
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=inp["bias"])
        saved[f"{name}.combined"] = oracle.bits(combined)
        checks[f"{name}.weights"] = bool(torch.equal(combined_w, inp["topk_weights"]))
        ex, _, _, eh, _ = buf.dispatch(inp["x"], inp["topk_idx"], num_experts=shape.num_experts,
                                       expert_alignment=CASE.expert_alignment, do_expand=True)
        ye = torch.zeros(ex.shape, dtype=torch.bfloat16)
        slots, src = eh.recv_src_metadata[:, 2:], eh.recv_src_metadata[:, 0].long()
        for k in range(shape.num_topk):
            ok = slots[:, k] >= 0
            ye[slots[ok, k].long()] = oracle.expert_rows(src[ok], k, shape.hidden)
        saved[f"{name}.e_combined"] = oracle.bits(buf.combine(ye, eh, bias=inp["bias"])[0])
        buf.destroy()
    np.savez(os.path.join(out, f"v2.{rank}.npz"), **saved)
    with open(os.path.join(out, f"v2.{rank}.json"), "w") as f:
        json.dump(checks, f)


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    run(argv[1])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
