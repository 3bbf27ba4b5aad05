/* cxlrpc.frame.decode in C, for frames without call metadata (cxlrpc/frame.py is the reference
 * and documents the format; frames flagged META go to it whole).
 *
 * Every header field is validated as the reference does (a frame from shared memory may be
 * garbage) and the same FrameError is raised. The body is copied out of the ring, except a
 * request's whose method is in ``lend``: it is a read-only view into the record.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_copy.h"

#define HEADER_SIZE 28 /* <BBHHIQdH */
#define MAX_METHOD 255
#define FLAG_RAW 1
#define FLAG_HEAP 2
#define FLAG_META 4
#define FLAG_STREAM 8
#define FLAG_FOLLOW 16
#define FLAG_IN_PLACE 32
#define KNOWN_FLAGS (FLAG_RAW | FLAG_HEAP | FLAG_META | FLAG_STREAM | FLAG_FOLLOW | FLAG_IN_PLACE)
#define MAX_KIND 9
#define KIND_REQUEST 1

/* Set by configure(): Frame, FrameError, the method-name cache (bytes -> str), the reference's
 * _method_name(raw) (decodes, validates, caches) and its decode (for META frames). */
static PyObject *frame_type, *frame_error, *method_cache, *method_name_fn, *reference_decode;

static inline uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t le32(const unsigned char *p) { return (uint32_t)le16(p) | (uint32_t)le16(p + 2) << 16; }
static inline uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *ft, *fe, *mc, *mn, *rd;
    if (!PyArg_ParseTuple(args, "OOO!OO", &ft, &fe, &PyDict_Type, &mc, &mn, &rd))
        return NULL;
    Py_XSETREF(frame_type, Py_NewRef(ft));
    Py_XSETREF(frame_error, Py_NewRef(fe));
    Py_XSETREF(method_cache, Py_NewRef(mc));
    Py_XSETREF(method_name_fn, Py_NewRef(mn));
    Py_XSETREF(reference_decode, Py_NewRef(rd));
    Py_RETURN_NONE;
}

/* A read-only view of view_obj[start:] (it keeps the exporter alive: no raw pointer escapes). */
static PyObject *lent_body(PyObject *view_obj, Py_ssize_t start) {
    PyObject *at = PyLong_FromSsize_t(start);
    if (at == NULL)
        return NULL;
    PyObject *slice = PySlice_New(at, NULL, NULL);
    Py_DECREF(at);
    if (slice == NULL)
        return NULL;
    PyObject *sub = PyObject_GetItem(view_obj, slice);
    Py_DECREF(slice);
    if (sub == NULL)
        return NULL;
    PyObject *body = PyObject_CallMethod(sub, "toreadonly", NULL);
    Py_DECREF(sub);
    return body;
}

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "decode(view, lend=None) takes one or two arguments");
        return NULL;
    }
    PyObject *view_obj = args[0], *lend = nargs == 2 && args[1] != Py_None ? args[1] : NULL;
    if (lend != NULL && !PyAnySet_Check(lend)) {
        PyErr_SetString(PyExc_TypeError, "lend must be a set or frozenset of method names, or None");
        return NULL;
    }
    if (frame_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cxlrpc._frame is not configured");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(view_obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = view.buf;
    Py_ssize_t n = view.len;
    PyObject *result = NULL, *method = NULL, *body = NULL;
    if (n < HEADER_SIZE) {
        PyErr_Format(frame_error, "frame of %zd bytes is shorter than its header", n);
        goto done;
    }
    unsigned kind = p[0], flags = p[1];
    uint16_t status = le16(p + 2), slot = le16(p + 4), mlen = le16(p + 26);
    uint32_t gen = le32(p + 6);
    uint64_t call_id = le64(p + 10), tbits = le64(p + 18);
    double timeout;
    memcpy(&timeout, &tbits, sizeof timeout);
    Py_ssize_t end = HEADER_SIZE + (Py_ssize_t)mlen;
    /* ``!(timeout >= 0)`` also rejects NaN */
    if (kind < 1 || kind > MAX_KIND || mlen > MAX_METHOD || end > n || (flags & ~KNOWN_FLAGS) || !(timeout >= 0)) {
        PyErr_SetString(frame_error, "frame header out of range");
        goto done;
    }
    if (flags & FLAG_META) { /* metadata: the reference decodes it (and raises BadMetadata) */
        PyBuffer_Release(&view);
        return PyObject_Vectorcall(reference_decode, args, nargs, NULL);
    }
    if (mlen) {
        PyObject *raw = PyBytes_FromStringAndSize((const char *)p + HEADER_SIZE, mlen);
        if (raw == NULL)
            goto done;
        method = PyDict_GetItemWithError(method_cache, raw);
        if (method != NULL) {
            Py_INCREF(method);
        } else if (!PyErr_Occurred()) {
            method = PyObject_CallOneArg(method_name_fn, raw);
        }
        Py_DECREF(raw);
        if (method == NULL)
            goto done;
    } else {
        method = PyUnicode_FromStringAndSize("", 0);
        if (method == NULL)
            goto done;
    }
    int lent = 0;
    if (lend != NULL && kind == KIND_REQUEST && (lent = PySet_Contains(lend, method)) < 0)
        goto done;
    body = lent ? lent_body(view_obj, end) : bytes_copy(p + end, n - end);
    if (body == NULL)
        goto done;
    PyObject *fields[9];
    fields[0] = PyLong_FromLong(kind);
    fields[1] = PyLong_FromLong(flags);
    fields[2] = PyLong_FromLong(status);
    fields[3] = PyLong_FromLong(slot);
    fields[4] = PyLong_FromUnsignedLong(gen);
    fields[5] = PyLong_FromUnsignedLongLong(call_id);
    fields[6] = PyFloat_FromDouble(timeout);
    fields[7] = method;
    fields[8] = body;
    int ok = 1;
    for (int i = 0; i < 7; i++)
        ok &= fields[i] != NULL;
    if (ok)
        result = PyObject_Vectorcall(frame_type, fields, 9, NULL);
    for (int i = 0; i < 7; i++)
        Py_XDECREF(fields[i]);
done:
    Py_XDECREF(method);
    Py_XDECREF(body);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(Frame, FrameError, method_cache, method_name, reference_decode): bind the reference's pieces."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL,
     "decode(view, lend=None): decode and validate a frame from a ring payload, copying the body "
     "out (a request's whose method is in lend: a read-only view into view)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cxlrpc._frame", "cxlrpc.frame.decode in C.", -1, methods};

PyMODINIT_FUNC PyInit__frame(void) { return PyModule_Create(&module); }
