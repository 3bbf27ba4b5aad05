/* Streaming (non-temporal) stores, shared by cxlrpc._flush (stream_copy, stream_bytes) and
 * kvservice._block (a put's copy into a pool block in flush mode).
 *
 * stream_span(dst, src, n): copy with streaming stores from the first 16-byte aligned byte of
 * dst on, 64 bytes at a time, plain stores at either end; no fence.
 * copy_streaming(dst, src, n): the same, then sfence: the bytes are in memory, and in no
 * cache of this CPU, before any later store (the one that publishes them). */
#ifndef CXLRPC_STREAM_H
#define CXLRPC_STREAM_H

#include <emmintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline void stream_span(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;  /* streaming stores need 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}

static inline void copy_streaming(char *dst, const char *src, size_t n) {
    stream_span(dst, src, n);
    _mm_sfence();  /* streaming stores are weakly ordered: in memory before any later store */
}

#endif
