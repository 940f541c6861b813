"""Byte layout of one rank's region of the Triton engine (identical on every rank, so a peer
finds any record at ``table[rank] + offset``).

Every area starts 64-byte aligned; the first ``HEADER_BYTES`` belong to the segment header of
``ubep.runtime.shm`` on CPU (kept free on a GPU too, so offsets are the same). Words are 8 bytes.

=============  =======================================================  =====================
area           contents                                                 written by
=============  =======================================================  =====================
counts[2]      ``[R][NB]`` words ``epoch32 << 32 | rows``, per dispatch   each source (release)
               parity
dflag          ``[R][4]`` words ``[count, checksum, epoch, 0]``         each source (SW, DC)
cflag          ``[R]`` words, epoch                                     each pusher (SW)
ready          ``[R]`` words, epoch: "source s takes combine rows"      each source (release)
notice         ``[epoch, code, length, message 488 bytes]``             the owner
sig[2]         ``[epoch, signature]`` per dispatch parity: what the       the owner (before
               call is (``ubep.buffer.signature``), read by every peer    its counts)
route[2]       ``[num_tokens, epoch, ...]`` 64 bytes, idx ``i32[T*K]``,   the owner (local)
               weights ``f32[T*K]``; one per dispatch parity
recv           ``cap_rows`` rows of ``row_stride`` bytes: ``recv_x``     each source
words          ``[cap_rows][nblk]`` TFF words                           each source (release)
comb           ``[T][J]`` rows of ``comb_stride`` bytes                 each pusher
cwords         ``[T][J][cnblk]`` TFF words of combine                   each pusher (release)
cdc            ``[T][J][2]`` words ``[checksum, epoch]``                each pusher (release)
ranks[2]       ``[R][R]`` words ``epoch32 << 32 | rows``: ``[s][d]``      each source (release)
               rows source ``s`` sends rank ``d``, per dispatch parity
=============  =======================================================  =====================

Counts come in two blocks, by the dispatch's parity (as routing records): a rank that has
finished a dispatch releases its next dispatch's counts at once, while a peer may still be
reading the last one's; the dispatch after that waits (in its prefix) for that peer's counts,
which the peer releases only once it is done.

``NB`` (buckets per destination) is ``num_local_experts`` for the expert layout and 1 for the
rank layout; ``J`` (combine slots per token) is ``num_topk`` or ``num_ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import dtype_of
from ..plane.layout import align_up
from ..plane.records import HEADER_BYTES, LINE_BYTES
from .config import TritonConfig

__all__ = ["NOTICE_MESSAGE_BYTES", "TFF_PAYLOAD_BYTES", "ArenaLayout", "arena_bytes",
           "arena_layout", "layout_of"]

_ALIGN = LINE_BYTES  # every area starts a cache line of its own
TFF_PAYLOAD_BYTES = 480  # docs/FORMATS.md: 512-byte blocks, 32 of them flag
NOTICE_MESSAGE_BYTES = 488


@dataclass(frozen=True)
class ArenaLayout:
    """Offsets (bytes from the region's start) and sizes of every area (module docstring)."""

    num_ranks: int
    num_buckets: int
    cap_tokens: int
    num_topk: int
    cap_rows: int
    row_bytes: int
    row_stride: int
    nblk: int
    comb_slots: int
    comb_row_bytes: int
    comb_stride: int
    cnblk: int
    counts: int
    ranks: int
    dflag: int
    cflag: int
    ready: int
    notice: int
    sig: int  # [epoch, signature] of parity p at sig + p * 16
    route: tuple[int, int]
    route_idx: int  # offset of idx inside a route record
    route_w: int
    recv: int
    words: int
    comb: int
    cwords: int
    cdc: int
    size_bytes: int


def arena_layout(*, num_ranks: int, num_local_experts: int, cap_tokens: int, num_topk: int,
                 row_bytes: int, comb_row_bytes: int, rank_layout: bool) -> ArenaLayout:
    """The layout for these shapes (``row_bytes``: a dispatched row; ``comb_row_bytes``: an
    expert-output row)."""
    R, T, K = num_ranks, cap_tokens, num_topk
    nb = 1 if rank_layout else num_local_experts
    per_src = T if rank_layout else T * min(K, num_local_experts)
    cap_rows = max(1, R * per_src)
    J = R if rank_layout else K
    row_stride = align_up(max(row_bytes, 1))
    comb_stride = align_up(max(comb_row_bytes, 1))
    nblk = -(-row_bytes // TFF_PAYLOAD_BYTES)
    cnblk = -(-comb_row_bytes // TFF_PAYLOAD_BYTES)
    off = HEADER_BYTES

    def take(n: int) -> int:
        nonlocal off
        start = off
        off = align_up(off + n)
        return start

    counts = take(2 * R * nb * 8)  # the block of parity p at counts + p * R * nb * 8
    dflag = take(R * 32)
    cflag = take(R * 8)
    ready = take(R * 8)
    notice = take(24 + NOTICE_MESSAGE_BYTES)
    sig = take(2 * 16)
    route_idx = _ALIGN
    route_w = align_up(route_idx + T * K * 4)
    route_bytes = align_up(route_w + T * K * 4)
    route = (take(route_bytes), take(route_bytes))
    recv = take(cap_rows * row_stride)
    words = take(cap_rows * nblk * 8)
    comb = take(T * J * comb_stride)
    cwords = take(T * J * cnblk * 8)
    cdc = take(T * J * 16)
    ranks = take(2 * R * R * 8)  # the block of parity p at ranks + p * R * R * 8
    return ArenaLayout(
        num_ranks=R, num_buckets=nb, cap_tokens=T, num_topk=K, cap_rows=cap_rows,
        row_bytes=row_bytes, row_stride=row_stride, nblk=nblk, comb_slots=J,
        comb_row_bytes=comb_row_bytes, comb_stride=comb_stride, cnblk=cnblk, counts=counts,
        ranks=ranks,
        dflag=dflag, cflag=cflag, ready=ready, notice=notice, sig=sig, route=route,
        route_idx=route_idx, route_w=route_w, recv=recv, words=words, comb=comb, cwords=cwords,
        cdc=cdc, size_bytes=off,
    )


def layout_of(config: TritonConfig, num_ranks: int) -> ArenaLayout:
    """The layout of an engine of ``config`` on ``num_ranks`` ranks."""
    return arena_layout(
        num_ranks=num_ranks, num_local_experts=config.num_experts // num_ranks,
        cap_tokens=config.max_tokens_per_rank, num_topk=config.num_topk,
        row_bytes=config.hidden * dtype_of(config.dtype).itemsize,
        comb_row_bytes=config.hidden * dtype_of(config.out_dtype).itemsize,
        rank_layout=config.layout == "rank")


def arena_bytes(config: TritonConfig, num_ranks: int) -> int:
    """Bytes of one rank's region (what a caller that maps the memory must give each rank)."""
    return layout_of(config, num_ranks).size_bytes
