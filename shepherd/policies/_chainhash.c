/* Chained 16-token block names at C speed: the same values as the pure-Python ``block_hashes`` in
 * ``prefix_index`` (``h_i = hash((h_{i-1}, tuple(block_i)))``, CPython's own tuple and int hashes), which
 * stays the reference and the fallback when this module is not built. The property tests compare the
 * two on lists of any ints (negative, huge, bools) and any seed.
 *
 * Why C: the Python version costs ~0.3 us a block (one 16-tuple, one pair tuple, two tuple hashes and a
 * list append per block), ~25 us for a 1,300-token prompt, more than the whole budget for a match
 * plus an insert. Here the tuples are never built: the 16 element hashes are folded as CPython's
 * ``tuplehash`` folds them (xxHash-style lanes, Objects/tupleobject.c, unchanged from 3.8 to 3.13), and the
 * previous name's own hash is CPython's int hash (reduction modulo 2**61 - 1, Python/pyhash.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if SIZEOF_PY_UHASH_T != 8
#error "block names are defined for 64-bit CPython"
#endif

#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))
#define BLOCK 16

/* a list or tuple (subclasses too: PromptIds is a list) as it is, anything else as a new list; PySequence_Fast
 * copies list subclasses */
static inline PyObject *as_fast(PyObject *o, const char *msg) {
    if (PyList_Check(o) || PyTuple_Check(o)) {
        Py_INCREF(o);
        return o;
    }
    return PySequence_Fast(o, msg);
}

/* hash(int(v)) for a 64-bit value: |v| mod (2**61 - 1), the sign kept, -1 taken as -2 */
static inline Py_hash_t int_hash(Py_hash_t v) {
    const Py_uhash_t modulus = ((Py_uhash_t)1 << 61) - 1;
    Py_uhash_t u = v < 0 ? (Py_uhash_t)0 - (Py_uhash_t)v : (Py_uhash_t)v;
    Py_hash_t x = (Py_hash_t)(u % modulus);
    if (v < 0) x = -x;
    return x == -1 ? -2 : x;
}

/* hash(o) for an id: small exact ints (every token id) inline; PY_HASH_SLOW (not a hash any int has: -1)
 * for anything else, hashed by the caller through its type */
#define PY_HASH_SLOW ((Py_hash_t)-1)
static inline Py_hash_t item_hash(PyObject *o) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        Py_hash_t v = (Py_hash_t)PyUnstable_Long_CompactValue((PyLongObject *)o); /* |v| < 2**30 */
        return v == -1 ? -2 : v;
    }
#else
    if (PyLong_CheckExact(o) && (size_t)(Py_SIZE(o) + 1) < 3) { /* at most one 30-bit digit */
        Py_hash_t v = (Py_hash_t)Py_SIZE(o) * (Py_hash_t)((PyLongObject *)o)->ob_digit[0];
        return v == -1 ? -2 : v;
    }
#endif
    return PY_HASH_SLOW;
}

static inline Py_hash_t finish(Py_uhash_t acc, Py_uhash_t len) {
    acc += len ^ (XXPRIME_5 ^ 3527539UL);
    return acc == (Py_uhash_t)-1 ? (Py_hash_t)1546275796 : (Py_hash_t)acc;
}

static inline Py_uhash_t lane(Py_uhash_t acc, Py_uhash_t h) {
    acc += h * XXPRIME_2;
    acc = XXROTATE(acc);
    return acc * XXPRIME_1;
}

static PyObject *block_hashes(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"ids", "seed", "start", NULL};
    PyObject *ids;
    PyObject *seed = NULL;
    Py_ssize_t start = 0;
    (void)module;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|On:block_hashes", kwlist, &ids, &seed, &start)) {
        return NULL;
    }
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0");
        return NULL;
    }
    PyObject *seq = as_fast(ids, "ids must be a sequence");
    if (seq == NULL) return NULL;
    Py_hash_t h;
    if (seed == NULL) {
        h = (Py_hash_t)0x5EED0FB10C5LL; /* CHAIN_SEED: hash(int) of a small int is itself */
    } else {
        h = PyObject_Hash(seed);
        if (h == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t blocks = n > start ? (n - start) / BLOCK : 0;
    PyObject *out = PyList_New(blocks);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_hash_t h0 = h;
restart:
    h = h0;
    PyObject **item = PySequence_Fast_ITEMS(seq) + start;
    for (Py_ssize_t b = 0; b < blocks; b++, item += BLOCK) {
        Py_uhash_t acc = XXPRIME_5;
        for (int i = 0; i < BLOCK; i++) {
            Py_hash_t e = item_hash(item[i]);
            if (e == PY_HASH_SLOW) {
                if (PyList_Check(seq)) {
                    /* hashing an object of another type may run Python code that changes the list: name
                     * a copy (a tuple holds its items), from the start */
                    for (Py_ssize_t j = 0; j < b; j++) { /* the names made so far are made again */
                        PyObject *x = PyList_GET_ITEM(out, j);
                        PyList_SET_ITEM(out, j, NULL);
                        Py_DECREF(x);
                    }
                    Py_SETREF(seq, PyList_AsTuple(seq));
                    if (seq == NULL) {
                        Py_DECREF(out);
                        return NULL;
                    }
                    goto restart;
                }
                e = PyObject_Hash(item[i]);
            }
            if (e == -1 && PyErr_Occurred()) goto fail;
            acc = lane(acc, (Py_uhash_t)e);
        }
        Py_hash_t inner = finish(acc, BLOCK);
        /* hash((h, block)): the previous name is an int object in the Python version; its hash is
         * int_hash(h), except for the seed, whose hash PyObject_Hash gave above (any int, even > 64 bits) */
        Py_uhash_t pair = lane(XXPRIME_5, (Py_uhash_t)(b == 0 ? h : int_hash(h)));
        pair = lane(pair, (Py_uhash_t)inner);
        h = finish(pair, 2);
        PyObject *v = PyLong_FromSsize_t(h);
        if (v == NULL) goto fail;
        PyList_SET_ITEM(out, b, v);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"block_hashes", (PyCFunction)(void (*)(void))block_hashes, METH_VARARGS | METH_KEYWORDS,
     "block_hashes(ids, seed=CHAIN_SEED, start=0) -> list[int]: chained names of the full 16-token blocks "
     "of ids[start:] (prefix_index.block_hashes at C speed)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_chainhash", "Chained 16-token block names (see prefix_index.block_hashes).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__chainhash(void) { return PyModule_Create(&module_def); }
