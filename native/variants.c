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

/* Which variants were compiled, for cpu_opt.native to check. */
const char *co_native_variants(void)
{
#if defined(__x86_64__)
    return "base,avx2,avx512";
#else
    return "base";
#endif
}
