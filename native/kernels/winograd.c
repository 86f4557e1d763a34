/* 3 x 3 stride-1 convolutions in fp32 by Winograd's F(2 x 2, 3 x 3) (Lavin & Gray, 2015): each 2 x 2
 * block of the output from a 4 x 4 tile of the input with 16 multiplications per input and output
 * channel instead of 36. On AVX2 the convolution libraries reachable from Python compute 3 x 3
 * convolutions directly (oneDNN's brgconv:avx2 in cpu_opt's oneDNN 3.2, torch's oneDNN and
 * OpenVINO): ResNet-50's thirteen stride-1 3 x 3 layers run at about 70 GFLOP/s per Zen 3 core there.
 *
 *   wino_pack_f32: W (Cout x Cin x 3 x 3, PyTorch's OIHW) into 16 matrices U_e = (G g G^T)_e (Cout x
 *                  Cin; g the 3 x 3 kernel of one output and input channel, computed in double), each
 *                  packed as sgemm.c packs a weight (sgemm_pack_f32), one after the other:
 *                  wino_packed_size(Cout, Cin) floats. Done once per layer.
 *   wino_conv_f32: y (B x OH x OW x Cout, NHWC) = conv(x (B x H x W x Cin, NHWC), W, zero padding
 *                  pad_h / pad_w on each side) (+ bias[Cout]) (+ add, y's shape and layout: a
 *                  residual), then act (0 none, 1 relu): OH = H + 2 pad_h - 2, OW = W + 2 pad_w - 2.
 *
 * The output's 2 x 2 blocks (tiles) are taken in chunks whose transformed inputs and products fit in
 * CO_WG_SCRATCH floats, each chunk in three steps inside one parallel region: every tile's 4 x 4
 * input patch to V = B^T d B (16 values per channel, written as 16 matrices V_e of tiles x Cin:
 * threads split the tiles); the 16 products M_e = V_e U_e^T on sgemm.c's packed GEMM (threads
 * split e, one single-threaded GEMM each); every tile's output y = A^T m A (+ bias, add, act: threads
 * split the tiles). The result does not depend on the thread count.
 * Against the direct convolution the products are rounded differently (the transforms add and
 * subtract up to 9 input values before the multiplication): relative errors of a few 1e-7 on
 * ResNet's layers, where the direct convolution's are of the same order.
 * Sizes and pointers are checked before any memory is touched: CO_ERR_BAD_ARGUMENT for B, H, W, Cin
 * or Cout < 1, pad_h or pad_w < 0, an output smaller than 1 x 1, act not 0 or 1, nthreads < 1 or a
 * NULL pointer (bias and add may be NULL); CO_ERR_NO_MEMORY when the scratch (V and M for one chunk: nothing
 * written then) or a GEMM's strips cannot be allocated (y is then incomplete; the caller raises). */

#ifndef CO_WINO_DEFINED
#define CO_WINO_DEFINED
#define CO_WG_SCRATCH (1 << 21) /* most floats of V and M per chunk of tiles (8 MiB) */
#endif

int64_t KFN(wino_packed_size)(int64_t Cout, int64_t Cin) {
    const int64_t one = KFN(sgemm_packed_size)(Cout, Cin);
    return one < 0 ? -1 : 16 * one;
}

int64_t KFN(wino_pack_f32)(const float *w, int64_t Cout, int64_t Cin, float *wp) {
    if (!w || !wp || Cout < 1 || Cin < 1) return CO_ERR_BAD_ARGUMENT;
    float *u = (float *)malloc((size_t)16 * (size_t)Cout * (size_t)Cin * sizeof(float));
    if (!u) return CO_ERR_NO_MEMORY;
    const int64_t plane = Cout * Cin;
    for (int64_t oc = 0; oc < Cout; ++oc)
        for (int64_t ic = 0; ic < Cin; ++ic) {
            const float *g = w + (oc * Cin + ic) * 9;
            double gg[4][3], r[4][4];
            for (int j = 0; j < 3; ++j) { /* G g: rows g0, (g0 + g1 + g2) / 2, (g0 - g1 + g2) / 2, g2 */
                const double g0 = g[j], g1 = g[3 + j], g2 = g[6 + j];
                gg[0][j] = g0;
                gg[1][j] = 0.5 * (g0 + g1 + g2);
                gg[2][j] = 0.5 * (g0 - g1 + g2);
                gg[3][j] = g2;
            }
            for (int i = 0; i < 4; ++i) { /* (G g) G^T */
                r[i][0] = gg[i][0];
                r[i][1] = 0.5 * (gg[i][0] + gg[i][1] + gg[i][2]);
                r[i][2] = 0.5 * (gg[i][0] - gg[i][1] + gg[i][2]);
                r[i][3] = gg[i][2];
            }
            for (int e = 0; e < 16; ++e) u[e * plane + oc * Cin + ic] = (float)r[e / 4][e % 4];
        }
    const int64_t one = KFN(sgemm_packed_size)(Cout, Cin);
    for (int e = 0; e < 16; ++e) KFN(sgemm_pack_f32)(u + e * plane, Cout, Cin, 0, wp + e * one);
    free(u);
    return CO_OK;
}

/* V = B^T d B on one channel: d the 4 x 4 patch (row-major), v the 16 results */
#define CO_WG_IN_TRANSFORM(T, d, v, ADD, SUB)                                                             \
    do {                                                                                                  \
        T t_[4][4];                                                                                       \
        for (int j_ = 0; j_ < 4; ++j_) {                                                                  \
            t_[0][j_] = SUB(d[0][j_], d[2][j_]);                                                          \
            t_[1][j_] = ADD(d[1][j_], d[2][j_]);                                                          \
            t_[2][j_] = SUB(d[2][j_], d[1][j_]);                                                          \
            t_[3][j_] = SUB(d[1][j_], d[3][j_]);                                                          \
        }                                                                                                 \
        for (int i_ = 0; i_ < 4; ++i_) {                                                                  \
            v[i_ * 4 + 0] = SUB(t_[i_][0], t_[i_][2]);                                                    \
            v[i_ * 4 + 1] = ADD(t_[i_][1], t_[i_][2]);                                                    \
            v[i_ * 4 + 2] = SUB(t_[i_][2], t_[i_][1]);                                                    \
            v[i_ * 4 + 3] = SUB(t_[i_][1], t_[i_][3]);                                                    \
        }                                                                                                 \
    } while (0)

/* y = A^T m A on one channel: m the 16 products, y the 2 x 2 outputs (row-major) */
#define CO_WG_OUT_TRANSFORM(T, m, y, ADD, SUB)                                                            \
    do {                                                                                                  \
        T t_[2][4];                                                                                       \
        for (int j_ = 0; j_ < 4; ++j_) {                                                                  \
            t_[0][j_] = ADD(ADD(m[j_], m[4 + j_]), m[8 + j_]);                                            \
            t_[1][j_] = SUB(SUB(m[4 + j_], m[8 + j_]), m[12 + j_]);                                       \
        }                                                                                                 \
        for (int i_ = 0; i_ < 2; ++i_) {                                                                  \
            y[i_ * 2 + 0] = ADD(ADD(t_[i_][0], t_[i_][1]), t_[i_][2]);                                    \
            y[i_ * 2 + 1] = SUB(SUB(t_[i_][1], t_[i_][2]), t_[i_][3]);                                    \
        }                                                                                                 \
    } while (0)

#define CO_WG_ADDS(a, b) ((a) + (b))
#define CO_WG_SUBS(a, b) ((a) - (b))

/* the input patch of tile t (its 4 x 4 pixels, zero outside the image) to V's 16 rows t */
static inline void KFN(co_wg_input)(const float *x, int64_t H, int64_t W, int64_t Cin, int64_t pad_h, int64_t pad_w,
                                    int64_t th, int64_t tw, int64_t tile, float *v, int64_t ldv, int64_t t) {
    const int64_t b = tile / (th * tw), r = tile % (th * tw);
    const int64_t iy0 = 2 * (r / tw) - pad_h, ix0 = 2 * (r % tw) - pad_w;
    const float *px[4][4];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) {
            const int64_t iy = iy0 + i, ix = ix0 + j;
            px[i][j] = iy >= 0 && iy < H && ix >= 0 && ix < W ? x + ((b * H + iy) * W + ix) * Cin : NULL;
        }
    float *dst = v + t * Cin;
    int64_t c = 0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    for (; c + 8 <= Cin; c += 8) {
        __m256 d[4][4], o[16];
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) d[i][j] = px[i][j] ? _mm256_loadu_ps(px[i][j] + c) : _mm256_setzero_ps();
        CO_WG_IN_TRANSFORM(__m256, d, o, _mm256_add_ps, _mm256_sub_ps);
        for (int e = 0; e < 16; ++e) _mm256_storeu_ps(dst + e * ldv + c, o[e]);
    }
#endif
    for (; c < Cin; ++c) {
        float d[4][4], o[16];
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) d[i][j] = px[i][j] ? px[i][j][c] : 0.f;
        CO_WG_IN_TRANSFORM(float, d, o, CO_WG_ADDS, CO_WG_SUBS);
        for (int e = 0; e < 16; ++e) dst[e * ldv + c] = o[e];
    }
}

/* M's 16 rows t to tile t's 2 x 2 outputs (those inside OH x OW), + bias, + add, act */
static inline void KFN(co_wg_output)(const float *m, int64_t ldm, int64_t t, int64_t OH, int64_t OW, int64_t Cout,
                                     int64_t th, int64_t tw, int64_t tile, const float *bias, const float *add,
                                     int act, float *y) {
    const int64_t b = tile / (th * tw), r = tile % (th * tw);
    const int64_t oy0 = 2 * (r / tw), ox0 = 2 * (r % tw);
    float *py[4];
    const float *pa[4];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
            const int inside = oy0 + i < OH && ox0 + j < OW;
            const int64_t at = ((b * OH + oy0 + i) * OW + ox0 + j) * Cout;
            py[i * 2 + j] = inside ? y + at : NULL;
            pa[i * 2 + j] = inside && add ? add + at : NULL;
        }
    const float *src = m + t * Cout;
    int64_t c = 0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
    const __m256 z = _mm256_setzero_ps();
    for (; c + 8 <= Cout; c += 8) {
        __m256 mv[16], o[4];
        for (int e = 0; e < 16; ++e) mv[e] = _mm256_loadu_ps(src + e * ldm + c);
        CO_WG_OUT_TRANSFORM(__m256, mv, o, _mm256_add_ps, _mm256_sub_ps);
        const __m256 bv = bias ? _mm256_loadu_ps(bias + c) : z;
        for (int k = 0; k < 4; ++k) {
            if (!py[k]) continue;
            __m256 v = _mm256_add_ps(o[k], bv);
            if (pa[k]) v = _mm256_add_ps(v, _mm256_loadu_ps(pa[k] + c));
            if (act == 1) v = _mm256_max_ps(z, v); /* max(0, v): NaN and -0 pass, as in sgemm.c */
            _mm256_storeu_ps(py[k] + c, v);
        }
    }
#endif
    for (; c < Cout; ++c) {
        float mv[16], o[4];
        for (int e = 0; e < 16; ++e) mv[e] = src[e * ldm + c];
        CO_WG_OUT_TRANSFORM(float, mv, o, CO_WG_ADDS, CO_WG_SUBS);
        for (int k = 0; k < 4; ++k) {
            if (!py[k]) continue;
            float v = o[k] + (bias ? bias[c] : 0.f);
            if (pa[k]) v += pa[k][c];
            if (act == 1 && v < 0.f) v = 0.f;
            py[k][c] = v;
        }
    }
}

int64_t KFN(wino_conv_f32)(const float *x, int64_t B, int64_t H, int64_t W, int64_t Cin, int64_t pad_h, int64_t pad_w,
                           const float *wp, int64_t Cout, const float *bias, const float *add, int act, float *y,
                           int nthreads) {
    if (!x || !wp || !y || B < 1 || H < 1 || W < 1 || Cin < 1 || Cout < 1 || pad_h < 0 || pad_w < 0 ||
        act < 0 || act > 1 || nthreads < 1)
        return CO_ERR_BAD_ARGUMENT;
    const int64_t OH = H + 2 * pad_h - 2, OW = W + 2 * pad_w - 2;
    if (OH < 1 || OW < 1) return CO_ERR_BAD_ARGUMENT;
    const int64_t th = (OH + 1) / 2, tw = (OW + 1) / 2, tiles = B * th * tw;
    /* tiles per chunk: V and M within CO_WG_SCRATCH floats, whole 6-row strips of the GEMM */
    int64_t chunk = CO_WG_SCRATCH / (16 * (Cin + Cout)) / CO_SG_MR * CO_SG_MR;
    if (chunk < CO_SG_MR) chunk = CO_SG_MR;
    if (chunk > tiles) chunk = tiles;
    const int64_t one = KFN(sgemm_packed_size)(Cout, Cin);
    float *v = (float *)malloc((size_t)16 * (size_t)chunk * (size_t)(Cin + Cout) * sizeof(float));
    if (!v) return CO_ERR_NO_MEMORY;
    float *m = v + 16 * chunk * Cin;
    int64_t status = CO_OK;
    for (int64_t c0 = 0; c0 < tiles && status == CO_OK; c0 += chunk) {
        const int64_t tc = c0 + chunk < tiles ? chunk : tiles - c0;
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tc; ++t)
                KFN(co_wg_input)(x, H, W, Cin, pad_h, pad_w, th, tw, c0 + t, v, chunk * Cin, t);
#pragma omp for schedule(static)
            for (int e = 0; e < 16; ++e) {
                const int64_t st = KFN(sgemm_packed_f32)(v + e * chunk * Cin, tc, Cin, Cin, wp + e * one, Cout, NULL,
                                                         NULL, 0, m + e * chunk * Cout, 1);
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
                        KFN(co_wg_output)(m, chunk * Cout, t, OH, OW, Cout, th, tw, c0 + t, bias, add, act, y);
        }
    }
    free(v);
    return status;
}
