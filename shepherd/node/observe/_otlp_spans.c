/* The OTLP ``ExportTraceServiceRequest`` of the node's lean span records (``tracing._Span``) at C speed:
 * what ``otlp_wire._lean_request`` writes (one resource, one scope, each span as ``otlp_wire._record``
 * writes it), without a Python object per field or attribute and without copying the request once per
 * enclosing message. The exporter spent ~70K instructions a span in ``_record``'s Python (most of it per
 * attribute, cache hits included); here a span is a few thousand.
 *
 * Only the plain span is written here: ids, times and counts in range, no trace state, attributes (a dict;
 * an event's may also be an empty mapping) whose keys are strings and whose values are strings, booleans,
 * ints in [-2**63, 2**64), floats, bytes, or lists / tuples of those. Any other span is
 * ``fallback(span)``'s bytes (the Python ``_record``: the same bytes, or its own error).
 * tests/unit/test_otlp_wire.py compares the bytes with the Python encoder's on generated spans, and both
 * with the stock exporter's message. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* results of the writers: written, not written here (the span goes to the fallback), an error set */
#define OK 0
#define OTHER 1
#define FAIL (-1)

typedef struct {
    uint8_t *p;
    Py_ssize_t len, cap;
} Buf;

static int grow(Buf *b, Py_ssize_t n) {
    Py_ssize_t cap = b->cap * 2;
    while (cap < b->len + n) cap *= 2;
    uint8_t *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

/* room for n more bytes: 0, or -1 with MemoryError set */
static inline int reserve(Buf *b, Py_ssize_t n) { return b->len + n <= b->cap ? 0 : grow(b, n); }

static inline int varint_size(uint64_t v) {
    int n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* the writers below write into reserved room */
static inline void put_varint(Buf *b, uint64_t v) {
    while (v >= 0x80) {
        b->p[b->len++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    b->p[b->len++] = (uint8_t)v;
}

static inline void put_fixed64(Buf *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b->p[b->len++] = (uint8_t)(v >> (8 * i));
}

static inline void put_big64(Buf *b, uint64_t v) {
    for (int i = 7; i >= 0; i--) b->p[b->len++] = (uint8_t)(v >> (8 * i));
}

static inline void put_raw(Buf *b, const void *s, Py_ssize_t n) {
    if (n <= 16) { /* most keys and values: no call */
        const uint8_t *q = s;
        for (Py_ssize_t i = 0; i < n; i++) b->p[b->len + i] = q[i];
    } else {
        memcpy(b->p + b->len, s, (size_t)n);
    }
    b->len += n;
}

/* a length-delimited field whose length is not known yet: its tag and one byte for the length; ``end``
 * writes the length (moving the body when it takes more than one byte). 2 bytes reserved by the caller. */
static inline Py_ssize_t begin(Buf *b, uint8_t tag) {
    b->p[b->len++] = tag;
    b->p[b->len++] = 0;
    return b->len;
}

static int end(Buf *b, Py_ssize_t start) {
    Py_ssize_t n = b->len - start;
    if (n < 0x80) {
        b->p[start - 1] = (uint8_t)n;
        return 0;
    }
    int extra = varint_size((uint64_t)n) - 1;
    if (reserve(b, extra) < 0) return -1;
    memmove(b->p + start + extra, b->p + start, (size_t)n);
    Py_ssize_t save = b->len + extra;
    b->len = start - 1;
    put_varint(b, (uint64_t)n);
    b->len = save;
    return 0;
}

/* a str's UTF-8 (NULL: not a str, or a lone surrogate: the Python encoder raises its own error) */
static inline const char *utf8(PyObject *s, Py_ssize_t *n) {
    if (!PyUnicode_Check(s)) return NULL;
    const char *u = PyUnicode_AsUTF8AndSize(s, n);
    if (u == NULL) PyErr_Clear();
    return u;
}

/* an int in [0, 2**128) as two halves; OTHER for anything else (the Python encoder's error) */
static int u128_of(PyObject *v, uint64_t *hi, uint64_t *lo) {
    if (!PyLong_Check(v)) return OTHER;
#if PY_VERSION_HEX < 0x030C0000
    Py_ssize_t size = Py_SIZE(v);
    if (size < 0) return OTHER;
    const digit *d = ((PyLongObject *)v)->ob_digit;
    uint64_t h = 0, l = 0;
    for (Py_ssize_t i = size - 1; i >= 0; i--) {
        if (h >> (64 - PyLong_SHIFT)) return OTHER;
        h = (h << PyLong_SHIFT) | (l >> (64 - PyLong_SHIFT));
        l = (l << PyLong_SHIFT) | (uint64_t)d[i];
    }
#else
    unsigned char buf[16];
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t need = PyLong_AsNativeBytes(v, buf, 16,
                                           Py_ASNATIVEBYTES_BIG_ENDIAN | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (need < 0) {
        PyErr_Clear();
        return OTHER;
    }
    if (need > 16) return OTHER;
#else
    if (_PyLong_AsByteArray((PyLongObject *)v, buf, 16, 0, 0) < 0) {
        PyErr_Clear();
        return OTHER;
    }
#endif
    uint64_t h = 0, l = 0;
    for (int i = 0; i < 8; i++) {
        h = (h << 8) | buf[i];
        l = (l << 8) | buf[8 + i];
    }
#endif
    *hi = h;
    *lo = l;
    return OK;
}

/* an int in [0, 2**64), OTHER for anything else */
static inline int u64_of(PyObject *v, uint64_t *out) {
    uint64_t hi;
    int r = u128_of(v, &hi, out);
    return r == OK && hi ? OTHER : r;
}

/* an int as the uint64 a protobuf int64 varint carries (negative: two's complement); OTHER out of range */
static int int64_bits(PyObject *v, uint64_t *out) {
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) return FAIL;
    if (!overflow) {
        *out = (uint64_t)x;
        return OK;
    }
    return overflow < 0 ? OTHER : u64_of(v, out);
}

/* a length-delimited field (tag, length, bytes) */
static inline int put_ld(Buf *b, uint8_t tag, const void *s, Py_ssize_t n) {
    if (reserve(b, n + 11) < 0) return FAIL;
    b->p[b->len++] = tag;
    put_varint(b, (uint64_t)n);
    put_raw(b, s, n);
    return OK;
}

/* a str field, omitted when empty (proto3) */
static inline int put_str(Buf *b, uint8_t tag, PyObject *s) {
    Py_ssize_t n;
    const char *u = utf8(s, &n);
    if (u == NULL) return OTHER;
    return n ? put_ld(b, tag, u, n) : OK;
}

static int any_value(Buf *b, PyObject *v, int depth);

/* an array_value (ArrayValue{values: AnyValue...}) */
static int array_value(Buf *b, PyObject *v, int depth) {
    if (depth >= 8 || reserve(b, 2) < 0) return depth >= 8 ? OTHER : FAIL;
    Py_ssize_t arr = begin(b, 0x2a);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); i++) {
        if (reserve(b, 2) < 0) return FAIL;
        Py_ssize_t el = begin(b, 0x0a);
        int r = any_value(b, PySequence_Fast_GET_ITEM(v, i), depth + 1);
        if (r != OK) return r;
        if (end(b, el) < 0) return FAIL;
    }
    return end(b, arr) < 0 ? FAIL : OK;
}

/* a scalar AnyValue's encoding: its size (OTHER: not a scalar this writes) */
typedef struct {
    uint8_t kind; /* 0: string, 1: bool, 2: int, 3: double, 4: bytes */
    const char *data;
    Py_ssize_t n;
    uint64_t u;
    double d;
} Scalar;

static int scalar(PyObject *v, Scalar *s, Py_ssize_t *size) {
    if (PyUnicode_Check(v)) {
        s->data = utf8(v, &s->n);
        if (s->data == NULL) return OTHER;
        s->kind = 0;
        *size = 1 + varint_size((uint64_t)s->n) + s->n;
        return OK;
    }
    if (PyBool_Check(v)) {
        s->kind = 1;
        s->u = v == Py_True;
        *size = 2;
        return OK;
    }
    if (PyLong_Check(v)) {
        int r = int64_bits(v, &s->u);
        if (r != OK) return r;
        s->kind = 2;
        *size = 1 + varint_size(s->u);
        return OK;
    }
    if (PyFloat_Check(v)) {
        s->kind = 3;
        s->d = PyFloat_AS_DOUBLE(v);
        *size = 9;
        return OK;
    }
    if (PyBytes_Check(v)) {
        s->kind = 4;
        s->data = PyBytes_AS_STRING(v);
        s->n = PyBytes_GET_SIZE(v);
        *size = 1 + varint_size((uint64_t)s->n) + s->n;
        return OK;
    }
    return OTHER;
}

static const uint8_t SCALAR_TAGS[] = {0x0a, 0x10, 0x18, 0x21, 0x3a};

static int put_scalar(Buf *b, const Scalar *s) { /* room reserved */
    b->p[b->len++] = SCALAR_TAGS[s->kind];
    switch (s->kind) {
    case 0:
    case 4:
        put_varint(b, (uint64_t)s->n);
        put_raw(b, s->data, s->n);
        return OK;
    case 1:
    case 2:
        put_varint(b, s->u);
        return OK;
    default:
        if (PyFloat_Pack8(s->d, (char *)b->p + b->len, 1) < 0) return FAIL;
        b->len += 8;
        return OK;
    }
}

/* an AnyValue message's fields (``otlp_wire._any``) */
static int any_value(Buf *b, PyObject *v, int depth) {
    Scalar s;
    Py_ssize_t size;
    int r = scalar(v, &s, &size);
    if (r == OK) return reserve(b, size) < 0 ? FAIL : put_scalar(b, &s);
    if (r == OTHER && (PyTuple_Check(v) || PyList_Check(v))) return array_value(b, v, depth);
    return r; /* a mapping, another sequence, any other object: the Python encoder's */
}

/* one KeyValue as an element of a repeated field (its tag, its length) */
static int key_value(Buf *b, uint8_t tag, PyObject *key, PyObject *value) {
    Py_ssize_t kn;
    const char *k = utf8(key, &kn);
    if (k == NULL) return OTHER;
    Py_ssize_t keypart = kn ? 1 + varint_size((uint64_t)kn) + kn : 0;
    Scalar s;
    Py_ssize_t any;
    int r = scalar(value, &s, &any);
    if (r == OK) { /* sizes known: written straight */
        Py_ssize_t body = keypart + 1 + varint_size((uint64_t)any) + any;
        if (reserve(b, 1 + varint_size((uint64_t)body) + body) < 0) return FAIL;
        b->p[b->len++] = tag;
        put_varint(b, (uint64_t)body);
        if (kn) {
            b->p[b->len++] = 0x0a;
            put_varint(b, (uint64_t)kn);
            put_raw(b, k, kn);
        }
        b->p[b->len++] = 0x12;
        put_varint(b, (uint64_t)any);
        return put_scalar(b, &s);
    }
    if (r != OTHER || !(PyTuple_Check(value) || PyList_Check(value))) return r;
    if (reserve(b, keypart + 4) < 0) return FAIL;
    Py_ssize_t kv = begin(b, tag);
    if (kn) {
        b->p[b->len++] = 0x0a;
        put_varint(b, (uint64_t)kn);
        put_raw(b, k, kn);
    }
    Py_ssize_t val = begin(b, 0x12);
    r = array_value(b, value, 0);
    if (r != OK) return r;
    return end(b, val) < 0 || end(b, kv) < 0 ? FAIL : OK;
}

static int attributes(Buf *b, uint8_t tag, PyObject *attrs) {
    if (PyDict_Check(attrs)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(attrs, &pos, &k, &v)) {
            int r = key_value(b, tag, k, v);
            if (r != OK) return r;
        }
        return OK;
    }
    /* an empty mapping proxy (an event without attributes); any other mapping: the Python encoder's */
    return Py_TYPE(attrs) == &PyDictProxy_Type && PyObject_Size(attrs) == 0 ? OK : OTHER;
}

/* one event (name, time, attributes) as an element of field 11 */
static int event(Buf *b, PyObject *ev) {
    uint64_t ts;
    int r = u64_of(PyTuple_GET_ITEM(ev, 1), &ts);
    if (r != OK) return r;
    if (reserve(b, 11) < 0) return FAIL;
    Py_ssize_t e = begin(b, 0x5a);
    b->p[b->len++] = 0x09;
    put_fixed64(b, ts);
    if ((r = put_str(b, 0x12, PyTuple_GET_ITEM(ev, 0))) != OK) return r;
    if ((r = attributes(b, 0x1a, PyTuple_GET_ITEM(ev, 2))) != OK) return r;
    return end(b, e) < 0 ? FAIL : OK;
}

/* the span's fields, by name; read from the instance's slots (offsets looked up once per type) */
enum { F_TRACE, F_SPAN, F_STATE, F_PARENT, F_NAME, F_KIND, F_START, F_END, F_ATTRS, F_EVENTS, F_DROPPED,
       F_STATUS, F_DESC, F_REMOTE, F_COUNT };
static const char *FIELD_NAMES[F_COUNT] = {"trace_id", "span_id", "state", "parent", "name", "kind",
                                           "start_time", "end_time", "attrs", "events", "dropped_events",
                                           "status", "desc", "remote"};
static PyObject *field_names[F_COUNT];

static struct {
    PyTypeObject *type; /* borrowed: compared only (its version tag says it is unchanged) */
    unsigned int version;
    Py_ssize_t offset[F_COUNT];
} slots;

/* the slots' offsets of ``type``'s fields: 0, or -1 when one is not a plain object slot of a class the
 * instances are of (what ``getattr`` reads: the member descriptor's own check, without which a class could
 * name another class's descriptors and have its instances read at that class's offsets) */
static int slot_offsets(PyTypeObject *type) {
    if (slots.type == type && slots.version == type->tp_version_tag &&
        PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG))
        return 0;
    slots.type = NULL;
    if (type->tp_getattro != PyObject_GenericGetAttr) return -1; /* a __getattribute__ / __getattr__ */
    Py_ssize_t offset[F_COUNT];
    for (int i = 0; i < F_COUNT; i++) {
        PyObject *d = _PyType_Lookup(type, field_names[i]);
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
        PyTypeObject *owner = PyDescr_TYPE(d);
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (owner == NULL || !PyType_IsSubtype(type, owner) || m->type != T_OBJECT_EX ||
            m->offset < (Py_ssize_t)sizeof(PyObject) ||
            m->offset > owner->tp_basicsize - (Py_ssize_t)sizeof(PyObject *))
            return -1;
        offset[i] = m->offset;
    }
    if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) return -1;
    memcpy(slots.offset, offset, sizeof offset);
    slots.version = type->tp_version_tag;
    slots.type = type;
    return 0;
}

/* the fields (new references): 0, 1 when one is missing (the fallback's), -1 on an error */
static int read_fields(PyObject *span, PyObject **f) {
    if (slot_offsets(Py_TYPE(span)) == 0) {
        for (int i = 0; i < F_COUNT; i++) {
            f[i] = *(PyObject **)((char *)span + slots.offset[i]);
            if (f[i] == NULL) return 1; /* an unset slot */
            Py_INCREF(f[i]);
        }
        return 0;
    }
    for (int i = 0; i < F_COUNT; i++) {
        f[i] = PyObject_GetAttr(span, field_names[i]);
        if (f[i] == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
            PyErr_Clear();
            return 1;
        }
    }
    return 0;
}

/* ``otlp_wire._record(span)`` into b */
static int record(Buf *b, PyObject *span) {
    PyObject *f[F_COUNT] = {NULL};
    int r = read_fields(span, f);
    if (r != 0) {
        r = r < 0 ? FAIL : OTHER;
        goto done;
    }
    r = OTHER; /* a trace state (rare: the Python encoder writes it), fields of other types or ranges */
    if (f[F_STATE] != Py_None || !PyDict_Check(f[F_ATTRS]) || !PyList_Check(f[F_EVENTS])) goto done;
    uint64_t thi, tlo, span_id, parent, kind, start, stop, dropped, status;
    if ((r = u128_of(f[F_TRACE], &thi, &tlo)) != OK || (r = u64_of(f[F_SPAN], &span_id)) != OK ||
        (r = u64_of(f[F_PARENT], &parent)) != OK || (r = u64_of(f[F_KIND], &kind)) != OK ||
        (r = u64_of(f[F_START], &start)) != OK || (r = u64_of(f[F_END], &stop)) != OK ||
        (r = u64_of(f[F_DROPPED], &dropped)) != OK || (r = u64_of(f[F_STATUS], &status)) != OK)
        goto done;
    r = OTHER;
    if (kind > 4 || !PyUnicode_Check(f[F_NAME]) || !PyUnicode_Check(f[F_DESC])) goto done;
    int remote = PyObject_IsTrue(f[F_REMOTE]);
    r = FAIL;
    if (remote < 0 || reserve(b, 64) < 0) goto done;
    Py_ssize_t sp = begin(b, 0x12);
    b->p[b->len++] = 0x0a; /* trace_id, span_id, parent_span_id: big-endian bytes */
    b->p[b->len++] = 16;
    put_big64(b, thi);
    put_big64(b, tlo);
    b->p[b->len++] = 0x12;
    b->p[b->len++] = 8;
    put_big64(b, span_id);
    if (parent) {
        b->p[b->len++] = 0x22;
        b->p[b->len++] = 8;
        put_big64(b, parent);
    }
    if ((r = put_str(b, 0x2a, f[F_NAME])) != OK) goto done;
    r = FAIL;
    if (reserve(b, 20) < 0) goto done;
    b->p[b->len++] = 0x30; /* kind: the API's value + 1 */
    b->p[b->len++] = (uint8_t)(kind + 1);
    b->p[b->len++] = 0x39;
    put_fixed64(b, start);
    b->p[b->len++] = 0x41;
    put_fixed64(b, stop);
    if ((r = attributes(b, 0x4a, f[F_ATTRS])) != OK) goto done;
    PyObject *events = f[F_EVENTS];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        r = OTHER;
        if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != 3) goto done;
        Py_INCREF(ev);
        r = event(b, ev);
        Py_DECREF(ev);
        if (r != OK) goto done;
    }
    r = FAIL;
    if (reserve(b, 14) < 0) goto done;
    if (dropped) {
        b->p[b->len++] = 0x60;
        put_varint(b, dropped);
    }
    if (!status) {
        b->p[b->len++] = 0x7a; /* an empty Status */
        b->p[b->len++] = 0;
    } else {
        Py_ssize_t st = begin(b, 0x7a);
        if ((r = put_str(b, 0x12, f[F_DESC])) != OK) goto done;
        r = FAIL;
        if (reserve(b, 11) < 0) goto done;
        b->p[b->len++] = 0x18;
        put_varint(b, status);
        if (end(b, st) < 0) goto done;
    }
    if (reserve(b, 6) < 0) goto done;
    b->p[b->len++] = 0x85; /* flags (field 16, fixed32): HAS_IS_REMOTE, IS_REMOTE */
    b->p[b->len++] = 0x01;
    b->p[b->len++] = 0x00;
    b->p[b->len++] = parent && remote ? 0x03 : 0x01;
    b->p[b->len++] = 0x00;
    b->p[b->len++] = 0x00;
    r = end(b, sp) < 0 ? FAIL : OK;
done:
    for (int i = 0; i < F_COUNT; i++) Py_XDECREF(f[i]);
    return r;
}

static inline Py_ssize_t ld_size(Py_ssize_t n) { return 1 + varint_size((uint64_t)n) + n; }

/* request(spans, fallback, resource, scope, scope_schema, resource_schema) -> bytes: the
 * ExportTraceServiceRequest of ``spans`` under one resource (its Resource message's bytes) and one scope
 * (its InstrumentationScope message's bytes, None: none), each span as ``otlp_wire._record`` writes it
 * (``fallback(span)``'s bytes for a span not written here). The spans are written first, at an offset
 * that leaves room for the enclosing messages' heads, which go in front once their lengths are known. */
static PyObject *request(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6 || !PyBytes_Check(args[2]) || !(args[3] == Py_None || PyBytes_Check(args[3])) ||
        !PyUnicode_Check(args[4]) || !PyUnicode_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "request(spans, fallback, resource: bytes, scope: bytes | None, scope_schema: str, "
                        "resource_schema: str)");
        return NULL;
    }
    PyObject *fallback = args[1], *resource = args[2], *scope = args[3];
    Py_ssize_t scope_schema_n, res_schema_n;
    const char *scope_schema = PyUnicode_AsUTF8AndSize(args[4], &scope_schema_n);
    const char *res_schema = PyUnicode_AsUTF8AndSize(args[5], &res_schema_n);
    if (scope_schema == NULL || res_schema == NULL) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "request: spans must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t res_n = PyBytes_GET_SIZE(resource), scope_n = scope == Py_None ? 0 : PyBytes_GET_SIZE(scope);
    Py_ssize_t head = 3 * 11 + res_n + (scope == Py_None ? 0 : 11 + scope_n);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Buf b = {NULL, head, head + 64 + count * 768};
    PyObject *out = NULL;
    b.p = PyMem_Malloc((size_t)b.cap);
    if (b.p == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *span = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(span); /* the fallback runs Python code: the sequence may change meanwhile */
        Py_ssize_t mark = b.len;
        int r = record(&b, span);
        if (r == OTHER) {
            b.len = mark;
            PyObject *got = PyObject_CallOneArg(fallback, span);
            if (got != NULL && !PyBytes_Check(got)) {
                PyErr_SetString(PyExc_TypeError, "request: the fallback must return bytes");
                Py_CLEAR(got);
            }
            r = got == NULL || reserve(&b, PyBytes_GET_SIZE(got)) < 0 ? FAIL : OK;
            if (r == OK) put_raw(&b, PyBytes_AS_STRING(got), PyBytes_GET_SIZE(got));
            Py_XDECREF(got);
        }
        Py_DECREF(span);
        if (r != OK) goto done;
    }
    Py_ssize_t spans_n = b.len - head;
    if (scope_schema_n && put_ld(&b, 0x1a, scope_schema, scope_schema_n) != OK) goto done;
    if (res_schema_n && put_ld(&b, 0x1a, res_schema, res_schema_n) != OK) goto done;
    /* ScopeSpans{scope, spans..., schema_url}; ResourceSpans{resource, scope_spans, schema_url} */
    Py_ssize_t ss_n = (scope == Py_None ? 0 : ld_size(scope_n)) + spans_n +
                      (scope_schema_n ? ld_size(scope_schema_n) : 0);
    Py_ssize_t rs_n = ld_size(res_n) + ld_size(ss_n) + (res_schema_n ? ld_size(res_schema_n) : 0);
    Py_ssize_t front = ld_size(rs_n) - rs_n + ld_size(res_n) + ld_size(ss_n) - ss_n +
                       (scope == Py_None ? 0 : ld_size(scope_n));
    Py_ssize_t total = b.len, at = head - front;
    b.len = at;
    b.p[b.len++] = 0x0a;
    put_varint(&b, (uint64_t)rs_n);
    b.p[b.len++] = 0x0a;
    put_varint(&b, (uint64_t)res_n);
    put_raw(&b, PyBytes_AS_STRING(resource), res_n);
    b.p[b.len++] = 0x12;
    put_varint(&b, (uint64_t)ss_n);
    if (scope != Py_None) {
        b.p[b.len++] = 0x0a;
        put_varint(&b, (uint64_t)scope_n);
        put_raw(&b, PyBytes_AS_STRING(scope), scope_n);
    }
    if (b.len != head) {
        PyErr_SetString(PyExc_SystemError, "request: the heads' sizes were miscounted");
        goto done;
    }
    out = PyBytes_FromStringAndSize((const char *)b.p + at, total - at);
done:
    PyMem_Free(b.p);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"request", (PyCFunction)(void (*)(void))request, METH_FASTCALL,
     "request(spans, fallback, resource, scope, scope_schema, resource_schema) -> bytes: the "
     "ExportTraceServiceRequest of the lean spans under one resource and scope (their messages' bytes); a "
     "span not written here is fallback(span)'s bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_otlp_spans",
    "The OTLP request of the node's lean span records (otlp_wire._lean_request at C speed).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__otlp_spans(void) {
    for (int i = 0; i < F_COUNT; i++) {
        field_names[i] = PyUnicode_InternFromString(FIELD_NAMES[i]);
        if (field_names[i] == NULL) return NULL;
    }
    return PyModule_Create(&module_def);
}
