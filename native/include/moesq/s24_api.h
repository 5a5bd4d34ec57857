/* The kernels' C interface: grouped 2:4 sparse FP8 GEMM for Hopper (sm_90a).
 *
 * The kernel objects (nvcc, no torch headers) sit behind this plain C interface; src/bindings.cpp, the
 * pybind11 module, checks the torch tensors and calls it. All pointers are device pointers; `stream` is a
 * cudaStream_t. Functions return 0 on success, otherwise an error code with a message in
 * moesq_s24_last_error() (thread-local).
 *
 * For experts e < L:  D[e, n, m] = bf16( (sum_k W_e[m, k] * X[e, n, k]) * scale_w[e, m] * scale_x[e, n] )
 * for n < counts[e] (rows n >= counts[e] are left unspecified: whole tiles past the count are skipped).
 *   a_values  float8_e4m3 [L, M, K/2]   the two kept values of each 4-group along K, in K order
 *   e_meta    uint8       [L, ceil(K/128), roundup(M, 64), 16]   2-bit kept indices, CUTLASS sm90 order
 *   b_act     float8_e4m3 [L, N, K]     activations, capacity-batched
 *   scale_w   float32     [L, M]
 *   scale_x   float32     [L, N]
 *   counts    int32       [L]           tokens per expert, read on the device
 *   d_out     bfloat16    [L, N, M]
 * Requirements: M % 8 == 0, K % 32 == 0, N >= 1, L >= 1, 16-byte aligned base pointers.
 */
#ifndef MOESQ_S24_API_H
#define MOESQ_S24_API_H

#ifdef __cplusplus
extern "C" {
#endif

#define MOESQ_S24_ABI_VERSION 1

typedef struct {
  const void* a_values;
  const void* e_meta;
  const void* b_act;
  const float* scale_w;
  const float* scale_x;
  const int* counts;
  void* d_out;
  int M, N, K, L;
  int max_clusters; /* 0 = fill the device; >0 caps the persistent grid (tests use it) */
  int device;       /* CUDA device ordinal of the pointers and the stream (made current before the launch) */
  void* stream;
} moesq_s24_args;

typedef struct {
  int tile_m, tile_n, tile_k;
  int cluster_m, cluster_n;
  int pingpong;   /* 1 = ping-pong schedule (one tile per consumer warp group), 0 = cooperative */
  int fast_accum; /* 1 = fp8 MMAs accumulate without periodic fp32 promotion */
  int stages;
  int smem_bytes;
} moesq_s24_variant_info;

int moesq_s24_abi_version(void);
int moesq_s24_num_variants(void);
const char* moesq_s24_variant_name(int variant);
int moesq_s24_get_variant_info(int variant, moesq_s24_variant_info* info);
const char* moesq_s24_last_error(void);

/* 0 when `device` can run the kernels (compute capability 9.0), else an error code. */
int moesq_s24_check_device(int device);

int moesq_s24_gemm(int variant, const moesq_s24_args* args);

/* CUTLASS's own sm90 structured-sparse compressor, for cross-checking the Python re-layout:
 * dense float8_e4m3 [L, M, K] (2:4 along K) -> a_values [L, M, K/2] and e_meta as above. */
int moesq_s24_compress(const void* dense, void* a_values, void* e_meta, int M, int K, int L, int device, void* stream);

#ifdef __cplusplus
}
#endif

#endif
