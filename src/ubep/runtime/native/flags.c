/* The sync modes' work per batch and per call (flags.h says what each mode is): the flag
 * records after a batch, the arrival and verification tests, SP's sentinel bookkeeping. */
#include "flags.h" /* first: engine.h's Python.h precedes the standard headers */

void reset_land(engine_t *g) {
    for (int reg = 0; reg < g->nland; reg++) {
        uint8_t *b = land(g, g->rank, reg);
        for (int64_t r = 0; r < g->cap_rows; r++)
            fill_pattern(b + r * g->slot_bytes, g->row_bytes, g->isz, g->sentinel);
    }
}

/* SP: make the land region whole again after a failed call, before peers may write it */
int ensure_clean(op_t *op) {
    engine_t *g = op->g;
    if (!g->land_dirty) return 0;
    waiter_t w;
    waiter_init(&w);
    while (!peers_done_geq(g, g->land_dirty_epoch)) {
        int rc = wait_step(op, &w, 0, -1, "peers to finish the failed call %llu",
                           (unsigned long long)g->land_dirty_epoch);
        if (rc) return rc;
    }
    reset_land(g);
    g->land_dirty = 0;
    return 0;
}

/* SP: put the sentinel back into the armed part of rows [0, n) of a land region */
static void sp_rearm(engine_t *g, uint8_t *base, int64_t n) {
    if (g->sp_tail == g->row_bytes) {
        fill_pattern(base, n * g->slot_bytes, g->isz, g->sentinel);
        return;
    }
    for (int64_t r = 0; r < n; r++)
        fill_pattern(base + r * g->slot_bytes + g->row_bytes - g->sp_tail, g->sp_tail, g->isz,
                     g->sentinel);
}

void flag_rearm_used(engine_t *g, int reg) {
    if (!flag_sentinel(g) || !land_is_out(g) || !g->sp_dirty[reg]) return;
    /* the region's last use left data where peers may write now; the user's view of it has
     * expired (recv_x lives until the second dispatch after it) */
    sp_rearm(g, land(g, g->rank, reg), g->sp_dirty[reg]);
    g->sp_dirty[reg] = 0;
}

void flag_publish_batch(op_t *op, int d) {
    engine_t *g = op->g;
    inbox_rec_t *ib = inbox(g, d, g->rank, op->par);
    if (g->sync == SYNC_SW) {
        store_fence();
        st_rlx(&ib->sw_count, (uint64_t)g->rows_to[d]);
        st_rel(&ib->sw_epoch, op->epoch);
    } else if (g->sync == SYNC_DC) {
        store_fence();
        uint64_t sum = dc_finish(atomic_load(&g->dc_s1[d]), atomic_load(&g->dc_s2[d]), op->epoch);
        st_rlx(&ib->dc_count, (uint64_t)g->rows_to[d]);
        st_rlx(&ib->dc_sum, sum);
        st_rel(&ib->dc_epoch, op->epoch);
    } /* SP, TFF: the data is the flag, nothing to publish */
    ring(g, d);
}

void flag_publish_staged(op_t *op, int d, const uint8_t *part) {
    engine_t *g = op->g;
    inbox_rec_t *ib = inbox(g, d, g->rank, op->par);
    if (g->sync == SYNC_SW) {
        st_rlx(&ib->sw_count, (uint64_t)g->rows_to[d]);
        st_rel(&ib->sw_epoch, op->epoch);
    } else if (g->sync == SYNC_DC) {
        st_rlx(&ib->dc_count, (uint64_t)g->rows_to[d]);
        st_rlx(&ib->dc_sum, dc_batch_sum(part, g->slot_bytes, g->rows_to[d], g->row_bytes,
                                         op->epoch));
        st_rel(&ib->dc_epoch, op->epoch);
    }
}

int flag_verify_staged(op_t *op, int s, const uint8_t *part, int64_t n) {
    engine_t *g = op->g;
    inbox_rec_t *ib = inbox(g, g->rank, s, op->par);
    int ok = 1;
    if (g->sync == SYNC_SW) {
        ok = ld_acq(&ib->sw_epoch) == op->epoch && (int64_t)ld_rlx(&ib->sw_count) == n;
    } else if (g->sync == SYNC_DC) {
        ok = ld_acq(&ib->dc_epoch) == op->epoch && (int64_t)ld_rlx(&ib->dc_count) == n &&
             ld_rlx(&ib->dc_sum) == dc_batch_sum(part, g->slot_bytes, n, g->row_bytes, op->epoch);
    } else if (g->sync == SYNC_SP) {
        for (int64_t i = 0; i < n && ok; i++)
            ok = !has_pattern(part + i * g->slot_bytes, g->row_bytes, g->isz, g->sentinel);
    } else {
        for (int64_t i = 0; i < n && ok; i++)
            for (int64_t b = 0; b < g->tff_nblocks && ok; b++)
                ok = tff_flag(g, part + i * g->slot_bytes, b) == op->epoch;
    }
    return ok;
}

/* Consume whatever has landed from source s without blocking: returns 1 when all its rows are
 * complete (they are in recv_x: every ASP mode lands in place), 0 when some are still missing,
 * -1 on error (recorded). */
int flag_arrived(op_t *op, int core, int s, const int64_t *rx_base, const uint8_t *land_base,
                 rx_cursor_t *c) {
    engine_t *g = op->g;
    inbox_rec_t *ib = inbox(g, g->rank, s, op->par);
    int64_t expect = RX_ROWS(g, core)[s];
    if (g->sync == SYNC_SW) {
        if (ld_acq(&ib->sw_epoch) != op->epoch) return 0;
        if ((int64_t)ld_rlx(&ib->sw_count) != expect)
            return op_error(op, E_INTERNAL, core, s, "SW flag of rank %d announces %llu rows, "
                            "counts said %lld", s, (unsigned long long)ld_rlx(&ib->sw_count),
                            (long long)expect), -1;
        return 1;
    }
    if (g->sync == SYNC_DC) {
        if (ld_acq(&ib->dc_epoch) != op->epoch) return 0;
        int64_t W = (g->row_bytes + 7) / 8;
        uint64_t s1 = 0, s2 = 0;
        FOR_SOURCE_ROWS(g, core, s, rx_base, pos, rank_, {
            uint64_t A, B;
            dc_row_sums(land_base + pos * g->slot_bytes, g->row_bytes, &A, &B);
            s1 += A;
            s2 += (uint64_t)rank_ * (uint64_t)W * A + B;
        });
        /* a mismatch means rows of this epoch are still landing (or a stale batch): retry */
        return (int64_t)ld_rlx(&ib->dc_count) == expect &&
               ld_rlx(&ib->dc_sum) == dc_finish(s1, s2, op->epoch);
    }
    const int expert = g->layout != LAY_RANK;
    const int nruns = expert ? g->L : 1;
    const uint32_t *cnt = RX_CNT(g, core) + (int64_t)s * g->L;
    const int64_t nb = g->tff_nblocks;
    for (; c->el < nruns; c->el++, c->off = 0) {
        int64_t n = expert ? (int64_t)cnt[c->el] : expect;
        int64_t p0 = rx_base[s * g->L + (expert ? c->el : 0)];
        if (g->sync == SYNC_TFF) { /* in place: the run's epoch words are contiguous */
            const uint64_t *words = (const uint64_t *)(land_base + p0 * g->slot_bytes);
            int64_t i = tff_first_missing(words, c->off * nb, n * nb, op->epoch);
            c->rank += i / nb - c->off;
            c->off = i / nb;
            if (c->off < n) return 0;
            continue;
        }
        for (; c->off < n; c->off++, c->rank++) { /* SP: in place, the row is recv_x already */
            const uint8_t *slot = land_base + (p0 + c->off) * g->slot_bytes;
            if (has_pattern(slot + g->row_bytes - g->sp_tail, g->sp_tail, g->isz, g->sentinel))
                return 0;
        }
    }
    atomic_thread_fence(memory_order_acquire); /* the rows after the words / sentinels seen */
    return 1;
}

const char *flag_awaited(const engine_t *g) {
    return g->sync == SYNC_SP    ? "SP"
           : g->sync == SYNC_TFF ? "TFF"
           : g->sync == SYNC_SW  ? "the SW flag of"
                                 : "a DC batch matching its checksum of";
}

void flag_dispatch_done(op_t *op, int err) {
    engine_t *g = op->g;
    if (op->kind != 0 || !flag_sentinel(g) || !op->published_ready) return;
    if (land_is_out(g)) {
        /* rows [0, n_recv) now hold data; after a failure, any row a peer may have reached */
        int64_t *dirty = &g->sp_dirty[op->n % g->nreg];
        int64_t used = err ? g->cap_rows : op->n_recv;
        if (used > *dirty) *dirty = used;
    } else if (err) {
        /* peers may have written rows this call never consumed: reset all before reuse */
        g->land_dirty = 1;
        g->land_dirty_epoch = op->epoch;
    }
}
