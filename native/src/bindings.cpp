// The Python extension module `_moesq_native` (pybind11, through torch's bundled copy): the s24-fp8 kernels
// with torch tensors as arguments. Every tensor is checked here (device, dtype, shape, contiguity, alignment)
// before a device pointer is taken, and launches go to torch's current stream on the tensors' device, so a
// call can be captured in a CUDA graph. The kernels themselves sit behind the C interface of s24_api.h,
// compiled by nvcc without torch.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>

#include "moesq/p48_api.h"
#include "moesq/s24_api.h"

namespace {

constexpr int64_t kMetaBlockK = 128;
constexpr int64_t kMetaBlockM = 64;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + (t.dim() == 1 ? ",)" : ")");
}

void check_tensor(const char* name, const at::Tensor& t, std::initializer_list<at::ScalarType> dtypes,
                  std::vector<int64_t> shape, const at::Device& device) {
  bool dtype_ok = false;
  for (auto d : dtypes) dtype_ok |= t.scalar_type() == d;
  TORCH_CHECK_VALUE(dtype_ok, name, ": unexpected dtype ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, name, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK_VALUE(t.sizes().vec() == shape, name, ": shape ", shape_str(t), ", expected ", c10::IntArrayRef(shape));
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

void raise_if(int rc, const char* what) {
  if (rc != 0) {
    const char* msg = moesq_s24_last_error();
    TORCH_CHECK(false, what, ": ", (msg && *msg) ? msg : "unknown error", " (code ", rc, ")");
  }
}

// D[e, n, m] = bf16((sum_k W_e[m, k] X[e, n, k]) * scale_w[e, m] * scale_x[e, n]) for n < counts[e].
void gemm(int64_t variant, const at::Tensor& values, const at::Tensor& meta, const at::Tensor& act,
          const at::Tensor& scale_w, const at::Tensor& scale_x, const at::Tensor& counts, at::Tensor& out,
          int64_t max_clusters) {
  TORCH_CHECK_VALUE(values.is_cuda(), "weights must be on a CUDA device, got ", values.device());
  TORCH_CHECK_VALUE(values.dim() == 3 && act.dim() == 3, "weights [E, M, K/2] and activations [E, N, K] expected");
  const at::Device dev = values.device();
  const int64_t L = values.size(0), M = values.size(1), K = values.size(2) * 2, N = act.size(1);
  TORCH_CHECK_VALUE(L >= 1 && N >= 1 && M % 8 == 0 && M > 0 && K % 32 == 0 && K > 0,
                    "bad shape E=", L, " M=", M, " N=", N, " K=", K, " (need M % 8 == 0, K % 32 == 0)");
  check_tensor("weight values", values, {at::kFloat8_e4m3fn, at::kByte}, {L, M, K / 2}, dev);
  check_tensor("weight metadata", meta, {at::kByte}, {L, cdiv(K, kMetaBlockK), cdiv(M, kMetaBlockM) * kMetaBlockM, 16},
               dev);
  check_tensor("activations", act, {at::kFloat8_e4m3fn}, {L, N, K}, dev);
  check_tensor("weight scales", scale_w, {at::kFloat}, {L, M}, dev);
  check_tensor("activation scales", scale_x, {at::kFloat}, {L, N}, dev);
  check_tensor("counts", counts, {at::kInt}, {L}, dev);
  check_tensor("out", out, {at::kBFloat16}, {L, N, M}, dev);
  TORCH_CHECK_VALUE(max_clusters >= 0, "max_clusters must be >= 0");
  const c10::cuda::CUDAGuard guard(dev);
  moesq_s24_args a{};
  a.a_values = values.data_ptr();
  a.e_meta = meta.data_ptr();
  a.b_act = act.data_ptr();
  a.scale_w = scale_w.data_ptr<float>();
  a.scale_x = scale_x.data_ptr<float>();
  a.counts = counts.data_ptr<int>();
  a.d_out = out.data_ptr();
  a.M = int(M);
  a.N = int(N);
  a.K = int(K);
  a.L = int(L);
  a.max_clusters = int(max_clusters);
  a.device = dev.index();
  a.stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  raise_if(moesq_s24_gemm(int(variant), &a), "s24-fp8 kernel");
}

// CUTLASS's sm90 compressor: dense 2:4 e4m3 [E, M, K] -> values [E, M, K/2] and metadata (kernel layout).
void compress(const at::Tensor& dense, at::Tensor& values, at::Tensor& meta) {
  TORCH_CHECK_VALUE(dense.is_cuda() && dense.dim() == 3, "dense must be a CUDA tensor [E, M, K]");
  const at::Device dev = dense.device();
  const int64_t L = dense.size(0), M = dense.size(1), K = dense.size(2);
  check_tensor("dense", dense, {at::kFloat8_e4m3fn, at::kByte}, {L, M, K}, dev);
  check_tensor("values", values, {at::kFloat8_e4m3fn, at::kByte}, {L, M, K / 2}, dev);
  check_tensor("metadata", meta, {at::kByte}, {L, cdiv(K, kMetaBlockK), cdiv(M, kMetaBlockM) * kMetaBlockM, 16}, dev);
  const c10::cuda::CUDAGuard guard(dev);
  raise_if(moesq_s24_compress(dense.data_ptr(), values.data_ptr(), meta.data_ptr(), int(M), int(K), int(L),
                              dev.index(), c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
           "CUTLASS compressor");
}

// out[row_start[e] + n, m] (=|+=) alpha[e] * sum_k W_e[m, k] x[row_start[e] + n, k] for n < counts[e]: the p48
// grouped GEMM on the 2:4 sparse tensor cores (records: moesq_core.serving.kernels.p48_mma.P48MmaWeights).
// With act_global (float32 [E]) the kernel fake-quantizes x to NVFP4 while staging it (W4A4).
void p48_gemm(int64_t variant, const at::Tensor& records, const at::Tensor& x, const at::Tensor& row_start,
              const at::Tensor& counts, const at::Tensor& alpha, at::Tensor& out, int64_t M, int64_t K,
              int64_t split, const std::optional<at::Tensor>& act_global, bool x_permuted, bool early_first_unit) {
  TORCH_CHECK_VALUE(records.is_cuda(), "records must be on a CUDA device, got ", records.device());
  TORCH_CHECK_VALUE(records.dim() == 4 && x.dim() == 2 && out.dim() == 2,
                    "records [E, MT, KR, 704], x [rows, K] and out [rows, M] expected");
  const at::Device dev = records.device();
  const int64_t E = records.size(0), MT = records.size(1), KR = records.size(2), rows = x.size(0);
  TORCH_CHECK_VALUE(M > 0 && K > 0 && K % 32 == 0 && MT == cdiv(M, 16) && KR == cdiv(K, MOESQ_P48_RECORD_K),
                    "records ", shape_str(records), " do not hold M=", M, " K=", K);
  check_tensor("records", records, {at::kByte}, {E, MT, KR, MOESQ_P48_RECORD_BYTES}, dev);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && x.device() == dev && x.size(1) == K && x.stride(1) == 1 &&
                        x.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
                    "x: expected bfloat16 [rows, ", K, "] on ", dev, " with 16-byte aligned rows, got ",
                    x.scalar_type(), " ", shape_str(x), " strides ", x.strides());
  TORCH_CHECK_VALUE((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.device() == dev &&
                        out.size(0) == rows && out.size(1) == M && out.stride(1) == 1,
                    "out: expected float32 or bfloat16 [", rows, ", ", M, "] on ", dev, ", got ", out.scalar_type(),
                    " ", shape_str(out));
  TORCH_CHECK_VALUE(split >= 1 && split <= KR, "split must be in [1, ", KR, "], got ", split);
  TORCH_CHECK_VALUE(split == 1 || out.scalar_type() == at::kFloat, "split > 1 accumulates atomically: out must be float32");
  check_tensor("row_start", row_start, {at::kInt}, {E}, dev);
  check_tensor("counts", counts, {at::kInt}, {E}, dev);
  check_tensor("alpha", alpha, {at::kFloat}, {E}, dev);
  if (act_global) check_tensor("act_global", *act_global, {at::kFloat}, {E}, dev);
  const c10::cuda::CUDAGuard guard(dev);
  moesq_p48_args a{};
  a.records = records.data_ptr();
  a.x = x.data_ptr();
  a.row_start = row_start.data_ptr<int>();
  a.counts = counts.data_ptr<int>();
  a.alpha = alpha.data_ptr<float>();
  a.act_global = act_global ? act_global->data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  a.E = int(E);
  a.M = int(M);
  a.K = int(K);
  a.MT = int(MT);
  a.KR = int(KR);
  a.x_stride = x.stride(0);
  a.out_stride = out.stride(0);
  a.out_bf16 = out.scalar_type() == at::kBFloat16;
  a.split = int(split);
  a.x_perm = x_permuted ? 1 : 0;
  a.early_first_unit = early_first_unit ? 1 : 0;
  a.device = dev.index();
  a.stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  raise_if(moesq_p48_gemm(int(variant), &a), "p48 kernel");
}

py::list p48_variants() {
  py::list out;
  for (int i = 0; i < moesq_p48_num_variants(); ++i) {
    moesq_p48_variant_info info{};
    raise_if(moesq_p48_get_variant_info(i, &info), "p48 variant table");
    py::dict d;
    d["index"] = i;
    d["tokens_per_block"] = info.tokens_per_block;
    d["row_tiles_per_warp"] = info.row_tiles_per_warp;
    d["warps"] = info.warps;
    d["stages"] = info.stages;
    d["k_chunk"] = info.k_chunk;
    d["smem_bytes"] = info.smem_bytes;
    d["row_groups_per_unit"] = info.row_groups_per_unit;
    out.append(d);
  }
  return out;
}

void check_device(int64_t device) { raise_if(moesq_s24_check_device(int(device)), "s24-fp8 kernel"); }

py::list variants() {
  py::list out;
  for (int i = 0; i < moesq_s24_num_variants(); ++i) {
    moesq_s24_variant_info info{};
    raise_if(moesq_s24_get_variant_info(i, &info), "variant table");
    py::dict d;
    d["index"] = i;
    d["name"] = std::string(moesq_s24_variant_name(i));
    d["tile_m"] = info.tile_m;
    d["tile_n"] = info.tile_n;
    d["tile_k"] = info.tile_k;
    d["cluster_m"] = info.cluster_m;
    d["cluster_n"] = info.cluster_n;
    d["pingpong"] = bool(info.pingpong);
    d["fast_accum"] = bool(info.fast_accum);
    d["stages"] = info.stages;
    d["smem_bytes"] = info.smem_bytes;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_moesq_native, m) {
  m.doc() = "moesq native kernels for Hopper (sm_90a): grouped 2:4 sparse FP8 GEMM (CUTLASS), p48-nvfp4 grouped GEMM on the sparse tensor cores";
  m.attr("ABI_VERSION") = MOESQ_S24_ABI_VERSION;
  m.def("s24_gemm", &gemm, py::arg("variant"), py::arg("values"), py::arg("meta"), py::arg("act"),
        py::arg("scale_w"), py::arg("scale_x"), py::arg("counts"), py::arg("out"), py::arg("max_clusters") = 0,
        "Grouped 2:4 sparse FP8 GEMM on the current stream; see moesq_core.serving.kernels.s24_gemm.grouped_gemm.");
  m.def("s24_compress", &compress, py::arg("dense"), py::arg("values"), py::arg("meta"),
        "CUTLASS's sm90 structured-sparse compressor (dense 2:4 e4m3 -> values + kernel-layout metadata).");
  m.def("s24_check_device", &check_device, py::arg("device"),
        "Raise unless the CUDA device can run the kernels (compute capability 9.0).");
  m.def("p48_gemm", &p48_gemm, py::arg("variant"), py::arg("records"), py::arg("x"), py::arg("row_start"),
        py::arg("counts"), py::arg("alpha"), py::arg("out"), py::arg("M"), py::arg("K"), py::arg("split") = 1,
        py::arg("act_global") = py::none(), py::arg("x_permuted") = false, py::arg("early_first_unit") = true,
        "p48-nvfp4 grouped GEMM on the 2:4 sparse tensor cores (alpha as given: the kernel applies the decode's "
        "2^7; act_global: NVFP4 activations quantized in the kernel, W4A4; x_permuted: x already in the kernel's "
        "K order; early_first_unit: the mma.sp variants copy each CTA's natural first unit's first weights before "
        "waiting for the previous grid); see moesq_core.serving.kernels.p48_mma.");
  m.def("p48_variants", &p48_variants, "The compiled p48 kernel variants (tokens per pass, warps, stages, ...).");
  m.def("s24_variants", &variants, "The compiled kernel variants (index, name, tile shape, schedule, ...).");
}
