/* A client's call in C, for the common shape (cxlrpc.client.Client.call is the reference, and
 * takes every call this does not): encode the request, push it, ring the server and, when the
 * client is the only caller, poll its reply ring for the first ``hot`` seconds without giving
 * the loop a turn. The reply to this call is decoded and returned; every other record polled
 * meanwhile goes to the client's own handler (Client._on_reply). _dispatch.h lists the
 * module's parts; _dispatch_follow.c has the call's followed bodies. */
#include "_dispatch.h"

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
    Py_buffer b;
    if (record_view("Caller", self->client != NULL && self->decode != NULL, args, nargsf, kwnames, &b) < 0)
        return NULL;
    int rc = caller_take(self, b.buf, b.len, args[0], NULL, 0);
    PyBuffer_Release(&b);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Memory without coherence: is the slot still ours (FlushClientChannel.push's check)? Its grant
 * word's line invalidated, then the word compared with the grant we took: 0, or -1 with
 * ClaimRevoked set (the server freed the slot: the ring may be another holder's now). */
static int grant_held(Caller *self) {
    if (!view_open(self->buf)) {
        PyErr_SetString(PyExc_ValueError, "the ring's region is closed");
        return -1;
    }
    uint64_t *word = (uint64_t *)((char *)PyMemoryView_GET_BUFFER(self->buf)->buf + self->grant_at);
    if (lines_invalidate((cxlrpc_lines *)self->lines, CXLRPC_SITE_CALL_GRANT, word, 8, CXLRPC_FULL_FENCE) < 0)
        return -1;
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != self->grant) {
        PyErr_SetString(claim_revoked, "the server freed this client's slot");
        return -1;
    }
    return 0;
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
    if (self->grant_at >= 0 && grant_held(self) < 0) /* memory without coherence: still our slot? */
        goto fail;
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
    if (ring_parked_server(self) < 0)
        return NULL;
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
        *turn_when, *in_place, *pack, *lines = Py_None;
    unsigned int slot;
    unsigned long gen;
    unsigned long long me, grant = 0;
    Py_ssize_t max_payload, bell_at, heap_start, heap_size, follow_chunk, grant_at = -1;
    double follow_stall, follow_rate;
    if (init_args("Caller", args, kwds, "OO!OO!OOOOIknO!nKO!O!O!nnnddO|nKO", &client, &PyDict_Type, &methods,
                  &requests, &PyTuple_Type, &push_args, &ring_bell, &ring, &encode_body, &decode, &slot, &gen,
                  &max_payload, &PyMemoryView_Type, &buf, &bell_at, &me, &PyTuple_Type, &idle_when, &PyTuple_Type,
                  &turn_when, &PySet_Type, &in_place, &heap_start, &heap_size, &follow_chunk,
                  &follow_stall, &follow_rate, &pack, &grant_at, &grant, &lines) < 0)
        return -1;
    if (grant_at >= 0 && (flush_api == NULL || !PyObject_TypeCheck(lines, flush_api->lines_type) ||
                          !word_inside(buf, grant_at) ||
                          !lines_cover((cxlrpc_lines *)lines, (char *)PyMemoryView_GET_BUFFER(buf)->buf + grant_at, 8))) {
        PyErr_SetString(PyExc_ValueError, "Caller: a grant word needs the region's Lines, and to lie inside it");
        return -1;
    }
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
    Py_XSETREF(self->lines, grant_at >= 0 ? Py_NewRef(lines) : NULL);
    self->grant_at = grant_at;
    self->grant = grant;
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

/* The object references a Caller holds: its GC visits and clears them (refs_traverse). */
#define CALLER_FIELDS(X) X(client) X(methods) X(requests) X(push_args) X(ring_bell) X(ring) X(encode_body) \
    X(decode) X(buf) X(idle_when) X(turn_when) X(reply) X(in_place) X(pack) X(decoder) X(lines)

#define REF(f) offsetof(Caller, f),
static const Py_ssize_t caller_refs[] = {CALLER_FIELDS(REF) 0};
#undef REF

static int caller_traverse(PyObject *self, visitproc visit, void *arg) {
    return refs_traverse(self, caller_refs, visit, arg);
}

static int caller_clear(PyObject *self) {
    return refs_clear(self, caller_refs);
}

static void caller_dealloc(PyObject *self) {
    refs_dealloc(self, caller_refs);
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

PyTypeObject CallerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlrpc._dispatch.Caller",
    .tp_doc = "Caller(client, methods, requests, push_args, ring_bell, ring, encode_body, decode, slot, gen, "
              "max_payload, buf, bell_at, me, idle_when, turn_when, in_place, heap_start, heap_size, follow_chunk, follow_stall, "
              "follow_rate, pack[, grant_at, grant, lines]): a connection's calls of the common shape in C "
              "(Client.call is the reference); called with a record, it is the reply ring's handler.",
    RECORD_HANDLER_SLOTS(Caller, caller),
    .tp_methods = caller_methods,
};
