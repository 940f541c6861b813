"""The DeepEP facades' exchange through shared memory (``ubep.torch.deep_ep_agree``) on real
processes: every rank gets every rank's value, in rank order, exchange after exchange (both
slots reused many times, ranks late by turns), a value too large for its slot goes through the
group's all-gather on every rank, and a rank that never posts fails the others at the group's
deadline naming it. The oracle: each rank's value is a closed form of (exchange, rank)."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from tests._shm import leaked_since, ubep_segments  # noqa: E402
from ubep.runtime import launch  # noqa: E402
from ubep.torch.deep_ep_agree import BODY_BYTES, Board, open_board  # noqa: E402

_ROUNDS = 60
_BIG = {17, 18, 41}  # exchanges in which rank 1 posts more than a slot holds


def _value(n: int, rank: int) -> Any:
    if n in _BIG and rank == 1:
        return [n] * (BODY_BYTES // 2)  # ", n" is 3 to 4 bytes: over the slot
    if n % 7 == 3:
        return None if rank % 2 else f"rank {rank}: bad argument at {n}"
    return [rank, n, [n * rank + i for i in range(n % 5 + rank)], {"k": n - rank}]


def _exchanges(group: Any) -> dict[str, Any]:
    board = open_board(group)
    assert isinstance(board, Board)
    used: list[int] = []

    def fallback(value: Any) -> list[Any]:
        used.append(1)
        return list(group.allgather(value))

    got = []
    for n in range(_ROUNDS):
        if n % 5 == group.rank % 5:  # one rank late by turns: past the peers' spin and yield
            time.sleep(0.004)
        got.append(board.allgather(_value(n, group.rank), fallback))
    board.close()
    return {"got": got, "fallbacks": len(used)}


def test_exchanges_match_every_rank() -> None:
    before = ubep_segments()
    num_ranks = 3
    out = launch(_exchanges, num_ranks, timeout_s=120)
    want = [[_value(n, r) for r in range(num_ranks)] for n in range(_ROUNDS)]
    for r in range(num_ranks):
        assert out[r]["got"] == want
        assert out[r]["fallbacks"] == len(_BIG)
    assert leaked_since(before) == []


def _late(group: Any) -> str | None:
    board = open_board(group)
    assert isinstance(board, Board)
    group.default_timeout_s = 0.5  # the group's deadline, which the exchange keeps
    error = None
    if group.rank == 0:
        try:
            board.allgather("here", list)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    group.barrier(timeout_s=30)
    board.close()
    return error


def test_missing_rank_times_out_naming_it() -> None:
    errors = launch(_late, 2, timeout_s=120)
    assert errors[1] is None
    assert errors[0] is not None and errors[0].startswith("TimeoutError")
    assert "rank(s) [1] did not post" in errors[0]
