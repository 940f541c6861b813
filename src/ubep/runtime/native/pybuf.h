/* Python buffers of the arguments a native call takes (calls.c, hooks.c): held until the call
 * is done, sizes checked against what the call will touch. */
#ifndef UBEP_PYBUF_H
#define UBEP_PYBUF_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

typedef struct {
    Py_buffer b;
    int held;
} pbuf_t;
#define NBUF_DISPATCH 18 /* 10 arguments, 8 plan arrays */

static inline int get_buf(PyObject *o, pbuf_t *pb, int writable, const char *name, int64_t min_bytes) {
    pb->held = 0;
    if (PyObject_GetBuffer(o, &pb->b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    pb->held = 1;
    if (pb->b.len < min_bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %lld", name, pb->b.len,
                     (long long)min_bytes);
        return -1;
    }
    return 0;
}
static inline void rel_bufs(pbuf_t *b, int n) {
    for (int i = 0; i < n; i++)
        if (b[i].held) PyBuffer_Release(&b[i].b);
}

#endif /* UBEP_PYBUF_H */
