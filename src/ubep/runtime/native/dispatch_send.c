/* Dispatch, ASP's send side (the UBEP task graph): count tasks per destination, then rows
 * straight to their final position at each destination as its counts and readiness arrive,
 * by the Plan of ubep.sched or, on one core, destinations whose counts are in first. */
#include "flags.h" /* first: engine.h's Python.h precedes the standard headers */

#include "phases.h"

/* d's counts are complete: arm its senders' countdown, publish my count record for d, mark it
 * counted and wake whoever waits on d */
static void count_published(op_t *op, int d) {
    engine_t *g = op->g;
    atomic_store_explicit(&g->remaining[d], g->units_to[d], memory_order_relaxed);
    publish_counts(op, d); /* its release store publishes the counts to this rank's senders */
    atomic_store_explicit(&g->counted[d], op->epoch, memory_order_release);
    ring(g, d);
}

/* The count task of destination d (ASP with count cores): publish my count record for d. With
 * the plan's units the prepare phase counted every destination in its pass over topk_idx (one
 * pass per call, whatever the number of count tasks); without them (one send core sending the
 * buckets) this task counts my picks of each of d's experts and my rows to d and fills d's
 * bucket. topk_idx was validated by the prepare phase. */
static void count_dst(op_t *op, int d) {
    engine_t *g = op->g;
    if (op->plan.have_units) { /* counts and batch ranks: dispatch_validate's */
        count_published(op, d);
        return;
    }
    const int K = g->K, L = g->L, expert = g->layout != LAY_RANK;
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
                int64_t u = b0 + units;
                g->u_t[u] = (int32_t)t;
                g->u_k[u] = k;
                g->u_e[u] = (int32_t)e;
                g->u_slot[u] = (int32_t)(expert ? cnt[el] : rows);
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
    count_published(op, d);
}

/* count core c: the destinations whose first expert is in its range, in expert order (the
 * simulator's count chunks) */
int ph_d_count(op_t *op, int core) {
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
            int64_t t0 = span_t0(g);
            count_dst(op, d);
            span_rec(op, core, SK_COUNT, t0, -1, d, g->rows_to[d], 0);
            g->core_dst_log[(int64_t)core * g->R + g->core_dsts[core]++] = d;
        }
    }
    return 0;
}

/* the Plan's units, from the routing dispatch_validate has just checked and copied (int32):
 * the native scheduler (schedule.c), before any core sends */
static void build_units(op_t *op) {
    engine_t *g = op->g;
    plan_t *p = &op->plan;
    sched_work_t *w = &g->sched;
    sched_build(&p->spec, (const int32_t *)own_route(g, op->n), op->ntok, w);
    p->core_ptr = w->core_ptr;
    p->token = w->token; p->k = w->k; p->expert = w->expert;
    p->dst_rank = w->dst; p->hop = w->hop; p->slot = w->slot;
    p->have_units = 1;
}

int ph_d_prepare(op_t *op, int core) {
    (void)core;
    TRACE(op->g, core, TRACE_D_ENTER);
    /* the route area validation writes was read by peers two calls ago: wait for them first */
    pub_word(word(op->g, op->g->rank, op->g->off_entered), op->epoch << 2 | (uint64_t)op->kind);
    int rc = wait_peers_done(op, op->epoch >= 2 ? op->epoch - 2 : 0, 0);
    if (rc) return rc;
    TRACE(op->g, core, TRACE_D_PREV_DONE);
    /* one pass counts for every destination when there are no count tasks, or when the plan's
     * units leave the count tasks nothing to fill (they then only publish) */
    const int units = op->plan.native || op->plan.have_units;
    const int count = !op->plan.num_count_cores || units;
    if ((rc = dispatch_validate(op, count, count && !units))) return rc;
    if (op->plan.native) build_units(op);
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
        if (g->integrity) /* ...but they are checked like any other (ph_d_check) */
            rsum_rows(g, d, reg)[pos] = row_check(row_sum(src, g->row_bytes), op->epoch, pos);
        copy_fast(outreg(g, d, reg) + pos * g->out_stride, src, g->row_bytes);
        return;
    }
    flag_put_row(g, d, reg, pos, src, op->epoch);
}

/* the last unit to d is written: publish the per-(source, destination) flag of SW / DC */
static void finish_dst(op_t *op, int d) {
    engine_t *g = op->g;
    if (d == g->rank || g->eng == ENG_BSP) return;
    flag_publish_batch(op, d);
}

static void send_unit(op_t *op, dc_memo_t *memo, int64_t t, int k, int e, int d, int64_t slot,
                      const int64_t *bases) {
    engine_t *g = op->g;
    int64_t pos = unit_pos(g, bases, e, slot);
    const uint8_t *src = op->x + t * g->row_bytes;
    put_row(op, d, pos, src);
    if (g->layout != LAY_RANK) op->o_dst_row[t * g->K + k] = pos;
    else op->o_dst_row[t * g->R + d] = pos;
    if (flag_sums_rows(g) && g->eng == ENG_ASP && d != g->rank)
        dc_add_row(g, memo, t, src, d,
                   g->layout != LAY_RANK ? g->my_rank_in_batch[e] + slot : slot);
}

static void unit_done(op_t *op, int d) {
    engine_t *g = op->g;
    if (g->C > 1) {
        if (atomic_fetch_sub(&g->remaining[d], 1) == 1) finish_dst(op, d);
    } else if (--g->remaining[d] == 0) {
        finish_dst(op, d);
    }
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
                int64_t t = span_t0(g);
                int rc = compute_bases(op, core, d, g->rank, bases);
                if (rc) return rc;
                t = span_rec(op, core, SK_CUMSUM, t, -1, d, 0, 0);
                dc_memo_t memo = DC_MEMO_INIT;
                for (int64_t u = bucket_start(g, i), end = u + g->units_to[d]; u < end; u++) {
                    send_unit(op, &memo, g->u_t[u], g->u_k[u], g->u_e[u], d, g->u_slot[u], bases);
                    log_unit(op, core, g->u_t[u], g->u_k[u]);
                    t = span_rec(op, core, SK_SEND, t, u, d, 1, g->row_bytes); /* back to back */
                }
                finish_dst(op, d);
            }
            pending[j] = pending[--np];
            progressed = 1;
            waiter_init(&w);
        }
        if (!progressed && np) {
            int d = (g->rank + 1 + pending[0]) % R;
            int64_t t0 = span_t0(g);
            int rc = wait_step(op, &w, core, d, "receive readiness and counts of rank %d", d);
            span_rec(op, core, SK_WAIT, t0, -1, d, 0, 0);
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
    int64_t t = span_t0(g); /* this core's tasks back to back: each starts where one ended */
    for (int j = core; j < p->num_send_cores; j += g->C) {
        for (int64_t u = p->core_ptr[j]; u < p->core_ptr[j + 1]; u++) {
            int d = (int)p->dst_rank[u];
            if (!ready[d]) {
                int rc = wait_dst(op, core, d);
                t = span_rec(op, core, SK_WAIT, t, -1, d, 0, 0);
                if (!rc) rc = compute_bases(op, core, d, g->rank, bases + (int64_t)d * L);
                if (rc) return rc;
                t = span_rec(op, core, SK_CUMSUM, t, -1, d, 0, 0);
                ready[d] = 1;
            }
            send_unit(op, &memo, p->token[u], (int)p->k[u], (int)p->expert[u], d, p->slot[u],
                      bases + (int64_t)d * L);
            log_unit(op, core, p->token[u], (int)p->k[u]);
            unit_done(op, d);
            t = span_rec(op, core, SK_SEND, t, u, d, 1, g->row_bytes);
        }
    }
    return 0;
}

int ph_d_send(op_t *op, int core) {
    int rc = op->plan.have_units ? send_planned(op, core)
             : core == 0         ? send_canonical(op, core)
                                 : 0;
    TRACE(op->g, core, TRACE_D_SENT);
    return rc;
}

