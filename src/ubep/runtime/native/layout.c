/* The DeepEP facades' decode-step passes, each one pass over a few hundred ids where numpy's
 * dozen small operations cost more than the dispatch itself: get_dispatch_layout (the checks
 * of ubep.routing.validate_topk_idx and the three counts), a combine's received weights summed
 * at home, a low-latency combine's dropped slots, and V2's receive counts. Each has the numpy
 * computation it replaces as the oracle of its test. */
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

/* any_negative(idx_i64) -> whether an id is negative: a low-latency combine's topk_idx, where
 * the caller may set a slot to -1 to drop it, is scanned once (numpy's compare and any cost a
 * decode step's combine more than its scan). */
PyObject *mod_any_negative(PyObject *self, PyObject *arg) {
    (void)self;
    pbuf_t b[1];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_buf(arg, &b[0], 0, "idx", 0)) goto done;
    if (b[0].b.itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "idx must be int64");
        goto done;
    }
    const int64_t *idx = b[0].b.buf;
    const Py_ssize_t n = b[0].b.len / 8;
    int neg = 0;
    for (Py_ssize_t i = 0; i < n; i++) neg |= idx[i] < 0;
    res = Py_NewRef(neg ? Py_True : Py_False);
done:
    rel_bufs(b, 1);
    return res;
}

/* received_counts(rank_i64, token_i64, local_idx_i64 [n, K], num_ranks, num_local,
 * alignment, counts_i64, aligned_i64, start_i64, rows_per_rank_i64) -> whether the rows are in
 * the receive order ((rank, token) strictly ascending: how the engines land a rank-layout
 * dispatch), with DeepEP V2's counts of them: (row, slot) pairs per local expert, those
 * rounded up to the alignment, each expert's first expanded row, and rows per source rank
 * (ubep.torch.deep_ep_v2_layout.received's numpy is the oracle its test holds it to). */
PyObject *mod_received_counts(PyObject *self, PyObject *args) {
    PyObject *o[7];
    long long R, L, A;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOLLLOOOO", &o[0], &o[1], &o[2], &R, &L, &A, &o[3], &o[4],
                          &o[5], &o[6]))
        return NULL;
    if (R < 1 || L < 0 || A < 1) {
        PyErr_SetString(PyExc_ValueError, "received_counts: bad num_ranks, num_local or alignment");
        return NULL;
    }
    pbuf_t b[7];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_buf(o[0], &b[0], 0, "rank", 0)) goto done;
    const Py_ssize_t n = b[0].b.len / 8;
    if (get_buf(o[1], &b[1], 0, "token", n * 8) || get_buf(o[2], &b[2], 0, "local_idx", 0) ||
        get_buf(o[3], &b[3], 1, "counts", L * 8) || get_buf(o[4], &b[4], 1, "aligned", L * 8) ||
        get_buf(o[5], &b[5], 1, "start", L * 8) || get_buf(o[6], &b[6], 1, "rows_per_rank", R * 8))
        goto done;
    const int64_t *rank = b[0].b.buf, *token = b[1].b.buf, *idx = b[2].b.buf;
    const Py_ssize_t nk = b[2].b.len / 8;
    int64_t *counts = b[3].b.buf, *aligned = b[4].b.buf, *start = b[5].b.buf,
            *per_rank = b[6].b.buf;
    memset(counts, 0, (size_t)L * 8);
    memset(per_rank, 0, (size_t)R * 8);
    int in_order = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rank[i] < 0 || rank[i] >= R) {
            PyErr_SetString(PyExc_ValueError, "received_counts: a source rank out of range");
            goto done;
        }
        per_rank[rank[i]]++;
        if (i && (rank[i] < rank[i - 1] || (rank[i] == rank[i - 1] && token[i] <= token[i - 1])))
            in_order = 0;
    }
    for (Py_ssize_t i = 0; i < nk; i++)
        if (idx[i] >= 0 && idx[i] < L) counts[idx[i]]++;
    int64_t at = 0;
    for (long long e = 0; e < L; e++) {
        aligned[e] = (counts[e] + A - 1) / A * A;
        start[e] = at;
        at += aligned[e];
    }
    res = Py_NewRef(in_order ? Py_True : Py_False);
done:
    rel_bufs(b, 7);
    return res;
}

/* masked_weights(idx_i64, w_f32 or None, num_experts, out_f32, plus_zero) -> whether every id
 * is -1 or in [0, num_experts); out holds w where the slot is routed (w + 0.0f with plus_zero:
 * -0.0 becomes +0.0), 0.0 where it is masked (undefined where an id is out of range). V2's
 * dispatch weights (numpy's min, max, where and cast in one pass), and what a source's
 * normal-mode combine sums of its tokens' weights when every rank hands back the weights its
 * dispatch received (plus_zero: the sum of w and the other ranks' zeros;
 * ubep.torch.deep_ep_agree.own_weights_sum). */
PyObject *mod_masked_weights(PyObject *self, PyObject *args) {
    PyObject *oi, *ow, *oo;
    long long E;
    int plus_zero;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOLOp", &oi, &ow, &E, &oo, &plus_zero)) return NULL;
    pbuf_t b[3];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_buf(oi, &b[0], 0, "idx", 0)) goto done;
    const Py_ssize_t n = b[0].b.len / 8;
    if (b[0].b.itemsize != 8 || (ow != Py_None && get_buf(ow, &b[1], 0, "w", n * 4)) ||
        get_buf(oo, &b[2], 1, "out", n * 4)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "idx must be int64");
        goto done;
    }
    const int64_t *idx = b[0].b.buf;
    const float *w = ow != Py_None ? b[1].b.buf : NULL;
    float *out = b[2].b.buf;
    /* volatile zero: the add must happen (it is what turns -0.0 into +0.0) */
    volatile float zero = 0.0f;
    const float z = zero;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        ok &= idx[i] >= -1 && idx[i] < E;
        const float v = w && idx[i] >= 0 ? w[i] : 0.0f;
        out[i] = plus_zero ? v + z : v;
    }
    res = Py_NewRef(ok ? Py_True : Py_False);
done:
    rel_bufs(b, 3);
    return res;
}
