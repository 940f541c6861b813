"""The quick soak (python -m benchmarks.soak --quick): 500 random calls on 2, 3 and 4 ranks, each
checked bit for bit against ubep.reference; plus checks that the random plan covers what it
claims (every engine, sync, layout, dtype, routing kind, zero-copy, empty ranks). And a short
fault soak (--faults): random faults between and during checked calls, zero wrong answers."""

from __future__ import annotations

import numpy as np

from benchmarks.soak.calls import run_soak
from benchmarks.soak.faults import (
    FAULT_KINDS,
    FaultSettings,
    check_contracts,
    draw_fault,
    run_fault_soak,
)
from benchmarks.soak.plan import make_blocks
from ubep.testing import same_bits as _same


def test_blocks_cover_every_mode_and_routing_and_are_valid() -> None:
    blocks = [b for r in (2, 3, 4) for b in make_blocks(r, 167, seed=1)]
    assert sum(len(b.calls) for b in blocks) == 3 * 167
    seen = {(b.engine, b.sync, b.layout) for b in blocks}
    assert len(seen) >= 12, seen  # most of the 16 engine x sync x layout combinations
    assert {b.engine for b in blocks} == {"asp", "bsp"}
    assert {b.sync for b in blocks} == {"sw", "tff", "dc", "sp"}
    assert {b.dtype for b in blocks} == {"bf16", "fp16", "fp32", "int8", "uint8"}
    assert {c.routing for b in blocks for c in b.calls} == {"uniform", "zipf", "hot", "one"}
    assert {b.zero_copy for b in blocks} == {True, False}
    calls = [c for b in blocks for c in b.calls]
    assert any(0 in c.tokens and max(c.tokens) > 0 for c in calls)  # a rank with no tokens
    for b in blocks:
        b.config()  # a valid BufferConfig (SP never with a 1-byte type)
        assert all(len(c.tokens) in (2, 3, 4) and max(c.tokens) <= b.max_tokens
                   for c in b.calls)
    # deterministic in the seed, different across seeds
    assert make_blocks(3, 50, seed=1) == make_blocks(3, 50, seed=1)
    assert make_blocks(3, 50, seed=1) != make_blocks(3, 50, seed=2)


def test_quick_soak_matches_reference_on_every_call() -> None:
    result = run_soak(500, [2, 3, 4], seed=1, progress=False, timeout_s=600)
    assert result["calls"] == 500
    for num_ranks, found in result["ranks"].items():
        for f in found:
            assert f["num_errors"] == 0, (num_ranks, f["rank"], f["errors"])
    assert result["ok"]


def test_the_soak_comparison_is_bit_for_bit() -> None:
    """The checker the soak relies on: bits, dtype and shape, not value equality."""
    a = np.arange(8, dtype=np.float32)
    assert _same(a, a.copy())
    assert not _same(a, a + 1)
    assert not _same(a, a.astype(np.float64))
    assert not _same(a, a.reshape(2, 4))
    nan = np.array([np.nan], np.float32)
    assert _same(nan, nan.copy())  # NaN equals itself bit for bit (np.array_equal would not)
    assert not _same(nan, (nan.view(np.uint32) | np.uint32(1)).view(np.float32))
    assert not _same(np.array([0.0], np.float32), np.array([-0.0], np.float32))


# --- the fault soak (benchmarks/soak.py --faults) ---------------------------------------------


def test_fault_draws_are_shared_seeded_and_cover_every_kind() -> None:
    settings = FaultSettings(seed=3)
    draws = [draw_fault(settings, 3, b, e) for b in range(12) for e in range(1, 40)]
    assert draws == [draw_fault(settings, 3, b, e) for b in range(12) for e in range(1, 40)]
    faults = [f for f in draws if f is not None]
    assert 0.15 < len(faults) / len(draws) < 0.4  # the rate, plus one rotation pair per block
    # the rotation pair (call 3 of every block) alone covers every kind in 6 blocks
    rotation = [draw_fault(settings, 3, b, 3) for b in range(6)]
    assert {f.kind for f in rotation if f is not None} == set(FAULT_KINDS)
    for f in faults:
        assert 0 <= f.rank < 3 and 0 <= f.peer < 3 and f.peer != f.rank
        assert f.phase in ("dispatch", "combine")
        if f.kind == "sigstop":
            assert f.rank != 0 and f.hold_s > settings.timeout_s  # rank 0 stops a peer
        if f.kind == "stale_handle":
            assert f.phase == "combine"
        assert (f.detail != "") == (f.kind == "bad_input")


def _entry(epoch: int, kind: str, frank: int, phase: str, d: str, c: str,
           **extra: object) -> dict[str, object]:
    return {"block": 0, "epoch": epoch, "gen": 0, "kind": kind, "frank": frank, "phase": phase,
            "d": d, "c": c, "inj": True} | extra


def test_fault_contract_checker_flags_each_broken_promise() -> None:
    """The contract checker the fault soak relies on fails on each broken promise."""
    ok = [[_entry(1, "none", 0, "", "ok", "ok")], [_entry(1, "none", 0, "", "ok", "ok")]]
    assert check_contracts(2, ok) == ([], 0)

    def pair(*per_rank: tuple[str, str], kind: str, phase: str = "combine",
             nxt: tuple[str, str] = ("ok", "ok"), before: str = "none",
             **extra: object) -> list[str]:
        logs = [[_entry(1, before, 0, "", "ok", "ok"), _entry(3, kind, 1, phase, d, c, **extra),
                 _entry(5, "none", 0, "", *nxt)] for d, c in per_rank]
        problems, checked = check_contracts(len(per_rank), logs)
        assert checked == 1  # the fault pair, or (after garbage or a stop) only the one before
        return problems

    clean = ("ok", "RemoteError(clean)"), ("ok", "InvalidArgumentError")
    assert pair(*clean, kind="bad_input") == []
    assert pair(("ok", "TimeoutError"), clean[1], kind="bad_input")  # a peer lost step
    assert pair(*clean, kind="bad_input", nxt=("OutOfStepError", "-"))  # next call failed
    assert pair(("ok", "UbepError"), ("ok", "InvalidArgumentError"), kind="stale_handle") == []
    assert pair(("ok", "ok"), ("ok", "InvalidArgumentError"), kind="stale_handle")
    assert pair(("RemoteError", "-"), ("ok", "-"), kind="mismatch", phase="dispatch")
    assert pair(("ok", "ok"), ("ok", "ok"), kind="thread", thread="refused") == []
    assert pair(("ok", "ok"), ("ok", "ok"), kind="thread", thread="returned")
    assert pair(("ok", "TimeoutError"), ("ok", "ok"), kind="thread", thread="refused")
    assert pair(("ok", "foreign:ValueError"), ("ok", "ok"), kind="garbage")
    # garbage left in a control area, or a rank still stopped, may fail the next pairs: those
    # are not held to their fault's promise (but never to a wrong answer)
    assert pair(("ok", "ok"), ("ok", "ok"), kind="stale_handle", before="garbage") == []
    assert pair(("ok", "ok"), ("ok", "ok"), kind="stale_handle", before="sigstop") == []


def test_fault_soak_never_returns_a_wrong_answer() -> None:
    """~240 pairs on 3 and 2 ranks with every fault kind injected: errors, never wrong data."""
    result = run_fault_soak(240, [3, 2], FaultSettings(seed=3), progress=False, timeout_s=900)
    for num_ranks, run in result["ranks"].items():
        assert run["wrong_answers"] == 0, (num_ranks, run["wrong"])
        assert run["violations"] == [], (num_ranks, run["violations"])
        fired = {k for k in FAULT_KINDS if run["kinds"][k]["injected"]}
        assert fired == set(FAULT_KINDS), (num_ranks, fired)
        assert run["resyncs"] > 0 and run["pairs"] >= 120
        assert run["pairs_checked_everywhere"] >= 60
    assert result["calls_checked"] >= 500
    assert result["ok"]
