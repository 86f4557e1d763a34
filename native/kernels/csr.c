/* Index structures for the GNN kernels (serial counting sorts, O(n + size)):
 *   index_to_csr   a scatter index -> rowptr over [0, dim_size) and the stable sorting permutation
 *   csr_transpose  CSR (rowptr, col) -> CSC (colptr, row_t, perm): perm[p] is the CSR position of
 *                  the p-th nonzero in column order; built once per graph and cached in Python.
 * Both check every index before writing; *bad_pos is the offending position. */

#define CO_CSR_FNS(IDX_T, SUF)                                                                 \
    int64_t KFN(index_to_csr_##SUF)(const IDX_T *index, int64_t n, int64_t dim_size,           \
                                    int64_t *rowptr, int64_t *perm, int nthreads,              \
                                    int64_t *bad_pos)                                          \
    {                                                                                          \
        if (n < 0 || dim_size < 0 || nthreads < 1 || !rowptr || (n > 0 && (!index || !perm)))  \
            return CO_ERR_BAD_ARGUMENT;                                                        \
        int64_t b = KFN(first_out_of_range_##IDX_T)(index, n, 0, dim_size, nthreads);          \
        if (b >= 0) { if (bad_pos) *bad_pos = b; return CO_ERR_INDEX_OUT_OF_RANGE; }           \
        int64_t *cursor = (int64_t *)malloc((size_t)(dim_size + 1) * sizeof(int64_t));         \
        if (!cursor) return CO_ERR_BAD_ARGUMENT;                                               \
        memset(rowptr, 0, (size_t)(dim_size + 1) * sizeof(int64_t));                          \
        for (int64_t i = 0; i < n; ++i) rowptr[(int64_t)index[i] + 1]++;                       \
        for (int64_t r = 0; r < dim_size; ++r) rowptr[r + 1] += rowptr[r];                     \
        memcpy(cursor, rowptr, (size_t)(dim_size + 1) * sizeof(int64_t));                      \
        for (int64_t i = 0; i < n; ++i) perm[cursor[(int64_t)index[i]]++] = i;                 \
        free(cursor);                                                                          \
        return CO_OK;                                                                          \
    }                                                                                          \
    int64_t KFN(csr_transpose_##SUF)(const int64_t *rowptr, int64_t n_rows, const IDX_T *col,  \
                                     int64_t n_cols, int64_t *colptr, int64_t *row_t,          \
                                     int64_t *perm, int nthreads, int64_t *bad_pos)            \
    {                                                                                          \
        if (n_rows < 0 || n_cols < 0 || nthreads < 1 || !rowptr || !colptr)                    \
            return CO_ERR_BAD_ARGUMENT;                                                        \
        int64_t b = KFN(check_rowptr)(rowptr, n_rows);                                         \
        if (b >= 0) { if (bad_pos) *bad_pos = b; return CO_ERR_UNSORTED; }                     \
        const int64_t nnz = rowptr[n_rows];                                                    \
        if (nnz > 0 && (!col || !row_t || !perm)) return CO_ERR_BAD_ARGUMENT;                  \
        b = KFN(first_out_of_range_##IDX_T)(col, nnz, 0, n_cols, nthreads);                    \
        if (b >= 0) { if (bad_pos) *bad_pos = b; return CO_ERR_INDEX_OUT_OF_RANGE; }           \
        int64_t *cursor = (int64_t *)malloc((size_t)(n_cols + 1) * sizeof(int64_t));           \
        if (!cursor) return CO_ERR_BAD_ARGUMENT;                                               \
        memset(colptr, 0, (size_t)(n_cols + 1) * sizeof(int64_t));                             \
        for (int64_t e = 0; e < nnz; ++e) colptr[(int64_t)col[e] + 1]++;                       \
        for (int64_t c = 0; c < n_cols; ++c) colptr[c + 1] += colptr[c];                       \
        memcpy(cursor, colptr, (size_t)(n_cols + 1) * sizeof(int64_t));                        \
        for (int64_t r = 0; r < n_rows; ++r)                                                   \
            for (int64_t e = rowptr[r]; e < rowptr[r + 1]; ++e) {                              \
                const int64_t p = cursor[(int64_t)col[e]]++;                                   \
                row_t[p] = r;                                                                  \
                perm[p] = e;                                                                   \
            }                                                                                  \
        free(cursor);                                                                          \
        return CO_OK;                                                                          \
    }

CO_CSR_FNS(int64_t, i64)
CO_CSR_FNS(int32_t, i32)
#undef CO_CSR_FNS
