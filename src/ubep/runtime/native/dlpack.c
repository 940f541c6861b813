/* The torch door's conversions in C, over DLPack (the ABI every array library exports):
 * storage_views() takes tensors' DLPack capsules (torch._C._to_dlpack, one C call each) to
 * numpy views of the same memory, and tensor_capsule() hands a numpy array to torch
 * (torch._C._from_dlpack) as the dtype torch should see (BF16 for uint16 bits). In Python each
 * conversion is a chain of torch and numpy calls (view, numpy, from_numpy: 1-1.5 us a tensor on
 * a decode step, more than the data plane's own overhead); here each is a struct read and one
 * array header.
 *
 * Nothing is copied: a view keeps its capsule (and so the tensor's memory) alive as its base;
 * a capsule handed to torch keeps its array alive until torch's deleter runs. A tensor this
 * path does not view (not on the CPU, a dtype numpy has no storage type for, a lane count or a
 * null data pointer) comes back as it was, for the caller's general path to take or refuse.
 */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <stdlib.h>
#include <string.h>

#define NO_IMPORT_ARRAY
#include "fastpath.h"

/* DLPack's ABI (dlpack.h, v0.8 and later: the unversioned "dltensor" capsule) */
typedef struct { int32_t device_type, device_id; } dl_device_t;
typedef struct { uint8_t code, bits; uint16_t lanes; } dl_dtype_t;
typedef struct {
    void *data;
    dl_device_t device;
    int32_t ndim;
    dl_dtype_t dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} dl_tensor_t;
typedef struct dl_managed {
    dl_tensor_t t;
    void *ctx;
    void (*deleter)(struct dl_managed *);
} dl_managed_t;

enum { DL_CPU = 1, DL_INT = 0, DL_UINT = 1, DL_FLOAT = 2, DL_BFLOAT = 4, DL_BOOL = 6 };
static const char DLTENSOR[] = "dltensor";

/* the numpy storage type of a DLPack dtype (BF16 as uint16 bits), or -1 */
static int storage_type(dl_dtype_t d) {
    if (d.lanes != 1) return -1;
    switch (d.code) {
    case DL_FLOAT:
        return d.bits == 16 ? NPY_FLOAT16 : d.bits == 32 ? NPY_FLOAT32
               : d.bits == 64 ? NPY_FLOAT64 : -1;
    case DL_BFLOAT: return d.bits == 16 ? NPY_UINT16 : -1;
    case DL_INT:
        return d.bits == 8 ? NPY_INT8 : d.bits == 16 ? NPY_INT16 : d.bits == 32 ? NPY_INT32
               : d.bits == 64 ? NPY_INT64 : -1;
    case DL_UINT:
        return d.bits == 8 ? NPY_UINT8 : d.bits == 16 ? NPY_UINT16 : d.bits == 32 ? NPY_UINT32
               : d.bits == 64 ? NPY_UINT64 : -1;
    case DL_BOOL: return d.bits == 8 ? NPY_BOOL : -1;
    default: return -1;
    }
}

/* a numpy view of the capsule's tensor (the capsule its base), or NULL (no error set) where this
 * path does not view it */
static PyObject *view_of(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, DLTENSOR)) return NULL;
    dl_managed_t *m = PyCapsule_GetPointer(cap, DLTENSOR);
    dl_tensor_t *t = &m->t;
    int type = storage_type(t->dtype);
    if (type < 0 || t->device.device_type != DL_CPU || !t->data || t->ndim < 0 ||
        t->ndim > NPY_MAXDIMS)
        return NULL;
    const npy_intp isz = t->dtype.bits / 8;
    npy_intp dims[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    for (int d = 0; d < t->ndim; d++) {
        dims[d] = (npy_intp)t->shape[d];
        strides[d] = (npy_intp)(t->strides ? t->strides[d] * isz : 0);
    }
    npy_intp step = isz;
    for (int d = t->ndim - 1; !t->strides && d >= 0; d--) { /* no strides: C order */
        strides[d] = step;
        step *= dims[d];
    }
    PyObject *a = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(type), t->ndim, dims,
                                       strides, (char *)t->data + t->byte_offset,
                                       NPY_ARRAY_WRITEABLE, NULL);
    if (!a) return NULL;
    Py_INCREF(cap);
    if (PyArray_SetBaseObject((PyArrayObject *)a, cap) < 0) {
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

/* torch._C._to_dlpack, once the torch door set it (use_dlpack): the engine's door then takes
 * tensors too (dl_array) */
static PyObject *to_dlpack_fn;

PyObject *dl_array(PyObject *o) {
    if (PyArray_Check(o) || !to_dlpack_fn) return Py_NewRef(o);
    PyObject *cap = PyObject_CallOneArg(to_dlpack_fn, o), *got = cap ? view_of(cap) : NULL;
    Py_XDECREF(cap);
    if (!got) PyErr_Clear(); /* not viewed: the engine's door declines it */
    return got ? got : Py_NewRef(o);
}

/* use_dlpack(to_dlpack): the engine's door takes what to_dlpack converts, as numpy views */
PyObject *mod_use_dlpack(PyObject *self, PyObject *fn) {
    (void)self;
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "use_dlpack: to_dlpack must be callable");
        return NULL;
    }
    Py_XSETREF(to_dlpack_fn, Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* storage_views(to_dlpack, *args) -> tuple: each argument that is not a numpy array or None,
 * to_dlpack(arg) as a numpy view (BF16 as uint16); an argument it does not view, as it was */
PyObject *mod_storage_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "storage_views(to_dlpack, *tensors)");
        return NULL;
    }
    PyObject *out = PyTuple_New(nargs - 1);
    for (Py_ssize_t i = 1; out && i < nargs; i++) {
        PyObject *a = args[i], *got = NULL;
        if (a != Py_None && !PyArray_Check(a)) {
            PyObject *cap = PyObject_CallOneArg(args[0], a);
            if (cap) {
                got = view_of(cap);
                Py_DECREF(cap); /* the view holds it; unviewed, its destructor frees it */
            }
            if (!got) PyErr_Clear(); /* not this path's tensor: the caller's path names why */
        }
        PyTuple_SET_ITEM(out, i - 1, got ? got : Py_NewRef(a));
    }
    return out;
}

/* ---- numpy -> torch ------------------------------------------------------------------------ */

static void array_deleter(dl_managed_t *m) {
    /* torch may free a tensor on a thread that does not hold the GIL */
    PyGILState_STATE s = PyGILState_Ensure();
    Py_XDECREF((PyObject *)m->ctx);
    PyGILState_Release(s);
    free(m);
}

static void capsule_destructor(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, DLTENSOR)) return; /* consumed ("used_dltensor"): torch's now */
    dl_managed_t *m = PyCapsule_GetPointer(cap, DLTENSOR);
    if (m && m->deleter) m->deleter(m);
}

/* tensor_capsule(array, code) -> a "dltensor" capsule over a numpy array's memory with DLPack
 * dtype code `code` (bits: the array's item size), for torch._C._from_dlpack */
PyObject *mod_tensor_capsule(PyObject *self, PyObject *args) {
    PyObject *o;
    int code;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!i", &PyArray_Type, &o, &code)) return NULL;
    PyArrayObject *a = (PyArrayObject *)o;
    const int nd = PyArray_NDIM(a);
    const npy_intp isz = PyArray_ITEMSIZE(a);
    dl_managed_t *m = malloc(sizeof *m + 2 * (size_t)(nd ? nd : 1) * sizeof(int64_t));
    if (!m) return PyErr_NoMemory();
    memset(m, 0, sizeof *m);
    m->t.shape = (int64_t *)(m + 1);
    m->t.strides = m->t.shape + nd;
    for (int d = 0; d < nd; d++) {
        npy_intp s = PyArray_STRIDE(a, d);
        if (s % isz) {
            free(m);
            PyErr_SetString(PyExc_ValueError, "tensor_capsule: strides not in whole items");
            return NULL;
        }
        m->t.shape[d] = PyArray_DIM(a, d);
        m->t.strides[d] = s / isz;
    }
    m->t.data = PyArray_DATA(a);
    m->t.device.device_type = DL_CPU;
    m->t.ndim = nd;
    m->t.dtype.code = (uint8_t)code;
    m->t.dtype.bits = (uint8_t)(isz * 8);
    m->t.dtype.lanes = 1;
    m->ctx = Py_NewRef(o);
    m->deleter = array_deleter;
    PyObject *cap = PyCapsule_New(m, DLTENSOR, capsule_destructor);
    if (!cap) {
        Py_DECREF(o);
        free(m);
    }
    return cap;
}
