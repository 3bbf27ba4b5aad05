/* The rings' C API for the native layers above them (cxlrpc._dispatch): polling with a C handler
 * of records and pushing buffers, so that no memoryview, header bytes or tuple of parts is made
 * for a record nobody looks at as an object. Exported
 * by cxlrpc._ring as the capsule ``cxlrpc._ring._C_API``. */
#ifndef CXLRPC_RING_API_H
#define CXLRPC_RING_API_H
#include <Python.h>

/* A record handler: ``p``/``n`` are the record's bytes, which begin at ``start`` in ``buf`` (the
 * ring's region memoryview: slice it for a view). 0 to go on; 1 to end the poll after this
 * record (handed over, as with 0); -1 with an error set (nothing is released: the record comes
 * again, as when a Python handler raises). */
typedef int (*cxlrpc_record_fn)(void *ctx, PyObject *buf, const unsigned char *p, Py_ssize_t n,
                                Py_ssize_t start);

typedef struct {
    PyTypeObject *ring_type; /* RingCore: the rings these functions take */
    /* ring.poll / ring.poll_within with ``fn(ctx, ...)`` as the handler: the count handed over
     * (a new reference), NULL with an error set, or NotImplemented (a new reference) where the
     * ring keeps to its Python reference (memory without coherence, counters to repair): call
     * its Python method with a Python handler then. */
    PyObject *(*poll)(PyObject *ring, long long limit, cxlrpc_record_fn fn, void *ctx);
    PyObject *(*poll_within)(PyObject *ring, long long limit, double seconds, cxlrpc_record_fn fn, void *ctx);
    /* ring.try_push_parts of ``n`` buffers already taken (the caller releases them; a view
     * may be a plain {buf, len} with no object), ``extra`` the MPSC arguments after the parts
     * (producer, tag[, claim[, revoked]]; none for SPSC): True, False (full), NULL with an
     * error set, or NotImplemented (a new reference): call the ring's Python method then. */
    PyObject *(*push)(PyObject *ring, Py_buffer *views, Py_ssize_t n, PyObject *const *extra, Py_ssize_t nextra);
} cxlrpc_ring_api;

#define CXLRPC_RING_API_CAPSULE "cxlrpc._ring._C_API"
#endif
