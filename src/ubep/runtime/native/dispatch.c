/* Dispatch, what ASP and BSP share: validate and count, publish counts and routing, read and
 * verify counts, compute bases, fill the receive metadata; and ASP's receive, which consumes
 * sources in arrival order. ASP's count tasks and sends are dispatch_send.c's, BSP's phases
 * dispatch_bsp.c's, the task graphs phases.c's. */
#include "flags.h" /* first: engine.h's Python.h precedes the standard headers */

#include "phases.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int bad_expert(op_t *op, int64_t t, int k, int64_t e, int dup) {
    char v[32];
    snprintf(v, sizeof v, "%lld", (long long)e);
    if (dup)
        return bad_input(op, "topk_idx", v, "row %lld names this expert twice", (long long)t);
    return bad_input(op, "topk_idx", v, "expert id at [%lld, %d] out of range [-1, %d) "
                     "(num_experts)", (long long)t, k, op->g->E);
}

/* my first batch rank per local expert of d at d (position order = expert, token) */
void batch_ranks(engine_t *g, int d) {
    int64_t acc = 0;
    for (int el = 0; el < g->L; el++) {
        g->my_rank_in_batch[d * g->L + el] = acc;
        acc += g->cnt[d * g->L + el];
    }
}

/* One pass over topk_idx: validate it (range, duplicates; not again when ubep.sched built the
 * plan's units from it), copy the routing into this rank's private route copy (int32) and, on
 * the one-call path, into the handle's owned copy (op->topk_copy), check the SP sentinel, and
 * with `count` count per expert and per destination; with `fill` also fill every
 * destination's bucket (count_dst's work for all of them at once; a plan with units needs no
 * buckets). Nothing a peer can see is written here. */
int dispatch_validate(op_t *op, int count, int fill) {
    engine_t *g = op->g;
    const int K = g->K, E = g->E, R = g->R, r = g->rank;
    const int64_t T = op->ntok, cap = g->cap_src_rows;
    const int expert = g->layout != LAY_RANK, sp = flag_sentinel(g), check = !op->checked;
    int64_t *restrict cnt = g->cnt, *restrict units_to = g->units_to;
    int64_t *restrict rows_to = g->rows_to, *restrict sent_to = g->sent_to;
    const int32_t *restrict e2d = g->e2d;
    int32_t *restrict ut = g->u_t, *restrict uk = g->u_k, *restrict ue = g->u_e;
    int32_t *restrict us = g->u_slot;
    uint64_t *restrict stamp = g->stamp;
    uint64_t gen = g->stamp_gen;
    int32_t *restrict ridx = (int32_t *)own_route(g, op->n);
    const int64_t *restrict topk = op->topk;
    int64_t *restrict copy = op->topk_copy; /* the one-call path's owned copy, or NULL */
    int64_t bstart[64];
    for (int d = 0; d < R; d++) bstart[d] = (int64_t)((d - r - 1 + 2 * R) % R) * cap;
    if (count) {
        memset(cnt, 0, sizeof(int64_t) * (size_t)E);
        memset(units_to, 0, sizeof(int64_t) * (size_t)R);
        memset(rows_to, 0, sizeof(int64_t) * (size_t)R);
    }
    memset(sent_to, 0, sizeof(int64_t) * (size_t)R);
    for (int64_t t = 0; t < T; t++) {
        const int64_t *row = topk + t * K;
        uint64_t seen_dst = 0; /* R <= 64 enforced at init */
        gen++;
        for (int k = 0; k < K; k++) {
            int64_t e = row[k]; /* read once: what is checked is what is copied */
            ridx[t * K + k] = (int32_t)e;
            if (copy) copy[t * K + k] = e;
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
            sent_to[d] += expert || first;
            if (!count) continue;
            if (expert || first) {
                if (fill) {
                    int64_t u = bstart[d] + units_to[d];
                    ut[u] = (int32_t)t;
                    uk[u] = k;
                    ue[u] = (int32_t)e;
                    us[u] = (int32_t)(expert ? cnt[e] : rows_to[d]);
                }
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
    if (copy) { /* every later reader (count tasks, the handle) reads the copy */
        op->topk = copy;
        op->topk_copy = NULL;
    }
    if (!count) return 0;
    if (expert)
        for (int d = 0; d < R; d++) rows_to[d] = units_to[d];
    for (int d = 0; d < R; d++) batch_ranks(g, d);
    return 0;
}

/* my count record for destination d: rows, counts per local expert of d, checksum, epoch */
void publish_counts(op_t *op, int d) {
    engine_t *g = op->g;
    const int L = g->L;
    inbox_rec_t *ib = inbox(g, d, g->rank, op->par);
    uint32_t *c = ib->counts;
    for (int el = 0; el < L; el++) c[el] = (uint32_t)g->cnt[d * L + el];
    st_rlx(&ib->rows, (uint64_t)g->rows_to[d]);
    st_rlx(&ib->sum, counts_sum(op->epoch, (uint64_t)g->rows_to[d], c, L));
    publish_ranks(op, ib);
    st_rlx(&ib->signature, g->signature);
    st_rel(&ib->counts_epoch, op->epoch);
}

/* my rows to every rank, after the counts of a count record (its release store publishes
 * them): every receiver learns the whole [source, destination] matrix from its own inbox */
void publish_ranks(op_t *op, inbox_rec_t *ib) {
    engine_t *g = op->g;
    uint32_t *v = ib->counts + g->L;
    for (int j = 0; j < g->R; j++) v[j] = (uint32_t)g->sent_to[j];
    st_rlx(&ib->ranks_sum, ranks_sum(op->epoch, v, g->R));
}

/* publish my routing (for receivers' metadata), my readiness and (without count tasks) my
 * counts */
int dispatch_publish(op_t *op) {
    engine_t *g = op->g;
    const int K = g->K, R = g->R;
    int reg = (int)(op->n % g->nreg);
    int rc;
    if (flag_sentinel(g) && (rc = ensure_clean(op))) return rc;
    /* From the private copy (dispatch_validate wrote topk_idx there): the checksum covers what
     * this rank meant, not what its segment holds, which any writer can change meanwhile. */
    route_rec_t *rt = route(g, g->rank, reg);
    uint32_t *own = own_route(g, op->n);
    const int64_t nk = op->ntok * K;
    memcpy(own + nk, op->w, sizeof(float) * (size_t)nk);
    memcpy(rt->idx, own, sizeof(uint32_t) * (size_t)nk);
    memcpy(route_weights(g, rt), own + nk, sizeof(uint32_t) * (size_t)nk);
    st_rlx(&rt->ntok, (uint64_t)op->ntok);
    st_rlx(&rt->sum, route_sum(op->epoch, (uint64_t)op->ntok, own, own + nk, nk));
    st_rlx(&rt->epoch, op->epoch);
    flag_rearm_used(g, reg);
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

/* d moved past this call while this rank still had rows for it: d failed the call (its
 * notice says why) or the ranks are out of step. */
int dst_gone(op_t *op, int core, int d) {
    int rc = check_failures(op, core);
    if (rc) return rc;
    return op_error(op, E_LOST, core, d, "rank %d moved past call %llu while rank %d still had "
                    "rows for it", d, (unsigned long long)op->epoch, op->g->rank);
}

/* Source s's call is another call than this rank's (its signature differs). Every rank reads
 * every source's record before any row of this call reaches a peer (a sender reads all of a
 * destination's records before its first row there, a receiver all of its own): with ASP a
 * clean reject on every rank that differs, named by both words ("mine:theirs:rank", decoded by
 * ubep.buffer.signature). BSP has sent its rows by then: the ranks lose step. */
static int signature_mismatch(op_t *op, int s, uint64_t theirs) {
    engine_t *g = op->g;
    char value[96];
    snprintf(value, sizeof value, "%llx:%llx:%d", (unsigned long long)g->signature,
             (unsigned long long)theirs, s);
    if (g->eng != ENG_ASP)
        return op_error(op, E_LOST, 0, s, "rank %d's call %llu is another call than rank %d's "
                        "(signature %s)", s, (unsigned long long)op->epoch, g->rank, value);
    return bad_input(op, "signature", value, "rank %d's call %llu differs from rank %d's", s,
                     (unsigned long long)op->epoch, g->rank);
}

/* Source s's count record for destination d in this call (its epoch word was seen), copied
 * out and verified: rows, and counts[L] per local expert of d. Callers use the copy only, so
 * bytes changed after the check cannot reach the data path. */
int read_counts(op_t *op, int core, int d, int s, int64_t *rows, uint32_t *cnt) {
    engine_t *g = op->g;
    const inbox_rec_t *ib = inbox(g, d, s, op->par);
    uint64_t r = ld_rlx(&ib->rows), sum = ld_rlx(&ib->sum), sig = ld_rlx(&ib->signature);
    memcpy(cnt, ib->counts, sizeof(uint32_t) * (size_t)g->L);
    if (sum != counts_sum(op->epoch, r, cnt, g->L))
        return op_error(op, E_LOST, core, s, "corrupt count record of rank %d for rank %d in "
                        "call %llu", s, d, (unsigned long long)op->epoch);
    if (sig != g->signature) return signature_mismatch(op, s, sig);
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
        const int padded = g->layout == LAY_EXPERT_PADDED;
        for (int el = 0; el < L; el++) {
            int64_t tot = 0, before = 0;
            for (int s = 0; s < R; s++) {
                uint32_t c = cnt[(int64_t)s * L + el];
                if (s < src) before += c;
                tot += c;
            }
            /* padded: expert el's rows start at its block of R * T slots (DeepEP's places);
             * each source's count is at most T (read_counts), so a block never overflows */
            out[el] = (padded ? el * padded_slots(g) : total) + before;
            total += padded ? padded_slots(g) : tot;
        }
    }
    if (total > g->cap_rows)
        return op_error(op, E_INTERNAL, core, d, "counts for rank %d add up to %lld rows, more "
                        "than the buffer's %lld", d, (long long)total, (long long)g->cap_rows);
    return 0;
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
    for (int64_t i = 0; i < op->ntok * (g->layout != LAY_RANK ? g->K : g->R); i++)
        op->o_dst_row[i] = -1;
}

/* receiver: wait for the counts of every source, copy and verify them (this core reads only its
 * copy from here on), then compute where each source's rows of each local expert start
 * (rx_base[s][el]) */
static int recv_bases(op_t *op, int core, int64_t *rx_base, int64_t *n_out) {
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
        const int padded = g->layout == LAY_EXPERT_PADDED;
        for (int el = 0; el < L; el++) {
            if (padded) pos = el * padded_slots(g); /* the expert's block; the rows after its
                                                     * count stay as they were (DeepEP's) */
            for (int s = 0; s < R; s++) {
                rx_base[s * L + el] = pos;
                pos += cnt[(int64_t)s * L + el];
            }
        }
        if (padded) pos = g->cap_rows; /* recv_x is the whole region */
    }
    if (pos > g->cap_rows)
        return op_error(op, E_INTERNAL, core, -1, "%lld rows announced, capacity %lld",
                        (long long)pos, (long long)g->cap_rows);
    *n_out = pos;
    return 0;
}

/* Source s's routing of this call (topk_idx as int32, then weights as float bits): a peer's is
 * copied into this core's scratch and verified (the peer may rewrite its record once this call
 * is over for it); this rank's own comes from its private copy, never from its segment (bytes a
 * third party writes there would otherwise become this rank's recv_topk_idx and weights). */
static int read_route(op_t *op, int core, int s, uint64_t *ntok_out, const int32_t **idx,
                      const float **wt) {
    engine_t *g = op->g;
    const int64_t K = g->K;
    const route_rec_t *rt = route(g, s, (int)(op->n % g->nreg));
    if (s == g->rank) {
        const uint32_t *own = own_route(g, op->n);
        *ntok_out = (uint64_t)op->ntok;
        *idx = (const int32_t *)own;
        *wt = (const float *)(own + op->ntok * K);
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
    if (g->layout != LAY_RANK) {
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
    int64_t t0 = span_t0(g);
    while (n) {
        int completed = 0;
        for (int i = 0; i < n;) {
            int rc = flag_arrived(op, core, src[i], rx_base, land_base, &cur[i]);
            if (rc < 0) return -1;
            if (rc == 1) { /* every row of src[i] is in: its span since the last one ended */
                t0 = span_rec(op, core, land_is_out(g) ? SK_WAIT : SK_REORDER, t0, -1, src[i],
                              RX_ROWS(g, core)[src[i]], RX_ROWS(g, core)[src[i]] * g->row_bytes);
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
                           flag_awaited(g), src[0],
                 (long long)cur[0].rank);
        if (rc) return rc;
    }
    return 0;
}

/* o_nrecv = [num_recv_tokens_per_expert (L) | rows received from each source rank (R) | rows
 * each source sent each rank (R x R, num_sent_rows_per_rank)]. A source's row of the matrix is
 * copied out of its count record (seen complete by recv_bases) and verified; its entry for this
 * rank must be the rows its verified counts announced. */
static int recv_counts_out(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, L = g->L;
    const uint32_t *cnt = RX_CNT(g, core);
    for (int el = 0; el < L; el++) {
        int64_t tot = 0;
        for (int s = 0; s < R; s++) tot += cnt[(int64_t)s * L + el];
        op->o_nrecv[el] = tot;
    }
    for (int s = 0; s < R; s++) op->o_nrecv[L + s] = RX_ROWS(g, core)[s];
    uint32_t v[64]; /* R <= 64 enforced at init */
    for (int s = 0; s < R; s++) {
        const inbox_rec_t *ib = inbox(g, g->rank, s, op->par);
        uint64_t sum = ld_rlx(&ib->ranks_sum);
        memcpy(v, ib->counts + L, sizeof(uint32_t) * (size_t)R);
        if (sum != ranks_sum(op->epoch, v, R) || v[g->rank] != (uint64_t)RX_ROWS(g, core)[s])
            return op_error(op, E_LOST, core, s, "corrupt rows-per-rank record of rank %d in "
                            "call %llu", s, (unsigned long long)op->epoch);
        for (int j = 0; j < R; j++) op->o_nrecv[L + R + (int64_t)s * R + j] = v[j];
    }
    if (g->layout != LAY_EXPERT_PADDED) return 0;
    /* padded: the metadata of the slots past each expert's count says "no row" (-1, weight
     * 0), so that nothing reading a row's origin takes a slot for a row; the payload there is
     * left as it was */
    for (int el = 0; el < g->L; el++)
        for (int64_t p = el * padded_slots(g) + op->o_nrecv[el]; p < (el + 1) * padded_slots(g);
             p++) {
            op->o_src_rank[p] = op->o_src_tok[p] = op->o_src_k[p] = op->o_idx[p] = -1;
            op->o_w[p] = 0.0f;
        }
    return 0;
}

/* How ASP's receive and BSP's reorder begin (their span of the bases from rv->t0): the row
 * bases of every source in this core's rx_base, and on core 0 the call's received rows
 * (op->n_recv, o_nrecv). */
int recv_begin(op_t *op, int core, recv_t *rv) {
    engine_t *g = op->g;
    rv->t0 = span_t0(g);
    rv->rx_base = g->rx_base + (int64_t)core * g->R * g->L;
    rv->n = 0;
    rv->reg = (int)(op->n % g->nreg);
    int rc = recv_bases(op, core, rv->rx_base, &rv->n);
    if (rc == 0 && core == 0) {
        op->n_recv = rv->n;
        rc = recv_counts_out(op, core);
    }
    return rc;
}

/* integrity: every row of recv_x against the checksum its sender stored (this core's share;
 * after an in-process barrier, so this rank's own rows, sent by any core, are in too) */
int ph_d_check(op_t *op, int core) {
    engine_t *g = op->g;
    int reg = (int)(op->n % g->nreg);
    const uint8_t *out = outreg(g, g->rank, reg);
    const uint64_t *sums = rsum_rows(g, g->rank, reg);
    int64_t lo = op->n_recv * core / g->C, hi = op->n_recv * (core + 1) / g->C;
    for (int64_t p = lo; p < hi; p++)
        if (op->o_src_rank[p] >= 0 && row_check(row_sum(out + p * g->out_stride, g->row_bytes), op->epoch, p) !=
            ld_rlx(&sums[p]))
            return op_error(op, E_LOST, core, (int)op->o_src_rank[p], "row %lld of call %llu "
                            "(from rank %lld) fails its checksum: it changed between its "
                            "sender and rank %d", (long long)p, (unsigned long long)op->epoch,
                            (long long)op->o_src_rank[p], g->rank);
    return 0;
}

int op_checks_rows(const op_t *op) { return op->g->integrity; }

int ph_d_receive(op_t *op, int core) {
    engine_t *g = op->g;
    recv_t rv;
    int rc = recv_begin(op, core, &rv);
    if (rc) return rc;
    TRACE(g, core, TRACE_D_COUNTS_IN);
    for (int s = core; s < g->R; s += g->C) {
        if ((rc = recv_metadata(op, core, s, rv.rx_base))) return rc;
    }
    span_rec(op, core, SK_CUMSUM, rv.t0, -1, -1, rv.n, 0); /* counts in, bases, metadata */
    TRACE(g, core, TRACE_D_METADATA);
    rc = recv_sources(op, core, rv.rx_base, rv.reg);
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
