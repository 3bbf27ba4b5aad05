/* Cache-line write-back and invalidation for memory without cross-host coherence.
 *
 * writeback(address, length): write every 64-byte line of the range back to memory (clwb, or
 * clflushopt / clflush where the CPU lacks it), then sfence: the stores are in memory before
 * any later store (the one that publishes them).
 * invalidate(address, length): drop every line of the range from this CPU's caches
 * (clflushopt / clflush), then mfence: later loads fetch what memory holds now.
 * stream_copy(dst, src): copy the bytes of buffer src to the start of writable buffer dst with
 * non-temporal (streaming) stores, then sfence: no read-for-ownership of cold destination lines
 * and nothing left in this CPU's caches (the next reader is another process or host).
 * stream_bytes(src): a new bytes object holding a copy of buffer src, written the same way.
 * features(): the instructions in use, e.g. "clwb+clflushopt".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cpuid.h>
#include <emmintrin.h>
#include <stdint.h>
#include <string.h>

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

static void copy_streaming(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;  /* streaming stores need 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
    _mm_sfence();  /* streaming stores are weakly ordered: in memory before any later store */
}

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src))
        return NULL;
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_BufferError, "stream_copy needs contiguous buffers");
    } else if (src.len > dst.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: %zd bytes do not fit a %zd-byte buffer",
                     src.len, dst.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_streaming((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *stream_bytes(PyObject *self, PyObject *args) {
    Py_buffer src;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*", &src))
        return NULL;
    if (!PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_BufferError, "stream_bytes needs a contiguous buffer");
    } else if ((out = PyBytes_FromStringAndSize(NULL, src.len)) != NULL) {
        char *dst = PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        copy_streaming(dst, (const char *)src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    return out;
}

static PyObject *features(PyObject *self, PyObject *unused) {
    return PyUnicode_FromFormat("%s+%s", have_clwb ? "clwb" : "no-clwb",
                                have_clflushopt ? "clflushopt" : "clflush");
}

static PyMethodDef methods[] = {
    {"writeback", writeback, METH_VARARGS, "Write back the lines of (address, length), then sfence."},
    {"invalidate", invalidate, METH_VARARGS, "Invalidate the lines of (address, length), then mfence."},
    {"stream_copy", stream_copy, METH_VARARGS, "Copy src into the start of dst with streaming stores, then sfence."},
    {"stream_bytes", stream_bytes, METH_VARARGS, "A new bytes copy of src, made with streaming stores."},
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
