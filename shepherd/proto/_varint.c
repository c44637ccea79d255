/* Packed protobuf varints of a list of token ids, at C speed: what ``engine_requests._packed`` otherwise asks
 * protobuf's encoder for (a repeated uint32 field built from Python ints, ~40 ns an id, and a message
 * made and serialized around it). Only the plain case is handled here: exact ints in [0, 2**32). Anything
 * else returns None and the caller takes protobuf's path, which refuses it with protobuf's own error. The
 * property tests compare the bytes with protobuf's on any ids.
 * ``chunk_fields`` reads a plain stream chunk (token ids and counts: one message per token from a paced
 * engine) without building protobuf messages; anything else is left to protobuf, and the property tests
 * compare its answers with protobuf's. ``lone_chunk`` does that for one whole response message and makes
 * the EngineChunk itself (no tuple, no Python __init__): the push path's per-token read. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#include "_pbwire.h" /* pb_utf8_ok */

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

/* one varint at *p (before end): its value, *p moved past it; -1 when truncated, longer than 10 bytes or
 * above 2**32 - 1 (the caller then leaves the message to protobuf, which truncates such a uint32) */
static inline int64_t read_uint32(const uint8_t **p, const uint8_t *end) {
    uint64_t v = 0;
    int shift = 0;
    const uint8_t *q = *p;
    while (q < end && shift < 70) {
        uint8_t b = *q++;
        v |= (uint64_t)(b & 0x7F) << (shift < 64 ? shift : 63);
        if (!(b & 0x80)) {
            *p = q;
            return v <= 0xFFFFFFFFULL && shift < 35 ? (int64_t)v : -1;
        }
        shift += 7;
    }
    return -1;
}

/* the token id v appended to ids: 0, or -1 with an exception set (memory) */
static inline int append_id(PyObject *ids, int64_t v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) return -1;
    int r = PyList_Append(ids, o);
    Py_DECREF(o);
    return r;
}

/* A plain GenerateStreamChunk at buf[start:n] (its length and body, ending the buffer): its ids into a new
 * list (*ids_out) and its varint counts (counts[2..4] and counts[index_field]; skip_field read past).
 * 1: read; 0: not plain (the caller leaves it to protobuf); -1: an exception is set (memory). */
static int read_plain_chunk(const uint8_t *buf, Py_ssize_t n, Py_ssize_t start, long index_field,
                            long skip_field, int64_t counts[16], PyObject **ids_out) {
    const uint8_t *p = buf + start, *end = buf + n;
    int64_t len = read_uint32(&p, end);
    if (len < 0 || len != end - p) return 0;
    PyObject *ids = PyList_New(0);
    if (ids == NULL) return -1;
    while (p < end) {
        uint8_t tag = *p++;
        if (tag & 0x80) goto other; /* a field number above 15: not ours */
        int field = tag >> 3, wire = tag & 7;
        if (field == 0) goto other; /* no field 0 in protobuf: its parse refuses it */
        if (field == 1 && wire == 2) { /* packed token ids */
            int64_t plen = read_uint32(&p, end);
            if (plen < 0 || plen > end - p) goto other;
            const uint8_t *pend = p + plen;
            while (p < pend) {
                int64_t v = read_uint32(&p, pend);
                if (v < 0) goto other;
                if (append_id(ids, v) < 0) goto fail;
            }
            continue;
        }
        if (wire != 0) goto other;
        int64_t v = read_uint32(&p, end);
        if (v < 0) goto other;
        if (field == 1) { /* an unpacked token id */
            if (append_id(ids, v) < 0) goto fail;
        } else if (field == 2 || field == 3 || field == 4 || field == index_field) {
            counts[field] = v;
        } else if (field != skip_field) {
            goto other;
        }
    }
    *ids_out = ids;
    return 1;
other:
    Py_DECREF(ids);
    return 0;
fail:
    Py_DECREF(ids);
    return -1;
}

/* chunk_fields(raw, start, index_field, skip_field) -> (index, ids, prompt, completion, cached) or None.
 * ``raw[start:]`` is a GenerateStreamChunk's length and body, the last thing in ``raw`` (a serialized
 * GenerateResponse after its chunk tag). Only the plain chunk is read here: token ids (packed or not)
 * and the varint counts, plus ``skip_field`` (a varint read past, 0: none). Anything else (logprobs,
 * hidden states, unknown fields, other wire types, bytes after the chunk, values protobuf would
 * truncate) answers None, and the caller parses the message with protobuf. */
static PyObject *chunk_fields(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4 || !PyBytes_CheckExact(args[0])) Py_RETURN_NONE;
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    long index_field = PyLong_AsLong(args[2]);
    long skip_field = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    const uint8_t *buf = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    if (start < 0 || start >= n || index_field <= 0 || index_field > 15 || skip_field < 0 || skip_field > 15)
        Py_RETURN_NONE;
    int64_t counts[16] = {0};
    PyObject *ids = NULL;
    int r = read_plain_chunk(buf, n, start, index_field, skip_field, counts, &ids);
    if (r < 0) return NULL;
    if (r == 0) Py_RETURN_NONE;
    return Py_BuildValue("(LNLLL)", (long long)counts[index_field], ids, (long long)counts[2],
                         (long long)counts[3], (long long)counts[4]);
}

/* ---- lone_chunk: a paced engine's message straight to an EngineChunk ---------------------------------- */

/* The event class and where its slots are (set by chunk_event_class): the object is made without its
 * Python __init__ (a dataclass's, which only stores its arguments). */
enum { F_INDEX, F_IDS, F_PROMPT, F_COMPLETION, F_CACHED, F_LOGPROBS, N_FIELDS };
static const char *const field_names[N_FIELDS] = {"index", "token_ids", "prompt_tokens",
                                                  "completion_tokens", "cached_tokens", "logprobs"};
static PyTypeObject *event_type = NULL;
static Py_ssize_t field_offset[N_FIELDS];

/* chunk_event_class(cls): cls has exactly the six slots (object members) and no __init__ of its own but
 * the dataclass's; returns None. Raises TypeError otherwise. */
static PyObject *chunk_event_class(PyObject *module, PyObject *cls) {
    (void)module;
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "chunk_event_class: a class");
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)cls;
    if (t->tp_base != &PyBaseObject_Type || t->tp_alloc != PyType_GenericAlloc) {
        PyErr_SetString(PyExc_TypeError, "chunk_event_class: a plain class with slots");
        return NULL;
    }
    Py_ssize_t offs[N_FIELDS];
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *d = PyDict_GetItemString(t->tp_dict, field_names[i]); /* borrowed */
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) {
            PyErr_Format(PyExc_TypeError, "chunk_event_class: no slot %s", field_names[i]);
            return NULL;
        }
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        /* the class's own slot (a descriptor of another class, set as an attribute, has that class's
         * offset: written in an object of this one, past its end), within its size */
        if (PyDescr_TYPE(d) != t || m->type != T_OBJECT_EX || (m->flags & READONLY) ||
            m->offset < (Py_ssize_t)sizeof(PyObject) ||
            m->offset > t->tp_basicsize - (Py_ssize_t)sizeof(PyObject *)) {
            PyErr_Format(PyExc_TypeError, "chunk_event_class: slot %s is not a plain object slot",
                         field_names[i]);
            return NULL;
        }
        offs[i] = m->offset;
    }
    Py_INCREF(cls);
    Py_XSETREF(event_type, t);
    memcpy(field_offset, offs, sizeof offs);
    Py_RETURN_NONE;
}

/* The chunk tag's end in a serialized SGLang GenerateResponse (request_id, field 1, then the oneof's
 * chunk, field 2), 0 when it is not a chunk, or when the request id is not UTF-8 (a string field:
 * protobuf's parse refuses the message): engine_responses._sglang_chunk_head in C. */
static Py_ssize_t sglang_head(const uint8_t *b, Py_ssize_t n) {
    if (n < 2) return 0;
    if (b[0] == 0x12) return 1;
    if (b[0] != 0x0A) return 0;
    Py_ssize_t size = b[1], p = 2;
    if (size >= 0x80) {
        if (n < 3 || b[2] >= 0x80) return 0;
        size = (size & 0x7F) | ((Py_ssize_t)b[2] << 7);
        p = 3;
    }
    if (size >= n - p || !pb_utf8_ok(b + p, b + p + size)) return 0;
    p += size;
    return b[p] == 0x12 ? p + 1 : 0;
}

/* lone_chunk(raw, vllm) -> EngineChunk or None: one serialized GenerateResponse (vLLM's when vllm is
 * true, else SGLang's) that is a plain chunk, as decode_batch([raw], single=...) reads it; None for
 * anything else (the caller then takes decode_batch). The event's logprobs is an empty list, as there. */
static PyObject *lone_chunk(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_CheckExact(args[0]) || event_type == NULL) Py_RETURN_NONE;
    const uint8_t *buf = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    int vllm = PyObject_IsTrue(args[1]);
    if (vllm < 0) return NULL;
    Py_ssize_t head = vllm ? (n > 0 && buf[0] == 0x0A ? 1 : 0) : sglang_head(buf, n);
    if (head == 0 || head >= n) Py_RETURN_NONE;
    long index_field = vllm ? 7 : 8, skip_field = vllm ? 0 : 9;
    int64_t counts[16] = {0};
    PyObject *ids = NULL;
    int r = read_plain_chunk(buf, n, head, index_field, skip_field, counts, &ids);
    if (r < 0) return NULL;
    if (r == 0) Py_RETURN_NONE;
    PyObject *vals[N_FIELDS];
    vals[F_IDS] = ids;
    vals[F_INDEX] = PyLong_FromLongLong(counts[index_field]);
    vals[F_PROMPT] = PyLong_FromLongLong(counts[2]);
    vals[F_COMPLETION] = PyLong_FromLongLong(counts[3]);
    vals[F_CACHED] = PyLong_FromLongLong(counts[4]);
    vals[F_LOGPROBS] = PyList_New(0);
    PyObject *obj = NULL;
    for (int i = 0; i < N_FIELDS; i++)
        if (vals[i] == NULL) goto fail;
    obj = event_type->tp_alloc(event_type, 0);
    if (obj == NULL) goto fail;
    for (int i = 0; i < N_FIELDS; i++) /* the slots are NULL in a new object: each takes its reference */
        *(PyObject **)((char *)obj + field_offset[i]) = vals[i];
    return obj;
fail:
    for (int i = 0; i < N_FIELDS; i++) Py_XDECREF(vals[i]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"packed_uint32", (PyCFunction)packed_uint32, METH_O,
     "packed_uint32(ids) -> bytes, or None unless ids is a list or tuple of ints in [0, 2**32)"},
    {"chunk_fields", (PyCFunction)(void (*)(void))chunk_fields, METH_FASTCALL,
     "chunk_fields(raw, start, index_field, skip_field) -> (index, ids, prompt, completion, cached), or None "
     "unless raw[start:] is a plain GenerateStreamChunk (length and body) ending raw"},
    {"chunk_event_class", (PyCFunction)chunk_event_class, METH_O,
     "chunk_event_class(cls): the class lone_chunk makes (EngineChunk: six object slots, a dataclass)"},
    {"lone_chunk", (PyCFunction)(void (*)(void))lone_chunk, METH_FASTCALL,
     "lone_chunk(raw, vllm) -> EngineChunk, or None unless raw is one plain chunk response"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_varint",
    "Packed protobuf varints of token ids (engine_requests._packed at C speed); a plain stream chunk's fields.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__varint(void) { return PyModule_Create(&module_def); }
