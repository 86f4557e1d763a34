/* Fused graph attention over the CSR of incoming edges (rowptr over the n_dst targets, col = the
 * sources in [0, n_src)): per-edge scores, a softmax over each target's incoming edges, optional
 * dropout of the normalised coefficients, and the weighted sum of the sources' per-head rows, with
 * H heads of C channels each (node rows are H x C, head h at offset h * C). No E x H x C message
 * tensor exists at any point; what is kept for backward is alpha (E x H, the softmax before
 * dropout, in CSR order).
 *
 *   gat          score[e, h] = leaky_relu(a_src[j, h] + a_dst[i, h] (+ a_edge[e, h]))   (GATConv)
 *                out[i, h] = sum_e alpha[e, h] * mask[e, h] * x[j, h]
 *   gatv2        score[e, h] = sum_c att[h, c] * leaky_relu(x_l[j, h, c] + x_r[i, h, c]) (GATv2Conv)
 *                out[i, h] = sum_e alpha[e, h] * mask[e, h] * x_l[j, h]
 *   transformer  score[e, h] = <q[i, h], k[j, h]> / score_div                          (TransformerConv)
 *                out[i, h] = sum_e alpha[e, h] * mask[e, h] * v[j, h]
 *   with alpha[e, h] = exp(score - max_row) / (sum_row exp(score - max_row) + 1e-16) (PyG's softmax)
 *   and mask the dropout multiplier (0 or 1 / (1 - p), drawn by torch; NULL: no dropout).
 *
 * Backward kernels take the CSC transpose the graph caches (colptr over sources, row_t = target of
 * each, perm = its CSR position): pass 1 runs over target rows (the SDDMM <g[i, h], x[j, h]>,
 * the softmax backward per row and the target-side gradients), pass 2 over source columns (the
 * source-side gradients, gathered: each thread owns whole output rows, no atomics). Gradients
 * are written only where their pointer is not NULL.
 *
 * Rows are split across threads by (nonzeros + rows) as in segment.c. Every index is checked
 * before any write: bad[0] = the offending position, bad[1] = which argument (0 rowptr, 1 col,
 * 2 colptr, 3 row_t, 4 perm); CO_ERR_UNSORTED for a pointer array that does not start at 0 or
 * decreases (or does not end at the number of edges), CO_ERR_INDEX_OUT_OF_RANGE for an index. */

#ifndef CO_ATT_DEFINED
#define CO_ATT_DEFINED
#define CO_ATT_ROWPTR 0
#define CO_ATT_COL 1
#define CO_ATT_COLPTR 2
#define CO_ATT_ROW_T 3
#define CO_ATT_PERM 4
/* PyG's softmax adds this to the denominator */
#define CO_SOFTMAX_EPS 1e-16
/* calls fn(args..., C) with C a compile-time constant for the usual channel counts, so the
 * always-inline helpers below compile to fixed-length vector loops; any other C takes the
 * generic loop */
#define CO_BY_C(C_, fn, ...)                                 \
    do {                                                     \
        switch (C_) {                                        \
        case 4: fn(__VA_ARGS__, 4); break;                   \
        case 8: fn(__VA_ARGS__, 8); break;                   \
        case 16: fn(__VA_ARGS__, 16); break;                 \
        case 32: fn(__VA_ARGS__, 32); break;                 \
        case 64: fn(__VA_ARGS__, 64); break;                 \
        default: fn(__VA_ARGS__, C_); break;                 \
        }                                                    \
    } while (0)
#define CO_INLINE static inline __attribute__((always_inline))
#endif

/* e^x in float, vectorizable (glibc's expf is not without -ffast-math): x = n ln2 + r with
 * |r| <= ln2 / 2 (Cody-Waite, two-part ln2), e^r by its degree-7 Taylor polynomial (truncation
 * below 6e-9 relative), times 2^n as two exponent-built factors so that n from -252 to 254 is
 * exact: underflow to 0 and overflow to inf come out as expf's; NaN stays NaN. */
static inline float KFN(co_expf)(float x)
{
    /* selects by bit masks, not ?:, so gcc keeps the whole body unconditional and vectorizes it */
    const int64_t ok = x == x;
    float xc = x < -150.0f ? -150.0f : x;
    xc = xc > 100.0f ? 100.0f : xc;
    xc = KFN(keep_f32)(xc, ok);
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (xc * 1.44269504088896341f + magic) - magic;
    float r = xc - n * 0.693145751953125f;
    r = r - n * 1.42860682030941723e-6f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;
    const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return KFN(keep_f32)(p * s1 * s2, ok) + KFN(keep_f32)(x, !ok);
}

static inline double KFN(co_exp)(double x) { return exp(x); }

#define CO_TEMPLATE "attention_tmpl.h"
#include "gnn_dtypes.h"
#undef CO_TEMPLATE
