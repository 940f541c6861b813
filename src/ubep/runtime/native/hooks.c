/* Module functions: the data plane's kernels and the control records' checksums, exposed for
 * tests and benchmarks (a test forges a record a peer could write; a benchmark times a copy). */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <string.h>

#include "pybuf.h"
#define NO_IMPORT_ARRAY
#include "fastpath.h"
#include "methods.h"

/* module-level helpers for benchmarks and tests */
static PyObject *mod_copy(PyObject *self, PyObject *args) {
    PyObject *od, *os;
    int which = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO|i", &od, &os, &which)) return NULL;
    pbuf_t b[2];
    memset(b, 0, sizeof b);
    if (get_buf(od, &b[0], 1, "dst", 0) || get_buf(os, &b[1], 0, "src", 0)) {
        rel_bufs(b, 2);
        return NULL;
    }
    int64_t n = b[0].b.len < b[1].b.len ? b[0].b.len : b[1].b.len;
    Py_BEGIN_ALLOW_THREADS
    (which ? copy_elem : copy_fast)(b[0].b.buf, b[1].b.buf, n);
    Py_END_ALLOW_THREADS
    rel_bufs(b, 2);
    Py_RETURN_NONE;
}

/* get_buf of a buffer of whole `row_bytes`-long rows, read-only; -1 with an error set (and
 * nothing held) if it is not one */
static int get_rows(PyObject *o, long long row_bytes, pbuf_t *b) {
    if (get_buf(o, b, 0, "rows", 0)) { rel_bufs(b, 1); return -1; }
    if (row_bytes < 1 || b->b.len % row_bytes) {
        rel_bufs(b, 1);
        PyErr_SetString(PyExc_ValueError, "rows: length must be a multiple of row_bytes");
        return -1;
    }
    return 0;
}

static PyObject *mod_dc_checksum(PyObject *self, PyObject *args) {
    PyObject *o;
    long long row_bytes;
    unsigned long long epoch;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLK", &o, &row_bytes, &epoch)) return NULL;
    pbuf_t b;
    if (get_rows(o, row_bytes, &b)) return NULL;
    uint64_t sum = dc_batch_sum(b.b.buf, row_bytes, b.b.len / row_bytes, row_bytes, epoch);
    rel_bufs(&b, 1);
    return PyLong_FromUnsignedLongLong(sum);
}

static PyObject *mod_convert(PyObject *self, PyObject *args) {
    /* convert(acc_f32, out, dtype): combine's float32 -> dtype rounding (ROUND), for tests */
    PyObject *oa, *oo;
    int dt;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOi", &oa, &oo, &dt)) return NULL;
    if (dt < 0 || dt > 2) { PyErr_SetString(PyExc_ValueError, "dtype code"); return NULL; }
    pbuf_t b[2];
    memset(b, 0, sizeof b);
    if (get_buf(oa, &b[0], 0, "acc", 0) || get_buf(oo, &b[1], 1, "out", 0)) {
        rel_bufs(b, 2);
        return NULL;
    }
    int64_t n = b[0].b.len / 4;
    int osz = dt == DT_FP32 ? 4 : 2;
    if (b[1].b.len < n * osz) {
        rel_bufs(b, 2);
        PyErr_SetString(PyExc_ValueError, "out");
        return NULL;
    }
    ROUND[dt](b[1].b.buf, b[0].b.buf, n);
    rel_bufs(b, 2);
    Py_RETURN_NONE;
}

/* quantize_rows(x, fmt, round_scale, values_out, scales_out, generic=0): quant_row_e4m3 /
 * quant_row_int8 over every row of x [rows, hidden] (uint16 = BF16 bits, float16 or float32),
 * for tests against ubep.quant. fmt: "e4m3" or "int8"; generic: the baseline build of the row
 * loop instead of the one select_kernels() picked (AVX2 here), so tests cover both. */
static PyObject *mod_quantize_rows(PyObject *self, PyObject *args) {
    PyObject *ox, *ov, *os;
    const char *fmt;
    int round_scale, generic = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OspOO|p", &ox, &fmt, &round_scale, &ov, &os, &generic))
        return NULL;
    int is_int8 = !strcmp(fmt, "int8");
    if (!is_int8 && strcmp(fmt, "e4m3")) {
        PyErr_SetString(PyExc_ValueError, "fmt: must be \"e4m3\" or \"int8\"");
        return NULL;
    }
    pbuf_t b[3];
    memset(b, 0, sizeof b);
    if (PyObject_GetBuffer(ox, &b[0].b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    b[0].held = 1;
    const char *f = b[0].b.format ? b[0].b.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int dt = !strcmp(f, "H") ? DT_BF16 : !strcmp(f, "e") ? DT_FP16 : !strcmp(f, "f") ? DT_FP32 : -1;
    if (dt < 0 || b[0].b.ndim != 2 || b[0].b.shape[1] % QUANT_BLOCK) {
        rel_bufs(b, 1);
        PyErr_SetString(PyExc_ValueError,
                        "x: must be [rows, hidden] uint16 (BF16), float16 or float32 with "
                        "hidden a multiple of 128");
        return NULL;
    }
    int64_t rows = b[0].b.shape[0], hidden = b[0].b.shape[1], nb = hidden / QUANT_BLOCK;
    if (get_buf(ov, &b[1], 1, "values_out", rows * hidden) ||
        get_buf(os, &b[2], 1, "scales_out", rows * nb * (int64_t)sizeof(float))) {
        rel_bufs(b, 3);
        return NULL;
    }
    const uint8_t *x = b[0].b.buf;
    uint8_t *v = b[1].b.buf;
    float *sc = b[2].b.buf;
    int64_t isz = b[0].b.itemsize;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *xr = x + r * hidden * isz;
        if (generic)
            quant_row_generic(xr, dt, hidden, v + r * hidden, sc + r * nb, round_scale, is_int8);
        else if (is_int8)
            quant_row_int8(xr, dt, hidden, (int8_t *)v + r * hidden, sc + r * nb, round_scale);
        else
            quant_row_e4m3(xr, dt, hidden, v + r * hidden, sc + r * nb, round_scale);
    }
    Py_END_ALLOW_THREADS
    rel_bufs(b, 3);
    Py_RETURN_NONE;
}

/* Checksums of the control records, for tests that forge records a peer could write
 * (the bounds checks behind the checksums must hold on their own). */
static PyObject *mod_counts_sum(PyObject *self, PyObject *args) {
    unsigned long long epoch, rows;
    PyObject *oc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKO", &epoch, &rows, &oc)) return NULL;
    pbuf_t b;
    if (get_buf(oc, &b, 0, "counts", 0)) { rel_bufs(&b, 1); return NULL; }
    uint64_t s = counts_sum(epoch, rows, b.b.buf, (int)(b.b.len / 4));
    rel_bufs(&b, 1);
    return PyLong_FromUnsignedLongLong(s);
}

static PyObject *mod_ranks_sum(PyObject *self, PyObject *args) {
    unsigned long long epoch;
    PyObject *oc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KO", &epoch, &oc)) return NULL;
    pbuf_t b;
    if (get_buf(oc, &b, 0, "rows", 0)) { rel_bufs(&b, 1); return NULL; }
    uint64_t s = ranks_sum(epoch, b.b.buf, (int)(b.b.len / 4));
    rel_bufs(&b, 1);
    return PyLong_FromUnsignedLongLong(s);
}

static PyObject *mod_route_sum(PyObject *self, PyObject *args) {
    unsigned long long epoch, ntok;
    PyObject *oi, *ow;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKOO", &epoch, &ntok, &oi, &ow)) return NULL;
    pbuf_t b[2];
    memset(b, 0, sizeof b);
    if (get_buf(oi, &b[0], 0, "idx", 0) || get_buf(ow, &b[1], 0, "weights", b[0].b.len)) {
        rel_bufs(b, 2);
        return NULL;
    }
    uint64_t s = route_sum(epoch, ntok, b[0].b.buf, b[1].b.buf, b[0].b.len / 4);
    rel_bufs(b, 2);
    return PyLong_FromUnsignedLongLong(s);
}

static PyObject *mod_comb_info_sum(PyObject *self, PyObject *args) {
    unsigned long long epoch, off, rows, stride, index;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKK", &epoch, &off, &rows, &stride, &index)) return NULL;
    return PyLong_FromUnsignedLongLong(comb_info_sum(epoch, off, rows, stride, index));
}

/* row_sums(rows, row_bytes) -> bytes: the u64 row_sum (abi.h, integrity="checksum") of every
 * row_bytes-long row of the buffer, for the test of the documented formula and the benchmark */
static PyObject *mod_row_sums(PyObject *self, PyObject *args) {
    PyObject *o;
    long long row_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "OL", &o, &row_bytes)) return NULL;
    pbuf_t b;
    if (get_rows(o, row_bytes, &b)) return NULL;
    int64_t n = b.b.len / row_bytes;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    if (!out) { rel_bufs(&b, 1); return NULL; }
    uint64_t *sums = (uint64_t *)PyBytes_AS_STRING(out);
    const uint8_t *rows = b.b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++) sums[i] = row_sum(rows + i * row_bytes, row_bytes);
    Py_END_ALLOW_THREADS
    rel_bufs(&b, 1);
    return out;
}

static PyObject *mod_reduce_rows(PyObject *self, PyObject *args) {
    /* reduce_rows(rows, nt, weights_f32, out, dtype_code, weighted): REDUCE[dtype] of the nt rows
     * of `rows` ([nt, n] of dtype) into out ([n]), for tests against ubep.reference */
    PyObject *orows, *ow, *oo;
    int dt, weighted, nt;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiOOip", &orows, &nt, &ow, &oo, &dt, &weighted)) return NULL;
    if (dt < 0 || dt > 2 || nt < 1 || nt > 64) {
        PyErr_SetString(PyExc_ValueError, "dtype code or number of rows");
        return NULL;
    }
    pbuf_t b[3];
    memset(b, 0, sizeof b);
    int isz = dt == DT_FP32 ? 4 : 2;
    if (get_buf(orows, &b[0], 0, "rows", 0) || get_buf(ow, &b[1], 0, "weights", nt * 4) ||
        get_buf(oo, &b[2], 1, "out", 0)) {
        rel_bufs(b, 3);
        return NULL;
    }
    int64_t n = b[2].b.len / isz;
    if (b[0].b.len < nt * n * isz) {
        rel_bufs(b, 3);
        PyErr_SetString(PyExc_ValueError, "rows must hold nt rows of out's length");
        return NULL;
    }
    const void *src[64];
    for (int j = 0; j < nt; j++) src[j] = (const uint8_t *)b[0].b.buf + (int64_t)j * n * isz;
    REDUCE[dt](b[2].b.buf, src, b[1].b.buf, nt, n, weighted, NULL, 0);
    rel_bufs(b, 3);
    Py_RETURN_NONE;
}

static PyObject *mod_reduce_at(PyObject *self, PyObject *args) {
    /* reduce_at(rows, at, weights, out, K, dtype_code, weighted): for each token t, REDUCE[dtype]
     * of the rows rows[at[t, j]] with at[t, j] >= 0, in ascending j, with weights[t, j], into
     * out[t]; a token with none gets zero bytes (the reference's +0.0). rows [nrows, n] and out
     * [ntok, n] of dtype, at int64 and weights float32 [ntok, K]. The RMA engine's combine
     * reduces its rows where they landed (no gather into slot order first). */
    PyObject *orows, *oat, *ow, *oo;
    int dt, weighted, K;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOiip", &orows, &oat, &ow, &oo, &K, &dt, &weighted))
        return NULL;
    if (dt < 0 || dt > 2 || K < 1 || K > 64) {
        PyErr_SetString(PyExc_ValueError, "dtype code or K");
        return NULL;
    }
    pbuf_t b[4];
    memset(b, 0, sizeof b);
    if (get_buf(orows, &b[0], 0, "rows", 0) || get_buf(oat, &b[1], 0, "at", 0) ||
        get_buf(ow, &b[2], 0, "weights", 0) || get_buf(oo, &b[3], 1, "out", 0)) {
        rel_bufs(b, 4);
        return NULL;
    }
    int isz = dt == DT_FP32 ? 4 : 2;
    int64_t ntok = b[1].b.len / (8 * (int64_t)K);
    int64_t row = ntok ? b[3].b.len / ntok : 0; /* bytes of one output row */
    const char *bad = NULL;
    if (b[1].b.len != ntok * 8 * K) bad = "at must be [ntok, K] int64";
    else if (b[2].b.len < ntok * 4 * K) bad = "weights must be [ntok, K] float32";
    else if (ntok && (row * ntok != b[3].b.len || row % isz || row == 0 || b[0].b.len % row))
        bad = "rows and out must be whole rows of one length";
    const int64_t *at = b[1].b.buf;
    int64_t nrows = row ? b[0].b.len / row : 0;
    for (int64_t i = 0; !bad && i < ntok * K; i++)
        if (at[i] >= nrows) bad = "at names a row outside rows";
    if (bad) {
        rel_bufs(b, 4);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    const uint8_t *rows = b[0].b.buf;
    const float *w = b[2].b.buf;
    uint8_t *out = b[3].b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t t = 0; t < ntok; t++) {
        const void *src[64];
        float wt[64];
        int nt = 0;
        for (int j = 0; j < K; j++) {
            int64_t r = at[t * K + j];
            if (r < 0) continue;
            src[nt] = rows + r * row;
            wt[nt++] = w[t * K + j];
        }
        if (nt) REDUCE[dt](out + t * row, src, wt, nt, row / isz, weighted, NULL, 0);
        else memset(out + t * row, 0, (size_t)row);
    }
    Py_END_ALLOW_THREADS
    rel_bufs(b, 4);
    Py_RETURN_NONE;
}

static PyObject *mod_use_kernels(PyObject *self, PyObject *args) {
    /* use_kernels(level) -> name: the best kernel set up to level (0 generic, 1 AVX2, 2
     * AVX-512) this CPU has, for tests that run every set; 2 restores the module's default */
    int level;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &level)) return NULL;
    return PyUnicode_FromString(select_kernels_upto(level));
}

static PyObject *mod_y_pool_min_bytes(PyObject *self, PyObject *args) {
    /* y_pool_min_bytes(bytes=0) -> the previous value: from which size combine outputs come
     * from the Buffer's blocks (fastpath.c new_y); tests lower it to reach the pool cheaply */
    long long bytes = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "|L", &bytes)) return NULL;
    return PyLong_FromLongLong((long long)fast_y_pool_min((npy_intp)bytes));
}

/* schedule(topk_idx_i32, spec tuple, out_units int64 [6, cap], out_core_ptr int64 [n + 1])
 * -> units: the native scheduler alone (tests compare it with ubep.sched.schedule).
 * spec: (policy, expert_layout, R, E, K, n, hop [R], issue [H], rpos [E]) */
static PyObject *mod_schedule(PyObject *self, PyObject *args) {
    PyObject *oroute, *ohop, *oissue, *orpos, *ounits, *optr;
    sched_spec_t s;
    (void)self;
    if (!PyArg_ParseTuple(args, "O(iiiiiiOOO)OO", &oroute, &s.policy, &s.expert_layout, &s.R,
                          &s.E, &s.K, &s.n, &ohop, &oissue, &orpos, &ounits, &optr))
        return NULL;
    pbuf_t b[6];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (s.R < 1 || s.E < 1 || s.K < 1 || s.n < 1 || s.E % s.R) {
        PyErr_SetString(PyExc_ValueError, "spec: sizes");
        return NULL;
    }
    s.L = s.E / s.R;
    if (get_buf(oroute, &b[0], 0, "topk_idx", 0) || get_buf(ohop, &b[1], 0, "hop", s.R * 8) ||
        get_buf(oissue, &b[2], 0, "issue", 8) || get_buf(orpos, &b[3], 0, "rpos", s.E * 8) ||
        get_buf(ounits, &b[4], 1, "out_units", 0) ||
        get_buf(optr, &b[5], 1, "out_core_ptr", (s.n + 1) * 8))
        goto done;
    s.H = (int)(b[2].b.len / 8);
    s.hop = b[1].b.buf; s.issue = b[2].b.buf; s.rpos = b[3].b.buf;
    int64_t T = b[0].b.len / 4 / s.K, cap = T * s.K;
    const char *bad = sched_spec_check(&s);
    if (bad || b[4].b.len < cap * 6 * 8) {
        PyErr_SetString(PyExc_ValueError, bad ? bad : "out_units too small");
        goto done;
    }
    const int32_t *route = b[0].b.buf;
    for (int64_t i = 0; i < cap; i++)
        if (route[i] < -1 || route[i] >= s.E) {
            PyErr_SetString(PyExc_ValueError, "topk_idx: expert id out of range");
            goto done;
        }
    /* one work space kept across calls (the GIL serialises them), as an engine keeps its own:
     * a timed call then prices the scheduler, not fresh pages */
    static sched_work_t w;
    if (!sched_work_ok(&w) || w.cap < cap || w.H != s.H || w.E != s.E || w.R != s.R ||
        w.n < s.n) {
        sched_work_free(&w);
        sched_work_init(&w, cap, s.H, s.E, s.R, s.n);
        if (!sched_work_ok(&w)) {
            sched_work_free(&w);
            PyErr_NoMemory();
            goto done;
        }
    }
    int64_t nu = sched_build(&s, route, T, &w);
    int64_t *out = b[4].b.buf;
    const int64_t *cols[6] = {w.token, w.k, w.expert, w.dst, w.hop, w.slot};
    for (int c = 0; c < 6; c++) memcpy(out + c * cap, cols[c], (size_t)nu * 8);
    memcpy(b[5].b.buf, w.core_ptr, (size_t)(s.n + 1) * 8);
    res = PyLong_FromLongLong(nu);
done:
    rel_bufs(b, 6);
    return res;
}

PyMethodDef HOOK_METHODS[] = {
    {"schedule", mod_schedule, METH_VARARGS,
     "schedule(topk_i32, spec, out_units, out_core_ptr) -> units: the native scheduler (tests)"},
    {"y_pool_min_bytes", mod_y_pool_min_bytes, METH_VARARGS,
     "y_pool_min_bytes(bytes=0) -> previous value (0 reads it; tests)"},
    {"reduce_rows", mod_reduce_rows, METH_VARARGS,
     "reduce_rows(rows, nt, weights, out, dtype_code, weighted): combine's REDUCE"},
    {"reduce_at", mod_reduce_at, METH_VARARGS,
     "reduce_at(rows, at, weights, out, K, dtype_code, weighted): REDUCE of rows by index"},
    {"use_kernels", mod_use_kernels, METH_VARARGS,
     "use_kernels(level) -> kernel set name (0 generic, 1 avx2, 2 avx512; tests)"},
    {"dispatch_layout", mod_dispatch_layout, METH_VARARGS,
     "dispatch_layout(idx_i64, num_experts, num_ranks, per_rank_i32, per_expert_i32, in_rank)"},
    {"any_negative", mod_any_negative, METH_O, "any_negative(idx_i64) -> whether an id is < 0"},
    {"received_counts", mod_received_counts, METH_VARARGS,
     "received_counts(rank, token, local_idx, R, L, align, counts, aligned, start, per_rank)"},
    {"masked_weights", mod_masked_weights, METH_VARARGS,
     "masked_weights(idx_i64, w_f32|None, num_experts, out_f32, plus_zero) -> ids in range"},
    {"counts_sum", mod_counts_sum, METH_VARARGS, "counts_sum(epoch, rows, counts_u32)"},
    {"ranks_sum", mod_ranks_sum, METH_VARARGS, "ranks_sum(epoch, rows_per_rank_u32)"},
    {"route_sum", mod_route_sum, METH_VARARGS, "route_sum(epoch, ntok, idx_i32, weights_f32)"},
    {"row_sums", mod_row_sums, METH_VARARGS, "row_sums(rows, row_bytes) -> u64 bytes per row"},
    {"comb_info_sum", mod_comb_info_sum, METH_VARARGS,
     "comb_info_sum(epoch, offset, rows, stride, dispatch_index)"},
    {"copy", mod_copy, METH_VARARGS, "copy(dst, src, element_safe=0): the data plane's copy"},
    {"dc_checksum", mod_dc_checksum, METH_VARARGS, "dc_checksum(rows, row_bytes, epoch)"},
    {"convert", mod_convert, METH_VARARGS, "convert(acc_f32, out, dtype_code)"},
    {"quantize_rows", mod_quantize_rows, METH_VARARGS,
     "quantize_rows(x, fmt, round_scale, values_out, scales_out, generic=0): ubep.quant"},
    {NULL, NULL, 0, NULL},
};
