/* Template of the backward kernels (see segment_backward.c). Parameters as segment_tmpl.h. */

/* out[e] = dot(a[row(e), :], b[col[e], :]) for every nonzero e of the CSR (rowptr, col) */
int64_t KFN(CO_N3(sddmm, CO_DT, CO_ISUF))(
    const int64_t *rowptr, int64_t n_rows, const CO_IT *col, int64_t n_b, int64_t F,
    const CO_T *a, const CO_T *b, CO_T *out, int nthreads, int64_t *bad_pos)
{
    if (n_rows < 0 || n_b < 0 || F < 0 || nthreads < 1 || !rowptr) return CO_ERR_BAD_ARGUMENT;
    int64_t bp = KFN(check_rowptr)(rowptr, n_rows);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_UNSORTED; }
    const int64_t nnz = rowptr[n_rows];
    if (nnz > 0 && (!col || !out)) return CO_ERR_BAD_ARGUMENT;
    bp = KFN(CO_N2(first_out_of_range, CO_IT))(col, nnz, 0, n_b, nthreads);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_INDEX_OUT_OF_RANGE; }
#pragma omp parallel num_threads(nthreads) if (nnz * F > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = KFN(balanced_row_start)(rowptr, n_rows, t, nt);
        const int64_t r1 = KFN(balanced_row_start)(rowptr, n_rows, t + 1, nt);
        for (int64_t r = r0; r < r1; ++r) {
            const CO_T *restrict ar = a + r * F;
            for (int64_t e = rowptr[r]; e < rowptr[r + 1]; ++e) {
                const CO_T *restrict br = b + (int64_t)col[e] * F;
                CO_ACC s = 0;
                for (int64_t j = 0; j < F; ++j) s += CO_LOAD(ar[j]) * CO_LOAD(br[j]);
                out[e] = CO_STORE(s);
            }
        }
    }
    return CO_OK;
}

/* arg: the winner index of segment_reduce (n_rows x F, int32, the winning nonzero relative to
 * its row start, -1 for none); e = rowptr[r] + arg[r, j]. col NULL means the identity.
 * out (n_out x F) = 0; then out[col[e], j] += weight[e] * g[r, j] for arg >= 0.
 * The backward of max/min: each winner gets its row's gradient. Threads own disjoint blocks of
 * feature columns, so there are no write conflicts and no atomics. */
int64_t KFN(CO_N3(arg_scatter, CO_DT, CO_ISUF))(
    const int32_t *arg, int64_t n_rows, int64_t F, const CO_T *g, const int64_t *rowptr, const CO_IT *col,
    const CO_T *weight, CO_T *out, int64_t n_out, int nthreads, int64_t *bad_pos)
{
    if (n_rows < 0 || F < 0 || n_out < 0 || nthreads < 1 || !rowptr) return CO_ERR_BAD_ARGUMENT;
    if ((n_rows * F > 0 && (!arg || !g)) || (n_out * F > 0 && !out))
        return CO_ERR_BAD_ARGUMENT;
    int64_t bp = KFN(check_rowptr)(rowptr, n_rows);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_UNSORTED; }
    const int64_t nnz = rowptr[n_rows];
    bp = KFN(first_bad_winner)(arg, rowptr, n_rows, F, nthreads);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_INDEX_OUT_OF_RANGE; }
    if (col) {
        bp = KFN(CO_N2(first_out_of_range, CO_IT))(col, nnz, 0, n_out, nthreads);
        if (bp >= 0) { if (bad_pos) *bad_pos = -2 - bp; return CO_ERR_INDEX_OUT_OF_RANGE; }
    } else if (nnz > n_out) {
        return CO_ERR_BAD_ARGUMENT;
    }
    CO_ACC *acc;
#if CO_T_IS_ACC
    acc = (CO_ACC *)out;
#else
    acc = (CO_ACC *)malloc((size_t)(n_out * F + 1) * sizeof(CO_ACC));
    if (!acc) return CO_ERR_BAD_ARGUMENT;
#endif
    const int64_t nblk = (F + 15) / 16;
#pragma omp parallel num_threads(nthreads) if (n_rows * F > 32768)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_out * F; ++i) acc[i] = 0;
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < nblk; ++blk) {
            const int64_t j0 = blk * 16, j1 = j0 + 16 < F ? j0 + 16 : F;
            for (int64_t r = 0; r < n_rows; ++r) {
                const int32_t *ar = arg + r * F;
                const CO_T *gr = g + r * F;
                for (int64_t j = j0; j < j1; ++j) {
                    if (ar[j] >= 0) {
                        const int64_t e = rowptr[r] + ar[j];
                        const CO_ACC w = weight ? CO_LOAD(weight[e]) : (CO_ACC)1;
                        acc[(col ? (int64_t)col[e] : e) * F + j] += w * CO_LOAD(gr[j]);
                    }
                }
            }
        }
#if !CO_T_IS_ACC
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_out * F; ++i) out[i] = CO_STORE(acc[i]);
#endif
    }
#if !CO_T_IS_ACC
    free(acc);
#endif
    return CO_OK;
}

/* out_w (nnz) = 0; then out_w[e] += x[col[e], j] * g[r, j] for every (r, j) whose winner is
 * e = rowptr[r] + arg[r, j] (arg as in arg_scatter). The backward of max/min with respect to the
 * edge weights. Parallel over rows: a row's winners are its own nonzeros, so rows write
 * disjoint entries. */
int64_t KFN(CO_N3(arg_weight_grad, CO_DT, CO_ISUF))(
    const int32_t *arg, int64_t n_rows, int64_t F, const CO_T *g, const CO_T *x, int64_t n_x,
    const int64_t *rowptr, const CO_IT *col, CO_T *out_w, int nthreads, int64_t *bad_pos)
{
    if (n_rows < 0 || F < 0 || n_x < 0 || nthreads < 1 || !rowptr) return CO_ERR_BAD_ARGUMENT;
    int64_t bp = KFN(check_rowptr)(rowptr, n_rows);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_UNSORTED; }
    const int64_t nnz = rowptr[n_rows];
    if ((n_rows * F > 0 && (!arg || !g)) || (nnz > 0 && (!col || !out_w))) return CO_ERR_BAD_ARGUMENT;
    bp = KFN(first_bad_winner)(arg, rowptr, n_rows, F, nthreads);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_INDEX_OUT_OF_RANGE; }
    bp = KFN(CO_N2(first_out_of_range, CO_IT))(col, nnz, 0, n_x, nthreads);
    if (bp >= 0) { if (bad_pos) *bad_pos = -2 - bp; return CO_ERR_INDEX_OUT_OF_RANGE; }
    CO_ACC *acc = (CO_ACC *)malloc((size_t)(nnz + 1) * sizeof(CO_ACC));
    if (!acc) return CO_ERR_BAD_ARGUMENT;
#pragma omp parallel num_threads(nthreads) if (n_rows * F > 32768)
    {
#pragma omp for schedule(static)
        for (int64_t e = 0; e < nnz; ++e) acc[e] = 0;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n_rows; ++r) {
            const int32_t *ar = arg + r * F;
            const CO_T *gr = g + r * F;
            for (int64_t j = 0; j < F; ++j) {
                if (ar[j] >= 0) {
                    const int64_t e = rowptr[r] + ar[j];
                    acc[e] += CO_LOAD(x[(int64_t)col[e] * F + j]) * CO_LOAD(gr[j]);
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t e = 0; e < nnz; ++e) out_w[e] = CO_STORE(acc[e]);
    }
    free(acc);
    return CO_OK;
}

/* The argument checks arg_gather and mask_gather share, before either writes: colptr starts at 0,
 * never decreases and ends at nnz; row_t in [0, n_rows); perm in [0, nnz) when check_perm
 * (*bad_pos: the position in colptr or row_t, or -2 - the position in perm). */
static int64_t KFN(CO_N3(check_csc, CO_DT, CO_ISUF))(const int64_t *colptr, int64_t n_out, const CO_IT *row_t,
                                                    const int64_t *perm, int64_t nnz, int64_t n_rows,
                                                    int check_perm, int nthreads, int64_t *bad_pos)
{
    int64_t bp = KFN(check_rowptr)(colptr, n_out);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_UNSORTED; }
    if (colptr[n_out] != nnz) return CO_ERR_BAD_ARGUMENT;
    bp = KFN(CO_N2(first_out_of_range, CO_IT))(row_t, nnz, 0, n_rows, nthreads);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_INDEX_OUT_OF_RANGE; }
    if (check_perm) {
        bp = KFN(first_out_of_range_int64_t)(perm, nnz, 0, nnz, nthreads);
        if (bp >= 0) { if (bad_pos) *bad_pos = -2 - bp; return CO_ERR_INDEX_OUT_OF_RANGE; }
    }
    return CO_OK;
}

/* The backward of max/min spmm with respect to x, by gathering over the CSC transpose
 * (colptr, row_t, perm) that the graph caches:
 *   out[i, j] = sum over k in [colptr[i], colptr[i+1]) with arg[row_t[k], j] == perm[k]
 *               of weight[perm[k]] * g[row_t[k], j]
 * The same result as arg_scatter(arg, g, col, weight) (arg holds CSR positions e), but each
 * thread owns whole output rows (balanced by nonzeros): no zeroing pass and no scattered
 * read-modify-writes; the rows of arg and g an edge needs are contiguous and prefetched
 * CO_PF_DIST edges ahead. arg is only compared, never used as an address, so it needs no check;
 * rowptr (n_rows + 1 entries) is read at rows that row_t's check bounds. */
int64_t KFN(CO_N3(arg_gather, CO_DT, CO_ISUF))(
    const int64_t *colptr, int64_t n_out, const CO_IT *row_t, const int64_t *perm, int64_t nnz,
    const int32_t *arg, const int64_t *rowptr, const CO_T *g, int64_t n_rows, int64_t F, const CO_T *weight,
    CO_T *out, int nthreads, int64_t *bad_pos)
{
    if (n_out < 0 || nnz < 0 || n_rows < 0 || F < 0 || nthreads < 1 || !colptr) return CO_ERR_BAD_ARGUMENT;
    if ((n_rows * F > 0 && (!arg || !g)) || (n_out * F > 0 && !out) || (nnz > 0 && (!row_t || !perm))
        || !rowptr)
        return CO_ERR_BAD_ARGUMENT;
    const int64_t st = KFN(CO_N3(check_csc, CO_DT, CO_ISUF))(colptr, n_out, row_t, perm, nnz, n_rows, weight != NULL,
                                                              nthreads, bad_pos);
    if (st != CO_OK) return st;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * F > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t i0 = KFN(balanced_row_start)(colptr, n_out, t, nt);
        const int64_t i1 = KFN(balanced_row_start)(colptr, n_out, t + 1, nt);
        const int64_t k_stop = colptr[i1];
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(F + 1) * sizeof(CO_ACC));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t i = i0; i < i1; ++i) {
                for (int64_t j = 0; j < F; ++j) acc[j] = (CO_ACC)0;
                for (int64_t k = colptr[i]; k < colptr[i + 1]; ++k) {
                    if (k + CO_PF_DIST < k_stop) {
                        const int64_t rp = (int64_t)row_t[k + CO_PF_DIST];
                        const char *pa = (const char *)(arg + rp * F), *pg = (const char *)(g + rp * F);
                        for (int64_t b = 0; b < F * (int64_t)sizeof(int32_t); b += 64) __builtin_prefetch(pa + b);
                        for (int64_t b = 0; b < F * (int64_t)sizeof(CO_T); b += 64) __builtin_prefetch(pg + b);
                    }
                    const int64_t r = (int64_t)row_t[k], e = perm[k];
                    const int32_t rel = (int32_t)(e - rowptr[r]); /* this edge's place in row r */
                    const int32_t *restrict ar = arg + r * F;
                    const CO_T *restrict gr = g + r * F;
                    const CO_ACC w = weight ? CO_LOAD(weight[e]) : (CO_ACC)1;
                    for (int64_t j = 0; j < F; ++j) {
                        const CO_ACC v = w * CO_LOAD(gr[j]);
                        acc[j] += CO_KEEP(v, ar[j] == rel);
                    }
                }
                CO_T *restrict o = out + i * F;
                for (int64_t j = 0; j < F; ++j) o[j] = CO_STORE(acc[j]);
            }
        }
        free(acc);
    }
    return failed ? CO_ERR_BAD_ARGUMENT : CO_OK;
}

#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
/* One output row i of mask_gather for float32 over the features [64 q, 64 q + 8 NV) (mask word q):
 * accumulators in registers; each set byte of an edge's mask word becomes a lane mask (bit j of the
 * byte -> lane j), and the masked row of g is added (lanes not won add +0: the sum of each feature
 * over its winners, in the same edge order as the scalar loop). Vectors whose byte is 0 read no g. */
static inline __attribute__((always_inline, unused)) void
KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(const int NV, int64_t k0, int64_t k1, int64_t k_stop, const CO_IT *row_t,
                                             const int64_t *perm, const uint64_t *wmask, int64_t W, int64_t q,
                                             const float *g, int64_t F, const float *weight, float *o)
{
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256 acc[8];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        if (q == 0 && k + 2 * CO_PF_DIST < k_stop) __builtin_prefetch(wmask + perm[k + 2 * CO_PF_DIST] * W);
        if (k + CO_PF_DIST < k_stop) {
            const uint64_t mp = wmask[perm[k + CO_PF_DIST] * W + q];
            const float *gp = g + (int64_t)row_t[k + CO_PF_DIST] * F + 64 * q;
            for (int l = 0; l < NV; l += 2)
                if ((mp >> (8 * l)) & 0xffff) __builtin_prefetch(gp + 8 * l);
        }
        const int64_t e = perm[k];
        const uint64_t m = wmask[e * W + q];
        if (!m) continue;
        const float *gr = g + (int64_t)row_t[k] * F + 64 * q;
        const __m256 w = _mm256_set1_ps(weight ? weight[e] : 1.0f);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
            const int byte = (int)((m >> (8 * v)) & 0xff);
            if (!byte) continue;
            const __m256 lanes = _mm256_castsi256_ps(
                _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(byte), sel), sel));
            __m256 gv = _mm256_loadu_ps(gr + 8 * v);
            if (weight) gv = _mm256_mul_ps(gv, w);
            acc[v] = _mm256_add_ps(acc[v], _mm256_and_ps(lanes, gv));
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + 64 * q + 8 * v, acc[v]);
}
#endif

#if defined(CO_VARIANT_AVX512)
/* mask_gather_row on AVX-512 over the features [64 q, 64 q + 16 NV): each 16 bits of an edge's mask
 * word are the k-mask of a masked load of g (lanes not won read nothing and add +0, as the AVX2 row's
 * and-mask does: the same sums in the same order, bit for bit), with no branch per vector or per
 * edge (the AVX2 row's test of each byte, taken about half the time on a max aggregation's winners,
 * mispredicts). The lines of g holding set bits are prefetched CO_PF_DIST edges ahead (a line with
 * none prefetches the mask word's own line instead: no branch there either). */
static inline __attribute__((always_inline, unused)) void
KFN(CO_N3(mask_gather_row16, CO_DT, CO_ISUF))(const int NV, int64_t k0, int64_t k1, int64_t k_stop, const CO_IT *row_t,
                                               const int64_t *perm, const uint64_t *wmask, int64_t W, int64_t q,
                                               const float *g, int64_t F, const float *weight, float *o)
{
    __m512 acc[4];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        if (q == 0 && k + 2 * CO_PF_DIST < k_stop) __builtin_prefetch(wmask + perm[k + 2 * CO_PF_DIST] * W);
        if (k + CO_PF_DIST < k_stop) {
            const uint64_t *mpp = wmask + perm[k + CO_PF_DIST] * W + q;
            const uint64_t mp = *mpp;
            const float *gp = g + (int64_t)row_t[k + CO_PF_DIST] * F + 64 * q;
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v)
                __builtin_prefetch(((mp >> (16 * v)) & 0xffff) ? (const void *)(gp + 16 * v) : (const void *)mpp);
        }
        const int64_t e = perm[k];
        const uint64_t m = wmask[e * W + q];
        const float *gr = g + (int64_t)row_t[k] * F + 64 * q;
        if (weight) {
            const __m512 w = _mm512_set1_ps(weight[e]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) {
                const __mmask16 km = (__mmask16)(m >> (16 * v));
                acc[v] = _mm512_add_ps(acc[v], _mm512_maskz_mov_ps(km, _mm512_mul_ps(_mm512_maskz_loadu_ps(km, gr + 16 * v), w)));
            }
        } else {
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v)
                acc[v] = _mm512_add_ps(acc[v], _mm512_maskz_loadu_ps((__mmask16)(m >> (16 * v)), gr + 16 * v));
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + 64 * q + 16 * v, acc[v]);
}
#endif

/* The backward of max/min spmm from the winner mask (wmask: nnz x W uint64, W = ceil(F / 64); bit
 * j of nonzero e set iff e won feature j of its row), over the CSC transpose as arg_gather:
 *   out[i, j] = sum over k in [colptr[i], colptr[i+1]) whose wmask[perm[k]] has bit j
 *               of weight[perm[k]] * g[row_t[k], j]
 * Only set bits are visited, so a nonzero that won nothing costs one 8-byte read and no row of g
 * (most edges of a hub row win nothing); the mask is prefetched 2 * CO_PF_DIST edges ahead and the
 * cache lines of g holding set bits CO_PF_DIST ahead. Indices (row_t, perm) and the mask's bits
 * are checked before any write. */
int64_t KFN(CO_N3(mask_gather, CO_DT, CO_ISUF))(
    const int64_t *colptr, int64_t n_out, const CO_IT *row_t, const int64_t *perm, int64_t nnz,
    const uint64_t *wmask, const CO_T *g, int64_t n_rows, int64_t F, const CO_T *weight,
    CO_T *out, int nthreads, int64_t *bad_pos)
{
    if (n_out < 0 || nnz < 0 || n_rows < 0 || F < 0 || nthreads < 1 || !colptr) return CO_ERR_BAD_ARGUMENT;
    if ((n_rows * F > 0 && !g) || (n_out * F > 0 && !out) || (nnz > 0 && (!row_t || !perm || !wmask)))
        return CO_ERR_BAD_ARGUMENT;
    const int64_t st = KFN(CO_N3(check_csc, CO_DT, CO_ISUF))(colptr, n_out, row_t, perm, nnz, n_rows, 1,
                                                              nthreads, bad_pos);
    if (st != CO_OK) return st;
    if (KFN(first_bad_mask)(wmask, nnz, F, nthreads) >= 0) return CO_ERR_BAD_ARGUMENT;
    const int64_t W = (F + 63) / 64;
    const int64_t epl = 64 / (int64_t)sizeof(CO_T); /* elements per cache line: 8, 16 or 32 */
    const uint64_t line_bits = (1ull << epl) - 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * F > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t i0 = KFN(balanced_row_start)(colptr, n_out, t, nt);
        const int64_t i1 = KFN(balanced_row_start)(colptr, n_out, t + 1, nt);
        const int64_t k_stop = colptr[i1];
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(F + 1) * sizeof(CO_ACC));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t i = i0; i < i1; ++i) {
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
                if (CO_T_IS_ACC && sizeof(CO_T) == 4 && ((F % 8 == 0 && F <= 64) || F % 64 == 0)) {
                    const float *gf = (const float *)g, *wf = (const float *)weight;
                    float *of = (float *)out + i * F;
#if defined(CO_VARIANT_AVX512)
                    if (F % 16 == 0) {
                        if (F >= 64)
                            for (int64_t q = 0; q < W; ++q)
                                KFN(CO_N3(mask_gather_row16, CO_DT, CO_ISUF))(4, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, gf, F, wf, of);
                        else if (F == 48)
                            KFN(CO_N3(mask_gather_row16, CO_DT, CO_ISUF))(3, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of);
                        else if (F == 32)
                            KFN(CO_N3(mask_gather_row16, CO_DT, CO_ISUF))(2, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of);
                        else
                            KFN(CO_N3(mask_gather_row16, CO_DT, CO_ISUF))(1, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of);
                        continue;
                    }
#endif
                    if (F >= 64)
                        for (int64_t q = 0; q < W; ++q)
                            KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(8, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, gf, F, wf, of);
                    else switch (F / 8) {
                    case 1: KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(1, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of); break;
                    case 2: KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(2, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of); break;
                    case 3: KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(3, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of); break;
                    case 4: KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(4, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of); break;
                    case 5: KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(5, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of); break;
                    case 6: KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(6, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of); break;
                    default: KFN(CO_N3(mask_gather_row, CO_DT, CO_ISUF))(7, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, 0, gf, F, wf, of);
                    }
                    continue;
                }
#endif
                for (int64_t j = 0; j < F; ++j) acc[j] = (CO_ACC)0;
                for (int64_t k = colptr[i]; k < colptr[i + 1]; ++k) {
                    if (k + 2 * CO_PF_DIST < k_stop) __builtin_prefetch(wmask + perm[k + 2 * CO_PF_DIST] * W);
                    if (k + CO_PF_DIST < k_stop) { /* the lines of g that hold set bits */
                        const uint64_t *mp = wmask + perm[k + CO_PF_DIST] * W;
                        const CO_T *gp = g + (int64_t)row_t[k + CO_PF_DIST] * F;
                        for (int64_t j0 = 0; j0 < F; j0 += epl)
                            if ((mp[j0 >> 6] >> (j0 & 63)) & line_bits) __builtin_prefetch(gp + j0);
                    }
                    const int64_t e = perm[k];
                    const uint64_t *restrict m = wmask + e * W;
                    const CO_T *restrict gr = g + (int64_t)row_t[k] * F;
                    const CO_ACC w = weight ? CO_LOAD(weight[e]) : (CO_ACC)1;
                    for (int64_t q = 0; q < W; ++q) {
                        for (uint64_t b = m[q]; b; b &= b - 1) {
                            const int64_t j = q * 64 + __builtin_ctzll(b);
                            acc[j] += w * CO_LOAD(gr[j]);
                        }
                    }
                }
                CO_T *restrict o = out + i * F;
                for (int64_t j = 0; j < F; ++j) o[j] = CO_STORE(acc[j]);
            }
        }
        free(acc);
    }
    return failed ? CO_ERR_BAD_ARGUMENT : CO_OK;
}

/* out_w[e] = sum over the bits j of wmask[e] of x[col[e], j] * g[r, j] (r: the row of e): the
 * backward of max/min spmm with respect to the edge weights, from the winner mask. Parallel over
 * rows; every nonzero is written once, and one that won nothing reads no row of x. */
int64_t KFN(CO_N3(mask_weight_grad, CO_DT, CO_ISUF))(
    const uint64_t *wmask, const int64_t *rowptr, int64_t n_rows, const CO_IT *col, const CO_T *x, int64_t n_x,
    const CO_T *g, int64_t F, CO_T *out_w, int nthreads, int64_t *bad_pos)
{
    if (n_rows < 0 || F < 0 || n_x < 0 || nthreads < 1 || !rowptr) return CO_ERR_BAD_ARGUMENT;
    int64_t bp = KFN(check_rowptr)(rowptr, n_rows);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_UNSORTED; }
    const int64_t nnz = rowptr[n_rows];
    if ((n_rows * F > 0 && !g) || (nnz > 0 && (!col || !out_w || !wmask))) return CO_ERR_BAD_ARGUMENT;
    bp = KFN(CO_N2(first_out_of_range, CO_IT))(col, nnz, 0, n_x, nthreads);
    if (bp >= 0) { if (bad_pos) *bad_pos = bp; return CO_ERR_INDEX_OUT_OF_RANGE; }
    if (KFN(first_bad_mask)(wmask, nnz, F, nthreads) >= 0) return CO_ERR_BAD_ARGUMENT;
    const int64_t W = (F + 63) / 64;
#pragma omp parallel num_threads(nthreads) if (nnz * F > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = KFN(balanced_row_start)(rowptr, n_rows, t, nt);
        const int64_t r1 = KFN(balanced_row_start)(rowptr, n_rows, t + 1, nt);
        for (int64_t r = r0; r < r1; ++r) {
            const CO_T *restrict gr = g + r * F;
            for (int64_t e = rowptr[r]; e < rowptr[r + 1]; ++e) {
                const CO_T *restrict xr = x + (int64_t)col[e] * F;
                CO_ACC s = 0;
                for (int64_t q = 0; q < W; ++q)
                    for (uint64_t b = wmask[e * W + q]; b; b &= b - 1) {
                        const int64_t j = q * 64 + __builtin_ctzll(b);
                        s += CO_LOAD(xr[j]) * CO_LOAD(gr[j]);
                    }
                out_w[e] = CO_STORE(s);
            }
        }
    }
    return CO_OK;
}

#if defined(CO_DT_IS_F32)
/* mask_gather_proj: the max/min spmm gradient of x from the winner bit mask (mask_gather above)
 * with the linear map that follows the aggregation folded in: each in-edge computes the F-wide row of
 * g @ wl it needs from g's narrow row (C floats) where it won a feature, so a max-aggregating
 * SAGEConv's backward reads 4 C bytes per edge instead of 4 F and writes no n x F gradient of the
 * aggregation. float32 only; vector rows on AVX-512 (F % 16 == 0) and AVX2 (F % 8 == 0). */

#if defined(CO_VARIANT_AVX512)
/* One output row i over the 64 features of mask word q (NV vectors of 16: F % 16 == 0): per CSC
 * in-edge k whose mask word is not 0, the edge's 16-lane products sum_o g[row_t[k], o] wl[o, 64q + 16v + l]
 * (C broadcasts, C x NV FMAs, wl read from L1), each added to the row's accumulators under the
 * word's bits as a k-mask (lanes not won add nothing). */
static inline __attribute__((always_inline)) void
KFN(CO_N2(mask_gather_proj_row16, CO_ISUF))(const int NV, int64_t k0, int64_t k1, int64_t k_stop, const CO_IT *row_t,
                               const int64_t *perm, const uint64_t *wmask, int64_t W, int64_t q, const float *g,
                               int64_t C, const float *wl, int64_t F, float *o, int accumulate)
{
    __m512 acc[4];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
        acc[v] = accumulate ? _mm512_loadu_ps(o + 64 * q + 16 * v) : _mm512_setzero_ps();
    const float *wq = wl + 64 * q;
    for (int64_t k = k0; k < k1; ++k) {
        if (k + CO_PF_DIST < k_stop) {
            __builtin_prefetch(wmask + perm[k + CO_PF_DIST] * W + q);
            __builtin_prefetch(g + (int64_t)row_t[k + CO_PF_DIST] * C);
        }
        const uint64_t m = wmask[perm[k] * W + q];
        if (!m)
            continue;
        const float *gr = g + (int64_t)row_t[k] * C;
        __m512 t[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            t[v] = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; ++c) {
            const __m512 b = _mm512_set1_ps(gr[c]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v)
                t[v] = _mm512_fmadd_ps(b, _mm512_loadu_ps(wq + c * F + 16 * v), t[v]);
        }
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            acc[v] = _mm512_mask_add_ps(acc[v], (__mmask16)(m >> (16 * v)), acc[v], t[v]);
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
        _mm512_storeu_ps(o + 64 * q + 16 * v, acc[v]);
}
#endif

#if defined(CO_VARIANT_AVX2)
/* mask_gather_proj_row16 on AVX2, over the features [64 q + 32 h, 64 q + 32 h + 8 NV) (F % 8 == 0; at
 * most 4 vectors a pass, so accumulators and products stay in the 16 ymm registers): each set byte
 * of the edge's mask word becomes a lane mask (bit j of the byte -> lane j) that ands its product */
static inline __attribute__((always_inline)) void
KFN(CO_N2(mask_gather_proj_row8, CO_ISUF))(const int NV, int64_t k0, int64_t k1, int64_t k_stop, const CO_IT *row_t,
                                           const int64_t *perm, const uint64_t *wmask, int64_t W, int64_t q, int h,
                                           const float *g, int64_t C, const float *wl, int64_t F, float *o,
                                           int accumulate)
{
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const int64_t f0 = 64 * q + 32 * h;
    __m256 acc[4];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
        acc[v] = accumulate ? _mm256_loadu_ps(o + f0 + 8 * v) : _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        if (k + CO_PF_DIST < k_stop) {
            __builtin_prefetch(wmask + perm[k + CO_PF_DIST] * W + q);
            __builtin_prefetch(g + (int64_t)row_t[k + CO_PF_DIST] * C);
        }
        const uint64_t m = (wmask[perm[k] * W + q] >> (32 * h)) & 0xffffffffull;
        if (!m)
            continue;
        const float *gr = g + (int64_t)row_t[k] * C;
        __m256 t[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            t[v] = _mm256_setzero_ps();
        for (int64_t c = 0; c < C; ++c) {
            const __m256 b = _mm256_set1_ps(gr[c]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v)
                t[v] = _mm256_fmadd_ps(b, _mm256_loadu_ps(wl + c * F + f0 + 8 * v), t[v]);
        }
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            const __m256 lanes = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
                _mm256_and_si256(_mm256_set1_epi32((int)((m >> (8 * v)) & 0xff)), sel), sel));
            acc[v] = _mm256_add_ps(acc[v], _mm256_and_ps(lanes, t[v]));
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
        _mm256_storeu_ps(o + f0 + 8 * v, acc[v]);
}
#endif

/* out[i, j] (=, or += with accumulate) sum over k in [colptr[i], colptr[i+1]) whose wmask[perm[k]]
 * has bit j of sum_{c < C} g[row_t[k], c] * wl[c, j]: mask_gather of g @ wl (g: n_rows x C, wl: C x F)
 * without that n_rows x F product, each edge computing its own row of it where it won a feature.
 * The backward of a max-aggregating layer whose linear map (wl) follows the aggregation: g is the
 * layer's output gradient, narrower than F. Indices (row_t, perm) and the mask's bits are checked
 * before any write, as mask_gather's. */
int64_t KFN(CO_N3(mask_gather_proj, CO_DT, CO_ISUF))(
    const int64_t *colptr, int64_t n_out, const CO_IT *row_t, const int64_t *perm, int64_t nnz,
    const uint64_t *wmask, const float *g, int64_t n_rows, int64_t C, const float *wl, int64_t F,
    float *out, int accumulate, int nthreads, int64_t *bad_pos)
{
    if (n_out < 0 || nnz < 0 || n_rows < 0 || C < 0 || F < 0 || nthreads < 1 || !colptr) return CO_ERR_BAD_ARGUMENT;
    if ((n_rows * C > 0 && !g) || (C * F > 0 && !wl) || (n_out * F > 0 && !out) ||
        (nnz > 0 && (!row_t || !perm || !wmask)))
        return CO_ERR_BAD_ARGUMENT;
    const int64_t st = KFN(CO_N3(check_csc, CO_DT, CO_ISUF))(colptr, n_out, row_t, perm, nnz, n_rows, 1, nthreads,
                                                            bad_pos);
    if (st != CO_OK) return st;
    if (KFN(first_bad_mask)(wmask, nnz, F, nthreads) >= 0) return CO_ERR_BAD_ARGUMENT;
    const int64_t W = (F + 63) / 64;
#pragma omp parallel num_threads(nthreads) if (nnz * F > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t i0 = KFN(balanced_row_start)(colptr, n_out, t, nt);
        const int64_t i1 = KFN(balanced_row_start)(colptr, n_out, t + 1, nt);
        const int64_t k_stop = colptr[i1];
        for (int64_t i = i0; i < i1; ++i) {
            float *restrict o = out + i * F;
#if defined(CO_VARIANT_AVX512)
            if (F % 16 == 0) {
                for (int64_t q = 0; q < W; ++q) {
                    const int64_t left = F - 64 * q;
                    if (left >= 64)
                        KFN(CO_N2(mask_gather_proj_row16, CO_ISUF))(4, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, g, C, wl, F, o, accumulate);
                    else if (left == 48)
                        KFN(CO_N2(mask_gather_proj_row16, CO_ISUF))(3, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, g, C, wl, F, o, accumulate);
                    else if (left == 32)
                        KFN(CO_N2(mask_gather_proj_row16, CO_ISUF))(2, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, g, C, wl, F, o, accumulate);
                    else
                        KFN(CO_N2(mask_gather_proj_row16, CO_ISUF))(1, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, g, C, wl, F, o, accumulate);
                }
                continue;
            }
#elif defined(CO_VARIANT_AVX2)
            if (F % 8 == 0) {
                for (int64_t f = 0; f < F; f += 32) {
                    const int nv = F - f >= 32 ? 4 : (int)((F - f) / 8);
                    const int64_t q = f / 64;
                    const int h = (int)((f % 64) / 32);
                    if (nv == 4)
                        KFN(CO_N2(mask_gather_proj_row8, CO_ISUF))(4, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, h, g, C, wl, F, o, accumulate);
                    else if (nv == 3)
                        KFN(CO_N2(mask_gather_proj_row8, CO_ISUF))(3, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, h, g, C, wl, F, o, accumulate);
                    else if (nv == 2)
                        KFN(CO_N2(mask_gather_proj_row8, CO_ISUF))(2, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, h, g, C, wl, F, o, accumulate);
                    else
                        KFN(CO_N2(mask_gather_proj_row8, CO_ISUF))(1, colptr[i], colptr[i + 1], k_stop, row_t, perm, wmask, W, q, h, g, C, wl, F, o, accumulate);
                }
                continue;
            }
#endif
            if (!accumulate)
                for (int64_t j = 0; j < F; ++j) o[j] = 0.f;
            for (int64_t k = colptr[i]; k < colptr[i + 1]; ++k) {
                const uint64_t *restrict m = wmask + perm[k] * W;
                const float *restrict gr = g + (int64_t)row_t[k] * C;
                for (int64_t q = 0; q < W; ++q)
                    for (uint64_t b = m[q]; b; b &= b - 1) {
                        const int64_t j = q * 64 + __builtin_ctzll(b);
                        float s = 0.f;
                        for (int64_t c = 0; c < C; ++c) s = fmaf(gr[c], wl[c * F + j], s);
                        o[j] += s;
                    }
            }
        }
    }
    return CO_OK;
}
#endif /* CO_DT_IS_F32 */
