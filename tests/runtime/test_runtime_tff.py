"""ASP TFF lands in place (ubep.plane.layout): rows go straight into ``recv_x`` and each
block's epoch word into a double-buffered word array, so nothing is staged or copied twice.

Checked against ``ubep.reference`` bit for bit: the segment holds no staging region; a
dispatch in flight does not make the next issue finish it (no staging to drain); calls
that reuse a region whose words hold an older epoch (stale rows at the very positions) take
this call's rows only, with a peer entering late; odd row sizes (a partial last block).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from ubep import reference, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.flags import TffCodec
from ubep.plane.layout import compute_layout
from ubep.runtime import launch

TOPK, EXPERTS, TOKENS = 4, 8, 12


def _config(layout: str, hidden: int) -> BufferConfig:
    return BufferConfig(max_tokens_per_rank=TOKENS, hidden=hidden, num_topk=TOPK,
                        num_experts=EXPERTS, dtype="bf16", layout=layout, engine="asp",
                        sync="tff", timeout_s=30.0)


def _refs(cfg: BufferConfig, num_ranks: int, seed: int) -> tuple[Any, Any, Any, Any]:
    xs, idxs, ws = testing.inputs("bf16", EXPERTS, TOPK, cfg.hidden, [TOKENS] * num_ranks,
                                  seed, "uniform")
    return xs, idxs, ws, reference.dispatch(xs, idxs, ws, EXPERTS, layout=cfg.layout)


def test_layout_has_words_not_staging() -> None:
    kw: dict[str, Any] = dict(num_ranks=2, num_cores=1, num_experts=8, num_topk=4, max_tokens=64,
                              hidden=7168, itemsize=2, combine_itemsize=2, layout="expert",
                              tff_block_bytes=512, tff_flag_bytes=32)
    tff = compute_layout(engine="asp", sync="tff", **kw)
    sw = compute_layout(engine="asp", sync="sw", **kw)
    blocks = TffCodec().num_blocks(7168 * 2)
    assert tff.num_land_regions == tff.num_regions == 2
    assert tff.slot_bytes == 8 * blocks and tff.out_stride == sw.out_stride
    # the rows take what SW's take; the words a 480th of them per block
    assert tff.size_bytes - sw.size_bytes <= 2 * tff.land_bytes
    assert tff.land_bytes < sw.land_bytes // 50


def _worker_in_flight(group: Any, layout: str, hidden: int) -> list[str]:
    cfg = _config(layout, hidden)
    r, R = group.rank, group.num_ranks
    errors: list[str] = []
    with Buffer(group, cfg) as buf:
        batches = [_refs(cfg, R, seed) for seed in range(5)]
        for i in (0, 1):  # regions 0 and 1 now hold rows and words of calls 1 and 2
            xs, idxs, ws, refs = batches[i]
            errors += [f"call {i}: {e}" for e in
                       testing.compare(buf.dispatch(xs[r], idxs[r], ws[r]), refs[r])]
        # Two dispatches in flight: with a staging region, issuing the second would first
        # finish the first (InFlightCalls.complete_staged); in place, nothing does.
        pending = []
        for i in (2, 3):
            xs, idxs, ws, _ = batches[i]
            pending.append(buf.dispatch(xs[r], idxs[r], ws[r], return_recv_hook=True))
        if pending[0].done:
            errors.append("issuing call 3 finished call 2 (staged)")
        for i, p in zip((2, 3), pending, strict=True):
            errors += [f"call {i}: {e}" for e in testing.compare(p.hook(), batches[i][3][r])]
        # The region of call 3 holds call 1's rows and words (an older epoch) at the same
        # positions; rank 1 enters late: rank 0 must wait for this call's words.
        xs, idxs, ws, refs = batches[4]
        if r == 1:
            time.sleep(0.1)
        errors += [f"call 4: {e}" for e in
                   testing.compare(buf.dispatch(xs[r], idxs[r], ws[r]), refs[r])]
    return errors


@pytest.mark.parametrize(("layout", "hidden"), [("expert", 1000), ("rank", 240)])
def test_in_place_rows_bit_exact_two_in_flight_and_stale_words(layout: str, hidden: int) -> None:
    # hidden 1000: 2000-byte rows, 5 blocks (the last partial); 240: exactly one block
    results = launch(_worker_in_flight, 2, layout, hidden, timeout_s=120)
    errors = [e for res in results for e in res]
    assert not errors, "\n".join(errors[:20])
