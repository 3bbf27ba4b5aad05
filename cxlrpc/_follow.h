/* A followed body's writing and reading (cxlrpc.heap), shared by cxlrpc._flush (publish_copy,
 * follow_copy, Follower) and the native caller's followed requests and replies (cxlrpc._dispatch):
 * one place for the protocol. */
#ifndef CXLRPC_FOLLOW_H
#define CXLRPC_FOLLOW_H

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_copy.h"

/* Copy ``n`` bytes of ``src`` into ``dst`` a ``chunk`` at a time, storing the count copied so
 * far into ``*progress`` (release) after each: a reader copies them out meanwhile. Needs no GIL. */
static inline void follow_publish(char *dst, const char *src, size_t n, size_t chunk, uint64_t *progress) {
    for (size_t done = 0; done < n;) {
        size_t step = n - done < chunk ? n - done : chunk;
        copy_span(dst + done, src + done, step);
        done += step;
        __atomic_store_n(progress, (uint64_t)done, __ATOMIC_RELEASE);
    }
}

static inline double follow_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Copy ``src[*done:]`` into ``dst`` as the progress word says its bytes are there, until all
 * ``n`` are, or the word stops moving for ``stall`` seconds, or ``limit`` seconds pass. Called
 * without the GIL. Returns 0, or -1 when the word is garbage (outside [*done, n]: ``*seen``). */
static inline int follow_loop(char *dst, const char *src, uint64_t *word, uint64_t n, uint64_t *done,
                              double stall, double limit, uint64_t *seen) {
    double end = follow_clock() + limit;
    double since = 0.0; /* when progress last moved (0: look at the clock next time) */
    for (unsigned spins = 1; *done < n; spins++) {
        uint64_t p = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (p > n || p < *done) { /* a writer only counts up to the length: garbage */
            *seen = p;
            return -1;
        }
        if (p > *done) {
            if (dst != NULL)
                copy_span(dst + *done, src + *done, (size_t)(p - *done));
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
