/* Dispatch, BSP (the CANN-EP-style baseline): rows to per-source staging, a global barrier,
 * flags and counts, verification, a second barrier, then reordering. The global barrier is
 * BSP combine's too. */
#include "flags.h" /* first: engine.h's Python.h precedes the standard headers */

#include "phases.h"

#include <string.h>

/* --- BSP dispatch: real global barriers between the phases ------------------------------- */

int barrier_arrive(op_t *op, int core, int phase) {
    engine_t *g = op->g;
    store_fence();
    pub_word(word(g, g->rank, g->off_barrier + (int64_t)core * LINE_BYTES),
             op->epoch * 4 + (uint64_t)phase);
    ring_all(g);
    return 0;
}
/* Arrival words only grow, so a peer already in a later call passes the test too: that is
 * right if it completed this call, wrong if it failed it (its arrival belongs to another call),
 * so such a peer's failure notice for this call is checked. */
int barrier_wait(op_t *op, int core, int phase) {
    engine_t *g = op->g;
    uint64_t target = op->epoch * 4 + (uint64_t)phase, next_call = (op->epoch + 1) * 4;
    for (int q = 0; q < g->R; q++) {
        for (int c = 0; c < g->C; c++) {
            waiter_t w;
            waiter_init(&w);
            uint64_t v;
            while ((v = rd_word(word(g, q, g->off_barrier + (int64_t)c * LINE_BYTES))) < target) {
                int rc = wait_step(op, &w, core, q, "global barrier %d (rank %d core %d)", phase,
                                   q, c);
                if (rc) return rc;
            }
            if (v >= next_call) {
                int rc = check_failures(op, core);
                if (rc) return rc;
            }
        }
    }
    return 0;
}

/* Token-Sending: rows go to the destination's staging partition of this source, at the slot
 * the sender computes alone (regions partitioned by (source, expert)). Work is split across
 * cores by unit index; the destination's readiness (its staging area is clean) is checked. */
int ph_bsp_send(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R;
    int reg = (int)(op->n % g->nreg);
    for (int i = 0; i < R; i++) {
        int d = (g->rank + 1 + i) % R;
        int64_t n = g->units_to[d], b = bucket_start(g, i);
        int64_t lo = b + n * core / g->C, hi = b + n * (core + 1) / g->C;
        if (lo < hi) { /* the destination's staging area is clean for this call */
            waiter_t w;
            waiter_init(&w);
            uint64_t at;
            int64_t t0 = span_t0(g);
            while ((at = rd_word(ready_word(g, d, op->epoch))) != op->epoch) {
                if (at > op->epoch) return dst_gone(op, core, d);
                int rc = wait_step(op, &w, core, d, "staging area of rank %d", d);
                if (rc) return rc;
            }
            span_rec(op, core, SK_WAIT, t0, -1, d, 0, 0);
        }
        int64_t t0 = span_t0(g);
        for (int64_t u = lo; u < hi; u++) {
            int64_t slot = g->layout != LAY_RANK
                               ? g->my_rank_in_batch[g->u_e[u]] + g->u_slot[u]
                               : g->u_slot[u];
            int64_t pos = (int64_t)g->rank * g->cap_src_rows + slot;
            const uint8_t *src = op->x + (int64_t)g->u_t[u] * g->row_bytes;
            uint8_t *slotp = land(g, d, reg) + pos * g->slot_bytes;
            if (g->integrity) /* before the slot: the barrier's store fence orders both */
                st_rlx(&rsum_rows(g, d, reg)[pos],
                       row_check(row_sum(src, g->row_bytes), op->epoch, pos));
            flag_put_staged(g, slotp, src, op->epoch);
        }
        if (lo < hi) span_rec(op, core, SK_SEND, t0, lo, d, hi - lo, (hi - lo) * g->row_bytes);
    }
    TRACE(g, core, TRACE_D_SENT);
    return 0;
}

/* SendFlag & TokenCnt: counts, SW flag, DC checksum (over the staged rows, slot order) */
int ph_bsp_flags(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int reg = (int)(op->n % g->nreg);
    for (int d = core; d < R; d += g->C) {
        inbox_rec_t *ib = inbox(g, d, g->rank, op->par);
        uint32_t *c = ib->counts;
        for (int el = 0; el < L; el++) c[el] = (uint32_t)g->cnt[d * L + el];
        st_rlx(&ib->rows, (uint64_t)g->rows_to[d]);
        st_rlx(&ib->sum, counts_sum(op->epoch, (uint64_t)g->rows_to[d], c, L));
        publish_ranks(op, ib);
        st_rlx(&ib->signature, g->signature);
        flag_publish_staged(op, d, land(g, d, reg) +
                                       (int64_t)g->rank * g->cap_src_rows * g->slot_bytes);
        st_rel(&ib->counts_epoch, op->epoch);
        ring(g, d);
    }
    return 0;
}

/* Verification: every core polls a subset of the sources' flags / data */
int ph_bsp_verify(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R;
    int reg = (int)(op->n % g->nreg);
    for (int s = core; s < R; s += g->C) {
        inbox_rec_t *ib = inbox(g, g->rank, s, op->par);
        waiter_t w;
        waiter_init(&w);
        while (ld_acq(&ib->counts_epoch) != op->epoch) {
            int rc = wait_step(op, &w, core, s, "the flag and counts of rank %d", s);
            if (rc) return rc;
        }
        int64_t n;
        int rc = read_counts(op, core, g->rank, s, &n, RX_CNT(g, core) + (int64_t)s * g->L);
        if (rc) return rc;
        uint8_t *part = land(g, g->rank, reg) + (int64_t)s * g->cap_src_rows * g->slot_bytes;
        int ok = flag_verify_staged(op, s, part, n);
        if (!ok)
            return op_error(op, E_INTERNAL, core, s, "verification of rank %d's rows failed after "
                            "the barrier", s);
    }
    TRACE(g, core, TRACE_D_COUNTS_IN); /* BSP: the first barrier, flags and counts verified */
    return 0;
}

/* CalCumSum + Token-Reordering: copy staged rows to their final position, fill metadata */
int ph_bsp_reorder(op_t *op, int core) {
    engine_t *g = op->g;
    recv_t rv;
    int rc = recv_begin(op, core, &rv);
    if (rc) return rc;
    span_rec(op, core, SK_CUMSUM, rv.t0, -1, -1, rv.n, 0);
    uint8_t *stage = land(g, g->rank, rv.reg), *out = outreg(g, g->rank, rv.reg);
    const uint64_t *sums = g->integrity ? rsum_rows(g, g->rank, rv.reg) : NULL;
    for (int s = core; s < g->R; s += g->C) {
        int64_t t0 = span_t0(g);
        if ((rc = recv_metadata(op, core, s, rv.rx_base))) return rc;
        uint8_t *part = stage + (int64_t)s * g->cap_src_rows * g->slot_bytes;
        int64_t bad = -1;
        FOR_SOURCE_ROWS(g, core, s, rv.rx_base, pos, rank_, {
            const uint8_t *slot = part + rank_ * g->slot_bytes;
            uint8_t *dst = out + pos * g->out_stride;
            flag_unstage(g, dst, (uint8_t *)slot);
            /* the row as recv_x holds it, against what its sender summed */
            int64_t at = (int64_t)s * g->cap_src_rows + rank_;
            if (sums && bad < 0 &&
                row_check(row_sum(dst, g->row_bytes), op->epoch, at) != ld_rlx(&sums[at]))
                bad = pos;
        });
        if (bad >= 0)
            return op_error(op, E_LOST, core, s, "row %lld of call %llu from rank %d fails its "
                            "checksum: it changed between its sender and rank %d",
                            (long long)bad, (unsigned long long)op->epoch, s, g->rank);
        span_rec(op, core, SK_REORDER, t0, -1, s, RX_ROWS(g, core)[s],
                 RX_ROWS(g, core)[s] * g->row_bytes);
    }
    TRACE(g, core, TRACE_D_METADATA); /* BSP: the second barrier, rows reordered with metadata */
    return 0;
}

/* send_dst_row of the BSP path: final positions, computed once the counts are known */
int ph_bsp_dst_rows(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *bases = g->core_base + (int64_t)core * R * L;
    for (int d = 0; d < R; d++) {
        int rc = compute_bases(op, core, d, g->rank, bases + (int64_t)d * L);
        if (rc) return rc;
    }
    for (int i = 0; i < R; i++) {
        int d = (g->rank + 1 + i) % R;
        for (int64_t u = bucket_start(g, i), end = u + g->units_to[d]; u < end; u++) {
            int64_t pos = unit_pos(g, bases + (int64_t)d * L, g->u_e[u], g->u_slot[u]);
            if (g->layout != LAY_RANK) op->o_dst_row[(int64_t)g->u_t[u] * g->K + g->u_k[u]] = pos;
            else op->o_dst_row[(int64_t)g->u_t[u] * g->R + d] = pos;
        }
    }
    TRACE(g, core, TRACE_D_DATA_IN); /* BSP: send_dst_row known */
    return 0;
}

int ph_bsp_prepare(op_t *op, int core) {
    TRACE(op->g, core, TRACE_D_ENTER);
    pub_word(word(op->g, op->g->rank, op->g->off_entered), op->epoch << 2 | (uint64_t)op->kind);
    int rc = wait_peers_done(op, op->epoch >= 2 ? op->epoch - 2 : 0, 0);
    if (rc) return rc;
    TRACE(op->g, core, TRACE_D_PREV_DONE);
    if ((rc = dispatch_validate(op, 1, 1))) return rc;
    TRACE(op->g, core, TRACE_D_VALIDATED);
    reset_send_state(op);
    rc = dispatch_publish(op);
    TRACE(op->g, core, TRACE_D_PUBLISHED);
    return rc;
}

