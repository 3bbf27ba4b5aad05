/* Out-of-line bodies in the native paths, both sides (_dispatch.h lists the parts): a body too
 * big for a ring goes through an extent of the region's heap, written a chunk at a time while
 * its reader copies it out (cxlrpc.heap; _follow.h has the protocol's writing and reading). The
 * server's followed reply, the client's followed request through its spare extent, the
 * client's reading of a followed reply, and the FREE that gives its extent back. */
#include "_dispatch.h"

/* A record's body of ``n`` (1 or 2) u64 words, little-endian: a FREE's offset (heap.OFFSET), a
 * followed body's extent (heap.EXTENT: offset, length). */
static PyObject *le_words(uint64_t first, uint64_t second, int n) {
    unsigned char words[16];
    put_le(words, first, 8);
    put_le(words + 8, second, 8);
    return PyBytes_FromStringAndSize((const char *)words, n == 2 ? 16 : 8);
}

/* A big reply of the slot's holder, followed (Server._push_followed): its frame, naming an
 * extent of the heap, goes first, then the body is written there a chunk at a time, the bytes
 * written so far stored into the extent's progress word (release) after each, while the client
 * copies them out. 1: sent; 0: not (no heap, or no room in it now, ALLOCs waiting for it, a body
 * over the heap's limit, a full ring: Server._send takes it, and says what is wrong); -1: an
 * error. */
int push_followed(Dispatcher *d, Req *r, PyObject *slot_obj, PyObject *gen_obj, unsigned flags,
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
    /* (an error ringing: the frame is out, so the body still follows, the error after) */
    rc = ring_parked_client(d, r->slot, slot_obj, gen_obj) < 0 ? -1 : 1;
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

/* A followed request through the spare extent ``spare`` (Client._call_large with a spare is the
 * reference): its frame, naming the extent, goes first; then the body is written into the
 * extent a chunk at a time, the bytes written so far stored into the extent's progress word
 * (release) after each (follow_publish, as memory.publish_copy), while the server copies them out. 1: sent; 0: not
 * (a method that reads its body in place, an extent that does not hold the body, a full ring:
 * the reference sends it); -1: an error. */
int send_followed(Caller *self, PyObject *mb, PyObject *body, uint64_t call_id, double timeout,
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
    if (ring_parked_server(self) < 0) /* the frame is out: the body still follows, the error after */
        rc = -1;
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
    if (pushed && ring_parked_server(self) < 0)
        return -1;
    return pushed;
}

/* The body of a followed reply (the extent caller_take found), copied out as the server writes
 * it (follow_loop, the GIL released), then the extent given back (caller_free, else
 * Client._give_back queues its FREE). When the server stops writing it, or its progress is
 * garbage, the error Client._reply_unfollowed makes of it (Unavailable) is raised, as
 * Client._heap_body would. */
PyObject *follow_reply(Caller *self, uint64_t call_id) {
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
    rc = follow_loop(NULL, dst, extent + FOLLOW_HEADER, (uint64_t *)extent, length, &done, stall, limit, &seen);
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
