"""``BufferConfig(integrity="checksum")``: rows changed between their sender and their receiver
fail the call on every rank; clean calls stay bit-exact against ``ubep.reference``.

The corruption is a third party's write, made deterministic with ``Engine.poke`` (a one-shot
write core 0 of a rank makes as its call reaches a chosen phase, phases.c): dispatch rows in
the receiver's ``recv_x`` (ASP) or staging slots (BSP) after every sync format's own check has
passed, and expert outputs in their owner's segment after it published them, before the
reader reduces them. With ``integrity="off"`` the same writes reach the results (the control
case that shows the checksum is what catches them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests._runtime_support import Case, bits, compare, make_inputs
from ubep import modes, reference, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError, UbepError
from ubep.runtime import launch

MODES = sorted({(m.engine, m.sync, m.layout) for m in modes.enumerate_modes()})
# When the poke is made (phases.c): dispatch, on the receiver, once every row is in (ASP: the
# check phase after an in-process barrier; BSP: ph_bsp_reorder, after the second global barrier
# and after the sync format's own verification); combine, on the owner of the expert outputs,
# as it publishes them (ph_c_publish, after they were copied into its segment).
D_PHASE = {"asp": 6, "bsp": 9}
C_PHASE = 2
HIDDEN = 128


def test_integrity_is_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="integrity"):
        BufferConfig(max_tokens_per_rank=4, hidden=8, num_topk=2, num_experts=4, dtype="bf16",
                     integrity="crc")  # type: ignore[arg-type]


def _poke_dispatch(buf: Buffer, engine: str) -> None:
    """Garbage over the first row this rank receives from its peer, as the check begins."""
    lay, r = buf.layout, buf.rank
    reg = buf._num_dispatches % lay.num_regions
    if engine == "asp":  # recv_x: in this layout the peer's rows come first on rank 1
        off = lay.off_out + reg * lay.out_bytes
    else:  # the peer's staging partition (nland = 1)
        off = lay.off_land + (1 - r) * lay.cap_src_rows * lay.slot_bytes
    buf._engine.kernel.poke(0, D_PHASE[engine], r, off, b"\x5a\xa5" * 16)


def _poke_combine(buf: Buffer, handle: Any) -> None:
    """Garbage over this rank's expert outputs in its segment (the first 16 rows: the peer's
    rows among them) as it publishes them."""
    lay = buf.layout
    off = lay.off_comb + (handle.dispatch_index % 2) * lay.comb_bytes
    buf._engine.kernel.poke(1, C_PHASE, buf.rank, off, b"\x3c\xc3" * 2048)


def _pair(buf: Buffer, case: Case, rank: int, corrupt: str) -> tuple[str, str]:
    """One dispatch + combine on seeded inputs, ``corrupt`` ("dispatch", "combine" or "")
    poked (dispatch: rank 1 into the rows it received; combine: rank 0 into the outputs rank 1
    reads): each call's outcome, "ok", "WRONG" or the exception's class name."""
    cfg = buf.config
    seed = buf._epoch + 1
    xs, idxs, ws = make_inputs(case, cfg.num_experts, [8, 8], seed, "uniform")
    refs = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout)
    if corrupt == "dispatch" and rank == 1:
        _poke_dispatch(buf, case.engine)
    try:
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    except UbepError as exc:
        return type(exc).__name__, "-"
    d = "WRONG" if compare(res, refs[rank]) else "ok"
    if corrupt == "combine" and rank == 0:
        _poke_combine(buf, res.handle)
    expert_out = np.array(refs[rank].recv_x)  # the reference's rows: a corrupt recv_x stays out
    try:
        y = buf.combine(expert_out, res.handle)
    except UbepError as exc:
        return d, type(exc).__name__
    y_ref = reference.combine([np.ascontiguousarray(r.recv_x) for r in refs], refs)[rank]
    return d, "ok" if np.array_equal(bits(y), bits(y_ref)) else "WRONG"


def _worker_detect(group: Any, integrity: str, mode_list: list[tuple[str, str, str]]
                   ) -> list[tuple[str, str, str, str]]:
    out = []
    for engine, sync, layout in mode_list:
        case = Case(engine, sync, layout, "bf16", 2, HIDDEN, "uniform")
        cfg = case.config(8, timeout_s=30.0, integrity=integrity)
        with Buffer(group, cfg) as buf:
            for corrupt in ("dispatch", "combine"):
                got = _pair(buf, case, group.rank, corrupt)
                # every rank resyncs if any failed, then the next pair must be clean
                if any(o not in ("ok", "WRONG") for o in got):
                    buf.resync(30.0)
                after = _pair(buf, case, group.rank, "")
                out.append((f"{engine}+{sync}+{layout} {corrupt}", *got, "/".join(after)))
    return out


@pytest.mark.parametrize("engine", ["asp", "bsp"])
def test_corrupt_rows_fail_the_call_on_every_rank(engine: str) -> None:
    mode_list = [m for m in MODES if m[0] == engine]
    logs = launch(_worker_detect, 2, "checksum", mode_list, timeout_s=600)
    for r, log in enumerate(logs):
        for what, d, c, after in log:
            failed = d if what.endswith("dispatch") else c
            assert "WRONG" not in (d, c), (r, what, d, c)
            # the corrupted call raised here, on every rank, a ubep error (never a result)
            assert failed.endswith("Error"), (r, what, d, c)
            assert after == "ok/ok", (r, what, after)


def test_without_integrity_the_same_writes_reach_the_results() -> None:
    """The control case: the writes the checksum catches reach rank 1's results otherwise."""
    logs = launch(_worker_detect, 2, "off", [("asp", "sw", "rank"), ("bsp", "sw", "expert")],
                  timeout_s=600)
    for what, d, c, after in logs[1]:
        assert (d if what.endswith("dispatch") else c) == "WRONG", (what, d, c)
        assert after == "ok/ok", (what, after)


def _worker_clean(group: Any) -> list[str]:
    errors: list[str] = []
    for i, (engine, sync, layout) in enumerate(MODES):
        case = Case(engine, sync, layout, "bf16", 2, HIDDEN, "uniform")
        cfg = case.config(16, integrity="checksum")
        with Buffer(group, cfg) as buf:
            for step, tokens in enumerate(([16, 16], [3, 11], [0, 5])):
                seed = 1000 + 10 * i + step
                xs, idxs, ws = make_inputs(case, cfg.num_experts, tokens, seed, "uniform")
                errors += [f"{case} step {step}: {e}"
                           for e in testing.check_call(buf, xs, idxs, ws, seed)]
    return errors


def test_clean_calls_with_integrity_are_bit_exact() -> None:
    logs = launch(_worker_clean, 2, timeout_s=600)
    assert logs == [[], []], logs


# --- the documented format (docs/FORMATS.md, "Row checksums"), reimplemented here ----------

_M = (1 << 64) - 1


def _mix64(h: int, v: int) -> int:
    h ^= (v + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & _M
    return (h * 0xBF58476D1CE4E5B9) & _M


def _row_sum(row: bytes) -> int:
    n = len(row)
    padded = row + bytes(-n % 32)
    a, c = [0] * 4, [0] * 4
    for g in range(0, len(padded), 32):
        for lane in range(4):
            w = int.from_bytes(padded[g + 8 * lane:g + 8 * lane + 8], "little")
            a[lane] = (a[lane] + w) & _M
            c[lane] = (c[lane] + a[lane]) & _M
    h = _mix64(0x726F7773756D, n)
    for lane in range(4):
        h = _mix64(_mix64(h, a[lane]), c[lane])
    return h


def _row_check(row: bytes, epoch: int, pos: int) -> int:
    return _mix64(_mix64(_row_sum(row) ^ 0x726F77, epoch), pos)


@pytest.mark.parametrize("level", [0, 1])  # the generic kernel, AVX2 where the CPU has it
@pytest.mark.parametrize("row_bytes", [1, 7, 8, 24, 32, 40, 253, 256, 4096 + 12])
def test_the_native_row_sum_is_the_documented_one(row_bytes: int, level: int) -> None:
    from ubep.runtime.abi import load_native

    native = load_native()
    rows = np.random.default_rng(row_bytes).integers(0, 256, 5 * row_bytes, dtype=np.uint8)
    native.use_kernels(level)
    try:
        got = np.frombuffer(native.row_sums(rows, row_bytes), dtype="<u8").tolist()
    finally:
        native.use_kernels(2)
    raw = rows.tobytes()
    assert got == [_row_sum(raw[i * row_bytes:(i + 1) * row_bytes]) for i in range(5)]
    # one changed word always changes the sum
    changed = bytearray(raw[:row_bytes])
    changed[row_bytes // 2] ^= 0x10
    assert _row_sum(bytes(changed)) != got[0]


def _worker_stored(group: Any) -> list[str]:
    """After a dispatch, the checksums beside recv_x (ASP: by row) are the documented ones."""
    case = Case("asp", "sw", "expert", "bf16", 2, HIDDEN, "uniform")
    cfg = case.config(8, integrity="checksum")
    bad = []
    with Buffer(group, cfg) as buf:
        lay = buf.layout
        for _ in range(3):
            reg = buf._num_dispatches % lay.num_regions
            xs, idxs, ws = make_inputs(case, cfg.num_experts, [8, 8], buf._epoch + 1, "uniform")
            res = buf.dispatch(xs[group.rank], idxs[group.rank], ws[group.rank])
            seg = buf._memory.segments[group.rank].array
            at = lay.off_rsum + reg * lay.rsum_bytes
            stored = seg[at:at + 8 * len(res.recv_x)].view("<u8").tolist()
            rows = [np.ascontiguousarray(res.recv_x[p]).tobytes() for p in range(len(res.recv_x))]
            want = [_row_check(row, buf._epoch, p) for p, row in enumerate(rows)]
            bad += [f"row {p}" for p, (s, w) in enumerate(zip(stored, want, strict=True)) if s != w]
            assert len(rows) > 0
    return bad


def test_the_stored_checksums_follow_the_documented_format() -> None:
    assert launch(_worker_stored, 2, timeout_s=120) == [[], []]


def _padded_body(group: Any) -> list[tuple[str, str, int, list[str]]]:
    """Clean calls of the padded layout with row checksums, every sync and engine: its empty
    slots (no row, no checksum) are not checked."""
    out = []
    for engine in modes.ENGINES:
        for sync in modes.SYNCS:
            cfg = BufferConfig(max_tokens_per_rank=8, hidden=256, num_topk=2, num_experts=8,
                               dtype="bf16", layout="expert_padded", integrity="checksum",
                               sync=sync, engine=engine)
            with Buffer(group, cfg) as buf:
                for seed in range(2):
                    xs, idxs, ws = testing.inputs("bf16", 8, 2, 256, [6, 4], seed, "uniform")
                    out.append((engine, sync, seed, testing.check_call(
                        buf, xs, idxs, ws, seed, zero_copy=seed == 1)))
    return out


def test_padded_layout_with_checksums_is_bit_exact() -> None:
    for got in launch(_padded_body, 2, timeout_s=240):
        assert [case for case in got if case[3]] == []
        assert len(got) == len(modes.ENGINES) * len(modes.SYNCS) * 2
