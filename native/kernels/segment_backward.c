/* Backward kernels of segment_reduce / spmm:
 *   sddmm            out[e] = <a[row(e)], b[col[e]]>    (sum/mean spmm: gradient of the edge weights)
 *   arg_scatter      out[col[e]] += w[e] * g            (max/min: gradient of x, from the saved winners;
 *                    e = rowptr[r] + arg[r, j], arg int32 relative to the row start)
 *   arg_weight_grad  out_w[e] += x[col[e]] * g          (max/min: gradient of the edge weights)
 *   arg_gather       out[i] = sum over CSC in-edges k of i that won their row of w * g
 *                    (max/min: gradient of x, as arg_scatter but gathered: no scattered writes)
 *   mask_gather      as arg_gather, from the winner bit mask (nnz x ceil(F/64) uint64; only set bits visited)
 *   mask_weight_grad out_w[e] = sum over e's set bits j of x[col[e], j] * g[r, j]
 *   mask_gather_proj mask_gather of g @ wl (g n x C, wl C x F) without that product (float32 only)
 * The gradient of x for sum/mean spmm is segment_reduce itself over the cached CSC transpose.
 * Every index is checked before any write (a winner must be -1 or inside its row); for arg
 * kernels *bad_pos >= 0 is a position in arg; a mask bit at or past F is CO_ERR_BAD_ARGUMENT,
 * *bad_pos <= -2 means position (-2 - bad_pos) in col. */

#define CO_TEMPLATE "segment_backward_tmpl.h"
#include "gnn_dtypes.h"
#undef CO_TEMPLATE
