// Persistent tile scheduler for capacity-batched MoE GEMMs (batch mode L = experts).
//
// The problem is (M, N = capacity, K, L = experts). Expert e only has counts[e] valid rows of its
// capacity slab, and the counts live in device memory (written by the router; no host sync, CUDA-graph
// safe). The stock persistent scheduler would visit all ceil(capacity / TileN) N-tiles of every expert;
// this one visits exactly ceil(count_e / TileN) of them (rounded up to the cluster's N extent) and
// nothing else, so the work is proportional to the routed tokens, not to the capacity.
//
// Work units are clusters. Units are ordered expert by expert; inside an expert, N is the fastest index
// so that CTAs running at the same time share a weight tile (the dominant traffic at decode) in L2.
// Each CTA walks units u = cluster_id, cluster_id + grid_clusters, ... which only ever move forward, so
// the expert cursor is advanced incrementally from the counts array: no prefix-sum kernel is needed.
#pragma once

#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace moesq {

// Tag passed as the TileScheduler of cutlass::gemm::kernel::GemmUniversal.
struct MoeSkipTileSchedulerTag {};

template <class TileShape, class ClusterShape>
class MoeSkipTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  static constexpr int TileM = cute::size<0>(TileShape{});
  static constexpr int TileN = cute::size<1>(TileShape{});
  static constexpr int ClusterM = cute::size<0>(ClusterShape{});
  static constexpr int ClusterN = cute::size<1>(ClusterShape{});
  static_assert(cute::size<2>(ClusterShape{}) == 1, "cluster must be flat in L");

  using WorkTileInfo = typename Base::WorkTileInfo;
  using RasterOrder = typename Base::RasterOrder;
  using RasterOrderOptions = typename Base::RasterOrderOptions;
  static constexpr bool IsDynamicPersistent = false;

  struct Arguments {
    int max_swizzle_size = 1;  // kept for the kernel's interface; unused
    RasterOrderOptions raster_order = RasterOrderOptions::Heuristic;  // unused
    int const* counts = nullptr;  // [L] valid rows per expert, device memory
    int max_clusters = 0;         // cap on the persistent grid (0 = as many as fit on the device)
  };

  struct Params : cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params {
    int const* counts = nullptr;
    int32_t num_experts = 0;
    int32_t capacity = 0;
    int32_t m_clusters = 0;
    int32_t grid_clusters = 1;
  };

  // ---------------------------------------------------------------- host side
  template <class ProblemShapeMNKL, class TileShapeT, class ClusterShapeT>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShapeT, ClusterShapeT,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        [[maybe_unused]] void* workspace = nullptr,
                                        [[maybe_unused]] uint32_t epilogue_subtile = 1,
                                        [[maybe_unused]] uint32_t ktile_start_alignment_count = 1u) {
    Params p{};
    int M = int(cute::get<0>(problem_shape_mnkl));
    int N = int(cute::get<1>(problem_shape_mnkl));
    int L = int(cute::get<3>(problem_shape_mnkl));
    int m_tiles = (M + TileM - 1) / TileM;
    p.counts = args.counts;
    p.num_experts = L;
    p.capacity = N;
    p.m_clusters = (m_tiles + ClusterM - 1) / ClusterM;
    int n_clusters_max = ((N + TileN - 1) / TileN + ClusterN - 1) / ClusterN;
    uint64_t upper = uint64_t(p.m_clusters) * uint64_t(n_clusters_max) * uint64_t(L);
    int fit = hw_info.max_active_clusters > 0 ? hw_info.max_active_clusters
                                              : hw_info.sm_count / (ClusterM * ClusterN);
    if (args.max_clusters > 0 && args.max_clusters < fit) fit = args.max_clusters;
    if (fit < 1) fit = 1;
    p.grid_clusters = int(upper < uint64_t(fit) ? (upper > 0 ? upper : 1) : uint64_t(fit));
    return p;
  }

  static bool can_implement(Arguments const& args) { return args.counts != nullptr; }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, ProblemShape, cutlass::KernelHardwareInfo const&, uint32_t,
                                   const uint32_t = 1, uint32_t = 1) {
    return 0;
  }

  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  template <class ProblemShapeMNKL, class BlockShape, class ClusterShapeT>
  static dim3 get_grid_shape(Params const& params, ProblemShapeMNKL, BlockShape, ClusterShapeT,
                             cutlass::KernelHardwareInfo, Arguments = Arguments{}, bool = true) {
    // Clusters are laid along x; a cluster spans (ClusterM, ClusterN) blocks.
    return dim3(unsigned(params.grid_clusters * ClusterM), unsigned(ClusterN), 1u);
  }

  // -------------------------------------------------------------- device side
  CUTLASS_HOST_DEVICE MoeSkipTileScheduler() {}

  CUTLASS_DEVICE explicit MoeSkipTileScheduler(Params const& params) : p_(params) {
#if defined(__CUDA_ARCH__)
    unit_ = uint64_t(blockIdx.x / ClusterM);
    stride_ = uint64_t(gridDim.x / ClusterM);
#endif
  }

  template <class ClusterShapeT>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShapeT) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() { return work_for(unit_); }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) { unit_ += stride_ * uint64_t(advance_count); }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&, TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    MoeSkipTileScheduler ahead = *this;
    ahead.advance_to_next_work(advance_count);
    return !ahead.get_current_work().is_valid();
  }

 private:
  // Move the expert cursor forward until unit u falls inside expert e_ (or the experts run out).
  CUTLASS_DEVICE void seek(uint64_t u) {
    while (u >= e_end_ && e_ + 1 < p_.num_experts) {
      ++e_;
      e_begin_ = e_end_;
      int c = __ldg(p_.counts + e_);
      c = c < 0 ? 0 : (c > p_.capacity ? p_.capacity : c);
      int n_tiles = (c + TileN - 1) / TileN;
      e_nclusters_ = (n_tiles + ClusterN - 1) / ClusterN;
      e_end_ = e_begin_ + uint64_t(e_nclusters_) * uint64_t(p_.m_clusters);
    }
  }

  CUTLASS_DEVICE WorkTileInfo work_for(uint64_t u) {
    seek(u);
    if (u >= e_end_) {
      return WorkTileInfo::invalid_work_tile();
    }
    uint32_t local = uint32_t(u - e_begin_);
    uint32_t m_cluster = local / uint32_t(e_nclusters_);
    uint32_t n_cluster = local - m_cluster * uint32_t(e_nclusters_);
    auto cta = cute::block_id_in_cluster();
    return {int32_t(m_cluster * ClusterM + cta.x), int32_t(n_cluster * ClusterN + cta.y), int32_t(e_), true};
  }

  Params p_{};
  uint64_t unit_ = 0;
  uint64_t stride_ = 1;
  int e_ = -1;
  int e_nclusters_ = 0;
  uint64_t e_begin_ = 0;
  uint64_t e_end_ = 0;
};

}  // namespace moesq

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<moesq::MoeSkipTileSchedulerTag, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = moesq::MoeSkipTileScheduler<TileShape, ClusterShape>;
};

}  // namespace cutlass::gemm::kernel::detail
