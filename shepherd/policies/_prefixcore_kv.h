/* Included by _prefixcore.c (after ``CoreType``): an engine's KV events applied in C.
 *
 * ``KvMap`` is ``kv_events.KvEventApplier``'s engine-hash map (engine block hash -> the index's names of
 * its 16-token blocks, one or ``per`` of them) with the same bound (oldest entries first, ``max / 16``
 * at a time past ``max``) and the same order (an insertion-ordered log, as a dict: a stored hash that is
 * already mapped keeps its place), and ``KvMap.apply`` reads the events of one serialized
 * ``smg.grpc.common.KvEventBatch`` (``SubscribeKvEvents``, the bytes as they came off the wire; their
 * structure checked beforehand by ``proto._kvwire.kv_scan``) and applies "stored" and "removed" to the
 * map and the ``Core`` in one call: no protobuf message, no Python int per block or token, no dict.
 * The names are ``block_hashes`` over the event's tokens (chained from the parent's last name), the insert
 * is ``insert_keys`` with ``gossip`` off (an engine's event is never sent: every subscribed node gets it),
 * a removal ``drop_entry``: what ``NativePrefixIndex.store_token_blocks`` and ``remove_blocks`` do. An
 * event it does not take (a "cleared", a block size other than the map's, a first insert before the
 * worker has a slot) is handed back by its byte range, for the Python path; the property tests hold
 * the index state and the map to ``KvEventApplier`` over protobuf's parse on random streams. */

typedef struct {
    int64_t key;
    Py_ssize_t pos; /* in the log; -1: empty */
} KvCell;

/* The map's keys are the engine's block hashes: values a remote peer picks. With a fixed hash (``mix`` is
 * a bijection anyone can invert) an engine, or whatever feeds the KV stream, could send hashes that all
 * land in one probe run and make every lookup scan it (hash flooding: quadratic work per batch). So a
 * cell's place is SipHash-1-3 of the key under a key drawn per process at module init (``kv_seed``, from
 * os.urandom); the map's order (the log's: insertion order) does not depend on it. */
static uint64_t kv_k0, kv_k1;

#define KV_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define KV_SIPROUND                                                                                          \
    do {                                                                                                     \
        v0 += v1;                                                                                            \
        v1 = KV_ROTL(v1, 13);                                                                                \
        v1 ^= v0;                                                                                            \
        v0 = KV_ROTL(v0, 32);                                                                                \
        v2 += v3;                                                                                            \
        v3 = KV_ROTL(v3, 16);                                                                                \
        v3 ^= v2;                                                                                            \
        v0 += v3;                                                                                            \
        v3 = KV_ROTL(v3, 21);                                                                                \
        v3 ^= v0;                                                                                            \
        v2 += v1;                                                                                            \
        v1 = KV_ROTL(v1, 17);                                                                                \
        v1 ^= v2;                                                                                            \
        v2 = KV_ROTL(v2, 32);                                                                                \
    } while (0)

/* SipHash-1-3 of the key's 8 bytes (little-endian) under (kv_k0, kv_k1) */
static inline uint64_t kv_hash(int64_t key) {
    uint64_t m = (uint64_t)key, b = (uint64_t)8 << 56;
    uint64_t v0 = kv_k0 ^ 0x736f6d6570736575ULL, v1 = kv_k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = kv_k0 ^ 0x6c7967656e657261ULL, v3 = kv_k1 ^ 0x7465646279746573ULL;
    v3 ^= m;
    KV_SIPROUND;
    v0 ^= m;
    v3 ^= b;
    KV_SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    KV_SIPROUND;
    KV_SIPROUND;
    KV_SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* the hash key from 16 random bytes (os.urandom), once per process: 0, or -1 with an exception set */
static int kv_seed(void) {
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL) return -1;
    PyObject *r = PyObject_CallMethod(os, "urandom", "i", 16);
    Py_DECREF(os);
    if (r == NULL) return -1;
    if (!PyBytes_Check(r) || PyBytes_GET_SIZE(r) != 16) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_RuntimeError, "os.urandom(16) gave no 16 bytes");
        return -1;
    }
    memcpy(&kv_k0, PyBytes_AS_STRING(r), 8);
    memcpy(&kv_k1, PyBytes_AS_STRING(r) + 8, 8);
    Py_DECREF(r);
    return 0;
}

typedef struct {
    PyObject_HEAD
    int per;            /* index blocks per engine block */
    Py_ssize_t max;     /* entries kept at most */
    KvCell *table;      /* open addressing (linear probing, backward-shift deletion), load <= 1/2 */
    Py_ssize_t tsize;   /* a power of 2 */
    int64_t *lkey;      /* the log, in insertion order: keys, ``per`` names each, dead flags */
    int64_t *lnames;
    uint8_t *ldead;
    Py_ssize_t head, top, lcap, live;
    int64_t *hbuf;      /* scratch: an event's engine hashes, names; token ids */
    Py_ssize_t hcap;
    int64_t *nbuf;
    Py_ssize_t ncap;
    uint32_t *tbuf;
    Py_ssize_t tcap;
    uint64_t probes;    /* cells kv_find stepped past (a debug counter: ``probes()``) */
} KvMap;

static inline Py_ssize_t kv_find(KvMap *m, int64_t key) {
    uint64_t mask = (uint64_t)m->tsize - 1;
    uint64_t j = kv_hash(key) & mask, steps = 0;
    while (m->table[j].pos >= 0 && m->table[j].key != key) {
        j = (j + 1) & mask;
        steps++;
    }
    m->probes += steps;
    return (Py_ssize_t)j;
}

static void kv_cell_delete(KvMap *m, Py_ssize_t i) { /* backward-shift deletion, as table_delete */
    uint64_t mask = (uint64_t)m->tsize - 1;
    uint64_t hole = (uint64_t)i, j = (uint64_t)i;
    m->table[hole].pos = -1;
    for (;;) { /* bounded: the table has empty cells (load <= 1/2) */
        j = (j + 1) & mask;
        if (m->table[j].pos < 0) return;
        uint64_t k = kv_hash(m->table[j].key) & mask;
        int stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
        if (!stays) {
            m->table[hole] = m->table[j];
            m->table[j].pos = -1;
            hole = j;
        }
    }
}

/* the table rebuilt at ``size`` cells from the live log entries */
static int kv_rehash(KvMap *m, Py_ssize_t size) {
    KvCell *t = PyMem_Malloc((size_t)size * sizeof(KvCell));
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++) t[i].pos = -1;
    PyMem_Free(m->table);
    m->table = t;
    m->tsize = size;
    uint64_t mask = (uint64_t)size - 1;
    for (Py_ssize_t p = m->head; p < m->top; p++) {
        if (m->ldead[p]) continue;
        uint64_t j = kv_hash(m->lkey[p]) & mask;
        while (t[j].pos >= 0) j = (j + 1) & mask;
        t[j].key = m->lkey[p];
        t[j].pos = p;
    }
    return 0;
}

/* room for one more log entry (compacting the dead ones out, or growing) and one more live key */
static int kv_room(KvMap *m) {
    if (2 * (m->live + 1) > m->tsize) {
        if (kv_rehash(m, m->tsize ? 2 * m->tsize : 64) < 0) return -1;
    }
    if (m->top < m->lcap) return 0;
    Py_ssize_t used = m->top - m->head;
    if (m->live <= used / 2 && m->lcap >= 64) { /* half or more dead: compact in place */
        Py_ssize_t w = 0;
        for (Py_ssize_t p = m->head; p < m->top; p++) {
            if (m->ldead[p]) continue;
            m->lkey[w] = m->lkey[p];
            memmove(&m->lnames[w * m->per], &m->lnames[p * m->per], (size_t)m->per * sizeof(int64_t));
            m->ldead[w] = 0;
            w++;
        }
        m->head = 0;
        m->top = w;
        return kv_rehash(m, m->tsize);
    }
    Py_ssize_t cap = m->lcap ? 2 * m->lcap : 64;
    int64_t *k = PyMem_Realloc(m->lkey, (size_t)cap * sizeof(int64_t));
    if (k == NULL) goto nomem;
    m->lkey = k;
    int64_t *nm = PyMem_Realloc(m->lnames, (size_t)cap * (size_t)m->per * sizeof(int64_t));
    if (nm == NULL) goto nomem;
    m->lnames = nm;
    uint8_t *d = PyMem_Realloc(m->ldead, (size_t)cap);
    if (d == NULL) goto nomem;
    m->ldead = d;
    m->lcap = cap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* map key -> names (``per`` of them): a new key goes last, a known one keeps its place */
static int kv_put(KvMap *m, int64_t key, const int64_t *names) {
    if (m->tsize) {
        Py_ssize_t i = kv_find(m, key);
        if (m->table[i].pos >= 0) {
            memcpy(&m->lnames[m->table[i].pos * m->per], names, (size_t)m->per * sizeof(int64_t));
            return 0;
        }
    }
    if (kv_room(m) < 0) return -1;
    Py_ssize_t i = kv_find(m, key);
    Py_ssize_t p = m->top++;
    m->lkey[p] = key;
    memcpy(&m->lnames[p * m->per], names, (size_t)m->per * sizeof(int64_t));
    m->ldead[p] = 0;
    m->table[i].key = key;
    m->table[i].pos = p;
    m->live++;
    return 0;
}

/* past the bound: the oldest entries go, ``max / 16`` more than needed (dropping them one at a time from
 * the front of a dict costs a scan of its dead slots each time: KvEventApplier's reason, kept here so
 * both hold the same entries) */
static void kv_bound(KvMap *m) {
    Py_ssize_t over = m->live - m->max;
    if (over <= 0) return;
    Py_ssize_t k = over + m->max / 16;
    while (k > 0 && m->head < m->top) { /* bounded: the log */
        Py_ssize_t p = m->head++;
        if (m->ldead[p]) continue;
        kv_cell_delete(m, kv_find(m, m->lkey[p]));
        m->ldead[p] = 1;
        m->live--;
        k--;
    }
    if (m->live == 0) m->head = m->top = 0;
}

/* the log position of key, -1 when absent */
static inline Py_ssize_t kv_get(KvMap *m, int64_t key) {
    return m->tsize ? m->table[kv_find(m, key)].pos : -1;
}

/* key taken out; its position (its names stay readable until the next put), -1 when absent */
static Py_ssize_t kv_pop(KvMap *m, int64_t key) {
    if (!m->tsize) return -1;
    Py_ssize_t i = kv_find(m, key);
    Py_ssize_t p = m->table[i].pos;
    if (p < 0) return -1;
    kv_cell_delete(m, i);
    m->ldead[p] = 1;
    m->live--;
    while (m->head < m->top && m->ldead[m->head]) m->head++; /* bounded: the log */
    if (m->live == 0) m->head = m->top = 0;
    return p;
}

static void kv_clear(KvMap *m) {
    for (Py_ssize_t i = 0; i < m->tsize; i++) m->table[i].pos = -1;
    m->head = m->top = m->live = 0;
}

static int kv_scratch(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t size) {
    if (need <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    void *b = PyMem_Realloc(*buf, (size_t)c * size);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = b;
    *cap = c;
    return 0;
}

/* the names of the full 16-token blocks of tok[0:n] chained from seed_hash (name_blocks over token ids
 * that are uint32s: each is its own hash) */
static void name_tokens(const uint32_t *tok, Py_ssize_t n, Py_hash_t seed_hash, int64_t *out) {
    Py_hash_t h = seed_hash;
    Py_ssize_t blocks = n / BLOCK;
    for (Py_ssize_t b = 0; b < blocks; b++, tok += BLOCK) {
        Py_uhash_t acc = XXPRIME_5;
        for (int i = 0; i < BLOCK; i++) acc = lane(acc, (Py_uhash_t)tok[i]);
        Py_hash_t inner = finish(acc, BLOCK);
        Py_uhash_t pair = lane(XXPRIME_5, (Py_uhash_t)(b == 0 ? h : int_hash(h)));
        pair = lane(pair, (Py_uhash_t)inner);
        h = finish(pair, 2);
        out[b] = (int64_t)h;
    }
}

/* -- the wire (protobuf): what kv_scan checked is read again here, the fields applied ----------------- */
#include "../proto/_pbwire.h"


#define KW_TAG(p, end, field, wt)                                                                            \
    uint64_t tag_;                                                                                           \
    if (pb_varint(&(p), (end), &tag_) < 0) goto bad;                                                         \
    int field = (int)(tag_ >> 3), wt = (int)(tag_ & 7);

/* the blocks of a KvBlocksStored into the map's scratch: engine hashes (hbuf), token ids (tbuf); also the
 * event's block size (the first block's, else its token count) and its parent and locality */
typedef struct {
    Py_ssize_t nb, nt;
    int32_t block_size;
    int has_parent, remote;
    int64_t parent;
} KvStored;

static int kw_stored(KvMap *m, const uint8_t *p, const uint8_t *end, KvStored *s) {
    s->nb = s->nt = 0;
    s->block_size = 0;
    s->has_parent = s->remote = 0;
    s->parent = 0;
    int32_t locality = 0;
    int has_locality = 0;
    while (p < end) {
        KW_TAG(p, end, field, wt)
        const uint8_t *lo = NULL, *hi = NULL;
        uint64_t v;
        if (field == 2 && wt == 0) {
            if (pb_varint(&p, end, &v) < 0) goto bad;
            s->has_parent = 1;
            s->parent = (int64_t)v;
        } else if (field == 8 && wt == 0) {
            if (pb_varint(&p, end, &v) < 0) goto bad;
            has_locality = 1;
            locality = (int32_t)v;
        } else if (field == 1 && wt == 2) { /* a KvBlock */
            if (pb_skip(&p, end, wt, &lo, &hi) < 0) goto bad;
            if (kv_scratch((void **)&m->hbuf, &m->hcap, s->nb + 1, sizeof(int64_t)) < 0) return -1;
            int64_t hash = 0;
            int32_t bsize = 0;
            Py_ssize_t ntok = 0;
            const uint8_t *q = lo;
            while (q < hi) {
                KW_TAG(q, hi, bf, bwt)
                if (bf == 1 && bwt == 0) {
                    if (pb_varint(&q, hi, &v) < 0) goto bad;
                    hash = (int64_t)v;
                } else if (bf == 3 && bwt == 0) {
                    if (pb_varint(&q, hi, &v) < 0) goto bad;
                    bsize = (int32_t)v;
                } else if (bf == 2 && (bwt == 0 || bwt == 2)) {
                    const uint8_t *a = q, *b = NULL;
                    if (bwt == 2) {
                        if (pb_skip(&q, hi, 2, &a, &b) < 0) goto bad;
                    } else {
                        b = hi;
                    }
                    /* at most one token per byte */
                    if (kv_scratch((void **)&m->tbuf, &m->tcap, s->nt + (b - a), sizeof(uint32_t)) < 0) return -1;
                    /* packed: every varint of [a, b), none when empty (protobuf takes an empty packed
                     * field); unpacked: the one */
                    for (int once = 1; bwt == 2 ? a < b : once; once = 0) {
                        if (pb_varint(&a, b, &v) < 0) goto bad;
                        m->tbuf[s->nt++] = (uint32_t)v;
                        ntok++;
                    }
                    if (bwt == 0) q = a;
                } else {
                    const uint8_t *x = NULL, *y = NULL;
                    if (pb_skip(&q, hi, bwt, &x, &y) < 0) goto bad;
                }
            }
            if (s->nb == 0) s->block_size = bsize ? bsize : (int32_t)ntok;
            m->hbuf[s->nb++] = hash;
        } else if (pb_skip(&p, end, wt, &lo, &hi) < 0) {
            goto bad;
        }
    }
    s->remote = has_locality && locality == 2; /* KV_CACHE_LOCALITY_REMOTE: a shared pool's, not the worker's */
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "malformed KvBlocksStored");
    return -1;
}

static PyTypeObject KvMapType;

/* apply(core, raw, start, slot, now) -> (stop_lo, stop_hi, events, stored_blocks, removed_blocks,
 * unknown_parent): the events of raw (a KvEventBatch) from byte ``start`` applied to this map and to
 * ``core``'s ``slot`` (-1: the worker has none yet) at ``now``; stop_lo < 0 when all were, else the event
 * in raw[stop_lo:stop_hi] is left to the caller (it resumes at stop_hi). Counts as WorkerKvState's. */
static PyObject *KvMap_apply(KvMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyObject_TypeCheck(args[0], &CoreType) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "apply(core, raw: bytes, start, slot, now)");
        return NULL;
    }
    Core *c = (Core *)args[0];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    long slot = PyLong_AsLong(args[3]);
    double now = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (slot >= MAX_SLOTS || slot < -1) {
        PyErr_SetString(PyExc_ValueError, "worker slot out of range");
        return NULL;
    }
    const uint8_t *buf = (const uint8_t *)PyBytes_AS_STRING(args[1]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[1]);
    if (start < 0 || start > size) {
        PyErr_SetString(PyExc_ValueError, "start out of range");
        return NULL;
    }
    const uint8_t *p = buf + start, *end = buf + size;
    Py_ssize_t events = 0, stored = 0, removed = 0, unknown = 0, stop_lo = -1, stop_hi = -1;
    int per = m->per;
    while (p < end) {
        KW_TAG(p, end, field, wt)
        const uint8_t *lo = NULL, *hi = NULL;
        if (pb_skip(&p, end, wt, &lo, &hi) < 0) goto bad;
        if (field != 3 || wt != 2) continue;
        /* a KvCacheEvent in [lo, hi): its one data field (kv_scan refused batches with more) */
        const uint8_t *q = lo, *dlo = NULL, *dhi = NULL;
        int kind = 0;
        while (q < hi) {
            KW_TAG(q, hi, ef, ewt)
            const uint8_t *a = NULL, *b = NULL;
            if (pb_skip(&q, hi, ewt, &a, &b) < 0) goto bad;
            if (ewt == 2 && ef >= 2 && ef <= 4) {
                kind = ef;
                dlo = a;
                dhi = b;
            }
        }
        if (kind == 2) { /* stored */
            KvStored s;
            if (kw_stored(m, dlo, dhi, &s) < 0) return NULL;
            if (s.remote) continue;
            if (s.block_size != per * BLOCK) goto hand_back; /* another applier's (or none): Python's */
            Py_hash_t seed = CHAIN_SEED_HASH;
            if (s.has_parent) {
                Py_ssize_t pp = kv_get(m, s.parent);
                if (pp < 0) {
                    events++;
                    unknown++;
                    continue;
                }
                seed = int_hash((Py_hash_t)m->lnames[pp * per + per - 1]);
            }
            Py_ssize_t nn = s.nt / BLOCK;
            if (nn > 0 && slot < 0) goto hand_back; /* the worker's first slot is given in Python */
            if (kv_scratch((void **)&m->nbuf, &m->ncap, nn + per, sizeof(int64_t)) < 0) return NULL;
            name_tokens(m->tbuf, s.nt, seed, m->nbuf);
            events++;
            if (nn > 0 && insert_keys(c, m->nbuf, nn, (int)slot, now, 0) < 0) return NULL;
            Py_ssize_t k = nn / per < s.nb ? nn / per : s.nb;
            for (Py_ssize_t i = 0; i < k; i++)
                if (kv_put(m, m->hbuf[i], &m->nbuf[i * per]) < 0) return NULL;
            kv_bound(m);
            stored += s.nb;
        } else if (kind == 3) { /* removed */
            const uint8_t *r = dlo;
            int32_t locality = 0;
            int has_locality = 0;
            while (r < dhi) { /* the locality first: a remote event is not applied */
                KW_TAG(r, dhi, rf, rwt)
                const uint8_t *a = NULL, *b = NULL;
                uint64_t v;
                if (rf == 6 && rwt == 0) {
                    if (pb_varint(&r, dhi, &v) < 0) goto bad;
                    has_locality = 1;
                    locality = (int32_t)v;
                } else if (pb_skip(&r, dhi, rwt, &a, &b) < 0) {
                    goto bad;
                }
            }
            if (has_locality && locality == 2) continue;
            events++;
            r = dlo;
            while (r < dhi) {
                KW_TAG(r, dhi, rf, rwt)
                const uint8_t *a = NULL, *b = NULL;
                uint64_t v;
                if (rf == 1 && (rwt == 0 || rwt == 2)) {
                    if (rwt == 2) {
                        if (pb_skip(&r, dhi, 2, &a, &b) < 0) goto bad;
                    } else {
                        a = r;
                        b = dhi;
                    }
                    for (int once = 1; rwt == 2 ? a < b : once; once = 0) { /* as the token ids */
                        if (pb_varint(&a, b, &v) < 0) goto bad;
                        removed++;
                        Py_ssize_t pos = kv_pop(m, (int64_t)v);
                        if (pos < 0 || slot < 0) continue;
                        for (int j = 0; j < per; j++) {
                            int32_t blk = find_block(c, m->lnames[pos * per + j]);
                            int32_t e = blk == NIL ? NIL : find_entry(c, blk, (int)slot);
                            if (e != NIL) drop_entry(c, e);
                        }
                    }
                    if (rwt == 0) r = a;
                } else if (pb_skip(&r, dhi, rwt, &a, &b) < 0) {
                    goto bad;
                }
            }
        } else if (kind == 4) { /* cleared: the worker's slot is freed in Python */
            goto hand_back;
        }
        continue;
    hand_back:
        stop_lo = lo - buf;
        stop_hi = hi - buf;
        break;
    }
    return Py_BuildValue("(nnnnnn)", stop_lo, stop_hi, events, stored, removed, unknown);
bad:
    PyErr_SetString(PyExc_ValueError, "malformed KvEventBatch");
    return NULL;
}

/* -- the map's own methods (the Python path's: ``NativeKvApplier``'s per-event calls) ----------------- */

static int kv_key(PyObject *o, int64_t *key) { /* 0, 1: outside 64 bits (never mapped), -1: error */
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow) return 1;
    *key = (int64_t)v;
    return 0;
}

/* seed(parent) -> the index's name of the parent's last block, or None when it is not mapped */
static PyObject *KvMap_seed(KvMap *m, PyObject *parent) {
    int64_t key;
    int r = kv_key(parent, &key);
    if (r < 0) return NULL;
    Py_ssize_t p = r ? -1 : kv_get(m, key);
    if (p < 0) Py_RETURN_NONE;
    return PyLong_FromLongLong(m->lnames[p * m->per + m->per - 1]);
}

/* put(engine_hashes, names): engine block i -> names[i*per:(i+1)*per] for the whole groups, then the bound */
static PyObject *KvMap_put(KvMap *m, PyObject *args) {
    PyObject *hs_o, *names_o;
    if (!PyArg_ParseTuple(args, "OO:put", &hs_o, &names_o)) return NULL;
    PyObject *hs = as_stable(hs_o, "engine hashes must be a sequence", 0);
    if (hs == NULL) return NULL;
    Py_ssize_t nn;
    int64_t *names = keys_of(names_o, &nn, NULL);
    if (names == NULL) {
        Py_DECREF(hs);
        return NULL;
    }
    Py_ssize_t nh = PySequence_Fast_GET_SIZE(hs);
    Py_ssize_t k = nn / m->per < nh ? nn / m->per : nh;
    int ok = 0;
    for (Py_ssize_t i = 0; i < k && ok == 0; i++) {
        int64_t key;
        int r = kv_key(PySequence_Fast_GET_ITEM(hs, i), &key);
        if (r == 1) {
            PyErr_SetString(PyExc_OverflowError, "engine block hash outside 64 bits");
            r = -1;
        }
        ok = r < 0 ? -1 : kv_put(m, key, &names[i * m->per]);
    }
    PyMem_Free(names);
    Py_DECREF(hs);
    if (ok < 0) return NULL;
    kv_bound(m);
    Py_RETURN_NONE;
}

/* pop(engine_hashes) -> the names of those mapped (in order), taken out of the map */
static PyObject *KvMap_pop(KvMap *m, PyObject *hs_o) {
    PyObject *hs = as_stable(hs_o, "engine hashes must be a sequence", 0);
    if (hs == NULL) return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < PySequence_Fast_GET_SIZE(hs); i++) {
        int64_t key;
        int r = kv_key(PySequence_Fast_GET_ITEM(hs, i), &key);
        if (r < 0) {
            Py_CLEAR(out);
            break;
        }
        Py_ssize_t p = r ? -1 : kv_pop(m, key);
        for (int j = 0; p >= 0 && j < m->per; j++) {
            PyObject *v = PyLong_FromLongLong(m->lnames[p * m->per + j]);
            if (v == NULL || PyList_Append(out, v) < 0) {
                Py_XDECREF(v);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(v);
        }
    }
    Py_DECREF(hs);
    return out;
}

static PyObject *KvMap_clear(KvMap *m, PyObject *Py_UNUSED(ignored)) {
    kv_clear(m);
    Py_RETURN_NONE;
}

/* keys() -> the mapped engine hashes in the map's order (oldest first) */
static PyObject *KvMap_keys(KvMap *m, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    for (Py_ssize_t p = m->head; out != NULL && p < m->top; p++) {
        if (m->ldead[p]) continue;
        PyObject *v = PyLong_FromLongLong(m->lkey[p]);
        if (v == NULL || PyList_Append(out, v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

static Py_ssize_t KvMap_len(KvMap *m) { return m->live; }

/* probes() -> the cells lookups stepped past so far (a debug counter: colliding keys make it quadratic) */
static PyObject *KvMap_probes(KvMap *m, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(m->probes);
}

/* a map made without __init__ is an empty one of 1 index block per engine block (never a 0 divisor) */
static PyObject *KvMap_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    KvMap *m = (KvMap *)type->tp_alloc(type, 0);
    if (m != NULL) {
        m->per = 1;
        m->max = 1;
    }
    return (PyObject *)m;
}

static int KvMap_init(KvMap *m, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"per_block", "max_blocks", NULL};
    int per;
    Py_ssize_t max;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "in:KvMap", kwlist, &per, &max)) return -1;
    if (per < 1 || max < 1) {
        PyErr_SetString(PyExc_ValueError, "per_block and max_blocks must be >= 1");
        return -1;
    }
    if (m->lcap && per != m->per) {
        PyErr_SetString(PyExc_ValueError, "KvMap already initialized");
        return -1;
    }
    m->per = per;
    m->max = max;
    kv_clear(m);
    return 0;
}

static void KvMap_dealloc(KvMap *m) {
    PyMem_Free(m->table);
    PyMem_Free(m->lkey);
    PyMem_Free(m->lnames);
    PyMem_Free(m->ldead);
    PyMem_Free(m->hbuf);
    PyMem_Free(m->nbuf);
    PyMem_Free(m->tbuf);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMethodDef KvMap_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))KvMap_apply, METH_FASTCALL,
     "apply(core, raw, start, slot, now) -> (stop_lo, stop_hi, events, stored_blocks, removed_blocks, "
     "unknown_parent)"},
    {"seed", (PyCFunction)KvMap_seed, METH_O, "seed(parent) -> name of its last index block, or None"},
    {"put", (PyCFunction)KvMap_put, METH_VARARGS, "put(engine_hashes, names)"},
    {"pop", (PyCFunction)KvMap_pop, METH_O, "pop(engine_hashes) -> names"},
    {"clear", (PyCFunction)KvMap_clear, METH_NOARGS, "clear()"},
    {"keys", (PyCFunction)KvMap_keys, METH_NOARGS, "keys() -> engine hashes, oldest first"},
    {"probes", (PyCFunction)KvMap_probes, METH_NOARGS, "probes() -> cells stepped past by lookups (debug)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KvMap_as_sequence = {.sq_length = (lenfunc)KvMap_len};

static PyTypeObject KvMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shepherd.policies._prefixcore.KvMap",
    .tp_basicsize = sizeof(KvMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An engine's block hashes -> the index's names (kv_events.NativeKvApplier), bounded; apply() "
              "applies a KvEventBatch's bytes.",
    .tp_new = KvMap_new,
    .tp_init = (initproc)KvMap_init,
    .tp_dealloc = (destructor)KvMap_dealloc,
    .tp_methods = KvMap_methods,
    .tp_as_sequence = &KvMap_as_sequence,
};
