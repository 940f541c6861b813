/* The module: what it exports of the ABI (ubep.runtime.abi compares it with its own at load)
 * and its init function. */
#include "engine.h" /* first: Python.h precedes the standard headers */

#include <stddef.h>

#include "fastpath.h" /* import_array: this file defines numpy's C API table */
#include "methods.h"

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native", "ubep native data plane (C11).", -1, HOOK_METHODS,
    NULL, NULL, NULL, NULL,
};

/* ---------------------------------------------------------------------------------------- */
/* What the module exports of the ABI (ubep.runtime.abi compares it with its own at load) */

typedef struct {
    const char *name;
    long long value;
} named_t;
#define NAMED_LEN(a) (sizeof(a) / sizeof((a)[0]))
static const named_t ERROR_CODES[] = {
    {"ok", E_OK}, {"bad_input", E_BAD_INPUT}, {"timeout", E_TIMEOUT}, {"peer_lost", E_PEER_LOST},
    {"remote", E_REMOTE}, {"internal", E_INTERNAL}, {"lost", E_LOST},
};
static const named_t DTYPE_CODES[] = {
    {"bf16", DT_BF16}, {"fp16", DT_FP16}, {"fp32", DT_FP32}, {"int8", DT_INT8},
    {"uint8", DT_UINT8},
};
static const named_t SYNC_CODES[] = {
    {"sw", SYNC_SW}, {"tff", SYNC_TFF}, {"dc", SYNC_DC}, {"sp", SYNC_SP},
};
static const named_t ENGINE_CODES[] = {{"asp", ENG_ASP}, {"bsp", ENG_BSP}};
static const named_t LAYOUT_CODES[] = {{"expert", LAY_EXPERT}, {"rank", LAY_RANK},
                                       {"expert_padded", LAY_EXPERT_PADDED}};
static const named_t POLICY_CODES[] = {
    {"expert_contiguous", SCHED_EXPERT_CONTIGUOUS}, {"balanced", SCHED_BALANCED},
    {"hierarchical", SCHED_HIERARCHICAL},
};
static const named_t QUANT_CODES[] = {
    {"none", QUANT_NONE}, {"e4m3", QUANT_E4M3}, {"int8", QUANT_INT8}};
static const named_t TRACE_CODES[] = {
    {"d_enter", TRACE_D_ENTER}, {"d_prev_done", TRACE_D_PREV_DONE},
    {"d_validated", TRACE_D_VALIDATED}, {"d_published", TRACE_D_PUBLISHED},
    {"d_sent", TRACE_D_SENT}, {"d_counts_in", TRACE_D_COUNTS_IN},
    {"d_metadata", TRACE_D_METADATA}, {"d_data_in", TRACE_D_DATA_IN},
    {"c_enter", TRACE_C_ENTER}, {"c_prev_done", TRACE_C_PREV_DONE},
    {"c_copied", TRACE_C_COPIED}, {"c_published", TRACE_C_PUBLISHED},
    {"c_peers", TRACE_C_PEERS}, {"c_reduced", TRACE_C_REDUCED}, {"d_native", TRACE_D_NATIVE},
    {"c_native", TRACE_C_NATIVE}, {"slots", TRACE_SLOTS},
};
#define AT(name, rec, field) {name, (long long)offsetof(rec, field)}
static const named_t RECORD_OFFSETS[] = {
    {"HEADER_BYTES", HEADER_BYTES},
    {"LINE_BYTES", LINE_BYTES},
    AT("WORD_CHECK", word_t, check),
    AT("DOORBELL_SLEEPERS", doorbell_t, sleepers),
    AT("IN_COUNTS_EPOCH", inbox_rec_t, counts_epoch),
    AT("IN_ROWS", inbox_rec_t, rows),
    AT("IN_SUM", inbox_rec_t, sum),
    AT("IN_SIGNATURE", inbox_rec_t, signature),
    AT("IN_SW_COUNT", inbox_rec_t, sw_count),
    AT("IN_SW_EPOCH", inbox_rec_t, sw_epoch),
    AT("IN_DC_COUNT", inbox_rec_t, dc_count),
    AT("IN_DC_SUM", inbox_rec_t, dc_sum),
    AT("IN_DC_EPOCH", inbox_rec_t, dc_epoch),
    AT("IN_COUNTS", inbox_rec_t, counts),
    AT("IN_RANKS_SUM", inbox_rec_t, ranks_sum),
    AT("CI_OFF", comb_info_rec_t, off),
    AT("CI_ROWS", comb_info_rec_t, rows),
    AT("CI_STRIDE", comb_info_rec_t, stride),
    AT("CI_EPOCH", comb_info_rec_t, epoch),
    AT("CI_INDEX", comb_info_rec_t, dispatch_index),
    AT("CI_SUM", comb_info_rec_t, sum),
    {"CI_BYTES", sizeof(comb_info_rec_t)},
    AT("FAIL_EPOCH", fail_rec_t, epoch),
    AT("FAIL_LEN", fail_rec_t, lencode),
    AT("FAIL_MSG", fail_rec_t, msg),
    {"FAIL_MSG_MAX", FAIL_MSG_MAX},
    AT("FAIL_SUM", fail_rec_t, sum),
    {"FAIL_BYTES", sizeof(fail_rec_t)},
    AT("ROUTE_NTOK", route_rec_t, ntok),
    AT("ROUTE_EPOCH", route_rec_t, epoch),
    AT("ROUTE_SUM", route_rec_t, sum),
    AT("ROUTE_IDX", route_rec_t, idx),
};

static int add_named(PyObject *m, const char *name, const named_t *items, size_t n) {
    PyObject *d = PyDict_New();
    if (!d) return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(items[i].value);
        if (!v || PyDict_SetItemString(d, items[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObject(m, name, d) < 0) {
        Py_DECREF(d);
        return -1;
    }
    return 0;
}

static int add_exports(PyObject *m) {
    PyObject *keys = param_keys();
    if (!keys || PyModule_AddObject(m, "PARAMS", keys) < 0) {
        Py_XDECREF(keys);
        return -1;
    }
    if (add_named(m, "ERRORS", ERROR_CODES, NAMED_LEN(ERROR_CODES)) ||
        add_named(m, "DTYPES", DTYPE_CODES, NAMED_LEN(DTYPE_CODES)) ||
        add_named(m, "SYNCS", SYNC_CODES, NAMED_LEN(SYNC_CODES)) ||
        add_named(m, "ENGINES", ENGINE_CODES, NAMED_LEN(ENGINE_CODES)) ||
        add_named(m, "LAYOUTS", LAYOUT_CODES, NAMED_LEN(LAYOUT_CODES)) ||
        add_named(m, "QUANTS", QUANT_CODES, NAMED_LEN(QUANT_CODES)) ||
        add_named(m, "POLICIES", POLICY_CODES, NAMED_LEN(POLICY_CODES)) ||
        add_named(m, "TRACE", TRACE_CODES, NAMED_LEN(TRACE_CODES)) ||
        add_named(m, "OFFSETS", RECORD_OFFSETS, NAMED_LEN(RECORD_OFFSETS)))
        return -1;
    PyObject *fields = fast_field_names();
    if (!fields || PyModule_AddObject(m, "FIELDS", fields) < 0) {
        Py_XDECREF(fields);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "ABI", UBEP_ABI_VERSION) < 0 ||
        PyModule_AddStringConstant(m, "KERNELS", kernel_set) < 0)
        return -1;
    return 0;
}

/* the module functions of the ABI itself (hooks.c's are for tests and benchmarks) */
static PyMethodDef ABI_METHODS[] = {
    {"set_error_type", (PyCFunction)engine_set_error_type, METH_O,
     "the type failed calls return (ubep.plane.records.ErrorRecord), handed over once"},
    {"storage_views", (PyCFunction)(void (*)(void))mod_storage_views, METH_FASTCALL,
     "storage_views(to_dlpack, *tensors) -> numpy views of the tensors (the torch door)"},
    {"tensor_capsule", (PyCFunction)mod_tensor_capsule, METH_VARARGS,
     "tensor_capsule(array, dlpack_code) -> a DLPack capsule over the array's memory"},
    {"use_dlpack", (PyCFunction)mod_use_dlpack, METH_O,
     "use_dlpack(to_dlpack): the engine's door takes tensors as their DLPack views"},
    {NULL, NULL, 0, NULL},
};

PyMODINIT_FUNC PyInit__native(void) {
    import_array(); /* numpy's C API (fastpath.c); returns NULL with ImportError if missing */
    select_kernels();
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddFunctions(m, ABI_METHODS) < 0 || add_exports(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
