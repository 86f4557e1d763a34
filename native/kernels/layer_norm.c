/* LayerNorm over the last dimension, fused with the uint8 quantization of its output
 * (cpu_opt.backends.native_norm): the norm in front of an int8 linear layer of a transformer.
 *
 * layer_norm_u8_f32: for each of `rows` rows of `cols` contiguous floats (row r at x + r * x_stride),
 *     n = (x - mean) / sqrt(var + eps) * gamma + beta      (var: the biased variance, as torch's)
 *   y[r, :] = n                                              (when y != NULL; rows contiguous)
 *   q[r, :] = clamp(rint(n * inv_scale) + zero_point, 0, qmax)   (when q != NULL; rows contiguous)
 * gamma / beta may be NULL (1 / 0). The rounding is the one torch.quantize_per_tensor uses on x86
 * (FBGEMM's: the product by the reciprocal of the scale, rounded half to even, then the zero point),
 * so q agrees with quantize_per_tensor(layer_norm(x)) except where the two norms differ in the
 * last float bit at a rounding boundary. One pass gathers a row's sum and sum of squares about its
 * first element (per-lane float partials over at most 4096 elements, reduced in double), a second
 * writes the outputs. Rows are split across threads in contiguous blocks; a small input runs on one
 * thread (its cost is below OpenMP's). */

#ifndef CO_LN_DEFINED
#define CO_LN_DEFINED
#define CO_LN_PARALLEL_MIN 65536   /* elements below which one thread runs the whole tensor */
#endif

/* sum(x - shift) and sum((x - shift)^2) of a row, shift = its first element (exact for a constant
 * row; the shift keeps a large common offset from cancelling into the variance). Per-lane float
 * partials over chunks of at most 4096 elements, reduced in double. */
static void KFN(co_row_moments)(const float *x, int64_t n, double *sum_out, double *sq_out) {
    const float shift = x[0];
    double sum = 0.0, sq = 0.0;
    int64_t i = 0;
#if defined(CO_VARIANT_AVX512)
    __m512 s = _mm512_set1_ps(shift);
    while (i + 16 <= n) {
        int64_t end = i + 4096 < n ? i + 4096 : n;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        for (; i + 32 <= end; i += 32) {
            __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(x + i), s), d1 = _mm512_sub_ps(_mm512_loadu_ps(x + i + 16), s);
            a0 = _mm512_add_ps(a0, d0); a1 = _mm512_add_ps(a1, d1);
            b0 = _mm512_fmadd_ps(d0, d0, b0); b1 = _mm512_fmadd_ps(d1, d1, b1);
        }
        for (; i + 16 <= end; i += 16) {
            __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(x + i), s);
            a0 = _mm512_add_ps(a0, d0); b0 = _mm512_fmadd_ps(d0, d0, b0);
        }
        float la[16], lb[16];
        _mm512_storeu_ps(la, _mm512_add_ps(a0, a1));
        _mm512_storeu_ps(lb, _mm512_add_ps(b0, b1));
        for (int l = 0; l < 16; l++) { sum += la[l]; sq += lb[l]; }
    }
#elif defined(CO_VARIANT_AVX2)
    __m256 s = _mm256_set1_ps(shift);
    while (i + 8 <= n) {
        int64_t end = i + 4096 < n ? i + 4096 : n;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        for (; i + 16 <= end; i += 16) {
            __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + i), s), d1 = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), s);
            a0 = _mm256_add_ps(a0, d0); a1 = _mm256_add_ps(a1, d1);
            b0 = _mm256_fmadd_ps(d0, d0, b0); b1 = _mm256_fmadd_ps(d1, d1, b1);
        }
        for (; i + 8 <= end; i += 8) {
            __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + i), s);
            a0 = _mm256_add_ps(a0, d0); b0 = _mm256_fmadd_ps(d0, d0, b0);
        }
        float la[8], lb[8];
        _mm256_storeu_ps(la, _mm256_add_ps(a0, a1));
        _mm256_storeu_ps(lb, _mm256_add_ps(b0, b1));
        for (int l = 0; l < 8; l++) { sum += la[l]; sq += lb[l]; }
    }
#endif
    for (; i < n; i++) {
        double d = (double)x[i] - (double)shift;
        sum += d;
        sq += d * d;
    }
    *sum_out = sum;
    *sq_out = sq;
}

static inline uint8_t KFN(co_quant_u8)(float v, float inv_scale, int32_t zero_point, int32_t qmax) {
    float t = v * inv_scale;
    t = t < 1e9f ? t : 1e9f;   /* inside int32 before the conversion (the result saturates anyway) */
    t = t > -1e9f ? t : -1e9f;
    int32_t r = (int32_t)nearbyintf(t) + zero_point;
    return (uint8_t)(r < 0 ? 0 : (r > qmax ? qmax : r));
}

static void KFN(co_ln_rows)(const float *x, int64_t x_stride, int64_t lo, int64_t hi, int64_t cols,
                            const float *gamma, const float *beta, double eps, float *y, uint8_t *q,
                            float inv_scale, int32_t zero_point, int32_t qmax) {
    for (int64_t r = lo; r < hi; r++) {
        const float *xr = x + r * x_stride;
        double sum, sq;
        KFN(co_row_moments)(xr, cols, &sum, &sq);
        double dmean = sum / (double)cols;
        double var = sq / (double)cols - dmean * dmean;
        var = var > 0.0 ? var : 0.0;
        /* (x - x0) is exact for x near x0, and dm is small: the mean is never rounded at x's magnitude */
        const float x0 = xr[0], dm = (float)dmean;
        float rstd = (float)(1.0 / sqrt(var + eps));
        float *yr = y ? y + r * cols : NULL;
        uint8_t *qr = q ? q + r * cols : NULL;
        int64_t i = 0;
#if defined(CO_VARIANT_AVX512)
        __m512 x0v = _mm512_set1_ps(x0), mv = _mm512_set1_ps(dm), rv = _mm512_set1_ps(rstd), isv = _mm512_set1_ps(inv_scale);
        __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
        __m512 clip = _mm512_set1_ps(1e9f), nclip = _mm512_set1_ps(-1e9f);
        __m512i zpv = _mm512_set1_epi32(zero_point), lo_v = _mm512_setzero_si512(), hi_v = _mm512_set1_epi32(qmax);
        for (; i + 16 <= cols; i += 16) {
            __m512 g = gamma ? _mm512_loadu_ps(gamma + i) : one, bb = beta ? _mm512_loadu_ps(beta + i) : zero;
            __m512 n = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + i), x0v), mv), _mm512_mul_ps(rv, g), bb);
            if (yr)
                _mm512_storeu_ps(yr + i, n);
            if (qr) {
                __m512 t = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(n, isv), clip), nclip);
                __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(t), zpv);   /* half to even (MXCSR default) */
                v = _mm512_min_epi32(_mm512_max_epi32(v, lo_v), hi_v);
                _mm_storeu_si128((__m128i *)(qr + i), _mm512_cvtusepi32_epi8(v));
            }
        }
#elif defined(CO_VARIANT_AVX2)
        __m256 x0v = _mm256_set1_ps(x0), mv = _mm256_set1_ps(dm), rv = _mm256_set1_ps(rstd), isv = _mm256_set1_ps(inv_scale);
        __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        __m256 clip = _mm256_set1_ps(1e9f), nclip = _mm256_set1_ps(-1e9f);
        __m256i zpv = _mm256_set1_epi32(zero_point), lo_v = _mm256_setzero_si256(), hi_v = _mm256_set1_epi32(qmax);
        for (; i + 8 <= cols; i += 8) {
            __m256 g = gamma ? _mm256_loadu_ps(gamma + i) : one, bb = beta ? _mm256_loadu_ps(beta + i) : zero;
            __m256 n = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + i), x0v), mv), _mm256_mul_ps(rv, g), bb);
            if (yr)
                _mm256_storeu_ps(yr + i, n);
            if (qr) {
                __m256 t = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(n, isv), clip), nclip);
                __m256i v = _mm256_add_epi32(_mm256_cvtps_epi32(t), zpv);   /* half to even (MXCSR default) */
                v = _mm256_min_epi32(_mm256_max_epi32(v, lo_v), hi_v);
                /* 8 int32 in [0, 255] -> 8 bytes */
                __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                _mm_storel_epi64((__m128i *)(qr + i), _mm_packus_epi16(w, w));
            }
        }
#endif
        for (; i < cols; i++) {
            float g = gamma ? gamma[i] : 1.f, bb = beta ? beta[i] : 0.f;
            float n = fmaf((xr[i] - x0) - dm, rstd * g, bb);
            if (yr)
                yr[i] = n;
            if (qr)
                qr[i] = KFN(co_quant_u8)(n, inv_scale, zero_point, qmax);
        }
    }
}

int64_t KFN(layer_norm_u8_f32)(const float *x, int64_t rows, int64_t cols, int64_t x_stride, const float *gamma,
                               const float *beta, double eps, float *y, uint8_t *q, float inv_scale,
                               int32_t zero_point, int32_t qmax, int nthreads) {
    if (rows < 0 || cols < 0 || nthreads < 1 || x_stride < cols || !(eps >= 0.0) || qmax < 0 || qmax > 255 ||
        zero_point < 0 || zero_point > qmax || !(inv_scale > 0.f) || isinf(inv_scale))
        return CO_ERR_BAD_ARGUMENT;
    if (rows == 0 || cols == 0)
        return CO_OK;
    if (x == NULL || (y == NULL && q == NULL))
        return CO_ERR_BAD_ARGUMENT;
    int64_t total = rows * cols;
    int nt = total < CO_LN_PARALLEL_MIN ? 1 : (nthreads < rows ? nthreads : (int)rows);
    if (nt <= 1) {
        KFN(co_ln_rows)(x, x_stride, 0, rows, cols, gamma, beta, eps, y, q, inv_scale, zero_point, qmax);
        return CO_OK;
    }
    int64_t chunk = (rows + nt - 1) / nt;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int t = 0; t < nt; t++) {
        int64_t lo = (int64_t)t * chunk, hi = lo + chunk < rows ? lo + chunk : rows;
        if (lo < hi)
            KFN(co_ln_rows)(x, x_stride, lo, hi, cols, gamma, beta, eps, y, q, inv_scale, zero_point, qmax);
    }
    return CO_OK;
}
