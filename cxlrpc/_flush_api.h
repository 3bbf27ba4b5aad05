/* Write-back and invalidation for the native paths over memory without cross-host coherence
 * (coherence="flush"): the ``Lines`` object of cxlrpc._flush, one per mapping, exported with this
 * header's layout as the capsule ``cxlrpc._flush._C_API``.
 *
 * A native path calls ``lines_writeback`` / ``lines_invalidate`` with an address in the mapping,
 * a length and its *site* (one of CXLRPC_FLUSH_SITES below). On real memory the object runs the
 * CPU's instructions (clwb / clflushopt, then the fence asked for); over a simulated region
 * (cxlrpc.simulator) it calls the simulator's Python hooks with the offset. Every call is
 * counted (so a test can hold a call shape to its flush count) and a mutation test can make one
 * site do nothing (``skip``) to prove some test catches its removal. */
#ifndef CXLRPC_FLUSH_API_H
#define CXLRPC_FLUSH_API_H
#include <Python.h>
#include <stddef.h>

/* Every write-back and invalidate site of the native paths: X(NAME, "what it protects"). A new
 * site is added here (at the end: the numbers are the mutation tests' names for them). */
#define CXLRPC_FLUSH_SITES(X)                                                                           \
    X(PY, "a call from Python (AtomicMemory.writeback / invalidate)")                                 \
    X(RING_PUSH_DATA, "ring push: the records' lines written back before the tail is stored")         \
    X(RING_PUSH_TAIL, "ring push: the tail's line written back after it is stored")                   \
    X(RING_FULL_HEAD, "ring push: the head's line invalidated before a full ring is judged full")     \
    X(RING_POLL_TAIL, "ring poll: the tail's line invalidated before it is read")                     \
    X(RING_POLL_DATA, "ring poll: the records' lines invalidated before they are read")               \
    X(RING_RELEASE_HEAD, "ring poll: the head's line written back after it is stored")                \
    X(RING_REPAIR, "ring: a repaired counter's line written back")                                    \
    X(CALL_GRANT, "caller: the slot's grant line invalidated before a push (a revoked slot)")         \
    X(BLOCK_READ, "kv block: the block's lines invalidated before a get copies them out")             \
    X(BLOCK_WRITE, "kv block: the block's lines written back before the put is committed")          \
    X(BLOCK_VERSION, "kv block: the block's version line invalidated before it is checked")           \
    X(BODY_WRITE, "heap body: the body's lines written back before its frame is published")           \
    X(BODY_READ, "heap body: the body's lines invalidated before they are copied out")                \
    X(BLOCK_STREAM, "kv put: a copied value streamed to memory (skipped: plain stores, left cached)")  \
    X(BLOCK_GIVEN_BACK, "kv put given back unpublished: the writer's lines written back before it is freed") \
    X(FOLLOW_WRITE, "followed body: each chunk streamed in (its partial lines written back) before its progress") \
    X(FOLLOW_PROGRESS, "followed body: the progress word's line written back after each store")       \
    X(FOLLOW_POLL, "followed body: the progress word's line invalidated before each load")            \
    X(FOLLOW_READ, "followed body: each run of bytes progress announced invalidated before it is copied") \
    X(FOLLOW_SEAL, "followed body: the seal's line invalidated before the seal is checked")

#define CXLRPC_SITE_ENUM(name, what) CXLRPC_SITE_##name,
enum { CXLRPC_SITE_NONE, CXLRPC_FLUSH_SITES(CXLRPC_SITE_ENUM) CXLRPC_SITE_COUNT };
#undef CXLRPC_SITE_ENUM

/* What a fence after the lines orders: nothing (a later call's fence will), later stores
 * (sfence: a write-back before the store that publishes it) or later loads too (mfence: an
 * invalidate before the load that reads memory). */
enum { CXLRPC_NO_FENCE = 0, CXLRPC_STORE_FENCE = 1, CXLRPC_FULL_FENCE = 2 };

typedef struct cxlrpc_lines cxlrpc_lines;
/* One operation over the lines of [p, p+n) of the mapping (no fence): 0, or -1 with an error set
 * (a simulator's hook raised; the CPU's instructions never fail). Called with the GIL held. */
typedef int (*cxlrpc_lines_fn)(cxlrpc_lines *l, const volatile void *p, size_t n);

struct cxlrpc_lines {
    PyObject_HEAD
    cxlrpc_lines_fn writeback, invalidate;
    char *base;   /* the mapping the object covers, in this process */
    size_t size;
    PyObject *py_writeback, *py_invalidate; /* the simulator's hooks (offset, length), or NULL */
    int skip;     /* a site whose calls do nothing (a mutation test; 0: none) */
    unsigned long long writebacks, invalidates, fences, lines; /* calls, fences, lines touched */
    /* per site: its calls (write-backs and invalidates) and the fences they asked for (a
     * flush-count test holds each site of a call shape to its count) */
    unsigned long long site_calls[CXLRPC_SITE_COUNT], site_fences[CXLRPC_SITE_COUNT];
};

/* A big body's copy into or out of the mapping in one pass (what cxlrpc.heap's out-of-line bodies
 * use in flush mode), at ``site``. Called with the GIL held; over real memory they release it
 * for big copies (other threads may run meanwhile: hold nothing the GIL protects across them).
 * ``body_write``: copy ``n`` bytes of ``src`` to ``dst`` (in the mapping) with streaming stores,
 * which leave nothing to write back (partial lines at either end written back), then a store
 * fence: the store that publishes the body may follow. Counted as one write-back of the lines
 * and one fence (over a simulator: a plain copy and its write-back hook).
 * ``body_read``: copy ``n`` bytes of ``src`` (in the mapping) to ``dst`` a CXLRPC_BODY_CHUNK at
 * a time, each chunk's lines invalidated and a full fence right before it is copied (counted:
 * one invalidate and one fence per chunk). Both: 0, or -1 with an error set (a range outside
 * the mapping, a simulator's hook that raised). */
#define CXLRPC_BODY_CHUNK (64 << 10)
typedef int (*cxlrpc_body_fn)(cxlrpc_lines *l, int site, char *dst, const char *src, size_t n);

typedef struct {
    PyTypeObject *lines_type;
    cxlrpc_body_fn body_write, body_read;
} cxlrpc_flush_api;

#define CXLRPC_FLUSH_API_CAPSULE "cxlrpc._flush._C_API"

/* [p, p+n) lies inside the mapping ``l`` covers. */
static inline int lines_cover(const cxlrpc_lines *l, const volatile void *p, size_t n) {
    const char *c = (const char *)p;
    return c >= l->base && n <= l->size && (size_t)(c - l->base) <= l->size - n;
}

/* A fence of ``kind`` (counted; a simulator needs none: its hooks act at once). */
static inline void lines_fence(cxlrpc_lines *l, int kind) {
    if (kind == CXLRPC_NO_FENCE)
        return;
    l->fences++;
    if (l->py_writeback != NULL)
        return;
    if (kind == CXLRPC_STORE_FENCE)
        __asm__ volatile("sfence" ::: "memory");
    else
        __asm__ volatile("mfence" ::: "memory");
}

/* Write back the lines of [p, p+n) at ``site``, then ``fence``: 0, or -1 with an error set. */
static inline int lines_writeback(cxlrpc_lines *l, int site, const volatile void *p, size_t n, int fence) {
    if (l->skip == site || n == 0)
        return 0;
    l->writebacks++;
    l->site_calls[site]++;
    if (l->writeback(l, p, n) < 0)
        return -1;
    l->site_fences[site] += fence != CXLRPC_NO_FENCE;
    lines_fence(l, fence);
    return 0;
}

/* Invalidate the lines of [p, p+n) at ``site`` (dirty ones are written back first, as
 * clflushopt does), then ``fence``: 0, or -1 with an error set. */
static inline int lines_invalidate(cxlrpc_lines *l, int site, const volatile void *p, size_t n, int fence) {
    if (l->skip == site || n == 0)
        return 0;
    l->invalidates++;
    l->site_calls[site]++;
    if (l->invalidate(l, p, n) < 0)
        return -1;
    l->site_fences[site] += fence != CXLRPC_NO_FENCE;
    lines_fence(l, fence);
    return 0;
}
#endif
