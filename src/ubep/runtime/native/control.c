/* The Engine's control methods: failure notices, resync, waiting for peers, SP re-arming,
 * closing, and what tests and profiling read back (trace, core log, combine regions). */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <stdlib.h>
#include <string.h>

#include "calls.h"
#include "flags.h"
#define NO_IMPORT_ARRAY
#include "fastpath.h"
#include "methods.h"

/* fail(epoch, code, message, finished, timeout_s) -> 0 | 1 | ErrorRecord: publish "call `epoch`
 * failed here" for a call rejected before the native code ran (finished=1: this rank is done
 * with it), or, finished=0, tell peers ahead of time that the next call cannot run here (a
 * Buffer that lost step). The notice slot of `epoch` last held the notice of `epoch - 2`: it
 * is written only once every peer has finished that call, waiting at most timeout_s (0: do not
 * wait; then nothing is published and the result is 1). */
PyObject *engine_fail(engine_t *g, PyObject *args) {
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
    PyObject *res = rc > 0 ? error_record(op) : PyLong_FromLong(rc ? 1 : 0);
    free(op);
    return res;
}

/* set_signature(word): what this rank's next calls are (ubep.buffer.signature), published in
 * its count records and compared with every source's; local, between calls. */
PyObject *engine_set_signature(engine_t *g, PyObject *arg) {
    unsigned long long word = PyLong_AsUnsignedLongLongMask(arg);
    if (word == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    g->signature = (uint64_t)word;
    Py_RETURN_NONE;
}

/* resync(base_epoch): forget every call before `base_epoch` (local; Buffer.resync runs it on
 * every rank between two group-wide exchanges, so no peer is inside a call and nobody writes
 * this segment meanwhile). Control records of this rank's segment are cleared, progress words
 * say "finished everything before base_epoch", SP regions are re-armed. */
PyObject *engine_resync(engine_t *g, PyObject *args) {
    quiesce(g);
    unsigned long long base;
    if (!PyArg_ParseTuple(args, "K", &base)) return NULL;
    if (base < 2) {
        PyErr_SetString(PyExc_ValueError, "engine.resync: base_epoch must be >= 2");
        return NULL;
    }
    g->poke.armed = 0; /* a test's write armed for a call that never ran */
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
    if (flag_sentinel(g)) reset_land(g);
    g->land_dirty = 0;
    memset(g->sp_dirty, 0, sizeof g->sp_dirty);
    g->comb_last_epoch[0] = g->comb_last_epoch[1] = 0;
    memset(g->peer_rows, 0, sizeof g->peer_rows);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* wait_done(epoch, timeout_s) -> 0 | ErrorRecord: every peer has finished call `epoch` */
PyObject *engine_wait_done(engine_t *g, PyObject *args) {
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
    PyObject *res = rc ? error_record(op) : PyLong_FromLong(0);
    free(op);
    return res;
}

/* reset_all(): fill the SP land region(s) with the sentinel (construction) */
PyObject *engine_reset_all(engine_t *g, PyObject *noargs) {
    quiesce(g);
    (void)noargs;
    if (!flag_sentinel(g)) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    reset_land(g);
    g->land_dirty = 0;
    memset(g->sp_dirty, 0, sizeof g->sp_dirty);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* poke(kind, phase, rank, offset, data): arm a one-shot write of `data` into rank `rank`'s
 * segment at `offset`, made by core 0 as the next operation of `kind` (0 dispatch, 1 combine)
 * reaches phase `phase` of its phase list (phases.c). For tests that put garbage into a
 * control record at a chosen moment; nothing of the library calls it. */
PyObject *engine_poke(engine_t *g, PyObject *args) {
    quiesce(g);
    int kind, phase, rank;
    long long off;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "iiiLy*", &kind, &phase, &rank, &off, &b)) return NULL;
    int bad = kind < 0 || kind > 1 || phase < 0 || rank < 0 || rank >= g->R || off < HEADER_BYTES ||
              b.len < 1 || b.len > MAX_POKE || off + b.len > g->seg_size;
    if (!bad) {
        memcpy(g->poke.data, b.buf, (size_t)b.len);
        g->poke.kind = kind;
        g->poke.phase = phase;
        g->poke.rank = rank;
        g->poke.off = off;
        g->poke.len = b.len;
        g->poke.armed = 1;
    }
    PyBuffer_Release(&b);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "poke: kind, phase, rank or bytes out of range");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *engine_trace(engine_t *g, PyObject *noargs) {
    quiesce(g);
    (void)noargs;
    PyObject *t = PyTuple_New(TRACE_SLOTS);
    if (!t) return NULL;
    for (int i = 0; i < TRACE_SLOTS; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(g->trace[i]));
    return t;
}

PyObject *engine_comb_last_epoch(engine_t *g, PyObject *args) {
    quiesce(g);
    int c;
    if (!PyArg_ParseTuple(args, "i", &c)) return NULL;
    if (c < 0 || c > 1) { PyErr_SetString(PyExc_ValueError, "region"); return NULL; }
    return PyLong_FromUnsignedLongLong(g->comb_last_epoch[c]);
}

PyObject *engine_close(engine_t *g, PyObject *noargs) {
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
PyObject *engine_core_log(engine_t *g, PyObject *noargs) {
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
