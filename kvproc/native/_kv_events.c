/* kv_device_batch: a device pool's KV-event batch (`kvproc/tiers/device_index_events.py`) as msgpack, in one call.
 *
 * Why in C: the publisher's thread runs in the engine's process, and each microsecond it holds the GIL or a core is
 * taken from a resolve somewhere (bench/RESULTS.md, "Seventh session": ~25 us of thread CPU per resolve, most of it
 * turning each page's token ids into Python ints, then into msgpack). Here the queued records are read as they were
 * queued -- the key lists, the prompt's token array through the buffer protocol -- and written straight into the
 * payload, with no Python object made per event or per token.
 *
 * The bytes are exactly what msgspec writes for `KVEventBatch(ts, coalesce(events))` (`kvproc/tiers/kv_events.py`:
 * array-like structs, tagged, every field written, defaults too), so the pure-Python form and this one are
 * interchangeable; the tests compare the two on random batches. The records (the `items`):
 *
 * - `(0, hashes, parent, tokens, start, stop)`: `BlockStored(list(hashes), parent, token_ids, block_size, None,
 *   medium)` with token_ids pages start..stop-1 of `tokens` (`block_size` ids a page; past the end of `tokens`,
 *   `pad`: a padded hand-off tail), [] when `tokens` is None. `tokens`: an int array (read through the buffer
 *   protocol), bytes (a prompt's ids packed as little-endian uint32: `PageHashes.data`), or a sequence of ints --
 *   the slowest: each id is a Python int read from wherever it lies in memory (~60 ns each in place, cold);
 * - `(1, hashes)`: `BlockRemoved(list(hashes), medium)`; neighbouring ones become one event, as `coalesce` does;
 * - in either, `hashes` is a sequence of bytes, or bytes: the keys packed (`kv_pack_keys`), `key_width` bytes each;
 * - anything else but a tuple: `fallback(item)` must return that one event's msgpack bytes, written as they are
 *   (a tuple that is neither record is refused: TypeError, as the pure-Python form refuses it).
 *
 * Two passes: the first (GIL held) checks every record, pins what the second reads and bounds the payload's size; the
 * second writes it without the GIL (unless a record's ids are Python ints), so the engine's threads run meanwhile:
 * a busy thread lost 2.9x less time to a steady batch's encode than with the GIL held throughout
 * (`bench/device_event_encode.py`). What makes that safe: the records' key lists and bytes are the queue's own
 * (`DeviceIndexEvents` slices them; bytes never change) and the token memory is pinned by pass 1 (a bytes object
 * or a held buffer) and never changed by its owner (`core.paged.IndexListener.stored`).
 */
#include "_native.h"

#include <string.h>

typedef struct {
    uint8_t *p;
} Out;

static inline void put1(Out *o, uint8_t b) { *o->p++ = b; }

static inline void put_be(Out *o, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; i--) *o->p++ = (uint8_t)(v >> (8 * i));
}

static inline void put_array_header(Out *o, Py_ssize_t n) {
    if (n < 16) put1(o, (uint8_t)(0x90 | n));
    else if (n <= 0xffff) { put1(o, 0xdc); put_be(o, (uint64_t)n, 2); }
    else { put1(o, 0xdd); put_be(o, (uint64_t)n, 4); }
}

static inline void put_str(Out *o, const char *s, Py_ssize_t n) {
    if (n < 32) put1(o, (uint8_t)(0xa0 | n));
    else if (n <= 0xff) { put1(o, 0xd9); put1(o, (uint8_t)n); }
    else if (n <= 0xffff) { put1(o, 0xda); put_be(o, (uint64_t)n, 2); }
    else { put1(o, 0xdb); put_be(o, (uint64_t)n, 4); }
    memcpy(o->p, s, (size_t)n);
    o->p += n;
}

static inline void put_bin(Out *o, const char *s, Py_ssize_t n) {
    if (n <= 0xff) { put1(o, 0xc4); put1(o, (uint8_t)n); }
    else if (n <= 0xffff) { put1(o, 0xc5); put_be(o, (uint64_t)n, 2); }
    else { put1(o, 0xc6); put_be(o, (uint64_t)n, 4); }
    memcpy(o->p, s, (size_t)n);
    o->p += n;
}

/* msgpack's smallest form of an int, as msgspec picks it: unsigned forms for n >= 0. At most 9 bytes. */
static inline void put_int(Out *o, int64_t v) {
    if (v >= 0) {
        if (v < 128) put1(o, (uint8_t)v);
        else if (v <= 0xff) { put1(o, 0xcc); put1(o, (uint8_t)v); }
        else if (v <= 0xffff) { put1(o, 0xcd); put_be(o, (uint64_t)v, 2); }
        else if (v <= 0xffffffffLL) { put1(o, 0xce); put_be(o, (uint64_t)v, 4); }
        else { put1(o, 0xcf); put_be(o, (uint64_t)v, 8); }
    } else {
        if (v >= -32) put1(o, (uint8_t)(int8_t)v);
        else if (v >= -128) { put1(o, 0xd0); put1(o, (uint8_t)(int8_t)v); }
        else if (v >= -32768) { put1(o, 0xd1); put_be(o, (uint64_t)(uint16_t)(int16_t)v, 2); }
        else if (v >= -2147483648LL) { put1(o, 0xd2); put_be(o, (uint64_t)(uint32_t)(int32_t)v, 4); }
        else { put1(o, 0xd3); put_be(o, (uint64_t)v, 8); }
    }
}

/* put_int for 0 <= v < 2**32, without a branch on the size: a token id's form varies id to id (a vocabulary of
 * 150,000 straddles the 3- and 5-byte forms), so branching mispredicted about every other id. Writes 8 bytes and
 * keeps the form's 1, 2, 3 or 5: the caller's bound leaves 9 a token. */
static inline void put_u32_branchless(Out *o, uint32_t v) {
    uint64_t w1 = v, w2 = 0xccu | ((uint64_t)v << 8), w3 = 0xcdu | ((uint64_t)(v >> 8) << 8) | ((uint64_t)(v & 0xff) << 16);
    uint64_t w5 = 0xceu | ((uint64_t)__builtin_bswap32(v) << 8);
    uint64_t w = v < 128 ? w1 : v < 256 ? w2 : v < 65536 ? w3 : w5;
    size_t n = v < 128 ? 1 : v < 256 ? 2 : v < 65536 ? 3 : 5;
#if !PY_LITTLE_ENDIAN
    w = __builtin_bswap64(w); /* the form's first byte is w's lowest */
#endif
    memcpy(o->p, &w, 8);
    o->p += n;
}

static inline void put_uint64(Out *o, uint64_t v) {
    if (v <= (uint64_t)INT64_MAX) put_int(o, (int64_t)v);
    else { put1(o, 0xcf); put_be(o, v, 8); }
}

#define HDR_MAX 5 /* the longest array / str / bin header */

/* A record's keys: a sequence of bytes (`seq`, a PySequence_Fast), or `packed`, `n` keys of `width` bytes one after
 * the other (what `kv_pack_keys` made of the listener's slice). */
typedef struct {
    PyObject *seq;    /* owned, or NULL when packed */
    PyObject *packed; /* owned bytes, or NULL */
    Py_ssize_t n, width;
} Keys;

static void keys_free(Keys *k) {
    Py_CLEAR(k->seq);
    Py_CLEAR(k->packed);
}

/* Pass 1 (GIL): take a record's keys field and bound the bytes its keys take; -1 with an exception set when they are
 * neither a sequence of bytes nor packed keys of `width` bytes. */
static Py_ssize_t keys_prepare(Keys *k, PyObject *field, Py_ssize_t width) {
    if (PyBytes_CheckExact(field)) {
        Py_ssize_t len = PyBytes_GET_SIZE(field);
        if (width <= 0 || len % width) {
            PyErr_Format(PyExc_ValueError, "packed block hashes: %zd bytes are not keys of %zd bytes", len, width);
            return -1;
        }
        Py_INCREF(field);
        k->packed = field;
        k->n = len / width;
        k->width = width;
        return HDR_MAX + k->n * (HDR_MAX + width);
    }
    k->seq = PySequence_Fast(field, "block hashes must be a sequence of bytes");
    if (!k->seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(k->seq), total = HDR_MAX;
    PyObject **items = PySequence_Fast_ITEMS(k->seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i])) {
            PyErr_Format(PyExc_TypeError, "a block hash must be bytes, got %.100s", Py_TYPE(items[i])->tp_name);
            return -1;
        }
        total += HDR_MAX + PyBytes_GET_SIZE(items[i]);
    }
    k->n = n;
    return total;
}

static void put_keys(Out *o, const Keys *k) {
    if (k->packed) {
        const char *p = PyBytes_AS_STRING(k->packed);
        for (Py_ssize_t i = 0; i < k->n; i++) put_bin(o, p + i * k->width, k->width);
        return;
    }
    PyObject **items = PySequence_Fast_ITEMS(k->seq);
    for (Py_ssize_t i = 0; i < k->n; i++) put_bin(o, PyBytes_AS_STRING(items[i]), PyBytes_GET_SIZE(items[i]));
}

/* One int of a token buffer of item size `size` and signedness `sign`. */
static inline int64_t buf_at(const uint8_t *b, Py_ssize_t size, int sign, Py_ssize_t i, uint64_t *u) {
    *u = 0;
    switch (size) {
    case 8: { int64_t v; memcpy(&v, b + 8 * i, 8); if (!sign) *u = (uint64_t)v; return v; }
    case 4: { if (sign) { int32_t v; memcpy(&v, b + 4 * i, 4); return v; } uint32_t v; memcpy(&v, b + 4 * i, 4); return v; }
    case 2: { if (sign) { int16_t v; memcpy(&v, b + 2 * i, 2); return v; } uint16_t v; memcpy(&v, b + 2 * i, 2); return v; }
    default: return sign ? (int64_t)((const int8_t *)b)[i] : (int64_t)b[i];
    }
}

/* Whether `view` is a C-contiguous 1-d buffer of native-order ints; its item size and signedness then. */
static int int_buffer(const Py_buffer *view, int *sign) {
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN) || (*f == '>' && PY_BIG_ENDIAN)) f++;
    if (f[0] == '\0' || f[1] != '\0' || view->ndim != 1) return 0;
    if (!strchr("bBhHiIlLqQ", f[0])) return 0;
    *sign = f[0] >= 'a';
    return view->itemsize == 1 || view->itemsize == 2 || view->itemsize == 4 || view->itemsize == 8;
}

/* How a record's token ids are read: none; from memory (a prompt's packed ids, `PageHashes.data`: little-endian
 * uint32; or an int buffer), which needs no GIL; or as a sequence of Python ints, which does. */
enum { T_NONE = 0, T_PACKED = 1, T_BUFFER = 2, T_SEQ = 3 };

typedef struct {
    int kind;
    const uint8_t *buf; /* T_PACKED, T_BUFFER */
    Py_ssize_t len;     /* ids in it */
    Py_ssize_t size;    /* T_BUFFER: item size */
    int sign;           /* T_BUFFER: signed */
    Py_buffer view;     /* T_BUFFER: held from pass 1 to the end */
} Tokens;

/* Pass 1 (GIL): classify `tokens`, acquiring an int buffer's view. Never fails: what is not bytes nor an int buffer
 * is read as a sequence (T_SEQ), whose errors come as it is written. */
static void tokens_prepare(Tokens *t, PyObject *tokens) {
    t->kind = T_NONE;
    if (tokens == Py_None) return;
    if (PyBytes_CheckExact(tokens)) {
        t->kind = T_PACKED;
        t->buf = (const uint8_t *)PyBytes_AS_STRING(tokens);
        t->len = PyBytes_GET_SIZE(tokens) / 4;
        return;
    }
    t->kind = T_SEQ;
    if (!PyObject_CheckBuffer(tokens)) return;
    if (PyObject_GetBuffer(tokens, &t->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return;
    }
    if (!int_buffer(&t->view, &t->sign)) {
        PyBuffer_Release(&t->view);
        return;
    }
    t->kind = T_BUFFER;
    t->buf = (const uint8_t *)t->view.buf;
    t->size = t->view.itemsize;
    t->len = t->view.len / t->view.itemsize;
}

static void tokens_release(Tokens *t) {
    if (t->kind == T_BUFFER) PyBuffer_Release(&t->view);
    t->kind = T_NONE;
}

/* Ids lo..lo+n-1 from memory (T_PACKED, T_BUFFER), `pad` past the end: reads only bytes pass 1 pinned, so it runs
 * without the GIL. */
static void put_tokens_raw(Out *o, const Tokens *t, Py_ssize_t lo, Py_ssize_t n, int64_t pad) {
    if (t->kind == T_PACKED) {
        Py_ssize_t have = lo >= t->len ? 0 : (t->len - lo < n ? t->len - lo : n);
        const uint8_t *b = t->buf + 4 * lo;
        for (Py_ssize_t i = 0; i < have; i++) put_u32_branchless(o, load32_le(b + 4 * i));
        for (Py_ssize_t i = have; i < n; i++) put_int(o, pad);
        return;
    }
    if (t->sign && t->size == 8 && lo + n <= t->len) { /* a request's int64 ids, no tail: the usual buffer */
        const uint8_t *b = t->buf + 8 * lo;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t v;
            memcpy(&v, b + 8 * i, 8); /* a buffer need not be aligned */
            if ((uint64_t)v <= 0xffffffffu) put_u32_branchless(o, (uint32_t)v);
            else put_int(o, v);
        }
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t u;
        if (lo + i >= t->len) { put_int(o, pad); continue; }
        int64_t v = buf_at(t->buf, t->size, t->sign, lo + i, &u);
        if (!t->sign && t->size == 8) put_uint64(o, u);
        else put_int(o, v);
    }
}

/* Ids lo..lo+n-1 of a sequence of ints (GIL held), `pad` past its end; 0, or -1 with an exception set. */
static int put_tokens_seq(Out *o, PyObject *tokens, Py_ssize_t lo, Py_ssize_t n, int64_t pad) {
    PyObject *seq = PySequence_Fast(tokens, "token ids must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lo + i >= len) { put_int(o, pad); continue; }
        PyObject *x = items[lo + i];
        if (PyBool_Check(x) || !PyIndex_Check(x)) {
            PyErr_Format(PyExc_TypeError, "a token id must be an int, got %.100s", Py_TYPE(x)->tp_name);
            Py_DECREF(seq);
            return -1;
        }
        int overflow = 0;
        PyObject *ix = PyNumber_Index(x);
        if (!ix) { Py_DECREF(seq); return -1; }
        long long v = PyLong_AsLongLongAndOverflow(ix, &overflow);
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(ix);
            Py_DECREF(ix);
            if (PyErr_Occurred()) { Py_DECREF(seq); return -1; }
            put_uint64(o, u);
            continue;
        }
        Py_DECREF(ix);
        if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "a token id is out of msgpack's int range");
            Py_DECREF(seq);
            return -1;
        }
        put_int(o, v);
    }
    Py_DECREF(seq);
    return 0;
}

enum { K_STORED = 0, K_REMOVED = 1, K_OTHER = 2 };

typedef struct {
    int kind;
    Keys keys;
    PyObject *parent;   /* borrowed: None or bytes */
    PyObject *tokens;   /* borrowed */
    Py_ssize_t start, stop;
    PyObject *encoded;  /* K_OTHER: fallback's bytes (owned) */
    Py_ssize_t run;     /* K_REMOVED that starts a run: the run's key count; -1 when it continues one */
    Tokens tok;         /* K_STORED: how its ids are read */
} Rec;

static void recs_free(Rec *recs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        keys_free(&recs[i].keys);
        Py_XDECREF(recs[i].encoded);
        tokens_release(&recs[i].tok);
    }
    PyMem_Free(recs);
}

/* Pass 2: the payload. Reads only what pass 1 checked and pinned (the key lists, their bytes, the parents, the
 * fallback's bytes, the token memory), so without the GIL unless a record's ids are a sequence (`seq`: then the
 * GIL is held and that is the one step that can fail: 0, or -1 with an exception set). */
static int write_batch(Out *o, Rec *recs, Py_ssize_t n, Py_ssize_t events, double ts, const char *medium,
                       Py_ssize_t medium_len, Py_ssize_t page, int64_t pad) {
    put1(o, 0x93); /* KVEventBatch(ts, events, data_parallel_rank None) */
    put1(o, 0xcb);
    uint64_t tsbits;
    memcpy(&tsbits, &ts, 8);
    put_be(o, tsbits, 8);
    put_array_header(o, events);
    for (Py_ssize_t i = 0; i < n; i++) {
        Rec *r = &recs[i];
        if (r->kind == K_OTHER) {
            memcpy(o->p, PyBytes_AS_STRING(r->encoded), (size_t)PyBytes_GET_SIZE(r->encoded));
            o->p += PyBytes_GET_SIZE(r->encoded);
        } else if (r->kind == K_REMOVED) {
            if (r->run >= 0) { /* a run's first: [tag, keys of the whole run, medium] */
                put1(o, 0x93);
                put_str(o, "BlockRemoved", 12);
                put_array_header(o, r->run);
            }
            put_keys(o, &r->keys);
            if (i + 1 == n || recs[i + 1].kind != K_REMOVED) put_str(o, medium, medium_len);
        } else { /* [tag, keys, parent, token_ids, block_size, lora_id None, medium] */
            put1(o, 0x97);
            put_str(o, "BlockStored", 11);
            put_array_header(o, r->keys.n);
            put_keys(o, &r->keys);
            if (r->parent == Py_None) put1(o, 0xc0);
            else put_bin(o, PyBytes_AS_STRING(r->parent), PyBytes_GET_SIZE(r->parent));
            Py_ssize_t lo = r->start * page, k = r->tok.kind == T_NONE ? 0 : (r->stop - r->start) * page;
            put_array_header(o, k);
            if (k && r->tok.kind == T_SEQ) {
                if (put_tokens_seq(o, r->tokens, lo, k, pad) < 0) return -1;
            } else if (k) {
                put_tokens_raw(o, &r->tok, lo, k, pad);
            }
            put_int(o, page);
            put1(o, 0xc0);
            put_str(o, medium, medium_len);
        }
    }
    put1(o, 0xc0);
    return 0;
}

static PyObject *kv_device_batch(PyObject *self, PyObject *args) {
    double ts;
    PyObject *items, *medium_obj, *fallback;
    Py_ssize_t page, key_width = 16;
    long long pad;
    int release_gil = 1, seq = 0;
    if (!PyArg_ParseTuple(args, "dO!nULO|pn:kv_device_batch", &ts, &PyList_Type, &items, &page, &medium_obj, &pad,
                          &fallback, &release_gil, &key_width))
        return NULL;
    if (page <= 0) return PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", page);
    Py_ssize_t medium_len;
    const char *medium = PyUnicode_AsUTF8AndSize(medium_obj, &medium_len);
    if (!medium) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    Rec *recs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Rec));
    if (!recs) return PyErr_NoMemory();
    Py_ssize_t bound = 2 * HDR_MAX + 9, events = 0, run_at = -1;
    /* Pass 1: check every record, count the events (a run of removals is one), bound the payload's size. */
    for (Py_ssize_t i = 0; i < n; i++) {
        Rec *r = &recs[i];
        PyObject *it = PyList_GET_ITEM(items, i);
        r->run = 0;
        Py_ssize_t arity = PyTuple_CheckExact(it) ? PyTuple_GET_SIZE(it) : 0;
        long kind = arity ? PyLong_AsLong(PyTuple_GET_ITEM(it, 0)) : -2;
        if (kind == -1 && PyErr_Occurred()) PyErr_Clear();
        if (kind == K_STORED && arity == 6) {
            r->kind = K_STORED;
            r->parent = PyTuple_GET_ITEM(it, 2);
            r->tokens = PyTuple_GET_ITEM(it, 3);
            r->start = PyLong_AsSsize_t(PyTuple_GET_ITEM(it, 4));
            r->stop = PyLong_AsSsize_t(PyTuple_GET_ITEM(it, 5));
            if (PyErr_Occurred()) goto fail;
            if (r->parent != Py_None && !PyBytes_CheckExact(r->parent)) {
                PyErr_Format(PyExc_TypeError, "a parent hash must be bytes or None, got %.100s",
                             Py_TYPE(r->parent)->tp_name);
                goto fail;
            }
            if (r->start < 0 || r->stop < r->start || r->stop > PY_SSIZE_T_MAX / 9 / page) {
                PyErr_Format(PyExc_ValueError, "bad page range %zd..%zd", r->start, r->stop);
                goto fail;
            }
            tokens_prepare(&r->tok, r->tokens);
            seq |= r->tok.kind == T_SEQ;
        } else if (kind == K_REMOVED && arity == 2) {
            r->kind = K_REMOVED;
        } else if (PyTuple_CheckExact(it)) {
            PyErr_Format(PyExc_TypeError, "not a device-event record: a tuple of %zd, kind %ld", arity, kind);
            goto fail;
        } else {
            r->kind = K_OTHER;
            r->encoded = PyObject_CallOneArg(fallback, it);
            if (!r->encoded) goto fail;
            if (!PyBytes_CheckExact(r->encoded)) {
                PyErr_SetString(PyExc_TypeError, "kv_device_batch: fallback must return bytes");
                goto fail;
            }
            bound += PyBytes_GET_SIZE(r->encoded);
            events++;
            run_at = -1;
            continue;
        }
        Py_ssize_t kb = keys_prepare(&r->keys, PyTuple_GET_ITEM(it, 1), key_width);
        if (kb < 0) goto fail;
        bound += kb;
        if (r->kind == K_STORED) {
            bound += 32 + medium_len + HDR_MAX + (r->parent == Py_None ? 1 : HDR_MAX + PyBytes_GET_SIZE(r->parent))
                     + HDR_MAX + 9 * (r->tok.kind == T_NONE ? 0 : (r->stop - r->start) * page);
            events++;
            run_at = -1;
        } else if (run_at >= 0) {
            recs[run_at].run += r->keys.n;
            r->run = -1;
        } else {
            bound += 32 + medium_len;
            r->run = r->keys.n;
            run_at = i;
            events++;
        }
    }
    PyObject *payload = PyBytes_FromStringAndSize(NULL, bound);
    if (!payload) goto fail;
    Out o = {(uint8_t *)PyBytes_AS_STRING(payload)};
    int rc;
    if (seq || !release_gil) {
        rc = write_batch(&o, recs, n, events, ts, medium, medium_len, page, pad);
    } else { /* the engine's threads run meanwhile */
        Py_BEGIN_ALLOW_THREADS
        rc = write_batch(&o, recs, n, events, ts, medium, medium_len, page, pad);
        Py_END_ALLOW_THREADS
    }
    if (rc < 0) {
        Py_DECREF(payload);
        goto fail;
    }
    recs_free(recs, n);
    if (_PyBytes_Resize(&payload, (Py_ssize_t)(o.p - (uint8_t *)PyBytes_AS_STRING(payload))) < 0) return NULL;
    return payload;
fail:
    recs_free(recs, n);
    return NULL;
}

/* kv_pack_keys(keys, lo, hi, width) -> bytes | None: keys[lo:hi] one after the other, when each is bytes of `width`
 * bytes (else None: the caller queues the keys as a list). Why: a record holding the keys' bytes objects keeps them
 * alive until the publisher's thread writes them, ~50 ms later, cold (each its own allocation), and frees them there
 * holding the GIL; one packed copy made on the resolve's path, while they are warm, is read in one sweep. */
static PyObject *kv_pack_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* METH_FASTCALL: it runs on a resolve's path, where an argument tuple's parse was half its cost */
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "kv_pack_keys takes 4 arguments, got %zd", nargs);
    PyObject *keys_o = args[0];
    Py_ssize_t lo = PyLong_AsSsize_t(args[1]), hi = PyLong_AsSsize_t(args[2]), width = PyLong_AsSsize_t(args[3]);
    if ((lo == -1 || hi == -1 || width == -1) && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(keys_o, "block hashes must be a sequence of bytes");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (lo < 0 || hi > n || hi < lo || width <= 0) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "kv_pack_keys: bad range %zd..%zd of %zd keys (width %zd)", lo, hi, n,
                            width);
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != width) {
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (hi - lo) * width);
    if (out) {
        char *p = PyBytes_AS_STRING(out);
        for (Py_ssize_t i = lo; i < hi; i++, p += width) memcpy(p, PyBytes_AS_STRING(items[i]), (size_t)width);
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef kv_event_methods[] = {
    {"kv_device_batch", kv_device_batch, METH_VARARGS,
     "kv_device_batch(ts, items, block_size, medium, pad, fallback, release_gil=True, key_width=16) -> msgpack "
     "bytes of the KVEventBatch"},
    {"kv_pack_keys", (PyCFunction)(void (*)(void))kv_pack_keys, METH_FASTCALL,
     "kv_pack_keys(keys, lo, hi, width) -> keys[lo:hi] packed, or None when one is not bytes of width bytes"},
    {NULL, NULL, 0, NULL},
};

int kvproc_add_kv_events(PyObject *module) { return PyModule_AddFunctions(module, kv_event_methods); }
