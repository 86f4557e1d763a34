/* Instantiates the template file CO_TEMPLATE once per (feature dtype, index dtype) pair:
 * f32/f64/bf16 x i64/i32. Included by segment.c and segment_backward.c. */

#define CO_IT int64_t
#define CO_ISUF i64
#include "gnn_dtypes_one.h"
#undef CO_IT
#undef CO_ISUF

#define CO_IT int32_t
#define CO_ISUF i32
#include "gnn_dtypes_one.h"
#undef CO_IT
#undef CO_ISUF
