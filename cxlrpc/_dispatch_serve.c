/* The server's reader in C (_dispatch.h lists the parts): the Dispatcher type, the request
 * ring's handler, and the batches it polls with itself as their handler (Server._serve is the
 * reference); _dispatch_request.c dispatches each record. */
#include "_dispatch.h"

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

static long long poll_rings(Dispatcher *self, PyObject *rings, long long limit, PyObject *seconds);

/* One batch of at most ``limit`` records with this dispatcher as their handler, ending once the
 * clock passes ``until`` (the loop's turn): the ring's C API (its poll_within for ``seconds``
 * when that is not NULL, else its poll), or else the ring's Python method with this as a
 * Python handler (which ends at ``limit`` only); a list of rings polled in turn (poll_rings).
 * The count handed over; -1 with an error set. */
static long long poll_batch(Dispatcher *self, PyObject *ring, long long limit, PyObject *seconds, double until) {
    PyObject *n;
    self->until = until;
    if (PyList_CheckExact(ring))
        return poll_rings(self, ring, limit, seconds);
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

/* A batch over a list of rings (one per client, memory without coherence: the transport's
 * NativeRings.requests): each polled in turn through poll_batch, a different one first each
 * time (fairness, as the reference's _ClientRequestRings), until ``limit`` records or the
 * loop's turn; with ``seconds``, looked over again and again (each look an empty poll: in flush
 * mode the invalidate of that ring's tail line only) until one hands records over or
 * ``seconds`` pass. The list may change under a handler (slots granted or freed). */
static long long poll_rings(Dispatcher *self, PyObject *rings, long long limit, PyObject *seconds) {
    double end = seconds != NULL ? now_s() + PyFloat_AS_DOUBLE(seconds) : 0.0;
    for (;;) {
        long long count = 0;
        Py_ssize_t n = PyList_GET_SIZE(rings);
        Py_ssize_t first = n ? self->next_ring % n : 0;
        self->next_ring = first + 1;
        for (Py_ssize_t k = 0; k < n && k < PyList_GET_SIZE(rings) && count < limit; k++) {
            PyObject *ring = Py_NewRef(PyList_GET_ITEM(rings, (first + k) % PyList_GET_SIZE(rings)));
            long long got = poll_batch(self, ring, limit - count, NULL, self->until);
            Py_DECREF(ring);
            if (got < 0)
                return -1;
            count += got;
            if (got && now_s() >= self->until)
                break; /* the loop's turn is due */
        }
        if (count || seconds == NULL || now_s() >= end)
            return count;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}

/* poll's and serve's arguments, (ring, float, float) as ``usage`` says, to an initialised
 * dispatcher: 0, or -1 with an error set. */
static int batch_args(Dispatcher *self, PyObject *const *args, Py_ssize_t nargs, const char *usage) {
    if (nargs != 3 || !PyFloat_Check(args[1]) || !PyFloat_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (self->server == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Dispatcher is not initialised");
        return -1;
    }
    return 0;
}

/* poll(ring, now, until): one batch of the request ring (the reader's first look,
 * Server._serve), ``polled_at`` set to ``now``, the clock reading it was taken after: at most
 * ``batch`` records, the next batch's size from this one's pace, and none after the clock passes
 * ``until`` (the loop's turn). The requests handed over. */
static PyObject *dispatcher_poll(Dispatcher *self, PyObject *const *args, Py_ssize_t nargs) {
    if (batch_args(self, args, nargs, "poll(ring, now: float, until: float)") < 0)
        return NULL;
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
    if (batch_args(self, args, nargs, "serve(ring, seconds: float, until: float)") < 0)
        return NULL;
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
    unsigned long long me, gen_mask = 0xFFFFFFFFULL;
    Py_ssize_t reply_limit, heap_start, heap_size, follow_min, body_limit, follow_chunk;
    if (init_args("Dispatcher", args, kwds, "OO!O!O!O!O!O!O!OOOOOOOOOOOOnOOO!KOO!nnnnnO|K", &server, &PyMemoryView_Type,
                  &buf, &PyList_Type, &slot_at, &PyList_Type, &seen, &PyDict_Type, &peers,
                  &PyDict_Type, &backlog, &PyDict_Type, &methods, &PyList_Type, &responses,
                  &chan, &context_type, &no_metadata, &current_call, &ring_client,
                  &encode_body, &loop, &current_task, &enter_task, &leave_task,
                  &eager_type, &cancelled, &reply_limit, &frame_type, &current_tasks,
                  &PyList_Type, &parked_at, &me, &heap, &PyList_Type, &heap_waiting, &heap_start,
                  &heap_size, &follow_min, &body_limit, &follow_chunk, &pack, &gen_mask) < 0)
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
    self->gen_mask = gen_mask;
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

/* The object references a Dispatcher holds: its GC visits and clears them (refs_traverse). */
#define FIELDS(X) X(server) X(buf) X(seen) X(peers) X(backlog) X(methods) X(responses) X(chan) \
    X(context_type) X(no_metadata) X(current_call) X(ring_client) X(encode_body) X(loop) \
    X(current_task) X(enter_task) X(leave_task) X(eager_type) X(cancelled) X(frame_type) \
    X(current_tasks) X(spare_eager) X(last_key) X(heap) X(heap_waiting) X(pack)

#define REF(f) offsetof(Dispatcher, f),
static const Py_ssize_t dispatcher_refs[] = {FIELDS(REF) 0};
#undef REF

static int dispatcher_traverse(PyObject *self, visitproc visit, void *arg) {
    return refs_traverse(self, dispatcher_refs, visit, arg);
}

static int dispatcher_clear(PyObject *self) {
    return refs_clear(self, dispatcher_refs);
}

static void dispatcher_dealloc(PyObject *self) {
    PyMem_Free(((Dispatcher *)self)->slot_at);
    PyMem_Free(((Dispatcher *)self)->parked_at);
    refs_dealloc(self, dispatcher_refs);
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

PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlrpc._dispatch.Dispatcher",
    .tp_doc = "Dispatcher(server, buf, slot_at, seen, peers, backlog, methods, responses, chan, "
              "context_type, no_metadata, current_call, ring_client, encode_body, loop, current_task, "
              "enter_task, leave_task, eager_type, cancelled, reply_limit, frame_type, current_tasks, parked_at, me, heap, "
              "heap_waiting, heap_start, heap_size, follow_min, body_limit, follow_chunk, pack[, gen_mask]): the request "
              "ring's handler, dispatching the common request shape in C (Server._dispatch is the reference); its "
              "poll and serve take a ring, or a list of rings polled in turn.",
    RECORD_HANDLER_SLOTS(Dispatcher, dispatcher),
    .tp_members = dispatcher_members,
    .tp_methods = dispatcher_methods,
};
