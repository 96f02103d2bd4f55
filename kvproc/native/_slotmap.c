/* SlotMap: the store's slot cache (`kvproc.tiers.slot_cache.SlotCache`) as one open-addressing table.
 *
 * key (16 bytes) -> (page slot, generation), bounded to `capacity` entries, the oldest learned forgotten first -- the
 * semantics of the dict form it replaces, exactly (a hypothesis test runs both side by side). Why: a resolve looks up
 * every page it wants right after an engine step, when the dict's index, its entries, the key objects and the value
 * tuples are all cold: four or five dependent cache misses per page (~0.5 us each in the 64-page bench). Here an
 * entry is 32 bytes inline (key, slot, generation), its bucket comes from the key's own bits (already a cryptographic
 * hash), and a lookup of many keys first prefetches every bucket, then every slot-table row it will check, so the
 * misses overlap instead of following one another.
 *
 * Layout: linear probing over 2^k >= 2 * capacity + 2 entries (load <= 1/2, so a probe ends at an empty entry);
 * deletion shifts the following entries back (no tombstones). Learn order: a ring of (key, sequence) events; an
 * entry remembers the sequence of its newest learn, so a popped event whose sequence differs is stale (the key was
 * learned again, or forgotten). When the live entries exceed `capacity`, events are popped from the oldest until one
 * is live and that entry goes. A full ring is compacted in place to its live events (at most capacity + 1 of its
 * 1.5 * capacity + 2), so each learn costs amortised O(1).
 *
 * Not thread-safe by itself: nothing here releases the GIL, and the Python wrapper holds its lock around each call
 * (an int subclass's __index__ could run Python code in between). */
#include "_native.h"

#include <string.h>

#define SM_KEY 16

typedef struct {
    uint64_t k0, k1; /* the key's two halves, little endian: k0 is also the slot table's tag */
    uint64_t slot1;  /* slot + 1; 0 marks an empty entry */
    int64_t gen;
} SmEntry;

typedef struct {
    uint64_t k0, k1;
    int64_t seq;
} SmEvent;

typedef struct {
    PyObject_HEAD SmEntry *ent;
    int64_t *eseq; /* per entry: the sequence number of its newest learn */
    Py_ssize_t mask;
    SmEvent *ring;
    Py_ssize_t rsize;
    int64_t tail, head; /* events [tail, head), absolute; position = index % rsize */
    Py_ssize_t live, capacity;
    int64_t next_seq;
} SlotMap;

static inline Py_ssize_t sm_home(const SlotMap *m, uint64_t k0, uint64_t k1) {
    uint64_t h = (k0 ^ (k1 * 0x9E3779B97F4A7C15ULL)) * 0xBF58476D1CE4E5B9ULL; /* keys may be test counters too */
    return (Py_ssize_t)((h ^ (h >> 31)) & (uint64_t)m->mask);
}

static int sm_key(PyObject *k, uint64_t *k0, uint64_t *k1) {
    if (!PyBytes_Check(k)) {
        PyErr_Format(PyExc_TypeError, "slot cache keys must be bytes, got %.100s", Py_TYPE(k)->tp_name);
        return -1;
    }
    if (PyBytes_GET_SIZE(k) != SM_KEY) {
        PyErr_Format(PyExc_ValueError, "slot cache keys must be %d bytes, got %zd", SM_KEY, PyBytes_GET_SIZE(k));
        return -1;
    }
    const uint8_t *b = (const uint8_t *)PyBytes_AS_STRING(k);
    *k0 = load64_le(b);
    *k1 = load64_le(b + 8);
    return 0;
}

/* 0 if the map was initialised; else -1 with an exception (a SlotMap made by __new__ alone has no table). */
static int sm_ready(const SlotMap *m) {
    if (m->ent) return 0;
    PyErr_SetString(PyExc_RuntimeError, "SlotMap was not initialised (call SlotMap(capacity))");
    return -1;
}

static Py_ssize_t sm_find_from(const SlotMap *m, uint64_t k0, uint64_t k1, Py_ssize_t i) {
    for (;; i = (i + 1) & m->mask) {
        const SmEntry *e = &m->ent[i];
        if (!e->slot1) return -1;
        if (e->k0 == k0 && e->k1 == k1) return i;
    }
}

static inline Py_ssize_t sm_find(const SlotMap *m, uint64_t k0, uint64_t k1) {
    return sm_find_from(m, k0, k1, sm_home(m, k0, k1));
}

/* Empty entry i and shift back the entries after it that probed past it (linear probing without tombstones). */
static void sm_delete(SlotMap *m, Py_ssize_t i) {
    Py_ssize_t j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        if (!m->ent[j].slot1) break;
        Py_ssize_t h = sm_home(m, m->ent[j].k0, m->ent[j].k1);
        int reachable = i <= j ? (i < h && h <= j) : (i < h || h <= j); /* its home lies in (i, j]: it stays */
        if (!reachable) {
            m->ent[i] = m->ent[j];
            m->eseq[i] = m->eseq[j];
            i = j;
        }
    }
    memset(&m->ent[i], 0, sizeof(SmEntry));
    m->live--;
}

/* Keep only the live events of a full ring, in order, from its tail. */
static void sm_compact(SlotMap *m) {
    int64_t w = m->tail;
    for (int64_t r = m->tail; r < m->head; r++) {
        SmEvent ev = m->ring[r % m->rsize];
        Py_ssize_t pos = sm_find(m, ev.k0, ev.k1);
        if (pos >= 0 && m->eseq[pos] == ev.seq) m->ring[w++ % m->rsize] = ev;
    }
    m->head = w;
}

static void sm_learn_one(SlotMap *m, uint64_t k0, uint64_t k1, int64_t slot, int64_t gen) {
    int64_t seq = m->next_seq++;
    Py_ssize_t home = sm_home(m, k0, k1), i = home;
    for (;; i = (i + 1) & m->mask) {
        SmEntry *e = &m->ent[i];
        if (!e->slot1) { /* absent: take the first empty entry of its probe */
            e->k0 = k0;
            e->k1 = k1;
            m->live++;
            break;
        }
        if (e->k0 == k0 && e->k1 == k1) break; /* learned again: newer values, newest in the order */
    }
    m->ent[i].slot1 = (uint64_t)slot + 1;
    m->ent[i].gen = gen;
    m->eseq[i] = seq;
    if (m->head - m->tail == m->rsize) sm_compact(m);
    m->ring[m->head++ % m->rsize] = (SmEvent){k0, k1, seq};
    while (m->live > m->capacity) { /* the oldest live learn goes; stale events on the way are dropped */
        SmEvent ev = m->ring[m->tail++ % m->rsize];
        Py_ssize_t pos = sm_find(m, ev.k0, ev.k1);
        if (pos >= 0 && m->eseq[pos] == ev.seq) sm_delete(m, pos);
    }
}

static void SlotMap_dealloc(SlotMap *self) {
    PyMem_RawFree(self->ent);
    PyMem_RawFree(self->eseq);
    PyMem_RawFree(self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int SlotMap_init(SlotMap *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &capacity)) return -1;
    if (capacity <= 0 || capacity > ((Py_ssize_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "capacity must be in [1, 2**40], got %zd", capacity);
        return -1;
    }
    if (self->ent) {
        PyErr_SetString(PyExc_RuntimeError, "SlotMap is already initialised");
        return -1;
    }
    Py_ssize_t nb = 4;
    while (nb < 2 * capacity + 2) nb <<= 1;
    self->ent = PyMem_RawCalloc((size_t)nb, sizeof(SmEntry));
    self->eseq = PyMem_RawCalloc((size_t)nb, sizeof(int64_t));
    self->rsize = capacity + capacity / 2 + 2; /* > capacity + 1: a compaction always frees room */
    self->ring = PyMem_RawMalloc((size_t)self->rsize * sizeof(SmEvent));
    if (!self->ent || !self->eseq || !self->ring) {
        PyErr_NoMemory();
        return -1; /* dealloc frees what was allocated */
    }
    self->mask = nb - 1;
    self->capacity = capacity;
    return 0;
}

static int64_t sm_int(PyObject *o, const char *what, Py_ssize_t i, int nonneg) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (nonneg && v < 0) {
        PyErr_Format(PyExc_ValueError, "slot cache: %s %lld at position %zd is negative", what, v, i);
        return -1;
    }
    return (int64_t)v;
}

/* learn(keys, slots, gens): record where the tier holds each key; pairs with a None slot or generation are skipped.
 * Every key is checked before anything changes. */
static PyObject *SlotMap_learn(SlotMap *self, PyObject *args) {
    PyObject *ko, *so, *go;
    if (sm_ready(self) || !PyArg_ParseTuple(args, "OOO", &ko, &so, &go)) return NULL;
    PyObject *keys = PySequence_Fast(ko, "keys must be a sequence");
    PyObject *slots = keys ? PySequence_Fast(so, "slots must be a sequence") : NULL;
    PyObject *gens = slots ? PySequence_Fast(go, "gens must be a sequence") : NULL;
    PyObject *result = NULL;
    int64_t *vals = NULL;
    if (!gens) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(slots) < n) n = PySequence_Fast_GET_SIZE(slots); /* zip() semantics */
    if (PySequence_Fast_GET_SIZE(gens) < n) n = PySequence_Fast_GET_SIZE(gens);
    vals = PyMem_Malloc((size_t)(n ? n : 1) * 4 * sizeof(int64_t)); /* k0, k1, slot (-1: skip), gen */
    if (!vals) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **K = PySequence_Fast_ITEMS(keys), **S = PySequence_Fast_ITEMS(slots), **G = PySequence_Fast_ITEMS(gens);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t *v = vals + 4 * i;
        if (sm_key(K[i], (uint64_t *)&v[0], (uint64_t *)&v[1])) goto done;
        if (S[i] == Py_None || G[i] == Py_None) {
            v[2] = -1;
            continue;
        }
        if ((v[2] = sm_int(S[i], "slot", i, 1)) == -1 && PyErr_Occurred()) goto done;
        if ((v[3] = sm_int(G[i], "generation", i, 0)) == -1 && PyErr_Occurred()) goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t *v = vals + 4 * i;
        if (v[2] >= 0) sm_learn_one(self, (uint64_t)v[0], (uint64_t)v[1], v[2], v[3]);
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(vals);
    Py_XDECREF(keys);
    Py_XDECREF(slots);
    Py_XDECREF(gens);
    return result;
}

/* Every key of a PySequence_Fast as its two halves (k0, k1 per key), into `stack` when it has room for `n` keys
 * (`stack_keys`), else a new PyMem block (the caller frees it when it is not `stack`); NULL and an exception on a bad
 * key or no memory. All keys are read before the caller changes or reads anything. */
static uint64_t *sm_keys(PyObject *keys, uint64_t *stack, Py_ssize_t stack_keys) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **K = PySequence_Fast_ITEMS(keys);
    uint64_t *ks = n <= stack_keys ? stack : PyMem_Malloc((size_t)n * 2 * sizeof(uint64_t));
    if (!ks) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sm_key(K[i], &ks[2 * i], &ks[2 * i + 1])) {
            if (ks != stack) PyMem_Free(ks);
            return NULL;
        }
    }
    return ks;
}

#define SM_STACK_KEYS 128 /* a resolve's pages fit: no allocation on its path */

/* forget(keys); every key is checked before any is forgotten. */
static PyObject *SlotMap_forget(SlotMap *self, PyObject *ko) {
    if (sm_ready(self)) return NULL;
    PyObject *keys = PySequence_Fast(ko, "keys must be a sequence");
    if (!keys) return NULL;
    uint64_t stack[2 * SM_STACK_KEYS], *ks = sm_keys(keys, stack, SM_STACK_KEYS);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (ks) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t pos = sm_find(self, ks[2 * i], ks[2 * i + 1]);
            if (pos >= 0) sm_delete(self, pos); /* its events are stale now */
        }
        if (ks != stack) PyMem_Free(ks);
    }
    Py_DECREF(keys);
    return ks ? Py_NewRef(Py_None) : NULL;
}

/* The positions of the longest leading run of `keys` the map holds (all buckets prefetched first); -1 and an
 * exception on a bad key. `pos` has room for every key. */
static Py_ssize_t sm_run(const SlotMap *m, PyObject *keys, Py_ssize_t *pos) {
    uint64_t stack[2 * SM_STACK_KEYS], *ks = sm_keys(keys, stack, SM_STACK_KEYS);
    if (!ks) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), known;
    for (Py_ssize_t i = 0; i < n; i++) {
        pos[i] = sm_home(m, ks[2 * i], ks[2 * i + 1]);
        __builtin_prefetch(&m->ent[pos[i]]);
    }
    for (known = 0; known < n; known++) {
        Py_ssize_t p = sm_find_from(m, ks[2 * known], ks[2 * known + 1], pos[known]);
        if (p < 0) break;
        pos[known] = p;
    }
    if (ks != stack) PyMem_Free(ks);
    return known;
}

static PyObject *sm_lists(const SlotMap *m, const Py_ssize_t *pos, Py_ssize_t n, Py_ssize_t known) {
    PyObject *slots = PyList_New(n), *gens = PyList_New(n), *out = NULL;
    if (!slots || !gens) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyLong_FromUnsignedLongLong(m->ent[pos[i]].slot1 - 1);
        if (!s) goto done;
        PyList_SET_ITEM(slots, i, s);
        PyObject *g = PyLong_FromLongLong(m->ent[pos[i]].gen);
        if (!g) goto done;
        PyList_SET_ITEM(gens, i, g);
    }
    out = known < 0 ? PyTuple_Pack(2, slots, gens) : Py_BuildValue("(OOn)", slots, gens, known);
done:
    Py_XDECREF(slots);
    Py_XDECREF(gens);
    return out;
}

/* run(keys) -> (slots, gens) of the longest leading run of keys the map holds. */
static PyObject *SlotMap_run(SlotMap *self, PyObject *ko) {
    if (sm_ready(self)) return NULL;
    PyObject *keys = PySequence_Fast(ko, "keys must be a sequence");
    if (!keys) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), *pos = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (!pos) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t known = sm_run(self, keys, pos);
    if (known >= 0) out = sm_lists(self, pos, known, -1);
done:
    PyMem_Free(pos);
    Py_DECREF(keys);
    return out;
}

/* run_verified(keys, gen_row, tag_row) -> (slots, gens, known): `run`, and of its entries the leading ones the
 * tier's slot table confirms (`slot_holds`: the rule `_native.slot_verify` applies); `known` = the length of the run
 * before the check. The table's rows are prefetched for the whole run before any is compared. */
static PyObject *SlotMap_run_verified(SlotMap *self, PyObject *args) {
    PyObject *ko, *rows[2];
    if (sm_ready(self) || !PyArg_ParseTuple(args, "OOO", &ko, &rows[0], &rows[1])) return NULL;
    Py_buffer bv[2];
    if (PyObject_GetBuffer(rows[0], &bv[0], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(rows[1], &bv[1], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&bv[0]);
        return NULL;
    }
    PyObject *keys = NULL, *out = NULL;
    Py_ssize_t *pos = NULL;
    if (bv[0].itemsize != 8 || bv[1].itemsize != 8) {
        PyErr_SetString(PyExc_TypeError, "run_verified: the slot table's rows must be 8-byte integers");
        goto done;
    }
    keys = PySequence_Fast(ko, "keys must be a sequence");
    if (!keys) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    pos = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (!pos) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t known = sm_run(self, keys, pos);
    if (known < 0) goto done;
    const int64_t *gen = bv[0].buf, *tag = bv[1].buf;
    Py_ssize_t limit = bv[0].len / 8 < bv[1].len / 8 ? bv[0].len / 8 : bv[1].len / 8;
    for (Py_ssize_t i = 0; i < known; i++) {
        uint64_t s = self->ent[pos[i]].slot1 - 1;
        if (s < (uint64_t)limit) {
            __builtin_prefetch(&gen[s]);
            __builtin_prefetch(&tag[s]);
        }
    }
    /* The table is shared memory the tier writes: these reads stay after whatever the caller observed before. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    Py_ssize_t ok = 0;
    for (; ok < known; ok++) {
        const SmEntry *e = &self->ent[pos[ok]];
        if (!slot_holds(gen, tag, limit, (long long)(e->slot1 - 1), e->gen, e->k0)) break;
    }
    out = sm_lists(self, pos, ok, known);
done:
    PyMem_Free(pos);
    Py_XDECREF(keys);
    PyBuffer_Release(&bv[0]);
    PyBuffer_Release(&bv[1]);
    return out;
}

static Py_ssize_t SlotMap_len(SlotMap *self) { return self->live; }

static PyObject *SlotMap_get_capacity(SlotMap *self, void *closure) { return PyLong_FromSsize_t(self->capacity); }

static PyMethodDef SlotMap_methods[] = {
    {"learn", (PyCFunction)SlotMap_learn, METH_VARARGS, "learn(keys, slots, gens): None pairs are skipped"},
    {"forget", (PyCFunction)SlotMap_forget, METH_O, "forget(keys)"},
    {"run", (PyCFunction)SlotMap_run, METH_O, "run(keys) -> (slots, gens) of the leading known keys"},
    {"run_verified", (PyCFunction)SlotMap_run_verified, METH_VARARGS,
     "run_verified(keys, gen_row, tag_row) -> (slots, gens, known)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef SlotMap_getset[] = {
    {"capacity", (getter)SlotMap_get_capacity, NULL, "the most entries it keeps", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods SlotMap_as_sequence = {.sq_length = (lenfunc)SlotMap_len};

static PyTypeObject SlotMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvproc.native._native.SlotMap",
    .tp_doc = "key (16 bytes) -> (slot, generation), bounded, oldest learned forgotten first",
    .tp_basicsize = sizeof(SlotMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SlotMap_init,
    .tp_dealloc = (destructor)SlotMap_dealloc,
    .tp_methods = SlotMap_methods,
    .tp_getset = SlotMap_getset,
    .tp_as_sequence = &SlotMap_as_sequence,
};

int kvproc_add_slotmap(PyObject *module) {
    if (PyType_Ready(&SlotMapType) < 0) return -1;
    Py_INCREF(&SlotMapType);
    if (PyModule_AddObject(module, "SlotMap", (PyObject *)&SlotMapType) < 0) {
        Py_DECREF(&SlotMapType);
        return -1;
    }
    return 0;
}
