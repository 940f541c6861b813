"""The DeepEP facades' exchange through shared memory (``ubep.torch.deep_ep_agree``) on real
processes: every rank gets every rank's value, in rank order, exchange after exchange (both
slots reused many times, ranks late by turns), a value too large for its slot goes through the
group's all-gather on every rank, and a rank that never posts fails the others at the group's
deadline naming it. The oracle: each rank's value is a closed form of (exchange, rank). Through
the V1 facade: a normal-mode dispatch with ``topk_idx`` and a combine with ``topk_weights``
exchange nothing (no board, no all-gather) once their Buffers exist, both results equal their
closed forms, and a bad argument on one rank still fails the call on every rank, after which
the next call is exact."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from tests._shm import leaked_since, ubep_segments  # noqa: E402
from ubep.errors import InvalidArgumentError  # noqa: E402
from ubep.runtime import launch  # noqa: E402
from ubep.torch.deep_ep_agree import (  # noqa: E402
    BODY_BYTES,
    CARRIED_BYTES,
    WEIGHTS_NONE,
    WEIGHTS_OTHER,
    WEIGHTS_RECEIVED,
    Board,
    RowCarrier,
    combine_weights_plan,
    combine_weights_word,
    open_board,
    own_weights_sum,
    own_weights_sum_numpy,
)

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


_T, _H, _E, _K = 300, 32, 16, 8  # ~600 rows of combine weights: once more than a board slot


def _facade_calls(group: Any) -> dict[str, Any]:
    """A V1 facade's dispatch and a combine with ``topk_weights``, twice, counting the group's
    all-gathers and the Buffers' dispatches; a third call pair with a bad
    ``num_tokens_per_expert`` on rank 1; then a fourth, whose receivers scale the weights; the
    results against closed forms."""
    from ubep import deep_ep
    from ubep.buffer import Buffer

    gathers: list[int] = []
    plain = group.allgather

    def counted(value: Any, timeout_s: Any = None) -> list[Any]:
        gathers.append(1)
        return list(plain(value, timeout_s))

    dispatches: list[int] = []
    plain_dispatch = Buffer.dispatch

    def dispatch_counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        dispatches.append(1)
        return plain_dispatch(self, *args, **kwargs)

    Buffer.dispatch = dispatch_counted  # type: ignore[method-assign]
    group.allgather = counted  # the facade's group is this object
    g = torch.Generator().manual_seed(group.rank)
    x = torch.randn(_T, _H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(_E, generator=g)[:_K] for _ in range(_T)])
    w = torch.rand(_T, _K, generator=g, dtype=torch.float32)  # float32, as DeepEP asks
    # the bits a sum must keep or normalise: -0.0 (summed with +0.0: +0.0), a NaN, an infinity
    w[0, 0], w[1, 1], w[2, 2] = -0.0, float("nan"), float("inf")
    idx[3, 3] = -1  # a masked slot sums to 0.0 whatever its weight
    buf = deep_ep.Buffer(group, max_tokens_per_rank=_T)
    out: dict[str, Any] = {}
    # identity experts: a token's row comes back once from each rank it went to (exact in FP32)
    _, _, _, in_rank, _ = buf.get_dispatch_layout(idx, _E)
    times = in_rank.sum(dim=1).float()
    want_y = (x.float() * times[:, None]).to(torch.bfloat16).view(torch.int16)
    for name in ("first", "second", "bad", "after", "later"):
        before = len(gathers)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, _E)
        if name == "bad" and group.rank == 1:
            per_expert = per_expert + 1  # disagrees with topk_idx: refused on rank 1 alone
        try:
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        except Exception as exc:  # the kind of error is what is checked
            out["bad_error"] = type(exc).__name__
            continue
        out[f"{name}_dispatch_gathers"] = len(gathers) - before
        before, sent = len(gathers), len(dispatches)
        # the last pair's receivers scale the weights they hold by (their rank + 1)
        scaled = name in ("after", "later")
        scale = group.rank + 1 if scaled else 1
        y, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w * scale)
        out[f"{name}_combine_gathers"] = len(gathers) - before
        out[f"{name}_combine_dispatches"] = len(dispatches) - sent
        out[f"{name}_y_exact"] = torch.equal(y.view(torch.int16), want_y)
        # a received row holds the weights of its rank's slots (0 elsewhere), so each slot's sum
        # is its owner's value: w times the owner's scale (one float32 product, + 0.0)
        owner = idx // (_E // group.num_ranks)
        want_w = (w * (owner + 1) if scaled else w) + 0.0
        want_w[idx < 0] = 0.0
        out[f"{name}_w_exact"] = torch.equal(combined_w.view(torch.int32),
                                             want_w.view(torch.int32))  # NaN, -0.0 bit for bit
    out["board"] = isinstance(buf.core.exchange.board, Board)
    return out


def test_facade_calls_exchange_nothing_and_still_fail_together() -> None:
    got = launch(_facade_calls, 2, timeout_s=120)
    for rank, out in enumerate(got):
        # Buffers are built by the first calls (collective); later calls exchange nothing: what
        # they need of the other ranks comes with the engine's count round, and the combine's
        # weights go back through the engine
        assert out["second_dispatch_gathers"] == out["second_combine_gathers"] == 0
        assert out["later_dispatch_gathers"] == out["later_combine_gathers"] == 0
        # every rank gave back the weights its dispatch received: the sources summed their own
        # (no dispatch), through the Board's words; scaled ones went back as rows (through a
        # float32 Buffer, built by the first such combine: collective, entered by a switch)
        assert out["board"]
        assert out["first_combine_dispatches"] == out["second_combine_dispatches"] == 0
        assert out["after_combine_dispatches"] >= 1 and out["later_combine_dispatches"] >= 1
        assert all(out[f"{n}_y_exact"] and out[f"{n}_w_exact"]
                   for n in ("first", "second", "after", "later"))
        assert out["bad_error"] == ("RemoteError" if rank == 0 else "InvalidArgumentError")


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "uint8"])
def test_row_carrier_moves_any_float32_bits_as_finite_row_elements(dtype: str) -> None:
    import numpy as np

    from ubep import BufferConfig

    cfg = BufferConfig(max_tokens_per_rank=4, hidden=40, num_topk=3, num_experts=4, dtype=dtype)
    carrier = RowCarrier.of(cfg, 10, 4)
    assert carrier is not None and carrier.num_topk == 3
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4e38, 0.125, 1.0, -1.0],
                        dtype=np.float32)
    rng = np.random.default_rng(0)
    values = np.concatenate([specials[None, :], rng.integers(0, 1 << 32, (50, 10), dtype=np.uint64)
                             .astype(np.uint32).view(np.float32)])
    rows = carrier.encode(values)
    assert rows.shape == (51, 40)
    if dtype == "uint8":  # the bytes themselves
        assert rows.dtype == np.uint8 and np.array_equal(rows, values.view(np.uint8))
    else:  # every element a finite normal number of the row dtype
        assert rows.dtype == np.uint16
        exponent = (rows >> 7) & 0xFF if dtype == "bf16" else (rows >> 10) & 0x1F
        assert np.all((exponent > 0) & (exponent < (0xFF if dtype == "bf16" else 0x1F)))
    assert np.array_equal(carrier.decode(rows, 10).view(np.uint32), values.view(np.uint32))


def test_row_carrier_refuses_rows_it_cannot_carry() -> None:
    from ubep import BufferConfig

    def cfg(**kw: Any) -> Any:
        base = dict(max_tokens_per_rank=4, hidden=32, num_topk=2, num_experts=4, dtype="bf16")
        return BufferConfig(**(base | kw))

    assert RowCarrier.of(cfg(), 8, 4) is not None
    assert RowCarrier.of(cfg(), 9, 4) is None  # 36 bytes, 32 elements
    assert RowCarrier.of(cfg(dtype="fp32"), 2, 4) is None
    assert RowCarrier.of(cfg(dtype="int8"), 2, 4) is None
    assert RowCarrier.of(cfg(quant="e4m3", hidden=128), 2, 4) is None
    assert RowCarrier.of(cfg(), 8, 5) is None  # more rows than a rank may dispatch
    # more bytes of rows than CARRIED_BYTES: the float32 Buffer's rounds cost less
    wide = cfg(hidden=4096, max_tokens_per_rank=1 << 20)
    rows = CARRIED_BYTES // (4096 * 2)
    assert RowCarrier.of(wide, 8, rows) is not None and RowCarrier.of(wide, 8, rows + 1) is None


def test_a_combines_weights_word_and_what_every_rank_does_with_the_words() -> None:
    received = np.array([[0.5, -0.0], [np.nan, 2.0]], dtype=np.float32)
    same = torch.from_numpy(received.copy())
    assert combine_weights_word(None, received) == WEIGHTS_NONE
    assert combine_weights_word(same, received) == WEIGHTS_RECEIVED  # NaN and -0.0, bit for bit
    plus_zero = same.clone()
    plus_zero[0, 1] = 0.0  # equal as numbers, not as bits: a sum would differ
    for other in (plus_zero, same.double(), same[:1], same * 2):
        assert combine_weights_word(other, received) == WEIGHTS_OTHER
        # a decode step's view of the tensor: the same word
        view = other.numpy()
        assert combine_weights_word(view, received) == WEIGHTS_OTHER
    assert combine_weights_word(same.numpy(), received) == WEIGHTS_RECEIVED
    assert combine_weights_word(same, None) == WEIGHTS_OTHER  # the dispatch had no topk_idx
    got, none, other = WEIGHTS_RECEIVED, WEIGHTS_NONE, WEIGHTS_OTHER
    assert combine_weights_plan([none, none, none]) == "none"
    assert combine_weights_plan([got, got, got]) == "local"
    assert combine_weights_plan([got, other, got]) == "carried"
    with pytest.raises(InvalidArgumentError, match=r"given on rank\(s\) \[0, 2\].*not on "
                                                   r"rank\(s\) \[1\]"):
        combine_weights_plan([got, none, other])


def test_own_weights_sum_is_the_sum_a_combine_makes_of_the_received_weights() -> None:
    rng = np.random.default_rng(5)
    ranks, experts, tokens, topk = 4, 16, 50, 4
    idx = np.array([rng.choice(experts, topk, replace=False) for _ in range(tokens)])
    idx[rng.random(idx.shape) < 0.2] = -1
    w = rng.standard_normal(idx.shape).astype(np.float32)
    w[0, 0], w[1, 1], w[2, 2] = -0.0, np.nan, -np.inf
    # the brute force: each rank the token went to gives back its slots' weights, 0.0 in the
    # others; the source adds them in rank order to float32 zeros
    owner = np.where(idx >= 0, idx // (experts // ranks), -1)
    want = np.zeros(w.shape, np.float32)
    for r in range(ranks):
        went = (owner == r).any(axis=1)
        want[went] += np.where(owner[went] == r, w[went], np.float32(0))
    assert np.array_equal(own_weights_sum(idx, w).view(np.uint32), want.view(np.uint32))
    # the numpy way (any layout: a transposed view here), the native pass's fallback
    got = own_weights_sum_numpy(np.asfortranarray(idx), np.asfortranarray(w))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(own_weights_sum(np.asfortranarray(idx), w).view(np.uint32),
                          want.view(np.uint32))
