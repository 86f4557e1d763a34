/* Fused bf16 attention on AVX512_BF16 dot products (cpu_opt.backends.attention.dpbf16_attention),
 * for CPUs with AVX512_BF16 and no AMX tiles (AMD Zen 4 and Zen 5, Intel Cooper Lake): the AMX
 * kernel's algorithm and operands (amx_attention.c, whose packing, softmax and bounds checks it
 * shares), with its two products on VDPBF16PS instead of tiles:
 *
 *   out[b, h, i, :] = sum_j p[i, j] v[b, h, j, :],  p = softmax_j(scale * <q[b, h, i], k[b, h, j]> + mask[b, h, i, j])
 *
 * q, k, v bf16 read where they lie (last dimension dense, any other strides), out float32 written
 * with its own strides, mask float32 (NULL: none; strides 0 where it broadcasts). k and v may have
 * fewer heads (Hk, dividing H: grouped-query attention, query head h reading kv head h / (H / Hk)).
 * causal: query i sees keys j <= i (torch's is_causal), the keys past a block's last query skipped.
 * Per (b, h) task: k and v packed into the pair-interleaved layout (key pairs for v, dimension pairs
 * for k), once per kv head a thread meets;
 * then per block of 12 queries the scores (12 x 32 keys per register block, float32), the softmax
 * of each row (bf16 probabilities, rounded to nearest even, normalised afterwards on the output
 * row as a flash kernel does; an all -inf row gives zeros) and p @ v (12 x 32 output dimensions per
 * register block). Returns CO_ERR_UNSUPPORTED_AMX (the "no such instructions here" status) outside
 * the avx512 variant or on a CPU without AVX512_BF16.
 *
 * dpbf16_attention_bf16out: the same, its output bf16 (each float rounded to nearest even as torch's
 * .to(torch.bfloat16) does, NaN kept NaN) as each block of 12 rows x 32 dimensions is done: what a bf16
 * graph wants, without a float32 output to write and read again. */

#if defined(CO_VARIANT_AVX512)
#define CO_DP_MR 12   /* query rows per register block: 12 x 2 accumulators of 16 floats */

/* c[r][0..31] = rs[r] * sum_t <a[r][2t], a[r][2t + 1]> . bp[t][0..31] for r < CO_DP_MR: a's rows
 * at stride lda (bf16 elements), bp's pairs (uint32: two bf16) at row stride ldb, c's rows at
 * stride ldc (floats); rs NULL: no row scale */
__attribute__((target("avx512bf16")))
static inline void KFN(co_dp_block)(const uint16_t *a, int64_t lda, const uint32_t *bp, int64_t ldb, int64_t pairs,
                                    float *c, int64_t ldc, const float *rs) {
    __m512 acc[CO_DP_MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < CO_DP_MR; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < pairs; t++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(bp + t * ldb));
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(bp + t * ldb + 16));
#pragma GCC unroll 12
        for (int r = 0; r < CO_DP_MR; r++) {
            uint32_t w;
            memcpy(&w, a + r * lda + 2 * t, 4);
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)w);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
        }
    }
    if (rs) {
#pragma GCC unroll 12
        for (int r = 0; r < CO_DP_MR; r++) {
            acc[r][0] = _mm512_mul_ps(acc[r][0], _mm512_set1_ps(rs[r]));
            acc[r][1] = _mm512_mul_ps(acc[r][1], _mm512_set1_ps(rs[r]));
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < CO_DP_MR; r++) {
        _mm512_storeu_ps(c + r * ldc, acc[r][0]);
        _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
    }
}

/* the first `rows` rows of a 32-float-wide block buffer, w <= 32 floats of each, to bf16 out (row stride
 * os elements): rounded to nearest even, NaN as the quiet NaN 0x7FC0 (torch's conversion) */
static inline void KFN(co_store_block_rows_bf16)(uint16_t *out, int64_t os, const float *ob, int64_t rows, int64_t w) {
    const __mmask16 m0 = w >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << w) - 1u);
    const __mmask16 m1 = w >= 32 ? (__mmask16)0xFFFF : (w <= 16 ? (__mmask16)0 : (__mmask16)((1u << (w - 16)) - 1u));
    const __m256i qnan = _mm256_set1_epi16(0x7FC0);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 a = _mm512_loadu_ps(ob + r * 32), b = _mm512_loadu_ps(ob + r * 32 + 16);
        const __m256i ha = _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), KFN(co_to_bf16x16)(a), qnan);
        const __m256i hb = _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q), KFN(co_to_bf16x16)(b), qnan);
        _mm256_mask_storeu_epi16(out + r * os, m0, ha);
        if (m1)
            _mm256_mask_storeu_epi16(out + r * os + 16, m1, hb);
    }
}

/* one (batch, head): k and v already packed (kp, vp); the output float32 (out) or bf16 (out16 non-NULL,
 * at the same element offsets) */
__attribute__((target("avx512bf16")))
static void KFN(co_dp_head)(const uint16_t *q, int64_t qs, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale,
                            int causal, const float *mask, int64_t ms, float *out, int64_t os,
                            const uint32_t *kp, const uint16_t *vp, uint16_t *qb, float *sb, uint16_t *pb, float *ob,
                            uint16_t *out16) {
    const int64_t nk_p = KFN(co_round_up)(nk, 32), d_p = KFN(co_round_up)(d, 2), dv_p = KFN(co_round_up)(dv, 32);
    for (int64_t i0 = 0; i0 < nq; i0 += CO_DP_MR) {
        const int64_t rows = nq - i0 < CO_DP_MR ? nq - i0 : CO_DP_MR;
        /* the block's queries: read where they lie when whole, else copied zero padded (a padded
         * query row scores 0 against every key: a finite softmax, never written out) */
        const uint16_t *qa = q + i0 * qs;
        int64_t lda = qs;
        if (rows < CO_DP_MR || d != d_p) {
            memset(qb, 0, (size_t)CO_DP_MR * d_p * sizeof(uint16_t));
            for (int64_t r = 0; r < rows; r++)
                memcpy(qb + r * d_p, q + (i0 + r) * qs, (size_t)d * sizeof(uint16_t));
            qa = qb;
            lda = d_p;
        }
        /* causal (query i sees keys j <= i, torch's top-left alignment): the keys past the block's
         * last query are neither scored nor read */
        const int64_t seen = causal ? (nk < i0 + CO_DP_MR ? nk : i0 + CO_DP_MR) : nk;
        const int64_t n_hi = KFN(co_round_up)(seen, 32);
        for (int64_t n0 = 0; n0 < n_hi; n0 += 32)
            KFN(co_dp_block)(qa, lda, kp + n0, nk_p, d_p / 2, sb + n0, nk_p, NULL);
        float inv[CO_DP_MR];
        for (int64_t r = 0; r < CO_DP_MR; r++) {
            const int64_t keys = causal && i0 + r + 1 < nk ? i0 + r + 1 : nk;
            inv[r] = KFN(co_amx_softmax_row)(sb + r * nk_p, keys, n_hi, scale,
                                             (mask && r < rows) ? mask + (i0 + r) * ms : NULL, pb + r * nk_p);
        }
        for (int64_t c0 = 0; c0 < dv_p; c0 += 32) {
            if (out16) {   /* bf16 output: the block in ob, then its rows rounded into out16 */
                KFN(co_dp_block)(pb, nk_p, (const uint32_t *)vp + c0, dv_p, n_hi / 2, ob, 32, inv);
                if (c0 < dv)
                    KFN(co_store_block_rows_bf16)(out16 + i0 * os + c0, os, ob, rows, dv - c0 < 32 ? dv - c0 : 32);
            } else if (rows == CO_DP_MR && c0 + 32 <= dv) {   /* straight into the output */
                KFN(co_dp_block)(pb, nk_p, (const uint32_t *)vp + c0, dv_p, n_hi / 2, out + i0 * os + c0, os, inv);
            } else {
                KFN(co_dp_block)(pb, nk_p, (const uint32_t *)vp + c0, dv_p, n_hi / 2, ob, 32, inv);
                KFN(co_copy_block_rows)(out + i0 * os + c0, os, ob, rows, dv - c0 < 32 ? dv - c0 : 32);
            }
        }
    }
}
#endif

/* both entry points: exactly one of out (float32) and out16 (bf16) is used; out_len counts elements */
static int64_t KFN(co_dpbf16_attention)(const uint16_t *q, int64_t q_len, const int64_t *qs, const uint16_t *k,
                                        int64_t k_len, const int64_t *ks, const uint16_t *v, int64_t v_len,
                                        const int64_t *vs, int64_t B, int64_t H, int64_t Hk, int64_t nq, int64_t nk,
                                        int64_t d, int64_t dv, float scale, int causal, const float *mask,
                                        int64_t mask_len, const int64_t *ms, float *out, uint16_t *out16,
                                        int64_t out_len, const int64_t *os, int nthreads) {
#if !defined(CO_VARIANT_AVX512)
    CO_ATTENTION_UNUSED();
    (void)Hk;
    (void)causal;
    (void)out16;
    return CO_ERR_UNSUPPORTED_AMX;
#else
    int64_t status = KFN(co_attention_check)(q, q_len, qs, k, k_len, ks, v, v_len, vs, B, H, Hk, nq, nk, d, dv,
                                             scale, mask, mask_len, ms, out16 ? (const float *)(const void *)out16 : out,
                                             out_len, os, nthreads);
    if (status != 1)
        return status;
    if (!__builtin_cpu_supports("avx512bf16"))
        return CO_ERR_UNSUPPORTED_AMX;
    const int64_t nk_p = KFN(co_round_up)(nk, 32), d_p = KFN(co_round_up)(d, 2), dv_p = KFN(co_round_up)(dv, 32);
    /* per thread: kp, vp, qb, sb, pb, ob, each 64-byte aligned */
    const size_t sizes[6] = {(size_t)(d_p / 2) * nk_p * 4, (size_t)nk_p * dv_p * 2, (size_t)CO_DP_MR * d_p * 2,
                             (size_t)CO_DP_MR * nk_p * 4, (size_t)CO_DP_MR * nk_p * 2, (size_t)CO_DP_MR * 32 * 4};
    size_t offs[7];
    KFN(co_buffer_offsets)(sizes, 6, offs);
    const int64_t tasks = B * H;
    int nt = tasks < nthreads ? (int)tasks : nthreads;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        int64_t lo, hi;
        char *buf = KFN(co_thread_share)(tasks, offs[6], &lo, &hi);
        if (lo < hi && buf == NULL) {
            failed = 1;
        } else if (lo < hi) {
            uint32_t *kp = (uint32_t *)(buf + offs[0]);
            uint16_t *vp = (uint16_t *)(buf + offs[1]);
            int64_t packed = -1;   /* the (batch, kv head) whose k and v are in kp / vp */
            for (int64_t t = lo; t < hi; t++) {
                const int64_t b = t / H, h = t % H, hk = h / (H / Hk);
                if (b * Hk + hk != packed) {   /* grouped query heads share their kv head's packing */
                    KFN(co_pack_k)(k + b * ks[0] + hk * ks[1], ks[2], nk, d, nk_p, d_p, kp);
                    KFN(co_pack_v)(v + b * vs[0] + hk * vs[1], vs[2], nk, dv, nk_p, dv_p, vp);
                    packed = b * Hk + hk;
                }
                const float *mb = mask ? mask + b * ms[0] + h * ms[1] : NULL;
                const int64_t oo = b * os[0] + h * os[1];
                KFN(co_dp_head)(q + b * qs[0] + h * qs[1], qs[2], nq, nk, d, dv, scale, causal, mb,
                                mask ? ms[2] : 0, out16 ? NULL : out + oo, os[2], kp, vp,
                                (uint16_t *)(buf + offs[2]), (float *)(buf + offs[3]), (uint16_t *)(buf + offs[4]),
                                (float *)(buf + offs[5]), out16 ? out16 + oo : NULL);
            }
            free(buf);
        }
    }
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
#endif
}

int64_t KFN(dpbf16_attention)(const uint16_t *q, int64_t q_len, const int64_t *qs, const uint16_t *k, int64_t k_len,
                              const int64_t *ks, const uint16_t *v, int64_t v_len, const int64_t *vs, int64_t B,
                              int64_t H, int64_t Hk, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale,
                              int causal, const float *mask, int64_t mask_len, const int64_t *ms, float *out,
                              int64_t out_len, const int64_t *os, int nthreads) {
    return KFN(co_dpbf16_attention)(q, q_len, qs, k, k_len, ks, v, v_len, vs, B, H, Hk, nq, nk, d, dv, scale, causal,
                                    mask, mask_len, ms, out, NULL, out_len, os, nthreads);
}

int64_t KFN(dpbf16_attention_bf16out)(const uint16_t *q, int64_t q_len, const int64_t *qs, const uint16_t *k,
                                      int64_t k_len, const int64_t *ks, const uint16_t *v, int64_t v_len,
                                      const int64_t *vs, int64_t B, int64_t H, int64_t Hk, int64_t nq, int64_t nk,
                                      int64_t d, int64_t dv, float scale, int causal, const float *mask,
                                      int64_t mask_len, const int64_t *ms, uint16_t *out, int64_t out_len,
                                      const int64_t *os, int nthreads) {
    return KFN(co_dpbf16_attention)(q, q_len, qs, k, k_len, ks, v, v_len, vs, B, H, Hk, nq, nk, d, dv, scale, causal,
                                    mask, mask_len, ms, NULL, out, out_len, os, nthreads);
}
