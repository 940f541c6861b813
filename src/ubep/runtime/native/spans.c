/* Task spans (engine.h, span_t): turned on per engine, read back by ubep.trace.native. The rings
 * are the engine's own memory (never the shared segment): a peer cannot write them, and what a
 * rank records costs its peers nothing. */
#include "calls.h" /* first: engine.h's Python.h precedes the standard headers */

#include <stdlib.h>

#include "methods.h"

#define MAX_SPAN_CAP (1LL << 24)

/* trace_enable(capacity): every core keeps the last `capacity` task spans (0: off, the rings
 * freed); the spans recorded so far are dropped */
PyObject *engine_trace_enable(engine_t *g, PyObject *args) {
    long long cap;
    if (!PyArg_ParseTuple(args, "L", &cap)) return NULL;
    if (cap < 0 || cap > MAX_SPAN_CAP) {
        PyErr_Format(PyExc_ValueError, "capacity=%lld: must be in [0, %lld]", cap, MAX_SPAN_CAP);
        return NULL;
    }
    quiesce(g);
    g->trace_on = 0;
    free(g->spans);
    free(g->span_n);
    g->spans = NULL;
    g->span_n = NULL;
    g->span_cap = 0;
    if (!cap) Py_RETURN_NONE;
    size_t rings = (size_t)g->C + 1; /* the cores', then the calls' */
    g->spans = malloc(rings * (size_t)cap * sizeof(span_t));
    g->span_n = calloc(rings * 8, sizeof(int64_t));
    if (!g->spans || !g->span_n) {
        free(g->spans);
        free(g->span_n);
        g->spans = NULL;
        g->span_n = NULL;
        return PyErr_NoMemory();
    }
    g->span_cap = cap;
    g->trace_on = 1;
    Py_RETURN_NONE;
}

/* trace_spans() -> (bytes, counts, dropped): the spans of every ring (cores 0..C-1, then the
 * calls), each ring oldest first, as packed span_t records, counts[c] of ring c; the rings are
 * emptied. dropped: spans a full ring overwrote. */
PyObject *engine_trace_spans(engine_t *g, PyObject *noargs) {
    (void)noargs;
    quiesce(g);
    if (!g->trace_on) return Py_BuildValue("(y#()L)", "", (Py_ssize_t)0, 0LL);
    int64_t total = 0, dropped = 0;
    for (int c = 0; c <= g->C; c++) {
        int64_t n = g->span_n[c * 8];
        total += n < g->span_cap ? n : g->span_cap;
        dropped += n > g->span_cap ? n - g->span_cap : 0;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(total * (int64_t)sizeof(span_t)));
    if (!out) return NULL;
    PyObject *counts = PyTuple_New(g->C + 1);
    if (!counts) {
        Py_DECREF(out);
        return NULL;
    }
    span_t *dst = (span_t *)PyBytes_AS_STRING(out);
    for (int c = 0; c <= g->C; c++) {
        int64_t n = g->span_n[c * 8], first = n > g->span_cap ? n - g->span_cap : 0;
        for (int64_t i = first; i < n; i++)
            *dst++ = g->spans[c * g->span_cap + i % g->span_cap];
        PyTuple_SET_ITEM(counts, c, PyLong_FromLongLong(n - first));
        g->span_n[c * 8] = 0;
    }
    PyObject *res = Py_BuildValue("(NNL)", out, counts, (long long)dropped);
    return res;
}
