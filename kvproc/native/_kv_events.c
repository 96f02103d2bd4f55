/* A device pool's KV events in C (`kvproc/tiers/device_index_events.py`): `EventLog`, the pool's index listener that
 * logs each change as a compact record, and the msgpack writer the publisher's thread turns a batch of them into
 * bytes with.
 *
 * Why in C: the listener runs on a resolve's path and the publisher's thread in the engine's process, so each
 * microsecond either spends in Python is taken from a resolve somewhere (bench/RESULTS.md, "Observability overhead":
 * the seventh session's ~25 us of thread CPU per resolve, most of it token ids turned into Python ints; the eleventh's
 * profile of the thread, a third of it per-record Python objects). Here nothing is made per record or per token.
 *
 * The bytes are exactly what msgspec writes for `KVEventBatch(ts, coalesce(events))` (`kvproc/tiers/kv_events.py`:
 * array-like structs, tagged, every field written, defaults too), so the pure-Python form (`DeviceIndexEvents`
 * without C, `DeviceBatchEncoder`) and this one are interchangeable; the tests compare the two on random changes.
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

/* How a registration's token ids are read: none; from memory (a prompt's packed ids, `PageHashes.data`: little-endian
 * uint32; or an int buffer, e.g. a request's int64 array); or as a sequence of Python ints. */
enum { T_NONE = 0, T_PACKED = 1, T_BUFFER = 2, T_SEQ = 3 };

typedef struct {
    int kind;
    const uint8_t *buf; /* T_PACKED, T_BUFFER */
    Py_ssize_t len;     /* ids in it */
    Py_ssize_t size;    /* T_BUFFER: item size */
    int sign;           /* T_BUFFER: signed */
    Py_buffer view;     /* T_BUFFER: held until tokens_release */
} Tokens;

/* Classify `tokens`, acquiring an int buffer's view. Never fails: what is not bytes nor an int buffer is read as a
 * sequence (T_SEQ), whose errors come as it is read (`put_tokens_seq`). */
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

/* ---- EventLog: the records logged in C as the index changes ---------------------------------------------------
 *
 * EventLog(block_size, medium, pad, hurry_records=4096, on_hurry=None) is a device pool's `IndexListener` in C
 * (`core.paged.PagedBlocks.listener`): `stored` and `removed` append one compact record each to a byte log, under
 * the pool's lock on a resolve's path, and the publisher's thread turns everything logged since its last batch into
 * that batch's msgpack in one call (`take`), the GIL let go while it writes.
 *
 * Why: the queued-tuple form cost a resolve two Python frames, a tuple and a packed-keys object per registration, and
 * the publisher's thread a popleft, a buffer export and the frees of every record (the eleventh session's profile of
 * that thread: the interpreter 28%, frees 12%, numpy's buffer export 6%; bench/RESULTS.md). Here a record is bytes in
 * one of two buffers the log owns and reuses: the keys and the parent already in their msgpack form (copied while
 * they are warm), the pages' token ids copied raw (uint32 where they fit: a memcpy for a restore's packed prompt,
 * one compare per id for an int64 array), so the tokens' owner is not kept alive and nothing is freed per record.
 *
 * The bytes are exactly what msgspec writes for `KVEventBatch(ts, coalesce(events))` of the same changes.
 * A record `stored` or `removed` cannot take (a key that is not bytes, a token that is not an int) never raises on
 * the resolve's path: it marks its batch failed, and `take` reports that batch's error instead of its payload (the
 * publisher counts it failed and its records dropped, as with a batch msgspec cannot encode).
 *
 * Threads: every append and `take`'s swap run with the GIL held, so they need no lock of their own; `take` then
 * writes the buffer it swapped out, which no one appends to, without the GIL. One `take` at a time (RuntimeError).
 */

enum { R_STORED = 0, R_REMOVED = 1, R_EVENT = 2 };
/* How a stored record's token ids are kept: none ([]), uint32, int64 or uint64 each, or already msgpack (a sequence
 * of Python ints: whatever their range, written as it is read). */
enum { TOK_NONE = 0, TOK_U32 = 1, TOK_I64 = 2, TOK_U64 = 3, TOK_ENC = 4 };

#define STORED_HDR 22 /* kind u8, nkeys u32, keys_len u32, parent_len u32, tok u8, ntok u32, tok_bytes u32 */
#define REMOVED_HDR 9 /* kind u8, nkeys u32, keys_len u32 */
#define EVENT_HDR 5   /* kind u8, len u32 */
#define LOG_KEEP_CAP ((size_t)8 << 20) /* a buffer grown past this by a burst is freed after its batch */

typedef struct {
    uint8_t *data; /* PyMem_Raw: freed or grown with or without the GIL */
    size_t len, cap;
    Py_ssize_t records;      /* appended (a removal merged into the one before counts) */
    Py_ssize_t events;       /* the events they make: neighbouring removals are one */
    size_t bound;            /* the most bytes their msgpack takes */
    Py_ssize_t open_removed; /* offset of the last record when it is a removal (the next one extends it), else -1 */
    PyObject *error;         /* the first record refused since the last take (a str), or NULL */
} LogBuf;

typedef struct {
    PyObject_HEAD
    LogBuf active, spare;
    Py_ssize_t page;
    uint32_t pad;
    char *medium;
    Py_ssize_t medium_len;
    Py_ssize_t hurry_records;
    PyObject *on_hurry; /* called once per batch when `hurry_records` are waiting; or NULL */
    int hurried, taking, dropping;
    long long appended, dropped;
} EventLog;

static void logbuf_reset(LogBuf *b) {
    b->len = 0;
    b->records = b->events = 0;
    b->bound = 0;
    b->open_removed = -1;
    Py_CLEAR(b->error);
}

static void logbuf_free(LogBuf *b) {
    logbuf_reset(b);
    PyMem_RawFree(b->data);
    b->data = NULL;
    b->cap = 0;
}

/* Room for `extra` more bytes: a pointer to them, or NULL with MemoryError set. */
static uint8_t *logbuf_reserve(LogBuf *b, size_t extra) {
    if (b->len + extra > b->cap) {
        size_t cap = b->cap ? b->cap : 64 << 10;
        while (cap < b->len + extra) cap *= 2;
        uint8_t *d = PyMem_RawRealloc(b->data, cap);
        if (!d) {
            PyErr_NoMemory();
            return NULL;
        }
        b->data = d;
        b->cap = cap;
    }
    return b->data + b->len;
}

/* 0, or -1 with RuntimeError set for a log made without its __init__ (`EventLog.__new__`): nothing to log into. */
static int log_ready(EventLog *self) {
    if (self->medium) return 0;
    PyErr_SetString(PyExc_RuntimeError, "EventLog is not initialised");
    return -1;
}

static inline void w32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline uint32_t r32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* The pending Python error as this batch's error (the first one wins), cleared: an append never raises. */
static void log_refuse(EventLog *self) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!self->active.error) {
        PyObject *s = value ? PyObject_Str(value) : NULL;
        if (!s) {
            PyErr_Clear();
            s = PyUnicode_FromString("an event record could not be logged");
        }
        PyObject *msg = s ? PyUnicode_FromFormat("%s: %U", type ? ((PyTypeObject *)type)->tp_name : "Error", s) : NULL;
        Py_XDECREF(s);
        if (!msg) PyErr_Clear();
        self->active.error = msg ? msg : Py_NewRef(Py_None);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    self->active.records++; /* counted: dropped with its batch */
    self->appended++;
    self->active.open_removed = -1;
}

static void log_appended(EventLog *self, Py_ssize_t records) {
    self->active.records += records;
    self->appended += records;
    if (self->on_hurry && !self->hurried && self->active.records >= self->hurry_records) {
        self->hurried = 1; /* once a batch: the thread takes everything at its wake */
        PyObject *r = PyObject_CallNoArgs(self->on_hurry);
        if (r) Py_DECREF(r);
        else PyErr_WriteUnraisable(self->on_hurry);
    }
}

/* The msgpack size of keys[lo:hi] as bins; -1 with TypeError set when one is not bytes. */
static Py_ssize_t keys_size(PyObject **keys, Py_ssize_t lo, Py_ssize_t hi) {
    Py_ssize_t total = 0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (!PyBytes_Check(keys[i])) {
            PyErr_Format(PyExc_TypeError, "a block hash must be bytes, got %.100s", Py_TYPE(keys[i])->tp_name);
            return -1;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(keys[i]);
        if (n > 0xffffffffLL) {
            PyErr_SetString(PyExc_ValueError, "a block hash is too long for msgpack");
            return -1;
        }
        total += (n <= 0xff ? 2 : n <= 0xffff ? 3 : 5) + n;
    }
    return total;
}

static uint8_t *put_keys_at(uint8_t *p, PyObject **keys, Py_ssize_t lo, Py_ssize_t hi) {
    Out o = {p};
    for (Py_ssize_t i = lo; i < hi; i++) put_bin(&o, PyBytes_AS_STRING(keys[i]), PyBytes_GET_SIZE(keys[i]));
    return o.p;
}

/* Token ids [lo, lo + n) of `t` (`pad` past its end) into `p` (room for 8 a token) in the narrowest raw form: uint32
 * where every id fits (a prompt's packed ids: a memcpy; an int64 array: one pass the compiler vectorises, which
 * notes whether any id did not fit), else int64, or uint64 for an unsigned 8-byte buffer. Returns the form (TOK_*)
 * and sets `*size` to the bytes written. */
static int tokens_put(uint8_t *p, const Tokens *t, Py_ssize_t lo, Py_ssize_t n, uint32_t pad, Py_ssize_t *size) {
    Py_ssize_t have = lo >= t->len ? 0 : (t->len - lo < n ? t->len - lo : n);
    *size = 4 * n;
    if (t->kind == T_PACKED) {
#if PY_LITTLE_ENDIAN
        memcpy(p, t->buf + 4 * lo, (size_t)(4 * have));
#else
        for (Py_ssize_t i = 0; i < have; i++) { uint32_t v = load32_le(t->buf + 4 * (lo + i)); memcpy(p + 4 * i, &v, 4); }
#endif
        for (Py_ssize_t i = have; i < n; i++) memcpy(p + 4 * i, &pad, 4);
        return TOK_U32;
    }
    int form = TOK_U32;
    if (t->size == 8) {
        const uint8_t *b = t->buf + 8 * lo;
        uint64_t high = 0;
        for (Py_ssize_t i = 0; i < have; i++) {
            uint64_t u;
            memcpy(&u, b + 8 * i, 8);
            high |= u >> 32;
            uint32_t x = (uint32_t)u;
            memcpy(p + 4 * i, &x, 4);
        }
        if (high) { /* an id past uint32 (or a negative one): all of them 8 bytes, as they are */
            memcpy(p, b, (size_t)(8 * have));
            form = t->sign ? TOK_I64 : TOK_U64;
        }
    } else if (t->sign) { /* narrower signed ints: int64 when one is negative */
        for (Py_ssize_t i = 0; i < have; i++) {
            uint64_t u;
            if (buf_at(t->buf, t->size, 1, lo + i, &u) < 0) { form = TOK_I64; break; }
        }
        for (Py_ssize_t i = 0; i < have; i++) {
            uint64_t u;
            int64_t v = buf_at(t->buf, t->size, 1, lo + i, &u);
            if (form == TOK_U32) { uint32_t x = (uint32_t)v; memcpy(p + 4 * i, &x, 4); }
            else memcpy(p + 8 * i, &v, 8);
        }
    } else { /* narrower unsigned ints: always uint32 */
        for (Py_ssize_t i = 0; i < have; i++) {
            uint64_t u;
            uint32_t x = (uint32_t)buf_at(t->buf, t->size, 0, lo + i, &u);
            memcpy(p + 4 * i, &x, 4);
        }
    }
    for (Py_ssize_t i = have; i < n; i++) { /* a padded tail */
        if (form == TOK_U32) memcpy(p + 4 * i, &pad, 4);
        else { uint64_t v = pad; memcpy(p + 8 * i, &v, 8); }
    }
    if (form != TOK_U32) *size = 8 * n;
    return form;
}

/* One stored record: keys[lo:hi], `parent` (None or bytes), the token ids of pages first_page+lo .. first_page+hi.
 * 0, or -1 with an exception set (nothing appended). */
static int log_stored_run(EventLog *self, PyObject **keys, Py_ssize_t lo, Py_ssize_t hi, PyObject *parent,
                          PyObject *tokens_o, const Tokens *tok, Py_ssize_t first_page) {
    Py_ssize_t keys_len = keys_size(keys, lo, hi);
    if (keys_len < 0) return -1;
    if (parent != Py_None && !PyBytes_Check(parent)) {
        PyErr_Format(PyExc_TypeError, "a parent hash must be bytes or None, got %.100s", Py_TYPE(parent)->tp_name);
        return -1;
    }
    Py_ssize_t parent_len = parent == Py_None ? 1 : keys_size(&parent, 0, 1);
    if (parent_len < 0) return -1;
    Py_ssize_t page = self->page, ntok = tok->kind == T_NONE ? 0 : (hi - lo) * page, tlo = (first_page + lo) * page;
    if (first_page < 0 || ntok > 0xffffffffLL / 9) {
        PyErr_Format(PyExc_ValueError, "bad page range %zd..%zd", first_page + lo, first_page + hi);
        return -1;
    }
    Py_ssize_t tok_size = 0;
    int form = TOK_NONE;
    PyObject *enc = NULL; /* TOK_ENC: the ids as msgpack, written by the one writer that reads Python ints */
    if (ntok && tok->kind == T_SEQ) {
        enc = PyBytes_FromStringAndSize(NULL, 9 * ntok);
        if (!enc) return -1;
        Out eo = {(uint8_t *)PyBytes_AS_STRING(enc)};
        if (put_tokens_seq(&eo, tokens_o, tlo, ntok, self->pad) < 0) { Py_DECREF(enc); return -1; }
        tok_size = eo.p - (uint8_t *)PyBytes_AS_STRING(enc);
        form = TOK_ENC;
    }
    LogBuf *b = &self->active;
    uint8_t *rec = logbuf_reserve(b, STORED_HDR + keys_len + parent_len + (enc ? tok_size : 8 * ntok));
    if (!rec) { Py_XDECREF(enc); return -1; }
    uint8_t *p = put_keys_at(rec + STORED_HDR, keys, lo, hi);
    if (parent == Py_None) *p++ = 0xc0;
    else p = put_keys_at(p, &parent, 0, 1);
    if (enc) memcpy(p, PyBytes_AS_STRING(enc), (size_t)tok_size);
    else if (ntok) form = tokens_put(p, tok, tlo, ntok, self->pad, &tok_size);
    Py_XDECREF(enc);
    rec[0] = R_STORED;
    w32(rec + 1, (uint32_t)(hi - lo));
    w32(rec + 5, (uint32_t)keys_len);
    w32(rec + 9, (uint32_t)parent_len);
    rec[13] = (uint8_t)form;
    w32(rec + 14, (uint32_t)ntok);
    w32(rec + 18, (uint32_t)tok_size);
    b->len += STORED_HDR + keys_len + parent_len + tok_size;
    b->bound += 32 + self->medium_len + HDR_MAX + keys_len + parent_len + HDR_MAX
                + (form == TOK_ENC ? tok_size : 9 * ntok);
    b->events++;
    b->open_removed = -1;
    return 0;
}

/* stored(hashes, positions, tokens=None, first_page=0, parent=None): `IndexListener.stored`, one record per run of
 * consecutive positions (parent: the key before the run, `parent` at the prompt's first page). */
static PyObject *EventLog_stored(EventLog *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 5) return PyErr_Format(PyExc_TypeError, "stored takes 2 to 5 arguments, got %zd", nargs);
    if (log_ready(self) < 0) return NULL;
    PyObject *tokens_o = nargs > 2 ? args[2] : Py_None, *parent = nargs > 4 ? args[4] : Py_None;
    Py_ssize_t first_page = nargs > 3 ? PyLong_AsSsize_t(args[3]) : 0;
    if (first_page == -1 && PyErr_Occurred()) return NULL;
    PyObject *hs = PySequence_Fast(args[0], "block hashes must be a sequence of bytes");
    PyObject *pos = hs ? PySequence_Fast(args[1], "positions must be a sequence of ints") : NULL;
    if (!pos) { /* not the pool's call: its batch fails, the caller goes on */
        Py_XDECREF(hs);
        if (self->dropping) {
            PyErr_Clear();
            self->dropped++;
        } else {
            log_refuse(self);
        }
        Py_RETURN_NONE;
    }
    Py_ssize_t nk = PySequence_Fast_GET_SIZE(hs), np_ = PySequence_Fast_GET_SIZE(pos);
    PyObject **keys = PySequence_Fast_ITEMS(hs), **ps = PySequence_Fast_ITEMS(pos);
    Tokens tok;
    tokens_prepare(&tok, tokens_o);
    for (Py_ssize_t i = 0; i < np_;) { /* one record per run of consecutive positions */
        Py_ssize_t lo = PyLong_AsSsize_t(ps[i]), j = i + 1;
        if (lo == -1 && PyErr_Occurred()) goto bad;
        while (j < np_) {
            Py_ssize_t q = PyLong_AsSsize_t(ps[j]);
            if (q == -1 && PyErr_Occurred()) goto bad;
            if (q != lo + (j - i)) break;
            j++;
        }
        Py_ssize_t hi = lo + (j - i);
        if (lo < 0 || hi > nk) {
            PyErr_Format(PyExc_IndexError, "positions %zd..%zd of %zd block hashes", lo, hi - 1, nk);
            goto bad;
        }
        if (self->dropping) self->dropped++;
        else if (log_stored_run(self, keys, lo, hi, lo ? keys[lo - 1] : parent, tokens_o, &tok, first_page) < 0)
            log_refuse(self);
        else
            log_appended(self, 1);
        i = j;
    }
    goto done;
bad: /* positions the pool never makes: the batch fails, the resolve does not */
    if (self->dropping) {
        PyErr_Clear();
        self->dropped++;
    } else {
        log_refuse(self);
    }
done:
    tokens_release(&tok);
    Py_DECREF(hs);
    Py_DECREF(pos);
    Py_RETURN_NONE;
}

/* removed(hashes): `IndexListener.removed`; joins the previous record when that is a removal too (`coalesce`). */
static PyObject *EventLog_removed(EventLog *self, PyObject *hashes) {
    if (log_ready(self) < 0) return NULL;
    if (self->dropping) { self->dropped++; Py_RETURN_NONE; }
    PyObject *hs = PySequence_Fast(hashes, "block hashes must be a sequence of bytes");
    if (!hs) {
        log_refuse(self);
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hs);
    PyObject **keys = PySequence_Fast_ITEMS(hs);
    Py_ssize_t keys_len = keys_size(keys, 0, n);
    LogBuf *b = &self->active;
    int extend = b->open_removed >= 0;
    uint8_t *p = keys_len < 0 ? NULL : logbuf_reserve(b, (extend ? 0 : REMOVED_HDR) + keys_len);
    if (!p) {
        Py_DECREF(hs);
        log_refuse(self);
        Py_RETURN_NONE;
    }
    if (extend) { /* the keys follow the open removal's, its counts grow */
        uint8_t *h = b->data + b->open_removed;
        w32(h + 1, r32(h + 1) + (uint32_t)n);
        w32(h + 5, r32(h + 5) + (uint32_t)keys_len);
    } else {
        b->open_removed = (Py_ssize_t)b->len;
        p[0] = R_REMOVED;
        w32(p + 1, (uint32_t)n);
        w32(p + 5, (uint32_t)keys_len);
        p += REMOVED_HDR;
        b->len += REMOVED_HDR;
        b->bound += 32 + self->medium_len + HDR_MAX;
        b->events++;
    }
    put_keys_at(p, keys, 0, n);
    b->len += keys_len;
    b->bound += keys_len;
    Py_DECREF(hs);
    log_appended(self, 1);
    Py_RETURN_NONE;
}

/* append_event(encoded): one event already msgpack (`attach`'s first ones), written as it is. */
static PyObject *EventLog_append_event(EventLog *self, PyObject *encoded) {
    if (log_ready(self) < 0) return NULL;
    if (!PyBytes_Check(encoded)) return PyErr_Format(PyExc_TypeError, "append_event takes bytes, got %.100s",
                                                     Py_TYPE(encoded)->tp_name);
    if (self->dropping) { self->dropped++; Py_RETURN_NONE; }
    Py_ssize_t n = PyBytes_GET_SIZE(encoded);
    if (n > 0xffffffffLL) return PyErr_Format(PyExc_ValueError, "an event of %zd bytes", n);
    LogBuf *b = &self->active;
    uint8_t *p = logbuf_reserve(b, EVENT_HDR + n);
    if (!p) return NULL;
    p[0] = R_EVENT;
    w32(p + 1, (uint32_t)n);
    memcpy(p + EVENT_HDR, PyBytes_AS_STRING(encoded), (size_t)n);
    b->len += EVENT_HDR + n;
    b->bound += n;
    b->events++;
    b->open_removed = -1;
    log_appended(self, 1);
    Py_RETURN_NONE;
}

/* The batch's msgpack from a buffer no one appends to: runs without the GIL. */
static void log_write(Out *o, const LogBuf *b, double ts, const char *medium, Py_ssize_t medium_len, Py_ssize_t page) {
    put1(o, 0x93); /* KVEventBatch(ts, events, data_parallel_rank None) */
    put1(o, 0xcb);
    uint64_t tsbits;
    memcpy(&tsbits, &ts, 8);
    put_be(o, tsbits, 8);
    put_array_header(o, b->events);
    const uint8_t *p = b->data, *end = b->data + b->len;
    while (p < end) {
        if (p[0] == R_EVENT) {
            uint32_t n = r32(p + 1);
            memcpy(o->p, p + EVENT_HDR, n);
            o->p += n;
            p += EVENT_HDR + n;
        } else if (p[0] == R_REMOVED) {
            uint32_t nkeys = r32(p + 1), klen = r32(p + 5);
            put1(o, 0x93);
            put_str(o, "BlockRemoved", 12);
            put_array_header(o, nkeys);
            memcpy(o->p, p + REMOVED_HDR, klen);
            o->p += klen;
            put_str(o, medium, medium_len);
            p += REMOVED_HDR + klen;
        } else { /* [tag, keys, parent, token_ids, block_size, lora_id None, medium] */
            uint32_t nkeys = r32(p + 1), klen = r32(p + 5), plen = r32(p + 9), ntok = r32(p + 14), tbytes = r32(p + 18);
            int form = p[13];
            put1(o, 0x97);
            put_str(o, "BlockStored", 11);
            put_array_header(o, nkeys);
            p += STORED_HDR;
            memcpy(o->p, p, klen + plen); /* the keys, then the parent: both msgpack already */
            o->p += klen + plen;
            p += klen + plen;
            put_array_header(o, ntok);
            if (form == TOK_ENC) {
                memcpy(o->p, p, tbytes);
                o->p += tbytes;
                p += tbytes;
            } else if (form == TOK_U32) {
                for (uint32_t i = 0; i < ntok; i++) put_u32_branchless(o, r32(p + 4 * i));
                p += 4 * (size_t)ntok;
            } else if (form == TOK_I64 || form == TOK_U64) {
                for (uint32_t i = 0; i < ntok; i++) {
                    uint64_t u;
                    memcpy(&u, p + 8 * i, 8);
                    if (form == TOK_U64) put_uint64(o, u);
                    else put_int(o, (int64_t)u);
                }
                p += 8 * (size_t)ntok;
            }
            put_int(o, page);
            put1(o, 0xc0);
            put_str(o, medium, medium_len);
        }
    }
    put1(o, 0xc0);
}

/* take(ts) -> (payload | None, records, error | None): everything logged since the last take, as one batch's
 * msgpack (None when nothing was), how many records that was, and, when one of them was refused, the first error
 * (then no payload: the batch fails). */
static PyObject *EventLog_take(EventLog *self, PyObject *arg) {
    double ts = PyFloat_AsDouble(arg);
    if (ts == -1.0 && PyErr_Occurred()) return NULL;
    if (log_ready(self) < 0) return NULL;
    if (self->taking) return PyErr_Format(PyExc_RuntimeError, "EventLog.take: another take is running");
    LogBuf tmp = self->active; /* swap: appends go on into the other buffer */
    self->active = self->spare;
    self->spare = tmp;
    self->hurried = 0;
    LogBuf *b = &self->spare;
    Py_ssize_t records = b->records;
    PyObject *payload = NULL, *error = NULL;
    if (b->error) {
        error = Py_NewRef(b->error);
    } else if (records) {
        payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(b->bound + 2 * HDR_MAX + 11));
        if (payload) {
            Out o = {(uint8_t *)PyBytes_AS_STRING(payload)};
            self->taking = 1;
            Py_BEGIN_ALLOW_THREADS
            log_write(&o, b, ts, self->medium, self->medium_len, self->page);
            Py_END_ALLOW_THREADS
            self->taking = 0;
            if (_PyBytes_Resize(&payload, (Py_ssize_t)(o.p - (uint8_t *)PyBytes_AS_STRING(payload))) < 0)
                payload = NULL; /* the resize freed it */
        }
        if (!payload) { /* out of memory: this batch fails, as one that cannot be encoded */
            PyErr_Clear();
            error = PyUnicode_FromString("MemoryError: no memory for the batch's payload");
            if (!error) return NULL;
        }
    }
    logbuf_reset(b);
    if (b->cap > LOG_KEEP_CAP) logbuf_free(b);
    return Py_BuildValue("(NnN)", payload ? payload : Py_NewRef(Py_None), records, error ? error : Py_NewRef(Py_None));
}

/* discard() -> records: drop what is logged (the publisher's thread ended: nothing will send it). */
static PyObject *EventLog_discard(EventLog *self, PyObject *unused) {
    Py_ssize_t n = self->active.records;
    logbuf_reset(&self->active);
    return PyLong_FromSsize_t(n);
}

static PyObject *EventLog_stop_keeping(EventLog *self, PyObject *unused) {
    self->dropping = 1;
    Py_RETURN_NONE;
}

static int EventLog_init(EventLog *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"block_size", "medium", "pad", "hurry_records", "on_hurry", NULL};
    Py_ssize_t page, hurry = 4096;
    PyObject *medium, *on_hurry = Py_None;
    long long pad;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nUL|nO:EventLog", kwlist, &page, &medium, &pad, &hurry, &on_hurry))
        return -1;
    if (page <= 0) { PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", page); return -1; }
    if (pad < 0 || pad > 0xffffffffLL) { PyErr_Format(PyExc_ValueError, "pad must be a uint32, got %lld", pad); return -1; }
    if (on_hurry != Py_None && !PyCallable_Check(on_hurry)) {
        PyErr_SetString(PyExc_TypeError, "on_hurry must be callable or None");
        return -1;
    }
    if (self->medium) { PyErr_SetString(PyExc_RuntimeError, "EventLog is initialised once"); return -1; }
    Py_ssize_t ml;
    const char *m = PyUnicode_AsUTF8AndSize(medium, &ml);
    if (!m) return -1;
    self->medium = PyMem_RawMalloc((size_t)ml + 1);
    if (!self->medium) { PyErr_NoMemory(); return -1; }
    memcpy(self->medium, m, (size_t)ml + 1);
    self->medium_len = ml;
    self->page = page;
    self->pad = (uint32_t)pad;
    self->hurry_records = hurry > 0 ? hurry : 1;
    self->on_hurry = on_hurry == Py_None ? NULL : Py_NewRef(on_hurry);
    self->active.open_removed = self->spare.open_removed = -1;
    return 0;
}

static void EventLog_dealloc(EventLog *self) {
    logbuf_free(&self->active);
    logbuf_free(&self->spare);
    Py_CLEAR(self->on_hurry);
    PyMem_RawFree(self->medium);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *EventLog_get_records(EventLog *self, void *c) { return PyLong_FromSsize_t(self->active.records); }
static PyObject *EventLog_get_appended(EventLog *self, void *c) { return PyLong_FromLongLong(self->appended); }
static PyObject *EventLog_get_dropped(EventLog *self, void *c) { return PyLong_FromLongLong(self->dropped); }

static PyMethodDef EventLog_methods[] = {
    {"stored", (PyCFunction)(void (*)(void))EventLog_stored, METH_FASTCALL,
     "stored(hashes, positions, tokens=None, first_page=0, parent=None): IndexListener.stored, logged"},
    {"removed", (PyCFunction)EventLog_removed, METH_O, "removed(hashes): IndexListener.removed, logged"},
    {"append_event", (PyCFunction)EventLog_append_event, METH_O, "append_event(msgpack bytes of one event)"},
    {"take", (PyCFunction)EventLog_take, METH_O,
     "take(ts) -> (payload | None, records, error | None): what was logged since the last take, as one batch"},
    {"discard", (PyCFunction)EventLog_discard, METH_NOARGS, "discard() -> records dropped"},
    {"stop_keeping", (PyCFunction)EventLog_stop_keeping, METH_NOARGS,
     "stop_keeping(): later records are counted as dropped, not kept"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef EventLog_getset[] = {
    {"records", (getter)EventLog_get_records, NULL, "records logged since the last take", NULL},
    {"appended", (getter)EventLog_get_appended, NULL, "records logged in all", NULL},
    {"dropped", (getter)EventLog_get_dropped, NULL, "records not kept after stop_keeping", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EventLogType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvproc.native._native.EventLog",
    .tp_doc = "a device pool's KV-event records, logged in C, taken as one batch's msgpack",
    .tp_basicsize = sizeof(EventLog),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)EventLog_init,
    .tp_dealloc = (destructor)EventLog_dealloc,
    .tp_methods = EventLog_methods,
    .tp_getset = EventLog_getset,
};

int kvproc_add_kv_events(PyObject *module) {
    if (PyType_Ready(&EventLogType) < 0) return -1;
    Py_INCREF(&EventLogType);
    if (PyModule_AddObject(module, "EventLog", (PyObject *)&EventLogType) < 0) {
        Py_DECREF(&EventLogType);
        return -1;
    }
    return 0;
}
