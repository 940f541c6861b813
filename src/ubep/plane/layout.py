"""Byte layout of one rank's Buffer segment (the single source of truth; the C engine gets these
offsets as parameters). What lies at which byte inside a control record is fixed by
:mod:`ubep.plane.records` (and ``native/abi.h``); this module only places the records.

All offsets are from the start of the segment; every control word sits on its own 64-byte line.

=================  =====================================================================
region             contents
=================  =====================================================================
header [256 B]     magic, version, owner rank, size, pid, group id (the memory's owner)
fail   [2x512 B]   failure notices by epoch parity: ``[epoch][len | code << 32][message][sum]``
entered / done     u64 epoch of the last call this rank entered / finished (credits)
recv_ready [2]     by epoch parity (words at +0, +16): the epoch whose receive region this
                   rank has made ready for writers
doorbell           u32 eventcount peers ring after a publication, u32 sleepers at +32
comb_info [2x64]   by epoch parity: ``[offset][rows][stride][epoch][index][sum]`` (outputs)
barrier [C x 64]   BSP global barrier arrivals, one word per core (target = epoch*4+phase)
inbox [R x 2]      per (source, epoch parity): ``[counts epoch][rows][sum]``, SW ``[count][epoch]``,
                   DC ``[count][checksum][epoch]``, per-local-expert counts (u32), then the
                   source's rows to every rank (u32 [R], their checksum at +152)
route [nreg]       per dispatch (index mod nreg): the sender's routing, read by receivers
                   for their metadata: ``[num_tokens][epoch][sum]``, topk_idx i32, weights f32
land [nland]       what senders write for a receiver to poll, one slot per row: ASP with
                   SW/DC/SP the rows themselves at their final positions (land = out); ASP
                   with TFF the rows' epoch words (u64 per block of the row, the rows go to
                   out); BSP staging partitioned by source, each slot encoded for the sync
                   mode (FORMATS.md)
out [nreg]         ``recv_x`` (raw rows); the same memory as ``land`` for ASP with SW/DC/SP
comb [2]           expert outputs for combine (unless the caller's already live here)
rsum [nreg + 2]    ``integrity="checksum"`` only (else empty): u64 row checksums, written by
                   each row's sender: per receive region (ASP: by row of ``recv_x``; BSP: by
                   staging slot), then per combine parity (by row of the published outputs)
=================  =====================================================================

``nreg = 2``: the ``recv_x`` of dispatch ``n`` stays valid while dispatch ``n+1`` runs. ASP
lands every row in ``recv_x`` itself (one copy) and double-buffers its land regions (``nland =
nreg``), so a dispatch in flight never forces the previous one to finish first: with TFF the
sender stores each block of a row straight into ``recv_x``, then the block's epoch word with a
release store into the land region (the flags live apart from the payload, so no copy ever
writes both); epochs, never cleared, tell this call's words from stale ones. ASP with SP re-arms
a region's sentinels when the region is reused. BSP stages rows (``nland = 1``): a peer writes
the staging region for the next call only after this rank has published that it finished with
it.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from .records import CI_BYTES, FAIL_BYTES, HEADER_BYTES, IN_COUNTS, LINE_BYTES, ROUTE_IDX

__all__ = ["HostRegions", "SegmentLayout", "align_up", "compute_layout", "host_regions"]

_LINE = LINE_BYTES
_PAGE = mmap.PAGESIZE


def align_up(v: int, a: int = _LINE) -> int:
    """``v`` rounded up to a multiple of ``a`` (a cache line by default): where each record,
    row and region of an engine's memory starts."""
    return -(-v // a) * a


@dataclass(frozen=True)
class SegmentLayout:
    """Sizes and offsets of one rank's segment (bytes)."""

    num_regions: int
    num_land_regions: int
    cap_rows: int
    cap_src_rows: int
    row_bytes: int
    slot_bytes: int
    out_stride: int
    combine_row_bytes: int
    off_fail: int
    off_entered: int
    off_done: int
    off_recv_ready: int
    off_doorbell: int
    off_comb_info: int
    off_barrier: int
    off_inbox: int
    inbox_bytes: int
    off_route: int
    route_stride: int
    route_w_off: int
    off_land: int
    land_bytes: int
    off_out: int
    out_bytes: int
    off_comb: int
    comb_bytes: int
    off_rsum: int
    rsum_bytes: int
    size_bytes: int

    def as_params(self) -> dict[str, int]:
        """The offsets the native engine takes."""
        return {name: int(getattr(self, name)) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class HostRegions:
    """The regions of a segment this process addresses (an engine on host memory hands them to
    the Buffer): per receive region the full-capacity read-only ``recv_x`` rows (and, quantised,
    their float32 scales), sliced per call; the two combine staging regions."""

    recv_views: list[np.ndarray]
    scale_views: list[np.ndarray]
    comb_regions: list[np.ndarray]


def _rows_view(region: np.ndarray, lay: SegmentLayout, dtype: np.dtype[Any], offset: int,
               width: int) -> np.ndarray:
    """Read-only ``[cap_rows, width]`` view of ``dtype`` elements starting ``offset`` bytes into
    each row of a receive region."""
    view = np.ndarray((lay.cap_rows, width), dtype=dtype, buffer=region, offset=offset,
                      strides=(lay.out_stride, dtype.itemsize))
    view.flags.writeable = False
    return view


def host_regions(seg: np.ndarray, lay: SegmentLayout, values: np.dtype[Any], hidden: int,
                 scale_cols: int) -> HostRegions:
    """The views of this rank's segment ``seg`` (building a view costs ~2 us: once per Buffer);
    quantised rows: the values, and the float32 scales after them in each row."""
    out = [seg[lay.off_out + i * lay.out_bytes: lay.off_out + (i + 1) * lay.out_bytes]
           for i in range(lay.num_regions)]
    f32 = np.dtype(np.float32)
    return HostRegions(
        [_rows_view(r, lay, values, 0, hidden) for r in out],
        [_rows_view(r, lay, f32, hidden, scale_cols) for r in out] if scale_cols else [],
        [seg[lay.off_comb + i * lay.comb_bytes: lay.off_comb + (i + 1) * lay.comb_bytes]
         for i in range(2)],
    )


def compute_layout(
    *,
    num_ranks: int,
    num_cores: int,
    num_experts: int,
    num_topk: int,
    max_tokens: int,
    hidden: int,
    itemsize: int,
    combine_itemsize: int,
    layout: str,
    engine: str,
    sync: str,
    tff_block_bytes: int,
    tff_flag_bytes: int,
    row_bytes: int | None = None,
    integrity: bool = False,
) -> SegmentLayout:
    """Lay out one rank's segment for a Buffer of this shape (``row_bytes``: a row on the
    wire, when it is not ``hidden * itemsize``: quantised rows; ``integrity``: room for the
    row checksums)."""
    R, C, T, K = num_ranks, num_cores, max_tokens, num_topk
    L = num_experts // num_ranks
    row_bytes = hidden * itemsize if row_bytes is None else row_bytes
    cap_src_rows = T if layout == "rank" else T * min(K, L)
    # expert_padded: one block of R * T slots per local expert (DeepEP's low-latency places)
    cap_rows = L * R * T if layout == "expert_padded" else R * cap_src_rows
    nreg = 2
    land_is_out = engine == "asp" and sync in ("sw", "dc", "sp")
    tff_blocks = -(-row_bytes // (tff_block_bytes - tff_flag_bytes))
    if sync == "tff" and engine == "asp":
        slot_bytes = tff_blocks * 8  # in place: a row's epoch words, one per block
    elif sync == "tff":
        slot_bytes = tff_blocks * tff_block_bytes  # staged: blocks of payload + flag
    else:
        slot_bytes = align_up(row_bytes)
    nland = nreg if engine == "asp" else 1
    out_stride = slot_bytes if land_is_out else align_up(row_bytes)
    combine_row_bytes = hidden * combine_itemsize

    off = HEADER_BYTES
    off_fail = off
    off += 2 * FAIL_BYTES
    off_entered, off_done, off_recv_ready = off, off + _LINE, off + 2 * _LINE
    off_doorbell = off + 3 * _LINE
    off += 4 * _LINE
    off_comb_info = off
    off += 2 * CI_BYTES
    off_barrier = off
    off += C * _LINE
    off_inbox = off
    inbox_bytes = align_up(IN_COUNTS + 4 * L + 4 * R)  # counts, then the rows per rank
    off += R * 2 * inbox_bytes
    off_route = align_up(off)
    route_w_off = ROUTE_IDX + align_up(T * K * 4)
    route_stride = align_up(route_w_off + T * K * 4)
    off = off_route + nreg * route_stride
    off_land = align_up(off, _PAGE)
    land_bytes = align_up(max(cap_rows, 1) * slot_bytes, _PAGE)
    off = off_land + nland * land_bytes
    if land_is_out:
        off_out, out_bytes = off_land, land_bytes
    else:
        off_out = off
        out_bytes = align_up(max(cap_rows, 1) * out_stride, _PAGE)
        off += nreg * out_bytes
    off_comb = off
    comb_bytes = align_up(max(cap_rows, 1) * combine_row_bytes, _PAGE)
    off += 2 * comb_bytes
    off_rsum = off
    rsum_bytes = align_up(max(cap_rows, 1) * 8) if integrity else 0
    off += (nreg + 2) * rsum_bytes
    return SegmentLayout(
        num_regions=nreg,
        num_land_regions=nland,
        cap_rows=cap_rows,
        cap_src_rows=cap_src_rows,
        row_bytes=row_bytes,
        slot_bytes=slot_bytes,
        out_stride=out_stride,
        combine_row_bytes=combine_row_bytes,
        off_fail=off_fail,
        off_entered=off_entered,
        off_done=off_done,
        off_recv_ready=off_recv_ready,
        off_doorbell=off_doorbell,
        off_comb_info=off_comb_info,
        off_barrier=off_barrier,
        off_inbox=off_inbox,
        inbox_bytes=inbox_bytes,
        off_route=off_route,
        route_stride=route_stride,
        route_w_off=route_w_off,
        off_land=off_land,
        land_bytes=land_bytes,
        off_out=off_out,
        out_bytes=out_bytes,
        off_comb=off_comb,
        comb_bytes=comb_bytes,
        off_rsum=off_rsum,
        rsum_bytes=rsum_bytes,
        size_bytes=align_up(off, _PAGE),
    )
