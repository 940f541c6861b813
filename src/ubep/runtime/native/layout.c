/* DeepEP's get_dispatch_layout in one pass over topk_idx: the checks of
 * ubep.routing.validate_topk_idx (ids in [-1, num_experts), no expert twice in a row) and the
 * three counts, for the torch facade's decode step, where numpy's dozen small operations cost
 * more than the dispatch itself. ubep.routing.get_dispatch_layout is the oracle its test holds it
 * to. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "methods.h"
#include "pybuf.h"

/* dispatch_layout(idx_i64, num_experts, num_ranks, per_rank_i32, per_expert_i32, in_rank_u8)
 * -> False when idx is valid (outputs written), True when an id is out of range or a row
 * names an expert twice (outputs undefined: the caller's check then names what is wrong). */
PyObject *mod_dispatch_layout(PyObject *self, PyObject *args) {
    PyObject *oi, *opr, *ope, *oin;
    long long E, R;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLLOOO", &oi, &E, &R, &opr, &ope, &oin)) return NULL;
    if (E < 1 || R < 1 || E % R) {
        PyErr_SetString(PyExc_ValueError, "num_experts must be a positive multiple of num_ranks");
        return NULL;
    }
    pbuf_t b[4];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_buf(oi, &b[0], 0, "idx", 0) || get_buf(opr, &b[1], 1, "per_rank", R * 4) ||
        get_buf(ope, &b[2], 1, "per_expert", E * 4))
        goto done;
    if (b[0].b.ndim != 2 || b[0].b.itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "idx must be a 2-D int64 array");
        goto done;
    }
    const int64_t T = b[0].b.shape[0], K = b[0].b.shape[1], n = T * K;
    if (get_buf(oin, &b[3], 1, "in_rank", T * R)) goto done;
    const int64_t *idx = b[0].b.buf;
    int64_t lo = 0, hi = -1;
    for (int64_t i = 0; i < n; i++) {
        if (idx[i] < lo) lo = idx[i];
        if (idx[i] > hi) hi = idx[i];
    }
    if (lo < -1 || hi >= E) {
        res = Py_NewRef(Py_True);
        goto done;
    }
    int32_t *per_rank = b[1].b.buf, *per_expert = b[2].b.buf;
    uint8_t *in_rank = b[3].b.buf;
    int64_t *seen = calloc((size_t)E, sizeof *seen); /* the last row (+1) that named each expert */
    if (!seen) {
        PyErr_NoMemory();
        goto done;
    }
    memset(per_rank, 0, (size_t)R * 4);
    memset(per_expert, 0, (size_t)E * 4);
    memset(in_rank, 0, (size_t)(T * R));
    const int64_t per = E / R;
    int dup = 0;
    for (int64_t t = 0; t < T && !dup; t++) {
        uint8_t *mine = in_rank + t * R;
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = idx[t * K + k];
            if (e < 0) continue;
            if (seen[e] == t + 1) {
                dup = 1;
                break;
            }
            seen[e] = t + 1;
            per_expert[e]++;
            mine[e / per] = 1;
        }
        for (int64_t r = 0; r < R; r++) per_rank[r] += mine[r];
    }
    free(seen);
    res = Py_NewRef(dup ? Py_True : Py_False);
done:
    rel_bufs(b, 4);
    return res;
}
