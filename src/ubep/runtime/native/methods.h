/* The Engine type's methods, by the file that holds them (module.c builds the method table
 * and the type; exports.c adds the type to the module). */
#ifndef UBEP_METHODS_H
#define UBEP_METHODS_H

#include "engine.h"

/* calls.c: a call's lifecycle */
PyObject *engine_dispatch(engine_t *g, PyObject *args);
PyObject *engine_combine(engine_t *g, PyObject *args);
PyObject *engine_complete(engine_t *g, PyObject *args);
PyObject *engine_abandon(engine_t *g, PyObject *args);

/* calls.c, a module function: the type failed calls return (ubep.plane.records.ErrorRecord) */
PyObject *engine_set_error_type(PyObject *module, PyObject *type);

/* control.c */
PyObject *engine_fail(engine_t *g, PyObject *args);
PyObject *engine_set_signature(engine_t *g, PyObject *arg);
PyObject *engine_resync(engine_t *g, PyObject *args);
PyObject *engine_wait_done(engine_t *g, PyObject *args);
PyObject *engine_reset_all(engine_t *g, PyObject *noargs);
PyObject *engine_trace(engine_t *g, PyObject *noargs);
PyObject *engine_poke(engine_t *g, PyObject *args);
PyObject *engine_comb_last_epoch(engine_t *g, PyObject *args);
PyObject *engine_close(engine_t *g, PyObject *noargs);
PyObject *engine_core_log(engine_t *g, PyObject *noargs);

/* spans.c: task spans */
PyObject *engine_trace_enable(engine_t *g, PyObject *args);
PyObject *engine_trace_spans(engine_t *g, PyObject *noargs);

/* layout.c, a module function: DeepEP's get_dispatch_layout, checked, in one pass */
PyObject *mod_dispatch_layout(PyObject *self, PyObject *args);
PyObject *mod_any_negative(PyObject *self, PyObject *arg);
PyObject *mod_received_counts(PyObject *self, PyObject *args);
PyObject *mod_masked_weights(PyObject *self, PyObject *args);

/* module.c: the type, and the keys of its parameter table (in order) */
extern PyTypeObject EngineType;
PyObject *param_keys(void);

#endif /* UBEP_METHODS_H */
