// One kernel configuration of the grouped 2:4 sparse FP8 GEMM, assembled from CUTLASS 4.2 sm90 parts:
// the sparse TMA/GMMA mainloop (A = 2:4 e4m3 weights + metadata, B = e4m3 activations, both K-major),
// an epilogue visitor tree D = bf16(acc * scale_w[m] * scale_x[n]) with batch-strided broadcasts, and
// the MoE skip-tile scheduler (moesq/s24_scheduler.hpp).
#pragma once

#include <cstdio>
#include <cstring>
#include <mutex>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "moesq/s24_api.h"
#include "moesq/s24_scheduler.hpp"

namespace moesq {

using namespace cute;

void set_last_error(const char* fmt, ...);

template <int TM, int TN, int TK, int CM, int CN, bool PingPong, bool FastAccum>
struct S24Config {
  static constexpr int kTileM = TM, kTileN = TN, kTileK = TK, kClusterM = CM, kClusterN = CN;
  static constexpr bool kPingPong = PingPong, kFastAccum = FastAccum;
  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  using KernelSchedule = cute::conditional_t<
      PingPong,
      cute::conditional_t<FastAccum, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                          cutlass::gemm::KernelTmaWarpSpecializedPingpong>,
      cute::conditional_t<FastAccum, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperative>>;
  using EpilogueSchedule = cute::conditional_t<PingPong, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;
};

template <class Cfg>
struct S24Gemm {
  using ElementA = cutlass::float_e4m3_t;  // weights (sparse operand)
  using ElementB = cutlass::float_e4m3_t;  // activations
  using ElementD = cutlass::bfloat16_t;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K contiguous
  using LayoutD = cutlass::layout::ColumnMajor;  // [N, M] row-major == (M, N) with M contiguous
  static constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 8;

  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;

  // D = bf16((acc * scale_w[m]) * scale_x[n]); both vectors batch-strided by expert.
  using ScaleW = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, int64_t>, 4,
                                                              false>;
  using ScaleX = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, int64_t>, 1,
                                                              false>;
  using AccTimesW = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
      ScaleW, cutlass::epilogue::fusion::Sm90AccFetch>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float, cutlass::FloatRoundStyle::round_to_nearest>,
      AccTimesW, ScaleX>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlignD, ElementD, LayoutD,
      kAlignD, typename Cfg::EpilogueSchedule, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassSparseTensorOp, ElementA, LayoutA, kAlignA, ElementB, LayoutB, kAlignB,
      ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Cfg::KernelSchedule>::CollectiveOp;

  using ProblemShape = Shape<int, int, int, int>;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue,
                                                          MoeSkipTileSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using SparseConfig = typename CollectiveMainloop::SparseConfig;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;

  // Every variant must read the metadata layout the Python side produces.
  static_assert(cute::is_same_v<typename SparseConfig::ElementEMma, cute::sparse_elem<8, uint8_t>>,
                "unexpected metadata element for sparse e4m3");
  static_assert(SparseConfig::TensorEAtomK::value == 128 && SparseConfig::TensorEAtomM::value == 64,
                "metadata must be blocked 64 x 128 (tile_k >= 128)");

  static int stages() { return CollectiveMainloop::DispatchPolicy::Stages; }

  struct DeviceState {
    int max_active_clusters = 0;
    int sm_count = 0;
    bool ready = false;
  };

  // One-time per device: raise the dynamic shared-memory limit and measure how many clusters fit, so
  // the persistent grid never oversubscribes (a late cluster would run after all others: a tail).
  static int prepare(int device, DeviceState& st) {
    int smem = GemmKernel::SharedStorageSize;
    cudaError_t err = cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) {
      set_last_error("cudaFuncSetAttribute(smem=%d): %s", smem, cudaGetErrorString(err));
      return 2;
    }
    cudaDeviceGetAttribute(&st.sm_count, cudaDevAttrMultiProcessorCount, device);
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = Cfg::kClusterM;
    attr[0].val.clusterDim.y = Cfg::kClusterN;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(Cfg::kClusterM, Cfg::kClusterN, 1);
    cfg.blockDim = dim3(GemmKernel::MaxThreadsPerBlock, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    err = cudaOccupancyMaxActiveClusters(&clusters, cutlass::device_kernel<GemmKernel>, &cfg);
    if (err != cudaSuccess || clusters <= 0) {
      (void)cudaGetLastError();
      clusters = st.sm_count / (Cfg::kClusterM * Cfg::kClusterN);
    }
    st.max_active_clusters = clusters;
    st.ready = true;
    return 0;
  }

  static int run(moesq_s24_args const& a) {
    static std::mutex mu;
    static DeviceState states[64];
    int device = a.device;
    if (device < 0 || device >= 64) {
      set_last_error("device ordinal %d out of range", device);
      return 1;
    }
    // Our statically linked CUDA runtime keeps its own current device: make the caller's current.
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) {
      set_last_error("cudaSetDevice(%d): %s", device, cudaGetErrorString(err));
      return 2;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!states[device].ready) {
        int rc = prepare(device, states[device]);
        if (rc) return rc;
      }
    }
    DeviceState const& st = states[device];

    ProblemShape problem{a.M, a.N, a.K, a.L};
    typename GemmKernel::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
    args.problem_shape = problem;

    args.mainloop.ptr_A = static_cast<ElementA const*>(a.a_values);
    args.mainloop.layout_a = SparseConfig::fill_layoutA(problem);
    args.mainloop.ptr_E = static_cast<typename CollectiveMainloop::ElementE const*>(a.e_meta);
    args.mainloop.layout_e = SparseConfig::fill_layoutE(problem);
    args.mainloop.ptr_B = static_cast<ElementB const*>(a.b_act);
    args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(a.N, a.K, a.L));

    auto& fusion = args.epilogue.thread;
    // Tree arguments: { {scale_w, acc, (*)}, scale_x, (*) }
    fusion.op_0.op_0 = {a.scale_w, 0.f, {_1{}, _0{}, int64_t(a.M)}};
    fusion.op_0.op_1 = {};
    fusion.op_0.op_2 = {};
    fusion.op_1 = {a.scale_x, 0.f, {_0{}, _1{}, int64_t(a.N)}};
    fusion.op_2 = {};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.ptr_D = static_cast<ElementD*>(a.d_out);
    args.epilogue.dD = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(a.M, a.N, a.L));
    args.epilogue.dC = args.epilogue.dD;

    args.hw_info.device_id = device;
    args.hw_info.sm_count = st.sm_count;
    args.hw_info.max_active_clusters = st.max_active_clusters;
    args.scheduler.counts = a.counts;
    args.scheduler.max_clusters = a.max_clusters;

    cutlass::Status status = Gemm::can_implement(args);
    if (status != cutlass::Status::kSuccess) {
      set_last_error("CUTLASS can_implement failed for M=%d N=%d K=%d L=%d: %s", a.M, a.N, a.K, a.L,
                     cutlassGetStatusString(status));
      return 3;
    }
    auto params = GemmKernel::to_underlying_arguments(args, nullptr);
    status = Gemm::run(params, static_cast<cudaStream_t>(a.stream));
    err = cudaGetLastError();
    if (status != cutlass::Status::kSuccess || err != cudaSuccess) {
      set_last_error("kernel launch failed: %s / %s", cutlassGetStatusString(status), cudaGetErrorString(err));
      return 4;
    }
    return 0;
  }

  static void info(moesq_s24_variant_info* out) {
    out->tile_m = Cfg::kTileM;
    out->tile_n = Cfg::kTileN;
    out->tile_k = Cfg::kTileK;
    out->cluster_m = Cfg::kClusterM;
    out->cluster_n = Cfg::kClusterN;
    out->pingpong = Cfg::kPingPong;
    out->fast_accum = Cfg::kFastAccum;
    out->stages = stages();
    out->smem_bytes = GemmKernel::SharedStorageSize;
  }
};

}  // namespace moesq
