/* cxlrpc._dispatch: the common call's shape in C on both sides, the server's dispatch of a
 * request (Dispatcher) and the client's call (Caller); _dispatch.h lists the parts. This part
 * is the module, and what both sides share. */
#include "_dispatch.h"

cxlrpc_ring_api *ring_api;
cxlrpc_flush_api *flush_api;
PyObject *claim_revoked;

PyObject *s_on_request, *s_failed, *s_bad_request, *s_suspended, *s_coroutine, *s_reply, *s_send, *s_broken,
    *s_push, *s_lent_reply, *s_toreadonly, *s_release, *s_polled_at, *s_poll_within, *s_poll, *s_free_extent,
    *s_alloc_reply, *s_free, *s_on_reply, *s_give_back, *s_reply_unfollowed, *s_extent_revoked;

/* ``ring``.try_push_parts of a header (``h``) and the bytes-likes ``parts`` then ``extra``: the
 * rings' C API where it serves (no bytes or tuple made), else the ring's Python method. */
PyObject *push_record(PyObject *ring, const unsigned char *h, PyObject **parts, Py_ssize_t nparts,
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

/* Is ``at`` the offset of an 8-byte aligned word inside ``buf``? */
int word_inside(PyObject *buf, Py_ssize_t at) {
    Py_buffer *view = PyMemoryView_GET_BUFFER(buf);
    return !(at < 0 || at % 8 || at > view->len - 8 || ((uintptr_t)view->buf + (uintptr_t)at) % 8);
}

/* Word offsets from Python (``offsets``, a list of ``n`` ints), each a word inside ``buf``
 * (word_inside). A new array (PyMem_Free it), or NULL with an error set. */
Py_ssize_t *word_offsets(PyObject *buf, PyObject *offsets, Py_ssize_t n, const char *what) {
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

/* The raised exception, taken, when ``kinds`` catches it (as the reference's ``except``);
 * NULL with the error left set otherwise. */
PyObject *caught(PyObject *kinds) {
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

/* ``who``'s __init__ arguments, positional only, parsed as PyArg_ParseTuple parses ``format``
 * into the pointers after it: 0, or -1 with an error set. */
int init_args(const char *who, PyObject *args, PyObject *kwds, const char *format, ...) {
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_Format(PyExc_TypeError, "%s takes positional arguments only", who);
        return -1;
    }
    va_list pointers;
    va_start(pointers, format);
    int parsed = PyArg_VaParse(args, format, pointers);
    va_end(pointers);
    return parsed ? 0 : -1;
}

/* ``who``(view), a record handler called from Python (by a ring without the C API): its one
 * positional argument's buffer, taken into ``b`` (the caller releases it), once ``ready`` (its
 * __init__ has run). 0, or -1 with an error set. */
int record_view(const char *who, int ready, PyObject *const *args, size_t nargsf, PyObject *kwnames, Py_buffer *b) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_Format(PyExc_TypeError, "%s(view) takes one positional argument", who);
        return -1;
    }
    if (!ready) {
        PyErr_Format(PyExc_RuntimeError, "%s is not initialised", who);
        return -1;
    }
    return PyObject_GetBuffer(args[0], b, PyBUF_SIMPLE);
}

/* The GC of an object whose references lie at ``refs`` (offsets into its struct, 0 last): visit
 * them, clear them, and dealloc it (after what else it frees). */
int refs_traverse(PyObject *self, const Py_ssize_t *refs, visitproc visit, void *arg) {
    for (; *refs; refs++)
        Py_VISIT(*(PyObject **)((char *)self + *refs));
    return 0;
}

int refs_clear(PyObject *self, const Py_ssize_t *refs) {
    for (; *refs; refs++) {
        PyObject **field = (PyObject **)((char *)self + *refs);
        Py_CLEAR(*field);
    }
    return 0;
}

void refs_dealloc(PyObject *self, const Py_ssize_t *refs) {
    PyObject_GC_UnTrack(self);
    refs_clear(self, refs);
    Py_TYPE(self)->tp_free(self);
}

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
    if (ring_api == NULL) {
        /* cxlrpc._ring not built (or refused): an ImportError, which the package answers by
           running its reference paths (PyCapsule_Import raises AttributeError for a module
           that lacks the capsule) */
        if (!PyErr_ExceptionMatches(PyExc_ImportError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ImportError, "cxlrpc._dispatch needs cxlrpc._ring's C API");
        }
        return NULL;
    }
#undef INTERN
    flush_api = PyCapsule_Import(CXLRPC_FLUSH_API_CAPSULE, 0);
    if (flush_api == NULL) /* cxlrpc._flush not built: no Lines, so no caller over flushed memory */
        PyErr_Clear();
    PyObject *mpsc = PyImport_ImportModule("cxlrpc.ring.mpsc");
    if (mpsc == NULL)
        return NULL;
    claim_revoked = PyObject_GetAttrString(mpsc, "ClaimRevoked");
    Py_DECREF(mpsc);
    if (claim_revoked == NULL)
        return NULL;
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
