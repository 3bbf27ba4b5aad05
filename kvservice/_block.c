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
 * Leaser: the pool's Pool.leased, validating every offset and size the server sent
 * (anything it would refuse goes to the reference, which raises the error) before slicing.
 *
 * Flush mode (a pool without coherence: the Leaser is given the region's cxlrpc._flush.Lines)
 * follows kvservice.pool's reference with the fewest flushes it allows. A reader: a zero-copy
 * view() invalidates the block's lines once (BLOCK_READ), before its first view is handed out;
 * a copy out (_copy_into_lines, _tobytes_lines) invalidates each BLOCK_CHUNK right before
 * copying it, with a full fence (no separate pass); every version check invalidates the entry's
 * line with a full fence, then loads it (BLOCK_VERSION). A writer: a copied value is streamed
 * into its block (non-temporal stores: nothing left to write back, BLOCK_STREAM) and one store
 * fence follows; a block written in place is written back with one store fence before its
 * commit (BLOCK_WRITE) or before it is given back unpublished (BLOCK_GIVEN_BACK). A read of a
 * version whose block this mapping invalidated already (the Leaser's memo) invalidates only the
 * version's line: lines it cached since were fetched after that version's commit, and the
 * block's bytes change only with a new version (clflushopt drops a line from every cache of
 * the host, so another process's copies are as fresh). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

#include "_copy.h"
#include "_flush_api.h"
#include "_stream.h"

#define LINE 64
#define BLOCK_CHUNK (64 << 10) /* a copy out invalidates and copies this much at a time */

static PyObject *s_release, *s_owner_release, *s_holds, *s_lease_expired;
static cxlrpc_flush_api *flush_api; /* cxlrpc._flush's C API, imported by the first flush Leaser */

/* Flush mode: a block this mapping invalidated while it held ``version`` (under a lease, so after
 * that version's commit): a copy of its lines cached since is that version's, which stays in the
 * block until the version entry changes. A later read of the same version checks the entry
 * (BLOCK_VERSION) and skips the block's invalidation. Direct-mapped by the block's unit. */
#define MEMO_SLOTS 1024
typedef struct {
    uint64_t unit;       /* the block's first unit + 1 (0: an empty slot) */
    uint64_t version;
    Py_ssize_t size;     /* the bytes invalidated from the block's start */
} memo_entry;

typedef struct {
    PyObject_HEAD
    PyTypeObject *block_type;  /* BlockType or a subclass of it */
    PyObject *readable;        /* the pool's data, read-only, a memoryview starting at data */
    PyObject *pool;
    PyObject *reference;       /* the pool's own leased(): takes every lease this refuses */
    Py_ssize_t capacity, alignment;
    Py_ssize_t table;          /* the version table's offset in the region */
    Py_ssize_t data;           /* the data's offset in the region */
    PyObject *lines;           /* flush mode: the region's cxlrpc._flush.Lines; NULL: coherent */
    memo_entry *memo;          /* flush mode: MEMO_SLOTS of them; NULL: coherent */
} Leaser;

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
    PyObject *lines;       /* flush mode: the region's cxlrpc._flush.Lines; NULL: coherent */
    Leaser *leaser;        /* flush mode: its memo of invalidated blocks (a reference) */
    uint64_t unit;         /* flush mode: the block's first unit in the pool */
    uint64_t version_u;
    int version_ok;        /* version fits a table entry; if not, it never matches one */
    int fresh;             /* flush mode: the block's lines were invalidated for a view */
} BlockObject;

static PyTypeObject BlockType;

static int block_traverse(BlockObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->view);
    Py_VISIT(self->views);
    Py_VISIT(self->owner);
    Py_VISIT(self->lease_id);
    Py_VISIT(self->pool);
    Py_VISIT(self->version);
    Py_VISIT(self->lines);
    Py_VISIT(self->leaser);
    return 0;
}

static int block_clear(BlockObject *self) {
    Py_CLEAR(self->view);
    Py_CLEAR(self->views);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->lease_id);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->version);
    Py_CLEAR(self->lines);
    Py_CLEAR(self->leaser);
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

/* The flush-mode block's Lines while its pool is open (NULL: coherent, or closed). */
static inline cxlrpc_lines *open_lines(BlockObject *self) {
    cxlrpc_lines *l = (cxlrpc_lines *)self->lines;
    return l != NULL && l->base != NULL ? l : NULL;
}

/* Flush mode: the memo's slot for this block, or NULL. */
static inline memo_entry *memo_slot(BlockObject *self) {
    return self->leaser != NULL && self->version_ok ? &self->leaser->memo[self->unit % MEMO_SLOTS] : NULL;
}

/* Whether this mapping invalidated the block's lines while it held this version already. */
static inline int memo_fresh(BlockObject *self) {
    memo_entry *m = memo_slot(self);
    return m != NULL && m->unit == self->unit + 1 && m->version == self->version_u && m->size >= self->size;
}

/* Note that this block's lines were invalidated under its lease (its check since passed). */
static inline void memo_note(BlockObject *self) {
    memo_entry *m = memo_slot(self);
    if (m != NULL) {
        m->unit = self->unit + 1;
        m->version = self->version_u;
        m->size = self->size;
    }
}

/* 1 if the pool still holds this block's value, 0 if not, -1 on error. */
static int block_holds(BlockObject *self) {
    if (self->pool == Py_None)
        return 1;
    if (self->word != NULL && view_live(self->view)) {  /* the view keeps the table mapped */
        if (!self->version_ok)
            return 0;
        if (self->lines == NULL) {
            __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the reads of the value come before */
            return __atomic_load_n(self->word, __ATOMIC_ACQUIRE) == self->version_u;
        }
        cxlrpc_lines *l = open_lines(self);
        if (l != NULL) {  /* (closed: the reference below raises its error) */
            /* the full fence orders the value's reads before the entry's load, which reads
             * memory: the server's latest write-back of the line */
            if (lines_invalidate(l, CXLRPC_SITE_BLOCK_VERSION, self->word, 8, CXLRPC_FULL_FENCE) < 0)
                return -1;
            return __atomic_load_n(self->word, __ATOMIC_ACQUIRE) == self->version_u;
        }
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
    cxlrpc_lines *l;
    int noted = 0;
    if (!self->fresh && (l = open_lines(self)) != NULL && view_live(self->view)) {
        /* flush mode, a first view: drop any stale copy of the block's lines (unless this
         * mapping did for this version already); the check's full fence orders it before the
         * reads through the view */
        if (!memo_fresh(self)) {
            if (lines_invalidate(l, CXLRPC_SITE_BLOCK_READ, PyMemoryView_GET_BUFFER(self->view)->buf,
                                 (size_t)self->size, CXLRPC_NO_FENCE) < 0)
                return NULL;
            noted = 1;
        }
        self->fresh = 1;
    }
    if (block_check_(self) < 0)
        return NULL;
    if (noted)
        memo_note(self);
    Py_INCREF(self->view);
    return self->view;
}

/* Flush mode: copy the value into ``dst`` (``size`` bytes), each BLOCK_CHUNK's lines
 * invalidated with a full fence right before it is copied, then check the version (after the
 * copy, as a seqlock reader does: a copy returned is never torn). 0, or -1 with an error set. */
static int lines_copy(BlockObject *self, char *dst) {
    if (self->view == NULL) {
        PyErr_SetString(PyExc_ValueError, "block already released");
        return -1;
    }
    cxlrpc_lines *l = open_lines(self);
    if (l == NULL || !view_live(self->view)) {
        if (self->lines != NULL && block_check_(self) < 0)  /* the reference's error: a closed pool */
            return -1;
        PyErr_SetString(PyExc_ValueError, self->lines == NULL ? "not a flush-mode block"
                                                              : "the block's view was released");
        return -1;
    }
    Py_buffer src;  /* held across the copy: the mapping stays whatever a hook's Python does */
    if (PyObject_GetBuffer(self->view, &src, PyBUF_SIMPLE) < 0)
        return -1;
    const char *from = (const char *)src.buf;
    int rc = 0, fresh = memo_fresh(self);
    if (fresh)  /* this mapping invalidated the block for this version: what it caches since is it */
        copy_span(dst, from, (size_t)self->size);
    for (Py_ssize_t at = 0, step; !fresh && rc == 0 && at < self->size; at += step) {
        step = self->size - at < BLOCK_CHUNK ? self->size - at : BLOCK_CHUNK;
        rc = lines_invalidate(l, CXLRPC_SITE_BLOCK_READ, from + at, (size_t)step, CXLRPC_FULL_FENCE);
        if (rc == 0)
            copy_span(dst + at, from + at, (size_t)step);
    }
    PyBuffer_Release(&src);
    if (rc < 0 || block_check_(self) < 0)
        return -1;
    if (!fresh)
        memo_note(self);
    return 0;
}

/* _copy_into_lines(out): flush mode's copy_into (the value into the writable buffer out). */
static PyObject *block_copy_into_lines(BlockObject *self, PyObject *out) {
    Py_buffer dst;
    if (PyObject_GetBuffer(out, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    int rc = -1;
    if (dst.len < self->size)
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is too small for %zd", dst.len, self->size);
    else
        rc = lines_copy(self, (char *)dst.buf);
    PyBuffer_Release(&dst);
    return rc < 0 ? NULL : PyLong_FromSsize_t(self->size);
}

/* _tobytes_lines(): flush mode's tobytes (a copy of the value). */
static PyObject *block_tobytes_lines(BlockObject *self, PyObject *unused) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, self->size);
    if (out != NULL && lines_copy(self, PyBytes_AS_STRING(out)) < 0)
        Py_CLEAR(out);
    return out;
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
    {"_copy_into_lines", (PyCFunction)block_copy_into_lines, METH_O,
     "Flush mode's copy_into: each chunk invalidated right before it is copied, checked after."},
    {"_tobytes_lines", (PyCFunction)block_tobytes_lines, METH_NOARGS,
     "Flush mode's tobytes: each chunk invalidated right before it is copied, checked after."},
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


/* ------------------------------------------------------------------------ the pool's leased() */

static int leaser_traverse(Leaser *self, visitproc visit, void *arg) {
    Py_VISIT(self->block_type);
    Py_VISIT(self->readable);
    Py_VISIT(self->pool);
    Py_VISIT(self->reference);
    Py_VISIT(self->lines);
    return 0;
}

static int leaser_clear(Leaser *self) {
    Py_CLEAR(self->block_type);
    Py_CLEAR(self->readable);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->reference);
    Py_CLEAR(self->lines);
    return 0;
}

static void leaser_dealloc(Leaser *self) {
    PyObject_GC_UnTrack(self);
    leaser_clear(self);
    PyMem_Free(self->memo);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *leaser_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyTypeObject *block_type;
    PyObject *readable, *pool, *reference, *lines = Py_None;
    Py_ssize_t capacity, alignment, table, data;
    if (!PyArg_ParseTuple(args, "O!O!OOnnnn|O:Leaser", &PyType_Type, &block_type, &PyMemoryView_Type,
                          &readable, &pool, &reference, &capacity, &alignment, &table, &data, &lines))
        return NULL;
    if (lines != Py_None) {
        if (flush_api == NULL &&
            (flush_api = (cxlrpc_flush_api *)PyCapsule_Import(CXLRPC_FLUSH_API_CAPSULE, 0)) == NULL)
            return NULL;
        if (!PyObject_TypeCheck(lines, flush_api->lines_type)) {
            PyErr_SetString(PyExc_TypeError, "Leaser: lines must be a cxlrpc._flush.Lines or None");
            return NULL;
        }
        cxlrpc_lines *l = (cxlrpc_lines *)lines;
        if (alignment < LINE || !lines_cover(l, (const char *)PyMemoryView_GET_BUFFER(readable)->buf - data,
                                             (size_t)data + (size_t)capacity)) {
            PyErr_SetString(PyExc_ValueError, "Leaser: lines must cover the pool's region, its blocks "
                            "whole lines");
            return NULL;
        }
    }
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
    if (lines != Py_None) {
        if ((self->memo = PyMem_Calloc(MEMO_SLOTS, sizeof(memo_entry))) == NULL) {
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
        Py_INCREF(lines);
        self->lines = lines;
    }
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
    if (self->lines != NULL) {
        Py_INCREF(self->lines);
        block->lines = self->lines;
        Py_INCREF(self);
        block->leaser = self;
        block->unit = (uint64_t)unit;
    }
    return (PyObject *)block;
reference:
    return PyObject_Vectorcall(self->reference, args, nargs, NULL);
}

/* Flush mode: [offset, offset+size) of the pool as an address, its Lines open: 0, or -1 with an
 * error set (a coherent Leaser, a closed pool, a range outside it or not starting a line). */
static int leaser_range(Leaser *self, Py_ssize_t offset, Py_ssize_t size, char **p) {
    cxlrpc_lines *l = (cxlrpc_lines *)self->lines;
    if (l == NULL) {
        PyErr_SetString(PyExc_ValueError, "Leaser: not a flush-mode pool's");
        return -1;
    }
    if (l->base == NULL || !view_live(self->readable)) {
        PyErr_SetString(PyExc_ValueError, "operation on a closed AtomicMemory (its region was closed)");
        return -1;
    }
    if (offset < 0 || size <= 0 || offset % LINE || offset > self->capacity - size) {
        PyErr_Format(PyExc_ValueError, "block [%zd, %zd+%zd) is not whole lines of the pool of %zd", offset,
                     offset, size, self->capacity);
        return -1;
    }
    /* the readable view's mapping is the pool's (writable) data: a put writes through it */
    *p = (char *)PyMemoryView_GET_BUFFER(self->readable)->buf + offset;
    return 0;
}

/* write(offset, data): flush mode, stream ``data`` into the pool at ``offset`` (a line's start)
 * with non-temporal stores, its last line padded with zeros (a block is whole lines: it is
 * this block's), then a store fence (before the commit): nothing is left to write back. Over a
 * simulator the stores land in this process's "cache": its write-back hook stands for the
 * streaming (not counted as a write-back). Skipped (BLOCK_STREAM): plain stores, left cached. */
static PyObject *leaser_write(Leaser *self, PyObject *args) {
    Py_ssize_t offset;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "ny*:write", &offset, &src))
        return NULL;
    char *dst;
    int rc = -1;
    if (!PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_BufferError, "Leaser.write needs a contiguous buffer");
    } else if (leaser_range(self, offset, src.len, &dst) == 0) {
        cxlrpc_lines *l = (cxlrpc_lines *)self->lines;
        size_t n = (size_t)src.len, whole = n & ~(size_t)(LINE - 1), padded = (n + LINE - 1) & ~(size_t)(LINE - 1);
        rc = 0;
        if (l->skip == CXLRPC_SITE_BLOCK_STREAM) {  /* a mutation test */
            copy_span(dst, src.buf, n);
        } else if (l->py_writeback != NULL) {  /* a simulator */
            copy_span(dst, src.buf, n);
            memset(dst + n, 0, padded - n);
            unsigned long long counted = l->lines;
            rc = l->writeback(l, dst, padded);
            l->lines = counted;
        } else {
            stream_span(dst, src.buf, whole);
            if (padded != whole) {
                char last[LINE] __attribute__((aligned(16))) = {0};
                memcpy(last, (const char *)src.buf + whole, n - whole);
                stream_span(dst + whole, last, LINE);
            }
        }
        if (rc == 0)
            lines_fence(l, CXLRPC_STORE_FENCE);
    }
    PyBuffer_Release(&src);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* written(offset, size) / given_back(offset, size): flush mode, write the block's lines back
 * and a store fence: before the commit that publishes it (BLOCK_WRITE), or before the message
 * that frees it unpublished (BLOCK_GIVEN_BACK: else its writer's lines land later over the
 * block's next value). */
static PyObject *leaser_writeback(Leaser *self, PyObject *args, int site) {
    Py_ssize_t offset, size;
    if (!PyArg_ParseTuple(args, "nn", &offset, &size))
        return NULL;
    char *p;
    if (leaser_range(self, offset, size, &p) < 0 ||
        lines_writeback((cxlrpc_lines *)self->lines, site, p, (size_t)size, CXLRPC_STORE_FENCE) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *leaser_written(Leaser *self, PyObject *args) {
    return leaser_writeback(self, args, CXLRPC_SITE_BLOCK_WRITE);
}

static PyObject *leaser_given_back(Leaser *self, PyObject *args) {
    return leaser_writeback(self, args, CXLRPC_SITE_BLOCK_GIVEN_BACK);
}

static PyMethodDef leaser_methods[] = {
    {"lease", (PyCFunction)(void (*)(void))leaser_lease, METH_FASTCALL,
     "lease(offset, size, version, owner, lease_id): the Block a lease names (the pool's leased)."},
    {"write", (PyCFunction)leaser_write, METH_VARARGS,
     "write(offset, data): flush mode, stream data into the pool at offset, then a store fence."},
    {"written", (PyCFunction)leaser_written, METH_VARARGS,
     "written(offset, size): flush mode, write the block back before its commit (store fence)."},
    {"given_back", (PyCFunction)leaser_given_back, METH_VARARGS,
     "given_back(offset, size): flush mode, write the block back before it is freed unpublished."},
    {NULL},
};

static PyTypeObject LeaserType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvservice._block.Leaser",
    .tp_doc = "Leaser(block_type, readable, pool, reference, capacity, alignment, table, data, lines=None): "
              "the pool's leased() in C (flush mode with lines, the region's cxlrpc._flush.Lines); "
              "reference takes what it refuses.",
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
