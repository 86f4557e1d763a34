/* gemv_f32: y = x W^T + b for a few activation rows (M <= CO_GEMV_MAX_ROWS): the decode step of a
 * language model, where every weight byte is read once per token and the time is the memory
 * stream, not the arithmetic (cpu_opt.backends.native_linear).
 *
 *   x: M x K, row-major; y: M x N, row-major; bias: N floats or NULL.
 *   w_kn = 1: W is K x N, row-major (GPT-2's Conv1D, an addmm weight): the K rows are split into
 *             one contiguous block per thread, each thread sums its block into a private M x N
 *             partial, and the partials (plus the bias) are added up after a barrier.
 *   w_kn = 0: W is N x K, row-major (nn.Linear): the N rows are split into one contiguous block per
 *             thread; each output is a dot product over a contiguous row.
 * Either way every thread reads one contiguous stretch of W, the pattern hardware prefetchers
 * follow best. Sizes are checked before any memory is touched; CO_ERR_NO_MEMORY if the partials
 * cannot be allocated (nothing written then). */

#ifndef CO_GEMV_DEFINED
#define CO_GEMV_DEFINED
#define CO_GEMV_MAX_ROWS 8
#endif

/* acc[m, :] += sum over k in [k0, k1) of x[m, k] * W[k, :], W K x N */
static void KFN(co_gemv_kn_block)(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                                  int64_t k0, int64_t k1, float *acc) {
    for (int64_t m = 0; m < M; ++m) {
        float *restrict a = acc + m * N;
        const float *xm = x + m * K;
        int64_t k = k0;
        for (; k + 4 <= k1; k += 4) {
            const float x0 = xm[k], x1 = xm[k + 1], x2 = xm[k + 2], x3 = xm[k + 3];
            const float *w0 = w + k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
            int64_t n = 0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
            const __m256 v0 = _mm256_set1_ps(x0), v1 = _mm256_set1_ps(x1), v2 = _mm256_set1_ps(x2),
                         v3 = _mm256_set1_ps(x3);
            for (; n + 8 <= N; n += 8) {
                __m256 s = _mm256_loadu_ps(a + n);
                s = _mm256_fmadd_ps(v0, _mm256_loadu_ps(w0 + n), s);
                s = _mm256_fmadd_ps(v1, _mm256_loadu_ps(w1 + n), s);
                s = _mm256_fmadd_ps(v2, _mm256_loadu_ps(w2 + n), s);
                s = _mm256_fmadd_ps(v3, _mm256_loadu_ps(w3 + n), s);
                _mm256_storeu_ps(a + n, s);
            }
#endif
            for (; n < N; ++n) a[n] += x0 * w0[n] + x1 * w1[n] + x2 * w2[n] + x3 * w3[n];
        }
        for (; k < k1; ++k) {
            const float xk = xm[k];
            const float *wk = w + k * N;
            for (int64_t n = 0; n < N; ++n) a[n] += xk * wk[n];
        }
    }
}

/* y[m, n] for n in [n0, n1) = dot(x[m, :], W[n, :]) (+ bias[n]), W N x K. Four rows of W at a
 * time (four streams in flight, each row read once for all M rows of x, which stay in L1). */
static void KFN(co_gemv_nk_block)(const float *x, int64_t M, int64_t K, const float *w, const float *bias,
                                  int64_t n0, int64_t n1, float *y, int64_t N) {
    int64_t n = n0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    for (; n + 4 <= n1; n += 4) {
        const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        for (int64_t m = 0; m < M; ++m) {
            const float *xm = x + m * K;
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(),
                   s3 = _mm256_setzero_ps();
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {
                const __m256 xv = _mm256_loadu_ps(xm + k);
                s0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + k), s0);
                s1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1 + k), s1);
                s2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w2 + k), s2);
                s3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w3 + k), s3);
            }
            float r0 = KFN(co_hsum8)(s0), r1 = KFN(co_hsum8)(s1), r2 = KFN(co_hsum8)(s2), r3 = KFN(co_hsum8)(s3);
            for (; k < K; ++k) {
                const float xk = xm[k];
                r0 += xk * w0[k]; r1 += xk * w1[k]; r2 += xk * w2[k]; r3 += xk * w3[k];
            }
            float *ym = y + m * N + n;
            ym[0] = r0 + (bias ? bias[n] : 0.f);
            ym[1] = r1 + (bias ? bias[n + 1] : 0.f);
            ym[2] = r2 + (bias ? bias[n + 2] : 0.f);
            ym[3] = r3 + (bias ? bias[n + 3] : 0.f);
        }
    }
#endif
    for (; n < n1; ++n) {
        const float *wn = w + n * K;
        for (int64_t m = 0; m < M; ++m) {
            const float *xm = x + m * K;
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += xm[k] * wn[k];
            y[m * N + n] = s + (bias ? bias[n] : 0.f);
        }
    }
}

int64_t KFN(gemv_f32)(const float *x, int64_t M, int64_t K, const float *w, int64_t N, int w_kn,
                      const float *bias, float *y, int nthreads) {
    if (M < 1 || M > CO_GEMV_MAX_ROWS || K < 1 || N < 1 || nthreads < 1 || (w_kn != 0 && w_kn != 1))
        return CO_ERR_BAD_ARGUMENT;
    if (!x || !w || !y)
        return CO_ERR_BAD_ARGUMENT;
    /* a thread per 256 KiB of weights at least: below that the fork costs more than it saves */
    const int64_t per = (int64_t)1 << 16;
    int64_t want = (K * N + per - 1) / per;
    int nt = want < nthreads ? (int)want : nthreads;
    if (nt < 1) nt = 1;
    if (!w_kn) {
        if (nt > N) nt = (int)N;
#pragma omp parallel for num_threads(nt) schedule(static, 1) if (nt > 1)
        for (int t = 0; t < nt; ++t) {
            const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
            KFN(co_gemv_nk_block)(x, M, K, w, bias, n0, n1, y, N);
        }
        return CO_OK;
    }
    if (nt > K) nt = (int)K;
    float *part = NULL;
    if (nt > 1) {
        part = (float *)calloc((size_t)(nt - 1) * (size_t)(M * N), sizeof(float));
        if (!part) return CO_ERR_NO_MEMORY;
    }
    /* thread 0 sums straight into y (zeroed first); the others into their partials */
    memset(y, 0, (size_t)(M * N) * sizeof(float));
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = nt > 1 ? omp_get_thread_num() : 0;
        const int n_t = nt > 1 ? omp_get_num_threads() : 1;
        const int64_t k0 = K * t / n_t, k1 = K * (t + 1) / n_t;
        float *acc = t == 0 ? y : part + (size_t)(t - 1) * (size_t)(M * N);
        KFN(co_gemv_kn_block)(x, M, K, w, N, k0, k1, acc);
#pragma omp barrier
        /* reduce: each thread adds the partials (and the bias) into its share of y's columns */
        const int64_t c0 = N * t / n_t, c1 = N * (t + 1) / n_t;
        for (int64_t m = 0; m < M; ++m) {
            float *ym = y + m * N;
            for (int u = 1; u < n_t; ++u) {
                const float *pm = part + (size_t)(u - 1) * (size_t)(M * N) + m * N;
                for (int64_t n = c0; n < c1; ++n) ym[n] += pm[n];
            }
            if (bias)
                for (int64_t n = c0; n < c1; ++n) ym[n] += bias[n];
        }
    }
    free(part);
    return CO_OK;
}
