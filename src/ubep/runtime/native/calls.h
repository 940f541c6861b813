/* A native call and its argument buffers, shared by the Engine's methods (calls.c) and the
 * one-call fast path of blocking calls (fastpath.c). */
#ifndef UBEP_CALLS_H
#define UBEP_CALLS_H

#include "engine.h"
#include "pybuf.h"

/* One call and the argument buffers it holds until it completes (a split-phase call holds
 * them between its two halves; the Python side keeps the arrays alive as long). */
typedef struct call {
    op_t op;
    pbuf_t b[NBUF_DISPATCH];
    /* a direct combine's arrays (combine_args_t.direct), held until the call is freed: another
     * thread may replace a handle's fields while this call runs without the GIL */
    PyObject *keep[5];
    const phase_list_t *phases;
    _Atomic uint32_t done; /* split-phase: the background core finished the second half */
} call_t;

/* The objects of one dispatch (engine.dispatch's arguments, ubep.plane.Engine). */
typedef struct {
    PyObject *x, *topk_idx, *topk_weights;
    long long num_tokens;
    unsigned long long epoch;
    long long index;
    PyObject *out[7]; /* recv_topk_idx, recv_topk_weights, recv_src_rank, recv_src_token,
                       * recv_src_k, counts (per local expert, then rows per source rank),
                       * send_dst_row */
    PyObject *plan;   /* None, ubep.sched's Plan or CoreSplit */
    int prequant;     /* x holds quantised rows already */
    /* out[0] == NULL: topk_idx, topk_weights and the outputs are memory the caller allocated
     * for this call's sizes (fastpath.c's blocks) instead of Python buffers */
    struct {
        const int64_t *topk; /* the caller's: validation copies it into topk_copy */
        int64_t *topk_copy;
        const float *w;
        int64_t *o_idx, *o_src_rank, *o_src_tok, *o_src_k, *o_nrecv, *o_dst_row;
        float *o_w;
    } direct;
} dispatch_args_t;

/* The objects of one combine (engine.combine's arguments). */
typedef struct {
    PyObject *expert_out;
    long long rows;
    PyObject *topk_idx, *topk_weights, *send_dst_row;
    long long num_tokens;
    unsigned long long epoch;
    int region;
    PyObject *y;
    unsigned long long dispatch_index;
    /* direct.y == NULL: the five arguments are any buffers, checked here. Else they are exact
     * numpy arrays of the Buffer's dtypes, C-contiguous, aligned and of the call's shapes
     * (fastpath.c checked), read at these addresses without the buffer protocol (as
     * dispatch_args_t.direct) */
    struct {
        const uint8_t *expert_out;
        const int64_t *topk_idx, *send_dst_row;
        const float *topk_weights;
        uint8_t *y;
    } direct;
} combine_args_t;

/* A call ready to run (its buffers held, sizes checked), or NULL with an exception set. */
call_t *dispatch_call(engine_t *g, const dispatch_args_t *a);
call_t *combine_call(engine_t *g, const combine_args_t *a);
/* Run a call (all of it, or with split its first half); returns engine.dispatch/combine's
 * result and frees the call unless it stays pending. */
PyObject *call_run(engine_t *g, call_t *c, int split);
void call_free(call_t *c);

/* shared with control.c: an operation's start, its error record (an ubep.plane.records.ErrorRecord), and the background core idle
 * (every method that touches the engine's state calls quiesce first) */
void op_init(op_t *op, engine_t *g, int kind, uint64_t epoch);
PyObject *error_record(op_t *op);
void quiesce(engine_t *g);

#endif /* UBEP_CALLS_H */
