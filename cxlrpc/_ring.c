/* The rings' hot path in C (cxlrpc.ring.base documents the protocol; the Python methods there
 * are the reference and run wherever this is not built). On memory without coherence an SPSC
 * ring runs here too, through the region's ``Lines`` (cxlrpc/_flush_api.h), with the reference's
 * write-backs and invalidates and no more: a push writes back the record's lines, fences once,
 * stores the tail and writes its line back; a poll invalidates the tail's line and, only when
 * it moved, the new records' lines, and writes the head's line back once it is stored. An MPSC
 * ring there (flush mode has none), or one whose memory flushes without the native Lines, keeps
 * to the reference. Coherent memory pays one predictable test (``lines``) at each such place.
 *
 * RingCore is the base class of RingBase: it holds the counters' private copies (_head_local,
 * _tail_local, _head_cache) and the dropped count, so the Python slow paths (repairs, unblock,
 * attach) and these fast paths share one state. Each entry point first checks that the region's
 * memoryview was not released (the mapping may be gone), and again after every handler call.
 * Every counter and header read from shared memory is validated before use, exactly as the
 * Python reference does: a peer may die mid-write or write garbage.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "_copy.h"
#include "_flush_api.h"
#include "_ring_api.h"

#define HEADER_SIZE 8
#define CONTROL_SIZE 256
#define TAIL_OFFSET 0
#define HEAD_OFFSET 128
#define KIND_DATA 1ULL
#define KIND_PADDING 2ULL
#define COMMITTED (1ULL << 62)
#define LENGTH_MASK 0xFFFFFFFFULL
#define TAG_SHIFT 56
#define MAX_PRODUCER 0xFFFF
#define TAG_MASK 0x3F
#define COUNTER_LIMIT (1ULL << 62)
#define PAD_CLEAN (1ULL << 63)
#define HOT_SPAN 16384ULL /* record.py's; a quarter of rings under 64 KiB (hot_span) */
#define NO_PADDING UINT64_MAX
#define MAX_PARTS 8

typedef struct {
    PyObject_HEAD
    PyObject *buf; /* the region's memoryview */
    char *base;
    unsigned long long capacity, mask, max_payload, hot_span;
    Py_ssize_t data, tail_at, head_at;
    unsigned long long head_local, tail_local, head_cache;
    unsigned long long wrap_from; /* a producer's next look for an early wrap (see early_wrap) */
    Py_ssize_t dropped;
    int multi;
    int flushing;          /* memory without coherence that this code does not serve: the reference */
    cxlrpc_lines *lines;   /* memory without coherence served here (an SPSC ring): its Lines; else NULL */
    size_t len; /* of the buffer */
    PyObject *claim_obj; /* the claim counter last pushed with, and its word when inside buf (else NULL) */
    uint64_t *claim_ptr;
} RingCore;

static PyObject *s_poll_py, *s_within_py, *s_readable_py, *s_push_py, *s_bad_tail, *s_open, *s_revoke, *s_lost_commit,
    *s_address, *s_cas;
static cxlrpc_flush_api *flush_api; /* cxlrpc._flush's C API, or NULL where it was not built */
static PyObject *acq_rel_order; /* cxlrpc.memory.ACQ_REL, for the claim counter's CAS (the native
                                   atomics' or, where they were not built, their stand-in's) */

static inline uint64_t *word_at(RingCore *r, Py_ssize_t off) { return (uint64_t *)(r->base + off); }
static inline uint64_t load_acq(RingCore *r, Py_ssize_t off) { return __atomic_load_n(word_at(r, off), __ATOMIC_ACQUIRE); }
static inline void store_rel(RingCore *r, Py_ssize_t off, uint64_t v) { __atomic_store_n(word_at(r, off), v, __ATOMIC_RELEASE); }
static inline void store_rlx(RingCore *r, Py_ssize_t off, uint64_t v) { __atomic_store_n(word_at(r, off), v, __ATOMIC_RELAXED); }
static inline uint64_t cas(RingCore *r, Py_ssize_t off, uint64_t expected, uint64_t desired) {
    __atomic_compare_exchange_n(word_at(r, off), &expected, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return expected; /* the previous value, as AtomicMemory.cas returns it */
}

static int check_open(RingCore *r) {
    if (r->buf == NULL || ((PyMemoryViewObject *)r->buf)->flags & _Py_MEMORYVIEW_RELEASED) {
        PyErr_SetString(PyExc_ValueError, "the ring's region is closed");
        return -1;
    }
    return 0;
}

/* ``self.<name>(*args, **kwargs)``: the Python reference takes every call the fast path does not
 * (memory without coherence, keywords, odd arguments, private counters that are not sane). */
static PyObject *to_reference(RingCore *self, PyObject *name, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *stack[16];
    if (nargs + nkw + 1 > 16) {
        PyErr_SetString(PyExc_TypeError, "too many arguments");
        return NULL;
    }
    stack[0] = (PyObject *)self;
    for (Py_ssize_t i = 0; i < nargs + nkw; i++)
        stack[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, stack, (size_t)(nargs + 1), kwnames);
}

/* A private counter the fast path can trust: aligned and far below 2**64 (no unsigned wrap). */
static inline int sane(uint64_t counter) { return !(counter & 7) && counter < COUNTER_LIMIT; }

/* Flush mode: invalidate the lines of the data bytes of positions [start, end) (wrapping: two
 * ranges), one full fence after the last: the consumer reads them next. 0, or -1 with an error
 * set (a simulator's hook raised, or the region was closed). */
static int invalidate_span(RingCore *r, uint64_t start, uint64_t end) {
    uint64_t idx = start & r->mask, n = end - start;
    char *data = r->base + r->data;
    if (n > r->capacity - idx) {
        uint64_t first = r->capacity - idx;
        if (lines_invalidate(r->lines, CXLRPC_SITE_RING_POLL_DATA, data + idx, first, CXLRPC_NO_FENCE) < 0)
            return -1;
        idx = 0;
        n -= first;
    }
    return lines_invalidate(r->lines, CXLRPC_SITE_RING_POLL_DATA, data + idx, n, CXLRPC_FULL_FENCE);
}

/* Flush mode: write back the line of a counter (at ``off``) just stored, at ``site``. No fence:
 * the store it publishes needs none of its own (the next publication's fence orders it). */
static inline int counter_written(RingCore *r, int site, Py_ssize_t off) {
    return lines_writeback(r->lines, site, r->base + off, 8, CXLRPC_NO_FENCE);
}

/* Flush mode: invalidate the line of the other side's counter (at ``off``) before it is read. */
static inline int counter_fetched(RingCore *r, int site, Py_ssize_t off) {
    return lines_invalidate(r->lines, site, r->base + off, 8, CXLRPC_FULL_FENCE);
}

/* RingCore(buf, offset, capacity, multi_producer, lines=None, flushing=False): ``lines`` the
 * region's Lines on memory without coherence (AtomicMemory.lines), ``flushing`` True there too
 * (without Lines, the native flush module absent: the reference serves the ring). */
static int core_init(RingCore *self, PyObject *args, PyObject *kwds) {
    PyObject *buf, *lines = Py_None;
    Py_ssize_t offset, capacity;
    int multi, flushing = 0;
    static char *kwlist[] = {"buf", "offset", "capacity", "multi_producer", "lines", "flushing", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnp|Op", kwlist, &buf, &offset, &capacity, &multi, &lines,
                                     &flushing))
        return -1;
    if (lines != Py_None && (flush_api == NULL || !PyObject_TypeCheck(lines, flush_api->lines_type))) {
        PyErr_SetString(PyExc_TypeError, "lines must be a cxlrpc._flush.Lines or None");
        return -1;
    }
    if (!PyMemoryView_Check(buf)) {
        PyErr_SetString(PyExc_TypeError, "buf must be a memoryview");
        return -1;
    }
    Py_buffer *view = PyMemoryView_GET_BUFFER(buf);
    if (view->readonly || view->itemsize != 1 || !PyBuffer_IsContiguous(view, 'C')) {
        PyErr_SetString(PyExc_ValueError, "buf must be a writable contiguous byte buffer");
        return -1;
    }
    if (capacity < 1024 || capacity > (1LL << 31) || (capacity & (capacity - 1))) {
        PyErr_SetString(PyExc_ValueError, "ring capacity must be a power of two in [1 KiB, 2 GiB]");
        return -1;
    }
    if (offset < 0 || offset % 128 || (unsigned long long)view->len < (unsigned long long)offset + CONTROL_SIZE + capacity ||
        ((uintptr_t)view->buf + (uintptr_t)offset) % 8) {
        PyErr_SetString(PyExc_ValueError, "ring does not fit its buffer at that offset (or is misaligned)");
        return -1;
    }
    if (lines != Py_None && !lines_cover((cxlrpc_lines *)lines, (char *)view->buf + offset, CONTROL_SIZE + capacity)) {
        PyErr_SetString(PyExc_ValueError, "the ring lies outside the mapping its lines cover");
        return -1;
    }
    Py_INCREF(buf);
    Py_XSETREF(self->buf, buf);
    /* an MPSC ring over such memory keeps to the reference (flush mode has none) */
    int native_lines = lines != Py_None && !multi;
    Py_XSETREF(self->lines, native_lines ? (cxlrpc_lines *)Py_NewRef(lines) : NULL);
    Py_CLEAR(self->claim_obj); /* its word was looked up in the previous buffer */
    self->claim_ptr = NULL;
    self->base = (char *)view->buf;
    self->len = (size_t)view->len;
    self->capacity = capacity;
    self->mask = capacity - 1;
    self->max_payload = capacity / 2 - HEADER_SIZE;
    self->hot_span = (unsigned long long)capacity / 4 < HOT_SPAN ? (unsigned long long)capacity / 4 : HOT_SPAN;
    if (native_lines)
        self->hot_span = UINT64_MAX; /* no early wrap: its padding's span would be written back whole */
    self->wrap_from = 0;
    self->data = offset + CONTROL_SIZE;
    self->tail_at = offset + TAIL_OFFSET;
    self->head_at = offset + HEAD_OFFSET;
    self->multi = multi;
    self->flushing = !native_lines && (flushing || lines != Py_None);
    return 0;
}

static int core_traverse(RingCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->buf);
    Py_VISIT(self->claim_obj);
    Py_VISIT(self->lines);
    return 0;
}

static int core_clear(RingCore *self) {
    Py_CLEAR(self->buf);
    Py_CLEAR(self->claim_obj);
    Py_CLEAR(self->lines);
    self->claim_ptr = NULL;
    return 0;
}

static void core_dealloc(RingCore *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Zero the data bytes of positions [start, end) (an MPSC consumer's release). */
static void zero_span(RingCore *r, uint64_t start, uint64_t end) {
    while (start < end) {
        uint64_t idx = start & r->mask;
        uint64_t n = end - start;
        if (n > r->capacity - idx)
            n = r->capacity - idx;
        memset(r->base + r->data + idx, 0, n);
        start += n;
    }
}

/* Release [head, pos) to the producers. An MPSC consumer zeroes it first (free space reads
 * zero), except the body of the clean padding at ``clean`` (a producer's wrap over free space,
 * zero already: up to a lap's worth of pages left untouched), or NO_PADDING. In flush mode the
 * head's line is written back. 0, or -1 with an error set. */
static int release_to(RingCore *r, uint64_t head, uint64_t pos, uint64_t clean) {
    if (r->multi) {
        if (clean != NO_PADDING && clean >= head && clean < pos) {
            zero_span(r, head, clean + HEADER_SIZE);
            zero_span(r, (clean | r->mask) + 1, pos);
        } else {
            zero_span(r, head, pos);
        }
    }
    r->head_local = pos;
    store_rel(r, r->head_at, pos);
    return r->lines != NULL ? counter_written(r, CXLRPC_SITE_RING_RELEASE_HEAD, r->head_at) : 0;
}

/* Should a record of ``size`` at ``tail`` (``idx`` in the buffer) go to the ring's start
 * although it fits before the end? Yes when ``idx`` is hot_span or more and the consumer has
 * taken everything (cxlrpc.ring.record): traffic keeps to the ring's first pages. The head is
 * read at most once per hot_span of tail. */
static int early_wrap(RingCore *r, uint64_t tail, uint64_t idx, uint64_t size) {
    if (idx < r->hot_span || size > idx || (tail < r->wrap_from && r->wrap_from - tail <= r->hot_span))
        return 0;
    uint64_t head = load_acq(r, r->head_at);
    if (head == tail) {
        r->head_cache = head;
        return 1;
    }
    r->wrap_from = tail + r->hot_span;
    return 0;
}

static PyObject *poll_records(RingCore *self, long long limit, PyObject *handler, cxlrpc_record_fn fn, void *ctx,
                              int tail_fresh);
static PyObject *push_spsc_views(RingCore *self, Py_buffer *views, Py_ssize_t n, uint64_t length);
static PyObject *push_mpsc_views(RingCore *self, long producer, long tag, PyObject *claim, PyObject *revoked,
                                 Py_buffer *views, Py_ssize_t n, uint64_t length);
static PyObject *poll_within_records(RingCore *self, PyObject *handler, long long limit, double seconds,
                                     cxlrpc_record_fn fn, void *ctx);

/* A poll's limit from Python (an int: huge ones saturate): 0, or -1 with an error set. */
static int limit_arg(PyObject *arg, long long *limit) {
    int overflow;
    *limit = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (overflow)
        *limit = overflow > 0 ? LLONG_MAX : -1;
    else if (*limit == -1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* poll(handler, limit=2**30): RingBase._poll_py. */
static PyObject *core_poll(RingCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (kwnames || self->flushing || nargs < 1 || nargs > 2 || (nargs == 2 && !PyLong_CheckExact(args[1])) ||
        !sane(self->head_local))
        return to_reference(self, s_poll_py, args, nargs, kwnames);
    long long limit = 1LL << 30;
    if (nargs == 2 && limit_arg(args[1], &limit) < 0)
        return NULL;
    return poll_records(self, limit, args[0], NULL, NULL, 0);
}

/* poll's work once its arguments are known: each data record goes to ``fn(ctx, ...)`` where
 * one is given (a C handler), else to ``handler`` as a view of the region. ``tail_fresh``: in
 * flush mode the tail's line was invalidated just now (poll_within's look), not again here. */
static PyObject *poll_records(RingCore *self, long long limit, PyObject *handler, cxlrpc_record_fn fn, void *ctx,
                              int tail_fresh) {
    if (check_open(self) < 0)
        return NULL;
    uint64_t head = self->head_local;
    if (self->lines != NULL && !tail_fresh && counter_fetched(self, CXLRPC_SITE_RING_POLL_TAIL, self->tail_at) < 0)
        return NULL;
    uint64_t tail = load_acq(self, self->tail_at);
    if (tail == head) {
        if (__atomic_load_n(word_at(self, self->head_at), __ATOMIC_RELAXED) != head) {
            store_rel(self, self->head_at, head); /* repair garbage written over our counter */
            if (self->lines != NULL && counter_written(self, CXLRPC_SITE_RING_REPAIR, self->head_at) < 0)
                return NULL;
        }
        return PyLong_FromLong(0);
    }
    uint64_t cap = self->capacity;
    if (tail < head || tail - head > cap || (tail & 7)) {
        PyObject *t = PyLong_FromUnsignedLongLong(tail);
        if (t == NULL)
            return NULL;
        PyObject *res = PyObject_CallMethodOneArg((PyObject *)self, s_bad_tail, t);
        Py_DECREF(t);
        if (res == NULL)
            return NULL;
        Py_DECREF(res);
        return PyLong_FromLong(0);
    }
    /* flush mode: the new records' lines (one full fence: they are read next) */
    if (self->lines != NULL && invalidate_span(self, head, tail) < 0)
        return NULL;
    uint64_t pos = head, clean = NO_PADDING;
    long long count = 0;
    while (pos < tail && count < limit) {
        uint64_t idx = pos & self->mask;
        uint64_t word = load_acq(self, self->data + idx);
        if (!(word & COMMITTED) && self->multi)
            break; /* a producer is still writing this record */
        uint64_t length = word & LENGTH_MASK;
        uint64_t size = HEADER_SIZE + ((length + 7) & ~7ULL);
        uint64_t kind = (word >> 48) & 0xFF;
        if (!(word & COMMITTED) || size > cap - idx || size > tail - pos || (kind != KIND_DATA && kind != KIND_PADDING) ||
            (kind == KIND_DATA && length > self->max_payload)) { /* no producer writes a record that long */
            if (!self->multi) {
                self->dropped += 1; /* corrupt: nothing up to the tail can be trusted */
                pos = tail;
                break;
            }
            /* the reference decides how far: not past a claim a live producer still writes */
            PyObject *stop = PyObject_CallMethod((PyObject *)self, "_past_corrupt", "KK", (unsigned long long)pos,
                                                 (unsigned long long)tail);
            if (stop == NULL)
                return NULL;
            unsigned long long to = PyLong_AsUnsignedLongLong(stop);
            Py_DECREF(stop);
            if (to == (unsigned long long)-1 && PyErr_Occurred())
                return NULL;
            if (check_open(self) < 0)
                return NULL;
            pos = to >= pos && to <= tail && !(to & 7) ? to : tail;
            break;
        }
        if (kind == KIND_DATA) {
            Py_ssize_t start = self->data + (Py_ssize_t)idx + HEADER_SIZE;
            if (fn != NULL) {
                int rc = fn(ctx, self->buf, (const unsigned char *)self->base + start, (Py_ssize_t)length, start);
                if (rc < 0)
                    return NULL; /* as the reference: nothing released, the record comes again */
                if (rc > 0)
                    limit = count + 1; /* the handler ends the poll after this record */
            } else {
                PyObject *view = PySequence_GetSlice(self->buf, start, start + (Py_ssize_t)length);
                if (view == NULL)
                    return NULL;
                PyObject *res = PyObject_CallOneArg(handler, view);
                Py_DECREF(view);
                if (res == NULL)
                    return NULL; /* as the reference: nothing released, the record comes again */
                Py_DECREF(res);
            }
            if (check_open(self) < 0)
                return NULL; /* the handler closed the region */
            if (self->head_local != head) {
                PyErr_SetString(PyExc_RuntimeError, "a handler polled the ring it was called from");
                return NULL;
            }
            count += 1;
        } else {
            uint64_t at = word & PAD_CLEAN && idx + size == cap ? pos : NO_PADDING;
            if (pos == head) { /* a wrap at the head: freed at once, so producers see the room an
                                * early wrap leaves behind it before the records after it are handled */
                if (release_to(self, head, pos + size, at) < 0)
                    return NULL;
                head = pos + size;
            } else if (at != NO_PADDING) {
                clean = at; /* (one per lap: it ends at the buffer's end) */
            }
        }
        pos += size;
    }
    if (pos != head && release_to(self, head, pos, clean) < 0)
        return NULL;
    return PyLong_FromLongLong(count);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* poll_within(handler, limit, seconds): RingBase._poll_within_py, watching the tail between
 * polls (a load, not a call) so a record is taken within nanoseconds. */
static PyObject *core_poll_within(RingCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (kwnames || self->flushing || nargs != 3 || !PyLong_CheckExact(args[1]) || !PyFloat_CheckExact(args[2]) ||
        !sane(self->head_local))
        return to_reference(self, s_within_py, args, nargs, kwnames);
    long long limit;
    if (limit_arg(args[1], &limit) < 0)
        return NULL;
    return poll_within_records(self, args[0], limit, PyFloat_AS_DOUBLE(args[2]), NULL, NULL);
}

/* readable(): RingBase._readable_py (in flush mode the tail's line invalidated first, at the
 * poll's own site: the consumer's look at the tail, whichever call makes it). */
static PyObject *core_readable(RingCore *self, PyObject *unused) {
    if (self->flushing)
        return to_reference(self, s_readable_py, NULL, 0, NULL);
    if (check_open(self) < 0)
        return NULL;
    if (self->lines != NULL && counter_fetched(self, CXLRPC_SITE_RING_POLL_TAIL, self->tail_at) < 0)
        return NULL;
    uint64_t tail = load_acq(self, self->tail_at);
    if (!sane(tail)) /* garbage: the reference knows whether it was dropped already */
        return to_reference(self, s_readable_py, NULL, 0, NULL);
    return PyBool_FromLong(tail != self->head_local);
}

/* The C API's poll (see _ring_api.h): NotImplemented where the ring keeps to its reference. */
static PyObject *api_poll(PyObject *ring, long long limit, cxlrpc_record_fn fn, void *ctx) {
    RingCore *self = (RingCore *)ring;
    if (self->flushing || !sane(self->head_local))
        Py_RETURN_NOTIMPLEMENTED;
    return poll_records(self, limit, NULL, fn, ctx, 0);
}

/* poll_within's loop, its records to ``handler`` (a Python one) or to ``fn``, a C handler, once
 * the head is known sane. In flush mode each look invalidates the tail's line (only it), and the
 * poll that follows a tail that moved does not again. */
static PyObject *poll_within_records(RingCore *self, PyObject *handler, long long limit, double seconds,
                                     cxlrpc_record_fn fn, void *ctx) {
    double end = now_s() + seconds;
    unsigned every = self->lines != NULL ? 0 : 63; /* a look at the clock every 64 spins; in flush
                                                      mode every spin (each costs an invalidate) */
    for (unsigned spins = 0;; spins++) {
        if (check_open(self) < 0)
            return NULL;
        if (self->lines != NULL && counter_fetched(self, CXLRPC_SITE_RING_POLL_TAIL, self->tail_at) < 0)
            return NULL;
        if (load_acq(self, self->tail_at) != self->head_local) {
            if (!sane(self->head_local)) /* (a slow path set it): the next call takes the reference */
                return PyLong_FromLong(0);
            PyObject *n = poll_records(self, limit, handler, fn, ctx, 1);
            if (n == NULL || PyLong_AsLong(n) != 0)
                return n; /* payloads handed over, or an error */
            Py_DECREF(n); /* claimed, not committed yet (or garbage the poll dealt with) */
        }
        if ((spins & every) == every && now_s() >= end)
            return PyLong_FromLong(0);
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}

/* The C API's poll_within (see _ring_api.h). */
static PyObject *api_poll_within(PyObject *ring, long long limit, double seconds, cxlrpc_record_fn fn, void *ctx) {
    RingCore *self = (RingCore *)ring;
    if (self->flushing || !sane(self->head_local))
        Py_RETURN_NOTIMPLEMENTED;
    return poll_within_records(self, NULL, limit, seconds, fn, ctx);
}

/* Get the buffers of ``parts`` (a sequence of bytes-likes) and their total length: 0, or -1 on
 * error, or 1 (nothing taken) when there are more than MAX_PARTS. */
static int get_parts(PyObject *parts, Py_buffer *views, Py_ssize_t *n_out, uint64_t *length) {
    PyObject *seq = PySequence_Fast(parts, "parts must be a sequence of bytes-like objects");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_PARTS) {
        Py_DECREF(seq);
        return 1; /* the caller hands the record to the reference */
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &views[i], PyBUF_SIMPLE) < 0) {
            for (Py_ssize_t j = 0; j < i; j++)
                PyBuffer_Release(&views[j]);
            Py_DECREF(seq);
            return -1;
        }
        total += (uint64_t)views[i].len;
    }
    Py_DECREF(seq);
    *n_out = n;
    *length = total;
    return 0;
}

static void release_parts(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

static void copy_parts(RingCore *r, Py_ssize_t start, Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        copy_span(r->base + start, views[i].buf, (size_t)views[i].len); /* a part may be a view of the ring */
        start += views[i].len;
    }
}

static PyObject *too_long(RingCore *r, uint64_t length) {
    PyErr_Format(PyExc_ValueError, "record of %llu bytes exceeds the ring's limit %llu",
                 (unsigned long long)length, r->max_payload);
    return NULL;
}

/* The start both pushes share: the parts' buffers and total length, checked against the region
 * and the ring's limit. 0: go on, the buffers are held. 1: the push is over, *out is its result
 * (the reference's, when there are more parts than MAX_PARTS) or NULL with an error set, and
 * nothing is held. */
static int take_parts(RingCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      Py_buffer *views, Py_ssize_t *n, uint64_t *length, PyObject **out) {
    int got = get_parts(args[0], views, n, length);
    *out = NULL;
    if (got < 0)
        return 1;
    if (got > 0) {
        *out = to_reference(self, s_push_py, args, nargs, kwnames);
        return 1;
    }
    if (check_open(self) < 0 || (*length > self->max_payload && too_long(self, *length) == NULL)) {
        release_parts(views, *n);
        return 1;
    }
    return 0;
}

static int valid_head(RingCore *r, uint64_t head, uint64_t tail) {
    return !(head & 7) && head <= tail && tail - head <= r->capacity;
}

/* try_push_parts(parts): SpscRing._try_push_parts_py for coherent memory. */
static PyObject *core_push_spsc(RingCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (kwnames || self->flushing || nargs != 1 || !sane(self->tail_local) || self->head_cache >= COUNTER_LIMIT)
        return to_reference(self, s_push_py, args, nargs, kwnames);
    Py_buffer views[MAX_PARTS];
    Py_ssize_t n;
    uint64_t length;
    PyObject *result;
    if (take_parts(self, args, nargs, kwnames, views, &n, &length, &result))
        return result;
    result = push_spsc_views(self, views, n, length);
    release_parts(views, n);
    return result;
}

/* The SPSC push once the parts' buffers are taken (the caller releases them). */
static PyObject *push_spsc_views(RingCore *self, Py_buffer *views, Py_ssize_t n, uint64_t length) {
    uint64_t cap = self->capacity, tail = self->tail_local;
    uint64_t size = HEADER_SIZE + ((length + 7) & ~7ULL);
    uint64_t idx = tail & self->mask, to_end = cap - idx;
    uint64_t need = size <= to_end && !early_wrap(self, tail, idx, size) ? size : to_end + size;
    if (self->head_cache > tail || tail + need - self->head_cache > cap) {
        if (self->lines != NULL && counter_fetched(self, CXLRPC_SITE_RING_FULL_HEAD, self->head_at) < 0)
            return NULL;
        uint64_t head = load_acq(self, self->head_at);
        if (!valid_head(self, head, tail)) {
            if (!(head & 7) && head > tail && head - tail <= cap && tail == self->tail_local)
                self->tail_local = self->head_cache = head; /* the consumer ran past our tail over garbage */
            goto republish; /* repair a garbage tail */
        }
        self->head_cache = head;
        if (tail + need - head > cap)
            goto republish; /* full: republish what we published (repairs garbage over it) */
    }
    if (need != size) {
        store_rlx(self, self->data + idx, COMMITTED | PAD_CLEAN | (KIND_PADDING << 48) | (to_end - HEADER_SIZE));
        /* flush mode: the padding's header (its body was not written) */
        if (self->lines != NULL &&
            lines_writeback(self->lines, CXLRPC_SITE_RING_PUSH_DATA, self->base + self->data + idx, HEADER_SIZE,
                            CXLRPC_NO_FENCE) < 0)
            return NULL;
        idx = 0;
    }
    store_rlx(self, self->data + idx, COMMITTED | (KIND_DATA << 48) | length);
    copy_parts(self, self->data + (Py_ssize_t)idx + HEADER_SIZE, views, n);
    /* flush mode: the record's lines in memory (one store fence) before the tail says so */
    if (self->lines != NULL &&
        lines_writeback(self->lines, CXLRPC_SITE_RING_PUSH_DATA, self->base + self->data + idx, size,
                        CXLRPC_STORE_FENCE) < 0)
        return NULL;
    self->tail_local = tail + need;
    store_rel(self, self->tail_at, tail + need);
    if (self->lines != NULL && counter_written(self, CXLRPC_SITE_RING_PUSH_TAIL, self->tail_at) < 0)
        return NULL;
    return Py_NewRef(Py_True);
republish:
    store_rel(self, self->tail_at, self->tail_local);
    if (self->lines != NULL && counter_written(self, CXLRPC_SITE_RING_REPAIR, self->tail_at) < 0)
        return NULL;
    return Py_NewRef(Py_False);
}

/* claim.cas(expected, value, ACQ_REL): straight into the word when the counter's address lies
 * inside this ring's buffer (a channel's slot word: no call on the hot path), else the call.
 * 0 and the word's previous value in *prev, or -1 with an exception set. */
static int set_claim(RingCore *self, PyObject *claim, uint64_t expected, uint64_t value, uint64_t *prev) {
    *prev = expected;
    if (claim == Py_None)
        return 0;
    if (claim != self->claim_obj) {
        uint64_t *ptr = NULL;
        PyObject *addr = PyObject_GetAttr(claim, s_address);
        if (addr == NULL) {
            PyErr_Clear();
        } else {
            unsigned long long a = PyLong_AsUnsignedLongLong(addr);
            Py_DECREF(addr);
            if (a == (unsigned long long)-1 && PyErr_Occurred())
                PyErr_Clear();
            else if (!(a & 7) && a >= (uintptr_t)self->base && a - (uintptr_t)self->base <= self->len - 8)
                ptr = (uint64_t *)(uintptr_t)a;
        }
        Py_INCREF(claim);
        Py_XSETREF(self->claim_obj, claim);
        self->claim_ptr = ptr;
    }
    if (self->claim_ptr != NULL) {
        if (check_open(self) < 0)
            return -1;
        __atomic_compare_exchange_n(self->claim_ptr, prev, value, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        return 0;
    }
    PyObject *v = PyLong_FromUnsignedLongLong(value), *e = PyLong_FromUnsignedLongLong(expected);
    if (v == NULL || e == NULL) {
        Py_XDECREF(v);
        Py_XDECREF(e);
        return -1;
    }
    PyObject *res = PyObject_VectorcallMethod(s_cas, (PyObject *[]){claim, e, v, acq_rel_order}, 4, NULL);
    Py_DECREF(v);
    Py_DECREF(e);
    if (res == NULL)
        return -1;
    *prev = PyLong_AsUnsignedLongLong(res);
    Py_DECREF(res);
    if (*prev == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return check_open(self); /* a callout: another thread may have closed the region */
}

#define NO_CLAIM (1ULL << 63) /* a claim word holding no position */

/* Our claim word as we leave it: NO_CLAIM (a claim we lost, or finished, must not look like
 * ours) unless it no longer holds ``mine``, what we wrote last (the slot has another holder). */
static int drop_claim(RingCore *self, PyObject *claim, uint64_t mine) {
    uint64_t prev;
    return set_claim(self, claim, mine, NO_CLAIM, &prev);
}

/* ``self.<name>(written, revoked[, message])`` where written is [(address, position, value), ...]. */
static int call_slow(RingCore *self, PyObject *name, uint64_t (*w)[3], int nw, PyObject *revoked, const char *message) {
    PyObject *list = PyList_New(nw);
    if (list == NULL)
        return -1;
    for (int i = 0; i < nw; i++) {
        PyObject *t = Py_BuildValue("(KKK)", (unsigned long long)w[i][0], (unsigned long long)w[i][1],
                                    (unsigned long long)w[i][2]);
        if (t == NULL) {
            Py_DECREF(list);
            return -1;
        }
        PyList_SET_ITEM(list, i, t);
    }
    PyObject *res;
    if (message != NULL)
        res = PyObject_CallMethod((PyObject *)self, PyUnicode_AsUTF8(name), "Os", list, message);
    else
        res = PyObject_CallMethodObjArgs((PyObject *)self, name, list, revoked, NULL);
    Py_DECREF(list);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* 1 if revoked() says so, 0 if not, -1 on error. */
static int ask_revoked(PyObject *revoked) {
    PyObject *res = PyObject_CallNoArgs(revoked);
    if (res == NULL)
        return -1;
    int yes = PyObject_IsTrue(res);
    Py_DECREF(res);
    return yes;
}

/* try_push_parts(parts, producer=0, tag=0, claim=None, revoked=None): MpscRing._try_push_parts_py
 * for coherent memory (its slow paths stay in Python). */
static PyObject *core_push_mpsc(RingCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (kwnames || self->flushing || nargs < 1 || nargs > 5 || (nargs > 1 && !PyLong_CheckExact(args[1])) ||
        (nargs > 2 && !PyLong_CheckExact(args[2])) || self->head_cache >= COUNTER_LIMIT)
        return to_reference(self, s_push_py, args, nargs, kwnames);
    long producer = 0, tag = 0;
    int overflow = 0, overflow2 = 0;
    if (nargs > 1 && (producer = PyLong_AsLongAndOverflow(args[1], &overflow)) == -1 && PyErr_Occurred())
        return NULL;
    if (nargs > 2 && (tag = PyLong_AsLongAndOverflow(args[2], &overflow2)) == -1 && PyErr_Occurred())
        return NULL;
    if (overflow || overflow2 || producer < 0 || producer > MAX_PRODUCER || tag < 0 || tag > TAG_MASK) {
        PyErr_SetString(PyExc_ValueError, "producer id must fit in 16 bits and tag in 6");
        return NULL;
    }
    PyObject *claim = nargs > 3 ? args[3] : Py_None, *revoked = nargs > 4 ? args[4] : Py_None;
    Py_buffer views[MAX_PARTS];
    Py_ssize_t n;
    uint64_t length;
    PyObject *result;
    if (take_parts(self, args, nargs, kwnames, views, &n, &length, &result))
        return result;
    result = push_mpsc_views(self, producer, tag, claim, revoked, views, n, length);
    release_parts(views, n);
    return result;
}

/* The MPSC push once its arguments are checked and the parts' buffers taken (the caller
 * releases them). */
static PyObject *push_mpsc_views(RingCore *self, long producer, long tag, PyObject *claim, PyObject *revoked,
                                 Py_buffer *views, Py_ssize_t n, uint64_t length) {
    PyObject *result = NULL;
    uint64_t cap = self->capacity, mask = self->mask;
    uint64_t size = HEADER_SIZE + ((length + 7) & ~7ULL);
    uint64_t tail, idx, to_end, need, mine = NO_CLAIM; /* what our claim word holds, as we left it */
    for (;;) {
        tail = load_acq(self, self->tail_at);
        if ((tail & 7) || tail >= COUNTER_LIMIT)
            goto full; /* garbage tail: the consumer resets it */
        idx = tail & mask;
        to_end = cap - idx;
        need = size <= to_end && !early_wrap(self, tail, idx, size) ? size : to_end + size;
        if (self->head_cache > tail || tail + need - self->head_cache > cap) {
            uint64_t head = load_acq(self, self->head_at);
            if (!valid_head(self, head, tail))
                goto full; /* garbage head: the consumer republishes its own */
            self->head_cache = head;
            if (tail + need - head > cap)
                goto full;
        }
        uint64_t prev;
        if (set_claim(self, claim, mine, tail, &prev) < 0) /* visible before the claim below is */
            goto done;
        if (prev != mine) { /* another holder's word (we were judged dead), or garbage: the reference */
            PyObject *res = PyObject_CallMethod((PyObject *)self, "_claim_moved", "OKO", claim,
                                                (unsigned long long)tail, revoked);
            if (res == NULL || check_open(self) < 0) {
                Py_XDECREF(res);
                goto done;
            }
            Py_DECREF(res);
        }
        mine = tail;
        if (cas(self, self->tail_at, tail, tail + need) == tail)
            break;
    }
    uint64_t data = (uint64_t)self->data;
    uint64_t word = ((uint64_t)tag << TAG_SHIFT) | (KIND_DATA << 48) | ((uint64_t)producer << 32) | length;
    uint64_t written[2][3];
    int nw;
    if (need != size) {
        /* Our record goes to the start: its uncommitted header goes first, so the whole claim is
         * attributable to us before the padding makes it reachable. */
        written[0][0] = data, written[0][1] = tail + to_end, written[0][2] = word;
        if (cas(self, (Py_ssize_t)data, 0, word) != 0 &&
            (call_slow(self, s_open, written, 1, revoked, NULL) < 0 || check_open(self) < 0))
            goto done;
        uint64_t pad = COMMITTED | PAD_CLEAN | (KIND_PADDING << 48) | ((uint64_t)producer << 32) | (to_end - HEADER_SIZE);
        written[1][0] = data + idx, written[1][1] = tail, written[1][2] = pad;
        if (cas(self, (Py_ssize_t)(data + idx), 0, pad) != 0 &&
            (call_slow(self, s_open, written, 2, revoked, NULL) < 0 || check_open(self) < 0))
            goto done;
        idx = 0;
        nw = 2;
    } else {
        written[0][0] = data + idx, written[0][1] = tail, written[0][2] = word;
        if (cas(self, (Py_ssize_t)(data + idx), 0, word) != 0 &&
            (call_slow(self, s_open, written, 1, revoked, NULL) < 0 || check_open(self) < 0))
            goto done;
        nw = 1;
    }
    /* The consumer passes a claim only by padding it (it judged us dead): then our header went
     * into free space, and nothing may be copied or committed there. */
    if (revoked != Py_None && load_acq(self, self->head_at) > tail) {
        int yes = ask_revoked(revoked);
        if (yes < 0 || check_open(self) < 0)
            goto done;
        if (yes) {
            if (nw == 2) { /* the reference passes only the written headers: data's, then the padding */
                call_slow(self, s_revoke, written, 2, NULL, "the consumer passed this claim before its header was written");
            } else {
                uint64_t one[1][3] = {{data + idx, tail, word}};
                call_slow(self, s_revoke, one, 1, NULL, "the consumer passed this claim before its header was written");
            }
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "_revoke returned");
            goto done;
        }
    }
    copy_parts(self, (Py_ssize_t)(data + idx) + HEADER_SIZE, views, n);
    if (cas(self, (Py_ssize_t)(data + idx), word, word | COMMITTED) != word && revoked != Py_None) {
        int yes = ask_revoked(revoked);
        if (yes < 0 || check_open(self) < 0)
            goto done;
        if (yes) { /* padded and consumed while we copied: the reference clears our bytes and raises */
            PyObject *res = PyObject_CallMethod((PyObject *)self, "_lost_commit", "KKKK", (unsigned long long)idx,
                                                (unsigned long long)tail, (unsigned long long)need,
                                                (unsigned long long)size);
            Py_XDECREF(res);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "_lost_commit returned");
            goto done;
        }
    }
    if (drop_claim(self, claim, tail) == 0) /* done: nothing more of ours lands at that claim */
        result = Py_NewRef(Py_True);
    goto done;
full:
    if (drop_claim(self, claim, mine) == 0)
        result = Py_NewRef(Py_False);
done:
    return result;
}

/* The C API's push (see _ring_api.h): ``try_push_parts`` of buffers already taken, with
 * ``extra`` the MPSC arguments after the parts (producer, tag, claim, revoked; none for SPSC).
 * NotImplemented where the ring keeps to its reference (its Python method takes the parts). */
static PyObject *api_push(PyObject *ring, Py_buffer *views, Py_ssize_t n, PyObject *const *extra, Py_ssize_t nextra) {
    RingCore *self = (RingCore *)ring;
    if (self->flushing || self->head_cache >= COUNTER_LIMIT || n > MAX_PARTS || nextra > 4 ||
        (self->multi ? nextra < 2 || !PyLong_CheckExact(extra[0]) || !PyLong_CheckExact(extra[1])
                     : nextra != 0 || !sane(self->tail_local)))
        Py_RETURN_NOTIMPLEMENTED;
    uint64_t length = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        length += (uint64_t)views[i].len;
    if (check_open(self) < 0)
        return NULL;
    if (length > self->max_payload)
        return too_long(self, length);
    if (!self->multi)
        return push_spsc_views(self, views, n, length);
    int overflow = 0, overflow2 = 0;
    long producer = PyLong_AsLongAndOverflow(extra[0], &overflow), tag = PyLong_AsLongAndOverflow(extra[1], &overflow2);
    if ((producer == -1 || tag == -1) && PyErr_Occurred())
        return NULL;
    if (overflow || overflow2 || producer < 0 || producer > MAX_PRODUCER || tag < 0 || tag > TAG_MASK) {
        PyErr_SetString(PyExc_ValueError, "producer id must fit in 16 bits and tag in 6");
        return NULL;
    }
    return push_mpsc_views(self, producer, tag, nextra > 2 ? extra[2] : Py_None, nextra > 3 ? extra[3] : Py_None,
                           views, n, length);
}

static PyMemberDef core_members[] = {
    {"_head_local", T_ULONGLONG, offsetof(RingCore, head_local), 0, "the consumer's own copy of its counter"},
    {"_tail_local", T_ULONGLONG, offsetof(RingCore, tail_local), 0, "an SPSC producer's own copy of its counter"},
    {"_head_cache", T_ULONGLONG, offsetof(RingCore, head_cache), 0, "the producer's last valid view of the head"},
    {"_wrap_from", T_ULONGLONG, offsetof(RingCore, wrap_from), 0, "the tail from which the producer next looks for an early wrap"},
    {"dropped", T_PYSSIZET, offsetof(RingCore, dropped), 0, "corrupt records or counters the consumer discarded"},
    {NULL},
};

static PyMethodDef core_methods[] = {
    {"poll", (PyCFunction)(void (*)(void))core_poll, METH_FASTCALL | METH_KEYWORDS,
     "poll(handler, limit=2**30): hand committed payloads to handler in order, then free their space."},
    {"readable", (PyCFunction)core_readable, METH_NOARGS,
     "readable(): True when the tail is ahead of the head (records claimed, maybe not yet committed)."},
    {"poll_within", (PyCFunction)(void (*)(void))core_poll_within, METH_FASTCALL | METH_KEYWORDS,
     "poll_within(handler, limit, seconds): poll until payloads are handed over or seconds pass."},
    {"_push_spsc", (PyCFunction)(void (*)(void))core_push_spsc, METH_FASTCALL | METH_KEYWORDS,
     "SPSC try_push_parts(parts)."},
    {"_push_mpsc", (PyCFunction)(void (*)(void))core_push_mpsc, METH_FASTCALL | METH_KEYWORDS,
     "MPSC try_push_parts(parts, producer=0, tag=0, claim=None, revoked=None)."},
    {NULL},
};

static PyTypeObject RingCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cxlrpc._ring.RingCore",
    .tp_basicsize = sizeof(RingCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A ring's counters and its hot path (see cxlrpc.ring.base).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_members = core_members,
    .tp_methods = core_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cxlrpc._ring", "The rings' hot path in C.", -1, NULL};

static cxlrpc_ring_api ring_api = {&RingCoreType, api_poll, api_poll_within, api_push};

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&RingCoreType) < 0)
        return NULL;
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_poll_py, "_poll_py");
    INTERN(s_within_py, "_poll_within_py");
    INTERN(s_readable_py, "_readable_py");
    INTERN(s_push_py, "_try_push_parts_py");
    INTERN(s_bad_tail, "_bad_tail");
    INTERN(s_open, "_open");
    INTERN(s_revoke, "_revoke");
    INTERN(s_lost_commit, "_lost_commit");
    INTERN(s_address, "address");
    INTERN(s_cas, "cas");
#undef INTERN
    flush_api = PyCapsule_Import(CXLRPC_FLUSH_API_CAPSULE, 0);
    if (flush_api == NULL) /* cxlrpc._flush not built: memory without coherence keeps to the reference */
        PyErr_Clear();
    PyObject *memory = PyImport_ImportModule("cxlrpc.memory");
    if (memory == NULL)
        return NULL;
    acq_rel_order = PyObject_GetAttrString(memory, "ACQ_REL");
    Py_DECREF(memory);
    if (acq_rel_order == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RingCoreType);
    if (PyModule_AddObject(m, "RingCore", (PyObject *)&RingCoreType) < 0) {
        Py_DECREF(&RingCoreType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *api = PyCapsule_New(&ring_api, CXLRPC_RING_API_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObject(m, "_C_API", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
