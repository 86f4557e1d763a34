/* int8 linear layers on AMX tiles (cpu_opt.backends.amx_linear.AmxLinear):
 *
 *   v[m, n] = scale[n] * sum_k x[m, k] w[n, k] + bias[n]  (+ residual[m, n]),  y = post(v)
 *
 * x: uint8, M rows of K bytes at x + m * ldx; w: int8, packed by the caller into 16-column panels
 * (panel p, k-quad q, column c, byte j at wp[p * 16 K + q * 64 + c * 4 + j] = w[16 p + c, 4 q + j],
 * zero past N and past K, which is padded to Kp, a multiple of 64): a B tile of the panel is 16
 * k-quads, 1 KB contiguous. When K is not a multiple of 64 x is copied, zero padded, first. The
 * input zero point is folded into bias by the caller (bias[n] - scale[n] * zp * sum_k w[n, k]).
 * residual (res_kind 0 none, 1 float32, 2 uint8 read as res_scale (u - res_zp), 3 int8 read as
 * res_scale s) at residual + m * ldr; post 0 none, 1 relu, 2 gelu (erf), 3 gelu (tanh), the same
 * formulas as eltwise.c's kernels, 4 silu, 5 hardswish; the output (out_kind 0 float32, 1 bfloat16 rounded to nearest
 * even, 2 uint8 = saturate(round_half_even(y / out_scale) + out_zp)) at out + m * ldo.
 *
 * Each thread takes a contiguous share of the panels, so each streams its own part of the weights
 * once, and walks them two panels (32 columns) at a time over blocks of up to 32 rows: a 2 x 2 block
 * of int32 tiles over K (TDPBUSD), stored and finished by the epilogue above. Rows are taken in
 * chunks of about 512 KB of x, so a long input stays in L2 while the chunk's weights pass. Rows past
 * the last whole 16 are copied, zero padded, into a buffer (a tile load reads 16 rows). Measured on a
 * Xeon with AMX (2026-12-07): software prefetch of the next pair of panels (into L1 or L2, one or two
 * pairs ahead), transparent huge pages for the weights, and 32-row chunks (weights outer) changed
 * nothing beyond the noise on BERT-base's 48 GEMMs with cold weights; prefetching the weights of the
 * layer that runs next into L2 while this one computes made int8 BERT-base slower (each thread's whole
 * share: 16.5 -> 19.0 ms; 512 / 256 KB of it: +9% / +3%; 128 KB: within 1%, noise), so none is here.
 *
 * Lengths are in elements of each operand's type and checked before anything is read or written.
 * Only in the avx512 variant, on a CPU with AMX-INT8 whose kernel grants the tile data state
 * (amx_attention.c's co_amx_permission); elsewhere CO_ERR_UNSUPPORTED_AMX. */

#define CO_AMXQ_UNUSED()                                                                                           \
    do {                                                                                                           \
        (void)x; (void)x_len; (void)M; (void)K; (void)ldx; (void)wp; (void)wp_len; (void)N; (void)scale;          \
        (void)bias; (void)residual; (void)res_len; (void)ldr; (void)res_kind; (void)res_scale; (void)res_zp;       \
        (void)post; (void)out; (void)out_len; (void)ldo; (void)out_kind; (void)out_scale; (void)out_zp;          \
        (void)nthreads;                                                                                            \
    } while (0)

#if defined(CO_VARIANT_AVX512)
/* tiles 0-3 = the int32 products of the row blocks a0 / a1 (a1 NULL: one) and the panels b0 / b1
 * (b1 NULL: one) over K, stored to c (32 x 32) */
__attribute__((target("amx-tile,amx-int8")))
static inline void KFN(co_amxq_block)(const uint8_t *a0, const uint8_t *a1, int64_t lda, const int8_t *b0,
                                      const int8_t *b1, int64_t K, int32_t *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 64) {
        _tile_loadd(4, a0 + k, lda);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_dpbusd(0, 4, 6);
        if (b1) {
            _tile_loadd(7, b1 + k * 16, 64);
            _tile_dpbusd(1, 4, 7);
        }
        if (a1) {
            _tile_loadd(5, a1 + k, lda);
            _tile_dpbusd(2, 5, 6);
            if (b1)
                _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
}

/* eltwise.c's erf GELU 16 lanes wide, its division as a reciprocal estimate refined by one Newton step
 * (relative error about 2^-23 instead of 0.5 ulp: a division per 16 values is what the epilogue of a
 * FFN GEMM would otherwise wait on) */
static inline __m512 KFN(co_amxq_gelu16)(__m512 v) {
    __m512 x = _mm512_mul_ps(v, _mm512_set1_ps(CO_SQRT1_2));
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(4.f)), _mm512_set1_ps(-4.f));
    const __m512 x2 = _mm512_mul_ps(x, x);
    __m512 p, q;
    CO_GELU_PQ(x2, p, q, _mm512_fmadd_ps, _mm512_set1_ps);
    __m512 r = _mm512_rcp14_ps(q);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(q, r, _mm512_set1_ps(2.f)));
    const __m512 erf = _mm512_mul_ps(_mm512_mul_ps(x, p), r);
    const __m512 half_v = _mm512_mul_ps(v, _mm512_set1_ps(0.5f));
    return _mm512_fmadd_ps(half_v, erf, half_v);
}

static inline __m512 KFN(co_amxq_post)(__m512 v, int post) {
    if (post == 1)
        return _mm512_max_ps(v, _mm512_setzero_ps());
    if (post == 2)
        return KFN(co_amxq_gelu16)(v);
    if (post == 4) {   /* silu: v / (1 + exp(-v)), eltwise.c's exp (clamped to +-88: v below -88 gives -0) */
        __m256 lo = _mm512_castps512_ps256(v), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        lo = _mm256_div_ps(lo, _mm256_add_ps(one, KFN(co_exp8)(_mm256_sub_ps(zero, lo))));
        hi = _mm256_div_ps(hi, _mm256_add_ps(one, KFN(co_exp8)(_mm256_sub_ps(zero, hi))));
        return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
    }
    if (post == 5) {   /* hardswish: v min(max(v + 3, 0), 6) / 6 */
        __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, _mm512_set1_ps(3.f)), _mm512_setzero_ps()),
                                 _mm512_set1_ps(6.f));
        return _mm512_mul_ps(v, _mm512_mul_ps(t, _mm512_set1_ps(1.f / 6.f)));
    }
    if (post == 3) {
        __m256 lo = _mm512_castps512_ps256(v), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        lo = KFN(co_gelu_tanh8)(lo);
        hi = KFN(co_gelu_tanh8)(hi);
        return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
    }
    return v;
}

/* rows x (up to 32) columns of c (row stride 32) -> the output's rows m0.., columns n0.. */
static void KFN(co_amxq_epilogue)(const int32_t *c, int64_t rows, int64_t m0, int64_t n0, int64_t ncols,
                                  const float *scale, const float *bias, const void *residual, int64_t ldr,
                                  int res_kind, float res_scale, int32_t res_zp, int post, void *out,
                                  int64_t ldo, int out_kind, float inv_out_scale, int32_t out_zp) {
    for (int64_t h = 0; h < ncols; h += 16) {
        const int64_t w = ncols - h < 16 ? ncols - h : 16;
        const __mmask16 mk = (__mmask16)((1u << w) - 1u);
        const int64_t n = n0 + h;
        const __m512 sc = _mm512_maskz_loadu_ps(mk, scale + n), bi = _mm512_maskz_loadu_ps(mk, bias + n);
        const __m512 rs = _mm512_set1_ps(res_scale), rz = _mm512_set1_ps((float)res_zp);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t m = m0 + r;
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(c + r * 32 + h))), sc, bi);
            if (res_kind == 1) {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, (const float *)residual + m * ldr + n));
            } else if (res_kind == 2) {
                __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mk, (const uint8_t *)residual + m * ldr + n)));
                v = _mm512_fmadd_ps(_mm512_sub_ps(u, rz), rs, v);
            } else if (res_kind == 3) {
                __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, (const int8_t *)residual + m * ldr + n)));
                v = _mm512_fmadd_ps(s, rs, v);
            }
            v = KFN(co_amxq_post)(v, post);
            if (out_kind == 0) {
                _mm512_mask_storeu_ps((float *)out + m * ldo + n, mk, v);
            } else if (out_kind == 1) {
                _mm256_mask_storeu_epi16((uint16_t *)out + m * ldo + n, mk, KFN(co_to_bf16x16)(v));
            } else {
                /* clamped first: a value past int32 would convert to INT_MIN */
                __m512 f = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv_out_scale)),
                                                       _mm512_set1_ps(-512.f)), _mm512_set1_ps(512.f));
                __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(f), _mm512_set1_epi32(out_zp));
                q = _mm512_max_epi32(q, _mm512_setzero_si512());
                _mm_mask_storeu_epi8((uint8_t *)out + m * ldo + n, mk, _mm512_cvtusepi32_epi8(q));
            }
        }
    }
}
#endif

int64_t KFN(amx_qlinear_u8s8)(const uint8_t *x, int64_t x_len, int64_t M, int64_t K, int64_t ldx, const int8_t *wp,
                              int64_t wp_len, int64_t N, const float *scale, const float *bias, const void *residual,
                              int64_t res_len, int64_t ldr, int res_kind, float res_scale, int32_t res_zp, int post,
                              void *out, int64_t out_len, int64_t ldo, int out_kind, float out_scale, int32_t out_zp,
                              int nthreads) {
#if !defined(CO_VARIANT_AVX512)
    CO_AMXQ_UNUSED();
    return CO_ERR_UNSUPPORTED_AMX;
#else
    if (M < 0 || K <= 0 || N <= 0 || nthreads < 1 || res_kind < 0 || res_kind > 3 || post < 0 || post > 5 || out_kind < 0 || out_kind > 2 || (out_kind == 2 && !(out_scale > 0.f)) ||
        (out_kind == 2 && (out_zp < 0 || out_zp > 255)) || !(res_scale == res_scale))
        return CO_ERR_BAD_ARGUMENT;
    if (M == 0)
        return CO_OK;
    if (x == NULL || wp == NULL || scale == NULL || bias == NULL || out == NULL || ldx < K || ldo < N ||
        (res_kind != 0 && (residual == NULL || ldr < N)))
        return CO_ERR_BAD_ARGUMENT;
    const int64_t panels = (N + 15) / 16, Kp = KFN(co_round_up)(K, 64);
    if ((M - 1) * ldx + K > x_len || panels * 16 * Kp > wp_len || (M - 1) * ldo + N > out_len ||
        (res_kind != 0 && (M - 1) * ldr + N > res_len))
        return CO_ERR_INDEX_OUT_OF_RANGE;
    if (!co_amx_permission())
        return CO_ERR_UNSUPPORTED_AMX;
    /* the rows past the last whole 16, zero padded to 16 rows of Kp; all of x so when K is not a multiple
     * of 64 (then every row is read from the copy) */
    const int64_t whole = K == Kp ? M / 16 * 16 : 0, tail = M - whole;
    uint8_t *pad = NULL;
    if (tail) {
        const int64_t prow = (tail + 15) / 16 * 16;
        pad = (uint8_t *)aligned_alloc(64, (size_t)(prow * Kp + 63) / 64 * 64);
        if (pad == NULL)
            return CO_ERR_NO_MEMORY;
        memset(pad, 0, (size_t)(prow * Kp));
        for (int64_t r = 0; r < tail; r++)
            memcpy(pad + r * Kp, x + (whole + r) * ldx, (size_t)K);
    }
    int64_t chunk = (512 * 1024 / Kp) / 32 * 32;
    if (chunk < 32)
        chunk = 32;
    const float inv_out_scale = out_kind == 2 ? 1.f / out_scale : 1.f;
    int nt = panels < nthreads ? (int)panels : nthreads;
#pragma omp parallel num_threads(nt)
    {
        int tid = 0, T = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        const int64_t p_lo = panels * tid / T, p_hi = panels * (tid + 1) / T;
        int32_t c[32 * 32] __attribute__((aligned(64)));
        if (p_lo < p_hi) {
            KFN(co_amx_config)();
            for (int64_t m_lo = 0; m_lo < M; m_lo += chunk) {
                const int64_t m_hi = m_lo + chunk < M ? m_lo + chunk : M;
                for (int64_t p = p_lo; p < p_hi; p += 2) {
                    const int64_t np = p + 1 < p_hi ? 2 : 1;
                    const int8_t *b0 = wp + p * 16 * Kp, *b1 = np == 2 ? b0 + 16 * Kp : NULL;
                    const int64_t n0 = p * 16, ncols = (N - n0 < 16 * np) ? N - n0 : 16 * np;
                    for (int64_t m0 = m_lo; m0 < m_hi; m0 += 32) {
                        const int64_t rows = m_hi - m0 < 32 ? m_hi - m0 : 32;
                        const uint8_t *a0 = m0 < whole ? x + m0 * ldx : pad + (m0 - whole) * Kp;
                        int64_t lda0 = m0 < whole ? ldx : Kp;
                        const uint8_t *a1 = NULL;
                        if (rows > 16)
                            a1 = m0 + 16 < whole ? x + (m0 + 16) * ldx : pad + (m0 + 16 - whole) * Kp;
                        /* a block that straddles the padded tail: a0 from x, a1 from the pad */
                        int64_t lda1 = m0 + 16 < whole ? ldx : Kp;
                        if (a1 != NULL && lda1 != lda0) {
                            KFN(co_amxq_block)(a0, NULL, lda0, b0, b1, Kp, c);
                            KFN(co_amxq_epilogue)(c, 16, m0, n0, ncols, scale, bias, residual, ldr, res_kind, res_scale,
                                                  res_zp, post, out, ldo, out_kind, inv_out_scale, out_zp);
                            KFN(co_amxq_block)(a1, NULL, lda1, b0, b1, Kp, c);
                            KFN(co_amxq_epilogue)(c, rows - 16, m0 + 16, n0, ncols, scale, bias, residual, ldr,
                                                  res_kind, res_scale, res_zp, post, out, ldo, out_kind, inv_out_scale,
                                                  out_zp);
                        } else {
                            KFN(co_amxq_block)(a0, a1, lda0, b0, b1, Kp, c);
                            KFN(co_amxq_epilogue)(c, rows, m0, n0, ncols, scale, bias, residual, ldr, res_kind,
                                                  res_scale, res_zp, post, out, ldo, out_kind, inv_out_scale, out_zp);
                        }
                    }
                }
            }
            KFN(co_amx_release)();
        }
    }
    free(pad);
    return CO_OK;
#endif
}
