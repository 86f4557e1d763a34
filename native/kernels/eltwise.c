/* Elementwise kernels for the inference graph (cpu_opt.backends.native_eltwise).
 *
 * gelu_erf_f32: y[i] = 0.5 x (1 + erf(x / sqrt 2)), torch's GELU (approximate="none"), in place
 * when y == x. erf is the rational approximation Eigen and XLA use for float (x P(x^2) / Q(x^2) on
 * [-4, 4], +-1 outside, a few ulp from the true value); the base variant calls libm's erff.
 * gelu_tanh_f32: torch's GELU with approximate="tanh", 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x +
 * 0.044715 x^3), computed as x / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh u) = sigmoid(2u))
 * with Cephes' exp (range reduction by ln 2, a degree-5 polynomial; the argument clamped to
 * +-88: past that the result is x, or 0 as torch's); the base variant calls libm's tanhf.
 * Both split across threads in contiguous chunks of whole vectors. */

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
/* the numerator p and denominator q of the erf approximation at x2 = x * x, for any vector width
 * (FMA, SET1: that width's fmadd and set1 intrinsics): erf(x) = x p / q on [-4, 4] */
#define CO_GELU_PQ(x2, p, q, FMA, SET1)                                                                            \
    do {                                                                                                       \
        p = FMA(x2, SET1(CO_GELU_A13), SET1(CO_GELU_A11));                                                     \
        p = FMA(x2, p, SET1(CO_GELU_A9));                                                                      \
        p = FMA(x2, p, SET1(CO_GELU_A7));                                                                      \
        p = FMA(x2, p, SET1(CO_GELU_A5));                                                                      \
        p = FMA(x2, p, SET1(CO_GELU_A3));                                                                      \
        p = FMA(x2, p, SET1(CO_GELU_A1));                                                                      \
        q = FMA(x2, SET1(CO_GELU_B8), SET1(CO_GELU_B6));                                                       \
        q = FMA(x2, q, SET1(CO_GELU_B4));                                                                      \
        q = FMA(x2, q, SET1(CO_GELU_B2));                                                                      \
        q = FMA(x2, q, SET1(CO_GELU_B0));                                                                      \
    } while (0)
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
    __m256 x2 = _mm256_mul_ps(x, x), p, q;
    CO_GELU_PQ(x2, p, q, _mm256_fmadd_ps, _mm256_set1_ps);
    __m256 erf = _mm256_div_ps(_mm256_mul_ps(x, p), q);
    __m256 half_v = _mm256_mul_ps(v, _mm256_set1_ps(0.5f));
    return _mm256_fmadd_ps(half_v, erf, half_v);  /* 0.5 v + 0.5 v erf */
}
#endif

#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
/* the sum of v's 8 lanes (gemv.c, f32_attention.c) */
static inline float KFN(co_hsum8)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x in [-88, 88] (clamped), Cephes' expf */
static inline __m256 KFN(co_exp8)(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-88.f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 KFN(co_gelu_tanh8)(__m256 v) {
    /* -2u = -2 sqrt(2 / pi) (v + 0.044715 v^3) = v (c1 + c3 v^2) */
    const __m256 v2 = _mm256_mul_ps(v, v);
    const __m256 m2u = _mm256_mul_ps(v, _mm256_fmadd_ps(v2, _mm256_set1_ps(-0.0713548162726f),
                                                        _mm256_set1_ps(-1.5957691216057f)));
    const __m256 y = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), KFN(co_exp8)(m2u)));
    /* past the clamp (v below about -10) the value is 0 (x / inf); torch's formula gives NaN at -inf
     * (-inf * 0) and passes NaN: so do these */
    const __m256 zero_out = _mm256_cmp_ps(m2u, _mm256_set1_ps(88.f), _CMP_GT_OQ);
    const __m256 minus_inf = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm256_or_ps(_mm256_andnot_ps(zero_out, y), _mm256_and_ps(minus_inf, _mm256_set1_ps(NAN)));
}
#endif

static inline float KFN(co_gelu_scalar)(float v, int tanh_form) {
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    if (tanh_form) { /* the vector formula on one lane, so a tensor's tail agrees with its body */
        float out[8];
        _mm256_storeu_ps(out, KFN(co_gelu_tanh8)(_mm256_set1_ps(v)));
        return out[0];
    }
#else
    if (tanh_form) return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
#endif
    return 0.5f * v * (1.f + KFN(co_erf_scalar)(v * CO_SQRT1_2));
}

static void KFN(co_gelu_range)(const float *x, float *y, int64_t lo, int64_t hi, int tanh_form) {
    int64_t i = lo;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    if (tanh_form)
        for (; i + 16 <= hi; i += 16) {
            __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
            _mm256_storeu_ps(y + i, KFN(co_gelu_tanh8)(a));
            _mm256_storeu_ps(y + i + 8, KFN(co_gelu_tanh8)(b));
        }
    else
        for (; i + 16 <= hi; i += 16) {
            __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
            _mm256_storeu_ps(y + i, KFN(co_gelu8)(a));
            _mm256_storeu_ps(y + i + 8, KFN(co_gelu8)(b));
        }
#endif
    for (; i < hi; i++) y[i] = KFN(co_gelu_scalar)(x[i], tanh_form);
}

static int64_t KFN(co_gelu_f32)(const float *x, float *y, int64_t n, int nthreads, int tanh_form) {
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
        KFN(co_gelu_range)(x, y, 0, n, tanh_form);
        return CO_OK;
    }
    int64_t chunk = ((n + nt - 1) / nt + 15) / 16 * 16;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int t = 0; t < nt; t++) {
        int64_t lo = (int64_t)t * chunk, hi = lo + chunk < n ? lo + chunk : n;
        if (lo < hi)
            KFN(co_gelu_range)(x, y, lo, hi, tanh_form);
    }
    return CO_OK;
}

int64_t KFN(gelu_erf_f32)(const float *x, float *y, int64_t n, int nthreads) {
    return KFN(co_gelu_f32)(x, y, n, nthreads, 0);
}

int64_t KFN(gelu_tanh_f32)(const float *x, float *y, int64_t n, int nthreads) {
    return KFN(co_gelu_f32)(x, y, n, nthreads, 1);
}

/* log_softmax over the last dimension of a row-major (rows x dim) float32 tensor, dim 1..15, and
 * its backward: the narrow class dimension of a classifier's loss (cross_entropy over a few
 * classes), where torch 2.13's kernels run 12-14x slower than at 16 (100k x 8, Zen 4, 1 thread:
 * 12.1 ms forward, 6.4 ms backward; 100k x 16: 0.95 and 0.41).
 * log_softmax_narrow_f32: out = (x - max) - log(sum exp(x - max)), torch's formula and order; out
 * may be x. log_softmax_backward_narrow_f32: gin = g - exp(out) * sum(g), torch's; gin may be g.
 * A row whose values are not all finite takes the scalar loop with libm's expf / logf and IEEE
 * rules (NaN and +inf rows give NaN, as torch's); the vector rows use Cephes' exp (a few ulp of
 * expf). Rows split across threads in contiguous chunks. */
static void KFN(co_log_softmax_row_scalar)(const float *x, float *o, int64_t dim) {
    float m = x[0];
    for (int64_t j = 1; j < dim; ++j) m = (x[j] > m || x[j] != x[j]) ? x[j] : m; /* NaN propagates */
    if (m != m) { for (int64_t j = 0; j < dim; ++j) o[j] = m; return; }
    float s = 0.f;
    for (int64_t j = 0; j < dim; ++j) s += expf(x[j] - m);
    const float ls = logf(s);
    for (int64_t j = 0; j < dim; ++j) o[j] = (x[j] - m) - ls;
}

#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
/* the lanes of a row of dim columns in one or two 8-float vectors (f0, f1: all ones where a column
 * is; want: their 16-bit movemask) and the first row of [., r1) whose vectors would reach past r1 */
typedef struct {
    __m256 f0, f1;
    int want;
    int64_t stop;
} KFN(co_row_lanes);

static inline KFN(co_row_lanes) KFN(co_lanes_of)(int64_t dim, int64_t r1) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    KFN(co_row_lanes) L;
    L.f0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(dim < 8 ? dim : 8)), lane));
    L.f1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(dim > 8 ? dim - 8 : 0)), lane));
    L.want = _mm256_movemask_ps(L.f0) | (_mm256_movemask_ps(L.f1) << 8);
    L.stop = r1 - ((dim <= 8 ? 8 : 16) + dim - 1) / dim;
    return L;
}

/* the max of v's 8 lanes, in every lane */
static inline __m256 KFN(co_hmax8)(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
}
#endif

/* Rows [r0, r1) of log_softmax. The vector rows read and write whole 8-float vectors (one for up to
 * 8 columns, two for 9..15): the lanes past the row belong to the next row (or rows), read as they
 * are and written back unchanged, so out may be x; the last rows of the range, whose vectors would
 * reach past it (another thread's rows, or the end of the tensor), take the scalar loop. Masked
 * loads and stores instead cost 1.7-3.5x (100k x 8, Zen 4). A row whose result has a NaN lane (a
 * NaN or +inf in it, or all -inf) is recomputed by the scalar loop with IEEE rules. */
static void KFN(co_log_softmax_rows)(const float *x, float *out, int64_t r0, int64_t r1, int64_t dim) {
    int64_t r = r0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    const KFN(co_row_lanes) L = KFN(co_lanes_of)(dim, r1);
    const __m256 f0 = L.f0, f1 = L.f1;
    const int want = L.want;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (; r < L.stop; ++r) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const __m256 ra = _mm256_loadu_ps(xr);
        const __m256 a = _mm256_blendv_ps(ninf, ra, f0);
        if (dim <= 8) {
            const __m256 da = _mm256_sub_ps(a, KFN(co_hmax8)(a));
            const __m256 oa = _mm256_sub_ps(da, _mm256_set1_ps(logf(KFN(co_hsum8)(_mm256_and_ps(KFN(co_exp8)(da), f0)))));
            if (_mm256_movemask_ps(_mm256_cmp_ps(oa, oa, _CMP_UNORD_Q)) & want) {
                KFN(co_log_softmax_row_scalar)(xr, o, dim);
                continue;
            }
            _mm256_storeu_ps(o, _mm256_blendv_ps(ra, oa, f0));
        } else {
            const __m256 rb = _mm256_loadu_ps(xr + 8);
            const __m256 b = _mm256_blendv_ps(ninf, rb, f1);
            const __m256 mx = KFN(co_hmax8)(_mm256_max_ps(a, b));
            const __m256 da = _mm256_sub_ps(a, mx), db = _mm256_sub_ps(b, mx);
            const __m256 sum = _mm256_add_ps(_mm256_and_ps(KFN(co_exp8)(da), f0), _mm256_and_ps(KFN(co_exp8)(db), f1));
            const __m256 ls = _mm256_set1_ps(logf(KFN(co_hsum8)(sum)));
            const __m256 oa = _mm256_sub_ps(da, ls), ob = _mm256_sub_ps(db, ls);
            const int nan = _mm256_movemask_ps(_mm256_cmp_ps(oa, oa, _CMP_UNORD_Q)) |
                            (_mm256_movemask_ps(_mm256_cmp_ps(ob, ob, _CMP_UNORD_Q)) << 8);
            if (nan & want) {
                KFN(co_log_softmax_row_scalar)(xr, o, dim);
                continue;
            }
            _mm256_storeu_ps(o, _mm256_blendv_ps(ra, oa, f0));
            _mm256_storeu_ps(o + 8, _mm256_blendv_ps(rb, ob, f1));
        }
    }
#endif
    for (; r < r1; ++r) KFN(co_log_softmax_row_scalar)(x + r * dim, out + r * dim, dim);
}

static void KFN(co_log_softmax_backward_row_scalar)(const float *g, const float *out, float *gin, int64_t dim) {
    float s = 0.f;
    for (int64_t j = 0; j < dim; ++j) s += g[j];
    for (int64_t j = 0; j < dim; ++j) gin[j] = g[j] - expf(out[j]) * s;
}

/* Rows [r0, r1) of the backward, whole vectors as the forward (gin may be g). Cephes' exp is within
 * a few ulp inside +-87; a row with an output outside (a probability under 1e-38, -inf, NaN) takes
 * the scalar row with libm's expf. */
static void KFN(co_log_softmax_backward_rows)(const float *g, const float *out, float *gin, int64_t r0, int64_t r1,
                                               int64_t dim) {
    int64_t r = r0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    const KFN(co_row_lanes) L = KFN(co_lanes_of)(dim, r1);
    const __m256 f0 = L.f0, f1 = L.f1;
    const int want = L.want;
    const __m256 lo = _mm256_set1_ps(-87.f), hi = _mm256_set1_ps(87.f);
    for (; r < L.stop; ++r) {
        const float *gr = g + r * dim, *orow = out + r * dim;
        float *o = gin + r * dim;
        const __m256 ga = _mm256_loadu_ps(gr), oa = _mm256_loadu_ps(orow);
        const __m256 ob = dim > 8 ? _mm256_loadu_ps(orow + 8) : _mm256_setzero_ps();
        const int ok = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(oa, lo, _CMP_GE_OQ), _mm256_cmp_ps(oa, hi, _CMP_LE_OQ))) |
                       (_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(ob, lo, _CMP_GE_OQ), _mm256_cmp_ps(ob, hi, _CMP_LE_OQ))) << 8);
        if ((ok & want) != want) {
            KFN(co_log_softmax_backward_row_scalar)(gr, orow, o, dim);
            continue;
        }
        if (dim <= 8) {
            const __m256 s = _mm256_set1_ps(KFN(co_hsum8)(_mm256_and_ps(ga, f0)));
            _mm256_storeu_ps(o, _mm256_blendv_ps(ga, _mm256_fnmadd_ps(KFN(co_exp8)(oa), s, ga), f0));
        } else {
            const __m256 gb = _mm256_loadu_ps(gr + 8);
            const __m256 s = _mm256_set1_ps(KFN(co_hsum8)(_mm256_add_ps(_mm256_and_ps(ga, f0), _mm256_and_ps(gb, f1))));
            _mm256_storeu_ps(o, _mm256_blendv_ps(ga, _mm256_fnmadd_ps(KFN(co_exp8)(oa), s, ga), f0));
            _mm256_storeu_ps(o + 8, _mm256_blendv_ps(gb, _mm256_fnmadd_ps(KFN(co_exp8)(ob), s, gb), f1));
        }
    }
#endif
    for (; r < r1; ++r) KFN(co_log_softmax_backward_row_scalar)(g + r * dim, out + r * dim, gin + r * dim, dim);
}

#define CO_LOG_SOFTMAX_MAX_DIM 15
/* the rows of [r0, r1) a thread takes, rows split in contiguous chunks of at least 2048 */
#define CO_ROWS_PARALLEL(rows, nthreads, BODY)                                                       \
    do {                                                                                         \
        int64_t pieces_ = ((rows) + 2047) / 2048;                                                \
        int nt_ = (nthreads) < pieces_ ? (nthreads) : (int)pieces_;                              \
        if (nt_ <= 1) { const int64_t r0 = 0, r1 = (rows); BODY; break; }                        \
        const int64_t chunk_ = ((rows) + nt_ - 1) / nt_;                                         \
        _Pragma("omp parallel for num_threads(nt_) schedule(static, 1)")                         \
        for (int t_ = 0; t_ < nt_; t_++) {                                                       \
            const int64_t r0 = (int64_t)t_ * chunk_, r1 = r0 + chunk_ < (rows) ? r0 + chunk_ : (rows); \
            if (r0 < r1) BODY;                                                                   \
        }                                                                                        \
    } while (0)

int64_t KFN(log_softmax_narrow_f32)(const float *x, float *out, int64_t rows, int64_t dim, int nthreads) {
    if (rows < 0 || dim < 1 || dim > CO_LOG_SOFTMAX_MAX_DIM || nthreads < 1) return CO_ERR_BAD_ARGUMENT;
    if (rows == 0) return CO_OK;
    if (!x || !out) return CO_ERR_BAD_ARGUMENT;
    CO_ROWS_PARALLEL(rows, nthreads, KFN(co_log_softmax_rows)(x, out, r0, r1, dim));
    return CO_OK;
}

int64_t KFN(log_softmax_backward_narrow_f32)(const float *g, const float *out, float *gin, int64_t rows, int64_t dim,
                                             int nthreads) {
    if (rows < 0 || dim < 1 || dim > CO_LOG_SOFTMAX_MAX_DIM || nthreads < 1) return CO_ERR_BAD_ARGUMENT;
    if (rows == 0) return CO_OK;
    if (!g || !out || !gin) return CO_ERR_BAD_ARGUMENT;
    CO_ROWS_PARALLEL(rows, nthreads, KFN(co_log_softmax_backward_rows)(g, out, gin, r0, r1, dim));
    return CO_OK;
}
#undef CO_ROWS_PARALLEL
#undef CO_LOG_SOFTMAX_MAX_DIM
