/* kvproc.native._native: the hot path's loops that no numpy call can do in one go, and its one bounded spin.
 *
 * - blake2b_chain: the chained page hashes of `kvproc.core.hashing` (h_i = BLAKE2b-128(h_{i-1} || page_i)). Each hash
 *   depends on the one before, so Python pays a hashlib call per page (~1.2 us, most of it call overhead); here a
 *   page of 16 tokens is one BLAKE2b compression (~0.2 us) and the loop runs without the GIL.
 * - sha256_chain / xxh3_chain (`_digest_chain.c`): the same chain for the other two families, through the hash
 *   functions the process already loaded (OpenSSL's, xxhash's).
 * - sketch_add (`_sketch.c`): lrfu's count-min sketch update and estimates for a batch of pages.
 * - pack_tokens: a token list as little-endian uint32 bytes, range-checked, in one pass (what the hash reads).
 * - paged_*: the per-block loops of `kvproc.core.paged.PagedBlocks` (refcounts, generations, the prefix index), one
 *   pass each where numpy needs several calls of fixed overhead on a resolve's few dozen ids.
 * - fence_cas: the atomic compare-and-swap of a save's fence word (`kvproc/tiers/save_fence.py`).
 * - EventLog (`_kv_events.c`): a device pool's KV events logged as its index changes, each batch written as msgpack.
 * - copy_plan: the run split of a copy order (`kvproc.workers.copy_exec.split_runs` + `_bounds`) in one pass over
 *   the two id lists, where numpy's version costs ~25 calls of fixed overhead whatever the order's size.
 * - copy_rows: the copy itself for arenas of packed or strided rows: ids checked, then one memmove per run (the GIL
 *   released for a big copy; numpy's gather + scatter passes over the bytes twice and costs ~10 us before a byte moves).
 *
 * Optional: kvproc falls back to the pure-Python forms when this module is not built (no compiler), and the tests
 * check both forms agree. BLAKE2b is implemented from RFC 7693 (unkeyed, no salt/personalisation, digest of 1..64
 * bytes); tests compare it against hashlib on random inputs.
 */
#include "_native.h"

#include <string.h>

/* ---- BLAKE2b (RFC 7693) ------------------------------------------------------------------------------------- */

static const uint64_t B2B_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

#define B2B_G(a, b, c, d, x, y)            \
    do {                                   \
        v[a] = v[a] + v[b] + (x);          \
        v[d] = rotr64(v[d] ^ v[a], 32);    \
        v[c] = v[c] + v[d];                \
        v[b] = rotr64(v[b] ^ v[c], 24);    \
        v[a] = v[a] + v[b] + (y);          \
        v[d] = rotr64(v[d] ^ v[a], 16);    \
        v[c] = v[c] + v[d];                \
        v[b] = rotr64(v[b] ^ v[c], 63);    \
    } while (0)

/* One round with its message schedule as constants: fully unrolled, so the compiler keeps m[] in registers. */
#define B2B_ROUND(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
    do {                                                                                  \
        B2B_G(0, 4, 8, 12, m[s0], m[s1]);                                                 \
        B2B_G(1, 5, 9, 13, m[s2], m[s3]);                                                 \
        B2B_G(2, 6, 10, 14, m[s4], m[s5]);                                                \
        B2B_G(3, 7, 11, 15, m[s6], m[s7]);                                                \
        B2B_G(0, 5, 10, 15, m[s8], m[s9]);                                                \
        B2B_G(1, 6, 11, 12, m[s10], m[s11]);                                              \
        B2B_G(2, 7, 8, 13, m[s12], m[s13]);                                               \
        B2B_G(3, 4, 9, 14, m[s14], m[s15]);                                               \
    } while (0)

/* One compression of a 128-byte block; `t` = message bytes up to and including this block. */
static void b2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = B2B_IV[i];
    }
    v[12] ^= t; /* the counter's high word stays 0: inputs here are far below 2**64 bytes */
    if (last) v[14] = ~v[14];
    /* The schedule of RFC 7693 (rounds 10 and 11 repeat rounds 0 and 1). */
    B2B_ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    B2B_ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    B2B_ROUND(11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4);
    B2B_ROUND(7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8);
    B2B_ROUND(9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13);
    B2B_ROUND(2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9);
    B2B_ROUND(12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11);
    B2B_ROUND(13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10);
    B2B_ROUND(6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5);
    B2B_ROUND(10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0);
    B2B_ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    B2B_ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* Unkeyed BLAKE2b of `len` bytes into `out` (`outlen` in 1..64). */
static void b2b_hash(const uint8_t *in, size_t len, uint8_t *out, size_t outlen) {
    uint64_t h[8];
    uint8_t block[128];
    memcpy(h, B2B_IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ (uint64_t)outlen; /* depth 1, fanout 1, no key */
    size_t done = 0;
    while (len - done > 128) { /* every block but the last one (which may be full) */
        b2b_compress(h, in + done, (uint64_t)(done + 128), 0);
        done += 128;
    }
    size_t rest = len - done;
    memset(block, 0, sizeof block);
    if (rest) memcpy(block, in + done, rest);
    b2b_compress(h, block, (uint64_t)len, 1);
    for (size_t i = 0; i < outlen; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}

static void b2b_page(const uint8_t *buf, size_t len, uint8_t *out) { b2b_hash(buf, len, out, KVPROC_CHAIN_DIGEST); }

/* blake2b_chain(data, page_bytes, seed) -> list[bytes]: the 16-byte chained hash of every full page of `data`. */
static PyObject *blake2b_chain(PyObject *self, PyObject *args) { return kvproc_page_chain(args, b2b_page, 1, "blake2b"); }

/* b2b(data, digest_size) -> bytes: plain BLAKE2b, for the tests' comparison with hashlib. */
static PyObject *b2b(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t outlen;
    if (!PyArg_ParseTuple(args, "y*n", &data, &outlen)) return NULL;
    if (outlen < 1 || outlen > 64) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "digest_size must be in 1..64");
        return NULL;
    }
    uint8_t out[64];
    b2b_hash((const uint8_t *)data.buf, (size_t)data.len, out, (size_t)outlen);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, outlen);
}

/* pack_tokens(list[int]) -> bytes: token ids as little-endian uint32, each checked to lie in [0, max_id]. One pass in C
 * (struct.pack(*tokens) spends ~18 us unpacking a 1,024-token list into call arguments). ValueError names the first
 * id out of range; a non-int raises TypeError. */
static PyObject *pack_tokens(PyObject *self, PyObject *args) {
    PyObject *list;
    long long max_id;
    if (!PyArg_ParseTuple(args, "O!L", &PyList_Type, &list, &max_id)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (!out) return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        if (!PyLong_Check(o)) {
            Py_DECREF(out);
            PyErr_Format(PyExc_TypeError, "token %zd is a %.100s, not an int", i, Py_TYPE(o)->tp_name);
            return NULL;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || v < 0 || v > max_id) {
            Py_DECREF(out);
            PyErr_Format(PyExc_ValueError, "token ids must lie in [0, %lld], got %R at position %zd", max_id, o, i);
            return NULL;
        }
        uint32_t u = (uint32_t)v;
        p[4 * i] = (uint8_t)u;
        p[4 * i + 1] = (uint8_t)(u >> 8);
        p[4 * i + 2] = (uint8_t)(u >> 16);
        p[4 * i + 3] = (uint8_t)(u >> 24);
    }
    return out;
}

/* ---- copy planning ------------------------------------------------------------------------------------------- */

/* Reads a sequence of ints (a list, or anything `PySequence_Fast` takes) into a new int64 array. */
static int64_t *read_ids(PyObject *obj, Py_ssize_t *n_out) {
    if (!PyList_Check(obj) && PyObject_CheckBuffer(obj)) {
        /* A 1-d int64 array (a packed run of ids, `paged_release(packed=True)`): one copy, no int per id. Any other
         * buffer (bytes, another dtype) goes through the sequence path below, as before. */
        Py_buffer v;
        if (PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
            const char *f = v.format ? v.format : "B";
            if (*f == '<' || *f == '=' || *f == '@') f++;
            if (v.ndim == 1 && v.itemsize == 8 && (f[0] == 'q' || f[0] == 'l') && f[1] == 0) {
                Py_ssize_t n = v.len / 8;
                int64_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
                if (out) memcpy(out, v.buf, (size_t)n * sizeof(int64_t));
                else PyErr_NoMemory();
                PyBuffer_Release(&v);
                *n_out = n;
                return out;
            }
            PyBuffer_Release(&v);
        } else {
            PyErr_Clear();
        }
    }
    PyObject *seq = PySequence_Fast(obj, "copy ids must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!out) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
        out[i] = (int64_t)v;
    }
    Py_DECREF(seq);
    *n_out = n;
    return out;
}

static int append_int(PyObject *list, int64_t v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (!o) return -1;
    int rc = PyList_Append(list, o);
    Py_DECREF(o);
    return rc;
}

/* copy_plan(src, dst, long_run) -> (long_runs, short_src, short_dst, (src_min, src_max, dst_min, dst_max)).
 * long_runs: [(src_start, dst_start, length)] of maximal runs (both sides advance by one) of at least `long_run`
 * blocks; short_src / short_dst: the ids of every block in a shorter run, in order. `long_run` 1 puts every run in
 * long_runs. Bounds are None for an empty order. */
static PyObject *copy_plan(PyObject *self, PyObject *args) {
    PyObject *src_obj, *dst_obj;
    Py_ssize_t long_run;
    if (!PyArg_ParseTuple(args, "OOn", &src_obj, &dst_obj, &long_run)) return NULL;
    Py_ssize_t n = 0, nd = 0;
    int64_t *s = read_ids(src_obj, &n);
    if (!s) return NULL;
    int64_t *d = read_ids(dst_obj, &nd);
    if (!d) {
        PyMem_Free(s);
        return NULL;
    }
    PyObject *runs = NULL, *ss = NULL, *sd = NULL, *bounds = NULL, *result = NULL;
    if (n != nd) {
        PyErr_Format(PyExc_ValueError, "%zd source ids against %zd destination ids", n, nd);
        goto done;
    }
    runs = PyList_New(0);
    ss = PyList_New(0);
    sd = PyList_New(0);
    if (!runs || !ss || !sd) goto done;
    if (n == 0) {
        Py_INCREF(Py_None);
        bounds = Py_None;
    } else {
        int64_t smin = s[0], smax = s[0], dmin = d[0], dmax = d[0];
        Py_ssize_t start = 0;
        for (Py_ssize_t i = 1; i <= n; i++) {
            if (i < n) {
                if (s[i] < smin) smin = s[i];
                if (s[i] > smax) smax = s[i];
                if (d[i] < dmin) dmin = d[i];
                if (d[i] > dmax) dmax = d[i];
                if (s[i] == s[i - 1] + 1 && d[i] == d[i - 1] + 1) continue;
            }
            Py_ssize_t k = i - start; /* the run [start, i) ends here */
            if (k >= long_run) {
                PyObject *t = Py_BuildValue("(LLn)", (long long)s[start], (long long)d[start], k);
                if (!t) goto done;
                int rc = PyList_Append(runs, t);
                Py_DECREF(t);
                if (rc) goto done;
            } else {
                for (Py_ssize_t j = start; j < i; j++)
                    if (append_int(ss, s[j]) || append_int(sd, d[j])) goto done;
            }
            start = i;
        }
        bounds = Py_BuildValue("(LLLL)", (long long)smin, (long long)smax, (long long)dmin, (long long)dmax);
        if (!bounds) goto done;
    }
    result = PyTuple_Pack(4, runs, ss, sd, bounds);
done:
    Py_XDECREF(runs);
    Py_XDECREF(ss);
    Py_XDECREF(sd);
    Py_XDECREF(bounds);
    PyMem_Free(s);
    PyMem_Free(d);
    return result;
}

/* copy_rows(dst, dst_stride, dst_ids, src, src_stride, src_ids, row_bytes[, gil_bytes]) -> bytes copied.
 * Row dst_ids[i] of `dst` (a writable contiguous buffer seen as rows `dst_stride` bytes apart) gets the first
 * `row_bytes` of row src_ids[i] of `src`. Every id is checked before any byte moves (an IndexError names the first bad
 * one, nothing half-applied); then one memmove per maximal run where both sides' rows are packed (stride ==
 * row_bytes) and advance by one, else one per row. What it replaces: numpy's fancy-index gather + scatter (two passes
 * over the bytes and ~10 us of fixed cost per arena) and a Python slice copy per run.
 * The GIL is released for a copy of at least `gil_bytes` (default 1 MiB; 0: always): getting it back can mean waiting
 * for another thread's switch interval, far more than a small copy takes -- right for a load on the worker's socket
 * thread, whose reply is waited for; a save on a handler thread releases it always, so that thread keeps serving. */
static PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj, *dids_obj, *sids_obj;
    Py_ssize_t dstride, sstride, row, gil_bytes = (Py_ssize_t)1 << 20;
    if (!PyArg_ParseTuple(args, "OnOOnOn|n", &dst_obj, &dstride, &dids_obj, &src_obj, &sstride, &sids_obj, &row,
                          &gil_bytes))
        return NULL;
    if (dstride <= 0 || sstride <= 0 || row < 0 || row > dstride || row > sstride) {
        PyErr_Format(PyExc_ValueError, "copy_rows: bad geometry (strides %zd / %zd, row %zd)", dstride, sstride, row);
        return NULL;
    }
    Py_buffer dv, sv;
    if (PyObject_GetBuffer(dst_obj, &dv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(src_obj, &sv, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    Py_ssize_t n = 0, ns = 0;
    int64_t *d = NULL, *s = NULL;
    PyObject *result = NULL;
    if (!(d = read_ids(dids_obj, &n)) || !(s = read_ids(sids_obj, &ns))) goto done;
    if (n != ns) {
        PyErr_Format(PyExc_ValueError, "copy_rows: %zd destination ids against %zd source ids", n, ns);
        goto done;
    }
    /* A row fits when id * stride + row <= len, i.e. id <= (len - row) / stride (no overflow on large ids). */
    Py_ssize_t dmax = dv.len < row ? -1 : (dv.len - row) / dstride, smax = sv.len < row ? -1 : (sv.len - row) / sstride;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (d[i] < 0 || d[i] > dmax || s[i] < 0 || s[i] > smax) {
            PyErr_Format(PyExc_IndexError, "copy_rows: ids out of range: pair %zd (dst %lld, src %lld) outside [0, %zd] x "
                         "[0, %zd]", i, (long long)d[i], (long long)s[i], dmax, smax);
            goto done;
        }
    }
    uint8_t *db = dv.buf;
    const uint8_t *sb = sv.buf;
    int packed = dstride == row && sstride == row;
    PyThreadState *ts = n * row >= gil_bytes ? PyEval_SaveThread() : NULL;
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t k = 1;
        if (packed)
            while (i + k < n && d[i + k] == d[i] + k && s[i + k] == s[i] + k) k++;
        /* memmove: the one caller that copies within an arena (a device copy) may name overlapping rows */
        memmove(db + d[i] * dstride, sb + s[i] * sstride, (size_t)(k * row));
        i += k;
    }
    if (ts) PyEval_RestoreThread(ts);
    result = PyLong_FromSsize_t(n * row);
done:
    PyMem_Free(d);
    PyMem_Free(s);
    PyBuffer_Release(&dv);
    PyBuffer_Release(&sv);
    return result;
}

/* ---- paged block book-keeping ------------------------------------------------------------------------------- */
/* The per-block loops of `kvproc.core.paged.PagedBlocks` over its numpy arrays (refcount int32, generation int64, hashed
 * bool, the LRU's stamp int64), written through the buffer protocol. numpy does each of these as several calls of
 * 1-4 us fixed cost (a 64-id list alone takes ~4 us to become an array); here each is one pass. Every function checks
 * all ids first and changes nothing when one is bad, like the numpy forms. Callers hold the pool's lock. */

typedef struct {
    Py_buffer view;
    Py_ssize_t n;
} Arr;

static int get_arr(PyObject *obj, Arr *a, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (a->view.itemsize != itemsize || a->view.ndim != 1) {
        PyErr_Format(PyExc_TypeError, "%s: expected a 1-d array of %zd-byte items", what, itemsize);
        PyBuffer_Release(&a->view);
        return -1;
    }
    a->n = a->view.shape ? a->view.shape[0] : a->view.len / itemsize;
    return 0;
}

/* Several arrays at once, all or none (on failure the ones already taken are released); `limit` gets the shortest
 * length, the bound every id is checked against. */
static int get_arrs(int n, PyObject *const *objs, Arr *arrs, const Py_ssize_t *itemsizes, const char *const *names,
                    Py_ssize_t *limit) {
    for (int i = 0; i < n; i++) {
        if (get_arr(objs[i], &arrs[i], itemsizes[i], names[i])) {
            while (i--) PyBuffer_Release(&arrs[i].view);
            return -1;
        }
        if (i == 0 || arrs[i].n < *limit) *limit = arrs[i].n;
    }
    return 0;
}

static void release_arrs(int n, Arr *arrs) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&arrs[i].view);
}

/* ids (any int sequence) into a new array, each checked to lie in [0, limit). */
static int64_t *read_ids_in(PyObject *obj, Py_ssize_t limit, Py_ssize_t *n_out) {
    int64_t *ids = read_ids(obj, n_out);
    if (!ids) return NULL;
    for (Py_ssize_t i = 0; i < *n_out; i++) {
        if (ids[i] < 0 || ids[i] >= limit) {
            PyErr_Format(PyExc_IndexError, "block id %lld out of range [0, %zd)", (long long)ids[i], limit);
            PyMem_Free(ids);
            return NULL;
        }
    }
    return ids;
}

static PyObject *first_ids(const int64_t *ids, const uint8_t *bad, Py_ssize_t n) {
    PyObject *l = PyList_New(0); /* at most 8 offending ids, for the error message */
    if (!l) return NULL;
    for (Py_ssize_t i = 0; i < n && PyList_GET_SIZE(l) < 8; i++)
        if (bad[i] && append_int(l, ids[i])) {
            Py_DECREF(l);
            return NULL;
        }
    return l;
}

/* paged_take(refcount, generation, ids) -> bytearray of int64: hand the blocks out (refcount 1, generation + 1) and
 * return their new generations (a reservation's handle needs them: one pass instead of a second call). */
static PyObject *paged_take(PyObject *self, PyObject *args) {
    PyObject *objs[2], *ids_o;
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &ids_o)) return NULL;
    Arr a[2];
    Py_ssize_t limit, n;
    if (get_arrs(2, objs, a, (const Py_ssize_t[]){4, 8}, (const char *const[]){"refcount", "generation"}, &limit))
        return NULL;
    int64_t *ids = read_ids_in(ids_o, limit, &n);
    PyObject *out = ids ? PyByteArray_FromStringAndSize(NULL, 8 * n) : NULL;
    if (out) {
        int32_t *r = a[0].view.buf;
        int64_t *g = a[1].view.buf, *o = (int64_t *)PyByteArray_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            r[ids[i]] = 1;
            o[i] = g[ids[i]] += 1;
        }
    }
    PyMem_Free(ids);
    release_arrs(2, a);
    return out;
}

/* paged_gens(generation, ids) -> bytearray of int64: the blocks' generations (np.frombuffer makes it an array). */
static PyObject *paged_gens(PyObject *self, PyObject *args) {
    PyObject *gen_o, *ids_o;
    if (!PyArg_ParseTuple(args, "OO", &gen_o, &ids_o)) return NULL;
    Arr gen;
    if (get_arr(gen_o, &gen, 8, "generation")) return NULL;
    Py_ssize_t n;
    int64_t *ids = read_ids_in(ids_o, gen.n, &n);
    PyObject *out = NULL;
    if (ids) {
        out = PyByteArray_FromStringAndSize(NULL, 8 * n);
        if (out) {
            int64_t *o = (int64_t *)PyByteArray_AS_STRING(out);
            const int64_t *g = gen.view.buf;
            for (Py_ssize_t i = 0; i < n; i++) o[i] = g[ids[i]];
        }
        PyMem_Free(ids);
    }
    PyBuffer_Release(&gen.view);
    return out;
}

/* paged_check(generation, ids, gens) -> list of (at most 8) ids whose generation differs from `gens` (int64). */
static PyObject *paged_check(PyObject *self, PyObject *args) {
    PyObject *gen_o, *ids_o, *want_o;
    if (!PyArg_ParseTuple(args, "OOO", &gen_o, &ids_o, &want_o)) return NULL;
    Arr gen;
    if (get_arr(gen_o, &gen, 8, "generation")) return NULL;
    Py_buffer want;
    if (PyObject_GetBuffer(want_o, &want, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&gen.view);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n = 0;
    int64_t *ids = NULL;
    uint8_t *bad = NULL;
    if (want.itemsize != 8) {
        PyErr_SetString(PyExc_TypeError, "gens: expected int64 items");
        goto done;
    }
    ids = read_ids_in(ids_o, gen.n, &n);
    if (!ids) goto done;
    if (n != want.len / 8) {
        PyErr_Format(PyExc_ValueError, "%zd ids against %zd generations", n, want.len / 8);
        goto done;
    }
    bad = PyMem_Calloc((size_t)(n ? n : 1), 1);
    if (!bad) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *g = gen.view.buf, *w = want.buf;
    for (Py_ssize_t i = 0; i < n; i++) bad[i] = g[ids[i]] != w[i];
    out = first_ids(ids, bad, n);
done:
    PyMem_Free(bad);
    PyMem_Free(ids);
    PyBuffer_Release(&want);
    PyBuffer_Release(&gen.view);
    return out;
}

/* paged_acquire(refcount, hashed, stamp, ids) -> (blocks taken out of the LRU, list of free blocks asked for).
 * A block with no reference leaves the LRU (stamp -1); every block gains one reference. If any block is free (no
 * reference and no hash) nothing changes and the second item names them (the caller raises). */
static PyObject *paged_acquire(PyObject *self, PyObject *args) {
    PyObject *objs[3], *ids_o;
    if (!PyArg_ParseTuple(args, "OOOO", &objs[0], &objs[1], &objs[2], &ids_o)) return NULL;
    Arr a[3];
    Py_ssize_t limit, n = 0;
    if (get_arrs(3, objs, a, (const Py_ssize_t[]){4, 1, 8}, (const char *const[]){"refcount", "hashed", "stamp"},
                 &limit))
        return NULL;
    PyObject *out = NULL;
    int64_t *ids = read_ids_in(ids_o, limit, &n);
    uint8_t *bad = NULL;
    if (!ids) goto done;
    int32_t *r = a[0].view.buf;
    const uint8_t *h = a[1].view.buf;
    int64_t *st = a[2].view.buf;
    int any_bad = 0;
    bad = PyMem_Calloc((size_t)(n ? n : 1), 1);
    if (!bad) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (r[ids[i]] == 0 && !h[ids[i]]) bad[i] = any_bad = 1;
    if (any_bad) {
        PyObject *l = first_ids(ids, bad, n);
        if (l) out = Py_BuildValue("(nN)", (Py_ssize_t)0, l);
        goto done;
    }
    Py_ssize_t removed = 0;
    for (Py_ssize_t i = 0; i < n; i++) removed += r[ids[i]] == 0 && st[ids[i]] >= 0;
    out = Py_BuildValue("(nN)", removed, PyList_New(0)); /* before any write: a failed allocation changes nothing */
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        if (r[b] == 0) st[b] = -1;
        r[b] += 1;
    }
done:
    PyMem_Free(bad);
    PyMem_Free(ids);
    release_arrs(3, a);
    return out;
}

/* paged_release(refcount, hashed, ids) -> (hashed, unhashed, underflow): drop one reference from each block, last id
 * first (a chain's tail goes into the LRU before its head); the blocks that became unreferenced, split by whether
 * they carry a hash (-> LRU) or not (-> free list). If any block would go below zero nothing changes and `underflow`
 * names them (the caller raises). `packed`: the hashed ones as one bytes of int64 instead of a list of ints. */
static PyObject *paged_release(PyObject *self, PyObject *args) {
    PyObject *objs[2], *ids_o;
    int packed = 0;
    if (!PyArg_ParseTuple(args, "OOO|p", &objs[0], &objs[1], &ids_o, &packed)) return NULL;
    Arr a[2];
    Py_ssize_t limit, n = 0;
    if (get_arrs(2, objs, a, (const Py_ssize_t[]){4, 1}, (const char *const[]){"refcount", "hashed"}, &limit))
        return NULL;
    PyObject *out = NULL, *hz = NULL, *uz = NULL;
    int64_t *ids = read_ids_in(ids_o, limit, &n);
    uint8_t *bad = NULL;
    if (!ids) goto done;
    int32_t *r = a[0].view.buf;
    const uint8_t *h = a[1].view.buf;
    int any_bad = 0;
    bad = PyMem_Calloc((size_t)(n ? n : 1), 1);
    hz = PyList_New(0);
    uz = PyList_New(0);
    if (!bad || !hz || !uz) {
        if (!bad) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (r[ids[i]] <= 0) bad[i] = any_bad = 1;
    if (any_bad) {
        PyObject *l = first_ids(ids, bad, n);
        if (l) out = Py_BuildValue("(OON)", hz, uz, l);
        goto done;
    }
    /* The lists first (ids are distinct: a block reaches zero iff its count is 1), the counts after: a failed
     * allocation leaves every refcount as it was. */
    if (packed) {
        /* The hashed zeros as one bytes of int64 (the LRU keeps it as its run): no int object per id, and none kept
         * alive per cached block (an unbounded pool caches millions). */
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++) k += r[ids[i]] == 1 && h[ids[i]];
        PyObject *hb = PyBytes_FromStringAndSize(NULL, k * (Py_ssize_t)sizeof(int64_t));
        if (!hb) goto done;
        int64_t *w = (int64_t *)PyBytes_AS_STRING(hb);
        for (Py_ssize_t i = n - 1; i >= 0; i--) {
            if (r[ids[i]] != 1) continue;
            if (h[ids[i]]) *w++ = ids[i];
            else if (append_int(uz, ids[i])) {
                Py_DECREF(hb);
                goto done;
            }
        }
        Py_DECREF(hz);
        hz = hb;
    } else {
        for (Py_ssize_t i = n - 1; i >= 0; i--)
            if (r[ids[i]] == 1 && append_int(h[ids[i]] ? hz : uz, ids[i])) goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) r[ids[i]] -= 1;
    out = Py_BuildValue("(OOO)", hz, uz, Py_None);
done:
    Py_XDECREF(hz);
    Py_XDECREF(uz);
    PyMem_Free(bad);
    PyMem_Free(ids);
    release_arrs(2, a);
    return out;
}

/* A pool's per-block keys: the list of bytes / None it kept until issue 35 (`*keys` stays NULL, `*limit` its length),
 * or a writable C-contiguous buffer of 16 bytes per block (`PagedBlocks.keys`: no object per indexed page; `*limit`
 * its blocks). 0, or -1 with TypeError. Release `view` after when `*keys` was set. */
static int get_keys(PyObject *bh, Py_buffer *view, uint8_t **keys, Py_ssize_t *limit) {
    *keys = NULL;
    if (PyList_Check(bh)) {
        *limit = PyList_GET_SIZE(bh);
        return 0;
    }
    if (PyObject_GetBuffer(bh, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % 16) {
        PyErr_Format(PyExc_TypeError, "block_hash: a list or a buffer of 16-byte keys, got %zd bytes", view->len);
        PyBuffer_Release(view);
        return -1;
    }
    *keys = view->buf;
    *limit = view->len / 16;
    return 0;
}

/* paged_register(hashed, block_hash, index, ids, hashes, added=None) -> blocks registered: each block not hashed yet
 * takes its hash (block_hash[id] = h, hashed[id] = True) and the index entry (index[h] = id: the newest block wins).
 * `index` is a `PrefixIndex` (_prefix_index.c, which does the per-page work). `added`, a list when the caller
 * publishes KV events (else None: no extra work), gets the position in `hashes` of every hash the index did not hold
 * before (a displaced duplicate changes the entry's owner, not the key set). */
static PyObject *paged_register(PyObject *self, PyObject *args) {
    PyObject *hashed_o, *bh, *index, *ids_o, *hashes_o, *added = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOO|O", &hashed_o, &bh, &index, &ids_o, &hashes_o, &added)) return NULL;
    if (!kvproc_is_prefix_index(index)) {
        PyErr_Format(PyExc_TypeError, "index must be a PrefixIndex, not %.100s", Py_TYPE(index)->tp_name);
        return NULL;
    }
    if (added == Py_None) added = NULL;
    else if (!PyList_Check(added)) {
        PyErr_SetString(PyExc_TypeError, "added must be a list or None");
        return NULL;
    }
    Arr hashed;
    Py_buffer kview;
    uint8_t *keys;
    Py_ssize_t nkeys;
    if (get_arr(hashed_o, &hashed, 1, "hashed")) return NULL;
    if (get_keys(bh, &kview, &keys, &nkeys)) {
        PyBuffer_Release(&hashed.view);
        return NULL;
    }
    PyObject *hs = NULL, *out = NULL;
    Py_ssize_t n = 0, limit = hashed.n < nkeys ? hashed.n : nkeys;
    int64_t *ids = read_ids_in(ids_o, limit, &n);
    if (!ids) goto done;
    hs = PySequence_Fast(hashes_o, "hashes must be a sequence of bytes");
    if (!hs) goto done;
    if (PySequence_Fast_GET_SIZE(hs) != n) {
        PyErr_Format(PyExc_ValueError, "%zd blocks against %zd hashes", n, PySequence_Fast_GET_SIZE(hs));
        goto done;
    }
    Py_ssize_t done_n = 0;
    if (kvproc_prefix_register(index, hashed.view.buf, bh, keys, ids, PySequence_Fast_ITEMS(hs), n, added,
                               &done_n) == 0)
        out = PyLong_FromSsize_t(done_n);
done:
    Py_XDECREF(hs);
    PyMem_Free(ids);
    PyBuffer_Release(&hashed.view);
    if (keys) PyBuffer_Release(&kview);
    return out;
}

/* paged_unhash(hashed, block_hash, index, ids, removed=None): evicted blocks lose their hash, and their index entry
 * where they still own it (a displaced duplicate does not: that entry belongs to the newer block). `index` is a
 * `PrefixIndex`; `removed`, a list when the caller publishes KV events (else None), gets every hash whose index entry
 * went. */
static PyObject *paged_unhash(PyObject *self, PyObject *args) {
    PyObject *hashed_o, *bh, *index, *ids_o, *removed = Py_None;
    if (!PyArg_ParseTuple(args, "OOOO|O", &hashed_o, &bh, &index, &ids_o, &removed)) return NULL;
    if (!kvproc_is_prefix_index(index)) {
        PyErr_Format(PyExc_TypeError, "index must be a PrefixIndex, not %.100s", Py_TYPE(index)->tp_name);
        return NULL;
    }
    if (removed == Py_None) removed = NULL;
    else if (!PyList_Check(removed)) {
        PyErr_SetString(PyExc_TypeError, "removed must be a list or None");
        return NULL;
    }
    Arr hashed;
    Py_buffer kview;
    uint8_t *keys;
    Py_ssize_t nkeys;
    if (get_arr(hashed_o, &hashed, 1, "hashed")) return NULL;
    if (get_keys(bh, &kview, &keys, &nkeys)) {
        PyBuffer_Release(&hashed.view);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n = 0, limit = hashed.n < nkeys ? hashed.n : nkeys;
    int64_t *ids = read_ids_in(ids_o, limit, &n);
    if (!ids) goto done;
    uint8_t *h = hashed.view.buf;
    if (keys) { /* the key array: a block's key is live while it is hashed */
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t b = ids[i];
            if (h[b]) {
                const uint8_t *key = keys + 16 * b;
                if (removed && kvproc_prefix_owns_raw(index, key, b)) {
                    PyObject *kb = PyBytes_FromStringAndSize((const char *)key, 16);
                    int rc = kb ? PyList_Append(removed, kb) : -1;
                    Py_XDECREF(kb);
                    if (rc) goto done;
                }
                kvproc_prefix_unhash_raw(index, key, b);
            }
            h[b] = 0;
        }
        Py_INCREF(Py_None);
        out = Py_None;
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        PyObject *key = PyList_GET_ITEM(bh, b);
        if (key != Py_None) {
            /* the list first, so a failed append changes nothing */
            if (removed && kvproc_prefix_owns(index, key, b) && PyList_Append(removed, key)) goto done;
            kvproc_prefix_unhash(index, key, b);
            Py_INCREF(Py_None);
            PyList_SetItem(bh, b, Py_None);
        }
        h[b] = 0;
    }
    Py_INCREF(Py_None);
    out = Py_None;
done:
    PyMem_Free(ids);
    PyBuffer_Release(&hashed.view);
    if (keys) PyBuffer_Release(&kview);
    return out;
}

/* lru_stamp(stamp, ids, seq) -> how many of `ids` were already stamped (in the LRU): `RunLru.insert`'s per-block
 * work, stamping every id with the new run's sequence number; `RunLru.remove` is seq -1 (not in the LRU). */
static PyObject *lru_stamp(PyObject *self, PyObject *args) {
    PyObject *stamp_o, *ids_o;
    long long seq;
    if (!PyArg_ParseTuple(args, "OOL", &stamp_o, &ids_o, &seq)) return NULL;
    Arr stamp;
    if (get_arr(stamp_o, &stamp, 8, "stamp")) return NULL;
    Py_ssize_t n;
    int64_t *ids = read_ids_in(ids_o, stamp.n, &n);
    PyObject *out = NULL;
    if (ids) {
        int64_t *st = stamp.view.buf;
        Py_ssize_t present = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            present += st[ids[i]] >= 0;
            st[ids[i]] = seq;
        }
        PyMem_Free(ids);
        out = PyLong_FromSsize_t(present);
    }
    PyBuffer_Release(&stamp.view);
    return out;
}

/* fence_cas(row, index, expected, desired) -> bool: one atomic compare-and-swap of row[index] (a writable int64 buffer,
 * in shared memory: the host tier's save-fence row, `kvproc/tiers/save_fence.py`). The tier and the copy workers are
 * separate processes writing the same word, so the read-compare-write must be one instruction. */
static PyObject *fence_cas(PyObject *self, PyObject *args) {
    Py_buffer row;
    Py_ssize_t index;
    long long expected, desired;
    if (!PyArg_ParseTuple(args, "w*nLL", &row, &index, &expected, &desired)) return NULL;
    if (row.len % 8 || index < 0 || index >= row.len / 8) {
        PyErr_Format(PyExc_IndexError, "fence_cas: index %zd outside a row of %zd int64", index, row.len / 8);
        PyBuffer_Release(&row);
        return NULL;
    }
    int64_t *word = (int64_t *)row.buf + index;
    int64_t want = (int64_t)expected;
    int ok = __atomic_compare_exchange_n(word, &want, (int64_t)desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&row);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"blake2b_chain", blake2b_chain, METH_VARARGS, "blake2b_chain(data, page_bytes, seed) -> list of 16-byte hashes"},
    {"b2b", b2b, METH_VARARGS, "b2b(data, digest_size) -> BLAKE2b digest (tests)"},
    {"pack_tokens", pack_tokens, METH_VARARGS, "pack_tokens(tokens, max_id) -> little-endian uint32 bytes"},
    {"copy_plan", copy_plan, METH_VARARGS,
     "copy_plan(src, dst, long_run) -> (long_runs, short_src, short_dst, bounds or None)"},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, dst_stride, dst_ids, src, src_stride, src_ids, row_bytes[, gil_bytes]) -> bytes copied"},
    {"paged_take", paged_take, METH_VARARGS, "paged_take(refcount, generation, ids) -> new generations (int64)"},
    {"paged_gens", paged_gens, METH_VARARGS, "paged_gens(generation, ids) -> bytearray of int64"},
    {"paged_check", paged_check, METH_VARARGS, "paged_check(generation, ids, gens) -> stale ids (<= 8)"},
    {"paged_acquire", paged_acquire, METH_VARARGS, "paged_acquire(refcount, hashed, stamp, ids) -> (left LRU, free)"},
    {"paged_release", paged_release, METH_VARARGS,
     "paged_release(refcount, hashed, ids, packed=False) -> (hashed zeros (bytes of int64 if packed), unhashed zeros, "
     "underflow ids or None)"},
    {"paged_register", paged_register, METH_VARARGS, "paged_register(hashed, block_hash, index, ids, hashes, added=None) -> n"},
    {"paged_unhash", paged_unhash, METH_VARARGS, "paged_unhash(hashed, block_hash, index, ids, removed=None)"},
    {"lru_stamp", lru_stamp, METH_VARARGS, "lru_stamp(stamp, ids, seq) -> ids already stamped"},
    {"fence_cas", fence_cas, METH_VARARGS, "fence_cas(row, index, expected, desired) -> swapped (atomic)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvproc.native._native", "kvproc's compiled hot-path loops", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod && (kvproc_add_kv_events(mod) < 0 || kvproc_add_digest_chain(mod) < 0 ||
                kvproc_add_sketch(mod) < 0 || kvproc_add_prefix_index(mod) < 0))
        Py_CLEAR(mod);
    return mod;
}
