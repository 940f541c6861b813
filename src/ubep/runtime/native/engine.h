/* The engine and an operation: state, shared-memory addresses, the helpers every phase uses,
 * and the functions the parts of the native core call across files (the files, one line each:
 * docs/ARCHITECTURE.md, "Native core"; the build takes every file of this folder). */
#ifndef UBEP_ENGINE_H
#define UBEP_ENGINE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "kernels.h"
#include "schedule.h"
#include "sync.h"

/* what the parts share stays inside the module: accessed without the GOT (-fvisibility=hidden
 * only covers definitions, not these declarations) */
#pragma GCC visibility push(hidden)

#define MAX_WHAT 160
#define MAX_PENDING 2 /* split-phase calls in flight per engine (two-batch overlap) */
#define MAX_MSG 512
#define MAX_POKE 4096

/* Task spans (tracing on: Engine.trace_enable): what each core ran, on CLOCK_MONOTONIC (one
 * clock for every rank of a host). The kinds are ubep.trace.spans.TASK_KINDS by index
 * (tests/trace/test_runtime_spans.py checks the two lists agree); the call spans (dispatch,
 * combine) go to one more ring after the cores'. */
enum {
    SK_INIT, SK_COUNT, SK_CUMSUM, SK_VERIFY, SK_SEND, SK_WAIT, SK_FLAG, SK_BARRIER, SK_REORDER,
    SK_REDUCE, SK_ROUTE, SK_CHECKSUM, SK_QUANT, SK_COPY, SK_DISPATCH, SK_COMBINE,
    SK_OWN = -1 /* a phase that records its own, finer spans */
};
typedef struct {
    int64_t start_ns, end_ns;
    int32_t kind, unit, peer, epoch;
    int64_t rows, size_bytes;
} span_t;

struct op;
typedef int (*phase_fn)(struct op *op, int core);
typedef struct {
    phase_fn fn;
    int all_cores;  /* 0: core 0 only */
    int sync_after; /* in-process barrier of this rank's cores after the phase */
    int (*when)(const struct op *op); /* NULL, or the phase (and its barrier) runs only if true */
    int kind;       /* the task span the phase is (SK_*), or SK_OWN */
} phase_t;

/* The Plan of ubep.sched (ubep/sched/plan.py), as ASP dispatch executes it: send core j runs on
 * thread j % C, count core c on thread (num_send_cores + c) % C; a thread runs its count tasks
 * before its sends. Count core c publishes the count records of the destinations whose first
 * expert lies in [count_expert_ptr[c], count_expert_ptr[c + 1]): with units, what the prepare
 * phase's one pass over topk_idx counted; without units (one send core), it counts them and
 * fills their buckets, which the send core sends, destinations whose counts are in first. With a
 * ScheduleSpec (`native`), the prepare phase builds the units itself (schedule.c) from the
 * routing it has just validated, into the engine's work space. */
typedef struct plan {
    int num_send_cores, num_count_cores; /* 0, 0: no plan (one core: validate, count and send) */
    const int64_t *count_expert_ptr;     /* [num_count_cores + 1] */
    int native;                          /* the units are this call's to build (spec) */
    sched_spec_t spec;
    int have_units;
    const int64_t *core_ptr;             /* [num_send_cores + 1] CSR offsets into the units */
    const int64_t *token, *k, *expert, *dst_rank, *hop, *slot; /* [units] */
} plan_t;

typedef struct fast fast_t;

typedef struct engine {
    PyObject_HEAD
    /* Configuration, read once from the parameters (module.c's PARAMS table maps each key of
     * ubep.runtime.abi.engine_params to its field). The short names are the paper's:
     * R ranks, C cores per rank, E experts, L experts per rank, K top-k, T max tokens. */
    int rank;              /* rank: this rank */
    int R;                 /* num_ranks */
    int C;                 /* num_cores: cores (threads) of this rank */
    int E;                 /* num_experts */
    int L;                 /* num_local_experts */
    int K;                 /* num_topk */
    int T;                 /* max_tokens: per rank and call */
    int hidden;            /* hidden: elements per row */
    int isz;               /* itemsize: bytes per payload element */
    int dt;                /* dtype: payload type (DT_*) */
    int cdt;               /* combine_dtype: type of the expert outputs and of y (DT_*) */
    int cisz;              /* combine_itemsize */
    int sync;              /* sync: SYNC_* */
    int eng;               /* engine: ENG_* */
    int layout;            /* layout: LAY_* */
    int nreg;              /* num_regions: receive (out) regions, used by dispatch index */
    int nland;             /* num_land_regions: 1, or nreg where land == out */
    int threaded;          /* threaded: cores 1..C-1 are threads (else core 0 plays all) */
    int64_t cap_rows;      /* cap_rows: rows a receive region holds */
    int64_t cap_src_rows;  /* cap_src_rows: rows one source can send to one destination */
    int64_t row_bytes;     /* row_bytes: hidden * itemsize */
    int64_t slot_bytes;    /* slot_bytes: a row's slot in a land region (TFF: with its flags) */
    int64_t out_stride;    /* out_stride: bytes between rows of recv_x */
    int64_t crow_bytes;    /* combine_row_bytes: hidden * combine_itemsize */
    int64_t tff_block;     /* tff_block_bytes: a TFF block, payload then flag */
    int64_t tff_flag;      /* tff_flag_bytes */
    uint64_t sentinel;     /* sentinel: SP's bit pattern (one element) */
    int64_t off_fail, off_entered, off_done, off_recv_ready, off_comb_info, off_barrier;
    int64_t off_doorbell, off_inbox, inbox_bytes, off_route, route_stride, route_w_off;
    int64_t off_land, land_bytes, off_out, out_bytes, off_comb, comb_bytes;
    int64_t seg_size;      /* seg_size: bytes of each rank's segment (layout.py: size_bytes) */
    int64_t timeout_ns;    /* timeout_ns: deadline of every wait of one call */
    int64_t yield_ns;      /* yield_ns: a wait yields this long before it sleeps */
    int64_t llc_bytes;     /* llc_bytes: the last-level cache (combine.c: when to prefetch) */
    int64_t sp_tail;       /* sp_check_bytes: SP's armed and polled tail of a row (0: all) */
    int quant;             /* quant: QUANT_* (rows are quantised once per token, kernels.h) */
    int quant_round;       /* quant_round_scale: UE8M0 scales */
    int background;        /* background: split-phase second halves on the background core */
    int integrity;         /* integrity: 1 = row checksums (docs/INTEGRITY.md) */
    int64_t off_rsum, rsum_bytes; /* off_rsum, rsum_bytes: the row checksum arrays (layout.py) */
    /* what this rank's calls are (set_signature; 0 until set): published in every count
     * record, and every source's must equal it (read_counts) */
    uint64_t signature;
    /* derived */
    int64_t tff_payload, tff_nblocks; /* payload bytes per TFF block, blocks per row */
    int64_t x_row_bytes;   /* a row of the caller's x: row_bytes, or hidden * itemsize when
                            * rows are quantised (row_bytes is then the quantised row) */
    uint8_t *qstage;       /* quant: [T][row_bytes] this call's quantised rows (the send source) */
    uint8_t **base;
    int *pids;
    unsigned long long *starts;
    /* scratch (max sizes) */
    int64_t *cnt;          /* [E] my counts per expert */
    int64_t *units_to;     /* [R] units I send to each rank */
    int64_t *rows_to;      /* [R] rows I send to each rank */
    int64_t *sent_to;      /* [R] the same, counted by validation on every path (the count
                            * records carry the whole vector to every rank) */
    int32_t *u_t, *u_k, *u_e, *u_slot; /* units in per-destination buckets [R * cap_src] */
    uint64_t *stamp;       /* [E] duplicate detection: stamp[e] == token generation */
    uint64_t stamp_gen;
    int64_t *my_rank_in_batch; /* [E] first batch rank of my rows of expert e at its dst */
    _Atomic int64_t *remaining; /* [R] */
    _Atomic uint64_t *dc_s1, *dc_s2; /* [R] */
    _Atomic uint64_t *counted; /* [R] epoch whose counts to each rank a count task published */
    int64_t *core_base;    /* [C][R][L] my partition start per (dst, local expert) */
    int64_t *core_ready;   /* [C][R] dst bases computed for this op (epoch) */
    int64_t *rx_base;      /* [C][R][L] receive: start of source s's rows of expert e */
    int64_t *rx_rows;      /* [C][R] receive: verified copy of each source's row count */
    uint32_t *rx_cnt;      /* [C][R][L] receive: verified copy of each source's counts */
    int64_t *tx_rows;      /* [C][R] send: verified copy of a destination's row counts */
    uint32_t *tx_cnt;      /* [C][R][L] send: verified copy of a destination's counts */
    uint32_t *route_snap;  /* [C][2 * T * K] receive: verified copy of a source's routing */
    uint32_t *route_own;   /* [nreg][2 * T * K] this rank's routing of each region's dispatch
                            * (topk_idx as int32, weights as float bits): what it publishes and
                            * reads of its own, so no byte of its segment is trusted for it */
    const void **term_ptr; /* [C][2][max(K, R)] combine: the rows one token sums, the next's */
    float *term_w;         /* [C][2][max(K, R)] and their weights */
    int64_t *ci_off, *ci_rows; /* [C][R] peers' combine data */
    int32_t *e2d, *e2l;    /* [E] owner rank and local index of each expert (no division) */
    uint64_t comb_last_epoch[2];
    /* threads */
    pthread_t *threads;
    int nthreads_started;
    _Atomic uint32_t job_gen;
    _Atomic int stopping;
    struct op *job_op;
    const struct phase_list *job_phases;
    int job_first, job_end; /* the phases of job_phases the cores run */
    /* split-phase calls not yet completed, oldest first (calls.h's call_t); their second
     * halves run on the background core, one at a time, in issue order */
    struct call *pending[MAX_PENDING];
    int npending;
    pthread_t bg_thread;
    int bg_started;
    _Atomic uint32_t bg_gen;  /* bumped to hand the background core a call (bg_op) */
    _Atomic uint32_t bg_idle; /* 1: no second half is running (futex word) */
    struct op *bg_op;
    const struct phase_list *bg_phases;
    _Atomic uint32_t *bg_done; /* the handed-over call's done word */
    _Atomic uint32_t tb_count, tb_gen;
    /* BSP with SP: the staging region must hold the sentinel wherever a peer may write.
     * Consumed rows are refilled at once; a failed call can leave rows behind: then the whole
     * region is reset before its next use, once every peer is done with the failed call. */
    int land_dirty;
    uint64_t land_dirty_epoch;
    /* SP in place (rows land in recv_x): rows [0, sp_dirty[reg]) of region reg lost their
     * sentinel in its last use; the rest still hold it. Re-armed when the region is reused. */
    int64_t sp_dirty[8];
    /* Combine copies into the segment only the rows peers pull: the rows of a receive
     * region's last dispatch that came from peers, as runs [lo, hi) (peer_runs_of: [nreg][L + 2]
     * pairs). Its own tokens' rows it reduces from the caller's expert_out where they lie.
     * index1 = dispatch index + 1 of the record (0: none), rows = rows received then. */
    struct { uint64_t index1; int64_t rows; int nruns; } peer_rows[8];
    int64_t *peer_runs;
    int in_use;            /* an operation is running (re-entrancy guard) */
    /* what each core did in the last dispatch (tests compare it with the simulator's spec):
     * core_units[c] units sent by core c, their (token * K + k) in core_unit_log[c][...];
     * core_dsts[c] count records core c published, their destinations in core_dst_log[c][...] */
    int64_t *core_units, *core_dsts;
    int32_t *core_unit_log, *core_dst_log;
    sched_work_t sched; /* the native scheduler's work space and Plan (on first use) */
    /* task spans: off (0) unless Engine.trace_enable; ring c in [0, C] holds span_cap spans,
     * span_n[c * 8] written so far (one cache line a core: no false sharing) */
    int trace_on;
    int64_t span_cap;
    span_t *spans;
    int64_t *span_n;
    int64_t trace[TRACE_SLOTS];     /* core 0's phase timestamps of the last call (ns), for profiling */
    /* Fault injection for tests (Engine.poke): once, as core 0 of the next operation of `kind`
     * reaches phase `phase` of its list, `len` bytes of `data` go to rank `rank`'s segment at
     * `off`: a third party writing a chosen record at a chosen moment. */
    struct { int armed, kind, phase, rank; int64_t off, len; uint8_t data[MAX_POKE]; } poke;
    struct fast *fast;     /* fastpath.c: what blocking calls build their results from */
} engine_t;

typedef struct op {
    engine_t *g;
    int kind; /* 0 dispatch, 1 combine */
    uint64_t epoch;
    int64_t n;    /* dispatch index (region = n % nreg) */
    int par;      /* epoch parity: which inbox / comb_info slot */
    int64_t deadline;
    int64_t start_ns; /* when the call began (its call span) */
    /* dispatch inputs */
    const uint8_t *x;     /* the rows sent: the caller's x, or the quantised rows (qstage) */
    const uint8_t *x_in;  /* the caller's x */
    int quant;            /* this call quantises x_in into qstage (ph_d_quant) */
    int64_t ntok;
    const int64_t *topk;
    /* the one-call path: the owned copy of topk_idx (the handle's), written by validation in
     * its one pass over the caller's array; op->topk then points at it */
    int64_t *topk_copy;
    const float *w;
    plan_t plan; /* ASP: the cores' tasks (calls.c reads it from ubep.sched's Plan) */
    int checked; /* topk_idx was validated by ubep.sched (the plan's units): range and
                  * duplicates are not checked twice */
    /* dispatch outputs */
    int64_t *o_idx, *o_src_rank, *o_src_tok, *o_src_k, *o_nrecv, *o_dst_row;
    float *o_w;
    int64_t n_recv;
    int published_ready;
    /* combine */
    const uint8_t *eo; int64_t eo_rows, eo_off; int zero_copy; int creg;
    const int64_t *h_idx, *h_dst_row; const float *h_w; int64_t h_ntok;
    uint8_t *y;
    _Atomic int armed; /* waits of this call that registered as sleepers on the doorbell */
    /* a second half on the background core while the caller computes: its waits sleep on the
     * doorbell at once instead of spinning and yielding (the cores are the caller's); cleared
     * when the caller's hook waits for it */
    _Atomic int patient;
    /* errors */
    _Atomic int err;
    _Atomic int abort;
    int err_core, err_peer;
    int remote_code; /* E_REMOTE: the code of the peer's notice */
    uint64_t dispatch_index; /* combine: the dispatch whose handle this call uses */
    char what[MAX_WHAT];
    char arg[64];
    char msg[MAX_MSG];
} op_t;

/* this core's verified copies of the counts (read_counts) */
#define RX_ROWS(g, core) ((g)->rx_rows + (int64_t)(core) * (g)->R)
#define RX_CNT(g, core) ((g)->rx_cnt + (int64_t)(core) * (g)->R * (g)->L)

/* addresses in the segments */
static inline word_t *word(engine_t *g, int rank, int64_t off) {
    return (word_t *)(g->base[rank] + off);
}
/* recv_ready by epoch parity (two words on one line): a rank one call ahead (a split-phase
 * call in flight) has made its next region ready while peers still send this call's rows */
static inline word_t *ready_word(engine_t *g, int rank, uint64_t epoch) {
    return (word_t *)(g->base[rank] + g->off_recv_ready) + (epoch & 1);
}
static inline inbox_rec_t *inbox(engine_t *g, int dst, int src, int par) {
    return (inbox_rec_t *)(g->base[dst] + g->off_inbox + ((int64_t)src * 2 + par) * g->inbox_bytes);
}
static inline comb_info_rec_t *comb_info(engine_t *g, int rank, int par) {
    return (comb_info_rec_t *)(g->base[rank] + g->off_comb_info) + par;
}
static inline route_rec_t *route(engine_t *g, int rank, int slot) {
    return (route_rec_t *)(g->base[rank] + g->off_route + (int64_t)slot * g->route_stride);
}
static inline uint32_t *own_route(engine_t *g, int64_t n) {
    return g->route_own + (n % g->nreg) * 2 * (int64_t)g->T * g->K;
}
static inline float *route_weights(engine_t *g, const route_rec_t *rt) {
    return (float *)((uint8_t *)rt + g->route_w_off); /* the segment is writable */
}
static inline uint8_t *land(engine_t *g, int rank, int reg) {
    /* nland is 1 (a separate land region, reused every call) or nreg (land == out) */
    return g->base[rank] + g->off_land + (int64_t)(reg % g->nland) * g->land_bytes;
}
/* integrity: rank's row checksums of receive region reg (ASP: by row of recv_x; BSP: by staging
 * slot), and of its published expert outputs of epoch parity par (by row) */
static inline uint64_t *rsum_rows(engine_t *g, int rank, int reg) {
    return (uint64_t *)(g->base[rank] + g->off_rsum + (int64_t)reg * g->rsum_bytes);
}
static inline uint64_t *rsum_comb(engine_t *g, int rank, int par) {
    return (uint64_t *)(g->base[rank] + g->off_rsum + (int64_t)(g->nreg + par) * g->rsum_bytes);
}
static inline uint8_t *outreg(engine_t *g, int rank, int reg) {
    return g->base[rank] + g->off_out + (int64_t)reg * g->out_bytes;
}
static inline int land_is_out(engine_t *g) {
    /* ASP with SW, DC or SP: senders write the final position in recv_x itself (one copy) */
    return g->eng == ENG_ASP && g->sync != SYNC_TFF;
}

typedef struct {
    int64_t start, next_live;
    uint32_t iter, seq;
    int armed;
} waiter_t;

static inline void waiter_init(waiter_t *w) {
    w->start = 0;
    w->next_live = 0;
    w->iter = 0;
    w->armed = 0;
}

/* Doorbells (an eventcount per rank): a waiter that has yielded for yield_ns registers as a
 * sleeper and blocks in the kernel on its rank's doorbell word; every publication another rank
 * may wait for rings the doorbell of the ranks concerned, and makes the wake system call only
 * if someone sleeps there. Oversubscribed ranks then stop taking CPU time from the ranks they
 * wait for (doorbell_t, abi.h). */
static inline doorbell_t *doorbell_line(engine_t *g, int rank) {
    return (doorbell_t *)(g->base[rank] + g->off_doorbell);
}
static inline _Atomic uint32_t *doorbell(engine_t *g, int rank) {
    return (_Atomic uint32_t *)&doorbell_line(g, rank)->bell;
}
static inline _Atomic uint32_t *sleepers(engine_t *g, int rank) {
    return (_Atomic uint32_t *)&doorbell_line(g, rank)->sleepers;
}
static inline void ring(engine_t *g, int d) {
    if (d == g->rank) return;
    atomic_fetch_add_explicit(doorbell(g, d), 1, memory_order_seq_cst);
    if (atomic_load_explicit(sleepers(g, d), memory_order_seq_cst))
        futex_wake_shared(doorbell(g, d), INT32_MAX);
}
static inline void ring_all(engine_t *g) {
    for (int q = 0; q < g->R; q++) ring(g, q);
}

static inline fail_rec_t *fail_block(engine_t *g, int rank, uint64_t epoch) {
    /* two notices, by epoch parity: a peer at most one call ahead never overwrites the one
     * for the call this rank is still in */
    return (fail_rec_t *)(g->base[rank] + g->off_fail) + (epoch & 1);
}

/* bucket of the i-th destination in send order */
static inline int64_t bucket_start(engine_t *g, int i) { return (int64_t)i * g->cap_src_rows; }

/* the [lo, hi) runs of region reg's peer_rows record: at most MAX_PEER_RUNS(g) pairs */
#define MAX_PEER_RUNS(g) ((g)->L + 2)
static inline int64_t *peer_runs_of(engine_t *g, int reg) {
    return g->peer_runs + (int64_t)reg * MAX_PEER_RUNS(g) * 2;
}

/* one task span of this core, if tracing is on (the one branch a task pays when it is off);
 * returns its end (0 when off): tasks back to back start where the last one ended, one clock
 * read a span */
static inline int64_t span_rec(op_t *op, int core, int kind, int64_t start_ns, int64_t unit,
                               int peer, int64_t rows, int64_t size_bytes) {
    engine_t *g = op->g;
    if (__builtin_expect(!g->trace_on, 1)) return 0;
    int64_t i = g->span_n[core * 8]++, end = now_ns();
    span_t *s = g->spans + core * g->span_cap + i % g->span_cap;
    s->start_ns = start_ns;
    s->end_ns = end;
    s->kind = kind;
    s->unit = (int32_t)unit;
    s->peer = peer;
    s->epoch = (int32_t)op->epoch;
    s->rows = rows;
    s->size_bytes = size_bytes;
    return end;
}
/* a span's start: 0 when tracing is off (no clock read) */
static inline int64_t span_t0(const engine_t *g) {
    return __builtin_expect(!g->trace_on, 1) ? 0 : now_ns();
}

#define TRACE(g, core, i) do { if ((core) == 0) (g)->trace[i] = now_ns(); } while (0)

/* the expert_padded layout: slots of one local expert's block, DeepEP's
 * num_max_dispatch_tokens_per_rank * num_ranks (layout.py: cap_rows = L * R * T) */
static inline int64_t padded_slots(const engine_t *g) { return (int64_t)g->R * g->T; }

static inline int64_t unit_pos(engine_t *g, const int64_t *bases, int e, int64_t slot) {
    return g->layout != LAY_RANK ? bases[g->e2l[e]] + slot : bases[0] + slot;
}

/* rows of source s in my region, in position order: calls the body with POS (the row's
 * position) and RANK (its rank in the source's batch). Reads this core's verified copy of the
 * counts (recv_bases), whose total recv_bases bounded by cap_rows. */
#define FOR_SOURCE_ROWS(g, core, s, rx_base, POS, RANK, ...)                               \
    do {                                                                                   \
        int64_t RANK = 0;                                                                  \
        if ((g)->layout == LAY_RANK) {                                                     \
            int64_t n_ = RX_ROWS(g, core)[s];                                              \
            for (int64_t POS = (rx_base)[(s) * (g)->L]; RANK < n_; POS++, RANK++) {        \
                __VA_ARGS__                                                                \
            }                                                                              \
        } else {                                                                           \
            for (int el_ = 0; el_ < (g)->L; el_++) {                                       \
                int64_t c_ = RX_CNT(g, core)[(int64_t)(s) * (g)->L + el_];                 \
                int64_t p0_ = (rx_base)[(s) * (g)->L + el_];                               \
                for (int64_t POS = p0_; POS < p0_ + c_; POS++, RANK++) {                   \
                    __VA_ARGS__                                                            \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    } while (0)

/* the task graphs as phase lists (phases.c), run by team.c */
/* A split-phase call (return_recv_hook) runs phases [0, split) in the caller's thread: the
 * local work (quantisation, validation, counts) and what peers need from this rank to send
 * (readiness, counts, routing; combine: the expert outputs); phases [split, num_phases) --
 * sends that wait for a destination, the receive, every wait on a peer -- run on the engine's
 * background core while the caller goes on; its hook collects the result. */
typedef struct phase_list {
    const phase_t *phase;
    int num_phases;
    int split;    /* the background core's first phase */
    int split_fg; /* without one (engine.background == 0): the caller's hook runs from here;
                   * the call itself sent what it could (waiting for destinations) */
} phase_list_t;
#define PHASE_LIST(a, split, split_fg) {(a), (int)(sizeof(a) / sizeof((a)[0])), (split), (split_fg)}
extern const phase_list_t ASP_DISPATCH, BSP_DISPATCH, ASP_COMBINE, BSP_COMBINE;

/* wait.c: errors, failure notices, liveness, waits */
int op_error(op_t *op, int code, int core, int peer, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
int bad_input(op_t *op, const char *arg, const char *value, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int check_failures(op_t *op, int core);
int wait_step(op_t *op, waiter_t *w, int core, int peer, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
int peers_done_geq(engine_t *g, uint64_t epoch);
int wait_peers_done(op_t *op, uint64_t epoch, int core);
void publish_failure(engine_t *g, uint64_t epoch, int code, const char *msg);
void format_error(op_t *op, char *buf, size_t n);

/* finish.c: the end of an operation */
void finish_op(op_t *op);

/* hooks.c: the module functions (kernels and checksums for tests and benchmarks) */
extern PyMethodDef HOOK_METHODS[];

/* team.c: the cores of a rank */
void maybe_poke(op_t *op, int phase);
int start_threads(engine_t *g);
void engine_stop(engine_t *g);
/* the background core (split-phase calls): hand it phases [split, end) of an operation and
 * return; bg_quiesce waits until it is idle (every engine method does, first) */
int bg_start(engine_t *g, op_t *op, const phase_list_t *phases, _Atomic uint32_t *done);
void bg_quiesce(engine_t *g);
void run_op(op_t *op, const phase_list_t *phases, int first, int end);

/* dispatch.c: what the BSP phases and ASP's sends (dispatch_send.c) share */
void batch_ranks(engine_t *g, int d);
void publish_counts(op_t *op, int d);
void publish_ranks(op_t *op, inbox_rec_t *ib);
int dispatch_validate(op_t *op, int count, int fill);
int dispatch_publish(op_t *op);
void reset_send_state(op_t *op);
int dst_gone(op_t *op, int core, int d);
int read_counts(op_t *op, int core, int d, int s, int64_t *rows, uint32_t *cnt);
int compute_bases(op_t *op, int core, int d, int src, int64_t *out);
/* the state a receive starts from (recv_begin): this core's row bases of every source, the
 * rows received in all, the receive region, the start of the bases' task span */
typedef struct {
    int64_t *rx_base;
    int64_t n;
    int reg;
    int64_t t0;
} recv_t;
int recv_begin(op_t *op, int core, recv_t *rv);
int recv_metadata(op_t *op, int core, int s, const int64_t *rx_base);

/* dispatch_bsp.c: the global barrier (BSP combine uses it too) */
int barrier_arrive(op_t *op, int core, int phase);
int barrier_wait(op_t *op, int core, int phase);

#pragma GCC visibility pop

#endif /* UBEP_ENGINE_H */
