"""Quaternary search (Algorithm 1) against np.searchsorted, plus its step bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.errors import InvalidArgumentError
from ubep.sched import (
    prefix_from_expert_list,
    quaternary_search,
    quaternary_search_many,
)


def _oracle(prefix: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """searchsorted: last expert whose start <= target; one-past-end maps to (E, 0)."""
    e = prefix.size - 1
    total = prefix[-1]
    expert = np.searchsorted(prefix, targets, side="right") - 1
    expert = np.where(targets == total, e, expert)
    offset = np.where(targets == total, 0, targets - prefix[np.minimum(expert, e)])
    return expert, offset


def _max_steps(e: int) -> int:
    # ceil(log4(E)) computed in integers: the smallest s with 4**s >= E.
    s = 0
    while 4**s < e:
        s += 1
    return s


def _check_all_targets(counts: np.ndarray) -> None:
    prefix = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    targets = np.arange(prefix[-1] + 1)
    want_e, want_o = _oracle(prefix, targets)
    got_e, got_o, steps = quaternary_search_many(prefix, targets)
    np.testing.assert_array_equal(got_e, want_e)
    np.testing.assert_array_equal(got_o, want_o)
    assert steps <= _max_steps(counts.size)
    assert steps <= math.ceil(math.log(counts.size, 4)) + 1 if counts.size > 1 else steps == 0
    # The scalar version and the expert-list form (unsorted list, counted by compare) agree.
    rng = np.random.default_rng(counts.size)
    expert_list = rng.permutation(np.repeat(np.arange(counts.size), counts))
    for t in rng.choice(targets, size=min(8, targets.size), replace=False):
        one = quaternary_search(prefix, int(t))
        assert (one.expert_id, one.local_offset) == (want_e[t], want_o[t])
        assert one.steps <= _max_steps(counts.size)
        assert quaternary_search(expert_list, int(t), kind="expert_list",
                                 num_experts=counts.size) == one
    got_e2, got_o2, _ = quaternary_search_many(expert_list, targets, kind="expert_list",
                                               num_experts=counts.size)
    np.testing.assert_array_equal(got_e2, want_e)
    np.testing.assert_array_equal(got_o2, want_o)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=80))
@settings(max_examples=150, deadline=None)
def test_matches_searchsorted_random(counts: list[int]) -> None:
    _check_all_targets(np.asarray(counts, dtype=np.int64))


@pytest.mark.parametrize(
    "counts",
    [
        [5],  # one expert
        [0, 3],  # two experts, first empty
        [3, 0],  # two experts, last empty
        [0, 0, 0, 7, 0, 0],  # all tokens in one expert
        [1] * 4,
        [1] * 5,
        [0] * 15 + [2],
        [2] + [0] * 16,
        [0, 1] * 33,
    ],
)
def test_adversarial(counts: list[int]) -> None:
    _check_all_targets(np.asarray(counts, dtype=np.int64))


@pytest.mark.parametrize("num_experts", [1, 2, 3, 4, 5, 16, 17, 64, 65, 256, 1000, 4096, 4097])
def test_step_bound_and_large_e(num_experts: int) -> None:
    rng = np.random.default_rng(num_experts)
    counts = rng.integers(0, 3, num_experts) * (rng.random(num_experts) < 0.3)
    counts[-1] += 1  # at least one unit, and target 0 may sit at the far end
    _check_all_targets(counts)


def test_empty_total_answers_end() -> None:
    prefix = np.zeros(5, dtype=np.int64)
    assert quaternary_search(prefix, 0).expert_id == 4
    e, o, _ = quaternary_search_many(prefix, np.array([0]))
    assert (e[0], o[0]) == (4, 0)


def test_prefix_from_expert_list() -> None:
    lst = np.array([3, 0, 3, 1])
    np.testing.assert_array_equal(prefix_from_expert_list(lst, 5), [0, 1, 2, 2, 4, 4])


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: quaternary_search(np.array([0, 2, 1]), 0), "values"),
        (lambda: quaternary_search(np.array([1, 2]), 0), "values"),
        (lambda: quaternary_search(np.array([0.0, 2.0]), 0), "values"),
        (lambda: quaternary_search(np.array([0, 2]), 3), "target"),
        (lambda: quaternary_search(np.array([0, 2]), -1), "target"),
        (lambda: quaternary_search(np.array([0, 2]), 0, kind="nope"), "kind"),
        (lambda: quaternary_search(np.array([0, 2]), 0, kind="expert_list"), "num_experts"),
        (lambda: quaternary_search(np.array([0, 5]), 0, kind="expert_list", num_experts=3),
         "values"),
        (lambda: quaternary_search(np.array([0, 2]), 0, num_experts=3), "num_experts"),
        (lambda: quaternary_search_many(np.array([0, 2]), np.array([3])), "targets"),
        (lambda: quaternary_search_many(np.array([0, 2]), np.array([[0]])), "targets"),
    ],
)
def test_bad_input(call: object, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        call()  # type: ignore[operator]
    assert err.value.argument == argument
