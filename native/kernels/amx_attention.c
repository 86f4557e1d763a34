/* Fused bf16 attention on AMX tiles (cpu_opt.backends.attention.amx_attention), one call for a
 * whole (batch, heads) attention:
 *
 *   out[b, h, i, :] = sum_j p[i, j] v[b, h, j, :],  p = softmax_j(scale * <q[b, h, i], k[b, h, j]> + mask[b, h, i, j])
 *
 * q, k, v: bfloat16, element (b, h, i, d) at b * s[0] + h * s[1] + i * s[2] + d (the last
 * dimension dense; any other strides: the strided views of a fused query/key/value projection are
 * read where they lie). out: float32 with strides os[] the same way. mask: float32 (NULL: none),
 * strides 0 where it broadcasts, its last dimension dense. Every operand's farthest element is
 * checked against its length (in elements) before anything is read or written.
 *
 * Per (b, h) task: k is packed once into the pair-interleaved ("VNNI") layout a B tile takes, and
 * v too, both zero-padded (keys to a multiple of 64, q/k's dimension to a multiple of 32, v's to a
 * multiple of 64); then for each block of 16 queries: the scores (16 x keys, float32, TDPBF16PS),
 * the scale, the mask and the softmax over the real keys (padded ones get probability 0) written
 * as bf16 (rounded to nearest even) before the normalisation, and p @ v (TDPBF16PS) written to the
 * output, whose rows are then divided by the sums of the exponentials, as a flash kernel does. An
 * all -inf row gives zeros.
 *
 * Only in the avx512 variant, and only on a CPU with AMX-BF16 whose kernel grants this process the
 * tile data state (arch_prctl ARCH_REQ_XCOMP_PERM); elsewhere, or when that request fails, the
 * kernel returns CO_ERR_UNSUPPORTED and the caller runs another attention. */

#ifndef CO_AMX_ATT_DEFINED
#define CO_AMX_ATT_DEFINED
#define CO_ERR_UNSUPPORTED_AMX -6
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
static int co_amx_permission(void) {
    /* 1 granted, 0 refused; asked once per process (oneDNN asks the same for its own AMX kernels) */
    static int state = -1;
#if defined(__linux__) && defined(__x86_64__) && defined(SYS_arch_prctl)
    if (state < 0) {
        int ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        state = ok;
    }
    return state;
#else
    return 0;
#endif
}
#define CO_AMX_KEYS_MAX 16384
#define CO_AMX_DIM_MAX 512
/* the arguments every fused attention kernel shares, unused outside the avx512 variant */
#define CO_ATTENTION_UNUSED()                                                                                      \
    do {                                                                                                           \
        (void)q; (void)q_len; (void)qs; (void)k; (void)k_len; (void)ks; (void)v; (void)v_len; (void)vs; (void)B;  \
        (void)H; (void)nq; (void)nk; (void)d; (void)dv; (void)scale; (void)mask; (void)mask_len; (void)ms;       \
        (void)out; (void)out_len; (void)os; (void)nthreads;                                                      \
    } while (0)
#endif

static inline int64_t KFN(co_round_up)(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

#if defined(CO_VARIANT_AVX512)
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} KFN(co_tilecfg);

/* exp for the softmax: x <= 0 here (scores minus the row maximum); -inf and anything below -88
 * give 0 */
static inline __m512 KFN(co_exp_nonpos16)(__m512 x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

static inline __m256i KFN(co_to_bf16x16)(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* s[0..keys) -> scale s + m in place (m NULL: no mask); returns their maximum */
static float KFN(co_scale_mask_max)(float *s, int64_t keys, float scale, const float *m) {
    const int64_t kv = keys / 16 * 16;
    __m512 sv = _mm512_set1_ps(scale), mxv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < kv; j += 16) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), sv);
        if (m)
            x = _mm512_add_ps(x, _mm512_loadu_ps(m + j));
        _mm512_storeu_ps(s + j, x);
        mxv = _mm512_max_ps(mxv, x);
    }
    float mx = _mm512_reduce_max_ps(mxv);
    for (int64_t j = kv; j < keys; j++) {
        float x = s[j] * scale + (m ? m[j] : 0.f);
        s[j] = x;
        mx = x > mx ? x : mx;
    }
    return mx;
}

/* one row: s (keys_p floats, the first `keys` real) -> p = bf16(exp(scale s + m - max)) (keys_p
 * values, padded keys 0); returns 1 / sum of the exponentials (the output row is scaled by it after
 * p @ v, as a flash kernel does), 0 for a row whose every entry is -inf (or NaN): p is then 0 */
static float KFN(co_amx_softmax_row)(float *s, int64_t keys, int64_t keys_p, float scale, const float *m, uint16_t *p) {
    const int64_t kv = keys / 16 * 16;
    const float mx = KFN(co_scale_mask_max)(s, keys, scale, m);
    if (mx == -INFINITY || mx != mx) {
        memset(p, 0, (size_t)keys_p * sizeof(uint16_t));
        return 0.f;
    }
    __m512 mv = _mm512_set1_ps(mx), sumv = _mm512_setzero_ps();
    for (int64_t j = 0; j < kv; j += 16) {
        __m512 e = KFN(co_exp_nonpos16)(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        sumv = _mm512_add_ps(sumv, e);
        _mm256_storeu_si256((__m256i *)(p + j), KFN(co_to_bf16x16)(e));
    }
    float sum = _mm512_reduce_add_ps(sumv);
    for (int64_t j = kv; j < keys; j++) {
        float x = s[j] - mx;
        float e = x < -87.33654f ? 0.f : expf(x);
        sum += e;
        uint32_t u;
        memcpy(&u, &e, 4);
        u += 0x7FFFu + ((u >> 16) & 1u);
        p[j] = (uint16_t)(u >> 16);
    }
    for (int64_t j = keys; j < keys_p; j++)
        p[j] = 0;
    return 1.f / sum;
}

/* k (nk rows of d bf16, row stride ks) -> kp[pair][key] (uint32: dims 2 pair, 2 pair + 1), the
 * transpose a B tile of k^T takes; zero padded to d_p / 2 pairs x nk_p keys */
static void KFN(co_pack_k)(const uint16_t *k, int64_t ks, int64_t nk, int64_t d, int64_t nk_p, int64_t d_p,
                           uint32_t *kp) {
    memset(kp, 0, (size_t)(d_p / 2) * nk_p * sizeof(uint32_t));
    const int64_t pairs = d / 2;
    if ((ks & 1) == 0 && ks * 2 * 16 < ((int64_t)1 << 31)) {
        /* 16 keys at a time: one gather per pair of dimensions */
        const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32((int)(ks * 2)));
        for (int64_t j0 = 0; j0 < nk; j0 += 16) {
            __mmask16 valid = nk - j0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nk - j0)) - 1u);
            const char *base = (const char *)(k + j0 * ks);
            for (int64_t t = 0; t < pairs; t++) {
                __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, base + 4 * t, 1);
                _mm512_storeu_si512((void *)(kp + t * nk_p + j0), g);
            }
        }
    } else {
        for (int64_t j = 0; j < nk; j++)
            for (int64_t t = 0; t < pairs; t++) {
                uint32_t w;
                memcpy(&w, k + j * ks + 2 * t, 4);
                kp[t * nk_p + j] = w;
            }
    }
    if (d & 1)
        for (int64_t j = 0; j < nk; j++)
            kp[pairs * nk_p + j] = k[j * ks + d - 1];
}

/* v (nk rows of dv bf16, row stride vs) -> vp[pair of keys][dim][2], zero padded to nk_p x dv_p */
static void KFN(co_pack_v)(const uint16_t *v, int64_t vs, int64_t nk, int64_t dv, int64_t nk_p, int64_t dv_p,
                           uint16_t *vp) {
    memset(vp, 0, (size_t)nk_p * dv_p * sizeof(uint16_t));
    const __m512i lo_idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi_idx = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t j = 0; j < nk; j += 2) {
        const uint16_t *r0 = v + j * vs, *r1 = j + 1 < nk ? v + (j + 1) * vs : NULL;
        uint16_t *dst = vp + (j / 2) * dv_p * 2;
        for (int64_t c = 0; c < dv; c += 32) {
            __mmask32 m = dv - c >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (dv - c)) - 1u);
            __m512i a = _mm512_maskz_loadu_epi16(m, r0 + c);
            __m512i b = r1 ? _mm512_maskz_loadu_epi16(m, r1 + c) : _mm512_setzero_si512();
            __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
            _mm512_storeu_si512((void *)(dst + 2 * c), _mm512_permutex2var_epi64(lo, lo_idx, hi));
            _mm512_storeu_si512((void *)(dst + 2 * c + 32), _mm512_permutex2var_epi64(lo, hi_idx, hi));
        }
    }
}

/* tiles 0-3 = the 32 x 32 float32 product of a (32 rows of k bf16, row stride a_stride bytes: tiles 4, 5)
 * and b in the pair-interleaved layout (k / 2 pair rows of ldb bf16, the block's first 32 columns:
 * tiles 6, 7), k a multiple of 32 */
__attribute__((target("amx-tile,amx-bf16")))
static inline void KFN(co_tiles_2x2)(const uint16_t *a, int64_t a_stride, const uint16_t *b, int64_t ldb, int64_t k) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < k; kc += 32) {
        const uint16_t *bb = b + (kc / 2) * ldb;
        _tile_loadd(4, a + kc, a_stride);
        _tile_loadd(5, (const char *)(a + kc) + 16 * a_stride, a_stride);
        _tile_loadd(6, bb, ldb * 2);
        _tile_loadd(7, bb + 32, ldb * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

__attribute__((target("amx-tile,amx-bf16")))
static void KFN(co_amx_head)(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t qs, int64_t ks,
                             int64_t vs, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale,
                             const float *mask, int64_t ms, float *out, int64_t os,
                             uint16_t *kp, uint16_t *vp, uint16_t *qb, float *sb, uint16_t *pb, float *ob) {
    const int64_t nk_p = KFN(co_round_up)(nk, 64), d_p = KFN(co_round_up)(d, 32), dv_p = KFN(co_round_up)(dv, 64);
    KFN(co_pack_k)(k, ks, nk, d, nk_p, d_p, (uint32_t *)kp);
    KFN(co_pack_v)(v, vs, nk, dv, nk_p, dv_p, vp);
    const int direct_q = d == d_p, direct_out = (dv & 15) == 0;
    for (int64_t i0 = 0; i0 < nq; i0 += 32) {
        const int64_t rows = nq - i0 < 32 ? nq - i0 : 32;
        /* the 32-query block: read where it lies when whole, else copied zero padded */
        const uint16_t *qa = q + i0 * qs;
        int64_t qstride = qs * 2;
        if (!(direct_q && rows == 32)) {
            memset(qb, 0, (size_t)32 * d_p * sizeof(uint16_t));
            for (int64_t r = 0; r < rows; r++)
                memcpy(qb + r * d_p, q + (i0 + r) * qs, (size_t)d * sizeof(uint16_t));
            qa = qb;
            qstride = d_p * 2;
        }
        /* scores, 32 queries x 32 keys per step: C = tiles 0-3, A = 4-5, B = 6-7 */
        for (int64_t n0 = 0; n0 < nk_p; n0 += 32) {
            KFN(co_tiles_2x2)(qa, qstride, kp + n0 * 2, nk_p * 2, d_p);
            _tile_stored(0, sb + n0, nk_p * 4);
            _tile_stored(1, sb + n0 + 16, nk_p * 4);
            _tile_stored(2, sb + 16 * nk_p + n0, nk_p * 4);
            _tile_stored(3, sb + 16 * nk_p + n0 + 16, nk_p * 4);
        }
        float inv[32];
        for (int64_t r = 0; r < 32; r++)
            inv[r] = KFN(co_amx_softmax_row)(sb + r * nk_p, nk, nk_p, scale,
                                             (mask && r < rows) ? mask + (i0 + r) * ms : NULL, pb + r * nk_p);
        /* p @ v, 32 queries x 32 output dimensions per step */
        const int whole = direct_out && rows == 32;
        for (int64_t c0 = 0; c0 < dv_p; c0 += 32) {
            KFN(co_tiles_2x2)(pb, nk_p * 2, vp + c0 * 2, dv_p * 2, nk_p);
            if (whole && c0 + 32 <= dv) {   /* straight into the output */
                float *o = out + i0 * os + c0;
                _tile_stored(0, o, os * 4);
                _tile_stored(1, o + 16, os * 4);
                _tile_stored(2, o + 16 * os, os * 4);
                _tile_stored(3, o + 16 * os + 16, os * 4);
            } else {
                _tile_stored(0, ob + c0, dv_p * 4);
                _tile_stored(1, ob + c0 + 16, dv_p * 4);
                _tile_stored(2, ob + 16 * dv_p + c0, dv_p * 4);
                _tile_stored(3, ob + 16 * dv_p + c0 + 16, dv_p * 4);
                int64_t c1 = c0 + 32 < dv ? c0 + 32 : dv;
                for (int64_t r = 0; r < rows && c0 < dv; r++)
                    memcpy(out + (i0 + r) * os + c0, ob + r * dv_p + c0, (size_t)(c1 - c0) * sizeof(float));
            }
        }
        /* the softmax's normalisation, on the output rows */
        for (int64_t r = 0; r < rows; r++) {
            float *o = out + (i0 + r) * os;
            __m512 iv = _mm512_set1_ps(inv[r]);
            int64_t c = 0;
            for (; c + 16 <= dv; c += 16)
                _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), iv));
            for (; c < dv; c++)
                o[c] *= inv[r];
        }
    }
}

__attribute__((target("amx-tile,amx-bf16")))
static void KFN(co_amx_config)(void) {
    KFN(co_tilecfg) cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    /* gcc 12 does not see ldtilecfg read all 64 bytes and drops the stores above without this */
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile,amx-bf16")))
static void KFN(co_amx_release)(void) { _tile_release(); }
#endif

/* the farthest element (b, h, i, last) of a 4-D operand, +1; -1 on a negative stride or size */
static int64_t KFN(co_extent4)(int64_t n0, int64_t n1, int64_t n2, int64_t n3, const int64_t *s) {
    if (n0 <= 0 || n1 <= 0 || n2 <= 0 || n3 <= 0)
        return 0;
    if (s[0] < 0 || s[1] < 0 || s[2] < 0)
        return -1;
    return (n0 - 1) * s[0] + (n1 - 1) * s[1] + (n2 - 1) * s[2] + n3;
}

#if defined(CO_VARIANT_AVX512) || defined(CO_VARIANT_AVX2)   /* shared with f32_attention.c's AVX2 kernel */
/* the arguments of a fused attention kernel (this one, dpbf16_attention.c's, f32_attention.c's; lengths in
 * elements of the operands' own type; k and v with Hk heads,
 * H / Hk query heads reading each): 1 when there is work and every operand's farthest element lies
 * within its length, else the status to return (CO_OK for an empty problem) */
static int64_t KFN(co_attention_check)(const void *q, int64_t q_len, const int64_t *qs, const void *k,
                                       int64_t k_len, const int64_t *ks, const void *v, int64_t v_len,
                                       const int64_t *vs, int64_t B, int64_t H, int64_t Hk, int64_t nq, int64_t nk, int64_t d,
                                       int64_t dv, float scale, const float *mask, int64_t mask_len, const int64_t *ms,
                                       const float *out, int64_t out_len, const int64_t *os, int nthreads) {
    if (B < 0 || H < 0 || Hk < 0 || nq < 0 || nk < 0 || d < 0 || dv < 0 || nthreads < 1 || !(scale == scale) ||
        nk > CO_AMX_KEYS_MAX || d > CO_AMX_DIM_MAX || dv > CO_AMX_DIM_MAX || qs == NULL || ks == NULL ||
        vs == NULL || os == NULL)
        return CO_ERR_BAD_ARGUMENT;
    if (B == 0 || H == 0 || nq == 0 || dv == 0)
        return CO_OK;
    if (Hk < 1 || H % Hk != 0 || nk == 0 || d == 0 || q == NULL || k == NULL || v == NULL || out == NULL || (mask != NULL && ms == NULL))
        return CO_ERR_BAD_ARGUMENT;
    int64_t eq = KFN(co_extent4)(B, H, nq, d, qs), ek = KFN(co_extent4)(B, Hk, nk, d, ks);
    int64_t ev = KFN(co_extent4)(B, Hk, nk, dv, vs), eo = KFN(co_extent4)(B, H, nq, dv, os);
    int64_t em = mask ? KFN(co_extent4)(B, H, nq, nk, ms) : 0;
    if (eq < 0 || ek < 0 || ev < 0 || eo < 0 || em < 0)
        return CO_ERR_BAD_ARGUMENT;
    if (eq > q_len || ek > k_len || ev > v_len || eo > out_len || (mask && em > mask_len))
        return CO_ERR_INDEX_OUT_OF_RANGE;
    return 1;
}
#endif

#if defined(CO_VARIANT_AVX512) || defined(CO_VARIANT_AVX2)   /* shared with f32_attention.c's AVX2 kernel */
/* offs[i] = where buffer i of n (sizes[i] bytes) starts, each 64-byte aligned; offs[n] = the total */
static void KFN(co_buffer_offsets)(const size_t *sizes, int n, size_t *offs) {
    offs[0] = 0;
    for (int i = 0; i < n; i++)
        offs[i + 1] = offs[i] + (sizes[i] + 63) / 64 * 64;
}

/* the first `rows` rows of a 32-float-wide block buffer, w <= 32 floats of each, to out (row stride os) */
static inline void KFN(co_copy_block_rows)(float *out, int64_t os, const float *ob, int64_t rows, int64_t w) {
    for (int64_t r = 0; r < rows && w > 0; r++)
        memcpy(out + r * os, ob + r * 32, (size_t)w * sizeof(float));
}

/* inside an omp parallel region: this thread's contiguous share [lo, hi) of `tasks` (no worksharing
 * construct: a thread whose buffer could not be allocated just reports it) and, when it has one, its
 * buffer of `bytes` (a multiple of 64), 64-byte aligned (NULL when it has no share or malloc failed) */
static char *KFN(co_thread_share)(int64_t tasks, size_t bytes, int64_t *lo, int64_t *hi) {
    int tid = 0, T = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    T = omp_get_num_threads();
#endif
    *lo = tasks * tid / T;
    *hi = tasks * (tid + 1) / T;
    return *lo < *hi ? (char *)aligned_alloc(64, bytes) : NULL;
}
#endif

int64_t KFN(amx_attention_bf16)(const uint16_t *q, int64_t q_len, const int64_t *qs, const uint16_t *k, int64_t k_len,
                                const int64_t *ks, const uint16_t *v, int64_t v_len, const int64_t *vs, int64_t B,
                                int64_t H, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale,
                                const float *mask, int64_t mask_len, const int64_t *ms, float *out, int64_t out_len,
                                const int64_t *os, int nthreads) {
#if !defined(CO_VARIANT_AVX512)
    CO_ATTENTION_UNUSED();
    return CO_ERR_UNSUPPORTED_AMX;
#else
    int64_t status = KFN(co_attention_check)(q, q_len, qs, k, k_len, ks, v, v_len, vs, B, H, H, nq, nk, d, dv, scale,
                                             mask, mask_len, ms, out, out_len, os, nthreads);
    if (status != 1)
        return status;
    if (!co_amx_permission())
        return CO_ERR_UNSUPPORTED_AMX;
    const int64_t nk_p = KFN(co_round_up)(nk, 64), d_p = KFN(co_round_up)(d, 32), dv_p = KFN(co_round_up)(dv, 64);
    const size_t kp_n = (size_t)d_p * nk_p, vp_n = (size_t)nk_p * dv_p;
    const size_t per_thread = kp_n * 2 + vp_n * 2 + (size_t)32 * d_p * 2 + (size_t)32 * nk_p * 4 +
                              (size_t)32 * nk_p * 2 + (size_t)32 * dv_p * 4 + 5 * 64;
    const int64_t tasks = B * H;
    int nt = tasks < nthreads ? (int)tasks : nthreads;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        int64_t lo, hi;
        char *buf = KFN(co_thread_share)(tasks, (per_thread + 63) / 64 * 64, &lo, &hi);
        if (lo < hi && buf == NULL) {
            failed = 1;
        } else if (lo < hi) {
            uint16_t *kp = (uint16_t *)buf;
            uint16_t *vp = (uint16_t *)(buf + ((kp_n * 2 + 63) / 64 * 64));
            uint16_t *qb = (uint16_t *)((char *)vp + ((vp_n * 2 + 63) / 64 * 64));
            float *sb = (float *)((char *)qb + ((32 * d_p * 2 + 63) / 64 * 64));
            uint16_t *pb = (uint16_t *)((char *)sb + ((32 * nk_p * 4 + 63) / 64 * 64));
            float *ob = (float *)((char *)pb + ((32 * nk_p * 2 + 63) / 64 * 64));
            KFN(co_amx_config)();
            for (int64_t t = lo; t < hi; t++) {
                int64_t b = t / H, h = t % H;
                const float *mb = mask ? mask + b * ms[0] + h * ms[1] : NULL;
                KFN(co_amx_head)(q + b * qs[0] + h * qs[1], k + b * ks[0] + h * ks[1], v + b * vs[0] + h * vs[1],
                                 qs[2], ks[2], vs[2], nq, nk, d, dv, scale, mb, mask ? ms[2] : 0,
                                 out + b * os[0] + h * os[1], os[2], kp, vp, qb, sb, pb, ob);
            }
            KFN(co_amx_release)();
            free(buf);
        }
    }
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
#endif
}
