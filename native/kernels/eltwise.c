/* Elementwise kernels for the inference graph (cpu_opt.backends.native_eltwise).
 *
 * gelu_erf_f32: y[i] = 0.5 x (1 + erf(x / sqrt 2)), torch's GELU (approximate="none"), in place
 * when y == x. erf is the rational approximation Eigen and XLA use for float (x P(x^2) / Q(x^2) on
 * [-4, 4], +-1 outside, a few ulp from the true value); the base variant calls libm's erff. Split
 * across threads in contiguous chunks of whole vectors. */

#ifndef CO_ELTWISE_DEFINED
#define CO_ELTWISE_DEFINED
#define CO_GELU_A1 -1.60960333262415e-02f
#define CO_GELU_A3 -2.95459980854025e-03f
#define CO_GELU_A5 -7.34990630326855e-04f
#define CO_GELU_A7 -5.69250639462346e-05f
#define CO_GELU_A9 -2.10102402082508e-06f
#define CO_GELU_A11 2.77068142495902e-08f
#define CO_GELU_A13 -2.72614225801306e-10f
#define CO_GELU_B0 -1.42647390514189e-02f
#define CO_GELU_B2 -7.37332916720468e-03f
#define CO_GELU_B4 -1.68282697438203e-03f
#define CO_GELU_B6 -2.13374055278905e-04f
#define CO_GELU_B8 -1.45660718464996e-05f
#define CO_SQRT1_2 0.70710678118654752f
#endif

static inline float KFN(co_erf_scalar)(float x) {
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    /* the same approximation as the vector loop, so a tensor's tail agrees with its body */
    x = x > 4.f ? 4.f : (x < -4.f ? -4.f : x);
    float x2 = x * x;
    float p = fmaf(x2, CO_GELU_A13, CO_GELU_A11);
    p = fmaf(x2, p, CO_GELU_A9); p = fmaf(x2, p, CO_GELU_A7); p = fmaf(x2, p, CO_GELU_A5);
    p = fmaf(x2, p, CO_GELU_A3); p = fmaf(x2, p, CO_GELU_A1);
    float q = fmaf(x2, CO_GELU_B8, CO_GELU_B6);
    q = fmaf(x2, q, CO_GELU_B4); q = fmaf(x2, q, CO_GELU_B2); q = fmaf(x2, q, CO_GELU_B0);
    return x * p / q;
#else
    return erff(x);
#endif
}

#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
static inline __m256 KFN(co_gelu8)(__m256 v) {
    __m256 x = _mm256_mul_ps(v, _mm256_set1_ps(CO_SQRT1_2));
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(4.f)), _mm256_set1_ps(-4.f));
    __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_fmadd_ps(x2, _mm256_set1_ps(CO_GELU_A13), _mm256_set1_ps(CO_GELU_A11));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(CO_GELU_A9));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(CO_GELU_A7));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(CO_GELU_A5));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(CO_GELU_A3));
    p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(CO_GELU_A1));
    __m256 q = _mm256_fmadd_ps(x2, _mm256_set1_ps(CO_GELU_B8), _mm256_set1_ps(CO_GELU_B6));
    q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(CO_GELU_B4));
    q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(CO_GELU_B2));
    q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(CO_GELU_B0));
    __m256 erf = _mm256_div_ps(_mm256_mul_ps(x, p), q);
    __m256 half_v = _mm256_mul_ps(v, _mm256_set1_ps(0.5f));
    return _mm256_fmadd_ps(half_v, erf, half_v);  /* 0.5 v + 0.5 v erf */
}
#endif

static void KFN(co_gelu_range)(const float *x, float *y, int64_t lo, int64_t hi) {
    int64_t i = lo;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    for (; i + 16 <= hi; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        _mm256_storeu_ps(y + i, KFN(co_gelu8)(a));
        _mm256_storeu_ps(y + i + 8, KFN(co_gelu8)(b));
    }
#endif
    for (; i < hi; i++) {
        float v = x[i];
        y[i] = 0.5f * v * (1.f + KFN(co_erf_scalar)(v * CO_SQRT1_2));
    }
}

int64_t KFN(gelu_erf_f32)(const float *x, float *y, int64_t n, int nthreads) {
    if (n < 0 || nthreads < 1)
        return CO_ERR_BAD_ARGUMENT;
    if (n == 0)
        return CO_OK;
    if (x == NULL || y == NULL)
        return CO_ERR_BAD_ARGUMENT;
    /* chunks of whole 16-float blocks; no more threads than 32 Ki-element pieces */
    int64_t pieces = (n + 32767) / 32768;
    int nt = nthreads < pieces ? nthreads : (int)pieces;
    if (nt <= 1) {
        KFN(co_gelu_range)(x, y, 0, n);
        return CO_OK;
    }
    int64_t chunk = ((n + nt - 1) / nt + 15) / 16 * 16;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int t = 0; t < nt; t++) {
        int64_t lo = (int64_t)t * chunk, hi = lo + chunk < n ? lo + chunk : n;
        if (lo < hi)
            KFN(co_gelu_range)(x, y, lo, hi);
    }
    return CO_OK;
}
