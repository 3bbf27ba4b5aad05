/* Cache-line write-back and invalidation for memory without cross-host coherence.
 *
 * writeback(address, length): write every 64-byte line of the range back to memory (clwb, or
 * clflushopt / clflush where the CPU lacks it), then sfence: the stores are in memory before
 * any later store (the one that publishes them).
 * invalidate(address, length): drop every line of the range from this CPU's caches
 * (clflushopt / clflush), then mfence: later loads fetch what memory holds now.
 * features(): the instructions in use, e.g. "clwb+clflushopt".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cpuid.h>
#include <stdint.h>

#define LINE 64

static int have_clwb, have_clflushopt;

static inline void line_writeback(volatile char *p) {
    if (have_clwb)
        __asm__ volatile("clwb %0" : "+m"(*p));
    else if (have_clflushopt)
        __asm__ volatile("clflushopt %0" : "+m"(*p));
    else
        __asm__ volatile("clflush %0" : "+m"(*p));
}

static inline void line_invalidate(volatile char *p) {
    if (have_clflushopt)
        __asm__ volatile("clflushopt %0" : "+m"(*p));
    else
        __asm__ volatile("clflush %0" : "+m"(*p));
}

static int parse(PyObject *args, uintptr_t *start, uintptr_t *end) {
    unsigned long long address, length;
    if (!PyArg_ParseTuple(args, "KK", &address, &length))
        return -1;
    if (address + length < address) {
        PyErr_SetString(PyExc_ValueError, "range wraps around the address space");
        return -1;
    }
    *start = (uintptr_t)address & ~(uintptr_t)(LINE - 1);
    *end = (uintptr_t)(address + length);
    return 0;
}

static PyObject *writeback(PyObject *self, PyObject *args) {
    uintptr_t p, end;
    if (parse(args, &p, &end) < 0)
        return NULL;
    for (; p < end; p += LINE)
        line_writeback((volatile char *)p);
    __asm__ volatile("sfence" ::: "memory");
    Py_RETURN_NONE;
}

static PyObject *invalidate(PyObject *self, PyObject *args) {
    uintptr_t p, end;
    if (parse(args, &p, &end) < 0)
        return NULL;
    for (; p < end; p += LINE)
        line_invalidate((volatile char *)p);
    __asm__ volatile("mfence" ::: "memory");
    Py_RETURN_NONE;
}

static PyObject *features(PyObject *self, PyObject *unused) {
    return PyUnicode_FromFormat("%s+%s", have_clwb ? "clwb" : "no-clwb",
                                have_clflushopt ? "clflushopt" : "clflush");
}

static PyMethodDef methods[] = {
    {"writeback", writeback, METH_VARARGS, "Write back the lines of (address, length), then sfence."},
    {"invalidate", invalidate, METH_VARARGS, "Invalidate the lines of (address, length), then mfence."},
    {"features", features, METH_NOARGS, "The flush instructions this CPU offers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cxlrpc._flush", NULL, -1, methods};

PyMODINIT_FUNC PyInit__flush(void) {
    unsigned int a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        have_clflushopt = (b >> 23) & 1;
        have_clwb = (b >> 24) & 1;
    }
    return PyModule_Create(&module);
}
