# mypy: allow-untyped-defs, allow-incomplete-defs
# (Triton reads a kernel's annotations itself: its parameters stay unannotated but constexprs)
"""UBEP's combine as Triton kernels: every receiver pushes each expert output back to the slot
``(token, j)`` of its source (``j`` = the top-k slot, or the receiver's rank in the rank
layout), and every source reduces its tokens in FP32 in a fixed order. Launches, in order:

1. (SP: the source arms the slots it expects, a local fill before the launch.)
   ``ready_kernel`` (a program per peer): "this rank takes combine rows of call ``epoch``",
   released into every peer's ``ready`` word. A pusher writes into a source's slots only after
   that word: the source has finished reading them in its previous combine.
2. ``wait_ready_kernel`` (a program per source): waits for the source's ``ready`` word.
3. ``push_kernel`` (programs over the received rows): each row to its slot, then the sync
   table's per-row record (TFF words, DC ``[checksum][epoch]``).
4. ``comb_publish_kernel`` (a program per source; SW only): the batch flag.
5. ``reduce_kernel`` (programs over tokens): waits for each expected slot, then
   ``acc = fl32(acc + fl32(w * out))`` (expert layout) or ``fl32(acc + out)`` (rank layout),
   ``j`` ascending, from ``+0.0``; masked slots skipped; the result rounded to the output type
   to nearest-even, a NaN as the type's canonical quiet NaN (ubep.reference). The product is
   rounded before the add: the engine compiles with ``enable_fp_fusion=False`` (no FMA).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit_common import (
    BATCH_FLAG,
    DONE,
    REMOTE,
    ROW_CHECKSUM,
    ROW_SENTINEL,
    ROW_WORDS,
    acquire,
    dc_checksum,
    failed_rank,
    has_sentinel,
    opened,
    region,
    release,
    set_status,
    word_sums,
)

OUT_FP32: tl.constexpr = tl.constexpr(0)
OUT_BF16: tl.constexpr = tl.constexpr(1)
OUT_FP16: tl.constexpr = tl.constexpr(2)


@triton.jit
def ready_kernel(table, order, gate, gate_n, me, epoch, OFF_READY, GP: tl.constexpr):
    p = tl.load(order + tl.program_id(0))
    if opened(gate, gate_n, GP) != 0:
        release(region(table, p, OFF_READY + me * 8, tl.int64), epoch, None)


@triton.jit
def wait_ready_kernel(table, order, gate, gate_n, status, ready_ptr, epoch, R, OFF_NOTICE, spins,
                      RP: tl.constexpr, GP: tl.constexpr):
    s = tl.load(order + tl.program_id(0))
    if (tl.load(status + s * 2) != DONE) & (opened(gate, gate_n, GP) != 0):
        got = acquire(ready_ptr + s, None) == epoch
        fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
        n = 0
        while (got == 0) & (fail == R) & (n < spins):
            got = acquire(ready_ptr + s, None) == epoch
            fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
            n += 1
        tl.debug_barrier()
        if got:
            set_status(status, s, DONE, s)
        elif fail < R:
            set_status(status, s, REMOTE, fail)


@triton.jit
def push_kernel(table, order, gate, gate_n, eo_ptr, eo64_ptr, src_rank, src_token, src_j, rows,
                per_prog, hidden, J, OFF_COMB, COMB_STRIDE, OFF_CWORDS, CNBLK, OFF_CDC, W, epoch,
                epoch_mix, ROW: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
                CNBLKP: tl.constexpr, GP: tl.constexpr):
    p = tl.load(order + tl.program_id(0))
    if opened(gate, gate_n, GP) != 0:
        h = tl.arange(0, BH)
        blk = tl.arange(0, CNBLKP)
        for i in range(p * per_prog, tl.minimum(rows, (p + 1) * per_prog)):
            s = tl.load(src_rank + i)
            slot = tl.load(src_token + i) * J + tl.load(src_j + i)
            ii = tl.cast(i, tl.int64)
            out = region(table, s, OFF_COMB + slot * COMB_STRIDE, eo_ptr.dtype.element_ty)
            for h0 in range(0, hidden, BH):
                m = h0 + h < hidden
                tl.store(out + h0 + h, tl.load(eo_ptr + ii * hidden + h0 + h, mask=m), mask=m)
            if ROW == ROW_WORDS:
                words = region(table, s, OFF_CWORDS + slot * CNBLK * 8, tl.int64)
                release(words + blk, epoch, blk < CNBLK)
            if ROW == ROW_CHECKSUM:
                a1, a2 = word_sums(eo64_ptr + ii * W, W, 0, BW)
                rec = region(table, s, OFF_CDC + slot * 16, tl.int64)
                tl.store(rec, dc_checksum(a1, a2, epoch_mix))
                release(rec + 1, epoch, None)


@triton.jit
def comb_publish_kernel(table, order, gate, gate_n, me, epoch, OFF_CFLAG, GP: tl.constexpr):
    s = tl.load(order + tl.program_id(0))
    if opened(gate, gate_n, GP) != 0:
        release(region(table, s, OFF_CFLAG + me * 8, tl.int64), epoch, None)


@triton.jit
def _slot_in(comb_ptr, cwords_ptr, cdc_ptr, slot, hidden, COMB_STRIDE_E, CNBLK, W, epoch,
             epoch_mix, sentinel, ROW: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
             CNBLKP: tl.constexpr):
    """One poll of slot ``slot``: 1 when its row is in (the sync table's row)."""
    ok = tl.full((), 1, tl.int32)
    row = comb_ptr + slot * COMB_STRIDE_E
    if ROW == ROW_WORDS:
        blk = tl.arange(0, CNBLKP)
        w = acquire(cwords_ptr + slot * CNBLK + blk, blk < CNBLK)
        ok = tl.min(((w == epoch) | (blk >= CNBLK)).to(tl.int32))
    if ROW == ROW_SENTINEL:
        ok = 1 - has_sentinel(row, hidden, sentinel, BH).to(tl.int32)
    if ROW == ROW_CHECKSUM:
        ok = (acquire(cdc_ptr + slot * 2 + 1, None) == epoch).to(tl.int32)
        tl.debug_barrier()
        if ok != 0:
            a1, a2 = word_sums(row.to(tl.pointer_type(tl.int64)), W, 0, BW)
            ok = (dc_checksum(a1, a2, epoch_mix) == tl.load(cdc_ptr + slot * 2,
                                                            volatile=True)).to(tl.int32)
    return ok


@triton.jit
def _as_f32(v, OUT: tl.constexpr):
    if OUT == OUT_BF16:
        f = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif OUT == OUT_FP16:
        f = v.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        f = v.to(tl.float32, bitcast=True)
    return f


@triton.jit
def _from_f32(acc, OUT: tl.constexpr):
    """``acc`` rounded to the output type to nearest-even, as that type's bits; NaN as the
    canonical quiet NaN (ubep.dtypes.CANONICAL_NAN)."""
    nan = acc != acc
    if OUT == OUT_BF16:
        u = acc.to(tl.uint32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
        bits = tl.where(nan, 0x7FC0, r).to(tl.int16)
    elif OUT == OUT_FP16:
        h = acc.to(tl.float16).to(tl.int16, bitcast=True)
        bits = tl.where(nan, 0x7E00, h.to(tl.int32)).to(tl.int16)
    else:
        bits = tl.where(nan, 0x7FC00000, acc.to(tl.int32, bitcast=True))
    return bits


@triton.jit
def reduce_kernel(table, order, gate, gate_n, status, y_ptr, comb_ptr, cwords_ptr, cdc_ptr,
                  cflag_ptr, idx_ptr, w_ptr, T, K, L, J, R, per_prog, hidden, COMB_STRIDE_E,
                  CNBLK, W, epoch, epoch_mix, sentinel, OFF_NOTICE, spins,
                  RANK_LAYOUT: tl.constexpr, ROW: tl.constexpr, BATCH: tl.constexpr,
                  OUT: tl.constexpr, RP: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr,
                  BW: tl.constexpr, CNBLKP: tl.constexpr, GP: tl.constexpr):
    p = tl.load(order + tl.program_id(0))
    if (tl.load(status + p * 2) != DONE) & (opened(gate, gate_n, GP) != 0):
        t0 = p * per_prog
        t1 = tl.minimum(T, t0 + per_prog)
        kk = tl.arange(0, KP)
        # Pass 1: every expected slot of the program's tokens is in.
        got = tl.full((), 1, tl.int32)
        fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
        n = 0
        if BATCH == BATCH_FLAG:
            r = tl.arange(0, RP)
            f = acquire(cflag_ptr + r, r < R)
            got = tl.min(((f == epoch) | (r >= R)).to(tl.int32))
            while (got == 0) & (fail == R) & (n < spins):
                f = acquire(cflag_ptr + r, r < R)
                got = tl.min(((f == epoch) | (r >= R)).to(tl.int32))
                fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
                n += 1
            tl.debug_barrier()
        if ROW != 0:
            for t in range(t0, t1):
                idx = tl.load(idx_ptr + t * K + kk, mask=kk < K, other=-1)
                for j in range(J):
                    if RANK_LAYOUT:
                        valid = tl.max(((idx >= 0) & (idx // L == j)).to(tl.int32), axis=0) > 0
                    else:
                        valid = tl.max(tl.where(kk == j, idx, -1), axis=0) >= 0
                    if valid & (got != 0):
                        slot = tl.cast(t, tl.int64) * J + j
                        ok = _slot_in(comb_ptr, cwords_ptr, cdc_ptr, slot, hidden,
                                      COMB_STRIDE_E, CNBLK, W, epoch, epoch_mix, sentinel, ROW,
                                      BH, BW, CNBLKP)
                        while (ok == 0) & (fail == R) & (n < spins):
                            ok = _slot_in(comb_ptr, cwords_ptr, cdc_ptr, slot, hidden,
                                          COMB_STRIDE_E, CNBLK, W, epoch, epoch_mix, sentinel,
                                          ROW, BH, BW, CNBLKP)
                            fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
                            n += 1
                        got = got & ok
            tl.debug_barrier()
        # Pass 2: the reduction, slots in ascending j.
        if got != 0:
            h = tl.arange(0, BH)
            for t in range(t0, t1):
                idx = tl.load(idx_ptr + t * K + kk, mask=kk < K, other=-1)
                for h0 in range(0, hidden, BH):
                    m = h0 + h < hidden
                    acc = tl.zeros((BH,), dtype=tl.float32)
                    for j in range(J):
                        if RANK_LAYOUT:
                            valid = tl.max(((idx >= 0) & (idx // L == j)).to(tl.int32), axis=0) > 0
                        else:
                            valid = tl.max(tl.where(kk == j, idx, -1), axis=0) >= 0
                        if valid:
                            row = comb_ptr + (tl.cast(t, tl.int64) * J + j) * COMB_STRIDE_E
                            v = _as_f32(tl.load(row + h0 + h, mask=m, other=0, volatile=True),
                                        OUT)
                            if RANK_LAYOUT:
                                acc = acc + v
                            else:
                                prod = tl.load(w_ptr + t * K + j) * v
                                acc = acc + prod
                    tl.store(y_ptr + tl.cast(t, tl.int64) * hidden + h0 + h, _from_f32(acc, OUT),
                             mask=m)
            set_status(status, p, DONE, p)
        elif fail < R:
            set_status(status, p, REMOTE, fail)
