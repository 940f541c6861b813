/* The one-call fast path of blocking calls (fastpath.c): the Engine methods it adds, and the
 * numpy C API it builds results with (exports.c imports it once, at module load). */
#ifndef UBEP_FASTPATH_H
#define UBEP_FASTPATH_H

#include "engine.h"

#define PY_ARRAY_UNIQUE_SYMBOL ubep_native_ARRAY_API
/* builds against numpy 2.x headers run on numpy >= 1.24 (pyproject's floor) */
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>

PyObject *engine_set_fast(engine_t *g, PyObject *args);
PyObject *engine_dispatch_fast(engine_t *g, PyObject *args);
PyObject *engine_combine_fast(engine_t *g, PyObject *args);
void fast_free(engine_t *g);
/* the result and handle field names the fast path builds (abi.py checks them at load against
 * ubep.plane.results' dataclasses, their one source) */
PyObject *fast_field_names(void);
/* the size from which combine outputs come from the Buffer's blocks; bytes > 0 sets it (tests);
 * returns the previous value */
npy_intp fast_y_pool_min(npy_intp bytes);
/* the torch door's conversions over DLPack (dlpack.c) */
PyObject *mod_storage_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_tensor_capsule(PyObject *self, PyObject *args);
PyObject *mod_use_dlpack(PyObject *self, PyObject *fn);
/* `o` as the engine's door reads it, a new reference: a numpy array as it is, a tensor (once
 * use_dlpack ran) as a numpy view of its memory, anything else (or a tensor not viewed) as it is,
 * which the door then declines */
PyObject *dl_array(PyObject *o);

#endif /* UBEP_FASTPATH_H */
