/* PrefixIndex: a device pool's prefix index (`kvproc.core.paged.PagedBlocks.index`), page hash (16 bytes) -> block
 * id, as one open-addressing table, with the pool's whole-chain operations on it.
 *
 * Why: the dict it replaces cost ~370 ns an insert and ~210 ns a lookup once it held millions of pages (the trace
 * replay's unbounded pool: ~1.1 M inserts per 2,000 requests): a dict entry points at a bytes key and an int value
 * object, its index and its entries are separate arrays, and it resizes by rehashing every object. Here an entry is
 * the 16 key bytes and the id inline (24 bytes, no object per entry), its bucket comes from the key's own bits (a
 * hash already; mixed, because tests use counters), and a chain's lookups or inserts first prefetch the buckets of
 * the pages a few ahead, so the cache misses of one chain overlap instead of following one another.
 *
 * Layout: linear probing over 2^k entries at load <= 1/2 (grown by doubling before a batch inserts, so an insert
 * never fails half-way through a batch); deletion shifts the following entries back (no tombstones). An empty
 * entry holds 0 where the id (+ 1) goes, so a new table is zeroed memory. To Python it is a mapping (len, [], in, get, iteration, keys /
 * values / items, == against a dict) so the store's stats, events and tests read it as they read the dict.
 *
 * Not thread-safe by itself: nothing here releases the GIL, and `BlockPool` calls it under its lock. */
#include "_native.h"

#include <string.h>
#include <sys/mman.h>

#define PI_KEY 16
#define PI_MIN_SIZE 64
#define PI_PREFETCH 8 /* pages ahead whose bucket a batch prefetches: enough to cover a DRAM miss */

typedef struct {
    uint64_t k0, k1;
    int64_t id1; /* block id + 1; 0 marks an empty entry, so a new table is zeroed memory (calloc) */
} PiEntry;

typedef struct {
    PyObject_HEAD PiEntry *ent;
    Py_ssize_t mask, used;
} PrefixIndex;

static PyTypeObject PrefixIndexType;

static inline Py_ssize_t pi_home(Py_ssize_t mask, uint64_t k0, uint64_t k1) {
    uint64_t h = (k0 ^ (k1 * 0x9E3779B97F4A7C15ULL)) * 0xBF58476D1CE4E5B9ULL;
    return (Py_ssize_t)((h ^ (h >> 29)) & (uint64_t)mask);
}

/* 1: `k` is a 16-byte bytes (its halves in k0, k1); 0: it cannot be a key (a lookup's miss). */
static inline int pi_split(PyObject *k, uint64_t *k0, uint64_t *k1) {
    if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != PI_KEY) return 0;
    const uint8_t *b = (const uint8_t *)PyBytes_AS_STRING(k);
    *k0 = load64_le(b);
    *k1 = load64_le(b + 8);
    return 1;
}

/* A key an insert takes: 0, or -1 with TypeError / ValueError (the dict took any bytes; the pool's are 16). */
static int pi_key_checked(PyObject *k, Py_ssize_t i, uint64_t *k0, uint64_t *k1) {
    if (!PyBytes_Check(k)) {
        PyErr_Format(PyExc_TypeError, "hash %zd is a %.100s, not bytes", i, Py_TYPE(k)->tp_name);
        return -1;
    }
    if (!pi_split(k, k0, k1)) {
        PyErr_Format(PyExc_ValueError, "hash %zd has %zd bytes, the prefix index keys %d-byte page hashes", i,
                     PyBytes_GET_SIZE(k), PI_KEY);
        return -1;
    }
    return 0;
}

static inline Py_ssize_t pi_find(const PrefixIndex *t, uint64_t k0, uint64_t k1) {
    for (Py_ssize_t i = pi_home(t->mask, k0, k1);; i = (i + 1) & t->mask) {
        const PiEntry *e = &t->ent[i];
        if (e->id1 == 0) return -1;
        if (e->k0 == k0 && e->k1 == k1) return i;
    }
}

static inline void pi_prefetch(const PrefixIndex *t, PyObject *k) {
    uint64_t k0, k1;
    if (pi_split(k, &k0, &k1)) __builtin_prefetch(&t->ent[pi_home(t->mask, k0, k1)], 0, 1);
}

/* Tables of PI_MAP_BYTES or more are their own mapping, populated in the mmap call: a grown table of millions of
 * entries (the trace replay's ends at 16 M entries, 384 MiB) was otherwise faulted in one 4 KiB page at a time,
 * each fault an exception, a zeroed page and a memory-cgroup charge (~0.3 s of a 4 s replay). Populating takes the
 * same zeroed pages in one system call. Which allocator a table came from follows from its size alone. */
#define PI_MAP_BYTES (4u << 20)

static PiEntry *pi_alloc(Py_ssize_t size) {
    size_t bytes = (size_t)size * sizeof(PiEntry);
    if (bytes >= PI_MAP_BYTES) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (p == MAP_FAILED) {
            PyErr_NoMemory();
            return NULL;
        }
        return p; /* anonymous pages are zero: every entry empty */
    }
    PiEntry *ent = PyMem_Calloc((size_t)size, sizeof(PiEntry));
    if (!ent) PyErr_NoMemory();
    return ent;
}

static void pi_free(PiEntry *ent, Py_ssize_t size) {
    size_t bytes = (size_t)size * sizeof(PiEntry);
    if (!ent) return;
    if (bytes >= PI_MAP_BYTES) munmap(ent, bytes);
    else PyMem_Free(ent);
}

/* Room for `extra` more keys at load <= 1/2: 0, or -1 with MemoryError and the table unchanged. */
static int pi_reserve(PrefixIndex *t, Py_ssize_t extra) {
    Py_ssize_t size = t->mask + 1, need = t->used + extra;
    if (t->ent && 2 * need <= size) return 0;
    while (2 * need > size) size *= 2;
    PiEntry *ent = pi_alloc(size), *old = t->ent;
    if (!ent) return -1;
    Py_ssize_t mask = size - 1;
    for (Py_ssize_t j = 0; old && j <= t->mask; j++) {
        if (old[j].id1 == 0) continue;
        Py_ssize_t i = pi_home(mask, old[j].k0, old[j].k1);
        while (ent[i].id1 != 0) i = (i + 1) & mask;
        ent[i] = old[j];
    }
    pi_free(old, t->mask + 1);
    t->ent = ent;
    t->mask = mask;
    return 0;
}

/* Set key -> id (room reserved by the caller); 1 if the key was new, 0 if it changed owner. */
static inline int pi_set(PrefixIndex *t, uint64_t k0, uint64_t k1, int64_t id) {
    Py_ssize_t i = pi_home(t->mask, k0, k1);
    for (;; i = (i + 1) & t->mask) {
        PiEntry *e = &t->ent[i];
        if (e->id1 == 0) break;
        if (e->k0 == k0 && e->k1 == k1) {
            e->id1 = id + 1;
            return 0;
        }
    }
    t->ent[i].k0 = k0;
    t->ent[i].k1 = k1;
    t->ent[i].id1 = id + 1;
    t->used++;
    return 1;
}

/* Remove entry i, shifting back the run after it (no tombstones: every lookup still ends at an empty entry). */
static void pi_delete_at(PrefixIndex *t, Py_ssize_t i) {
    Py_ssize_t mask = t->mask, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (t->ent[j].id1 == 0) break;
        Py_ssize_t home = pi_home(mask, t->ent[j].k0, t->ent[j].k1);
        /* j's entry may fill the hole at i iff its home does not lie cyclically in (i, j]. */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->ent[i] = t->ent[j];
            i = j;
        }
    }
    t->ent[i].id1 = 0;
    t->used--;
}

static PyObject *pi_key_object(const PiEntry *e) {
    uint8_t b[PI_KEY];
    for (int s = 0; s < 8; s++) b[s] = (uint8_t)(e->k0 >> (8 * s)), b[8 + s] = (uint8_t)(e->k1 >> (8 * s));
    return PyBytes_FromStringAndSize((const char *)b, PI_KEY);
}

/* -- the pool's batch operations (kvproc/core/paged.py) ------------------------------------------------------- */

/* match(hashes) -> [block id, ...] of the longest indexed prefix of `hashes` (a non-key ends it like a miss). */
static PyObject *pi_match(PrefixIndex *t, PyObject *hashes_o) {
    PyObject *hs = PySequence_Fast(hashes_o, "hashes must be a sequence of bytes");
    if (!hs) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hs);
    PyObject **items = PySequence_Fast_ITEMS(hs);
    PyObject *out = PyList_New(0);
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < n && i < PI_PREFETCH; i++) pi_prefetch(t, items[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PI_PREFETCH < n) pi_prefetch(t, items[i + PI_PREFETCH]);
        uint64_t k0, k1;
        Py_ssize_t at;
        if (!pi_split(items[i], &k0, &k1) || (at = pi_find(t, k0, k1)) < 0) break;
        PyObject *id = PyLong_FromLongLong(t->ent[at].id1 - 1);
        if (!id || PyList_Append(out, id)) {
            Py_XDECREF(id);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(id);
    }
done:
    Py_DECREF(hs);
    return out;
}

/* register_blocks(hashed, block_hash, ids, hashes, added) -> blocks registered: `paged_register`'s work (see
 * paged.py `register`). Every block not hashed yet takes its hash (block_hash[id] = h, or its 16 bytes copied to
 * keys[16 * id] where `keys` is given: the pool's per-block key array; hashed[id] = 1) and the index
 * entry (the newest block wins); `added`, a list or None, gets the position of every hash new to the index. Every
 * id and hash is checked, and room reserved, before anything changes. */
int kvproc_prefix_register(PyObject *index, uint8_t *hashed, PyObject *bh, uint8_t *keys, const int64_t *ids,
                           PyObject **items, Py_ssize_t n, PyObject *added, Py_ssize_t *done_n) {
    PrefixIndex *t = (PrefixIndex *)index;
    uint64_t k0, k1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (pi_key_checked(items[i], i, &k0, &k1)) return -1;
    if (pi_reserve(t, n)) return -1;
    for (Py_ssize_t i = 0; i < n && i < PI_PREFETCH; i++) pi_prefetch(t, items[i]);
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PI_PREFETCH < n) pi_prefetch(t, items[i + PI_PREFETCH]);
        int64_t b = ids[i];
        if (hashed[b]) continue;
        pi_split(items[i], &k0, &k1);
        if (pi_set(t, k0, k1, b) && added) {
            PyObject *pos = PyLong_FromSsize_t(i);
            int rc = pos ? PyList_Append(added, pos) : -1;
            Py_XDECREF(pos);
            if (rc) return -1; /* only with events on, after this key went in: the caller's list is the loss */
        }
        if (keys) {
            memcpy(keys + PI_KEY * b, PyBytes_AS_STRING(items[i]), PI_KEY); /* no object kept per block */
        } else {
            Py_INCREF(items[i]);
            PyList_SetItem(bh, b, items[i]); /* steals the new reference, drops the old item */
        }
        hashed[b] = 1;
        count++;
    }
    *done_n = count;
    return 0;
}

/* paged_unhash's index step: 1 if `key`'s entry was owned by block `b` and went, 0 if not (displaced, or absent). */
int kvproc_prefix_unhash(PyObject *index, PyObject *key, int64_t b) {
    PrefixIndex *t = (PrefixIndex *)index;
    uint64_t k0, k1;
    if (!pi_split(key, &k0, &k1)) return 0;
    Py_ssize_t at = pi_find(t, k0, k1);
    if (at < 0 || t->ent[at].id1 - 1 != b) return 0;
    pi_delete_at(t, at);
    return 1;
}

/* The same two on a key's 16 raw bytes (the pool's per-block key array). */
int kvproc_prefix_unhash_raw(PyObject *index, const uint8_t *key, int64_t b) {
    PrefixIndex *t = (PrefixIndex *)index;
    Py_ssize_t at = pi_find(t, load64_le(key), load64_le(key + 8));
    if (at < 0 || t->ent[at].id1 - 1 != b) return 0;
    pi_delete_at(t, at);
    return 1;
}

int kvproc_prefix_owns_raw(PyObject *index, const uint8_t *key, int64_t b) {
    const PrefixIndex *t = (const PrefixIndex *)index;
    Py_ssize_t at = pi_find(t, load64_le(key), load64_le(key + 8));
    return at >= 0 && t->ent[at].id1 - 1 == b;
}

int kvproc_prefix_owns(PyObject *index, PyObject *key, int64_t b) {
    const PrefixIndex *t = (const PrefixIndex *)index;
    uint64_t k0, k1;
    if (!pi_split(key, &k0, &k1)) return 0;
    Py_ssize_t at = pi_find(t, k0, k1);
    return at >= 0 && t->ent[at].id1 - 1 == b;
}

int kvproc_is_prefix_index(PyObject *o) { return PyObject_TypeCheck(o, &PrefixIndexType); }

/* -- the mapping face ---------------------------------------------------------------------------------------- */

static PyObject *pi_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (!_PyArg_NoKeywords("PrefixIndex", kw) || !_PyArg_NoPositional("PrefixIndex", args)) return NULL;
    PrefixIndex *t = (PrefixIndex *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    t->mask = PI_MIN_SIZE - 1; /* no table yet: pi_reserve allocates this size */
    if (pi_reserve(t, 1)) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void pi_dealloc(PrefixIndex *t) {
    pi_free(t->ent, t->mask + 1);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t pi_len(PrefixIndex *t) { return t->used; }

static PyObject *pi_getitem(PrefixIndex *t, PyObject *key) {
    uint64_t k0, k1;
    Py_ssize_t at;
    if (!pi_split(key, &k0, &k1) || (at = pi_find(t, k0, k1)) < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLongLong(t->ent[at].id1 - 1);
}

static int pi_setitem(PrefixIndex *t, PyObject *key, PyObject *value) {
    uint64_t k0, k1;
    if (pi_key_checked(key, 0, &k0, &k1)) return -1;
    if (!value) {
        Py_ssize_t at = pi_find(t, k0, k1);
        if (at < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        pi_delete_at(t, at);
        return 0;
    }
    long long id = PyLong_AsLongLong(value);
    if (id == -1 && PyErr_Occurred()) return -1;
    if (id < 0) {
        PyErr_Format(PyExc_ValueError, "block ids are non-negative, got %lld", id);
        return -1;
    }
    if (pi_reserve(t, 1)) return -1;
    pi_set(t, k0, k1, id);
    return 0;
}

static int pi_contains(PrefixIndex *t, PyObject *key) {
    uint64_t k0, k1;
    return pi_split(key, &k0, &k1) && pi_find(t, k0, k1) >= 0;
}

static PyObject *pi_get(PrefixIndex *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    uint64_t k0, k1;
    Py_ssize_t at;
    if (pi_split(args[0], &k0, &k1) && (at = pi_find(t, k0, k1)) >= 0) return PyLong_FromLongLong(t->ent[at].id1 - 1);
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

/* what: 0 keys, 1 values, 2 (key, value) tuples; a list (a snapshot: the pool changes the table under its lock). */
static PyObject *pi_list(PrefixIndex *t, int what) {
    PyObject *out = PyList_New(t->used);
    if (!out) return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j <= t->mask && k < t->used; j++) {
        const PiEntry *e = &t->ent[j];
        if (e->id1 == 0) continue;
        PyObject *key = what != 1 ? pi_key_object(e) : NULL, *id = what != 0 ? PyLong_FromLongLong(e->id1 - 1) : NULL;
        PyObject *item = what == 0 ? key : what == 1 ? id : (key && id ? PyTuple_Pack(2, key, id) : NULL);
        if (what == 2) Py_XDECREF(key), Py_XDECREF(id);
        if (!item) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k++, item);
    }
    return out;
}

static PyObject *pi_keys(PrefixIndex *t, PyObject *unused) { return pi_list(t, 0); }
static PyObject *pi_values(PrefixIndex *t, PyObject *unused) { return pi_list(t, 1); }
static PyObject *pi_items(PrefixIndex *t, PyObject *unused) { return pi_list(t, 2); }

static PyObject *pi_iter(PrefixIndex *t) {
    PyObject *keys = pi_list(t, 0);
    if (!keys) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *pi_as_dict(PrefixIndex *t) {
    PyObject *items = pi_list(t, 2);
    if (!items) return NULL;
    PyObject *d = PyDict_New();
    for (Py_ssize_t i = 0; d && i < PyList_GET_SIZE(items); i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        if (PyDict_SetItem(d, PyTuple_GET_ITEM(kv, 0), PyTuple_GET_ITEM(kv, 1))) Py_CLEAR(d);
    }
    Py_DECREF(items);
    return d;
}

static PyObject *pi_richcompare(PrefixIndex *t, PyObject *other, int op) {
    if ((op != Py_EQ && op != Py_NE) || !(PyDict_Check(other) || kvproc_is_prefix_index(other)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *a = pi_as_dict(t), *b = NULL, *out = NULL;
    if (!a) return NULL;
    if (PyDict_Check(other)) {
        b = other;
        Py_INCREF(b);
    } else {
        b = pi_as_dict((PrefixIndex *)other);
    }
    if (b) out = PyObject_RichCompare(a, b, op);
    Py_DECREF(a);
    Py_XDECREF(b);
    return out;
}

static PyObject *pi_repr(PrefixIndex *t) { return PyUnicode_FromFormat("<PrefixIndex: %zd pages>", t->used); }

static PyMethodDef pi_methods[] = {
    {"match", (PyCFunction)pi_match, METH_O, "match(hashes) -> block ids of the longest indexed prefix"},
    {"get", (PyCFunction)(void (*)(void))pi_get, METH_FASTCALL, "get(key, default=None)"},
    {"keys", (PyCFunction)pi_keys, METH_NOARGS, "keys() -> list of the indexed page hashes"},
    {"values", (PyCFunction)pi_values, METH_NOARGS, "values() -> list of block ids"},
    {"items", (PyCFunction)pi_items, METH_NOARGS, "items() -> list of (page hash, block id)"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods pi_mapping = {(lenfunc)pi_len, (binaryfunc)pi_getitem, (objobjargproc)pi_setitem};
static PySequenceMethods pi_sequence = {.sq_contains = (objobjproc)pi_contains};

static PyTypeObject PrefixIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvproc.native._native.PrefixIndex",
    .tp_basicsize = sizeof(PrefixIndex),
    .tp_dealloc = (destructor)pi_dealloc,
    .tp_repr = (reprfunc)pi_repr,
    .tp_as_mapping = &pi_mapping,
    .tp_as_sequence = &pi_sequence,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A device pool's prefix index: 16-byte page hash -> block id (one open-addressing table).",
    .tp_richcompare = (richcmpfunc)pi_richcompare,
    .tp_iter = (getiterfunc)pi_iter,
    .tp_methods = pi_methods,
    .tp_new = pi_new,
};

/* untrack_atomic(lst): take a list that holds only bytes, ints and None out of the cyclic GC's scans. The pool's
 * per-block lists (`block_hash`, `free`: one item per block, tens of millions in an unbounded replay) cannot be part
 * of a reference cycle, yet every full collection, and the two that first promote them, walks each item (a pointer
 * to a type check per block: ~8% of the trace replay's time). PagedBlocks only ever stores those kinds in them. */
static PyObject *untrack_atomic(PyObject *self, PyObject *lst) {
    if (!PyList_CheckExact(lst)) {
        PyErr_Format(PyExc_TypeError, "untrack_atomic takes a list, not %.100s", Py_TYPE(lst)->tp_name);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(lst); i++) {
        PyObject *o = PyList_GET_ITEM(lst, i);
        if (o != Py_None && !PyBytes_CheckExact(o) && !PyLong_CheckExact(o)) {
            PyErr_Format(PyExc_TypeError, "untrack_atomic: item %zd is a %.100s (only bytes, int, None)", i,
                         Py_TYPE(o)->tp_name);
            return NULL;
        }
    }
    if (PyObject_GC_IsTracked(lst)) PyObject_GC_UnTrack(lst);
    Py_RETURN_NONE;
}

static PyMethodDef pi_module_methods[] = {
    {"untrack_atomic", untrack_atomic, METH_O, "untrack_atomic(list of bytes / int / None): out of the GC's scans"},
    {NULL, NULL, 0, NULL},
};

int kvproc_add_prefix_index(PyObject *module) {
    if (PyModule_AddFunctions(module, pi_module_methods) < 0) return -1;
    if (PyType_Ready(&PrefixIndexType) < 0) return -1;
    Py_INCREF(&PrefixIndexType);
    if (PyModule_AddObject(module, "PrefixIndex", (PyObject *)&PrefixIndexType) < 0) {
        Py_DECREF(&PrefixIndexType);
        return -1;
    }
    return 0;
}
