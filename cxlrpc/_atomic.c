/* Atomic u64 operations on a writable buffer shared between processes (cxlrpc.memory's core).
 *
 * AtomicView(buffer) holds the buffer's export (so an mmap cannot be closed, nor a bytearray
 * resized, underneath it) and offers load/store/cas/fetch_add/exchange on the 8-byte aligned
 * word at a byte offset, with an explicit memory order; cell_u64(offset) binds one word as an
 * AtomicU64 whose operations skip the offset's checks. Every call checks that the view is open
 * (one load of its base pointer) after converting its arguments (an __index__ may run Python
 * code that closes it), so a closed view or a cell of one raises ValueError and never touches
 * memory. close() with cells alive invalidates them: they keep their view object alive, not
 * the buffer. The GIL is held throughout: close() cannot run between the check and the access.
 *
 * The operations are GCC/Clang __atomic builtins with constant orders (a switch per order: a
 * non-constant order would be taken as SEQ_CST), lock-free for 8-byte words on x86-64 and
 * aarch64. Values go in as ints in [-2**63, 2**64) (negative ones wrap) and come out unsigned.
 * Methods are METH_FASTCALL with positional arguments only: no tuple, no keyword parsing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if !defined(__GNUC__)
#error "cxlrpc._atomic needs GCC or Clang (__atomic builtins)"
#endif
#ifdef Py_GIL_DISABLED
#error "cxlrpc._atomic relies on the GIL between its open check and the access: free-threaded builds are not supported"
#endif
_Static_assert(__atomic_always_lock_free(8, 0), "8-byte atomics must be lock-free on this target");

enum { O_RELAXED, O_ACQUIRE, O_RELEASE, O_ACQ_REL, O_SEQ_CST, N_ORDERS };
static const char *const order_names[N_ORDERS] = {"RELAXED", "ACQUIRE", "RELEASE", "ACQ_REL", "SEQ_CST"};
#define LOAD_ORDERS ((1u << O_RELAXED) | (1u << O_ACQUIRE) | (1u << O_SEQ_CST))
#define STORE_ORDERS ((1u << O_RELAXED) | (1u << O_RELEASE) | (1u << O_SEQ_CST))
#define ALL_ORDERS ((1u << N_ORDERS) - 1)

enum { K_LOAD, K_STORE, K_CAS, K_FETCH_ADD, K_EXCHANGE };
typedef struct {
    const char *name;
    int nvalues;      /* ints before the order */
    unsigned orders;  /* the orders the operation accepts */
    int fail_order;   /* a failure order may follow (cas) */
} OpSpec;
static const OpSpec specs[] = {
    [K_LOAD] = {"load", 0, LOAD_ORDERS, 0},
    [K_STORE] = {"store", 1, STORE_ORDERS, 0},
    [K_CAS] = {"cas", 2, ALL_ORDERS, 1},
    [K_FETCH_ADD] = {"fetch_add", 1, ALL_ORDERS, 0},
    [K_EXCHANGE] = {"exchange", 1, ALL_ORDERS, 0},
};

typedef struct {
    uint64_t value[2];
    int order, fail;
} OpArgs;

typedef struct {
    PyObject_HEAD
    char *base; /* NULL once closed */
    Py_ssize_t len;
    Py_buffer buffer;
} AtomicView;

typedef struct {
    PyObject_HEAD
    AtomicView *view; /* strong: the cell checks it is open before each operation */
    uint64_t *word;
    Py_ssize_t offset;
} AtomicU64;

static PyTypeObject AtomicViewType, AtomicU64Type;

/* ---- argument conversion ---------------------------------------------------------------- */

static int as_offset(PyObject *obj, Py_ssize_t *out) {
    Py_ssize_t off = PyLong_Check(obj) ? PyLong_AsSsize_t(obj) : PyNumber_AsSsize_t(obj, PyExc_OverflowError);
    if (off == -1 && PyErr_Occurred())
        return -1;
    *out = off;
    return 0;
}

/* An int in [-2**63, 2**64), as the u64 with its bits (negative values wrap). */
static inline int as_u64(PyObject *obj, uint64_t *out) {
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow); /* calls __index__ on a non-int */
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred())
            return -1;
        *out = (uint64_t)v;
        return 0;
    }
    PyObject *num = PyNumber_Index(obj);
    if (num == NULL)
        return -1;
    unsigned long long u = overflow > 0 ? PyLong_AsUnsignedLongLong(num) : (unsigned long long)-1;
    if (overflow < 0 || (u == (unsigned long long)-1 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "value %R is outside [-2**63, 2**64)", num);
        Py_DECREF(num);
        return -1;
    }
    Py_DECREF(num);
    *out = (uint64_t)u;
    return 0;
}

static PyObject *order_objects[N_ORDERS]; /* the ints 0..4 (cached by CPython): a pointer compare */

static inline int as_order(PyObject *obj, unsigned allowed, int *out) {
    long o = 0;
    while (o < N_ORDERS && order_objects[o] != obj)
        o++;
    if (o == N_ORDERS && (o = PyLong_AsLong(obj)) == -1 && PyErr_Occurred())
        return -1;
    if (o < 0 || o >= N_ORDERS) {
        PyErr_Format(PyExc_ValueError, "unknown memory order: %ld", o);
        return -1;
    }
    if (!(allowed >> o & 1u)) {
        PyErr_Format(PyExc_ValueError, "%s is not a valid memory order for this operation", order_names[o]);
        return -1;
    }
    *out = (int)o;
    return 0;
}

/* The operation's arguments after the offset: its values, then an order (SEQ_CST when left
 * out), then for cas a failure order (by default the success order without its release). */
static inline __attribute__((always_inline)) int parse(int kind, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t before, OpArgs *out) {
    const OpSpec *s = &specs[kind];
    Py_ssize_t most = s->nvalues + 1 + s->fail_order;
    if (nargs < s->nvalues || nargs > most) {
        PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd positional arguments but %zd were given",
                     s->name, s->nvalues + before, most + before, nargs + before);
        return -1;
    }
    for (int i = 0; i < s->nvalues; i++)
        if (as_u64(args[i], &out->value[i]) < 0)
            return -1;
    out->order = O_SEQ_CST;
    if (nargs > s->nvalues && as_order(args[s->nvalues], s->orders, &out->order) < 0)
        return -1;
    out->fail = -1;
    if (nargs > s->nvalues + 1 && as_order(args[s->nvalues + 1], LOAD_ORDERS, &out->fail) < 0)
        return -1;
    return 0;
}

/* ---- the operations: each order a constant for the builtin --------------------------- */

static inline uint64_t do_load(uint64_t *p, int o) {
    switch (o) {
    case O_RELAXED: return __atomic_load_n(p, __ATOMIC_RELAXED);
    case O_ACQUIRE: return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    default: return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
}

static inline void do_store(uint64_t *p, uint64_t v, int o) {
    switch (o) {
    case O_RELAXED: __atomic_store_n(p, v, __ATOMIC_RELAXED); break;
    case O_RELEASE: __atomic_store_n(p, v, __ATOMIC_RELEASE); break;
    default: __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    }
}

#define RMW_SWITCH(EXPR_OF_ORDER) \
    switch (o) { \
    case O_RELAXED: return EXPR_OF_ORDER(__ATOMIC_RELAXED); \
    case O_ACQUIRE: return EXPR_OF_ORDER(__ATOMIC_ACQUIRE); \
    case O_RELEASE: return EXPR_OF_ORDER(__ATOMIC_RELEASE); \
    case O_ACQ_REL: return EXPR_OF_ORDER(__ATOMIC_ACQ_REL); \
    default: return EXPR_OF_ORDER(__ATOMIC_SEQ_CST); \
    }

static inline uint64_t do_fetch_add(uint64_t *p, uint64_t v, int o) {
#define FADD(ORD) __atomic_fetch_add(p, v, ORD)
    RMW_SWITCH(FADD)
#undef FADD
}

static inline uint64_t do_exchange(uint64_t *p, uint64_t v, int o) {
#define XCHG(ORD) __atomic_exchange_n(p, v, ORD)
    RMW_SWITCH(XCHG)
#undef XCHG
}

/* Strong CAS; the previous value. A failure order stronger than the success order's own
 * (RELAXED for RELAXED/RELEASE, ACQUIRE for ACQUIRE/ACQ_REL) strengthens the success order
 * to cover it, so the pair is always one the builtin takes, and never weaker than asked. */
static inline uint64_t do_cas(uint64_t *p, uint64_t expected, uint64_t desired, int o, int fail) {
    if (fail == O_SEQ_CST)
        o = O_SEQ_CST;
    else if (fail == O_ACQUIRE)
        o = o == O_RELAXED ? O_ACQUIRE : o == O_RELEASE ? O_ACQ_REL : o;
#define CAS(ORD) (__atomic_compare_exchange_n(p, &expected, desired, 0, ORD, \
                  ORD == __ATOMIC_RELEASE ? __ATOMIC_RELAXED : ORD == __ATOMIC_ACQ_REL ? __ATOMIC_ACQUIRE : ORD), \
                  expected)
    RMW_SWITCH(CAS)
#undef CAS
}

static inline __attribute__((always_inline)) PyObject *run(int kind, uint64_t *p, const OpArgs *a) {
    switch (kind) {
    case K_LOAD: return PyLong_FromUnsignedLongLong(do_load(p, a->order));
    case K_STORE: do_store(p, a->value[0], a->order); Py_RETURN_NONE;
    case K_CAS: return PyLong_FromUnsignedLongLong(do_cas(p, a->value[0], a->value[1], a->order, a->fail));
    case K_FETCH_ADD: return PyLong_FromUnsignedLongLong(do_fetch_add(p, a->value[0], a->order));
    default: return PyLong_FromUnsignedLongLong(do_exchange(p, a->value[0], a->order));
    }
}

/* ---- AtomicView --------------------------------------------------------------------------- */

static int closed_error(void) {
    PyErr_SetString(PyExc_ValueError, "operation on a closed AtomicView");
    return -1;
}

/* The word at ``offset``: open, inside the buffer and 8-byte aligned, else NULL and ValueError. */
static uint64_t *word_at(AtomicView *self, Py_ssize_t offset) {
    if (self->base == NULL) {
        closed_error();
        return NULL;
    }
    if (offset < 0 || offset > self->len - 8) {
        PyErr_Format(PyExc_ValueError, "offset %zd out of range for an 8-byte access into a %zd-byte view",
                     offset, self->len);
        return NULL;
    }
    uintptr_t address = (uintptr_t)self->base + (uintptr_t)offset;
    if (address & 7) {
        PyErr_Format(PyExc_ValueError, "offset %zd gives address %p, which is not 8-byte aligned", offset,
                     (void *)address);
        return NULL;
    }
    return (uint64_t *)address;
}

static PyObject *view_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *obj;
    static char *kwlist[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:AtomicView", kwlist, &obj))
        return NULL;
    AtomicView *self = (AtomicView *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (PyObject_GetBuffer(obj, &self->buffer, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->base = self->buffer.buf;
    self->len = self->buffer.len;
    if (self->base == NULL) /* an empty buffer may have none: keep "open" distinct from "closed" */
        self->base = (char *)&self->len;
    return (PyObject *)self;
}

static PyObject *view_close(AtomicView *self, PyObject *unused) {
    if (self->base != NULL) {
        self->base = NULL;
        self->len = 0;
        PyBuffer_Release(&self->buffer);
    }
    Py_RETURN_NONE;
}

static void view_dealloc(AtomicView *self) {
    view_close(self, NULL);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline __attribute__((always_inline)) PyObject *view_op(AtomicView *self, PyObject *const *args, Py_ssize_t nargs, int kind) {
    Py_ssize_t offset;
    OpArgs a;
    if (nargs < 1) {
        PyErr_Format(PyExc_TypeError, "%s_u64() needs an offset", specs[kind].name);
        return NULL;
    }
    if (as_offset(args[0], &offset) < 0 || parse(kind, args + 1, nargs - 1, 1, &a) < 0)
        return NULL;
    uint64_t *p = word_at(self, offset); /* after the conversions: they may run Python code */
    return p == NULL ? NULL : run(kind, p, &a);
}

#define VIEW_OP(NAME, KIND) \
    static PyObject *view_##NAME(AtomicView *self, PyObject *const *args, Py_ssize_t nargs) { \
        return view_op(self, args, nargs, KIND); \
    }
VIEW_OP(load, K_LOAD)
VIEW_OP(store, K_STORE)
VIEW_OP(cas, K_CAS)
VIEW_OP(fetch_add, K_FETCH_ADD)
VIEW_OP(exchange, K_EXCHANGE)

static PyObject *cell_new_at(PyTypeObject *type, AtomicView *view, Py_ssize_t offset) {
    uint64_t *p = word_at(view, offset);
    if (p == NULL)
        return NULL;
    AtomicU64 *cell = (AtomicU64 *)type->tp_alloc(type, 0);
    if (cell == NULL)
        return NULL;
    cell->view = (AtomicView *)Py_NewRef(view);
    cell->word = p;
    cell->offset = offset;
    return (PyObject *)cell;
}

static PyObject *view_cell_u64(AtomicView *self, PyObject *arg) {
    Py_ssize_t offset;
    if (as_offset(arg, &offset) < 0)
        return NULL;
    return cell_new_at(&AtomicU64Type, self, offset);
}

static PyObject *view_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *view_exit(AtomicView *self, PyObject *const *args, Py_ssize_t nargs) {
    return view_close(self, NULL);
}

static PyObject *view_address(AtomicView *self, void *closure) {
    if (self->base == NULL) {
        closed_error();
        return NULL;
    }
    return PyLong_FromVoidPtr(self->buffer.buf);
}

static PyObject *view_nbytes(AtomicView *self, void *closure) { return PyLong_FromSsize_t(self->len); }

static PyObject *view_closed(AtomicView *self, void *closure) { return PyBool_FromLong(self->base == NULL); }

static PyObject *view_repr(AtomicView *self) {
    if (self->base == NULL)
        return PyUnicode_FromString("<AtomicView (closed)>");
    return PyUnicode_FromFormat("<AtomicView of %zd bytes at %p>", self->len, self->buffer.buf);
}

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
static PyMethodDef view_methods[] = {
    {"load_u64", FASTCALL(view_load), "load_u64(offset, order=SEQ_CST, /) -> int"},
    {"store_u64", FASTCALL(view_store), "store_u64(offset, value, order=SEQ_CST, /) -> None"},
    {"cas_u64", FASTCALL(view_cas),
     "cas_u64(offset, expected, desired, order=SEQ_CST, fail_order=..., /) -> int: the previous value "
     "(desired was stored when it equals expected)"},
    {"fetch_add_u64", FASTCALL(view_fetch_add), "fetch_add_u64(offset, value, order=SEQ_CST, /) -> int: the previous value"},
    {"exchange_u64", FASTCALL(view_exchange), "exchange_u64(offset, value, order=SEQ_CST, /) -> int: the previous value"},
    {"cell_u64", (PyCFunction)view_cell_u64, METH_O,
     "cell_u64(offset, /) -> AtomicU64: the word at offset (bounds and alignment checked once, here)"},
    {"close", (PyCFunction)view_close, METH_NOARGS,
     "Release the buffer's export (idempotent); later operations, and those of its cells, raise ValueError."},
    {"__enter__", view_enter, METH_NOARGS, NULL},
    {"__exit__", FASTCALL(view_exit), NULL},
    {NULL},
};

static PyGetSetDef view_getset[] = {
    {"address", (getter)view_address, NULL, "Where the buffer starts in this process (ValueError once closed).", NULL},
    {"nbytes", (getter)view_nbytes, NULL, "The buffer's length (0 once closed).", NULL},
    {"closed", (getter)view_closed, NULL, "Whether close() was called.", NULL},
    {NULL},
};

static PyTypeObject AtomicViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlrpc._atomic.AtomicView",
    .tp_basicsize = sizeof(AtomicView),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AtomicView(buffer)\n\nAtomic u64 access to a writable, C-contiguous buffer (an mmap, a bytearray, "
              "a memoryview). The buffer stays exported until close().",
    .tp_new = view_new,
    .tp_dealloc = (destructor)view_dealloc,
    .tp_repr = (reprfunc)view_repr,
    .tp_methods = view_methods,
    .tp_getset = view_getset,
};

/* ---- AtomicU64 ------------------------------------------------------------------------------ */

static PyObject *cell_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *view;
    Py_ssize_t offset;
    static char *kwlist[] = {"view", "offset", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!n:AtomicU64", kwlist, &AtomicViewType, &view, &offset))
        return NULL;
    return cell_new_at(type, (AtomicView *)view, offset);
}

static void cell_dealloc(AtomicU64 *self) {
    Py_DECREF(self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline __attribute__((always_inline)) PyObject *cell_op(AtomicU64 *self, PyObject *const *args, Py_ssize_t nargs, int kind) {
    OpArgs a;
    if (parse(kind, args, nargs, 0, &a) < 0)
        return NULL;
    if (self->view->base == NULL) { /* after the conversions: they may run Python code */
        closed_error();
        return NULL;
    }
    return run(kind, self->word, &a);
}

#define CELL_OP(NAME, KIND) \
    static PyObject *cell_##NAME(AtomicU64 *self, PyObject *const *args, Py_ssize_t nargs) { \
        return cell_op(self, args, nargs, KIND); \
    }
CELL_OP(load, K_LOAD)
CELL_OP(store, K_STORE)
CELL_OP(cas, K_CAS)
CELL_OP(fetch_add, K_FETCH_ADD)
CELL_OP(exchange, K_EXCHANGE)

static PyObject *cell_view(AtomicU64 *self, void *closure) { return Py_NewRef(self->view); }

static PyObject *cell_offset(AtomicU64 *self, void *closure) { return PyLong_FromSsize_t(self->offset); }

static PyObject *cell_address(AtomicU64 *self, void *closure) {
    if (self->view->base == NULL) {
        closed_error();
        return NULL;
    }
    return PyLong_FromVoidPtr(self->word);
}

static PyObject *cell_repr(AtomicU64 *self) {
    return PyUnicode_FromFormat("<AtomicU64 at offset %zd%s>", self->offset, self->view->base ? "" : " (closed)");
}

static PyMethodDef cell_methods[] = {
    {"load", FASTCALL(cell_load), "load(order=SEQ_CST, /) -> int"},
    {"store", FASTCALL(cell_store), "store(value, order=SEQ_CST, /) -> None"},
    {"cas", FASTCALL(cell_cas), "cas(expected, desired, order=SEQ_CST, fail_order=..., /) -> int: the previous value"},
    {"fetch_add", FASTCALL(cell_fetch_add), "fetch_add(value, order=SEQ_CST, /) -> int: the previous value"},
    {"exchange", FASTCALL(cell_exchange), "exchange(value, order=SEQ_CST, /) -> int: the previous value"},
    {NULL},
};

static PyGetSetDef cell_getset[] = {
    {"view", (getter)cell_view, NULL, "The AtomicView the word lies in.", NULL},
    {"offset", (getter)cell_offset, NULL, "The word's byte offset in its view.", NULL},
    {"address", (getter)cell_address, NULL, "The word's address in this process (ValueError once closed).", NULL},
    {NULL},
};

static PyTypeObject AtomicU64Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cxlrpc._atomic.AtomicU64",
    .tp_basicsize = sizeof(AtomicU64),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AtomicU64(view, offset)\n\nOne atomic u64 word of an AtomicView, bound once (bounds and alignment "
              "checked here); each operation checks only that the view is still open.",
    .tp_new = cell_new,
    .tp_dealloc = (destructor)cell_dealloc,
    .tp_repr = (reprfunc)cell_repr,
    .tp_methods = cell_methods,
    .tp_getset = cell_getset,
};

/* ---- module ------------------------------------------------------------------------------- */

static PyObject *fence(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    int o = O_SEQ_CST;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "fence() takes at most 1 argument (%zd given)", nargs);
        return NULL;
    }
    if (nargs == 1 && as_order(args[0], ALL_ORDERS, &o) < 0)
        return NULL;
    switch (o) {
    case O_RELAXED: break; /* orders nothing */
    case O_ACQUIRE: __atomic_thread_fence(__ATOMIC_ACQUIRE); break;
    case O_RELEASE: __atomic_thread_fence(__ATOMIC_RELEASE); break;
    case O_ACQ_REL: __atomic_thread_fence(__ATOMIC_ACQ_REL); break;
    default: __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"fence", FASTCALL(fence), "fence(order=SEQ_CST, /) -> None: a memory fence of this thread's loads and stores"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cxlrpc._atomic",
    "Atomic u64 operations with explicit memory orders on shared buffers (see cxlrpc.memory).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__atomic(void) {
    if (PyType_Ready(&AtomicViewType) < 0 || PyType_Ready(&AtomicU64Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    for (int o = 0; o < N_ORDERS; o++) {
        order_objects[o] = PyLong_FromLong(o); /* a reference kept for the process's life */
        if (order_objects[o] == NULL || PyModule_AddObjectRef(m, order_names[o], order_objects[o]) < 0)
            goto fail;
    }
    if (PyModule_AddObjectRef(m, "AtomicView", (PyObject *)&AtomicViewType) < 0 ||
        PyModule_AddObjectRef(m, "AtomicU64", (PyObject *)&AtomicU64Type) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
