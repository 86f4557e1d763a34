/* Public prototypes of cpu_opt's native kernels, one line per function, written with KFN().
 * build_native.py expands KFN(name) into name_<variant> for each ISA variant to make the cffi
 * cdef; variants.c includes this file once per variant. Keep to cffi-parsable C: no macros
 * other than KFN, integer types from stdint.h. */

/* status codes: 0 is success; negative values are errors the Python wrapper turns into exceptions */
#ifndef CO_STATUS_DEFINED
#define CO_STATUS_DEFINED
#define CO_OK 0
#define CO_ERR_INDEX_OUT_OF_RANGE -1
#define CO_ERR_BAD_ARGUMENT -2
#define CO_ERR_UNSORTED -3
#define CO_ERR_DUPLICATE -4
#define CO_ERR_NO_MEMORY -5
#endif

/* proof-of-mechanism kernel: out[i, :] = src[index[i], :]; on a bad index writes nothing and
 * returns CO_ERR_INDEX_OUT_OF_RANGE with the offending position in *bad_pos */
int64_t KFN(gather_rows_f32_i64)(const float *src, int64_t n_src, int64_t row_len,
                                 const int64_t *index, int64_t n_index, float *out,
                                 int nthreads, int64_t *bad_pos);
int64_t KFN(gather_rows_f32_i32)(const float *src, int64_t n_src, int64_t row_len,
                                 const int32_t *index, int64_t n_index, float *out,
                                 int nthreads, int64_t *bad_pos);

/* ---- GNN kernels (native/kernels/segment.c, segment_backward.c, csr.c, gather.c) ----
 * Feature dtypes: f32 = float, f64 = double, bf16 = uint16_t (bf16 bits; accumulated in float,
 * written back round-to-nearest-even). Index dtypes: i64 = int64_t, i32 = int32_t.
 * reduce codes: 0 sum, 1 mean, 2 max, 3 min, 4 prod. weight, self and arg may be NULL.
 * arg (max/min winners, n_rows x F int32): the winning nonzero relative to its row start
 * (e = rowptr[r] + arg[r, j]), -1 where self or nothing won; NULL skips tracking winners.
 * wmask (max/min winners as bits, nnz x W uint64 with W = ceil(F / 64)): bit j % 64 of word j / 64
 * of nonzero e is set iff e won feature j of its row; may be given instead of (or with) arg.
 * Smaller than arg when the average degree is below 32 (8 W bytes per nonzero against 4 F per
 * row), and its backward reads only the gradient rows of nonzeros that won something. */
int64_t KFN(segment_reduce_f32_i64)(const int64_t *rowptr, int64_t n_rows, const int64_t *col, const float *weight, const float *x, int64_t n_x, int64_t F, int reduce, const float *self, int include_self, float *out, int32_t *arg, uint64_t *wmask, int nthreads, int64_t *bad_pos);
int64_t KFN(segment_reduce_f64_i64)(const int64_t *rowptr, int64_t n_rows, const int64_t *col, const double *weight, const double *x, int64_t n_x, int64_t F, int reduce, const double *self, int include_self, double *out, int32_t *arg, uint64_t *wmask, int nthreads, int64_t *bad_pos);
int64_t KFN(segment_reduce_bf16_i64)(const int64_t *rowptr, int64_t n_rows, const int64_t *col, const uint16_t *weight, const uint16_t *x, int64_t n_x, int64_t F, int reduce, const uint16_t *self, int include_self, uint16_t *out, int32_t *arg, uint64_t *wmask, int nthreads, int64_t *bad_pos);
int64_t KFN(segment_reduce_f32_i32)(const int64_t *rowptr, int64_t n_rows, const int32_t *col, const float *weight, const float *x, int64_t n_x, int64_t F, int reduce, const float *self, int include_self, float *out, int32_t *arg, uint64_t *wmask, int nthreads, int64_t *bad_pos);
int64_t KFN(segment_reduce_f64_i32)(const int64_t *rowptr, int64_t n_rows, const int32_t *col, const double *weight, const double *x, int64_t n_x, int64_t F, int reduce, const double *self, int include_self, double *out, int32_t *arg, uint64_t *wmask, int nthreads, int64_t *bad_pos);
int64_t KFN(segment_reduce_bf16_i32)(const int64_t *rowptr, int64_t n_rows, const int32_t *col, const uint16_t *weight, const uint16_t *x, int64_t n_x, int64_t F, int reduce, const uint16_t *self, int include_self, uint16_t *out, int32_t *arg, uint64_t *wmask, int nthreads, int64_t *bad_pos);
int64_t KFN(sddmm_f32_i64)(const int64_t *rowptr, int64_t n_rows, const int64_t *col, int64_t n_b, int64_t F, const float *a, const float *b, float *out, int nthreads, int64_t *bad_pos);
int64_t KFN(sddmm_f64_i64)(const int64_t *rowptr, int64_t n_rows, const int64_t *col, int64_t n_b, int64_t F, const double *a, const double *b, double *out, int nthreads, int64_t *bad_pos);
int64_t KFN(sddmm_bf16_i64)(const int64_t *rowptr, int64_t n_rows, const int64_t *col, int64_t n_b, int64_t F, const uint16_t *a, const uint16_t *b, uint16_t *out, int nthreads, int64_t *bad_pos);
int64_t KFN(sddmm_f32_i32)(const int64_t *rowptr, int64_t n_rows, const int32_t *col, int64_t n_b, int64_t F, const float *a, const float *b, float *out, int nthreads, int64_t *bad_pos);
int64_t KFN(sddmm_f64_i32)(const int64_t *rowptr, int64_t n_rows, const int32_t *col, int64_t n_b, int64_t F, const double *a, const double *b, double *out, int nthreads, int64_t *bad_pos);
int64_t KFN(sddmm_bf16_i32)(const int64_t *rowptr, int64_t n_rows, const int32_t *col, int64_t n_b, int64_t F, const uint16_t *a, const uint16_t *b, uint16_t *out, int nthreads, int64_t *bad_pos);
/* max/min spmm backward for x by gathering over the CSC transpose (segment_backward_tmpl.h) */
int64_t KFN(arg_gather_f32_i64)(const int64_t *colptr, int64_t n_out, const int64_t *row_t, const int64_t *perm, int64_t nnz, const int32_t *arg, const int64_t *rowptr, const float *g, int64_t n_rows, int64_t F, const float *weight, float *out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_gather_f64_i64)(const int64_t *colptr, int64_t n_out, const int64_t *row_t, const int64_t *perm, int64_t nnz, const int32_t *arg, const int64_t *rowptr, const double *g, int64_t n_rows, int64_t F, const double *weight, double *out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_gather_bf16_i64)(const int64_t *colptr, int64_t n_out, const int64_t *row_t, const int64_t *perm, int64_t nnz, const int32_t *arg, const int64_t *rowptr, const uint16_t *g, int64_t n_rows, int64_t F, const uint16_t *weight, uint16_t *out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_gather_f32_i32)(const int64_t *colptr, int64_t n_out, const int32_t *row_t, const int64_t *perm, int64_t nnz, const int32_t *arg, const int64_t *rowptr, const float *g, int64_t n_rows, int64_t F, const float *weight, float *out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_gather_f64_i32)(const int64_t *colptr, int64_t n_out, const int32_t *row_t, const int64_t *perm, int64_t nnz, const int32_t *arg, const int64_t *rowptr, const double *g, int64_t n_rows, int64_t F, const double *weight, double *out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_gather_bf16_i32)(const int64_t *colptr, int64_t n_out, const int32_t *row_t, const int64_t *perm, int64_t nnz, const int32_t *arg, const int64_t *rowptr, const uint16_t *g, int64_t n_rows, int64_t F, const uint16_t *weight, uint16_t *out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_scatter_f32_i64)(const int32_t *arg, int64_t n_rows, int64_t F, const float *g, const int64_t *rowptr, const int64_t *col, const float *weight, float *out, int64_t n_out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_scatter_f64_i64)(const int32_t *arg, int64_t n_rows, int64_t F, const double *g, const int64_t *rowptr, const int64_t *col, const double *weight, double *out, int64_t n_out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_scatter_bf16_i64)(const int32_t *arg, int64_t n_rows, int64_t F, const uint16_t *g, const int64_t *rowptr, const int64_t *col, const uint16_t *weight, uint16_t *out, int64_t n_out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_scatter_f32_i32)(const int32_t *arg, int64_t n_rows, int64_t F, const float *g, const int64_t *rowptr, const int32_t *col, const float *weight, float *out, int64_t n_out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_scatter_f64_i32)(const int32_t *arg, int64_t n_rows, int64_t F, const double *g, const int64_t *rowptr, const int32_t *col, const double *weight, double *out, int64_t n_out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_scatter_bf16_i32)(const int32_t *arg, int64_t n_rows, int64_t F, const uint16_t *g, const int64_t *rowptr, const int32_t *col, const uint16_t *weight, uint16_t *out, int64_t n_out, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_weight_grad_f32_i64)(const int32_t *arg, int64_t n_rows, int64_t F, const float *g, const float *x, int64_t n_x, const int64_t *rowptr, const int64_t *col, float *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_weight_grad_f64_i64)(const int32_t *arg, int64_t n_rows, int64_t F, const double *g, const double *x, int64_t n_x, const int64_t *rowptr, const int64_t *col, double *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_weight_grad_bf16_i64)(const int32_t *arg, int64_t n_rows, int64_t F, const uint16_t *g, const uint16_t *x, int64_t n_x, const int64_t *rowptr, const int64_t *col, uint16_t *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_weight_grad_f32_i32)(const int32_t *arg, int64_t n_rows, int64_t F, const float *g, const float *x, int64_t n_x, const int64_t *rowptr, const int32_t *col, float *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_weight_grad_f64_i32)(const int32_t *arg, int64_t n_rows, int64_t F, const double *g, const double *x, int64_t n_x, const int64_t *rowptr, const int32_t *col, double *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(arg_weight_grad_bf16_i32)(const int32_t *arg, int64_t n_rows, int64_t F, const uint16_t *g, const uint16_t *x, int64_t n_x, const int64_t *rowptr, const int32_t *col, uint16_t *out_w, int nthreads, int64_t *bad_pos);
/* max/min spmm backward from the winner mask wmask (segment_backward_tmpl.h): for x over the
 * CSC transpose, and for the edge weights */
int64_t KFN(mask_gather_f32_i64)(const int64_t *colptr, int64_t n_out, const int64_t *row_t, const int64_t *perm, int64_t nnz, const uint64_t *wmask, const float *g, int64_t n_rows, int64_t F, const float *weight, float *out, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_gather_f64_i64)(const int64_t *colptr, int64_t n_out, const int64_t *row_t, const int64_t *perm, int64_t nnz, const uint64_t *wmask, const double *g, int64_t n_rows, int64_t F, const double *weight, double *out, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_gather_bf16_i64)(const int64_t *colptr, int64_t n_out, const int64_t *row_t, const int64_t *perm, int64_t nnz, const uint64_t *wmask, const uint16_t *g, int64_t n_rows, int64_t F, const uint16_t *weight, uint16_t *out, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_gather_f32_i32)(const int64_t *colptr, int64_t n_out, const int32_t *row_t, const int64_t *perm, int64_t nnz, const uint64_t *wmask, const float *g, int64_t n_rows, int64_t F, const float *weight, float *out, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_gather_f64_i32)(const int64_t *colptr, int64_t n_out, const int32_t *row_t, const int64_t *perm, int64_t nnz, const uint64_t *wmask, const double *g, int64_t n_rows, int64_t F, const double *weight, double *out, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_gather_bf16_i32)(const int64_t *colptr, int64_t n_out, const int32_t *row_t, const int64_t *perm, int64_t nnz, const uint64_t *wmask, const uint16_t *g, int64_t n_rows, int64_t F, const uint16_t *weight, uint16_t *out, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_weight_grad_f32_i64)(const uint64_t *wmask, const int64_t *rowptr, int64_t n_rows, const int64_t *col, const float *x, int64_t n_x, const float *g, int64_t F, float *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_weight_grad_f64_i64)(const uint64_t *wmask, const int64_t *rowptr, int64_t n_rows, const int64_t *col, const double *x, int64_t n_x, const double *g, int64_t F, double *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_weight_grad_bf16_i64)(const uint64_t *wmask, const int64_t *rowptr, int64_t n_rows, const int64_t *col, const uint16_t *x, int64_t n_x, const uint16_t *g, int64_t F, uint16_t *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_weight_grad_f32_i32)(const uint64_t *wmask, const int64_t *rowptr, int64_t n_rows, const int32_t *col, const float *x, int64_t n_x, const float *g, int64_t F, float *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_weight_grad_f64_i32)(const uint64_t *wmask, const int64_t *rowptr, int64_t n_rows, const int32_t *col, const double *x, int64_t n_x, const double *g, int64_t F, double *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_weight_grad_bf16_i32)(const uint64_t *wmask, const int64_t *rowptr, int64_t n_rows, const int32_t *col, const uint16_t *x, int64_t n_x, const uint16_t *g, int64_t F, uint16_t *out_w, int nthreads, int64_t *bad_pos);
int64_t KFN(gather_rows_bytes_i64)(const void *src, int64_t n_src, int64_t row_bytes, const int64_t *index, int64_t n_index, void *out, int nthreads, int64_t *bad_pos);
int64_t KFN(index_to_csr_i64)(const int64_t *index, int64_t n, int64_t dim_size, int64_t *rowptr, int64_t *perm, int nthreads, int64_t *bad_pos);
int64_t KFN(csr_transpose_i64)(const int64_t *rowptr, int64_t n_rows, const int64_t *col, int64_t n_cols, int64_t *colptr, int64_t *row_t, int64_t *perm, int nthreads, int64_t *bad_pos);
int64_t KFN(gather_rows_bytes_i32)(const void *src, int64_t n_src, int64_t row_bytes, const int32_t *index, int64_t n_index, void *out, int nthreads, int64_t *bad_pos);
int64_t KFN(index_to_csr_i32)(const int32_t *index, int64_t n, int64_t dim_size, int64_t *rowptr, int64_t *perm, int nthreads, int64_t *bad_pos);
int64_t KFN(csr_transpose_i32)(const int64_t *rowptr, int64_t n_rows, const int32_t *col, int64_t n_cols, int64_t *colptr, int64_t *row_t, int64_t *perm, int nthreads, int64_t *bad_pos);

/* ---- neighbour sampling (native/kernels/sample.c, sample_tmpl.h) ----
 * Uniform k-hop sampling over a CSR graph (rowptr over n_nodes rows, col in [0, n_nodes)): for each
 * hop h, every node found at hop h - 1 draws fanouts[h] of its neighbours (-1: all), with or
 * without replacement. Draws come from a counter-based generator keyed by (rng_seed, hop, node,
 * subgraph), so the result does not depend on nthreads. Relabelled output, malloc'ed here and
 * handed to the caller (free each with co_free): node (global id of each sampled node, seeds
 * first, then in hop order), batch (its subgraph when disjoint, else NULL), and per edge row (the
 * expanding node), col (the sampled neighbour), both local ids, and edge (its position in col).
 * out_counts = {nodes, edges}; nodes_per_hop has n_hops + 1 entries, edges_per_hop n_hops.
 * directed = 0: the edges are instead every edge of the graph between sampled nodes (of one
 * subgraph), grouped by row. Temporal (node_time over nodes, edge_time over nonzeros; requires
 * disjoint): only neighbours with time <= the seed's time (seed_time, else node_time[seed]);
 * strategy 0 uniform among those, 1 the last fanouts[h] of them in CSR order.
 * Errors before any output: CO_ERR_INDEX_OUT_OF_RANGE (a seed: bad_pos = its position; a col
 * entry: bad_pos = -2 - its position), CO_ERR_UNSORTED (a row r with rowptr[r] > rowptr[r + 1] or
 * outside [0, nnz]: bad_pos = r), CO_ERR_DUPLICATE (a seed twice without disjoint: bad_pos = the
 * second position), CO_ERR_NO_MEMORY, CO_ERR_BAD_ARGUMENT (bad_pos = the hop of a bad fan-out). */
int64_t KFN(neighbor_sample_i64)(const int64_t *rowptr, int64_t n_nodes, const int64_t *col, int64_t nnz, const int64_t *seeds, int64_t n_seeds, const int64_t *fanouts, int64_t n_hops, int replace, int directed, int disjoint, const int64_t *node_time, const int64_t *edge_time, const int64_t *seed_time, int strategy, uint64_t rng_seed, int64_t **out_node, int64_t **out_batch, int64_t **out_row, int64_t **out_col, int64_t **out_edge, int64_t *out_counts, int64_t *nodes_per_hop, int64_t *edges_per_hop, int nthreads, int64_t *bad_pos);
int64_t KFN(neighbor_sample_f64)(const int64_t *rowptr, int64_t n_nodes, const int64_t *col, int64_t nnz, const int64_t *seeds, int64_t n_seeds, const int64_t *fanouts, int64_t n_hops, int replace, int directed, int disjoint, const double *node_time, const double *edge_time, const double *seed_time, int strategy, uint64_t rng_seed, int64_t **out_node, int64_t **out_batch, int64_t **out_row, int64_t **out_col, int64_t **out_edge, int64_t *out_counts, int64_t *nodes_per_hop, int64_t *edges_per_hop, int nthreads, int64_t *bad_pos);
