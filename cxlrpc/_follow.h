/* A followed body's writing and reading (cxlrpc.heap), shared by cxlrpc._flush (publish_copy,
 * follow_copy, Follower) and the native caller's followed requests and replies (cxlrpc._dispatch):
 * one place for the protocol. */
#ifndef CXLRPC_FOLLOW_H
#define CXLRPC_FOLLOW_H

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_copy.h"
#include "_flush_api.h"

/* A followed extent's seal: the u64 after its progress word (FOLLOW_SEAL_AT), which the server
 * sets to its owner's follow_seal(slot, generation) when it hands the extent out and to 0 when
 * the owner departs (cxlrpc.heap.seal_word): a client frozen past its reaping checks it before
 * each chunk it writes and after each body it reads, so it never writes on (beyond the chunk it
 * was in) nor returns bytes of an extent that is no longer its own. */
#define FOLLOW_SEAL_AT 8

static inline uint64_t follow_seal(unsigned slot, uint32_t gen) {
    return ((((uint64_t)gen) << 32) | ((uint64_t)(slot & 0x7FFFFFFFu) << 1) | 1u) * 0x9E3779B97F4A7C15ULL;
}

/* Is the seal still ``expected``, after the loads before this call (a copy out: seqlock-style)? */
static inline int follow_sealed(const uint64_t *seal, uint64_t expected) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(seal, __ATOMIC_RELAXED) == expected;
}

/* Copy ``n`` bytes of ``src`` into ``dst`` a ``chunk`` at a time, storing the count copied so
 * far into ``*progress`` (release) after each: a reader copies them out meanwhile. With a
 * ``seal`` (not NULL), it must read ``expected`` before each chunk and before each progress
 * store, else the writer stops there: -1 (nothing more written); 0 once all is. Needs no GIL. */
static inline int follow_publish(char *dst, const char *src, size_t n, size_t chunk, uint64_t *progress,
                                 const uint64_t *seal, uint64_t expected) {
    for (size_t done = 0; done < n;) {
        size_t step = n - done < chunk ? n - done : chunk;
        if (seal != NULL && __atomic_load_n(seal, __ATOMIC_ACQUIRE) != expected)
            return -1;
        copy_span(dst + done, src + done, step);
        done += step;
        if (seal != NULL && __atomic_load_n(seal, __ATOMIC_ACQUIRE) != expected)
            return -1;
        __atomic_store_n(progress, (uint64_t)done, __ATOMIC_RELEASE);
    }
    return 0;
}

static inline double follow_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Copy ``src[*done:]`` into ``dst`` as the progress word says its bytes are there, until all
 * ``n`` are, or the word stops moving for ``stall`` seconds, or ``limit`` seconds pass. With
 * ``l`` (memory without coherence; NULL on coherent memory) each look at the word and each copy
 * is preceded by its invalidate (sites FOLLOW_POLL, FOLLOW_READ; a NULL ``dst`` only waits, its
 * reader invalidates the body whole). Called without the GIL unless ``l`` calls a simulator's
 * hooks. Returns 0; -1 when the word is garbage (outside [*done, n]: ``*seen``); -2 with an
 * error set (a hook raised). */
static inline int follow_loop(cxlrpc_lines *l, char *dst, const char *src, uint64_t *word, uint64_t n,
                              uint64_t *done, double stall, double limit, uint64_t *seen) {
    double end = follow_clock() + limit;
    double since = 0.0; /* when progress last moved (0: look at the clock next time) */
    for (unsigned spins = 1; *done < n; spins++) {
        if (l != NULL && lines_invalidate(l, CXLRPC_SITE_FOLLOW_POLL, word, 8, CXLRPC_FULL_FENCE) < 0)
            return -2;
        uint64_t p = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (p > n || p < *done) { /* a writer only counts up to the length: garbage */
            *seen = p;
            return -1;
        }
        if (p > *done) {
            if (dst != NULL) {
                if (l != NULL && lines_invalidate(l, CXLRPC_SITE_FOLLOW_READ, src + *done, (size_t)(p - *done),
                                                  CXLRPC_FULL_FENCE) < 0)
                    return -2;
                copy_span(dst + *done, src + *done, (size_t)(p - *done));
            }
            *done = p;
            since = 0.0;
            continue;
        }
        if ((spins & 255) == 0) {
            double now = follow_clock();
            if (now > end)
                break;
            if (since == 0.0)
                since = now;
            else if (now - since > stall)
                break;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    return 0;
}

#endif
