"""One rank of test_multihost_torch.py's job: a torch program launched by ``mpiexec`` across
namespaced hosts, ``torch.distributed`` (gloo) initialised from the launcher's environment.

``python -m tests.mpi._torch_worker OUT_DIR`` (every rank): on ``dist.group.WORLD`` it runs
``ubep.Buffer`` (both layouts, against ``ubep.reference`` bit for bit), ``ubep.deep_ep.Buffer``
(normal and low-latency calls, against closed forms of identity experts) and the V2 buffers
(``tests/torch/_torchrun_v2_worker.run``: ``ElasticBuffer`` and ``EPBuffer``), and writes what
it found to ``OUT_DIR/torch.RANK.json`` (the V2 results as that worker writes them).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

E, H, K, T = 8, 64, 2, 6  # experts (2 per rank on 4 ranks), hidden, top-k, tokens per rank


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(x bf16 [T - rank % 2, H], topk_idx, topk_weights)``, one slot masked."""
    g = torch.Generator().manual_seed(700 + rank)
    n = T - rank % 2
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    idx[1, 1] = -1
    return x, idx, torch.rand(n, K, generator=g)


def _ubep_buffer(rank: int, R: int) -> dict[str, Any]:
    """ubep.Buffer on the torch group, each layout: dispatch + combine vs the reference."""
    import ubep
    from ubep import testing

    xs, idxs, ws = testing.inputs("bf16", E, K, H, [T - r % 2 for r in range(R)], 11, "uniform")
    found: dict[str, Any] = {}
    for layout in ("expert", "rank"):
        cfg = ubep.BufferConfig(max_tokens_per_rank=T, hidden=H, num_topk=K, num_experts=E,
                                dtype="bf16", layout=layout, sync="dc", timeout_s=60.0)
        with ubep.Buffer(dist.group.WORLD, cfg) as buf:
            found[f"buffer.{layout}.group"] = type(buf.group).__name__
            found[f"buffer.{layout}.errors"] = testing.check_call(buf, xs, idxs, ws, 3)
            found[f"buffer.{layout}.errors"] += testing.check_call(buf, xs, idxs, ws, 4)
    return found


def _f32_rows(x: torch.Tensor) -> np.ndarray:
    return x.float().numpy()


def _deep_ep(rank: int, R: int) -> dict[str, Any]:
    """DeepEP's normal and low-latency round trips with identity experts, against closed forms
    over every rank's inputs (float32 sums in DeepEP's order, rounded to BF16 once)."""
    from ubep.deep_ep import Buffer

    x, idx, w = _inputs(rank)
    found: dict[str, Any] = {}
    buf = Buffer(dist.group.WORLD, explicitly_destroy=True, low_latency_mode=True,
                 max_tokens_per_rank=T, timeout_s=60.0)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv, _, _, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    # rows this rank received: every rank's tokens with an expert here, by source then token
    L = E // R
    want = [xs[t] for s in range(R) for xs, ids in [(_inputs(s)[0], _inputs(s)[1])]
            for t in range(ids.shape[0]) if bool(((ids[t] // L) == rank).any())]
    found["normal.recv"] = bool(torch.equal(recv.view(torch.int16),
                                            torch.stack(want).view(torch.int16)))
    y, _, _ = buf.combine(recv, handle)
    ranks_of = torch.zeros(x.shape[0], dtype=torch.float32)  # ranks each token went to
    for t in range(x.shape[0]):
        ranks_of[t] = len({int(e) // L for e in idx[t] if e >= 0})
    acc = np.zeros((x.shape[0], H), np.float32)
    for t in range(x.shape[0]):
        for _ in range(int(ranks_of[t])):
            acc[t] += _f32_rows(x[t])
    found["normal.combine"] = bool(torch.equal(
        y.view(torch.int16), torch.from_numpy(acc).to(torch.bfloat16).view(torch.int16)))
    # low latency: rows per local expert (source by source, then token), weighted combine
    recv_ll, count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    ok = True
    for el in range(L):
        expert = rank * L + el
        rows = [_inputs(s)[0][t] for s in range(R) for t in range(_inputs(s)[1].shape[0])
                if bool((_inputs(s)[1][t] == expert).any())]
        ok = ok and int(count[el]) == len(rows)
        if rows:
            ok = ok and bool(torch.equal(recv_ll[el, :len(rows)].view(torch.int16),
                                         torch.stack(rows).view(torch.int16)))
    found["ll.recv"] = ok
    y_ll, _, _ = buf.low_latency_combine(recv_ll, idx, w, ll_handle)
    acc = np.zeros((x.shape[0], H), np.float32)
    for t in range(x.shape[0]):
        for k in range(K):
            if idx[t, k] >= 0:
                acc[t] += np.float32(w[t, k].item()) * _f32_rows(x[t])
    found["ll.combine"] = bool(torch.equal(
        y_ll.view(torch.int16), torch.from_numpy(acc).to(torch.bfloat16).view(torch.int16)))
    buf.destroy()
    return found


def main(out: str) -> int:
    os.environ["MASTER_ADDR"] = os.environ["UBEP_TEST_MASTER_ADDR"]
    os.environ["MASTER_PORT"] = os.environ["UBEP_TEST_MASTER_PORT"]
    rank, R = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=120))
    from tests.torch import _torchrun_v2_worker as v2
    from ubep.torch.group import from_torch

    group = from_torch(dist.group.WORLD)
    found: dict[str, Any] = {"group": type(group).__name__,
                             "hosts": int(getattr(group, "num_hosts", 1))}
    found |= _ubep_buffer(rank, R)
    found |= _deep_ep(rank, R)
    v2.run(out)
    with open(os.path.join(out, f"torch.{rank}.json"), "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
