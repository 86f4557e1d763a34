/* segment_reduce: out[r, :] = reduce over e in [rowptr[r], rowptr[r+1]) of weight[e] * x[col[e], :]
 * for sum, mean, max, min, prod, optionally starting from self[r, :] (include_self).
 *
 * This one kernel is both spmm (CSR x dense: rowptr/col/weight of the adjacency) and
 * scatter_reduce (the index sorted once by csr.c: rowptr of the sorted index, col = the sorting
 * permutation). Rows are split across threads by their number of nonzeros (no atomics); each
 * thread reduces a row into a small accumulator (float for f32/bf16, double for f64) and writes
 * it once. max/min record the winning position e in arg[r, j] (-1 where self or nothing won),
 * so their backward is a scatter or a gather (segment_backward.c). The winner is stored as int32
 * relative to the row start (e - rowptr[r]): half the bytes of an int64 position, for any nnz;
 * or (wmask) as one bit per (nonzero, feature), set on the nonzero that won: smaller for sparse
 * graphs, and its backward skips the nonzeros that won nothing.
 * Every index is checked before any write: CO_ERR_UNSORTED (rowptr decreases; *bad_pos = the
 * position) or CO_ERR_INDEX_OUT_OF_RANGE (*bad_pos = the position in col). */

#define CO_TEMPLATE "segment_tmpl.h"
#include "gnn_dtypes.h"
#undef CO_TEMPLATE
