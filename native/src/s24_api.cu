// C ABI entry points: variant table, device check, error reporting, and the CUTLASS compressor.
#include <cstdarg>
#include <cstdio>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/builders/sm90_sparse_config.inl"
#include "cutlass/transform/device/transform_universal_adapter.hpp"
#include "cutlass/transform/kernel/sparse_gemm_compressor.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "moesq/s24_api.h"

namespace moesq {

static thread_local char g_last_error[1024] = "";

void set_last_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
  va_end(ap);
}

}  // namespace moesq

#define VARIANT(id, name, tm, tn, tk, cm, cn, pp, fa)             \
  int moesq_s24_run_v##id(moesq_s24_args const& args);            \
  void moesq_s24_info_v##id(moesq_s24_variant_info* info);
#include "variants.def"
#undef VARIANT

namespace {

struct VariantEntry {
  const char* name;
  int (*run)(moesq_s24_args const&);
  void (*info)(moesq_s24_variant_info*);
};

const VariantEntry kVariants[] = {
#define VARIANT(id, name, tm, tn, tk, cm, cn, pp, fa) {name, &moesq_s24_run_v##id, &moesq_s24_info_v##id},
#include "variants.def"
#undef VARIANT
};

constexpr int kNumVariants = int(sizeof(kVariants) / sizeof(kVariants[0]));

// The metadata layout shared by every variant (tile_k >= 128): e4m3 2:4, K-major A.
using SparseConfig = cutlass::Sm90GemmSparseConfig<cute::sparse_elem<2, cutlass::float_e4m3_t>, cute::GMMA::Major::K,
                                                   cute::sparse_elem<8, uint8_t>, cute::Int<128>>;
using ProblemShape = cute::Shape<int, int, int, int>;
using CompressorKernel =
    cutlass::transform::kernel::StructuredSparseCompressor<ProblemShape, cutlass::float_e4m3_t,
                                                           cutlass::layout::RowMajor, SparseConfig,
                                                           cutlass::arch::Sm90>;
using Compressor = cutlass::transform::device::TransformUniversalAdapter<CompressorKernel>;

}  // namespace

extern "C" {

int moesq_s24_abi_version(void) { return MOESQ_S24_ABI_VERSION; }

int moesq_s24_num_variants(void) { return kNumVariants; }

const char* moesq_s24_variant_name(int variant) {
  if (variant < 0 || variant >= kNumVariants) return nullptr;
  return kVariants[variant].name;
}

int moesq_s24_get_variant_info(int variant, moesq_s24_variant_info* info) {
  if (variant < 0 || variant >= kNumVariants || info == nullptr) {
    moesq::set_last_error("variant %d out of range [0, %d)", variant, kNumVariants);
    return 1;
  }
  kVariants[variant].info(info);
  return 0;
}

const char* moesq_s24_last_error(void) { return moesq::g_last_error; }

int moesq_s24_check_device(int device) {
  int major = 0, minor = 0;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) {
    moesq::set_last_error("no usable CUDA device: %s", cudaGetErrorString(err));
    (void)cudaGetLastError();
    return 2;
  }
  if (major != 9 || minor != 0) {
    moesq::set_last_error("device %d has compute capability %d.%d; these kernels are built for sm_90a (H100/H200)",
                          device, major, minor);
    return 5;
  }
  return 0;
}

int moesq_s24_gemm(int variant, const moesq_s24_args* args) {
  if (variant < 0 || variant >= kNumVariants) {
    moesq::set_last_error("variant %d out of range [0, %d)", variant, kNumVariants);
    return 1;
  }
  if (args == nullptr) {
    moesq::set_last_error("null args");
    return 1;
  }
  const moesq_s24_args& a = *args;
  if (a.M <= 0 || a.N <= 0 || a.K <= 0 || a.L <= 0 || a.M % 8 || a.K % 32) {
    moesq::set_last_error("bad shape M=%d N=%d K=%d L=%d (need M%%8==0, K%%32==0, all > 0)", a.M, a.N, a.K, a.L);
    return 1;
  }
  if (!a.a_values || !a.e_meta || !a.b_act || !a.scale_w || !a.scale_x || !a.counts || !a.d_out) {
    moesq::set_last_error("null device pointer in args");
    return 1;
  }
  return kVariants[variant].run(a);
}

int moesq_s24_compress(const void* dense, void* a_values, void* e_meta, int M, int K, int L, int device, void* stream) {
  if (M <= 0 || K <= 0 || L <= 0 || M % 8 || K % 32) {
    moesq::set_last_error("bad shape M=%d K=%d L=%d", M, K, L);
    return 1;
  }
  ProblemShape problem{M, 1, K, L};
  using StrideA = cutlass::gemm::TagToStrideA_t<cutlass::layout::RowMajor>;
  StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, L));
  cudaError_t set = cudaSetDevice(device);
  if (set != cudaSuccess) {
    moesq::set_last_error("cudaSetDevice(%d): %s", device, cudaGetErrorString(set));
    return 2;
  }
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw_info.device_id);
  typename Compressor::Arguments arguments{problem, {dense, stride_a, a_values, e_meta}, {hw_info}};
  Compressor op;
  // A test utility, not on the hot path: a synchronous workspace allocation is fine here.
  size_t ws_bytes = Compressor::get_workspace_size(arguments);
  void* workspace = nullptr;
  if (ws_bytes && cudaMalloc(&workspace, ws_bytes) != cudaSuccess) {
    moesq::set_last_error("compressor workspace allocation of %zu bytes failed", ws_bytes);
    return 2;
  }
  cutlass::Status status = op.can_implement(arguments);
  if (status == cutlass::Status::kSuccess) status = op.initialize(arguments, workspace, static_cast<cudaStream_t>(stream));
  if (status == cutlass::Status::kSuccess) status = op.run(static_cast<cudaStream_t>(stream));
  cudaError_t err = cudaGetLastError();
  if (workspace) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
    cudaFree(workspace);
  }
  if (status != cutlass::Status::kSuccess || err != cudaSuccess) {
    moesq::set_last_error("compressor failed: %s / %s", cutlassGetStatusString(status), cudaGetErrorString(err));
    return 4;
  }
  return 0;
}

}  // extern "C"
