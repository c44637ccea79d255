/* ``kv_scan``: a SubscribeKvEvents message (``smg.grpc.common.KvEventBatch``) checked and its header read
 * without protobuf, so that the node's KV feed can apply the events from the bytes in C
 * (``policies._prefixcore.KvMap.apply``) instead of building a message, a Python object per event and
 * a Python int per block hash and token id (``kv_codec.decode_kv_wire``). The property tests compare its
 * answers with protobuf's parse on random and mutated messages. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* == kv_scan: a SubscribeKvEvents message (smg.grpc.common.KvEventBatch) checked and its header read ====
 * What the node's KV feed needs before it applies a batch: the sequence number, how many events
 * ``kv_codec.decode_kv_batch`` would keep (stored/removed/cleared, not a remote pool's), and where the load
 * record is. The whole message is walked: a batch this accepts is one protobuf parses alike (every length
 * in bounds, varints of at most 10 bytes, the known fields with their own wire types, UTF-8 in the string
 * fields, at most one load record and one data field per event, no snapshot chunk); anything else answers
 * None and the caller parses it with protobuf (which raises on what is malformed). The events themselves
 * are applied from the bytes in C (``policies._prefixcore.KvMap.apply``). */

#include "_pbwire.h"

/* the fields of one message kind: wire type per field number (-1: not a field of it; 'S': a string,
 * 'M': a message checked by ``sub``, 'P': a repeated scalar, packed or not) */
typedef struct KvMsg {
    int nfields;
    const char *kinds; /* kinds[f] for field f: 'V' varint, '8' fixed64, 'S', 'B' bytes, 'M', 'P', '.' none */
    const struct KvMsg *const *subs; /* for 'M' fields, by field number */
} KvMsg;

/* 1 when [p, end) is a message of kind k (the counts below for the event kinds), 0 when not plain */
static int kv_check(const KvMsg *k, const uint8_t *p, const uint8_t *end, int *seen, int64_t *last) {
    while (p < end) {
        int f, wt;
        const uint8_t *lo = NULL, *hi = NULL;
        if (pb_tag(&p, end, &f, &wt) < 0) return 0;
        char kind = f < k->nfields ? k->kinds[f] : '.';
        const uint8_t *vp = p;
        if (pb_skip(&p, end, wt, &lo, &hi) < 0) return 0;
        switch (kind) {
        case '.':
            continue; /* unknown: protobuf keeps it aside */
        case 'V':
            if (wt != 0) return 0;
            if (last != NULL) {
                uint64_t v = 0;
                pb_varint(&vp, end, &v);
                last[f] = (int64_t)v;
            }
            break;
        case '8':
            if (wt != 1) return 0;
            break;
        case 'S':
            if (wt != 2 || !pb_utf8_ok(lo, hi)) return 0;
            break;
        case 'B':
            if (wt != 2) return 0;
            break;
        case 'M':
            if (wt != 2 || k->subs == NULL || k->subs[f] == NULL || !kv_check(k->subs[f], lo, hi, NULL, NULL)) return 0;
            break;
        case 'P':
            if (wt == 2) { /* packed varints: each ends with a byte below 0x80 within 10 bytes */
                int run = 0;
                for (; lo < hi; lo++) {
                    run = *lo & 0x80 ? run + 1 : 0;
                    if (run >= 10) return 0;
                }
                if (run) return 0;
            } else if (wt != 0) {
                return 0;
            }
            break;
        default:
            return 0;
        }
        if (seen != NULL) seen[f]++;
    }
    return 1;
}

/* smg.grpc.common: KvMultimodalKey, KvBlockExtraKey, KvBlock, KvBlocksStored, KvBlocksRemoved, KvCacheCleared */
static const KvMsg KV_MM = {3, ".SV", NULL};
static const KvMsg *const KV_EXTRA_SUBS[] = {NULL, NULL, NULL, NULL, &KV_MM};
static const KvMsg KV_EXTRA = {5, ".SBVM", KV_EXTRA_SUBS};
static const KvMsg *const KV_BLOCK_SUBS[] = {NULL, NULL, NULL, NULL, NULL, NULL, &KV_EXTRA};
static const KvMsg KV_BLOCK = {7, ".VPVVVM", KV_BLOCK_SUBS};
static const KvMsg *const KV_STORED_SUBS[] = {NULL, &KV_BLOCK};
static const KvMsg KV_STORED = {13, ".MVVSVSVVSSSS", KV_STORED_SUBS};
static const KvMsg KV_REMOVED = {8, ".PVVSVVS", NULL};
static const KvMsg KV_CLEARED = {2, ".S", NULL};

/* The fields ``kv_codec.decode_load`` reads of an EngineLoad in [p, end), as the arguments of
 * ``engine_types.EngineLoad`` and ``load_only`` last; Py_None when the record carries nested telemetry
 * (memory, queues, ...: protobuf's to check and parse), NULL when malformed (no exception set). A field
 * with another wire type than its own is an unknown field to protobuf: not read here either. */
static PyObject *kv_load(const uint8_t *p, const uint8_t *end) {
    uint64_t u[13] = {0}; /* by field number: the varints and the bits of the doubles */
    while (p < end) {
        int f, wt;
        const uint8_t *lo = NULL, *hi = NULL;
        if (pb_tag(&p, end, &f, &wt) < 0) return NULL;
        const uint8_t *vp = p;
        if (pb_skip(&p, end, wt, &lo, &hi) < 0) return NULL;
        if (f >= 13 && f <= 17) Py_RETURN_NONE;
        if (f > 12) continue;
        int dbl = f == 4 || f == 5 || f == 10;
        if (dbl && wt == 1) {
            memcpy(&u[f], vp, 8); /* little-endian, as the wire */
        } else if (!dbl && wt == 0) {
            pb_varint(&vp, end, &u[f]);
        }
    }
    double usage, hit;
    memcpy(&usage, &u[4], 8);
    memcpy(&hit, &u[10], 8);
    return Py_BuildValue("(IIiidIIdO)", (unsigned)(uint32_t)u[1], (unsigned)(uint32_t)u[2], (int)(int32_t)u[11],
                         (int)(int32_t)u[12], usage, (unsigned)(uint32_t)u[3], (unsigned)(uint32_t)u[6], hit,
                         u[9] ? Py_True : Py_False);
}

/* kv_scan(raw) -> (sequence_number, events, load_lo, load_hi, load), or None (the caller parses with
 * protobuf). events: those decode_kv_batch keeps; load_lo < 0: no load record, else it is
 * raw[load_lo:load_hi] and ``load`` its fields (``kv_load``), or None when protobuf should parse it. */
static PyObject *kv_scan(PyObject *module, PyObject *raw) {
    (void)module;
    if (!PyBytes_Check(raw)) Py_RETURN_NONE;
    const uint8_t *buf = (const uint8_t *)PyBytes_AS_STRING(raw);
    const uint8_t *p = buf, *end = buf + PyBytes_GET_SIZE(raw);
    uint64_t seq = 0;
    Py_ssize_t events = 0, load_lo = -1, load_hi = -1;
    while (p < end) {
        int f, wt;
        const uint8_t *lo = NULL, *hi = NULL;
        if (pb_tag(&p, end, &f, &wt) < 0) Py_RETURN_NONE;
        const uint8_t *vp = p;
        if (pb_skip(&p, end, wt, &lo, &hi) < 0) Py_RETURN_NONE;
        if (f == 1) {
            if (wt != 0) Py_RETURN_NONE;
            pb_varint(&vp, end, &seq);
        } else if (f == 2) {
            if (wt != 1) Py_RETURN_NONE;
        } else if (f == 4) {
            if (wt != 0) Py_RETURN_NONE;
        } else if (f == 7) {
            Py_RETURN_NONE; /* a relay's snapshot chunk: protobuf's */
        } else if (f == 8) {
            if (wt != 2 || load_lo >= 0) Py_RETURN_NONE; /* a second record would merge: protobuf's */
            load_lo = lo - buf;
            load_hi = hi - buf;
        } else if (f == 3) { /* a KvCacheEvent: event_id, then one of stored (2), removed (3), cleared (4) */
            if (wt != 2) Py_RETURN_NONE;
            const uint8_t *q = lo, *dlo = NULL, *dhi = NULL;
            int kind = 0;
            while (q < hi) {
                int ef, ewt;
                const uint8_t *a = NULL, *b = NULL;
                if (pb_tag(&q, hi, &ef, &ewt) < 0 || pb_skip(&q, hi, ewt, &a, &b) < 0) Py_RETURN_NONE;
                if (ef == 1) {
                    if (ewt != 0) Py_RETURN_NONE;
                } else if (ef >= 2 && ef <= 4) {
                    if (ewt != 2 || kind) Py_RETURN_NONE; /* two data fields merge or replace: protobuf's */
                    kind = ef;
                    dlo = a;
                    dhi = b;
                }
            }
            int seen[16] = {0};
            int64_t last[16] = {0};
            if (kind == 2) {
                if (!kv_check(&KV_STORED, dlo, dhi, seen, last)) Py_RETURN_NONE;
                events += !(seen[8] && (int32_t)last[8] == 2); /* KV_CACHE_LOCALITY_REMOTE: not kept */
            } else if (kind == 3) {
                if (!kv_check(&KV_REMOVED, dlo, dhi, seen, last)) Py_RETURN_NONE;
                events += !(seen[6] && (int32_t)last[6] == 2);
            } else if (kind == 4) {
                if (!kv_check(&KV_CLEARED, dlo, dhi, NULL, NULL)) Py_RETURN_NONE;
                events++;
            }
        }
    }
    PyObject *load = Py_None;
    if (load_lo >= 0) {
        load = kv_load(buf + load_lo, buf + load_hi);
        if (load == NULL) Py_RETURN_NONE;
    } else {
        Py_INCREF(load);
    }
    return Py_BuildValue("(KnnnN)", (unsigned long long)seq, events, load_lo, load_hi, load);
}

static PyMethodDef methods[] = {
    {"kv_scan", (PyCFunction)kv_scan, METH_O,
     "kv_scan(raw) -> (sequence_number, events, load_lo, load_hi, load fields or None), or None when protobuf "
     "should parse raw"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kvwire", "A KvEventBatch's structure checked and its header read (kv_codec).", -1, methods,
};

PyMODINIT_FUNC PyInit__kvwire(void) { return PyModule_Create(&module_def); }
