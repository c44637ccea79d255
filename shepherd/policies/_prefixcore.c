/* The prefix index in C: chained block names (``block_hashes``: the values of the pure-Python reference
 * ``block_names.py_block_hashes``) and the index's state (``Core``: block name -> holders, one last access
 * per (block, worker), exact LRU per worker), wrapped by ``native_index.NativePrefixIndex`` (names, slots,
 * config). The pure-Python ``PrefixIndex`` is the reference the property tests hold it to.
 *
 * Layout (arrays of plain structs, allocated with PyMem_* so tracemalloc counts them):
 * - ``table``: open addressing (linear probing, backward-shift deletion, load <= 1/2) of block name
 *   (int64) -> block record index; the name is kept in the slot so a probe reads one cache line.
 * - ``blocks``: per block its name, the mask of its holders (worker slot bits) and its first entry.
 * - ``entries``: per (block, worker) the last access, the next entry of the same block, and the
 *   worker's LRU links (most recent at the head). Freed records are reused (free lists).
 *
 * An insert walks the chain from its deepest block back to its first, moving each to the head of the
 * worker's LRU list: the ancestors end up nearer the head, so eviction (from the tail) takes deeper
 * blocks first and what a worker keeps of a chain stays a prefix (the binary search in ``match``
 * relies on it). Merged entries keep their own times and are placed by them (a bounded walk: merges of
 * old entries are approximately LRU-placed). ``match_ids`` names a prompt and matches it without making
 * the names Python ints; ``insert_named`` then inserts that chain (what a routing decision does).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_SLOTS 64
#define NIL (-1)
#define PLACE_WALK 64 /* how far a merged entry is walked into place from the head */

typedef struct {
    int64_t key;
    int32_t blk; /* NIL: empty */
} Slot;

typedef struct {
    int64_t key;
    uint64_t mask;
    int32_t head; /* first entry; on the free list: the next free block */
} Block;

typedef struct {
    double time;
    int32_t blk;   /* NIL: free */
    int32_t bnext; /* next entry of the same block; on the free list: the next free entry */
    int32_t prev, next; /* the worker's LRU list (prev: towards the head) */
    int32_t slot;
} Entry;

typedef struct {
    int32_t head, tail;
    Py_ssize_t count;
    Py_ssize_t cap;
} Worker;

/* -- replication state (see the replication section) -- */
typedef struct {
    int64_t slot; /* a time slot: floor(t / granularity), or the bits of the exact time */
    int64_t count; /* 0: an empty cell */
    uint64_t sum;  /* of the block names, mod 2**64 */
} Bucket;

typedef struct {
    Bucket *cells;
    Py_ssize_t size, used; /* size a power of 2 (or 0), used <= size / 2 */
} Buckets;

typedef struct {
    double time; /* NaN: the times the index holds when the batch is cut */
    Py_ssize_t start, end; /* its keys: dk[start:end] */
    int32_t slot;
    uint32_t gen; /* the slot's generation when buffered: a worker cleared since is skipped */
} DeltaGroup;

typedef struct {
    double gran; /* digest granularity in seconds; 0: exact times */
    int relay;   /* merged changes are buffered too */
    double refresh; /* a local re-access moves a held entry into another slot (and sends it) only this old */
    uint8_t quiet[MAX_SLOTS]; /* per slot: local inserts are never buffered (the engine's KV events tell
                               * every node), and always take the access time */
    Py_ssize_t max_pending, pending, dropped;
    Buckets buckets[MAX_SLOTS];
    uint32_t gen[MAX_SLOTS];
    DeltaGroup *dg;
    Py_ssize_t dg_head, dg_len, dg_cap;
    int64_t *dk;
    Py_ssize_t dk_len, dk_cap;
    int open; /* a group is being recorded (the last one) */
} Repl;

typedef struct {
    PyObject_HEAD
    Slot *table;
    Py_ssize_t tsize; /* a power of 2 */
    Py_ssize_t live;  /* blocks in the table */
    Block *blocks;
    Py_ssize_t bcap, btop;
    int32_t bfree;
    Entry *entries;
    Py_ssize_t ecap, etop;
    int32_t efree;
    Worker workers[MAX_SLOTS];
    int64_t *named; /* the chain the last match_ids named (for insert_named) */
    Py_ssize_t nnamed, named_cap;
    PyObject *names; /* list of MAX_SLOTS: the worker name of each slot, or None */
    Repl *repl;      /* digest and delta buffer (a mesh's replica), NULL until replicate() */
} Core;

static inline uint64_t mix(int64_t key) { /* splitmix64's finalizer: names are hashes, but cheap insurance */
    uint64_t z = (uint64_t)key;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* where a block name or a turn record's name sits in its table: names come from token ids a client
 * chooses, so their places are keyed per process (from the KvMap's os.urandom key, set at import) and
 * cannot be ground offline into one probe run; two rounds of the mixer, a key before each */
static uint64_t place_k0, place_k1;
static inline uint64_t place(int64_t key) {
    return mix((int64_t)(mix((int64_t)((uint64_t)key ^ place_k0)) ^ place_k1));
}

/* a list or tuple (subclasses too: PromptIds is a list) as it is, anything else as a new list; PySequence_Fast
 * copies list subclasses */
static inline PyObject *as_fast(PyObject *o, const char *msg) {
    if (PyList_Check(o) || PyTuple_Check(o)) {
        Py_INCREF(o);
        return o;
    }
    return PySequence_Fast(o, msg);
}

/* as_fast, but a list holding anything other than ints (whose conversion may run Python code that changes
 * the list) as a tuple copy */
static PyObject *as_stable(PyObject *o, const char *msg, int floats) {
    PyObject *seq = as_fast(o, msg);
    if (seq == NULL || !PyList_Check(seq)) return seq;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(seq); i++) {
        PyObject *x = PyList_GET_ITEM(seq, i);
        if (!PyLong_Check(x) && !(floats && PyFloat_Check(x))) {
            Py_SETREF(seq, PyList_AsTuple(seq));
            break;
        }
    }
    return seq;
}

/* == naming: chained 16-token block names ============================================================
 * The same values as the pure-Python reference ``block_names.py_block_hashes``
 * (``h_i = hash((h_{i-1}, tuple(block_i)))``, CPython's own tuple and int hashes); the property tests compare
 * the two on lists of any ints (negative, huge, bools) and any seed. The Python version costs ~0.3 us a
 * block (a 16-tuple, a pair tuple, two tuple hashes and a list append per block); here the tuples are never
 * built: the 16 element hashes are folded as CPython's ``tuplehash`` folds them (xxHash-style lanes,
 * Objects/tupleobject.c, unchanged from 3.8 to 3.13), and the previous name's own hash is CPython's int hash
 * (reduction modulo 2**61 - 1, Python/pyhash.h). About the cost of ``sum(ids)``: reading the ids. */

#if SIZEOF_PY_UHASH_T != 8
#error "block names are defined for 64-bit CPython"
#endif

#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))
#define BLOCK 16

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

/* *out (a PyMem buffer, *cap its size) grown to hold ``blocks`` names; -1 (MemoryError set) if it cannot */
static int names_room(Py_ssize_t blocks, int64_t **out, Py_ssize_t *cap) {
    if (blocks > *cap) {
        int64_t *grown = PyMem_Realloc(*out, (size_t)blocks * sizeof(int64_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *out = grown;
        *cap = blocks;
    }
    return 0;
}

/* the block names of an array('I') read in place (``text_ids``: a relayed request's pseudo ids, one per
 * 4 bytes of its text, which would cost an int object each as a list): a word below 2**32 is an int
 * whose hash is its value, so the names are those of the same values in a list. -2: not such a buffer
 * (no exception set: the caller reads ``ids`` as a sequence). */
static Py_ssize_t name_words(PyObject *ids, Py_hash_t seed_hash, Py_ssize_t start, int64_t **out, Py_ssize_t *cap) {
    if (PyList_Check(ids) || PyTuple_Check(ids) || !PyObject_CheckBuffer(ids)) return -2;
    Py_buffer view;
    if (PyObject_GetBuffer(ids, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return -2;
    }
    if (view.ndim != 1 || view.itemsize != 4 || view.format == NULL || strcmp(view.format, "I") != 0) {
        PyBuffer_Release(&view);
        return -2;
    }
    Py_ssize_t n = view.len / 4;
    Py_ssize_t blocks = n > start ? (n - start) / BLOCK : 0;
    if (names_room(blocks, out, cap) < 0) {
        PyBuffer_Release(&view);
        return -1;
    }
    int64_t *names = *out;
    const uint32_t *word = (const uint32_t *)view.buf + (blocks ? start : 0);
    Py_hash_t h = seed_hash;
    for (Py_ssize_t b = 0; b < blocks; b++, word += BLOCK) {
        Py_uhash_t acc = XXPRIME_5;
        for (int i = 0; i < BLOCK; i++) acc = lane(acc, (Py_uhash_t)word[i]);
        Py_uhash_t pair = lane(XXPRIME_5, (Py_uhash_t)(b == 0 ? h : int_hash(h)));
        pair = lane(pair, (Py_uhash_t)finish(acc, BLOCK));
        h = finish(pair, 2);
        names[b] = (int64_t)h;
    }
    PyBuffer_Release(&view);
    return blocks;
}

/* the names of the full blocks of ids[start:] into a PyMem buffer (*out, grown as needed, *cap its size);
 * returns how many, -1 on error (a Python exception set) */
static Py_ssize_t name_blocks(PyObject *ids, Py_hash_t seed_hash, Py_ssize_t start, int64_t **out, Py_ssize_t *cap) {
    Py_ssize_t words = name_words(ids, seed_hash, start, out, cap);
    if (words != -2) return words;
    PyObject *seq = as_fast(ids, "ids must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t blocks = n > start ? (n - start) / BLOCK : 0;
    if (names_room(blocks, out, cap) < 0) {
        Py_DECREF(seq);
        return -1;
    }
    int64_t *names = *out;
restart:;
    Py_hash_t h = seed_hash;
    PyObject **item = PySequence_Fast_ITEMS(seq) + start;
    for (Py_ssize_t b = 0; b < blocks; b++, item += BLOCK) {
        Py_uhash_t acc = XXPRIME_5;
        for (int i = 0; i < BLOCK; i++) {
            Py_hash_t e = item_hash(item[i]);
            if (e == PY_HASH_SLOW) {
                if (PyList_Check(seq)) {
                    /* hashing an object of another type may run Python code that changes the list: name a
                     * copy (a tuple holds its items), from the start */
                    Py_SETREF(seq, PyList_AsTuple(seq));
                    if (seq == NULL) return -1;
                    goto restart;
                }
                e = PyObject_Hash(item[i]);
                if (e == -1 && PyErr_Occurred()) {
                    Py_DECREF(seq);
                    return -1;
                }
            }
            acc = lane(acc, (Py_uhash_t)e);
        }
        Py_hash_t inner = finish(acc, BLOCK);
        /* hash((h, block)): the previous name is an int object in the Python version; its hash is
         * int_hash(h), except for the seed, whose hash the caller gave (any int, even > 64 bits) */
        Py_uhash_t pair = lane(XXPRIME_5, (Py_uhash_t)(b == 0 ? h : int_hash(h)));
        pair = lane(pair, (Py_uhash_t)inner);
        h = finish(pair, 2);
        names[b] = (int64_t)h;
    }
    Py_DECREF(seq);
    return blocks;
}

#define CHAIN_SEED_HASH ((Py_hash_t)0x5EED0FB10C5LL) /* block_names.CHAIN_SEED: a small int hashes to itself */

/* block_hashes(ids, seed=CHAIN_SEED, start=0) -> list[int] */
static PyObject *block_hashes(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"ids", "seed", "start", NULL};
    PyObject *ids, *seed = NULL;
    Py_ssize_t start = 0;
    (void)module;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|On:block_hashes", kwlist, &ids, &seed, &start)) return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0");
        return NULL;
    }
    Py_hash_t h = CHAIN_SEED_HASH;
    if (seed != NULL && (h = PyObject_Hash(seed)) == -1 && PyErr_Occurred()) return NULL;
    int64_t *names = NULL;
    Py_ssize_t cap = 0;
    Py_ssize_t n = name_blocks(ids, h, start, &names, &cap);
    if (n < 0) {
        PyMem_Free(names);
        return NULL;
    }
    PyObject *out = PyList_New(n);
    for (Py_ssize_t b = 0; out != NULL && b < n; b++) {
        PyObject *v = PyLong_FromLongLong(names[b]);
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, b, v);
    }
    PyMem_Free(names);
    return out;
}

static int table_alloc(Core *c, Py_ssize_t size) {
    Slot *t = PyMem_Malloc((size_t)size * sizeof(Slot));
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++) t[i].blk = NIL;
    Slot *old = c->table;
    Py_ssize_t osize = c->tsize;
    c->table = t;
    c->tsize = size;
    uint64_t m = (uint64_t)size - 1;
    for (Py_ssize_t i = 0; i < osize; i++) {
        if (old[i].blk == NIL) continue;
        uint64_t j = place(old[i].key) & m;
        while (t[j].blk != NIL) j = (j + 1) & m;
        t[j] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

/* the slot of ``key``, or the empty slot where it would go */
static inline Py_ssize_t find_slot(const Core *c, int64_t key) {
    uint64_t m = (uint64_t)c->tsize - 1;
    uint64_t j = place(key) & m;
    while (c->table[j].blk != NIL && c->table[j].key != key) j = (j + 1) & m;
    return (Py_ssize_t)j;
}

static inline int32_t find_block(const Core *c, int64_t key) {
    return c->table[find_slot(c, key)].blk;
}

static void table_delete(Core *c, Py_ssize_t i) { /* backward-shift deletion: no tombstones */
    uint64_t m = (uint64_t)c->tsize - 1;
    uint64_t hole = (uint64_t)i, j = (uint64_t)i;
    c->table[hole].blk = NIL;
    for (;;) { /* bounded: the table has empty slots (load <= 1/2) */
        j = (j + 1) & m;
        if (c->table[j].blk == NIL) return;
        uint64_t k = place(c->table[j].key) & m;
        /* the entry at j may move to the hole unless its home k lies cyclically in (hole, j] */
        int stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
        if (!stays) {
            c->table[hole] = c->table[j];
            c->table[j].blk = NIL;
            hole = j;
        }
    }
}

/* grows an array (items of ``size`` bytes, capacity *cap) to hold ``need`` items, doubling from 1024 */
static int grow(void **arr, Py_ssize_t *cap, Py_ssize_t need, size_t size, const char *what) {
    if (need <= *cap) return 0;
    Py_ssize_t ncap = *cap ? *cap : 1024;
    while (ncap < need) ncap *= 2; /* bounded: doubles */
    if (ncap > INT32_MAX) {
        PyErr_Format(PyExc_MemoryError, "prefix index: too many %s", what);
        return -1;
    }
    void *p = PyMem_Realloc(*arr, (size_t)ncap * size);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *arr = p;
    *cap = ncap;
    return 0;
}

/* room for n more blocks and entries (table slots included), so that nothing after it can fail: an
 * insert or merge either changes nothing (an error here) or completes */
static int reserve(Core *c, Py_ssize_t n) {
    Py_ssize_t size = c->tsize;
    while (2 * (c->live + n + 1) > size) size *= 2; /* bounded: doubles */
    if (size != c->tsize && table_alloc(c, size) < 0) return -1;
    if (grow((void **)&c->blocks, &c->bcap, c->btop + n, sizeof(Block), "blocks") < 0) return -1;
    return grow((void **)&c->entries, &c->ecap, c->etop + n, sizeof(Entry), "entries");
}

/* a block record for ``key`` at its empty table slot ``slot_at`` (room reserved) */
static int32_t new_block(Core *c, Py_ssize_t slot_at, int64_t key) {
    int32_t b = c->bfree;
    if (b != NIL) c->bfree = c->blocks[b].head;
    else b = (int32_t)c->btop++;
    c->blocks[b].key = key;
    c->blocks[b].mask = 0;
    c->blocks[b].head = NIL;
    c->table[slot_at].key = key;
    c->table[slot_at].blk = b;
    c->live++;
    return b;
}

static int32_t new_entry(Core *c) { /* room reserved */
    int32_t e = c->efree;
    if (e == NIL) return (int32_t)c->etop++;
    c->efree = c->entries[e].bnext;
    return e;
}

static inline int32_t find_entry(const Core *c, int32_t b, int slot) {
    int32_t e = c->blocks[b].head;
    while (e != NIL && c->entries[e].slot != slot) e = c->entries[e].bnext; /* bounded: its holders */
    return e;
}

static inline void lru_unlink(Core *c, int32_t e) {
    Entry *x = &c->entries[e];
    Worker *w = &c->workers[x->slot];
    if (x->prev != NIL) c->entries[x->prev].next = x->next; else w->head = x->next;
    if (x->next != NIL) c->entries[x->next].prev = x->prev; else w->tail = x->prev;
}

static inline void lru_push_head(Core *c, int32_t e) {
    Entry *x = &c->entries[e];
    Worker *w = &c->workers[x->slot];
    x->prev = NIL;
    x->next = w->head;
    if (w->head != NIL) c->entries[w->head].prev = e; else w->tail = e;
    w->head = e;
}

static inline void lru_insert_after(Core *c, int32_t at, int32_t e) { /* at: an entry of the same worker */
    Entry *x = &c->entries[e];
    Worker *w = &c->workers[x->slot];
    x->prev = at;
    x->next = c->entries[at].next;
    if (x->next != NIL) c->entries[x->next].prev = e; else w->tail = e;
    c->entries[at].next = e;
}

/* == replication (a mesh's replica: Core.replicate) ====================================================
 * The digest: per worker, per time slot, the count of its entries and the sum of their block names (mod
 * 2**64), kept up to date by every change of an entry (made, retimed into another slot, dropped). The delta
 * buffer: the blocks a routing decision made, or moved into another slot once ``refresh`` old (as
 * ``prefix_replica.ReplicatedPrefixIndex`` does: a held prefix re-accessed sooner stays in its slot and is not
 * sent again), one group per insert, in chain order; never a KV event's or a quiet worker's; with ``relay``,
 * what merges changed too. The same semantics as the Python replica, tested alike. */

/* Python's float floor division (Objects/floatobject.c), so that slots are the Python replica's */
static double py_floordiv(double vx, double wx) {
    double mod = fmod(vx, wx);
    double div = (vx - mod) / wx;
    if (mod && ((wx < 0) != (mod < 0))) div -= 1.0;
    if (!div) return copysign(0.0, vx / wx);
    double floordiv = floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
    return floordiv;
}

static inline int64_t slot_of(const Repl *r, double t) {
    if (r->gran > 0) {
        double q = py_floordiv(t, r->gran);
        /* within int64 (q is integral): Python's int(t // g); beyond it (times no clock gives) slot 0 */
        return q >= -9223372036854775808.0 && q < 9223372036854775808.0 ? (int64_t)q : 0;
    }
    if (t == 0) t = 0.0; /* -0.0 and 0.0 are one dict key in Python */
    int64_t k;
    memcpy(&k, &t, sizeof k);
    return k;
}

static PyObject *slot_value(const Repl *r, int64_t slot) {
    if (r->gran > 0) return PyLong_FromLongLong(slot);
    double t;
    memcpy(&t, &slot, sizeof t);
    return PyFloat_FromDouble(t);
}

static int buckets_resize(Buckets *bs, Py_ssize_t size) {
    Bucket *cells = PyMem_Calloc((size_t)size, sizeof(Bucket));
    if (cells == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t m = (uint64_t)size - 1;
    for (Py_ssize_t i = 0; i < bs->size; i++) {
        if (!bs->cells[i].count) continue;
        uint64_t j = mix(bs->cells[i].slot) & m;
        while (cells[j].count) j = (j + 1) & m; /* bounded: load <= 1/2 */
        cells[j] = bs->cells[i];
    }
    PyMem_Free(bs->cells);
    bs->cells = cells;
    bs->size = size;
    return 0;
}

/* room for n more buckets */
static int buckets_reserve(Buckets *bs, Py_ssize_t n) {
    Py_ssize_t size = bs->size ? bs->size : 8;
    while (2 * (bs->used + n) > size) size *= 2; /* bounded: doubles */
    return size == bs->size ? 0 : buckets_resize(bs, size);
}

/* count += dn, sum += dsum in the bucket of ``slot`` (room reserved for a new one); an emptied bucket goes */
static void bucket_add(Buckets *bs, int64_t slot, int64_t dn, uint64_t dsum) {
    uint64_t m = (uint64_t)bs->size - 1;
    uint64_t j = mix(slot) & m;
    while (bs->cells[j].count && bs->cells[j].slot != slot) j = (j + 1) & m; /* bounded: load <= 1/2 */
    Bucket *b = &bs->cells[j];
    if (!b->count) {
        b->slot = slot;
        b->sum = 0;
        bs->used++;
    }
    b->count += dn;
    b->sum += dsum;
    if (b->count) return;
    bs->used--; /* backward-shift deletion, as the block table's */
    uint64_t hole = j;
    for (;;) { /* bounded: the map has empty cells */
        j = (j + 1) & m;
        if (!bs->cells[j].count) return;
        uint64_t k = mix(bs->cells[j].slot) & m;
        int stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
        if (!stays) {
            bs->cells[hole] = bs->cells[j];
            bs->cells[j].count = 0;
            hole = j;
        }
    }
}

/* the time a held entry at ``old`` (time slot ``so``) takes for an access at ``now`` that does not move it
 * out of its slot: the slot's last instant at most (never earlier than ``old``) */
static double clamp_to_slot(const Repl *r, int64_t so, double old, double now) {
    if (!(now > old) || r->gran <= 0) return old;
    double end = nextafter(((double)so + 1.0) * r->gran, -INFINITY);
    if (end > now) end = now;
    return end > old && slot_of(r, end) == so ? end : old;
}

/* the digest terms of an entry of ``slot`` at time ``t`` for block ``key``: added (+1) or removed (-1) */
static inline void digest_term(Core *c, int slot, double t, int64_t key, int sign) {
    bucket_add(&c->repl->buckets[slot], slot_of(c->repl, t), sign, sign > 0 ? (uint64_t)key : (uint64_t)0 - (uint64_t)key);
}

/* room for a group of up to ``nkeys`` keys, and ``nbuckets`` new buckets of ``slot`` */
static int repl_reserve(Core *c, int slot, Py_ssize_t nbuckets, Py_ssize_t nkeys) {
    Repl *r = c->repl;
    if (nbuckets && buckets_reserve(&r->buckets[slot], nbuckets) < 0) return -1;
    if (r->dg_head && r->dg_head == r->dg_len) { /* all taken: start over */
        r->dg_head = r->dg_len = r->dk_len = 0;
    } else if (r->dg_head && ((r->dg_head > 1024 && 2 * r->dg_head > r->dg_len) ||
                              (r->dg[r->dg_head].start > 4096 && 2 * r->dg[r->dg_head].start > r->dk_len))) {
        /* the taken (or dropped) front, by groups or by keys, compacted: the buffer stays within about
         * twice what is pending, however large the groups */
        Py_ssize_t k0 = r->dg[r->dg_head].start;
        memmove(r->dg, r->dg + r->dg_head, (size_t)(r->dg_len - r->dg_head) * sizeof(DeltaGroup));
        r->dg_len -= r->dg_head;
        r->dg_head = 0;
        memmove(r->dk, r->dk + k0, (size_t)(r->dk_len - k0) * sizeof(int64_t));
        r->dk_len -= k0;
        for (Py_ssize_t i = 0; i < r->dg_len; i++) {
            r->dg[i].start -= k0;
            r->dg[i].end -= k0;
        }
    }
    if (grow((void **)&r->dg, &r->dg_cap, r->dg_len + 1, sizeof(DeltaGroup), "delta groups") < 0) return -1;
    return grow((void **)&r->dk, &r->dk_cap, r->dk_len + nkeys, sizeof(int64_t), "delta keys");
}

/* a group of ``slot`` at ``time`` (NaN: held times) opens; record() appends to it (room reserved) */
static void group_open(Core *c, int slot, double time) {
    Repl *r = c->repl;
    DeltaGroup *g = &r->dg[r->dg_len];
    g->time = time;
    g->start = g->end = r->dk_len;
    g->slot = slot;
    g->gen = r->gen[slot];
    r->open = 1;
}

static inline void record(Core *c, int64_t key) {
    Repl *r = c->repl;
    r->dk[r->dk_len++] = key;
}

/* the open group closes (its keys reversed when recorded deepest first); the buffer's bound applies */
static void group_close(Core *c, int reversed) {
    Repl *r = c->repl;
    DeltaGroup *g = &r->dg[r->dg_len];
    r->open = 0;
    g->end = r->dk_len;
    if (g->end == g->start) return;
    if (reversed) {
        for (Py_ssize_t i = g->start, j = g->end - 1; i < j; i++, j--) {
            int64_t k = r->dk[i];
            r->dk[i] = r->dk[j];
            r->dk[j] = k;
        }
    }
    r->dg_len++;
    r->pending += g->end - g->start;
    while (r->pending > r->max_pending && r->dg_head < r->dg_len) { /* the oldest batches go, whole */
        DeltaGroup *old = &r->dg[r->dg_head++];
        r->pending -= old->end - old->start;
        r->dropped += old->end - old->start;
    }
}

/* take entry e out of everything; its block goes when it was the last holder */
static void drop_entry(Core *c, int32_t e) {
    Entry *x = &c->entries[e];
    int32_t b = x->blk;
    int slot = x->slot;
    if (c->repl != NULL) digest_term(c, slot, x->time, c->blocks[b].key, -1);
    lru_unlink(c, e);
    c->workers[slot].count--;
    Block *blk = &c->blocks[b];
    if (blk->head == e) {
        blk->head = x->bnext;
    } else {
        int32_t p = blk->head;
        while (c->entries[p].bnext != e) p = c->entries[p].bnext; /* bounded: its holders */
        c->entries[p].bnext = x->bnext;
    }
    blk->mask &= ~((uint64_t)1 << slot);
    x->blk = NIL;
    x->bnext = c->efree;
    c->efree = e;
    if (blk->head == NIL) {
        table_delete(c, find_slot(c, blk->key));
        blk->head = c->bfree;
        c->bfree = b;
        c->live--;
    }
}

/* the entry of (key, slot), made when absent (room reserved), unlinked from the LRU list, time unset */
static int32_t get_or_add(Core *c, int64_t key, int slot, int *added) {
    Py_ssize_t at = find_slot(c, key);
    int32_t b = c->table[at].blk;
    *added = 0;
    if (b == NIL) {
        b = new_block(c, at, key);
    } else {
        int32_t e = find_entry(c, b, slot);
        if (e != NIL) {
            lru_unlink(c, e);
            return e;
        }
    }
    int32_t e = new_entry(c);
    Entry *x = &c->entries[e];
    x->blk = b;
    x->slot = slot;
    x->bnext = c->blocks[b].head;
    c->blocks[b].head = e;
    c->blocks[b].mask |= (uint64_t)1 << slot;
    c->workers[slot].count++;
    *added = 1;
    return e;
}

/* The blocks of a chain sit at random places in the table, so touching them one after the other waits
 * for one cache miss after another (table slot, block record, entry: a prompt's ~80 blocks' worth of serial
 * misses, most of an insert's time). Four passes issue each level's loads for every block at once, so
 * the misses overlap; the insert loop then finds them in cache. Only hints: nothing is changed. */
static void prefetch_chain(const Core *c, const int64_t *keys, Py_ssize_t n, int slot, int32_t *ent) {
    uint64_t m = (uint64_t)c->tsize - 1;
    Py_ssize_t i;
    for (i = 0; i < n; i++) __builtin_prefetch(&c->table[place(keys[i]) & m]);
    for (i = 0; i < n; i++) { /* ent holds block indexes for a while */
        int32_t b = find_block(c, keys[i]);
        ent[i] = b;
        if (b != NIL) __builtin_prefetch(&c->blocks[b]);
    }
    for (i = 0; i < n; i++) {
        if (ent[i] == NIL) continue;
        int32_t e = c->blocks[ent[i]].head;
        if (e != NIL) __builtin_prefetch(&c->entries[e], 1);
    }
    for (i = 0; i < n; i++) { /* the worker's entries, and their LRU neighbours: the moves write them */
        if (ent[i] == NIL) continue;
        int32_t e = ent[i] = find_entry(c, ent[i], slot);
        if (e == NIL) continue;
        if (c->entries[e].prev != NIL) __builtin_prefetch(&c->entries[c->entries[e].prev], 1);
        if (c->entries[e].next != NIL) __builtin_prefetch(&c->entries[c->entries[e].next], 1);
    }
}

#define EVICT_BATCH 64

static Py_ssize_t evict(Core *c, int slot) {
    Worker *w = &c->workers[slot];
    Py_ssize_t n = 0;
    int32_t victims[EVICT_BATCH];
    while (w->count > w->cap && w->tail != NIL) { /* bounded: each turn drops at least one entry */
        /* the next victims from the tail, then their blocks' and table slots' loads issued together
         * (cold memory: the least recently used), then dropped in order */
        int k = 0;
        Py_ssize_t need = w->count - w->cap;
        for (int32_t e = w->tail; e != NIL && k < EVICT_BATCH && k < need; e = c->entries[e].prev) {
            victims[k++] = e;
            __builtin_prefetch(&c->blocks[c->entries[e].blk], 1);
        }
        uint64_t m = (uint64_t)c->tsize - 1;
        for (int j = 0; j < k; j++) __builtin_prefetch(&c->table[place(c->blocks[c->entries[victims[j]].blk].key) & m], 1);
        for (int j = 0; j < k; j++) drop_entry(c, victims[j]);
        n += k;
    }
    return n;
}

/* -- argument helpers -------------------------------------------------------------------------------- */

static int get_slot(PyObject *arg, int *slot) {
    long s = PyLong_AsLong(arg);
    if (s == -1 && PyErr_Occurred()) return -1;
    if (s < 0 || s >= MAX_SLOTS) {
        PyErr_SetString(PyExc_ValueError, "worker slot out of range");
        return -1;
    }
    *slot = (int)s;
    return 0;
}

static inline int key_of(PyObject *o, int64_t *key) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *key = (int64_t)v;
    return 0;
}

/* the names of ``hs`` (a sequence of ints) as int64s in a PyMem buffer the caller frees. Without ``bad`` a
 * name outside 64 bits is an OverflowError; with it, such names are flagged in *bad (allocated only when
 * there is one, freed by the caller) rather than refused: a lookup of them finds nothing */
static int64_t *keys_of(PyObject *hs, Py_ssize_t *n, uint8_t **bad) {
    if (bad != NULL) *bad = NULL;
    if (PyObject_CheckBuffer(hs) && !PyBytes_Check(hs) && !PyByteArray_Check(hs)) {
        /* an int64 array (array("q"), what the wire decodes to): copied as it is, no int per name */
        Py_buffer view;
        if (PyObject_GetBuffer(hs, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            int ok = view.itemsize == 8 && view.format != NULL &&
                     (strcmp(view.format, "q") == 0 || strcmp(view.format, "l") == 0 || strcmp(view.format, "=q") == 0 ||
                      strcmp(view.format, "<q") == 0);
            if (ok) {
                Py_ssize_t m = view.len / 8;
                int64_t *keys = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(int64_t));
                if (keys == NULL) {
                    PyBuffer_Release(&view);
                    PyErr_NoMemory();
                    return NULL;
                }
                memcpy(keys, view.buf, (size_t)m * sizeof(int64_t));
                PyBuffer_Release(&view);
                *n = m;
                return keys;
            }
            PyBuffer_Release(&view);
        } else {
            PyErr_Clear();
        }
    }
    PyObject *seq = as_stable(hs, "block names must be a sequence", 0);
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    int64_t *keys = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(int64_t));
    if (bad != NULL) *bad = NULL;
    if (keys == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < m; i++) {
        if (key_of(items[i], &keys[i]) == 0) continue;
        if (bad != NULL && PyErr_ExceptionMatches(PyExc_OverflowError) &&
            (*bad != NULL || (*bad = PyMem_Calloc((size_t)m, 1)) != NULL)) {
            PyErr_Clear();
            (*bad)[i] = 1;
            keys[i] = 0;
            continue;
        }
        if (!PyErr_Occurred()) PyErr_NoMemory();
        PyMem_Free(keys);
        if (bad != NULL) {
            PyMem_Free(*bad);
            *bad = NULL;
        }
        Py_DECREF(seq);
        return NULL;
    }
    Py_DECREF(seq);
    *n = m;
    return keys;
}

/* -- methods ---------------------------------------------------------------------------------------- */

static inline uint64_t mask_at(const Core *c, const int64_t *keys, const uint8_t *bad, Py_ssize_t i) {
    if (bad != NULL && bad[i]) return 0;
    int32_t b = find_block(c, keys[i]);
    return b == NIL ? 0 : c->blocks[b].mask;
}

static int put_counts(Core *c, PyObject *out, uint64_t ws, Py_ssize_t n) {
    PyObject *v = NULL;
    while (ws) { /* bounded: one bit per turn */
        int s = __builtin_ctzll(ws);
        ws &= ws - 1;
        PyObject *name = PyList_GET_ITEM(c->names, s);
        if (name == Py_None) continue;
        if (v == NULL && (v = PyLong_FromSsize_t(n)) == NULL) return -1;
        Py_INCREF(name); /* its hash may run Python code that sets another name (any object is one) */
        int r = PyDict_SetItem(out, name, v);
        Py_DECREF(name);
        if (r < 0) {
            Py_DECREF(v);
            return -1;
        }
    }
    Py_XDECREF(v);
    return 0;
}

/* {worker: leading blocks of the chain keys[:n] it holds}: a shared binary search over the chain */
static PyObject *match_keys(Core *c, const int64_t *keys, const uint8_t *bad, Py_ssize_t n) {
    PyObject *out = PyDict_New();
    if (out == NULL || n == 0) return out;
    uint64_t first = mask_at(c, keys, bad, 0);
    if (!first) return out;
    uint64_t full = n > 1 ? (mask_at(c, keys, bad, n - 1) & first) : first;
    if (full && put_counts(c, out, full, n) < 0) goto fail;
    uint64_t rest = first & ~full;
    /* (lo, hi, ws): each worker in ws holds block lo-1 and exactly b leading blocks, lo <= b <= hi;
     * a set splits at most once per worker: the stack holds at most MAX_SLOTS items */
    Py_ssize_t st_lo[MAX_SLOTS + 1], st_hi[MAX_SLOTS + 1];
    uint64_t st_ws[MAX_SLOTS + 1];
    int top = 0;
    if (rest) {
        st_lo[0] = 1;
        st_hi[0] = n - 1;
        st_ws[0] = rest;
        top = 1;
    }
    while (top) { /* bounded: each turn settles a set, each inner step halves a range */
        top--;
        Py_ssize_t lo = st_lo[top], hi = st_hi[top];
        uint64_t ws = st_ws[top];
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) >> 1;
            uint64_t right = ws & mask_at(c, keys, bad, mid);
            if (right) {
                if (right != ws) {
                    st_lo[top] = lo;
                    st_hi[top] = mid;
                    st_ws[top] = ws ^ right;
                    top++;
                }
                lo = mid + 1;
                ws = right;
            } else {
                hi = mid;
            }
        }
        if (put_counts(c, out, ws, lo) < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* match(hs) -> {worker: leading blocks of the chain hs it holds} */
static PyObject *Core_match(Core *c, PyObject *hs) {
    Py_ssize_t n;
    uint8_t *bad;
    int64_t *keys = keys_of(hs, &n, &bad);
    if (keys == NULL) return NULL;
    PyObject *out = match_keys(c, keys, bad, n);
    PyMem_Free(keys);
    PyMem_Free(bad);
    return out;
}

/* match_ids(ids) -> match(block_hashes(ids)), the names kept (not made into ints) for insert_named */
static PyObject *Core_match_ids(Core *c, PyObject *ids) {
    int64_t *buf = c->named;
    Py_ssize_t cap = c->named_cap;
    c->named = NULL;
    c->named_cap = c->nnamed = 0;
    Py_ssize_t n = name_blocks(ids, CHAIN_SEED_HASH, 0, &buf, &cap);
    PyObject *out = n < 0 ? NULL : match_keys(c, buf, NULL, n);
    PyMem_Free(c->named); /* what a reentrant call left */
    c->named = buf;
    c->named_cap = cap;
    c->nnamed = out == NULL ? 0 : n;
    return out;
}

/* the worker holds every block of keys[:n] (its capacity applied); returns the blocks evicted. A replica
 * also counts each new or re-slotted entry in the digest and, for a routing decision (``gossip``) of a
 * worker not ``quiet``, buffers it for gossip. A held entry re-accessed in another time slot than its
 * own moves there (and is sent again) only once it is ``refresh`` old; until then it stays in its slot,
 * its time the slot's last instant at most (peers' digests still agree: no slot-move re-sends). Inserts
 * that are not sent (a KV event: not ``gossip``; a quiet worker's) always move their entries: every node
 * subscribed to the engine sees the same event. */
static Py_ssize_t insert_keys(Core *c, const int64_t *keys, Py_ssize_t n, int slot, double now, int gossip) {
    Worker *w = &c->workers[slot];
    Repl *r = c->repl;
    if (n > w->cap) n = w->cap; /* a prompt longer than the worker's cache: it keeps the leading blocks */
    if (reserve(c, n) < 0 || (r != NULL && repl_reserve(c, slot, 1, n) < 0)) return -1;
    int32_t small[512];
    int32_t *ent = n <= 512 ? small : PyMem_Malloc((size_t)n * sizeof(int32_t));
    if (ent == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    prefetch_chain(c, keys, n, slot, ent); /* ent[i]: the worker's entry of keys[i] (NIL: none yet) */
    if (r == NULL) {
        for (Py_ssize_t i = n - 1; i >= 0; i--) { /* deepest first: the ancestors end nearer the head */
            int added;
            int32_t e = ent[i];
            if (e != NIL) lru_unlink(c, e);
            else e = get_or_add(c, keys[i], slot, &added);
            c->entries[e].time = now;
            lru_push_head(c, e);
        }
        if (ent != small) PyMem_Free(ent);
        return evict(c, slot);
    }
    int64_t sn = slot_of(r, now);
    int quiet = r->quiet[slot];
    int rec = gossip && !quiet;
    group_open(c, slot, now);
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        int added = 0;
        int32_t e = ent[i];
        if (e != NIL) lru_unlink(c, e);
        else e = get_or_add(c, keys[i], slot, &added);
        Entry *x = &c->entries[e];
        double t = now;
        if (added) {
            bucket_add(&r->buckets[slot], sn, 1, (uint64_t)keys[i]);
            if (rec) record(c, keys[i]);
        } else {
            int64_t so = slot_of(r, x->time);
            if (so == sn) {
            } else if (!rec || now < x->time || !(now - x->time < r->refresh)) { /* moved in the digest */
                bucket_add(&r->buckets[slot], so, -1, (uint64_t)0 - (uint64_t)keys[i]);
                bucket_add(&r->buckets[slot], sn, 1, (uint64_t)keys[i]);
                if (rec) record(c, keys[i]); /* a refresh: sent again */
            } else {
                t = clamp_to_slot(r, so, x->time, now);
            }
        }
        x->time = t;
        lru_push_head(c, e);
    }
    group_close(c, 1);
    if (ent != small) PyMem_Free(ent);
    return evict(c, slot);
}

/* insert(hs, slot, now, gossip=True) -> blocks evicted (gossip False: an engine's KV event, never sent) */
static PyObject *Core_insert(Core *c, PyObject *args) {
    PyObject *hs, *slot_o;
    double now;
    int slot, gossip = 1;
    if (!PyArg_ParseTuple(args, "OOd|p:insert", &hs, &slot_o, &now, &gossip) || get_slot(slot_o, &slot) < 0)
        return NULL;
    Py_ssize_t n;
    int64_t *keys = keys_of(hs, &n, NULL);
    if (keys == NULL) return NULL;
    Py_ssize_t gone = insert_keys(c, keys, n, slot, now, gossip);
    PyMem_Free(keys);
    return gone < 0 ? NULL : PyLong_FromSsize_t(gone);
}

/* insert_named(slot, now) -> blocks evicted: insert the chain the last match_ids named */
static PyObject *Core_insert_named(Core *c, PyObject *args) {
    PyObject *slot_o;
    double now;
    int slot;
    if (!PyArg_ParseTuple(args, "Od:insert_named", &slot_o, &now) || get_slot(slot_o, &slot) < 0) return NULL;
    Py_ssize_t gone = insert_keys(c, c->named, c->nnamed, slot, now, 1);
    return gone < 0 ? NULL : PyLong_FromSsize_t(gone);
}

/* merge(slot, hs, times) -> entries changed (made or set newer): max-merge of (block, worker) -> time for
 * one worker; names outside 64 bits are skipped */
static PyObject *Core_merge(Core *c, PyObject *args) {
    PyObject *slot_o, *hs, *times;
    int slot;
    if (!PyArg_ParseTuple(args, "OOO:merge", &slot_o, &hs, &times) || get_slot(slot_o, &slot) < 0) return NULL;
    Py_ssize_t n;
    double *tv = NULL;
    uint8_t *bad; /* names outside 64 bits: never held, skipped */
    int64_t *keys = keys_of(hs, &n, &bad);
    if (keys == NULL) return NULL;
    PyObject *ts = as_stable(times, "times must be a sequence", 1);
    if (ts == NULL || PySequence_Fast_GET_SIZE(ts) != n) {
        if (ts != NULL) {
            Py_DECREF(ts);
            PyErr_SetString(PyExc_ValueError, "one time per block");
        }
        PyMem_Free(keys);
        PyMem_Free(bad);
        return NULL;
    }
    /* every time read before anything changes: a merge either fails whole or completes */
    tv = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(double));
    if (tv == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        tv[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(ts, i));
        if (tv[i] == -1.0 && PyErr_Occurred()) goto fail;
    }
    Repl *r = c->repl;
    Py_ssize_t nslots = 0; /* an upper bound of the distinct time slots: 1 + the changes along the group */
    for (Py_ssize_t i = 0; r != NULL && i < n; i++)
        if (i == 0 || slot_of(r, tv[i]) != slot_of(r, tv[i - 1])) nslots++;
    if (reserve(c, n) < 0 || (r != NULL && repl_reserve(c, slot, nslots, r->relay ? n : 0) < 0)) goto fail;
    Py_ssize_t changed = 0;
    Worker *w = &c->workers[slot];
    {   /* the table slots of every name first (their cache misses overlap), as an insert does */
        uint64_t m = (uint64_t)c->tsize - 1;
        for (Py_ssize_t i = 0; i < n; i++) __builtin_prefetch(&c->table[place(keys[i]) & m]);
    }
    int32_t prev = NIL; /* the entry placed last, and its time: the next one at that time goes right after it */
    double prev_t = NAN;
    if (r != NULL && r->relay) group_open(c, slot, NAN);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bad != NULL && bad[i]) continue;
        double t = tv[i];
        int32_t b = find_block(c, keys[i]);
        int32_t e = b == NIL ? NIL : find_entry(c, b, slot);
        if (e != NIL && !(t > c->entries[e].time)) continue; /* max-merge: nothing newer */
        if (r != NULL) {
            if (e != NIL) digest_term(c, slot, c->entries[e].time, keys[i], -1);
            digest_term(c, slot, t, keys[i], 1);
            if (r->relay) record(c, keys[i]);
        }
        int added;
        e = get_or_add(c, keys[i], slot, &added);
        changed++;
        c->entries[e].time = t;
        /* placed by its time: after the entries as recent as it or more (so a chain merged in order, on
         * equal times, keeps its deeper blocks nearer the tail), found by a walk from the head of at most
         * PLACE_WALK steps; one no newer than the tail goes to the tail (approximate in between). The
         * blocks of a group share a time: each after the one placed before it (where the walk ends) */
        int32_t at = NIL, cur = w->head;
        if (prev != NIL && prev != e && t == prev_t && c->entries[prev].blk != NIL && c->entries[prev].slot == slot) {
            at = prev;
        } else {
            for (int k = 0; cur != NIL && c->entries[cur].time >= t; k++) { /* bounded: PLACE_WALK */
                if (k == PLACE_WALK) {
                    if (c->entries[w->tail].time >= t) at = w->tail;
                    break;
                }
                at = cur;
                cur = c->entries[cur].next;
            }
        }
        prev = e;
        prev_t = t;
        if (at == NIL) {
            lru_push_head(c, e);
        } else {
            lru_insert_after(c, at, e);
        }
    }
    if (r != NULL && r->relay) group_close(c, 0);
    Py_DECREF(ts);
    PyMem_Free(keys);
    PyMem_Free(bad);
    PyMem_Free(tv);
    evict(c, slot);
    return PyLong_FromSsize_t(changed);
fail:
    Py_DECREF(ts);
    PyMem_Free(keys);
    PyMem_Free(bad);
    PyMem_Free(tv);
    return NULL;
}

/* remove(hs, slot) -> entries removed */
static PyObject *Core_remove(Core *c, PyObject *args) {
    PyObject *hs, *slot_o;
    int slot;
    if (!PyArg_ParseTuple(args, "OO:remove", &hs, &slot_o) || get_slot(slot_o, &slot) < 0) return NULL;
    Py_ssize_t n, gone = 0;
    uint8_t *bad;
    int64_t *keys = keys_of(hs, &n, &bad);
    if (keys == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bad != NULL && bad[i]) continue; /* outside 64 bits: never held */
        int32_t b = find_block(c, keys[i]);
        int32_t e = b == NIL ? NIL : find_entry(c, b, slot);
        if (e != NIL) {
            drop_entry(c, e);
            gone++;
        }
    }
    PyMem_Free(keys);
    PyMem_Free(bad);
    return PyLong_FromSsize_t(gone);
}

static PyObject *Core_clear(Core *c, PyObject *slot_o) {
    int slot;
    if (get_slot(slot_o, &slot) < 0) return NULL;
    Py_ssize_t n = 0;
    while (c->workers[slot].tail != NIL) { /* bounded: one entry per turn */
        drop_entry(c, c->workers[slot].tail);
        n++;
    }
    if (c->repl != NULL) {
        c->repl->gen[slot]++; /* its buffered deltas are not sent */
        c->repl->quiet[slot] = 0;  /* the slot may serve another worker next */
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *Core_set_capacity(Core *c, PyObject *args) {
    PyObject *slot_o;
    Py_ssize_t cap;
    int slot;
    if (!PyArg_ParseTuple(args, "On:set_capacity", &slot_o, &cap) || get_slot(slot_o, &slot) < 0) return NULL;
    c->workers[slot].cap = cap < 1 ? 1 : cap;
    return PyLong_FromSsize_t(evict(c, slot));
}

/* expire(slot, cutoff, budget) -> entries dropped: from the LRU tail while older than cutoff */
static PyObject *Core_expire(Core *c, PyObject *args) {
    PyObject *slot_o;
    double cutoff;
    Py_ssize_t budget;
    int slot;
    if (!PyArg_ParseTuple(args, "Odn:expire", &slot_o, &cutoff, &budget) || get_slot(slot_o, &slot) < 0) return NULL;
    Worker *w = &c->workers[slot];
    Py_ssize_t n = 0;
    while (n < budget && w->tail != NIL && c->entries[w->tail].time < cutoff) { /* bounded by budget */
        drop_entry(c, w->tail);
        n++;
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *Core_holders(Core *c, PyObject *key_o) {
    int64_t key;
    if (key_of(key_o, &key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear(); /* not a name this index can hold */
        return PyLong_FromLong(0);
    }
    int32_t b = find_block(c, key);
    return PyLong_FromUnsignedLongLong(b == NIL ? 0 : c->blocks[b].mask);
}

static PyObject *Core_last_access(Core *c, PyObject *args) {
    PyObject *key_o, *slot_o;
    int slot;
    int64_t key;
    if (!PyArg_ParseTuple(args, "OO:last_access", &key_o, &slot_o) || get_slot(slot_o, &slot) < 0) return NULL;
    if (key_of(key_o, &key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int32_t b = find_block(c, key);
    int32_t e = b == NIL ? NIL : find_entry(c, b, slot);
    if (e == NIL) Py_RETURN_NONE;
    return PyFloat_FromDouble(c->entries[e].time);
}

static PyObject *Core_count(Core *c, PyObject *slot_o) {
    int slot;
    if (get_slot(slot_o, &slot) < 0) return NULL;
    return PyLong_FromSsize_t(c->workers[slot].count);
}

/* export(since) -> {(block, worker name): time}, entries newer than since (None: all) */
static PyObject *Core_export(Core *c, PyObject *since_o) {
    double since = -INFINITY;
    if (since_o != Py_None) {
        since = PyFloat_AsDouble(since_o);
        if (since == -1.0 && PyErr_Occurred()) return NULL;
    }
    typedef struct { int64_t key; double time; int slot; } Snap;
    Py_ssize_t total = 0;
    for (int s = 0; s < MAX_SLOTS; s++) total += c->workers[s].count;
    Snap *snap = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(Snap));
    if (snap == NULL) return PyErr_NoMemory();
    Py_ssize_t k_n = 0;
    for (int s = 0; s < MAX_SLOTS; s++)
        for (int32_t e = c->workers[s].head; e != NIL; e = c->entries[e].next) { /* bounded: its list */
            const Entry *x = &c->entries[e];
            if (x->time > since) snap[k_n++] = (Snap){c->blocks[x->blk].key, x->time, s};
        }
    /* the names as they are now, held: Python code run below (hashes, a collection) may change them */
    PyObject *names = PyList_GetSlice(c->names, 0, MAX_SLOTS);
    PyObject *out = names == NULL ? NULL : PyDict_New();
    for (Py_ssize_t i = 0; out != NULL && i < k_n; i++) {
        PyObject *k = Py_BuildValue("(LO)", (long long)snap[i].key, PyList_GET_ITEM(names, snap[i].slot));
        PyObject *t = k == NULL ? NULL : PyFloat_FromDouble(snap[i].time);
        if (t == NULL || PyDict_SetItem(out, k, t) < 0) Py_CLEAR(out);
        Py_XDECREF(k);
        Py_XDECREF(t);
    }
    Py_XDECREF(names);
    PyMem_Free(snap);
    return out;
}

/* -- replication methods ----------------------------------------------------------------------------- */

/* replicate(granularity, max_pending, relay, refresh=0): keep a digest and a delta buffer from now on (on an
 * empty core) */
static PyObject *Core_replicate(Core *c, PyObject *args) {
    double gran, refresh = 0.0;
    Py_ssize_t max_pending;
    int relay;
    if (!PyArg_ParseTuple(args, "dnp|d:replicate", &gran, &max_pending, &relay, &refresh)) return NULL;
    if (c->repl != NULL || c->live) {
        PyErr_SetString(PyExc_RuntimeError, "replicate() is called once, on an empty index");
        return NULL;
    }
    Repl *r = PyMem_Calloc(1, sizeof(Repl));
    if (r == NULL) return PyErr_NoMemory();
    r->gran = gran > 0 ? gran : 0.0;
    r->relay = relay;
    r->refresh = refresh > 0 ? refresh : 0.0;
    r->max_pending = max_pending;
    c->repl = r;
    Py_RETURN_NONE;
}

static Repl *need_repl(Core *c);

/* set_quiet(slot, quiet): the worker's local inserts are not buffered for gossip (see insert_keys) */
static PyObject *Core_set_quiet(Core *c, PyObject *args) {
    PyObject *slot_o;
    int slot, quiet;
    Repl *r = need_repl(c);
    if (r == NULL || !PyArg_ParseTuple(args, "Op:set_quiet", &slot_o, &quiet) || get_slot(slot_o, &slot) < 0)
        return NULL;
    r->quiet[slot] = (uint8_t)quiet;
    Py_RETURN_NONE;
}

static Repl *need_repl(Core *c) {
    if (c->repl == NULL) PyErr_SetString(PyExc_RuntimeError, "not a replica: call replicate() first");
    return c->repl;
}

/* {slot: {time slot: (count, sum)}} of buckets */
static int put_buckets(const Repl *r, PyObject *out, int slot, const Buckets *bs) {
    if (!bs->used) return 0;
    PyObject *d = PyDict_New();
    PyObject *k = d == NULL ? NULL : PyLong_FromLong(slot);
    if (k == NULL || PyDict_SetItem(out, k, d) < 0) goto fail;
    for (Py_ssize_t i = 0; i < bs->size; i++) {
        const Bucket *b = &bs->cells[i];
        if (!b->count) continue;
        PyObject *sl = slot_value(r, b->slot);
        PyObject *v = sl == NULL ? NULL : Py_BuildValue("(LK)", (long long)b->count, (unsigned long long)b->sum);
        int bad = v == NULL || PyDict_SetItem(d, sl, v) < 0;
        Py_XDECREF(sl);
        Py_XDECREF(v);
        if (bad) goto fail;
    }
    Py_DECREF(k);
    Py_DECREF(d);
    return 0;
fail:
    Py_XDECREF(k);
    Py_XDECREF(d);
    return -1;
}

/* digest(recompute) -> {slot: {time slot: (count, sum of names mod 2**64)}}: the incremental one, or (True)
 * one recomputed from every entry (a check) */
static PyObject *Core_digest(Core *c, PyObject *recompute) {
    Repl *r = need_repl(c);
    if (r == NULL) return NULL;
    int full = PyObject_IsTrue(recompute); /* once: it may run Python code, or fail */
    if (full < 0) return NULL;
    PyObject *out = PyDict_New();
    for (int s = 0; out != NULL && s < MAX_SLOTS; s++) {
        if (!full) {
            if (put_buckets(r, out, s, &r->buckets[s]) < 0) Py_CLEAR(out);
            continue;
        }
        Buckets tmp = {NULL, 0, 0};
        int bad = 0;
        for (int32_t e = c->workers[s].head; e != NIL && !bad; e = c->entries[e].next) { /* bounded: its list */
            bad = buckets_reserve(&tmp, 1) < 0;
            if (!bad) bucket_add(&tmp, slot_of(r, c->entries[e].time), 1, (uint64_t)c->blocks[c->entries[e].blk].key);
        }
        if (bad || put_buckets(r, out, s, &tmp) < 0) Py_CLEAR(out);
        PyMem_Free(tmp.cells);
    }
    return out;
}

static PyObject *bytes_of(const void *p, Py_ssize_t n) { return PyBytes_FromStringAndSize((const char *)p, n); }

/* take(limit) -> [(slot, time or None, keys bytes, times bytes or None)]: the buffered deltas, oldest first,
 * at most ``limit`` keys (the rest stay; a negative limit: all); keys their worker no longer holds, and
 * groups of a worker cleared since, are left out; a group without a time gets the times held now */
static PyObject *Core_take(Core *c, PyObject *limit_o) {
    Repl *r = need_repl(c);
    if (r == NULL) return NULL;
    Py_ssize_t budget = PyLong_AsSsize_t(limit_o);
    if (budget == -1 && PyErr_Occurred()) return NULL;
    if (budget < 0) budget = PY_SSIZE_T_MAX;
    PyObject *out = PyList_New(0);
    int64_t *ks = NULL;
    double *ts = NULL;
    Py_ssize_t cap = 0;
    while (out != NULL && budget > 0 && r->dg_head < r->dg_len) { /* bounded: each turn consumes keys */
        DeltaGroup *g = &r->dg[r->dg_head];
        Py_ssize_t s0 = g->start, e0 = g->end;
        if (e0 - s0 <= budget) {
            r->dg_head++;
        } else {
            e0 = s0 + budget;
            g->start = e0;
        }
        r->pending -= e0 - s0;
        budget -= e0 - s0;
        if (g->gen != r->gen[g->slot]) continue;
        if (e0 - s0 > cap) {
            cap = e0 - s0;
            PyMem_Free(ks);
            PyMem_Free(ts);
            ks = PyMem_Malloc((size_t)cap * sizeof(int64_t));
            ts = PyMem_Malloc((size_t)cap * sizeof(double));
            if (ks == NULL || ts == NULL) {
                PyErr_NoMemory();
                Py_CLEAR(out);
                break;
            }
        }
        Py_ssize_t m = 0;
        for (Py_ssize_t i = s0; i < e0; i++) {
            int32_t b = find_block(c, r->dk[i]);
            int32_t e = b == NIL ? NIL : find_entry(c, b, g->slot);
            if (e == NIL) continue;
            ks[m] = r->dk[i];
            ts[m++] = c->entries[e].time;
        }
        if (!m) continue;
        int held = isnan(g->time);
        PyObject *item = Py_BuildValue("(iNNN)", g->slot, held ? Py_NewRef(Py_None) : PyFloat_FromDouble(g->time),
                                       bytes_of(ks, m * (Py_ssize_t)sizeof(int64_t)),
                                       held ? bytes_of(ts, m * (Py_ssize_t)sizeof(double)) : Py_NewRef(Py_None));
        if (item == NULL || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    PyMem_Free(ks);
    PyMem_Free(ts);
    return out;
}

/* queue(slot, hs): buffer these blocks of the worker for gossip, at the times held when taken (repair) */
static PyObject *Core_queue(Core *c, PyObject *args) {
    PyObject *slot_o, *hs;
    int slot;
    Repl *r = need_repl(c);
    if (r == NULL || !PyArg_ParseTuple(args, "OO:queue", &slot_o, &hs) || get_slot(slot_o, &slot) < 0) return NULL;
    Py_ssize_t n;
    int64_t *keys = keys_of(hs, &n, NULL);
    if (keys == NULL) return NULL;
    if (repl_reserve(c, slot, 0, n) < 0) {
        PyMem_Free(keys);
        return NULL;
    }
    group_open(c, slot, NAN);
    for (Py_ssize_t i = 0; i < n; i++) record(c, keys[i]);
    group_close(c, 0);
    PyMem_Free(keys);
    Py_RETURN_NONE;
}

/* entries(slot) -> (keys bytes, times bytes): the worker's entries, most recent first */
static PyObject *Core_entries(Core *c, PyObject *slot_o) {
    int slot;
    if (get_slot(slot_o, &slot) < 0) return NULL;
    Py_ssize_t n = c->workers[slot].count;
    int64_t *ks = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    double *ts = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(double));
    PyObject *out = NULL;
    if (ks == NULL || ts == NULL) {
        PyErr_NoMemory();
    } else {
        Py_ssize_t m = 0;
        for (int32_t e = c->workers[slot].head; e != NIL && m < n; e = c->entries[e].next) { /* bounded: n */
            ks[m] = c->blocks[c->entries[e].blk].key;
            ts[m++] = c->entries[e].time;
        }
        out = Py_BuildValue("(NN)", bytes_of(ks, m * (Py_ssize_t)sizeof(int64_t)), bytes_of(ts, m * (Py_ssize_t)sizeof(double)));
    }
    PyMem_Free(ks);
    PyMem_Free(ts);
    return out;
}

/* pending() -> (keys buffered, keys dropped by the bound) */
static PyObject *Core_pending(Core *c, PyObject *Py_UNUSED(ignored)) {
    Repl *r = need_repl(c);
    return r == NULL ? NULL : Py_BuildValue("(nn)", r->pending, r->dropped);
}

static PyObject *Core_set_name(Core *c, PyObject *args) {
    PyObject *slot_o, *name;
    int slot;
    if (!PyArg_ParseTuple(args, "OO:set_name", &slot_o, &name) || get_slot(slot_o, &slot) < 0) return NULL;
    Py_INCREF(name);
    if (PyList_SetItem(c->names, slot, name) < 0) return NULL; /* steals the reference */
    Py_RETURN_NONE;
}

static PyObject *Core_live(Core *c, PyObject *Py_UNUSED(ignored)) { return PyLong_FromSsize_t(c->live); }

static PyObject *Core_nbytes(Core *c, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t n = c->tsize * (Py_ssize_t)sizeof(Slot) + c->bcap * (Py_ssize_t)sizeof(Block) +
                   c->ecap * (Py_ssize_t)sizeof(Entry);
    const Repl *r = c->repl;
    if (r != NULL) {
        n += (Py_ssize_t)sizeof(Repl) + r->dg_cap * (Py_ssize_t)sizeof(DeltaGroup) + r->dk_cap * (Py_ssize_t)sizeof(int64_t);
        for (int s = 0; s < MAX_SLOTS; s++) n += r->buckets[s].size * (Py_ssize_t)sizeof(Bucket);
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args; (void)kwargs;
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (c == NULL) return NULL;
    c->names = PyList_New(MAX_SLOTS);
    if (c->names == NULL || table_alloc(c, 1024) < 0) { Py_DECREF(c); return NULL; }
    for (int s = 0; s < MAX_SLOTS; s++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(c->names, s, Py_None);
        c->workers[s].head = c->workers[s].tail = NIL;
        c->workers[s].cap = 1;
    }
    c->bfree = c->efree = NIL;
    return (PyObject *)c;
}

static int Core_init(Core *c, PyObject *args, PyObject *kwargs) {
    Py_ssize_t cap;
    static char *kwlist[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:Core", kwlist, &cap)) return -1;
    if (c->live || c->etop) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialised once");
        return -1;
    }
    for (int s = 0; s < MAX_SLOTS; s++) c->workers[s].cap = cap < 1 ? 1 : cap;
    return 0;
}

static void Core_dealloc(Core *c) {
    PyMem_Free(c->table);
    PyMem_Free(c->blocks);
    PyMem_Free(c->entries);
    PyMem_Free(c->named);
    if (c->repl != NULL) {
        for (int s = 0; s < MAX_SLOTS; s++) PyMem_Free(c->repl->buckets[s].cells);
        PyMem_Free(c->repl->dg);
        PyMem_Free(c->repl->dk);
        PyMem_Free(c->repl);
    }
    Py_XDECREF(c->names);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"match", (PyCFunction)Core_match, METH_O, "match(hs) -> {worker: leading blocks held}"},
    {"match_ids", (PyCFunction)Core_match_ids, METH_O, "match_ids(ids) -> match(block_hashes(ids)), names kept"},
    {"insert_named", (PyCFunction)Core_insert_named, METH_VARARGS, "insert_named(slot, now): the last match_ids"},
    {"insert", (PyCFunction)Core_insert, METH_VARARGS, "insert(hs, slot, now, gossip=True) -> blocks evicted"},
    {"merge", (PyCFunction)Core_merge, METH_VARARGS, "merge(slot, hs, times) -> entries added"},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, "remove(hs, slot) -> entries removed"},
    {"clear", (PyCFunction)Core_clear, METH_O, "clear(slot) -> entries removed"},
    {"set_capacity", (PyCFunction)Core_set_capacity, METH_VARARGS, "set_capacity(slot, blocks) -> evicted"},
    {"expire", (PyCFunction)Core_expire, METH_VARARGS, "expire(slot, cutoff, budget) -> dropped"},
    {"holders", (PyCFunction)Core_holders, METH_O, "holders(block) -> mask of slots"},
    {"last_access", (PyCFunction)Core_last_access, METH_VARARGS, "last_access(block, slot) -> time or None"},
    {"count", (PyCFunction)Core_count, METH_O, "count(slot) -> blocks held"},
    {"export", (PyCFunction)Core_export, METH_O, "export(since or None) -> {(block, worker): time}"},
    {"set_name", (PyCFunction)Core_set_name, METH_VARARGS, "set_name(slot, name or None)"},
    {"replicate", (PyCFunction)Core_replicate, METH_VARARGS, "replicate(granularity, max_pending, relay, refresh)"},
    {"set_quiet", (PyCFunction)Core_set_quiet, METH_VARARGS, "set_quiet(slot, quiet)"},
    {"digest", (PyCFunction)Core_digest, METH_O, "digest(recompute) -> {slot: {time slot: (count, sum)}}"},
    {"take", (PyCFunction)Core_take, METH_O, "take(limit) -> [(slot, time or None, keys, times or None)]"},
    {"queue", (PyCFunction)Core_queue, METH_VARARGS, "queue(slot, hs): buffered at the times held"},
    {"entries", (PyCFunction)Core_entries, METH_O, "entries(slot) -> (keys bytes, times bytes)"},
    {"pending", (PyCFunction)Core_pending, METH_NOARGS, "pending() -> (buffered, dropped)"},
    {"live", (PyCFunction)Core_live, METH_NOARGS, "live() -> blocks held by anyone"},
    {"nbytes", (PyCFunction)Core_nbytes, METH_NOARGS, "nbytes() -> bytes of the arrays"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shepherd.policies._prefixcore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block name -> holders with a last access per (block, worker), exact LRU per worker.",
    .tp_new = Core_new,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

/* -- turn ends: sparse replication (``prefix_replica_native``, README "Mesh at scale") -------------------
 *
 * A routing decision's prompt is named by the chain name of its last full block (``block_hashes`` chains,
 * so that name determines every block before it). Instead of the blocks, a replica in sparse mode sends
 * one record per decision, (end name, worker, blocks), and the receivers keep the records in ``Turns``:
 * two generations of an open-addressing table (linear probing, no deletion: a generation is dropped whole
 * when the next one fills to half the bound or spans half the retention, so records are kept between
 * half and all of ``max_records`` / ``span``; 8 bytes a cell, load <= 1/2). A cell keeps a 32-bit
 * fingerprint of the name (the low bits of its mix, which also place it: a table grows by them), so a
 * lookup takes a record of another name with odds 2**-32 per cell compared, and only at its own depth.
 * ``combine`` adds them to a match: for each block i of the prompt, a record (name_i, worker, i + 1)
 * means the worker holds the first i + 1 blocks; the worker's match is the longer of the index's walk
 * and that. */
#define TURN_DEAD 0xFF /* a cell whose worker was cleared (kept: the probe runs stay intact) */
#define TURN_MAX_N 65535u /* a record's blocks fit 16 bits on the wire: a longer prompt's 65,535th block */

typedef struct {
    uint32_t fp;  /* (uint32_t)place(name): its fingerprint and its place */
    uint16_t n;   /* 0: an empty cell */
    uint8_t slot; /* TURN_DEAD: its worker was cleared */
    uint8_t pad;
} TurnCell;

typedef struct {
    TurnCell *cells;
    Py_ssize_t size, used; /* size a power of 2 (or 0) */
    double first, last;    /* times of the records put (first: NaN when empty) */
} TurnGen;

typedef struct {
    int64_t key;
    double time;
    uint32_t n;
    uint8_t slot;
} TurnRec;

typedef struct {
    PyObject_HEAD
    TurnGen gen[2]; /* [0]: the records put now, [1]: the generation before */
    Py_ssize_t max_records;
    double span;
    uint8_t send[MAX_SLOTS]; /* per slot: its routing decisions are buffered as turn ends */
    TurnRec *buf;             /* turn ends of local decisions, not yet taken */
    Py_ssize_t blen, bcap, bmax, dropped;
} Turns;

static void turngen_free(TurnGen *g) {
    PyMem_Free(g->cells);
    g->cells = NULL;
    g->size = g->used = 0;
    g->first = g->last = 0.0;
}

static int turngen_grow(TurnGen *g, Py_ssize_t size) {
    TurnCell *t = PyMem_Calloc((size_t)size, sizeof(TurnCell));
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t m = (uint64_t)size - 1;
    for (Py_ssize_t i = 0; i < g->size; i++) {
        if (!g->cells[i].n) continue;
        uint64_t j = g->cells[i].fp & m;
        while (t[j].n) j = (j + 1) & m;
        t[j] = g->cells[i];
    }
    PyMem_Free(g->cells);
    g->cells = t;
    g->size = size;
    return 0;
}

/* put one record in generation g (a cell of the same key and slot is overwritten); 1 if new */
static int turngen_put(TurnGen *g, int64_t key, uint16_t n, uint8_t slot) {
    uint64_t m = (uint64_t)g->size - 1;
    uint32_t fp = (uint32_t)place(key);
    uint64_t j = fp & m;
    while (g->cells[j].n) { /* bounded: load <= 1/2 */
        if (g->cells[j].fp == fp && g->cells[j].slot == slot) {
            g->cells[j].n = n;
            return 0;
        }
        j = (j + 1) & m;
    }
    g->cells[j].fp = fp;
    g->cells[j].n = n;
    g->cells[j].slot = slot;
    g->used++;
    return 1;
}

static int turns_put(Turns *t, int64_t key, uint16_t n, uint8_t slot, double time) {
    TurnGen *g = &t->gen[0];
    if (g->used && (g->used * 2 >= t->max_records || (t->span > 0 && time - g->first >= t->span / 2))) { /* rotate */
        turngen_free(&t->gen[1]);
        t->gen[1] = *g;
        memset(g, 0, sizeof(*g));
    }
    if ((g->used + 1) * 2 > g->size && turngen_grow(g, g->size ? g->size * 2 : 1024) < 0) return -1;
    if (!g->used) g->first = g->last = time;
    if (time > g->last) g->last = time;
    if (time < g->first) g->first = time;
    turngen_put(g, key, n, slot);
    return 0;
}

/* per slot, the longest run keys[:i + 1] some record names (best[slot], 0: none) */
static void turns_lookup(const Turns *t, const int64_t *keys, const uint8_t *bad, Py_ssize_t n, uint32_t *best) {
    for (int k = 0; k < 2; k++) {
        const TurnGen *g = &t->gen[k];
        if (!g->used) continue;
        uint64_t m = (uint64_t)g->size - 1;
        Py_ssize_t i;
        Py_ssize_t top = n < (Py_ssize_t)TURN_MAX_N ? n : (Py_ssize_t)TURN_MAX_N; /* deeper: no record */
        for (i = 0; i < top; i++) __builtin_prefetch(&g->cells[(uint32_t)place(keys[i]) & m]); /* misses overlap */
        for (i = 0; i < top; i++) {
            if (bad != NULL && bad[i]) continue;
            uint32_t fp = (uint32_t)place(keys[i]);
            for (uint64_t j = fp & m; g->cells[j].n; j = (j + 1) & m) { /* bounded: load <= 1/2 */
                const TurnCell *x = &g->cells[j];
                if (x->fp == fp && x->n == (uint32_t)(i + 1) && x->slot != TURN_DEAD && x->n > best[x->slot])
                    best[x->slot] = x->n;
            }
        }
    }
}

static PyObject *Turns_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args; (void)kwargs;
    return type->tp_alloc(type, 0);
}

/* Turns(max_records, span, max_pending) */
static int Turns_init(Turns *t, PyObject *args, PyObject *kwargs) {
    Py_ssize_t max_records, max_pending;
    double span;
    static char *kwlist[] = {"max_records", "span", "max_pending", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ndn:Turns", kwlist, &max_records, &span, &max_pending))
        return -1;
    t->max_records = max_records < 2 ? 2 : max_records;
    t->span = span > 0 ? span : 0.0;
    t->bmax = max_pending < 1 ? 1 : max_pending;
    return 0;
}

static void Turns_dealloc(Turns *t) {
    turngen_free(&t->gen[0]);
    turngen_free(&t->gen[1]);
    PyMem_Free(t->buf);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* set_send(slot, on): the worker's routing decisions are buffered as turn ends (``note_named``) */
static PyObject *Turns_set_send(Turns *t, PyObject *args) {
    PyObject *slot_o;
    int slot, on;
    if (!PyArg_ParseTuple(args, "Op:set_send", &slot_o, &on) || get_slot(slot_o, &slot) < 0) return NULL;
    t->send[slot] = (uint8_t)on;
    Py_RETURN_NONE;
}

static int turns_note(Turns *t, int slot, int64_t key, Py_ssize_t n, double now) {
    if (!t->send[slot] || n < 1) return 0;
    if (t->blen >= t->bmax) { /* not taken for a long while: the newest are dropped (counted) */
        t->dropped++;
        return 0;
    }
    if (t->blen == t->bcap && grow((void **)&t->buf, &t->bcap, t->blen + 1, sizeof(TurnRec), "turn ends") < 0)
        return -1;
    TurnRec *r = &t->buf[t->blen++];
    r->key = key;
    r->n = (uint32_t)n;
    r->slot = (uint8_t)slot;
    r->time = now;
    return 1;
}

/* note_named(core, slot, now) -> bool: buffer the turn end of the chain core's last match_ids named (the
 * worker's capacity applied, as insert_named does) */
static PyObject *Turns_note_named(Turns *t, PyObject *args) {
    PyObject *core_o, *slot_o;
    double now;
    int slot;
    if (!PyArg_ParseTuple(args, "O!Od:note_named", &CoreType, &core_o, &slot_o, &now) || get_slot(slot_o, &slot) < 0)
        return NULL;
    const Core *c = (const Core *)core_o;
    Py_ssize_t n = c->nnamed;
    if (n > c->workers[slot].cap) n = c->workers[slot].cap;
    if (n > (Py_ssize_t)TURN_MAX_N) n = TURN_MAX_N;
    int r = n < 1 ? 0 : turns_note(t, slot, c->named[n - 1], n, now);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

/* note(slot, key, n, now) -> bool: buffer a turn end given by its name (n <= 65,535) */
static PyObject *Turns_note(Turns *t, PyObject *args) {
    PyObject *slot_o, *key_o;
    Py_ssize_t n;
    double now;
    int slot;
    int64_t key;
    if (!PyArg_ParseTuple(args, "OOnd:note", &slot_o, &key_o, &n, &now) || get_slot(slot_o, &slot) < 0 ||
        key_of(key_o, &key) < 0)
        return NULL;
    if (n > (Py_ssize_t)TURN_MAX_N) {
        PyErr_SetString(PyExc_ValueError, "a turn end names at most 65,535 blocks");
        return NULL;
    }
    int r = turns_note(t, slot, key, n, now);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

/* take() -> (keys int64 bytes, blocks uint16 bytes, slots uint8 bytes, times float64 bytes), oldest first */
static PyObject *Turns_take(Turns *t, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t n = t->blen;
    PyObject *kb = PyBytes_FromStringAndSize(NULL, n * 8), *nb = PyBytes_FromStringAndSize(NULL, n * 2);
    PyObject *sb = PyBytes_FromStringAndSize(NULL, n), *tb = PyBytes_FromStringAndSize(NULL, n * 8);
    if (kb == NULL || nb == NULL || sb == NULL || tb == NULL) goto fail;
    int64_t *k = (int64_t *)PyBytes_AS_STRING(kb);
    uint16_t *nn = (uint16_t *)PyBytes_AS_STRING(nb);
    uint8_t *s = (uint8_t *)PyBytes_AS_STRING(sb);
    double *tt = (double *)PyBytes_AS_STRING(tb);
    for (Py_ssize_t i = 0; i < n; i++) {
        k[i] = t->buf[i].key;
        nn[i] = (uint16_t)t->buf[i].n;
        s[i] = t->buf[i].slot;
        tt[i] = t->buf[i].time;
    }
    t->blen = 0;
    return Py_BuildValue("(NNNN)", kb, nb, sb, tb);
fail:
    Py_XDECREF(kb);
    Py_XDECREF(nb);
    Py_XDECREF(sb);
    Py_XDECREF(tb);
    return NULL;
}

/* put(keys, blocks, slots, time) -> records kept: received turn ends (keys int64 bytes, blocks uint16 bytes,
 * slots uint8 bytes in this index's slots, TURN_DEAD: skipped), all at ``time`` */
static PyObject *Turns_put(Turns *t, PyObject *args) {
    Py_buffer kv, nv, sv;
    double time;
    if (!PyArg_ParseTuple(args, "y*y*y*d:put", &kv, &nv, &sv, &time)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = sv.len, kept = 0;
    if (kv.len != n * 8 || nv.len != n * 2) {
        PyErr_SetString(PyExc_ValueError, "turn ends: keys, blocks and slots differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t key;
        uint16_t nb;
        memcpy(&key, (const char *)kv.buf + i * 8, 8);
        memcpy(&nb, (const char *)nv.buf + i * 2, 2);
        uint8_t slot = ((const uint8_t *)sv.buf)[i];
        if (nb == 0 || slot >= MAX_SLOTS) continue;
        if (turns_put(t, key, nb, slot, time) < 0) goto done;
        kept++;
    }
    out = PyLong_FromSsize_t(kept);
done:
    PyBuffer_Release(&kv);
    PyBuffer_Release(&nv);
    PyBuffer_Release(&sv);
    return out;
}

/* combine(core, matched, hs=None) -> workers improved: raise matched[worker] (leading blocks) to the longest
 * turn end of the chain hs (None: the chain core's last match_ids named) that names the worker */
static PyObject *Turns_combine(Turns *t, PyObject *args) {
    PyObject *core_o, *out, *hs = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!|O:combine", &CoreType, &core_o, &PyDict_Type, &out, &hs)) return NULL;
    const Core *c = (const Core *)core_o;
    if (!t->gen[0].used && !t->gen[1].used) return PyLong_FromLong(0);
    const int64_t *keys = c->named;
    Py_ssize_t n = c->nnamed;
    int64_t *own = NULL;
    uint8_t *bad = NULL;
    if (hs != Py_None) {
        if ((own = keys_of(hs, &n, &bad)) == NULL) return NULL;
        keys = own;
    }
    uint32_t best[MAX_SLOTS] = {0};
    turns_lookup(t, keys, bad, n, best);
    PyMem_Free(own);
    PyMem_Free(bad);
    long improved = 0;
    for (int s = 0; s < MAX_SLOTS; s++) {
        if (!best[s]) continue;
        PyObject *name = PyList_GET_ITEM(c->names, s);
        if (name == Py_None) continue;
        Py_INCREF(name); /* held: its hash or the dict's values may run Python code that sets another name */
        PyObject *have = PyDict_GetItemWithError(out, name);
        Py_XINCREF(have);
        long long h = -1;
        if (have != NULL) h = PyLong_AsLongLong(have);
        Py_XDECREF(have);
        if (PyErr_Occurred()) {
            Py_DECREF(name);
            return NULL;
        }
        if (have != NULL && h >= (long long)best[s]) {
            Py_DECREF(name);
            continue;
        }
        PyObject *v = PyLong_FromUnsignedLong(best[s]);
        int r = v == NULL ? -1 : PyDict_SetItem(out, name, v);
        Py_DECREF(name);
        Py_XDECREF(v);
        if (r < 0) return NULL;
        improved++;
    }
    return PyLong_FromLong(improved);
}

/* clear(slot): the worker's records are no longer matched, its buffered ones not sent (the slot may serve
 * another worker next) */
static PyObject *Turns_clear(Turns *t, PyObject *slot_o) {
    int slot;
    if (get_slot(slot_o, &slot) < 0) return NULL;
    Py_ssize_t n = 0;
    for (int k = 0; k < 2; k++) {
        TurnGen *g = &t->gen[k];
        for (Py_ssize_t i = 0; i < g->size; i++) {
            if (g->cells[i].n && g->cells[i].slot == (uint8_t)slot) {
                g->cells[i].slot = TURN_DEAD;
                n++;
            }
        }
    }
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < t->blen; i++)
        if (t->buf[i].slot != (uint8_t)slot) t->buf[j++] = t->buf[i];
    t->blen = j;
    t->send[slot] = 0;
    return PyLong_FromSsize_t(n);
}

/* expire(cutoff) -> records dropped: the generations whose records are all older than cutoff */
static PyObject *Turns_expire(Turns *t, PyObject *arg) {
    double cutoff = PyFloat_AsDouble(arg);
    if (cutoff == -1.0 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = 0;
    for (int k = 1; k >= 0; k--) {
        TurnGen *g = &t->gen[k];
        if (g->used && g->last < cutoff) {
            n += g->used;
            turngen_free(g);
        }
    }
    return PyLong_FromSsize_t(n);
}

/* stats() -> (records kept, buffered, dropped, bytes of the arrays) */
static PyObject *Turns_stats(Turns *t, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t bytes = (t->gen[0].size + t->gen[1].size) * (Py_ssize_t)sizeof(TurnCell) + t->bcap * (Py_ssize_t)sizeof(TurnRec);
    return Py_BuildValue("(nnnn)", t->gen[0].used + t->gen[1].used, t->blen, t->dropped, bytes);
}

static PyMethodDef Turns_methods[] = {
    {"set_send", (PyCFunction)Turns_set_send, METH_VARARGS, "set_send(slot, on)"},
    {"note_named", (PyCFunction)Turns_note_named, METH_VARARGS, "note_named(core, slot, now) -> buffered"},
    {"note", (PyCFunction)Turns_note, METH_VARARGS, "note(slot, key, blocks, now) -> buffered"},
    {"take", (PyCFunction)Turns_take, METH_NOARGS, "take() -> (keys, blocks, slots, times) bytes"},
    {"put", (PyCFunction)Turns_put, METH_VARARGS, "put(keys, blocks, slots, time) -> records kept"},
    {"combine", (PyCFunction)Turns_combine, METH_VARARGS, "combine(core, matched, hs=None) -> improved"},
    {"clear", (PyCFunction)Turns_clear, METH_O, "clear(slot) -> records dropped"},
    {"expire", (PyCFunction)Turns_expire, METH_O, "expire(cutoff) -> records dropped"},
    {"stats", (PyCFunction)Turns_stats, METH_NOARGS, "stats() -> (kept, buffered, dropped, bytes)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TurnsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shepherd.policies._prefixcore.Turns",
    .tp_basicsize = sizeof(Turns),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Turn ends (end block name -> worker, blocks) for sparse index replication.",
    .tp_new = Turns_new,
    .tp_init = (initproc)Turns_init,
    .tp_dealloc = (destructor)Turns_dealloc,
    .tp_methods = Turns_methods,
};

#include "_prefixcore_kv.h" /* KvMap: an engine's KV events applied from their wire bytes */

/* place_of(name) -> the 64-bit value that places a block name (or a turn record) in its table: keyed
 * per process (a debug view: tests check that names ground to collide do not share their places) */
static PyObject *place_of(PyObject *Py_UNUSED(mod), PyObject *arg) {
    long long key = PyLong_AsLongLong(arg);
    if (key == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(place((int64_t)key));
}

static PyMethodDef module_methods[] = {
    {"place_of", (PyCFunction)place_of, METH_O, "place_of(name) -> the keyed value that places a name in its table"},
    {"block_hashes", (PyCFunction)(void (*)(void))block_hashes, METH_VARARGS | METH_KEYWORDS,
     "block_hashes(ids, seed=CHAIN_SEED, start=0) -> list[int]: chained names of the full 16-token blocks of "
     "ids[start:] (block_names.py_block_hashes at C speed)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_prefixcore",
    "The prefix index in C: block naming (block_hashes) and its state (Core, see native_index.NativePrefixIndex).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__prefixcore(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyType_Ready(&TurnsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&TurnsType);
    if (PyModule_AddObject(m, "Turns", (PyObject *)&TurnsType) < 0) {
        Py_DECREF(&TurnsType);
        Py_DECREF(m);
        return NULL;
    }
    if (kv_seed() < 0) { /* the KvMap's hash key: per process */
        Py_DECREF(m);
        return NULL;
    }
    place_k0 = mix((int64_t)(kv_k0 ^ 0x9e3779b97f4a7c15ULL)); /* the places' key: from the same 16 random bytes */
    place_k1 = mix((int64_t)(kv_k1 + 0x632be59bd9b4e019ULL));
    if (PyType_Ready(&KvMapType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&KvMapType);
    if (PyModule_AddObject(m, "KvMap", (PyObject *)&KvMapType) < 0) {
        Py_DECREF(&KvMapType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
