/*
 * ubep native data plane (C11): the Python type and the module functions.
 *
 * One Engine per Buffer. It knows where every rank's shared-memory segment is mapped in this
 * process and runs a whole dispatch or combine in ONE call, with the GIL released: validation
 * and counting, the count exchange, the row copies straight from the caller's tensor into the
 * destination's receive slots, arrival detection (SW / TFF / DC / SP), metadata, and for
 * combine the one-pass float32 reduction over the expert outputs where they lie.
 *
 * The ABI, all that crosses between Python and C (ubep/runtime/abi.py is the Python side):
 *   - Engine(params, addresses, pids, start_times): params is a dict with exactly the keys of
 *     PARAMS (read through the {key, offsetof} table below), addresses the base address of
 *     every rank's segment in this process, pids and start times the peer processes (liveness).
 *   - Methods take arrays as C-contiguous buffers, their sizes checked against the parameters,
 *     and return their result or an error tuple (code, peer, core, argument, what: bytes,
 *     message: bytes), abi.ErrorRecord; ubep.engine.Engine documents each method.
 *   - The codes (E_*, DT_*, SYNC_*, ENG_*, LAY_*) and the offsets inside the control records
 *     are abi.h's. The module exports them (ERRORS, DTYPES, SYNCS, ENGINES, LAYOUTS, OFFSETS,
 *     PARAMS, ABI) and abi.load_native() refuses a build whose exports differ from abi.py's.
 *   - Where each record lies in a segment is ubep/runtime/layout.py's (offsets as parameters).
 *
 * The parts of the core are listed in engine.h.
 */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calls.h"
#include "fastpath.h"
#include "pybuf.h"

static PyObject *error_tuple(op_t *op) {
    int err = atomic_load(&op->err);
    char buf[MAX_MSG];
    format_error(op, buf, sizeof buf);
    /* E_REMOTE: the notice's code in the core slot; the message as bytes (a peer wrote it) */
    const char *msg = err == E_REMOTE || err == E_BAD_INPUT ? op->msg : buf;
    return Py_BuildValue("(iiisy#y#)", err, op->err_peer,
                         err == E_REMOTE ? op->remote_code : op->err_core, op->arg, op->what,
                         (Py_ssize_t)strlen(op->what), msg, (Py_ssize_t)strlen(msg));
}

/* The engine's parameters: ubep.runtime.abi.engine_params builds a dict with exactly these keys
 * (exported as PARAMS and checked at load); each value is stored into its field. */
typedef enum { P_INT, P_I64, P_U64 } param_kind_t;
typedef struct {
    const char *key;
    size_t offset;
    param_kind_t kind;
} param_t;
#define PARAM(key, field, kind) {key, offsetof(engine_t, field), kind}
static const param_t PARAMS[] = {
    PARAM("rank", rank, P_INT),
    PARAM("num_ranks", R, P_INT),
    PARAM("num_cores", C, P_INT),
    PARAM("num_experts", E, P_INT),
    PARAM("num_local_experts", L, P_INT),
    PARAM("num_topk", K, P_INT),
    PARAM("max_tokens", T, P_INT),
    PARAM("hidden", hidden, P_INT),
    PARAM("itemsize", isz, P_INT),
    PARAM("dtype", dt, P_INT),
    PARAM("combine_dtype", cdt, P_INT),
    PARAM("combine_itemsize", cisz, P_INT),
    PARAM("sync", sync, P_INT),
    PARAM("engine", eng, P_INT),
    PARAM("layout", layout, P_INT),
    PARAM("num_regions", nreg, P_INT),
    PARAM("num_land_regions", nland, P_INT),
    PARAM("threaded", threaded, P_INT),
    PARAM("cap_rows", cap_rows, P_I64),
    PARAM("cap_src_rows", cap_src_rows, P_I64),
    PARAM("row_bytes", row_bytes, P_I64),
    PARAM("slot_bytes", slot_bytes, P_I64),
    PARAM("out_stride", out_stride, P_I64),
    PARAM("combine_row_bytes", crow_bytes, P_I64),
    PARAM("tff_block_bytes", tff_block, P_I64),
    PARAM("tff_flag_bytes", tff_flag, P_I64),
    PARAM("sentinel", sentinel, P_U64),
    PARAM("off_fail", off_fail, P_I64),
    PARAM("off_entered", off_entered, P_I64),
    PARAM("off_done", off_done, P_I64),
    PARAM("off_recv_ready", off_recv_ready, P_I64),
    PARAM("off_doorbell", off_doorbell, P_I64),
    PARAM("off_comb_info", off_comb_info, P_I64),
    PARAM("off_barrier", off_barrier, P_I64),
    PARAM("off_inbox", off_inbox, P_I64),
    PARAM("inbox_bytes", inbox_bytes, P_I64),
    PARAM("off_route", off_route, P_I64),
    PARAM("route_stride", route_stride, P_I64),
    PARAM("route_w_off", route_w_off, P_I64),
    PARAM("off_land", off_land, P_I64),
    PARAM("land_bytes", land_bytes, P_I64),
    PARAM("off_out", off_out, P_I64),
    PARAM("out_bytes", out_bytes, P_I64),
    PARAM("off_comb", off_comb, P_I64),
    PARAM("comb_bytes", comb_bytes, P_I64),
    PARAM("seg_size", seg_size, P_I64),
    PARAM("timeout_ns", timeout_ns, P_I64),
    PARAM("yield_ns", yield_ns, P_I64),
    PARAM("sp_check_bytes", sp_tail, P_I64),
    PARAM("quant", quant, P_INT),
    PARAM("quant_round_scale", quant_round, P_INT),
    PARAM("background", background, P_INT),
    PARAM("llc_bytes", llc_bytes, P_I64),
};
#define NUM_PARAMS ((Py_ssize_t)(sizeof PARAMS / sizeof PARAMS[0]))

static int read_params(engine_t *g, PyObject *p) {
    for (Py_ssize_t i = 0; i < NUM_PARAMS; i++) {
        const param_t *pa = &PARAMS[i];
        PyObject *v = PyDict_GetItemString(p, pa->key);
        if (!v) {
            PyErr_Format(PyExc_KeyError, "engine parameter %s missing", pa->key);
            return -1;
        }
        long long x = PyLong_AsLongLong(v);
        if (x == -1 && PyErr_Occurred()) return -1;
        void *field = (char *)g + pa->offset;
        if (pa->kind == P_INT) {
            if (x < INT_MIN || x > INT_MAX) {
                PyErr_Format(PyExc_ValueError, "engine parameter %s=%lld out of range", pa->key,
                             x);
                return -1;
            }
            *(int *)field = (int)x;
        } else if (pa->kind == P_I64) {
            *(int64_t *)field = x;
        } else {
            *(uint64_t *)field = (uint64_t)x;
        }
    }
    if (PyDict_Size(p) != NUM_PARAMS) { /* a key the engine does not know: a stale build */
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(p, &pos, &key, &value)) {
            const char *k = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
            int known = 0;
            for (Py_ssize_t i = 0; k && i < NUM_PARAMS && !known; i++)
                known = strcmp(k, PARAMS[i].key) == 0;
            if (!known) {
                PyErr_Format(PyExc_KeyError, "engine parameter %R unknown", key);
                return -1;
            }
        }
    }
    return 0;
}

static void engine_free_scratch(engine_t *g) {
    free(g->base); free(g->pids); free(g->starts);
    free(g->cnt); free(g->units_to); free(g->rows_to);
    free(g->u_t); free(g->u_k); free(g->u_e); free(g->u_slot); free(g->stamp);
    free(g->my_rank_in_batch); free((void *)g->remaining); free((void *)g->dc_s1);
    free((void *)g->dc_s2); free(g->core_base); free(g->core_ready); free(g->rx_base);
    free(g->rx_rows); free(g->rx_cnt); free(g->tx_rows); free(g->tx_cnt);
    free(g->route_snap); free(g->ci_off); free(g->ci_rows); free(g->peer_runs);
    free(g->threads); free(g->e2d); free(g->e2l);
    free((void *)g->term_ptr); free(g->term_w);
    free((void *)g->counted); free(g->qstage);
    free(g->core_units); free(g->core_dsts); free(g->core_unit_log); free(g->core_dst_log);
    g->base = NULL;
}


static void engine_dealloc(engine_t *g) {
    Py_BEGIN_ALLOW_THREADS
    engine_stop(g);
    Py_END_ALLOW_THREADS
    while (g->npending) call_free(g->pending[--g->npending]); /* never completed: buffers */
    fast_free(g);
    engine_free_scratch(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static int engine_init(engine_t *g, PyObject *args, PyObject *kwds) {
    PyObject *p, *bases, *pids, *starts;
    (void)kwds;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyDict_Type, &p, &bases, &pids, &starts)) return -1;
    if (read_params(g, p)) return -1;
    /* 0 (or a whole row or more): every element of the row is armed and polled */
    if (g->sp_tail <= 0 || g->sp_tail >= g->row_bytes) g->sp_tail = g->row_bytes;
    if (g->isz > 1) g->sp_tail -= g->sp_tail % g->isz;
    if (g->R < 1 || g->R > 64 || g->C < 1 || g->C > 256 || g->L < 1 || g->K < 1 ||
        g->cdt < 0 || g->cdt > 2 || g->rank < 0 || g->rank >= g->R || g->nreg < 1 ||
        g->nreg > 8 || (g->nland != 1 && g->nland != g->nreg) || g->quant < QUANT_NONE ||
        g->quant > QUANT_INT8 || (g->quant && (g->dt > DT_FP32 || g->hidden % QUANT_BLOCK ||
                                               g->sync == SYNC_SP))) {
        PyErr_SetString(PyExc_ValueError, "engine: parameters out of range (num_ranks <= 64)");
        return -1;
    }
    g->x_row_bytes = g->quant ? (int64_t)g->hidden * g->isz : g->row_bytes;
    g->tff_payload = g->tff_block - g->tff_flag;
    g->tff_nblocks = g->tff_payload > 0 ? (g->row_bytes + g->tff_payload - 1) / g->tff_payload : 0;
    if (!PySequence_Check(bases) || PySequence_Size(bases) != g->R ||
        PySequence_Size(pids) != g->R || PySequence_Size(starts) != g->R) {
        PyErr_SetString(PyExc_ValueError, "engine: bases/pids/starts need one entry per rank");
        return -1;
    }
    const int R = g->R, C = g->C, L = g->L, E = g->E;
    g->base = calloc((size_t)R, sizeof(uint8_t *));
    g->pids = calloc((size_t)R, sizeof(int));
    g->starts = calloc((size_t)R, sizeof(unsigned long long));
    g->cnt = calloc((size_t)E, sizeof(int64_t));
    g->units_to = calloc((size_t)R, sizeof(int64_t));
    g->rows_to = calloc((size_t)R, sizeof(int64_t));
    const int64_t UB = (int64_t)R * g->cap_src_rows + 1;
    g->u_t = calloc((size_t)UB, 4); g->u_k = calloc((size_t)UB, 4);
    g->u_e = calloc((size_t)UB, 4); g->u_slot = calloc((size_t)UB, 4);
    g->stamp = calloc((size_t)E, sizeof(uint64_t));
    g->my_rank_in_batch = calloc((size_t)E, sizeof(int64_t));
    g->remaining = calloc((size_t)R, sizeof(int64_t));
    g->dc_s1 = calloc((size_t)R, sizeof(uint64_t));
    g->dc_s2 = calloc((size_t)R, sizeof(uint64_t));
    int64_t big = (int64_t)R * L > E ? (int64_t)R * L : E;
    g->core_base = calloc((size_t)(C * big + R), sizeof(int64_t));
    g->core_ready = calloc((size_t)C * R, sizeof(int64_t));
    g->rx_base = calloc((size_t)(C * big + R), sizeof(int64_t));
    g->rx_rows = calloc((size_t)C * R, sizeof(int64_t));
    g->rx_cnt = calloc((size_t)C * R * L, sizeof(uint32_t));
    g->tx_rows = calloc((size_t)C * R, sizeof(int64_t));
    g->tx_cnt = calloc((size_t)C * R * L, sizeof(uint32_t));
    g->route_snap = calloc((size_t)C * 2 * (size_t)(g->T * g->K) + 1, sizeof(uint32_t));
    g->ci_off = calloc((size_t)C * R, 8); g->ci_rows = calloc((size_t)C * R, 8);
    g->peer_runs = calloc((size_t)g->nreg * (size_t)MAX_PEER_RUNS(g) * 2, sizeof(int64_t));
    g->e2d = calloc((size_t)E, sizeof(int32_t)); g->e2l = calloc((size_t)E, sizeof(int32_t));
    int maxt = g->K > R ? g->K : R;
    g->term_ptr = calloc((size_t)C * 2 * maxt, sizeof(void *)); /* 2: this token's, the next's */
    g->term_w = calloc((size_t)C * 2 * maxt, sizeof(float));
    g->counted = calloc((size_t)R, sizeof(uint64_t));
    g->qstage = calloc(g->quant ? (size_t)g->T * (size_t)g->row_bytes + 1 : 1, 1);
    g->core_units = calloc((size_t)C, sizeof(int64_t));
    g->core_dsts = calloc((size_t)C, sizeof(int64_t));
    g->core_unit_log = calloc((size_t)C * (size_t)(g->T * g->K) + 1, sizeof(int32_t));
    g->core_dst_log = calloc((size_t)C * R, sizeof(int32_t));
    if (g->e2d && g->e2l)
        for (int e = 0; e < E; e++) { g->e2d[e] = e / L; g->e2l[e] = e % L; }
    const void *scratch[] = {
        g->base, g->pids, g->starts, g->cnt, g->units_to, g->rows_to, g->u_t, g->u_k, g->u_e,
        g->u_slot, g->stamp, g->my_rank_in_batch, (const void *)g->remaining,
        (const void *)g->dc_s1, (const void *)g->dc_s2, g->core_base, g->core_ready, g->rx_base,
        g->rx_rows, g->rx_cnt, g->tx_rows, g->tx_cnt, g->route_snap, g->ci_off, g->ci_rows,
        g->e2d, g->e2l, (const void *)g->term_ptr, g->term_w, (const void *)g->counted, g->qstage, g->core_units,
        g->core_dsts, g->core_unit_log, g->core_dst_log, g->peer_runs,
    };
    int missing = 0;
    for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; i++) missing |= !scratch[i];
    if (missing) {
        PyErr_NoMemory();
        return -1;
    }
    for (int r = 0; r < R; r++) {
        PyObject *b = PySequence_GetItem(bases, r), *pi = PySequence_GetItem(pids, r),
                 *st = PySequence_GetItem(starts, r);
        if (!b || !pi || !st) { Py_XDECREF(b); Py_XDECREF(pi); Py_XDECREF(st); return -1; }
        g->base[r] = (uint8_t *)PyLong_AsVoidPtr(b);
        g->pids[r] = (int)PyLong_AsLong(pi);
        g->starts[r] = PyLong_AsUnsignedLongLong(st);
        Py_DECREF(b); Py_DECREF(pi); Py_DECREF(st);
        if (PyErr_Occurred()) return -1;
    }
    if (start_threads(g)) {
        PyErr_SetString(PyExc_OSError, "engine: could not start worker threads");
        return -1;
    }
    return 0;
}

static void op_init(op_t *op, engine_t *g, int kind, uint64_t epoch) {
    memset(op, 0, sizeof *op);
    op->g = g;
    op->kind = kind;
    op->epoch = epoch;
    op->par = (int)(epoch & 1);
    op->deadline = now_ns() + g->timeout_ns;
    op->err_peer = -1;
}

/* an int64 (itemsize 8) array attribute of the plan, at least n elements */
static int plan_array(PyObject *plan, const char *name, pbuf_t *pb, int64_t n,
                      const int64_t **out) {
    PyObject *a = PyObject_GetAttrString(plan, name);
    if (!a) return -1;
    char what[48];
    snprintf(what, sizeof what, "plan.%s", name);
    int rc = get_buf(a, pb, 0, what, n * 8);
    Py_DECREF(a); /* the buffer holds its own reference */
    if (!rc && pb->b.itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "%s must be int64", what);
        rc = -1;
    }
    if (!rc) *out = pb->b.buf;
    return rc;
}

static int plan_int(PyObject *plan, const char *name, int lo, int hi, int *out) {
    PyObject *a = PyObject_GetAttrString(plan, name);
    if (!a) return -1;
    long v = PyLong_AsLong(a);
    Py_DECREF(a);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "plan.%s = %ld out of range [%d, %d]", name, v, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* The Plan of ubep.sched (or its CoreSplit: the core split without units) into op->plan, read
 * by field name; the unit arrays are bounds-checked (they index x, topk_idx and peers' rows). */
static int read_plan(PyObject *plan, op_t *op, pbuf_t *b) {
    engine_t *g = op->g;
    plan_t *p = &op->plan;
    int64_t T = op->ntok, K = g->K;
    if (plan_int(plan, "num_send_cores", 1, 1 << 16, &p->num_send_cores) ||
        plan_int(plan, "num_count_cores", 1, 1 << 16, &p->num_count_cores) ||
        plan_array(plan, "count_expert_ptr", &b[0], p->num_count_cores + 1, &p->count_expert_ptr))
        return -1;
    if (!PyObject_HasAttrString(plan, "core_ptr")) return 0; /* a CoreSplit */
    if (plan_array(plan, "core_ptr", &b[1], p->num_send_cores + 1, &p->core_ptr)) return -1;
    int64_t nu = p->core_ptr[p->num_send_cores];
    if (nu < 0 || nu > T * K) {
        PyErr_SetString(PyExc_ValueError, "plan: bad unit count");
        return -1;
    }
    if (plan_array(plan, "send_token", &b[2], nu, &p->token) ||
        plan_array(plan, "send_k", &b[3], nu, &p->k) ||
        plan_array(plan, "send_expert", &b[4], nu, &p->expert) ||
        plan_array(plan, "send_dst_rank", &b[5], nu, &p->dst_rank) ||
        plan_array(plan, "send_hop", &b[6], nu, &p->hop) ||
        plan_array(plan, "send_slot", &b[7], nu, &p->slot))
        return -1;
    for (int j = 0; j < p->num_send_cores; j++)
        if (p->core_ptr[j] > p->core_ptr[j + 1] || p->core_ptr[j] < 0) {
            PyErr_SetString(PyExc_ValueError, "plan: core_ptr not non-decreasing");
            return -1;
        }
    for (int64_t u = 0; u < nu; u++)
        if (p->dst_rank[u] < 0 || p->dst_rank[u] >= g->R || p->expert[u] < 0 ||
            p->expert[u] >= g->E || p->token[u] < 0 || p->token[u] >= T || p->k[u] < 0 ||
            p->k[u] >= K || p->slot[u] < 0 || p->slot[u] >= g->cap_src_rows ||
            g->e2d[p->expert[u]] != p->dst_rank[u]) {
            PyErr_SetString(PyExc_ValueError, "plan: a unit out of range");
            return -1;
        }
    p->have_units = 1;
    op->checked = 1; /* ubep.sched validated topk_idx when it built these units */
    return 0;
}


/* the background core idle, with the GIL released (every method that touches the engine's
 * state calls this first: a second half may still be running) */
static void quiesce(engine_t *g) {
    if (!g->bg_started || atomic_load(&g->bg_idle)) return;
    Py_BEGIN_ALLOW_THREADS
    bg_quiesce(g);
    Py_END_ALLOW_THREADS
}

/* a split-phase call's second half is done (the background core ran it) */
static void wait_call(call_t *c) {
    if (atomic_load(&c->done)) return;
    Py_BEGIN_ALLOW_THREADS
    while (!atomic_load(&c->done)) {
        struct timespec ts = {0, 1000000};
        futex_wait(&c->done, 0, &ts);
    }
    Py_END_ALLOW_THREADS
}

void call_free(call_t *c) {
    rel_bufs(c->b, NBUF_DISPATCH);
    for (int i = 0; i < 5; i++) Py_XDECREF(c->keep[i]);
    free(c);
}

/* the result of a finished call (frees it): rows received (dispatch) or whether the expert
 * outputs were used in place (combine), or the error tuple */
static PyObject *call_result(call_t *c) {
    op_t *op = &c->op;
    PyObject *res = atomic_load(&op->err) ? error_tuple(op)
                    : op->kind == 0        ? PyLong_FromLongLong(op->n_recv)
                                           : PyLong_FromLong(op->zero_copy);
    call_free(c);
    return res;
}

/* Run a call: all of it, or (split) its first half -- the local work, and what peers need
 * from this rank -- after which the background core runs the rest while the caller goes on,
 * and the call waits in g->pending for complete(); a first half that failed has finished the
 * call (its notice is out). */
PyObject *call_run(engine_t *g, call_t *c, int split) {
    op_t *op = &c->op;
    if (split && g->npending == MAX_PENDING) {
        call_free(c);
        PyErr_SetString(PyExc_RuntimeError, "engine: too many split-phase calls in flight");
        return NULL;
    }
    quiesce(g); /* the previous call's second half uses the engine's state */
    int end = !split ? c->phases->num_phases : g->background ? c->phases->split
                                                              : c->phases->split_fg;
    g->in_use = 1;
    Py_BEGIN_ALLOW_THREADS
    run_op(op, c->phases, 0, end);
    if (split && g->background) {
        atomic_store(&op->patient, 1);
        if (!atomic_load(&op->err) && bg_start(g, op, c->phases, &c->done)) {
            run_op(op, c->phases, end, c->phases->num_phases); /* no thread: the rest here */
            split = 0;
        }
    }
    if (!split || atomic_load(&op->err)) finish_op(op);
    Py_END_ALLOW_THREADS
    g->in_use = 0;
    if (split && !atomic_load(&op->err)) {
        g->pending[g->npending++] = c;
        Py_RETURN_NONE;
    }
    return call_result(c);
}

/* the oldest pending call, if it is call `epoch` (calls complete in issue order: a finished
 * call's `done` word says every earlier call is finished too) */
static call_t *oldest_pending(engine_t *g, unsigned long long epoch) {
    if (!g->npending || g->pending[0]->op.epoch != epoch) {
        PyErr_Format(PyExc_ValueError, "engine: call %llu is not the oldest call in flight", epoch);
        return NULL;
    }
    call_t *c = g->pending[0];
    for (int i = 1; i < g->npending; i++) g->pending[i - 1] = g->pending[i];
    g->npending--;
    return c;
}

/* complete(epoch) -> result of dispatch / combine | error tuple: the oldest split-phase call,
 * once the background core has run its second half */
static PyObject *engine_complete(engine_t *g, PyObject *args) {
    unsigned long long epoch;
    if (!PyArg_ParseTuple(args, "K", &epoch)) return NULL;
    if (g->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "engine: another call is in progress on this buffer");
        return NULL;
    }
    call_t *c = oldest_pending(g, epoch);
    if (!c) return NULL;
    if (!g->background) { /* the caller runs the second half, here */
        op_t *op = &c->op;
        op->deadline = now_ns() + g->timeout_ns; /* the hook may come late */
        g->in_use = 1;
        Py_BEGIN_ALLOW_THREADS
        run_op(op, c->phases, c->phases->split_fg, c->phases->num_phases);
        finish_op(op);
        Py_END_ALLOW_THREADS
        g->in_use = 0;
        return call_result(c);
    }
    atomic_store(&c->op.patient, 0); /* the caller waits now: the background core may spin */
    wait_call(c);
    return call_result(c);
}

/* abandon(epoch, message): the oldest split-phase call fails here without its second half (the
 * Buffer lost step, or closes): its notice tells peers, its buffers are released */
static PyObject *engine_abandon(engine_t *g, PyObject *args) {
    unsigned long long epoch;
    const char *msg;
    if (!PyArg_ParseTuple(args, "Ks", &epoch, &msg)) return NULL;
    call_t *c = oldest_pending(g, epoch);
    if (!c) return NULL;
    if (!g->background) { /* its second half never ran: it fails here */
        snprintf(c->op.what, sizeof c->op.what, "%s", msg);
        atomic_store(&c->op.err, E_LOST);
        Py_BEGIN_ALLOW_THREADS
        finish_op(&c->op);
        Py_END_ALLOW_THREADS
        call_free(c);
        Py_RETURN_NONE;
    }
    wait_call(c); /* its second half ran (or failed) on the background core */
    if (!atomic_load(&c->op.err)) {
        /* it completed here, but this rank lost step: peers still in it fail too */
        Py_BEGIN_ALLOW_THREADS
        publish_failure(g, epoch, E_LOST, msg);
        Py_END_ALLOW_THREADS
    }
    call_free(c);
    Py_RETURN_NONE;
}

/* dispatch(x, topk_idx, topk_weights, num_tokens, epoch, index, recv_topk_idx,
 *          recv_topk_weights, recv_src_rank, recv_src_token, recv_src_k, counts, send_dst_row,
 *          plan, split) -> rows received | None (split: the first half ran, complete() runs
 *          the rest) | error tuple; plan: None (one core), ubep.sched's Plan or CoreSplit
 *          (read_plan) */
static PyObject *engine_dispatch(engine_t *g, PyObject *args) {
    dispatch_args_t a;
    PyObject **o = a.out;
    int split = 0;
    a.prequant = 0;
    if (!PyArg_ParseTuple(args, "OOOLKLOOOOOOOO|pp", &a.x, &a.topk_idx, &a.topk_weights,
                          &a.num_tokens, &a.epoch, &a.index, &o[0], &o[1], &o[2], &o[3], &o[4],
                          &o[5], &o[6], &a.plan, &split, &a.prequant))
        return NULL;
    call_t *c = dispatch_call(g, &a);
    return c ? call_run(g, c, split) : NULL;
}

static int dispatch_bufs(engine_t *g, const dispatch_args_t *a, pbuf_t *b, int64_t ntok);

call_t *dispatch_call(engine_t *g, const dispatch_args_t *a) {
    if (a->prequant && !g->quant) {
        PyErr_SetString(PyExc_ValueError, "engine: quantised rows need a quantising engine");
        return NULL;
    }
    const int quant = g->quant && !a->prequant; /* this call quantises x */
    if (g->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "engine: another call is in progress on this buffer");
        return NULL;
    }
    const long long ntok = a->num_tokens;
    if (ntok < 0 || ntok > g->T || a->index < 0) {
        PyErr_SetString(PyExc_ValueError, "engine: num_tokens or dispatch index out of range");
        return NULL;
    }
    call_t *c = calloc(1, sizeof(call_t));
    if (!c) return (call_t *)PyErr_NoMemory();
    pbuf_t *b = c->b;
    PyObject *const *o = a->out;
    if (get_buf(a->x, &b[0], 0, "x", ntok * (quant ? g->x_row_bytes : g->row_bytes)) ||
        (o[0] && dispatch_bufs(g, a, b, ntok))) {
        call_free(c);
        return NULL;
    }
    op_t *op = &c->op;
    op_init(op, g, 0, a->epoch);
    op->n = a->index;
    op->x_in = b[0].b.buf; op->ntok = ntok;
    op->x = quant ? g->qstage : op->x_in; /* quantised rows: the quant phase fills them */
    if (o[0]) {
        op->topk = b[1].b.buf; op->w = b[2].b.buf;
        op->o_idx = b[3].b.buf; op->o_w = b[4].b.buf; op->o_src_rank = b[5].b.buf;
        op->o_src_tok = b[6].b.buf; op->o_src_k = b[7].b.buf; op->o_nrecv = b[8].b.buf;
        op->o_dst_row = b[9].b.buf;
    } else {
        op->topk = a->direct.topk; op->w = a->direct.w;
        op->o_idx = a->direct.o_idx; op->o_w = a->direct.o_w;
        op->o_src_rank = a->direct.o_src_rank; op->o_src_tok = a->direct.o_src_tok;
        op->o_src_k = a->direct.o_src_k; op->o_nrecv = a->direct.o_nrecv;
        op->o_dst_row = a->direct.o_dst_row;
    }
    if (a->plan != Py_None && read_plan(a->plan, op, &b[10])) {
        call_free(c);
        return NULL;
    }
    op->quant = quant;
    c->phases = g->eng == ENG_ASP ? &ASP_DISPATCH : &BSP_DISPATCH;
    return c;
}

/* the routing and output buffers of a dispatch given as Python objects */
static int dispatch_bufs(engine_t *g, const dispatch_args_t *a, pbuf_t *b, int64_t ntok) {
    const int K = g->K;
    PyObject *const *o = a->out;
    int64_t nrows = g->cap_rows;
    int64_t dst_w = g->layout == LAY_EXPERT ? K : g->R;
    int64_t meta_w = g->layout == LAY_EXPERT ? 1 : K;
    return get_buf(a->topk_idx, &b[1], 0, "topk_idx", ntok * K * 8) ||
        get_buf(a->topk_weights, &b[2], 0, "topk_weights", ntok * K * 4) ||
        get_buf(o[0], &b[3], 1, "recv_topk_idx", nrows * meta_w * 8) ||
        get_buf(o[1], &b[4], 1, "recv_topk_weights", nrows * meta_w * 4) ||
        get_buf(o[2], &b[5], 1, "recv_src_rank", nrows * 8) ||
        get_buf(o[3], &b[6], 1, "recv_src_token", nrows * 8) ||
        get_buf(o[4], &b[7], 1, "recv_src_k", nrows * 8) ||
        get_buf(o[5], &b[8], 1, "num_recv_tokens_per_expert", (g->L + g->R) * 8) ||
        get_buf(o[6], &b[9], 1, "send_dst_row", ntok * dst_w * 8);
}

/* combine(expert_out, num_rows, topk_idx, topk_weights, send_dst_row, num_tokens, epoch,
 *         region, y, dispatch_index, split) -> 1 if expert_out was used in place, else 0 |
 *         None (split, as dispatch) | error tuple; every rank must name the same dispatch */
static PyObject *engine_combine(engine_t *g, PyObject *args) {
    combine_args_t a = {0};
    int split = 0;
    if (!PyArg_ParseTuple(args, "OLOOOLKiOK|p", &a.expert_out, &a.rows, &a.topk_idx,
                          &a.topk_weights, &a.send_dst_row, &a.num_tokens, &a.epoch, &a.region,
                          &a.y, &a.dispatch_index, &split))
        return NULL;
    call_t *c = combine_call(g, &a);
    return c ? call_run(g, c, split) : NULL;
}

call_t *combine_call(engine_t *g, const combine_args_t *a) {
    if (g->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "engine: another call is in progress on this buffer");
        return NULL;
    }
    const int K = g->K;
    const long long rows = a->rows, ntok = a->num_tokens;
    int64_t dst_w = g->layout == LAY_EXPERT ? K : g->R;
    if (rows < 0 || rows > g->cap_rows || ntok < 0 || ntok > g->T || a->region < 0 ||
        a->region > 1) {
        PyErr_SetString(PyExc_ValueError, "engine: combine sizes out of range");
        return NULL;
    }
    call_t *c = calloc(1, sizeof(call_t));
    if (!c) return (call_t *)PyErr_NoMemory();
    pbuf_t *b = c->b;
    PyObject *arr[5] = {a->expert_out, a->topk_idx, a->topk_weights, a->send_dst_row, a->y};
    if (a->direct.y) {
        for (int i = 0; i < 5; i++) c->keep[i] = Py_NewRef(arr[i]);
    } else if (get_buf(arr[0], &b[0], 0, "expert_out", rows * g->crow_bytes) ||
               get_buf(arr[1], &b[1], 0, "handle.topk_idx", ntok * K * 8) ||
               get_buf(arr[2], &b[2], 0, "handle.topk_weights", ntok * K * 4) ||
               get_buf(arr[3], &b[3], 0, "handle.send_dst_row", ntok * dst_w * 8) ||
               get_buf(arr[4], &b[4], 1, "y", ntok * g->hidden * g->cisz)) {
        call_free(c);
        return NULL;
    }
    op_t *op = &c->op;
    op_init(op, g, 1, a->epoch);
    op->dispatch_index = a->dispatch_index;
    if (a->direct.y) {
        op->eo = a->direct.expert_out; op->h_idx = a->direct.topk_idx;
        op->h_w = a->direct.topk_weights; op->h_dst_row = a->direct.send_dst_row;
        op->y = a->direct.y;
    } else {
        op->eo = b[0].b.buf; op->h_idx = b[1].b.buf; op->h_w = b[2].b.buf;
        op->h_dst_row = b[3].b.buf; op->y = b[4].b.buf;
    }
    op->eo_rows = rows;
    op->creg = a->region;
    uintptr_t mine = (uintptr_t)g->base[g->rank], at = (uintptr_t)op->eo;
    uint64_t end = at + (uint64_t)rows * (uint64_t)g->crow_bytes;
    if (at >= mine + HEADER_BYTES && end <= mine + (uint64_t)g->seg_size) {
        op->zero_copy = 1; /* the expert outputs already live in this rank's segment */
        op->eo_off = (int64_t)(at - mine);
    } else {
        op->eo_off = g->off_comb + (int64_t)a->region * g->comb_bytes;
    }
    op->h_ntok = ntok;
    c->phases = g->eng == ENG_ASP ? &ASP_COMBINE : &BSP_COMBINE;
    return c;
}

/* fail(epoch, code, message, finished, timeout_s) -> 0 | 1 | error tuple: publish "call `epoch`
 * failed here" for a call rejected before the native code ran (finished=1: this rank is done
 * with it), or, finished=0, tell peers ahead of time that the next call cannot run here (a
 * Buffer that lost step). The notice slot of `epoch` last held the notice of `epoch - 2`: it
 * is written only once every peer has finished that call, waiting at most timeout_s (0: do not
 * wait; then nothing is published and the result is 1). */
static PyObject *engine_fail(engine_t *g, PyObject *args) {
    quiesce(g);
    unsigned long long epoch;
    int code, finished;
    const char *msg;
    double timeout;
    if (!PyArg_ParseTuple(args, "Kisid", &epoch, &code, &msg, &finished, &timeout)) return NULL;
    if (code < E_BAD_INPUT || code > E_LOST) {
        PyErr_SetString(PyExc_ValueError, "engine.fail: code out of range");
        return NULL;
    }
    op_t *op = calloc(1, sizeof(op_t));
    if (!op) return PyErr_NoMemory();
    op_init(op, g, 2, epoch);
    op->deadline = now_ns() + (int64_t)(timeout * 1e9);
    int rc = 0;
    uint64_t credit = epoch >= 2 ? epoch - 2 : 0;
    Py_BEGIN_ALLOW_THREADS
    if (timeout > 0) {
        rc = wait_peers_done(op, credit, 0);
    } else if (!peers_done_geq(g, credit)) {
        rc = -1;
    }
    if (!rc) {
        publish_failure(g, epoch, code, msg);
        if (finished) {
            pub_word(word(g, g->rank, g->off_done), epoch);
            ring_all(g);
        }
    }
    int armed = atomic_load(&op->armed);
    if (armed) atomic_fetch_sub(sleepers(g, g->rank), (uint32_t)armed);
    Py_END_ALLOW_THREADS
    PyObject *res = rc > 0 ? error_tuple(op) : PyLong_FromLong(rc ? 1 : 0);
    free(op);
    return res;
}

/* resync(base_epoch): forget every call before `base_epoch` (local; Buffer.resync runs it on
 * every rank between two group-wide exchanges, so no peer is inside a call and nobody writes
 * this segment meanwhile). Control records of this rank's segment are cleared, progress words
 * say "finished everything before base_epoch", SP regions are re-armed. */
static PyObject *engine_resync(engine_t *g, PyObject *args) {
    quiesce(g);
    unsigned long long base;
    if (!PyArg_ParseTuple(args, "K", &base)) return NULL;
    if (base < 2) {
        PyErr_SetString(PyExc_ValueError, "engine.resync: base_epoch must be >= 2");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *me = g->base[g->rank];
    memset(me + g->off_fail, 0, 2 * sizeof(fail_rec_t));
    memset(me + g->off_comb_info, 0, 2 * sizeof(comb_info_rec_t));
    memset(me + g->off_barrier, 0, (size_t)g->C * LINE_BYTES);
    memset(me + g->off_inbox, 0, (size_t)(g->R * 2 * g->inbox_bytes));
    for (int reg = 0; reg < g->nreg; reg++) memset(route(g, g->rank, reg), 0, sizeof(route_rec_t));
    pub_word(word(g, g->rank, g->off_entered), (base - 1) << 2);
    pub_word(word(g, g->rank, g->off_done), base - 1);
    pub_word(ready_word(g, g->rank, 0), 0);
    pub_word(ready_word(g, g->rank, 1), 0);
    atomic_store(sleepers(g, g->rank), 0);
    if (g->sync == SYNC_SP) reset_land(g);
    g->land_dirty = 0;
    memset(g->sp_dirty, 0, sizeof g->sp_dirty);
    g->comb_last_epoch[0] = g->comb_last_epoch[1] = 0;
    memset(g->peer_rows, 0, sizeof g->peer_rows);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* wait_done(epoch, timeout_s) -> 0 | error tuple: every peer has finished call `epoch` */
static PyObject *engine_wait_done(engine_t *g, PyObject *args) {
    quiesce(g);
    unsigned long long epoch;
    double timeout;
    if (!PyArg_ParseTuple(args, "Kd", &epoch, &timeout)) return NULL;
    op_t *op = calloc(1, sizeof(op_t));
    if (!op) return PyErr_NoMemory();
    op_init(op, g, 2, epoch); /* kind 2: waits ignore failure notices */
    op->deadline = now_ns() + (int64_t)(timeout * 1e9);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = wait_peers_done(op, epoch, 0);
    int armed = atomic_load(&op->armed);
    if (armed) atomic_fetch_sub(sleepers(g, g->rank), (uint32_t)armed);
    Py_END_ALLOW_THREADS
    PyObject *res = rc ? error_tuple(op) : PyLong_FromLong(0);
    free(op);
    return res;
}

/* reset_all(): fill the SP land region(s) with the sentinel (construction) */
static PyObject *engine_reset_all(engine_t *g, PyObject *noargs) {
    quiesce(g);
    (void)noargs;
    if (g->sync != SYNC_SP) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    reset_land(g);
    g->land_dirty = 0;
    memset(g->sp_dirty, 0, sizeof g->sp_dirty);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *engine_trace(engine_t *g, PyObject *noargs) {
    quiesce(g);
    (void)noargs;
    PyObject *t = PyTuple_New(16);
    if (!t) return NULL;
    for (int i = 0; i < 16; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(g->trace[i]));
    return t;
}

static PyObject *engine_comb_last_epoch(engine_t *g, PyObject *args) {
    quiesce(g);
    int c;
    if (!PyArg_ParseTuple(args, "i", &c)) return NULL;
    if (c < 0 || c > 1) { PyErr_SetString(PyExc_ValueError, "region"); return NULL; }
    return PyLong_FromUnsignedLongLong(g->comb_last_epoch[c]);
}

static PyObject *engine_close(engine_t *g, PyObject *noargs) {
    quiesce(g);
    (void)noargs;
    Py_BEGIN_ALLOW_THREADS
    engine_stop(g);
    Py_END_ALLOW_THREADS
    fast_free(g); /* its views of the receive regions must not keep the segments mapped */
    Py_RETURN_NONE;
}

/* ([units of core c: token * K + k, in the order sent], [destinations whose counts core c
 * published, in order]) per core, of the last dispatch */
static PyObject *engine_core_log(engine_t *g, PyObject *noargs) {
    quiesce(g);
    (void)noargs;
    PyObject *units = PyList_New(g->C), *dsts = PyList_New(g->C);
    if (!units || !dsts) goto fail;
    for (int c = 0; c < g->C; c++) {
        PyObject *u = PyList_New(g->core_units[c]), *d = PyList_New(g->core_dsts[c]);
        if (!u || !d) { Py_XDECREF(u); Py_XDECREF(d); goto fail; }
        for (int64_t i = 0; i < g->core_units[c]; i++)
            PyList_SET_ITEM(u, i, PyLong_FromLong(g->core_unit_log[(int64_t)c * g->T * g->K + i]));
        for (int64_t i = 0; i < g->core_dsts[c]; i++)
            PyList_SET_ITEM(d, i, PyLong_FromLong(g->core_dst_log[(int64_t)c * g->R + i]));
        PyList_SET_ITEM(units, c, u);
        PyList_SET_ITEM(dsts, c, d);
    }
    return Py_BuildValue("(NN)", units, dsts);
fail:
    Py_XDECREF(units);
    Py_XDECREF(dsts);
    return NULL;
}

static PyMethodDef engine_methods[] = {
    {"core_log", (PyCFunction)engine_core_log, METH_NOARGS,
     "per core: the units it sent and the count records it published in the last dispatch"},
    {"dispatch", (PyCFunction)engine_dispatch, METH_VARARGS, "one dispatch (ubep.engine.Engine)"},
    {"combine", (PyCFunction)engine_combine, METH_VARARGS, "one combine (ubep.engine.Engine)"},
    {"set_fast", (PyCFunction)engine_set_fast, METH_VARARGS,
     "what blocking calls build their results from (fastpath.c)"},
    {"dispatch_fast", (PyCFunction)engine_dispatch_fast, METH_VARARGS,
     "a whole blocking dispatch in one call: its DispatchResult, an error tuple or None"},
    {"combine_fast", (PyCFunction)engine_combine_fast, METH_VARARGS,
     "a whole blocking combine in one call: y, an error tuple or None"},
    {"complete", (PyCFunction)engine_complete, METH_VARARGS,
     "the second half of the oldest split-phase call"},
    {"abandon", (PyCFunction)engine_abandon, METH_VARARGS,
     "fail the oldest split-phase call without its second half"},
    {"fail", (PyCFunction)engine_fail, METH_VARARGS, "publish a failure notice"},
    {"resync", (PyCFunction)engine_resync, METH_VARARGS, "forget every call before an epoch"},
    {"wait_done", (PyCFunction)engine_wait_done, METH_VARARGS, "wait for peers' progress"},
    {"reset_all", (PyCFunction)engine_reset_all, METH_NOARGS, "SP: fill regions with sentinel"},
    {"comb_last_epoch", (PyCFunction)engine_comb_last_epoch, METH_VARARGS,
     "epoch of the last combine that used combine region c"},
    {"close", (PyCFunction)engine_close, METH_NOARGS, "stop worker threads"},
    {"trace", (PyCFunction)engine_trace, METH_NOARGS,
     "core 0's phase timestamps (CLOCK_MONOTONIC ns) of the last dispatch, for profiling"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ubep.runtime._native.Engine",
    .tp_basicsize = sizeof(engine_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)engine_init,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_methods = engine_methods,
    .tp_doc = "Native dispatch/combine engine of one Buffer.",
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native", "ubep native data plane (C11).", -1, HOOK_METHODS,
    NULL, NULL, NULL, NULL,
};

/* ---------------------------------------------------------------------------------------- */
/* What the module exports of the ABI (ubep.runtime.abi compares it with its own at load) */

typedef struct {
    const char *name;
    long long value;
} named_t;
#define NAMED_LEN(a) (sizeof(a) / sizeof((a)[0]))
static const named_t ERROR_CODES[] = {
    {"ok", E_OK}, {"bad_input", E_BAD_INPUT}, {"timeout", E_TIMEOUT}, {"peer_lost", E_PEER_LOST},
    {"remote", E_REMOTE}, {"internal", E_INTERNAL}, {"lost", E_LOST},
};
static const named_t DTYPE_CODES[] = {
    {"bf16", DT_BF16}, {"fp16", DT_FP16}, {"fp32", DT_FP32}, {"int8", DT_INT8},
    {"uint8", DT_UINT8},
};
static const named_t SYNC_CODES[] = {
    {"sw", SYNC_SW}, {"tff", SYNC_TFF}, {"dc", SYNC_DC}, {"sp", SYNC_SP},
};
static const named_t ENGINE_CODES[] = {{"asp", ENG_ASP}, {"bsp", ENG_BSP}};
static const named_t LAYOUT_CODES[] = {{"expert", LAY_EXPERT}, {"rank", LAY_RANK}};
static const named_t QUANT_CODES[] = {
    {"none", QUANT_NONE}, {"e4m3", QUANT_E4M3}, {"int8", QUANT_INT8}};
#define AT(name, rec, field) {name, (long long)offsetof(rec, field)}
static const named_t RECORD_OFFSETS[] = {
    {"HEADER_BYTES", HEADER_BYTES},
    {"LINE_BYTES", LINE_BYTES},
    AT("WORD_CHECK", word_t, check),
    AT("DOORBELL_SLEEPERS", doorbell_t, sleepers),
    AT("IN_COUNTS_EPOCH", inbox_rec_t, counts_epoch),
    AT("IN_ROWS", inbox_rec_t, rows),
    AT("IN_SUM", inbox_rec_t, sum),
    AT("IN_SW_COUNT", inbox_rec_t, sw_count),
    AT("IN_SW_EPOCH", inbox_rec_t, sw_epoch),
    AT("IN_DC_COUNT", inbox_rec_t, dc_count),
    AT("IN_DC_SUM", inbox_rec_t, dc_sum),
    AT("IN_DC_EPOCH", inbox_rec_t, dc_epoch),
    AT("IN_COUNTS", inbox_rec_t, counts),
    AT("CI_OFF", comb_info_rec_t, off),
    AT("CI_ROWS", comb_info_rec_t, rows),
    AT("CI_STRIDE", comb_info_rec_t, stride),
    AT("CI_EPOCH", comb_info_rec_t, epoch),
    AT("CI_INDEX", comb_info_rec_t, dispatch_index),
    AT("CI_SUM", comb_info_rec_t, sum),
    {"CI_BYTES", sizeof(comb_info_rec_t)},
    AT("FAIL_EPOCH", fail_rec_t, epoch),
    AT("FAIL_LEN", fail_rec_t, lencode),
    AT("FAIL_MSG", fail_rec_t, msg),
    {"FAIL_MSG_MAX", FAIL_MSG_MAX},
    AT("FAIL_SUM", fail_rec_t, sum),
    {"FAIL_BYTES", sizeof(fail_rec_t)},
    AT("ROUTE_NTOK", route_rec_t, ntok),
    AT("ROUTE_EPOCH", route_rec_t, epoch),
    AT("ROUTE_SUM", route_rec_t, sum),
    AT("ROUTE_IDX", route_rec_t, idx),
};

static int add_named(PyObject *m, const char *name, const named_t *items, size_t n) {
    PyObject *d = PyDict_New();
    if (!d) return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(items[i].value);
        if (!v || PyDict_SetItemString(d, items[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObject(m, name, d) < 0) {
        Py_DECREF(d);
        return -1;
    }
    return 0;
}

static int add_exports(PyObject *m) {
    PyObject *keys = PyTuple_New(NUM_PARAMS);
    if (!keys) return -1;
    for (Py_ssize_t i = 0; i < NUM_PARAMS; i++) {
        PyObject *k = PyUnicode_FromString(PARAMS[i].key);
        if (!k) {
            Py_DECREF(keys);
            return -1;
        }
        PyTuple_SET_ITEM(keys, i, k);
    }
    if (PyModule_AddObject(m, "PARAMS", keys) < 0) {
        Py_DECREF(keys);
        return -1;
    }
    if (add_named(m, "ERRORS", ERROR_CODES, NAMED_LEN(ERROR_CODES)) ||
        add_named(m, "DTYPES", DTYPE_CODES, NAMED_LEN(DTYPE_CODES)) ||
        add_named(m, "SYNCS", SYNC_CODES, NAMED_LEN(SYNC_CODES)) ||
        add_named(m, "ENGINES", ENGINE_CODES, NAMED_LEN(ENGINE_CODES)) ||
        add_named(m, "LAYOUTS", LAYOUT_CODES, NAMED_LEN(LAYOUT_CODES)) ||
        add_named(m, "QUANTS", QUANT_CODES, NAMED_LEN(QUANT_CODES)) ||
        add_named(m, "OFFSETS", RECORD_OFFSETS, NAMED_LEN(RECORD_OFFSETS)))
        return -1;
    if (PyModule_AddIntConstant(m, "ABI", UBEP_ABI_VERSION) < 0 ||
        PyModule_AddStringConstant(m, "KERNELS", kernel_set) < 0)
        return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    import_array(); /* numpy's C API (fastpath.c); returns NULL with ImportError if missing */
    select_kernels();
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    if (add_exports(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
