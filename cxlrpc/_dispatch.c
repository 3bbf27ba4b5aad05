/* The server's dispatch of a request in C, for the common shape: a REQUEST frame without
 * metadata, heap extent or stream, from its slot's known holder, for a plain or `async def`
 * handler that takes bytes or a MessagePack-decoded argument (cxlrpc.server.Server._dispatch is
 * the reference, and documents what each step means).
 *
 * A Dispatcher is the ring handler the server's reader passes to poll(). Every frame it cannot
 * vouch for goes whole to the reference (Server._on_request) before anything is done for it:
 * other kinds and flags, an unknown or reserved method, a slot whose generation, seen record or
 * peer entry is not the sender's, a server that is draining or has interceptors, a slot whose
 * replies are held back. Once a handler has run, its rare outcomes go to the reference's own methods (_fail,
 * _reply, _bad_request, _eager_reply, _suspended_at, _broken), given the request as a Frame
 * made from the fields validated here (what a peer writes into the record meanwhile changes
 * nothing). The header is validated before use, as the reference decoder does: a peer
 * may write garbage.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include "_copy.h"
#include "_follow.h"
#include "_ring_api.h"

static cxlrpc_ring_api *ring_api; /* cxlrpc._ring's C API: polls with C handlers of records */

#define HEADER_SIZE 28 /* <BBHHIQdH: kind flags status slot gen call_id timeout method_len */
#define MAX_METHOD 255
#define FLAG_RAW 1
#define FLAG_HEAP 2    /* the frame carries a heap extent (offset, length), not its body */
#define FLAG_FOLLOW 16 /* with HEAP: the body is written after the frame (cxlrpc.heap) */
#define FOLLOW_HEADER 64 /* a followed extent: its progress word, its seal, then from here its body */
/* why a followed body copied whole is not returned (heap.SEAL_BROKEN, as the reference says it) */
#define SEAL_BROKEN "the extent's seal is not this client's: the server reaped it (the bytes may be another's)"
#define HEAP_UNIT 4096   /* heap extents start at multiples of this */
#define KIND_REQUEST 1
#define KIND_RESPONSE 2
#define KIND_FREE 6 /* give a heap extent back (body: its offset) */
#define NO_REPLY 0
#define MAX_PUSH_ARGS 8

/* A method entry's mode bits (Server.add_method: _TAKES_ARG, _IS_ASYNC, _RAW_ARG, _VIEW_ARG). */
#define TAKES_ARG 1
#define IS_ASYNC 2
#define RAW_ARG 4
#define VIEW_ARG 8 /* (_VIEW_ARG) it takes a memoryview: a plain one is lent the record's body */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall; /* Dispatcher(view): the ring's handler, called per record */
    PyObject *server;    /* the reference and the slow paths */
    PyObject *buf;       /* the region's memoryview: the slots' state words are read in it */
    Py_ssize_t *slot_at; /* offset of each slot's state word */
    Py_ssize_t *parked_at; /* offset of each slot's doorbell word (its holder parked there) */
    uint64_t me;           /* this host's identity, as a parked consumer writes it */
    Py_ssize_t slots;
    PyObject *seen, *peers, *backlog, *methods, *responses, *chan;
    PyObject *context_type, *no_metadata, *current_call, *ring_client, *encode_body;
    PyObject *pack; /* encode_body's MessagePack encoder: results that are not bytes-like, encoded here */
    PyObject *loop, *current_task, *enter_task, *leave_task, *eager_type, *cancelled, *frame_type;
    PyObject *current_tasks; /* asyncio's loop -> current task dict, where its functions use one; or None */
    PyObject *spare_eager;   /* a stand-in no handler kept (see first_step), or NULL */
    PyObject *last_key;      /* the method name of the last request, or NULL */
    Py_ssize_t reply_limit;
    /* the heap (cxlrpc.heap: big replies are followed through it): the server's ServerHeap or
     * None, its ALLOCs waiting for room (a list, changed in place), where it lies in the region,
     * the smallest body followed (else PY_SSIZE_T_MAX), the largest body it takes, the step of
     * a followed body's progress */
    PyObject *heap, *heap_waiting;
    Py_ssize_t heap_start, heap_size, follow_min, body_limit, follow_chunk;
    double polled_at;
    double synced_at; /* the polled_at last written to server._polled_at (for the reference) */
    long long batch;  /* records a batch takes: as many as its handlers ran in one loop turn's time */
    double until;     /* when the loop's turn is due: a batch polled with the C API ends there */
    int enabled;
    int detoured;     /* a request went to the server's own code since serve() began */
} Dispatcher;

static PyObject *s_on_request, *s_failed, *s_bad_request, *s_suspended, *s_coroutine, *s_reply,
    *s_send, *s_broken, *s_push, *s_lent_reply, *s_toreadonly, *s_release, *s_polled_at, *s_poll_within, *s_poll, *s_free_extent, *s_alloc_reply, *s_free;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic()'s clock */
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t le32(const unsigned char *p) { return (uint32_t)le16(p) | (uint32_t)le16(p + 2) << 16; }
static inline uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

/* ``obj`` is the int ``gen`` (a generation the reader recorded for a slot). */
static inline int is_gen(PyObject *obj, uint32_t gen) {
    if (!PyLong_CheckExact(obj))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return v == gen;
}

static inline void put_le(unsigned char *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++)
        p[i] = (v >> (8 * i)) & 0xFF;
}

/* A record's body of ``n`` (1 or 2) u64 words, little-endian: a FREE's offset (heap.OFFSET), a
 * followed body's extent (heap.EXTENT: offset, length). */
static PyObject *le_words(uint64_t first, uint64_t second, int n) {
    unsigned char words[16];
    put_le(words, first, 8);
    put_le(words + 8, second, 8);
    return PyBytes_FromStringAndSize((const char *)words, n == 2 ? 16 : 8);
}

/* A frame header into h[HEADER_SIZE] (frame.HEADER.pack's layout, little-endian). */
static void fill_header(unsigned char *h, unsigned kind, unsigned flags, unsigned slot, uint32_t gen,
                        uint64_t call_id, double timeout, unsigned mlen) {
    uint64_t tbits;
    memcpy(&tbits, &timeout, sizeof tbits);
    h[0] = (unsigned char)kind;
    h[1] = (unsigned char)flags;
    put_le(h + 2, 0, 2); /* status */
    put_le(h + 4, slot, 2);
    put_le(h + 6, gen, 4);
    put_le(h + 10, call_id, 8);
    put_le(h + 18, tbits, 8);
    put_le(h + 26, mlen, 2);
}

/* ``ring``.try_push_parts of a header (``h``) and the bytes-likes ``parts`` then ``extra``: the
 * rings' C API where it serves (no bytes or tuple made), else the ring's Python method. */
static PyObject *push_record(PyObject *ring, const unsigned char *h, PyObject **parts, Py_ssize_t nparts,
                             PyObject *const *extra, Py_ssize_t nextra) {
    Py_buffer views[4];
    PyObject *ok = Py_NewRef(Py_NotImplemented);
    if (nparts <= 3 && PyObject_TypeCheck(ring, ring_api->ring_type)) {
        Py_ssize_t got = 0;
        views[0] = (Py_buffer){.buf = (void *)h, .len = HEADER_SIZE, .itemsize = 1, .readonly = 1};
        for (; got < nparts; got++)
            if (PyObject_GetBuffer(parts[got], &views[1 + got], PyBUF_SIMPLE) < 0)
                break;
        Py_DECREF(ok);
        ok = got == nparts ? ring_api->push(ring, views, 1 + nparts, extra, nextra) : NULL;
        for (Py_ssize_t i = 0; i < got; i++)
            PyBuffer_Release(&views[1 + i]);
        if (ok == NULL)
            return NULL;
    }
    if (ok != Py_NotImplemented)
        return ok;
    Py_DECREF(ok);
    PyObject *head = PyBytes_FromStringAndSize((const char *)h, HEADER_SIZE), *tuple = NULL;
    if (head == NULL)
        return NULL;
    if (nparts == 1)
        tuple = PyTuple_Pack(2, head, parts[0]);
    else if (nparts == 2)
        tuple = PyTuple_Pack(3, head, parts[0], parts[1]);
    else
        PyErr_SetString(PyExc_ValueError, "push_record: one or two parts after the header");
    Py_DECREF(head);
    if (tuple == NULL)
        return NULL;
    PyObject *stack[2 + MAX_PUSH_ARGS];
    stack[0] = ring;
    stack[1] = tuple;
    for (Py_ssize_t i = 0; i < nextra && i < MAX_PUSH_ARGS; i++)
        stack[2 + i] = extra[i];
    ok = PyObject_VectorcallMethod(s_push, stack, 2 + (nextra < MAX_PUSH_ARGS ? nextra : MAX_PUSH_ARGS), NULL);
    Py_DECREF(tuple);
    return ok;
}

static int view_open(PyObject *buf) {
    return buf != NULL && !(((PyMemoryViewObject *)buf)->flags & _Py_MEMORYVIEW_RELEASED);
}

static int region_open(Dispatcher *d) {
    return view_open(d->buf);
}

/* Is the consumer whose doorbell word lies at ``at`` in ``buf`` parked on this host (``me``)?
 * Doorbell.ring's first look, after the same full fence (the records just published are seen
 * before the word is read). The common answer, no (it is awake, or polls from another host),
 * costs no call; yes goes to Doorbell.ring, which claims the word and sends the wake-up. */
static int parked_here(PyObject *buf, Py_ssize_t at, uint64_t me) {
    if (!view_open(buf))
        return 1; /* let Doorbell.ring say what a closed region means */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n((uint64_t *)((char *)PyMemoryView_GET_BUFFER(buf)->buf + at), __ATOMIC_RELAXED) == me;
}

/* Is ``at`` the offset of an 8-byte aligned word inside ``buf``? */
static int word_inside(PyObject *buf, Py_ssize_t at) {
    Py_buffer *view = PyMemoryView_GET_BUFFER(buf);
    return !(at < 0 || at % 8 || at > view->len - 8 || ((uintptr_t)view->buf + (uintptr_t)at) % 8);
}

/* Word offsets from Python (``offsets``, a list of ``n`` ints), each a word inside ``buf``
 * (word_inside). A new array (PyMem_Free it), or NULL with an error set. */
static Py_ssize_t *word_offsets(PyObject *buf, PyObject *offsets, Py_ssize_t n, const char *what) {
    Py_ssize_t *at = PyMem_New(Py_ssize_t, n ? n : 1);
    if (at == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        at[i] = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, i));
        if (at[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(at);
            return NULL;
        }
        if (!word_inside(buf, at[i])) {
            PyMem_Free(at);
            PyErr_Format(PyExc_ValueError, "%s: a word is outside the region", what);
            return NULL;
        }
    }
    return at;
}

/* server.<name>(*args): a slow path; its result is dropped. The server's own code may leave
 * work for the loop (a task, a reply held back, a body to follow): serve() then returns. */
static int call_server(Dispatcher *d, PyObject *name, PyObject **args, size_t n) {
    PyObject *stack[6];
    d->detoured = 1;
    if (d->synced_at != d->polled_at) { /* the reference counts deadlines from server._polled_at */
        PyObject *at = PyFloat_FromDouble(d->polled_at);
        if (at == NULL || PyObject_SetAttr(d->server, s_polled_at, at) < 0) {
            Py_XDECREF(at);
            return -1;
        }
        Py_DECREF(at);
        d->synced_at = d->polled_at;
    }
    stack[0] = d->server;
    for (size_t i = 0; i < n; i++)
        stack[i + 1] = args[i];
    PyObject *res = PyObject_VectorcallMethod(name, stack, n + 1, NULL);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* The raised exception, taken, when ``kinds`` catches it (as the reference's ``except``);
 * NULL with the error left set otherwise. */
static PyObject *caught(PyObject *kinds) {
    if (!PyErr_ExceptionMatches(kinds))
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* A request being dispatched: its validated header fields, and its body in the record (valid
 * until the ring's poll returns). The slow paths get it as a Frame, made once from these fields,
 * so that what a peer writes into the record meanwhile changes nothing. */
typedef struct {
    unsigned flags, status, slot;
    uint32_t gen;
    uint64_t call_id;
    double timeout;
    PyObject *method;   /* borrowed: the method entry's name */
    const unsigned char *body;
    Py_ssize_t body_len;
    PyObject *body_obj; /* borrowed: a bytes copy already made, or NULL */
    PyObject *frame;    /* owned, once made */
    PyObject *record;   /* borrowed: the record's view, as the ring handed it over; or NULL: */
    PyObject *buf;      /* borrowed: the region's view, where the record begins at ``start`` */
    Py_ssize_t start;
    Py_ssize_t body_at; /* where the body starts in it */
    PyObject *lent;     /* owned: the read-only view of the body lent to a plain handler, or NULL */
} Req;

/* The request as the reference's decoder would give it (a borrowed reference, owned by r). */
static PyObject *req_frame(Dispatcher *d, Req *r) {
    if (r->frame != NULL)
        return r->frame;
    PyObject *fields[9] = {0};
    fields[0] = PyLong_FromLong(KIND_REQUEST);
    fields[1] = PyLong_FromLong(r->flags);
    fields[2] = PyLong_FromLong(r->status);
    fields[3] = PyLong_FromLong(r->slot);
    fields[4] = PyLong_FromUnsignedLong(r->gen);
    fields[5] = PyLong_FromUnsignedLongLong(r->call_id);
    fields[6] = PyFloat_FromDouble(r->timeout);
    fields[7] = Py_NewRef(r->method);
    /* (a handler that ran may have closed the region: a record handed over without a view of
     * its own is then unmapped, and its body is not read) */
    fields[8] = r->body_obj != NULL                 ? Py_NewRef(r->body_obj)
                : r->record == NULL && !region_open(d) ? PyBytes_FromStringAndSize(NULL, 0)
                                                       : bytes_copy(r->body, r->body_len);
    int ok = 1;
    for (int i = 0; i < 9; i++)
        ok &= fields[i] != NULL;
    if (ok)
        r->frame = PyObject_Vectorcall(d->frame_type, fields, 9, NULL);
    for (int i = 0; i < 9; i++)
        Py_XDECREF(fields[i]);
    return r->frame;
}

/* server.<name>(frame, *args): a slow path given the request as a Frame. */
static int call_with_frame(Dispatcher *d, PyObject *name, Req *r, PyObject **args, size_t n) {
    PyObject *stack[5];
    if ((stack[0] = req_frame(d, r)) == NULL)
        return -1;
    for (size_t i = 0; i < n; i++)
        stack[i + 1] = args[i];
    return call_server(d, name, stack, n + 1);
}

/* A handler (or its coroutine's first step) raised: the reference's _fail, when its except
 * clause catches it (``kinds``); anything else propagates. */
static int handler_raised(Dispatcher *d, Req *r, PyObject *kinds) {
    PyObject *exc = caught(kinds);
    if (exc == NULL)
        return -1;
    int rc = call_with_frame(d, s_failed, r, &exc, 1);
    Py_DECREF(exc);
    return rc;
}

/* A big reply of the slot's holder, followed (Server._push_followed): its frame, naming an
 * extent of the heap, goes first, then the body is written there a chunk at a time, the bytes
 * written so far stored into the extent's progress word (release) after each, while the client
 * copies them out. 1: sent; 0: not (no heap, or no room in it now, ALLOCs waiting for it, a body
 * over the heap's limit, a full ring: Server._send takes it, and says what is wrong); -1: an
 * error. */
static int push_followed(Dispatcher *d, Req *r, PyObject *slot_obj, PyObject *gen_obj, unsigned flags,
                         PyObject *body, Py_ssize_t length) {
    if (d->heap == Py_None || PyList_GET_SIZE(d->heap_waiting) || length > d->body_limit ||
        length > d->heap_size - FOLLOW_HEADER || (Py_ssize_t)r->slot >= PyList_GET_SIZE(d->responses) ||
        !view_open(d->buf))
        return 0;
    Py_buffer src, region; /* (encode_body's bodies are one flat run of bytes) */
    if (PyObject_GetBuffer(body, &src, PyBUF_SIMPLE) < 0)
        return -1;
    if (src.len != length || PyObject_GetBuffer(d->buf, &region, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        if (src.len != length)
            PyErr_SetString(PyExc_ValueError, "a reply body's length changed while it was sent");
        return -1;
    }
    int rc = -1;
    PyObject *size_obj = PyLong_FromSsize_t(FOLLOW_HEADER + length), *offset_obj = NULL, *ok = NULL;
    if (size_obj == NULL)
        goto done;
    PyObject *args[4] = {d->heap, slot_obj, gen_obj, size_obj};
    offset_obj = PyObject_VectorcallMethod(s_alloc_reply, args, 4, NULL);
    if (offset_obj == NULL)
        goto done;
    if (offset_obj == Py_None) { /* the heap is full for now */
        rc = 0;
        goto done;
    }
    unsigned long long offset = PyLong_AsUnsignedLongLong(offset_obj);
    if (offset == (unsigned long long)-1 && PyErr_Occurred())
        goto done;
    if (offset % HEAP_UNIT || offset > (unsigned long long)d->heap_size ||
        (unsigned long long)(FOLLOW_HEADER + length) > (unsigned long long)d->heap_size - offset) {
        PyErr_Format(PyExc_ValueError, "the heap's allocator gave extent %llu, outside the heap", offset);
        goto done;
    }
    char *extent = (char *)region.buf + d->heap_start + offset; /* inside: checked here and at init */
    uint64_t *progress = (uint64_t *)extent; /* 8-byte aligned: heap_start is (checked at init) */
    __atomic_store_n(progress, 0, __ATOMIC_RELEASE);
    unsigned char h[HEADER_SIZE];
    fill_header(h, KIND_RESPONSE, flags | FLAG_HEAP | FLAG_FOLLOW, r->slot, r->gen, r->call_id, 0.0, 0);
    PyObject *ext = le_words(offset, (uint64_t)length, 2);
    if (ext == NULL)
        goto done;
    ok = push_record(PyList_GET_ITEM(d->responses, r->slot), h, &ext, 1, NULL, 0);
    Py_DECREF(ext);
    if (ok != Py_True) { /* not pushed: the extent back (a full ring: the reference waits for room) */
        PyObject *et, *ev, *etb, *fargs[4] = {d->heap, offset_obj, slot_obj, gen_obj};
        PyErr_Fetch(&et, &ev, &etb); /* (the push's error, raised after) */
        PyObject *freed = PyObject_VectorcallMethod(s_free, fargs, 4, NULL);
        rc = et != NULL || freed == NULL ? -1 : 0;
        Py_XDECREF(freed);
        if (et != NULL) {
            PyErr_Clear();
            PyErr_Restore(et, ev, etb);
        }
        goto done;
    }
    rc = 1;
    if (parked_here(d->buf, d->parked_at[r->slot], d->me)) { /* ServerChannel.ring_client sends */
        PyObject *rargs[2] = {slot_obj, gen_obj};
        PyObject *res = PyObject_Vectorcall(d->ring_client, rargs, 2, NULL);
        if (res == NULL) /* the frame is out: the body still follows, the error after */
            rc = -1;
        Py_XDECREF(res);
    }
    Py_BEGIN_ALLOW_THREADS
    follow_publish(extent + FOLLOW_HEADER, (const char *)src.buf, (size_t)length, (size_t)d->follow_chunk, progress,
                   NULL, 0); /* (the server's own extent: no seal to check) */
    Py_END_ALLOW_THREADS
done:
    Py_XDECREF(ok);
    Py_XDECREF(offset_obj);
    Py_XDECREF(size_obj);
    PyBuffer_Release(&region);
    PyBuffer_Release(&src);
    return rc;
}

/* Send ``result`` as the reply (Server._reply with held=True). */
static int reply(Dispatcher *d, Req *r, PyObject *slot_obj, PyObject *result) {
    unsigned slot = r->slot;
    uint32_t gen = r->gen;
    uint64_t call_id = r->call_id;
    if (call_id == NO_REPLY)
        return 0;
    PyObject *body;
    unsigned flags;
    if (PyBytes_Check(result) || PyByteArray_Check(result)) {
        flags = FLAG_RAW; /* encode_body passes these through raw (a memoryview made flat) */
        body = Py_NewRef(result);
    } else if (!PyMemoryView_Check(result)) { /* encode_body's MessagePack, without its frame */
        flags = 0;
        if ((body = PyObject_CallOneArg(d->pack, result)) == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return -1;
            PyErr_Clear(); /* the reference encodes again and answers how it failed */
            PyObject *args[2] = {result, Py_True};
            return call_with_frame(d, s_reply, r, args, 2);
        }
    } else {
        PyObject *enc = PyObject_CallOneArg(d->encode_body, result);
        if (enc == NULL || !PyTuple_CheckExact(enc) || PyTuple_GET_SIZE(enc) != 2 ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(enc, 0))) {
            Py_XDECREF(enc);
            if (enc != NULL || PyErr_ExceptionMatches(PyExc_Exception)) {
                PyErr_Clear(); /* the reference encodes again and answers how it failed */
                PyObject *args[2] = {result, Py_True};
                return call_with_frame(d, s_reply, r, args, 2);
            }
            return -1;
        }
        flags = (unsigned)PyLong_AsLong(PyTuple_GET_ITEM(enc, 0));
        body = Py_NewRef(PyTuple_GET_ITEM(enc, 1));
        Py_DECREF(enc);
    }
    Py_ssize_t length = PyObject_Length(body);
    if (length < 0) {
        Py_DECREF(body);
        return -1;
    }
    unsigned char h[HEADER_SIZE];
    fill_header(h, KIND_RESPONSE, flags, slot, gen, call_id, 0.0, 0);
    int rc = -1, pushed = 0;
    PyObject *gen_obj = NULL;
    int held_back = PyDict_Contains(d->backlog, slot_obj);
    if (held_back < 0)
        goto done;
    if (!held_back && HEADER_SIZE + length <= d->reply_limit && (Py_ssize_t)slot < PyList_GET_SIZE(d->responses)) {
        PyObject *ok = push_record(PyList_GET_ITEM(d->responses, slot), h, &body, 1, NULL, 0);
        if (ok == NULL)
            goto done;
        pushed = ok == Py_True;
        Py_DECREF(ok);
    }
    if ((gen_obj = PyLong_FromUnsignedLong(gen)) == NULL)
        goto done;
    if (!held_back && !pushed && length >= d->follow_min) {
        int sent = push_followed(d, r, slot_obj, gen_obj, flags, body, length);
        if (sent != 0) {
            rc = sent < 0 ? -1 : 0;
            goto done;
        }
    }
    if (pushed) {
        rc = 0;
        if (parked_here(d->buf, d->parked_at[slot], d->me)) { /* ServerChannel.ring_client sends */
            PyObject *args[2] = {slot_obj, gen_obj};
            PyObject *res = PyObject_Vectorcall(d->ring_client, args, 2, NULL);
            rc = res == NULL ? -1 : 0;
            Py_XDECREF(res);
        }
    } else { /* the heap, the backlog, or nobody left to answer */
        PyObject *head = PyBytes_FromStringAndSize((const char *)h, HEADER_SIZE);
        if (head != NULL) {
            PyObject *args[4] = {slot_obj, gen_obj, head, body};
            rc = call_server(d, s_send, args, 4);
            Py_DECREF(head);
        }
    }
done:
    Py_XDECREF(gen_obj);
    Py_DECREF(body);
    return rc;
}

/* asyncio's _enter_task or _leave_task (``fn``) of ``task`` in the server's loop. */
static int task_call(Dispatcher *d, PyObject *fn, PyObject *task) {
    PyObject *args[2] = {d->loop, task};
    PyObject *res = PyObject_Vectorcall(fn, args, 2, NULL);
    Py_XDECREF(res);
    return res == NULL ? -1 : 0;
}

/* Swap ``loop``'s current task from ``from`` to ``to`` (asyncio's _leave_task/_enter_task; None:
 * no task, as in a loop callback): in asyncio's dict of current tasks where it has one (two
 * calls saved), raising as they would. */
static int swap_task(Dispatcher *d, PyObject *from, PyObject *to) {
    if (PyDict_CheckExact(d->current_tasks)) {
        PyObject *now = PyDict_GetItemWithError(d->current_tasks, d->loop); /* borrowed */
        if (now == NULL && PyErr_Occurred())
            return -1;
        if (now != (from == Py_None ? NULL : from)) {
            PyErr_Format(PyExc_RuntimeError, "Leaving task %R does not match the current task %R.",
                         from, now ? now : Py_None);
            return -1;
        }
        return to == Py_None ? PyDict_DelItem(d->current_tasks, d->loop)
                             : PyDict_SetItem(d->current_tasks, d->loop, to);
    }
    if (from != Py_None && task_call(d, d->leave_task, from) < 0)
        return -1;
    return to != Py_None ? task_call(d, d->enter_task, to) : 0;
}

/* Does a weak reference to ``obj`` exist (one kept by, say, a WeakKeyDictionary of tasks)? Its
 * list lies at tp_weaklistoffset from the object: positive up to 3.11, negative (before the
 * object, "managed") for a class's __weakref__ from 3.12; 0 when the type has none. */
static int weakly_held(PyObject *obj) {
    Py_ssize_t at = Py_TYPE(obj)->tp_weaklistoffset;
    return at != 0 && *(PyObject **)((char *)obj + at) != NULL;
}

/* A coroutine handler's first step, inline (Server._run_eagerly and _first_step): in a copy of
 * the current context where ``context()`` is ``call``, with a stand-in as the loop's current
 * task. Its result (a new reference), or NULL: with an error set to propagate, or without one
 * when the call went on elsewhere (it suspended: a task carries it) or failed (answered). */
static PyObject *first_step(Dispatcher *d, Req *r, PyObject *coro, PyObject *call) {
    PyObject *ctx = PyContext_CopyCurrent(), *eager = NULL, *reader = NULL, *step = NULL;
    PyObject *kinds = NULL;
    if (ctx == NULL)
        return NULL;
    if (PyContext_Enter(ctx) < 0) {
        Py_DECREF(ctx);
        return NULL;
    }
    PySendResult status = PYGEN_ERROR;
    PyObject *token = PyContextVar_Set(d->current_call, call);
    if (token == NULL)
        goto left;
    Py_DECREF(token);
    eager = d->spare_eager != NULL ? d->spare_eager : PyObject_CallNoArgs(d->eager_type);
    d->spare_eager = NULL;
    if (eager == NULL)
        goto left;
    if (PyDict_CheckExact(d->current_tasks)) {
        reader = Py_XNewRef(PyDict_GetItemWithError(d->current_tasks, d->loop));
        if (reader == NULL && !PyErr_Occurred())
            reader = Py_NewRef(Py_None); /* as current_task(): no task (a loop callback's) */
    } else {
        reader = PyObject_CallOneArg(d->current_task, d->loop);
    }
    if (reader == NULL || swap_task(d, reader, eager) < 0)
        goto left;
    status = PyIter_Send(coro, Py_None, &step);
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb); /* the swap back must run whatever the step did */
        if (swap_task(d, eager, reader) < 0) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            Py_CLEAR(step);
            status = PYGEN_ERROR;
        } else {
            PyErr_Restore(type, value, tb);
        }
    }
left:
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (PyContext_Exit(ctx) < 0) { /* not entered: cannot happen, but never leave it entered */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            Py_CLEAR(step);
            status = PYGEN_ERROR;
        } else {
            PyErr_Restore(type, value, tb);
        }
    }
    PyObject *result = NULL;
    if (status == PYGEN_RETURN) {
        result = step;
        step = NULL;
        if (Py_REFCNT(eager) == 1 && !weakly_held(eager)) { /* nobody kept it: the next call's */
            d->spare_eager = eager;
            eager = NULL;
        }
    } else if (status == PYGEN_NEXT) { /* a task carries it on (and takes the stand-in's place) */
        PyObject *args[4] = {coro, step, ctx, eager};
        (void)call_with_frame(d, s_suspended, r, args, 4);
    } else {
        kinds = PyTuple_Pack(2, PyExc_Exception, d->cancelled);
        if (kinds != NULL)
            (void)handler_raised(d, r, kinds);
    }
    Py_XDECREF(kinds);
    Py_XDECREF(step);
    Py_XDECREF(reader);
    Py_XDECREF(eager);
    Py_DECREF(ctx);
    return result;
}

/* The handler's argument from the body (p, n), or NULL: with an error set, or without one when
 * the request was answered INVALID_ARGUMENT (the reference's decode failure). ``*slow``: the
 * reference must take the frame (nothing was done for it). */
static PyObject *argument(Dispatcher *d, Req *r, PyObject *entry, long mode, PyObject **body, int *slow) {
    if (mode & VIEW_ARG && !(mode & IS_ASYNC) && r->flags & FLAG_RAW) {
        if (r->body_obj != NULL) { /* a body taken out of the heap: the reference lends it */
            *slow = 1;
            return NULL;
        }
        /* lent in place while the plain handler runs (Server._lent_reply takes it back) */
        Py_ssize_t at = r->record != NULL ? r->body_at : r->start + r->body_at;
        PyObject *slice = PySequence_GetSlice(r->record != NULL ? r->record : r->buf, at, at + r->body_len);
        if (slice == NULL)
            return NULL;
        r->lent = PyObject_CallMethodNoArgs(slice, s_toreadonly);
        Py_DECREF(slice);
        return Py_XNewRef(r->lent);
    }
    if (mode & VIEW_ARG && !(r->flags & FLAG_RAW)) {
        *slow = 1; /* a MessagePack body for a view: the reference's decode_body */
        return NULL;
    }
    if (r->flags & FLAG_RAW && !(mode & RAW_ARG)) {
        *slow = 1; /* a raw body validated into a typed argument: the reference's decode_body */
        return NULL;
    }
    /* a copy, as the reference's: a decoded value may keep views of what it was decoded from
     * (a body taken out of the heap is one already) */
    *body = r->body_obj != NULL ? Py_NewRef(r->body_obj) : bytes_copy(r->body, r->body_len);
    if (*body == NULL)
        return NULL;
    r->body_obj = *body;
    if (mode & VIEW_ARG) /* a coroutine, which may outlive the record: a view of a copy */
        return PyMemoryView_FromObject(*body);
    if (r->flags & FLAG_RAW)
        return Py_NewRef(*body);
    PyObject *arg = PyObject_CallOneArg(PyTuple_GET_ITEM(entry, 2), *body);
    if (arg != NULL)
        return arg;
    PyObject *exc = caught(PyExc_Exception);
    if (exc == NULL)
        return NULL;
    (void)call_with_frame(d, s_bad_request, r, &exc, 1);
    Py_DECREF(exc);
    return NULL;
}

/* Does ``slot`` hold generation ``gen`` (its slot word, in an open region), a holder the reader
 * has seen? Else a record from it is garbage or the previous holder's (the reference drops it),
 * or a new holder's (the reference sees it first). */
static int seen_holder(Dispatcher *d, unsigned slot, uint32_t gen) {
    if ((Py_ssize_t)slot >= d->slots || (Py_ssize_t)slot >= PyList_GET_SIZE(d->seen))
        return 0;
    uint64_t word = __atomic_load_n((uint64_t *)((char *)PyMemoryView_GET_BUFFER(d->buf)->buf + d->slot_at[slot]),
                                    __ATOMIC_ACQUIRE);
    return (word & 1) && ((word >> 1) & 0xFFFFFFFFULL) == gen && is_gen(PyList_GET_ITEM(d->seen, slot), gen);
}

/* Dispatch a request whose header fields, body and where it lies are in ``r`` (its method
 * name: ``mname``/``mlen``, valid lengths); 1: the reference must take it (nothing was done). */
static int dispatch_req(Dispatcher *d, Req *r, const unsigned char *mname, unsigned mlen) {
    if (!d->enabled || !region_open(d) || r->flags & ~FLAG_RAW || mlen == 0 || mlen > MAX_METHOD)
        return 1;
    int rc = 1, slow = 0;
    PyObject *slot_obj = NULL, *key = NULL, *arg = NULL, *deadline = NULL, *call = NULL, *result = NULL;
    PyObject *peer = NULL, *entry = NULL; /* held: a decoder or handler may change the tables */
    PyObject *body = NULL;
    unsigned slot = r->slot;
    uint32_t gen = r->gen;
    double timeout = r->timeout;
    if (!(timeout >= 0) || !isfinite(timeout) || !seen_holder(d, slot, gen))
        goto done;
    if ((slot_obj = PyLong_FromUnsignedLong(slot)) == NULL)
        goto fail;
    /* replies held back for this slot (its client reads slower than it calls): the reference,
     * which keeps them in order and bounds them (Server._hold); other slots stay here */
    if (PyDict_GET_SIZE(d->backlog)) {
        int held = PyDict_Contains(d->backlog, slot_obj);
        if (held < 0)
            goto fail;
        if (held)
            goto done;
    }
    peer = PyDict_GetItemWithError(d->peers, slot_obj);
    if (peer == NULL) {
        if (PyErr_Occurred())
            goto fail;
        goto done;
    }
    if (!PyTuple_Check(peer) || PyTuple_GET_SIZE(peer) < 2 || !is_gen(PyTuple_GET_ITEM(peer, 1), gen)) {
        peer = NULL;
        goto done;
    }
    Py_INCREF(peer);
    if (d->last_key != NULL && PyBytes_GET_SIZE(d->last_key) == (Py_ssize_t)mlen &&
        memcmp(PyBytes_AS_STRING(d->last_key), mname, mlen) == 0) {
        key = Py_NewRef(d->last_key); /* (its hash is cached) */
    } else {
        if ((key = PyBytes_FromStringAndSize((const char *)mname, mlen)) == NULL)
            goto fail;
        Py_XSETREF(d->last_key, Py_NewRef(key));
    }
    entry = PyDict_GetItemWithError(d->methods, key);
    if (entry == NULL) {
        if (PyErr_Occurred())
            goto fail;
        goto done; /* unknown, reserved or special: the reference */
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4 || !PyLong_CheckExact(PyTuple_GET_ITEM(entry, 1))) {
        entry = NULL;
        goto done;
    }
    Py_INCREF(entry);
    long mode = PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));
    r->method = PyTuple_GET_ITEM(entry, 3);
    if (mode & TAKES_ARG) {
        arg = argument(d, r, entry, mode, &body, &slow);
        if (arg == NULL) {
            if (slow)
                goto done;
            rc = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
    }
    PyObject *fn = PyTuple_GET_ITEM(entry, 0);
    if (timeout > 0) {
        if ((deadline = PyFloat_FromDouble(d->polled_at + timeout)) == NULL)
            goto fail;
    } else {
        deadline = Py_NewRef(Py_None);
    }
    PyObject *cargs[5] = {PyTuple_GET_ITEM(entry, 3), d->no_metadata, peer, deadline, d->chan};
    if ((call = PyObject_Vectorcall(d->context_type, cargs, 5, NULL)) == NULL)
        goto fail;
    /* from here the call is this path's to finish */
    rc = -1;
    if (mode & IS_ASYNC) {
        PyObject *coro = arg != NULL ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
        if (coro == NULL) {
            rc = handler_raised(d, r, PyExc_Exception);
            goto out;
        }
        result = first_step(d, r, coro, call);
        Py_DECREF(coro);
        if (result == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
    } else {
        PyObject *token = PyContextVar_Set(d->current_call, call);
        if (token == NULL)
            goto out;
        result = arg != NULL ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
        int failed = 0;
        if (result == NULL) /* reported while context() is still the call, as the reference does */
            failed = handler_raised(d, r, PyExc_Exception) < 0 ? -1 : 1;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        int reset = PyContextVar_Reset(d->current_call, token);
        Py_DECREF(token);
        if (reset < 0) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            goto out;
        }
        PyErr_Restore(type, value, tb);
        if (failed) {
            rc = failed < 0 ? -1 : 0;
            goto out;
        }
        if (r->lent != NULL && PyCoro_CheckExact(result)) { /* it could read the body later */
            PyObject *args[2] = {r->lent, result};
            rc = call_with_frame(d, s_lent_reply, r, args, 2);
            goto out;
        }
        if (PyCoro_CheckExact(result)) { /* a plain function that returned a coroutine */
            PyObject *args[2] = {result, call};
            rc = call_with_frame(d, s_coroutine, r, args, 2);
            goto out;
        }
    }
    rc = reply(d, r, slot_obj, result);
    goto out;
fail:
    rc = -1;
    goto out;
done:
    rc = 1;
out:
    if (r->lent != NULL) { /* taken back (Server._take_back): a handler that kept it gets an error */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *res = PyObject_CallMethodNoArgs(r->lent, s_release);
        if (res == NULL)
            PyErr_Clear(); /* BufferError: the handler still exports it (np.frombuffer) */
        Py_XDECREF(res);
        PyErr_Restore(type, value, tb);
        Py_DECREF(r->lent);
    }
    Py_XDECREF(r->frame);
    Py_XDECREF(body);
    Py_XDECREF(entry);
    Py_XDECREF(peer);
    Py_XDECREF(result);
    Py_XDECREF(call);
    Py_XDECREF(deadline);
    Py_XDECREF(arg);
    Py_XDECREF(key);
    Py_XDECREF(slot_obj);
    return rc;
}

/* A FREE record (a client is done with a reply body of ours in the heap): server._free_extent(
 * offset, slot, gen) once the header is a sound FREE's from the slot's holder the reader has seen;
 * else the reference (1). No detour: freeing leaves no work for the loop. */
static int dispatch_free(Dispatcher *d, const unsigned char *p) {
    unsigned slot = le16(p + 4);
    uint32_t gen = le32(p + 6);
    if (!d->enabled || !region_open(d) || p[1] != FLAG_RAW || le16(p + 2) != 0 || le64(p + 10) != NO_REPLY ||
        le64(p + 18) != 0 || le16(p + 26) != 0 || !seen_holder(d, slot, gen))
        return 1;
    PyObject *stack[4] = {d->server, PyLong_FromUnsignedLongLong(le64(p + HEADER_SIZE)), PyLong_FromUnsignedLong(slot),
                          PyLong_FromUnsignedLong(gen)};
    PyObject *res = NULL;
    if (stack[1] != NULL && stack[2] != NULL && stack[3] != NULL)
        res = PyObject_VectorcallMethod(s_free_extent, stack, 4, NULL);
    Py_XDECREF(stack[1]);
    Py_XDECREF(stack[2]);
    Py_XDECREF(stack[3]);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* Dispatch one record of the request ring (a request, or a FREE), ``p``/``n``: a view of it
 * (``record``), or where it begins in the region's (``buf``, ``start``); 1: the reference must
 * take it (nothing was done for it). */
static int dispatch(Dispatcher *d, const unsigned char *p, Py_ssize_t n, PyObject *record, PyObject *buf,
                    Py_ssize_t start) {
    if (n == HEADER_SIZE + 8 && p[0] == KIND_FREE)
        return dispatch_free(d, p);
    if (n < HEADER_SIZE || p[0] != KIND_REQUEST)
        return 1;
    unsigned mlen = le16(p + 26);
    Py_ssize_t end = HEADER_SIZE + (Py_ssize_t)mlen;
    if (end > n)
        return 1;
    uint64_t tbits = le64(p + 18);
    Req r = {0};
    r.flags = p[1];
    r.status = le16(p + 2);
    r.slot = le16(p + 4);
    r.gen = le32(p + 6);
    r.call_id = le64(p + 10);
    memcpy(&r.timeout, &tbits, sizeof r.timeout);
    r.body = p + end;
    r.body_len = n - end;
    r.record = record;
    r.buf = buf;
    r.start = start;
    r.body_at = end;
    return dispatch_req(d, &r, p + HEADER_SIZE, mlen);
}

/* What follows dispatch(): the reference takes a record it did not (``rc`` 1), and what a record
 * raised goes to the server's _broken (-1): nothing a peer sends may stop the reader. */
static int dispatched(Dispatcher *self, int rc, PyObject *view) {
    if (rc > 0) {
        PyObject *a[1] = {view};
        return call_server(self, s_on_request, a, 1);
    }
    if (rc < 0) {
        PyObject *exc = caught(PyExc_Exception);
        if (exc == NULL)
            return -1;
        PyObject *a[1] = {exc};
        rc = call_server(self, s_broken, a, 1);
        Py_DECREF(exc);
    }
    return rc;
}

/* The C handler of request records (cxlrpc._ring's C API): a view is made only for the
 * reference. It ends the batch (1) once the loop's turn is due, whatever the batch's size: a
 * clock reading (~25 ns) a record. */
static int dispatch_record(void *ctx, PyObject *buf, const unsigned char *p, Py_ssize_t n, Py_ssize_t start) {
    Dispatcher *self = ctx;
    int rc = dispatch(self, p, n, NULL, buf, start);
    if (rc != 0) {
        PyObject *view = NULL;
        if (rc > 0 && (view = PySequence_GetSlice(buf, start, start + n)) == NULL)
            return -1;
        rc = dispatched(self, rc, view);
        Py_XDECREF(view);
        if (rc < 0)
            return -1;
    }
    return now_s() >= self->until;
}

/* Dispatcher(view): one request record, as Server._on_request takes it. */
static PyObject *dispatcher_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Dispatcher *self = (Dispatcher *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "Dispatcher(view) takes one positional argument");
        return NULL;
    }
    PyObject *view = args[0];
    if (self->server == NULL || self->backlog == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Dispatcher is not initialised");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(view, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = dispatch(self, b.buf, b.len, view, NULL, 0);
    PyBuffer_Release(&b);
    if (dispatched(self, rc, view) < 0)
        return NULL;
    Py_RETURN_NONE;
}

#define BATCH_MAX 256 /* the most records one batch takes (Server._BATCH_MAX) */
#define BATCH_SPAN_S 1e-3 /* Server._TURN_EVERY_S: the serving time a batch is sized to */

/* The next batch's size: the records that fit in BATCH_SPAN_S at ``got`` records per ``took``
 * seconds, 1 to BATCH_MAX. Sized so, slow handlers (20 us each, or a client hammering the
 * ring's counters) no longer keep the loop from its turn for a batch of 256 (5-40 ms). A batch
 * that waited for its first record counts the wait too: the next one is smaller. */
static long long fitting(long long got, double took) {
    if (took <= 0.0)
        return BATCH_MAX;
    double fit = BATCH_SPAN_S * (double)got / took;
    return fit >= BATCH_MAX ? BATCH_MAX : fit < 1.0 ? 1 : (long long)fit;
}

/* One batch of at most ``limit`` records with this dispatcher as their handler, ending once the
 * clock passes ``until`` (the loop's turn): the ring's C API (its poll_within for ``seconds``
 * when that is not NULL, else its poll), or else the ring's Python method with this as a
 * Python handler (which ends at ``limit`` only). The count handed over; -1 with an error set. */
static long long poll_batch(Dispatcher *self, PyObject *ring, long long limit, PyObject *seconds, double until) {
    PyObject *n;
    self->until = until;
    if (PyObject_TypeCheck(ring, ring_api->ring_type))
        n = seconds != NULL ? ring_api->poll_within(ring, limit, PyFloat_AS_DOUBLE(seconds), dispatch_record, self)
                            : ring_api->poll(ring, limit, dispatch_record, self);
    else
        n = Py_NewRef(Py_NotImplemented);
    if (n == Py_NotImplemented) {
        Py_DECREF(n);
        PyObject *py_limit = PyLong_FromLongLong(limit);
        if (py_limit == NULL)
            return -1;
        PyObject *pargs[4] = {ring, (PyObject *)self, py_limit, seconds};
        n = PyObject_VectorcallMethod(seconds != NULL ? s_poll_within : s_poll, pargs, seconds != NULL ? 4 : 3, NULL);
        Py_DECREF(py_limit);
    }
    if (n == NULL)
        return -1;
    long long got = PyLong_AsLongLong(n);
    Py_DECREF(n);
    if (got < 0 && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "a ring's poll returned a negative count");
        return -1;
    }
    return got;
}

/* poll(ring, now, until): one batch of the request ring (the reader's first look,
 * Server._serve), ``polled_at`` set to ``now``, the clock reading it was taken after: at most
 * ``batch`` records, the next batch's size from this one's pace, and none after the clock passes
 * ``until`` (the loop's turn). The requests handed over. */
static PyObject *dispatcher_poll(Dispatcher *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyFloat_Check(args[1]) || !PyFloat_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "poll(ring, now: float, until: float)");
        return NULL;
    }
    if (self->server == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Dispatcher is not initialised");
        return NULL;
    }
    double now = PyFloat_AS_DOUBLE(args[1]);
    self->polled_at = now;
    long long got = poll_batch(self, args[0], self->batch, NULL, PyFloat_AS_DOUBLE(args[2]));
    if (got < 0)
        return NULL;
    if (got > 0)
        self->batch = fitting(got, now_s() - now);
    return PyLong_FromLongLong(got);
}

/* serve(ring, seconds, until): the reader's hot loop (Server._serve), natively: batch after
 * batch, each the request ring's poll_within for ``seconds`` with this dispatcher as its
 * handler (see poll_batch) with ``polled_at`` read just before it, until one finds nothing, a
 * request went to the server's own code (which may have left work for the loop), the
 * dispatcher is disabled, or the clock passes ``until`` (the loop's turn, housekeeping). Each
 * batch takes the records that fit before ``until`` at the pace of the one before (``batch``,
 * kept for the next call). The requests handed over; ``polled_at`` is the last reading. */
static PyObject *dispatcher_serve(Dispatcher *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyFloat_Check(args[1]) || !PyFloat_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "serve(ring, seconds: float, until: float)");
        return NULL;
    }
    if (self->server == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Dispatcher is not initialised");
        return NULL;
    }
    double until = PyFloat_AS_DOUBLE(args[2]);
    long long total = 0;
    self->detoured = 0;
    double now = now_s();
    while (self->enabled && !self->detoured) {
        self->polled_at = now;
        if (now >= until)
            break;
        double left = until - now; /* a turn due sooner than a batch's span: fewer records */
        long long limit = left >= BATCH_SPAN_S ? self->batch : (long long)((double)self->batch * left / BATCH_SPAN_S);
        long long got = poll_batch(self, args[0], limit < 1 ? 1 : limit, args[1], until);
        if (got < 0)
            return NULL;
        if (got == 0)
            break;
        total += got;
        double after = now_s();
        self->batch = fitting(got, after - now);
        now = after;
    }
    return PyLong_FromLongLong(total);
}

/* dispatch_body(slot, gen, call_id, flags, timeout, method, body): a request whose body the
 * server has taken whole out of the heap (a followed one, Server._follow_step), dispatched as a
 * record is, its deadline ``timeout`` after ``polled_at``; False: nothing was done for it (the
 * reference's _dispatch_request takes it). What the handler raised goes to the reference's
 * _fail, as a record's; an error raised here is the caller's (its _broken). */
static PyObject *dispatcher_dispatch_body(Dispatcher *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyLong_CheckExact(args[0]) || !PyLong_CheckExact(args[1]) || !PyLong_CheckExact(args[2]) ||
        !PyLong_CheckExact(args[3]) || !PyFloat_CheckExact(args[4]) || !PyBytes_CheckExact(args[5]) ||
        !PyBytes_CheckExact(args[6])) {
        PyErr_SetString(PyExc_TypeError,
                        "dispatch_body(slot: int, gen: int, call_id: int, flags: int, timeout: float, "
                        "method: bytes, body: bytes)");
        return NULL;
    }
    if (self->server == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Dispatcher is not initialised");
        return NULL;
    }
    unsigned long slot = PyLong_AsUnsignedLong(args[0]), flags = PyLong_AsUnsignedLong(args[3]);
    unsigned long long gen = PyLong_AsUnsignedLongLong(args[1]), call_id = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (slot > 0xFFFF || gen > 0xFFFFFFFFULL || flags > 0xFF)
        Py_RETURN_FALSE;
    Py_ssize_t mlen = PyBytes_GET_SIZE(args[5]);
    Req r = {0};
    r.flags = (unsigned)flags;
    r.slot = (unsigned)slot;
    r.gen = (uint32_t)gen;
    r.call_id = call_id;
    r.timeout = PyFloat_AS_DOUBLE(args[4]);
    r.body_obj = args[6];
    r.body = (const unsigned char *)PyBytes_AS_STRING(args[6]);
    r.body_len = PyBytes_GET_SIZE(args[6]);
    int rc = dispatch_req(self, &r, (const unsigned char *)PyBytes_AS_STRING(args[5]),
                          (unsigned)(mlen > MAX_METHOD ? MAX_METHOD + 1 : mlen));
    if (rc < 0)
        return NULL;
    return PyBool_FromLong(rc == 0);
}

static PyMethodDef dispatcher_methods[] = {
    {"poll", (PyCFunction)(void (*)(void))dispatcher_poll, METH_FASTCALL,
     "poll(ring, now, until): one batch of the request ring, ending by the loop's turn."},
    {"serve", (PyCFunction)(void (*)(void))dispatcher_serve, METH_FASTCALL,
     "serve(ring, seconds, until): poll batch after batch while nothing needs the loop."},
    {"dispatch_body", (PyCFunction)(void (*)(void))dispatcher_dispatch_body, METH_FASTCALL,
     "dispatch_body(slot, gen, call_id, flags, timeout, method, body): a request taken out of the heap."},
    {NULL},
};

static PyObject *dispatcher_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Dispatcher *self = (Dispatcher *)PyType_GenericNew(type, args, kwds);
    if (self != NULL)
        self->vectorcall = dispatcher_call; /* (it says when __init__ was not run) */
    return (PyObject *)self;
}

static int dispatcher_init(Dispatcher *self, PyObject *args, PyObject *kwds) {
    PyObject *server, *buf, *slot_at, *seen, *peers, *backlog, *methods, *responses, *chan;
    PyObject *context_type, *no_metadata, *current_call, *ring_client, *encode_body, *loop;
    PyObject *current_task, *enter_task, *leave_task, *eager_type, *cancelled, *frame_type, *current_tasks;
    PyObject *parked_at, *heap, *heap_waiting, *pack;
    unsigned long long me;
    Py_ssize_t reply_limit, heap_start, heap_size, follow_min, body_limit, follow_chunk;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Dispatcher takes positional arguments only");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!O!O!OOOOOOOOOOOOnOOO!KOO!nnnnnO", &server, &PyMemoryView_Type, &buf,
                          &PyList_Type, &slot_at, &PyList_Type, &seen, &PyDict_Type, &peers,
                          &PyDict_Type, &backlog, &PyDict_Type, &methods, &PyList_Type, &responses,
                          &chan, &context_type, &no_metadata, &current_call, &ring_client,
                          &encode_body, &loop, &current_task, &enter_task, &leave_task,
                          &eager_type, &cancelled, &reply_limit, &frame_type, &current_tasks,
                          &PyList_Type, &parked_at, &me, &heap, &PyList_Type, &heap_waiting, &heap_start,
                          &heap_size, &follow_min, &body_limit, &follow_chunk, &pack))
        return -1;
    if (!PyCallable_Check(pack)) {
        PyErr_SetString(PyExc_TypeError, "Dispatcher: pack must be callable");
        return -1;
    }
    if (!PyContextVar_CheckExact(current_call)) {
        PyErr_SetString(PyExc_TypeError, "current_call must be a ContextVar");
        return -1;
    }
    Py_buffer *view = PyMemoryView_GET_BUFFER(buf);
    Py_ssize_t slots = PyList_GET_SIZE(slot_at);
    if (view->readonly || !PyBuffer_IsContiguous(view, 'C') || PyList_GET_SIZE(seen) != slots ||
        PyList_GET_SIZE(responses) != slots || PyList_GET_SIZE(parked_at) != slots || slots > 65536 ||
        reply_limit < 0) {
        PyErr_SetString(PyExc_ValueError, "Dispatcher: inconsistent region, slots or limits");
        return -1;
    }
    if (heap_start < 0 || heap_start % 8 || heap_size < 0 || heap_size > view->len - heap_start ||
        follow_min < 1 || body_limit < 0 || follow_chunk < 64) {
        PyErr_SetString(PyExc_ValueError, "Dispatcher: the heap lies outside the region, or a followed body's "
                                          "limits are out of range");
        return -1;
    }
    Py_ssize_t *at = word_offsets(buf, slot_at, slots, "Dispatcher: slot state");
    if (at == NULL)
        return -1;
    Py_ssize_t *bells = word_offsets(buf, parked_at, slots, "Dispatcher: slot doorbell");
    if (bells == NULL) {
        PyMem_Free(at);
        return -1;
    }
    PyMem_Free(self->slot_at);
    PyMem_Free(self->parked_at);
    self->slot_at = at;
    self->parked_at = bells;
    self->me = me;
    self->slots = slots;
#define KEEP(field) Py_XSETREF(self->field, Py_NewRef(field))
    KEEP(server); KEEP(buf); KEEP(seen); KEEP(peers); KEEP(backlog); KEEP(methods); KEEP(responses);
    KEEP(chan); KEEP(context_type); KEEP(no_metadata); KEEP(current_call); KEEP(ring_client);
    KEEP(encode_body); KEEP(loop); KEEP(current_task); KEEP(enter_task); KEEP(leave_task);
    KEEP(eager_type); KEEP(cancelled); KEEP(frame_type); KEEP(current_tasks); KEEP(heap); KEEP(heap_waiting);
    KEEP(pack);
#undef KEEP
    self->reply_limit = reply_limit;
    self->batch = BATCH_MAX;
    self->heap_start = heap_start;
    self->heap_size = heap_size;
    self->follow_min = follow_min;
    self->body_limit = body_limit;
    self->follow_chunk = follow_chunk;
    return 0;
}

#define FIELDS(X) X(server) X(buf) X(seen) X(peers) X(backlog) X(methods) X(responses) X(chan) \
    X(context_type) X(no_metadata) X(current_call) X(ring_client) X(encode_body) X(loop) \
    X(current_task) X(enter_task) X(leave_task) X(eager_type) X(cancelled) X(frame_type) \
    X(current_tasks) X(spare_eager) X(last_key) X(heap) X(heap_waiting) X(pack)

static int dispatcher_traverse(Dispatcher *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int dispatcher_clear(Dispatcher *self) {
#define CLEAR(f) Py_CLEAR(self->f);
    FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void dispatcher_dealloc(Dispatcher *self) {
    PyObject_GC_UnTrack(self);
    dispatcher_clear(self);
    PyMem_Free(self->slot_at);
    PyMem_Free(self->parked_at);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef dispatcher_members[] = {
    {"enabled", T_INT, offsetof(Dispatcher, enabled), 0,
     "0 sends every frame to the reference (draining, interceptors); set by the server"},
    {"polled_at", T_DOUBLE, offsetof(Dispatcher, polled_at), 0,
     "when the reader began its batch: deadlines count from it"},
    {"batch", T_LONGLONG, offsetof(Dispatcher, batch), READONLY,
     "the records the next batch takes: as many as the last one's pace fits in a loop turn's span"},
    {NULL},
};

static PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlrpc._dispatch.Dispatcher",
    .tp_doc = "Dispatcher(server, buf, slot_at, seen, peers, backlog, methods, responses, chan, "
              "context_type, no_metadata, current_call, ring_client, encode_body, loop, current_task, "
              "enter_task, leave_task, eager_type, cancelled, reply_limit, frame_type, current_tasks, parked_at, me, heap, "
              "heap_waiting, heap_start, heap_size, follow_min, body_limit, follow_chunk, pack): the request ring's "
              "handler, dispatching the common request shape in C (Server._dispatch is the reference).",
    .tp_basicsize = sizeof(Dispatcher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = dispatcher_new,
    .tp_init = (initproc)dispatcher_init,
    .tp_dealloc = (destructor)dispatcher_dealloc,
    .tp_traverse = (traverseproc)dispatcher_traverse,
    .tp_clear = (inquiry)dispatcher_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Dispatcher, vectorcall),
    .tp_members = dispatcher_members,
    .tp_methods = dispatcher_methods,
};


/* ---------------------------------------------------------------- the client's side */

/* A client's call in C, for the common shape (cxlrpc.client.Client.call is the reference, and
 * takes every call this does not): encode the request, push it, ring the server and, when the
 * client is the only caller, poll its reply ring for the first ``hot`` seconds without giving
 * the loop a turn. The reply to this call is decoded and returned; every other record polled
 * meanwhile goes to the client's own handler (Client._on_reply). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall; /* Caller(view): the reply ring's handler during the hot wait */
    PyObject *client, *methods, *requests, *push_args, *ring_bell, *ring, *encode_body, *decode, *buf;
    PyObject *idle_when; /* a tuple of the client's containers of calls in flight: all empty, or the reference */
    PyObject *turn_when; /* a tuple of its containers of tasks owed a loop turn: all empty, or the call has had it */
    Py_ssize_t max_payload;
    Py_ssize_t bell_at; /* the server's doorbell word in the region */
    uint64_t me;        /* this host's identity, as a parked server writes it */
    uint32_t gen;
    unsigned slot;
    uint64_t expected; /* the call id whose reply the handler keeps */
    int raw;           /* that call takes a raw RESPONSE's body as it is (no response type) */
    PyObject *decoder; /* or decodes a MessagePack RESPONSE's body with this (its response type's) */
    PyObject *pack;    /* encode_body's MessagePack encoder: arguments that are not bytes-like */
    PyObject *reply;   /* that reply, once polled: a Frame, (raw) the body's bytes, or [decoded] */
    PyObject *in_place; /* the client's set of methods that read their bodies in place (never followed) */
    Py_ssize_t heap_start, heap_size, follow_chunk; /* the region's heap; a followed body's publish step */
    double follow_stall, follow_rate; /* a followed reply's writer is given up after (heap.FOLLOW_*; 0: not followed here) */
    int followed;                     /* the reply to this call is a followed extent: */
    uint64_t followed_at, followed_len; /* its offset in the heap and its body's length */
} Caller;

static PyObject *s_on_reply, *s_give_back, *s_reply_unfollowed, *s_extent_revoked;

static PyObject *caller_send(Caller *self, PyObject *mb, PyObject *const *args, double timeout, double hot,
                             double spin, PyObject *spare);

/* Is the reply header at ``p`` a sound one's: no method name, a timeout decode accepts? */
static int sound_reply(const unsigned char *p) {
    double timeout;
    uint64_t bits = le64(p + 18);
    memcpy(&timeout, &bits, sizeof timeout);
    return le16(p + 26) == 0 && timeout >= 0;
}

/* A reply record, ``p``/``n``: given as a view (``view``), or where it begins in the region's
 * (``buf``, ``start``; a view is made only for the Python code it goes to). 0, or -1 on error. */
static int caller_take(Caller *self, const unsigned char *p, Py_ssize_t n, PyObject *view, PyObject *buf,
                       Py_ssize_t start) {
    int ours = self->reply == NULL && !self->followed && n >= HEADER_SIZE && (p[0] == KIND_RESPONSE || p[0] == 3) &&
               le16(p + 4) == self->slot && le32(p + 6) == self->gen && le64(p + 10) == self->expected;
    if (ours && self->raw && p[0] == KIND_RESPONSE && (p[1] == FLAG_RAW || p[1] == (FLAG_RAW | FLAG_HEAP | FLAG_FOLLOW))) {
        /* what Client._answer returns of it, without a Frame: the body, when the header is a
         * sound reply's (no method name, a timeout decode accepts); anything else goes to
         * decode, which says why not */
        int sound = sound_reply(p);
        if (sound && p[1] == FLAG_RAW) {
            self->reply = bytes_copy(p + HEADER_SIZE, n - HEADER_SIZE);
            return self->reply == NULL ? -1 : 0;
        }
        if (sound && n == HEADER_SIZE + 16 && self->follow_stall > 0) {
            /* a followed body (Client._heap_body): copied out once the poll is over
             * (follow_reply), when its extent lies inside the heap (else the reference says so) */
            uint64_t offset = le64(p + HEADER_SIZE), length = le64(p + HEADER_SIZE + 8);
            uint64_t heap = (uint64_t)self->heap_size;
            if (offset % HEAP_UNIT == 0 && offset <= heap && heap - offset >= FOLLOW_HEADER &&
                length <= heap - offset - FOLLOW_HEADER) {
                self->followed = 1;
                self->followed_at = offset;
                self->followed_len = length;
                return 0;
            }
        }
    }
    if (ours && self->decoder != NULL && p[0] == KIND_RESPONSE && p[1] == 0) {
        /* what Client._answer returns of a plain MessagePack result (a kv get's leases), in a
         * list (a decoded value may be of any type); decoded from a copy, as the reference's
         * Frame holds one (a decoded value may keep views of its input) */
        if (sound_reply(p)) {
            PyObject *body = bytes_copy(p + HEADER_SIZE, n - HEADER_SIZE), *value = NULL;
            if (body == NULL)
                return -1;
            value = PyObject_CallOneArg(self->decoder, body);
            Py_DECREF(body);
            if (value != NULL) {
                self->reply = PyList_New(1);
                if (self->reply == NULL) {
                    Py_DECREF(value);
                    return -1;
                }
                PyList_SET_ITEM(self->reply, 0, value);
                return 0;
            }
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return -1;
            PyErr_Clear(); /* the Frame: Client._answer says why it does not decode */
        }
    }
    PyObject *made = NULL;
    if (view == NULL && (view = made = PySequence_GetSlice(buf, start, start + n)) == NULL)
        return -1;
    int rc = 0;
    if (ours) {
        PyObject *f = PyObject_CallOneArg(self->decode, view);
        if (f != NULL) {
            self->reply = f;
            goto done;
        }
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            rc = -1;
            goto done;
        }
        PyErr_Clear(); /* garbage: the client's handler counts it dropped */
    }
    PyObject *stack[2] = {self->client, view};
    PyObject *res = PyObject_VectorcallMethod(s_on_reply, stack, 2, NULL);
    rc = res == NULL ? -1 : 0;
    Py_XDECREF(res);
done:
    Py_XDECREF(made);
    return rc;
}

/* The C handler of reply records during the hot wait (cxlrpc._ring's C API). */
static int caller_record(void *ctx, PyObject *buf, const unsigned char *p, Py_ssize_t n, Py_ssize_t start) {
    return caller_take((Caller *)ctx, p, n, NULL, buf, start);
}

/* Caller(view): a reply record polled during the hot wait (by a ring without the C API). */
static PyObject *caller_handle(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Caller *self = (Caller *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "Caller(view) takes one positional argument");
        return NULL;
    }
    PyObject *view = args[0];
    if (self->client == NULL || self->decode == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Caller is not initialised");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(view, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = caller_take(self, b.buf, b.len, view, NULL, 0);
    PyBuffer_Release(&b);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* call(method, arg, timeout, call_id, hot, raw[, spin[, turned[, spare]]]): the reply Frame (with ``raw`` True, a
 * RESPONSE flagged RAW alone, or a followed one (RAW|HEAP|FOLLOW, follow_reply), is its body's bytes, as
 * Client._answer would return them; with ``raw`` a decode function, a MessagePack RESPONSE
 * that it decodes is ``[its value]``, unless the call has a ``spare``); None once the
 * request is out but its reply has not come within ``hot`` seconds (polled for without a pause
 * for the first ``spin`` of them, default all, then yielding the CPU between polls, as a wait
 * strategy's spin and yield phases do); (flags, body) when the request did not go
 * (too big for the ring, or the ring is full: the reference sends that body); NotImplemented
 * for a method not yet in the client's cache (the reference encodes its name), while any
 * container of ``idle_when`` is not empty (other calls in flight: the reference orders them), or,
 * unless ``turned`` (the call has given the loop its turn), any of ``turn_when``. ``spare``: the
 * client's spare heap extent (offset, size) for a bytes body to follow (send_followed): once
 * the result is neither a tuple nor NotImplemented, the request went through it. */
static PyObject *caller_call(Caller *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 6 || nargs > 9 || !PyLong_CheckExact(args[3]) || !(PyBool_Check(args[5]) || PyCallable_Check(args[5])) ||
        (nargs >= 8 && !PyBool_Check(args[7])) ||
        (nargs == 9 && args[8] != Py_None && (!PyTuple_CheckExact(args[8]) || PyTuple_GET_SIZE(args[8]) != 2))) {
        PyErr_SetString(PyExc_TypeError, "call(method: str, arg, timeout: float, call_id: int, hot: float, raw: bool | decode"
                                         "[, spin: float[, turned: bool[, spare: tuple | None]]])");
        return NULL;
    }
    if (self->methods == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Caller is not initialised");
        return NULL;
    }
    if (!PyUnicode_CheckExact(args[0])) /* a str subclass (an enum's member): the reference */
        Py_RETURN_NOTIMPLEMENTED;
    double timeout = PyFloat_AsDouble(args[2]), hot = PyFloat_AsDouble(args[4]);
    double spin = nargs >= 7 ? PyFloat_AsDouble(args[6]) : hot;
    if ((timeout == -1.0 || hot == -1.0 || spin == -1.0) && PyErr_Occurred())
        return NULL;
    PyObject *mb = PyDict_GetItemWithError(self->methods, args[0]);
    if (mb == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (!PyBytes_CheckExact(mb) || PyBytes_GET_SIZE(mb) == 0 || PyBytes_GET_SIZE(mb) > MAX_METHOD)
        Py_RETURN_NOTIMPLEMENTED;
    int turned = nargs >= 8 && args[7] == Py_True;
    PyObject *spare = nargs == 9 && args[8] != Py_None ? args[8] : NULL;
    for (int t = 0; t < 2 - turned; t++) {
        PyObject *containers = t == 0 ? self->idle_when : self->turn_when;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(containers); i++) {
            Py_ssize_t len = PyObject_Length(PyTuple_GET_ITEM(containers, i));
            if (len != 0) { /* other calls in flight, or tasks owed a turn: the reference */
                if (len < 0)
                    return NULL;
                Py_RETURN_NOTIMPLEMENTED;
            }
        }
    }
    Py_INCREF(mb); /* held: encoding runs Python code */
    PyObject *out = caller_send(self, mb, args, timeout, hot, spin, spare);
    Py_DECREF(mb);
    return out;
}

/* A followed request through the spare extent ``spare`` (Client._call_large with a spare is the
 * reference): its frame, naming the extent, goes first; then the body is written into the
 * extent a chunk at a time, the bytes written so far stored into the extent's progress word
 * (release) after each (follow_publish, as memory.publish_copy), while the server copies them out. 1: sent; 0: not
 * (a method that reads its body in place, an extent that does not hold the body, a full ring:
 * the reference sends it); -1: an error. */
static int send_followed(Caller *self, PyObject *mb, PyObject *body, uint64_t call_id, double timeout,
                         PyObject *spare) {
    if (self->in_place == NULL || self->heap_size <= 0)
        return 0;
    int lends = PySet_Contains(self->in_place, mb);
    if (lends != 0)
        return lends < 0 ? -1 : 0;
    unsigned long long offset = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(spare, 0));
    unsigned long long size = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(spare, 1));
    if (PyErr_Occurred())
        return -1;
    unsigned long long blen = (unsigned long long)PyBytes_GET_SIZE(body), end = FOLLOW_HEADER + blen;
    if (offset % HEAP_UNIT || size < end || offset > (unsigned long long)self->heap_size ||
        end > (unsigned long long)self->heap_size - offset || !view_open(self->buf))
        return 0; /* the reference gives a small spare back, or says the grant was bad */
    Py_buffer region;
    if (PyObject_GetBuffer(self->buf, &region, PyBUF_WRITABLE) < 0)
        return -1;
    int rc = -1;
    char *extent = (char *)region.buf + self->heap_start + offset; /* inside: checked at init */
    uint64_t *progress = (uint64_t *)extent; /* 8-byte aligned: heap_start is (checked at init) */
    const uint64_t *seal = (const uint64_t *)(extent + FOLLOW_SEAL_AT);
    uint64_t mine = follow_seal(self->slot, self->gen);
    int sealed;
    if (__atomic_load_n(seal, __ATOMIC_ACQUIRE) != mine) { /* not ours (we were reaped): not a store */
        sealed = -1;
        rc = 0;
        goto revoked;
    }
    __atomic_store_n(progress, 0, __ATOMIC_RELEASE);
    unsigned char h[HEADER_SIZE];
    fill_header(h, KIND_REQUEST, FLAG_RAW | FLAG_HEAP | FLAG_FOLLOW, self->slot, self->gen, call_id, timeout,
                (unsigned)PyBytes_GET_SIZE(mb));
    PyObject *ext = le_words(offset, blen, 2);
    if (ext == NULL)
        goto done;
    PyObject *parts[2] = {mb, ext};
    PyObject *ok = push_record(self->requests, h, parts, 2, &PyTuple_GET_ITEM(self->push_args, 0),
                               PyTuple_GET_SIZE(self->push_args));
    Py_DECREF(ext);
    if (ok == NULL)
        goto done;
    rc = ok == Py_True;
    Py_DECREF(ok);
    if (!rc) /* the ring is full: the reference waits for room (it zeroes the word again) */
        goto done;
    if (parked_here(self->buf, self->bell_at, self->me)) { /* Doorbell.ring sends */
        PyObject *rang = PyObject_CallNoArgs(self->ring_bell);
        if (rang == NULL) { /* the frame is out: the body still follows, the error after */
            rc = -1;
        } else {
            Py_DECREF(rang);
        }
    }
    const char *src = PyBytes_AS_STRING(body); /* immutable, and held by the caller's arguments */
    Py_BEGIN_ALLOW_THREADS
    sealed = follow_publish(extent + FOLLOW_HEADER, src, (size_t)blen, (size_t)self->follow_chunk, progress,
                            seal, mine);
    Py_END_ALLOW_THREADS
revoked:
    if (sealed < 0 && rc >= 0) { /* the extent is ours no more (we were reaped): Client._extent_revoked */
        PyObject *exc = PyObject_CallMethodNoArgs(self->client, s_extent_revoked);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        rc = -1;
    }
done:
    PyBuffer_Release(&region);
    return rc;
}

/* A FREE of the heap extent at ``offset`` (a followed reply's, read whole), pushed at once, the
 * server rung if parked; 1: pushed, 0: not (a full ring, a revoked claim: Client._give_back, the
 * reference, queues it or knows why), -1: an error to raise. */
static int caller_free(Caller *self, uint64_t offset) {
    unsigned char h[HEADER_SIZE];
    fill_header(h, KIND_FREE, FLAG_RAW, self->slot, self->gen, NO_REPLY, 0.0, 0);
    PyObject *part = le_words(offset, 0, 1);
    if (part == NULL)
        return -1;
    PyObject *ok = push_record(self->requests, h, &part, 1, &PyTuple_GET_ITEM(self->push_args, 0),
                               PyTuple_GET_SIZE(self->push_args));
    Py_DECREF(part);
    if (ok == NULL) {
        PyErr_Clear(); /* the reference pushes again, and says what is wrong */
        return 0;
    }
    int pushed = ok == Py_True;
    Py_DECREF(ok);
    if (pushed && parked_here(self->buf, self->bell_at, self->me)) { /* Doorbell.ring sends */
        PyObject *rang = PyObject_CallNoArgs(self->ring_bell);
        if (rang == NULL)
            return -1;
        Py_DECREF(rang);
    }
    return pushed;
}

/* The body of a followed reply (the extent caller_take found), copied out as the server writes
 * it (follow_loop, the GIL released), then the extent given back (caller_free, else
 * Client._give_back queues its FREE). When the server stops writing it, or its progress is
 * garbage, the error Client._reply_unfollowed makes of it (Unavailable) is raised, as
 * Client._heap_body would. */
static PyObject *follow_reply(Caller *self, uint64_t call_id) {
    uint64_t offset = self->followed_at, length = self->followed_len, done = 0, seen = 0;
    PyObject *out = NULL, *res;
    if (!view_open(self->buf)) {
        PyErr_SetString(PyExc_ValueError, "the region was closed while a reply was followed");
        return NULL;
    }
    if (length > (uint64_t)PY_SSIZE_T_MAX || (out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length)) == NULL)
        return length > (uint64_t)PY_SSIZE_T_MAX ? PyErr_NoMemory() : NULL;
    Py_buffer region;
    if (PyObject_GetBuffer(self->buf, &region, PyBUF_SIMPLE) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    char *extent = (char *)region.buf + self->heap_start + offset; /* inside: caller_take checked */
    int rc, sealed;
    double stall = self->follow_stall, limit = stall + (double)length / self->follow_rate;
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    rc = follow_loop(dst, extent + FOLLOW_HEADER, (uint64_t *)extent, length, &done, stall, limit, &seen);
    /* copied, then the seal re-read: still ours, or what was copied may be another's */
    sealed = follow_sealed((const uint64_t *)(extent + FOLLOW_SEAL_AT), follow_seal(self->slot, self->gen));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&region);
    PyObject *offset_obj = PyLong_FromUnsignedLongLong(offset);
    if (offset_obj == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    if (rc == 0 && done == length && sealed) {
        int freed = caller_free(self, offset);
        res = freed < 0 ? NULL : freed ? Py_NewRef(Py_None) : PyObject_CallMethodOneArg(self->client, s_give_back, offset_obj);
    } else {
        Py_CLEAR(out);
        PyObject *why = rc < 0 ? PyUnicode_FromFormat("progress word %llu is outside [%llu, %llu]",
                                                      (unsigned long long)seen, (unsigned long long)done,
                                                      (unsigned long long)length)
                        : done == length ? PyUnicode_FromString(SEAL_BROKEN)
                                         : Py_NewRef(Py_None); /* (a stall: the client words it) */
        PyObject *id_obj = PyLong_FromUnsignedLongLong(call_id);
        res = why == NULL || id_obj == NULL ? NULL
                                            : PyObject_CallMethodObjArgs(self->client, s_reply_unfollowed, id_obj,
                                                                         offset_obj, why, NULL);
        Py_XDECREF(why);
        Py_XDECREF(id_obj);
        if (res != NULL) { /* the error to raise */
            PyErr_SetObject((PyObject *)Py_TYPE(res), res);
            Py_CLEAR(res);
        }
    }
    Py_DECREF(offset_obj);
    if (res == NULL) {
        Py_XDECREF(out);
        return NULL;
    }
    Py_DECREF(res);
    return out;
}

/* call()'s work once the method's name is known (``mb``, held by the caller). */
static PyObject *caller_send(Caller *self, PyObject *mb, PyObject *const *args, double timeout, double hot,
                             double spin, PyObject *spare) {
    uint64_t call_id = PyLong_AsUnsignedLongLong(args[3]);
    if (call_id == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    unsigned flags;
    PyObject *body, *encoded = NULL; /* encoded: what holds body, unless it is the caller's bytes */
    PyObject *arg = args[1];
    if (PyBytes_CheckExact(arg)) {
        flags = FLAG_RAW;
        body = arg;
    } else if (!PyBytes_Check(arg) && !PyByteArray_Check(arg) && !PyMemoryView_Check(arg) &&
               (encoded = PyObject_CallOneArg(self->pack, arg)) != NULL) {
        flags = 0; /* encode_body's MessagePack, without its frame */
        body = encoded;
    } else {
        if (PyErr_Occurred()) { /* encode_body raises how it failed */
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL;
            PyErr_Clear();
        }
        PyObject *pair = PyObject_CallOneArg(self->encode_body, arg);
        if (pair == NULL)
            return NULL;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(pair, 0))) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_TypeError, "encode_body must return (flags, body)");
            return NULL;
        }
        flags = (unsigned)PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
        encoded = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
        body = encoded;
    }
    Py_ssize_t blen = PyObject_Length(body);
    if (blen < 0) {
        Py_XDECREF(encoded);
        return NULL;
    }
    Py_ssize_t mlen = PyBytes_GET_SIZE(mb);
    if (spare != NULL && encoded == NULL) { /* a bytes body to follow through the spare extent */
        double began = now_s();
        int sent = send_followed(self, mb, body, call_id, timeout, spare);
        if (sent < 0)
            return NULL;
        if (sent) { /* the server reads the body as it is written: its reply comes about as long
                     * after as any other's, but its reading may lag ours; wait that much longer */
            hot += now_s() - began;
            goto wait;
        }
    }
    if (HEADER_SIZE + mlen + blen > self->max_payload) /* out of line: the reference */
        goto not_out;
    unsigned char h[HEADER_SIZE];
    fill_header(h, KIND_REQUEST, flags, self->slot, self->gen, call_id, timeout, (unsigned)mlen);
    /* the request ring's try_push_parts((head, mb, body), *push_args), as ClientChannel.push calls it */
    PyObject *parts[2] = {mb, body};
    PyObject *ok = push_record(self->requests, h, parts, 2, &PyTuple_GET_ITEM(self->push_args, 0),
                               PyTuple_GET_SIZE(self->push_args));
    if (ok == NULL)
        goto fail;
    if (ok != Py_True) { /* the ring is full: the reference waits for room */
        Py_DECREF(ok);
        goto not_out;
    }
    Py_CLEAR(ok);
    Py_CLEAR(encoded);
    if (parked_here(self->buf, self->bell_at, self->me)) { /* Doorbell.ring sends */
        PyObject *rang = PyObject_CallNoArgs(self->ring_bell);
        if (rang == NULL)
            return NULL;
        Py_DECREF(rang);
    }
wait:
    if (!(hot > 0))
        Py_RETURN_NONE;
    self->expected = call_id;
    self->raw = args[5] == Py_True;
    Py_XSETREF(self->decoder, spare == NULL && !PyBool_Check(args[5]) ? Py_NewRef(args[5]) : NULL);
    Py_CLEAR(self->reply);
    double start = now_s(), end = start + hot, spin_end = start + spin;
    PyObject *limit = PyLong_FromLong(1024);
    if (limit == NULL)
        return NULL;
    PyObject *result = NULL;
    int native = PyObject_TypeCheck(self->ring, ring_api->ring_type);
    do {
        PyObject *n = native ? ring_api->poll(self->ring, 1024, caller_record, self) : Py_NewRef(Py_NotImplemented);
        if (n == Py_NotImplemented) { /* the ring's Python method, with this as a Python handler */
            Py_DECREF(n);
            PyObject *pargs[3] = {self->ring, (PyObject *)self, limit};
            n = PyObject_VectorcallMethod(s_poll, pargs, 3, NULL);
        }
        if (n == NULL) {
            Py_CLEAR(self->reply); /* the record comes again, as a late reply */
            self->followed = 0;
            break;
        }
        Py_DECREF(n);
        if (self->followed) {
            self->followed = 0;
            result = follow_reply(self, call_id);
            break;
        }
        if (self->reply != NULL) {
            result = self->reply;
            self->reply = NULL;
            break;
        }
        double t = now_s();
        if (t >= end)
            break;
        if (t >= spin_end)
            sched_yield(); /* a peer on this core (an oversubscribed machine) runs meanwhile */
    } while (1);
    Py_DECREF(limit);
    self->expected = 0; /* NO_REPLY: never a reply's id */
    Py_CLEAR(self->decoder);
    if (result == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
not_out: { /* (flags, body): the reference sends it */
    PyObject *pair = Py_BuildValue("(iO)", (int)flags, body);
    Py_XDECREF(encoded);
    return pair;
}
fail:
    Py_XDECREF(encoded);
    return NULL;
}

static PyObject *caller_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Caller *self = (Caller *)PyType_GenericNew(type, args, kwds);
    if (self != NULL)
        self->vectorcall = caller_handle;
    return (PyObject *)self;
}

static int caller_init(Caller *self, PyObject *args, PyObject *kwds) {
    PyObject *client, *methods, *requests, *push_args, *ring_bell, *ring, *encode_body, *decode, *buf, *idle_when,
        *turn_when, *in_place, *pack;
    unsigned int slot;
    unsigned long gen;
    unsigned long long me;
    Py_ssize_t max_payload, bell_at, heap_start, heap_size, follow_chunk;
    double follow_stall, follow_rate;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Caller takes positional arguments only");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO!OO!OOOOIknO!nKO!O!O!nnnddO", &client, &PyDict_Type, &methods, &requests, &PyTuple_Type,
                          &push_args, &ring_bell, &ring, &encode_body, &decode, &slot, &gen, &max_payload,
                          &PyMemoryView_Type, &buf, &bell_at, &me, &PyTuple_Type, &idle_when, &PyTuple_Type,
                          &turn_when, &PySet_Type, &in_place, &heap_start, &heap_size, &follow_chunk,
                          &follow_stall, &follow_rate, &pack))
        return -1;
    if (!PyCallable_Check(pack)) {
        PyErr_SetString(PyExc_TypeError, "Caller: pack must be callable");
        return -1;
    }
    if (slot > 0xFFFF || gen > 0xFFFFFFFFUL || max_payload < HEADER_SIZE || PyTuple_GET_SIZE(push_args) > MAX_PUSH_ARGS) {
        PyErr_SetString(PyExc_ValueError, "Caller: slot, generation, ring limit or push arguments out of range");
        return -1;
    }
    if (heap_start < 0 || heap_start % 8 || heap_size < 0 ||
        heap_size > PyMemoryView_GET_BUFFER(buf)->len - heap_start || follow_chunk < 64 || !(follow_stall >= 0) ||
        !(follow_rate > 0)) {
        PyErr_SetString(PyExc_ValueError, "Caller: the heap lies outside the region, the publish step is under 64, "
                                          "or a followed reply's stall or rate is not positive");
        return -1;
    }
    if (!word_inside(buf, bell_at)) {
        PyErr_SetString(PyExc_ValueError, "Caller: server doorbell: a word is outside the region");
        return -1;
    }
#define KEEP(field) Py_XSETREF(self->field, Py_NewRef(field))
    KEEP(client); KEEP(methods); KEEP(requests); KEEP(push_args); KEEP(ring_bell); KEEP(ring); KEEP(encode_body);
    KEEP(decode); KEEP(buf); KEEP(idle_when); KEEP(turn_when); KEEP(in_place); KEEP(pack);
#undef KEEP
    self->bell_at = bell_at;
    self->me = me;
    self->slot = slot;
    self->gen = (uint32_t)gen;
    self->max_payload = max_payload;
    self->heap_start = heap_start;
    self->heap_size = heap_size;
    self->follow_chunk = follow_chunk;
    self->follow_stall = follow_stall;
    self->follow_rate = follow_rate;
    self->followed = 0;
    return 0;
}

#define CALLER_FIELDS(X) X(client) X(methods) X(requests) X(push_args) X(ring_bell) X(ring) X(encode_body) \
    X(decode) X(buf) X(idle_when) X(turn_when) X(reply) X(in_place) X(pack) X(decoder)

static int caller_traverse(Caller *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    CALLER_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int caller_clear(Caller *self) {
#define CLEAR(f) Py_CLEAR(self->f);
    CALLER_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void caller_dealloc(Caller *self) {
    PyObject_GC_UnTrack(self);
    caller_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef caller_methods[] = {
    {"call", (PyCFunction)(void (*)(void))caller_call, METH_FASTCALL,
     "call(method, arg, timeout, call_id, hot, raw[, spin[, turned[, spare]]]): push a request and wait hot seconds for its reply "
     "(spinning the first spin of them, then yielding the CPU between polls) "
     "(the reply Frame, or with raw True a raw RESPONSE's body bytes, with raw a decode function [the value "
     "it decodes]; None: it is out, its reply not here "
     "yet; (flags, body): it did not go; NotImplemented: a method name not yet encoded)."},
    {NULL},
};

static PyTypeObject CallerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlrpc._dispatch.Caller",
    .tp_doc = "Caller(client, methods, requests, push_args, ring_bell, ring, encode_body, decode, slot, gen, "
              "max_payload, buf, bell_at, me, idle_when, turn_when, in_place, heap_start, heap_size, follow_chunk, follow_stall, "
              "follow_rate, pack): a connection's calls of the common shape in C (Client.call is the "
              "reference); called with a record, it is the reply ring's handler.",
    .tp_basicsize = sizeof(Caller),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = caller_new,
    .tp_init = (initproc)caller_init,
    .tp_dealloc = (destructor)caller_dealloc,
    .tp_traverse = (traverseproc)caller_traverse,
    .tp_clear = (inquiry)caller_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Caller, vectorcall),
    .tp_methods = caller_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cxlrpc._dispatch",
                                    "The server's request dispatch and the client's call in C, for the common shape.", -1, NULL};

PyMODINIT_FUNC PyInit__dispatch(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_on_request, "_on_request")
    INTERN(s_failed, "_fail")
    INTERN(s_bad_request, "_bad_request")
    INTERN(s_suspended, "_suspended_at")
    INTERN(s_coroutine, "_eager_reply")
    INTERN(s_reply, "_reply")
    INTERN(s_send, "_send")
    INTERN(s_broken, "_broken")
    INTERN(s_push, "try_push_parts")
    INTERN(s_lent_reply, "_lent_reply")
    INTERN(s_toreadonly, "toreadonly")
    INTERN(s_release, "release")
    INTERN(s_on_reply, "_on_reply")
    INTERN(s_give_back, "_give_back")
    INTERN(s_reply_unfollowed, "_reply_unfollowed")
    INTERN(s_extent_revoked, "_extent_revoked")
    INTERN(s_polled_at, "_polled_at")
    INTERN(s_poll_within, "poll_within")
    INTERN(s_poll, "poll")
    INTERN(s_free_extent, "_free_extent")
    INTERN(s_alloc_reply, "alloc_reply")
    INTERN(s_free, "free")
    ring_api = PyCapsule_Import(CXLRPC_RING_API_CAPSULE, 0);
    if (ring_api == NULL)
        return NULL;
#undef INTERN
    if (PyType_Ready(&DispatcherType) < 0 || PyType_Ready(&CallerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Dispatcher", (PyObject *)&DispatcherType) < 0 ||
        PyModule_AddObjectRef(m, "Caller", (PyObject *)&CallerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
