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
#endif

/* proof-of-mechanism kernel: out[i, :] = src[index[i], :]; on a bad index writes nothing and
 * returns CO_ERR_INDEX_OUT_OF_RANGE with the offending position in *bad_pos */
int64_t KFN(gather_rows_f32_i64)(const float *src, int64_t n_src, int64_t row_len,
                                 const int64_t *index, int64_t n_index, float *out,
                                 int nthreads, int64_t *bad_pos);
int64_t KFN(gather_rows_f32_i32)(const float *src, int64_t n_src, int64_t row_len,
                                 const int32_t *index, int64_t n_index, float *out,
                                 int nthreads, int64_t *bad_pos);
