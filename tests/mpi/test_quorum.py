"""The quorum of a masking Buffer over MPI (``ubep.mpi.quorum``) against a closed form: a side
serves on with ``n`` of ``N`` ranks iff ``n > N // 2`` (default) or ``n >= min_live_ranks``; two
disjoint sides never both pass the default. ``BufferConfig.min_live_ranks`` is checked, naming
itself. (The rule at work across hosts: tests/mpi/test_multihost_faults.py.)"""

from __future__ import annotations

import itertools

import pytest

from ubep.buffer import BufferConfig
from ubep.errors import InvalidArgumentError, NoQuorumError, PeerLostError, RankMaskedError
from ubep.mpi.quorum import check_quorum, quorum_of


def _serves(rank: int, side: tuple[int, ...], num_ranks: int, k: int | None) -> bool:
    try:
        check_quorum(rank, side, num_ranks, k)
    except NoQuorumError:
        return False
    return True


@pytest.mark.parametrize("num_ranks", range(1, 9))
def test_default_quorum_is_more_than_half_and_no_two_sides_hold_it(num_ranks: int) -> None:
    assert quorum_of(num_ranks, None) == num_ranks // 2 + 1
    ranks = range(num_ranks)
    for size in range(num_ranks + 1):
        for side in itertools.combinations(ranks, size):
            assert _serves(0, side, num_ranks, None) == (2 * size > num_ranks)
            rest = tuple(r for r in ranks if r not in side)
            assert not (_serves(0, side, num_ranks, None) and
                        _serves(0, rest, num_ranks, None))  # never two serving sides


@pytest.mark.parametrize(("num_ranks", "k"), [(4, 2), (4, 4), (3, 1), (8, 5)])
def test_min_live_ranks_sets_the_quorum(num_ranks: int, k: int) -> None:
    assert quorum_of(num_ranks, k) == k
    for size in range(num_ranks + 1):
        assert _serves(0, tuple(range(size)), num_ranks, k) == (size >= k)


def test_no_quorum_error_names_the_quorum_and_is_a_peer_loss() -> None:
    with pytest.raises(NoQuorumError) as info:
        check_quorum(3, (2, 3), 4, None)
    assert isinstance(info.value, RankMaskedError) and isinstance(info.value, PeerLostError)
    text = str(info.value)
    assert "rank 3" in text and "2 of 4" in text and "quorum is 3" in text
    with pytest.raises(NoQuorumError, match="min_live_ranks=4"):
        check_quorum(0, (0, 1, 2), 4, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_min_live_ranks_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="min_live_ranks"):
        BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=8, dtype="bf16",
                     on_peer_loss="mask", min_live_ranks=bad)
    assert BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=8,
                        dtype="bf16", min_live_ranks=3).min_live_ranks == 3
