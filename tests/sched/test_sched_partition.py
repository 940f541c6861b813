"""Appendix A partition model: exact integer min-max, approximation (8), sweep."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.errors import InvalidArgumentError
from ubep.sched import partition, partition_sweep


def _brute(n: int, e: int, k: int, b: int, alpha: float, beta: float, bc: float,
           bt: float) -> tuple[int, float]:
    best_nc, best_t = 0, math.inf
    for nc in range(1, n):
        t = max(beta * e / nc + bc, alpha * k * b / (n - nc) + bt)
        if t < best_t * (1 - 1e-12):
            best_nc, best_t = nc, t
    return best_nc, best_t


@given(
    n=st.integers(2, 96), e=st.integers(1, 512), k=st.integers(1, 8), b=st.integers(1, 512),
    alpha=st.floats(1, 500), beta=st.floats(1, 500), bc=st.floats(0, 2000), bt=st.floats(0, 2000),
)
@settings(max_examples=150, deadline=None)
def test_exact_min_max_matches_brute_force(n: int, e: int, k: int, b: int, alpha: float,
                                           beta: float, bc: float, bt: float) -> None:
    p = partition(n, e, k, b, alpha=alpha, beta=beta, b_count=bc, b_token=bt)
    _, t = _brute(n, e, k, b, alpha, beta, bc, bt)
    assert p.t_dispatch_ns == pytest.approx(t)
    assert p.num_count_cores + p.num_send_cores == n
    assert p.num_count_cores >= 1 and p.num_send_cores >= 1
    assert max(p.t_count_ns, p.t_token_ns) == pytest.approx(t)


@given(n=st.integers(8, 96), e=st.integers(1, 512), k=st.integers(1, 8), b=st.integers(1, 512))
@settings(max_examples=100, deadline=None)
def test_optimum_sits_at_the_continuous_crossing(n: int, e: int, k: int, b: int) -> None:
    """With zero overheads T_count = T_token at x = beta*E*n / (beta*E + alpha*K*B); the integer
    optimum is floor(x) or ceil(x) clamped to [1, n-1], and (8) = beta*E*n/(alpha*K*B) >= x."""
    alpha, beta = 100.0, 50.0
    p = partition(n, e, k, b, alpha=alpha, beta=beta)
    x = beta * e * n / (beta * e + alpha * k * b)
    candidates = {min(max(math.floor(x), 1), n - 1), min(max(math.ceil(x), 1), n - 1)}
    assert p.num_count_cores in candidates
    assert p.approx_num_count_cores >= x - 1e-9
    assert p.approx_num_count_cores == pytest.approx(beta * e * n / (alpha * k * b))


@given(n=st.integers(4, 64), e=st.integers(1, 300), k=st.integers(1, 8),
       b1=st.integers(1, 300), b2=st.integers(1, 300))
@settings(max_examples=100, deadline=None)
def test_more_tokens_never_adds_count_cores(n: int, e: int, k: int, b1: int, b2: int) -> None:
    lo, hi = sorted((b1, b2))
    assert partition(n, e, k, hi).num_count_cores <= partition(n, e, k, lo).num_count_cores
    assert partition(n, e + 50, k, lo).num_count_cores >= partition(n, e, k, lo).num_count_cores


def test_sweep_is_pointwise_partition() -> None:
    sweep = partition_sweep(48, [16, 64, 256], [8, 128], experts_per_rank=2, num_topk=8)
    assert sweep.num_count_cores.shape == (3, 2)
    for i, r in enumerate((16, 64, 256)):
        for j, bsz in enumerate((8, 128)):
            p = partition(48, 2 * r, 8, bsz)
            assert sweep.num_count_cores[i, j] == p.num_count_cores
            assert sweep.t_dispatch_ns[i, j] == pytest.approx(p.t_dispatch_ns)
    assert len(sweep.rows()) == 6
    np.testing.assert_array_equal(sweep.num_experts, [32, 128, 512])


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(num_cores=1), "num_cores"),
        (dict(num_experts=0), "num_experts"),
        (dict(num_topk=1.5), "num_topk"),
        (dict(batch_size=-3), "batch_size"),
        (dict(alpha=0.0), "alpha"),
        (dict(beta=float("inf")), "beta"),
        (dict(b_count=-1.0), "b_count"),
        (dict(b_token="x"), "b_token"),
    ],
)
def test_bad_input(kwargs: dict, argument: str) -> None:
    args: dict = dict(num_cores=48, num_experts=64, num_topk=8, batch_size=128)
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError) as err:
        partition(**args)
    assert err.value.argument == argument
    with pytest.raises(InvalidArgumentError) as err2:
        partition_sweep(48, [], [8])
    assert err2.value.argument == "num_ranks"
