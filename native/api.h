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
/* mask_gather_proj_f32_*: out (n_out x F) = (accumulate: +=) mask_gather of g @ wl without that product:
 * g n_rows x C, wl C x F (row-major); each in-edge computes sum_c g[row_t[k], c] wl[c, j] for the
 * features j it won. Statuses and bad_pos as mask_gather. */
int64_t KFN(mask_gather_proj_f32_i64)(const int64_t *colptr, int64_t n_out, const int64_t *row_t, const int64_t *perm, int64_t nnz, const uint64_t *wmask, const float *g, int64_t n_rows, int64_t C, const float *wl, int64_t F, float *out, int accumulate, int nthreads, int64_t *bad_pos);
int64_t KFN(mask_gather_proj_f32_i32)(const int64_t *colptr, int64_t n_out, const int32_t *row_t, const int64_t *perm, int64_t nnz, const uint64_t *wmask, const float *g, int64_t n_rows, int64_t C, const float *wl, int64_t F, float *out, int accumulate, int nthreads, int64_t *bad_pos);
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

/* ---- fused graph attention (native/kernels/attention.c, attention_tmpl.h) ----
 * Over the CSR of incoming edges (rowptr over n_dst targets, col = sources in [0, n_src)), H heads of
 * C channels (node rows H x C). Forward: per-edge scores (gat: leaky_relu(a_src[j] + a_dst[i] (+ a_edge[e]));
 * gatv2: att . leaky_relu(x_l[j] + x_r[i]); transformer: <q[i], k[j]> / score_div), softmax over each row
 * (PyG's: max-subtracted, + 1e-16 in the denominator), times mask (E x H dropout multipliers; NULL: none),
 * out[i, h] = sum_e alpha * mask * value[j, h]; alpha (E x H, before dropout) is written for backward.
 * Backward: also the CSC transpose (colptr over n_src, row_t, perm: int64); gradients whose pointer is
 * NULL are skipped. bad: int64_t[2] = {position, argument: 0 rowptr, 1 col, 2 colptr, 3 row_t, 4 perm}
 * for CO_ERR_UNSORTED / CO_ERR_INDEX_OUT_OF_RANGE; CO_ERR_NO_MEMORY when scratch cannot be had. */
int64_t KFN(gat_forward_f32_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const float *x, const float *a_src, const float *a_dst, const float *a_edge, const float *mask, double negative_slope, float *out, float *alpha, int nthreads, int64_t *bad);
int64_t KFN(gat_backward_f32_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const float *x, const float *a_src, const float *a_dst, const float *a_edge, const float *mask, double negative_slope, const float *alpha, const float *g, float *grad_x, float *grad_a_src, float *grad_a_dst, float *grad_a_edge, int nthreads, int64_t *bad);
int64_t KFN(gatv2_forward_f32_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const float *x_l, const float *x_r, const float *att, const float *mask, double negative_slope, float *out, float *alpha, int nthreads, int64_t *bad);
int64_t KFN(gatv2_backward_f32_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const float *x_l, const float *x_r, const float *att, const float *mask, double negative_slope, const float *alpha, const float *g, float *grad_x_l, float *grad_x_r, float *grad_att, int nthreads, int64_t *bad);
int64_t KFN(transformer_forward_f32_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const float *q, const float *k, const float *v, const float *mask, double score_div, float *out, float *alpha, int nthreads, int64_t *bad);
int64_t KFN(transformer_backward_f32_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const float *q, const float *k, const float *v, const float *mask, double score_div, const float *alpha, const float *g, float *grad_q, float *grad_k, float *grad_v, int nthreads, int64_t *bad);
int64_t KFN(gat_forward_f64_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const double *x, const double *a_src, const double *a_dst, const double *a_edge, const double *mask, double negative_slope, double *out, double *alpha, int nthreads, int64_t *bad);
int64_t KFN(gat_backward_f64_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const double *x, const double *a_src, const double *a_dst, const double *a_edge, const double *mask, double negative_slope, const double *alpha, const double *g, double *grad_x, double *grad_a_src, double *grad_a_dst, double *grad_a_edge, int nthreads, int64_t *bad);
int64_t KFN(gatv2_forward_f64_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const double *x_l, const double *x_r, const double *att, const double *mask, double negative_slope, double *out, double *alpha, int nthreads, int64_t *bad);
int64_t KFN(gatv2_backward_f64_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const double *x_l, const double *x_r, const double *att, const double *mask, double negative_slope, const double *alpha, const double *g, double *grad_x_l, double *grad_x_r, double *grad_att, int nthreads, int64_t *bad);
int64_t KFN(transformer_forward_f64_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const double *q, const double *k, const double *v, const double *mask, double score_div, double *out, double *alpha, int nthreads, int64_t *bad);
int64_t KFN(transformer_backward_f64_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const double *q, const double *k, const double *v, const double *mask, double score_div, const double *alpha, const double *g, double *grad_q, double *grad_k, double *grad_v, int nthreads, int64_t *bad);
int64_t KFN(gat_forward_bf16_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const uint16_t *x, const uint16_t *a_src, const uint16_t *a_dst, const uint16_t *a_edge, const uint16_t *mask, double negative_slope, uint16_t *out, uint16_t *alpha, int nthreads, int64_t *bad);
int64_t KFN(gat_backward_bf16_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const uint16_t *x, const uint16_t *a_src, const uint16_t *a_dst, const uint16_t *a_edge, const uint16_t *mask, double negative_slope, const uint16_t *alpha, const uint16_t *g, uint16_t *grad_x, uint16_t *grad_a_src, uint16_t *grad_a_dst, uint16_t *grad_a_edge, int nthreads, int64_t *bad);
int64_t KFN(gatv2_forward_bf16_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const uint16_t *x_l, const uint16_t *x_r, const uint16_t *att, const uint16_t *mask, double negative_slope, uint16_t *out, uint16_t *alpha, int nthreads, int64_t *bad);
int64_t KFN(gatv2_backward_bf16_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const uint16_t *x_l, const uint16_t *x_r, const uint16_t *att, const uint16_t *mask, double negative_slope, const uint16_t *alpha, const uint16_t *g, uint16_t *grad_x_l, uint16_t *grad_x_r, uint16_t *grad_att, int nthreads, int64_t *bad);
int64_t KFN(transformer_forward_bf16_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, int64_t n_src, int64_t H, int64_t C, const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *mask, double score_div, uint16_t *out, uint16_t *alpha, int nthreads, int64_t *bad);
int64_t KFN(transformer_backward_bf16_i64)(const int64_t *rowptr, int64_t n_dst, const int64_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *mask, double score_div, const uint16_t *alpha, const uint16_t *g, uint16_t *grad_q, uint16_t *grad_k, uint16_t *grad_v, int nthreads, int64_t *bad);
int64_t KFN(gat_forward_f32_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const float *x, const float *a_src, const float *a_dst, const float *a_edge, const float *mask, double negative_slope, float *out, float *alpha, int nthreads, int64_t *bad);
int64_t KFN(gat_backward_f32_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const float *x, const float *a_src, const float *a_dst, const float *a_edge, const float *mask, double negative_slope, const float *alpha, const float *g, float *grad_x, float *grad_a_src, float *grad_a_dst, float *grad_a_edge, int nthreads, int64_t *bad);
int64_t KFN(gatv2_forward_f32_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const float *x_l, const float *x_r, const float *att, const float *mask, double negative_slope, float *out, float *alpha, int nthreads, int64_t *bad);
int64_t KFN(gatv2_backward_f32_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const float *x_l, const float *x_r, const float *att, const float *mask, double negative_slope, const float *alpha, const float *g, float *grad_x_l, float *grad_x_r, float *grad_att, int nthreads, int64_t *bad);
int64_t KFN(transformer_forward_f32_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const float *q, const float *k, const float *v, const float *mask, double score_div, float *out, float *alpha, int nthreads, int64_t *bad);
int64_t KFN(transformer_backward_f32_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const float *q, const float *k, const float *v, const float *mask, double score_div, const float *alpha, const float *g, float *grad_q, float *grad_k, float *grad_v, int nthreads, int64_t *bad);
int64_t KFN(gat_forward_f64_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const double *x, const double *a_src, const double *a_dst, const double *a_edge, const double *mask, double negative_slope, double *out, double *alpha, int nthreads, int64_t *bad);
int64_t KFN(gat_backward_f64_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const double *x, const double *a_src, const double *a_dst, const double *a_edge, const double *mask, double negative_slope, const double *alpha, const double *g, double *grad_x, double *grad_a_src, double *grad_a_dst, double *grad_a_edge, int nthreads, int64_t *bad);
int64_t KFN(gatv2_forward_f64_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const double *x_l, const double *x_r, const double *att, const double *mask, double negative_slope, double *out, double *alpha, int nthreads, int64_t *bad);
int64_t KFN(gatv2_backward_f64_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const double *x_l, const double *x_r, const double *att, const double *mask, double negative_slope, const double *alpha, const double *g, double *grad_x_l, double *grad_x_r, double *grad_att, int nthreads, int64_t *bad);
int64_t KFN(transformer_forward_f64_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const double *q, const double *k, const double *v, const double *mask, double score_div, double *out, double *alpha, int nthreads, int64_t *bad);
int64_t KFN(transformer_backward_f64_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const double *q, const double *k, const double *v, const double *mask, double score_div, const double *alpha, const double *g, double *grad_q, double *grad_k, double *grad_v, int nthreads, int64_t *bad);
int64_t KFN(gat_forward_bf16_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const uint16_t *x, const uint16_t *a_src, const uint16_t *a_dst, const uint16_t *a_edge, const uint16_t *mask, double negative_slope, uint16_t *out, uint16_t *alpha, int nthreads, int64_t *bad);
int64_t KFN(gat_backward_bf16_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const uint16_t *x, const uint16_t *a_src, const uint16_t *a_dst, const uint16_t *a_edge, const uint16_t *mask, double negative_slope, const uint16_t *alpha, const uint16_t *g, uint16_t *grad_x, uint16_t *grad_a_src, uint16_t *grad_a_dst, uint16_t *grad_a_edge, int nthreads, int64_t *bad);
int64_t KFN(gatv2_forward_bf16_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const uint16_t *x_l, const uint16_t *x_r, const uint16_t *att, const uint16_t *mask, double negative_slope, uint16_t *out, uint16_t *alpha, int nthreads, int64_t *bad);
int64_t KFN(gatv2_backward_bf16_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const uint16_t *x_l, const uint16_t *x_r, const uint16_t *att, const uint16_t *mask, double negative_slope, const uint16_t *alpha, const uint16_t *g, uint16_t *grad_x_l, uint16_t *grad_x_r, uint16_t *grad_att, int nthreads, int64_t *bad);
int64_t KFN(transformer_forward_bf16_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, int64_t n_src, int64_t H, int64_t C, const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *mask, double score_div, uint16_t *out, uint16_t *alpha, int nthreads, int64_t *bad);
int64_t KFN(transformer_backward_bf16_i32)(const int64_t *rowptr, int64_t n_dst, const int32_t *col, const int64_t *colptr, const int64_t *row_t, const int64_t *perm, int64_t n_src, int64_t H, int64_t C, const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *mask, double score_div, const uint16_t *alpha, const uint16_t *g, uint16_t *grad_q, uint16_t *grad_k, uint16_t *grad_v, int nthreads, int64_t *bad);

/* ---- inference elementwise kernels (native/kernels/eltwise.c) ----
 * gelu_erf_f32: y = 0.5 x (1 + erf(x / sqrt 2)) over n contiguous floats; y == x works in place
 * (any other overlap does not). CO_ERR_BAD_ARGUMENT for n < 0, nthreads < 1 or a NULL pointer. */
int64_t KFN(gelu_erf_f32)(const float *x, float *y, int64_t n, int nthreads);
/* gelu_tanh_f32: the same for torch's approximate="tanh" GELU, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) */
int64_t KFN(gelu_tanh_f32)(const float *x, float *y, int64_t n, int nthreads);
/* log_softmax_narrow_f32: out = log_softmax(x) over the last dimension of a row-major rows x dim
 * tensor, 1 <= dim <= 15 (torch 2.13's kernel is 12x slower there than at 16); out may be x.
 * log_softmax_backward_narrow_f32: gin = g - exp(out) * sum(g) per row; gin may be g (not out). CO_ERR_BAD_ARGUMENT on a bad
 * size or a NULL pointer */
int64_t KFN(log_softmax_narrow_f32)(const float *x, float *out, int64_t rows, int64_t dim, int nthreads);
int64_t KFN(log_softmax_backward_narrow_f32)(const float *g, const float *out, float *gin, int64_t rows, int64_t dim,
                                             int nthreads);

/* ---- LayerNorm + uint8 quantization (native/kernels/layer_norm.c) ----
 * layer_norm_u8_f32: torch's layer_norm over the last `cols` of `rows` rows (row r at x + r * x_stride),
 * written as floats to y (dense rows) and/or as uint8 to q: clamp(rint(n * inv_scale) + zero_point,
 * 0, qmax). gamma / beta may be NULL. CO_ERR_BAD_ARGUMENT for negative sizes, x_stride < cols, eps < 0,
 * a scale that is not finite and positive, a zero point outside [0, qmax], qmax outside [0, 255],
 * nthreads < 1, a NULL x, or both outputs NULL. */
int64_t KFN(layer_norm_u8_f32)(const float *x, int64_t rows, int64_t cols, int64_t x_stride, const float *gamma, const float *beta, double eps, float *y, uint8_t *q, float inv_scale, int32_t zero_point, int32_t qmax, int nthreads);

/* ---- int8 linear layers on AMX tiles (native/kernels/amx_qlinear.c) ----
 * amx_qlinear_u8s8: y = post(scale * (x @ w^T) + bias (+ residual)), x uint8 (M x K, row stride ldx), w int8
 * packed in 16-column panels over K padded to a multiple of 64 (see the kernel file); res_kind 0 none, 1 f32,
 * 2 u8 (res_scale, res_zp), 3 s8 (res_scale); post 0 none, 1 relu, 2 gelu erf, 3 gelu tanh, 4 silu, 5 hardswish; out_kind 0 f32,
 * 1 bf16, 2 u8 (out_scale, out_zp). CO_ERR_UNSUPPORTED_AMX (-6) without AMX-INT8. */
int64_t KFN(amx_qlinear_u8s8)(const uint8_t *x, int64_t x_len, int64_t M, int64_t K, int64_t ldx, const int8_t *wp, int64_t wp_len, int64_t N, const float *scale, const float *bias, const void *residual, int64_t res_len, int64_t ldr, int res_kind, float res_scale, int32_t res_zp, int post, void *out, int64_t out_len, int64_t ldo, int out_kind, float out_scale, int32_t out_zp, int nthreads);

/* ---- fused bf16 attention on AMX tiles (native/kernels/amx_attention.c) ----
 * amx_attention_bf16: out (float32) = softmax(scale q k^T + mask) v over B x H heads, bf16 q / k / v;
 * every operand 4-D with strides s[0..2] (elements) and a dense last dimension, mask NULL or float32
 * with strides 0 where it broadcasts; q_len etc. bound each operand's reach (elements). nk up to
 * 16384, d and dv up to 512. CO_ERR_UNSUPPORTED_AMX (-6) outside the avx512 variant or when the
 * kernel refuses this process the AMX tile state; CO_ERR_INDEX_OUT_OF_RANGE when an operand reaches
 * past its length; CO_ERR_NO_MEMORY when a thread's packing buffers cannot be allocated. */
int64_t KFN(amx_attention_bf16)(const uint16_t *q, int64_t q_len, const int64_t *qs, const uint16_t *k, int64_t k_len, const int64_t *ks, const uint16_t *v, int64_t v_len, const int64_t *vs, int64_t B, int64_t H, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale, const float *mask, int64_t mask_len, const int64_t *ms, float *out, int64_t out_len, const int64_t *os, int nthreads);

/* ---- the same attention on AVX512_BF16 dot products (native/kernels/dpbf16_attention.c) ----
 * dpbf16_attention: amx_attention_bf16's operands, limits and statuses, computed with VDPBF16PS for
 * CPUs with AVX512_BF16 and no AMX; also k / v with Hk heads (Hk divides H: query head h reads kv head
 * h / (H / Hk)) and causal != 0 (query i sees keys j <= i). CO_ERR_UNSUPPORTED_AMX (-6) outside the
 * avx512 variant or on a CPU without AVX512_BF16. */
int64_t KFN(dpbf16_attention)(const uint16_t *q, int64_t q_len, const int64_t *qs, const uint16_t *k, int64_t k_len, const int64_t *ks, const uint16_t *v, int64_t v_len, const int64_t *vs, int64_t B, int64_t H, int64_t Hk, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale, int causal, const float *mask, int64_t mask_len, const int64_t *ms, float *out, int64_t out_len, const int64_t *os, int nthreads);
/* dpbf16_attention_bf16out: the same with a bf16 output (out, out_len in bf16 elements), each float rounded
 * to nearest even as torch's .to(torch.bfloat16) does */
int64_t KFN(dpbf16_attention_bf16out)(const uint16_t *q, int64_t q_len, const int64_t *qs, const uint16_t *k, int64_t k_len, const int64_t *ks, const uint16_t *v, int64_t v_len, const int64_t *vs, int64_t B, int64_t H, int64_t Hk, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale, int causal, const float *mask, int64_t mask_len, const int64_t *ms, uint16_t *out, int64_t out_len, const int64_t *os, int nthreads);

/* ---- the same attention in float32 on AVX-512 FMA (native/kernels/f32_attention.c) ----
 * f32_attention: dpbf16_attention's operands, limits and statuses with float32 q / k / v (lengths in
 * floats): the attention of float32 graphs. CO_ERR_UNSUPPORTED_AMX (-6) outside the avx512 variant. */
int64_t KFN(f32_attention)(const float *q, int64_t q_len, const int64_t *qs, const float *k, int64_t k_len, const int64_t *ks, const float *v, int64_t v_len, const int64_t *vs, int64_t B, int64_t H, int64_t Hk, int64_t nq, int64_t nk, int64_t d, int64_t dv, float scale, int causal, const float *mask, int64_t mask_len, const int64_t *ms, float *out, int64_t out_len, const int64_t *os, int nthreads);

/* ---- decode-step GEMV (native/kernels/gemv.c) ----
 * gemv_f32: y (M x N) = x (M x K) W^T + bias, 1 <= M <= 8, W K x N row-major when w_kn = 1, N x K
 * when w_kn = 0; bias N floats or NULL; all row-major and dense. CO_ERR_BAD_ARGUMENT for sizes out
 * of range or a NULL x / w / y, CO_ERR_NO_MEMORY when the per-thread partials cannot be allocated. */
int64_t KFN(gemv_f32)(const float *x, int64_t M, int64_t K, const float *w, int64_t N, int w_kn, const float *bias, float *y, int nthreads);

/* ---- tall-skinny GEMMs for GNN training (native/kernels/tsgemm.c) ----
 * ts_gemm_nn_f32: C (M x N) = A (M x K) B' (+ bias) (+ C when accumulate = 1), B' = B (K x N) when
 * b_nk = 0, B^T (B N x K) when b_nk = 1. ts_gemm_tn_f32: C (N1 x N2) = A^T B (A M x N1, B M x N2),
 * and colsum[N1] = A's column sums when colsum is not NULL. All row-major and dense; K, N, N1, N2 in
 * [1, 1024], M >= 0. CO_ERR_BAD_ARGUMENT for sizes out of range or a NULL matrix, CO_ERR_NO_MEMORY
 * when the packed panels / partials cannot be allocated; nothing written on an error. */
int64_t KFN(ts_gemm_nn_f32)(const float *a, int64_t M, int64_t K, const float *b, int64_t N, int b_nk, const float *bias, int accumulate, float *c, int nthreads);
/* ts_gemm_nn_ep_f32: C = A B' (+ bias), then max(0, C) when relu = 1, then C where keep > 0 (or NaN) and 0
 * elsewhere when keep (M x N, like C) is not NULL: torch's relu and threshold_backward(C, keep, 0). */
int64_t KFN(ts_gemm_nn_ep_f32)(const float *a, int64_t M, int64_t K, const float *b, int64_t N, int b_nk, const float *bias, int relu, const float *keep, float *c, int nthreads);
/* ts_gemm_nn2_f32: C (M x N) = A1 W1^T + A2 W2^T (+ bias), A1 M x K1, A2 M x K2, W1 N x K1, W2 N x K2. */
int64_t KFN(ts_gemm_nn2_f32)(const float *a1, int64_t M, int64_t K1, const float *w1, const float *a2, int64_t K2, const float *w2, int64_t N, const float *bias, float *c, int nthreads);
int64_t KFN(ts_gemm_tn_f32)(const float *a, int64_t M, int64_t N1, const float *b, int64_t N2, float *c, float *colsum, int nthreads);
/* ts_gemm_nn2_ep_f32: ts_gemm_nn2_f32, then max(0, C) when relu = 1. ts_gemm_tn_ep_f32: ts_gemm_tn_f32
 * with A taken as 0 where keep (M x N1, like A; NULL: none) is <= 0: threshold_backward(A, keep, 0). */
int64_t KFN(ts_gemm_nn2_ep_f32)(const float *a1, int64_t M, int64_t K1, const float *w1, const float *a2, int64_t K2, const float *w2, int64_t N, const float *bias, int relu, float *c, int nthreads);
int64_t KFN(ts_gemm_tn_ep_f32)(const float *a, int64_t M, int64_t N1, const float *b, int64_t N2, const float *keep, float *c, float *colsum, int nthreads);
/* ts_gemm_tn2_ep_f32: ts_gemm_tn_ep_f32 for two B operands (B1 M x N2 into C1 N1 x N2, B2 M x N3 into C2
 * N1 x N3) in one pass over A and keep; colsum as there. */
int64_t KFN(ts_gemm_tn2_ep_f32)(const float *a, int64_t M, int64_t N1, const float *b1, int64_t N2, const float *b2, int64_t N3, const float *keep, float *c1, float *c2, float *colsum, int nthreads);

/* ---- GEMMs against packed constant weights (native/kernels/sgemm.c) ----
 * sgemm_packed_size: floats of W packed for (N, K) (-1 for N or K < 1). sgemm_pack_f32: W (N x K when
 * w_kn = 0, K x N when w_kn = 1) into that many floats at bp. sgemm_packed_f32: C (M x N) = A (M x K,
 * row stride lda) W' (+ bias[N]) (+ add, M x N dense), then the activation act (0 none, 1 relu, 2 erf GELU,
 * 3 tanh GELU: eltwise.c's). CO_ERR_BAD_ARGUMENT
 * for sizes out of range or a NULL a / bp / c, CO_ERR_NO_MEMORY when the A strips cannot be allocated;
 * nothing written on an error. */
int64_t KFN(sgemm_packed_size)(int64_t N, int64_t K);
int64_t KFN(sgemm_pack_f32)(const float *w, int64_t N, int64_t K, int w_kn, float *bp);
int64_t KFN(sgemm_packed_f32)(const float *a, int64_t M, int64_t K, int64_t lda, const float *bp, int64_t N, const float *bias, const float *add, int act, float *c, int nthreads);

/* ---- 3 x 3 stride-1 convolutions by Winograd F(m x m, 3 x 3), m = 2 or 4 (native/kernels/winograd.c) ----
 * wino_packed_size: floats of a Cout x Cin x 3 x 3 weight transformed for m and packed (-1 for Cout or
 * Cin < 1 or another m). wino_pack_f32: W (OIHW) into that many floats at wp. wino_conv_f32: y (B x OH x
 * OW x Cout, NHWC, OH = H + 2 pad_h - 2, OW = W + 2 pad_w - 2) = conv(x (B x H x W x Cin, NHWC), W)
 * (+ bias) (+ add, B x OH x OW x Cout), then act (0 none, 1 relu), wp packed for the same m.
 * CO_ERR_BAD_ARGUMENT for sizes out of range or a NULL x / wp / y, CO_ERR_NO_MEMORY when the scratch
 * cannot be allocated. */
int64_t KFN(wino_packed_size)(int64_t Cout, int64_t Cin, int64_t m);
int64_t KFN(wino_pack_f32)(const float *w, int64_t Cout, int64_t Cin, int64_t m, float *wp);
int64_t KFN(wino_conv_f32)(const float *x, int64_t B, int64_t H, int64_t W, int64_t Cin, int64_t pad_h, int64_t pad_w, int64_t m, const float *wp, int64_t Cout, const float *bias, const float *add, int act, float *y, int nthreads);

/* ---- torch's CPU Bernoulli draws (native/kernels/random.c) ----
 * bernoulli_mt19937_f32: out[i] = scale when draw i of torch's MT19937 (the legacy_pod state bytes of
 * torch.get_rng_state(), advanced in place) keeps, else 0: what `torch.empty(n).bernoulli_(p)
 * .div_(p)` gives with keep_below = ceil(p * 2^53) and scale = 1 / p as torch rounds it.
 * CO_ERR_BAD_ARGUMENT for a short or inconsistent state, n < 0 or a NULL out. */
int64_t KFN(bernoulli_mt19937_f32)(void *state, int64_t state_bytes, int64_t n, uint64_t keep_below, float scale, float *out);
