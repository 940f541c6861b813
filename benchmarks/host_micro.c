/*
 * Host microbenchmarks for the simulator's host fabric (benchmarks/host_micro.py builds and runs
 * this, linked with the runtime's own kernels.c and kernels_x86.c). Each kernel is one memory
 * pass the runtime's algorithm makes (docs/FORMATS.md, docs/SIMULATOR.md "Host validation"),
 * calling the engine's copy / fill / sentinel-scan / DC-sum / REDUCE kernels as dispatch.c,
 * dispatch_bsp.c and combine.c call them:
 *
 *   bulk    one memcpy of ROWS x TERMS x ROW_BYTES bytes into a private buffer, timed in every
 *           pass next to the others (the unit the others are expressed in)
 *   copy    copy_fast of each row into a 64-byte aligned slot              (SW / DC / reorder)
 *   spw     SP writer: copy_fast of the body, store fence, copy_elem of the 32 B tail
 *   tffw    TFF in place (ASP): copy_fast of the row, store fence, one release-stored 8 B
 *           epoch word per 480 B block in a word array
 *   tffr    its receiver: the words checked, nothing copied
 *   tff     each row cut into 480 B pieces (copy_elem), each + a release-stored 8 B epoch in a
 *           512 B block                                               (BSP staging)
 *   untff   the 480 B pieces of each block copied back into a row    (BSP TFF receive)
 *   scan    has_pattern over every row                                 (SP full check)
 *   tail    has_pattern over the last 32 B of each row
 *   sptail  SP receiver (ASP): tail check of each row, then the tails re-armed (fill_pattern)
 *   dc      dc_batch_sum over the rows                                 (DC checksum)
 *   fill    fill_pattern of each row with the 2-byte sentinel          (SP refill)
 *   reduce  per token: REDUCE[bf16] over TERMS rows, weighted          (combine, expert layout)
 *   reduce_rank  the same, unweighted                                  (combine, rank layout)
 *   picks   count (token, k) picks per expert with a duplicate stamp (routing validation)
 *   rowmeta the ASP send's per-row bookkeeping, traced: o_dst_row, unit log, span record
 *   route   a rank's routing record published (ROWS tokens x TERMS picks: int32 experts, then
 *           float weights), as dispatch.c's prepare writes it into the rank's segment
 *   recvmeta  (as READER, after route) the receive metadata of one source, read from the
 *           partner's record (dispatch.c read_route + recv_metadata, layout "expert"): the
 *           record copied and checked (abi.h route_sum), then every pick that lands on this
 *           rank's experts written out (origin rank, token, k, expert, weight); per token
 *   recvmeta_rank  the same, layout "rank": one row per token that lands here, its K picks
 *           written branch-free
 *   out     each received row copied into a private output row        (BSP reorder)
 *   bsp_sp  out + scan + fill per row (BSP SP: verify, reorder, refill the staging slot)
 *   bsp_dc  dc + out per row (BSP DC: verify, reorder)
 *   flag    round trip of an 8-byte flag between process pairs: spin, then sched_yield
 *   all     (as READER) wait until every process has finished its WRITER pass (spin, then
 *           sched_yield): with COLD, the fifth number printed is then a call's latency of
 *           PROCS ranks that each write and wait for all others (oversubscription)
 *
 * Usage: host_micro WRITER READER ROW_BYTES ROWS PROCS MILLIS [TERMS [COPIES [COLD [MAP [LLC [WPOS]]]]]]
 *        host_micro flag - 8 1 PROCS MILLIS
 * Runs PROCS processes at once in pairs (p, p^1), free-running for MILLIS ms after one warm-up:
 * each pass, process p runs WRITER into its outgoing buffer X[p] (a shared mapping, pre-faulted)
 * and then READER over its partner's X[p^1], so that, as in the runtime, a writer stores into
 * lines the other core has just read and a reader reads lines the other core has just written.
 * Every pass also times one bulk memcpy of the same bytes right after WRITER and READER. It
 * prints one line per process: the median over passes of WRITER / bulk and READER / bulk (in
 * parts per million; per pass, so that a change of load hits both sides of a ratio alike) and
 * the median ns of the bulk memcpy, then the process's CPU share: its mean wall time per pass
 * over its median pass (ppm; 1e6 = a CPU to itself, 2e6 = half of one, as four processes on
 * two CPUs get, or fewer with other load). Flag mode prints the median round trip in ns. With
 * COPIES > 1 every pass uses the next of that many copies of the buffers (the runtime alternates
 * two receive regions between calls, so a case's working set is two copies of its rows). With
 * COLD = 1 every pass starts with its buffers flushed and all processes together (see evict),
 * the first three numbers are first quartiles instead of medians, and a fifth is printed: the 10th percentile over passes of the slowest process's
 * WRITER + READER time. PROCS = 1 pairs p with itself.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* the runtime's own kernels (src/ubep/runtime/native/kernels.{h,c}, kernels_x86.c, linked in by
 * host_micro.py): what a pass costs is what the engine's code costs, not a re-implementation */
#include "kernels.h"
/* route_sum: the routing record's check, the runtime's own (header-only) */
#include "abi.h"

/* now_ns(): sync.h's CLOCK_MONOTONIC, as the engine's */

static void *shared(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(2); }
    memset(p, 1, n); /* pre-fault */
    return p;
}

static int64_t al64(int64_t v) { return (v + 63) / 64 * 64; }

static volatile uint64_t sink;
static int64_t B, N, TERMS;
static uint8_t *src, *dst, *aux;
static const int64_t *idxp;

/* WPOS (writers, optional): the slot each row of the pass lands in, in send order -- the
 * runtime's own positions in a peer's receive region (ubep.sim.host.send_positions), which for
 * the expert layout scatter a call's rows over every local expert's block, a page apart or
 * more; without it, slot r (rows back to back). WSLOTS: the region's slots. */
static const int64_t *WPOS, *WSRC;
static int64_t WSLOTS;
static int64_t wslot(int64_t r) { return WPOS ? WPOS[r] : r; }
/* ... and the source row each reads: a dispatch reads a token's row once per destination
 * expert (or rank), so a call's sends read its x again and again (WSRC); without it, row r */
static int64_t wsrc(int64_t r) { return WSRC ? WSRC[r] : r; }
static void k_copy(void) {
    int64_t s = al64(B);
    for (int64_t r = 0; r < N; r++) copy_fast(dst + wslot(r) * s, src + wsrc(r) * B, B);
}
/* the ASP send's per-row bookkeeping with tracing on (dispatch_send.c send_unit, log_unit,
 * engine.h span_rec): the row's position into o_dst_row, its (token, k) into the core's unit
 * log, and a span record (a clock read and 48 B into the core's ring); no payload */
typedef struct { int64_t start_ns, end_ns, rows, size_bytes; int32_t kind, unit, peer, epoch; } span_rec_t;
static void k_rowmeta(void) {
    int64_t *dst_row = (int64_t *)aux;
    int32_t *log = (int32_t *)(aux + N * 8);
    span_rec_t *ring = (span_rec_t *)(aux + N * 12 + 64);
    int64_t t = now_ns();
    for (int64_t r = 0; r < N; r++) {
        dst_row[r] = wslot(r);
        log[r] = (int32_t)r;
        span_rec_t *e = &ring[r];
        int64_t end = now_ns();
        e->start_ns = t;
        e->end_ns = end;
        e->kind = 4;
        e->unit = (int32_t)r;
        e->peer = 1;
        e->epoch = 1;
        e->rows = 1;
        e->size_bytes = B;
        t = end;
    }
}
/* SP writer (dispatch.c put_sp_row): the body by copy_fast (nobody polls it), a store fence,
 * then the polled 32 B tail element-safe */
static void k_spw(void) {
    int64_t s = al64(B), body = B - 32;
    for (int64_t r = 0; r < N; r++) {
        copy_fast(dst + wslot(r) * s, src + wsrc(r) * B, body);
        store_fence();
        copy_elem(dst + wslot(r) * s + body, src + wsrc(r) * B + body, 32);
    }
}
/* normal BF16 values (exponents 2^-7 .. 2^2, either sign), as expert outputs are: subnormal or
 * NaN inputs would put microcode assists into the reduce's multiplies; `seed` offsets the
 * sequence (each segment its own values) */
static void fill_normal_bf16(uint16_t *p, size_t n, size_t seed) {
    for (size_t i = 0; i < n; i++) {
        uint32_t x = (uint32_t)((i + seed) * 2654435761u) >> 7;
        p[i] = (uint16_t)((x & 1) << 15 | (120 + (x >> 1) % 10) << 7 | (x >> 5 & 0x7F));
    }
}
/* TFF blocks of a row: 480 B of payload each (the engine's tff_payload) */
static int64_t tff_nblocks(void) { return (B + 479) / 480; }
/* TFF in place (engine.h put_tff_in_place): the row to its final place, a store fence, then
 * one release-stored 8 B epoch word per 480 B block in a word array after the rows */
static uint64_t *tff_words(uint8_t *base) {
    return (uint64_t *)(base + (WSLOTS > N ? WSLOTS : N) * al64(B));
}
static void k_tffw(void) {
    int64_t s = al64(B), nb = tff_nblocks();
    uint64_t *w = tff_words(dst);
    for (int64_t r = 0; r < N; r++) {
        copy_fast(dst + wslot(r) * s, src + wsrc(r) * B, B);
        store_fence();
        for (int64_t b = 0; b < nb; b++) st_rel(&w[wslot(r) * nb + b], (uint64_t)r + 1);
    }
}
/* its receiver (dispatch.c recv_progress): every word of each row checked, nothing copied */
static void k_tffr(void) {
    int64_t nb = tff_nblocks();
    const uint64_t *w = tff_words(dst);
    for (int64_t r = 0; r < N; r++)
        for (int64_t b = 0; b < nb; b++) sink += ld_rlx(&w[r * nb + b]) == 0;
    atomic_thread_fence(memory_order_acquire);
}
static void k_bulk(void) { memcpy(dst, src, (size_t)(N * (TERMS > 1 ? TERMS : 1) * B)); }
static void k_tff(void) {
    int64_t nb = tff_nblocks();
    for (int64_t r = 0; r < N; r++) {
        uint8_t *slot = dst + r * nb * 512;
        for (int64_t b = 0; b < nb; b++) {
            int64_t off = b * 480, len = B - off > 480 ? 480 : B - off;
            copy_elem(slot + b * 512, src + r * B + off, len);
            if (len < 480) memset(slot + b * 512 + len, 0, (size_t)(480 - len));
            memset(slot + b * 512 + 488, 0, 24);
            atomic_store_explicit((_Atomic uint64_t *)(slot + b * 512 + 480), (uint64_t)r + 1,
                                  memory_order_release);
        }
    }
}
static void k_untff(void) {
    int64_t nb = tff_nblocks();
    for (int64_t r = 0; r < N; r++) {
        const uint8_t *slot = dst + r * nb * 512;
        for (int64_t b = 0; b < nb; b++) {
            int64_t off = b * 480, len = B - off > 480 ? 480 : B - off;
            if (atomic_load_explicit((_Atomic uint64_t *)(slot + b * 512 + 480),
                                     memory_order_acquire) == 0) sink++;
            copy_fast(aux + r * al64(B) + off, slot + b * 512, len);
        }
    }
}
static void k_scan(void) {
    int64_t s = al64(B), any = 0;
    for (int64_t r = 0; r < N; r++) any += has_pattern(dst + r * s, B, 2, 0x7FA5);
    sink += (uint64_t)any;
}
static void k_tail(void) {
    int64_t s = al64(B), any = 0;
    for (int64_t r = 0; r < N; r++) any += has_pattern(dst + r * s + B - 32, 32, 2, 0x7FA5);
    sink += (uint64_t)any;
}
/* SP receiver, ASP (dispatch.c recv_progress + sp_rearm): tail check, then re-arm the tail */
static void k_sptail(void) {
    int64_t s = al64(B), any = 0;
    for (int64_t r = 0; r < N; r++) any += has_pattern(dst + r * s + B - 32, 32, 2, 0x7FA5);
    for (int64_t r = 0; r < N; r++) fill_pattern(dst + r * s + B - 32, 32, 2, 0x7FA5);
    sink += (uint64_t)any;
}
static void k_dc(void) { sink += dc_batch_sum(dst, al64(B), N, B, 1); }
static void k_fill(void) {
    int64_t s = al64(B);
    for (int64_t r = 0; r < N; r++) fill_pattern(dst + r * s, B, 2, 0x7FA5);
}
/* combine.c ph_c_reduce: per token, the engine's fused REDUCE[bf16] over its rows (weighted as
 * the expert layout, unweighted as the rank layout). With a row map (MAP, see main) the rows
 * are where the runtime puts them: rank d's expert outputs in segment SEG[d], token t's rows
 * at MAP[t] (d, row) in combine.c's order; without one, TERMS rows per token back to back in
 * the pool (src, N * TERMS rows). The order matters: reading the same bytes as the rank
 * layout's per-rank streams runs ~3x faster than as adjacent pairs (docs/SIMULATOR.md, 6). */
static int WEIGHTED = 1;
static int PREFETCH; /* combine.c's rule: prefetch the next token's rows (set in main) */
enum { Y_OFF = 2048 + 16 }; /* the reduce's output offset in its buffer, see k_reduce_any */
static const int32_t *MAP; /* [N][MAPW][2] of this process's rank, -1 = no row */
static int MAPW;
static uint8_t *SEG[64];
static int64_t map_rows(void) {
    int64_t n = 0;
    for (int64_t i = 0; i < N * MAPW; i++) n += MAP[2 * i] >= 0;
    return n;
}
/* token t's rows and weights into tp / tw (as combine.c's token_terms): how many */
static int token_terms(int64_t t, const void **tp, float *tw) {
    int nt = 0;
    if (MAP) {
        for (int k = 0; k < MAPW && k < 64; k++) {
            const int32_t *m = MAP + 2 * (t * MAPW + k);
            if (m[0] < 0) continue;
            tp[nt] = SEG[m[0]] + (int64_t)m[1] * B;
            tw[nt++] = 0.125f * (float)(k + 1);
        }
        return nt;
    }
    for (; nt < TERMS && nt < 64; nt++) {
        tp[nt] = src + (t * TERMS + nt) * B;
        tw[nt] = 0.125f * (float)(nt + 1);
    }
    return nt;
}
static void k_reduce_any(void) {
    const void *tp[2][64];
    float tw[2][64];
    /* a token ahead, as combine.c: the reduce prefetches the next token's rows */
    int nt = N > 0 ? token_terms(0, tp[0], tw[0]) : 0;
    for (int64_t t = 0; t < N; t++) {
        int cur = (int)(t & 1);
        int nn = t + 1 < N ? token_terms(t + 1, tp[!cur], tw[!cur]) : 0;
        /* y half a page past the rows' page offset (Y_OFF). The runtime's y is a block of its
         * process heap; its page offset is the allocator's (1024 and 2192 measured in a 2-rank
         * 512-token combine loop), not a fixed one. Stores that lie a few bytes past the next
         * loads' address bits 0-11 (y at page + 16 over rows at page + 0) 4K-alias them: the
         * loads wait on the stores, which cost this pass 1.2-4.5x with two rows per token and
         * that the runtime does not have (docs/SIMULATOR.md, 6) */
        REDUCE[DT_BF16](dst + Y_OFF + t * (B / 2 * 2), tp[cur], tw[cur], nt, B / 2, WEIGHTED,
                        tp[!cur], PREFETCH ? nn : 0);
        nt = nn;
    }
}
static void k_reduce(void) { WEIGHTED = 1; k_reduce_any(); }
static void k_reduce_rank(void) { WEIGHTED = 0; k_reduce_any(); }
static void k_picks(void) {
    /* N tokens x TERMS picks over 64 experts (the routing in aux), stamp-checked */
    static int64_t cnt[64];
    static uint64_t stamp[64], gen;
    const int64_t *idx = idxp;
    memset(cnt, 0, sizeof cnt);
    for (int64_t t = 0; t < N; t++) {
        gen++;
        for (int64_t k = 0; k < TERMS; k++) {
            int64_t e = idx[t * TERMS + k];
            if (stamp[e] == gen) sink++;
            stamp[e] = gen;
            cnt[e]++;
        }
    }
    sink += (uint64_t)cnt[3];
}

/* The receive metadata of one source (dispatch.c read_route, recv_metadata): the source's
 * routing record (ROWS tokens x TERMS picks, int32 experts then float weights), which the
 * partner process wrote into its buffer (k_route, as a peer's prepare writes its record into
 * its segment), copied into a scratch and checked with the runtime's route_sum, then every
 * pick that lands on this rank's LOCAL experts (HOST_MICRO_LOCAL, experts [0, LOCAL) of 64)
 * written out as recv_metadata writes it. The routing is uniform (TERMS distinct experts a
 * token, a fixed seed): the branch per pick goes as the routing's. */
static int64_t LOCAL = 32, *rm_src_rank, *rm_src_tok, *rm_src_k, *rm_idx, rm_cur[130], rm_base[65];
static uint32_t *rm_route, *rm_snap;
static float *rm_w;
static uint64_t rm_sum;
static void rm_setup(void) {
    if (rm_route) return;
    int64_t n = N * TERMS, cnt[64] = {0};
    rm_route = calloc((size_t)(4 * n + 32), sizeof(uint32_t));
    rm_snap = rm_route + 2 * n + 16;
    int64_t *o = calloc((size_t)(4 * n + 4), sizeof(int64_t));
    rm_src_rank = o, rm_src_tok = o + n + 1, rm_src_k = o + 2 * n + 2, rm_idx = o + 3 * n + 3;
    rm_w = calloc((size_t)n + 1, sizeof(float));
    for (uint64_t t = 0, x = 0x9E3779B97F4A7C15ULL; t < (uint64_t)N; t++)
        for (uint64_t k = 0, used = 0, e; k < (uint64_t)TERMS && k < 64; k++, used |= 1ULL << e) {
            do { x ^= x << 13; x ^= x >> 7; x ^= x << 17; e = x % 64; } while (used >> e & 1);
            float w = 1.0f / (float)(k + 1);
            rm_route[t * TERMS + k] = (uint32_t)e;
            memcpy(&rm_route[n + t * TERMS + k], &w, sizeof w);
            cnt[e]++;
        }
    rm_sum = route_sum(1, (uint64_t)N, rm_route, rm_route + n, n);
    for (int e = 0; e < 64; e++) rm_base[e + 1] = rm_base[e] + cnt[e]; /* by expert (recv_bases) */
}
static void k_route(void) {
    rm_setup();
    memcpy(dst, rm_route, sizeof(uint32_t) * (size_t)(2 * N * TERMS));
}
static int rm_snapshot(void) { /* the partner's record (dst), copied and checked */
    int64_t n = N * TERMS;
    memcpy(rm_snap, dst, sizeof(uint32_t) * (size_t)(2 * n));
    return route_sum(1, (uint64_t)N, rm_snap, rm_snap + n, n) == rm_sum;
}
static void k_recvmeta(void) {
    rm_setup();
    if (!rm_snapshot()) { sink++; return; }
    const int32_t *idx = (const int32_t *)rm_snap;
    const float *wt = (const float *)(rm_snap + N * TERMS);
    const int64_t K = TERMS, L = LOCAL, lo = 0, hi = L;
    for (int64_t el = 0; el < L; el++) rm_cur[el] = rm_base[el], rm_cur[L + el] = rm_base[el + 1];
    for (int64_t t = 0; t < N; t++)
        for (int64_t k = 0; k < K; k++) {
            int64_t e = idx[t * K + k];
            if (e < lo || e >= hi) continue;
            int64_t p = rm_cur[e - lo]++;
            if (p >= rm_cur[L + e - lo]) { sink++; return; }
            rm_src_rank[p] = 1, rm_src_tok[p] = t, rm_src_k[p] = k, rm_idx[p] = e;
            rm_w[p] = wt[t * K + k];
        }
    sink += (uint64_t)rm_cur[0];
}
static void k_recvmeta_rank(void) {
    rm_setup();
    if (!rm_snapshot()) { sink++; return; }
    const int32_t *idx = (const int32_t *)rm_snap;
    const float *wt = (const float *)(rm_snap + N * TERMS);
    const int64_t K = TERMS, L = LOCAL, lo = 0;
    int64_t p = 0;
    for (int64_t t = 0; t < N; t++) { /* branch-free per pick, as recv_metadata's rank path */
        const int32_t *ti = idx + t * K;
        int64_t *ri = rm_idx + p * K;
        float *rw = rm_w + p * K;
        int first = (int)K;
        for (int64_t k = K - 1; k >= 0; k--) {
            int here = (uint64_t)(ti[k] - lo) < (uint64_t)L;
            ri[k] = here ? ti[k] - lo : -1;
            rw[k] = here ? wt[t * K + k] : 0.0f;
            first = here ? (int)k : first;
        }
        if (first == (int)K) continue;
        rm_src_rank[p] = 1, rm_src_tok[p] = t, rm_src_k[p] = first;
        p++;
    }
    sink += (uint64_t)p;
}
static void k_out(void) {
    int64_t s = al64(B);
    for (int64_t r = 0; r < N; r++) memcpy(aux + r * s, dst + r * s, (size_t)B);
}
static void k_bsp_sp(void) { k_scan(); k_out(); k_fill(); }
static void k_bsp_dc(void) { k_dc(); k_out(); }

/* COLD = 1: the pass's buffers are flushed from every cache level before it (and the bulk
 * memcpy's before it): bench_dispatch interleaves its cases, so between two calls of one case
 * the other cases' buffers (tens of MB) have evicted this one's from the 32 MB L3 */
static void evict(const uint8_t *p, size_t n) {
#if UBEP_X86
    for (size_t i = 0; i < n; i += 64) _mm_clflush(p + i);
    _mm_mfence();
#else
    (void)p;
    (void)n;
#endif
}

/* HOST_MICRO_DST (warm writer passes): the state of the destination's lines when a pass
 * starts, the rest (source rows, bookkeeping) as the previous pass left it. evict: flushed,
 * they come from memory; remote: last written by a helper process on CPU 1, a peer core holds
 * them modified. An ASP receive region is written again two calls later, nobody reading it in
 * between (docs/SIMULATOR.md, 6) */
static int dst_mode;
static _Atomic int64_t *touch_req, *touch_done;
static uint8_t *touch_base;
static void touch_remote(uint8_t *p, size_t n) {
    int64_t want = atomic_load(touch_done) + 1;
    atomic_store(&touch_req[1], (int64_t)(p - touch_base));
    atomic_store(&touch_req[2], (int64_t)n);
    atomic_store(touch_req, want);
    while (atomic_load(touch_done) < want) sched_yield();
}
static void touch_helper(int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    sched_setaffinity(0, sizeof one, &one);
    for (int64_t seen = 0;;) {
        int64_t r;
        while ((r = atomic_load(touch_req)) == seen) sched_yield();
        if (r < 0) _exit(0);
        seen = r;
        uint8_t *q = touch_base + atomic_load(&touch_req[1]);
        size_t n = (size_t)atomic_load(&touch_req[2]);
        for (size_t i = 0; i < n; i += 64) q[i] = (uint8_t)(i + (size_t)r);
        atomic_store(touch_done, r);
    }
}

typedef void (*kern_t)(void);

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void spin_barrier(_Atomic int64_t *cnt, int64_t target) {
    atomic_fetch_add(cnt, 1);
    int spins = 0;
    while (atomic_load(cnt) < target)
        if (++spins > 200) { sched_yield(); spins = 0; }
}

/* flag ping-pong between process 2i and 2i+1: one-way latency = round trip / 2 */
static int64_t flag_run(_Atomic uint64_t *words, int me, int64_t millis) {
    _Atomic uint64_t *mine = words + 8 * me, *peer = words + 8 * (me ^ 1);
    int64_t samples[65536], n = 0, stop = now_ns() + millis * 1000000LL;
    uint64_t v = 0;
    for (;;) {
        int64_t t0 = now_ns();
        if (me & 1) {
            while (atomic_load_explicit(peer, memory_order_acquire) <= v) {
                for (int s = 0; s < 64 && atomic_load_explicit(peer, memory_order_acquire) <= v; s++);
                if (atomic_load_explicit(peer, memory_order_acquire) <= v) sched_yield();
            }
            v = atomic_load(peer);
            if (v == UINT64_MAX) break;
            atomic_store_explicit(mine, v, memory_order_release);
        } else {
            uint64_t next = v + 1;
            int done = now_ns() > stop || n == 65536;
            atomic_store_explicit(mine, done ? UINT64_MAX : next, memory_order_release);
            if (done) break;
            while (atomic_load_explicit(peer, memory_order_acquire) < next) {
                for (int s = 0; s < 64 && atomic_load_explicit(peer, memory_order_acquire) < next; s++);
                if (atomic_load_explicit(peer, memory_order_acquire) < next) sched_yield();
            }
            v = next;
            samples[n++] = now_ns() - t0;
        }
    }
    if (!n) return -1;
    qsort(samples, (size_t)n, sizeof(int64_t), cmp64);
    return samples[n / 2];
}

static kern_t find(const char *name) {
    struct { const char *name; kern_t fn; } table[] = {
        {"bulk", k_bulk}, {"copy", k_copy}, {"tff", k_tff}, {"untff", k_untff}, {"scan", k_scan},
        {"tffw", k_tffw}, {"tffr", k_tffr},
        {"tail", k_tail}, {"dc", k_dc}, {"fill", k_fill}, {"reduce", k_reduce}, {"reduce_rank", k_reduce_rank}, {"spw", k_spw}, {"sptail", k_sptail},
        {"picks", k_picks}, {"rowmeta", k_rowmeta}, {"route", k_route}, {"recvmeta", k_recvmeta}, {"recvmeta_rank", k_recvmeta_rank}, {"out", k_out}, {"bsp_sp", k_bsp_sp}, {"bsp_dc", k_bsp_dc},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(name, table[i].name)) return table[i].fn;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s WRITER READER ROW_BYTES ROWS PROCS MILLIS [TERMS]\n", argv[0]);
        return 2;
    }
    select_kernels(); /* the AVX2 set where the CPU has it, as the engine does at load */
    B = atoll(argv[3]);
    N = atoll(argv[4]);
    int procs = atoi(argv[5]);
    int64_t millis = atoll(argv[6]);
    TERMS = argc > 7 ? atoll(argv[7]) : 1;
    int64_t copies = argc > 8 ? atoll(argv[8]) : 1;
    int cold = argc > 9 ? atoi(argv[9]) : 0;
    int64_t llc = argc > 11 ? atoll(argv[11]) : (int64_t)32 << 20;
    /* WPOS (writers): int64 SLOTS, then ROWS int64 slots in [0, SLOTS), the rows' send order,
     * then ROWS int64 source rows in [0, ROWS) */
    if (argc > 12 && strcmp(argv[12], "-")) {
        FILE *f = fopen(argv[12], "rb");
        int64_t slots = 0;
        int64_t *pos = malloc(sizeof(int64_t) * (size_t)(N > 0 ? 2 * N : 2));
        if (!f || fread(&slots, sizeof slots, 1, f) != 1 || slots < N ||
            fread(pos, sizeof(int64_t), (size_t)(2 * N), f) != (size_t)(2 * N)) {
            fprintf(stderr, "bad WPOS file %s (ROWS slots and ROWS sources needed)\n", argv[12]);
            return 2;
        }
        fclose(f);
        for (int64_t r = 0; r < N; r++)
            if (pos[r] < 0 || pos[r] >= slots || pos[N + r] < 0 || pos[N + r] >= N) {
                fprintf(stderr, "WPOS slot or source out of range\n");
                return 2;
            }
        WPOS = pos;
        WSRC = pos + N;
        WSLOTS = slots;
    }
    /* MAP (reduce readers): int32 R, T, W, then [R][T][W][2] (rank d, row) per token, -1 = none
     * (ubep.sim.host.combine_row_map); process p reduces rank p's tokens (p < R) */
    int32_t *map_all = NULL, map_r = 0;
    if (argc > 10 && strcmp(argv[10], "-")) {
        FILE *f = fopen(argv[10], "rb");
        int32_t hdr[3];
        if (!f || fread(hdr, sizeof hdr, 1, f) != 1 || hdr[0] < 1 || hdr[0] > 64 ||
            hdr[1] != N || hdr[2] < 1 || hdr[2] > 64) {
            fprintf(stderr, "bad MAP file %s (tokens must be ROWS)\n", argv[10]);
            return 2;
        }
        size_t cnt = (size_t)hdr[0] * (size_t)hdr[1] * (size_t)hdr[2] * 2;
        map_all = malloc(cnt * sizeof(int32_t));
        if (fread(map_all, sizeof(int32_t), cnt, f) != cnt) { fprintf(stderr, "short MAP\n"); return 2; }
        fclose(f);
        map_r = hdr[0];
        MAPW = hdr[2];
        /* the R segments' expert outputs, shared and written once, as bench_dispatch's */
        int64_t rows[64] = {0};
        for (size_t i = 0; i < cnt; i += 2)
            if (map_all[i] >= 0 && map_all[i + 1] + 1 > rows[map_all[i]])
                rows[map_all[i]] = map_all[i + 1] + 1;
        for (int d = 0; d < map_r; d++) {
            size_t n = ((size_t)(rows[d] > 0 ? rows[d] : 1) * (size_t)B + 4095) / 4096 * 4096;
            SEG[d] = shared(n);
            fill_normal_bf16((uint16_t *)SEG[d], n / 2, (size_t)d * 7919);
        }
    }

    /* combine.c: tokens of at most 4 rows whose rows overflow a rank's share of the LLC */
    int64_t terms_max = map_all ? MAPW : TERMS;
    PREFETCH = terms_max <= 4 && N * terms_max * B > llc / procs;
    /* HOST_MICRO_TURNS=M (warm passes): all processes on one CPU, taking turns, M passes
     * each: a pass follows the other processes' passes on its CPU, as the ranks of a call
     * that share a CPU run one after another (ubep.sim.host_sched) */
    const char *dst_env = getenv("HOST_MICRO_DST");
    if (dst_env && strcmp(dst_env, "warm")) {
        dst_mode = !strcmp(dst_env, "evict") ? 1 : !strcmp(dst_env, "remote") ? 2 : -1;
        if (dst_mode < 0 || cold) {
            fprintf(stderr, "HOST_MICRO_DST must be warm, evict or remote, with COLD = 0\n");
            return 2;
        }
    }
    /* HOST_MICRO_GAP_US=G (warm passes): each writer pass starts G us after the process's
     * previous one ended, asleep in between, so that whatever else runs on the host in that
     * time runs: a rank writes one slot of a receive region again only a call or two later,
     * and what ran meanwhile decides where its lines are (ubep.sim.host.send_region_state) */
    const char *gap_env = getenv("HOST_MICRO_GAP_US");
    int64_t gap_us = gap_env && !cold ? atoll(gap_env) : 0;
    const char *turns_env = getenv("HOST_MICRO_TURNS");
    /* HOST_MICRO_LOCAL=L (recvmeta): this rank's experts, [0, L) of 64 */
    const char *local_env = getenv("HOST_MICRO_LOCAL");
    if (local_env) LOCAL = atoll(local_env);
    if (LOCAL < 1 || LOCAL > 64) { fprintf(stderr, "HOST_MICRO_LOCAL must be 1..64\n"); return 2; }
    int64_t turns = turns_env && !cold ? atoll(turns_env) : 0;
    int is_flag = !strcmp(argv[1], "flag");
    kern_t wr = is_flag ? NULL : find(argv[1]);
    int all_wait = !strcmp(argv[2], "all");
    kern_t rd = is_flag || all_wait ? NULL : find(argv[2]);
    if (!is_flag && ((!wr && strcmp(argv[1], "-")) || (!rd && !all_wait && strcmp(argv[2], "-")))) {
        fprintf(stderr, "unknown kernel %s / %s\n", argv[1], argv[2]);
        return 2;
    }
    if (is_flag && procs % 2) { fprintf(stderr, "flag needs an even PROCS\n"); return 2; }
    _Atomic int64_t *ctl = shared(4096);
    memset((void *)ctl, 0, 4096); /* barrier counters start at 0 */
    int64_t *out = (int64_t *)((uint8_t *)ctl + 64);
    /* cold mode: every process's pass start and end (after the barrier, after the reader):
     * the fifth number printed is the median over passes of the slowest process's pass */
    enum { MAXLAT = 20000 };
    int64_t *lat = shared((size_t)MAXLAT * (size_t)procs * 2 * sizeof(int64_t));
    memset(lat, 0, (size_t)MAXLAT * (size_t)procs * 2 * sizeof(int64_t));
    _Atomic uint64_t *words = is_flag ? shared((size_t)procs * 64 + 64) : NULL;
    if (words) memset((void *)words, 0, (size_t)procs * 64 + 64);
    int64_t slot = tff_nblocks() * 512;
    if (slot < al64(B)) slot = al64(B);
    int64_t xrows = WSLOTS > N ? WSLOTS : N; /* a WPOS region's slots */
    size_t xbytes = (size_t)xrows * (size_t)(TERMS > 1 ? TERMS : 1) * (size_t)slot +
                    (size_t)xrows * (size_t)tff_nblocks() * 8 + 64; /* + k_tffw's words */
    size_t pool = (size_t)(N * (TERMS > 1 ? TERMS : 1)) * (size_t)al64(B);
    if (copies < 1) copies = 1;
    if (copies > 256) copies = 256;
    uint8_t *xall = is_flag ? NULL : shared(xbytes * (size_t)procs * (size_t)copies);
    for (int p = 0; p < procs; p++) {
        if (fork() == 0) {
            if (turns) { /* every process on CPU 0 */
                cpu_set_t one;
                CPU_ZERO(&one);
                CPU_SET(0, &one);
                sched_setaffinity(0, sizeof one, &one);
            }
            if (is_flag) {
                spin_barrier(ctl, procs);
                out[8 * p] = flag_run(words, p, millis);
                _exit(0);
            }
            if (map_all) MAP = map_all + (size_t)(p % map_r) * (size_t)N * (size_t)MAPW * 2;
            uint8_t *src_all = shared(pool * (size_t)copies + 64);
            src = src_all;
            size_t auxbytes = (size_t)N * (size_t)al64(B) + (size_t)N * (size_t)TERMS * 8 + 64 + Y_OFF
                              + (size_t)N * (12 + sizeof(span_rec_t)) + 64; /* + k_rowmeta's */
            aux = shared(auxbytes);
            fill_normal_bf16((uint16_t *)src, pool * (size_t)copies / 2, 0);
            int64_t *idx = (int64_t *)(aux + Y_OFF + (size_t)N * (size_t)al64(B));
            for (int64_t i = 0; i < N * TERMS; i++) idx[i] = (i * 37 + i / TERMS) % 64;
            idxp = idx;
            size_t stride = xbytes * (size_t)procs;
            pid_t helper = 0;
            if (dst_mode >= 2) {
                touch_req = (_Atomic int64_t *)shared(4096);
                memset((void *)touch_req, 0, 4096);
                touch_done = touch_req + 8;
                touch_base = xall;
                if ((helper = fork()) == 0) touch_helper(1);
            }
            uint8_t *mine0 = xall + xbytes * (size_t)p;
            uint8_t *theirs0 = xall + xbytes * (size_t)(procs > 1 ? (p ^ 1) : p);
            uint8_t *mine = mine0, *theirs = theirs0;
            (void)mine;
            /* readers of TFF blocks / reduce inputs need blocks / rows written in that format */
            dst = mine;
            if (!strcmp(argv[2], "untff")) k_tff();
            /* expert outputs for the reduce: written once before the passes (as bench_dispatch
             * writes them at set-up), so the reader's lines are not invalidated every pass */
            if (!strncmp(argv[2], "reduce", 6))
                for (int64_t c = 0; c < copies; c++)
                    memcpy(mine0 + xbytes * (size_t)procs * (size_t)c, src_all + pool * (size_t)c,
                           (size_t)(N * (TERMS > 1 ? TERMS : 1) * B));
            /* the bulk memcpy's destination is private, as bench_dispatch's np.copyto floor */
            uint8_t *bulk_dst = shared(pool + 64);
            static int64_t rw[100000], rr[100000], bb[100000], aw[100000], ar[100000];
            int64_t n = 0, stop, t_all = 0;
            int64_t passes = 0, exchanges = 0; /* pass barriers, all-waits crossed */
            for (int warm = 1; warm >= 0; warm--) {
                spin_barrier(ctl, procs * (2 - warm));
                stop = now_ns() + (warm ? 0 : millis * 1000000LL);
                n = 0;
                t_all = now_ns();
                int64_t c = 0;
                do {
                    c = (c + 1) % copies;
                    mine = mine0 + stride * (size_t)c;
                    theirs = theirs0 + stride * (size_t)((c + copies - 1) % copies);
                    src = src_all + pool * (size_t)c;
                    if (cold) {
                        evict(src, pool);
                        evict(mine, xbytes);
                        evict(aux, auxbytes);
                        if ((rd == k_reduce || rd == k_reduce_rank) && MAP) {
                            for (int64_t i = 0; i < N * MAPW; i++)
                                if (MAP[2 * i] >= 0) evict(SEG[MAP[2 * i]] + (int64_t)MAP[2 * i + 1] * B, (size_t)B);
                        } else if (rd == k_reduce || rd == k_reduce_rank) {
                            evict(theirs, xbytes);
                        }
                        /* every process starts the pass together, as a call's ranks do after
                         * its barrier (they share the memory bandwidth); process 0 decides
                         * when to stop, so that all make the same number of passes */
                        if (p == 0 && n > 0 && (now_ns() >= stop || n >= 99999))
                            atomic_store(&ctl[3], passes + 1); /* the barrier to stop at */
                        spin_barrier(&ctl[2], procs * ++passes);
                        if (atomic_load(&ctl[3]) == passes) break;
                    }
                    if (turns) /* this process's turn: the others have had theirs */
                        while (atomic_load(&ctl[6]) % procs != p) sched_yield();
                    if (gap_us > 0) {
                        struct timespec gap = {(time_t)(gap_us / 1000000),
                                               (long)(gap_us % 1000000) * 1000};
                        nanosleep(&gap, NULL);
                    }
                    if (dst_mode == 1) evict(mine, xbytes); /* from memory */
                    if (dst_mode == 2) touch_remote(mine, xbytes); /* from a peer core */
                    int64_t t0 = now_ns();
                    if (wr) { dst = mine; wr(); }
                    int64_t t1 = now_ns();
                    if (all_wait) {
                        /* "all": wait (spin, then yield, as the engine's waits) until every
                         * process has finished its writer pass, as a rank of a call waits for
                         * every peer's rows */
                        atomic_fetch_add(&ctl[5], 1);
                        ++exchanges;
                        int spins = 0;
                        while (atomic_load(&ctl[5]) < procs * exchanges)
                            if (++spins > 64) { sched_yield(); spins = 0; }
                    } else if (rd) {
                        if (rd == k_reduce || rd == k_reduce_rank) { uint8_t *s0 = src; src = theirs; dst = aux; rd(); src = s0; }
                        else { dst = theirs; rd(); }
                    }
                    int64_t t2 = now_ns();
                    if (turns) atomic_fetch_add(&ctl[6], 1);
                    if (cold && !warm && n < MAXLAT) {
                        lat[((size_t)n * (size_t)procs + (size_t)p) * 2] = t0;
                        lat[((size_t)n * (size_t)procs + (size_t)p) * 2 + 1] = t2;
                    }
                    if (cold) {
                        evict(src, pool);
                        evict(bulk_dst, pool);
                        spin_barrier(&ctl[2], procs * ++passes);
                    }
                    int64_t t2b = now_ns();
                    dst = bulk_dst;
                    /* a WPOS pass stands for one case's calls back to back: nothing but the
                     * pass itself goes through the caches between two passes */
                    if (!WPOS) k_bulk();
                    int64_t t3 = now_ns(), tb = t3 - t2b > 0 ? t3 - t2b : 1;
                    /* per pass, relative to the bulk memcpy timed next to it (ppm) */
                    aw[n] = t1 - t0;
                    ar[n] = t2 - t1;
                    rw[n] = (t1 - t0) * 1000000 / tb;
                    rr[n] = (t2 - t1) * 1000000 / tb;
                    bb[n] = tb;
                    n++;
                } while (cold || (turns ? n < (warm ? 1 : turns)
                                        : (now_ns() < stop && n < 100000)));
                t_all = now_ns() - t_all;
                if (p == 0) atomic_store(&ctl[4], n);
            }
            qsort(rw, (size_t)n, sizeof(int64_t), cmp64);
            qsort(aw, (size_t)n, sizeof(int64_t), cmp64);
            qsort(ar, (size_t)n, sizeof(int64_t), cmp64);
            qsort(rr, (size_t)n, sizeof(int64_t), cmp64);
            qsort(bb, (size_t)n, sizeof(int64_t), cmp64);
            /* CPU share: the wall time of a whole pass on average over the median pass time
             * measured without interruption (ppm; 1e6 = the process had a CPU to itself) */
            int64_t med_pass = 0;
            {
                /* reconstruct the median pass from the medians: bulk + writer + reader */
                med_pass = bb[n / 2] + (rw[n / 2] + rr[n / 2]) * bb[n / 2] / 1000000;
            }
            /* cold mode: the first quartile, not the median: a pass of milliseconds on a shared
             * host is often cut by other processes' time slices, which the model leaves out
             * (it predicts the machine to itself); the quartile keeps the uninterrupted ones */
            int64_t q = cold ? n / 4 : n / 2;
            out[8 * p] = rw[q];
            out[8 * p + 1] = rr[q];
            out[8 * p + 2] = bb[q];
            out[8 * p + 3] = med_pass > 0 && n > 0 ? (t_all / n) * 1000000 / med_pass : 0;
            out[8 * p + 4] = aw[q]; /* the passes' own times (ns), same quantile */
            out[8 * p + 5] = ar[q];
            out[8 * p + 6] = MAP ? map_rows() : N; /* rows (tokens) of the reader pass */
            if (helper > 0) { atomic_store(touch_req, -1); waitpid(helper, NULL, 0); }
            _exit(0);
        }
    }
    for (int p = 0; p < procs; p++) wait(NULL);
    int64_t passes_all = is_flag || !cold ? 0 : atomic_load(&ctl[4]), lat_med = 0;
    if (passes_all > MAXLAT) passes_all = MAXLAT;
    if (passes_all > 0) {
        int64_t *l = malloc(sizeof(int64_t) * (size_t)passes_all);
        for (int64_t i = 0; i < passes_all; i++) {
            int64_t worst = 0; /* the slowest process's own pass, as bench_dispatch takes the
                                * slowest rank's own call: time slices taken from it count */
            for (int q = 0; q < procs; q++) {
                const int64_t *e = lat + ((size_t)i * (size_t)procs + (size_t)q) * 2;
                if (e[1] - e[0] > worst) worst = e[1] - e[0];
            }
            l[i] = worst;
        }
        qsort(l, (size_t)passes_all, sizeof(int64_t), cmp64);
        lat_med = l[passes_all / 10]; /* 10th percentile: see the "all" note */
        free(l);
    }
    for (int p = 0; p < procs; p++)
        printf("%lld %lld %lld %lld %lld %lld %lld %lld\n", (long long)out[8 * p],
               (long long)out[8 * p + 1], (long long)out[8 * p + 2], (long long)out[8 * p + 3],
               (long long)lat_med, (long long)out[8 * p + 4], (long long)out[8 * p + 5],
               (long long)out[8 * p + 6]);
    return 0;
}
