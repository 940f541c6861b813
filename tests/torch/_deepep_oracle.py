"""Inputs and brute-force oracles the DeepEP-surface tests share (test_deep_ep_surface.py and
the mpiexec run in tests/mpi/test_mpi_deep_ep.py): every rank's inputs rebuilt from its
seed, DeepEP's internode handle recomputed from all ranks' routing, and the normal-mode results
from ``ubep.reference`` (rank layout)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ubep import reference

E, H, K = 6, 32, 2  # experts (a multiple of 2 and 3 ranks), hidden, top-k


def inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(x bf16 [4 + rank, H], topk_idx int64, topk_weights float32)``: distinct
    experts per token, one slot dropped (-1)."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 4 + rank
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    idx[1, 0] = -1
    w = torch.rand(n, K, generator=g, dtype=torch.float32)
    return x, idx, w


def in_rank_of(idx: torch.Tensor, num_ranks: int) -> np.ndarray:
    """``[num_tokens, num_ranks]``: the token has an expert on that rank (brute force)."""
    per = E // num_ranks
    out = np.zeros((idx.shape[0], num_ranks), dtype=bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                out[t, e // per] = True
    return out


def normal_reference(num_ranks: int) -> tuple[list[Any], list[np.ndarray]]:
    """The rank-layout dispatch of every rank's inputs, and the combine of identity experts
    (each rank sends back the rows it received)."""
    xs, idxs, ws = zip(*(inputs(r) for r in range(num_ranks)), strict=True)
    res = reference.dispatch([x.view(torch.int16).numpy().view(np.uint16) for x in xs],
                             [i.numpy() for i in idxs], [w.numpy() for w in ws], E,
                             layout="rank")
    ys = reference.combine([r.recv_x for r in res], res)
    return res, ys


def bf16_as_f32(a: np.ndarray) -> np.ndarray:
    """uint16 BF16 bits as float32 values (exact)."""
    return (np.asarray(a, dtype=np.uint32) << 16).view(np.float32)


def internode_handle(rank: int, num_ranks: int, host_of: list[int]) -> dict[str, np.ndarray]:
    """DeepEP's internode handle fields of ``rank`` on ubep's direct path, brute force from every
    rank's routing (the meanings in ``ubep.torch.deep_ep_types.InternodeHandle``)."""
    hosts = max(host_of) + 1
    local = [p for p in range(num_ranks) if host_of[p] == host_of[rank]]
    ins = [in_rank_of(inputs(r)[1], num_ranks) for r in range(num_ranks)]
    mine = ins[rank]
    to_host = np.stack([mine[:, [p for p in range(num_ranks) if host_of[p] == h]].any(axis=1)
                        for h in range(hosts)], axis=1)
    per_src = np.array([ins[s][:, rank].sum() for s in range(num_ranks)])
    # where token t of source s lands at rank p: its index among s's tokens sent to p
    def row_at(s: int, t: int, p: int) -> int:
        before = sum(ins[q][:, p].sum() for q in range(s))
        return int(before + ins[s][:t, p].sum()) if ins[s][t, p] else -1

    rows = [(s, t) for s in range(num_ranks) for t in np.flatnonzero(ins[s][:, rank])]
    meta = np.array([[host_of[s], sum(1 << j for j, p in enumerate(local) if ins[s][t, p])]
                     for s, t in rows], dtype=np.int32).reshape(-1, 2)
    from_host = np.array([per_src[[s for s in range(num_ranks) if host_of[s] == h]].sum()
                          for h in range(hosts)])
    send_rdma = np.full(to_host.shape, -1)
    for h in range(hosts):
        send_rdma[to_host[:, h], h] = np.arange(to_host[:, h].sum())
    return {
        "is_token_in_rank": mine,
        "rdma_channel_prefix_matrix": to_host.sum(axis=0)[:, None],
        "gbl_channel_prefix_matrix": mine.sum(axis=0)[:, None],
        "recv_rdma_channel_prefix_matrix": from_host[:, None],
        "recv_rdma_rank_prefix_sum": np.cumsum(from_host),
        "recv_gbl_channel_prefix_matrix": (np.cumsum(per_src) - per_src)[:, None],
        "recv_gbl_rank_prefix_sum": np.cumsum(per_src),
        "recv_src_meta": meta.view(np.uint8).reshape(-1, 8),
        "send_rdma_head": send_rdma,
        "send_nvl_head": np.array([[row_at(s, t, p) for p in local] for s, t in rows],
                                  dtype=np.int64).reshape(-1, len(local)),
    }


def normal_flow(buf: Any, rank: int, internode: bool) -> dict[str, Any]:
    """DeepEP's normal round trip through ``buf`` (``internode``: the explicit internode calls,
    positionally in DeepEP's order; else ``dispatch``/``combine``), identity experts."""
    x, idx, w = inputs(rank)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    if internode:
        recv, recv_idx, recv_w, counts, handle, _ = buf.internode_dispatch(
            x, None, per_rank, per_rdma, in_rank, per_expert, idx, w)
        y, _, _ = buf.internode_combine(recv, handle)
        cached = buf.internode_dispatch(x, handle)[0]
    else:
        recv, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
            topk_weights=w)
        y, _, _ = buf.combine(recv, handle)
        cached = buf.dispatch(x, handle=handle)[0]
    return {
        "recv": recv.float().numpy(), "y": y.float().numpy(), "len": len(handle),
        "handle": [np.asarray(f.numpy()) for f in handle], "type": type(handle).__name__,
        "per_rdma": None if per_rdma is None else per_rdma.numpy(),
        "cached_ok": bool(torch.equal(cached, recv)), "counts": list(counts),
        "recv_idx": recv_idx.numpy(), "recv_w": recv_w.numpy(),
    }


def received_routing(rank: int, num_ranks: int, res: list[Any]) -> tuple[np.ndarray, ...]:
    """DeepEP's ``recv_topk_idx`` (the rank's local expert of each slot, -1 where the slot's
    expert is elsewhere or dropped), ``recv_topk_weights`` (0 there) and the per-local-expert
    counts of ``rank``'s received rows, brute force from each row's source token."""
    per = E // num_ranks
    ref = res[rank]
    rows_idx, rows_w = [], []
    for src, token in zip(ref.recv_src_rank.tolist(), ref.recv_src_token.tolist(), strict=True):
        _, idx, w = inputs(src)
        row = idx[token].numpy()
        local = np.where((row >= 0) & (row // per == rank), row - rank * per, -1)
        rows_idx.append(local)
        rows_w.append(np.where(local >= 0, w[token].numpy(), np.float32(0)))
    recv_idx = np.array(rows_idx, dtype=np.int64).reshape(-1, K)
    counts = np.array([(recv_idx == e).sum() for e in range(per)], dtype=np.int64)
    return recv_idx, np.array(rows_w, dtype=np.float32).reshape(-1, K), counts


def check_normal(got: dict[str, Any], rank: int, num_ranks: int, host_of: list[int] | None,
                 res: list[Any], ys: list[np.ndarray]) -> None:
    """``got`` (:func:`normal_flow`) against the reference; with ``host_of`` also its internode
    handle against :func:`internode_handle`."""
    np.testing.assert_array_equal(got["recv"], bf16_as_f32(res[rank].recv_x))
    np.testing.assert_array_equal(got["y"], bf16_as_f32(ys[rank]))
    assert got["cached_ok"]
    recv_idx, recv_w, counts = received_routing(rank, num_ranks, res)
    np.testing.assert_array_equal(got["recv_idx"], recv_idx)
    np.testing.assert_array_equal(got["recv_w"], recv_w)
    assert got["counts"] == counts.tolist()
    if host_of is None:
        # the intranode handle: rank_prefix_matrix (tokens sources 0..i sent each rank),
        # recv_src_idx (each row's token at its source), is_token_in_rank
        sent = np.array([in_rank_of(inputs(s)[1], num_ranks).sum(axis=0)
                         for s in range(num_ranks)])
        np.testing.assert_array_equal(got["handle"][0], np.cumsum(sent, axis=0))
        np.testing.assert_array_equal(got["handle"][3], res[rank].recv_src_token)
        np.testing.assert_array_equal(got["handle"][4], in_rank_of(inputs(rank)[1], num_ranks))
        return
    want = internode_handle(rank, num_ranks, host_of)
    assert got["type"] == "InternodeHandle" and got["len"] == 10
    for (name, value), field in zip(want.items(), got["handle"], strict=True):
        np.testing.assert_array_equal(field, value, err_msg=name)
    np.testing.assert_array_equal(got["handle"][-4], want["recv_gbl_rank_prefix_sum"])
    if max(host_of) > 0:
        np.testing.assert_array_equal(got["per_rdma"], want["rdma_channel_prefix_matrix"][:, 0])
