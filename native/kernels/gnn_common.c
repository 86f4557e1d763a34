/* Helpers shared by the GNN kernels (segment.c, segment_backward.c, csr.c).
 * Included once per ISA variant by variants.c; every name goes through KFN.
 *
 * Feature dtypes: f32 (float, accumulated in float), f64 (double, accumulated in double; used by
 * gradcheck) and bf16 (stored as uint16_t, widened to float to accumulate, rounded to nearest
 * even when written back). */

#ifndef CO_GNN_REDUCE_DEFINED
#define CO_GNN_REDUCE_DEFINED
/* reduce codes, shared with cpu_opt/gnn/_kernels.py */
#define CO_RED_SUM 0
#define CO_RED_MEAN 1
#define CO_RED_MAX 2
#define CO_RED_MIN 3
#define CO_RED_PROD 4
/* how many edges ahead segment_reduce prefetches the neighbour's feature row */
#define CO_PF_DIST 16
#endif

static inline float KFN(bf16_to_f32)(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t KFN(f32_to_bf16)(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a (quiet) NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* v where keep is 1, +0.0 where keep is 0, by bit masking: unlike `keep ? v : 0` this keeps the
 * loops around it free of control flow, so gcc vectorizes them (mixed int64 / float lanes). */
static inline float KFN(keep_f32)(float v, int64_t keep)
{
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    b &= 0u - (uint32_t)keep;
    memcpy(&v, &b, sizeof v);
    return v;
}

static inline double KFN(keep_f64)(double v, int64_t keep)
{
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    b &= 0ull - (uint64_t)keep;
    memcpy(&v, &b, sizeof v);
    return v;
}

#ifndef CO_KEEP
#define CO_KEEP(v, keep) _Generic((v), float: KFN(keep_f32), double: KFN(keep_f64))((v), (keep))
#endif

/* first row of thread t's share when n_rows rows (rowptr) are split into nt parts of about
 * equal (nonzeros + rows): the smallest r with rowptr[r] + r >= total * t / nt */
static inline int64_t KFN(balanced_row_start)(const int64_t *rowptr, int64_t n_rows, int t, int nt)
{
    if (t <= 0) return 0;
    if (t >= nt) return n_rows;
    int64_t total = rowptr[n_rows] + n_rows;
    int64_t target = (int64_t)((double)total * t / nt);
    int64_t lo = 0, hi = n_rows;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (rowptr[mid] + mid >= target) hi = mid; else lo = mid + 1;
    }
    return lo;
}

/* rowptr must start at 0, never decrease; returns the first bad position or -1 */
static int64_t KFN(check_rowptr)(const int64_t *rowptr, int64_t n_rows)
{
    if (rowptr[0] != 0) return 0;
    for (int64_t r = 0; r < n_rows; ++r)
        if (rowptr[r + 1] < rowptr[r]) return r + 1;
    return -1;
}

/* A winner index (n_rows x F, int32, relative to the row start; -1: none) is valid when every
 * entry is -1 or inside its row: returns the first bad flat position or -1. */
static int64_t KFN(first_bad_winner)(const int32_t *arg, const int64_t *rowptr, int64_t n_rows, int64_t F,
                                     int nthreads)
{
    int64_t bad = INT64_MAX;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(min:bad) if (n_rows * F > 65536)
    for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t len = rowptr[r + 1] - rowptr[r];
        for (int64_t j = 0; j < F; ++j) {
            const int64_t v = arg[r * F + j];
            if ((v < -1 || v >= len) && r * F + j < bad) bad = r * F + j;
        }
    }
    return bad == INT64_MAX ? -1 : bad;
}

/* A winner mask (nnz x W uint64, W = ceil(F / 64); bit j % 64 of word j / 64: the nonzero won
 * feature j) is valid when no bit at or past F is set: returns the first bad word or -1. */
static int64_t KFN(first_bad_mask)(const uint64_t *wmask, int64_t nnz, int64_t F, int nthreads)
{
    const int64_t W = (F + 63) / 64;
    if (F % 64 == 0) return -1;
    const uint64_t extra = ~0ull << (F % 64); /* bits past F in the last word */
    int64_t bad = INT64_MAX;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(min:bad) if (nnz > 65536)
    for (int64_t e = 0; e < nnz; ++e)
        if ((wmask[e * W + W - 1] & extra) && e * W + W - 1 < bad) bad = e * W + W - 1;
    return bad == INT64_MAX ? -1 : bad;
}

#define CO_CHECK_RANGE(IDX_T)                                                                \
    static int64_t KFN(first_out_of_range_##IDX_T)(const IDX_T *idx, int64_t n, int64_t lo, \
                                                   int64_t hi, int nthreads)               \
    {                                                                                        \
        int64_t bad = INT64_MAX;                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) reduction(min:bad) if(n > 65536)") \
        for (int64_t i = 0; i < n; ++i) {                                                    \
            int64_t v = (int64_t)idx[i];                                                     \
            if ((v < lo || v >= hi) && i < bad) bad = i;                                     \
        }                                                                                    \
        return bad == INT64_MAX ? -1 : bad;                                                  \
    }
CO_CHECK_RANGE(int64_t)
CO_CHECK_RANGE(int32_t)
#undef CO_CHECK_RANGE

#ifndef _OPENMP
#ifndef CO_NO_OMP_STUBS
#define CO_NO_OMP_STUBS
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif
#endif

/* token pasting through one more level, so template parameters that are macros expand first */
#ifndef CO_N2
#define CO_N2_(a, b) a##_##b
#define CO_N2(a, b) CO_N2_(a, b)
#define CO_N3_(a, b, c) a##_##b##_##c
#define CO_N3(a, b, c) CO_N3_(a, b, c)
#endif
