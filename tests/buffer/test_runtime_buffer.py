"""Buffer life cycle and the bytes the native data plane writes.

* configuration validation, ``size_hint`` against the real segment, config mismatch between
  ranks, two Buffers in one process, many calls in a row, ``recv_x`` lifetime (a read-only view
  valid through the next dispatch; ``copy=True`` owns its data), combine buffers;
* wire formats: what the engine leaves in shared memory equals what the pure-numpy codecs of
  ``ubep.flags`` produce (TFF slots, DC control block, SW flag, SP pre-fill and reset).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tests._runtime_support import Case, bits, compare, make_inputs
from ubep import dtypes, reference, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError, RankFailedError, UbepError
from ubep.flags import DcCodec, SpCodec, SwFlag, TffCodec, as_row_bytes
from ubep.modes import LAYOUTS
from ubep.runtime import launch  # type: ignore[attr-defined]

# --- configuration --------------------------------------------------------------------------


def test_config_validation() -> None:
    base = dict(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=4)
    with pytest.raises(InvalidArgumentError) as info:
        BufferConfig(**base, dtype="int8", sync="sp")
    assert info.value.argument == "sync" and "tff" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="num_topk"):
        BufferConfig(**(base | {"num_topk": 5}), dtype="bf16")
    with pytest.raises(InvalidArgumentError, match="engine"):
        BufferConfig(**base, dtype="bf16", engine="bulk")
    with pytest.raises(InvalidArgumentError, match="combine_dtype"):
        BufferConfig(**base, dtype="fp16", combine_dtype="bf16")
    with pytest.raises(InvalidArgumentError, match="hidden"):
        BufferConfig(**(base | {"hidden": 0}), dtype="bf16")
    cfg = BufferConfig(**base, dtype=np.float16)
    assert cfg.dtype == "fp16" and cfg.combine_dtype == "fp16"
    assert BufferConfig(**base, dtype="uint8", sync="dc").combine_dtype == "bf16"


def test_size_hint_grows_with_the_shape() -> None:
    small = BufferConfig(max_tokens_per_rank=16, hidden=256, num_topk=4, num_experts=8,
                         dtype="bf16")
    big = BufferConfig(max_tokens_per_rank=32, hidden=256, num_topk=4, num_experts=8,
                       dtype="bf16")
    rows = 2 * 16 * 4  # ranks x tokens x min(top-k, experts per rank)
    # two SP receive regions (rows land in recv_x itself) and two combine regions, at least
    assert Buffer.size_hint(small, 2) >= 4 * rows * 256 * 2
    assert Buffer.size_hint(big, 2) > Buffer.size_hint(small, 2)
    with pytest.raises(InvalidArgumentError, match="num_experts"):
        Buffer.size_hint(small, 3)


# --- life cycle -----------------------------------------------------------------------------

A = Case("asp", "sp", "expert", "bf16", 2, 256, "uniform")
B = Case("bsp", "dc", "rank", "fp32", 2, 128, "hot")


def _call(buf: Buffer, group: Any, case: Case, tokens: list[int], seed: int) -> Any:
    cfg = buf.config
    xs, idxs, ws = make_inputs(case, cfg.num_experts, tokens, seed, case.routing)
    r = group.rank
    res = buf.dispatch(xs[r], idxs[r], ws[r])
    refs = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout)
    return res, refs


def _worker_lifecycle(group: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": []}
    cfg_a, cfg_b = A.config(16), B.config(24)
    buf_a, buf_b = Buffer(group, cfg_a), Buffer(group, cfg_b)
    out["size_hint"] = buf_a._memory.segments[group.rank].size == Buffer.size_hint(cfg_a, 2)
    r = group.rank
    views = []
    for i in range(30):  # interleaved calls on two Buffers
        for buf, case, tokens in ((buf_a, A, [16, 9]), (buf_b, B, [24, 0])):
            res, refs = _call(buf, group, case, tokens, i)
            out["errors"] += compare(res, refs[r])
            outs = [ref.recv_x for ref in refs]
            y = buf.combine(res.recv_x, res.handle)
            if not np.array_equal(bits(y), bits(reference.combine(outs, refs)[r])):
                out["errors"].append(f"combine {i}")
            if buf is buf_a:
                views.append((res.recv_x, refs[r].recv_x.copy()))
    # a view survives the next dispatch (and is read-only)
    prev_view, prev_ref = views[-2]
    out["view_valid"] = bool(np.array_equal(prev_view, prev_ref))
    out["read_only"] = not views[-1][0].flags.writeable
    res, refs = _call(buf_a, group, A, [16, 16], 99)
    owned = buf_a.dispatch(*[a[r] for a in make_inputs(A, cfg_a.num_experts, [16, 16], 99,
                                                       A.routing)], copy=True)
    out["copy_owned"] = owned.recv_x.flags.writeable and owned.recv_x.base is None
    # combine buffers of consecutive dispatches are distinct memory
    cb1, cb2 = buf_a.get_combine_buffer(res.handle), buf_a.get_combine_buffer(owned.handle)
    out["distinct_combine_buffers"] = not np.shares_memory(cb1, cb2)
    cb2[...] = owned.recv_x
    y = buf_a.combine(cb2, owned.handle)
    y_ref = reference.combine([ref.recv_x for ref in refs], refs)[r]
    out["zero_copy_combine"] = bool(np.array_equal(bits(y), bits(y_ref)))
    buf_a.close()
    buf_b.close()
    try:
        buf_a.dispatch(np.zeros((0, 256), np.uint16), np.zeros((0, 4), np.int64),
                       np.zeros((0, 4), np.float32))
        out["closed"] = "no error"
    except UbepError as exc:
        out["closed"] = str(exc)
    return out


def test_two_buffers_many_calls_views_and_combine_buffers() -> None:
    for out in launch(_worker_lifecycle, 2, timeout_s=300):
        assert not out["errors"], out["errors"][:5]
        assert out["size_hint"] and out["view_valid"] and out["read_only"]
        assert out["copy_owned"] and out["distinct_combine_buffers"] and out["zero_copy_combine"]
        assert "closed" in out["closed"]


def _worker_combine_order(group: Any, layout: str) -> list[str]:
    """Combines of dispatches made before the last one, each with fresh expert outputs: the
    peers' rows a combine copies into the segment come from its own dispatch's record, never
    from a later dispatch that reused the receive region."""
    case = Case("asp", "sw", layout, "bf16", 2, 128, "uniform")
    cfg = case.config(8)
    r, errors = group.rank, []
    with Buffer(group, cfg) as buf:
        calls = [_call(buf, group, case, [8, 6], seed) for seed in range(3)]  # A, B, C
        for n, i in enumerate((0, 2, 1, 1)):  # A (region reused by C), C, B, B again
            res, refs = calls[i]
            outs = [testing.payload(np.random.default_rng(100 * n + q), "bf16",
                                    len(ref.recv_x), 128) for q, ref in enumerate(refs)]
            y = buf.combine(outs[r], res.handle)
            if not np.array_equal(bits(y), bits(reference.combine(outs, refs)[r])):
                errors.append(f"combine {n} of dispatch {i}")
    return errors


@pytest.mark.parametrize("layout", LAYOUTS)
def test_combine_of_earlier_dispatches(layout: str) -> None:
    for errors in launch(_worker_combine_order, 2, layout, timeout_s=120):
        assert errors == []


def _worker_mismatch(group: Any) -> None:
    cfg = A.config(16 if group.rank == 0 else 17)
    Buffer(group, cfg)


def test_config_must_match_on_every_rank() -> None:
    with pytest.raises(RankFailedError) as info:
        launch(_worker_mismatch, 2, timeout_s=120)
    assert info.value.remote_type == "InvalidArgumentError"
    assert all("InvalidArgumentError" in f for f in info.value.failures.values())
    # the field and both values, on every rank, not a truncated BufferConfig(...)
    want = "config.max_tokens_per_rank=16: differs between ranks: rank 0 has 16, rank 1 has 17"
    assert all(want in f for f in info.value.failures.values()), info.value.failures


# --- wire formats ---------------------------------------------------------------------------


def _inbox(buf: Buffer, src: int, epoch: int) -> np.ndarray:
    lay = buf.layout
    off = lay.off_inbox + (src * 2 + epoch % 2) * lay.inbox_bytes
    return buf._memory.segments[buf.rank].array[off: off + lay.inbox_bytes]


def _land(buf: Buffer, index: int) -> np.ndarray:
    lay = buf.layout
    off = lay.off_land + (index % lay.num_regions) * lay.land_bytes
    return buf._memory.segments[buf.rank].array[off: off + lay.land_bytes]


def _worker_formats(group: Any) -> dict[str, bool]:
    r, peer = group.rank, 1 - group.rank
    out: dict[str, bool] = {}
    for sync in ("tff", "dc", "sw", "sp"):
        case = Case("asp", sync, "expert", "bf16", 2, 300, "uniform")  # 600-byte rows
        with Buffer(group, case.config(16)) as buf:
            if sync == "sp":
                codec = SpCodec("bf16")
                lay = buf.layout
                land = _land(buf, 0)[: lay.cap_rows * lay.slot_bytes].reshape(lay.cap_rows, -1)
                out["sp_prefilled"] = not codec.element_ready(land[:, :600]).any()
            res, refs = _call(buf, group, case, [16, 16], 5)
            epoch = buf._epoch
            mine = np.nonzero(res.recv_src_rank == peer)[0]  # rows from the peer, slot order
            rows = as_row_bytes(refs[r].recv_x[mine])
            slots = _land(buf, 0).reshape(-1, buf.layout.slot_bytes)[mine]
            ctl = _inbox(buf, peer, epoch).view(np.uint64)
            if sync == "tff":
                # ASP lands in place: recv_x holds the rows, each land slot the row's epoch
                # words, one per block of the format (TffCodec's blocks)
                words = slots.view(np.uint64)
                out["tff"] = (words.shape[1] == TffCodec().num_blocks(600)
                              and bool((words == epoch).all())
                              and bool(np.array_equal(as_row_bytes(res.recv_x[mine]), rows)))
            elif sync == "dc":
                out["dc"] = bool(np.array_equal(ctl[16:19], DcCodec().control(rows, epoch)))
            elif sync == "sw":
                out["sw"] = SwFlag.ready(ctl[9:10], epoch) and int(ctl[8]) == len(mine)
            else:
                # ASP+SP lands rows in recv_x itself: the slots are the raw rows
                out["sp_raw"] = bool(np.array_equal(as_row_bytes(res.recv_x[mine]), rows))
                out["sp_in_place"] = bool(np.array_equal(slots[:, :600], rows))
            group.barrier(60)
    return out


def test_native_bytes_equal_the_codecs() -> None:
    for out in launch(_worker_formats, 2, timeout_s=300):
        assert out == {k: True for k in ("tff", "dc", "sw", "sp_prefilled", "sp_raw",
                                         "sp_in_place")}, out


def _worker_sp_stale(group: Any) -> list[str]:
    # Only rank 1 sends: to rank 2 first (its send order is rank + 1, ...), then to rank 0,
    # which polls meanwhile.
    # * ~1000 rows of 8 KiB: the rows of the call before last, left complete in the same region,
    #   would be taken at once if the region were not re-armed (rows are copied out the moment
    #   dispatch returns: recv_x is a view rank 1 could still write into).
    # * 1 row of 8 MiB: the elements just before the polled tail, read the moment dispatch
    #   returns, are the last the body copy writes: stale if the tail were stored first.
    errors = []
    r = group.rank
    for hidden, tokens in ((4096, 1024), (1 << 22, 1)):
        case = Case("asp", "sp", "rank", "bf16", 3, hidden, "uniform")
        with Buffer(group, case.config(tokens)) as buf:
            for seed in range(1, 5):
                xs, idxs, ws = make_inputs(case, buf.config.num_experts, [0, tokens, 0], seed,
                                           case.routing)
                group.barrier(60)
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                before_tail = res.recv_x[:, -64:-16].copy()
                recv_x = res.recv_x.copy()
                refs = reference.dispatch(xs, idxs, ws, buf.config.num_experts, layout="rank")
                if not np.array_equal(before_tail, refs[r].recv_x[:, -64:-16]):
                    errors.append(f"hidden {hidden}: body not complete when its tail was")
                res = dataclasses.replace(res, recv_x=recv_x)
                errors += [f"hidden {hidden}: {e}" for e in compare(res, refs[r])]
    return errors


def test_sp_rearms_stale_slots_before_readiness() -> None:
    """SP in place re-arms a reused region before readiness, and its writer stores the polled
    tail of a row after the rest."""
    for errors in launch(_worker_sp_stale, 3, timeout_s=300):
        assert not errors, errors[:3]


def _worker_sp_check(group: Any, check: int) -> list[str]:
    errors = []
    for layout in LAYOUTS:
        case = Case("asp", "sp", layout, "bf16", 2, 300, "uniform")  # 600-byte rows
        with Buffer(group, case.config(24, sp_check_bytes=check)) as buf:
            for seed in range(5):
                res, refs = _call(buf, group, case, [24, 17], seed)
                errors += [f"{layout} {seed}: {e}" for e in compare(res, refs[group.rank])]
            # the sentinel in the body of every rank's row 3: nobody's flag under a tail, it
            # travels bit-exact; polled (the whole row), it is refused on every rank
            xs, idxs, ws = make_inputs(case, buf.config.num_experts, [24, 17], 9, case.routing)
            for x in xs:
                x[3, 0] = dtypes.BF16.sentinel
            r = group.rank
            if check == 0 or check >= 600:
                try:
                    buf.dispatch(xs[r], idxs[r], ws[r])
                    errors.append(f"{layout}: a polled sentinel was sent")
                except InvalidArgumentError as exc:
                    if exc.argument != "x":
                        errors.append(f"{layout}: refused naming {exc.argument}")
            else:
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                refs = reference.dispatch(xs, idxs, ws, buf.config.num_experts, layout=layout)
                errors += [f"{layout} body sentinel: {e}" for e in compare(res, refs[r])]
    return errors


@pytest.mark.parametrize("check", [0, 8, 4096])
def test_sp_every_check_width_matches_the_reference(check: int) -> None:
    """Whole-row SP (0), the narrowest tail (8 bytes) and a tail wider than the row."""
    for errors in launch(_worker_sp_check, 2, check, timeout_s=300):
        assert not errors, errors[:3]


def test_sp_check_bytes_is_validated() -> None:
    base = dict(max_tokens_per_rank=4, hidden=8, num_topk=2, num_experts=4, dtype="bf16")
    for bad in (-8, 12, 1.0, True):
        with pytest.raises(InvalidArgumentError, match="sp_check_bytes"):
            BufferConfig(**base, sp_check_bytes=bad)


def _worker_nan_combine(group: Any, dtype: str) -> list[str]:
    # Expert outputs full of NaNs of every sign and payload, several meeting in one sum: the
    # result is the canonical NaN wherever a term was NaN, bit for bit with the reference.
    errors = []
    for layout in LAYOUTS:
        case = Case("asp", "sw", layout, dtype, 2, 300, "uniform")
        with Buffer(group, case.config(24)) as buf:
            res, refs = _call(buf, group, case, [24, 24], 3)
            dt = dtypes.dtype_of(dtype)
            outs = []
            for r, ref in enumerate(refs):
                rng = np.random.default_rng([r, 11])
                vals = rng.standard_normal(ref.recv_x.shape).astype(np.float32)
                out = dt.from_float32(vals)
                raw = out.view(dt.bits_dtype)
                nan_at = rng.random(raw.shape) < 0.3
                width = 8 * dt.itemsize
                payload = rng.integers(1, 2 ** (width - 10), raw.shape, dtype=np.uint64)
                exp_bits = {"bf16": 0x7F80, "fp16": 0x7C00, "fp32": 0x7F800000}[dtype]
                sign = rng.integers(0, 2, raw.shape, dtype=np.uint64) << np.uint64(width - 1)
                raw[nan_at] = (exp_bits | payload[nan_at] | sign[nan_at]).astype(raw.dtype)
                outs.append(out)
            y = buf.combine(outs[group.rank], res.handle)
            want = reference.combine(outs, refs)[group.rank]
            if not np.array_equal(bits(y), bits(want)):
                errors.append(f"{layout}: combine differs from the reference")
            nan = np.isnan(dt.to_float32(want))
            if not nan.any() or not (want.view(dt.bits_dtype)[nan]
                                     == dtypes.CANONICAL_NAN[dtype]).all():
                errors.append(f"{layout}: reference NaNs are not canonical")
    return errors


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_nan_sums_combine_to_the_canonical_nan(dtype: str) -> None:
    for errors in launch(_worker_nan_combine, 2, dtype, timeout_s=300):
        assert not errors, errors
