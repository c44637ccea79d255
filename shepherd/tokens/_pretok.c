/* tiktoken's encode_ordinary for ASCII text under the Qwen2 and cl100k split patterns, with the split in C.
 *
 * tiktoken spends ~90% of an encode in fancy_regex's backtracking VM (the patterns' ``\s+(?!\S)`` needs
 * it): ~1.8K instructions a token. For ASCII text the two patterns are decided by a hand-written scan
 * (below, alternative by alternative, with the regex's leftmost-first and backtracking outcome); each
 * piece is then looked up whole among the encoding's ASCII tokens (``rank_table``: most pieces are one
 * token) and only a piece that is not goes to tiktoken's own ``encode_single_piece`` (its BPE). Text that
 * is not ASCII answers None (the caller takes tiktoken). The property tests hold the ids to tiktoken's.
 *
 * Patterns (``digits`` 1: Qwen2's ``\p{N}``; 3: cl100k's ``\p{N}{1,3}``):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 *   \s*[\r\n]+|\s+(?!\S)|\s+
 * In ASCII: \p{L} is [A-Za-z], \p{N} [0-9], \s [\t\n\v\f\r ] (Unicode White_Space: not 0x1C-0x1F). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { C_L = 1, C_N = 2, C_S = 4, C_NL = 8 };
static uint8_t cls[128];

static void init_classes(void) {
    for (int c = 'A'; c <= 'Z'; c++) cls[c] = C_L;
    for (int c = 'a'; c <= 'z'; c++) cls[c] = C_L;
    for (int c = '0'; c <= '9'; c++) cls[c] = C_N;
    for (int c = 0x09; c <= 0x0D; c++) cls[c] = C_S;
    cls[' '] = C_S;
    cls['\r'] |= C_NL;
    cls['\n'] |= C_NL;
}

#define IS_L(c) (cls[(c)] & C_L)
#define IS_N(c) (cls[(c)] & C_N)
#define IS_S(c) (cls[(c)] & C_S)
#define IS_NL(c) (cls[(c)] & C_NL)
#define IS_P(c) (!(cls[(c)] & (C_L | C_N | C_S))) /* [^\s\p{L}\p{N}] */

static inline uint8_t lower(uint8_t c) { return (c >= 'A' && c <= 'Z') ? (uint8_t)(c + 32) : c; }

/* the end of the piece that starts at s[i] (i < n) */
static Py_ssize_t piece_end(const uint8_t *s, Py_ssize_t i, Py_ssize_t n, int digits) {
    uint8_t c = s[i];
    /* (?i:'s|'t|'re|'ve|'m|'ll|'d) */
    if (c == '\'' && i + 1 < n) {
        uint8_t a = lower(s[i + 1]);
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
        if (i + 2 < n) {
            uint8_t b = lower(s[i + 2]);
            if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
        }
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (IS_L(c) || (!IS_NL(c) && !IS_N(c) && i + 1 < n && IS_L(s[i + 1]))) {
        Py_ssize_t j = i + 1;
        while (j < n && IS_L(s[j])) j++;
        return j;
    }
    /* \p{N}{1,digits} */
    if (IS_N(c)) {
        Py_ssize_t j = i + 1;
        while (j < n && j - i < digits && IS_N(s[j])) j++;
        return j;
    }
    /* ' '?[^\s\p{L}\p{N}]+[\r\n]* */
    if (IS_P(c) || (c == ' ' && i + 1 < n && IS_P(s[i + 1]))) {
        Py_ssize_t j = i + 1;
        while (j < n && IS_P(s[j])) j++;
        while (j < n && IS_NL(s[j])) j++;
        return j;
    }
    /* c is white space: the run [i, j) */
    Py_ssize_t j = i + 1;
    while (j < n && IS_S(s[j])) j++;
    /* \s*[\r\n]+: up to the run's last line break */
    for (Py_ssize_t k = j - 1; k >= i; k--)
        if (IS_NL(s[k])) return k + 1;
    /* \s+(?!\S): the run, less its last character when something follows; else \s+ */
    if (j < n && j - i >= 2) return j - 1;
    return j;
}

/* ---- the ranks of the ASCII tokens, in a table of our own -----------------------------------------------
 * A piece of ASCII text can only be an ASCII token: those of the ranks dict go in an open-addressing table
 * (FNV-1a hashes, the bytes in one arena, the dict's own id objects), looked up without making a bytes
 * object or hashing it with SipHash (a dict lookup costs ~600 instructions a piece, this ~60). The table
 * holds a reference to each id (the dict may change or go after it is built: the table does not read it
 * again). Qwen3: 3.8 MB, built at load, before the tokenizer pool forks (shared with it). */

typedef struct {
    uint64_t hash;
    uint32_t off, len; /* the token's bytes: arena[off : off + len] */
    PyObject *id;      /* NULL: an empty slot; else a reference of the table's */
} entry_t;

typedef struct {
    entry_t *slots;
    size_t mask;
    uint8_t *arena;
} table_t;

#define TABLE_NAME "shepherd.tokens._pretok.table"

static inline uint64_t fnv1a(const uint8_t *p, Py_ssize_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

static void table_clear(table_t *t) {
    if (t->slots != NULL)
        for (size_t i = 0; i <= t->mask; i++) Py_XDECREF(t->slots[i].id);
    PyMem_Free(t->slots);
    PyMem_Free(t->arena);
    PyMem_Free(t);
}

static void table_free(PyObject *capsule) {
    table_t *t = PyCapsule_GetPointer(capsule, TABLE_NAME);
    if (t == NULL) return;
    table_clear(t);
}

static int is_ascii(const uint8_t *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i] & 0x80) return 0;
    return 1;
}

/* rank_table(ranks) -> an opaque table of the dict's ASCII tokens (bytes -> id) */
static PyObject *rank_table(PyObject *module, PyObject *ranks) {
    (void)module;
    if (!PyDict_CheckExact(ranks)) {
        PyErr_SetString(PyExc_TypeError, "rank_table(ranks: dict[bytes, int])");
        return NULL;
    }
    Py_ssize_t pos = 0, count = 0, bytes = 0;
    PyObject *k, *v;
    while (PyDict_Next(ranks, &pos, &k, &v)) {
        if (!PyBytes_CheckExact(k) || !PyLong_CheckExact(v)) {
            PyErr_SetString(PyExc_TypeError, "rank_table: bytes keys and int values");
            return NULL;
        }
        const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(k);
        Py_ssize_t n = PyBytes_GET_SIZE(k);
        if (n > 0 && is_ascii(p, n)) {
            count++;
            bytes += n;
        }
    }
    if (bytes > 0x7FFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "rank_table: too many token bytes");
        return NULL;
    }
    size_t size = 16;
    while (size * 3 < (size_t)count * 4) size <<= 1; /* load at most 3/4 (Qwen3: 94K tokens, 131K slots) */
    table_t *t = PyMem_Calloc(1, sizeof *t);
    if (t == NULL) return PyErr_NoMemory();
    t->slots = PyMem_Calloc(size, sizeof(entry_t));
    t->arena = PyMem_Malloc(bytes > 0 ? (size_t)bytes : 1);
    if (t->slots == NULL || t->arena == NULL) {
        PyMem_Free(t->slots);
        PyMem_Free(t->arena);
        PyMem_Free(t);
        return PyErr_NoMemory();
    }
    t->mask = size - 1;
    uint32_t off = 0;
    pos = 0;
    while (PyDict_Next(ranks, &pos, &k, &v)) {
        const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(k);
        Py_ssize_t n = PyBytes_GET_SIZE(k);
        if (n == 0 || !is_ascii(p, n)) continue;
        uint64_t h = fnv1a(p, n);
        size_t i = (size_t)h & t->mask;
        while (t->slots[i].id != NULL) i = (i + 1) & t->mask; /* keys are distinct: no match to find */
        memcpy(t->arena + off, p, (size_t)n);
        t->slots[i].hash = h;
        t->slots[i].off = off;
        t->slots[i].len = (uint32_t)n;
        Py_INCREF(v); /* (no Python code runs in this loop: the dict cannot change under it) */
        t->slots[i].id = v;
        off += (uint32_t)n;
    }
    PyObject *cap = PyCapsule_New(t, TABLE_NAME, table_free);
    if (cap == NULL) table_clear(t);
    return cap;
}

/* the id of the ASCII token p[:n] (borrowed from the table), NULL when it is not one */
static inline PyObject *table_get(const table_t *t, const uint8_t *p, Py_ssize_t n) {
    uint64_t h = fnv1a(p, n);
    size_t i = (size_t)h & t->mask;
    for (;;) { /* bounded: the table has empty slots */
        const entry_t *e = &t->slots[i];
        if (e->id == NULL) return NULL;
        if (e->hash == h && e->len == (uint32_t)n && memcmp(t->arena + e->off, p, (size_t)n) == 0) return e->id;
        i = (i + 1) & t->mask;
    }
}

/* encode_ascii(text, table, encode_piece, digits) -> list of ids, or None when text is not ASCII */
static PyObject *encode_ascii(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4 || !PyUnicode_Check(args[0]) || !PyCapsule_IsValid(args[1], TABLE_NAME)) {
        PyErr_SetString(PyExc_TypeError, "encode_ascii(text: str, table, encode_piece, digits: int)");
        return NULL;
    }
    PyObject *text = args[0], *encode_piece = args[2];
    const table_t *table = PyCapsule_GetPointer(args[1], TABLE_NAME);
    long digits = PyLong_AsLong(args[3]);
    if (digits == -1 && PyErr_Occurred()) return NULL;
    if (digits != 1 && digits != 3) {
        PyErr_SetString(PyExc_ValueError, "encode_ascii: digits is 1 or 3");
        return NULL;
    }
    if (PyUnicode_READY(text) < 0) return NULL;
    if (!PyUnicode_IS_ASCII(text)) Py_RETURN_NONE;
    const uint8_t *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    Py_ssize_t i = 0;
    while (i < n) { /* bounded: each piece is at least one character */
        Py_ssize_t j = piece_end(s, i, n, (int)digits);
        PyObject *id = table_get(table, s + i, j - i); /* borrowed */
        if (id != NULL) {
            if (PyList_Append(out, id) < 0) goto fail;
        } else { /* not one token: tiktoken's BPE of the piece */
            PyObject *key = PyBytes_FromStringAndSize((const char *)s + i, j - i);
            if (key == NULL) goto fail;
            PyObject *ids = PyObject_CallOneArg(encode_piece, key);
            Py_DECREF(key);
            if (ids == NULL) goto fail;
            Py_ssize_t end = PyList_GET_SIZE(out);
            int r = PyList_SetSlice(out, end, end, ids);
            Py_DECREF(ids);
            if (r < 0) goto fail;
        }
        i = j;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* split_ascii(text, digits) -> list of (start, end), or None when text is not ASCII (for the tests) */
static PyObject *split_ascii(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "split_ascii(text: str, digits: int)");
        return NULL;
    }
    long digits = PyLong_AsLong(args[1]);
    if (digits == -1 && PyErr_Occurred()) return NULL;
    if (digits != 1 && digits != 3) {
        PyErr_SetString(PyExc_ValueError, "split_ascii: digits is 1 or 3");
        return NULL;
    }
    if (PyUnicode_READY(args[0]) < 0) return NULL;
    if (!PyUnicode_IS_ASCII(args[0])) Py_RETURN_NONE;
    const uint8_t *s = PyUnicode_1BYTE_DATA(args[0]);
    Py_ssize_t n = PyUnicode_GET_LENGTH(args[0]);
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t j = piece_end(s, i, n, (int)digits);
        PyObject *t = Py_BuildValue("(nn)", i, j);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(t);
        i = j;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"rank_table", (PyCFunction)rank_table, METH_O,
     "rank_table(ranks) -> the table of the ASCII tokens of a bytes -> id dict, for encode_ascii"},
    {"encode_ascii", (PyCFunction)(void (*)(void))encode_ascii, METH_FASTCALL,
     "encode_ascii(text, table, encode_piece, digits) -> ids, or None unless text is ASCII"},
    {"split_ascii", (PyCFunction)(void (*)(void))split_ascii, METH_FASTCALL,
     "split_ascii(text, digits) -> [(start, end)] of the pattern's pieces, or None unless text is ASCII"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_pretok",
    "tiktoken's encode_ordinary of ASCII text under the Qwen2 / cl100k patterns, the split in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__pretok(void) {
    init_classes();
    return PyModule_Create(&module_def);
}
