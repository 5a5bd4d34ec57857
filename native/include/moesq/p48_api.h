/* C interface of the p48-nvfp4 grouped GEMM on Hopper's 2:4 sparse tensor cores (sm_90a).
 *
 * For each expert e < E and each of its tokens n < counts[e] (activation row r = row_start[e] + n):
 *     out[r, m] (=|+=) alpha[e] * sum_k W_e[m, k] * x[r, k]          for m < M
 * with W_e the expert's paired 4:8 NVFP4 weight in the kernel's record layout (see
 * moesq_core/serving/kernels/p48_mma.py, which builds it at load time):
 *     records uint8 [E, MT, KR, 704]   MT = ceil(M/16) row tiles, KR = ceil(K/128) K records; one record =
 *                                      16 rows x 128 columns: 512 B of E2M1 codes (2 kept per 4-group), 128 B
 *                                      of 2:4 metadata (4 bits per 8-group), 64 B of UE4M3 block scales,
 *                                      ordered so that each lane's part of a record is contiguous.
 *     x       bfloat16 [rows, K]       activations (row stride x_stride elements) in natural K order, and the
 *                                      kernel applies the paired-4:8 -> 2:4 K permutation while staging; or,
 *                                      with x_perm, already in that order (each 8-group as e0 e2 e4 e6 e1 e3
 *                                      e5 e7, e.g. the output of a GEMM whose weight rows were so permuted)
 *     row_start, counts int32 [E]      read on the device (CUDA-graph safe)
 *     alpha   float32 [E]              epilogue factor (the kernel itself applies the 2^7 of its
 *                                      in-register decode)
 *     act_global float32 [E] or NULL   W4A4: the kernel quantizes x to NVFP4 while staging it (32-column
 *                                      blocks, UE4M3 block scales under act_global[e] > 0), giving exactly
 *                                      the operands a separate quantization pass would; NULL: x as given
 *     out     float32 or bfloat16 [rows, M] (row stride out_stride); with split > 1 it must be float32 and
 *                                      zero-initialised (K slices accumulate with fp32 atomics)
 * Requirements: K % 32 == 0, x rows 16-byte aligned. Functions return 0 on success, else an error code
 * with a message in moesq_s24_last_error() (the module's one thread-local error buffer).
 */
#ifndef MOESQ_P48_API_H
#define MOESQ_P48_API_H

#ifdef __cplusplus
extern "C" {
#endif

#define MOESQ_P48_RECORD_BYTES 704
#define MOESQ_P48_RECORD_K 128

typedef struct {
  const void* records;
  const void* x;
  const int* row_start;
  const int* counts;
  const float* alpha;
  const float* act_global; /* NULL: W4A16; else per-expert NVFP4 activation global scales (W4A4) */
  void* out;
  int E, M, K, MT, KR;
  long long x_stride, out_stride;
  int out_bf16; /* 1: out is bfloat16 (plain stores), 0: float32 */
  int split;    /* K slices per (expert, row-tile group); > 1 accumulates with atomics into float32 out */
  int device;
  void* stream;
  int x_perm; /* 1: x arrives K-permuted (staged as it is) */
  int early_first_unit; /* 1 (mma.sp variants): copy the first weights of each CTA's natural first unit before
                           waiting for the previous grid; they are skipped when its expert has no token */
} moesq_p48_args;

typedef struct {
  int tokens_per_block; /* tokens staged in shared memory at a time (N per weight pass) */
  int row_tiles_per_warp;
  int warps;
  int stages; /* weight records in flight per warp (cp.async ring) */
  int k_chunk; /* activation columns staged per pass */
  int smem_bytes;
  int row_groups_per_unit; /* groups of 16 * warps * row_tiles_per_warp rows a CTA takes per unit of work */
} moesq_p48_variant_info;

int moesq_p48_num_variants(void);
int moesq_p48_get_variant_info(int variant, moesq_p48_variant_info* info);
int moesq_p48_gemm(int variant, const moesq_p48_args* args);

#ifdef __cplusplus
}
#endif

#endif
