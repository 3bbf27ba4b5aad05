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
 * publish_copy(dst, src, progress, chunk): copy src into dst a chunk at a time, storing the bytes
 * copied so far into the u64 ``progress`` (release) after each: a reader copies them out meanwhile.
 * follow_copy(src, progress, stall, limit): a new bytes copy of src, taken as ``progress``
 * (acquire) says its bytes were written; None if it stops moving for ``stall`` seconds or is
 * not done within ``limit``.
 * features(): the instructions in use, e.g. "clwb+clflushopt".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cpuid.h>
#include <emmintrin.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

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

/* The aligned u64 a buffer of at least 8 bytes starts with, or NULL with an error set. */
static uint64_t *progress_word(Py_buffer *b) {
    if (b->len < 8 || ((uintptr_t)b->buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "progress must be an 8-byte aligned buffer of 8 bytes or more");
        return NULL;
    }
    return (uint64_t *)b->buf;
}

static PyObject *publish_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src, prog;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "w*y*w*n", &dst, &src, &prog, &chunk))
        return NULL;
    uint64_t *word = progress_word(&prog);
    if (word == NULL) {
    } else if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_BufferError, "publish_copy needs contiguous buffers");
    } else if (src.len > dst.len || chunk < 64) {
        PyErr_Format(PyExc_ValueError, "publish_copy: %zd bytes in a %zd-byte buffer by chunks of %zd",
                     src.len, dst.len, chunk);
    } else {
        char *d = (char *)dst.buf;
        const char *s = (const char *)src.buf;
        size_t n = (size_t)src.len;
        Py_BEGIN_ALLOW_THREADS
        for (size_t done = 0; done < n;) {
            size_t step = n - done < (size_t)chunk ? n - done : (size_t)chunk;
            memcpy(d + done, s + done, step);
            done += step;
            __atomic_store_n(word, (uint64_t)done, __ATOMIC_RELEASE);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&prog);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static PyObject *follow_copy(PyObject *self, PyObject *args) {
    Py_buffer src, prog;
    double stall, limit;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*y*dd", &src, &prog, &stall, &limit))
        return NULL;
    uint64_t *word = progress_word(&prog);
    if (word == NULL) {
    } else if (!PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_BufferError, "follow_copy needs a contiguous buffer");
    } else if ((out = PyBytes_FromStringAndSize(NULL, src.len)) != NULL) {
        char *d = PyBytes_AS_STRING(out);
        const char *s = (const char *)src.buf;
        uint64_t n = (uint64_t)src.len, done = 0, seen = 0;
        int bad = 0;
        double since = 0.0; /* when progress last moved (0: look at the clock next time) */
        Py_BEGIN_ALLOW_THREADS
        double end = seconds_now() + limit;
        for (unsigned spins = 1; done < n; spins++) {
            uint64_t p = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if (p > n || p < done) { /* a writer only counts up to the length: garbage */
                seen = p;
                bad = 1;
                break;
            }
            if (p > done) {
                memcpy(d + done, s + done, (size_t)(p - done));
                done = p;
                since = 0.0;
                continue;
            }
            if ((spins & 255) == 0) {
                double now = seconds_now();
                if (now > end)
                    break;
                if (since == 0.0)
                    since = now;
                else if (now - since > stall)
                    break;
            }
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        Py_END_ALLOW_THREADS
        if (bad) {
            PyErr_Format(PyExc_ValueError, "progress word %llu is outside [%llu, %llu]",
                         (unsigned long long)seen, (unsigned long long)done, (unsigned long long)n);
            Py_CLEAR(out);
        } else if (done < n) {
            Py_DECREF(out);
            out = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&prog);
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
    {"publish_copy", publish_copy, METH_VARARGS, "Copy src into dst by chunks, publishing the count copied into progress."},
    {"follow_copy", follow_copy, METH_VARARGS, "A bytes copy of src, taken as progress says it was written; None on a stall."},
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
