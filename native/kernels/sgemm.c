/* A general fp32 GEMM against constant weights, packed once: the linear layers of a transformer or
 * an MLP at 4+ rows (the GEMV in gemv.c takes 1-3). Where it is routed (AVX2 without AVX-512), the
 * GEMM libraries reachable from Python leave a fifth of the FMA units idle: on 2 Zen 3 cores torch's
 * oneDNN 3.12 (brg_matmul:avx2, packed weights) runs BERT's 128 x 768 x 3072 at 70-75 GFLOP/s per
 * core, pip oneDNN 3.2 (gemm:jit) and MKL lower, against 100 for a register-only FMA loop and 96 for
 * a 6 x 16 tile fed from L1. The classic blocking (Goto/BLIS) gets 81-89 there:
 *
 *   sgemm_pack_f32:   W (N x K, w_kn = 0: nn.Linear's weight; K x N, w_kn = 1) into ceil(N / 16)
 *                     panels of K x 16 floats (column n of panel p: W's n = 16 p + j; zero past N).
 *                     Done once per layer; the packed weight has sgemm_packed_size(N, K) floats.
 *   sgemm_packed_f32: C (M x N) = A (M x K, row stride lda) W' (+ bias[N]) (+ add (M x N, row stride N))
 *                     then the activation act: 0 none, 1 relu (max(0, .)), 2 the exact (erf) GELU, 3 the
 *                     tanh GELU, both as eltwise.c computes them (co_gelu8 / co_gelu_tanh8): a linear
 *                     layer's GELU applied as the tile is stored, not in a second pass over C.
 *
 * A is taken CO_SG_KC columns (a K block) by at most CO_SG_MC rows (an M block) at a time, copied
 * into 6-row strips (k-major: one broadcast stream per tile) that stay in L2; each 16-column panel's
 * K block (CO_SG_KC x 16 floats, 24 KiB) stays in L1 while every strip of the M block passes over
 * it into a 6 x 16 register tile (12 ymm accumulators, 2 loads and 6 broadcasts per 12 FMAs). The
 * K blocks of one tile add up in C (the first writes bias + its product, the last adds `add` and
 * applies the activation). Where a thread's columns of C outgrow L2 (GPT-2's LM head: 128 x 50257), its panels
 * go in groups of ~32 KiB of C, each group through every K block before the next, A's strips for
 * all of K packed once: C then stays in L2 between K blocks instead of a round trip to memory (5%
 * on the LM head, 2-4% at 128 x 768 x 3072 on 2 Zen 3 cores). Threads split the panels (each its
 * own columns of C: no barrier, no reduction, the result independent of the thread count) or the
 * rows: with fewer panels than threads, and for N <= 384 on 4+ strips per thread, where splitting
 * the panels would have every thread pack all of A for a few panels (ConvNeXt's 3136 x 384 x 96:
 * 9-15% faster split by rows; 784 x 768 x 192: 7-8%).
 * Sizes and pointers are checked before any memory is touched: CO_ERR_BAD_ARGUMENT for M < 0, K or
 * N < 1, lda < K, act not 0-3, nthreads < 1 or a NULL pointer (bias and add may be NULL);
 * CO_ERR_NO_MEMORY when the strips cannot be allocated (nothing written then). */

#ifndef CO_SGEMM_DEFINED
#define CO_SGEMM_DEFINED
#define CO_SG_NR 16   /* panel width: 2 AVX2 vectors */
#define CO_SG_MR 6    /* rows per register tile */
#define CO_SG_KC 384  /* K block: a panel's block is 24 KiB (L1 32 KiB) */
#define CO_SG_MC 144  /* most rows per M block: a block's strips are 216 KiB (L2 512 KiB) */
#define CO_SG_CL2 65536      /* a thread's columns of C beyond this many floats (256 KiB) leave L2 ... */
#define CO_SG_CBLOCK 8192    /* ... so its panels are taken in groups of at most this many floats of C */
#define CO_SG_APACK (1 << 21) /* most floats of A's strips packed at once per thread (8 MiB) */
#define CO_SG_ROWSPLIT_N 384 /* threads split the rows, not the panels, up to this N */
_Static_assert(CO_SG_NR == CO_TS_NR, "sgemm packs its weights into tsgemm.c's panels");
#endif

int64_t KFN(sgemm_packed_size)(int64_t N, int64_t K) {
    if (N < 1 || K < 1) return -1;
    return (N + CO_SG_NR - 1) / CO_SG_NR * K * CO_SG_NR;
}

int64_t KFN(sgemm_pack_f32)(const float *w, int64_t N, int64_t K, int w_kn, float *bp) {
    if (!w || !bp || N < 1 || K < 1 || (w_kn != 0 && w_kn != 1)) return CO_ERR_BAD_ARGUMENT;
    /* the layout of tsgemm.c's panels (CO_TS_NR = CO_SG_NR = 16 columns, zero past N) */
    KFN(co_ts_pack)(w, K, N, !w_kn, bp);
    return CO_OK;
}

/* rows [i0, i0 + mr) of A, columns [k0, k0 + kc), into a k-major strip of 6 (rows past mr repeat the
 * first: their products are computed and never stored) */
static inline void KFN(co_sg_strip)(const float *a, int64_t lda, int64_t i0, int mr, int64_t k0, int64_t kc,
                                    float *dst) {
    const float *s[CO_SG_MR];
    for (int r = 0; r < CO_SG_MR; ++r) s[r] = a + (i0 + (r < mr ? r : 0)) * lda + k0;
    int64_t k = 0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    /* 8 columns at a time: the 6 rows' 8 values (and 2 rows of padding) transposed in registers,
     * each column's 6 values stored as 4 + 2 (a strip's last column is its last 6 floats) */
    for (; k + 8 <= kc; k += 8) {
        const __m256 r0 = _mm256_loadu_ps(s[0] + k), r1 = _mm256_loadu_ps(s[1] + k), r2 = _mm256_loadu_ps(s[2] + k),
                     r3 = _mm256_loadu_ps(s[3] + k), r4 = _mm256_loadu_ps(s[4] + k), r5 = _mm256_loadu_ps(s[5] + k),
                     r6 = r4, r7 = r5;
        const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
        const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
        const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
        const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        /* column j of the 8: rows 0-3 in u(j % 4)'s half j / 4, rows 4-5 in u(4 + j % 4)'s */
        const __m256 lo[4] = {u0, u1, u2, u3}, hi[4] = {u4, u5, u6, u7};
        float *d = dst + k * CO_SG_MR;
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
            _mm_storeu_ps(d + j * CO_SG_MR, _mm256_castps256_ps128(lo[j]));
            _mm_storel_pi((__m64 *)(d + j * CO_SG_MR + 4), _mm256_castps256_ps128(hi[j]));
            _mm_storeu_ps(d + (j + 4) * CO_SG_MR, _mm256_extractf128_ps(lo[j], 1));
            _mm_storel_pi((__m64 *)(d + (j + 4) * CO_SG_MR + 4), _mm256_extractf128_ps(hi[j], 1));
        }
    }
#endif
    for (; k < kc; ++k)
        for (int r = 0; r < CO_SG_MR; ++r) dst[k * CO_SG_MR + r] = s[r][k];
}

/* the tile's epilogue on one row of up to 16 values v (nv of them valid): + bias on the first K block,
 * + C on the later ones; + add and the activation on the last */
static inline void KFN(co_sg_store)(const float *v, int nv, float *cr, int first, int last, const float *bias,
                                    const float *addr, int act) {
    for (int j = 0; j < nv; ++j) {
        float x = v[j] + (first ? (bias ? bias[j] : 0.f) : cr[j]);
        if (last) {
            if (addr) x += addr[j];
            if (act == 1 && x < 0.f) x = 0.f; /* as max(0, x) below: NaN and -0 pass, as torch's relu passes them */
            if (act >= 2) x = KFN(co_gelu_scalar)(x, act == 3);
        }
        cr[j] = x;
    }
}

#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)

/* the first `rows` (6, 4 or 2: a constant where it is inlined) rows of a strip against one panel:
 * a strip's last rows (M = 128: 21 strips of 6 and one of 2) on a smaller tile instead of six rows'
 * worth of FMAs for two */
static inline __attribute__((always_inline)) void
KFN(co_sg_tile_rows)(const int rows, int64_t kc, const float *as, const float *b, float *c, int64_t ldc, int mr,
                     int nv, int first, int last, const float *bias, const float *add, int act) {
    __m256 c0[CO_SG_MR], c1[CO_SG_MR];
#pragma GCC unroll 6
    for (int r = 0; r < rows; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
        for (int r = 0; r < rows; ++r) {
            const __m256 av = _mm256_broadcast_ss(as + r);
            c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
        }
        b += CO_SG_NR;
        as += CO_SG_MR;
    }
    /* the accumulators leave their registers here, indexed by constants only: a row loop over them
     * with a variable bound (mr) would keep them in memory through the k loop */
    float v[CO_SG_MR][CO_SG_NR] __attribute__((aligned(32)));
#pragma GCC unroll 6
    for (int r = 0; r < rows; ++r) {
        _mm256_store_ps(v[r], c0[r]);
        _mm256_store_ps(v[r] + 8, c1[r]);
    }
    if (nv < CO_SG_NR) {
        for (int r = 0; r < mr; ++r)
            KFN(co_sg_store)(v[r], nv, c + r * ldc, first, last, bias, add ? add + r * ldc : NULL, act);
        return;
    }
    const __m256 z = _mm256_setzero_ps();
    const __m256 bi0 = first && bias ? _mm256_loadu_ps(bias) : z, bi1 = first && bias ? _mm256_loadu_ps(bias + 8) : z;
    for (int r = 0; r < mr; ++r) {
        float *cr = c + r * ldc;
        __m256 v0 = _mm256_add_ps(_mm256_load_ps(v[r]), first ? bi0 : _mm256_loadu_ps(cr));
        __m256 v1 = _mm256_add_ps(_mm256_load_ps(v[r] + 8), first ? bi1 : _mm256_loadu_ps(cr + 8));
        if (last && add) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(add + r * ldc));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(add + r * ldc + 8));
        }
        if (last && act == 1) { /* max(0, v), v second: NaN and -0 pass, as torch's relu passes them */
            v0 = _mm256_max_ps(z, v0);
            v1 = _mm256_max_ps(z, v1);
        } else if (last && act == 2) {
            v0 = KFN(co_gelu8)(v0);
            v1 = KFN(co_gelu8)(v1);
        } else if (last && act == 3) {
            v0 = KFN(co_gelu_tanh8)(v0);
            v1 = KFN(co_gelu_tanh8)(v1);
        }
        _mm256_storeu_ps(cr, v0);
        _mm256_storeu_ps(cr + 8, v1);
    }
}

static inline void KFN(co_sg_tile)(int64_t kc, const float *as, const float *b, float *c, int64_t ldc, int mr, int nv,
                                   int first, int last, const float *bias, const float *add, int act) {
    if (mr > 4)
        KFN(co_sg_tile_rows)(6, kc, as, b, c, ldc, mr, nv, first, last, bias, add, act);
    else if (mr > 2)
        KFN(co_sg_tile_rows)(4, kc, as, b, c, ldc, mr, nv, first, last, bias, add, act);
    else
        KFN(co_sg_tile_rows)(2, kc, as, b, c, ldc, mr, nv, first, last, bias, add, act);
}

#else

static inline void KFN(co_sg_tile)(int64_t kc, const float *as, const float *b, float *c, int64_t ldc, int mr, int nv,
                                   int first, int last, const float *bias, const float *add, int act) {
    float acc[CO_SG_MR][CO_SG_NR];
    for (int r = 0; r < CO_SG_MR; ++r)
        for (int j = 0; j < CO_SG_NR; ++j) acc[r][j] = 0.f;
    for (int64_t k = 0; k < kc; ++k) {
        for (int r = 0; r < CO_SG_MR; ++r) {
            const float av = as[r];
            for (int j = 0; j < CO_SG_NR; ++j) acc[r][j] += av * b[j];
        }
        b += CO_SG_NR;
        as += CO_SG_MR;
    }
    for (int r = 0; r < mr; ++r)
        KFN(co_sg_store)(acc[r], nv, c + r * ldc, first, last, bias, add ? add + r * ldc : NULL, act);
}

#endif

/* rows i0..i1 of A, columns k0..k0+kc, as consecutive strips of CO_SG_MR rows (the last may be shorter) */
static inline void KFN(co_sg_pack_block)(const float *a, int64_t lda, int64_t i0, int64_t i1, int64_t k0, int64_t kc,
                                         float *dst) {
    for (int64_t i = i0; i < i1; i += CO_SG_MR)
        KFN(co_sg_strip)(a, lda, i, (int)(i + CO_SG_MR <= i1 ? CO_SG_MR : i1 - i), k0, kc, dst + (i - i0) * kc);
}

/* threads: tn over the panels, tm over the rows (when the panels are fewer than the threads, or N
 * is narrow and the rows many) */
static inline void KFN(co_sg_split)(int64_t np, int64_t strips, int nthreads, int *tn, int *tm) {
    *tn = nthreads;
    *tm = 1;
    if (np * CO_SG_NR <= CO_SG_ROWSPLIT_N && strips >= 4 * nthreads) {
        *tn = 1;
        *tm = nthreads;
    } else if (np < nthreads) {
        *tn = (int)np;
        *tm = nthreads / (int)np;
        if (*tm > strips) *tm = (int)strips;
    }
}

int64_t KFN(sgemm_packed_f32)(const float *a, int64_t M, int64_t K, int64_t lda, const float *bp, int64_t N,
                              const float *bias, const float *add, int act, float *c, int nthreads) {
    if (!a || !bp || !c || M < 0 || K < 1 || N < 1 || lda < K || act < 0 || act > 3 || nthreads < 1)
        return CO_ERR_BAD_ARGUMENT;
    if (M == 0) return CO_OK;
    const int64_t np = (N + CO_SG_NR - 1) / CO_SG_NR;
    /* blocks of even size: K into ceil(K / KC) blocks, M into ceil(M / MC) blocks of whole strips */
    const int64_t nkb = (K + CO_SG_KC - 1) / CO_SG_KC, kcb = (K + nkb - 1) / nkb;
    const int64_t nmb = (M + CO_SG_MC - 1) / CO_SG_MC;
    const int64_t mcb = ((M + nmb - 1) / nmb + CO_SG_MR - 1) / CO_SG_MR * CO_SG_MR;
    const int64_t strips = (M + CO_SG_MR - 1) / CO_SG_MR;
    int tn, tm;
    KFN(co_sg_split)(np, strips, nthreads, &tn, &tm);
    /* with 2+ K blocks and A's strips for the whole of K within CO_SG_APACK floats per thread, those
     * strips are packed first, and a thread whose columns of C would leave L2 takes its panels in
     * groups (at most CO_SG_CBLOCK floats of C), each through every K block */
    const int whole = nkb > 1 && mcb * K <= CO_SG_APACK;
    int64_t group = CO_SG_CBLOCK / (mcb * CO_SG_NR);
    if (group < 1) group = 1;
    const int64_t strip_floats = whole ? mcb * K : mcb * kcb; /* per thread */
    float *scratch = (float *)malloc((size_t)(tn * tm) * (size_t)strip_floats * sizeof(float));
    if (!scratch) return CO_ERR_NO_MEMORY;
#pragma omp parallel num_threads(tn * tm)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
#else
        const int t = 0, team = 1;
#endif
        /* the team may be smaller than asked (OMP_THREAD_LIMIT, nesting): split over the threads there are */
        int tn_, tm_;
        KFN(co_sg_split)(np, strips, team, &tn_, &tm_);
        if (t < tn_ * tm_) {
            const int ti = t / tn_, tj = t % tn_;
            const int64_t p0 = np * tj / tn_, p1 = np * (tj + 1) / tn_;
            const int64_t r0 = strips * ti / tm_ * CO_SG_MR, r1m = strips * (ti + 1) / tm_ * CO_SG_MR;
            const int64_t r1 = r1m < M ? r1m : M;
            float *as = scratch + (int64_t)t * strip_floats;
            /* groups only where this thread's columns of C would not stay in L2 anyway */
            const int64_t gsize = whole && mcb * (p1 - p0) * CO_SG_NR > CO_SG_CL2 ? group : p1 - p0;
            for (int64_t i0 = r0; i0 < r1; i0 += mcb) {
                const int64_t i1 = i0 + mcb < r1 ? i0 + mcb : r1;
                if (whole)
                    for (int64_t k0 = 0; k0 < K; k0 += kcb)
                        KFN(co_sg_pack_block)(a, lda, i0, i1, k0, k0 + kcb < K ? kcb : K - k0, as + mcb * k0);
                for (int64_t g0 = p0; g0 < p1; g0 += gsize) {
                    const int64_t g1 = g0 + gsize < p1 ? g0 + gsize : p1;
                    for (int64_t k0 = 0; k0 < K; k0 += kcb) {
                        const int64_t kc = k0 + kcb < K ? kcb : K - k0;
                        const int first = k0 == 0, last = k0 + kc == K;
                        const float *ak = whole ? as + mcb * k0 : as;
                        if (!whole) KFN(co_sg_pack_block)(a, lda, i0, i1, k0, kc, as);
                        for (int64_t p = g0; p < g1; ++p) {
                            const int nv = (int)((p + 1) * CO_SG_NR <= N ? CO_SG_NR : N - p * CO_SG_NR);
                            const float *bb = bp + (p * K + k0) * CO_SG_NR;
                            for (int64_t i = i0; i < i1; i += CO_SG_MR)
                                KFN(co_sg_tile)(kc, ak + (i - i0) * kc, bb, c + i * N + p * CO_SG_NR, N,
                                                (int)(i + CO_SG_MR <= i1 ? CO_SG_MR : i1 - i), nv, first, last,
                                                bias ? bias + p * CO_SG_NR : NULL,
                                                add ? add + i * N + p * CO_SG_NR : NULL, act);
                        }
                    }
                }
            }
        }
    }
    free(scratch);
    return CO_OK;
}
