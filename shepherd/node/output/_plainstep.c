/* A streamed choice's common per-token step in C: one engine chunk of plain tokens in, its SSE chunk written
 * to the client. What ``Generation._drive``'s ``take_and_write`` does for that case (``ChoiceState.feed``
 * without stop strings, ``IncrementalDetokenizer.step`` on its byte table, ``ChoiceParsing.stream`` with no
 * tool parser and the reasoning parser absent or passed through, the encoder's ``content(0, text)`` bytes,
 * ``emit_now``'s write through the connection), on the same Python state: the detokenizer's ``_ids``,
 * ``_held``, ``_emitted`` and ``_parts``, the choice's ``tokens`` and ``text``, the generation loop's
 * counters (lists), the ITL histogram and the keep-alive entry. Anything else (a batch of more than one event,
 * logprobs, a finished choice, an id that is special, a stop id or outside the vocabulary, a hold past 32 ids,
 * a reasoning parser still parsing, data pending before the chunk, more than 64 ids) goes to the Python
 * ``fallback`` (``take_and_write``) before anything is changed. The property tests hold the two paths to the
 * same bytes and state on hostile token sequences. See shepherd/node/output/plain_step.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#define MAX_IDS 64      /* ids per chunk taken here (a paced engine sends 1) */
#define MAX_PENDING 32  /* IncrementalDetokenizer._MAX_PENDING */

typedef struct {
    PyObject_HEAD
    PyObject *chunk_type; /* EngineChunk */
    PyObject *state;      /* ChoiceState */
    PyObject *state_text; /* its ``text`` list */
    PyObject *detok;      /* IncrementalDetokenizer */
    PyObject *ids;        /* its ``_ids`` list */
    PyObject *parts;      /* its ``_parts`` list */
    PyObject *drop;       /* frozenset, or None */
    PyObject *drop_extra; /* set / frozenset, or None */
    PyObject *stop_ids;   /* frozenset */
    PyObject *reasoning;  /* a reasoning parser, or None */
    PyObject *prefix;     /* bytes before the JSON text */
    PyObject *tail;       /* bytes after it */
    PyObject *observe;    /* the ITL histogram's observe */
    PyObject *clock;      /* time.perf_counter */
    PyObject *last;       /* [float]: the last batch's time */
    PyObject *cached;     /* [int]: the most cached tokens seen */
    PyObject *got;        /* [int, ...]: chunk tokens received per choice */
    PyObject *last_ids;   /* [ids, ...]: the last chunk's ids per choice */
    PyObject *seen;       /* [bool, ...]: whether a chunk came, per choice */
    PyObject *ka;         /* the keep-alive entry (its ``last`` is touched per write) */
    PyObject *monotonic;  /* time.monotonic */
    PyObject *send;       /* the connection's send_framed(bytes) -> bool (pause) */
    PyObject *pending;    /* list of chunks not yet written (must be empty here) */
    PyObject *fallback;   /* take_and_write(batch) -> bool */
    PyObject *itl;        /* the ITL histogram child (slots bounds, counts, sum), or None: observe is called */
    Py_ssize_t vocab;
    Py_ssize_t limit; /* the tokens the choice may have: a chunk going past them is Python's (it cuts it) */
    /* slot offsets (object members) of the state's finished and tokens, the detokenizer's _table, _held and
     * _emitted, the keep-alive entry's last, the histogram's bounds, counts and sum; the event's index,
     * token_ids, logprobs and cached_tokens (-1: read by name) */
    Py_ssize_t o_finished, o_tokens, o_table, o_held, o_emitted, o_ka_last, o_bounds, o_counts, o_sum;
    Py_ssize_t o_index, o_token_ids, o_logprobs, o_cached_tokens;
    char paused;
    Py_ssize_t taken; /* batches taken here (for tests and benches) */
    /* bind_listener's: the engine stream's messages (a deque), the stream, the push future, lone_chunk and
     * its vllm flag, the call's Python listener (slow), its stop and failure ends */
    PyObject *l_msgs, *l_stream, *l_fut, *l_lone, *l_vllm, *l_slow, *l_stopped, *l_failed;
} PlainStep;

static PyObject *s_index, *s_token_ids, *s_logprobs, *s_cached_tokens, *s_finished, *s_tokens, *s_table,
    *s_held, *s_emitted, *s_passthrough, *s_last, *empty_bytes;

static int traverse(PlainStep *self, visitproc visit, void *arg) {
    Py_VISIT(self->chunk_type);
    Py_VISIT(self->state);
    Py_VISIT(self->state_text);
    Py_VISIT(self->detok);
    Py_VISIT(self->ids);
    Py_VISIT(self->parts);
    Py_VISIT(self->drop);
    Py_VISIT(self->drop_extra);
    Py_VISIT(self->stop_ids);
    Py_VISIT(self->reasoning);
    Py_VISIT(self->prefix);
    Py_VISIT(self->tail);
    Py_VISIT(self->observe);
    Py_VISIT(self->clock);
    Py_VISIT(self->last);
    Py_VISIT(self->cached);
    Py_VISIT(self->got);
    Py_VISIT(self->last_ids);
    Py_VISIT(self->seen);
    Py_VISIT(self->ka);
    Py_VISIT(self->monotonic);
    Py_VISIT(self->send);
    Py_VISIT(self->pending);
    Py_VISIT(self->fallback);
    Py_VISIT(self->itl);
    Py_VISIT(self->l_msgs);
    Py_VISIT(self->l_stream);
    Py_VISIT(self->l_fut);
    Py_VISIT(self->l_lone);
    Py_VISIT(self->l_vllm);
    Py_VISIT(self->l_slow);
    Py_VISIT(self->l_stopped);
    Py_VISIT(self->l_failed);
    return 0;
}

static int clear(PlainStep *self) {
    Py_CLEAR(self->chunk_type);
    Py_CLEAR(self->state);
    Py_CLEAR(self->state_text);
    Py_CLEAR(self->detok);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->parts);
    Py_CLEAR(self->drop);
    Py_CLEAR(self->drop_extra);
    Py_CLEAR(self->stop_ids);
    Py_CLEAR(self->reasoning);
    Py_CLEAR(self->prefix);
    Py_CLEAR(self->tail);
    Py_CLEAR(self->observe);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->last);
    Py_CLEAR(self->cached);
    Py_CLEAR(self->got);
    Py_CLEAR(self->last_ids);
    Py_CLEAR(self->seen);
    Py_CLEAR(self->ka);
    Py_CLEAR(self->monotonic);
    Py_CLEAR(self->send);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->itl);
    Py_CLEAR(self->l_msgs);
    Py_CLEAR(self->l_stream);
    Py_CLEAR(self->l_fut);
    Py_CLEAR(self->l_lone);
    Py_CLEAR(self->l_vllm);
    Py_CLEAR(self->l_slow);
    Py_CLEAR(self->l_stopped);
    Py_CLEAR(self->l_failed);
    return 0;
}

static void dealloc(PlainStep *self) {
    PyObject_GC_UnTrack(self);
    clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* the offset of object slot ``name`` of ``obj``'s type (a plain, writable object member), else -1 */
static Py_ssize_t slot_offset(PyObject *obj, PyObject *name) {
    PyObject *d = _PyType_Lookup(Py_TYPE(obj), name); /* borrowed */
    if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset < (Py_ssize_t)sizeof(PyObject)) return -1;
    return m->offset;
}

/* a slot's value, a new reference: by offset when known (NULL with AttributeError when unset), else by name */
static PyObject *get_slot(PyObject *obj, Py_ssize_t off, PyObject *name) {
    if (off < 0) return PyObject_GetAttr(obj, name);
    PyObject *v = *(PyObject **)((char *)obj + off);
    if (v == NULL) {
        PyErr_SetObject(PyExc_AttributeError, name);
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

/* set a slot (value borrowed): by offset when known, else by name */
static int set_slot(PyObject *obj, Py_ssize_t off, PyObject *name, PyObject *value) {
    if (off < 0) return PyObject_SetAttr(obj, name, value);
    PyObject **p = (PyObject **)((char *)obj + off);
    PyObject *old = *p;
    Py_INCREF(value);
    *p = value;
    Py_XDECREF(old);
    return 0;
}

static PyObject *s_bounds, *s_counts, *s_sum;

/* the raised exception (normalized), cleared */
static PyObject *PyErr_GetRaisedException_compat(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (value == NULL) {
        Py_INCREF(Py_None);
        value = Py_None;
    }
    return value;
}

static PyObject *new_step(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"chunk_type", "state", "state_text", "detok", "ids", "parts", "drop", "drop_extra",
                         "stop_ids", "reasoning", "prefix", "tail", "observe", "clock", "last", "cached",
                         "got", "last_ids", "seen", "ka", "monotonic", "send", "pending", "fallback",
                         "vocab", "itl", "limit", NULL};
    PyObject *o[24];
    Py_ssize_t vocab;
    Py_ssize_t limit = PY_SSIZE_T_MAX;
    PyObject *itl = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!OO!O!OOO!OO!O!OOO!O!O!O!O!OOOO!On|On:PlainStep", kw,
                                     &PyType_Type, &o[0], &o[1], &PyList_Type, &o[2], &o[3], &PyList_Type,
                                     &o[4], &PyList_Type, &o[5], &o[6], &o[7], &PyFrozenSet_Type, &o[8], &o[9],
                                     &PyBytes_Type, &o[10], &PyBytes_Type, &o[11], &o[12], &o[13],
                                     &PyList_Type, &o[14], &PyList_Type, &o[15], &PyList_Type, &o[16],
                                     &PyList_Type, &o[17], &PyList_Type, &o[18], &o[19], &o[20], &o[21],
                                     &PyList_Type, &o[22], &o[23], &vocab, &itl, &limit))
        return NULL;
    if (o[6] != Py_None && !PyFrozenSet_CheckExact(o[6])) {
        PyErr_SetString(PyExc_TypeError, "PlainStep: drop is a frozenset or None");
        return NULL;
    }
    if (o[7] != Py_None && !PyFrozenSet_CheckExact(o[7]) && !PySet_CheckExact(o[7])) {
        PyErr_SetString(PyExc_TypeError, "PlainStep: drop_extra is a set, a frozenset or None");
        return NULL;
    }
    if (vocab < 0) {
        PyErr_SetString(PyExc_ValueError, "PlainStep: vocab >= 0");
        return NULL;
    }
    PlainStep *self = (PlainStep *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject **slots[24] = {&self->chunk_type, &self->state,    &self->state_text, &self->detok,
                            &self->ids,        &self->parts,    &self->drop,       &self->drop_extra,
                            &self->stop_ids,   &self->reasoning, &self->prefix,    &self->tail,
                            &self->observe,    &self->clock,    &self->last,       &self->cached,
                            &self->got,        &self->last_ids, &self->seen,       &self->ka,
                            &self->monotonic,  &self->send,     &self->pending,    &self->fallback};
    for (int i = 0; i < 24; i++) {
        Py_INCREF(o[i]);
        *slots[i] = o[i];
    }
    self->vocab = vocab;
    self->limit = limit < 0 ? 0 : limit;
    Py_INCREF(itl);
    self->itl = itl;
    self->o_finished = slot_offset(self->state, s_finished);
    self->o_tokens = slot_offset(self->state, s_tokens);
    self->o_table = slot_offset(self->detok, s_table);
    self->o_held = slot_offset(self->detok, s_held);
    self->o_emitted = slot_offset(self->detok, s_emitted);
    self->o_ka_last = slot_offset(self->ka, s_last);
    self->o_bounds = self->o_counts = self->o_sum = -1;
    if (itl != Py_None) {
        self->o_bounds = slot_offset(itl, s_bounds);
        self->o_counts = slot_offset(itl, s_counts);
        self->o_sum = slot_offset(itl, s_sum);
    }
    self->o_index = self->o_token_ids = self->o_logprobs = self->o_cached_tokens = -1;
    if (PyType_Check(self->chunk_type)) {
        PyTypeObject *t = (PyTypeObject *)self->chunk_type;
        PyObject *d;
        PyObject *names[4] = {s_index, s_token_ids, s_logprobs, s_cached_tokens};
        Py_ssize_t *offs[4] = {&self->o_index, &self->o_token_ids, &self->o_logprobs, &self->o_cached_tokens};
        for (int i = 0; i < 4; i++) {
            d = _PyType_Lookup(t, names[i]);
            if (d != NULL && Py_TYPE(d) == &PyMemberDescr_Type) {
                PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
                if (m->type == T_OBJECT_EX && m->offset >= (Py_ssize_t)sizeof(PyObject)) *offs[i] = m->offset;
            }
        }
    }
    return (PyObject *)self;
}

/* an exact int's value when it fits an int64 (else -1 with no error set; an error only on failure) */
static int64_t small_int(PyObject *o) {
    if (!PyLong_CheckExact(o)) return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) PyErr_Clear();
    if (overflow) return -1;
    return (int64_t)v;
}

/* a count's value when it is an exact int in 0 .. INT64_MAX - MAX_IDS (a chunk's ids added to it cannot
 * overflow), else -1 with no error set */
static int64_t small_count(PyObject *o) {
    int64_t v = small_int(o);
    return v > INT64_MAX - MAX_IDS ? -1 : v;
}

/* JSON string body length of UTF-8 text s (n bytes) as orjson escapes it */
static Py_ssize_t escaped_len(const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t len = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = s[i];
        if (c >= 0x20) {
            len += (c == '"' || c == '\\') ? 2 : 1;
        } else {
            len += (c == '\b' || c == '\t' || c == '\n' || c == '\f' || c == '\r') ? 2 : 6;
        }
    }
    return len;
}

static char *escape_into(char *out, const unsigned char *s, Py_ssize_t n) {
    static const char hex[] = "0123456789abcdef";
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *out++ = (char)c;
            continue;
        }
        *out++ = '\\';
        switch (c) {
        case '"': *out++ = '"'; break;
        case '\\': *out++ = '\\'; break;
        case '\b': *out++ = 'b'; break;
        case '\t': *out++ = 't'; break;
        case '\n': *out++ = 'n'; break;
        case '\f': *out++ = 'f'; break;
        case '\r': *out++ = 'r'; break;
        default:
            *out++ = 'u';
            *out++ = '0';
            *out++ = '0';
            *out++ = hex[c >> 4];
            *out++ = hex[c & 15];
        }
    }
    return out;
}

/* the HTTP/1.1 chunk of prefix + JSON(text) + tail: "%x\r\n" data "\r\n" */
static PyObject *framed_chunk(PlainStep *self, PyObject *text) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(text, &n);
    if (u == NULL) return NULL;
    Py_ssize_t pn = PyBytes_GET_SIZE(self->prefix), tn = PyBytes_GET_SIZE(self->tail);
    Py_ssize_t body = escaped_len((const unsigned char *)u, n);
    if (body > (PY_SSIZE_T_MAX - 64 - pn - tn)) return PyErr_NoMemory();
    Py_ssize_t data = pn + 2 + body + tn;
    char head[24]; /* the size in lowercase hex (as b"%x" formats it), then CRLF */
    int hn = 0;
    {
        static const char hex[] = "0123456789abcdef";
        char digits[20];
        int nd = 0;
        size_t v = (size_t)data;
        do {
            digits[nd++] = hex[v & 15];
            v >>= 4;
        } while (v != 0 && nd < (int)sizeof digits);
        while (nd > 0) head[hn++] = digits[--nd];
        head[hn++] = '\r';
        head[hn++] = '\n';
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, hn + data + 2);
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
    memcpy(p, head, (size_t)hn);
    p += hn;
    memcpy(p, PyBytes_AS_STRING(self->prefix), (size_t)pn);
    p += pn;
    *p++ = '"';
    p = escape_into(p, (const unsigned char *)u, n);
    *p++ = '"';
    memcpy(p, PyBytes_AS_STRING(self->tail), (size_t)tn);
    p += tn;
    *p++ = '\r';
    *p++ = '\n';
    return out;
}

/* metrics._HistogramChild.observe(value) in C: counts[bisect_left(bounds, value)] += 1; sum += value.
 * 1: done; 0: not a histogram this can update (the caller calls observe); -1: error */
static int observe_inline(PlainStep *self, double value) {
    if (self->o_bounds < 0 || self->o_counts < 0 || self->o_sum < 0) return 0;
    PyObject *itl = self->itl;
    PyObject *bounds = *(PyObject **)((char *)itl + self->o_bounds);
    PyObject *counts = *(PyObject **)((char *)itl + self->o_counts);
    PyObject *sum = *(PyObject **)((char *)itl + self->o_sum);
    if (bounds == NULL || counts == NULL || sum == NULL || !PyList_CheckExact(bounds) ||
        !PyList_CheckExact(counts) || !PyFloat_CheckExact(sum) ||
        PyList_GET_SIZE(counts) != PyList_GET_SIZE(bounds) + 1)
        return 0;
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(bounds);
    while (lo < hi) { /* bisect_left: a[mid] < x moves lo past mid */
        Py_ssize_t mid = lo + (hi - lo) / 2;
        PyObject *b = PyList_GET_ITEM(bounds, mid);
        if (!PyFloat_CheckExact(b)) return 0;
        if (PyFloat_AS_DOUBLE(b) < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    PyObject *c = PyList_GET_ITEM(counts, lo);
    if (!PyLong_CheckExact(c)) return 0;
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL) return -1;
    PyObject *c2 = PyNumber_Add(c, one); /* exact ints: no Python code */
    Py_DECREF(one);
    if (c2 == NULL) return -1;
    PyObject *s2 = PyFloat_FromDouble(PyFloat_AS_DOUBLE(sum) + value);
    if (s2 == NULL) {
        Py_DECREF(c2);
        return -1;
    }
    if (PyList_SetItem(counts, lo, c2) < 0) { /* (steals c2) */
        Py_DECREF(s2);
        return -1;
    }
    set_slot(itl, self->o_sum, s_sum, s2);
    Py_DECREF(s2);
    return 1;
}

static PyObject *call_fallback(PlainStep *self, PyObject *batch) {
    PyObject *f = self->fallback;
    Py_INCREF(f);
    PyObject *r = PyObject_CallOneArg(f, batch);
    Py_DECREF(f);
    return r;
}

/* 1: the set holds v (an int object); 0: no; -1: error */
static int holds(PyObject *set, PyObject *v) {
    if (set == Py_None) return 0;
    return PySet_Contains(set, v);
}

/* step(batch) -> bool: True when the caller should stop (the client's transport wants a pause) */
static PyObject *step_impl(PlainStep *self, PyObject *batch) {
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PlainStep cleared");
        return NULL;
    }
    if (!PyList_CheckExact(batch) || PyList_GET_SIZE(batch) != 1) return call_fallback(self, batch);
    PyObject *ev = PyList_GET_ITEM(batch, 0);
    if ((PyObject *)Py_TYPE(ev) != self->chunk_type) return call_fallback(self, batch);

    /* -- checks: nothing is changed before the case is known to be ours */
    PyObject *hold_refs[MAX_IDS];
    int64_t vals[MAX_IDS];
    Py_ssize_t k = 0;
    PyObject *index = NULL, *tids = NULL, *lps = NULL, *evc = NULL, *fin = NULL, *tokens = NULL, *pt = NULL,
             *table = NULL, *held = NULL, *emitted_o = NULL, *text = NULL, *newheld = NULL, *result = NULL,
             *frame = NULL;
    char small[512];
    char *buf = small;
    int ours = 0;
    Py_INCREF(ev);
    Py_INCREF(batch);
    if ((index = get_slot(ev, self->o_index, s_index)) == NULL) goto error;
    if ((tids = get_slot(ev, self->o_token_ids, s_token_ids)) == NULL) goto error;
    if ((lps = get_slot(ev, self->o_logprobs, s_logprobs)) == NULL) goto error;
    if ((evc = get_slot(ev, self->o_cached_tokens, s_cached_tokens)) == NULL) goto error;
    if ((fin = get_slot(self->state, self->o_finished, s_finished)) == NULL) goto error;
    if ((tokens = get_slot(self->state, self->o_tokens, s_tokens)) == NULL) goto error;
    if (self->reasoning != Py_None) {
        if ((pt = PyObject_GetAttr(self->reasoning, s_passthrough)) == NULL) goto error;
        if (pt != Py_True) goto theirs;
    }
    if ((table = get_slot(self->detok, self->o_table, s_table)) == NULL) goto error;
    if ((held = get_slot(self->detok, self->o_held, s_held)) == NULL) goto error;
    if ((emitted_o = get_slot(self->detok, self->o_emitted, s_emitted)) == NULL) goto error;
    /* (no Python code runs from here to the writes below: exact types only) */
    if (small_int(index) != 0 || fin != Py_False || !PyList_CheckExact(tids) || !PyList_CheckExact(table) ||
        !PyBytes_CheckExact(held) || small_int(emitted_o) < 0 || small_count(tokens) < 0 || small_int(evc) < 0)
        goto theirs;
    if (!((PyTuple_CheckExact(lps) && PyTuple_GET_SIZE(lps) == 0) ||
          (PyList_CheckExact(lps) && PyList_GET_SIZE(lps) == 0)))
        goto theirs;
    if (PyList_GET_SIZE(self->pending) != 0 || PyList_GET_SIZE(self->got) < 1 ||
        PyList_GET_SIZE(self->last_ids) < 1 || PyList_GET_SIZE(self->seen) < 1 ||
        PyList_GET_SIZE(self->cached) < 1 || PyList_GET_SIZE(self->last) < 1)
        goto theirs;
    if (small_count(PyList_GET_ITEM(self->got, 0)) < 0 || small_int(PyList_GET_ITEM(self->cached, 0)) < 0)
        goto theirs;
    Py_ssize_t n = PyList_GET_SIZE(tids);
    if (n < 1 || n > MAX_IDS) goto theirs;
    if (small_count(tokens) + n > self->limit) goto theirs; /* more than the engine was asked for */
    for (; k < n; k++) { /* the ids, each held: the set lookups below may compare with other objects */
        PyObject *v = PyList_GET_ITEM(tids, k);
        Py_INCREF(v);
        hold_refs[k] = v;
        int64_t x = small_int(v);
        vals[k] = x;
        if (x < 0 || x >= self->vocab) {
            k++;
            goto theirs;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = holds(self->stop_ids, hold_refs[i]);
        if (r == 0) r = holds(self->drop, hold_refs[i]);
        if (r == 0) r = holds(self->drop_extra, hold_refs[i]);
        if (r < 0) goto error;
        if (r > 0) goto theirs;
    }
    /* (a set's lookup may have run Python code: the objects are read again from here on) */
    if (!PyList_CheckExact(table) || PyList_GET_SIZE(self->pending) != 0 || PyList_GET_SIZE(self->got) < 1 ||
        PyList_GET_SIZE(self->last_ids) < 1 || PyList_GET_SIZE(self->seen) < 1 ||
        PyList_GET_SIZE(self->cached) < 1 || PyList_GET_SIZE(self->last) < 1 ||
        small_count(PyList_GET_ITEM(self->got, 0)) < 0 || small_int(PyList_GET_ITEM(self->cached, 0)) < 0)
        goto theirs;
    Py_ssize_t total = PyBytes_GET_SIZE(held);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (vals[i] >= PyList_GET_SIZE(table)) goto theirs;
        PyObject *b = PyList_GET_ITEM(table, vals[i]);
        if (!PyBytes_CheckExact(b)) goto theirs;
        if (PyBytes_GET_SIZE(b) > PY_SSIZE_T_MAX / 2 - total) goto theirs;
        total += PyBytes_GET_SIZE(b);
    }
    if (total > (Py_ssize_t)sizeof small) {
        buf = PyMem_Malloc((size_t)total);
        if (buf == NULL) {
            PyErr_NoMemory();
            goto error;
        }
    }
    Py_ssize_t at = PyBytes_GET_SIZE(held);
    memcpy(buf, PyBytes_AS_STRING(held), (size_t)at);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(table, vals[i]);
        memcpy(buf + at, PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(b));
        at += PyBytes_GET_SIZE(b);
    }
    /* DecodeStream's rule on the held bytes (IncrementalDetokenizer.step): emit unless it ends in U+FFFD */
    text = PyUnicode_DecodeUTF8(buf, total, "replace");
    if (text == NULL) goto error;
    Py_ssize_t tl = PyUnicode_GET_LENGTH(text);
    int emit = tl > 0 && PyUnicode_READ_CHAR(text, tl - 1) != 0xFFFD;
    Py_ssize_t nall = PyList_GET_SIZE(self->ids) + n;
    int64_t emitted = small_int(emitted_o);
    if (!emit) {
        if (nall - emitted > MAX_PENDING) goto theirs; /* the hand-over to DecodeStream: Python's */
        newheld = PyBytes_FromStringAndSize(buf, total);
        if (newheld == NULL) goto error;
    }
    ours = 1;
    /* -- the writes (as take, feed and step make them) */
    {
        PyObject *t2 = PyLong_FromSsize_t((Py_ssize_t)(small_int(tokens) + n));
        if (t2 == NULL) goto error;
        int r = set_slot(self->state, self->o_tokens, s_tokens, t2);
        Py_DECREF(t2);
        if (r < 0) goto error;
        if (PyList_GET_SIZE(self->got) < 1) {
            PyErr_SetString(PyExc_RuntimeError, "PlainStep: the counts list was emptied");
            goto error;
        }
        PyObject *g2 = PyLong_FromLongLong((long long)(small_int(PyList_GET_ITEM(self->got, 0)) + n));
        if (g2 == NULL) goto error;
        if (PyList_SetItem(self->got, 0, g2) < 0) goto error; /* (each steals its item, also on error) */
        Py_INCREF(Py_True);
        if (PyList_SetItem(self->seen, 0, Py_True) < 0) goto error;
        Py_INCREF(tids);
        if (PyList_SetItem(self->last_ids, 0, tids) < 0) goto error;
        if (PyList_GET_SIZE(self->cached) < 1) {
            PyErr_SetString(PyExc_RuntimeError, "PlainStep: the cached list was emptied");
            goto error;
        }
        if (small_int(evc) > small_int(PyList_GET_ITEM(self->cached, 0))) {
            Py_INCREF(evc);
            if (PyList_SetItem(self->cached, 0, evc) < 0) goto error;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (PyList_Append(self->ids, hold_refs[i]) < 0) goto error;
        if (emit) {
            if (set_slot(self->detok, self->o_held, s_held, empty_bytes) < 0) goto error;
            PyObject *e2 = PyLong_FromSsize_t(PyList_GET_SIZE(self->ids));
            if (e2 == NULL) goto error;
            r = set_slot(self->detok, self->o_emitted, s_emitted, e2);
            Py_DECREF(e2);
            if (r < 0) goto error;
            if (PyList_Append(self->parts, text) < 0 || PyList_Append(self->state_text, text) < 0) goto error;
        } else if (set_slot(self->detok, self->o_held, s_held, newheld) < 0) {
            goto error;
        }
    }
    self->taken++;
    /* -- the ITL (take's observe), then emit_now's write */
    {
        PyObject *now = PyObject_CallNoArgs(self->clock);
        if (now == NULL) goto error;
        double t_now = PyFloat_AsDouble(now);
        if (t_now == -1.0 && PyErr_Occurred()) {
            Py_DECREF(now);
            goto error;
        }
        if (PyList_GET_SIZE(self->last) < 1) {
            Py_DECREF(now);
            PyErr_SetString(PyExc_RuntimeError, "PlainStep: the clock list was emptied");
            goto error;
        }
        double t_last = PyFloat_AsDouble(PyList_GET_ITEM(self->last, 0));
        if (t_last == -1.0 && PyErr_Occurred()) {
            Py_DECREF(now);
            goto error;
        }
        if (PyList_SetItem(self->last, 0, now) < 0) goto error;
        double value = (t_now - t_last) / (double)n;
        int r = observe_inline(self, value);
        if (r < 0) goto error;
        if (r == 0) { /* not a histogram of ours: its observe */
            PyObject *itl = PyFloat_FromDouble(value);
            if (itl == NULL) goto error;
            PyObject *res = PyObject_CallOneArg(self->observe, itl);
            Py_DECREF(itl);
            if (res == NULL) goto error;
            Py_DECREF(res);
        }
    }
    int paused = 0;
    if (emit) {
        frame = framed_chunk(self, text);
        if (frame == NULL) goto error;
        PyObject *mono = PyObject_CallNoArgs(self->monotonic);
        if (mono == NULL) goto error;
        int r = set_slot(self->ka, self->o_ka_last, s_last, mono);
        Py_DECREF(mono);
        if (r < 0) goto error;
        PyObject *sent = PyObject_CallOneArg(self->send, frame);
        if (sent == NULL) goto error;
        paused = PyObject_IsTrue(sent);
        Py_DECREF(sent);
        if (paused < 0) goto error;
    }
    self->paused = (char)paused;
    result = paused ? Py_True : Py_False;
    Py_INCREF(result);
    goto done;
theirs:
    if (!ours) result = call_fallback(self, batch);
    goto done;
error:
    result = NULL;
done:
    for (Py_ssize_t i = 0; i < k; i++) Py_DECREF(hold_refs[i]);
    if (buf != small) PyMem_Free(buf);
    Py_XDECREF(index);
    Py_XDECREF(tids);
    Py_XDECREF(lps);
    Py_XDECREF(evc);
    Py_XDECREF(fin);
    Py_XDECREF(tokens);
    Py_XDECREF(pt);
    Py_XDECREF(table);
    Py_XDECREF(held);
    Py_XDECREF(emitted_o);
    Py_XDECREF(text);
    Py_XDECREF(newheld);
    Py_XDECREF(frame);
    Py_DECREF(ev);
    Py_DECREF(batch);
    return result;
}

static PyObject *step_call(PlainStep *self, PyObject *args, PyObject *kwds) {
    PyObject *batch;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "PlainStep() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "PlainStep", 1, 1, &batch)) return NULL;
    return step_impl(self, batch);
}

static PyObject *s_done, *s_popleft;

/* bind_listener(msgs, stream, fut, lone_chunk, vllm, slow, stopped, failed) -> the listener (self.ready) */
static PyObject *bind_listener(PlainStep *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "bind_listener takes 8 arguments");
        return NULL;
    }
    PyObject **fields[8] = {&self->l_msgs, &self->l_stream, &self->l_fut,     &self->l_lone,
                            &self->l_vllm, &self->l_slow,   &self->l_stopped, &self->l_failed};
    for (int i = 0; i < 8; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*fields[i], args[i]);
    }
    return PyObject_GetAttrString((PyObject *)self, "ready");
}

/* call f() and give back None (its result dropped), or NULL */
static PyObject *call_none(PyObject *f) {
    Py_INCREF(f);
    PyObject *r = PyObject_CallNoArgs(f);
    Py_DECREF(f);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

/* failed(the raised Exception) as _on_ready's except clause, None; anything not an Exception propagates */
static PyObject *fail_push(PyObject *failed) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyObject *exc = PyErr_GetRaisedException_compat();
    PyObject *res = PyObject_CallOneArg(failed, exc);
    Py_DECREF(exc);
    if (res == NULL) return NULL;
    Py_DECREF(res);
    Py_RETURN_NONE;
}

/* ready's work on bind_listener's objects, held (l: msgs, stream, fut, lone, vllm, slow, stopped, failed):
 * the Python code it calls (the future's done, lone_chunk, the step's callbacks) may bind the listener
 * again and drop the objects the fields held */
static PyObject *ready_held(PlainStep *self, PyObject *const *l) {
    PyObject *msgs = l[0], *stream = l[1], *fut = l[2], *lone = l[3], *vllm = l[4], *slow = l[5],
             *stopped = l[6], *failed = l[7];
    Py_ssize_t n = PyObject_Length(msgs);
    if (n < 0) return NULL;
    if (n != 1) return call_none(slow);
    PyObject *d = PyObject_CallMethodNoArgs(fut, s_done);
    if (d == NULL) return NULL;
    int fut_done = PyObject_IsTrue(d);
    Py_DECREF(d);
    if (fut_done < 0) return NULL;
    if (!fut_done) {
        n = PyObject_Length(msgs);
        if (n < 0) return NULL;
    }
    if (fut_done || n != 1) return call_none(slow);
    PyObject *raw = PySequence_GetItem(msgs, 0);
    if (raw == NULL) return NULL;
    PyObject *cargs[2] = {raw, vllm};
    PyObject *ev = PyObject_Vectorcall(lone, cargs, 2, NULL);
    if (ev == NULL) { /* as _on_ready, where the message was taken off before lone_chunk raised */
        Py_DECREF(raw);
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *popped = PyObject_CallMethodNoArgs(msgs, s_popleft);
        if (popped == NULL) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        Py_DECREF(popped);
        PyErr_Restore(type, value, tb);
        return fail_push(failed);
    }
    if (ev == Py_None) { /* not a plain chunk: the message stays for the Python listener */
        Py_DECREF(ev);
        Py_DECREF(raw);
        return call_none(slow);
    }
    PyObject *popped = PyObject_CallMethodNoArgs(msgs, s_popleft);
    if (popped == NULL) {
        Py_DECREF(ev);
        Py_DECREF(raw);
        return NULL;
    }
    int same = popped == raw;
    Py_DECREF(popped);
    Py_DECREF(raw);
    PyObject *r = NULL;
    if (!same) {
        Py_DECREF(ev);
        PyErr_SetString(PyExc_RuntimeError, "PlainStep.ready: the messages changed under it");
    } else {
        PyObject *batch = PyList_New(1);
        if (batch == NULL) {
            Py_DECREF(ev);
            return NULL;
        }
        PyList_SET_ITEM(batch, 0, ev); /* (steals ev) */
        r = step_impl(self, batch);
        Py_DECREF(batch);
    }
    if (r == NULL) return fail_push(failed); /* as _on_ready: an Exception fails the push */
    int stop = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (stop < 0) return NULL;
    if (stop) return call_none(stopped);
    Py_ssize_t left = PyObject_Length(msgs);
    if (left < 0) return NULL;
    if (left == 0) {
        PyObject *done = PyObject_GetAttr(stream, s_done);
        if (done == NULL) return NULL;
        int is_done = PyObject_IsTrue(done);
        Py_DECREF(done);
        if (is_done < 0) return NULL;
        if (!is_done) Py_RETURN_NONE;
    }
    return call_none(slow); /* more messages came, or the stream ended: the Python listener's */
}

/* ready(): the engine stream's listener while pushing. One message, a plain lone chunk, the future pending:
 * the message taken off the deque and stepped here (GenerateCall._on_ready's common case); anything else,
 * and whatever is left after it, is the Python listener's (slow). A stop calls stopped(), an Exception
 * failed(exc), as _on_ready ends the push. */
static PyObject *ready(PlainStep *self, PyObject *unused) {
    (void)unused;
    PyObject *l[8] = {self->l_msgs, self->l_stream, self->l_fut,     self->l_lone,
                      self->l_vllm, self->l_slow,   self->l_stopped, self->l_failed};
    for (int i = 0; i < 8; i++) {
        if (l[i] == NULL || self->fallback == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "PlainStep.ready before bind_listener");
            return NULL;
        }
    }
    for (int i = 0; i < 8; i++) Py_INCREF(l[i]);
    PyObject *r = ready_held(self, l);
    for (int i = 0; i < 8; i++) Py_DECREF(l[i]);
    return r;
}

static PyMethodDef step_methods[] = {
    {"bind_listener", (PyCFunction)(void (*)(void))bind_listener, METH_FASTCALL,
     "bind_listener(msgs, stream, fut, lone_chunk, vllm, slow, stopped, failed) -> the stream's listener"},
    {"ready", (PyCFunction)ready, METH_NOARGS, "the engine stream's listener (after bind_listener)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef members[] = {
    {"paused", T_BOOL, offsetof(PlainStep, paused), 0,
     "whether the last batch taken here left the client's transport wanting a pause"},
    {"taken", T_PYSSIZET, offsetof(PlainStep, taken), READONLY, "batches taken in C"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PlainStepType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shepherd.node.output._plainstep.PlainStep",
    .tp_basicsize = sizeof(PlainStep),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "PlainStep(...)(batch) -> bool: a streamed choice's plain token chunk, detokenized, encoded and "
              "written in C; anything else through fallback(batch)",
    .tp_new = new_step,
    .tp_dealloc = (destructor)dealloc,
    .tp_traverse = (traverseproc)traverse,
    .tp_clear = (inquiry)clear,
    .tp_call = (ternaryfunc)step_call,
    .tp_members = members,
    .tp_methods = step_methods,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_plainstep",
    "A streamed choice's plain per-token step (detokenize, SSE chunk, write) in C.", -1, NULL, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__plainstep(void) {
    struct {
        PyObject **p;
        const char *s;
    } names[] = {{&s_index, "index"},       {&s_token_ids, "token_ids"}, {&s_logprobs, "logprobs"},
                 {&s_cached_tokens, "cached_tokens"}, {&s_finished, "finished"}, {&s_tokens, "tokens"},
                 {&s_table, "_table"},      {&s_held, "_held"},          {&s_emitted, "_emitted"},
                 {&s_passthrough, "passthrough"}, {&s_last, "last"}, {&s_bounds, "bounds"},
                 {&s_counts, "counts"}, {&s_sum, "sum"}, {&s_done, "done"}, {&s_popleft, "popleft"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].p == NULL && (*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL) return NULL;
    }
    if (empty_bytes == NULL && (empty_bytes = PyBytes_FromStringAndSize(NULL, 0)) == NULL) return NULL;
    if (PyType_Ready(&PlainStepType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&PlainStepType);
    if (PyModule_AddObject(m, "PlainStep", (PyObject *)&PlainStepType) < 0) {
        Py_DECREF(&PlainStepType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
