/* Packed protobuf varints of a list of token ids, at C speed: what ``engine_requests._packed`` otherwise asks
 * protobuf's encoder for (a repeated uint32 field built from Python ints, ~40 ns an id, and a message
 * made and serialized around it). Only the plain case is handled here: exact ints in [0, 2**32). Anything
 * else returns None and the caller takes protobuf's path, which refuses it with protobuf's own error. The
 * property tests compare the bytes with protobuf's on any ids. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* the value of an exact int when it is a uint32, else -1 */
static inline int64_t uint32_of(PyObject *o) {
    if (!PyLong_CheckExact(o)) return -1;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
        return v >= 0 && v <= 0xFFFFFFFFLL ? (int64_t)v : -1;
    }
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0) return 0;
    if (size == 1) return (int64_t)((PyLongObject *)o)->ob_digit[0];
#endif
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
        PyErr_Clear();
        return -1;
    }
    return (int64_t)v;
}

/* packed_uint32(ids) -> bytes, or None when ids is not a list or tuple of uint32 ints */
static PyObject *packed_uint32(PyObject *module, PyObject *ids) {
    (void)module;
    if (!PyList_Check(ids) && !PyTuple_Check(ids)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    if (n == 0) return PyBytes_FromStringAndSize(NULL, 0);
    PyObject **items = PySequence_Fast_ITEMS(ids);
    uint8_t small[1280];
    uint8_t *buf = n * 5 <= (Py_ssize_t)sizeof small ? small : PyMem_Malloc((size_t)n * 5);
    if (buf == NULL) return PyErr_NoMemory();
    Py_ssize_t len = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* only exact ints: no Python code runs, the list cannot change */
        int64_t v = uint32_of(items[i]);
        if (v < 0) {
            if (buf != small) PyMem_Free(buf);
            Py_RETURN_NONE;
        }
        uint32_t u = (uint32_t)v;
        while (u >= 0x80) {
            buf[len++] = (uint8_t)(u | 0x80);
            u >>= 7;
        }
        buf[len++] = (uint8_t)u;
    }
    PyObject *out = PyBytes_FromStringAndSize((const char *)buf, len);
    if (buf != small) PyMem_Free(buf);
    return out;
}

static PyMethodDef methods[] = {
    {"packed_uint32", (PyCFunction)packed_uint32, METH_O,
     "packed_uint32(ids) -> bytes, or None unless ids is a list or tuple of ints in [0, 2**32)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_varint", "Packed protobuf varints of token ids (engine_requests._packed at C speed).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__varint(void) { return PyModule_Create(&module_def); }
