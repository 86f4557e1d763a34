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

/* Which variants were compiled, for cpu_opt.native to check. */
const char *co_native_variants(void)
{
#if defined(__x86_64__)
    return "base,avx2,avx512";
#else
    return "base";
#endif
}
