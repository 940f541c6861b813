"""Tests of ubep.routing: DeepEP's dispatch layout against a brute-force loop, and the seeded
generators against the distributions they claim (closed forms computed here: exact successive
sampling probabilities by enumeration, binomial expectations with scipy.stats.binom).

Statistical tests run at fixed seeds with generous thresholds (5 sigma, p > 1e-4), so they are
deterministic and still catch a wrong distribution by a wide margin.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from ubep.errors import InvalidArgumentError
from ubep.routing import (
    experts_per_rank,
    get_dispatch_layout,
    hot_experts_topk,
    uniform_topk,
    validate_topk_idx,
    zipf_topk,
)

# --- dispatch layout ---------------------------------------------------------------------------


def brute_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int):
    L = num_experts // num_ranks
    T = len(topk_idx)
    per_expert = [0] * num_experts
    in_rank = [[False] * num_ranks for _ in range(T)]
    for t in range(T):
        for e in topk_idx[t]:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t][e // L] = True
    per_rank = [sum(in_rank[t][r] for t in range(T)) for r in range(num_ranks)]
    return per_rank, per_expert, in_rank


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4), st.integers(1, 4), st.integers(0, 12), st.integers(1, 4),
    st.floats(0, 1), st.integers(0, 2**16),
)
def test_dispatch_layout_matches_brute_force(num_ranks, local, num_tokens, num_topk, mask, seed):
    num_experts = num_ranks * local
    num_topk = min(num_topk, num_experts)
    rng = np.random.default_rng(seed)
    idx = np.array(
        [rng.permutation(num_experts)[:num_topk] for _ in range(num_tokens)], dtype=np.int64
    ).reshape(num_tokens, num_topk)
    idx[rng.random(idx.shape) < mask] = -1
    layout = get_dispatch_layout(idx, num_experts, num_ranks)
    per_rank, per_expert, in_rank = brute_layout(idx, num_experts, num_ranks)
    assert layout.num_tokens_per_rank.tolist() == per_rank
    assert layout.num_tokens_per_expert.tolist() == per_expert
    assert layout.is_token_in_rank.tolist() == [list(r) for r in in_rank]
    assert layout.is_token_in_rank.shape == (num_tokens, num_ranks)
    assert layout.num_tokens_per_rank.dtype == np.int64
    assert layout.num_tokens_per_expert.dtype == np.int64
    assert layout.is_token_in_rank.dtype == bool


def test_dispatch_layout_hand_case():
    # 4 experts on 2 ranks; token 1 has both its experts on rank 1 (counted once there).
    idx = np.array([[0, 3], [2, 3], [-1, -1], [1, -1]])
    layout = get_dispatch_layout(idx, 4, 2)
    assert layout.num_tokens_per_rank.tolist() == [2, 2]
    assert layout.num_tokens_per_expert.tolist() == [1, 1, 1, 2]
    assert layout.is_token_in_rank.tolist() == [[True, True], [False, True], [False, False],
                                                [True, False]]


@pytest.mark.parametrize(
    ("args", "argument"),
    [
        ((np.array([[0, 1]]), 5, 2), "num_experts"),
        ((np.array([[0, 1]]), 4, 0), "num_ranks"),
        ((np.array([[0, 1]]), 0, 1), "num_experts"),
        ((np.array([0, 1]), 4, 2), "topk_idx"),
        ((np.array([[0.0, 1.0]]), 4, 2), "topk_idx"),
        ((np.array([[0, 4]]), 4, 2), "topk_idx"),
        ((np.array([[0, -2]]), 4, 2), "topk_idx"),
        ((np.array([[3, 3]]), 4, 2), "topk_idx"),
        ((np.array([[True, False]]), 4, 2), "topk_idx"),
    ],
)
def test_dispatch_layout_rejects_bad_input(args, argument):
    with pytest.raises(InvalidArgumentError) as err:
        get_dispatch_layout(*args)
    assert isinstance(err.value, ValueError)
    assert err.value.argument == argument


def test_validate_topk_idx():
    out = validate_topk_idx(np.array([[1, -1, -1]], dtype=np.int32), 4)  # repeated -1 is fine
    assert out.dtype == np.int64 and out.flags.c_contiguous
    with pytest.raises(InvalidArgumentError) as err:
        validate_topk_idx(np.zeros((2, 1), np.int64), 4, argument="idx", num_tokens=3)
    assert err.value.argument == "idx"
    assert experts_per_rank(256, 64) == 4


# --- generators --------------------------------------------------------------------------------


def check_rows(idx: np.ndarray, num_tokens: int, num_experts: int, num_topk: int):
    assert idx.shape == (num_tokens, num_topk) and idx.dtype == np.int64
    validate_topk_idx(idx, num_experts)  # range and no repeats within a row


def test_uniform_every_expert_equally_likely():
    T, E, k = 20000, 16, 4
    idx = uniform_topk(T, E, k, seed=11)
    check_rows(idx, T, E, k)
    assert (idx >= 0).all()
    counts = np.bincount(idx.ravel(), minlength=E)
    assert stats.chisquare(counts).pvalue > 1e-4
    # Slot order is random too: the first slot alone is uniform.
    assert stats.chisquare(np.bincount(idx[:, 0], minlength=E)).pvalue > 1e-4


def successive_sampling_probs(p: np.ndarray, k: int):
    """Exact P(expert in the k picks) and P(expert is the first pick) of weighted sampling
    without replacement, by enumerating every ordered k-prefix."""
    E = len(p)
    incl = np.zeros(E)
    for seq in itertools.permutations(range(E), k):
        prob, left = 1.0, 1.0
        for e in seq:
            prob *= p[e] / left
            left -= p[e]
        incl[list(seq)] += prob
    return incl, p.copy()


@pytest.mark.parametrize(("alpha", "k"), [(1.0, 3), (1.5, 1), (0.6, 2)])
def test_zipf_is_successive_weighted_sampling(alpha, k):
    T, E = 40000, 6
    idx = zipf_topk(T, E, k, alpha=alpha, seed=5)
    check_rows(idx, T, E, k)
    ranks = np.arange(E)
    p = 1.0 / (ranks + 1.0) ** alpha
    p /= p.sum()
    incl, first = successive_sampling_probs(p, k)
    freq = np.bincount(idx.ravel(), minlength=E) / T
    # The popularity order is a seeded permutation: recover it from the data, then every
    # expert's frequency must sit on the law of its popularity rank.
    order = np.argsort(-freq, kind="stable")
    sigma = np.sqrt(incl * (1 - incl) / T)
    assert (np.abs(freq[order] - incl) < 5 * sigma).all(), (freq[order], incl)
    first_freq = np.bincount(idx[:, 0], minlength=E)[order] / T
    assert (np.abs(first_freq - first) < 5 * np.sqrt(first * (1 - first) / T)).all()


def test_zipf_alpha_zero_is_uniform_and_alpha_orders_skew():
    T, E = 20000, 16
    counts = np.bincount(zipf_topk(T, E, 4, alpha=0.0, seed=3).ravel(), minlength=E)
    assert stats.chisquare(counts).pvalue > 1e-4
    # More skew, more load on the most popular expert.
    top = [np.bincount(zipf_topk(T, E, 4, alpha=a, seed=3).ravel()).max() for a in (0.5, 1, 2)]
    assert top[0] < top[1] < top[2]


def expected_hot_share(k: int, share: float, num_hot: int, num_cold: int):
    """E[h]/k and sd(h)/k with h = max(min(Bin(k, share), num_hot), k - num_cold)."""
    j = np.arange(k + 1)
    h = np.maximum(np.minimum(j, num_hot), k - num_cold)
    pmf = stats.binom.pmf(j, k, share)
    mean = (pmf * h).sum()
    var = (pmf * h**2).sum() - mean**2
    return mean / k, np.sqrt(var) / k


@pytest.mark.parametrize(
    ("E", "k", "N", "s"),
    [(32, 8, 2, 0.5), (32, 8, 8, 0.3), (64, 8, 4, 0.9), (10, 8, 6, 0.2), (16, 4, 3, 1.0)],
)
def test_hot_experts_share(E, k, N, s):
    T = 20000
    hot_ids = np.arange(E - N, E)  # explicit, so the test knows which ones are hot
    idx = hot_experts_topk(T, E, k, hot_experts=N, hot_share=s, hot_ids=hot_ids, seed=9)
    check_rows(idx, T, E, k)
    is_hot = np.isin(idx, hot_ids)
    want, sd = expected_hot_share(k, s, N, E - N)
    realised = is_hot.mean()
    assert abs(realised - want) <= 5 * sd / np.sqrt(T) + 1e-12, (realised, want)
    # Hot picks are spread over the slots, not packed into the leading ones.
    slot_sd = np.sqrt(want * (1 - want) / T)
    assert (np.abs(is_hot.mean(axis=0) - want) <= 5 * slot_sd + 1e-12).all()
    # Within each group, experts are equally likely.
    counts = np.bincount(idx.ravel(), minlength=E)
    if is_hot.any() and N > 1:
        assert stats.chisquare(counts[hot_ids]).pvalue > 1e-4
    cold = np.setdiff1d(np.arange(E), hot_ids)
    if (~is_hot).any():
        assert stats.chisquare(counts[cold]).pvalue > 1e-4


def test_hot_experts_default_ids_are_the_hot_ones():
    T, E, k, N, s = 10000, 64, 8, 4, 0.5
    idx = hot_experts_topk(T, E, k, hot_experts=N, hot_share=s, seed=21)
    counts = np.bincount(idx.ravel(), minlength=E)
    hot = np.argsort(-counts)[:N]
    want, sd = expected_hot_share(k, s, N, E - N)
    assert abs(np.isin(idx, hot).mean() - want) <= 5 * sd / np.sqrt(T)
    assert counts[hot].min() > 5 * np.delete(counts, hot).max()


@pytest.mark.parametrize(
    "generate",
    [
        lambda seed, m: uniform_topk(8000, 32, 4, seed=seed, mask_prob=m),
        lambda seed, m: zipf_topk(8000, 32, 4, alpha=1.0, seed=seed, mask_prob=m),
        lambda seed, m: hot_experts_topk(8000, 32, 4, hot_experts=3, seed=seed, mask_prob=m),
    ],
)
def test_masking_probability_and_determinism(generate):
    for m in (0.0, 0.25, 1.0):
        idx = generate(4, m)
        masked = (idx == -1).mean()
        assert abs(masked - m) <= 5 * np.sqrt(m * (1 - m) / idx.size) + 1e-12
        validate_topk_idx(idx, 32)
    np.testing.assert_array_equal(generate(4, 0.25), generate(4, 0.25))
    assert not np.array_equal(generate(4, 0.25), generate(5, 0.25))


def test_zero_tokens_and_full_topk():
    assert uniform_topk(0, 8, 2).shape == (0, 2)
    assert hot_experts_topk(0, 8, 2, hot_experts=2).shape == (0, 2)
    full = zipf_topk(50, 5, 5, seed=1)
    assert (np.sort(full, axis=1) == np.arange(5)).all()


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: uniform_topk(-1, 8, 2), "num_tokens"),
        (lambda: uniform_topk(4.5, 8, 2), "num_tokens"),
        (lambda: uniform_topk(4, 8, 0), "num_topk"),
        (lambda: uniform_topk(4, 8, 9), "num_topk"),
        (lambda: uniform_topk(4, 0, 1), "num_experts"),
        (lambda: uniform_topk(4, 8, 2, mask_prob=1.5), "mask_prob"),
        (lambda: uniform_topk(4, 8, 2, mask_prob=-0.1), "mask_prob"),
        (lambda: zipf_topk(4, 8, 2, alpha=-1.0), "alpha"),
        (lambda: hot_experts_topk(4, 8, 2, hot_experts=0), "hot_experts"),
        (lambda: hot_experts_topk(4, 8, 2, hot_experts=8), "hot_experts"),
        (lambda: hot_experts_topk(4, 8, 2, hot_experts=2, hot_share=1.1), "hot_share"),
        (lambda: hot_experts_topk(4, 8, 2, hot_experts=2, hot_ids=np.array([1])), "hot_ids"),
        (lambda: hot_experts_topk(4, 8, 2, hot_experts=2, hot_ids=np.array([1, 1])), "hot_ids"),
        (lambda: hot_experts_topk(4, 8, 2, hot_experts=2, hot_ids=np.array([1, 8])), "hot_ids"),
        (lambda: hot_experts_topk(4, 8, 2, hot_experts=2, hot_ids=np.array([-1, 2])), "hot_ids"),
        (lambda: hot_experts_topk(4, 8, 2, hot_experts=2, hot_ids=np.array([0.5, 2])), "hot_ids"),
    ],
)
def test_generators_reject_bad_input(call, argument):
    with pytest.raises(InvalidArgumentError) as err:
        call()
    assert err.value.argument == argument
