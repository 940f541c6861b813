"""Tests of the Data-as-Flag codecs (ubep.flags) against docs/FORMATS.md.

The byte formats are re-derived here in plain Python (bytes, int.from_bytes, Python-int
arithmetic mod 2^64) from the document, not from the codecs. Torn writes are simulated by
applying a writer's stores one at a time, in several orders, onto a fresh (zero) or stale
(previous epoch) buffer, and asking the reader about every intermediate state.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ubep import dtypes
from ubep.errors import InvalidArgumentError
from ubep.flags import DcCodec, NotReadyError, SpCodec, SwFlag, TffCodec, as_row_bytes

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MASK64 = 2**64 - 1
ORDERS = ("forward", "reverse", "shuffled", "head_tail", "odd_even")


def store_order(n: int, order: str, rng: np.random.Generator) -> list[int]:
    """Order in which the ``n`` stores of a region land (every prefix is a state the reader
    may observe, so "half a block then a pause" is covered by any order's prefixes)."""
    idx = list(range(n))
    if order == "reverse":
        return idx[::-1]
    if order == "shuffled":
        return [int(i) for i in rng.permutation(n)]
    if order == "head_tail":  # what glibc memcpy does for small copies: head and tail first
        return [0, n - 1, *range(1, n - 1)] if n > 1 else idx
    if order == "odd_even":  # two interleaved streams, one lagging
        return idx[1::2] + idx[::2]
    return idx


def region_stores(start: int, end: int, width: int, order: str, rng) -> list[tuple[int, int]]:
    starts = list(range(start, end, width))
    return [(starts[i], min(width, end - starts[i])) for i in store_order(len(starts), order, rng)]


def replay(initial: np.ndarray, final: np.ndarray, stores: list[tuple[int, int]]):
    """Yield the buffer after each store (including before the first)."""
    state = initial.copy()
    yield state.copy()
    for off, length in stores:
        state[off : off + length] = final[off : off + length]
        yield state.copy()


def random_rows(rng, n: int, row_bytes: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, row_bytes), dtype=np.uint8)


# --- independent format oracles ----------------------------------------------------------------


def tff_encode_oracle(row: bytes, epoch: int, block_bytes: int, flag_bytes: int) -> bytes:
    P = block_bytes - flag_bytes
    out = b""
    for start in range(0, len(row), P):
        chunk = row[start : start + P]
        out += chunk + bytes(P - len(chunk)) + epoch.to_bytes(8, "little") + bytes(flag_bytes - 8)
    return out


def dc_checksum_oracle(rows: list[bytes], epoch: int, block_bytes: int, check_bytes) -> int:
    words = []
    for row in rows:
        for start in range(0, len(row), block_bytes):
            block = row[start : start + block_bytes]
            part = block if check_bytes is None else block[:check_bytes]
            part += bytes(-len(part) % 8)
            words += [int.from_bytes(part[i : i + 8], "little") for i in range(0, len(part), 8)]
    s1 = sum(words) % 2**64
    s2 = sum((i + 1) * w for i, w in enumerate(words)) % 2**64
    rot = ((s2 << 29) | (s2 >> 35)) & MASK64
    value = s1 ^ rot ^ (epoch * 0x9E3779B97F4A7C15 % 2**64)
    return value or 1


# --- SW ----------------------------------------------------------------------------------------


def test_sw_flag_is_the_epoch_word():
    for epoch in (1, 2**32 + 5, MASK64):
        flag = SwFlag.encode(epoch)
        assert flag.tobytes() == epoch.to_bytes(8, "little")
        assert SwFlag.ready(flag, epoch)
        assert not SwFlag.ready(flag, epoch - 1 if epoch > 1 else 2)
    rows = random_rows(np.random.default_rng(0), 3, 10)
    # Raw-row slots (SW, DC, SP) are 64-byte aligned strides.
    for codec in (SwFlag, DcCodec, SpCodec):
        assert (codec.slot_bytes(10), codec.slot_bytes(64), codec.slot_bytes(65)) == (64, 64, 128)
    np.testing.assert_array_equal(SwFlag.decode(rows, SwFlag.encode(7), 7), rows)
    with pytest.raises(NotReadyError):
        SwFlag.decode(rows, SwFlag.encode(6), 7)  # stale flag of the previous call
    with pytest.raises(NotReadyError):
        SwFlag.decode(rows, np.zeros(1, np.uint64), 7)  # fresh buffer
    for bad in (0, -1, 2**64, 1.0, True):
        with pytest.raises(InvalidArgumentError) as err:
            SwFlag.encode(bad)
        assert err.value.argument == "epoch"


# --- TFF ---------------------------------------------------------------------------------------

TFF_GEOMETRIES = [(512, 32), (64, 8), (128, 16), (64, 56)]


@SETTINGS
@given(
    st.sampled_from(TFF_GEOMETRIES),
    st.integers(0, 4),
    st.integers(1, 1100),
    st.integers(1, MASK64),
    st.integers(0, 2**32),
)
def test_tff_round_trip_and_bytes(geometry, n, row_bytes, epoch, seed):
    codec = TffCodec(*geometry)
    rows = random_rows(np.random.default_rng(seed), n, row_bytes)
    slots = codec.encode(rows, epoch)
    P = geometry[0] - geometry[1]
    assert codec.slot_bytes(row_bytes) == -(-row_bytes // P) * geometry[0]
    assert slots.shape == (n, codec.slot_bytes(row_bytes)) and slots.dtype == np.uint8
    for i in range(n):
        assert slots[i].tobytes() == tff_encode_oracle(rows[i].tobytes(), epoch, *geometry)
    assert codec.row_ready(slots, epoch, row_bytes).all()
    assert codec.row_ready(slots, epoch).all()  # the width alone locates the blocks
    np.testing.assert_array_equal(codec.decode(slots, epoch, row_bytes), rows)


def tff_writer_stores(codec: TffCodec, row_bytes: int, order: str, flag_first: bool, rng):
    """A writer's stores for one slot: per block, 8-byte payload stores then the epoch word
    (or, for the buggy writer, the epoch word first). Blocks go in ``order`` too."""
    nblocks = codec.num_blocks(row_bytes)
    stores = []
    for b in store_order(nblocks, order, rng):
        base = b * codec.block_bytes
        payload = region_stores(base, base + codec.payload_per_block, 8, order, rng)
        flag = [(base + codec.payload_per_block, 8)]
        stores += flag + payload if flag_first else payload + flag
    return stores


def block_epochs(slot: np.ndarray, codec: TffCodec) -> list[int]:
    raw = slot.tobytes()
    P = codec.payload_per_block
    return [
        int.from_bytes(raw[b + P : b + P + 8], "little")
        for b in range(0, len(raw), codec.block_bytes)
    ]


@pytest.mark.parametrize("geometry", [(512, 32), (64, 8)])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("initial", ["fresh", "stale"])
def test_tff_reader_never_accepts_a_partial_block(geometry, order, initial):
    codec = TffCodec(*geometry)
    rng = np.random.default_rng(1)
    epoch = 9
    row_bytes = 2 * codec.payload_per_block + 13  # three blocks, the last one partial
    row = random_rows(rng, 1, row_bytes)
    final = codec.encode(row, epoch)[0]
    if initial == "fresh":
        start = np.zeros_like(final)
    else:  # the previous call's complete slot, different data
        start = codec.encode(random_rows(rng, 1, row_bytes), epoch - 1)[0]
    stores = tff_writer_stores(codec, row_bytes, order, flag_first=False, rng=rng)
    states = list(replay(start, final, stores))
    for state in states:
        ready = codec.block_ready(state[None], epoch, row_bytes)[0]
        # Accepted exactly when the epoch word is the new one ...
        assert ready.tolist() == [e == epoch for e in block_epochs(state, codec)]
        # ... and with a writer that stores the flag last, an accepted block is complete.
        for b in np.nonzero(ready)[0]:
            blk = slice(b * codec.block_bytes, (b + 1) * codec.block_bytes)
            np.testing.assert_array_equal(state[blk], final[blk])
        if ready.all():
            np.testing.assert_array_equal(codec.decode(state[None], epoch, row_bytes), row)
        else:
            with pytest.raises(NotReadyError):
                codec.decode(state[None], epoch, row_bytes)
    assert codec.row_ready(states[-1][None], epoch, row_bytes)[0]
    assert sum(codec.row_ready(s[None], epoch, row_bytes)[0] for s in states) == 1


def test_tff_flag_before_payload_is_the_writers_bug():
    # The reader cannot tell: a writer that stores the epoch word first exposes a torn block
    # that passes the check. This is why the flag needs its own release store, after the data.
    codec = TffCodec(64, 8)
    rng = np.random.default_rng(2)
    row = random_rows(rng, 1, 100)
    final = codec.encode(row, 5)[0]
    stores = tff_writer_stores(codec, 100, "forward", flag_first=True, rng=rng)
    exposed = 0
    for state in replay(np.zeros_like(final), final, stores):
        ready = codec.block_ready(state[None], 5, 100)[0]
        for b in np.nonzero(ready)[0]:
            blk = slice(b * 64, (b + 1) * 64)
            exposed += not np.array_equal(state[blk], final[blk])
    assert exposed > 0


def test_tff_stale_and_future_epochs_rejected():
    codec = TffCodec()
    rows = random_rows(np.random.default_rng(3), 2, 1000)
    for written, expected in [(4, 5), (6, 5), (2**32, 1), (1, 2**32 + 1)]:
        slots = codec.encode(rows, written)
        assert not codec.row_ready(slots, expected, 1000).any()
        with pytest.raises(NotReadyError):
            codec.decode(slots, expected, 1000)
    # Only one of the two rows updated: the other is rejected, the first accepted.
    slots = codec.encode(rows, 4)
    slots[0] = codec.encode(rows[:1], 5)[0]
    assert codec.row_ready(slots, 5, 1000).tolist() == [True, False]


def test_tff_validation():
    for kwargs, argument in [
        ({"flag_bytes": 4}, "flag_bytes"),
        ({"flag_bytes": 12}, "flag_bytes"),
        ({"block_bytes": 500}, "block_bytes"),
        ({"block_bytes": 64, "flag_bytes": 64}, "block_bytes"),
    ]:
        with pytest.raises(InvalidArgumentError) as err:
            TffCodec(**kwargs)
        assert err.value.argument == argument
    codec = TffCodec()
    assert codec.payload_per_block == 480 and codec.efficiency == 480 / 512
    with pytest.raises(InvalidArgumentError) as err:
        codec.encode(np.zeros((2, 4), np.uint16), 1)
    assert err.value.argument == "rows_u8"
    with pytest.raises(InvalidArgumentError) as err:
        codec.encode(np.zeros((2, 4), np.uint8), 0)
    assert err.value.argument == "epoch"
    with pytest.raises(InvalidArgumentError) as err:
        codec.decode(np.zeros((2, 500), np.uint8), 1, 100)
    assert err.value.argument == "slots"
    with pytest.raises(InvalidArgumentError) as err:
        codec.row_ready(np.zeros((2, 500), np.uint8), 1)
    assert err.value.argument == "slots"


# --- DC ----------------------------------------------------------------------------------------

DC_GEOMETRIES = [(512, None), (512, 32), (64, None), (64, 8), (24, None), (24, 16)]


@SETTINGS
@given(
    st.sampled_from(DC_GEOMETRIES),
    st.integers(0, 4),
    st.integers(1, 1100),
    st.integers(1, MASK64),
    st.integers(0, 2**32),
)
def test_dc_checksum_matches_format(geometry, n, row_bytes, epoch, seed):
    codec = DcCodec(*geometry)
    rows = random_rows(np.random.default_rng(seed), n, row_bytes)
    want = dc_checksum_oracle([r.tobytes() for r in rows], epoch, *geometry)
    assert codec.checksum(rows, epoch) == want
    control = codec.control(rows, epoch)
    assert control.tobytes() == b"".join(v.to_bytes(8, "little") for v in (n, want, epoch))
    assert codec.verify(rows, control, epoch)
    np.testing.assert_array_equal(codec.decode(rows, control, epoch), rows)


def solve_zero_checksum_word(epoch: int) -> int | None:
    """A word ``x`` with ``x ^ rotl(x, 29) == epoch * golden``: a one-word batch whose raw
    checksum is 0. Solvable iff the target has even parity (the map's image)."""
    target = epoch * 0x9E3779B97F4A7C15 % 2**64
    if bin(target).count("1") % 2:
        return None
    x, j = 0, 0
    for _ in range(63):  # bit (j + 29) = target bit (j + 29) ^ bit j, walking all 64 bits
        nxt = (j + 29) % 64
        bit = ((target >> nxt) & 1) ^ ((x >> j) & 1)
        x |= bit << nxt
        j = nxt
    return x


def test_dc_checksum_zero_becomes_one():
    epoch = next(e for e in range(1, 100) if solve_zero_checksum_word(e) is not None)
    x = solve_zero_checksum_word(epoch)
    assert x is not None
    assert (x ^ (((x << 29) | (x >> 35)) & MASK64)) == epoch * 0x9E3779B97F4A7C15 % 2**64
    rows = np.frombuffer(x.to_bytes(8, "little"), np.uint8)[None].copy()
    assert DcCodec(block_bytes=8).checksum(rows, epoch) == 1
    assert DcCodec(block_bytes=8).checksum(rows, epoch + 1) != 1


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("initial", ["fresh", "stale"])
def test_dc_rejects_every_partial_batch(order, initial):
    # The control block of epoch e is visible (as with a writer whose payload stores were not
    # ordered before it): the checksum alone must catch every partial payload.
    codec = DcCodec()
    rng = np.random.default_rng(4)
    epoch, n, row_bytes = 11, 3, 700
    rows = random_rows(rng, n, row_bytes)
    control = codec.control(rows, epoch)
    final = rows.reshape(-1)
    start = np.zeros_like(final) if initial == "fresh" else random_rows(rng, n, row_bytes).ravel()
    stores = region_stores(0, final.size, 16, order, rng)
    accepted = []
    for state in replay(start, final, stores):
        ok = codec.verify(state.reshape(n, row_bytes), control, epoch)
        accepted.append(ok)
        assert ok == np.array_equal(state, final)
    assert accepted[-1] and sum(accepted) == 1


def test_dc_check_bytes_32_accepts_a_torn_tail():
    # UB writes a 512-byte block atomically, so the paper checks only its first 32 bytes. A CPU
    # store tears: here the head of the block has landed and the tail is still last call's
    # data. The 32-byte check passes that torn block; the whole-block default rejects it.
    rng = np.random.default_rng(5)
    epoch = 3
    rows = random_rows(rng, 1, 512)
    torn = random_rows(rng, 1, 512)  # previous contents
    torn[0, :32] = rows[0, :32]
    paper, cpu = DcCodec(check_bytes=32), DcCodec()
    assert paper.verify(torn, paper.control(rows, epoch), epoch)
    assert not cpu.verify(torn, cpu.control(rows, epoch), epoch)
    with pytest.raises(NotReadyError):
        cpu.decode(torn, cpu.control(rows, epoch), epoch)


def test_dc_stale_epoch_and_count_rejected():
    codec = DcCodec()
    rows = random_rows(np.random.default_rng(6), 2, 300)
    old = codec.control(rows, 7)
    assert not codec.verify(rows, old, 8)  # last call's control block
    forged = codec.control(rows, 7)
    forged[2] = 8  # epoch word updated but checksum from epoch 7: the epoch is mixed in
    assert not codec.verify(rows, forged, 8)
    assert codec.checksum(rows, 7) != codec.checksum(rows, 8)
    assert not codec.verify(rows[:1], codec.control(rows, 8), 8)  # count mismatch
    # Trailing zero words add nothing to s1 or s2, so the checksum alone cannot tell a batch
    # from the same batch plus an all-zero row: the published count is what does.
    padded = np.concatenate([rows, np.zeros((1, 300), np.uint8)])
    assert codec.checksum(padded, 8) == codec.checksum(rows, 8)
    assert not codec.verify(padded, codec.control(rows, 8), 8)
    for kwargs, argument in [
        ({"block_bytes": 20}, "block_bytes"),
        ({"check_bytes": 12}, "check_bytes"),
        ({"check_bytes": 1024}, "check_bytes"),
    ]:
        with pytest.raises(InvalidArgumentError) as err:
            DcCodec(**kwargs)
        assert err.value.argument == argument
    with pytest.raises(InvalidArgumentError) as err:
        codec.verify(rows, np.zeros(2, np.uint64), 8)
    assert err.value.argument == "control"


# --- SP ----------------------------------------------------------------------------------------

# docs/FORMATS.md, "SP": the normative sentinels.
SENTINELS = {"bf16": 0x7FA5, "fp16": 0x7CA5, "fp32": 0x7FA5A5A5}


def test_sp_sentinels_are_the_documented_ones():
    for name, bits in SENTINELS.items():
        codec = SpCodec(name)
        assert codec.sentinel_bits == bits
        assert codec.sentinel.dtype == dtypes.DTYPES[name].storage
        assert codec.sentinel.tobytes() == bits.to_bytes(codec.dtype.itemsize, "little")


@pytest.mark.parametrize("dtype", ["int8", "uint8", np.int8, np.uint8])
def test_sp_refuses_one_byte_types(dtype):
    with pytest.raises(InvalidArgumentError) as err:
        SpCodec(dtype)
    assert err.value.argument == "sync"
    assert "tff" in str(err.value) and "dc" in str(err.value)


@SETTINGS
@given(st.sampled_from(list(SENTINELS)), st.integers(0, 4), st.integers(1, 40), st.integers(0, 99))
def test_sp_round_trip(name, n, hidden, seed):
    codec = SpCodec(name)
    dt = codec.dtype
    rng = np.random.default_rng(seed)
    x = dt.from_float32((rng.standard_normal((n, hidden)) * 100).astype(np.float32))
    codec.check_payload(x)
    buf = np.empty((n, hidden), dt.storage)
    codec.fill(buf)
    assert not codec.row_ready(buf).any()
    buf[...] = x
    assert codec.row_ready(buf).all()
    np.testing.assert_array_equal(codec.decode(buf).view(dt.bits_dtype), x.view(dt.bits_dtype))
    # The same check on the raw bytes the runtime sees.
    assert codec.row_ready(as_row_bytes(buf)).all()


@pytest.mark.parametrize("name", list(SENTINELS))
@pytest.mark.parametrize("order", ORDERS)
def test_sp_rejects_every_partial_row(name, order):
    codec = SpCodec(name)
    dt = codec.dtype
    rng = np.random.default_rng(7)
    hidden = 16
    x = dt.from_float32(rng.standard_normal((1, hidden)).astype(np.float32))
    buf = np.empty_like(x)
    codec.fill(buf)
    final = x.view(np.uint8).reshape(-1)
    stores = region_stores(0, final.size, dt.itemsize, order, rng)  # whole-element stores
    states = list(replay(buf.view(np.uint8).reshape(-1), final, stores))
    ready = [bool(codec.row_ready(s.view(dt.storage)[None])[0]) for s in states]
    assert ready == [False] * (len(states) - 1) + [True]
    with pytest.raises(NotReadyError):
        codec.decode(states[-2].view(dt.storage)[None])


def test_sp_bytewise_stores_can_fool_the_reader():
    # Why writers must store whole elements: an FP32 element written byte by byte passes
    # through states that are neither the sentinel nor the value, and the reader accepts them.
    codec = SpCodec("fp32")
    value = np.array([1.5], np.float32)
    buf = np.empty(1, np.float32)
    codec.fill(buf)
    stores = region_stores(0, 4, 1, "forward", None)
    fooled = 0
    for state in list(replay(buf.view(np.uint8), value.view(np.uint8), stores))[1:-1]:
        fooled += bool(codec.row_ready(state.view(np.float32)[None])[0])
    assert fooled == 3


def test_sp_payload_with_sentinel_rejected_and_arithmetic_never_makes_it():
    for name in SENTINELS:
        codec = SpCodec(name)
        dt = codec.dtype
        x = dt.from_float32(np.linspace(-2, 2, 12, dtype=np.float32)).reshape(3, 4)
        x.view(dt.bits_dtype)[1, 2] = codec.sentinel_bits
        with pytest.raises(InvalidArgumentError) as err:
            codec.check_payload(x)
        assert err.value.argument == "x"
        # Every operation on NaNs, infinities and the sentinel itself yields quiet NaNs.
        specials = np.array([np.inf, -np.inf, np.nan, 0.0], np.float32)
        sent_f32 = dt.to_float32(codec.sentinel.reshape(1))
        operands = np.concatenate([specials, sent_f32])
        with np.errstate(all="ignore"):
            produced = np.concatenate([
                (operands[:, None] + operands[None, :]).ravel(),
                (operands[:, None] * operands[None, :]).ravel(),
                (operands[:, None] / operands[None, :]).ravel(),
            ])
            codec.check_payload(dt.from_float32(produced.astype(np.float32))[None])


def test_sp_reset_is_what_rejects_stale_rows():
    codec = SpCodec("bf16")
    x = dtypes.BF16.from_float32(np.ones((2, 8), np.float32))
    buf = np.empty_like(x)
    codec.fill(buf)
    buf[...] = x
    assert codec.row_ready(buf).all()
    # Without a reset, last call's rows look complete for the next call: SP has no epoch, so
    # the reset after consumption is mandatory.
    codec.reset(buf)
    assert not codec.row_ready(buf).any()
    with pytest.raises(InvalidArgumentError):
        codec.fill(np.empty((2, 8), np.float32))
    with pytest.raises(InvalidArgumentError):
        codec.row_ready(np.empty((2, 3), np.uint8))  # 3 bytes: not whole bf16 elements
