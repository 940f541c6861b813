"""The quick soak (benchmarks/soak.py --quick): 500 random calls on 2, 3 and 4 ranks, each
checked bit for bit against ubep.reference; plus checks that the random plan covers what it
claims (every engine, sync, layout, dtype, routing kind, zero-copy, empty ranks)."""

from __future__ import annotations

import numpy as np
from benchmarks.soak import _same, make_blocks, run_soak


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
