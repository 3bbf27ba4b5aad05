/* copy_span: memcpy for the transport's bodies, without the case where glibc's `rep movsb`
 * crawls. On AMD Zen (this project's test machine: glibc 2.36, an EPYC VM) a copy of 4 KiB
 * up to glibc's non-temporal threshold whose destination lies 1-63 bytes past its source
 * modulo a 4 KiB page runs up to 12x slower: 1 MiB in 64 KiB memcpy calls 350-590 us against
 * 30-45. A bytes object's data (page offset 48 when malloc maps it) copied to a followed
 * extent's body (offset 64) is exactly that case. There the copy is a plain SSE2 loop
 * (27-29 us per MiB here at every skew); everywhere else, memcpy. */
#ifndef CXLRPC_COPY_H
#define CXLRPC_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* Copy ``n`` bytes from ``src`` to ``dst``; the ranges may overlap (memmove then). */
static inline void copy_span(void *dst, const void *src, size_t n) {
#if defined(__x86_64__)
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    size_t skew = (size_t)((d - s) & 4095);
    if (n >= 4096 && skew != 0 && skew < 64 && (d >= s + n || s >= d + n)) {
        char *to = (char *)dst;
        const char *from = (const char *)src;
        for (; n >= 64; to += 64, from += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)from);
            __m128i b = _mm_loadu_si128((const __m128i *)(from + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(from + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(from + 48));
            _mm_storeu_si128((__m128i *)to, a);
            _mm_storeu_si128((__m128i *)(to + 16), b);
            _mm_storeu_si128((__m128i *)(to + 32), c);
            _mm_storeu_si128((__m128i *)(to + 48), e);
        }
        memcpy(to, from, n);
        return;
    }
#endif
    memmove(dst, src, n);
}

/* A new bytes object holding ``n`` bytes of ``src``, copied by copy_span (Python.h first). */
#ifdef Py_PYTHON_H
static inline PyObject *bytes_copy(const void *src, Py_ssize_t n) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out != NULL)
        copy_span(PyBytes_AS_STRING(out), src, (size_t)n);
    return out;
}
#endif

#endif
