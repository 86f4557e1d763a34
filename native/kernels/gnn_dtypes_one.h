/* One index dtype (CO_IT, CO_ISUF), three feature dtypes. */

#define CO_DT f32
#define CO_DT_IS_F32 1   /* for a template's float32-only kernels */
#define CO_T float
#define CO_ACC float
#define CO_T_IS_ACC 1
#define CO_LOAD(v) (v)
#define CO_STORE(a) (a)
#include CO_TEMPLATE
#undef CO_DT
#undef CO_DT_IS_F32
#undef CO_T
#undef CO_ACC
#undef CO_T_IS_ACC
#undef CO_LOAD
#undef CO_STORE

#define CO_DT f64
#define CO_T double
#define CO_ACC double
#define CO_T_IS_ACC 1
#define CO_LOAD(v) (v)
#define CO_STORE(a) (a)
#include CO_TEMPLATE
#undef CO_DT
#undef CO_T
#undef CO_ACC
#undef CO_T_IS_ACC
#undef CO_LOAD
#undef CO_STORE

#define CO_DT bf16
#define CO_T uint16_t
#define CO_ACC float
#define CO_T_IS_ACC 0
#define CO_LOAD(v) KFN(bf16_to_f32)(v)
#define CO_STORE(a) KFN(f32_to_bf16)(a)
#include CO_TEMPLATE
#undef CO_DT
#undef CO_T
#undef CO_ACC
#undef CO_T_IS_ACC
#undef CO_LOAD
#undef CO_STORE
