/* sketch_add: one access of each fingerprint in lrfu's count-min sketch (`kvproc/core/eviction/sketch.py`).
 *
 * numpy's form is `np.add.at` over a (4, n) index (it must be add.at: two fingerprints of one batch may share a
 * cell) and a gather for the estimates: ~0.6 us per page, which made lrfu cost ~45% of the trace replay. Here it is
 * two passes over the batch with no temporaries. The passes keep numpy's semantics exactly: every increment of the
 * batch first (float32 adds, each cell's in batch order), then each fingerprint's estimate, the minimum over the
 * four rows, so a batch's pages see each other's increments as they did. Row hashes are multiply-shift with the
 * same four multipliers as the Python form (which stays the fallback, and the tests compare the two).
 */
#include "_native.h"

#include <string.h>

#define SKETCH_DEPTH 4

static const uint64_t SKETCH_MULT[SKETCH_DEPTH] = {0x9E3779B97F4A7C15ULL, 0xBF58476D1CE4E5B9ULL,
                                                   0x94D049BB133111EBULL, 0xD6E8FEB86659FD93ULL};

/* sketch_add(cells, fps, shift, increment) -> bytearray of float32 estimates: `cells` a C-contiguous float32 array of
 * 4 rows x 2**(64 - shift) cells, `fps` uint64 fingerprints. */
static PyObject *sketch_add(PyObject *self, PyObject *args) {
    PyObject *cells_o, *fps_o;
    unsigned int shift;
    float increment;
    if (!PyArg_ParseTuple(args, "OOIf", &cells_o, &fps_o, &shift, &increment)) return NULL;
    Py_buffer cells, fps;
    if (PyObject_GetBuffer(cells_o, &cells, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(fps_o, &fps, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&cells);
        return NULL;
    }
    PyObject *out = NULL;
    if (shift < 1 || shift > 63) {
        PyErr_Format(PyExc_ValueError, "sketch_add: shift %u outside 1..63", shift);
        goto done;
    }
    const Py_ssize_t width = (Py_ssize_t)1 << (64 - shift);
    if (cells.itemsize != 4 || strcmp(cells.format ? cells.format : "B", "f") || cells.len != SKETCH_DEPTH * width * 4) {
        PyErr_Format(PyExc_TypeError, "sketch_add: cells must be float32, %d x %zd", SKETCH_DEPTH, width);
        goto done;
    }
    if (fps.itemsize != 8 || fps.len % 8) {
        PyErr_SetString(PyExc_TypeError, "sketch_add: fps must be an array of uint64");
        goto done;
    }
    Py_ssize_t n = fps.len / 8;
    out = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(float));
    if (!out) goto done;
    float *row = (float *)cells.buf, *est = (float *)PyByteArray_AS_STRING(out);
    const uint64_t *fp = (const uint64_t *)fps.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        for (int d = 0; d < SKETCH_DEPTH; d++) row[d * width + (Py_ssize_t)((fp[i] * SKETCH_MULT[d]) >> shift)] += increment;
    for (Py_ssize_t i = 0; i < n; i++) {
        float m = row[(Py_ssize_t)((fp[i] * SKETCH_MULT[0]) >> shift)];
        for (int d = 1; d < SKETCH_DEPTH; d++) {
            float c = row[d * width + (Py_ssize_t)((fp[i] * SKETCH_MULT[d]) >> shift)];
            if (c < m) m = c;
        }
        est[i] = m;
    }
done:
    PyBuffer_Release(&cells);
    PyBuffer_Release(&fps);
    return out;
}

static PyMethodDef sketch_methods[] = {
    {"sketch_add", sketch_add, METH_VARARGS, "sketch_add(cells, fps, shift, increment) -> float32 estimates"},
    {NULL, NULL, 0, NULL},
};

int kvproc_add_sketch(PyObject *module) { return PyModule_AddFunctions(module, sketch_methods); }
