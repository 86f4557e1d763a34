/* Template of the forward segment reduction (see segment.c). Parameters: CO_DT, CO_T, CO_ACC,
 * CO_LOAD, CO_STORE (feature dtype), CO_IT, CO_ISUF (index dtype). */

#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
/* max / min of one CSR row over features [c0, c0 + 8 NV) of float32 x, accumulators in registers
 * (no weights, no include_self, no winners: seg_maxmin_row_track keeps them). Returns 1 without
 * writing anything if a NaN was read (the caller runs the generic loop, whose NaN rules are
 * PyG's), else 0. */
static inline __attribute__((always_inline, unused)) int
KFN(CO_N3(seg_maxmin_row, CO_DT, CO_ISUF))(const int NV, const int is_max, const float *x, int64_t F,
                                            const CO_IT *col, int64_t s, int64_t end, int64_t e_stop, int64_t c0,
                                            float *o, uint64_t *wmask, int64_t W, int stream)
{
    const __m256 init = _mm256_set1_ps(is_max ? -INFINITY : INFINITY);
    __m256 acc[8], nan = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[v] = init;
    for (int64_t e = s; e < end; ++e) {
        if (c0 == 0 && e + CO_PF_DIST < e_stop) {
            const char *p_ = (const char *)(x + (int64_t)col[e + CO_PF_DIST] * F);
            for (int64_t k_ = 0; k_ < F * 4; k_ += 64) __builtin_prefetch(p_ + k_);
        }
        const float *xr = x + (int64_t)col[e] * F + c0;
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
            const __m256 xv = _mm256_loadu_ps(xr + 8 * v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
            acc[v] = is_max ? _mm256_max_ps(acc[v], xv) : _mm256_min_ps(acc[v], xv);
        }
    }
    if (_mm256_movemask_ps(nan)) return 1;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
        if (stream) _mm256_stream_ps(o + c0 + 8 * v, acc[v]);
        else _mm256_storeu_ps(o + c0 + 8 * v, acc[v]);
    }
    return 0;
}

/* seg_maxmin_row with the winners: each lane keeps, beside its running max (min), the position in
 * the row of the first edge that reached it (strict comparison, as the generic loop), in one pass
 * over the edges; then word c0 / 64 of each edge's winner mask gets bit j iff the edge won feature
 * j (none where the result is the identity: nothing won). Rows of up to 24 edges form each edge's
 * word by comparing the positions with the edge's, longer ones zero their words and set the bits
 * one by one. NaN is detected by a running sum per lane (one add an element; a NaN stays, and the
 * only false alarm, +inf and -inf in one lane, merely sends the row to the exact generic loop).
 * The AVX-512 build keeps 16 lanes a register with k-mask blends. The former second pass, which
 * re-gathered the row to find the winners by equality: 7.0 ms against 5.1 (this one) and 4.3 (no
 * winners) on the power-law graph of python -m bench gnn, 100k x 64, Zen 4, 2 threads.
 * Returns 1 without writing anything if a NaN was read, else 0. */
#define CO_MASK_COMPARE_MAX_DEG 24
#if defined(CO_VARIANT_AVX512)
static inline __attribute__((always_inline, unused)) int
KFN(CO_N3(seg_maxmin_row_track, CO_DT, CO_ISUF))(const int NV, const int is_max, const float *x, int64_t F,
                                                  const CO_IT *col, int64_t s, int64_t end, int64_t e_stop,
                                                  int64_t c0, float *o, uint64_t *wmask, int64_t W, int stream)
{
    const int NZ = NV / 2; /* 16-float registers */
    const __m512 init = _mm512_set1_ps(is_max ? -INFINITY : INFINITY);
    const __m512i one = _mm512_set1_epi32(1);
    __m512 acc[4], chk = _mm512_setzero_ps();
    __m512i at[4], ev = _mm512_setzero_si512(); /* ev: this edge's position in the row, in every lane */
#pragma GCC unroll 4
    for (int v = 0; v < NZ; ++v) { acc[v] = init; at[v] = _mm512_set1_epi32(-1); }
    for (int64_t e = s; e < end; ++e) {
        if (c0 == 0 && e + CO_PF_DIST < e_stop) {
            const char *p_ = (const char *)(x + (int64_t)col[e + CO_PF_DIST] * F);
            for (int64_t k_ = 0; k_ < F * 4; k_ += 64) __builtin_prefetch(p_ + k_);
        }
        const float *xr = x + (int64_t)col[e] * F + c0;
#pragma GCC unroll 4
        for (int v = 0; v < NZ; ++v) {
            const __m512 xv = _mm512_loadu_ps(xr + 16 * v);
            chk = _mm512_add_ps(chk, xv);
            const __mmask16 take = _mm512_cmp_ps_mask(xv, acc[v], is_max ? _CMP_GT_OQ : _CMP_LT_OQ);
            acc[v] = _mm512_mask_mov_ps(acc[v], take, xv);
            at[v] = _mm512_mask_mov_epi32(at[v], take, ev);
        }
        ev = _mm512_add_epi32(ev, one);
    }
    if (_mm512_cmp_ps_mask(chk, chk, _CMP_UNORD_Q)) return 1;
#pragma GCC unroll 4
    for (int v = 0; v < NZ; ++v) {
        if (stream && ((uintptr_t)o & 63) == 0) _mm512_stream_ps(o + c0 + 16 * v, acc[v]); /* whole lines only */
        else _mm512_storeu_ps(o + c0 + 16 * v, acc[v]);
    }
    uint64_t *m = wmask + s * W + c0 / 64;
    const int64_t deg = end - s;
    if (deg <= CO_MASK_COMPARE_MAX_DEG) {
        __m512i pos = _mm512_setzero_si512();
        for (int64_t k = 0; k < deg; ++k) {
            uint64_t bits = 0;
#pragma GCC unroll 4
            for (int v = 0; v < NZ; ++v) bits |= (uint64_t)_mm512_cmpeq_epi32_mask(at[v], pos) << (16 * v);
            m[k * W] = bits;
            pos = _mm512_add_epi32(pos, one);
        }
    } else {
        int32_t who[64];
#pragma GCC unroll 4
        for (int v = 0; v < NZ; ++v) _mm512_storeu_si512(who + 16 * v, at[v]);
        for (int64_t k = 0; k < deg; ++k) m[k * W] = 0;
        for (int j = 0; j < 16 * NZ; ++j)
            if (who[j] >= 0) m[(int64_t)who[j] * W] |= 1ull << j;
    }
    return 0;
}
#else
static inline __attribute__((always_inline, unused)) int
KFN(CO_N3(seg_maxmin_row_track, CO_DT, CO_ISUF))(const int NV, const int is_max, const float *x, int64_t F,
                                                  const CO_IT *col, int64_t s, int64_t end, int64_t e_stop,
                                                  int64_t c0, float *o, uint64_t *wmask, int64_t W, int stream)
{
    const __m256 init = _mm256_set1_ps(is_max ? -INFINITY : INFINITY);
    const __m256i one = _mm256_set1_epi32(1);
    __m256 acc[8], chk = _mm256_setzero_ps();
    __m256i at[8], ev = _mm256_setzero_si256(); /* ev: this edge's position in the row, in every lane */
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) { acc[v] = init; at[v] = _mm256_set1_epi32(-1); }
    for (int64_t e = s; e < end; ++e) {
        if (c0 == 0 && e + CO_PF_DIST < e_stop) {
            const char *p_ = (const char *)(x + (int64_t)col[e + CO_PF_DIST] * F);
            for (int64_t k_ = 0; k_ < F * 4; k_ += 64) __builtin_prefetch(p_ + k_);
        }
        const float *xr = x + (int64_t)col[e] * F + c0;
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
            const __m256 xv = _mm256_loadu_ps(xr + 8 * v);
            chk = _mm256_add_ps(chk, xv);
            const __m256 take = _mm256_cmp_ps(xv, acc[v], is_max ? _CMP_GT_OQ : _CMP_LT_OQ);
            acc[v] = _mm256_blendv_ps(acc[v], xv, take);
            at[v] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[v]), _mm256_castsi256_ps(ev), take));
        }
        ev = _mm256_add_epi32(ev, one);
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(chk, chk, _CMP_UNORD_Q))) return 1;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
        if (stream) _mm256_stream_ps(o + c0 + 8 * v, acc[v]);
        else _mm256_storeu_ps(o + c0 + 8 * v, acc[v]);
    }
    uint64_t *m = wmask + s * W + c0 / 64;
    const int64_t deg = end - s;
    if (deg <= CO_MASK_COMPARE_MAX_DEG) {
        __m256i pos = _mm256_setzero_si256();
        for (int64_t k = 0; k < deg; ++k) {
            uint64_t bits = 0;
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v)
                bits |= (uint64_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(at[v], pos))) << (8 * v);
            m[k * W] = bits;
            pos = _mm256_add_epi32(pos, one);
        }
    } else {
        int32_t who[64];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) _mm256_storeu_si256((__m256i *)(who + 8 * v), at[v]);
        for (int64_t k = 0; k < deg; ++k) m[k * W] = 0;
        for (int j = 0; j < 8 * NV; ++j)
            if (who[j] >= 0) m[(int64_t)who[j] * W] |= 1ull << j;
    }
    return 0;
}
#endif
#undef CO_MASK_COMPARE_MAX_DEG

/* sum / mean of one CSR row over features [c0, c0 + 8 NV) of float32 x (optionally weighted),
 * accumulators in registers, edges in order (the generic loop's order); mean divides by the
 * row's count as the generic loop does. */
static inline __attribute__((always_inline, unused)) void
KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(const int NV, const float *x, int64_t F, const CO_IT *col,
                                         const float *weight, int64_t s, int64_t end, int64_t e_stop,
                                         int64_t c0, int mean, float *o, int stream)
{
    __m256 acc[8];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t e = s; e < end; ++e) {
        if (c0 == 0 && e + CO_PF_DIST < e_stop) {
            const char *p_ = (const char *)(x + (int64_t)col[e + CO_PF_DIST] * F);
            for (int64_t k_ = 0; k_ < F * 4; k_ += 64) __builtin_prefetch(p_ + k_);
        }
        const float *xr = x + (int64_t)col[e] * F + c0;
        if (weight) {
            const __m256 w = _mm256_set1_ps(weight[e]);
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[v] = _mm256_add_ps(acc[v], _mm256_mul_ps(w, _mm256_loadu_ps(xr + 8 * v)));
        } else {
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[v] = _mm256_add_ps(acc[v], _mm256_loadu_ps(xr + 8 * v));
        }
    }
    if (mean) {
        const __m256 cnt = _mm256_set1_ps((float)(end - s));
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[v] = _mm256_div_ps(acc[v], cnt);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
        if (stream) _mm256_stream_ps(o + c0 + 8 * v, acc[v]);
        else _mm256_storeu_ps(o + c0 + 8 * v, acc[v]);
    }
}
#endif

#undef CO_SUM_FAST
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
#define CO_SUM_FAST 1
#else
#define CO_SUM_FAST 0
#endif

int64_t KFN(CO_N3(segment_reduce, CO_DT, CO_ISUF))(
    const int64_t *rowptr, int64_t n_rows, const CO_IT *col, const CO_T *weight,
    const CO_T *x, int64_t n_x, int64_t F, int reduce, const CO_T *self, int include_self,
    CO_T *out, int32_t *arg, uint64_t *wmask, int nthreads, int64_t *bad_pos)
{
    if (n_rows < 0 || n_x < 0 || F < 0 || nthreads < 1 || reduce < CO_RED_SUM || reduce > CO_RED_PROD ||
        !rowptr || (!out && n_rows * F > 0) || (!x && n_x * F > 0))
        return CO_ERR_BAD_ARGUMENT;
    /* every check before any write */
    int64_t b = KFN(check_rowptr)(rowptr, n_rows);
    if (b >= 0) { if (bad_pos) *bad_pos = b; return CO_ERR_UNSORTED; }
    const int64_t nnz = rowptr[n_rows];
    if (nnz > 0 && !col) return CO_ERR_BAD_ARGUMENT;
    b = KFN(CO_N2(first_out_of_range, CO_IT))(col, nnz, 0, n_x, nthreads);
    if (b >= 0) { if (bad_pos) *bad_pos = b; return CO_ERR_INDEX_OUT_OF_RANGE; }

    const int is_arg = (reduce == CO_RED_MAX || reduce == CO_RED_MIN);
    const int track = is_arg && (arg || wmask);
    const int64_t W = (F + 63) / 64; /* words of the winner mask per nonzero */
    /* max/min keep the winner relative to the row start in int32: refuse longer rows */
    if (is_arg)
        for (int64_t r = 0; r < n_rows; ++r)
            if (rowptr[r + 1] - rowptr[r] > INT32_MAX) return CO_ERR_BAD_ARGUMENT;
    const int inc = include_self ? 1 : 0;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * F > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = KFN(balanced_row_start)(rowptr, n_rows, t, nt);
        const int64_t r1 = KFN(balanced_row_start)(rowptr, n_rows, t + 1, nt);
        /* CSR rows are contiguous in col: prefetch CO_PF_DIST edges ahead across row ends too
         * (short rows, as in uniform graphs, otherwise start every row with cold misses) */
        const int64_t e_stop = rowptr[r1];
#define CO_PREFETCH_ROW(e_) do { \
            const char *p_ = (const char *)(x + (int64_t)col[(e_)] * F); \
            for (int64_t k_ = 0; k_ < F * (int64_t)sizeof(CO_T); k_ += 64) __builtin_prefetch(p_ + k_); \
        } while (0)
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(F + 1) * sizeof(CO_ACC));
        int32_t *ab = (int32_t *)malloc((size_t)(F + 1) * sizeof(int32_t)); /* winner, relative to the row start */
        if (!acc || !ab) {
#pragma omp atomic write
            failed = 1;
        } else if (CO_T_IS_ACC && sizeof(CO_T) == 4 && CO_SUM_FAST && (reduce == CO_RED_SUM || reduce == CO_RED_MEAN) &&
                   !inc && ((F % 8 == 0 && F <= 64) || F % 64 == 0)) {
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
            /* float32 sum / mean, no include_self, 8..64 features in whole vectors or chunks of 64:
             * a row loop of its own with the accumulators in registers (the generic loop below
             * keeps them in memory and its per-row work made a 100k x 8 mean over a power-law
             * graph as slow as 100k x 64) */
            const int mean = reduce == CO_RED_MEAN;
            const float *xf = (const float *)x, *wf = (const float *)weight;
            /* streaming stores of whole 64-byte lines only (on Zen 3 they kept the gathered rows of
             * x in L3: 7-14% on a uniform graph); half-line rows (F = 8) use plain stores */
            const int stream = F % 16 == 0 && ((uintptr_t)out & 63) == 0;
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t s = rowptr[r], end = rowptr[r + 1];
                float *o = (float *)out + r * F;
                if (s == end) {
                    for (int64_t j = 0; j < F; j += 8) _mm256_storeu_ps(o + j, _mm256_setzero_ps());
                    continue;
                }
                switch (F) {
                case 8: KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(1, xf, F, col, wf, s, end, e_stop, 0, mean, o, stream); break;
                case 16: KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(2, xf, F, col, wf, s, end, e_stop, 0, mean, o, stream); break;
                case 24: KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(3, xf, F, col, wf, s, end, e_stop, 0, mean, o, stream); break;
                case 32: KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(4, xf, F, col, wf, s, end, e_stop, 0, mean, o, stream); break;
                case 40: KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(5, xf, F, col, wf, s, end, e_stop, 0, mean, o, stream); break;
                case 48: KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(6, xf, F, col, wf, s, end, e_stop, 0, mean, o, stream); break;
                case 56: KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(7, xf, F, col, wf, s, end, e_stop, 0, mean, o, stream); break;
                default:
                    for (int64_t c0 = 0; c0 < F; c0 += 64)
                        KFN(CO_N3(seg_sum_row, CO_DT, CO_ISUF))(8, xf, F, col, wf, s, end, e_stop, c0, mean, o, stream);
                }
            }
#endif
        } else {
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t s = rowptr[r], end = rowptr[r + 1];
                CO_T *restrict o = out + r * F;
                const CO_T *sf = self ? self + r * F : NULL;
                if (s == end) { /* empty segment: the base value (self, or zero) */
                    if (sf) for (int64_t j = 0; j < F; ++j) o[j] = sf[j];
                    else for (int64_t j = 0; j < F; ++j) o[j] = CO_STORE((CO_ACC)0);
                    if (arg) for (int64_t j = 0; j < F; ++j) arg[r * F + j] = -1;
                    continue; /* no nonzeros: nothing of wmask belongs to this row */
                }
                /* initial value: self (or 0) when include_self, else the reduction's identity */
                CO_ACC init;
                switch (reduce) {
                case CO_RED_MAX: init = (CO_ACC)(-INFINITY); break;
                case CO_RED_MIN: init = (CO_ACC)INFINITY; break;
                case CO_RED_PROD: init = (CO_ACC)1; break;
                default: init = (CO_ACC)0;
                }
                if (inc && sf) for (int64_t j = 0; j < F; ++j) acc[j] = CO_LOAD(sf[j]);
                else if (inc) for (int64_t j = 0; j < F; ++j) acc[j] = (CO_ACC)0;
                else for (int64_t j = 0; j < F; ++j) acc[j] = init;

#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
                /* float32 max / min, no weights or self, features in whole chunks of 64 (or 32):
                 * accumulators in registers; a row with a NaN goes on to the generic loops below */
                if (is_arg && CO_T_IS_ACC && sizeof(CO_T) == 4 && !weight && !inc && !arg && (F % 64 == 0 || F == 32)) {
                    const int is_max = reduce == CO_RED_MAX;
                    const int stream = F % 8 == 0 && ((uintptr_t)o & 31) == 0;
                    uint64_t *wm = track ? wmask : NULL;
                    int redo = 0;
                    const float *xf = (const float *)x;
                    float *of = (float *)o;
#define CO_MAXMIN_ROW(fn_, nv_, c0_) \
                    (is_max ? KFN(CO_N3(fn_, CO_DT, CO_ISUF))(nv_, 1, xf, F, col, s, end, e_stop, c0_, of, wm, W, stream) \
                            : KFN(CO_N3(fn_, CO_DT, CO_ISUF))(nv_, 0, xf, F, col, s, end, e_stop, c0_, of, wm, W, stream))
                    if (F == 32)
                        redo = wm ? CO_MAXMIN_ROW(seg_maxmin_row_track, 4, 0) : CO_MAXMIN_ROW(seg_maxmin_row, 4, 0);
                    else
                        for (int64_t c0 = 0; c0 < F && !redo; c0 += 64)
                            redo = wm ? CO_MAXMIN_ROW(seg_maxmin_row_track, 8, c0) : CO_MAXMIN_ROW(seg_maxmin_row, 8, c0);
#undef CO_MAXMIN_ROW
                    if (!redo) continue;
                }
#endif
                if (reduce == CO_RED_SUM || reduce == CO_RED_MEAN) {
                    for (int64_t e = s; e < end; ++e) {
                        if (e + CO_PF_DIST < e_stop) CO_PREFETCH_ROW(e + CO_PF_DIST);
                        const CO_T *restrict xr = x + (int64_t)col[e] * F;
                        if (weight) {
                            const CO_ACC w = CO_LOAD(weight[e]);
                            for (int64_t j = 0; j < F; ++j) acc[j] += w * CO_LOAD(xr[j]);
                        } else {
                            for (int64_t j = 0; j < F; ++j) acc[j] += CO_LOAD(xr[j]);
                        }
                    }
                    if (reduce == CO_RED_MEAN) {
                        const CO_ACC cnt = (CO_ACC)(end - s + inc);
                        for (int64_t j = 0; j < F; ++j) acc[j] = acc[j] / cnt;
                    }
                } else if (reduce == CO_RED_PROD) {
                    for (int64_t e = s; e < end; ++e) {
                        const CO_T *restrict xr = x + (int64_t)col[e] * F;
                        const CO_ACC w = weight ? CO_LOAD(weight[e]) : (CO_ACC)1;
                        for (int64_t j = 0; j < F; ++j) acc[j] *= w * CO_LOAD(xr[j]);
                    }
                } else if (!track) { /* max / min without the winner (no gradient wanted) */
                    const int is_max = reduce == CO_RED_MAX;
                    for (int64_t e = s; e < end; ++e) {
                        if (e + CO_PF_DIST < e_stop) CO_PREFETCH_ROW(e + CO_PF_DIST);
                        const CO_T *restrict xr = x + (int64_t)col[e] * F;
                        const CO_ACC w = weight ? CO_LOAD(weight[e]) : (CO_ACC)1;
                        if (is_max) {
                            for (int64_t j = 0; j < F; ++j) {
                                const CO_ACC v = w * CO_LOAD(xr[j]);
                                acc[j] = ((v > acc[j]) | (v != v)) ? v : acc[j]; /* NaN propagates */
                            }
                        } else {
                            for (int64_t j = 0; j < F; ++j) {
                                const CO_ACC v = w * CO_LOAD(xr[j]);
                                acc[j] = ((v < acc[j]) | (v != v)) ? v : acc[j];
                            }
                        }
                    }
                } else { /* max / min, keeping the winning position e (-1: self or nothing won) */
                    for (int64_t j = 0; j < F; ++j) ab[j] = -1;
                    const int is_max = reduce == CO_RED_MAX;
                    for (int64_t e = s; e < end; ++e) {
                        const int32_t rel = (int32_t)(e - s);
                        if (e + CO_PF_DIST < e_stop) CO_PREFETCH_ROW(e + CO_PF_DIST);
                        const CO_T *restrict xr = x + (int64_t)col[e] * F;
                        const CO_ACC w = weight ? CO_LOAD(weight[e]) : (CO_ACC)1;
                        if (is_max) {
                            for (int64_t j = 0; j < F; ++j) {
                                const CO_ACC v = w * CO_LOAD(xr[j]);
                                const int take = (v > acc[j]) | (v != v); /* NaN propagates */
                                acc[j] = take ? v : acc[j];
                                ab[j] = take ? rel : ab[j];
                            }
                        } else {
                            for (int64_t j = 0; j < F; ++j) {
                                const CO_ACC v = w * CO_LOAD(xr[j]);
                                const int take = (v < acc[j]) | (v != v);
                                acc[j] = take ? v : acc[j];
                                ab[j] = take ? rel : ab[j];
                            }
                        }
                    }
                    if (arg) for (int64_t j = 0; j < F; ++j) arg[r * F + j] = ab[j];
                    if (wmask) { /* bit j of nonzero s + ab[j]: written once, row by row */
                        uint64_t *restrict m = wmask + s * W;
                        for (int64_t k = 0; k < (end - s) * W; ++k) m[k] = 0;
                        for (int64_t j = 0; j < F; ++j)
                            if (ab[j] >= 0) m[(int64_t)ab[j] * W + (j >> 6)] |= 1ull << (j & 63);
                    }
                }
                (void)is_arg;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
                /* float32 rows, 32-byte aligned: streaming stores. The output is written once and
                 * not read here, so it need not evict from L3 the rows of x that later rows gather
                 * (uniform graph, 100k x 64, A/B in one process: 7-14% faster; power-law 0-5%) */
                if (CO_T_IS_ACC && sizeof(CO_T) == 4 && F % 8 == 0 && ((uintptr_t)o & 31) == 0) {
                    for (int64_t j = 0; j < F; j += 8)
                        _mm256_stream_ps((float *)o + j, _mm256_loadu_ps((const float *)acc + j));
                    continue;
                }
#endif
                for (int64_t j = 0; j < F; ++j) o[j] = CO_STORE(acc[j]);
            }
        }
        free(acc);
        free(ab);
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
        _mm_sfence(); /* order the streaming stores before the kernel returns */
#endif
    }
#undef CO_PREFETCH_ROW
    return failed ? CO_ERR_BAD_ARGUMENT : CO_OK;
}
