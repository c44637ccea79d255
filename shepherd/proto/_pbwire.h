/* Reading protobuf's wire format in C: a varint (at most 10 bytes), a tag, a field skipped by its wire type
 * (groups refused), a string field's UTF-8 checked. Shared by ``shepherd/proto/_kvwire.c`` (a KV event batch
 * checked), ``shepherd/policies/_prefixcore_kv.h`` (its events applied) and ``shepherd/proto/_varint.c``
 * (an SGLang request id checked). Each reader returns -1 on malformed input. */
#ifndef SHEPHERD_PBWIRE_H
#define SHEPHERD_PBWIRE_H
#include <stdint.h>
#include <string.h>

static inline int pb_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    uint64_t x = 0;
    const uint8_t *q = *p;
    if (end - q >= 10) { /* room for the longest: no bound checks (token ids are 1-3 bytes) */
        for (int i = 0; i < 10; i++) {
            uint8_t b = q[i];
            x |= (uint64_t)(b & 0x7F) << (7 * i);
            if (b < 0x80) {
                *p = q + i + 1;
                *v = x;
                return 0;
            }
        }
        return -1;
    }
    for (int i = 0; i < 10; i++) {
        if (q >= end) return -1;
        uint8_t b = *q++;
        x |= (uint64_t)(b & 0x7F) << (7 * i);
        if (!(b & 0x80)) {
            *p = q;
            *v = x;
            return 0;
        }
    }
    return -1;
}

/* one tag: its field number (> 0, < 2**29) and wire type; -1 when malformed */
static inline int pb_tag(const uint8_t **p, const uint8_t *end, int *field, int *wt) {
    uint64_t t;
    if (pb_varint(p, end, &t) < 0 || t > 0xFFFFFFFFULL || (t >> 3) == 0) return -1;
    *field = (int)(t >> 3);
    *wt = (int)(t & 7);
    return 0;
}

/* past one field of wire type wt (groups refused); the body of a length-delimited one in [*lo, *hi) */
static inline int pb_skip(const uint8_t **p, const uint8_t *end, int wt, const uint8_t **lo, const uint8_t **hi) {
    uint64_t v;
    switch (wt) {
    case 0:
        return pb_varint(p, end, &v);
    case 1:
        if (end - *p < 8) return -1;
        *p += 8;
        return 0;
    case 2:
        if (pb_varint(p, end, &v) < 0 || v > (uint64_t)(end - *p)) return -1;
        *lo = *p;
        *p += v;
        *hi = *p;
        return 0;
    case 5:
        if (end - *p < 4) return -1;
        *p += 4;
        return 0;
    default:
        return -1;
    }
}

/* 1 when [s, end) is UTF-8 as protobuf checks a string field (upb: strict), else 0 */
/* (strict: no overlongs, surrogates or code points above U+10FFFF) */
static inline int pb_utf8_ok(const uint8_t *s, const uint8_t *end) {
    while (s < end) {
        uint64_t w; /* ASCII 8 bytes at a time (a request id, a medium's name) */
        if (end - s >= 8 && (memcpy(&w, s, 8), !(w & 0x8080808080808080ULL))) {
            s += 8;
            continue;
        }
        uint8_t c = *s++;
        if (c < 0x80) continue;
        int n;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) {
            n = 1;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 2;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (end - s < n) return 0;
        for (int i = 0; i < n; i++) {
            if ((s[i] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i] & 0x3F);
        }
        s += n;
        if ((n == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)))
            return 0;
    }
    return 1;
}

#endif
