/* Tall-skinny GEMMs: one dimension huge (the rows: a graph's nodes, 10^4-10^7), the others small
 * (the features: 1..CO_TS_MAX_DIM). The dense layers of GNN training (cpu_opt.gnn): the forward
 * and input-gradient GEMMs C = A B (+ bias) (+ C), and the weight gradient C = A^T B over all rows.
 * General GEMM libraries lose half their speed on these shapes (K = 64: the packing of A costs as
 * much as the arithmetic; N1 x N2 = 64 x 64 with K = 10^5: one small output, a reduction split
 * across threads): torch's oneDNN runs 100000 x 64 x 64 at ~64 GFLOP/s on 2 Zen 3 cores, MKL's mm
 * the weight gradient at ~60. Here the small operand is packed once per call into 16-column panels
 * that stay in L1, and A is streamed through once, 6 rows at a time, into a 6 x 16 register tile
 * (AVX-512: 12 rows into a 12 x 16 tile, a zmm per row; 12 rows into a 12 x 8 tile when N <= 8).
 * The weight gradient reads A and B where they are, a block of rows at a time (co_ts_tn_rows), each
 * 6 x 16 (AVX-512: 12 x 16) tile of the output a pass over the block.
 *
 *   ts_gemm_nn_f32: C (M x N) = A (M x K) B' (+ bias[N]) (+ C when accumulate), B' = B (K x N,
 *                   b_nk = 0: a gradient times a weight) or B^T (B N x K, b_nk = 1: nn.Linear's
 *                   weight). Rows split across threads in contiguous blocks.
 *   ts_gemm_nn_ep_f32: ts_gemm_nn_f32 without accumulate, with an epilogue: relu (C = max(0, .)) and/or
 *                   keep (C = . where keep > 0, else 0; keep M x N like C): a Linear + ReLU's forward, and
 *                   the input gradient of a Linear whose input came out of a ReLU (keep: that output).
 *   ts_gemm_nn2_f32: C (M x N) = A1 W1^T + A2 W2^T (+ bias), W1 N x K1, W2 N x K2: two linear
 *                   layers summed (SAGEConv's lin_l(aggr) + lin_r(x)) in one pass over C;
 *                   ts_gemm_nn2_ep_f32 the same with relu (a ReLU after the layer, in the epilogue).
 *   ts_gemm_tn_f32: C (N1 x N2) = A^T B, A M x N1, B M x N2 (a weight gradient g^T x), and
 *                   optionally colsum[N1] = sum over rows of A (the bias gradient) in the same pass.
 *                   ts_gemm_tn_ep_f32 with keep (M x N1, like A): A taken as 0 where keep <= 0 (not
 *                   NaN), torch's threshold_backward(A, keep, 0): the weight gradient of a layer
 *                   followed by a ReLU, from the gradient of the ReLU's output and that output, each
 *                   block of rows masked once in L1 (no pass writing a masked copy of A to memory).
 *                   ts_gemm_tn2_ep_f32: C1 = A^T B1 and C2 = A^T B2 in one pass over A (and keep):
 *                   SAGEConv's two weight gradients g^T aggr and g^T x, each block of A masked and
 *                   summed once for both.
 *                   Rows split across threads, each into a private partial; partials summed after
 *                   a barrier, so the result does not depend on timing (it does on the thread count).
 * All matrices row-major and dense. Sizes are checked before any memory is touched: CO_ERR_BAD_ARGUMENT
 * for M < 0, K/N/N1/N2 outside [1, CO_TS_MAX_DIM], nthreads < 1 or a NULL pointer; CO_ERR_NO_MEMORY
 * when the packed panels or partials cannot be allocated (nothing written then). */

#ifndef CO_TSGEMM_DEFINED
#define CO_TSGEMM_DEFINED
#define CO_TS_MAX_DIM 1024
#define CO_TS_NR 16         /* panel width: 2 AVX2 vectors */
#define CO_TS_MR 6          /* rows per register tile */
#define CO_TS_MR8 12        /* rows per register tile when N <= 8 (one vector of columns) */
/* AVX2: prefetch A's rows this many tiles ahead. The tile reads its rows 256+ bytes apart, k by k,
 * which the hardware prefetchers follow badly: Zen 3, 100k x 64 -> 8 at 1 thread 5.2 -> 2.7-3.5 ms,
 * -> 64 13.5 -> 11 ms. Not measured on AVX-512 CPUs, so not done there. */
#ifndef CO_TS_PF
#define CO_TS_PF 1
#endif
#ifndef CO_TS_TN_BLOCK
#define CO_TS_TN_BLOCK 128  /* at most this many rows of A and B per pass of the weight-gradient kernel */
#endif
#endif

/* Rows of A and B per pass of the weight-gradient kernel: the most (a power of 2, 16 to
 * CO_TS_TN_BLOCK) whose rows of both fit in 32 KiB, so that the block's 4-11 tile passes read it from
 * L1: Zen 3 (AVX2), 100k rows, 1 thread, 64 x 64 11.0 -> 9.6 ms (64 rows), 8 x 64 2.6-2.9 -> 2.1-2.3
 * (64), 64 x 128 22.0 -> 19.5 (32), against 128 rows that stay in L2. The AVX-512 variant takes the
 * same blocks: its tiles add the same products in the same order as the AVX2 ones, and with the same
 * blocks the sums are equal bit for bit (tests/gnn/test_tsgemm.py). */
static inline int64_t KFN(co_ts_tn_rows)(int64_t N1, int64_t N2) {
    int64_t rows = CO_TS_TN_BLOCK;
    while (rows > 16 && rows * (N1 + N2) * (int64_t)sizeof(float) > 32768) rows /= 2;
    return rows;
}

/* rows per register tile for N > 8, per variant: AVX2 holds a 6 x 16 tile in 12 ymm registers;
 * AVX-512 a 12 x 16 tile in 12 zmm registers (one per row: the panel's 16 columns are one vector) */
#undef CO_TS_MRV
#if defined(CO_VARIANT_AVX512)
#define CO_TS_MRV 12
#else
#define CO_TS_MRV CO_TS_MR
#endif

/* B' packed into ceil(N / 16) panels of K x 16 floats, zero beyond column N */
static void KFN(co_ts_pack)(const float *b, int64_t K, int64_t N, int b_nk, float *bp) {
    const int64_t np = (N + CO_TS_NR - 1) / CO_TS_NR;
    for (int64_t p = 0; p < np; ++p) {
        float *dst = bp + p * K * CO_TS_NR;
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < CO_TS_NR; ++j) {
                const int64_t n = p * CO_TS_NR + j;
                dst[k * CO_TS_NR + j] = n < N ? (b_nk ? b[n * K + k] : b[k * N + n]) : 0.f;
            }
    }
}

/* n values of a where keep > 0 (or NaN), 0 elsewhere: torch's threshold_backward(a, keep, 0), the
 * gradient through a ReLU whose output was keep (a flat loop the variant's flags vectorize) */
static inline void KFN(co_ts_keep)(const float *a, const float *keep, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; ++i) dst[i] = keep[i] <= 0.f ? 0.f : a[i];
}

#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)

static inline __m256i KFN(co_ts_mask)(int64_t n) { /* lanes [0, n) on, n in [0, 8] */
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx);
}

/* the epilogue's options on 8 columns: relu (max(0, v): NaN and -0 pass as torch's relu passes them)
 * and keep (v where keep > 0 or NaN, else 0: torch's threshold_backward(v, keep, 0), a ReLU's input
 * gradient from its output); kp = NULL: no keep. m: the lanes to read when !full */
static inline __attribute__((always_inline)) __m256 KFN(co_ts_ep8)(__m256 v, int relu, const float *kp, __m256i m,
                                                                   int full) {
    if (relu) v = _mm256_max_ps(_mm256_setzero_ps(), v);
    if (kp) {
        const __m256 kv = full ? _mm256_loadu_ps(kp) : _mm256_maskload_ps(kp, m);
        v = _mm256_and_ps(v, _mm256_cmp_ps(kv, _mm256_setzero_ps(), _CMP_NLE_UQ));
    }
    return v;
}

#if defined(CO_VARIANT_AVX512)

/* c[r] += a[r * rs + k * ks] * bp[k * bs + 0:16] over k in [0, K), rows r in [0, R): the rank-1
 * updates of a 12 x 16 register tile, one zmm per row (the same products, added in the same order
 * per output element, as the AVX2 tile's two ymm halves: the results are the same bit for bit) */
static inline __attribute__((always_inline)) void
KFN(co_ts_fma)(const int R, const float *a, int64_t rs, int64_t ks, const float *bp, int64_t bs, int64_t K,
               __m512 *c) {
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; ++k) {
        const __m512 b = _mm512_loadu_ps(bp + k * bs);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * rs + k * ks]), b, c[r]);
    }
}

/* co_ts_ep8 on 16 columns (m: the lanes read) */
static inline __attribute__((always_inline)) __m512 KFN(co_ts_ep16)(__m512 v, int relu, const float *kp, __mmask16 m) {
    if (relu) v = _mm512_max_ps(_mm512_setzero_ps(), v);
    if (kp) v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(m, kp), _mm512_setzero_ps(), _CMP_NLE_UQ), v);
    return v;
}

/* rows [0, R) of the R x 16 tile c[:, n0 : n0 + ncols] from A rows a (lda = K) and one panel bp;
 * columns past ncols neither read nor written (k-masks); kp: keep's rows beside c's (co_ts_ep8) */
static inline __attribute__((always_inline)) void
KFN(co_ts_tile)(const int R, const float *a, int64_t K, const float *bp, const float *a2, int64_t K2,
                const float *bp2, const float *bias, int acc, const float *kp, int relu, float *c, int64_t ldc,
                int64_t ncols) {
    __m512 c0[CO_TS_MRV];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) c0[r] = _mm512_setzero_ps();
    KFN(co_ts_fma)(R, a, K, 1, bp, CO_TS_NR, K, c0);
    if (a2) KFN(co_ts_fma)(R, a2, K2, 1, bp2, CO_TS_NR, K2, c0); /* the second product, into the same registers */
    const __mmask16 m = ncols >= CO_TS_NR ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1u);
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(m, bias) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
        float *cr = c + r * ldc;
        __m512 v = _mm512_add_ps(c0[r], bi);
        if (acc == 1) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, cr));
        v = KFN(co_ts_ep16)(v, relu, kp ? kp + r * ldc : NULL, m);
        if (acc == 2 && ncols == CO_TS_NR) /* streaming stores: C is written once and larger than the caches */
            _mm512_stream_ps(cr, v);
        else
            _mm512_mask_storeu_ps(cr, m, v);
    }
}

/* c0/c1[r] += a[r * rs + k] * (panel p0 | panel p1)[k, 0:16] over k in [0, K): two panels (32 columns)
 * at once, 24 accumulators, two vector loads and 12 broadcasts per 24 multiply-adds instead of one
 * load and 12 broadcasts per 12 */
static inline __attribute__((always_inline)) void
KFN(co_ts_fma2)(const float *a, int64_t K, const float *p0, const float *p1, __m512 *c0, __m512 *c1) {
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; ++k) {
        const __m512 b0 = _mm512_load_ps(p0 + k * CO_TS_NR), b1 = _mm512_load_ps(p1 + k * CO_TS_NR);
#pragma GCC unroll 12
        for (int r = 0; r < CO_TS_MRV; ++r) {
            const __m512 av = _mm512_set1_ps(a[r * K + k]);
            c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
            c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
        }
    }
}

/* a whole 12-row tile over columns [n0, n0 + ncols), 16 < ncols <= 32: panels bp and bp + K * 16
 * (the second masked past ncols); the same products in the same order as two co_ts_tile calls */
static inline __attribute__((always_inline)) void
KFN(co_ts_tile2)(const float *a, int64_t K, const float *bp, const float *a2, int64_t K2, const float *bp2,
                 const float *bias, int acc, const float *kp, int relu, float *c, int64_t ldc, int64_t ncols) {
    __m512 c0[CO_TS_MRV], c1[CO_TS_MRV];
#pragma GCC unroll 12
    for (int r = 0; r < CO_TS_MRV; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
    KFN(co_ts_fma2)(a, K, bp, bp + K * CO_TS_NR, c0, c1);
    if (a2) KFN(co_ts_fma2)(a2, K2, bp2, bp2 + K2 * CO_TS_NR, c0, c1);
    const int64_t n1 = ncols - CO_TS_NR;
    const __mmask16 m = n1 >= CO_TS_NR ? (__mmask16)0xFFFF : (__mmask16)((1u << n1) - 1u);
    const __m512 bi0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 bi1 = bias ? _mm512_maskz_loadu_ps(m, bias + CO_TS_NR) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < CO_TS_MRV; ++r) {
        float *cr = c + r * ldc;
        __m512 v0 = _mm512_add_ps(c0[r], bi0), v1 = _mm512_add_ps(c1[r], bi1);
        if (acc == 1) {
            v0 = _mm512_add_ps(v0, _mm512_loadu_ps(cr));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m, cr + CO_TS_NR));
        }
        v0 = KFN(co_ts_ep16)(v0, relu, kp ? kp + r * ldc : NULL, (__mmask16)0xFFFF);
        v1 = KFN(co_ts_ep16)(v1, relu, kp ? kp + r * ldc + CO_TS_NR : NULL, m);
        if (acc == 2 && n1 == CO_TS_NR) {
            _mm512_stream_ps(cr, v0);
            _mm512_stream_ps(cr + CO_TS_NR, v1);
        } else {
            _mm512_storeu_ps(cr, v0);
            _mm512_mask_storeu_ps(cr + CO_TS_NR, m, v1);
        }
    }
}

#else

/* c0/c1[r] += a[r * rs + k * ks] * bp[k * bs + 0:16] over k in [0, K), rows r in [0, R): the rank-1
 * updates of a 6 x 16 register tile (bp: a packed 16-column panel or strip, K x 16 with bs = 16, or
 * 16 columns of a row-major matrix with row stride bs) */
static inline __attribute__((always_inline)) void
KFN(co_ts_fma)(const int R, const float *a, int64_t rs, int64_t ks, const float *bp, int64_t bs, int64_t K,
               __m256 *c0, __m256 *c1) {
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; ++k) {
        const __m256 b0 = _mm256_loadu_ps(bp + k * bs), b1 = _mm256_loadu_ps(bp + k * bs + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const __m256 av = _mm256_broadcast_ss(a + r * rs + k * ks);
            c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
        }
    }
}

/* rows [0, R) of the R x 16 tile c[:, n0 : n0 + ncols] from A rows a (lda = K) and one panel bp */
static inline __attribute__((always_inline)) void
KFN(co_ts_tile)(const int R, const float *a, int64_t K, const float *bp, const float *a2, int64_t K2,
                const float *bp2, const float *bias, int acc, const float *kp, int relu, float *c, int64_t ldc,
                int64_t ncols) {
    __m256 c0[CO_TS_MR], c1[CO_TS_MR];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
    KFN(co_ts_fma)(R, a, K, 1, bp, CO_TS_NR, K, c0, c1);
    if (a2) KFN(co_ts_fma)(R, a2, K2, 1, bp2, CO_TS_NR, K2, c0, c1); /* the second product, into the same registers */
    if (ncols == CO_TS_NR) {
        const __m256 bi0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        const __m256 bi1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            float *cr = c + r * ldc;
            __m256 v0 = _mm256_add_ps(c0[r], bi0), v1 = _mm256_add_ps(c1[r], bi1);
            if (acc == 1) {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(cr));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(cr + 8));
            }
            v0 = KFN(co_ts_ep8)(v0, relu, kp ? kp + r * ldc : NULL, _mm256_setzero_si256(), 1);
            v1 = KFN(co_ts_ep8)(v1, relu, kp ? kp + r * ldc + 8 : NULL, _mm256_setzero_si256(), 1);
            if (acc == 2) { /* streaming stores: C is written once and larger than the caches */
                _mm256_stream_ps(cr, v0);
                _mm256_stream_ps(cr + 8, v1);
            } else {
                _mm256_storeu_ps(cr, v0);
                _mm256_storeu_ps(cr + 8, v1);
            }
        }
        return;
    }
    /* the last panel of an N that is not a multiple of 16: masked loads and stores, nothing beyond */
    const int64_t n0 = ncols < 8 ? ncols : 8, n1 = ncols - n0;
    const __m256i m0 = KFN(co_ts_mask)(n0), m1 = KFN(co_ts_mask)(n1);
    const __m256 bi0 = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
    const __m256 bi1 = bias && n1 ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        float *cr = c + r * ldc;
        __m256 v0 = _mm256_add_ps(c0[r], bi0), v1 = _mm256_add_ps(c1[r], bi1);
        if (acc == 1) {
            v0 = _mm256_add_ps(v0, _mm256_maskload_ps(cr, m0));
            if (n1) v1 = _mm256_add_ps(v1, _mm256_maskload_ps(cr + 8, m1));
        }
        v0 = KFN(co_ts_ep8)(v0, relu, kp ? kp + r * ldc : NULL, m0, 0);
        v1 = KFN(co_ts_ep8)(v1, relu, kp && n1 ? kp + r * ldc + 8 : NULL, m1, 0);
        _mm256_maskstore_ps(cr, m0, v0);
        if (n1) _mm256_maskstore_ps(cr + 8, m1, v1);
    }
}

#endif /* AVX-512 / AVX2 tiles */

/* N <= 8: rows [0, R) (R <= 12) of C from one 8-column vector per k and R broadcasts. The 6 x 16
 * tile would compute 16 columns of which 8 or fewer are kept: half its multiply-adds wasted. */
static inline __attribute__((always_inline)) void
KFN(co_ts_tile8)(const int R, const float *a, int64_t K, const float *bp, const float *a2, int64_t K2,
                 const float *bp2, const float *bias, int acc, const float *kp, int relu, float *c, int64_t ncols) {
    __m256 c0[CO_TS_MR8];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) c0[r] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int64_t k = 0; k < K; ++k) {
        const __m256 b0 = _mm256_load_ps(bp + k * CO_TS_NR);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) c0[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + r * K + k), b0, c0[r]);
    }
    if (a2)
#pragma GCC unroll 2
        for (int64_t k = 0; k < K2; ++k) {
            const __m256 b0 = _mm256_load_ps(bp2 + k * CO_TS_NR);
#pragma GCC unroll 12
            for (int r = 0; r < R; ++r) c0[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + r * K2 + k), b0, c0[r]);
        }
    const __m256i m0 = KFN(co_ts_mask)(ncols);
    const __m256 bi = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
        float *cr = c + r * ncols;
        __m256 v = _mm256_add_ps(c0[r], bi);
        if (acc == 1) v = _mm256_add_ps(v, ncols == 8 ? _mm256_loadu_ps(cr) : _mm256_maskload_ps(cr, m0));
        v = KFN(co_ts_ep8)(v, relu, kp ? kp + r * ncols : NULL, m0, ncols == 8);
        if (ncols == 8 && acc == 2) {
            _mm256_stream_ps(cr, v);
        } else if (ncols == 8) {
            _mm256_storeu_ps(cr, v);
        } else {
            _mm256_maskstore_ps(cr, m0, v);
        }
    }
}

static void KFN(co_ts_rows)(int64_t R, const float *a, int64_t K, const float *bp, const float *a2, int64_t K2,
                            const float *bp2, int64_t N, const float *bias, int acc, const float *kp, int relu,
                            float *c) {
    if (N <= 8) {
        switch (R) {
#define CO_TS_T8(n) case n: KFN(co_ts_tile8)(n, a, K, bp, a2, K2, bp2, bias, acc, kp, relu, c, N); return;
        CO_TS_T8(12) CO_TS_T8(11) CO_TS_T8(10) CO_TS_T8(9) CO_TS_T8(8) CO_TS_T8(7)
        CO_TS_T8(6) CO_TS_T8(5) CO_TS_T8(4) CO_TS_T8(3) CO_TS_T8(2)
#undef CO_TS_T8
        default: KFN(co_ts_tile8)(1, a, K, bp, a2, K2, bp2, bias, acc, kp, relu, c, N); return;
        }
    }
    int64_t n0 = 0;
#if defined(CO_VARIANT_AVX512)
    if (R == CO_TS_MRV) /* whole tiles: pairs of panels (the last one, alone, below) */
        for (; n0 + CO_TS_NR < N; n0 += 2 * CO_TS_NR)
            KFN(co_ts_tile2)(a, K, bp + (n0 / CO_TS_NR) * K * CO_TS_NR, a2, K2,
                             a2 ? bp2 + (n0 / CO_TS_NR) * K2 * CO_TS_NR : NULL, bias ? bias + n0 : NULL, acc,
                             kp ? kp + n0 : NULL, relu, c + n0, N, N - n0 < 2 * CO_TS_NR ? N - n0 : 2 * CO_TS_NR);
#endif
    for (; n0 < N; n0 += CO_TS_NR) {
        const float *p = bp + (n0 / CO_TS_NR) * K * CO_TS_NR;
        const float *p2 = a2 ? bp2 + (n0 / CO_TS_NR) * K2 * CO_TS_NR : NULL;
        const float *bi = bias ? bias + n0 : NULL;
        const int64_t nc = N - n0 < CO_TS_NR ? N - n0 : CO_TS_NR;
        const float *kq = kp ? kp + n0 : NULL;
        switch (R) {
#define CO_TS_T(n) case n: KFN(co_ts_tile)(n, a, K, p, a2, K2, p2, bi, acc, kq, relu, c + n0, N, nc); break;
#if CO_TS_MRV == 12
        CO_TS_T(12) CO_TS_T(11) CO_TS_T(10) CO_TS_T(9) CO_TS_T(8) CO_TS_T(7)
#endif
        CO_TS_T(6) CO_TS_T(5) CO_TS_T(4) CO_TS_T(3) CO_TS_T(2)
#undef CO_TS_T
        default: KFN(co_ts_tile)(1, a, K, p, a2, K2, p2, bi, acc, kq, relu, c + n0, N, nc); break;
        }
    }
}

/* acc tile (R x 16 at part[i0:, j0:]) += sum over the block's L rows m of a[m, 0:R]^T b[m, 0:16]:
 * a and b read in place (row strides lda, ldb; b may be the packed tail strip, ldb = 16) */
#if defined(CO_VARIANT_AVX512)
static inline __attribute__((always_inline)) void
KFN(co_ts_tn_tile)(const int R, const float *a, int64_t lda, const float *b, int64_t ldb, int64_t L, float *part,
                   int64_t ldp) {
    __m512 c0[CO_TS_MRV];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) c0[r] = _mm512_setzero_ps();
    KFN(co_ts_fma)(R, a, 1, lda, b, ldb, L, c0);
    /* part is padded to a multiple of 16 columns: whole-vector updates are in bounds */
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
        float *pr = part + r * ldp;
        _mm512_storeu_ps(pr, _mm512_add_ps(_mm512_loadu_ps(pr), c0[r]));
    }
}
#else
static inline __attribute__((always_inline)) void
KFN(co_ts_tn_tile)(const int R, const float *a, int64_t lda, const float *b, int64_t ldb, int64_t L, float *part,
                   int64_t ldp) {
    __m256 c0[CO_TS_MR], c1[CO_TS_MR];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
    KFN(co_ts_fma)(R, a, 1, lda, b, ldb, L, c0, c1);
    /* part is padded to a multiple of 16 columns: whole-vector updates are in bounds */
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        float *pr = part + r * ldp;
        _mm256_storeu_ps(pr, _mm256_add_ps(_mm256_loadu_ps(pr), c0[r]));
        _mm256_storeu_ps(pr + 8, _mm256_add_ps(_mm256_loadu_ps(pr + 8), c1[r]));
    }
}
#endif

/* rows [m0, m1) (at most blk) into the thread's partials, one per B operand (nb_ops: 1, or 2 for two
 * weight gradients from the same g: A's block masked and summed once, then each B's tiles). A and B
 * are read where they are (the 6 broadcasts of a tile step are one row of A, its two vectors 16
 * columns of one row of B): only a last strip of B narrower than 16 columns is copied, zero-padded,
 * into scratch (blk x 16 floats per operand; then, with keep, A's masked block).
 * Packing both operands cost a quarter of the arithmetic's time (scalar copies of A's strips). */
static void KFN(co_ts_tn_block)(const float *a, int64_t N1, int nb_ops, const float *const *bs, const int64_t *n2s,
                                const float *keep, int64_t m0, int64_t m1, int64_t m_end, int64_t blk,
                                float *const *parts, float *colsum, float *scratch) {
    const int64_t L = m1 - m0, na = (N1 + CO_TS_MRV - 1) / CO_TS_MRV;
    const float *ab = a + m0 * N1;
    if (keep) { /* the block's rows of A masked once into scratch, read from L1 by the tiles */
        float *am = scratch + 2 * (size_t)blk * CO_TS_NR;
        KFN(co_ts_keep)(ab, keep + m0 * N1, L * N1, am);
        ab = am;
    }
    if (colsum)
        for (int64_t m = 0; m < L; ++m) {
            const float *am = ab + m * N1;
            for (int64_t i = 0; i < N1; ++i) colsum[i] += am[i];
        }
    /* the next block's rows of A, keep and each B (contiguous byte ranges), prefetched into L2 a slice
     * per tile, so that reading them does not wait on memory while the arithmetic here does not use it */
    const int64_t mn = m1 + blk < m_end ? m1 + blk : m_end, rows = m1 < mn ? mn - m1 : 0;
    const char *pf[4];
    int64_t lines[4], total = 0, tiles = 0;
    int npf = 0;
    pf[npf] = (const char *)(a + m1 * N1), lines[npf++] = (rows * N1 * 4 + 63) / 64;
    if (keep) pf[npf] = (const char *)(keep + m1 * N1), lines[npf++] = (rows * N1 * 4 + 63) / 64;
    for (int u = 0; u < nb_ops; ++u) {
        pf[npf] = (const char *)(bs[u] + m1 * n2s[u]), lines[npf++] = (rows * n2s[u] * 4 + 63) / 64;
        tiles += na * ((n2s[u] + CO_TS_NR - 1) / CO_TS_NR);
    }
    for (int q = 0; q < npf; ++q) total += lines[q];
    const int64_t per_tile = (total + tiles - 1) / tiles;
    int cur = 0;
    int64_t off = 0;
    for (int u = 0; u < nb_ops; ++u) {
        const int64_t N2 = n2s[u], ldp = (N2 + CO_TS_NR - 1) / CO_TS_NR * CO_TS_NR, nb = ldp / CO_TS_NR;
        const int64_t fb = N2 / CO_TS_NR; /* whole strips of B */
        const float *bb = bs[u] + m0 * N2;
        float *strip = scratch + (size_t)u * (size_t)blk * CO_TS_NR;
        if (fb < nb)
            for (int64_t m = 0; m < L; ++m) {
                float *d = strip + m * CO_TS_NR;
                const float *sr = bb + m * N2 + fb * CO_TS_NR;
                for (int64_t j = 0; j < CO_TS_NR; ++j) d[j] = fb * CO_TS_NR + j < N2 ? sr[j] : 0.f;
            }
        for (int64_t jb = 0; jb < nb; ++jb) {
            const float *bp = jb < fb ? bb + jb * CO_TS_NR : strip;
            const int64_t ldb = jb < fb ? N2 : CO_TS_NR;
            for (int64_t ia = 0; ia < na; ++ia) {
                const int64_t R = N1 - ia * CO_TS_MRV < CO_TS_MRV ? N1 - ia * CO_TS_MRV : CO_TS_MRV;
                for (int64_t q = 0; q < per_tile && cur < npf; ++q) {
                    while (cur < npf && off >= lines[cur]) ++cur, off = 0;
                    if (cur < npf) __builtin_prefetch(pf[cur] + 64 * off++, 0, 2);
                }
                const float *ap = ab + ia * CO_TS_MRV;
                float *pt = parts[u] + ia * CO_TS_MRV * ldp + jb * CO_TS_NR;
                switch (R) {
#define CO_TS_T(n) case n: KFN(co_ts_tn_tile)(n, ap, N1, bp, ldb, L, pt, ldp); break;
#if CO_TS_MRV == 12
                CO_TS_T(12) CO_TS_T(11) CO_TS_T(10) CO_TS_T(9) CO_TS_T(8) CO_TS_T(7)
#endif
                CO_TS_T(6) CO_TS_T(5) CO_TS_T(4) CO_TS_T(3) CO_TS_T(2)
#undef CO_TS_T
                default: KFN(co_ts_tn_tile)(1, ap, N1, bp, ldb, L, pt, ldp); break;
                }
            }
        }
    }
}

#else /* base: plain loops the compiler vectorizes as it can */

static void KFN(co_ts_rows)(int64_t R, const float *a, int64_t K, const float *bp, const float *a2, int64_t K2,
                            const float *bp2, int64_t N, const float *bias, int acc, const float *kp, int relu,
                            float *c) {
    for (int64_t r = 0; r < R; ++r)
        for (int64_t n = 0; n < N; ++n) {
            const float *p = bp + (n / CO_TS_NR) * K * CO_TS_NR + n % CO_TS_NR;
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += a[r * K + k] * p[k * CO_TS_NR];
            if (a2) {
                const float *p2 = bp2 + (n / CO_TS_NR) * K2 * CO_TS_NR + n % CO_TS_NR;
                for (int64_t k = 0; k < K2; ++k) s += a2[r * K2 + k] * p2[k * CO_TS_NR];
            }
            s += bias ? bias[n] : 0.f;
            if (acc == 1) s += c[r * N + n];
            if (relu && s < 0.f) s = 0.f;              /* NaN and -0 pass, as max(0, s) on the vector paths */
            if (kp && kp[r * N + n] <= 0.f) s = 0.f;   /* keep NaN: passes */
            c[r * N + n] = s;
        }
}

static void KFN(co_ts_tn_block)(const float *a, int64_t N1, int nb_ops, const float *const *bs, const int64_t *n2s,
                                const float *keep, int64_t m0, int64_t m1, int64_t m_end, int64_t blk,
                                float *const *parts, float *colsum, float *scratch) {
    (void)scratch;
    (void)m_end;
    (void)blk;
    for (int64_t m = m0; m < m1; ++m)
        for (int64_t i = 0; i < N1; ++i) {
            const float ai = keep && keep[m * N1 + i] <= 0.f ? 0.f : a[m * N1 + i];
            for (int u = 0; u < nb_ops; ++u) {
                const int64_t N2 = n2s[u], ldp = (N2 + CO_TS_NR - 1) / CO_TS_NR * CO_TS_NR;
                float *pr = parts[u] + i * ldp;
                for (int64_t j = 0; j < N2; ++j) pr[j] += ai * bs[u][m * N2 + j];
            }
            if (colsum) colsum[i] += ai;
        }
}

#endif

/* C = A B' (+ A2 B2^T when a2) (+ bias) (+ C when accumulate): the body of both entry points */
static int64_t KFN(co_ts_nn)(const float *a, int64_t M, int64_t K, const float *b, int64_t N, int b_nk,
                             const float *a2, int64_t K2, const float *b2, const float *bias, int accumulate,
                             int relu, const float *keep, float *c, int nthreads) {
    if (M < 0 || K < 1 || K > CO_TS_MAX_DIM || N < 1 || N > CO_TS_MAX_DIM || nthreads < 1 ||
        (b_nk != 0 && b_nk != 1) || (accumulate != 0 && accumulate != 1) || (relu != 0 && relu != 1) ||
        (a2 && (K2 < 1 || K2 > CO_TS_MAX_DIM || !b2)))
        return CO_ERR_BAD_ARGUMENT;
    if (!a || !b || !c) return CO_ERR_BAD_ARGUMENT;
    if (M == 0) return CO_OK;
    const int64_t np = (N + CO_TS_NR - 1) / CO_TS_NR;
    const int64_t k2 = a2 ? K2 : 0;
    float *bp = (float *)aligned_alloc(64, (size_t)(np * (K + k2) * CO_TS_NR) * sizeof(float));
    if (!bp) return CO_ERR_NO_MEMORY;
    float *bp2 = bp + np * K * CO_TS_NR;
    KFN(co_ts_pack)(b, K, N, b_nk, bp);
    if (a2) KFN(co_ts_pack)(b2, K2, N, 1, bp2);
    /* a thread per 2M multiply-adds at least */
    const int64_t want = (M * (K + k2) * N + (1 << 21) - 1) >> 21;
    int nt = want < nthreads ? (int)want : nthreads;
    if (nt < 1) nt = 1;
    const int64_t mr = N <= 8 ? CO_TS_MR8 : CO_TS_MRV; /* rows per tile */
    const int64_t tiles = (M + mr - 1) / mr;
    /* 1: C += ...; 2: C = ... with streaming stores (C aligned to the stores' width, rows whole
     * vectors, and beyond the L2 caches: 8 MiB); 0: C = ... */
#if defined(CO_VARIANT_AVX512)
    const int whole = N <= 8 ? ((uintptr_t)c & 31) == 0 && N % 8 == 0 : ((uintptr_t)c & 63) == 0 && N % 16 == 0;
#else
    const int whole = ((uintptr_t)c & 31) == 0 && N % 8 == 0;
#endif
    const int mode = accumulate ? 1 : (whole && M * N >= ((int64_t)1 << 21)) ? 2 : 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = nt > 1 ? omp_get_thread_num() : 0;
        const int n_t = nt > 1 ? omp_get_num_threads() : 1;
        const int64_t r0 = tiles * t / n_t * mr;
        int64_t r1 = tiles * (t + 1) / n_t * mr;
        if (r1 > M) r1 = M;
        for (int64_t r = r0; r < r1; r += mr) {
            const int64_t R = r1 - r < mr ? r1 - r : mr;
#if defined(CO_VARIANT_AVX2)
            if (r + (CO_TS_PF + 1) * mr <= r1) { /* a later tile's rows of A into L1, one prefetch per 64-byte line */
                const char *pa = (const char *)(a + (r + CO_TS_PF * mr) * K);
                for (int64_t o = 0; o < mr * K * 4; o += 64) _mm_prefetch(pa + o, _MM_HINT_T0);
                if (a2) {
                    const char *pb = (const char *)(a2 + (r + CO_TS_PF * mr) * k2);
                    for (int64_t o = 0; o < mr * k2 * 4; o += 64) _mm_prefetch(pb + o, _MM_HINT_T0);
                }
            }
#endif
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
            /* and keep's (read by the epilogue a row segment per panel, which the hardware
             * prefetchers follow badly): Zen 4, 100k x 64 -> 64 with keep (GIN's hidden-layer input
             * gradient), avx512 tiles 11.9-12.0 -> 10.8-10.9 ms at 1 thread, 6.1-8.5 -> 5.5-8.0 at 2;
             * avx2 tiles level (they prefetch A already) */
            if (keep && r + (CO_TS_PF + 1) * mr <= r1) {
                const char *pk = (const char *)(keep + (r + CO_TS_PF * mr) * N);
                for (int64_t o = 0; o < mr * N * 4; o += 64) _mm_prefetch(pk + o, _MM_HINT_T0);
            }
#endif
            KFN(co_ts_rows)(R, a + r * K, K, bp, a2 ? a2 + r * K2 : NULL, k2, bp2, N, bias, mode,
                            keep ? keep + r * N : NULL, relu, c + r * N);
        }
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
        if (mode == 2) _mm_sfence();
#endif
    }
    free(bp);
    return CO_OK;
}

int64_t KFN(ts_gemm_nn_f32)(const float *a, int64_t M, int64_t K, const float *b, int64_t N, int b_nk,
                            const float *bias, int accumulate, float *c, int nthreads) {
    return KFN(co_ts_nn)(a, M, K, b, N, b_nk, NULL, 0, NULL, bias, accumulate, 0, NULL, c, nthreads);
}

int64_t KFN(ts_gemm_nn_ep_f32)(const float *a, int64_t M, int64_t K, const float *b, int64_t N, int b_nk,
                               const float *bias, int relu, const float *keep, float *c, int nthreads) {
    return KFN(co_ts_nn)(a, M, K, b, N, b_nk, NULL, 0, NULL, bias, 0, relu, keep, c, nthreads);
}

int64_t KFN(ts_gemm_nn2_ep_f32)(const float *a1, int64_t M, int64_t K1, const float *w1, const float *a2, int64_t K2,
                                const float *w2, int64_t N, const float *bias, int relu, float *c, int nthreads) {
    if (!a2) return CO_ERR_BAD_ARGUMENT;
    return KFN(co_ts_nn)(a1, M, K1, w1, N, 1, a2, K2, w2, bias, 0, relu, NULL, c, nthreads);
}

int64_t KFN(ts_gemm_nn2_f32)(const float *a1, int64_t M, int64_t K1, const float *w1, const float *a2, int64_t K2,
                             const float *w2, int64_t N, const float *bias, float *c, int nthreads) {
    return KFN(ts_gemm_nn2_ep_f32)(a1, M, K1, w1, a2, K2, w2, N, bias, 0, c, nthreads);
}

/* C_u = A'^T B_u for nb_ops (1 or 2) operands B_u (M x n2s[u]), A' = A where keep > 0 or NaN (keep
 * NULL: A), colsum = A's column sums: the body of the weight-gradient entry points */
static int64_t KFN(co_ts_tn)(const float *a, int64_t M, int64_t N1, int nb_ops, const float *const *bs,
                             const int64_t *n2s, const float *keep, float *const *cs, float *colsum, int nthreads) {
    if (M < 0 || N1 < 1 || N1 > CO_TS_MAX_DIM || nthreads < 1 || !a) return CO_ERR_BAD_ARGUMENT;
    int64_t ldps[2], nsum = 0, psz = N1; /* each padded partial, then the partial column sums */
    for (int u = 0; u < nb_ops; ++u) {
        if (n2s[u] < 1 || n2s[u] > CO_TS_MAX_DIM || !bs[u] || !cs[u]) return CO_ERR_BAD_ARGUMENT;
        ldps[u] = (n2s[u] + CO_TS_NR - 1) / CO_TS_NR * CO_TS_NR;
        psz += N1 * ldps[u];
        nsum += n2s[u];
    }
    const int64_t want = (M * N1 * nsum + (1 << 21) - 1) >> 21;
    int nt = want < nthreads ? (int)want : nthreads;
    if (nt < 1) nt = 1;
    const int64_t blk = KFN(co_ts_tn_rows)(N1, nsum);
    /* per thread: each operand's last strip of B when narrower than 16 columns, zero-padded (64-byte
     * aligned), then, with keep, the block's rows of A masked (co_ts_tn_block) */
    const size_t ssz = 2 * (size_t)CO_TS_TN_BLOCK * CO_TS_NR + (keep ? (size_t)blk * (size_t)N1 : 0);
    float *part = (float *)calloc((size_t)nt * (size_t)psz, sizeof(float));
    float *scratch = (float *)aligned_alloc(64, (size_t)nt * ssz * sizeof(float));
    if (!part || !scratch) {
        free(part);
        free(scratch);
        return CO_ERR_NO_MEMORY;
    }
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = nt > 1 ? omp_get_thread_num() : 0;
        const int n_t = nt > 1 ? omp_get_num_threads() : 1;
        const int64_t m0 = M * t / n_t, m1 = M * (t + 1) / n_t;
        float *pt = part + (size_t)t * (size_t)psz;
        float *parts[2] = {pt, nb_ops > 1 ? pt + N1 * ldps[0] : NULL};
        float *ps = pt + psz - N1;
        for (int64_t m = m0; m < m1; m += blk) {
            const int64_t me = m1 - m < blk ? m1 : m + blk;
            KFN(co_ts_tn_block)(a, N1, nb_ops, bs, n2s, keep, m, me, m1, blk, parts, colsum ? ps : NULL,
                                scratch + (size_t)t * ssz);
        }
#pragma omp barrier
        /* each thread sums its share of the output rows over the partials */
        const int64_t i0 = N1 * t / n_t, i1 = N1 * (t + 1) / n_t;
        for (int64_t i = i0; i < i1; ++i) {
            int64_t base = 0;
            for (int u = 0; u < nb_ops; ++u) {
                float *ci = cs[u] + i * n2s[u];
                for (int64_t j = 0; j < n2s[u]; ++j) {
                    float s = 0.f;
                    for (int w = 0; w < n_t; ++w) s += part[(size_t)w * (size_t)psz + base + i * ldps[u] + j];
                    ci[j] = s;
                }
                base += N1 * ldps[u];
            }
            if (colsum) {
                float s = 0.f;
                for (int w = 0; w < n_t; ++w) s += part[(size_t)w * (size_t)psz + psz - N1 + i];
                colsum[i] = s;
            }
        }
    }
    free(part);
    free(scratch);
    return CO_OK;
}

int64_t KFN(ts_gemm_tn_ep_f32)(const float *a, int64_t M, int64_t N1, const float *b, int64_t N2, const float *keep,
                               float *c, float *colsum, int nthreads) {
    const float *bs[1] = {b};
    const int64_t n2s[1] = {N2};
    float *cs[1] = {c};
    return KFN(co_ts_tn)(a, M, N1, 1, bs, n2s, keep, cs, colsum, nthreads);
}

int64_t KFN(ts_gemm_tn2_ep_f32)(const float *a, int64_t M, int64_t N1, const float *b1, int64_t N2, const float *b2,
                                int64_t N3, const float *keep, float *c1, float *c2, float *colsum, int nthreads) {
    const float *bs[2] = {b1, b2};
    const int64_t n2s[2] = {N2, N3};
    float *cs[2] = {c1, c2};
    return KFN(co_ts_tn)(a, M, N1, 2, bs, n2s, keep, cs, colsum, nthreads);
}

int64_t KFN(ts_gemm_tn_f32)(const float *a, int64_t M, int64_t N1, const float *b, int64_t N2, float *c,
                            float *colsum, int nthreads) {
    return KFN(ts_gemm_tn_ep_f32)(a, M, N1, b, N2, NULL, c, colsum, nthreads);
}
