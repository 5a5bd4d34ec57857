// One kernel variant per object file: compiled once per line of variants.def with -DMOESQ_VARIANT_ID=<id>
// (variants compile in parallel and a broken one names itself).
#include "moesq/s24_gemm.cuh"

#ifndef MOESQ_VARIANT_ID
#error "compile with -DMOESQ_VARIANT_ID=<id from variants.def>"
#endif

#define MOESQ_CAT2(a, b) a##b
#define MOESQ_CAT(a, b) MOESQ_CAT2(a, b)

namespace {
template <int Id>
struct VariantCfg;
#define VARIANT(id, name, tm, tn, tk, cm, cn, pp, fa) \
  template <>                                         \
  struct VariantCfg<id> {                             \
    using type = moesq::S24Config<tm, tn, tk, cm, cn, bool(pp), bool(fa)>; \
  };
#include "variants.def"
#undef VARIANT

using This = moesq::S24Gemm<typename VariantCfg<MOESQ_VARIANT_ID>::type>;
}  // namespace

int MOESQ_CAT(moesq_s24_run_v, MOESQ_VARIANT_ID)(moesq_s24_args const& args) { return This::run(args); }
void MOESQ_CAT(moesq_s24_info_v, MOESQ_VARIANT_ID)(moesq_s24_variant_info* info) { This::info(info); }
