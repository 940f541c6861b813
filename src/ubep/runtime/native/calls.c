/* A call's lifecycle: its arguments read and checked (the plan by field name), its run (whole,
 * or split into two halves with the second on the background core), its completion or
 * abandonment, and its result or error record. The Engine methods dispatch, combine, complete
 * and abandon; fastpath.c builds calls through the same functions. */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calls.h"
#include "methods.h"

/* ubep.plane.records.ErrorRecord: what a failed call returns, handed over once (set_error_type,
 * from abi.load_native) */
static PyObject *error_type;

PyObject *engine_set_error_type(PyObject *module, PyObject *type) {
    (void)module;
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "set_error_type: a type is needed");
        return NULL;
    }
    Py_XSETREF(error_type, Py_NewRef(type));
    Py_RETURN_NONE;
}

/* text a peer may have written: any bytes at all, decoded without failing */
static PyObject *peer_text(const char *s) {
    return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "replace");
}

PyObject *error_record(op_t *op) {
    if (!error_type) {
        PyErr_SetString(PyExc_RuntimeError, "engine: no error record type (load the module "
                        "through ubep.runtime.abi.load_native)");
        return NULL;
    }
    int err = atomic_load(&op->err);
    char buf[MAX_MSG];
    format_error(op, buf, sizeof buf);
    /* E_REMOTE: the notice's code in the core slot; its message, as a peer wrote it */
    const char *msg = err == E_REMOTE || err == E_BAD_INPUT ? op->msg : buf;
    PyObject *what = peer_text(op->what), *message = peer_text(msg);
    if (!what || !message) {
        Py_XDECREF(what);
        Py_XDECREF(message);
        return NULL;
    }
    return PyObject_CallFunction(error_type, "iiisNN", err, op->err_peer,
                                 err == E_REMOTE ? op->remote_code : op->err_core, op->arg, what,
                                 message);
}

/* The fields of a call record (ubep.plane.DispatchCall / CombineCall), read by name as
 * read_plan reads the Plan: new references, or -1 with an exception set and none held. */
static int record_fields(PyObject *rec, const char *const *names, PyObject **interned, int n,
                         PyObject **out) {
    for (int i = 0; i < n; i++) {
        if (!interned[i] && !(interned[i] = PyUnicode_InternFromString(names[i]))) goto fail;
        if (!(out[i] = PyObject_GetAttr(rec, interned[i]))) goto fail;
        continue;
    fail:
        while (i--) Py_DECREF(out[i]);
        return -1;
    }
    return 0;
}

static void drop_fields(PyObject **f, int n) {
    for (int i = 0; i < n; i++) Py_DECREF(f[i]);
}


void op_init(op_t *op, engine_t *g, int kind, uint64_t epoch) {
    memset(op, 0, sizeof *op);
    op->g = g;
    op->kind = kind;
    op->epoch = epoch;
    op->par = (int)(epoch & 1);
    op->start_ns = now_ns();
    op->deadline = op->start_ns + g->timeout_ns;
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

/* A ScheduleSpec of ubep.sched (the split and the tables the native scheduler needs) into
 * op->plan.spec, checked; the engine's scheduler work space sized for it. The units are built
 * by the prepare phase, after it validated the routing. */
static int read_spec(PyObject *plan, op_t *op, pbuf_t *b) {
    engine_t *g = op->g;
    plan_t *p = &op->plan;
    sched_spec_t *s = &p->spec;
    s->expert_layout = g->layout != LAY_RANK;
    s->R = g->R; s->E = g->E; s->K = g->K; s->L = g->L; s->n = p->num_send_cores;
    if (plan_int(plan, "policy_code", SCHED_EXPERT_CONTIGUOUS, SCHED_HIERARCHICAL, &s->policy) ||
        plan_int(plan, "num_hops", 1, 64, &s->H) ||
        plan_array(plan, "hop_of_rank", &b[1], g->R, &s->hop) ||
        plan_array(plan, "hop_issue_rank", &b[2], s->H, &s->issue) ||
        plan_array(plan, "remapped_expert", &b[3], g->E, &s->rpos))
        return -1;
    const char *bad = sched_spec_check(s);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "plan: %s", bad);
        return -1;
    }
    sched_work_t *w = &g->sched;
    if (!sched_work_ok(w) || w->H != s->H || w->n < s->n) {
        sched_work_free(w);
        sched_work_init(w, (int64_t)g->T * g->K, s->H, g->E, g->R, s->n > g->C ? s->n : g->C);
        if (!sched_work_ok(w)) {
            sched_work_free(w);
            PyErr_NoMemory();
            return -1;
        }
    }
    p->native = 1;
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
    if (PyObject_HasAttrString(plan, "policy_code")) return read_spec(plan, op, b);
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
void quiesce(engine_t *g) {
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
 * outputs were used in place (combine), or the ErrorRecord */
static PyObject *call_result(call_t *c) {
    op_t *op = &c->op;
    PyObject *res = atomic_load(&op->err) ? error_record(op)
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

/* complete(epoch) -> result of dispatch / combine | ErrorRecord: the oldest split-phase call,
 * once the background core has run its second half */
PyObject *engine_complete(engine_t *g, PyObject *args) {
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
PyObject *engine_abandon(engine_t *g, PyObject *args) {
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

enum { D_X, D_TOPK_IDX, D_TOPK_WEIGHTS, D_NUM_TOKENS, D_EPOCH, D_INDEX, D_OUT, D_PLAN = D_OUT + 7,
       D_SPLIT, D_PREQUANT, D_FIELDS };
static const char *const DISPATCH_FIELDS[D_FIELDS] = {
    "x", "topk_idx", "topk_weights", "num_tokens", "epoch", "index", "recv_topk_idx",
    "recv_topk_weights", "recv_src_rank", "recv_src_token", "recv_src_k", "counts",
    "send_dst_row", "plan", "split", "prequant",
};

/* run_dispatch(call: ubep.plane.DispatchCall) -> rows received | None (call.split: the first half
 * ran, complete() runs the rest) | ErrorRecord; call.plan: None (one core), ubep.sched's Plan or
 * CoreSplit (read_plan) */
PyObject *engine_dispatch(engine_t *g, PyObject *rec) {
    g->trace[TRACE_D_NATIVE] = now_ns();
    static PyObject *names[D_FIELDS];
    PyObject *f[D_FIELDS];
    if (record_fields(rec, DISPATCH_FIELDS, names, D_FIELDS, f)) return NULL;
    dispatch_args_t a;
    a.x = f[D_X]; a.topk_idx = f[D_TOPK_IDX]; a.topk_weights = f[D_TOPK_WEIGHTS];
    for (int i = 0; i < 7; i++) a.out[i] = f[D_OUT + i];
    a.plan = f[D_PLAN];
    a.num_tokens = PyLong_AsLongLong(f[D_NUM_TOKENS]);
    a.epoch = PyLong_AsUnsignedLongLong(f[D_EPOCH]);
    a.index = PyLong_AsLongLong(f[D_INDEX]);
    int split = PyObject_IsTrue(f[D_SPLIT]);
    a.prequant = PyObject_IsTrue(f[D_PREQUANT]);
    PyObject *res = NULL;
    if (!PyErr_Occurred() && split >= 0 && a.prequant >= 0) {
        call_t *c = dispatch_call(g, &a);
        res = c ? call_run(g, c, split) : NULL;
    }
    drop_fields(f, D_FIELDS);
    return res;
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
        op->topk = a->direct.topk; op->topk_copy = a->direct.topk_copy; op->w = a->direct.w;
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
    int64_t dst_w = g->layout != LAY_RANK ? K : g->R;
    int64_t meta_w = g->layout != LAY_RANK ? 1 : K;
    return get_buf(a->topk_idx, &b[1], 0, "topk_idx", ntok * K * 8) ||
        get_buf(a->topk_weights, &b[2], 0, "topk_weights", ntok * K * 4) ||
        get_buf(o[0], &b[3], 1, "recv_topk_idx", nrows * meta_w * 8) ||
        get_buf(o[1], &b[4], 1, "recv_topk_weights", nrows * meta_w * 4) ||
        get_buf(o[2], &b[5], 1, "recv_src_rank", nrows * 8) ||
        get_buf(o[3], &b[6], 1, "recv_src_token", nrows * 8) ||
        get_buf(o[4], &b[7], 1, "recv_src_k", nrows * 8) ||
        get_buf(o[5], &b[8], 1, "num_recv_tokens_per_expert", (g->L + g->R + g->R * g->R) * 8) ||
        get_buf(o[6], &b[9], 1, "send_dst_row", ntok * dst_w * 8);
}

enum { C_EXPERT_OUT, C_NUM_ROWS, C_TOPK_IDX, C_TOPK_WEIGHTS, C_SEND_DST_ROW, C_NUM_TOKENS,
       C_EPOCH, C_REGION, C_Y, C_DISPATCH_INDEX, C_SPLIT, C_FIELDS };
static const char *const COMBINE_FIELDS[C_FIELDS] = {
    "expert_out", "num_rows", "topk_idx", "topk_weights", "send_dst_row", "num_tokens", "epoch",
    "region", "y", "dispatch_index", "split",
};

/* run_combine(call: ubep.plane.CombineCall) -> 1 if expert_out was used in place, else 0 | None
 * (call.split, as dispatch) | ErrorRecord; every rank must name the same dispatch */
PyObject *engine_combine(engine_t *g, PyObject *rec) {
    g->trace[TRACE_C_NATIVE] = now_ns();
    static PyObject *names[C_FIELDS];
    PyObject *f[C_FIELDS];
    if (record_fields(rec, COMBINE_FIELDS, names, C_FIELDS, f)) return NULL;
    combine_args_t a = {0};
    a.expert_out = f[C_EXPERT_OUT]; a.topk_idx = f[C_TOPK_IDX];
    a.topk_weights = f[C_TOPK_WEIGHTS]; a.send_dst_row = f[C_SEND_DST_ROW]; a.y = f[C_Y];
    a.rows = PyLong_AsLongLong(f[C_NUM_ROWS]);
    a.num_tokens = PyLong_AsLongLong(f[C_NUM_TOKENS]);
    a.epoch = PyLong_AsUnsignedLongLong(f[C_EPOCH]);
    long region = PyLong_AsLong(f[C_REGION]);
    a.region = region < INT_MIN || region > INT_MAX ? -1 : (int)region;
    a.dispatch_index = PyLong_AsUnsignedLongLong(f[C_DISPATCH_INDEX]);
    int split = PyObject_IsTrue(f[C_SPLIT]);
    PyObject *res = NULL;
    if (!PyErr_Occurred() && split >= 0) {
        call_t *c = combine_call(g, &a);
        res = c ? call_run(g, c, split) : NULL;
    }
    drop_fields(f, C_FIELDS);
    return res;
}

call_t *combine_call(engine_t *g, const combine_args_t *a) {
    if (g->in_use) {
        PyErr_SetString(PyExc_RuntimeError, "engine: another call is in progress on this buffer");
        return NULL;
    }
    const int K = g->K;
    const long long rows = a->rows, ntok = a->num_tokens;
    int64_t dst_w = g->layout != LAY_RANK ? K : g->R;
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
