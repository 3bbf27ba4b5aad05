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
 * may write garbage. (_dispatch.h lists the module's parts: the Dispatcher type and its batches
 * are in _dispatch_serve.c, a handler's rarer outcomes in _dispatch_handler.c.)
 */
#include "_dispatch.h"

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
        rc = ring_parked_client(d, slot, slot_obj, gen_obj);
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
    return (word & 1) && ((word >> 1) & d->gen_mask) == gen && is_gen(PyList_GET_ITEM(d->seen, slot), gen);
}

/* Dispatch a request whose header fields, body and where it lies are in ``r`` (its method
 * name: ``mname``/``mlen``, valid lengths); 1: the reference must take it (nothing was done). */
int dispatch_req(Dispatcher *d, Req *r, const unsigned char *mname, unsigned mlen) {
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
        PyObject *saved[3];
        PyErr_Fetch(&saved[0], &saved[1], &saved[2]);
        int reset = PyContextVar_Reset(d->current_call, token);
        Py_DECREF(token);
        if (error_after(reset, saved) < 0)
            goto out;
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
int dispatch_record(void *ctx, PyObject *buf, const unsigned char *p, Py_ssize_t n, Py_ssize_t start) {
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
PyObject *dispatcher_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Dispatcher *self = (Dispatcher *)callable;
    Py_buffer b;
    if (record_view("Dispatcher", self->server != NULL && self->backlog != NULL, args, nargsf, kwnames, &b) < 0)
        return NULL;
    PyObject *view = args[0];
    int rc = dispatch(self, b.buf, b.len, view, NULL, 0);
    PyBuffer_Release(&b);
    if (dispatched(self, rc, view) < 0)
        return NULL;
    Py_RETURN_NONE;
}
