# mypy: allow-untyped-defs, allow-incomplete-defs
# (Triton reads a kernel's annotations itself: its parameters stay unannotated but constexprs)
"""UBEP's ASP dispatch as Triton kernels: count, prefix sum, send (the Plan's units per
program), publish, receive. One launch per task; the host runs them in this order:

0. ``ranks_kernel`` (a program per destination): this rank's rows to every rank, released
   into each destination's ranks block of the dispatch's parity (``epoch32 << 32 | rows``).
1. ``count_kernel`` (a program per count core of the Plan): rows per bucket (local expert, or
   destination rank) of this rank's tokens, each released into the destination's count inbox
   of the dispatch's parity as ``epoch32 << 32 | rows``: the counts are their own flag. This
   rank's routing record and, under SP, its armed receive rows were written before the launch.
2. ``prefix_kernel`` (a program per destination): waits for every source's counts to that
   destination, then the row where this rank's rows of each bucket start there: rows before
   the bucket, plus the bucket's rows from lower sources. A destination publishes its own
   count to itself only once it left its previous call, so these counts also say its receive
   region is free.
2b. ``signature_kernel`` (one program, gated on the prefix): every source's call signature
   against this rank's; a difference closes the gate of what follows (no row moves).
3. ``send_kernel`` (a program per send core): the Plan's units of that core in its order, each
   row stored at its final place in the destination's ``recv_x``; TFF: the row's block words.
4. ``publish_kernel`` (a program per destination; SW and DC only): the batch's flag, after the
   whole previous launch.
5. ``recv_kernel`` (a program per source): the rows from that source, their metadata built from
   the source's routing record (read through the table), waited for by the sync table's row.

No program waits on a program of its own launch (the interpreter runs them one after another;
a launch that waits runs again until its deadline, programs that finished skip): waits are only
on other ranks, or on earlier launches of this rank, which have completed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit_common import (
    BATCH_CHECKSUM,
    CORRUPT,
    DIFFERS,
    DONE,
    REMOTE,
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


@triton.jit
def count_kernel(table, order, gate, gate_n, idx_ptr, T, K, L, bptr, me, epoch32, NB, OFF_COUNTS,
                 RANK_LAYOUT: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr):
    pid = tl.load(order + tl.program_id(0))
    if opened(gate, gate_n, GP) != 0:
        b0 = tl.load(bptr + pid)
        b1 = tl.load(bptr + pid + 1)
        kk = tl.arange(0, KP)
        for g in range(b0, b1):  # a global bucket: an expert, or a destination rank
            cnt = tl.zeros((), dtype=tl.int64)
            for t0 in range(0, T, BT):
                t = t0 + tl.arange(0, BT)
                m = (t[:, None] < T) & (kk[None, :] < K)
                idx = tl.load(idx_ptr + t[:, None] * K + kk[None, :], mask=m, other=-1)
                if RANK_LAYOUT:  # noqa: SIM108 (a constexpr branch, compiled away)
                    hit = (idx >= 0) & (idx // L == g)
                else:
                    hit = idx == g
                cnt += tl.sum(tl.max(hit.to(tl.int64), axis=1), axis=0)
            if RANK_LAYOUT:  # noqa: SIM108
                dst = g
            else:
                dst = g // L
            b = g - dst * NB
            word = (epoch32.to(tl.int64) << 32) | cnt
            release(region(table, dst, OFF_COUNTS + (me * NB + b) * 8, tl.int64), word, None)


@triton.jit
def ranks_kernel(table, order, gate, gate_n, rows_ptr, me, epoch32, R, OFF_RANKS,
                 RP: tl.constexpr, GP: tl.constexpr):
    """This rank's rows to every rank, released into destination ``d``'s ranks block (a
    program per destination), before the counts: a receiver that has every source's counts
    reads every source's rows per rank, the whole ``[source, destination]`` matrix."""
    d = tl.load(order + tl.program_id(0))
    if opened(gate, gate_n, GP) != 0:
        j = tl.arange(0, RP)
        m = j < R
        rows = tl.load(rows_ptr + j, mask=m, other=0)
        words = (epoch32.to(tl.int64) << 32) | rows
        release(region(table, d, OFF_RANKS + (me * R + j) * 8, tl.int64), words, m)


@triton.jit
def _counts_in(cptr, R, NB, epoch32, RP: tl.constexpr, NBP: tl.constexpr):
    s = tl.arange(0, RP)[:, None]
    b = tl.arange(0, NBP)[None, :]
    m = (s < R) & (b < NB)
    w = acquire(cptr + s * NB + b, m)
    good = ((w >> 32) == epoch32) | (~m)
    return tl.min(good.to(tl.int32)), w & 0xFFFFFFFF


@triton.jit
def prefix_kernel(table, order, gate, gate_n, status, offs, me, epoch, epoch32, R, NB, OFF_COUNTS,
                  OFF_NOTICE, spins, RP: tl.constexpr, NBP: tl.constexpr, GP: tl.constexpr):
    d = tl.load(order + tl.program_id(0))
    if (tl.load(status + d * 2) != DONE) & (opened(gate, gate_n, GP) != 0):
        cptr = region(table, d, OFF_COUNTS, tl.int64)
        got, cnt = _counts_in(cptr, R, NB, epoch32, RP, NBP)
        fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
        n = 0
        while (got == 0) & (fail == R) & (n < spins):
            got, cnt = _counts_in(cptr, R, NB, epoch32, RP, NBP)
            fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
            n += 1
        tl.debug_barrier()
        if got != 0:
            s = tl.arange(0, RP)[:, None]
            b = tl.arange(0, NBP)
            tot = tl.sum(cnt, axis=0)
            start = tl.cumsum(tot, axis=0) - tot + tl.sum(tl.where(s < me, cnt, 0), axis=0)
            tl.store(offs + d * NB + b, start, mask=b < NB)
            set_status(status, d, DONE, d)
        elif fail < R:
            set_status(status, d, REMOTE, fail)


@triton.jit
def signature_kernel(table, order, gate, gate_n, status, theirs, mine, epoch, R, OFF_SIG,
                     RP: tl.constexpr, GP: tl.constexpr):
    """Every source's signature of call ``epoch`` (``[epoch, word]`` at ``OFF_SIG`` of its own
    region, stored before its counts, which the prefix launch this one is gated on acquired)
    against this rank's word ``mine`` (one program): done, or the lowest source whose word
    differs (``theirs``: its word), which closes the gate of the call's sends."""
    if opened(gate, gate_n, GP) != 0:
        s = tl.arange(0, RP)
        m = s < R
        base = tl.load(table + s, mask=m, other=0) + OFF_SIG
        e = acquire(base.to(tl.pointer_type(tl.int64)), m)
        w = acquire((base + 8).to(tl.pointer_type(tl.int64)), m)
        first = tl.min(tl.where(m & (e == epoch) & (w != mine), s, R), axis=0)
        if first < R:
            tl.store(theirs, tl.sum(tl.where(s == first, w, 0), axis=0))
            set_status(status, 0, DIFFERS, first)
        else:
            set_status(status, 0, DONE, 0)


@triton.jit
def send_kernel(table, order, gate, gate_n, x_ptr, u_token, u_dst, u_bucket, u_slot, core_ptr,
                offs, hidden, NB, OFF_RECV, ROW_STRIDE, OFF_WORDS, NBLK, epoch, ROW: tl.constexpr,
                BH: tl.constexpr, NBLKP: tl.constexpr, GP: tl.constexpr):
    j = tl.load(order + tl.program_id(0))
    if opened(gate, gate_n, GP) != 0:
        u0 = tl.load(core_ptr + j)
        u1 = tl.load(core_ptr + j + 1)
        h = tl.arange(0, BH)
        blk = tl.arange(0, NBLKP)
        for u in range(u0, u1):
            t = tl.load(u_token + u).to(tl.int64)
            dst = tl.load(u_dst + u)
            row = (tl.load(offs + dst * NB + tl.load(u_bucket + u)) + tl.load(u_slot + u))
            row = row.to(tl.int64)
            out = region(table, dst, OFF_RECV + row * ROW_STRIDE, x_ptr.dtype.element_ty)
            for h0 in range(0, hidden, BH):
                m = h0 + h < hidden
                tl.store(out + h0 + h, tl.load(x_ptr + t * hidden + h0 + h, mask=m), mask=m)
            if ROW == ROW_WORDS:
                words = region(table, dst, OFF_WORDS + row * NBLK * 8, tl.int64)
                release(words + blk, epoch, blk < NBLK)


@triton.jit
def publish_kernel(table, order, gate, gate_n, x64_ptr, c_token, c_ptr, W, me, epoch, epoch_mix,
                   OFF_DFLAG, BATCH: tl.constexpr, BW: tl.constexpr, GP: tl.constexpr):
    d = tl.load(order + tl.program_id(0))
    if opened(gate, gate_n, GP) != 0:
        rec = region(table, d, OFF_DFLAG + me * 32, tl.int64)
        if BATCH == BATCH_CHECKSUM:
            p0 = tl.load(c_ptr + d)
            p1 = tl.load(c_ptr + d + 1)
            s1 = tl.zeros((), dtype=tl.uint64)
            s2 = tl.zeros((), dtype=tl.uint64)
            for p in range(p0, p1):
                t = tl.load(c_token + p).to(tl.int64)
                a1, a2 = word_sums(x64_ptr + t * W, W, (p - p0).to(tl.int64) * W, BW)
                s1 += a1
                s2 += a2
            tl.store(rec, (p1 - p0).to(tl.int64))
            tl.store(rec + 1, dc_checksum(s1, s2, epoch_mix))
        release(rec + 2, epoch, None)


@triton.jit
def _rows_of(counts_ptr, s, R, NB, RP: tl.constexpr, NBP: tl.constexpr):
    """Per bucket: the first row of source ``s``'s rows here and their number."""
    sr = tl.arange(0, RP)[:, None]
    b = tl.arange(0, NBP)[None, :]
    m = (sr < R) & (b < NB)
    cnt = tl.load(counts_ptr + sr * NB + b, mask=m, other=0, volatile=True) & 0xFFFFFFFF
    tot = tl.sum(cnt, axis=0)
    first = tl.cumsum(tot, axis=0) - tot + tl.sum(tl.where(sr < s, cnt, 0), axis=0)
    return first, tl.sum(tl.where(sr == s, cnt, 0), axis=0)


@triton.jit
def _pick(vec, i, NBP: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, NBP) == i, vec, 0), axis=0)


@triton.jit
def _source_in(recv_ptr, words_ptr, dflag_ptr, s, first, nrows, NB, epoch, epoch_mix, hidden,
               ROW_STRIDE_E, NBLK, W, sentinel, ROW: tl.constexpr, BATCH: tl.constexpr,
               NBP: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, NBLKP: tl.constexpr):
    """One poll: 1 when every row from source ``s`` is in (the sync table's row)."""
    ok = tl.full((), 1, tl.int32)
    if BATCH != 0:
        ok = (acquire(dflag_ptr + s * 4 + 2, None) == epoch).to(tl.int32)
        tl.debug_barrier()
    if BATCH == BATCH_CHECKSUM:  # noqa: SIM102 (constexpr, then runtime)
        if ok != 0:
            s1 = tl.zeros((), dtype=tl.uint64)
            s2 = tl.zeros((), dtype=tl.uint64)
            idx = tl.zeros((), dtype=tl.int64)
            for bb in range(NB):
                r0 = _pick(first, bb, NBP)
                for r in range(r0, r0 + _pick(nrows, bb, NBP)):
                    rp = recv_ptr + tl.cast(r, tl.int64) * ROW_STRIDE_E
                    rp = rp.to(tl.pointer_type(tl.int64))
                    a1, a2 = word_sums(rp, W, idx * W, BW)
                    s1 += a1
                    s2 += a2
                    idx += 1
            want = tl.load(dflag_ptr + s * 4 + 1, volatile=True)
            count = tl.load(dflag_ptr + s * 4, volatile=True)
            ok = ((dc_checksum(s1, s2, epoch_mix) == want) & (count == idx)).to(tl.int32)
    if ROW != 0:
        blk = tl.arange(0, NBLKP)
        for bb in range(NB):
            r0 = _pick(first, bb, NBP)
            for r in range(r0, r0 + _pick(nrows, bb, NBP)):
                if ROW == ROW_WORDS:
                    w = acquire(words_ptr + tl.cast(r, tl.int64) * NBLK + blk, blk < NBLK)
                    ok = ok & tl.min(((w == epoch) | (blk >= NBLK)).to(tl.int32))
                else:
                    rp = recv_ptr + tl.cast(r, tl.int64) * ROW_STRIDE_E
                    ok = ok & (1 - has_sentinel(rp, hidden, sentinel, BH).to(tl.int32))
        tl.debug_barrier()
    return ok


@triton.jit
def recv_kernel(table, order, gate, gate_n, status, counts_ptr, recv_ptr, words_ptr, dflag_ptr,
                m_src, m_tok, m_k, m_idx, m_w, me, epoch, epoch_mix, R, NB, L, K, OFF_ROUTE,
                OFF_RIDX, OFF_RW, OFF_NOTICE, hidden, ROW_STRIDE_E, NBLK, W, sentinel, spins,
                RANK_LAYOUT: tl.constexpr, ROW: tl.constexpr, BATCH: tl.constexpr,
                RP: tl.constexpr, NBP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                BH: tl.constexpr, BW: tl.constexpr, NBLKP: tl.constexpr, GP: tl.constexpr):
    s = tl.load(order + tl.program_id(0))
    if (tl.load(status + s * 2) != DONE) & (opened(gate, gate_n, GP) != 0):
        first, nrows = _rows_of(counts_ptr, s, R, NB, RP, NBP)
        # The metadata of s's rows, from s's routing record (published before its counts).
        # (volatile: peers' words, acquired by this rank's prefix launch, never from a cache)
        Ts = tl.load(region(table, s, OFF_ROUTE, tl.int64), volatile=True)
        ridx = region(table, s, OFF_ROUTE + OFF_RIDX, tl.int32)
        rw = region(table, s, OFF_ROUTE + OFF_RW, tl.float32)
        kk = tl.arange(0, KP)
        bad = tl.zeros((), dtype=tl.int32)
        for bb in range(NB):
            base = _pick(first, bb, NBP)
            run = tl.zeros((), dtype=tl.int64)
            for t0 in range(0, Ts, BT):
                t = t0 + tl.arange(0, BT)
                m2 = (t[:, None] < Ts) & (kk[None, :] < K)
                idx = tl.load(ridx + t[:, None] * K + kk[None, :], mask=m2, other=-1,
                              volatile=True)
                if RANK_LAYOUT:
                    hit = m2 & (idx >= 0) & (idx // L == me)
                else:
                    hit = m2 & (idx == me * L + bb)
                c = tl.max(hit.to(tl.int64), axis=1)
                row = base + run + tl.cumsum(c, axis=0) - c
                kfirst = tl.min(tl.where(hit, kk[None, :], KP), axis=1)
                got = c > 0
                tl.store(m_src + row, s.to(tl.int64), mask=got)
                tl.store(m_tok + row, tl.cast(t, tl.int64), mask=got)
                tl.store(m_k + row, kfirst.to(tl.int64), mask=got)
                if RANK_LAYOUT:
                    cell = row[:, None] * K + kk[None, :]
                    keep = got[:, None] & (kk[None, :] < K)
                    wv = tl.load(rw + t[:, None] * K + kk[None, :], mask=m2, other=0.0,
                                 volatile=True)
                    tl.store(m_idx + cell, tl.where(hit, idx - me * L, -1).to(tl.int64),
                             mask=keep)
                    tl.store(m_w + cell, tl.where(hit, wv, 0.0), mask=keep)
                else:
                    tl.store(m_idx + row, tl.cast(me * L + bb, tl.int64), mask=got)
                    tl.store(m_w + row, tl.load(rw + t * K + kfirst, mask=got, other=0.0,
                                                volatile=True), mask=got)
                run += tl.sum(c, axis=0)
            bad += (run != _pick(nrows, bb, NBP)).to(tl.int32)
        if bad != 0:
            set_status(status, s, CORRUPT, s)
        else:
            got = _source_in(recv_ptr, words_ptr, dflag_ptr, s, first, nrows, NB, epoch,
                             epoch_mix, hidden, ROW_STRIDE_E, NBLK, W, sentinel, ROW, BATCH,
                             NBP, BH, BW, NBLKP)
            fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
            n = 0
            while (got == 0) & (fail == R) & (n < spins):
                got = _source_in(recv_ptr, words_ptr, dflag_ptr, s, first, nrows, NB, epoch,
                                 epoch_mix, hidden, ROW_STRIDE_E, NBLK, W, sentinel, ROW, BATCH,
                                 NBP, BH, BW, NBLKP)
                fail = failed_rank(table, R, OFF_NOTICE, epoch, RP)
                n += 1
            if got != 0:
                set_status(status, s, DONE, s)
            elif fail < R:
                set_status(status, s, REMOTE, fail)
