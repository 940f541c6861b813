"""ubep.deep_ep's surface beyond DeepEP's intranode and low-latency calls, on real processes
(``ubep.launch``): the raw buffer tensors in shared memory, the internode pair on one host, and
masking a rank on request in shrink mode; each against a closed form or ``ubep.reference``.
(The constructor's order and the mask API without shrink are in test_torch_deep_ep.py; the
internode pair across hosts and ``comm=`` in tests/mpi/test_mpi_deep_ep.py; the shrink program
in test_deepep_programs.py.)"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from tests._shm import leaked_since, ubep_segments  # noqa: E402
from tests.torch import _deepep_oracle as oracle  # noqa: E402
from ubep import reference  # noqa: E402
from ubep.errors import InvalidArgumentError, RankMaskedError  # noqa: E402
from ubep.runtime import launch  # noqa: E402
from ubep.runtime.launch import LostRank  # noqa: E402

NVL_BYTES, RDMA_BYTES = 4096, 1024


def _raw_buffers(group: Any) -> dict[str, Any]:
    from ubep.deep_ep import Buffer

    buf = Buffer(group, NVL_BYTES, RDMA_BYTES, explicitly_destroy=True)
    nvl = buf.get_local_buffer_tensor(torch.int32)  # the whole NVL buffer
    nvl.copy_(torch.arange(nvl.numel(), dtype=torch.int32) + 1000 * group.rank)
    rdma = buf.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), 64, True)
    rdma.fill_(group.rank + 0.5)
    group.barrier()  # every rank wrote
    peer = (group.rank + 1) % group.num_ranks
    out = {
        "numel": nvl.numel(),
        "peer_nvl": buf.get_peer_buffer_tensor(peer, torch.int32).clone().numpy(),
        "peer_rdma": buf.get_peer_buffer_tensor(peer, torch.float32, (4, 8), 64, True).clone()
        .numpy(),
        # a second view at byte offset 8 is the same memory: its first element is nvl[2]
        "offset_view": buf.get_local_buffer_tensor(torch.int32, offset=8)[:3].clone().numpy(),
    }
    with pytest.raises(InvalidArgumentError, match="size"):
        buf.get_local_buffer_tensor(torch.int32, torch.Size([NVL_BYTES]))
    with pytest.raises(InvalidArgumentError, match="offset"):
        buf.get_local_buffer_tensor(torch.int32, offset=NVL_BYTES + 4)
    group.barrier()  # every rank read its peer before the regions go
    buf.destroy()
    with pytest.raises(InvalidArgumentError, match="destroyed"):
        buf.get_local_buffer_tensor(torch.int32)
    return out


def _worker(group: Any) -> dict[str, Any]:
    from ubep.deep_ep import Buffer

    buf = Buffer(group, max_tokens_per_rank=8, timeout_s=60.0)
    return {"raw": _raw_buffers(group),
            "internode": oracle.normal_flow(buf, group.rank, internode=True),
            "normal": oracle.normal_flow(buf, group.rank, internode=False)}


def test_raw_buffers_and_the_internode_pair_on_one_host() -> None:
    """get_local_buffer_tensor is shared memory its peers see (closed form); the internode pair
    on one host matches ubep.reference and DeepEP's handle (brute force)."""
    num_ranks = 3
    before = ubep_segments()
    res, ys = oracle.normal_reference(num_ranks)
    for rank, got in enumerate(launch(_worker, num_ranks, timeout_s=120)):
        peer = (rank + 1) % num_ranks
        raw = got["raw"]
        assert raw["numel"] == NVL_BYTES // 4
        np.testing.assert_array_equal(raw["peer_nvl"], np.arange(NVL_BYTES // 4) + 1000 * peer)
        np.testing.assert_array_equal(raw["peer_rdma"], np.full((4, 8), peer + 0.5, np.float32))
        np.testing.assert_array_equal(raw["offset_view"], np.arange(2, 5) + 1000 * rank)
        oracle.check_normal(got["internode"], rank, num_ranks, [0] * num_ranks, res, ys)
        oracle.check_normal(got["normal"], rank, num_ranks, None, res, ys)
        assert got["normal"]["type"] == "NormalHandle" and got["internode"]["per_rdma"] is None
    assert leaked_since(before) == []


# --- shrink mode: a rank that dies, a rank masked on request ------------------------------

SHRINK_RANKS, DEAD, VICTIM, MAX_TOKENS = 3, 1, 2, 8


def _ll_round(buf: Any, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """One low-latency round trip with identity experts: (valid received rows, combined y)."""
    x, idx, w = oracle.inputs(rank)
    recv, count, handle, _, hook = buf.low_latency_dispatch(
        x, idx, MAX_TOKENS, oracle.E, use_fp8=False, return_recv_hook=True)
    hook()  # a masking Buffer runs the call at once; the hook still completes it
    rows = torch.cat([recv[e, : int(c)] for e, c in enumerate(count.tolist())])
    y, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    return rows.float().numpy(), y.float().numpy()


def _status(buf: Any) -> np.ndarray:
    status = torch.full((SHRINK_RANKS,), 7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    return status.numpy()


def _shrink_worker(group: Any) -> dict[str, Any]:
    from ubep.deep_ep import Buffer

    buf = Buffer(group, 0, 0, True, enable_shrink=True, timeout_s=60.0)
    out: dict[str, Any] = {"full": _ll_round(buf, group.rank)}
    buf.clean_low_latency_buffer(MAX_TOKENS, oracle.H, oracle.E)  # a barrier of the members
    if group.rank == DEAD:
        os._exit(3)  # dies before its next dispatch: the others see its pid gone at once
    out["dead"] = _ll_round(buf, group.rank)
    out["status_dead"] = _status(buf)
    buf.low_latency_update_mask_buffer(VICTIM, True)  # every member, the victim too
    if group.rank == VICTIM:
        with pytest.raises(RankMaskedError):
            _ll_round(buf, group.rank)
        return {"masked": True, "full": out["full"], "dead": out["dead"]}
    out["status"] = _status(buf)
    out["masked"] = _ll_round(buf, group.rank)
    buf.low_latency_update_mask_buffer(VICTIM, True)  # masked already: nothing happens
    with pytest.raises(InvalidArgumentError, match="rejoin"):
        buf.low_latency_update_mask_buffer(VICTIM, False)
    with pytest.raises(InvalidArgumentError, match="enable_shrink"):
        buf.dispatch(torch.zeros(1, oracle.H), num_tokens_per_expert=torch.zeros(oracle.E))
    out["again"] = _ll_round(buf, group.rank)
    buf.low_latency_clean_mask_buffer()  # the mask stays: those ranks are gone
    out["status_clean"] = _status(buf)
    return out


def _ll_reference(masked: set[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Expert-layout reference with the masked ranks' tokens gone and their experts' slots -1
    (DeepEP's shrink semantics, docs/ELASTIC.md)."""
    per = oracle.E // SHRINK_RANKS
    xs, idxs, ws = [], [], []
    for r in range(SHRINK_RANKS):
        x, idx, w = oracle.inputs(r)
        idx = idx.clone()
        idx[(idx >= 0) & torch.isin(idx // per, torch.tensor(sorted(masked) or [-1]))] = -1
        keep = slice(0, 0) if r in masked else slice(None)
        xs.append(x[keep].view(torch.int16).numpy().view(np.uint16))
        idxs.append(idx[keep].numpy())
        ws.append(w[keep].numpy())
    res = reference.dispatch(xs, idxs, ws, oracle.E, layout="expert")
    ys = reference.combine([r.recv_x for r in res], res)
    return ([oracle.bf16_as_f32(r.recv_x) for r in res], [oracle.bf16_as_f32(y) for y in ys])


def _check_round(got: tuple[np.ndarray, np.ndarray], rank: int, masked: set[int]) -> None:
    rows, ys = _ll_reference(masked)
    np.testing.assert_array_equal(got[0], rows[rank])
    np.testing.assert_array_equal(got[1], ys[rank])


def test_shrink_mode_masks_a_dead_rank_and_one_on_request_serving_on_bit_exact() -> None:
    before = ubep_segments()
    got = launch(_shrink_worker, SHRINK_RANKS, timeout_s=180, keep_survivors=True)
    assert isinstance(got[DEAD], LostRank)
    assert got[VICTIM]["masked"]
    for rank in (0, VICTIM):
        _check_round(got[rank]["full"], rank, set())
        _check_round(got[rank]["dead"], rank, {DEAD})
    survivor = got[0]
    np.testing.assert_array_equal(survivor["status_dead"], [0, 1, 0])
    np.testing.assert_array_equal(survivor["status"], [0, 1, 1])
    _check_round(survivor["masked"], 0, {DEAD, VICTIM})
    _check_round(survivor["again"], 0, {DEAD, VICTIM})
    np.testing.assert_array_equal(survivor["status_clean"], [0, 1, 1])
    assert leaked_since(before) == []
