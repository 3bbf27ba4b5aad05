/* A handler's rarer outcomes in the server's native dispatch (_dispatch.h lists the parts): a
 * coroutine handler's first step, run inline in a stand-in task (Server._run_eagerly), and the
 * slow paths, the reference's own methods, given the request as a Frame made from the fields
 * validated (Server._fail, _suspended_at, _eager_reply, ...). */
#include "_dispatch.h"

/* server.<name>(*args): a slow path; its result is dropped. The server's own code may leave
 * work for the loop (a task, a reply held back, a body to follow): serve() then returns. */
int call_server(Dispatcher *d, PyObject *name, PyObject **args, size_t n) {
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
int call_with_frame(Dispatcher *d, PyObject *name, Req *r, PyObject **args, size_t n) {
    PyObject *stack[5];
    if ((stack[0] = req_frame(d, r)) == NULL)
        return -1;
    for (size_t i = 0; i < n; i++)
        stack[i + 1] = args[i];
    return call_server(d, name, stack, n + 1);
}

/* A handler (or its coroutine's first step) raised: the reference's _fail, when its except
 * clause catches it (``kinds``); anything else propagates. */
int handler_raised(Dispatcher *d, Req *r, PyObject *kinds) {
    PyObject *exc = caught(kinds);
    if (exc == NULL)
        return -1;
    int rc = call_with_frame(d, s_failed, r, &exc, 1);
    Py_DECREF(exc);
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
PyObject *first_step(Dispatcher *d, Req *r, PyObject *coro, PyObject *call) {
    PyObject *ctx = PyContext_CopyCurrent(), *eager = NULL, *reader = NULL, *step = NULL;
    PyObject *kinds = NULL, *saved[3];
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
    PyErr_Fetch(&saved[0], &saved[1], &saved[2]); /* the swap back must run whatever the step did */
    if (error_after(swap_task(d, eager, reader), saved) < 0) {
        Py_CLEAR(step);
        status = PYGEN_ERROR;
    }
left:
    PyErr_Fetch(&saved[0], &saved[1], &saved[2]);
    if (error_after(PyContext_Exit(ctx), saved) < 0) { /* not entered: cannot happen, but never leave it entered */
        Py_CLEAR(step);
        status = PYGEN_ERROR;
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
