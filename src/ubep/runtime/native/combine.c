/* Combine: publish where this rank's expert outputs lie (copying them into the segment unless
 * they already live there), then every core reduces its tokens' rows where they lie, in one
 * pass, in ubep.reference's order. */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include "phases.h"

#include <stdio.h>

int ph_c_prepare(op_t *op, int core) {
    engine_t *g = op->g;
    TRACE(g, core, TRACE_C_ENTER);
    pub_word(word(g, g->rank, g->off_entered), op->epoch << 2 | (uint64_t)op->kind);
    int rc = wait_peers_done(op, op->epoch >= 2 ? op->epoch - 2 : 0, 0);
    if (rc) return rc;
    if (!op->zero_copy) {
        /* the region's previous readers must be done before it is overwritten */
        if ((rc = wait_peers_done(op, g->comb_last_epoch[op->creg], 0))) return rc;
        g->comb_last_epoch[op->creg] = op->epoch;
    }
    TRACE(g, core, TRACE_C_PREV_DONE);
    return 0;
}

/* integrity: the checksums of expert output rows [a, b), from the caller's expert_out (what
 * this rank means, whatever happens to the segment's copy), stored before the combine info */
static void sum_rows(op_t *op, int64_t a, int64_t b) {
    engine_t *g = op->g;
    uint64_t *sums = rsum_comb(g, g->rank, op->par);
    for (int64_t r = a; r < b; r++)
        st_rlx(&sums[r], row_check(row_sum(op->eo + r * g->crow_bytes, g->crow_bytes), op->epoch,
                                   r));
}

/* rows [lo, hi) of expert_out into the segment, this core's share of them */
static void copy_rows(op_t *op, int core, int64_t lo, int64_t hi) {
    engine_t *g = op->g;
    int64_t a = lo + (hi - lo) * core / g->C, b = lo + (hi - lo) * (core + 1) / g->C;
    uint8_t *dst = g->base[g->rank] + op->eo_off;
    if (!g->integrity) {
        if (a < b)
            copy_fast(dst + a * g->crow_bytes, op->eo + a * g->crow_bytes, (b - a) * g->crow_bytes);
        return;
    }
    /* in pieces of about 32 KB, each summed right after its copy, while it is in the cache */
    int64_t step = (32768 + g->crow_bytes - 1) / g->crow_bytes;
    for (int64_t r = a; r < b; r += step) {
        int64_t e = r + step < b ? r + step : b;
        copy_fast(dst + r * g->crow_bytes, op->eo + r * g->crow_bytes, (e - r) * g->crow_bytes);
        sum_rows(op, r, e);
    }
}

/* Only the rows peers pull are copied: the rows of this rank's own tokens are reduced from
 * expert_out where it lies (ph_c_reduce). Which rows came from peers is the dispatch's own
 * record (engine.h, peer_rows); without one (a dispatch older than the region's last), all. */
int ph_c_copy(op_t *op, int core) {
    engine_t *g = op->g;
    if (op->zero_copy) {
        if (g->integrity) /* the outputs already lie in the segment: sum them where they are */
            sum_rows(op, op->eo_rows * core / g->C, op->eo_rows * (core + 1) / g->C);
        return 0;
    }
    int reg = (int)(op->dispatch_index % (uint64_t)g->nreg);
    if (g->peer_rows[reg].index1 != op->dispatch_index + 1 || g->peer_rows[reg].rows != op->eo_rows) {
        copy_rows(op, core, 0, op->eo_rows);
        return 0;
    }
    const int64_t *runs = peer_runs_of(g, reg);
    for (int i = 0; i < g->peer_rows[reg].nruns; i++) copy_rows(op, core, runs[2 * i], runs[2 * i + 1]);
    return 0;
}

int ph_c_publish(op_t *op, int core) {
    engine_t *g = op->g;
    (void)core;
    TRACE(g, core, TRACE_C_COPIED);
    comb_info_rec_t *ci = comb_info(g, g->rank, op->par);
    store_fence();
    st_rlx(&ci->off, (uint64_t)op->eo_off);
    st_rlx(&ci->rows, (uint64_t)op->eo_rows);
    st_rlx(&ci->stride, (uint64_t)g->crow_bytes);
    st_rlx(&ci->dispatch_index, op->dispatch_index);
    st_rlx(&ci->sum, comb_info_sum(op->epoch, (uint64_t)op->eo_off, (uint64_t)op->eo_rows,
                                      (uint64_t)g->crow_bytes, op->dispatch_index));
    st_rel(&ci->epoch, op->epoch);
    ring_all(g);
    for (int c = 0; c < 2; c++) {
        int64_t lo = g->off_comb + c * g->comb_bytes;
        if (op->eo_off >= lo && op->eo_off < lo + g->comb_bytes) g->comb_last_epoch[c] = op->epoch;
    }
    TRACE(g, core, TRACE_C_PUBLISHED);
    return 0;
}


/* expert output row `pos` of rank d: this rank's own from expert_out itself */
static inline const uint8_t *row_of(op_t *op, int d, const int64_t *coff, int64_t pos) {
    engine_t *g = op->g;
    return (d == g->rank ? op->eo : g->base[d] + coff[d]) + pos * g->crow_bytes;
}

/* integrity: a peer's expert output row against the checksum its owner stored (0: it holds) */
static int check_row(op_t *op, int core, int d, int64_t pos, const uint8_t *row) {
    engine_t *g = op->g;
    if (!g->integrity || d == g->rank) return 0;
    if (row_check(row_sum(row, g->crow_bytes), op->epoch, pos) ==
        ld_rlx(&rsum_comb(g, d, op->par)[pos]))
        return 0;
    return op_error(op, E_LOST, core, d, "expert output row %lld of rank %d in call %llu fails "
                    "its checksum: it changed between rank %d and rank %d", (long long)pos, d,
                    (unsigned long long)op->epoch, d, g->rank), -1;
}

/* token t's rows (from the handle, bounded by what each rank published) and weights into tp /
 * tw: how many, or -1 (recorded) if the handle names a row no rank published */
static int token_terms(op_t *op, int core, int64_t t, const int64_t *coff, const int64_t *crows,
                       const void **tp, float *tw) {
    engine_t *g = op->g;
    const int R = g->R, K = g->K;
    int nt = 0;
    if (g->layout != LAY_RANK) {
        for (int k = 0; k < K; k++) {
            int64_t e = op->h_idx[t * K + k];
            if (e < 0) continue;
            if (e >= g->E)
                return op_error(op, E_INTERNAL, core, -1, "handle names expert %lld",
                                (long long)e), -1;
            int d = g->e2d[e];
            int64_t pos = op->h_dst_row[t * K + k];
            if (pos < 0 || pos >= crows[d])
                return op_error(op, E_INTERNAL, core, d, "handle row %lld outside rank %d's "
                                "%lld expert outputs", (long long)pos, d, (long long)crows[d]),
                       -1;
            tp[nt] = row_of(op, d, coff, pos);
            if (check_row(op, core, d, pos, tp[nt])) return -1;
            tw[nt++] = op->h_w[t * K + k];
        }
    } else {
        for (int d = 0; d < R; d++) {
            int64_t pos = op->h_dst_row[t * R + d];
            if (pos < 0) continue;
            if (pos >= crows[d])
                return op_error(op, E_INTERNAL, core, d, "handle row %lld outside rank %d's "
                                "%lld expert outputs", (long long)pos, d, (long long)crows[d]),
                       -1;
            tp[nt] = row_of(op, d, coff, pos);
            if (check_row(op, core, d, pos, tp[nt])) return -1;
            tw[nt++] = 1.0f;
        }
    }
    return nt;
}

int ph_c_reduce(op_t *op, int core) {
    engine_t *g = op->g;
    const int R = g->R, K = g->K;
    int64_t *coff = g->ci_off + (int64_t)core * R, *crows = g->ci_rows + (int64_t)core * R;
    /* every peer's expert outputs: wait for them (ASP) / verify them (BSP) */
    for (int q = 0; q < R; q++) {
        comb_info_rec_t *ci = comb_info(g, q, op->par);
        waiter_t w;
        waiter_init(&w);
        while (ld_acq(&ci->epoch) != op->epoch) {
            if (g->eng == ENG_BSP) {
                /* past the barrier without its outputs: q failed this call (notice) or the
                 * ranks are out of step */
                int rc = check_failures(op, core);
                if (rc) return rc;
                return op_error(op, E_LOST, core, q, "rank %d's expert outputs missing after "
                                "the barrier of call %llu", q, (unsigned long long)op->epoch);
            }
            int rc = wait_step(op, &w, core, q, "the expert outputs of rank %d", q);
            if (rc) return rc;
        }
        uint64_t off = ld_rlx(&ci->off), rows = ld_rlx(&ci->rows);
        uint64_t stride = ld_rlx(&ci->stride), index = ld_rlx(&ci->dispatch_index);
        if (ld_rlx(&ci->sum) != comb_info_sum(op->epoch, off, rows, stride, index))
            return op_error(op, E_LOST, core, q, "corrupt combine record of rank %d in call %llu",
                            q, (unsigned long long)op->epoch);
        if (index != op->dispatch_index) {
            char v[48];
            snprintf(v, sizeof v, "dispatch %llu", (unsigned long long)op->dispatch_index);
            return bad_input(op, "handle", v, "ranks combine different dispatches (rank %d "
                             "passed the handle of dispatch %llu): every rank must pass the "
                             "handle of the same dispatch", q, (unsigned long long)index);
        }
        if (stride != (uint64_t)g->crow_bytes || rows > (uint64_t)g->cap_rows ||
            off < HEADER_BYTES || off + rows * stride > (uint64_t)g->seg_size)
            return op_error(op, E_INTERNAL, core, q, "rank %d published expert outputs outside "
                            "its segment", q);
        coff[q] = (int64_t)off;
        crows[q] = (int64_t)rows;
    }
    TRACE(g, core, TRACE_C_PEERS);
    const int maxt = K > R ? K : R;
    const void **tp[2] = {g->term_ptr + (int64_t)core * 2 * maxt,
                          g->term_ptr + ((int64_t)core * 2 + 1) * maxt};
    float *tw[2] = {g->term_w + (int64_t)core * 2 * maxt, g->term_w + ((int64_t)core * 2 + 1) * maxt};
    int64_t lo = op->h_ntok * core / g->C, hi = op->h_ntok * (core + 1) / g->C;
    /* Each token's terms are found a token ahead, and the reduce brings the next token's rows
     * into L2 while it sums this one's (kernels.h, prefetch_next) where that measured a gain:
     * tokens of at most 4 rows, whose rows (all of this call's) overflow this rank's share of
     * the L3. Paired calls, 2 ranks (prefetch / none): rank layout 0.73-0.88 at 16-67 MB,
     * expert layout top-2 0.82-0.90 and top-4 0.79 at 33-67 MB; but top-8 1.02-1.06 (its eight
     * streams already run as fast) and in-cache sizes 1.12-1.30 (4-7 MB: the prefetches only
     * take issue slots). */
    const int terms = g->layout != LAY_RANK ? K : K < R ? K : R;
    const int prefetch = terms <= 4 && op->h_ntok * terms * g->crow_bytes > g->llc_bytes / R;
    int nt = lo < hi ? token_terms(op, core, lo, coff, crows, tp[0], tw[0]) : 0;
    for (int64_t t = lo; t < hi; t++) {
        int cur = (int)((t - lo) & 1);
        int nn = t + 1 < hi ? token_terms(op, core, t + 1, coff, crows, tp[!cur], tw[!cur]) : 0;
        if (nt < 0 || nn < 0) return atomic_load(&op->err); /* recorded by token_terms */
        REDUCE[g->cdt](op->y + t * (int64_t)g->hidden * g->cisz, tp[cur], tw[cur], nt, g->hidden,
                       g->layout != LAY_RANK, tp[!cur], prefetch ? nn : 0);
        nt = nn;
    }
    TRACE(g, core, TRACE_C_REDUCED);
    return 0;
}
