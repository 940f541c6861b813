/* The one-call fast path of blocking calls (decode-sized calls).
 *
 * A decode step dispatches a few tokens; building its arguments and its result in Python cost
 * more than the native call (~60 numpy and attribute operations, 8-10 us). Here one C call
 * checks the arguments, allocates the outputs, runs the call and builds the result objects
 * (numpy views of two owned blocks and of the receive region, ubep.plane.results'
 * DispatchResult and RuntimeHandle) -- the same objects, field for field, that the engine's
 * general path (ubep.plane.host.HostEngine) builds.
 *
 * These are the engine's door (ubep.plane.Engine.dispatch / combine), which each call passes
 * once. Only the common case runs here: numpy arrays of the Buffer's dtypes and the shapes it
 * expects, a handle of this Buffer; an array not C-contiguous and aligned is copied into that
 * layout first (taken()), as the Buffer's checks would. Offered without options a shape it
 * does not serve, it returns None before anything is touched (ubep.buffer's checks then raise
 * the InvalidArgumentError that names the argument); a call with options that are not the
 * plain ones (split, copy, pre-quantised rows), or with arrays this path does not take, goes
 * to the general path set_fast names.
 */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <string.h>

#define NO_IMPORT_ARRAY
#include "calls.h"
#include "fastpath.h"

/* result and handle field names, interned once */
enum {
    K_RECV_X, K_RECV_TOPK_IDX, K_RECV_TOPK_WEIGHTS, K_NUM_RECV_TOKENS_PER_EXPERT,
    K_RECV_SRC_RANK, K_RECV_SRC_TOKEN, K_RECV_SRC_K, K_HANDLE, K_RECV_X_SCALES,
    K_NUM_SENT_ROWS_PER_RANK,
    K_NUM_TOKENS, K_TOPK_IDX, K_TOPK_WEIGHTS, K_NUM_RECV_ROWS_PER_RANK, K_SEND_DST_ROW,
    K_DISPATCH_INDEX, K_GENERATION, K_BUFFER_UID, K_RANK, K_LAYOUT, K_HIDDEN, K_NUM_RANKS,
    K_NUM_EXPERTS, K_X_DTYPE, NUM_KEYS
};
static const char *const KEY_NAMES[NUM_KEYS] = {
    "recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert",
    "recv_src_rank", "recv_src_token", "recv_src_k", "handle", "recv_x_scales",
    "num_sent_rows_per_rank",
    "num_tokens", "topk_idx", "topk_weights", "num_recv_rows_per_rank", "send_dst_row",
    "dispatch_index", "generation", "buffer_uid", "rank", "layout", "hidden", "num_ranks",
    "num_experts", "x_dtype",
};
PyObject *fast_field_names(void) {
    PyObject *t = PyTuple_New(NUM_KEYS);
    for (int i = 0; t && i < NUM_KEYS; i++) {
        PyObject *s = PyUnicode_FromString(KEY_NAMES[i]);
        if (!s) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

/* the handle fields that are the same for every call of a Buffer */
#define FIRST_CONST_KEY K_BUFFER_UID

/* Every object of one dispatch result the fast path built: the result, its handle, their
 * __dict__s, the two blocks and the array views of them (and of the receive region). */
enum { KO_RES, KO_RES_DICT, KO_HANDLE, KO_HANDLE_DICT, KO_I64, KO_F32, KO_VIEWS };
#define KEPT_MAX 24
typedef struct {
    PyObject *obj[KEPT_MAX];
    Py_ssize_t refs[KEPT_MAX]; /* each one's count when only the graph and this cache hold it */
    int n;
    int64_t ntok; /* the call's tokens: the blocks are laid out for them */
} kept_t;

struct fast {
    PyObject *result_type, *handle_type; /* ubep.plane.results: DispatchResult, RuntimeHandle */
    /* the engine's general path (ubep.plane.host.HostEngine, by weak reference): the calls
     * that come with options or whose arrays this path does not take as they are */
    PyObject *general_dispatch, *general_combine;
    PyObject *plain; /* the options object of a plain blocking call (CallOptions()) */
    PyObject *handle_const;              /* dict: the handle's per-Buffer fields */
    PyObject *recv_views[8];             /* [cap_rows, hidden] read-only view of each region */
    PyObject *scale_views[8];            /* quantised rows: their float32 scales, else NULL */
    PyArray_Descr *x_descr, *c_descr;    /* storage dtype of x, of expert_out and y */
    PyObject *keys[NUM_KEYS];
    /* handle_const's values by key (borrowed: handle_const holds them), NULL where absent;
     * looked up once here instead of once per combine */
    PyObject *const_vals[NUM_KEYS];
    /* big combine outputs: blocks handed out again once nothing views them (new_y) */
    PyObject *y_blocks[2];
    /* per receive region, the last dispatch result built (reused: kept_free) */
    kept_t kept[8];
};

static void kept_drop(kept_t *k) {
    for (int i = 0; i < k->n; i++) Py_DECREF(k->obj[i]);
    k->n = 0;
}

static void release(fast_t *f) {
    if (!f) return;
    for (int i = 0; i < 8; i++) kept_drop(&f->kept[i]);
    Py_XDECREF(f->result_type);
    Py_XDECREF(f->handle_type);
    Py_XDECREF(f->handle_const);
    Py_XDECREF(f->general_dispatch);
    Py_XDECREF(f->general_combine);
    Py_XDECREF(f->plain);
    for (int i = 0; i < 8; i++) {
        Py_XDECREF(f->recv_views[i]);
        Py_XDECREF(f->scale_views[i]);
    }
    Py_XDECREF(f->x_descr);
    Py_XDECREF(f->c_descr);
    for (int i = 0; i < NUM_KEYS; i++) Py_XDECREF(f->keys[i]);
    for (int i = 0; i < 2; i++) Py_XDECREF(f->y_blocks[i]); /* views keep theirs alive */
    free(f);
}

void fast_free(engine_t *g) {
    fast_t *f = g->fast;
    g->fast = NULL;
    release(f);
}

/* a full-capacity read-only view of a region as ubep.buffer builds it */
static int region_view_ok(engine_t *g, PyObject *v, int64_t width_bytes) {
    if (!PyArray_CheckExact(v)) return 0;
    PyArrayObject *a = (PyArrayObject *)v;
    return PyArray_NDIM(a) == 2 && PyArray_DIM(a, 0) == g->cap_rows &&
           PyArray_DIM(a, 1) * PyArray_ITEMSIZE(a) == width_bytes &&
           PyArray_STRIDE(a, 0) == g->out_stride;
}

/* set_fast(DispatchResult, RuntimeHandle, handle_const, recv_views, scale_views, x_dtype,
 *          combine_dtype, general_dispatch, general_combine, plain): what the fast path builds
 *          its results from, and where the other calls go (once per Buffer) */
PyObject *engine_set_fast(engine_t *g, PyObject *args) {
    PyObject *rt, *ht, *hc, *rv, *sv, *xd, *cd, *gd, *gc, *plain;
    xd = cd = NULL;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OO&O&OOO", &PyType_Type, &rt, &PyType_Type, &ht,
                          &PyDict_Type, &hc, &PyList_Type, &rv, &sv, PyArray_DescrConverter, &xd,
                          PyArray_DescrConverter, &cd, &gd, &gc, &plain)) {
        Py_XDECREF(xd); /* converted before a later argument failed */
        return NULL;
    }
    fast_t *f = calloc(1, sizeof(fast_t));
    if (!f) {
        Py_DECREF(xd);
        Py_DECREF(cd);
        return PyErr_NoMemory();
    }
    f->x_descr = (PyArray_Descr *)xd;
    f->c_descr = (PyArray_Descr *)cd;
    Py_INCREF(rt); f->result_type = rt;
    Py_INCREF(ht); f->handle_type = ht;
    f->general_dispatch = Py_NewRef(gd);
    f->general_combine = Py_NewRef(gc);
    f->plain = Py_NewRef(plain);
    f->handle_const = PyDict_Copy(hc);
    fast_t *old = g->fast;
    g->fast = f;
    release(old);
    int ok = f->handle_const != NULL && PyList_GET_SIZE(rv) == g->nreg &&
             (sv == Py_None || (PyList_Check(sv) && PyList_GET_SIZE(sv) == g->nreg));
    for (int i = 0; ok && i < NUM_KEYS; i++)
        ok = (f->keys[i] = PyUnicode_InternFromString(KEY_NAMES[i])) != NULL;
    for (int i = FIRST_CONST_KEY; ok && i < NUM_KEYS; i++) {
        f->const_vals[i] = PyDict_GetItemWithError(f->handle_const, f->keys[i]);
        ok = !PyErr_Occurred();
    }
    for (int r = 0; ok && r < g->nreg; r++) {
        PyObject *v = PyList_GET_ITEM(rv, r);
        ok = region_view_ok(g, v, g->quant ? g->hidden : g->row_bytes);
        if (ok) { Py_INCREF(v); f->recv_views[r] = v; }
        if (ok && sv != Py_None) {
            PyObject *s = PyList_GET_ITEM(sv, r);
            ok = region_view_ok(g, s, (int64_t)(g->hidden / QUANT_BLOCK) * 4);
            if (ok) { Py_INCREF(s); f->scale_views[r] = s; }
        }
    }
    if (ok && (sv == Py_None) != !g->quant) ok = 0;
    if (!ok) {
        fast_free(g);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "engine.set_fast: views do not match the engine");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- argument checks: 1 if `o` is exactly what the native call reads, else 0 ------------- */

static int exact(PyObject *o, int type_num, npy_intp rows, npy_intp cols) {
    if (!PyArray_CheckExact(o)) return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    return PyArray_TYPE(a) == type_num && PyArray_NDIM(a) == 2 && PyArray_DIM(a, 0) == rows &&
           PyArray_DIM(a, 1) == cols && PyArray_IS_C_CONTIGUOUS(a) && PyArray_ISALIGNED(a) &&
           PyArray_ISNOTSWAPPED(a);
}

/* `o` as the native call reads it, a new reference: `o` itself when exact; for another numpy
 * array of that shape, a C-contiguous aligned copy (with `cast`, of any numeric type, cast as
 * np.ascontiguousarray(o, dtype) casts; else of the same type only): the conversion the
 * Buffer's checks would make, made here so that the call still takes this one door. NULL for
 * anything else, with an error set only if the copy could not be made. */
static PyObject *taken(PyObject *o, int type_num, npy_intp rows, npy_intp cols, int cast) {
    if (exact(o, type_num, rows, cols)) return Py_NewRef(o);
    if (!PyArray_Check(o)) return NULL;
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 0) != rows || PyArray_DIM(a, 1) != cols ||
        (!cast && PyArray_TYPE(a) != type_num))
        return NULL;
    return PyArray_FromAny(o, PyArray_DescrFromType(type_num), 2, 2,
                           NPY_ARRAY_CARRAY_RO | NPY_ARRAY_ENSUREARRAY | NPY_ARRAY_FORCECAST,
                           NULL);
}

/* ---- result building ------------------------------------------------------------------- */

/* a view of `base`'s memory (base keeps it alive) */
static PyObject *view(PyObject *base, PyArray_Descr *d, int nd, npy_intp *dims,
                      npy_intp *strides, void *data, int writable) {
    Py_INCREF(d);
    PyObject *a = PyArray_NewFromDescr(&PyArray_Type, d, nd, dims, strides, data,
                                       writable ? NPY_ARRAY_WRITEABLE : 0, NULL);
    if (!a) return NULL;
    Py_INCREF(base);
    if (PyArray_SetBaseObject((PyArrayObject *)a, base) < 0) {
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

/* A combine's y. One above glibc's mapping ceiling (32 MiB on 64-bit: anything larger is mapped
 * anew and unmapped on free, whatever the allocator's adaptive threshold) would be fresh
 * zero-filled pages, faulted in one by one, every call: 547 faults and about a third of a
 * 2-rank 2346-token hidden-7168 combine (33.6 MB). So a y that big is a view of one of two blocks
 * the Buffer keeps, and a block goes out again only when nothing but this pool holds it: every
 * array that views y, and every object that keeps such an array (a view, a memoryview, a torch
 * tensor from torch.from_numpy, a DLPack capsule), holds a reference that leads to the block,
 * so a y the caller still has is never written. Two blocks, so that a caller keeping each y
 * until the next call's returns (two micro-batches) still reuses them; with both held, y is an
 * array of its own, as below the threshold. A block is at most twice the y it holds. */
static npy_intp y_pool_min_bytes = (npy_intp)32 << 20;

npy_intp fast_y_pool_min(npy_intp bytes) {
    npy_intp old = y_pool_min_bytes;
    if (bytes > 0) y_pool_min_bytes = bytes;
    return old;
}

static int block_free(PyObject *b) { return !b || Py_REFCNT(b) == 1; }
static int block_fits(PyObject *b, npy_intp nbytes) {
    npy_intp have = b ? PyArray_NBYTES((PyArrayObject *)b) : 0;
    return have >= nbytes && have <= 2 * nbytes;
}

static PyObject *new_y(engine_t *g, fast_t *f, npy_intp ntok) {
    npy_intp dims[2] = {ntok, g->hidden};
    npy_intp nbytes = ntok * g->hidden * (npy_intp)g->cisz;
    int pick = -1;
    for (int pass = 0; nbytes >= y_pool_min_bytes && pass < 2 && pick < 0; pass++)
        for (int i = 0; i < 2 && pick < 0; i++) /* a free block that fits, else any free one */
            if (block_free(f->y_blocks[i]) && (pass || block_fits(f->y_blocks[i], nbytes)))
                pick = i;
    if (pick < 0) {
        Py_INCREF(f->c_descr);
        return PyArray_NewFromDescr(&PyArray_Type, f->c_descr, 2, dims, NULL, NULL, 0, NULL);
    }
    if (!block_fits(f->y_blocks[pick], nbytes)) { /* nobody else holds it: replaced, freed */
        PyObject *b = PyArray_SimpleNew(1, &nbytes, NPY_UINT8);
        if (!b) return NULL;
        Py_XSETREF(f->y_blocks[pick], b);
    }
    PyObject *b = f->y_blocks[pick];
    return view(b, f->c_descr, 2, dims, NULL, PyArray_DATA((PyArrayObject *)b), 1);
}

/* an instance of a frozen dataclass with `fields` as its __dict__ (steals fields), without
 * __init__: what ubep.buffer.regions.new_frozen does. The dict goes in through the type's own
 * `__dict__` descriptor (object.__setattr__(obj, "__dict__", fields)), not
 * PyObject_GenericSetDict: from 3.13 an instance keeps its attributes inline, and only the
 * descriptor retires the inline values so that lookups read the new dict. */
static PyObject *frozen(PyObject *type, PyObject *fields) {
    static PyObject *dict_name;
    if (!dict_name && !(dict_name = PyUnicode_InternFromString("__dict__"))) {
        Py_DECREF(fields);
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)type;
    PyObject *obj = t->tp_alloc(t, 0);
    if (obj && PyObject_GenericSetAttr(obj, dict_name, fields) < 0) Py_CLEAR(obj);
    Py_DECREF(fields);
    return obj;
}

static int put(PyObject *d, PyObject *key, PyObject *v) { /* steals v */
    if (!v) return -1;
    int rc = PyDict_SetItem(d, key, v);
    Py_DECREF(v);
    return rc;
}

/* The outputs of one dispatch: one int64 block (recv_topk_idx | recv_src_rank, _token, _k |
 * counts per local expert, rows per source rank, rows per (source, destination) rank |
 * send_dst_row | topk_idx) and one
 * float32 block (recv_topk_weights | topk_weights): two allocations, not eleven. */
typedef struct {
    PyObject *i64, *f32;
    int64_t *o_idx, *meta, *counts, *dst, *idx;
    float *o_w, *w;
    int64_t w_idx, w_dst; /* row widths of recv_topk_idx, send_dst_row */
} outputs_t;

/* the parts of the two blocks (laid out for ntok tokens) */
static void point_outputs(engine_t *g, int64_t ntok, outputs_t *o) {
    const int64_t cap = g->cap_rows, L = g->L, R = g->R;
    const int expert = g->layout != LAY_RANK;
    o->w_idx = expert ? 1 : g->K;
    o->w_dst = expert ? g->K : R;
    o->o_idx = PyArray_DATA((PyArrayObject *)o->i64);
    o->meta = o->o_idx + cap * o->w_idx;
    o->counts = o->meta + 3 * cap;
    o->dst = o->counts + L + R + R * R;
    o->idx = o->dst + ntok * o->w_dst;
    o->o_w = PyArray_DATA((PyArrayObject *)o->f32);
    o->w = o->o_w + cap * o->w_idx;
}

static int alloc_outputs(engine_t *g, int64_t ntok, outputs_t *o) {
    const int64_t cap = g->cap_rows, K = g->K, L = g->L, R = g->R;
    const int expert = g->layout != LAY_RANK;
    const int64_t w_idx = expert ? 1 : K, w_dst = expert ? K : R;
    npy_intp n64 = cap * w_idx + 3 * cap + L + R + R * R + ntok * w_dst + ntok * K;
    npy_intp n32 = cap * w_idx + ntok * K;
    o->i64 = PyArray_SimpleNew(1, &n64, NPY_INT64);
    o->f32 = o->i64 ? PyArray_SimpleNew(1, &n32, NPY_FLOAT32) : NULL;
    if (!o->f32) {
        Py_CLEAR(o->i64);
        return -1;
    }
    point_outputs(g, ntok, o);
    return 0;
}

/* 1-D or 2-D ([rows, width]) C-order view */
static PyObject *rows_of(PyObject *base, int type_num, void *data, int64_t rows, int64_t width,
                         int two_d, int writable) {
    PyArray_Descr *d = PyArray_DescrFromType(type_num);
    npy_intp dims[2] = {rows, width};
    PyObject *v = view(base, d, two_d ? 2 : 1, dims, NULL, data, writable);
    Py_DECREF(d);
    return v;
}

/* the view of the first n rows of a full-capacity region view */
static PyObject *head_rows(PyObject *full, int64_t n) {
    PyArrayObject *a = (PyArrayObject *)full;
    npy_intp dims[2] = {n, PyArray_DIM(a, 1)};
    return view(full, PyArray_DESCR(a), 2, dims, PyArray_STRIDES(a), PyArray_DATA(a), 0);
}

static PyObject *build_dispatch_result(engine_t *g, const outputs_t *o, int64_t ntok,
                                       int64_t n, long long index, PyObject *generation) {
    fast_t *f = g->fast;
    PyObject **k = f->keys;
    const int64_t cap = g->cap_rows, K = g->K, L = g->L, R = g->R;
    const int expert = g->layout != LAY_RANK;
    int reg = (int)(index % g->nreg);
    PyObject *res = PyDict_New(), *h = PyDict_Copy(f->handle_const);
    if (!res || !h) goto fail;
    /* shared by the result and the handle, and what combine trusts: read-only */
    PyObject *src[3];
    for (int i = 0; i < 3; i++) {
        src[i] = rows_of(o->i64, NPY_INT64, o->meta + i * cap, n, 1, 0, 0);
        if (!src[i] || PyDict_SetItem(res, k[K_RECV_SRC_RANK + i], src[i]) < 0 ||
            PyDict_SetItem(h, k[K_RECV_SRC_RANK + i], src[i]) < 0) {
            Py_XDECREF(src[i]);
            goto fail;
        }
        Py_DECREF(src[i]);
    }
    if (put(res, k[K_RECV_X], head_rows(f->recv_views[reg], n)) ||
        put(res, k[K_RECV_TOPK_IDX], rows_of(o->i64, NPY_INT64, o->o_idx, n, K, !expert, 1)) ||
        put(res, k[K_RECV_TOPK_WEIGHTS], rows_of(o->f32, NPY_FLOAT32, o->o_w, n, K, !expert, 1)) ||
        put(res, k[K_NUM_RECV_TOKENS_PER_EXPERT],
            rows_of(o->i64, NPY_INT64, o->counts, L, 1, 0, 1)) ||
        put(res, k[K_RECV_X_SCALES], f->scale_views[reg] ? head_rows(f->scale_views[reg], n)
                                                          : Py_NewRef(Py_None)) ||
        put(res, k[K_NUM_SENT_ROWS_PER_RANK],
            rows_of(o->i64, NPY_INT64, o->counts + L + R, R, R, 1, 0)) ||
        put(h, k[K_NUM_TOKENS], PyLong_FromLongLong(ntok)) ||
        put(h, k[K_TOPK_IDX], rows_of(o->i64, NPY_INT64, o->idx, ntok, K, 1, 0)) ||
        put(h, k[K_TOPK_WEIGHTS], rows_of(o->f32, NPY_FLOAT32, o->w, ntok, K, 1, 0)) ||
        put(h, k[K_NUM_RECV_ROWS_PER_RANK], rows_of(o->i64, NPY_INT64, o->counts + L, R, 1, 0, 1)) ||
        put(h, k[K_SEND_DST_ROW], rows_of(o->i64, NPY_INT64, o->dst, ntok, o->w_dst, 1, 0)) ||
        put(h, k[K_DISPATCH_INDEX], PyLong_FromLongLong(index)) ||
        PyDict_SetItem(h, k[K_GENERATION], generation) < 0)
        goto fail;
    PyObject *handle = frozen(f->handle_type, h);
    h = NULL;
    if (put(res, k[K_HANDLE], handle)) goto fail;
    return frozen(f->result_type, res);
fail:
    Py_XDECREF(res);
    Py_XDECREF(h);
    return NULL;
}

/* ---- reusing a region's last result ------------------------------------------------------
 *
 * Building a result (two blocks, eleven views, two dicts, two objects) and freeing the one
 * before it is most of a small dispatch's exit. So the fast path keeps the last result it built
 * per receive region, and a dispatch into that region with the same number of tokens refills it
 * in place (the views' row counts, the handle's dispatch index and generation) when nothing but
 * the result's own graph and this cache refers to any of its objects: every refcount equal to
 * the one taken when the result was handed out, minus the caller's reference, and no weak
 * reference to any. Whatever the caller kept (the result, its handle, a field, a slice of one:
 * a numpy view keeps the block under it alive, a memoryview or tensor keeps its array) makes a
 * count differ, and a new result is built: a result anyone can still reach is never written. */

static int has_weakrefs(PyObject *o) {
    Py_ssize_t off = Py_TYPE(o)->tp_weaklistoffset;
    return off > 0 && *(PyObject **)((char *)o + off) != NULL;
}

static int kept_free(const kept_t *k) {
    if (k->n == 0) return 0;
    for (int i = 0; i < k->n; i++) /* None (recv_x_scales of unquantised rows) is shared */
        if (k->obj[i] != Py_None &&
            (Py_REFCNT(k->obj[i]) != k->refs[i] || has_weakrefs(k->obj[i])))
            return 0;
    return 1;
}

static int kept_add(kept_t *k, PyObject *o) { /* a new reference, held by the cache */
    if (!o || k->n == KEPT_MAX) return -1;
    Py_INCREF(o);
    k->obj[k->n++] = o;
    return 0;
}

/* keys of the views, in the order keep() adds them after KO_VIEWS */
enum { KV_RES_FIELDS = 7, KV_HANDLE_FIELDS = 4 };
static const int VIEW_RES_KEYS[KV_RES_FIELDS] = {
    K_RECV_X, K_RECV_X_SCALES, K_RECV_TOPK_IDX, K_RECV_TOPK_WEIGHTS, K_RECV_SRC_RANK + 0,
    K_NUM_RECV_TOKENS_PER_EXPERT, K_NUM_SENT_ROWS_PER_RANK};
static const int VIEW_HANDLE_KEYS[KV_HANDLE_FIELDS] = {
    K_TOPK_IDX, K_TOPK_WEIGHTS, K_NUM_RECV_ROWS_PER_RANK, K_SEND_DST_ROW};

/* Remember `res` (just built for region reg from blocks o) as that region's result to refill. */
static void keep(fast_t *f, int reg, int64_t ntok, PyObject *res, const outputs_t *o) {
    kept_t *k = &f->kept[reg];
    kept_drop(k);
    PyObject *d = PyObject_GenericGetDict(res, NULL), *hd = NULL;
    PyObject *h = d ? PyDict_GetItemWithError(d, f->keys[K_HANDLE]) : NULL;
    int ok = kept_add(k, res) == 0 && kept_add(k, d) == 0 && kept_add(k, h) == 0;
    if (ok) hd = PyObject_GenericGetDict(h, NULL);
    ok = ok && kept_add(k, hd) == 0 && kept_add(k, o->i64) == 0 && kept_add(k, o->f32) == 0;
    for (int i = 0; ok && i < KV_RES_FIELDS; i++) {
        PyObject *v = PyDict_GetItemWithError(d, f->keys[VIEW_RES_KEYS[i]]);
        ok = v != NULL && kept_add(k, v) == 0;
    }
    for (int i = 1; ok && i < 3; i++) /* recv_src_token, recv_src_k */
        ok = kept_add(k, PyDict_GetItemWithError(d, f->keys[K_RECV_SRC_RANK + i])) == 0;
    for (int i = 0; ok && i < KV_HANDLE_FIELDS; i++)
        ok = kept_add(k, PyDict_GetItemWithError(hd, f->keys[VIEW_HANDLE_KEYS[i]])) == 0;
    Py_XDECREF(d);
    Py_XDECREF(hd);
    if (!ok) { /* not kept: the next dispatch builds anew */
        PyErr_Clear();
        kept_drop(k);
        return;
    }
    for (int i = 0; i < k->n; i++) k->refs[i] = Py_REFCNT(k->obj[i]);
    k->refs[KO_RES] -= 1; /* the caller's */
    k->ntok = ntok;
}

static void set_rows(PyObject *a, npy_intp rows) {
    if (a == Py_None) return; /* recv_x_scales without quantised rows */
    PyArray_DIMS((PyArrayObject *)a)[0] = rows;
    PyArray_UpdateFlags((PyArrayObject *)a, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_F_CONTIGUOUS);
}

/* The kept result of region reg, refilled for this call (n rows received): a new reference. */
static PyObject *refill(fast_t *f, int reg, int64_t n, long long index, PyObject *generation) {
    kept_t *k = &f->kept[reg];
    PyObject **v = k->obj + KO_VIEWS;
    /* recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_rank; then
     * recv_src_token, recv_src_k (after the counts); the handle's rows are the call's tokens,
     * the same number (kept_t.ntok) */
    for (int i = 0; i < 5; i++) set_rows(v[i], n);
    set_rows(v[KV_RES_FIELDS], n);
    set_rows(v[KV_RES_FIELDS + 1], n);
    PyObject *hd = k->obj[KO_HANDLE_DICT], **key = f->keys;
    if (put(hd, key[K_DISPATCH_INDEX], PyLong_FromLongLong(index)) ||
        PyDict_SetItem(hd, key[K_GENERATION], generation) < 0)
        return NULL;
    return Py_NewRef(k->obj[KO_RES]);
}

/* Not this path's call. Without options (the caller's arrays, offered unchecked): None,
 * nothing was done (a shape the Buffer's checks reject, or outputs that could not be
 * allocated). With options: the general path takes it. */
static PyObject *not_this(PyObject *general, PyObject *opts, PyObject *args) {
    if (!opts) Py_RETURN_NONE;
    if (!general) {
        PyErr_SetString(PyExc_RuntimeError, "engine: no general path (set_fast not called)");
        return NULL;
    }
    return PyObject_Call(general, args, NULL);
}

/* the fast path's dispatch of arrays it took (taken()): outputs, the call, its result */
static PyObject *dispatch_taken(engine_t *g, fast_t *f, dispatch_args_t *args_in, npy_intp ntok,
                                PyObject *generation, PyObject *opts, PyObject *args) {
    dispatch_args_t a = *args_in;
    outputs_t o;
    int reg = (int)(a.index % g->nreg);
    int reuse = f->kept[reg].ntok == ntok && kept_free(&f->kept[reg]);
    if (reuse) { /* the kept result's blocks: its arrays are refilled below */
        o.i64 = Py_NewRef(f->kept[reg].obj[KO_I64]);
        o.f32 = Py_NewRef(f->kept[reg].obj[KO_F32]);
        point_outputs(g, ntok, &o);
    } else if (alloc_outputs(g, ntok, &o)) { /* nothing was done: the general path */
        PyErr_Clear(); /* allocates (and fails, if it must) before the call, a clean reject */
        return not_this(f->general_dispatch, opts, args);
    }
    /* owned copies: the handle keeps them, the caller may reuse its arrays. topk_idx's is
     * written by validation as it reads the caller's array (one pass over it per call) */
    memcpy(o.w, PyArray_DATA((PyArrayObject *)a.topk_weights), (size_t)ntok * g->K * 4);
    a.num_tokens = ntok;
    a.prequant = 0;
    a.out[0] = NULL; /* the blocks' parts, directly */
    a.direct.topk = PyArray_DATA((PyArrayObject *)a.topk_idx);
    a.direct.topk_copy = o.idx; a.direct.w = o.w;
    a.direct.o_idx = o.o_idx; a.direct.o_w = o.o_w;
    a.direct.o_src_rank = o.meta; a.direct.o_src_tok = o.meta + g->cap_rows;
    a.direct.o_src_k = o.meta + 2 * g->cap_rows;
    a.direct.o_nrecv = o.counts; a.direct.o_dst_row = o.dst;
    call_t *c = dispatch_call(g, &a);
    PyObject *res = c ? call_run(g, c, 0) : NULL;
    if (res && PyLong_Check(res)) {
        long long n = PyLong_AsLongLong(res);
        Py_DECREF(res);
        res = reuse ? refill(f, reg, n, a.index, generation)
                    : build_dispatch_result(g, &o, ntok, n, a.index, generation);
        if (res && !reuse) {
            Py_DECREF(o.i64); /* keep() counts the references the result holds */
            Py_DECREF(o.f32);
            keep(f, reg, ntok, res, &o);
            return res;
        }
    }
    Py_DECREF(o.i64);
    Py_DECREF(o.f32);
    return res;
}

/* dispatch(x, topk_idx, topk_weights, epoch, index, generation, plan[, opts]) -> None (no
 * opts, not this path's case: nothing was done; with split opts: the first half ran) |
 * DispatchResult | ErrorRecord (ubep.plane.protocol.Engine.dispatch) */
PyObject *engine_dispatch_fast(engine_t *g, PyObject *args) {
    g->trace[TRACE_D_NATIVE] = now_ns(); /* the general path stamps again if it takes the call */
    dispatch_args_t a;
    PyObject *generation, *opts = NULL;
    if (!PyArg_ParseTuple(args, "OOOKLOO|O", &a.x, &a.topk_idx, &a.topk_weights, &a.epoch,
                          &a.index, &generation, &a.plan, &opts))
        return NULL;
    fast_t *f = g->fast;
    if (opts == Py_None) opts = NULL;
    if (!f) return not_this(NULL, opts, args);
    if (opts && opts != f->plain) return not_this(f->general_dispatch, opts, args);
    /* tensors as numpy views of their memory (dl_array; numpy arrays as they are) */
    PyObject *in[3] = {dl_array(a.x), dl_array(a.topk_idx), dl_array(a.topk_weights)};
    PyObject *held[3] = {NULL, NULL, NULL};
    npy_intp ntok = PyArray_Check(in[0]) && PyArray_NDIM((PyArrayObject *)in[0]) == 2
                        ? PyArray_DIM((PyArrayObject *)in[0], 0) : -1;
    /* the arrays as the call reads them (a layout copy where the caller's is not one) */
    if (ntok >= 0 && ntok <= g->T &&
        (held[0] = taken(in[0], f->x_descr->type_num, ntok, g->hidden, 0)) != NULL &&
        (held[1] = taken(in[1], NPY_INT64, ntok, g->K, 0)) != NULL)
        held[2] = taken(in[2], NPY_FLOAT32, ntok, g->K, 0);
    for (int i = 0; i < 3; i++) Py_DECREF(in[i]); /* held[] keeps what the call reads */
    if (!held[2]) {
        for (int i = 0; i < 3; i++) Py_XDECREF(held[i]);
        PyErr_Clear(); /* a copy that could not be made: declined, nothing was done */
        return not_this(f->general_dispatch, opts, args);
    }
    a.x = held[0]; a.topk_idx = held[1]; a.topk_weights = held[2];
    PyObject *res = dispatch_taken(g, f, &a, ntok, generation, opts, args);
    for (int i = 0; i < 3; i++) Py_DECREF(held[i]);
    return res;
}

/* whether the bytes [lo, hi) of expert outputs lie in a receive region that a dispatch after
 * dispatch `index` has filled again (of `num_dispatches` so far): the C side of
 * HostEngine.stale_view (plane/host.py) */
static int overwritten(engine_t *g, uintptr_t lo, uintptr_t hi, long long index,
                       long long num_dispatches) {
    for (int r = 0; r < g->nreg && r < num_dispatches; r++) {
        const uintptr_t base = (uintptr_t)outreg(g, g->rank, r);
        if (hi <= lo || hi <= base || lo >= base + (uintptr_t)g->out_bytes) continue;
        const long long last = num_dispatches - 1 - (num_dispatches - 1 - r) % g->nreg;
        if (last > index) return 1;
    }
    return 0;
}

/* the first and one-past-last byte an array can reach (plane/host.py's _byte_span) */
static void byte_span(PyArrayObject *a, uintptr_t *lo, uintptr_t *hi) {
    *lo = *hi = (uintptr_t)PyArray_DATA(a);
    for (int d = 0; d < PyArray_NDIM(a); d++) {
        npy_intp n = PyArray_DIM(a, d), stride = PyArray_STRIDE(a, d);
        if (n == 0) { *hi = *lo; return; }
        if (stride < 0) *lo -= (uintptr_t)((n - 1) * -stride);
        else *hi += (uintptr_t)((n - 1) * stride);
    }
    *hi += (uintptr_t)PyArray_ITEMSIZE(a);
}

/* the handle's field `key` (a borrowed reference), or NULL if absent */
static PyObject *field(PyObject *d, PyObject *key) { return PyDict_GetItemWithError(d, key); }

/* combine(expert_out, handle, epoch, generation, num_dispatches[, opts]) -> None (as
 * dispatch) | y | ErrorRecord (ubep.plane.protocol.Engine.combine) */
PyObject *engine_combine_fast(engine_t *g, PyObject *args) {
    g->trace[TRACE_C_NATIVE] = now_ns();
    PyObject *eo, *handle, *generation, *opts = NULL;
    unsigned long long epoch;
    long long num_dispatches;
    if (!PyArg_ParseTuple(args, "OOKOL|O", &eo, &handle, &epoch, &generation, &num_dispatches,
                          &opts))
        return NULL;
    fast_t *f = g->fast;
    if (opts == Py_None) opts = NULL;
    if (!f) return not_this(NULL, opts, args);
    if ((opts && opts != f->plain) || (PyObject *)Py_TYPE(handle) != f->handle_type)
        return not_this(f->general_combine, opts, args);
    PyObject *d = PyObject_GenericGetDict(handle, NULL);
    if (!d) return NULL;
    PyObject **k = f->keys, *res = NULL, *eo_view = NULL;
    /* this Buffer's handle, of this generation, of a dispatch that happened */
    /* only exact ints and strs are compared: no user __eq__ runs while borrowed references
     * into the handle's __dict__ are held */
    for (int i = FIRST_CONST_KEY; i < NUM_KEYS; i++) {
        PyObject *mine = f->const_vals[i], *theirs = field(d, k[i]);
        if (!mine || !theirs || Py_TYPE(theirs) != Py_TYPE(mine) ||
            !(PyLong_CheckExact(theirs) || PyUnicode_CheckExact(theirs)) ||
            PyObject_RichCompareBool(mine, theirs, Py_EQ) != 1)
            goto not_mine; /* an error may be set (not_mine keeps it) */
    }
    PyObject *gen = field(d, k[K_GENERATION]);
    if (!gen || !PyLong_CheckExact(gen) || !PyLong_CheckExact(generation) ||
        PyObject_RichCompareBool(gen, generation, Py_EQ) != 1)
        goto not_mine;
    PyObject *oi = field(d, k[K_DISPATCH_INDEX]), *on = field(d, k[K_NUM_TOKENS]),
             *idx = field(d, k[K_TOPK_IDX]), *w = field(d, k[K_TOPK_WEIGHTS]),
             *dr = field(d, k[K_SEND_DST_ROW]), *src = field(d, k[K_RECV_SRC_RANK]);
    if (!oi || !on || !idx || !w || !dr || !src || !PyLong_CheckExact(oi) ||
        !PyLong_CheckExact(on) || !PyArray_CheckExact(src) ||
        PyArray_NDIM((PyArrayObject *)src) != 1)
        goto not_mine;
    long long index = PyLong_AsLongLong(oi), ntok = PyLong_AsLongLong(on);
    npy_intp rows = PyArray_DIM((PyArrayObject *)src, 0);
    int64_t w_dst = g->layout != LAY_RANK ? g->K : g->R;
    if (PyErr_Occurred() || index < 0 || index >= num_dispatches || ntok < 0 || ntok > g->T ||
        rows > g->cap_rows)
        goto not_mine;
    eo_view = dl_array(eo); /* a tensor as a numpy view of its memory */
    if (!PyArray_Check(eo_view)) goto not_mine;
    eo = eo_view;
    uintptr_t lo, hi;
    byte_span((PyArrayObject *)eo, &lo, &hi);
    if (overwritten(g, lo, hi, index, num_dispatches))
        goto not_mine; /* a stale recv_x view: the general path names the dispatch that wrote */
    /* the arrays as the call reads them (a copy where the layout or, for the handle's, the
     * type is not the call's: what the Buffer's checks convert) */
    PyObject *held[4] = {NULL, NULL, NULL, NULL};
    if ((held[0] = taken(eo, f->c_descr->type_num, rows, g->hidden, 0)) != NULL &&
        (held[1] = taken(idx, NPY_INT64, ntok, g->K, 1)) != NULL &&
        (held[2] = taken(w, NPY_FLOAT32, ntok, g->K, 1)) != NULL)
        held[3] = taken(dr, NPY_INT64, ntok, w_dst, 1);
    PyObject *y = held[3] ? new_y(g, f, (npy_intp)ntok) : NULL;
    if (!y) { /* as dispatch's outputs: the general path's allocation is a clean reject */
        for (int i = 0; i < 4; i++) Py_XDECREF(held[i]);
        PyErr_Clear();
        goto not_mine;
    }
    eo = held[0]; idx = held[1]; w = held[2]; dr = held[3];
    /* every array is exact now (the caller's or taken()'s copy): its memory is passed as is (no
     * buffer protocol) */
    combine_args_t a = {.expert_out = eo, .rows = rows, .topk_idx = idx, .topk_weights = w,
                        .send_dst_row = dr, .num_tokens = ntok, .epoch = epoch,
                        .region = (int)(index % 2), .y = y, .dispatch_index = (uint64_t)index,
                        .direct = {.expert_out = PyArray_DATA((PyArrayObject *)eo),
                                   .topk_idx = PyArray_DATA((PyArrayObject *)idx),
                                   .send_dst_row = PyArray_DATA((PyArrayObject *)dr),
                                   .topk_weights = PyArray_DATA((PyArrayObject *)w),
                                   .y = PyArray_DATA((PyArrayObject *)y)}};
    call_t *c = combine_call(g, &a);
    res = c ? call_run(g, c, 0) : NULL;
    if (res && PyLong_Check(res)) {
        Py_DECREF(res);
        res = y;
    } else {
        Py_DECREF(y);
    }
    for (int i = 0; i < 4; i++) Py_DECREF(held[i]);
    goto done;
not_mine:
    if (!PyErr_Occurred()) res = not_this(f->general_combine, opts, args);
done:
    Py_XDECREF(eo_view);
    Py_DECREF(d);
    return res;
}
