/* A followed body's writing (cxlrpc.heap), shared by cxlrpc._flush's publish_copy and the native
 * caller's followed requests (cxlrpc._dispatch): one place for the protocol a reader follows. */
#ifndef CXLRPC_FOLLOW_H
#define CXLRPC_FOLLOW_H

#include <stdint.h>
#include <string.h>

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

#endif
