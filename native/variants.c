/* The single translation unit of cpu_opt._native: every kernel file, once per ISA variant.
 * See native/README.md. */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <math.h>
#include <float.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <errno.h>
#include <sys/mman.h>
#endif

#define CO_CAT_(a, b) a##b
#define CO_CAT(a, b) CO_CAT_(a, b)
#define KFN(name) CO_CAT(name, KSUFFIX)

/* ---- base: compiler default ISA ---- */
#define KSUFFIX _base
#define CO_VARIANT_BASE 1
#include "api.h"
#include "kernels/all.inc"
#undef CO_VARIANT_BASE
#undef KSUFFIX

#if defined(__x86_64__)
/* ---- avx2 ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define KSUFFIX _avx2
#define CO_VARIANT_AVX2 1
#include "api.h"
#include "kernels/all.inc"
#undef CO_VARIANT_AVX2
#undef KSUFFIX
#pragma GCC pop_options

/* ---- avx512 ---- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#define KSUFFIX _avx512
#define CO_VARIANT_AVX512 1
#include "api.h"
#include "kernels/all.inc"
#undef CO_VARIANT_AVX512
#undef KSUFFIX
#pragma GCC pop_options
#endif

/* Ask for transparent huge pages on the 2 MiB-aligned interior of a fresh buffer, before its
 * first touch. Large tensors come from glibc's mmap and are faulted in 4 KiB at a time on first
 * write; for a kernel that writes a 25-50 MB output that costs as much as the work itself
 * (measured: spmm max 100k x 64 with its winner index 80 -> 50 ms). Returns 0 when advised,
 * 1 when the buffer is too small or the platform has no madvise, -errno on failure. */
int co_advise_hugepages(void *p, int64_t nbytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    const uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    const uintptr_t hi = ((uintptr_t)p + (uintptr_t)nbytes) & ~(huge - 1);
    if (nbytes <= 0 || hi <= lo) return 1;
    return madvise((void *)lo, hi - lo, MADV_HUGEPAGE) == 0 ? 0 : -errno;
#else
    (void)p;
    (void)nbytes;
    return 1;
#endif
}

/* A 64-bit fingerprint of nbytes of memory, for caches that must notice any change to a tensor's
 * contents (in-place writes that bump no version counter: .data, numpy views, reused buffers).
 * Not cryptographic: a multiply-xorshift mix of 8-byte words, four lanes for instruction-level
 * parallelism, over fixed 1 MiB chunks hashed in parallel and combined in order, so the result does
 * not depend on the thread count. About memory bandwidth. Returns 0, or CO_ERR_BAD_ARGUMENT. */
static inline uint64_t co_mix64(uint64_t x)
{
    x ^= x >> 32;
    x *= 0xd6e8feb86659fd93ULL;
    x ^= x >> 32;
    x *= 0xd6e8feb86659fd93ULL;
    x ^= x >> 32;
    return x;
}

static uint64_t co_fingerprint_chunk(const unsigned char *p, int64_t n, uint64_t seed)
{
    uint64_t a = seed ^ 0x9e3779b97f4a7c15ULL, b = seed + 0x632be59bd9b4e019ULL,
             c = seed * 0xbf58476d1ce4e5b9ULL + 1, d = ~seed;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, p + i, 32);
        a = (a ^ w[0]) * 0x9fb21c651e98df25ULL;
        b = (b ^ w[1]) * 0xc2b2ae3d27d4eb4fULL;
        c = (c ^ w[2]) * 0x165667b19e3779f9ULL;
        d = (d ^ w[3]) * 0x27d4eb2f165667c5ULL;
        a ^= a >> 29;
        b ^= b >> 31;
        c ^= c >> 27;
        d ^= d >> 33;
    }
    uint64_t tail = 0;
    int64_t left = n - i;
    if (left > 0) {
        unsigned char buf[32] = {0};
        memcpy(buf, p + i, (size_t)left);
        for (int k = 0; k < 4; ++k) {
            uint64_t w;
            memcpy(&w, buf + 8 * k, 8);
            tail = co_mix64(tail ^ w ^ (uint64_t)k);
        }
    }
    return co_mix64(a ^ co_mix64(b ^ co_mix64(c ^ co_mix64(d ^ tail ^ (uint64_t)n))));
}

int64_t co_fingerprint(const void *data, int64_t nbytes, int64_t nthreads, uint64_t *out)
{
    if (nbytes < 0 || out == NULL || (nbytes > 0 && data == NULL)) return CO_ERR_BAD_ARGUMENT;
    const int64_t chunk = (int64_t)1 << 20;
    const int64_t nchunks = nbytes ? (nbytes + chunk - 1) / chunk : 0;
    if (nchunks <= 1) {
        *out = co_mix64(co_fingerprint_chunk((const unsigned char *)data, nbytes, 0) ^ (uint64_t)nbytes);
        return CO_OK;
    }
    uint64_t *parts = (uint64_t *)malloc((size_t)nchunks * sizeof(uint64_t));
    if (parts == NULL) return CO_ERR_BAD_ARGUMENT;
    int nt = nthreads > 0 ? (int)nthreads : 1;
    (void)nt;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
    for (int64_t k = 0; k < nchunks; ++k) {
        int64_t off = k * chunk;
        int64_t len = nbytes - off < chunk ? nbytes - off : chunk;
        parts[k] = co_fingerprint_chunk((const unsigned char *)data + off, len, (uint64_t)k);
    }
    uint64_t h = (uint64_t)nbytes;
    for (int64_t k = 0; k < nchunks; ++k) h = co_mix64(h ^ parts[k]) + (uint64_t)k;
    free(parts);
    *out = h;
    return CO_OK;
}

/* Which variants were compiled, for cpu_opt.native to check. */
const char *co_native_variants(void)
{
#if defined(__x86_64__)
    return "base,avx2,avx512";
#else
    return "base";
#endif
}

/* Frees a buffer a kernel malloc'ed and handed to the caller (neighbor_sample's outputs). */
void co_free(void *p)
{
    free(p);
}
