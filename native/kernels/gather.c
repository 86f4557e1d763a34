/* gather_rows: out[i, :] = src[index[i], :] (index_select along dim 0).
 * Included once per ISA variant by variants.c; every name goes through KFN. */

#define CO_GATHER_ROWS(IDX_T, SUFFIX)                                                         \
    int64_t KFN(gather_rows_f32_##SUFFIX)(const float *src, int64_t n_src, int64_t row_len,  \
                                          const IDX_T *index, int64_t n_index, float *out,   \
                                          int nthreads, int64_t *bad_pos)                    \
    {                                                                                        \
        if (n_src < 0 || row_len < 0 || n_index < 0 || nthreads < 1)                         \
            return CO_ERR_BAD_ARGUMENT;                                                      \
        /* check every index before any write */                                            \
        for (int64_t i = 0; i < n_index; ++i) {                                              \
            if (index[i] < 0 || (int64_t)index[i] >= n_src) {                                \
                if (bad_pos) *bad_pos = i;                                                   \
                return CO_ERR_INDEX_OUT_OF_RANGE;                                            \
            }                                                                                \
        }                                                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if(n_index * row_len > 32768)") \
        for (int64_t i = 0; i < n_index; ++i) {                                              \
            const float *restrict s = src + (int64_t)index[i] * row_len;                     \
            float *restrict d = out + i * row_len;                                           \
            for (int64_t j = 0; j < row_len; ++j) d[j] = s[j];                               \
        }                                                                                    \
        return CO_OK;                                                                        \
    }

CO_GATHER_ROWS(int64_t, i64)
CO_GATHER_ROWS(int32_t, i32)
#undef CO_GATHER_ROWS

/* gather_rows_bytes: the same for any element type, rows of row_bytes bytes (memcpy per row):
 * index_select along dim 0 for f32, f64, bf16 ... into a preallocated out. */
#define CO_GATHER_BYTES(IDX_T, SUFFIX)                                                        \
    int64_t KFN(gather_rows_bytes_##SUFFIX)(const void *src, int64_t n_src, int64_t row_bytes, \
                                            const IDX_T *index, int64_t n_index, void *out,  \
                                            int nthreads, int64_t *bad_pos)                  \
    {                                                                                        \
        if (n_src < 0 || row_bytes < 0 || n_index < 0 || nthreads < 1)                       \
            return CO_ERR_BAD_ARGUMENT;                                                      \
        if ((n_index > 0 && (!index || (!out && row_bytes > 0))) || (n_src > 0 && row_bytes > 0 && !src)) \
            return CO_ERR_BAD_ARGUMENT;                                                      \
        for (int64_t i = 0; i < n_index; ++i) {                                              \
            if (index[i] < 0 || (int64_t)index[i] >= n_src) {                                \
                if (bad_pos) *bad_pos = i;                                                   \
                return CO_ERR_INDEX_OUT_OF_RANGE;                                            \
            }                                                                                \
        }                                                                                    \
        if (row_bytes == 0) return CO_OK;                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if(n_index * row_bytes > 131072)") \
        for (int64_t i = 0; i < n_index; ++i)                                                \
            memcpy((char *)out + i * row_bytes,                                              \
                   (const char *)src + (int64_t)index[i] * row_bytes, (size_t)row_bytes);    \
        return CO_OK;                                                                        \
    }

CO_GATHER_BYTES(int64_t, i64)
CO_GATHER_BYTES(int32_t, i32)
#undef CO_GATHER_BYTES
