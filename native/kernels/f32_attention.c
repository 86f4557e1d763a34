/* Fused float32 attention on AVX-512 or AVX2 FMA (cpu_opt.backends.attention.f32_attention): the attention
 * of float32 graphs, with the operands, limits, statuses and task split of the bf16 kernels
 * (amx_attention.c, dpbf16_attention.c) and their arithmetic in float32 throughout:
 *
 *   out[b, h, i, :] = sum_j p[i, j] v[b, h, j, :],  p = softmax_j(scale * <q[b, h, i], k[b, h, j]> + mask[b, h, i, j])
 *
 * q, k, v float32 read where they lie (last dimension dense, any other strides), out float32 with its
 * own strides, mask float32 (NULL: none; strides 0 where it broadcasts). k and v may have fewer heads
 * (Hk dividing H). causal: query i sees keys j <= i (torch's is_causal).
 * Per (b, h) task: k packed transposed (dimension-major, keys zero padded to a multiple of 32), once
 * per kv head a thread meets; v read in place when its dimension is a multiple of 32, else packed
 * zero padded. Per block of 12 queries: the scores (12 x 32 keys per register block: 24 zmm
 * accumulators, one FMA per key-vector and query per dimension), the softmax of each row in place
 * (float32 exponentials; an all -inf row gives zeros), p @ v (12 x 32 output dimensions per block)
 * with each row's 1 / sum applied as it is stored. torch's flash kernel computes the same sums in
 * another order (differences at float32 rounding, ~1e-6 relative).
 * The avx2 variant runs the same blocks as four 6 x 16 ymm tiles each and the softmax 8 lanes wide
 * (the same algorithm; sums in another order than the avx512 variant's).
 * Returns CO_ERR_UNSUPPORTED_AMX (the "no such instructions here" status) in the base variant. */

#if defined(CO_VARIANT_AVX512) || defined(CO_VARIANT_AVX2)
#define CO_F32_MR 12   /* query rows per register block: 12 x 2 accumulators of 16 floats (AVX2: four 6 x 16 tiles) */
#if defined(CO_VARIANT_AVX512)

/* c[r][0..31] = rs[r] * sum_{t < n} a[r * lda + t] * b[t * ldb + 0..31] for r < CO_F32_MR (rs NULL:
 * no scale) */
static inline void KFN(co_f32_block)(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t n,
                                     float *c, int64_t ldc, const float *rs) {
    __m512 acc[CO_F32_MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < CO_F32_MR; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const __m512 b0 = _mm512_loadu_ps(b + t * ldb), b1 = _mm512_loadu_ps(b + t * ldb + 16);
#pragma GCC unroll 12
        for (int r = 0; r < CO_F32_MR; r++) {
            const __m512 av = _mm512_set1_ps(a[r * lda + t]);
            acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
        }
    }
    if (rs) {
#pragma GCC unroll 12
        for (int r = 0; r < CO_F32_MR; r++) {
            acc[r][0] = _mm512_mul_ps(acc[r][0], _mm512_set1_ps(rs[r]));
            acc[r][1] = _mm512_mul_ps(acc[r][1], _mm512_set1_ps(rs[r]));
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < CO_F32_MR; r++) {
        _mm512_storeu_ps(c + r * ldc, acc[r][0]);
        _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
    }
}

/* one row in place: s[0..keys) scores -> exp(scale s + m - max), s[keys..width) -> 0; returns 1 / sum
 * of the exponentials, 0 for a row whose every entry is -inf (or NaN): the row is then all zeros */
static float KFN(co_f32_softmax_row)(float *s, int64_t keys, int64_t width, float scale, const float *m) {
    const int64_t kv = keys / 16 * 16;
    const float mx = KFN(co_scale_mask_max)(s, keys, scale, m);
    if (mx == -INFINITY || mx != mx) {
        memset(s, 0, (size_t)width * sizeof(float));
        return 0.f;
    }
    __m512 mv = _mm512_set1_ps(mx), sumv = _mm512_setzero_ps();
    for (int64_t j = 0; j < kv; j += 16) {
        __m512 e = KFN(co_exp_nonpos16)(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        sumv = _mm512_add_ps(sumv, e);
        _mm512_storeu_ps(s + j, e);
    }
    float sum = _mm512_reduce_add_ps(sumv);
    for (int64_t j = kv; j < keys; j++) {
        float x = s[j] - mx;
        float e = x < -87.33654f ? 0.f : expf(x);
        sum += e;
        s[j] = e;
    }
    if (width > keys)
        memset(s + keys, 0, (size_t)(width - keys) * sizeof(float));
    return 1.f / sum;
}

#else /* AVX2: the same 12 x 32 blocks as four 6 x 16 register tiles, softmax 8 lanes at a time */

/* c[r][0..15] = rs[r] * sum_{t < n} a[r * lda + t] * b[t * ldb + 0..15] for r < 6 (rs NULL: no scale) */
static inline __attribute__((always_inline)) void
KFN(co_f32_tile6)(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t n, float *c, int64_t ldc,
                  const float *rs) {
    __m256 c0[6], c1[6];
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
        c0[r] = c1[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t t = 0; t < n; t++) {
        const __m256 b0 = _mm256_loadu_ps(b + t * ldb), b1 = _mm256_loadu_ps(b + t * ldb + 8);
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            const __m256 av = _mm256_broadcast_ss(a + r * lda + t);
            c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
        const __m256 sc = _mm256_set1_ps(rs ? rs[r] : 1.f);
        _mm256_storeu_ps(c + r * ldc, rs ? _mm256_mul_ps(c0[r], sc) : c0[r]);
        _mm256_storeu_ps(c + r * ldc + 8, rs ? _mm256_mul_ps(c1[r], sc) : c1[r]);
    }
}

/* the AVX-512 block's contract (12 rows x 32 columns) on four 6 x 16 tiles */
static void KFN(co_f32_block)(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t n, float *c,
                              int64_t ldc, const float *rs) {
    for (int r0 = 0; r0 < CO_F32_MR; r0 += 6)
        for (int c0 = 0; c0 < 32; c0 += 16)
            KFN(co_f32_tile6)(a + r0 * lda, lda, b + c0, ldb, n, c + r0 * ldc + c0, ldc, rs ? rs + r0 : NULL);
}

static inline float KFN(co_f32_hmax8)(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* exp for the softmax, as co_exp_nonpos16: x <= 0, -inf and anything below -87.34 give 0
 * (eltwise.c's Cephes exp, whose clamp would otherwise give exp(-88) there) */
static inline __m256 KFN(co_exp_nonpos8)(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_GE_OQ);
    return _mm256_and_ps(keep, KFN(co_exp8)(x));
}

/* co_f32_softmax_row's contract, 8 lanes at a time */
static float KFN(co_f32_softmax_row)(float *s, int64_t keys, int64_t width, float scale, const float *m) {
    const int64_t kv = keys / 8 * 8;
    const __m256 sv = _mm256_set1_ps(scale);
    __m256 mxv = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < kv; j += 8) {   /* s -> scale s + m in place, and their maximum */
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), sv);
        if (m)
            x = _mm256_add_ps(x, _mm256_loadu_ps(m + j));
        _mm256_storeu_ps(s + j, x);
        mxv = _mm256_max_ps(mxv, x);
    }
    float mx = KFN(co_f32_hmax8)(mxv);
    for (int64_t j = kv; j < keys; j++) {
        const float x = s[j] * scale + (m ? m[j] : 0.f);
        s[j] = x;
        mx = x > mx ? x : mx;
    }
    if (mx == -INFINITY || mx != mx) {
        memset(s, 0, (size_t)width * sizeof(float));
        return 0.f;
    }
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sumv = _mm256_setzero_ps();
    for (int64_t j = 0; j < kv; j += 8) {
        const __m256 e = KFN(co_exp_nonpos8)(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        sumv = _mm256_add_ps(sumv, e);
        _mm256_storeu_ps(s + j, e);
    }
    float sum = KFN(co_hsum8)(sumv);
    for (int64_t j = kv; j < keys; j++) {
        const float x = s[j] - mx;
        const float e = x < -87.33654f ? 0.f : expf(x);
        sum += e;
        s[j] = e;
    }
    if (width > keys)
        memset(s + keys, 0, (size_t)(width - keys) * sizeof(float));
    return 1.f / sum;
}
#endif /* AVX-512 / AVX2 block and softmax */

/* k (nk rows of d floats, row stride ks) -> kp[t][j] = k[j][t], keys zero padded to nk_p */
static void KFN(co_f32_pack_k)(const float *k, int64_t ks, int64_t nk, int64_t d, int64_t nk_p, float *kp) {
    for (int64_t j = 0; j < nk; j++) {
        const float *row = k + j * ks;
        for (int64_t t = 0; t < d; t++)
            kp[t * nk_p + j] = row[t];
    }
    if (nk_p > nk)
        for (int64_t t = 0; t < d; t++)
            memset(kp + t * nk_p + nk, 0, (size_t)(nk_p - nk) * sizeof(float));
}

/* v (nk rows of dv floats, row stride vs) -> vp, rows of dv_p floats, zero padded */
static void KFN(co_f32_pack_v)(const float *v, int64_t vs, int64_t nk, int64_t dv, int64_t dv_p, float *vp) {
    for (int64_t j = 0; j < nk; j++) {
        memcpy(vp + j * dv_p, v + j * vs, (size_t)dv * sizeof(float));
        memset(vp + j * dv_p + dv, 0, (size_t)(dv_p - dv) * sizeof(float));
    }
}

/* one (batch, head): k packed (kp), v at vb with row stride vbs (in place or packed) */
static void KFN(co_f32_head)(const float *q, int64_t qs, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale,
                             int causal, const float *mask, int64_t ms, float *out, int64_t os, const float *kp,
                             const float *vb, int64_t vbs, float *qb, float *sb, float *ob) {
    const int64_t nk_p = KFN(co_round_up)(nk, 32), dv_p = KFN(co_round_up)(dv, 32);
    for (int64_t i0 = 0; i0 < nq; i0 += CO_F32_MR) {
        const int64_t rows = nq - i0 < CO_F32_MR ? nq - i0 : CO_F32_MR;
        /* the block's queries: read where they lie when whole, else copied (padded rows are zeros:
         * a finite softmax, never written out) */
        const float *qa = q + i0 * qs;
        int64_t lda = qs;
        if (rows < CO_F32_MR) {
            memset(qb, 0, (size_t)CO_F32_MR * d * sizeof(float));
            for (int64_t r = 0; r < rows; r++)
                memcpy(qb + r * d, q + (i0 + r) * qs, (size_t)d * sizeof(float));
            qa = qb;
            lda = d;
        }
        /* causal: the keys past the block's last query are neither scored nor read */
        const int64_t seen = causal ? (nk < i0 + CO_F32_MR ? nk : i0 + CO_F32_MR) : nk;
        for (int64_t n0 = 0; n0 < seen; n0 += 32)
            KFN(co_f32_block)(qa, lda, kp + n0, nk_p, d, sb + n0, nk_p, NULL);
        float inv[CO_F32_MR];
        for (int64_t r = 0; r < CO_F32_MR; r++) {
            const int64_t keys = causal && i0 + r + 1 < nk ? i0 + r + 1 : nk;
            inv[r] = KFN(co_f32_softmax_row)(sb + r * nk_p, keys, seen, scale,
                                             (mask && r < rows) ? mask + (i0 + r) * ms : NULL);
        }
        for (int64_t c0 = 0; c0 < dv_p; c0 += 32) {
            if (rows == CO_F32_MR && c0 + 32 <= dv) {   /* straight into the output */
                KFN(co_f32_block)(sb, nk_p, vb + c0, vbs, seen, out + i0 * os + c0, os, inv);
            } else {
                KFN(co_f32_block)(sb, nk_p, vb + c0, vbs, seen, ob, 32, inv);
                KFN(co_copy_block_rows)(out + i0 * os + c0, os, ob, rows, dv - c0 < 32 ? dv - c0 : 32);
            }
        }
    }
}
#endif

int64_t KFN(f32_attention)(const float *q, int64_t q_len, const int64_t *qs, const float *k, int64_t k_len,
                           const int64_t *ks, const float *v, int64_t v_len, const int64_t *vs, int64_t B,
                           int64_t H, int64_t Hk, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale,
                           int causal, const float *mask, int64_t mask_len, const int64_t *ms, float *out,
                           int64_t out_len, const int64_t *os, int nthreads) {
#if !defined(CO_VARIANT_AVX512) && !defined(CO_VARIANT_AVX2)
    CO_ATTENTION_UNUSED();
    (void)Hk;
    (void)causal;
    return CO_ERR_UNSUPPORTED_AMX;
#else
    int64_t status = KFN(co_attention_check)(q, q_len, qs, k, k_len, ks, v, v_len, vs, B, H, Hk, nq, nk, d, dv,
                                             scale, mask, mask_len, ms, out, out_len, os, nthreads);
    if (status != 1)
        return status;
    const int64_t nk_p = KFN(co_round_up)(nk, 32), dv_p = KFN(co_round_up)(dv, 32);
    const int v_in_place = dv % 32 == 0;
    /* per thread: kp, vp (unless v is read in place), qb, sb, ob, each 64-byte aligned */
    const size_t sizes[5] = {(size_t)d * nk_p * 4, v_in_place ? 0 : (size_t)nk * dv_p * 4,
                             (size_t)CO_F32_MR * d * 4, (size_t)CO_F32_MR * nk_p * 4, (size_t)CO_F32_MR * 32 * 4};
    size_t offs[6];
    KFN(co_buffer_offsets)(sizes, 5, offs);
    const int64_t tasks = B * H;
    int nt = tasks < nthreads ? (int)tasks : nthreads;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        int64_t lo, hi;
        char *buf = KFN(co_thread_share)(tasks, offs[5], &lo, &hi);
        if (lo < hi && buf == NULL) {
            failed = 1;
        } else if (lo < hi) {
            float *kp = (float *)(buf + offs[0]), *vp = (float *)(buf + offs[1]);
            int64_t packed = -1;   /* the (batch, kv head) whose k (and v) are in kp / vp */
            for (int64_t t = lo; t < hi; t++) {
                const int64_t b = t / H, h = t % H, hk = h / (H / Hk);
                const float *vh = v + b * vs[0] + hk * vs[1];
                if (b * Hk + hk != packed) {   /* grouped query heads share their kv head's packing */
                    KFN(co_f32_pack_k)(k + b * ks[0] + hk * ks[1], ks[2], nk, d, nk_p, kp);
                    if (!v_in_place)
                        KFN(co_f32_pack_v)(vh, vs[2], nk, dv, dv_p, vp);
                    packed = b * Hk + hk;
                }
                const float *mb = mask ? mask + b * ms[0] + h * ms[1] : NULL;
                KFN(co_f32_head)(q + b * qs[0] + h * qs[1], qs[2], nq, nk, d, dv, scale, causal, mb, mask ? ms[2] : 0,
                                 out + b * os[0] + h * os[1], os[2], kp, v_in_place ? vh : vp,
                                 v_in_place ? vs[2] : dv_p, (float *)(buf + offs[2]), (float *)(buf + offs[3]),
                                 (float *)(buf + offs[4]));
            }
            free(buf);
        }
    }
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
#endif
}
