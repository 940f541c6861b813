/* Dispatch, ASP (the UBEP task graph): validate and count, publish counts and routing, send
 * rows straight to their final position as each destination's counts arrive, receive sources
 * in arrival order. Validation, counts, bases and metadata are shared with BSP
 * (dispatch_bsp.c). */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static int bad_expert(op_t *op, int64_t t, int k, int64_t e, int dup) {
    char v[32];
    snprintf(v, sizeof v, "%lld", (long long)e);
    if (dup)
        return bad_input(op, "topk_idx", v, "row %lld names this expert twice", (long long)t);
    return bad_input(op, "topk_idx", v, "expert id at [%lld, %d] out of range [-1, %d) "
                     "(num_experts)", (long long)t, k, op->g->E);
}

/* my first batch rank per local expert of d at d (position order = expert, token) */
static void batch_ranks(engine_t *g, int d) {
    int64_t acc = 0;
    for (int el = 0; el < g->L; el++) {
        g->my_rank_in_batch[d * g->L + el] = acc;
        acc += g->cnt[d * g->L + el];
    }
}

/* One pass over topk_idx: validate it (range, duplicates; not again when ubep.sched built the
 * plan's units from it), copy the routing into this rank's own route area (int32), check the SP
 * sentinel, and with `count` (no count tasks: one core, or BSP) count per expert and per
 * destination and fill every destination's bucket (count_dst's work for all of them at once).
 * Nothing a peer can see is written here. */
int dispatch_validate(op_t *op, int count) {
    engine_t *g = op->g;
    const int K = g->K, E = g->E, R = g->R, r = g->rank;
    const int64_t T = op->ntok, cap = g->cap_src_rows;
    const int expert = g->layout == LAY_EXPERT, sp = g->sync == SYNC_SP, check = !op->checked;
    int64_t *restrict cnt = g->cnt, *restrict units_to = g->units_to;
    int64_t *restrict rows_to = g->rows_to;
    const int32_t *restrict e2d = g->e2d;
    int32_t *restrict ut = g->u_t, *restrict uk = g->u_k, *restrict ue = g->u_e;
    int32_t *restrict us = g->u_slot;
    uint64_t *restrict stamp = g->stamp;
    uint64_t gen = g->stamp_gen;
    int32_t *restrict ridx = route(g, r, (int)(op->n % g->nreg))->idx;
    const int64_t *restrict topk = op->topk;
    int64_t bstart[64];
    for (int d = 0; d < R; d++) bstart[d] = (int64_t)((d - r - 1 + 2 * R) % R) * cap;
    if (count) {
        memset(cnt, 0, sizeof(int64_t) * (size_t)E);
        memset(units_to, 0, sizeof(int64_t) * (size_t)R);
        memset(rows_to, 0, sizeof(int64_t) * (size_t)R);
    }
    for (int64_t t = 0; t < T; t++) {
        const int64_t *row = topk + t * K;
        uint64_t seen_dst = 0; /* R <= 64 enforced at init */
        gen++;
        for (int k = 0; k < K; k++) {
            int64_t e = row[k];
            ridx[t * K + k] = (int32_t)e;
            if (e < 0) {
                if (check && e != -1) { g->stamp_gen = gen; return bad_expert(op, t, k, e, 0); }
                continue;
            }
            if (check) {
                if (e >= E) { g->stamp_gen = gen; return bad_expert(op, t, k, e, 0); }
                if (stamp[e] == gen) { g->stamp_gen = gen; return bad_expert(op, t, k, e, 1); }
                stamp[e] = gen;
            }
            int d = e2d[e];
            int first = !(seen_dst >> d & 1);
            seen_dst |= 1ULL << d;
            if (!count) continue;
            if (expert || first) {
                int64_t u = bstart[d] + units_to[d];
                ut[u] = (int32_t)t;
                uk[u] = k;
                ue[u] = (int32_t)e;
                us[u] = (int32_t)(expert ? cnt[e] : rows_to[d]);
                units_to[d]++;
            }
            cnt[e]++;
            if (first) rows_to[d]++;
        }
        /* only what the receiver polls must be free of the sentinel: the armed tail (the
         * whole row with sp_check_bytes=0); a sentinel in the body travels as any payload */
        if (sp && seen_dst &&
            has_pattern(op->x + (t + 1) * g->row_bytes - g->sp_tail, g->sp_tail, g->isz,
                        g->sentinel)) {
            char v[32];
            snprintf(v, sizeof v, "row %lld", (long long)t);
            g->stamp_gen = gen;
            return bad_input(op, "x", v, "contains the SP sentinel bit pattern 0x%llx, which SP "
                             "cannot carry: use sync='tff' or sync='dc'",
                             (unsigned long long)g->sentinel);
        }
    }
    g->stamp_gen = gen;
    if (!count) return 0;
    if (expert)
        for (int d = 0; d < R; d++) rows_to[d] = units_to[d];
    for (int d = 0; d < R; d++) batch_ranks(g, d);
    return 0;
}

/* SP writer: the row's body, a store fence, then its armed tail (the last sp_tail bytes). A
 * reader that finds no sentinel left in the tail has, after its acquire fence, the whole row:
 * the fence orders the body's stores before the tail's (SFENCE on x86, for the fast-string
 * stores of the libc copy the body takes, a DMB on Arm). Nobody polls the body, so any copy
 * will do there; the tail is polled, so it is copied element-safe (no element tears). With
 * sp_tail == row_bytes this is plain SP, every element armed and polled. */
static void put_sp_row(engine_t *g, uint8_t *slot, const uint8_t *src) {
    int64_t body = g->row_bytes - g->sp_tail;
    if (body > 0) {
        copy_fast(slot, src, body);
        store_fence();
    }
    copy_elem(slot + body, src + body, g->sp_tail);
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

/* my count record for destination d: rows, counts per local expert of d, checksum, epoch */
static void publish_counts(op_t *op, int d) {
    engine_t *g = op->g;
    const int L = g->L;
    inbox_rec_t *ib = inbox(g, d, g->rank, op->par);
    uint32_t *c = ib->counts;
    for (int el = 0; el < L; el++) c[el] = (uint32_t)g->cnt[d * L + el];
    st_rlx(&ib->rows, (uint64_t)g->rows_to[d]);
    st_rlx(&ib->sum, counts_sum(op->epoch, (uint64_t)g->rows_to[d], c, L));
    st_rel(&ib->counts_epoch, op->epoch);
}

/* publish my routing (for receivers' metadata), my readiness and (without count tasks) my
 * counts */
int dispatch_publish(op_t *op) {
    engine_t *g = op->g;
    const int K = g->K, R = g->R;
    int reg = (int)(op->n % g->nreg);
    int rc;
    if (g->sync == SYNC_SP && (rc = ensure_clean(op))) return rc;
    route_rec_t *rt = route(g, g->rank, reg); /* topk_idx was copied by dispatch_validate */
    float *rw = (float *)(route_weights(g, rt));
    memcpy(rw, op->w, sizeof(float) * (size_t)(op->ntok * K));
    st_rlx(&rt->ntok, (uint64_t)op->ntok);
    st_rlx(&rt->sum, route_sum(op->epoch, (uint64_t)op->ntok,
                                     (const uint32_t *)rt->idx, (const uint32_t *)rw,
                                     op->ntok * K));
    st_rlx(&rt->epoch, op->epoch);
    if (g->sync == SYNC_SP && land_is_out(g) && g->sp_dirty[reg]) {
        /* SP in place: the region's last use left data where peers may write now; the user's
         * view of it has expired (recv_x lives until the second dispatch after it) */
        sp_rearm(g, land(g, g->rank, reg), g->sp_dirty[reg]);
        g->sp_dirty[reg] = 0;
    }
    pub_word(ready_word(g, g->rank, op->epoch), op->epoch);
    op->published_ready = 1;
    if (g->eng == ENG_BSP || op->plan.num_count_cores) {
        ring_all(g);
        return 0; /* BSP sends counts after its first barrier; count tasks publish their own */
    }
    for (int i = 0; i < R; i++) publish_counts(op, (g->rank + 1 + i) % R);
    ring_all(g); /* every sender to every rank reads these counts */
    return 0;
}

/* The count task of destination d (ASP with count cores): count my picks of each of d's
 * experts and my rows to d, fill d's bucket unless the plan has units, then publish the count
 * record. topk_idx was validated by the prepare phase. */
static void count_dst(op_t *op, int d) {
    engine_t *g = op->g;
    const int K = g->K, L = g->L, expert = g->layout == LAY_EXPERT, fill = !op->plan.have_units;
    const int64_t T = op->ntok, b0 = bucket_start(g, (d - g->rank - 1 + 2 * g->R) % g->R);
    const int32_t *restrict e2d = g->e2d, *restrict e2l = g->e2l;
    const int64_t *restrict topk = op->topk;
    int64_t *restrict cnt = g->cnt + (int64_t)d * L;
    int64_t units = 0, rows = 0;
    memset(cnt, 0, sizeof(int64_t) * (size_t)L);
    for (int64_t t = 0; t < T; t++) {
        const int64_t *row = topk + t * K;
        int hit = 0;
        for (int k = 0; k < K; k++) {
            int64_t e = row[k];
            if (e < 0 || e2d[e] != d) continue;
            int el = e2l[e];
            if (expert || !hit) {
                if (fill) {
                    int64_t u = b0 + units;
                    g->u_t[u] = (int32_t)t;
                    g->u_k[u] = k;
                    g->u_e[u] = (int32_t)e;
                    g->u_slot[u] = (int32_t)(expert ? cnt[el] : rows);
                }
                units++;
            }
            cnt[el]++;
            hit = 1;
        }
        rows += hit;
    }
    g->units_to[d] = units;
    g->rows_to[d] = expert ? units : rows;
    batch_ranks(g, d);
    atomic_store_explicit(&g->remaining[d], units, memory_order_relaxed);
    publish_counts(op, d); /* its release store publishes the above to this rank's senders */
    atomic_store_explicit(&g->counted[d], op->epoch, memory_order_release);
    ring(g, d);
}

/* count core c: the destinations whose first expert is in its range, in expert order (the
 * simulator's count chunks) */
static int ph_d_count(op_t *op, int core) {
    engine_t *g = op->g;
    const plan_t *p = &op->plan;
    g->core_dsts[core] = 0;
    if (!p->num_count_cores) { /* the prepare phase counted and published for everyone */
        for (int i = 0; core == 0 && i < g->R; i++)
            g->core_dst_log[g->core_dsts[0]++] = (g->rank + 1 + i) % g->R;
        return 0;
    }
    for (int c = 0; c < p->num_count_cores; c++) {
        if ((p->num_send_cores + c) % g->C != core) continue;
        for (int d = 0; d < g->R; d++) {
            int64_t first = (int64_t)d * g->L;
            if (first < p->count_expert_ptr[c] || first >= p->count_expert_ptr[c + 1]) continue;
            count_dst(op, d);
            g->core_dst_log[(int64_t)core * g->R + g->core_dsts[core]++] = d;
        }
    }
    return 0;
}

static int ph_d_prepare(op_t *op, int core) {
    (void)core;
    TRACE(op->g, core, TRACE_D_ENTER);
    /* the route area validation writes was read by peers two calls ago: wait for them first */
    pub_word(word(op->g, op->g->rank, op->g->off_entered), op->epoch << 2 | (uint64_t)op->kind);
    int rc = wait_peers_done(op, op->epoch >= 2 ? op->epoch - 2 : 0, 0);
    if (rc) return rc;
    TRACE(op->g, core, TRACE_D_PREV_DONE);
    if ((rc = dispatch_validate(op, !op->plan.num_count_cores))) return rc;
    TRACE(op->g, core, TRACE_D_VALIDATED);
    reset_send_state(op);
    rc = dispatch_publish(op);
    TRACE(op->g, core, TRACE_D_PUBLISHED);
    return rc;
}

/* Destination d has published readiness and every source has published counts to d: 1;
 * not yet: 0; d has published readiness for a later call of this parity, so it left this one
 * without the rows this rank still has for it: -1 (see dst_gone). Readiness must be this
 * call's exactly: rows of this call must never land in a region a later call has armed. */
static int dst_ready(op_t *op, int d) {
    engine_t *g = op->g;
    uint64_t ready = rd_word(ready_word(g, d, op->epoch));
    if (ready != op->epoch) return ready > op->epoch ? -1 : 0;
    for (int s = 0; s < g->R; s++)
        if (ld_acq(&inbox(g, d, s, op->par)->counts_epoch) != op->epoch) return 0;
    return 1;
}

/* d moved past this call while this rank still had rows for it: d failed the call (its
 * notice says why) or the ranks are out of step. */
int dst_gone(op_t *op, int core, int d) {
    int rc = check_failures(op, core);
    if (rc) return rc;
    return op_error(op, E_LOST, core, d, "rank %d moved past call %llu while rank %d still had "
                    "rows for it", d, (unsigned long long)op->epoch, op->g->rank);
}

/* Source s's count record for destination d in this call (its epoch word was seen), copied
 * out and verified: rows, and counts[L] per local expert of d. Callers use the copy only, so
 * bytes changed after the check cannot reach the data path. */
int read_counts(op_t *op, int core, int d, int s, int64_t *rows, uint32_t *cnt) {
    engine_t *g = op->g;
    const inbox_rec_t *ib = inbox(g, d, s, op->par);
    uint64_t r = ld_rlx(&ib->rows), sum = ld_rlx(&ib->sum);
    memcpy(cnt, ib->counts, sizeof(uint32_t) * (size_t)g->L);
    if (sum != counts_sum(op->epoch, r, cnt, g->L))
        return op_error(op, E_LOST, core, s, "corrupt count record of rank %d for rank %d in "
                        "call %llu", s, d, (unsigned long long)op->epoch);
    if (r > (uint64_t)g->cap_src_rows)
        return op_error(op, E_INTERNAL, core, s, "rank %d published %llu rows for rank %d, more "
                        "than the %lld a source can send", s, (unsigned long long)r, d,
                        (long long)g->cap_src_rows);
    for (int el = 0; el < g->L; el++)
        if (cnt[el] > (uint32_t)g->T)
            return op_error(op, E_INTERNAL, core, s, "rank %d published count %u for an expert, "
                            "more than max_tokens_per_rank", s, cnt[el]);
    *rows = (int64_t)r;
    return 0;
}

/* For the expert layout: out[el] = start of my rows of local expert el in d's region.
 * For the rank layout: out[0] = start of my rows. Peer counts are verified and bounded. */
int compute_bases(op_t *op, int core, int d, int src, int64_t *out) {
    engine_t *g = op->g;
    const int L = g->L, R = g->R;
    int64_t *rows = g->tx_rows + (int64_t)core * R;
    uint32_t *cnt = g->tx_cnt + (int64_t)core * R * L;
    for (int s = 0; s < R; s++) {
        int rc = read_counts(op, core, d, s, &rows[s], cnt + (int64_t)s * L);
        if (rc) return rc;
    }
    int64_t total = 0;
    if (g->layout == LAY_RANK) {
        int64_t before = 0;
        for (int s = 0; s < R; s++) {
            if (s < src) before += rows[s];
            total += rows[s];
        }
        out[0] = before;
    } else {
        for (int el = 0; el < L; el++) {
            int64_t tot = 0, before = 0;
            for (int s = 0; s < R; s++) {
                uint32_t c = cnt[(int64_t)s * L + el];
                if (s < src) before += c;
                tot += c;
            }
            out[el] = total + before;
            total += tot;
        }
    }
    if (total > g->cap_rows)
        return op_error(op, E_INTERNAL, core, d, "counts for rank %d add up to %lld rows, more "
                        "than the buffer's %lld", d, (long long)total, (long long)g->cap_rows);
    return 0;
}

static int wait_dst(op_t *op, int core, int d) {
    waiter_t w;
    waiter_init(&w);
    int ready;
    while ((ready = dst_ready(op, d)) != 1) {
        if (ready < 0) return dst_gone(op, core, d);
        int rc = wait_step(op, &w, core, d, "receive readiness and counts of rank %d", d);
        if (rc) return rc;
    }
    return 0;
}

/* write one row to its slot in destination d (encoded for the sync mode) */
static void put_row(op_t *op, int d, int64_t pos, const uint8_t *src) {
    engine_t *g = op->g;
    int reg = (int)(op->n % g->nreg);
    if (g->eng == ENG_ASP && d == g->rank) { /* own rows: nobody polls them */
        copy_fast(outreg(g, d, reg) + pos * g->out_stride, src, g->row_bytes);
        return;
    }
    if (g->sync == SYNC_TFF) {
        put_tff_in_place(g, outreg(g, d, reg) + pos * g->out_stride, tff_words(g, d, reg, pos),
                         src, op->epoch);
        return;
    }
    uint8_t *slot = land(g, d, reg) + pos * g->slot_bytes;
    if (g->sync == SYNC_SP) {
        put_sp_row(g, slot, src);
    } else {
        copy_fast(slot, src, g->row_bytes);
    }
}

/* the last unit to d is written: publish the per-(source, destination) flag of SW / DC */
static void finish_dst(op_t *op, int d) {
    engine_t *g = op->g;
    if (d == g->rank || g->eng == ENG_BSP) return;
    if (g->sync == SYNC_SP || g->sync == SYNC_TFF) { /* data-as-flag: nothing to publish */
        ring(g, d);
        return;
    }
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
    }
    ring(g, d);
}

/* DC: the row sums of the token a send loop summed last. A token's rows to one destination
 * follow each other in its bucket (expert layout: up to top-k of them, the same bytes), so its
 * sums are computed once, not once per row. */
typedef struct {
    int64_t t;
    uint64_t A, B;
} dc_memo_t;
#define DC_MEMO_INIT {-1, 0, 0}

static void send_unit(op_t *op, dc_memo_t *memo, int64_t t, int k, int e, int d, int64_t slot,
                      const int64_t *bases) {
    engine_t *g = op->g;
    int64_t pos = unit_pos(g, bases, e, slot);
    const uint8_t *src = op->x + t * g->row_bytes;
    put_row(op, d, pos, src);
    if (g->layout == LAY_EXPERT) op->o_dst_row[t * g->K + k] = pos;
    else op->o_dst_row[t * g->R + d] = pos;
    if (g->sync == SYNC_DC && g->eng == ENG_ASP && d != g->rank) {
        int64_t W = (g->row_bytes + 7) / 8;
        int64_t brank = g->layout == LAY_EXPERT ? g->my_rank_in_batch[e] + slot : slot;
        if (memo->t != t) {
            dc_row_sums(src, g->row_bytes, &memo->A, &memo->B);
            memo->t = t;
        }
        uint64_t A = memo->A, B = memo->B;
        if (g->C > 1) {
            atomic_fetch_add(&g->dc_s1[d], A);
            atomic_fetch_add(&g->dc_s2[d], (uint64_t)brank * (uint64_t)W * A + B);
        } else {
            g->dc_s1[d] += A;
            g->dc_s2[d] += (uint64_t)brank * (uint64_t)W * A + B;
        }
    }
}

static void unit_done(op_t *op, int d) {
    engine_t *g = op->g;
    if (g->C > 1) {
        if (atomic_fetch_sub(&g->remaining[d], 1) == 1) finish_dst(op, d);
    } else if (--g->remaining[d] == 0) {
        finish_dst(op, d);
    }
}

void reset_send_state(op_t *op) {
    engine_t *g = op->g;
    for (int c = 0; c < g->C; c++) g->core_units[c] = 0;
    for (int d = 0; d < g->R; d++) {
        /* count tasks set their destinations' (count_dst) */
        if (!op->plan.num_count_cores) atomic_store(&g->remaining[d], g->units_to[d]);
        atomic_store(&g->dc_s1[d], 0);
        atomic_store(&g->dc_s2[d], 0);
        g->core_ready[d] = 0;
    }
    for (int64_t i = 0; i < op->ntok * (g->layout == LAY_EXPERT ? g->K : g->R); i++)
        op->o_dst_row[i] = -1;
}

/* My counts to d are known (a count task may still be at work on them): d's units, 1; not yet,
 * 0. Without count tasks the prepare phase counted everything. */
static int counted(op_t *op, int d) {
    return !op->plan.num_count_cores ||
           atomic_load_explicit(&op->g->counted[d], memory_order_acquire) == op->epoch;
}

static void log_unit(op_t *op, int core, int64_t t, int k) {
    engine_t *g = op->g;
    g->core_unit_log[(int64_t)core * g->T * g->K + g->core_units[core]++] = (int32_t)(t * g->K + k);
}

/* ASP send, one send core: destinations whose counts are in go first. A destination this rank
 * sends nothing learns that from the counts, so it is not waited for (it may well have
 * finished the call already). */
static int send_canonical(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R;
    int64_t *bases = g->core_base + (int64_t)core * R * g->L;
    int pending[64], np = 0; /* index into the send order */
    for (int i = 0; i < R; i++) pending[np++] = i;
    waiter_t w;
    waiter_init(&w);
    while (np) {
        int progressed = 0;
        for (int j = 0; j < np;) {
            int i = pending[j], d = (g->rank + 1 + i) % R;
            if (!counted(op, d)) { j++; continue; }
            if (g->units_to[d]) {
                int ready = dst_ready(op, d);
                if (ready < 0) return dst_gone(op, core, d);
                if (!ready) { j++; continue; }
                int rc = compute_bases(op, core, d, g->rank, bases);
                if (rc) return rc;
                dc_memo_t memo = DC_MEMO_INIT;
                for (int64_t u = bucket_start(g, i), end = u + g->units_to[d]; u < end; u++) {
                    send_unit(op, &memo, g->u_t[u], g->u_k[u], g->u_e[u], d, g->u_slot[u], bases);
                    log_unit(op, core, g->u_t[u], g->u_k[u]);
                }
                finish_dst(op, d);
            }
            pending[j] = pending[--np];
            progressed = 1;
            waiter_init(&w);
        }
        if (!progressed && np) {
            int d = (g->rank + 1 + pending[0]) % R;
            int rc = wait_step(op, &w, core, d, "receive readiness and counts of rank %d", d);
            if (rc) return rc;
        }
    }
    return 0;
}

/* ASP send by the Plan from ubep.sched: plan core j runs on thread j % C, in plan order */
static int send_planned(op_t *op, int core) {
    engine_t *g = op->g;
    const plan_t *p = &op->plan;
    const int R = g->R, L = g->L;
    int64_t *bases = g->core_base + (int64_t)core * R * L;
    int64_t *ready = g->core_ready + (int64_t)core * R;
    for (int d = 0; d < R; d++) ready[d] = 0;
    dc_memo_t memo = DC_MEMO_INIT;
    for (int j = core; j < p->num_send_cores; j += g->C) {
        for (int64_t u = p->core_ptr[j]; u < p->core_ptr[j + 1]; u++) {
            int d = (int)p->dst_rank[u];
            if (!ready[d]) {
                int rc = wait_dst(op, core, d);
                if (!rc) rc = compute_bases(op, core, d, g->rank, bases + (int64_t)d * L);
                if (rc) return rc;
                ready[d] = 1;
            }
            send_unit(op, &memo, p->token[u], (int)p->k[u], (int)p->expert[u], d, p->slot[u],
                      bases + (int64_t)d * L);
            log_unit(op, core, p->token[u], (int)p->k[u]);
            unit_done(op, d);
        }
    }
    return 0;
}

static int ph_d_send(op_t *op, int core) {
    int rc = op->plan.have_units ? send_planned(op, core)
             : core == 0         ? send_canonical(op, core)
                                 : 0;
    TRACE(op->g, core, TRACE_D_SENT);
    return rc;
}

/* receiver: wait for the counts of every source, copy and verify them (this core reads only its
 * copy from here on), then compute where each source's rows of each local expert start
 * (rx_base[s][el]) */
int recv_bases(op_t *op, int core, int64_t *rx_base, int64_t *n_out) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *rows = RX_ROWS(g, core);
    uint32_t *cnt = RX_CNT(g, core);
    for (int s = 0; s < R; s++) {
        waiter_t w;
        waiter_init(&w);
        while (ld_acq(&inbox(g, g->rank, s, op->par)->counts_epoch) != op->epoch) {
            int rc = wait_step(op, &w, core, s, "the counts of rank %d", s);
            if (rc) return rc;
        }
        int rc = read_counts(op, core, g->rank, s, &rows[s], cnt + (int64_t)s * L);
        if (rc) return rc;
    }
    int64_t pos = 0;
    if (g->layout == LAY_RANK) {
        for (int s = 0; s < R; s++) {
            rx_base[s * L] = pos;
            pos += rows[s];
        }
    } else {
        for (int el = 0; el < L; el++) {
            for (int s = 0; s < R; s++) {
                rx_base[s * L + el] = pos;
                pos += cnt[(int64_t)s * L + el];
            }
        }
    }
    if (pos > g->cap_rows)
        return op_error(op, E_INTERNAL, core, -1, "%lld rows announced, capacity %lld",
                        (long long)pos, (long long)g->cap_rows);
    *n_out = pos;
    return 0;
}

/* Source s's routing of this call (topk_idx as int32, then weights as float bits): a peer's is
 * copied into this core's scratch and verified (the peer may rewrite its record once this call
 * is over for it); this rank's own is read in place. */
static int read_route(op_t *op, int core, int s, uint64_t *ntok_out, const int32_t **idx,
                      const float **wt) {
    engine_t *g = op->g;
    const int64_t K = g->K;
    const route_rec_t *rt = route(g, s, (int)(op->n % g->nreg));
    if (s == g->rank) { /* written by this call's prepare phase, and by nobody else */
        *ntok_out = (uint64_t)op->ntok;
        *idx = rt->idx;
        *wt = (const float *)route_weights(g, rt);
        return 0;
    }
    uint64_t ntok = ld_rlx(&rt->ntok), sum = ld_rlx(&rt->sum);
    if (ntok > (uint64_t)g->T || ld_rlx(&rt->epoch) != op->epoch)
        return op_error(op, E_LOST, core, s, "rank %d's routing is not for call %llu", s,
                        (unsigned long long)op->epoch);
    int64_t n = (int64_t)ntok * K;
    uint32_t *snap = g->route_snap + (int64_t)core * 2 * g->T * K;
    memcpy(snap, rt->idx, sizeof(uint32_t) * (size_t)n);
    memcpy(snap + n, route_weights(g, rt), sizeof(uint32_t) * (size_t)n);
    if (sum != route_sum(op->epoch, ntok, snap, snap + n, n))
        return op_error(op, E_LOST, core, s, "corrupt routing record of rank %d in call %llu", s,
                        (unsigned long long)op->epoch);
    *ntok_out = ntok;
    *idx = (const int32_t *)snap;
    *wt = (const float *)(snap + n);
    return 0;
}

/* fill the metadata of source s's rows from its published routing */
int recv_metadata(op_t *op, int core, int s, const int64_t *rx_base) {
    engine_t *g = op->g;
    const int K = g->K, L = g->L, r = g->rank;
    uint64_t ntok = 0;
    const int32_t *idx = NULL;
    const float *wt = NULL;
    int rc = read_route(op, core, s, &ntok, &idx, &wt);
    if (rc) return rc;
    const int64_t lo = (int64_t)r * L, hi = lo + L;
    const uint32_t *cnt = RX_CNT(g, core) + (int64_t)s * L;
    if (g->layout == LAY_EXPERT) {
        /* cursor[el]: next row of expert el; cursor[L + el]: end of the rows the counts give
         * it. A row beyond its expert's count is refused before it is written. */
        int64_t cur[2048];
        int64_t *cursor = L <= 1024 ? cur : malloc(sizeof(int64_t) * 2 * (size_t)L);
        if (!cursor) return op_error(op, E_INTERNAL, core, -1, "out of memory");
        for (int el = 0; el < L; el++) {
            cursor[el] = rx_base[s * L + el];
            cursor[L + el] = cursor[el] + cnt[el];
        }
        for (int64_t t = 0; t < (int64_t)ntok; t++) {
            for (int k = 0; k < K; k++) {
                int64_t e = idx[t * K + k];
                if (e < lo || e >= hi) continue;
                int64_t p = cursor[e - lo]++;
                if (p >= cursor[L + e - lo]) {
                    if (cursor != cur) free(cursor);
                    return op_error(op, E_INTERNAL, core, s, "rank %d's routing disagrees with "
                                    "its counts", s);
                }
                op->o_src_rank[p] = s;
                op->o_src_tok[p] = t;
                op->o_src_k[p] = k;
                op->o_idx[p] = e;
                op->o_w[p] = wt[t * K + k];
            }
        }
        int bad = 0;
        for (int el = 0; el < L; el++)
            if (cursor[el] != cursor[L + el]) bad = 1;
        if (cursor != cur) free(cursor);
        if (bad) return op_error(op, E_INTERNAL, core, s, "rank %d's routing disagrees with its "
                                 "counts", s);
    } else {
        int64_t p = rx_base[s * L], end = p + RX_ROWS(g, core)[s];
        for (int64_t t = 0; t < (int64_t)ntok; t++) {
            const int32_t *ti = idx + t * K;
            if (p >= end) { /* every row is filled: a token that lands here is one too many */
                for (int k = 0; k < K; k++)
                    if ((uint64_t)(ti[k] - lo) < (uint64_t)L)
                        return op_error(op, E_INTERNAL, core, s, "rank %d's routing disagrees "
                                        "with its row count", s);
                continue;
            }
            /* One pass that writes row p whether or not the token lands here, with no branch
             * per pick (which picks land is as random as the routing): a token that does not
             * land leaves row p to the next one that does, or to the count check below. */
            int64_t *ri = op->o_idx + p * K;
            float *rw = op->o_w + p * K;
            int first = K;
            for (int k = K - 1; k >= 0; k--) {
                int here = (uint64_t)(ti[k] - lo) < (uint64_t)L;
                ri[k] = here ? ti[k] - lo : -1;
                rw[k] = here ? wt[t * K + k] : 0.0f;
                first = here ? k : first;
            }
            if (first == K) continue;
            op->o_src_rank[p] = s;
            op->o_src_tok[p] = t;
            op->o_src_k[p] = first;
            p++;
        }
        if (p != end) return op_error(op, E_INTERNAL, core, s, "rank %d's routing disagrees "
                                      "with its row count", s);
    }
    return 0;
}

/* How far a source's rows have been consumed, in position (= batch rank) order. */
typedef struct {
    int el;        /* local expert (expert layout); 0 for the rank layout */
    int64_t off;   /* rows done inside that expert's block from this source */
    int64_t rank;  /* rows done in total */
} rx_cursor_t;

/* Consume whatever has landed from source s without blocking: returns 1 when all its rows are
 * complete (they are in recv_x: every ASP mode lands in place), 0 when some are still missing,
 * -1 on error (recorded). */
static int recv_progress(op_t *op, int core, int s, const int64_t *rx_base,
                         const uint8_t *land_base, rx_cursor_t *c) {
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
    const int expert = g->layout == LAY_EXPERT;
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

/* ASP receive of this core's sources: consume whichever source has data, in arrival order */
static int recv_sources(op_t *op, int core, const int64_t *rx_base, int reg) {
    engine_t *g = op->g;
    int src[64], n = 0;
    rx_cursor_t cur[64];
    for (int s = core; s < g->R; s += g->C) {
        if (s == g->rank || RX_ROWS(g, core)[s] == 0) continue;
        src[n] = s;
        cur[n].el = 0;
        cur[n].off = cur[n].rank = 0;
        n++;
    }
    const uint8_t *land_base = land(g, g->rank, reg);
    waiter_t w;
    waiter_init(&w);
    while (n) {
        int completed = 0;
        for (int i = 0; i < n;) {
            int rc = recv_progress(op, core, src[i], rx_base, land_base, &cur[i]);
            if (rc < 0) return -1;
            if (rc == 1) {
                src[i] = src[n - 1];
                cur[i] = cur[n - 1];
                n--;
                completed = 1;
                continue;
            }
            i++;
        }
        if (!n) break;
        /* Rows trickling in do not restart the spin/yield budget: once it is spent, this core
         * sleeps until a source rings at the end of its batch. With a core per rank that is
         * rarely reached; oversubscribed, polling row by row would take the CPU from the very
         * ranks still writing (the wait then degrades to SW's one wake-up per source). */
        if (completed) {
            waiter_init(&w);
            continue;
        }
        int rc = wait_step(op, &w, core, src[0], "%s rows from rank %d (row %lld of its batch)",
                 g->sync == SYNC_SP ? "SP" : g->sync == SYNC_TFF ? "TFF" : g->sync == SYNC_SW
                 ? "the SW flag of" : "a DC batch matching its checksum of", src[0],
                 (long long)cur[0].rank);
        if (rc) return rc;
    }
    return 0;
}

/* o_nrecv = [num_recv_tokens_per_expert (L) | rows received from each source rank (R)] */
void recv_counts_out(op_t *op, int core) {
    engine_t *g = op->g;
    const uint32_t *cnt = RX_CNT(g, core);
    for (int el = 0; el < g->L; el++) {
        int64_t tot = 0;
        for (int s = 0; s < g->R; s++) tot += cnt[(int64_t)s * g->L + el];
        op->o_nrecv[el] = tot;
    }
    for (int s = 0; s < g->R; s++) op->o_nrecv[g->L + s] = RX_ROWS(g, core)[s];
}

static int ph_d_receive(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    int64_t *rx_base = g->rx_base + (int64_t)core * R * L;
    int64_t n = 0;
    int rc = recv_bases(op, core, rx_base, &n);
    if (rc) return rc;
    TRACE(g, core, TRACE_D_COUNTS_IN);
    int reg = (int)(op->n % g->nreg);
    if (core == 0) {
        op->n_recv = n;
        recv_counts_out(op, core);
    }
    for (int s = core; s < R; s += g->C) {
        if ((rc = recv_metadata(op, core, s, rx_base))) return rc;
    }
    TRACE(g, core, TRACE_D_METADATA);
    rc = recv_sources(op, core, rx_base, reg);
    TRACE(g, core, TRACE_D_DATA_IN);
    return rc;
}

/* Quantised rows (BufferConfig.quant): every token once, each core its share, into qstage, the
 * rows every destination then gets a plain copy of (a token goes to up to top-k rows: one
 * quantisation each, not one per row). Local work: before anything is sent. */
int ph_d_quant(op_t *op, int core) {
    engine_t *g = op->g;
    int64_t lo = op->ntok * core / g->C, hi = op->ntok * (core + 1) / g->C;
    for (int64_t t = lo; t < hi; t++) {
        uint8_t *row = g->qstage + t * g->row_bytes;
        QUANT_ROW(op->x_in + t * g->x_row_bytes, g->dt, g->hidden, row,
                  (float *)(row + g->hidden), g->quant_round, g->quant == QUANT_INT8);
    }
    return 0;
}

int op_quantises(const op_t *op) { return op->quant; }

static const phase_t ASP_DISPATCH_PHASES[] = {
    {ph_d_quant, 1, 1, op_quantises},
    {ph_d_prepare, 0, 1, NULL},
    {ph_d_count, 1, 0, NULL}, /* no barrier: a thread goes on to its sends, others still count */
    {ph_d_send, 1, 0, NULL},
    {ph_d_receive, 1, 0, NULL},
};
const phase_list_t ASP_DISPATCH = PHASE_LIST(ASP_DISPATCH_PHASES, 3, 4);
