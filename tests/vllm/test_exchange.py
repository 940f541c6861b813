"""``ubep.vllm.exchange.EpExchange`` (what vLLM's all2all manager runs on) without vLLM.

Two ranks of ``ubep.launch``; every rank holds the same seeded experts ``e(x) = tanh(x @
W_e)``. What the exchange hands the experts kernel is run the way vLLM's CPU kernel runs it
(``sum_k w[r, k] * e_local(ids[r, k])(recv_x[r])``, local ids indexing this rank's experts),
and the combined rows must equal the brute force over each rank's own tokens with global ids.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

import ubep

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch is not installed")

NUM_EXPERTS, NUM_RANKS, HIDDEN, TOPK = 8, 2, 64, 3
TOKENS = (37, 0)  # rank 1 sends nothing and still serves its experts


def _experts() -> Any:
    import torch

    gen = torch.Generator().manual_seed(7)
    return torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5


def _inputs(rank: int) -> tuple[Any, Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    n = TOKENS[rank]
    x = torch.randn(n, HIDDEN, generator=gen)
    ids = torch.argsort(torch.rand(n, NUM_EXPERTS, generator=gen), dim=1)[:, :TOPK]
    weights = torch.rand(n, TOPK, generator=gen)
    return x, ids.to(torch.int32), weights


def _worker(group: Any, dtype_name: str) -> dict[str, Any]:
    import torch

    from ubep.vllm.exchange import EpExchange

    dtype = getattr(torch, dtype_name)
    w_experts = _experts()
    x, ids, weights = _inputs(group.rank)
    x = x.to(dtype)
    local = NUM_EXPERTS // NUM_RANKS
    with EpExchange(group, num_experts=NUM_EXPERTS, max_tokens_per_rank=64) as ex:
        recv_x, recv_w, recv_ids = ex.dispatch(x, weights, ids)
        out = torch.zeros(recv_x.shape[0], HIDDEN)
        for k in range(TOPK):  # vLLM's CPU kernel: local ids, every one taken as valid
            mine = w_experts[group.rank * local + recv_ids[:, k].long()]
            out += recv_w[:, k:k + 1] * torch.tanh(
                torch.einsum("rh,rhg->rg", recv_x.float(), mine))
        y = ex.combine(out.to(dtype))
        calls, stats_rows = ex.stats.calls, ex.stats.recv_rows
    ref = torch.zeros(x.shape[0], HIDDEN)
    for k in range(TOPK):
        ref += weights[:, k:k + 1] * torch.tanh(
            torch.einsum("th,thg->tg", x.float(), w_experts[ids[:, k].long()]))
    dest_ranks = {(t, int(e) // local) for t in range(x.shape[0]) for e in ids[t]}
    return {"err": float((y.float() - ref).abs().max()) if len(ref) else 0.0,
            "y_dtype": str(y.dtype), "y_shape": tuple(y.shape),
            "ids_dtype": str(recv_ids.dtype), "w_dtype": str(recv_w.dtype),
            "ids_range": (int(recv_ids.min()), int(recv_ids.max())) if recv_ids.numel()
            else (0, 0),
            "recv_rows": int(recv_x.shape[0]), "sent_pairs": len(dest_ranks), "calls": calls,
            "stats_rows": stats_rows}


@pytest.mark.parametrize(("dtype_name", "tol"), [("float32", 1e-5), ("bfloat16", 5e-2)])
def test_exchange_gives_each_rank_its_tokens_sums(dtype_name: str, tol: float) -> None:
    out = ubep.launch(_worker, NUM_RANKS, dtype_name)
    for rank, res in enumerate(out):
        assert res["err"] < tol, (rank, res)
        assert res["y_shape"] == (TOKENS[rank], HIDDEN)
        assert res["y_dtype"] == f"torch.{dtype_name}"
        assert (res["ids_dtype"], res["w_dtype"]) == ("torch.int32", "torch.float32")
        lo, hi = res["ids_range"]
        assert lo >= 0 and hi < NUM_EXPERTS // NUM_RANKS
        assert res["calls"] == 1
        assert res["stats_rows"] == res["recv_rows"]
    # a token goes once to each rank of its experts, nowhere else (not all-gathered)
    assert sum(r["recv_rows"] for r in out) == sum(r["sent_pairs"] for r in out)


def test_local_topk_fills_foreign_slots_with_a_held_expert_of_weight_zero() -> None:
    import torch

    from ubep.vllm.exchange import local_topk

    idx = np.array([[-1, 2, -1], [1, -1, 0], [3, 1, 2]])
    weights = np.array([[0, .5, 0], [.25, 0, .125], [.1, .2, .3]], dtype=np.float32)
    ids, w = local_topk(idx, weights, torch.int32, torch.float32)
    assert ids.tolist() == [[2, 2, 2], [1, 1, 0], [3, 1, 2]]
    assert np.array_equal(w.numpy(), weights)
    empty_ids, _ = local_topk(np.zeros((0, 3), np.int64), np.zeros((0, 3), np.float32),
                              torch.int32, torch.float32)
    assert empty_ids.shape == (0, 3)


def test_too_many_tokens_are_refused_before_any_exchange() -> None:
    import torch

    from ubep.vllm.exchange import EpExchange

    ex = EpExchange(object(), num_experts=NUM_EXPERTS, max_tokens_per_rank=4)
    with pytest.raises(ubep.InvalidArgumentError, match="max_tokens_per_rank=4"):
        ex.dispatch(torch.zeros(5, HIDDEN), torch.zeros(5, 2), torch.zeros(5, 2, dtype=torch.int32))
    with pytest.raises(ubep.InvalidArgumentError, match="hidden_states"):
        ex.dispatch(torch.zeros(2, HIDDEN, dtype=torch.int8), torch.zeros(2, 2),
                    torch.zeros(2, 2, dtype=torch.int32))
