/* Backward kernels of segment_reduce / spmm:
 *   sddmm            out[e] = <a[row(e)], b[col[e]]>    (sum/mean spmm: gradient of the edge weights)
 *   arg_scatter      out[col[arg]] += w[arg] * g        (max/min: gradient of x, from the saved arg)
 *   arg_weight_grad  out_w[arg] += x[col[arg]] * g      (max/min: gradient of the edge weights)
 *   arg_gather       out[i] = sum over CSC in-edges k of i where arg[row_t[k]] == perm[k] of w * g
 *                    (max/min: gradient of x, as arg_scatter but gathered: no scattered writes)
 * The gradient of x for sum/mean spmm is segment_reduce itself over the cached CSC transpose.
 * Every index is checked before any write; for arg kernels *bad_pos >= 0 is a position in arg,
 * *bad_pos <= -2 means position (-2 - bad_pos) in col. */

#define CO_TEMPLATE "segment_backward_tmpl.h"
#include "gnn_dtypes.h"
#undef CO_TEMPLATE
