/* 3 x 3 stride-1 convolutions in fp32 by Winograd's minimal filtering (Lavin & Gray, 2015): F(2 x 2, 3 x 3)
 * makes each 2 x 2 block of the output from a 4 x 4 input tile with 16 multiplications per input and
 * output channel instead of 36, F(4 x 4, 3 x 3) each 4 x 4 block from a 6 x 6 tile with 36 instead of 144.
 * On AVX2 the convolution libraries reachable from Python compute 3 x 3 convolutions directly
 * (oneDNN's brgconv:avx2 in cpu_opt's oneDNN 3.2, torch's oneDNN and OpenVINO): ResNet-50's stride-1
 * 3 x 3 layers run at about 70 GFLOP/s per Zen 3 core there.
 *
 *   wino_pack_f32: W (Cout x Cin x 3 x 3, PyTorch's OIHW) into E = (m + 2)^2 matrices U_e = (G g G^T)_e
 *                  (Cout x Cin; g the 3 x 3 kernel of one output and input channel, computed in
 *                  double), each packed as sgemm.c packs a weight (sgemm_pack_f32), one after the
 *                  other: wino_packed_size(Cout, Cin, m) floats, m = 2 or 4. Done once per layer.
 *   wino_conv_f32: y (B x OH x OW x Cout, NHWC) = conv(x (B x H x W x Cin, NHWC), W, zero padding
 *                  pad_h / pad_w on each side) (+ bias[Cout]) (+ add, y's shape and layout: a
 *                  residual), then act (0 none, 1 relu): OH = H + 2 pad_h - 2, OW = W + 2 pad_w - 2;
 *                  wp packed for the same m.
 *
 * The output's m x m blocks (tiles) are taken in chunks whose transformed inputs and products fit in
 * CO_WG_SCRATCH floats, each chunk in three steps inside one parallel region: every tile's input
 * patch to V = B^T d B (E values per channel, written as E matrices V_e of tiles x Cin: threads split
 * the tiles); the E products M_e = V_e U_e^T on sgemm.c's packed GEMM (threads split e, one
 * single-threaded GEMM each); every tile's output y = A^T m A (+ bias, add, act: threads split the
 * tiles). The result does not depend on the thread count.
 * Against the direct convolution the products are rounded differently (the transforms combine up to
 * 9 (m = 2) or 25 (m = 4, with factors up to 5 and 8) values around each multiplication): relative
 * errors against float64 of a few 1e-7 with m = 2 on ResNet's layers (the direct convolution's are
 * 1e-6), a few 1e-6 with m = 4.
 * Sizes and pointers are checked before any memory is touched: CO_ERR_BAD_ARGUMENT for B, H, W, Cin
 * or Cout < 1, m not 2 or 4, pad_h or pad_w < 0, an output smaller than 1 x 1, act not 0 or 1,
 * nthreads < 1 or a NULL pointer (bias and add may be NULL); CO_ERR_NO_MEMORY when the scratch (V and
 * M for one chunk: nothing written then) or a GEMM's strips cannot be allocated (y is then
 * incomplete; the caller raises). */

#ifndef CO_WINO_DEFINED
#define CO_WINO_DEFINED
#define CO_WG_SCRATCH (1 << 21) /* most floats of V and M per chunk of tiles (8 MiB) */
#define CO_WG_MAXA 6            /* the largest tile side (m = 4) */

/* one dimension of each transform, on a[0..] into r[0..], for vectors or scalars (ADD, SUB, MUL(c, v)) */
#define CO_WG2_BT(a, r, ADD, SUB, MUL)                                                                    \
    do {                                                                                                  \
        r[0] = SUB(a[0], a[2]);                                                                           \
        r[1] = ADD(a[1], a[2]);                                                                           \
        r[2] = SUB(a[2], a[1]);                                                                           \
        r[3] = SUB(a[1], a[3]);                                                                           \
    } while (0)
#define CO_WG4_BT(a, r, ADD, SUB, MUL)                                                                    \
    do {                                                                                                  \
        r[0] = ADD(SUB(MUL(4.f, a[0]), MUL(5.f, a[2])), a[4]);                                            \
        r[1] = SUB(ADD(a[3], a[4]), MUL(4.f, ADD(a[1], a[2])));                                           \
        r[2] = ADD(MUL(4.f, SUB(a[1], a[2])), SUB(a[4], a[3]));                                           \
        r[3] = ADD(MUL(2.f, SUB(a[3], a[1])), SUB(a[4], a[2]));                                           \
        r[4] = ADD(MUL(2.f, SUB(a[1], a[3])), SUB(a[4], a[2]));                                           \
        r[5] = ADD(SUB(MUL(4.f, a[1]), MUL(5.f, a[3])), a[5]);                                            \
    } while (0)
#define CO_WG2_AT(a, r, ADD, SUB, MUL)                                                                    \
    do {                                                                                                  \
        r[0] = ADD(ADD(a[0], a[1]), a[2]);                                                                \
        r[1] = SUB(SUB(a[1], a[2]), a[3]);                                                                \
    } while (0)
#define CO_WG4_AT(a, r, ADD, SUB, MUL)                                                                    \
    do {                                                                                                  \
        r[0] = ADD(ADD(a[0], ADD(a[1], a[2])), ADD(a[3], a[4]));                                          \
        r[1] = ADD(SUB(a[1], a[2]), MUL(2.f, SUB(a[3], a[4])));                                           \
        r[2] = ADD(ADD(a[1], a[2]), MUL(4.f, ADD(a[3], a[4])));                                           \
        r[3] = ADD(ADD(SUB(a[1], a[2]), MUL(8.f, SUB(a[3], a[4]))), a[5]);                                \
    } while (0)
/* a 2-D transform, rows then columns: p (n x n, row-major) to q (k x k), one 1-D step T1 of n -> k */
#define CO_WG_2D(TYPE, T1, n, k, p, q, ADD, SUB, MUL)                                                     \
    do {                                                                                                  \
        TYPE t_[CO_WG_MAXA][CO_WG_MAXA], a_[CO_WG_MAXA], r_[CO_WG_MAXA];                                  \
        for (int j_ = 0; j_ < (n); ++j_) {                                                                \
            for (int i_ = 0; i_ < (n); ++i_) a_[i_] = p[i_ * (n) + j_];                                   \
            T1(a_, r_, ADD, SUB, MUL);                                                                    \
            for (int i_ = 0; i_ < (k); ++i_) t_[i_][j_] = r_[i_];                                         \
        }                                                                                                 \
        for (int i_ = 0; i_ < (k); ++i_) {                                                                \
            T1(t_[i_], r_, ADD, SUB, MUL);                                                                \
            for (int j_ = 0; j_ < (k); ++j_) q[i_ * (k) + j_] = r_[j_];                                   \
        }                                                                                                 \
    } while (0)
#define CO_WG_ADDS(a, b) ((a) + (b))
#define CO_WG_SUBS(a, b) ((a) - (b))
#define CO_WG_MULS(c, v) ((c) * (v))
#define CO_WG_MULV(c, v) _mm256_mul_ps(_mm256_set1_ps(c), (v))
#endif

int64_t KFN(wino_packed_size)(int64_t Cout, int64_t Cin, int64_t m) {
    const int64_t one = KFN(sgemm_packed_size)(Cout, Cin);
    return one < 0 || (m != 2 && m != 4) ? -1 : (m + 2) * (m + 2) * one;
}

int64_t KFN(wino_pack_f32)(const float *w, int64_t Cout, int64_t Cin, int64_t m, float *wp) {
    if (!w || !wp || Cout < 1 || Cin < 1 || (m != 2 && m != 4)) return CO_ERR_BAD_ARGUMENT;
    const int n = (int)m + 2, E = n * n;
    /* G (n x 3) of F(m x m, 3 x 3): the rows a kernel column g0, g1, g2 is combined with */
    static const double G2[4][3] = {{1, 0, 0}, {0.5, 0.5, 0.5}, {0.5, -0.5, 0.5}, {0, 0, 1}};
    static const double G4[6][3] = {{0.25, 0, 0},
                                    {-1. / 6, -1. / 6, -1. / 6},
                                    {-1. / 6, 1. / 6, -1. / 6},
                                    {1. / 24, 1. / 12, 1. / 6},
                                    {1. / 24, -1. / 12, 1. / 6},
                                    {0, 0, 1}};
    const double(*G)[3] = m == 2 ? G2 : G4;
    float *u = (float *)malloc((size_t)E * (size_t)Cout * (size_t)Cin * sizeof(float));
    if (!u) return CO_ERR_NO_MEMORY;
    const int64_t plane = Cout * Cin;
    for (int64_t oc = 0; oc < Cout; ++oc)
        for (int64_t ic = 0; ic < Cin; ++ic) {
            const float *g = w + (oc * Cin + ic) * 9;
            double gg[CO_WG_MAXA][3];
            for (int i = 0; i < n; ++i) /* G g */
                for (int j = 0; j < 3; ++j) gg[i][j] = G[i][0] * g[j] + G[i][1] * g[3 + j] + G[i][2] * g[6 + j];
            for (int i = 0; i < n; ++i) /* (G g) G^T */
                for (int j = 0; j < n; ++j)
                    u[(i * n + j) * plane + oc * Cin + ic] =
                        (float)(gg[i][0] * G[j][0] + gg[i][1] * G[j][1] + gg[i][2] * G[j][2]);
        }
    const int64_t one = KFN(sgemm_packed_size)(Cout, Cin);
    for (int e = 0; e < E; ++e) KFN(sgemm_pack_f32)(u + e * plane, Cout, Cin, 0, wp + e * one);
    free(u);
    return CO_OK;
}

/* the input patch of tile t (its n x n pixels, n = m + 2, zero outside the image) to V's E rows t */
static inline void KFN(co_wg_input)(const float *x, int64_t H, int64_t W, int64_t Cin, int64_t pad_h, int64_t pad_w,
                                    int m, int64_t th, int64_t tw, int64_t tile, float *v, int64_t ldv, int64_t t) {
    const int n = m + 2, E = n * n;
    const int64_t b = tile / (th * tw), r = tile % (th * tw);
    const int64_t iy0 = m * (r / tw) - pad_h, ix0 = m * (r % tw) - pad_w;
    const float *px[CO_WG_MAXA * CO_WG_MAXA];
    for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) {
            const int64_t iy = iy0 + i, ix = ix0 + j;
            px[i * n + j] = iy >= 0 && iy < H && ix >= 0 && ix < W ? x + ((b * H + iy) * W + ix) * Cin : NULL;
        }
    float *dst = v + t * Cin;
    int64_t c = 0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    for (; c + 8 <= Cin; c += 8) {
        __m256 d[CO_WG_MAXA * CO_WG_MAXA], o[CO_WG_MAXA * CO_WG_MAXA];
        for (int k = 0; k < E; ++k) d[k] = px[k] ? _mm256_loadu_ps(px[k] + c) : _mm256_setzero_ps();
        if (m == 2)
            CO_WG_2D(__m256, CO_WG2_BT, 4, 4, d, o, _mm256_add_ps, _mm256_sub_ps, CO_WG_MULV);
        else
            CO_WG_2D(__m256, CO_WG4_BT, 6, 6, d, o, _mm256_add_ps, _mm256_sub_ps, CO_WG_MULV);
        for (int e = 0; e < E; ++e) _mm256_storeu_ps(dst + e * ldv + c, o[e]);
    }
#endif
    for (; c < Cin; ++c) {
        float d[CO_WG_MAXA * CO_WG_MAXA], o[CO_WG_MAXA * CO_WG_MAXA];
        for (int k = 0; k < E; ++k) d[k] = px[k] ? px[k][c] : 0.f;
        if (m == 2)
            CO_WG_2D(float, CO_WG2_BT, 4, 4, d, o, CO_WG_ADDS, CO_WG_SUBS, CO_WG_MULS);
        else
            CO_WG_2D(float, CO_WG4_BT, 6, 6, d, o, CO_WG_ADDS, CO_WG_SUBS, CO_WG_MULS);
        for (int e = 0; e < E; ++e) dst[e * ldv + c] = o[e];
    }
}

/* M's E rows t to tile t's m x m outputs (those inside OH x OW), + bias, + add, act */
static inline void KFN(co_wg_output)(const float *mt, int64_t ldm, int64_t t, int64_t OH, int64_t OW, int64_t Cout,
                                     int m, int64_t th, int64_t tw, int64_t tile, const float *bias,
                                     const float *add, int act, float *y) {
    const int n = m + 2, E = n * n, mm = m * m;
    const int64_t b = tile / (th * tw), r = tile % (th * tw);
    const int64_t oy0 = m * (r / tw), ox0 = m * (r % tw);
    float *py[16];
    const float *pa[16];
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < m; ++j) {
            const int inside = oy0 + i < OH && ox0 + j < OW;
            const int64_t at = ((b * OH + oy0 + i) * OW + ox0 + j) * Cout;
            py[i * m + j] = inside ? y + at : NULL;
            pa[i * m + j] = inside && add ? add + at : NULL;
        }
    const float *src = mt + t * Cout;
    int64_t c = 0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    const __m256 z = _mm256_setzero_ps();
    for (; c + 8 <= Cout; c += 8) {
        __m256 mv[CO_WG_MAXA * CO_WG_MAXA], o[16];
        for (int e = 0; e < E; ++e) mv[e] = _mm256_loadu_ps(src + e * ldm + c);
        if (m == 2)
            CO_WG_2D(__m256, CO_WG2_AT, 4, 2, mv, o, _mm256_add_ps, _mm256_sub_ps, CO_WG_MULV);
        else
            CO_WG_2D(__m256, CO_WG4_AT, 6, 4, mv, o, _mm256_add_ps, _mm256_sub_ps, CO_WG_MULV);
        const __m256 bv = bias ? _mm256_loadu_ps(bias + c) : z;
        for (int k = 0; k < mm; ++k) {
            if (!py[k]) continue;
            __m256 v = _mm256_add_ps(o[k], bv);
            if (pa[k]) v = _mm256_add_ps(v, _mm256_loadu_ps(pa[k] + c));
            if (act == 1) v = _mm256_max_ps(z, v); /* max(0, v): NaN and -0 pass, as in sgemm.c */
            _mm256_storeu_ps(py[k] + c, v);
        }
    }
#endif
    for (; c < Cout; ++c) {
        float mv[CO_WG_MAXA * CO_WG_MAXA], o[16];
        for (int e = 0; e < E; ++e) mv[e] = src[e * ldm + c];
        if (m == 2)
            CO_WG_2D(float, CO_WG2_AT, 4, 2, mv, o, CO_WG_ADDS, CO_WG_SUBS, CO_WG_MULS);
        else
            CO_WG_2D(float, CO_WG4_AT, 6, 4, mv, o, CO_WG_ADDS, CO_WG_SUBS, CO_WG_MULS);
        for (int k = 0; k < mm; ++k) {
            if (!py[k]) continue;
            float v = o[k] + (bias ? bias[c] : 0.f);
            if (pa[k]) v += pa[k][c];
            if (act == 1 && v < 0.f) v = 0.f;
            py[k][c] = v;
        }
    }
}

int64_t KFN(wino_conv_f32)(const float *x, int64_t B, int64_t H, int64_t W, int64_t Cin, int64_t pad_h, int64_t pad_w,
                           int64_t m, const float *wp, int64_t Cout, const float *bias, const float *add, int act,
                           float *y, int nthreads) {
    if (!x || !wp || !y || B < 1 || H < 1 || W < 1 || Cin < 1 || Cout < 1 || pad_h < 0 || pad_w < 0 ||
        (m != 2 && m != 4) || act < 0 || act > 1 || nthreads < 1)
        return CO_ERR_BAD_ARGUMENT;
    const int64_t OH = H + 2 * pad_h - 2, OW = W + 2 * pad_w - 2;
    if (OH < 1 || OW < 1) return CO_ERR_BAD_ARGUMENT;
    const int E = (int)((m + 2) * (m + 2));
    const int64_t th = (OH + m - 1) / m, tw = (OW + m - 1) / m, tiles = B * th * tw;
    /* tiles per chunk: V and M within CO_WG_SCRATCH floats, whole 6-row strips of the GEMM */
    int64_t chunk = CO_WG_SCRATCH / (E * (Cin + Cout)) / CO_SG_MR * CO_SG_MR;
    if (chunk < CO_SG_MR) chunk = CO_SG_MR;
    if (chunk > tiles) chunk = tiles;
    const int64_t one = KFN(sgemm_packed_size)(Cout, Cin);
    float *v = (float *)malloc((size_t)E * (size_t)chunk * (size_t)(Cin + Cout) * sizeof(float));
    if (!v) return CO_ERR_NO_MEMORY;
    float *mt = v + E * chunk * Cin;
    int64_t status = CO_OK;
    for (int64_t c0 = 0; c0 < tiles && status == CO_OK; c0 += chunk) {
        const int64_t tc = c0 + chunk < tiles ? chunk : tiles - c0;
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tc; ++t)
                KFN(co_wg_input)(x, H, W, Cin, pad_h, pad_w, (int)m, th, tw, c0 + t, v, chunk * Cin, t);
#pragma omp for schedule(static)
            for (int e = 0; e < E; ++e) {
                const int64_t st = KFN(sgemm_packed_f32)(v + e * chunk * Cin, tc, Cin, Cin, wp + e * one, Cout, NULL,
                                                         NULL, 0, mt + e * chunk * Cout, 1);
                if (st != CO_OK) {
#pragma omp atomic write
                    status = st;
                }
            }
            int64_t ok;
#pragma omp atomic read
            ok = status;
            if (ok == CO_OK) /* the same for every thread: read after the barrier that ends the GEMMs */
#pragma omp for schedule(static)
                for (int64_t t = 0; t < tc; ++t)
                    KFN(co_wg_output)(mt, chunk * Cout, t, OH, OW, Cout, (int)m, th, tw, c0 + t, bias, add, act, y);
        }
    }
    free(v);
    return status;
}
