"""The V2 facade's receive layout and combine reduction (``ubep.torch.deep_ep_v2_layout``), in one
process, against brute force written from the module's documented order: expanded slots by a
loop over experts, rows and slots; the source's reduction by adding a ``[num_topk, tokens,
hidden]`` FP32 tensor slot by slot, zeros where a slot contributes nothing, onto the bias sum.
The signed zeros get their own case: a ``-0.0`` bias sum meets ``-0.0`` rows and zero slots."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from ubep.torch.deep_ep_v2_layout import (  # noqa: E402
    expanded_slots,
    masked_weights,
    received,
    reduce_at_source,
    source_route,
)


def _slots_by_loop(local_idx: np.ndarray, start: np.ndarray) -> np.ndarray:
    slots = np.full(local_idx.shape, -1, dtype=np.int64)
    for e in range(start.size):
        place = int(start[e])
        for r in range(local_idx.shape[0]):
            for k in range(local_idx.shape[1]):
                if local_idx[r, k] == e:
                    slots[r, k] = place
                    place += 1
    return slots


def _reduce_by_slots(rows: torch.Tensor, row_of: np.ndarray, use: np.ndarray,
                     bias: tuple[torch.Tensor, ...]) -> torch.Tensor:
    T, K = use.shape
    contrib = torch.zeros((K, T, rows.shape[1]), dtype=rows.dtype)
    for t in range(T):
        for k in range(K):
            if use[t, k]:
                contrib[k, t] = rows[int(row_of[t, k])]
    acc = torch.zeros((T, rows.shape[1]), dtype=torch.float32)
    if bias:
        acc = bias[0].float()
        for b in bias[1:]:
            acc = acc + b.float()
    for k in range(K):
        acc = acc + contrib[k].float()
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("seed", range(6))
def test_expanded_slots_and_counts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, K, L, R = int(rng.integers(0, 40)), int(rng.integers(1, 9)), int(rng.integers(1, 7)), 3
    local_idx = rng.integers(-1, L, size=(n, K))
    start = np.concatenate([[0], np.cumsum(rng.integers(0, 50, size=L))[:-1]]).astype(np.int64)
    np.testing.assert_array_equal(expanded_slots(local_idx, start),
                                  _slots_by_loop(local_idx, start))
    src_rank, src_token = rng.integers(0, R, size=n), rng.permutation(n)
    alignment = int(rng.integers(1, 5))
    rec = received(src_rank, src_token, local_idx, R, L, K, alignment)
    counts = [int((local_idx == e).sum()) for e in range(L)]
    np.testing.assert_array_equal(rec.counts, counts)
    np.testing.assert_array_equal(rec.slots, _slots_by_loop(rec.local_idx, rec.start))
    # the rows as the engines land them (already in the receive order): the same record
    order = np.lexsort((src_token, src_rank))
    landed = received(src_rank[order], src_token[order], local_idx[order], R, L, K, alignment)
    np.testing.assert_array_equal(landed.order, np.arange(n))
    for field in ("src_rank", "src_token", "local_idx", "counts", "aligned", "start",
                  "rows_per_rank", "slots"):
        np.testing.assert_array_equal(getattr(landed, field), getattr(rec, field))


@pytest.mark.parametrize("seed", range(4))
def test_source_route_last_slots(seed: int) -> None:
    rng = np.random.default_rng(seed)
    R, per_rank, K, T = 4, 3, 6, 30
    topk_idx = rng.integers(-1, R * per_rank, size=(T, K))
    route = source_route(topk_idx, R * per_rank, R)
    for t in range(T):
        for k in range(K):
            owner = -1 if topk_idx[t, k] < 0 else int(topk_idx[t, k]) // per_rank
            later = [int(topk_idx[t, j]) // per_rank for j in range(k + 1, K)
                     if topk_idx[t, j] >= 0]
            assert route.last[t, k] == (owner >= 0 and owner not in later)
    for r in range(R):
        want = [t for t in range(T) if any(topk_idx[t, k] >= 0 and topk_idx[t, k] // per_rank
                                           == r for k in range(K))]
        np.testing.assert_array_equal(route.tokens_to[r], want)


@pytest.mark.parametrize("num_bias", [0, 1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_reduce_at_source_bitwise(num_bias: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    T, K, H, m = 24, 5, 16, 40
    # rows of mixed magnitude (FP32 partial sums round), a third of them -0.0 or +0.0
    rows = (torch.randn(m, H, generator=g) * 2.0 ** torch.randint(-8, 20, (m, 1), generator=g))
    zero_rows = torch.rand(m, generator=g) < 0.33
    rows[zero_rows] = torch.where(torch.rand(int(zero_rows.sum()), H, generator=g) < 0.5,
                                  -0.0, 0.0)
    use = rng.random((T, K)) < 0.6
    use[: T // 4] = True  # tokens with no unused slot
    row_of = np.where(use, rng.integers(0, m, size=(T, K)), -1)
    rows[m - 1] = -0.0  # token 0 adds it at every slot, token 2 at all slots but one
    use[0], use[2], use[2, 1] = True, True, False
    row_of[0], row_of[2] = m - 1, np.where(use[2], m - 1, -1)
    rows = rows.to(torch.bfloat16)
    bias = tuple((torch.randn(T, H, generator=g) * 4).to(torch.bfloat16) for _ in range(num_bias))
    for b in bias:  # -0.0 bias sums on half the tokens: they meet the zero slots
        b[::2] = -0.0
    got = reduce_at_source(rows, row_of, use, bias, torch.bfloat16)
    want = _reduce_by_slots(rows, row_of, use, bias)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the signed zeros are really met: a -0.0 bias sum stays -0.0 through -0.0 rows, and a
    # slot without a row makes it +0.0 (without bias the sum starts at +0.0)
    assert bool((want[0].view(torch.int16) == (-32768 if num_bias else 0)).all())
    assert bool((want[2].view(torch.int16) == 0).all())


@pytest.mark.parametrize("seed", range(3))
def test_masked_weights_keep_routed_weights_bit_for_bit_and_refuse_ids_out_of_range(
        seed: int) -> None:
    rng = np.random.default_rng(seed)
    E, T, K = 16, 9, 4
    idx = rng.integers(-1, E, size=(T, K))
    w = rng.standard_normal((T, K)).astype(np.float32)
    w[0, :] = [-0.0, np.nan, np.inf, -np.inf]
    idx[0, :] = [1, 2, 3, 4]
    want = np.zeros((T, K), np.float32)
    for t in range(T):  # the brute force
        for k in range(K):
            if idx[t, k] >= 0:
                want[t, k] = w[t, k]
    for i, ws in ((idx, w), (np.asfortranarray(idx), w)):  # native, then numpy's way
        got = masked_weights(i, ws, E)
        assert got is not None and np.array_equal(got.view(np.uint32), want.view(np.uint32))
        zeros = masked_weights(i, None, E)
        assert zeros is not None and not zeros.view(np.uint32).any()
    for bad in (-2, E):
        wrong = idx.copy()
        wrong[T - 1, K - 1] = bad
        assert masked_weights(wrong, w, E) is None
        assert masked_weights(np.asfortranarray(wrong), w, E) is None
