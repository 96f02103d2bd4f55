/* Chained page hashes, `h_i = H(h_{i-1} || page_i)` as in `kvproc.core.hashing`: the one chain loop every family
 * runs (`kvproc_page_chain`; `_native.c`'s BLAKE2b too), and the families `_native.c` does not implement itself:
 * SHA-256 (truncated to 128 bits) and XXH3-128.
 *
 * Why here and not in Python: the chain is sequential, so Python pays one hashlib / xxhash call per page (~0.5 us,
 * most of it call overhead and a bytes object for `h + page`), which was ~60% of the trace replay with sha256. Why
 * through function pointers and not our own SHA-256 / XXH3: the process already has both implementations loaded
 * (OpenSSL's libcrypto behind hashlib, with its SHA extensions where the CPU has them; the xxhash package's
 * `XXH3_128bits`), and linking either at build time would need headers a fresh machine may lack. Python resolves
 * the two symbols once with ctypes (`kvproc/native/digests.py`) and installs their addresses here; a chain whose
 * function was not installed raises, and the caller keeps its per-page loop. Each page is one call with no Python
 * object and no GIL. Tests compare every chain with hashlib / xxhash.
 */
#include "_native.h"

#include <string.h>

/* OpenSSL's low-level `SHA256_Init` / `SHA256_Update` / `SHA256_Final` (its one-shot `SHA256()` goes through an EVP
 * fetch per call in OpenSSL 3, several times the cost of one 80-byte hash). Their context is opaque here: 112 bytes
 * in every OpenSSL release (eight state words, two counters, a 64-byte block, two ints); `ShaCtx` reserves more. */
typedef struct {
    _Alignas(16) unsigned char opaque[256];
} ShaCtx;
typedef int (*sha256_init_fn)(ShaCtx *);
typedef int (*sha256_update_fn)(ShaCtx *, const void *, size_t);
typedef int (*sha256_final_fn)(unsigned char *, ShaCtx *);
/* xxhash's `XXH3_128bits(data, len)`: the 128-bit value as two native integers (XXH128_hash_t). */
typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_value;
typedef xxh128_value (*xxh3_128_fn)(const void *, size_t);

static sha256_init_fn sha256_init = NULL;
static sha256_update_fn sha256_update = NULL;
static sha256_final_fn sha256_final = NULL;
static xxh3_128_fn installed_xxh3 = NULL;

static void store64_be(uint8_t *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8) p[i] = (uint8_t)v;
}

/* One page: `buf` holds the parent's 16 bytes then the page; `out` gets this page's 16-byte hash. */
static void sha256_page(const uint8_t *buf, size_t len, uint8_t *out) {
    uint8_t md[32];
    ShaCtx ctx;
    sha256_init(&ctx);
    sha256_update(&ctx, buf, len);
    sha256_final(md, &ctx);
    memcpy(out, md, KVPROC_CHAIN_DIGEST);
}

static void xxh3_page(const uint8_t *buf, size_t len, uint8_t *out) {
    xxh128_value v = installed_xxh3(buf, len);
    /* xxhash's canonical form (what `xxh3_128_digest` returns): the high word then the low word, big-endian. */
    store64_be(out, v.high64);
    store64_be(out + 8, v.low64);
}

PyObject *kvproc_page_chain(PyObject *args, kvproc_page_fn page, int installed, const char *what) {
    Py_buffer data, seed;
    Py_ssize_t page_bytes;
    if (!PyArg_ParseTuple(args, "y*ny*", &data, &page_bytes, &seed)) return NULL;
    PyObject *result = NULL;
    uint8_t *digests = NULL, *buf = NULL;
    if (!installed) {
        PyErr_Format(PyExc_RuntimeError, "%s_chain: no %s function installed (install_digests)", what, what);
        goto done;
    }
    if (page_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_bytes must be positive");
        goto done;
    }
    if (seed.len != KVPROC_CHAIN_DIGEST) {
        PyErr_Format(PyExc_ValueError, "seed must be %d bytes, got %zd", KVPROC_CHAIN_DIGEST, seed.len);
        goto done;
    }
    Py_ssize_t n = data.len / page_bytes;
    digests = PyMem_RawMalloc((size_t)(n ? n : 1) * KVPROC_CHAIN_DIGEST);
    buf = PyMem_RawMalloc((size_t)(KVPROC_CHAIN_DIGEST + page_bytes));
    if (!digests || !buf) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *pages = (const uint8_t *)data.buf;
    memcpy(buf, seed.buf, KVPROC_CHAIN_DIGEST);
    Py_BEGIN_ALLOW_THREADS /* the buffers are pinned by Py_buffer; the hash functions touch no Python object */
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf + KVPROC_CHAIN_DIGEST, pages + i * page_bytes, (size_t)page_bytes);
        page(buf, (size_t)(KVPROC_CHAIN_DIGEST + page_bytes), digests + i * KVPROC_CHAIN_DIGEST);
        memcpy(buf, digests + i * KVPROC_CHAIN_DIGEST, KVPROC_CHAIN_DIGEST); /* the parent of the next page */
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (!result) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)digests + i * KVPROC_CHAIN_DIGEST, KVPROC_CHAIN_DIGEST);
        if (!b) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, b);
    }
done:
    PyMem_RawFree(digests);
    PyMem_RawFree(buf);
    PyBuffer_Release(&data);
    PyBuffer_Release(&seed);
    return result;
}

/* sha256_chain(data, page_bytes, seed) -> list[bytes]: SHA-256 truncated to 16 bytes, chained over every full page. */
static PyObject *sha256_chain(PyObject *self, PyObject *args) {
    return kvproc_page_chain(args, sha256_page, sha256_final != NULL, "sha256");
}

/* xxh3_chain(data, page_bytes, seed) -> list[bytes]: XXH3-128 (canonical bytes), chained over every full page. */
static PyObject *xxh3_chain(PyObject *self, PyObject *args) {
    return kvproc_page_chain(args, xxh3_page, installed_xxh3 != NULL, "xxh3");
}

/* install_digests(sha256_init, sha256_update, sha256_final, xxh3_128bits): the functions' addresses (0: leave that
 * family uninstalled). Only
 * `kvproc/native/digests.py` calls it, with addresses ctypes resolved from the loaded libraries: any other integer
 * would be called as a function. */
static PyObject *install_digests(PyObject *self, PyObject *args) {
    unsigned long long init, update, final, xxh;
    if (!PyArg_ParseTuple(args, "KKKK", &init, &update, &final, &xxh)) return NULL;
    if (init && update && final) {
        sha256_init = (sha256_init_fn)(uintptr_t)init;
        sha256_update = (sha256_update_fn)(uintptr_t)update;
        sha256_final = (sha256_final_fn)(uintptr_t)final;
    }
    if (xxh) installed_xxh3 = (xxh3_128_fn)(uintptr_t)xxh;
    return Py_BuildValue("(OO)", sha256_final ? Py_True : Py_False, installed_xxh3 ? Py_True : Py_False);
}

/* tokens_match(data, tokens, max_id) -> bool: True iff every id of `tokens` (int64, C-contiguous) lies in
 * [0, max_id] and equals the little-endian int32 at the same position of `data`, which holds at least as many.
 * `PageHashes.covers`' check that a chain was computed over a request's prompt, in one pass without the two
 * temporaries (validated int32 copy, bytes slice) of serialising the prompt again: ~3 us instead of ~20 for a
 * 14 k-token prompt. False covers every other case, which the caller then examines the slow way (same answer). */
static PyObject *tokens_match(PyObject *self, PyObject *args) {
    Py_buffer data, tok;
    PyObject *tok_o;
    long long max_id;
    if (!PyArg_ParseTuple(args, "y*OL", &data, &tok_o, &max_id)) return NULL;
    if (PyObject_GetBuffer(tok_o, &tok, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *f = tok.format ? tok.format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    int ok = tok.itemsize == 8 && (!strcmp(f, "l") || !strcmp(f, "q")) && data.len / 4 >= tok.len / 8;
    const int64_t *t = tok.buf;
    const uint8_t *d = data.buf;
    for (Py_ssize_t i = 0; ok && i < tok.len / 8; i++)
        ok = t[i] >= 0 && t[i] <= max_id && (uint32_t)t[i] == load32_le(d + 4 * i);
    PyBuffer_Release(&tok);
    PyBuffer_Release(&data);
    return PyBool_FromLong(ok);
}

static PyMethodDef digest_methods[] = {
    {"tokens_match", tokens_match, METH_VARARGS, "tokens_match(data, tokens, max_id) -> ids equal and in range"},
    {"sha256_chain", sha256_chain, METH_VARARGS, "sha256_chain(data, page_bytes, seed) -> list of 16-byte hashes"},
    {"xxh3_chain", xxh3_chain, METH_VARARGS, "xxh3_chain(data, page_bytes, seed) -> list of 16-byte hashes"},
    {"install_digests", install_digests, METH_VARARGS,
     "install_digests(sha256_init, sha256_update, sha256_final, xxh3_128bits) -> (sha256 installed, xxh3 installed)"},
    {NULL, NULL, 0, NULL},
};

int kvproc_add_digest_chain(PyObject *module) { return PyModule_AddFunctions(module, digest_methods); }
