/* Template of the attention kernels (see attention.c). Parameters as segment_tmpl.h: CO_DT, CO_T,
 * CO_ACC, CO_LOAD, CO_STORE (feature dtype), CO_IT, CO_ISUF (index dtype of col). row_t and perm
 * are int64 for both index dtypes (csr_transpose makes them so).
 *
 * Layout: node rows are H x C (head h at h * C); per-edge, per-head arrays (alpha, mask, the
 * gradients of the scores) are E x H in CSR order. The forward kernels keep one row's scores
 * head-major in a per-thread scratch (sc[h * deg + d]), so max, exp, sum and normalisation run
 * as contiguous loops over the row's edges. */

#define CO_ATT(name) KFN(CO_N3(name, CO_DT, CO_ISUF))
#define CO_EXP(v) _Generic((v), float: KFN(co_expf), double: KFN(co_exp))(v)

/* leaky_relu without a branch (scores are unpredictable: a branch mispredicts half the time) */
#define CO_LRELU(z, slope) (CO_KEEP((z), (z) > 0) + CO_KEEP((z) * (slope), !((z) > 0)))

/* ---------------------------------------------------------------------------- per-edge helpers
 * Each is always inlined and called through CO_BY_C, so C is a constant in the hot loops. */

/* acc[h, :] += w[h * ws] * v[h, :] for every head */
CO_INLINE void CO_ATT(axpy_heads)(CO_ACC *restrict acc, const CO_T *restrict v, const CO_ACC *restrict w,
                                  int64_t ws, int64_t H, int64_t C)
{
    for (int64_t h = 0; h < H; ++h) {
        const CO_ACC wh = w[h * ws];
        CO_ACC *restrict ah = acc + h * C;
        const CO_T *restrict vh = v + h * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) ah[c] += wh * CO_LOAD(vh[c]);
    }
}

/* out[h * os] = <a[h, :], b[h, :]> for every head */
CO_INLINE void CO_ATT(dot_heads)(CO_ACC *restrict out, int64_t os, const CO_T *restrict a, const CO_T *restrict b,
                                 int64_t H, int64_t C)
{
    for (int64_t h = 0; h < H; ++h) {
        CO_ACC s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < C; ++c) s += CO_LOAD(a[h * C + c]) * CO_LOAD(b[h * C + c]);
        out[h * os] = s;
    }
}

/* GATv2's score: out[h * os] = sum_c att[h, c] * leaky_relu(xl[h, c] + xr[h, c]) */
CO_INLINE void CO_ATT(v2_score_heads)(CO_ACC *restrict out, int64_t os, const CO_T *restrict xl,
                                      const CO_ACC *restrict xr, const CO_ACC *restrict at, CO_ACC slope, int64_t H,
                                      int64_t C)
{
    for (int64_t h = 0; h < H; ++h) {
        CO_ACC s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < C; ++c) {
            const CO_ACC z = CO_LOAD(xl[h * C + c]) + xr[h * C + c];
            s += at[h * C + c] * CO_LRELU(z, slope);
        }
        out[h * os] = s;
    }
}

/* GATv2 backward, target side of one edge with score gradient d[h]:
 * gxr[h, c] += d[h] * att[h, c] * leaky_relu'(z), gatt[h, c] += d[h] * leaky_relu(z), z = xl + xr */
CO_INLINE void CO_ATT(v2_row_heads)(CO_ACC *restrict gxr, CO_ACC *restrict gatt, const CO_T *restrict xl,
                                    const CO_ACC *restrict xr, const CO_ACC *restrict at, const CO_ACC *restrict d,
                                    CO_ACC slope, int64_t H, int64_t C)
{
    for (int64_t h = 0; h < H; ++h) {
        const CO_ACC dh = d[h];
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
            const int64_t q = h * C + c;
            const CO_ACC z = CO_LOAD(xl[q]) + xr[q];
            const CO_ACC da = dh * at[q];
            gxr[q] += CO_KEEP(da, z > 0) + CO_KEEP(da * slope, !(z > 0));
            gatt[q] += dh * CO_LRELU(z, slope);
        }
    }
}

/* GATv2 backward, source side of one edge: acc[h, c] += w[h] * g[h, c] + d[h] * att[h, c] * leaky_relu'(xl + xr) */
CO_INLINE void CO_ATT(v2_col_heads)(CO_ACC *restrict acc, const CO_T *restrict g, const CO_T *restrict xl,
                                    const CO_T *restrict xr, const CO_ACC *restrict at, const CO_ACC *restrict w,
                                    const CO_ACC *restrict d, CO_ACC slope, int64_t H, int64_t C)
{
    for (int64_t h = 0; h < H; ++h) {
        const CO_ACC wh = w[h], dh = d[h];
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
            const int64_t q = h * C + c;
            const CO_ACC z = CO_LOAD(xl[q]) + CO_LOAD(xr[q]);
            const CO_ACC da = dh * at[q];
            acc[q] += wh * CO_LOAD(g[q]) + (CO_KEEP(da, z > 0) + CO_KEEP(da * slope, !(z > 0)));
        }
    }
}

/* ---------------------------------------------------------------------------- checks, scratch */

/* The checks every attention kernel makes before it writes: the CSR (rowptr over n_dst rows, col in
 * [0, n_src)) and, when colptr is given, its CSC transpose (colptr over n_src columns ending at the
 * same nnz, row_t in [0, n_dst), perm in [0, nnz)). */
static int64_t CO_ATT(att_check)(const int64_t *rowptr, int64_t n_dst, const CO_IT *col, const int64_t *colptr,
                                 const int64_t *row_t, const int64_t *perm, int64_t n_src, int nthreads,
                                 int64_t *bad)
{
    int64_t bp = KFN(check_rowptr)(rowptr, n_dst);
    if (bp >= 0) { bad[0] = bp; bad[1] = CO_ATT_ROWPTR; return CO_ERR_UNSORTED; }
    const int64_t nnz = rowptr[n_dst];
    if (nnz > 0 && !col) return CO_ERR_BAD_ARGUMENT;
    bp = KFN(CO_N2(first_out_of_range, CO_IT))(col, nnz, 0, n_src, nthreads);
    if (bp >= 0) { bad[0] = bp; bad[1] = CO_ATT_COL; return CO_ERR_INDEX_OUT_OF_RANGE; }
    if (!colptr) return CO_OK;
    if (nnz > 0 && (!row_t || !perm)) return CO_ERR_BAD_ARGUMENT;
    bp = KFN(check_rowptr)(colptr, n_src);
    if (bp < 0 && colptr[n_src] != nnz) bp = n_src;
    if (bp >= 0) { bad[0] = bp; bad[1] = CO_ATT_COLPTR; return CO_ERR_UNSORTED; }
    bp = KFN(first_out_of_range_int64_t)(row_t, nnz, 0, n_dst, nthreads);
    if (bp >= 0) { bad[0] = bp; bad[1] = CO_ATT_ROW_T; return CO_ERR_INDEX_OUT_OF_RANGE; }
    bp = KFN(first_out_of_range_int64_t)(perm, nnz, 0, nnz, nthreads);
    if (bp >= 0) { bad[0] = bp; bad[1] = CO_ATT_PERM; return CO_ERR_INDEX_OUT_OF_RANGE; }
    return CO_OK;
}

/* The argument checks of the forward kernels; returns CO_OK or the status. */
static int64_t CO_ATT(att_forward_args)(const int64_t *rowptr, int64_t n_dst, const CO_IT *col, int64_t n_src,
                                        int64_t H, int64_t C, const void *val, CO_T *out, CO_T *alpha,
                                        int nthreads, int64_t *bad)
{
    if (n_dst < 0 || n_src < 0 || H < 1 || C < 1 || nthreads < 1 || !rowptr || !bad) return CO_ERR_BAD_ARGUMENT;
    bad[0] = bad[1] = -1;
    const int64_t st = CO_ATT(att_check)(rowptr, n_dst, col, NULL, NULL, NULL, n_src, nthreads, bad);
    if (st != CO_OK) return st;
    const int64_t nnz = rowptr[n_dst];
    if ((n_dst > 0 && !out) || (nnz > 0 && (!alpha || !val))) return CO_ERR_BAD_ARGUMENT;
    return CO_OK;
}

/* The argument checks of the backward kernels. */
static int64_t CO_ATT(att_backward_args)(const int64_t *rowptr, int64_t n_dst, const CO_IT *col,
                                         const int64_t *colptr, const int64_t *row_t, const int64_t *perm,
                                         int64_t n_src, int64_t H, int64_t C, const void *val, const CO_T *alpha,
                                         const CO_T *g, int nthreads, int64_t *bad)
{
    if (n_dst < 0 || n_src < 0 || H < 1 || C < 1 || nthreads < 1 || !rowptr || !colptr || !bad)
        return CO_ERR_BAD_ARGUMENT;
    bad[0] = bad[1] = -1;
    const int64_t st = CO_ATT(att_check)(rowptr, n_dst, col, colptr, row_t, perm, n_src, nthreads, bad);
    if (st != CO_OK) return st;
    const int64_t nnz = rowptr[n_dst];
    if (nnz > 0 && (!alpha || !g || !val)) return CO_ERR_BAD_ARGUMENT;
    return CO_OK;
}

/* The longest row of [r0, r1) (scratch size for its scores). */
static inline int64_t CO_ATT(att_max_row)(const int64_t *ptr, int64_t r0, int64_t r1)
{
    int64_t m = 0;
    for (int64_t r = r0; r < r1; ++r) m = ptr[r + 1] - ptr[r] > m ? ptr[r + 1] - ptr[r] : m;
    return m;
}

/* E x H scratch of the accumulator type, from huge pages where it is large (a fresh 10 MB buffer
 * costs thousands of page faults on first touch); free with free(). */
static CO_ACC *CO_ATT(att_scratch)(int64_t n)
{
    const size_t bytes = (size_t)(n + 1) * sizeof(CO_ACC);
    void *p = NULL;
    if (bytes >= ((size_t)4 << 20)) {
        if (posix_memalign(&p, (size_t)2 << 20, bytes) != 0) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
        madvise(p, bytes & ~(((size_t)2 << 20) - 1), MADV_HUGEPAGE);
#endif
        return (CO_ACC *)p;
    }
    return (CO_ACC *)malloc(bytes);
}

/* ---------------------------------------------------------------------------- forward, shared */

/* Softmax per head over one row's scores sc (deg x H, row-major), in place: max-subtracted exp,
 * divided by the sum plus PyG's eps. Called through CO_BY_H, so the head loops have a fixed length
 * for the usual head counts (one vector op per edge for H = 8 in float). */
CO_INLINE void CO_ATT(att_row_softmax)(CO_ACC *restrict sc, int64_t deg, CO_ACC *restrict mx, CO_ACC *restrict sum,
                                       int64_t H)
{
    if (H == 1) {
        CO_ACC m = (CO_ACC)(-INFINITY), z = 0;
#pragma omp simd reduction(max : m)
        for (int64_t d = 0; d < deg; ++d) m = sc[d] > m ? sc[d] : m;
#pragma omp simd reduction(+ : z)
        for (int64_t d = 0; d < deg; ++d) {
            const CO_ACC p = CO_EXP(sc[d] - m);
            sc[d] = p;
            z += p;
        }
        z += (CO_ACC)CO_SOFTMAX_EPS;
#pragma omp simd
        for (int64_t d = 0; d < deg; ++d) sc[d] = sc[d] / z;
        return;
    }
    for (int64_t h = 0; h < H; ++h) { mx[h] = sc[h]; sum[h] = 0; }
    for (int64_t d = 1; d < deg; ++d) {
        const CO_ACC *restrict sd = sc + d * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) mx[h] = sd[h] > mx[h] ? sd[h] : mx[h];
    }
    for (int64_t d = 0; d < deg; ++d) {
        CO_ACC *restrict sd = sc + d * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) {
            const CO_ACC p = CO_EXP(sd[h] - mx[h]);
            sd[h] = p;
            sum[h] += p;
        }
    }
    for (int64_t h = 0; h < H; ++h) sum[h] += (CO_ACC)CO_SOFTMAX_EPS;
    for (int64_t d = 0; d < deg; ++d) {
        CO_ACC *restrict sd = sc + d * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) sd[h] = sd[h] / sum[h];
    }
}

/* calls fn(args..., H) with H a compile-time constant for the usual head counts */
#define CO_BY_H(H_, fn, ...)                                 \
    do {                                                     \
        switch (H_) {                                        \
        case 1: fn(__VA_ARGS__, 1); break;                   \
        case 2: fn(__VA_ARGS__, 2); break;                   \
        case 4: fn(__VA_ARGS__, 4); break;                   \
        case 8: fn(__VA_ARGS__, 8); break;                   \
        case 16: fn(__VA_ARGS__, 16); break;                 \
        default: fn(__VA_ARGS__, H_); break;                 \
        }                                                    \
    } while (0)

/* The scores of row [s, end) go here: alpha itself where it has the accumulator's type (f32, f64),
 * else the thread's scratch (copied to alpha by att_row_finish). */
#if CO_T_IS_ACC
#define CO_ROW_SCORES(scratch, alpha, s, H) ((CO_ACC *)(alpha) + (s) * (H))
#else
#define CO_ROW_SCORES(scratch, alpha, s, H) (scratch)
#endif

/* One row after its scores are in sc (deg x H): softmax, alpha written (E x H), and acc (H x C) =
 * sum_e alpha[e] * mask[e] * val[col[e]] (rows of val prefetched CO_PF_DIST edges ahead).
 * tmp: 3 H accumulators of scratch. */
CO_INLINE void CO_ATT(att_row_finish)(int64_t s, int64_t end, int64_t e_stop, const CO_IT *restrict col, int64_t H,
                                      int64_t C, const CO_T *restrict val, CO_ACC *restrict sc,
                                      const CO_T *restrict mask, CO_T *restrict alpha, CO_ACC *restrict acc,
                                      CO_ACC *restrict tmp)
{
    const int64_t deg = end - s, HC = H * C;
    CO_ACC *restrict w = tmp + 2 * H;
    CO_BY_H(H, CO_ATT(att_row_softmax), sc, deg, tmp, tmp + H);
#if !CO_T_IS_ACC
    for (int64_t q = 0; q < deg * H; ++q) alpha[s * H + q] = CO_STORE(sc[q]);
#endif
    for (int64_t q = 0; q < HC; ++q) acc[q] = 0;
    for (int64_t e = s; e < end; ++e) {
        if (e + CO_PF_DIST < e_stop) {
            const char *p = (const char *)(val + (int64_t)col[e + CO_PF_DIST] * HC);
            for (int64_t b = 0; b < HC * (int64_t)sizeof(CO_T); b += 64) __builtin_prefetch(p + b);
        }
        const CO_ACC *restrict se = sc + (e - s) * H;
        if (mask)
            for (int64_t h = 0; h < H; ++h) w[h] = se[h] * CO_LOAD(mask[e * H + h]);
        CO_BY_C(C, CO_ATT(axpy_heads), acc, val + (int64_t)col[e] * HC, mask ? w : se, 1, H);
    }
}

/* Prefetch the row of t (HC elements) that edge e + CO_PF_DIST reads. */
#define CO_ATT_PREFETCH(t, e, e_stop, idx, HC)                                                     \
    do {                                                                                           \
        if ((e) + CO_PF_DIST < (e_stop)) {                                                         \
            const char *p_ = (const char *)((t) + (int64_t)(idx)[(e) + CO_PF_DIST] * (HC));        \
            for (int64_t b_ = 0; b_ < (HC) * (int64_t)sizeof(CO_T); b_ += 64) __builtin_prefetch(p_ + b_); \
        }                                                                                          \
    } while (0)

/* ---------------------------------------------------------------------------- backward, shared
 * Backward pass 1 (over target rows, CSR order) fills a scratch wz of E x 2H: wz[e, 0:H] = alpha *
 * mask (the weight edge e gave its source) and wz[e, H:2H] = the gradient of its score; pass 2
 * (over source columns) reads both for a CSC entry from one place, at a random CSR position: one
 * cache line per edge for H <= 8, where separate alpha, mask and score-gradient arrays cost three
 * (pass 2 was waiting on those misses most of its time). */

/* Prefetch the wz entry (2H values) of CSC entry k + CO_PF_DIST. */
#define CO_ATT_PREFETCH_WZ(wz, k, k_stop, perm, H)                                                 \
    do {                                                                                           \
        if ((k) + CO_PF_DIST < (k_stop)) {                                                         \
            const char *p_ = (const char *)((wz) + (perm)[(k) + CO_PF_DIST] * 2 * (H));            \
            for (int64_t b_ = 0; b_ < 2 * (H) * (int64_t)sizeof(CO_ACC); b_ += 64) __builtin_prefetch(p_ + b_); \
        }                                                                                          \
    } while (0)

/* Pass 1 for row i: wz[e, 0:H] = alpha * mask; with scores, wz[e, H:2H] = mask * <g[i, h],
 * val[col[e], h]> (the SDDMM), then the softmax backward in place: alpha * (d - sum_row alpha * d). */
CO_INLINE void CO_ATT(att_row_pass1)(int64_t i, int64_t s, int64_t end, int64_t e_stop, const CO_IT *restrict col,
                                     int64_t H, int64_t C, const CO_T *restrict val, const CO_T *restrict g,
                                     const CO_T *restrict mask, const CO_T *restrict alpha, CO_ACC *restrict wz,
                                     CO_ACC *restrict tot, int scores)
{
    const int64_t HC = H * C, W = 2 * H;
    for (int64_t e = s; e < end; ++e) {
        CO_ACC *restrict we = wz + e * W;
        const CO_T *restrict ae = alpha + e * H;
        if (mask) {
            const CO_T *restrict me = mask + e * H;
#pragma omp simd
            for (int64_t h = 0; h < H; ++h) we[h] = CO_LOAD(ae[h]) * CO_LOAD(me[h]);
        } else {
#pragma omp simd
            for (int64_t h = 0; h < H; ++h) we[h] = CO_LOAD(ae[h]);
        }
    }
    if (!scores) return;
    const CO_T *restrict gi = g + i * HC;
    for (int64_t e = s; e < end; ++e) {
        CO_ATT_PREFETCH(val, e, e_stop, col, HC);
        CO_BY_C(C, CO_ATT(dot_heads), wz + e * W + H, 1, gi, val + (int64_t)col[e] * HC, H);
    }
    for (int64_t h = 0; h < H; ++h) tot[h] = 0;
    for (int64_t e = s; e < end; ++e) {
        CO_ACC *restrict de = wz + e * W + H;
        const CO_T *restrict ae = alpha + e * H;
        if (mask)
            for (int64_t h = 0; h < H; ++h) de[h] *= CO_LOAD(mask[e * H + h]);
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) tot[h] += CO_LOAD(ae[h]) * de[h];
    }
    for (int64_t e = s; e < end; ++e) {
        CO_ACC *restrict de = wz + e * W + H;
        const CO_T *restrict ae = alpha + e * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) de[h] = CO_LOAD(ae[h]) * (de[h] - tot[h]);
    }
}

/* ------------------------------------------------------------------------------------ GAT */

int64_t KFN(CO_N3(gat_forward, CO_DT, CO_ISUF))(
    const int64_t *rowptr, int64_t n_dst, const CO_IT *col, int64_t n_src, int64_t H, int64_t C,
    const CO_T *x, const CO_T *a_src, const CO_T *a_dst, const CO_T *a_edge, const CO_T *mask,
    double negative_slope, CO_T *out, CO_T *alpha, int nthreads, int64_t *bad)
{
    int64_t st = CO_ATT(att_forward_args)(rowptr, n_dst, col, n_src, H, C, x, out, alpha, nthreads, bad);
    if (st != CO_OK) return st;
    const int64_t nnz = rowptr[n_dst], HC = H * C;
    if (nnz > 0 && (!a_src || !a_dst)) return CO_ERR_BAD_ARGUMENT;
    const CO_ACC slope = (CO_ACC)negative_slope;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * HC > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = KFN(balanced_row_start)(rowptr, n_dst, t, nt);
        const int64_t r1 = KFN(balanced_row_start)(rowptr, n_dst, t + 1, nt);
        const int64_t e_stop = rowptr[r1];
        CO_ACC *scratch = (CO_ACC *)malloc((size_t)(CO_T_IS_ACC ? 1 : CO_ATT(att_max_row)(rowptr, r0, r1) * H + 1)
                                           * sizeof(CO_ACC));
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(HC + 4 * H) * sizeof(CO_ACC));
        if (!scratch || !acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            CO_ACC *ad = acc + HC, *tmp = ad + H;
            for (int64_t i = r0; i < r1; ++i) {
                const int64_t s = rowptr[i], end = rowptr[i + 1];
                CO_T *restrict o = out + i * HC;
                if (end == s) {
                    for (int64_t q = 0; q < HC; ++q) o[q] = CO_STORE((CO_ACC)0);
                    continue;
                }
                CO_ACC *restrict sc = CO_ROW_SCORES(scratch, alpha, s, H);
                for (int64_t h = 0; h < H; ++h) ad[h] = CO_LOAD(a_dst[i * H + h]);
                for (int64_t e = s; e < end; ++e) {
                    if (e + CO_PF_DIST < e_stop) __builtin_prefetch(a_src + (int64_t)col[e + CO_PF_DIST] * H);
                    const CO_T *restrict as = a_src + (int64_t)col[e] * H;
                    CO_ACC *restrict se = sc + (e - s) * H;
                    if (a_edge) {
                        const CO_T *restrict ae = a_edge + e * H;
#pragma omp simd
                        for (int64_t h = 0; h < H; ++h) {
                            const CO_ACC z = CO_LOAD(as[h]) + ad[h] + CO_LOAD(ae[h]);
                            se[h] = CO_LRELU(z, slope);
                        }
                    } else {
#pragma omp simd
                        for (int64_t h = 0; h < H; ++h) {
                            const CO_ACC z = CO_LOAD(as[h]) + ad[h];
                            se[h] = CO_LRELU(z, slope);
                        }
                    }
                }
                CO_ATT(att_row_finish)(s, end, e_stop, col, H, C, x, sc, mask, alpha, acc, tmp);
                for (int64_t q = 0; q < HC; ++q) o[q] = CO_STORE(acc[q]);
            }
        }
        free(scratch);
        free(acc);
    }
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
}

int64_t KFN(CO_N3(gat_backward, CO_DT, CO_ISUF))(
    const int64_t *rowptr, int64_t n_dst, const CO_IT *col, const int64_t *colptr, const int64_t *row_t,
    const int64_t *perm, int64_t n_src, int64_t H, int64_t C,
    const CO_T *x, const CO_T *a_src, const CO_T *a_dst, const CO_T *a_edge, const CO_T *mask,
    double negative_slope, const CO_T *alpha, const CO_T *g,
    CO_T *grad_x, CO_T *grad_a_src, CO_T *grad_a_dst, CO_T *grad_a_edge, int nthreads, int64_t *bad)
{
    int64_t st = CO_ATT(att_backward_args)(rowptr, n_dst, col, colptr, row_t, perm, n_src, H, C, x, alpha, g,
                                           nthreads, bad);
    if (st != CO_OK) return st;
    const int64_t nnz = rowptr[n_dst], HC = H * C, W = 2 * H;
    if (nnz > 0 && (!a_src || !a_dst)) return CO_ERR_BAD_ARGUMENT;
    if (!grad_x && !grad_a_src && !grad_a_dst && !grad_a_edge) return CO_OK;
    const CO_ACC slope = (CO_ACC)negative_slope;
    const int scores = grad_a_src || grad_a_dst || grad_a_edge; /* the attention logits need a gradient */
    CO_ACC *wz = CO_ATT(att_scratch)(nnz * W); /* [w | dL/d(logit before leaky_relu)] per edge */
    if (!wz) return CO_ERR_NO_MEMORY;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * HC > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(HC + 2 * H) * sizeof(CO_ACC));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
        CO_ACC *tot = acc ? acc + HC : NULL, *ad = acc ? acc + HC + H : NULL;
        if (acc) { /* pass 1, over target rows */
            const int64_t r0 = KFN(balanced_row_start)(rowptr, n_dst, t, nt);
            const int64_t r1 = KFN(balanced_row_start)(rowptr, n_dst, t + 1, nt);
            const int64_t e_stop = rowptr[r1];
            for (int64_t i = r0; i < r1; ++i) {
                const int64_t s = rowptr[i], end = rowptr[i + 1];
                CO_ATT(att_row_pass1)(i, s, end, e_stop, col, H, C, x, g, mask, alpha, wz, tot, scores);
                if (!scores) continue;
                for (int64_t h = 0; h < H; ++h) { tot[h] = 0; ad[h] = CO_LOAD(a_dst[i * H + h]); }
                for (int64_t e = s; e < end; ++e) { /* leaky_relu backward, z recomputed */
                    if (e + CO_PF_DIST < e_stop) __builtin_prefetch(a_src + (int64_t)col[e + CO_PF_DIST] * H);
                    const CO_T *restrict as = a_src + (int64_t)col[e] * H;
                    const CO_T *restrict ae = a_edge ? a_edge + e * H : NULL;
                    CO_ACC *restrict ge = wz + e * W + H;
#pragma omp simd
                    for (int64_t h = 0; h < H; ++h) {
                        const CO_ACC z = CO_LOAD(as[h]) + ad[h] + (ae ? CO_LOAD(ae[h]) : (CO_ACC)0);
                        const CO_ACC v = CO_KEEP(ge[h], z > 0) + CO_KEEP(ge[h] * slope, !(z > 0));
                        ge[h] = v;
                        tot[h] += v;
                    }
                    if (grad_a_edge)
                        for (int64_t h = 0; h < H; ++h) grad_a_edge[e * H + h] = CO_STORE(ge[h]);
                }
                if (grad_a_dst)
                    for (int64_t h = 0; h < H; ++h) grad_a_dst[i * H + h] = CO_STORE(tot[h]);
            }
        }
#pragma omp barrier
        if ((grad_x || grad_a_src) && acc) { /* pass 2, over source columns */
            const int64_t j0 = KFN(balanced_row_start)(colptr, n_src, t, nt);
            const int64_t j1 = KFN(balanced_row_start)(colptr, n_src, t + 1, nt);
            const int64_t k_stop = colptr[j1];
            for (int64_t j = j0; j < j1; ++j) {
                for (int64_t q = 0; q < HC; ++q) acc[q] = 0;
                for (int64_t h = 0; h < H; ++h) tot[h] = 0;
                for (int64_t k = colptr[j]; k < colptr[j + 1]; ++k) {
                    CO_ATT_PREFETCH_WZ(wz, k, k_stop, perm, H);
                    const CO_ACC *restrict we = wz + perm[k] * W;
                    if (grad_x) {
                        CO_ATT_PREFETCH(g, k, k_stop, row_t, HC);
                        CO_BY_C(C, CO_ATT(axpy_heads), acc, g + row_t[k] * HC, we, 1, H);
                    }
                    if (grad_a_src)
#pragma omp simd
                        for (int64_t h = 0; h < H; ++h) tot[h] += we[H + h];
                }
                if (grad_x)
                    for (int64_t q = 0; q < HC; ++q) grad_x[j * HC + q] = CO_STORE(acc[q]);
                if (grad_a_src)
                    for (int64_t h = 0; h < H; ++h) grad_a_src[j * H + h] = CO_STORE(tot[h]);
            }
        }
        free(acc);
    }
    free(wz);
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
}

/* ------------------------------------------------------------------------------------ GATv2 */

int64_t KFN(CO_N3(gatv2_forward, CO_DT, CO_ISUF))(
    const int64_t *rowptr, int64_t n_dst, const CO_IT *col, int64_t n_src, int64_t H, int64_t C,
    const CO_T *x_l, const CO_T *x_r, const CO_T *att, const CO_T *mask, double negative_slope,
    CO_T *out, CO_T *alpha, int nthreads, int64_t *bad)
{
    int64_t st = CO_ATT(att_forward_args)(rowptr, n_dst, col, n_src, H, C, x_l, out, alpha, nthreads, bad);
    if (st != CO_OK) return st;
    const int64_t nnz = rowptr[n_dst], HC = H * C;
    if (nnz > 0 && (!x_r || !att)) return CO_ERR_BAD_ARGUMENT;
    const CO_ACC slope = (CO_ACC)negative_slope;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * HC > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = KFN(balanced_row_start)(rowptr, n_dst, t, nt);
        const int64_t r1 = KFN(balanced_row_start)(rowptr, n_dst, t + 1, nt);
        const int64_t e_stop = rowptr[r1];
        CO_ACC *scratch = (CO_ACC *)malloc((size_t)(CO_T_IS_ACC ? 1 : CO_ATT(att_max_row)(rowptr, r0, r1) * H + 1)
                                           * sizeof(CO_ACC));
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(3 * HC + 3 * H) * sizeof(CO_ACC));
        if (!scratch || !acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            CO_ACC *xr = acc + HC, *at = acc + 2 * HC, *tmp = acc + 3 * HC;
            for (int64_t q = 0; q < HC; ++q) at[q] = nnz > 0 ? CO_LOAD(att[q]) : 0;
            for (int64_t i = r0; i < r1; ++i) {
                const int64_t s = rowptr[i], end = rowptr[i + 1];
                CO_T *restrict o = out + i * HC;
                if (end == s) {
                    for (int64_t q = 0; q < HC; ++q) o[q] = CO_STORE((CO_ACC)0);
                    continue;
                }
                CO_ACC *restrict sc = CO_ROW_SCORES(scratch, alpha, s, H);
                for (int64_t q = 0; q < HC; ++q) xr[q] = CO_LOAD(x_r[i * HC + q]);
                for (int64_t e = s; e < end; ++e) {
                    CO_ATT_PREFETCH(x_l, e, e_stop, col, HC);
                    CO_BY_C(C, CO_ATT(v2_score_heads), sc + (e - s) * H, 1, x_l + (int64_t)col[e] * HC, xr, at, slope,
                            H);
                }
                CO_ATT(att_row_finish)(s, end, e_stop, col, H, C, x_l, sc, mask, alpha, acc, tmp);
                for (int64_t q = 0; q < HC; ++q) o[q] = CO_STORE(acc[q]);
            }
        }
        free(scratch);
        free(acc);
    }
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
}

/* grad_att is reduced over all edges: each thread sums into its own H x C partial, combined in
 * thread order at the end (no atomics). */
int64_t KFN(CO_N3(gatv2_backward, CO_DT, CO_ISUF))(
    const int64_t *rowptr, int64_t n_dst, const CO_IT *col, const int64_t *colptr, const int64_t *row_t,
    const int64_t *perm, int64_t n_src, int64_t H, int64_t C,
    const CO_T *x_l, const CO_T *x_r, const CO_T *att, const CO_T *mask, double negative_slope,
    const CO_T *alpha, const CO_T *g, CO_T *grad_x_l, CO_T *grad_x_r, CO_T *grad_att, int nthreads, int64_t *bad)
{
    int64_t st = CO_ATT(att_backward_args)(rowptr, n_dst, col, colptr, row_t, perm, n_src, H, C, x_l, alpha, g,
                                           nthreads, bad);
    if (st != CO_OK) return st;
    const int64_t nnz = rowptr[n_dst], HC = H * C, W = 2 * H;
    if (nnz > 0 && (!x_r || !att)) return CO_ERR_BAD_ARGUMENT;
    if (!grad_x_l && !grad_x_r && !grad_att) return CO_OK;
    const CO_ACC slope = (CO_ACC)negative_slope;
    CO_ACC *wz = CO_ATT(att_scratch)(nnz * W); /* [w | dL/d(score)] per edge */
    CO_ACC *partial = (CO_ACC *)calloc((size_t)(nthreads * HC + 1), sizeof(CO_ACC)); /* per-thread grad_att */
    if (!wz || !partial) { free(wz); free(partial); return CO_ERR_NO_MEMORY; }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * HC > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(3 * HC + H) * sizeof(CO_ACC));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
        CO_ACC *at = acc ? acc + HC : NULL, *xr = acc ? acc + 2 * HC : NULL, *tot = acc ? acc + 3 * HC : NULL;
        if (acc)
            for (int64_t q = 0; q < HC; ++q) at[q] = nnz > 0 ? CO_LOAD(att[q]) : 0;
        if (acc) { /* pass 1, over target rows */
            const int64_t r0 = KFN(balanced_row_start)(rowptr, n_dst, t, nt);
            const int64_t r1 = KFN(balanced_row_start)(rowptr, n_dst, t + 1, nt);
            CO_ACC *ga = partial + (int64_t)t * HC;
            for (int64_t i = r0; i < r1; ++i) {
                const int64_t s = rowptr[i], end = rowptr[i + 1];
                CO_ATT(att_row_pass1)(i, s, end, rowptr[r1], col, H, C, x_l, g, mask, alpha, wz, tot, 1);
                if (!grad_x_r && !grad_att) continue; /* grad_x_l needs only wz */
                for (int64_t q = 0; q < HC; ++q) { acc[q] = 0; xr[q] = CO_LOAD(x_r[i * HC + q]); }
                for (int64_t e = s; e < end; ++e)
                    CO_BY_C(C, CO_ATT(v2_row_heads), acc, ga, x_l + (int64_t)col[e] * HC, xr, at, wz + e * W + H, slope,
                            H);
                if (grad_x_r)
                    for (int64_t q = 0; q < HC; ++q) grad_x_r[i * HC + q] = CO_STORE(acc[q]);
            }
        }
#pragma omp barrier
        if (grad_x_l && acc) { /* pass 2, over source columns: aggregation + score terms */
            const int64_t j0 = KFN(balanced_row_start)(colptr, n_src, t, nt);
            const int64_t j1 = KFN(balanced_row_start)(colptr, n_src, t + 1, nt);
            const int64_t k_stop = colptr[j1];
            for (int64_t j = j0; j < j1; ++j) {
                for (int64_t q = 0; q < HC; ++q) acc[q] = 0;
                for (int64_t k = colptr[j]; k < colptr[j + 1]; ++k) {
                    CO_ATT_PREFETCH(g, k, k_stop, row_t, HC);
                    CO_ATT_PREFETCH(x_r, k, k_stop, row_t, HC);
                    CO_ATT_PREFETCH_WZ(wz, k, k_stop, perm, H);
                    const CO_ACC *restrict we = wz + perm[k] * W;
                    CO_BY_C(C, CO_ATT(v2_col_heads), acc, g + row_t[k] * HC, x_l + j * HC, x_r + row_t[k] * HC, at, we,
                            we + H, slope, H);
                }
                for (int64_t q = 0; q < HC; ++q) grad_x_l[j * HC + q] = CO_STORE(acc[q]);
            }
        }
        free(acc);
    }
    if (grad_att && !failed) {
        for (int64_t q = 0; q < HC; ++q) {
            CO_ACC sum = 0;
            for (int t = 0; t < nthreads; ++t) sum += partial[(int64_t)t * HC + q];
            grad_att[q] = CO_STORE(sum);
        }
    }
    free(wz);
    free(partial);
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
}

/* ------------------------------------------------------------------------------------ TransformerConv */

int64_t KFN(CO_N3(transformer_forward, CO_DT, CO_ISUF))(
    const int64_t *rowptr, int64_t n_dst, const CO_IT *col, int64_t n_src, int64_t H, int64_t C,
    const CO_T *q, const CO_T *k, const CO_T *v, const CO_T *mask, double score_div,
    CO_T *out, CO_T *alpha, int nthreads, int64_t *bad)
{
    int64_t st = CO_ATT(att_forward_args)(rowptr, n_dst, col, n_src, H, C, v, out, alpha, nthreads, bad);
    if (st != CO_OK) return st;
    const int64_t nnz = rowptr[n_dst], HC = H * C;
    if (nnz > 0 && (!q || !k)) return CO_ERR_BAD_ARGUMENT;
    const CO_ACC div = (CO_ACC)score_div;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * HC > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = KFN(balanced_row_start)(rowptr, n_dst, t, nt);
        const int64_t r1 = KFN(balanced_row_start)(rowptr, n_dst, t + 1, nt);
        const int64_t e_stop = rowptr[r1];
        CO_ACC *scratch = (CO_ACC *)malloc((size_t)(CO_T_IS_ACC ? 1 : CO_ATT(att_max_row)(rowptr, r0, r1) * H + 1)
                                           * sizeof(CO_ACC));
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(HC + 3 * H) * sizeof(CO_ACC));
        if (!scratch || !acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            CO_ACC *tmp = acc + HC;
            for (int64_t i = r0; i < r1; ++i) {
                const int64_t s = rowptr[i], end = rowptr[i + 1], deg = end - s;
                CO_T *restrict o = out + i * HC;
                if (deg == 0) {
                    for (int64_t c = 0; c < HC; ++c) o[c] = CO_STORE((CO_ACC)0);
                    continue;
                }
                CO_ACC *restrict sc = CO_ROW_SCORES(scratch, alpha, s, H);
                for (int64_t e = s; e < end; ++e) {
                    CO_ATT_PREFETCH(k, e, e_stop, col, HC);
                    CO_BY_C(C, CO_ATT(dot_heads), sc + (e - s) * H, 1, q + i * HC, k + (int64_t)col[e] * HC, H);
                }
#pragma omp simd
                for (int64_t z = 0; z < deg * H; ++z) sc[z] = sc[z] / div;
                CO_ATT(att_row_finish)(s, end, e_stop, col, H, C, v, sc, mask, alpha, acc, tmp);
                for (int64_t c = 0; c < HC; ++c) o[c] = CO_STORE(acc[c]);
            }
        }
        free(scratch);
        free(acc);
    }
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
}

int64_t KFN(CO_N3(transformer_backward, CO_DT, CO_ISUF))(
    const int64_t *rowptr, int64_t n_dst, const CO_IT *col, const int64_t *colptr, const int64_t *row_t,
    const int64_t *perm, int64_t n_src, int64_t H, int64_t C,
    const CO_T *q, const CO_T *k, const CO_T *v, const CO_T *mask, double score_div,
    const CO_T *alpha, const CO_T *g, CO_T *grad_q, CO_T *grad_k, CO_T *grad_v, int nthreads, int64_t *bad)
{
    int64_t st = CO_ATT(att_backward_args)(rowptr, n_dst, col, colptr, row_t, perm, n_src, H, C, v, alpha, g,
                                           nthreads, bad);
    if (st != CO_OK) return st;
    const int64_t nnz = rowptr[n_dst], HC = H * C, W = 2 * H;
    if (nnz > 0 && (!q || !k)) return CO_ERR_BAD_ARGUMENT;
    if (!grad_q && !grad_k && !grad_v) return CO_OK;
    const CO_ACC div = (CO_ACC)score_div;
    const int scores = grad_q || grad_k;
    CO_ACC *wz = CO_ATT(att_scratch)(nnz * W); /* [w | dL/d(score)] per edge */
    if (!wz) return CO_ERR_NO_MEMORY;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nnz * HC > 32768)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        CO_ACC *acc = (CO_ACC *)malloc((size_t)(2 * HC + H) * sizeof(CO_ACC));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
        CO_ACC *gk = acc ? acc + HC : NULL, *tot = acc ? acc + 2 * HC : NULL;
        if (acc) { /* pass 1, over target rows: the score gradient and grad_q */
            const int64_t r0 = KFN(balanced_row_start)(rowptr, n_dst, t, nt);
            const int64_t r1 = KFN(balanced_row_start)(rowptr, n_dst, t + 1, nt);
            for (int64_t i = r0; i < r1; ++i) {
                const int64_t s = rowptr[i], end = rowptr[i + 1];
                CO_ATT(att_row_pass1)(i, s, end, rowptr[r1], col, H, C, v, g, mask, alpha, wz, tot, scores);
                if (!scores) continue;
                for (int64_t e = s; e < end; ++e)
                    for (int64_t h = 0; h < H; ++h) wz[e * W + H + h] = wz[e * W + H + h] / div;
                if (!grad_q) continue;
                for (int64_t c = 0; c < HC; ++c) acc[c] = 0;
                for (int64_t e = s; e < end; ++e)
                    CO_BY_C(C, CO_ATT(axpy_heads), acc, k + (int64_t)col[e] * HC, wz + e * W + H, 1, H);
                for (int64_t c = 0; c < HC; ++c) grad_q[i * HC + c] = CO_STORE(acc[c]);
            }
        }
#pragma omp barrier
        if ((grad_k || grad_v) && acc) { /* pass 2, over source columns: grad_v and grad_k */
            const int64_t j0 = KFN(balanced_row_start)(colptr, n_src, t, nt);
            const int64_t j1 = KFN(balanced_row_start)(colptr, n_src, t + 1, nt);
            const int64_t k_stop = colptr[j1];
            for (int64_t j = j0; j < j1; ++j) {
                for (int64_t c = 0; c < HC; ++c) { acc[c] = 0; gk[c] = 0; }
                for (int64_t kk = colptr[j]; kk < colptr[j + 1]; ++kk) {
                    const int64_t i = row_t[kk];
                    CO_ATT_PREFETCH_WZ(wz, kk, k_stop, perm, H);
                    const CO_ACC *restrict we = wz + perm[kk] * W;
                    if (grad_v) {
                        CO_ATT_PREFETCH(g, kk, k_stop, row_t, HC);
                        CO_BY_C(C, CO_ATT(axpy_heads), acc, g + i * HC, we, 1, H);
                    }
                    if (grad_k) {
                        CO_ATT_PREFETCH(q, kk, k_stop, row_t, HC);
                        CO_BY_C(C, CO_ATT(axpy_heads), gk, q + i * HC, we + H, 1, H);
                    }
                }
                if (grad_v)
                    for (int64_t c = 0; c < HC; ++c) grad_v[j * HC + c] = CO_STORE(acc[c]);
                if (grad_k)
                    for (int64_t c = 0; c < HC; ++c) grad_k[j * HC + c] = CO_STORE(gk[c]);
            }
        }
        free(acc);
    }
    free(wz);
    return failed ? CO_ERR_NO_MEMORY : CO_OK;
}

#undef CO_ATT_PREFETCH
#undef CO_ATT_PREFETCH_WZ
#undef CO_ROW_SCORES
#undef CO_BY_H
#undef CO_LRELU
#undef CO_EXP
#undef CO_ATT
