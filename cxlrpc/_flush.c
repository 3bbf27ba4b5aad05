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
 * publish_copy(dst, src, progress, chunk[, seal, expected]): copy src into dst a chunk at a time,
 * storing the bytes copied so far into the u64 ``progress`` (release) after each: a reader copies
 * them out meanwhile; with a ``seal`` (u64 buffer), it stops as soon as that does not read
 * ``expected`` (before a chunk or a progress store): False then, else True.
 * follow_copy(src, progress, stall, limit[, seal, expected]): a new bytes copy of src, taken as
 * ``progress`` (acquire) says its bytes were written; None if it stops moving for ``stall``
 * seconds or is not done within ``limit``; False if, once copied, ``seal`` does not read
 * ``expected`` (the extent is no longer the reader's: the bytes may be another's).
 * Follower(length, copy): the same a step at a time (step(src, progress, spin, budget) -> bytes
 * done; take() -> the bytes), for a reader that must not wait long for one writer.
 * copy(dst, src): copy buffer src into the start of writable buffer dst with plain stores
 * (copy_span: around glibc's slow skews); copied(src): a new bytes object holding a copy of src.
 * features(): the instructions in use, e.g. "clwb+clflushopt".
 * Lines(address, size[, writeback, invalidate]): write-back and invalidation over one mapping for
 * the native paths (cxlrpc/_flush_api.h, the capsule _C_API): the instructions above, or a
 * simulator's hooks; counted, and a site can be skipped (mutation tests). sites(): their names.
 * Lines.write_body(offset, src) / read_body(offset, length): a big body into or out of the
 * mapping in one pass (streaming stores; each BODY_CHUNK invalidated right before it is copied).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cpuid.h>
#include <emmintrin.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_copy.h"
#include "_flush_api.h"
#include "_follow.h"
#include "_stream.h"

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

typedef void (*copier)(char *dst, const char *src, size_t n);

static void span_copy(char *dst, const char *src, size_t n) {
    copy_span(dst, src, n);
}

#define NOGIL_FROM (256 << 10) /* plain copies this big let other threads run meanwhile */

/* ``name``(dst, src): copy buffer src into the start of writable buffer dst with ``how``, the
 * GIL released from ``nogil_from`` bytes. */
static PyObject *copy_into(PyObject *args, const char *name, copier how, Py_ssize_t nogil_from) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src))
        return NULL;
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_Format(PyExc_BufferError, "%s needs contiguous buffers", name);
    } else if (src.len > dst.len) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes do not fit a %zd-byte buffer", name, src.len, dst.len);
    } else if (src.len >= nogil_from) {
        Py_BEGIN_ALLOW_THREADS
        how((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    } else {
        how((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* ``name``(src): a new bytes object holding a copy of buffer src made with ``how``, the GIL
 * released from ``nogil_from`` bytes. */
static PyObject *copy_out(PyObject *args, const char *name, copier how, Py_ssize_t nogil_from) {
    Py_buffer src;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*", &src))
        return NULL;
    if (!PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_Format(PyExc_BufferError, "%s needs a contiguous buffer", name);
    } else if ((out = PyBytes_FromStringAndSize(NULL, src.len)) != NULL) {
        char *dst = PyBytes_AS_STRING(out);
        if (src.len >= nogil_from) {
            Py_BEGIN_ALLOW_THREADS
            how(dst, (const char *)src.buf, (size_t)src.len);
            Py_END_ALLOW_THREADS
        } else {
            how(dst, (const char *)src.buf, (size_t)src.len);
        }
    }
    PyBuffer_Release(&src);
    return out;
}

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    return copy_into(args, "stream_copy", copy_streaming, 0);
}

static PyObject *stream_bytes(PyObject *self, PyObject *args) {
    return copy_out(args, "stream_bytes", copy_streaming, 0);
}

static PyObject *copy(PyObject *self, PyObject *args) {
    return copy_into(args, "copy", span_copy, NOGIL_FROM);
}

static PyObject *copied(PyObject *self, PyObject *args) {
    return copy_out(args, "copied", span_copy, NOGIL_FROM);
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
    Py_buffer dst, src, prog, sealbuf = {0};
    Py_ssize_t chunk;
    unsigned long long expected = 0;
    int stopped = 0;
    if (!PyArg_ParseTuple(args, "w*y*w*n|y*K", &dst, &src, &prog, &chunk, &sealbuf, &expected))
        return NULL;
    uint64_t *word = progress_word(&prog);
    const uint64_t *seal = sealbuf.obj == NULL ? NULL : progress_word(&sealbuf);
    if (word == NULL || (sealbuf.obj != NULL && seal == NULL)) {
    } else if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_BufferError, "publish_copy needs contiguous buffers");
    } else if (src.len > dst.len || chunk < 64) {
        PyErr_Format(PyExc_ValueError, "publish_copy: %zd bytes in a %zd-byte buffer by chunks of %zd",
                     src.len, dst.len, chunk);
    } else {
        Py_BEGIN_ALLOW_THREADS
        stopped = follow_publish((char *)dst.buf, (const char *)src.buf, (size_t)src.len, (size_t)chunk, word,
                                 seal, (uint64_t)expected) < 0;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&prog);
    if (sealbuf.obj != NULL)
        PyBuffer_Release(&sealbuf);
    if (PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(!stopped);
}

static void garbage_progress(uint64_t seen, uint64_t done, uint64_t n) {
    PyErr_Format(PyExc_ValueError, "progress word %llu is outside [%llu, %llu]",
                 (unsigned long long)seen, (unsigned long long)done, (unsigned long long)n);
}

static PyObject *follow_copy(PyObject *self, PyObject *args) {
    Py_buffer src, prog, sealbuf = {0};
    double stall, limit;
    unsigned long long expected = 0;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*y*dd|y*K", &src, &prog, &stall, &limit, &sealbuf, &expected))
        return NULL;
    uint64_t *word = progress_word(&prog);
    const uint64_t *seal = sealbuf.obj == NULL ? NULL : progress_word(&sealbuf);
    if (word == NULL || (sealbuf.obj != NULL && seal == NULL)) {
    } else if (!PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_BufferError, "follow_copy needs a contiguous buffer");
    } else if ((out = PyBytes_FromStringAndSize(NULL, src.len)) != NULL) {
        char *d = PyBytes_AS_STRING(out);
        uint64_t n = (uint64_t)src.len, done = 0, seen = 0;
        int rc, sealed = 1;
        Py_BEGIN_ALLOW_THREADS
        rc = follow_loop(NULL, d, (const char *)src.buf, word, n, &done, stall, limit, &seen);
        if (seal != NULL) /* copied, then the seal re-read (seqlock-style) */
            sealed = follow_sealed(seal, (uint64_t)expected);
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            garbage_progress(seen, done, n);
            Py_CLEAR(out);
        } else if (done < n) {
            Py_DECREF(out);
            out = Py_NewRef(Py_None);
        } else if (!sealed) {
            Py_DECREF(out);
            out = Py_NewRef(Py_False);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&prog);
    if (sealbuf.obj != NULL)
        PyBuffer_Release(&sealbuf);
    return out;
}

static cxlrpc_lines *lines_arg(PyObject *o, const Py_ssize_t *ranges, int count);

/* Follower(length, copy): a followed body taken a step at a time, so a reader that serves
 * others (the server's loop) never waits for one writer; with ``copy``, into a bytes object
 * nobody sees before take(). */
typedef struct {
    PyObject_HEAD
    PyObject *body;  /* the bytes being filled (NULL: not copying, or taken) */
    uint64_t length, done;
    int taken;
} Follower;

static int Follower_init(Follower *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"length", "copy", NULL};
    Py_ssize_t length;
    int copy;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "np", kwlist, &length, &copy))
        return -1;
    if (length < 0 || self->length || self->body) {
        PyErr_SetString(PyExc_ValueError, "Follower: a length of 0 or more, given once");
        return -1;
    }
    if (copy && (self->body = PyBytes_FromStringAndSize(NULL, length)) == NULL)
        return -1;
    self->length = (uint64_t)length;
    return 0;
}

static void Follower_dealloc(Follower *self) {
    Py_CLEAR(self->body);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* step(src, progress, spin, budget): follow on while progress moves (up to ``spin`` s without
 * it, ``budget`` s in all); the bytes done. ValueError if the word is garbage. */
static PyObject *Follower_step(Follower *self, PyObject *args) {
    Py_buffer src, prog;
    double spin, budget;
    if (!PyArg_ParseTuple(args, "y*y*dd", &src, &prog, &spin, &budget))
        return NULL;
    uint64_t *word = progress_word(&prog);
    if (word == NULL) {
    } else if (!PyBuffer_IsContiguous(&src, 'C') || (uint64_t)src.len != self->length) {
        PyErr_Format(PyExc_ValueError, "Follower.step: a contiguous source of %llu bytes",
                     (unsigned long long)self->length);
    } else if (self->taken) {
        PyErr_SetString(PyExc_ValueError, "Follower.step: the body was taken");
    } else {
        char *d = self->body != NULL ? PyBytes_AS_STRING(self->body) : NULL;
        uint64_t done = self->done, seen = 0;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = follow_loop(NULL, d, (const char *)src.buf, word, self->length, &done, spin, budget, &seen);
        Py_END_ALLOW_THREADS
        if (rc < 0)
            garbage_progress(seen, done, self->length);
        self->done = done;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&prog);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLongLong(self->done);
}

/* step_flushed(lines, at, progress_at, spin, budget): step over memory without coherence, through
 * a Lines (offsets in its mapping): the progress word's line invalidated before each look, each
 * run of bytes right before it is copied (follow_flushed's). */
static PyObject *Follower_step_flushed(Follower *self, PyObject *args) {
    PyObject *lo;
    Py_ssize_t at, progress_at;
    double spin, budget;
    if (!PyArg_ParseTuple(args, "Onndd", &lo, &at, &progress_at, &spin, &budget))
        return NULL;
    Py_ssize_t ranges[] = {at, (Py_ssize_t)self->length, progress_at, 8};
    cxlrpc_lines *l = lines_arg(lo, ranges, 2);
    if (l == NULL)
        return NULL;
    if (progress_at & 7) {
        PyErr_SetString(PyExc_ValueError, "Follower.step_flushed: an aligned progress word");
        return NULL;
    }
    if (self->taken) {
        PyErr_SetString(PyExc_ValueError, "Follower.step_flushed: the body was taken");
        return NULL;
    }
    char *d = self->body != NULL ? PyBytes_AS_STRING(self->body) : NULL;
    uint64_t done = self->done, seen = 0;
    int rc;
    if (l->py_writeback != NULL) {
        rc = follow_loop(l, d, l->base + at, (uint64_t *)(l->base + progress_at), self->length, &done, spin,
                                 budget, &seen);
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = follow_loop(l, d, l->base + at, (uint64_t *)(l->base + progress_at), self->length, &done, spin,
                                 budget, &seen);
        Py_END_ALLOW_THREADS
    }
    self->done = done;
    if (rc == -1)
        garbage_progress(seen, done, self->length);
    if (rc < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(self->done);
}

/* take(): the completed copy (once; None when not copying). */
static PyObject *Follower_take(Follower *self, PyObject *unused) {
    if (self->done < self->length || self->taken) {
        PyErr_SetString(PyExc_ValueError, "Follower.take: the body is not complete, or was taken");
        return NULL;
    }
    self->taken = 1;
    PyObject *body = self->body;
    self->body = NULL;
    return body != NULL ? body : Py_NewRef(Py_None);
}

static PyObject *Follower_get_done(Follower *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->done);
}

static PyMethodDef Follower_methods[] = {
    {"step", (PyCFunction)Follower_step, METH_VARARGS, "Follow while progress moves (spin, budget): the bytes done."},
    {"step_flushed", (PyCFunction)Follower_step_flushed, METH_VARARGS,
     "step without coherence, through a Lines: step_flushed(lines, at, progress_at, spin, budget)."},
    {"take", (PyCFunction)Follower_take, METH_NOARGS, "The completed copy (None when not copying)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Follower_getset[] = {
    {"done", (getter)Follower_get_done, NULL, "bytes followed so far", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FollowerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlrpc._flush.Follower",
    .tp_basicsize = sizeof(Follower),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Follower(length, copy): a followed body taken a step at a time.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Follower_init,
    .tp_dealloc = (destructor)Follower_dealloc,
    .tp_methods = Follower_methods,
    .tp_getset = Follower_getset,
};


/* ------------------------------------------------------------------ Lines (cxlrpc/_flush_api.h) */

static unsigned long long line_count(const volatile void *p, size_t n) {
    uintptr_t start = (uintptr_t)p & ~(uintptr_t)(LINE - 1);
    return (unsigned long long)(((uintptr_t)p + n - start + LINE - 1) / LINE);
}

static int outside(cxlrpc_lines *l, const volatile void *p, size_t n) {
    if (lines_cover(l, p, n))
        return 0;
    if (l->base == NULL)
        PyErr_SetString(PyExc_ValueError, "operation on a closed AtomicMemory (its region was closed)");
    else
        PyErr_Format(PyExc_ValueError, "range (%zd, %zu) outside a %zu-byte mapping",
                     (Py_ssize_t)((const char *)p - l->base), n, l->size);
    return 1;
}

static int cpu_writeback(cxlrpc_lines *l, const volatile void *p, size_t n) {
    if (outside(l, p, n))
        return -1;
    l->lines += line_count(p, n);
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)(LINE - 1), end = (uintptr_t)p + n; a < end; a += LINE)
        line_writeback((volatile char *)a);
    return 0;
}

static int cpu_invalidate(cxlrpc_lines *l, const volatile void *p, size_t n) {
    if (outside(l, p, n))
        return -1;
    l->lines += line_count(p, n);
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)(LINE - 1), end = (uintptr_t)p + n; a < end; a += LINE)
        line_invalidate((volatile char *)a);
    return 0;
}

static int hook(cxlrpc_lines *l, PyObject *fn, const volatile void *p, size_t n) {
    if (outside(l, p, n))
        return -1;
    l->lines += line_count(p, n);
    PyObject *args[2] = {PyLong_FromSsize_t((Py_ssize_t)((const char *)p - l->base)), PyLong_FromSize_t(n)};
    PyObject *res = args[0] != NULL && args[1] != NULL ? PyObject_Vectorcall(fn, args, 2, NULL) : NULL;
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    Py_XDECREF(res);
    return res == NULL ? -1 : 0;
}

static int sim_writeback(cxlrpc_lines *l, const volatile void *p, size_t n) {
    return hook(l, l->py_writeback, p, n);
}

static int sim_invalidate(cxlrpc_lines *l, const volatile void *p, size_t n) {
    return hook(l, l->py_invalidate, p, n);
}

/* ------------------------------------------------------------------ bodies in one pass */

static int body_write(cxlrpc_lines *l, int site, char *dst, const char *src, size_t n) {
    if (n == 0)
        return 0;
    if (outside(l, dst, n))
        return -1;
    if (l->py_writeback != NULL) { /* a simulator: the stores land in this process's "cache" */
        copy_span(dst, src, n);
        return lines_writeback(l, site, dst, n, CXLRPC_STORE_FENCE);
    }
    if (l->skip == site) { /* (a mutation test: cached stores, nothing written back) */
        copy_span(dst, src, n);
        return 0;
    }
    l->writebacks++;
    l->lines += line_count(dst, n);
    l->fences++;
    l->site_calls[site]++;
    l->site_fences[site]++;
    Py_BEGIN_ALLOW_THREADS
    stream_span(dst, src, n);
    /* the bytes stream_span stored plainly: the partial lines at either end */
    if ((uintptr_t)dst & (LINE - 1))
        line_writeback(dst);
    if (((uintptr_t)dst + n) & (LINE - 1))
        line_writeback(dst + n - 1);
    _mm_sfence();
    Py_END_ALLOW_THREADS
    return 0;
}

static int body_read(cxlrpc_lines *l, int site, char *dst, const char *src, size_t n) {
    if (n == 0)
        return 0;
    if (outside(l, src, n))
        return -1;
    if (l->py_writeback != NULL || l->skip == site) { /* a simulator's hooks (the GIL held) */
        for (size_t done = 0, step; done < n; done += step) {
            step = n - done < CXLRPC_BODY_CHUNK ? n - done : CXLRPC_BODY_CHUNK;
            if (lines_invalidate(l, site, src + done, step, CXLRPC_FULL_FENCE) < 0)
                return -1;
            copy_span(dst + done, src + done, step);
        }
        return 0;
    }
    for (size_t done = 0, step; done < n; done += step) { /* counted first, with the GIL */
        step = n - done < CXLRPC_BODY_CHUNK ? n - done : CXLRPC_BODY_CHUNK;
        l->invalidates++;
        l->fences++;
        l->lines += line_count(src + done, step);
        l->site_calls[site]++;
        l->site_fences[site]++;
    }
    PyThreadState *ts = n >= NOGIL_FROM ? PyEval_SaveThread() : NULL;
    for (size_t done = 0, step; done < n; done += step) {
        step = n - done < CXLRPC_BODY_CHUNK ? n - done : CXLRPC_BODY_CHUNK;
        for (uintptr_t a = (uintptr_t)(src + done) & ~(uintptr_t)(LINE - 1), end = (uintptr_t)(src + done + step);
             a < end; a += LINE)
            line_invalidate((volatile char *)a);
        __asm__ volatile("mfence" ::: "memory");
        copy_span(dst + done, src + done, step);
    }
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    return 0;
}

/* ------------------------------------------------------------------ followed bodies, flushed */
/* A followed body (cxlrpc.heap) over memory without coherence, through ``l``: the writer streams
 * each chunk in (nothing left to write back), fences, stores the progress word and writes its
 * line back; the reader invalidates the progress word's line before each look, and each run of
 * bytes it announced right before copying it; the seal's line is invalidated before each check.
 * Over real memory these run without the GIL (the CPU's instructions only: every range was
 * checked to lie inside the mapping first); over a simulator with it (its hooks are Python).
 * Return 0, or -1 with an error set (a hook raised); *sealed says whether the seal held. */

static int seal_holds(cxlrpc_lines *l, const uint64_t *seal, uint64_t expected, int *held) {
    if (lines_invalidate(l, CXLRPC_SITE_FOLLOW_SEAL, seal, 8, CXLRPC_FULL_FENCE) < 0)
        return -1;
    *held = __atomic_load_n(seal, __ATOMIC_ACQUIRE) == expected;
    return 0;
}

static int publish_flushed_loop(cxlrpc_lines *l, char *dst, const char *src, size_t n, size_t chunk,
                                uint64_t *progress, const uint64_t *seal, uint64_t expected, int *sealed) {
    int sim = l->py_writeback != NULL;
    *sealed = 1;
    for (size_t done = 0, step; done < n; done += step) {
        step = n - done < chunk ? n - done : chunk;
        if (seal != NULL && (seal_holds(l, seal, expected, sealed) < 0 || !*sealed))
            return *sealed ? -1 : 0;
        if (sim || l->skip == CXLRPC_SITE_FOLLOW_WRITE) {
            copy_span(dst + done, src + done, step);
            if (lines_writeback(l, CXLRPC_SITE_FOLLOW_WRITE, dst + done, step, CXLRPC_STORE_FENCE) < 0)
                return -1;
        } else {
            char *d = dst + done;
            l->writebacks++;
            l->lines += line_count(d, step);
            l->site_calls[CXLRPC_SITE_FOLLOW_WRITE]++;
            l->site_fences[CXLRPC_SITE_FOLLOW_WRITE]++;
            stream_span(d, src + done, step);
            if ((uintptr_t)d & (LINE - 1))
                line_writeback(d);
            if (((uintptr_t)d + step) & (LINE - 1))
                line_writeback(d + step - 1);
            lines_fence(l, CXLRPC_STORE_FENCE);
        }
        if (seal != NULL && (seal_holds(l, seal, expected, sealed) < 0 || !*sealed))
            return *sealed ? -1 : 0;
        __atomic_store_n(progress, (uint64_t)(done + step), __ATOMIC_RELEASE);
        if (lines_writeback(l, CXLRPC_SITE_FOLLOW_PROGRESS, progress, 8, CXLRPC_NO_FENCE) < 0)
            return -1;
    }
    return 0;
}

/* The Lines object of argument ``o``, its ranges (offset, length) checked: NULL with an error set. */
static cxlrpc_lines *lines_arg(PyObject *o, const Py_ssize_t *ranges, int count);

/* publish_flushed(lines, at, src, progress_at, chunk[, seal_at, expected]): publish_copy over
 * memory without coherence (offsets in the mapping; seal_at -1: none). False: the seal changed. */
static PyObject *publish_flushed(PyObject *self, PyObject *args) {
    PyObject *lo;
    Py_ssize_t at, progress_at, chunk, seal_at = -1;
    unsigned long long expected = 0;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "Ony*nn|nK", &lo, &at, &src, &progress_at, &chunk, &seal_at, &expected))
        return NULL;
    Py_ssize_t ranges[] = {at, src.len, progress_at, 8, seal_at < 0 ? 0 : seal_at, seal_at < 0 ? 0 : 8};
    cxlrpc_lines *l = lines_arg(lo, ranges, 3);
    int rc = -1, sealed = 1;
    if (l == NULL) {
    } else if (!PyBuffer_IsContiguous(&src, 'C') || chunk < 64 || (progress_at & 7) || (seal_at >= 0 && (seal_at & 7))) {
        PyErr_SetString(PyExc_ValueError, "publish_flushed: a contiguous source, chunks of 64 bytes or more, aligned words");
    } else {
        uint64_t *progress = (uint64_t *)(l->base + progress_at);
        const uint64_t *seal = seal_at < 0 ? NULL : (const uint64_t *)(l->base + seal_at);
        if (l->py_writeback != NULL) {
            rc = publish_flushed_loop(l, l->base + at, (const char *)src.buf, (size_t)src.len, (size_t)chunk, progress,
                                      seal, (uint64_t)expected, &sealed);
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = publish_flushed_loop(l, l->base + at, (const char *)src.buf, (size_t)src.len, (size_t)chunk, progress,
                                      seal, (uint64_t)expected, &sealed);
            Py_END_ALLOW_THREADS
        }
    }
    PyBuffer_Release(&src);
    if (rc < 0)
        return NULL;
    return PyBool_FromLong(sealed);
}

/* follow_flushed(lines, at, length, progress_at, stall, limit[, seal_at, expected]): follow_copy
 * over memory without coherence (offsets in the mapping; seal_at -1: none). */
static PyObject *follow_flushed(PyObject *self, PyObject *args) {
    PyObject *lo, *out = NULL;
    Py_ssize_t at, length, progress_at, seal_at = -1;
    double stall, limit;
    unsigned long long expected = 0;
    if (!PyArg_ParseTuple(args, "Onnndd|nK", &lo, &at, &length, &progress_at, &stall, &limit, &seal_at, &expected))
        return NULL;
    Py_ssize_t ranges[] = {at, length, progress_at, 8, seal_at < 0 ? 0 : seal_at, seal_at < 0 ? 0 : 8};
    cxlrpc_lines *l = lines_arg(lo, ranges, 3);
    if (l == NULL)
        return NULL;
    if ((progress_at & 7) || (seal_at >= 0 && (seal_at & 7))) {
        PyErr_SetString(PyExc_ValueError, "follow_flushed: aligned words");
        return NULL;
    }
    if ((out = PyBytes_FromStringAndSize(NULL, length)) == NULL)
        return NULL;
    uint64_t *word = (uint64_t *)(l->base + progress_at), done = 0, seen = 0;
    const uint64_t *seal = seal_at < 0 ? NULL : (const uint64_t *)(l->base + seal_at);
    int rc = 0, sealed = 1, sim = l->py_writeback != NULL;
    PyThreadState *ts = sim ? NULL : PyEval_SaveThread();
    rc = follow_loop(l, PyBytes_AS_STRING(out), l->base + at, word, (uint64_t)length, &done, stall, limit, &seen);
    if (rc == 0 && done == (uint64_t)length && seal != NULL && seal_holds(l, seal, (uint64_t)expected, &sealed) < 0)
        rc = -2;
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    if (rc == -1) {
        garbage_progress(seen, done, (uint64_t)length);
        Py_CLEAR(out);
    } else if (rc < 0) {
        Py_CLEAR(out);
    } else if (done < (uint64_t)length) {
        Py_SETREF(out, Py_NewRef(Py_None));
    } else if (!sealed) {
        Py_SETREF(out, Py_NewRef(Py_False));
    }
    return out;
}

static int Lines_init(cxlrpc_lines *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"address", "size", "writeback", "invalidate", NULL};
    unsigned long long address, size;
    PyObject *wb = Py_None, *inv = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KK|OO", kwlist, &address, &size, &wb, &inv))
        return -1;
    if (self->base != NULL || self->writeback != NULL) {
        PyErr_SetString(PyExc_ValueError, "Lines: initialised once");
        return -1;
    }
    if ((wb == Py_None) != (inv == Py_None) || (wb != Py_None && (!PyCallable_Check(wb) || !PyCallable_Check(inv)))) {
        PyErr_SetString(PyExc_TypeError, "Lines: both hooks (callables of offset, length) or neither");
        return -1;
    }
    if (address == 0 || address + size < address) {
        PyErr_SetString(PyExc_ValueError, "Lines: a mapping's address and size");
        return -1;
    }
    self->base = (char *)(uintptr_t)address;
    self->size = (size_t)size;
    if (wb != Py_None) {
        self->py_writeback = Py_NewRef(wb);
        self->py_invalidate = Py_NewRef(inv);
        self->writeback = sim_writeback;
        self->invalidate = sim_invalidate;
    } else {
        self->writeback = cpu_writeback;
        self->invalidate = cpu_invalidate;
    }
    return 0;
}

static int Lines_traverse(cxlrpc_lines *self, visitproc visit, void *arg) {
    Py_VISIT(self->py_writeback);
    Py_VISIT(self->py_invalidate);
    return 0;
}

static int Lines_clear(cxlrpc_lines *self) {
    Py_CLEAR(self->py_writeback);
    Py_CLEAR(self->py_invalidate);
    return 0;
}

static void Lines_dealloc(cxlrpc_lines *self) {
    PyObject_GC_UnTrack(self);
    Lines_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* (offset, length) of the mapping as a pointer and size: 0, or -1 with an error set. */
static int lines_args(cxlrpc_lines *self, PyObject *const *args, Py_ssize_t nargs, const char **p, size_t *n) {
    if (nargs != 2 || !PyLong_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "(offset: int, length: int)");
        return -1;
    }
    if (self->writeback == NULL) {
        PyErr_SetString(PyExc_ValueError, "Lines is not initialised");
        return -1;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[0]), length = PyLong_AsSsize_t(args[1]);
    if ((offset == -1 || length == -1) && PyErr_Occurred())
        return -1;
    if (offset < 0 || length < 0 || self->base == NULL || (size_t)offset > self->size ||
        (size_t)length > self->size - (size_t)offset) {
        if (self->base == NULL)
            PyErr_SetString(PyExc_ValueError, "operation on a closed AtomicMemory (its region was closed)");
        else
            PyErr_Format(PyExc_ValueError, "range (%zd, %zd) outside a %zu-byte buffer", offset, length, self->size);
        return -1;
    }
    *p = self->base + offset;
    *n = (size_t)length;
    return 0;
}

static PyObject *Lines_writeback(cxlrpc_lines *self, PyObject *const *args, Py_ssize_t nargs) {
    const char *p;
    size_t n;
    if (lines_args(self, args, nargs, &p, &n) < 0 ||
        lines_writeback(self, CXLRPC_SITE_PY, p, n, CXLRPC_STORE_FENCE) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Lines_invalidate(cxlrpc_lines *self, PyObject *const *args, Py_ssize_t nargs) {
    const char *p;
    size_t n;
    if (lines_args(self, args, nargs, &p, &n) < 0 ||
        lines_invalidate(self, CXLRPC_SITE_PY, p, n, CXLRPC_FULL_FENCE) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* write_body(offset, src): body_write of buffer src at offset of the mapping (BODY_WRITE). */
static PyObject *Lines_write_body(cxlrpc_lines *self, PyObject *args) {
    Py_ssize_t offset;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "ny*", &offset, &src))
        return NULL;
    int rc = -1;
    if (!PyBuffer_IsContiguous(&src, 'C'))
        PyErr_SetString(PyExc_BufferError, "write_body needs a contiguous buffer");
    else if (self->writeback == NULL || self->base == NULL)
        PyErr_SetString(PyExc_ValueError, "operation on a closed AtomicMemory (its region was closed)");
    else if (offset < 0 || (size_t)offset > self->size)
        PyErr_Format(PyExc_ValueError, "offset %zd outside a %zu-byte mapping", offset, self->size);
    else
        rc = body_write(self, CXLRPC_SITE_BODY_WRITE, self->base + offset, (const char *)src.buf, (size_t)src.len);
    PyBuffer_Release(&src);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* read_body(offset, length): a new bytes copy of the mapping's range, by body_read (BODY_READ). */
static PyObject *Lines_read_body(cxlrpc_lines *self, PyObject *const *args, Py_ssize_t nargs) {
    const char *p;
    size_t n;
    if (lines_args(self, args, nargs, &p, &n) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (out != NULL && body_read(self, CXLRPC_SITE_BODY_READ, PyBytes_AS_STRING(out), p, n) < 0)
        Py_CLEAR(out);
    return out;
}

static PyObject *Lines_close(cxlrpc_lines *self, PyObject *unused) {
    self->base = NULL;
    self->size = 0;
    Py_RETURN_NONE;
}

static PyObject *Lines_counts(cxlrpc_lines *self, PyObject *unused) {
    return Py_BuildValue("{sKsKsKsK}", "writebacks", self->writebacks, "invalidates", self->invalidates,
                         "fences", self->fences, "lines", self->lines);
}

static PyObject *Lines_reset(cxlrpc_lines *self, PyObject *unused) {
    self->writebacks = self->invalidates = self->fences = self->lines = 0;
    memset(self->site_calls, 0, sizeof self->site_calls);
    memset(self->site_fences, 0, sizeof self->site_fences);
    Py_RETURN_NONE;
}

static PyObject *Lines_site_counts(cxlrpc_lines *self, PyObject *unused);

static PyObject *Lines_get_skip(cxlrpc_lines *self, void *closure) {
    return PyLong_FromLong(self->skip);
}

static int Lines_set_skip(cxlrpc_lines *self, PyObject *value, void *closure) {
    long site = value == NULL ? 0 : PyLong_AsLong(value);
    if (site == -1 && PyErr_Occurred())
        return -1;
    if (site < 0 || site >= CXLRPC_SITE_COUNT) {
        PyErr_Format(PyExc_ValueError, "skip: a site number in [0, %d) (0: none)", CXLRPC_SITE_COUNT);
        return -1;
    }
    self->skip = (int)site;
    return 0;
}

static PyObject *Lines_get_simulated(cxlrpc_lines *self, void *closure) {
    return PyBool_FromLong(self->py_writeback != NULL);
}

static PyMethodDef Lines_methods[] = {
    {"writeback", (PyCFunction)(void (*)(void))Lines_writeback, METH_FASTCALL,
     "writeback(offset, length): write the range's lines back, then a store fence."},
    {"invalidate", (PyCFunction)(void (*)(void))Lines_invalidate, METH_FASTCALL,
     "invalidate(offset, length): drop the range's lines from this CPU's caches, then a full fence."},
    {"write_body", (PyCFunction)Lines_write_body, METH_VARARGS,
     "write_body(offset, src): copy src there with streaming stores (nothing to write back), then a store fence."},
    {"read_body", (PyCFunction)(void (*)(void))Lines_read_body, METH_FASTCALL,
     "read_body(offset, length): a bytes copy of the range, each chunk invalidated right before it is copied."},
    {"close", (PyCFunction)Lines_close, METH_NOARGS, "From here every operation raises ValueError (unmapped)."},
    {"counts", (PyCFunction)Lines_counts, METH_NOARGS, "Write-backs, invalidates, fences and lines so far."},
    {"reset", (PyCFunction)Lines_reset, METH_NOARGS, "Zero the counts."},
    {"site_counts", (PyCFunction)Lines_site_counts, METH_NOARGS,
     "Per site called so far (by name): (calls, fences) of its write-backs or invalidates."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lines_getset[] = {
    {"skip", (getter)Lines_get_skip, (setter)Lines_set_skip, "a site whose calls do nothing (0: none)", NULL},
    {"simulated", (getter)Lines_get_simulated, NULL, "True over a simulator's hooks", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LinesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlrpc._flush.Lines",
    .tp_basicsize = sizeof(cxlrpc_lines),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Lines(address, size, writeback=None, invalidate=None): write-back and invalidation over one mapping.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lines_init,
    .tp_dealloc = (destructor)Lines_dealloc,
    .tp_traverse = (traverseproc)Lines_traverse,
    .tp_clear = (inquiry)Lines_clear,
    .tp_methods = Lines_methods,
    .tp_getset = Lines_getset,
};

static cxlrpc_lines *lines_arg(PyObject *o, const Py_ssize_t *ranges, int count) {
    if (!PyObject_TypeCheck(o, &LinesType)) {
        PyErr_SetString(PyExc_TypeError, "a cxlrpc._flush.Lines");
        return NULL;
    }
    cxlrpc_lines *l = (cxlrpc_lines *)o;
    if (l->writeback == NULL || l->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "operation on a closed AtomicMemory (its region was closed)");
        return NULL;
    }
    for (int i = 0; i < count; i++) {
        Py_ssize_t off = ranges[2 * i], len = ranges[2 * i + 1];
        if (off < 0 || len < 0 || (size_t)off > l->size || (size_t)len > l->size - (size_t)off) {
            PyErr_Format(PyExc_ValueError, "range (%zd, %zd) outside a %zu-byte mapping", off, len, l->size);
            return NULL;
        }
    }
    return l;
}

#define SITE_ENTRY(name, what) {#name, what},
static const struct { const char *name, *what; } site_table[] = {{"NONE", "no site (skip = 0)"},
                                                                  CXLRPC_FLUSH_SITES(SITE_ENTRY)};
#undef SITE_ENTRY

static PyObject *sites(PyObject *self, PyObject *unused) {
    PyObject *out = PyTuple_New(CXLRPC_SITE_COUNT);
    for (int i = 0; out != NULL && i < CXLRPC_SITE_COUNT; i++) {
        PyObject *item = Py_BuildValue("(ss)", site_table[i].name, site_table[i].what);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *Lines_site_counts(cxlrpc_lines *self, PyObject *unused) {
    PyObject *out = PyDict_New();
    for (int i = 1; out != NULL && i < CXLRPC_SITE_COUNT; i++) {
        if (!self->site_calls[i])
            continue;
        PyObject *item = Py_BuildValue("(KK)", self->site_calls[i], self->site_fences[i]);
        if (item == NULL || PyDict_SetItemString(out, site_table[i].name, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

static cxlrpc_flush_api c_api;

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
    {"publish_flushed", publish_flushed, METH_VARARGS, "publish_copy over memory without coherence, through a Lines."},
    {"follow_flushed", follow_flushed, METH_VARARGS, "follow_copy over memory without coherence, through a Lines."},
    {"copy", copy, METH_VARARGS, "Copy src into the start of dst with plain stores."},
    {"copied", copied, METH_VARARGS, "A new bytes copy of src."},
    {"features", features, METH_NOARGS, "The flush instructions this CPU offers."},
    {"sites", sites, METH_NOARGS, "The flush sites: (name, what it protects), by number (0: none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cxlrpc._flush", NULL, -1, methods};

PyMODINIT_FUNC PyInit__flush(void) {
    unsigned int a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        have_clflushopt = (b >> 23) & 1;
        have_clwb = (b >> 24) & 1;
    }
    if (PyType_Ready(&FollowerType) < 0 || PyType_Ready(&LinesType) < 0)
        return NULL;
    c_api.lines_type = &LinesType;
    c_api.body_write = body_write;
    c_api.body_read = body_read;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *api = PyCapsule_New(&c_api, CXLRPC_FLUSH_API_CAPSULE, NULL);
    if (PyModule_AddObjectRef(m, "Follower", (PyObject *)&FollowerType) < 0 ||
        PyModule_AddObjectRef(m, "Lines", (PyObject *)&LinesType) < 0 || api == NULL ||
        PyModule_AddObject(m, "_C_API", api) < 0 || PyModule_AddIntConstant(m, "BODY_CHUNK", CXLRPC_BODY_CHUNK) < 0) {
        Py_XDECREF(api);
        Py_CLEAR(m);
    }
    return m;
}
