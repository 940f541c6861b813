/*
 * ubep native data plane (C11): the Engine type and its parameter table.
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
 *     and return their result or an abi.ErrorRecord (built from the type abi.load_native hands
 *     over with set_error_type); run_dispatch and run_combine take one call record
 *     (ubep.plane.DispatchCall, CombineCall) read by field name; dispatch and combine are
 *     ubep.plane.Engine's door (fastpath.c).
 *   - The codes (E_*, DT_*, SYNC_*, ENG_*, LAY_*, TRACE_*) and the offsets inside the control
 *     records are abi.h's. exports.c exports them and abi.load_native() refuses a build whose
 *     exports differ from abi.py's.
 *   - Where each record lies in a segment is ubep/plane/layout.py's (offsets as parameters).
 *
 * The methods live by job: calls.c (a call's lifecycle), control.c (notices, resync, waits,
 * introspection), fastpath.c (whole blocking calls); the parts of the core are listed in
 * engine.h.
 */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <limits.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "calls.h"
#include "flags.h"
#define NO_IMPORT_ARRAY
#include "fastpath.h"
#include "methods.h"

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
    PARAM("off_rsum", off_rsum, P_I64),
    PARAM("rsum_bytes", rsum_bytes, P_I64),
    PARAM("integrity", integrity, P_INT),
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

/* the parameter keys, in table order (exports.c exports them as PARAMS) */
PyObject *param_keys(void) {
    PyObject *keys = PyTuple_New(NUM_PARAMS);
    if (!keys) return NULL;
    for (Py_ssize_t i = 0; i < NUM_PARAMS; i++) {
        PyObject *k = PyUnicode_FromString(PARAMS[i].key);
        if (!k) {
            Py_DECREF(keys);
            return NULL;
        }
        PyTuple_SET_ITEM(keys, i, k);
    }
    return keys;
}

static void engine_free_scratch(engine_t *g) {
    free(g->base); free(g->pids); free(g->starts);
    free(g->cnt); free(g->units_to); free(g->rows_to); free(g->sent_to);
    free(g->u_t); free(g->u_k); free(g->u_e); free(g->u_slot); free(g->stamp);
    free(g->my_rank_in_batch); free((void *)g->remaining); free((void *)g->dc_s1);
    free((void *)g->dc_s2); free(g->core_base); free(g->core_ready); free(g->rx_base);
    free(g->rx_rows); free(g->rx_cnt); free(g->tx_rows); free(g->tx_cnt);
    free(g->route_snap); free(g->route_own); free(g->ci_off); free(g->ci_rows); free(g->peer_runs);
    free(g->threads); free(g->e2d); free(g->e2l);
    free((void *)g->term_ptr); free(g->term_w);
    free((void *)g->counted); free(g->qstage);
    free(g->core_units); free(g->core_dsts); free(g->core_unit_log); free(g->core_dst_log);
    sched_work_free(&g->sched);
    free(g->spans); free(g->span_n);
    g->spans = NULL; g->span_n = NULL; g->trace_on = 0;
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
        g->quant > QUANT_INT8 || (g->integrity && g->rsum_bytes < g->cap_rows * 8) ||
        (g->quant && (g->dt > DT_FP32 || g->hidden % QUANT_BLOCK ||
                                               flag_sentinel(g)))) {
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
    g->sent_to = calloc((size_t)R, sizeof(int64_t));
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
    g->route_own = calloc((size_t)g->nreg * 2 * (size_t)(g->T * g->K) + 1, sizeof(uint32_t));
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
        g->base, g->pids, g->starts, g->cnt, g->units_to, g->rows_to, g->sent_to, g->u_t, g->u_k, g->u_e,
        g->u_slot, g->stamp, g->my_rank_in_batch, (const void *)g->remaining,
        (const void *)g->dc_s1, (const void *)g->dc_s2, g->core_base, g->core_ready, g->rx_base,
        g->rx_rows, g->rx_cnt, g->tx_rows, g->tx_cnt, g->route_snap, g->route_own, g->ci_off, g->ci_rows,
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

static PyMethodDef engine_methods[] = {
    {"core_log", (PyCFunction)engine_core_log, METH_NOARGS,
     "per core: the units it sent and the count records it published in the last dispatch"},
    {"run_dispatch", (PyCFunction)engine_dispatch, METH_O,
     "one dispatch of an ubep.plane.DispatchCall: its arrays filled, the rows received"},
    {"run_combine", (PyCFunction)engine_combine, METH_O,
     "one combine of an ubep.plane.CombineCall into its y"},
    {"set_fast", (PyCFunction)engine_set_fast, METH_VARARGS,
     "what blocking calls build their results from, where the others go (fastpath.c)"},
    {"dispatch", (PyCFunction)engine_dispatch_fast, METH_VARARGS,
     "a dispatch (ubep.plane.Engine): its DispatchResult, an ErrorRecord or None"},
    {"combine", (PyCFunction)engine_combine_fast, METH_VARARGS,
     "a combine (ubep.plane.Engine): y, an ErrorRecord or None"},
    {"complete", (PyCFunction)engine_complete, METH_VARARGS,
     "the second half of the oldest split-phase call"},
    {"abandon", (PyCFunction)engine_abandon, METH_VARARGS,
     "fail the oldest split-phase call without its second half"},
    {"fail", (PyCFunction)engine_fail, METH_VARARGS, "publish a failure notice"},
    {"set_signature", (PyCFunction)engine_set_signature, METH_O,
     "what this rank's next calls are (compared in every count record)"},
    {"resync", (PyCFunction)engine_resync, METH_VARARGS, "forget every call before an epoch"},
    {"wait_done", (PyCFunction)engine_wait_done, METH_VARARGS, "wait for peers' progress"},
    {"reset_all", (PyCFunction)engine_reset_all, METH_NOARGS, "SP: fill regions with sentinel"},
    {"comb_last_epoch", (PyCFunction)engine_comb_last_epoch, METH_VARARGS,
     "epoch of the last combine that used combine region c"},
    {"close", (PyCFunction)engine_close, METH_NOARGS, "stop worker threads"},
    {"poke", (PyCFunction)engine_poke, METH_VARARGS,
     "poke(kind, phase, rank, offset, data): tests' one-shot write into a segment mid-call"},
    {"trace", (PyCFunction)engine_trace, METH_NOARGS,
     "core 0's phase timestamps (CLOCK_MONOTONIC ns) of the last dispatch, for profiling"},
    {"trace_enable", (PyCFunction)engine_trace_enable, METH_VARARGS,
     "trace_enable(capacity): record every core's task spans, the last capacity per core"},
    {"trace_spans", (PyCFunction)engine_trace_spans, METH_NOARGS,
     "(packed spans of every core and of the calls, spans dropped): the rings emptied"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject EngineType = {
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
