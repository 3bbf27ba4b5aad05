/* cxlrpc._dispatch's parts, for one another (not an API): the frame's constants, the server's
 * Dispatcher, a request being dispatched (Req) and the client's Caller, the small helpers both
 * sides inline on their hot paths, and the functions one part calls in another. The module is
 * one extension built from several sources (setup.py):
 *
 *   _dispatch.c          the module, and what both sides share: pushing a record, the GC of
 *                        the two types, a record handler's argument, the words of the region
 *   _dispatch_serve.c    the server's reader: Dispatcher, its batches (poll, serve), init
 *   _dispatch_request.c  the server's dispatch of one record: validate, decode, run, reply
 *   _dispatch_handler.c  a handler's rarer outcomes: its coroutine's first step, and the
 *                        reference's own methods (given the request as a Frame)
 *   _dispatch_follow.c   out-of-line bodies through the heap, both sides: a followed reply
 *                        written, a followed request written, a followed reply read, FREE
 *   _dispatch_call.c     the client's call: Caller, the push and the hot wait for its reply
 *
 * Functions shared across the parts are hidden (visible inside the module only); the tiny
 * ones on the hot paths are static inline here. */
#ifndef CXLRPC_DISPATCH_H
#define CXLRPC_DISPATCH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include "_copy.h"
#include "_flush_api.h"
#include "_follow.h"
#include "_ring_api.h"

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
    uint64_t gen_mask;     /* a slot's word holds its holder's generation as (word >> 1) & gen_mask */
    Py_ssize_t slots;
    Py_ssize_t next_ring;  /* a list of request rings: the one the next batch looks at first */
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

/* A connection's caller (_dispatch_call.c has what it does). */
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
    /* memory without coherence: the slot's grant word (-1: none), what it must read before each
     * push (else the slot is another's: ClaimRevoked), and the region's Lines (a cxlrpc_lines) */
    Py_ssize_t grant_at;
    uint64_t grant;
    PyObject *lines;
} Caller;

static inline double now_s(void) {
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

/* A frame header into h[HEADER_SIZE] (frame.HEADER.pack's layout, little-endian). */
static inline void fill_header(unsigned char *h, unsigned kind, unsigned flags, unsigned slot, uint32_t gen,
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

static inline int view_open(PyObject *buf) {
    return buf != NULL && !(((PyMemoryViewObject *)buf)->flags & _Py_MEMORYVIEW_RELEASED);
}

static inline int region_open(Dispatcher *d) {
    return view_open(d->buf);
}

/* Is the consumer whose doorbell word lies at ``at`` in ``buf`` parked on this host (``me``)?
 * Doorbell.ring's first look, after the same full fence (the records just published are seen
 * before the word is read). The common answer, no (it is awake, or polls from another host),
 * costs no call; yes goes to Doorbell.ring, which claims the word and sends the wake-up. */
static inline int parked_here(PyObject *buf, Py_ssize_t at, uint64_t me) {
    if (!view_open(buf))
        return 1; /* let Doorbell.ring say what a closed region means */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n((uint64_t *)((char *)PyMemoryView_GET_BUFFER(buf)->buf + at), __ATOMIC_RELAXED) == me;
}

/* Ring the client of ``slot`` (``slot_obj``, its generation ``gen_obj``) when its doorbell word says
 * it is parked on this host: ServerChannel.ring_client sends. 0, or -1 with an error set. */
static inline int ring_parked_client(Dispatcher *d, unsigned slot, PyObject *slot_obj, PyObject *gen_obj) {
    if (!parked_here(d->buf, d->parked_at[slot], d->me))
        return 0;
    PyObject *args[2] = {slot_obj, gen_obj};
    PyObject *res = PyObject_Vectorcall(d->ring_client, args, 2, NULL);
    Py_XDECREF(res);
    return res == NULL ? -1 : 0;
}

/* Ring the server when its doorbell word says it is parked on this host: Doorbell.ring sends.
 * 0, or -1 with an error set. */
static inline int ring_parked_server(Caller *self) {
    if (!parked_here(self->buf, self->bell_at, self->me))
        return 0;
    PyObject *rang = PyObject_CallNoArgs(self->ring_bell);
    Py_XDECREF(rang);
    return rang == NULL ? -1 : 0;
}

/* The error fetched into ``saved`` before an undo that must run whatever came before it (a task
 * swapped back, a context left or reset), whose result is ``undone``: set again when the undo
 * went (0), dropped when it raised (-1: the undo's error stands). */
static inline int error_after(int undone, PyObject **saved) {
    if (undone < 0) {
        Py_XDECREF(saved[0]);
        Py_XDECREF(saved[1]);
        Py_XDECREF(saved[2]);
        return -1;
    }
    PyErr_Restore(saved[0], saved[1], saved[2]);
    return 0;
}

/* The slots of Dispatcher and Caller (``T``, its functions named ``p``_new, ``p``_init, ...):
 * objects that hold references the GC follows and, called with one record (vectorcall, set by
 * ``p``_new), are a ring's record handler. */
#define RECORD_HANDLER_SLOTS(T, p)                                                                \
    .tp_basicsize = sizeof(T),                                                                    \
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,             \
    .tp_new = p##_new, .tp_init = (initproc)p##_init, .tp_dealloc = p##_dealloc,                  \
    .tp_traverse = p##_traverse, .tp_clear = p##_clear, .tp_call = PyVectorcall_Call,             \
    .tp_vectorcall_offset = offsetof(T, vectorcall)

#pragma GCC visibility push(hidden)

/* _dispatch.c */
extern cxlrpc_ring_api *ring_api; /* cxlrpc._ring's C API: polls with C handlers of records */
extern cxlrpc_flush_api *flush_api; /* cxlrpc._flush's C API (its Lines type), or NULL: not built */
extern PyObject *claim_revoked;     /* cxlrpc.ring.mpsc.ClaimRevoked */
/* the names of the Python methods and attributes the parts call or set, interned at import */
extern PyObject *s_on_request, *s_failed, *s_bad_request, *s_suspended, *s_coroutine, *s_reply, *s_send,
    *s_broken, *s_push, *s_lent_reply, *s_toreadonly, *s_release, *s_polled_at, *s_poll_within, *s_poll,
    *s_free_extent, *s_alloc_reply, *s_free, *s_on_reply, *s_give_back, *s_reply_unfollowed, *s_extent_revoked;
PyObject *push_record(PyObject *ring, const unsigned char *h, PyObject **parts, Py_ssize_t nparts,
                      PyObject *const *extra, Py_ssize_t nextra);
int word_inside(PyObject *buf, Py_ssize_t at);
Py_ssize_t *word_offsets(PyObject *buf, PyObject *offsets, Py_ssize_t n, const char *what);
PyObject *caught(PyObject *kinds);
int init_args(const char *who, PyObject *args, PyObject *kwds, const char *format, ...);
int record_view(const char *who, int ready, PyObject *const *args, size_t nargsf, PyObject *kwnames, Py_buffer *b);
int refs_traverse(PyObject *self, const Py_ssize_t *refs, visitproc visit, void *arg);
int refs_clear(PyObject *self, const Py_ssize_t *refs);
void refs_dealloc(PyObject *self, const Py_ssize_t *refs);

/* _dispatch_serve.c, _dispatch_call.c: the module's types */
extern PyTypeObject DispatcherType, CallerType;

/* _dispatch_request.c */
int dispatch_req(Dispatcher *d, Req *r, const unsigned char *mname, unsigned mlen);
int dispatch_record(void *ctx, PyObject *buf, const unsigned char *p, Py_ssize_t n, Py_ssize_t start);
PyObject *dispatcher_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames);

/* _dispatch_handler.c */
int call_server(Dispatcher *d, PyObject *name, PyObject **args, size_t n);
int call_with_frame(Dispatcher *d, PyObject *name, Req *r, PyObject **args, size_t n);
int handler_raised(Dispatcher *d, Req *r, PyObject *kinds);
PyObject *first_step(Dispatcher *d, Req *r, PyObject *coro, PyObject *call);

/* _dispatch_follow.c */
int push_followed(Dispatcher *d, Req *r, PyObject *slot_obj, PyObject *gen_obj, unsigned flags, PyObject *body,
                  Py_ssize_t length);
int send_followed(Caller *self, PyObject *mb, PyObject *body, uint64_t call_id, double timeout, PyObject *spare);
PyObject *follow_reply(Caller *self, uint64_t call_id);

#pragma GCC visibility pop

#endif
