/* kvservice's leased Block in C: a zero-copy get makes one and ends it per call, and the
 * Python Block (kvservice.pool's reference, used where this does not build) cost the client
 * about 2.5 us of a ~10 us get to make, check, view and release.
 *
 * Block: what kvservice.pool documents (view, check, release, with, len, released, size,
 * version; ended through owner._release(lease_id, collected)). Its version check reads the
 * version table entry in place when the pool is coherent and the Block's view is not released
 * (the view keeps the whole mapping mapped), and asks pool.holds(entry, version) otherwise, as
 * the reference does: view() hands that view out, so its user may release it, and once the
 * pool is closed too the entry is unmapped (pool.holds then raises ValueError).
 *
 * Leaser: a coherent pool's Pool.leased, validating every offset and size the server sent
 * (anything it would refuse goes to the reference, which raises the error) before slicing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

static PyObject *s_release, *s_owner_release, *s_holds, *s_lease_expired;

typedef struct {
    PyObject_HEAD
    PyObject *view;        /* the value, read-only; NULL once released */
    PyObject *views;       /* a list of the views handed to arrays, made on demand */
    PyObject *owner;       /* ends the lease; NULL once ended (or never: None) */
    PyObject *lease_id;
    PyObject *pool;        /* Py_None: a block that always holds (no pool) */
    PyObject *version;     /* the value's version, as given */
    Py_ssize_t size;
    Py_ssize_t entry;      /* the version entry's offset in the pool's region (pool.holds) */
    const uint64_t *word;  /* that entry in this mapping, read while view is held; NULL: ask pool */
    uint64_t version_u;
    int version_ok;        /* version fits a table entry; if not, it never matches one */
} BlockObject;

static PyTypeObject BlockType;

static int block_traverse(BlockObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->view);
    Py_VISIT(self->views);
    Py_VISIT(self->owner);
    Py_VISIT(self->lease_id);
    Py_VISIT(self->pool);
    Py_VISIT(self->version);
    return 0;
}

static int block_clear(BlockObject *self) {
    Py_CLEAR(self->view);
    Py_CLEAR(self->views);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->lease_id);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->version);
    return 0;
}

/* A collected block whose lease was not ended: end it (collected=True: no sending from here). */
static void block_finalize(BlockObject *self) {
    PyObject *owner = self->owner;
    if (owner == NULL)
        return;
    self->owner = NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *args[3] = {owner, self->lease_id, Py_True};
    PyObject *r = PyObject_VectorcallMethod(s_owner_release, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            NULL);
    if (r == NULL) {
        if (PyErr_ExceptionMatches(PyExc_Exception))
            PyErr_Clear();  /* at interpreter exit the client may be half torn down */
        else
            PyErr_WriteUnraisable((PyObject *)self);
    }
    Py_XDECREF(r);
    Py_DECREF(owner);
    PyErr_Restore(type, value, tb);
}

static void block_dealloc(BlockObject *self) {
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0)
        return;  /* resurrected */
    PyObject_GC_UnTrack(self);
    block_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void set_version(BlockObject *self, PyObject *version) {
    Py_INCREF(version);
    self->version = version;
    self->version_ok = 0;
    if (PyLong_Check(version)) {
        self->version_u = PyLong_AsUnsignedLongLong(version);
        if (self->version_u == (uint64_t)-1 && PyErr_Occurred())
            PyErr_Clear();  /* negative or past 64 bits: no entry holds it */
        else
            self->version_ok = 1;
    }
}

static PyObject *block_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"view", "version", "owner", "lease_id", "pool", "entry", NULL};
    PyObject *view, *version = NULL, *owner = Py_None, *lease_id = NULL, *pool = Py_None;
    Py_ssize_t entry = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!|OOOOn:Block", kwlist, &PyMemoryView_Type, &view,
                                     &version, &owner, &lease_id, &pool, &entry))
        return NULL;
    Py_ssize_t size = PyObject_Length(view);
    if (size < 0)
        return NULL;
    BlockObject *self = (BlockObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (PyMemoryView_GET_BUFFER(view)->readonly) {
        Py_INCREF(view);
        self->view = view;
    } else if ((self->view = PyObject_CallMethod(view, "toreadonly", NULL)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->size = size;
    if (version == NULL || lease_id == NULL) {
        PyObject *zero = PyLong_FromLong(0);
        if (zero == NULL) {
            Py_DECREF(self);
            return NULL;
        }
        set_version(self, version != NULL ? version : zero);
        self->lease_id = lease_id != NULL ? lease_id : zero;
        Py_INCREF(self->lease_id);
        Py_DECREF(zero);
    } else {
        set_version(self, version);
        Py_INCREF(lease_id);
        self->lease_id = lease_id;
    }
    if (owner != Py_None) {
        Py_INCREF(owner);
        self->owner = owner;
    }
    Py_INCREF(pool);
    self->pool = pool;
    self->entry = entry;
    return (PyObject *)self;
}

/* Does ``view`` still hold its export of the pool's mapping? A user may release the view
 * view() handed out; the pool may then be closed and unmapped (one load of a flag). */
static inline int view_live(PyObject *view) {
    return view != NULL && !(((PyMemoryViewObject *)view)->flags & _Py_MEMORYVIEW_RELEASED);
}

/* 1 if the pool still holds this block's value, 0 if not, -1 on error. */
static int block_holds(BlockObject *self) {
    if (self->pool == Py_None)
        return 1;
    if (self->word != NULL && view_live(self->view)) {  /* the view keeps the table mapped */
        if (!self->version_ok)
            return 0;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the reads of the value come before */
        return __atomic_load_n(self->word, __ATOMIC_ACQUIRE) == self->version_u;
    }
    PyObject *entry = PyLong_FromSsize_t(self->entry);
    if (entry == NULL)
        return -1;
    PyObject *args[3] = {self->pool, entry, self->version};
    PyObject *r = PyObject_VectorcallMethod(s_holds, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(entry);
    if (r == NULL)
        return -1;
    int holds = PyObject_IsTrue(r);
    Py_DECREF(r);
    return holds;
}

static int block_check_(BlockObject *self) {
    int holds = block_holds(self);
    if (holds != 0)
        return holds < 0 ? -1 : 0;
    if (s_lease_expired == NULL) {  /* first lapse seen: kvservice.pool is loaded by then */
        PyObject *pool = PyImport_ImportModule("kvservice.pool");
        if (pool == NULL)
            return -1;
        s_lease_expired = PyObject_GetAttrString(pool, "LeaseExpired");
        Py_DECREF(pool);
        if (s_lease_expired == NULL)
            return -1;
    }
    PyErr_Format(s_lease_expired, "the lease on this block (version %S) ended and the pool reused "
                 "its bytes", self->version);
    return -1;
}

static PyObject *block_check(BlockObject *self, PyObject *unused) {
    if (block_check_(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *block_view(BlockObject *self, PyObject *unused) {
    if (self->view == NULL) {
        PyErr_SetString(PyExc_ValueError, "block already released");
        return NULL;
    }
    if (block_check_(self) < 0)
        return NULL;
    Py_INCREF(self->view);
    return self->view;
}

static PyObject *block_tracked_view(BlockObject *self, PyObject *unused) {
    PyObject *view = block_view(self, NULL);
    if (view == NULL)
        return NULL;
    PyObject *copy = PySequence_GetSlice(view, 0, PY_SSIZE_T_MAX);
    Py_DECREF(view);
    if (copy == NULL)
        return NULL;
    if (self->views == NULL && (self->views = PyList_New(0)) == NULL) {
        Py_DECREF(copy);
        return NULL;
    }
    if (PyList_Append(self->views, copy) < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    return copy;
}

/* Release one view; a view an array still exports stays (see the class docstring). */
static int release_view(PyObject *view) {
    PyObject *r = PyObject_CallMethodNoArgs(view, s_release);
    if (r != NULL) {
        Py_DECREF(r);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_BufferError))
        return -1;
    PyErr_Clear();
    return 0;
}

static PyObject *block_release(BlockObject *self, PyObject *unused) {
    PyObject *view = self->view, *views = self->views;
    if (view == NULL)
        Py_RETURN_NONE;
    self->view = self->views = NULL;
    int failed = release_view(view);
    Py_DECREF(view);
    if (views != NULL) {
        for (Py_ssize_t i = 0; !failed && i < PyList_GET_SIZE(views); i++)
            failed = release_view(PyList_GET_ITEM(views, i));
        Py_DECREF(views);
    }
    if (failed)
        return NULL;
    PyObject *owner = self->owner;
    if (owner == NULL)
        Py_RETURN_NONE;
    self->owner = NULL;
    PyObject *args[3] = {owner, self->lease_id, Py_False};
    PyObject *r = PyObject_VectorcallMethod(s_owner_release, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            NULL);
    Py_DECREF(owner);
    return r;
}

static PyObject *block_enter(BlockObject *self, PyObject *unused) {
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *block_exit(BlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *r = block_release(self, NULL);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;  /* exceptions propagate */
}

static PyObject *block_released(BlockObject *self, void *unused) {
    return PyBool_FromLong(self->view == NULL);
}

static Py_ssize_t block_len(BlockObject *self) {
    return self->size;
}

static PyMethodDef block_methods[] = {
    {"check", (PyCFunction)block_check, METH_NOARGS, "Raise LeaseExpired if the block no longer holds this value."},
    {"view", (PyCFunction)block_view, METH_NOARGS, "A read-only memoryview of the value (into the pool: no copy)."},
    {"_tracked_view", (PyCFunction)block_tracked_view, METH_NOARGS,
     "A view of its own, released with the block (what array() wraps)."},
    {"release", (PyCFunction)block_release, METH_NOARGS,
     "End the lease (idempotent) and release the views into the pool."},
    {"__enter__", (PyCFunction)block_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))block_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyMemberDef block_members[] = {
    {"size", T_PYSSIZET, offsetof(BlockObject, size), READONLY, "the value's length in bytes"},
    {"version", T_OBJECT, offsetof(BlockObject, version), READONLY, "the value's version in the pool"},
    {NULL},
};

static PyGetSetDef block_getset[] = {
    {"released", (getter)block_released, NULL, "whether release() ended it", NULL},
    {NULL},
};

static PySequenceMethods block_as_sequence = {.sq_length = (lenfunc)block_len};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvservice._block.Block",
    .tp_doc = "Block(view, version=0, owner=None, lease_id=0, pool=None, entry=0): a leased value "
              "read in place (kvservice.pool.Block's base).",
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = block_new,
    .tp_dealloc = (destructor)block_dealloc,
    .tp_finalize = (destructor)block_finalize,
    .tp_traverse = (traverseproc)block_traverse,
    .tp_clear = (inquiry)block_clear,
    .tp_methods = block_methods,
    .tp_members = block_members,
    .tp_getset = block_getset,
    .tp_as_sequence = &block_as_sequence,
};


/* ---------------------------------------------------------------- a coherent pool's leased() */

typedef struct {
    PyObject_HEAD
    PyTypeObject *block_type;  /* BlockType or a subclass of it */
    PyObject *readable;        /* the pool's data, read-only, a memoryview starting at data */
    PyObject *pool;
    PyObject *reference;       /* the pool's own leased(): takes every lease this refuses */
    Py_ssize_t capacity, alignment;
    Py_ssize_t table;          /* the version table's offset in the region */
    Py_ssize_t data;           /* the data's offset in the region */
} Leaser;

static int leaser_traverse(Leaser *self, visitproc visit, void *arg) {
    Py_VISIT(self->block_type);
    Py_VISIT(self->readable);
    Py_VISIT(self->pool);
    Py_VISIT(self->reference);
    return 0;
}

static int leaser_clear(Leaser *self) {
    Py_CLEAR(self->block_type);
    Py_CLEAR(self->readable);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->reference);
    return 0;
}

static void leaser_dealloc(Leaser *self) {
    PyObject_GC_UnTrack(self);
    leaser_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *leaser_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyTypeObject *block_type;
    PyObject *readable, *pool, *reference;
    Py_ssize_t capacity, alignment, table, data;
    if (!PyArg_ParseTuple(args, "O!O!OOnnnn:Leaser", &PyType_Type, &block_type, &PyMemoryView_Type,
                          &readable, &pool, &reference, &capacity, &alignment, &table, &data))
        return NULL;
    Py_buffer *buf = PyMemoryView_GET_BUFFER(readable);
    if (!PyType_IsSubtype(block_type, &BlockType)) {
        PyErr_SetString(PyExc_TypeError, "block_type must be a subclass of kvservice._block.Block");
        return NULL;
    }
    if (alignment < 8 || (alignment & (alignment - 1)) || capacity <= 0 || capacity % alignment ||
        buf->len != capacity || !buf->readonly || !PyBuffer_IsContiguous(buf, 'C') || buf->itemsize != 1 ||
        table < 0 || table % 8 || capacity / alignment > (data - table) / 8) {
        PyErr_SetString(PyExc_ValueError, "Leaser: the readable view, capacity, alignment and version "
                        "table do not describe one pool");
        return NULL;
    }
    Leaser *self = (Leaser *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(block_type);
    self->block_type = block_type;
    Py_INCREF(readable);
    self->readable = readable;
    Py_INCREF(pool);
    self->pool = pool;
    Py_INCREF(reference);
    self->reference = reference;
    self->capacity = capacity;
    self->alignment = alignment;
    self->table = table;
    self->data = data;
    return (PyObject *)self;
}

/* lease(offset, size, version, owner, lease_id): the Block a lease names. */
static PyObject *leaser_lease(Leaser *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyLong_CheckExact(args[0]) || !PyLong_CheckExact(args[1]))
        goto reference;
    Py_ssize_t offset = PyLong_AsSsize_t(args[0]), size = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        goto reference;
    }
    if (offset < 0 || size <= 0 || offset % self->alignment || offset > self->capacity - size)
        goto reference;
    PyObject *view = PySequence_GetSlice(self->readable, offset, offset + size);
    if (view == NULL)
        return NULL;  /* the pool was closed: its view is released */
    BlockObject *block = (BlockObject *)self->block_type->tp_alloc(self->block_type, 0);
    if (block == NULL) {
        Py_DECREF(view);
        return NULL;
    }
    block->view = view;
    block->size = size;
    set_version(block, args[2]);
    if (args[3] != Py_None) {
        Py_INCREF(args[3]);
        block->owner = args[3];
    }
    Py_INCREF(args[4]);
    block->lease_id = args[4];
    Py_INCREF(self->pool);
    block->pool = self->pool;
    Py_ssize_t unit = offset / self->alignment;
    block->entry = self->table + unit * 8;
    /* the view's first byte is the region's data + offset: the entry is table - data - offset
     * + unit*8 bytes from it, inside the same mapping (checked at construction) */
    block->word = (const uint64_t *)((const char *)PyMemoryView_GET_BUFFER(view)->buf
                                     - offset - self->data + block->entry);
    return (PyObject *)block;
reference:
    return PyObject_Vectorcall(self->reference, args, nargs, NULL);
}

static PyMethodDef leaser_methods[] = {
    {"lease", (PyCFunction)(void (*)(void))leaser_lease, METH_FASTCALL,
     "lease(offset, size, version, owner, lease_id): the Block a lease names (the pool's leased)."},
    {NULL},
};

static PyTypeObject LeaserType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvservice._block.Leaser",
    .tp_doc = "Leaser(block_type, readable, pool, reference, capacity, alignment, table, data): a "
              "coherent pool's leased() in C; reference takes what it refuses.",
    .tp_basicsize = sizeof(Leaser),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = leaser_new,
    .tp_dealloc = (destructor)leaser_dealloc,
    .tp_traverse = (traverseproc)leaser_traverse,
    .tp_clear = (inquiry)leaser_clear,
    .tp_methods = leaser_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvservice._block",
                                    "kvservice's leased Block in C (kvservice.pool holds the reference).",
                                    -1, NULL};

PyMODINIT_FUNC PyInit__block(void) {
    if ((s_release = PyUnicode_InternFromString("release")) == NULL ||
        (s_owner_release = PyUnicode_InternFromString("_release")) == NULL ||
        (s_holds = PyUnicode_InternFromString("holds")) == NULL)
        return NULL;
    if (PyType_Ready(&BlockType) < 0 || PyType_Ready(&LeaserType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Block", (PyObject *)&BlockType) < 0 ||
        PyModule_AddObjectRef(m, "Leaser", (PyObject *)&LeaserType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
