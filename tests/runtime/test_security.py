"""Security of the shared-memory runtime: what a rank refuses to map, and that words a peer
writes into shared memory (counts, routing, expert-output descriptors) are bounds-checked before
they become positions.

A corrupted peer is played by a rank that, instead of calling dispatch/combine, writes forged
control words straight into the shared segments (record placement from ``ubep.plane.layout``,
offsets inside records from ``ubep.runtime.abi``, docs/FORMATS.md). The victim calls the engine with
output arrays that sit inside larger canary-filled arrays, so a write past the end is seen.
(Mode 0600, name format, size/group/owner checks: tests/test_runtime_launch.py.)
"""

from __future__ import annotations

import os
import secrets
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ubep.buffer import Buffer, BufferConfig
from ubep.errors import RankFailedError, UbepError
from ubep.modes import LAYOUTS
from ubep.plane import DispatchCall
from ubep.plane.records import (
    CI_BYTES,
    CI_EPOCH,
    CI_INDEX,
    CI_OFF,
    CI_ROWS,
    CI_STRIDE,
    CI_SUM,
    HDR_KIND,
    HDR_SIZE,
    HDR_VERSION,
    IN_COUNTS_EPOCH,
    IN_RANKS_SUM,
    IN_ROWS,
    IN_SUM,
    ROUTE_EPOCH,
    ROUTE_IDX,
    ROUTE_NTOK,
    ROUTE_SUM,
    ErrorRecord,
)
from ubep.plane.records import IN_COUNTS as INBOX_COUNTS
from ubep.runtime import _native, launch  # type: ignore[attr-defined]
from ubep.runtime.shm import SHM_DIR, Segment

GID = b"g" * 16


# --- what a rank refuses to map -----------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a file to another user")
def test_refuses_a_segment_owned_by_another_user() -> None:
    seg = Segment.create(4096, group_id=GID, owner_rank=1, kind="buffer")
    try:
        os.chown(os.path.join(SHM_DIR, seg.name), 65534, 65534)  # nobody
        with pytest.raises(UbepError, match="owned by uid 65534"):
            Segment.open_peer(seg.name, size_bytes=4096, group_id=GID, owner_rank=1,
                              kind="buffer")
    finally:
        seg.close()


@pytest.mark.parametrize("field", ["magic", "version", "kind", "size"])
def test_refuses_a_segment_whose_header_does_not_match(field: str) -> None:
    seg = Segment.create(4096, group_id=GID, owner_rank=1, kind="buffer")
    try:
        if field == "magic":
            seg.array[0:8] = np.frombuffer(b"EVILSEG1", np.uint8)
        elif field == "version":
            seg.array[HDR_VERSION:HDR_VERSION + 4] = np.frombuffer(struct.pack("<I", 99), np.uint8)
        elif field == "kind":
            seg.array[HDR_KIND:HDR_KIND + 16] = np.frombuffer(b"group".ljust(16, b"\0"), np.uint8)
        else:  # header claims a larger segment than the file
            seg.array[HDR_SIZE:HDR_SIZE + 8] = np.frombuffer(struct.pack("<Q", 1 << 40), np.uint8)
        with pytest.raises(UbepError, match=r"header|magic"):
            Segment.open_peer(seg.name, size_bytes=4096, group_id=GID, owner_rank=1,
                              kind="buffer")
    finally:
        seg.close()


def test_refuses_a_symlink_in_place_of_a_segment(tmp_path: Path) -> None:
    target = tmp_path / "decoy"
    target.write_bytes(b"\0" * 4096)
    os.chmod(target, 0o600)
    name = f"ubep-{secrets.token_hex(16)}"
    link = os.path.join(SHM_DIR, name)
    os.symlink(target, link)
    try:
        with pytest.raises((UbepError, OSError)):
            Segment.open_peer(name, size_bytes=4096, group_id=GID, owner_rank=1, kind="buffer")
    finally:
        os.unlink(link)


def test_segment_names_are_128_random_bits() -> None:
    names = {Segment.create(4096, group_id=GID, owner_rank=0, kind="buffer") for _ in range(64)}
    try:
        tails = [int(s.name[len("ubep-"):], 16) for s in names]
        assert len(set(tails)) == 64
        # every one of the 128 bit positions varies across names (no fixed or counter bits)
        ones = [sum(t >> b & 1 for t in tails) for b in range(128)]
        assert all(0 < c < 64 for c in ones)
    finally:
        for s in names:
            s.close()


def _worker_tampered_header(group: Any, record: str) -> str:
    """Rank 1 stamps a foreign group id into its Buffer segment before peers map it; every rank
    records the names of the Buffer segments it creates."""
    real_create = Segment.create

    def create(size_bytes: int, **kw: Any) -> Segment:
        seg = real_create(size_bytes, **kw)
        if kw.get("kind") == "buffer":
            Path(f"{record}.{group.rank}").write_text(seg.name)
            if group.rank == 1:
                seg.array[32:48] = np.frombuffer(b"X" * 16, np.uint8)
        return seg

    Segment.create = create  # type: ignore[method-assign]
    cfg = BufferConfig(max_tokens_per_rank=4, hidden=64, num_topk=2, num_experts=4,
                       dtype="bf16", timeout_s=5.0)
    try:
        Buffer(group, cfg).close()
    except UbepError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "mapped"


def test_a_rank_refuses_a_peer_buffer_with_a_foreign_group_id(tmp_path: Path) -> None:
    record = str(tmp_path / "name")
    try:
        results = launch(_worker_tampered_header, 2, record, timeout_s=60)
    except RankFailedError as exc:  # rank 1 may die waiting for the peer that refused
        results = [exc.results.get(0, exc.failures.get(0, "")), ""]
    assert "has header" in results[0] and "expected" in results[0], results
    names = [Path(f"{record}.{r}").read_text() for r in range(2)]
    assert names[1] in results[0]  # the refused segment is rank 1's
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]


# --- peer-written words are bounds-checked --------------------------------------------------


def _u64(arr: np.ndarray, off: int, value: int) -> None:
    arr[off: off + 8] = np.frombuffer(struct.pack("<Q", value), np.uint8)


def _word(arr: np.ndarray, off: int, value: int) -> None:
    """A progress word as the engine publishes it: the value, then its complement."""
    _u64(arr, off, value)
    _u64(arr, off + 8, ~value & (2**64 - 1))


def _config(layout: str) -> BufferConfig:
    # T=8 tokens, K=4 of E=8 experts (L=4 per rank), 2 ranks: cap_rows = 2 * 8 * 4 = 64
    return BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=4, num_experts=8,
                        dtype="bf16", layout=layout, engine="asp", sync="sw", num_cores=1,
                        threads=False, timeout_s=5.0)


def _forge_dispatch(buf: Buffer, epoch: int, index: int, counts: list[int], rows: int,
                    route: np.ndarray, ranks: list[int] | None = None,
                    ranks_sum: int | None = None) -> None:
    """Play a corrupted rank 1 for dispatch ``epoch``: announce ``counts``/``rows`` to rank 0
    (and ``ranks``, its rows to each rank, by default ``[rows, 0]``, with ``ranks_sum`` or
    their checksum) and publish ``route`` (int32 [ntok, K]) as rank 1's routing. The forger
    knows the record format, checksums included: what is tested is the bounds checks behind
    them."""
    lay, cfg = buf.layout, buf.config
    par, reg = epoch & 1, index % lay.num_regions
    seg0, seg1 = buf._memory.segments[0].array, buf._memory.segments[1].array
    ib = lay.off_inbox + (1 * 2 + par) * lay.inbox_bytes  # inbox of rank 0 from rank 1
    cnt = np.array(counts, "<u4")
    seg0[ib + INBOX_COUNTS: ib + INBOX_COUNTS + 4 * len(counts)] = cnt.view(np.uint8)
    _u64(seg0, ib + IN_ROWS, rows)
    _u64(seg0, ib + IN_SUM, _native.counts_sum(epoch, rows, cnt))
    per_rank = np.array([rows, 0] if ranks is None else ranks, "<u4")
    at = ib + INBOX_COUNTS + 4 * len(counts)  # the rows per rank follow the counts
    seg0[at: at + 4 * per_rank.size] = per_rank.view(np.uint8)
    _u64(seg0, ib + IN_RANKS_SUM,
         _native.ranks_sum(epoch, per_rank) if ranks_sum is None else ranks_sum)
    _u64(seg0, ib + IN_COUNTS_EPOCH, epoch)
    own = lay.off_inbox + (1 * 2 + par) * lay.inbox_bytes  # rank 1's inbox from itself
    own_cnt = np.ascontiguousarray(seg1[own + INBOX_COUNTS: own + INBOX_COUNTS + 4 * len(counts)])
    _u64(seg1, own + IN_ROWS, 0)
    _u64(seg1, own + IN_SUM, _native.counts_sum(epoch, 0, own_cnt))
    _u64(seg1, own + IN_COUNTS_EPOCH, epoch)
    rt = lay.off_route + reg * lay.route_stride
    flat = np.ascontiguousarray(route, "<i4").reshape(-1)
    seg1[rt + ROUTE_IDX: rt + ROUTE_IDX + 4 * flat.size] = flat.view(np.uint8)
    weights = np.ascontiguousarray(seg1[rt + lay.route_w_off: rt + lay.route_w_off + 4 * flat.size])
    _u64(seg1, rt + ROUTE_NTOK, route.shape[0])
    _u64(seg1, rt + ROUTE_SUM, _native.route_sum(epoch, route.shape[0], flat, weights))
    _u64(seg1, rt + ROUTE_EPOCH, epoch)
    _word(seg1, lay.off_recv_ready + 16 * (epoch & 1), epoch)  # readiness by parity
    assert cfg.num_topk == route.shape[1]


CANARY = 0x5A


def _guarded(shape: tuple[int, ...], dtype: Any, spare: int) -> tuple[np.ndarray, np.ndarray]:
    """An array of ``shape`` followed by ``spare`` canary elements in the same allocation."""
    n = int(np.prod(shape))
    whole = np.empty(n + spare, dtype)
    whole.view(np.uint8)[:] = CANARY
    return whole[:n].reshape(shape), whole


def _worker_forged_routing(group: Any, layout: str) -> dict[str, Any]:
    cfg = _config(layout)
    out: dict[str, Any] = {}
    with Buffer(group, cfg) as buf:
        group.barrier(30)
        T, K, L, R = 8, 4, 4, 2
        if group.rank == 1:
            if layout == "expert":
                # counts 8 per local expert of rank 0 (64 rows = capacity, so all valid), but a
                # routing that names its last expert 32 times: without a check the receiver
                # would write rows 56..87 of a 64-row buffer
                route = np.full((T, K), 3, np.int32)
                _forge_dispatch(buf, 1, 0, [8, 8, 8, 8], 32, route)
            else:
                # 3 rows announced, a routing that sends every token: rows 8+3 .. 8+8 overflow
                # the 3 announced (never the buffer: the rank layout checks its row count)
                route = np.tile(np.arange(K, dtype=np.int32), (T, 1))
                _forge_dispatch(buf, 1, 0, [8, 8, 8, 8], 3, route)
        group.barrier(30)
        if group.rank == 0:
            cap = buf.layout.cap_rows
            spare = 64 * K
            x = np.ones((T, cfg.hidden), np.uint16)
            idx = np.tile(np.arange(L, dtype=np.int64), (T, 1))  # all to rank 0's experts
            w = np.ones((T, K), np.float32)
            o_idx, idx_all = _guarded((cap,) if layout == "expert" else (cap, K), np.int64,
                                      spare)
            o_w, w_all = _guarded((cap,) if layout == "expert" else (cap, K), np.float32, spare)
            meta = [_guarded((cap,), np.int64, spare) for _ in range(3)]
            counts, counts_all = _guarded((L + R + R * R,), np.int64, spare)
            o_dst = np.empty((T, K if layout == "expert" else R), np.int64)
            got = buf._engine.kernel.run_dispatch(DispatchCall(
                x, idx, w, T, 1, 0, o_idx, o_w, meta[0][0], meta[1][0], meta[2][0], counts,
                o_dst))
            out["error"] = got if isinstance(got, ErrorRecord) else None
            tails = [a.view(np.uint8)[-spare * a.itemsize:] for a in
                     (idx_all, w_all, counts_all, *(m[1] for m in meta))]
            out["canaries_intact"] = all(bool((t == CANARY).all()) for t in tails)
        group.barrier(30)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forged_routing_raises_instead_of_writing_out_of_bounds(layout: str) -> None:
    results = launch(_worker_forged_routing, 2, layout, timeout_s=120)
    victim = results[0]
    assert victim["canaries_intact"], "the receiver wrote past its output arrays"
    rec = victim["error"]
    assert rec.code == 5 and rec.peer == 1 and "rank 1's routing disagrees" in rec.what, rec


def _rank0_dispatch(group: Any, buf: Buffer, hidden: int) -> str:
    """After rank 1 forged its records: rank 0's dispatch of 8 tokens to 4 experts, "accepted"
    or the error it raised (every rank waits for it at the barriers)."""
    group.barrier(30)
    result = ""
    if group.rank == 0:
        x = np.ones((8, hidden), np.uint16)
        idx = np.tile(np.arange(4, dtype=np.int64), (8, 1))
        try:
            buf.dispatch(x, idx, np.ones((8, 4), np.float32))
            result = "accepted"
        except UbepError as exc:
            result = str(exc)
    group.barrier(30)
    return result


def _worker_forged_counts(group: Any) -> str:
    cfg = _config("expert")
    with Buffer(group, cfg) as buf:
        group.barrier(30)
        if group.rank == 1:  # a count above max_tokens_per_rank (8) for one expert
            _forge_dispatch(buf, 1, 0, [8, 8, 8, 1 << 30], 8, np.zeros((8, 4), np.int32))
        return _rank0_dispatch(group, buf, cfg.hidden)


def test_forged_count_above_capacity_is_rejected() -> None:
    result = launch(_worker_forged_counts, 2, timeout_s=120)[0]
    assert "internal error" in result and "rank 1" in result, result


def _worker_forged_rows_per_rank(group: Any, what: str) -> str:
    cfg = _config("rank")
    with Buffer(group, cfg) as buf:
        group.barrier(30)
        if group.rank == 1:  # 8 rows to rank 0, told right in its counts, wrong in its ranks
            ranks, ranks_sum = {"checksum": ([8, 0], 12345), "disagree": ([5, 0], None)}[what]
            _forge_dispatch(buf, 1, 0, [8, 8, 8, 8], 8,
                            np.tile(np.arange(4, dtype=np.int32), (8, 1)), ranks, ranks_sum)
        return _rank0_dispatch(group, buf, cfg.hidden)


@pytest.mark.parametrize("what", ["checksum", "disagree"])
def test_forged_rows_per_rank_are_rejected(what: str) -> None:
    """The rows per rank a source's count record carries (every rank learns the [source,
    destination] matrix from them) are checked against their checksum and, for the receiver,
    against the rows the verified counts announced: a bad one is an error, never a result."""
    result = launch(_worker_forged_rows_per_rank, 2, what, timeout_s=120)[0]
    assert "corrupt rows-per-rank record of rank 1" in result, result


def _worker_forged_combine_descriptor(group: Any, what: str) -> str:
    cfg = _config("expert")
    with Buffer(group, cfg) as buf:
        x = np.ones((8, cfg.hidden), np.uint16)
        idx = np.tile(np.array([0, 1, 4, 5], np.int64), (8, 1))  # two experts on each rank
        res = buf.dispatch(x, idx, np.ones((8, 4), np.float32))
        group.barrier(30)
        result = ""
        if group.rank == 1:  # publish a descriptor for combine (epoch 2) instead of calling it
            seg1 = buf._memory.segments[1].array
            ci = buf.layout.off_comb_info + (2 & 1) * CI_BYTES
            lay = buf.layout
            off, rows = {
                "offset": (lay.size_bytes - 64, 16),       # runs past the segment end
                "rows": (lay.off_comb, lay.cap_rows + 1),   # more rows than any dispatch gives
                "header": (0, 16),                          # would read the header as data
            }[what]
            _u64(seg1, ci + CI_OFF, off)
            _u64(seg1, ci + CI_ROWS, rows)
            _u64(seg1, ci + CI_STRIDE, lay.combine_row_bytes)
            _u64(seg1, ci + CI_INDEX, 0)  # the handle's dispatch
            _u64(seg1, ci + CI_SUM,
                 _native.comb_info_sum(2, off, rows, lay.combine_row_bytes, 0))
            _u64(seg1, ci + CI_EPOCH, 2)
        else:
            try:
                buf.combine(res.recv_x, res.handle)
                result = "accepted"
            except UbepError as exc:
                result = str(exc)
        group.barrier(30)
        return result


@pytest.mark.parametrize("what", ["offset", "rows", "header"])
def test_forged_expert_output_descriptor_is_rejected(what: str) -> None:
    result = launch(_worker_forged_combine_descriptor, 2, what, timeout_s=120)[0]
    assert "outside its segment" in result, result
