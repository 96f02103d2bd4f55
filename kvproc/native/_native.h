/* What the source files of `kvproc.native._native` share. */
#ifndef KVPROC_NATIVE_H
#define KVPROC_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static inline uint64_t load64_le(const uint8_t *p) {
    /* Byte by byte: correct on any endianness; compilers turn it into one load on little-endian targets. */
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24) |
           ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline uint32_t load32_le(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* _kv_events.c: adds the EventLog type (a device pool's KV events, logged and written as msgpack); -1 with an exception set. */
int kvproc_add_kv_events(PyObject *module);

/* _digest_chain.c: the chained page hash loop of every family. `page` hashes one buffer (the parent's
 * KVPROC_CHAIN_DIGEST bytes then the page) into the page's digest; args are (data, page_bytes, seed); a family whose
 * function is not `installed` raises RuntimeError naming `what`. Returns a list of bytes, or NULL with an exception. */
#define KVPROC_CHAIN_DIGEST 16
typedef void (*kvproc_page_fn)(const uint8_t *, size_t, uint8_t *);
PyObject *kvproc_page_chain(PyObject *args, kvproc_page_fn page, int installed, const char *what);

/* _digest_chain.c: adds sha256_chain, xxh3_chain and install_digests; -1 with an exception set on failure. */
int kvproc_add_digest_chain(PyObject *module);

/* _sketch.c: adds sketch_add (lrfu's count-min sketch update); -1 with an exception set on failure. */
int kvproc_add_sketch(PyObject *module);

/* _prefix_index.c: the PrefixIndex type (a device pool's prefix index) and the pool's per-page steps on it. */
int kvproc_add_prefix_index(PyObject *module);
int kvproc_is_prefix_index(PyObject *o);
/* paged_register's work on a PrefixIndex: 0 (*done_n = blocks registered), or -1 with an exception set (nothing
 * changed, except when appending to `added` failed). `hashed`/`bh`/`ids` already checked against each other.
 * `keys`: NULL (the keys go into the list `bh`) or a per-block array of 16-byte keys (`bh` unused). */
int kvproc_prefix_register(PyObject *index, uint8_t *hashed, PyObject *bh, uint8_t *keys, const int64_t *ids,
                           PyObject **items, Py_ssize_t n, PyObject *added, Py_ssize_t *done_n);
/* 1 if block `b` owns `key`'s entry (and, for unhash, the entry went), else 0; never fails. */
int kvproc_prefix_owns(PyObject *index, PyObject *key, int64_t b);
int kvproc_prefix_unhash(PyObject *index, PyObject *key, int64_t b);
/* The same on a key's 16 raw bytes (`keys`, the pool's per-block key array, instead of the `bh` list). */
int kvproc_prefix_owns_raw(PyObject *index, const uint8_t *key, int64_t b);
int kvproc_prefix_unhash_raw(PyObject *index, const uint8_t *key, int64_t b);

#endif
