// p48-nvfp4 grouped GEMM on Hopper's 2:4 sparse tensor cores (mma.sp m16n8k32, bf16 operands, fp32 accumulate).
//
// Paired 4:8 is 2:4 after permuting K inside every 8-group to [e0 e2 e4 e6 | e1 e3 e5 e7]. The weights are the
// sparse A operand (16 output rows per MMA), the activations B (8 tokens per MMA). A persistent grid walks work
// units (one expert, W*R row tiles of 16 rows, one K slice); per pass a CTA stages up to NB tokens x KC columns
// of activations in shared memory (permuting K on the way unless they arrive permuted) and every warp streams its
// row tiles' weight records through a private ring of bulk copies (records are laid out at load time so that one
// record is one contiguous 704-byte copy and each lane's share of it is contiguous: 16 B of codes, 4 B of
// metadata, 8 B of scales). Launched with programmatic dependent launch (see wait_previous_grid). Each weight record is
// decoded once into bf16 fragments (E2M1 bits placed in bf16 fields, times the UE4M3 scale * 2^119 by a bf16x2
// FMA: exact, the values are e2m1 * s * 2^-7) and used for every 8-token tile of the pass.
// W4A4 (act_global given): the staging also fake-quantizes the activations to NVFP4 (32-column blocks, the
// expert's static global scale), writing the exact unscaled values e2m1 * s_a that a separate quantization
// pass would have written, so the MMAs see the same bf16 operands bit for bit.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "moesq/p48_api.h"

namespace moesq {
void set_last_error(const char* fmt, ...);
}

namespace {

constexpr int kRecBytes = MOESQ_P48_RECORD_BYTES;  // 512 codes + 128 metadata + 64 scales
constexpr int kRecK = MOESQ_P48_RECORD_K;
constexpr int kMetaOff = 512;
constexpr int kScaleOff = 640;
constexpr int kRecChunks = kRecBytes / 16;
constexpr float kAlphaFold = 128.f;  // the decode yields e2m1 * s * 2^-7 (exact: alpha * 2^7 rounds like alpha)
constexpr int kMaxOrderE = 4096;     // experts a CTA can sort for an ORDER variant (8 KB of shared memory); the
                                     // generated p48_variants.inc checks it against p48_variants.MAX_ORDER_EXPERTS

struct Params {
  const uint8_t* records;
  int E;
  const uint16_t* x;
  const int* row_start;
  const int* counts;
  const float* alpha;
  void* out;
  int M, K, MT, KR;
  long long x_stride, out_stride;
  int split;
  const float* act_global;  // W4A4: per-expert activation global scale (> 0); unused in W4A16
  int x_perm;               // x arrives K-permuted ([e0 e2 e4 e6 | e1 e3 e5 e7] per 8-group): staged as it is
  // (mma.sp variants) before waiting for the previous grid, copy the ring's first steps of the CTA's natural first
  // unit (the one it takes when that expert has tokens: the weights do not depend on the previous grid) and set up
  // the ring, so that after the wait one round trip for the unit's count and row start stands between the CTA and
  // its first MMA; when the expert has no token the copies are waited for and skipped. Else only an L2 prefetch
  // of those records goes before the wait, and the unit walk, the ring's setup and its first copies after it.
  int early;
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The weight ring: an mbarrier per stage (one arrival: the producer lane's expect_tx; the bulk copies complete
// the transaction bytes), waited on by parity.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Programmatic dependent launch (the kernels are launched with programmatic stream serialization): a CTA may
// start while the previous grid on the stream still runs; it waits for that grid (its completion and memory)
// before reading anything the grid may have written (counts, row starts, activations) or writing its outputs,
// and lets the next grid launch as soon as every CTA has begun.
__device__ __forceinline__ void wait_previous_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void allow_next_grid() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
// `bytes` (a multiple of 16, 16-byte aligned) of global memory towards L2 (no shared memory, no completion).
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16) from global to shared memory (both 16-byte aligned), counted on mbarrier `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// One lane of the (converged) warp, chosen by elect.sync (why the producer uses it: issue_step).
__device__ __forceinline__ bool elect_one() {
  uint32_t e;
  asm volatile("{\n.reg .pred P;\nelect.sync _|P, 0xffffffff;\nselp.u32 %0, 1, 0, P;\n}\n" : "=r"(e));
  return e != 0;
}
// The warp index broadcast from lane 0, so the compiler knows it (and what follows from it) warp-uniform.
__device__ __forceinline__ int uniform_warp_index() { return __shfl_sync(~0u, threadIdx.x >> 5, 0); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// (x & mask) | y in one lop3 (0xEA = (a & b) | c).
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask, uint32_t y) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(x), "r"(mask), "r"(y));
  return d;
}

// One code word (8 E2M1 codes; register r's two codes at the bits CODE_BITS[r] of p48_mma.py) -> A register r =
// bf16x2(lo, hi) of e2m1 * 2^-126 (bf16 fields: magnitude at bits 6..8, sign at 15), then times the row's scale
// (registers 0, 2: row g; 1, 3: row g + 8). The layout costs 9 integer operations per word (a shift by 6, a rotate
// by 12, a shift by 2, each and a mask; the fourth register's in-place bits and two bits shifted down by 8): the
// fewest a search found over layouts where a register is its fields in place, or moved by one shift or rotate, or
// two such moves merged (11 before; no layout lets every register be one move and a mask). The fma keeps bf16
// subnormals (no flush), so it is exact.
__device__ __forceinline__ void decode_fields(uint32_t w, uint32_t (&f)[4]) {
  constexpr uint32_t kField = 0x81C081C0u;
  f[0] = (w << 6) & kField;
  f[1] = __funnelshift_l(w, w, 12) & kField;
  f[2] = (w << 2) & kField;
  f[3] = and_or(w, 0x81808180u, (w >> 8) & 0x00400040u);
}
// bf16x2 a * (h, h), h = half H of s (the lo/hi selection is an operand modifier of the multiply), + -0: decoded
// fields (decode_fields) times the row's scale; the fma keeps bf16 subnormals (no flush), so it is exact.
template <int H>
__device__ __forceinline__ uint32_t bf16x2_mul_half(uint32_t a, uint32_t s) {
  uint32_t d;
  if constexpr (H == 0)
    asm("{\n.reg .b16 l, h;\n.reg .b32 t;\nmov.b32 {l, h}, %2;\nmov.b32 t, {l, l};\nfma.rn.bf16x2 %0, %1, t, %3;\n}\n"
        : "=r"(d)
        : "r"(a), "r"(s), "r"(0x80008000u));
  else
    asm("{\n.reg .b16 l, h;\n.reg .b32 t;\nmov.b32 {l, h}, %2;\nmov.b32 t, {h, h};\nfma.rn.bf16x2 %0, %1, t, %3;\n}\n"
        : "=r"(d)
        : "r"(a), "r"(s), "r"(0x80008000u));
  return d;
}

// A record's four scale words (decoded once per record): bf16x2 (step 2i, step 2i + 1) of s * 2^119 for
// row g (lo[i]) and row g + 8 (hi[i]); the scale bytes of step s are bytes 2 (s & 1) (row g) and 2 (s & 1) + 1
// (row g + 8) of word s >> 1.
struct RecScales {
  uint32_t lo[2], hi[2];
};
__device__ __forceinline__ RecScales record_scales(uint2 sc) {
  return RecScales{{prmt(sc.x, 0, 0x4240) * 16u + 0x76007600u, prmt(sc.y, 0, 0x4240) * 16u + 0x76007600u},
                   {prmt(sc.x, 0, 0x4341) * 16u + 0x76007600u, prmt(sc.y, 0, 0x4341) * 16u + 0x76007600u}};
}

// Two compact metadata bytes (n_a | n_b << 4 each; bytes at bit 0 and 16 of x) -> one mma.sp metadata register:
// every 8-group's 2:4 nibble repeated for its two 4-groups (x + 15 (x & 0xF0) moves n_b up by 4, times 17 repeats
// each nibble).
__device__ __forceinline__ uint32_t expand_meta_imad(uint32_t x) { return (x + (x & 0x00F000F0u) * 15u) * 17u; }

template <int SEL>
__device__ __forceinline__ void mma_sp(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[4], uint32_t e) {
  asm volatile(
      "mma.sp.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, %13;\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e), "n"(SEL));
}

// Warpgroup MMA (wgmma.sp, sm_90a): D[64 x N] += A[64 x 32] (2:4 sparse, bf16 from registers: warp w of the
// warpgroup holds rows 16w..16w+15 in the fragment and metadata layout of mma.sp m16n8k32) x B[32 x N] (shared
// memory, K-major, 128-byte swizzle, through a descriptor). Scale-d is 1: the accumulators are zeroed by hand.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins the accumulators at a fence or wait (the compiler must not move their reads or writes across it).
template <int N>
__device__ __forceinline__ void acc_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Generic-proxy shared-memory writes (the staged activations) become visible to wgmma's async proxy.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define MOESQ_D8(i)                                                                                       \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
template <int SEL>
__device__ __forceinline__ void wgmma_sp(float (&d)[8], const uint32_t (&a)[4], uint64_t desc, uint32_t e) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %15, 0;\n"
      "wgmma.mma_async.sp.sync.aligned.m64n16k32.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7"
      "}, {%8,%9,%10,%11}, %12, %13, %14, p, 1, 1, 0;\n}\n"
      : MOESQ_D8(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(e), "n"(SEL), "n"(1));
}
template <int SEL>
__device__ __forceinline__ void wgmma_sp(float (&d)[16], const uint32_t (&a)[4], uint64_t desc, uint32_t e) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %23, 0;\n"
      "wgmma.mma_async.sp.sync.aligned.m64n32k32.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, {%16,%17,%18,%19}, %20, %21, %22, p, 1, 1, 0;\n}\n"
      : MOESQ_D8(0), MOESQ_D8(8)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(e), "n"(SEL), "n"(1));
}
template <int SEL>
__device__ __forceinline__ void wgmma_sp(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, uint32_t e) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %39, 0;\n"
      "wgmma.mma_async.sp.sync.aligned.m64n64k32.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, %37, %38, p, 1, 1, 0;\n}\n"
      : MOESQ_D8(0), MOESQ_D8(8), MOESQ_D8(16), MOESQ_D8(24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(e), "n"(SEL), "n"(1));
}
template <int SEL>
__device__ __forceinline__ void wgmma_sp(float (&d)[48], const uint32_t (&a)[4], uint64_t desc, uint32_t e) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %55, 0;\n"
      "wgmma.mma_async.sp.sync.aligned.m64n96k32.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
      "}, {%48,%49,%50,%51}, %52, %53, %54, p, 1, 1, 0;\n}\n"
      : MOESQ_D8(0), MOESQ_D8(8), MOESQ_D8(16), MOESQ_D8(24), MOESQ_D8(32), MOESQ_D8(40)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(e), "n"(SEL), "n"(1));
}
template <int SEL>
__device__ __forceinline__ void wgmma_sp(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, uint32_t e) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %71, 0;\n"
      "wgmma.mma_async.sp.sync.aligned.m64n128k32.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64,%65,%66,%67}, %68, %69, %70, p, 1, 1, 0;\n}\n"
      : MOESQ_D8(0), MOESQ_D8(8), MOESQ_D8(16), MOESQ_D8(24), MOESQ_D8(32), MOESQ_D8(40), MOESQ_D8(48), MOESQ_D8(56)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(e), "n"(SEL), "n"(1));
}
#undef MOESQ_D8

// Descriptor bits of the B operand (wgmma's K-major 128-byte swizzle): layout type 1 at bit 62, 1024 bytes
// between 8-row groups (bits 32-45, in 16-byte units), leading offset 1 (unused by swizzled K-major layouts).
constexpr uint64_t kDescSw128 = (1ull << 62) | (uint64_t(1024 >> 4) << 32) | (1ull << 16);

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&b)[4], uint32_t s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(s));
}

// x in [2^-9, 448] -> the nearest UE4M3 value, ties to even (as torch's float8_e4m3fn cast of the clamped
// scale): 3 mantissa bits from 2^-6 up, multiples of 2^-9 below.
__device__ __forceinline__ float round_ue4m3(float x) {
  if (x < 0.015625f) return rintf(x * 512.f) * 0.001953125f;
  const uint32_t b = __float_as_uint(x);
  return __uint_as_float((b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u);
}

// Eight bf16 activations (one uint4; lanes 4q..4q+3 hold the 32-column block) -> their NVFP4 unscaled values
// e2m1(c) * s (bf16, exact) under global scale g, with the float32 operations of the reference quantizer in
// its order: s = e4m3(clamp(amax / 6 * g, 2^-9, 448)), c = e2m1((x * g) / s) (IEEE division, ties of the
// E2M1 grid to the even code, no -0). Every lane of the warp must call it (the block amax is shuffled).
__device__ __forceinline__ uint4 nvfp4_block_values(uint4 v, float g) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float f[8];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[i] = __uint_as_float((i & 1) ? (w[i >> 1] & 0xFFFF0000u) : (w[i >> 1] << 16));
    amax = fmaxf(amax, fabsf(f[i]));
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  const float s = round_ue4m3(fminf(fmaxf(__fmul_rn(__fdiv_rn(amax, 6.f), g), 0.001953125f), 448.f));
  uint32_t o[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float t = __fdiv_rn(__fmul_rn(f[i], g), s);
    const float a = fabsf(t);
    const int mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
    const float m = mag < 4 ? 0.5f * mag : mag == 7 ? 6.f : float(mag - 2);
    const float q = __fmul_rn((t < 0.f && mag > 0) ? -m : m, s);  // exact: <= 6 significant bits
    o[i >> 1] |= (i & 1) ? (__float_as_uint(q) & 0xFFFF0000u) : (__float_as_uint(q) >> 16);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// The decode variant (mma.sp): NB tokens per pass, R row tiles per warp, W warps, S ring stages per warp, KC
// activation columns per chunk, RK consecutive K records per row tile and step (one contiguous copy; the per-step
// work of the producer, the cursor and the loop is shared by RK records). Lane 0 of each warp fills a ring step
// with one bulk copy per row tile (cp.async.bulk, completion counted on the stage's mbarrier) and the decode turns
// each record's scales into bf16x2 pairs once (both steps of a pair in one register): fewer instructions per weight
// byte, which is what bounds decode. Per unit, the staging (LeanStage) skips its iterations past the tokens and the
// warps whose column groups lie past the chunk (warp-uniform branches), takes the chunk's row start and token count
// from the cursor (loaded when it takes the unit) and loads the activations into registers before the barrier that
// frees the shared buffer (their latency overlaps the wait for the other warps); the epilogue writes through a
// per-thread base pointer with constant offsets (skipping the second token tile at <= 8 tokens).
// P: row groups (of W R row tiles) per unit, walked one after the other; when the unit's K slice fits one chunk and
// its tokens one block, the later row groups re-use the staged chunk (no staging, no barrier).
// DEAL: how the CTAs share the units. 0: unit b, b + G, ... to CTA b (G CTAs) in expert order, experts without
// tokens skipped where they fall (a CTA draws many or few units by where the empty experts fall, and only long ones
// when the token counts repeat with a period that meets G). 1 (deal_by_tiles): round 0 as 0 over the experts whose
// units it covers whole (so the records prefetched before the grid waits are the right ones); the rest of the
// experts with tokens listed by decreasing cost class (8-token tiles: 1, 2, 3, >= 4; ties in expert order) and
// dealt in rounds to the CTAs ranked by their round-0 unit's class, lightest (or none) first.
template <int NB_, int R_, int W_, int S_, int KC_, int RK_, int P_ = 1, int DEAL_ = 0>
struct Variant {
  static constexpr int NB = NB_, R = R_, W = W_, S = S_, KC = KC_, RK = RK_, P = P_, DEAL = DEAL_;
  static_assert(R <= 2, "the producer keeps one offset between the row tiles (issue_step)");
  static constexpr bool ORDER = DEAL > 0;  // the units of the experts with tokens, in a listed order
  static constexpr int XS = KC + 8;  // staged row stride (elements): +16 B keeps ldmatrix conflict-free
  static constexpr int kXBytes = NB * XS * 2;
  static constexpr int kRingBytes = W * S * R * RK * kRecBytes;
  // + one mbarrier per warp and stage, + (DEAL 1) the deal: a 16-byte header and the experts in list order (16-bit
  // indices; the launch adds 2 E bytes)
  static constexpr int kOrderOff = kXBytes + kRingBytes + W * S * 8;
  static constexpr int kSmem = kOrderOff + (ORDER ? 16 : 0);
  static constexpr int kOrderBytesPerExpert = ORDER ? 2 : 0;  // dynamic shared memory per expert (the list)
  static constexpr int kThreads = W * 32;
  static constexpr int kXIters = (NB * KC / 8 + kThreads - 1) / kThreads;
  static constexpr bool SWZ = false;
  static constexpr int kMinBlocks = kThreads <= 128 ? 4 : 2;  // at most 128 registers per thread
  static_assert(KC % (kRecK * RK) == 0 && NB % 8 == 0, "bad variant");
};

// Warpgroup variants (wgmma.sp m64nNBk32): WG warpgroups, each warp streams one row tile (the 16 rows it holds in
// the warpgroup's 64-row A operand), the activations are B in shared memory (wgmma's swizzled layout), so each
// decoded weight fragment serves all NB tokens of a pass in one instruction.
// The weight ring is the mbarrier one, so cp.async groups are free for the activations: a staging map fixed
// at compile time (each thread one 8-column group of tokens t0, t0 + TS, ...: the swizzled destination moves by a
// constant), warp-uniform skips past the tokens, scales and metadata decoded once per record, and an epilogue
// through one base pointer per thread. Each thread cp.async-copies its units of the next chunk into a raw
// (natural-order) buffer one chunk ahead (columns past K zero-filled by the copy), so at the chunk boundary only the
// shared-memory K permutation (raw -> swizzled; units past the chunk's width go to columns no wgmma of the chunk
// reads) sits between the two barriers instead of the L2 latency of the loads; activations that arrive K-permuted
// (W4A16) are copied straight to their swizzled places in two buffers in turn, one barrier per chunk.
// TW (> 0): the wgmma's N per token block is its token count rounded up to a multiple of TW (at most NB), not NB:
// an expert with few tokens does not pay the tensor-core work (and latency) of a full pass.
// ORDER: the CTAs walk the units of the experts with tokens by decreasing token count, dealt out in a snake
// (round r gives unit r G + b to CTA b for even r, r G + G - 1 - b for odd r; G CTAs) instead of unit b, b + G, ...
// in expert order: each CTA then gets a like mix of long and short units (the round-robin deal let a CTA draw
// mostly long ones whenever the token counts repeat with a period that meets G, and the kernel waited for it).
// Each CTA sorts the experts itself at the start (E <= kMaxOrderE).
template <int NB_, int WG_, int S_, int KC_, int RK_, int TW_ = 0, bool ORDER_ = false>
struct WgVariant {
  static constexpr int NB = NB_, R = 1, W = 4 * WG_, S = S_, KC = KC_, RK = RK_, P = 1;
  static constexpr int TW = TW_;
  static constexpr bool ORDER = ORDER_;
  static constexpr int DEAL = ORDER ? 2 : 0;  // 2: the sorted snake above (Variant's DEAL 1 is another deal)
  static_assert(TW == 0 || (TW % 16 == 0 && NB % (TW ? TW : 1) == 0), "the token width step must divide NB");
  static constexpr int kXBuf = NB * KC;  // elements per activation buffer
  // the swizzled and the raw buffer (or the second swizzled one) + slack: the swizzle needs a 1024-byte base
  static constexpr int kXBytes = 2 * kXBuf * 2 + 1024;
  static constexpr int kRingBytes = W * S * RK * kRecBytes;
  // + one mbarrier per warp and stage, + the experts in unit order (ORDER: 16-bit indices)
  static constexpr int kOrderOff = kXBytes + kRingBytes + W * S * 8;
  static constexpr int kSmem = kOrderOff + (ORDER ? 2 * kMaxOrderE : 0);
  static constexpr int kThreads = W * 32;
  static constexpr bool SWZ = true;
  static constexpr int kOrderBytesPerExpert = 0;  // the sorted list is in kSmem already
  static_assert(!ORDER || kXBuf * 2 >= 4 * kMaxOrderE, "ORDER sorts the counts in the activation buffer");
  static constexpr int kMinBlocks = kThreads <= 256 ? 2 : 1;  // 128 registers per thread either way
  static_assert(KC % (kRecK * RK) == 0 && KC % 64 == 0 && NB % 16 == 0 && NB <= 256, "bad variant");
};

// One chunk of staged activations, rows [row0, row0 + ntok) x columns [k0, k0 + kw), kw a multiple of 128: in
// shared memory K-permuted per 8-group; columns >= K are zeros (the padded weight columns are zero, and
// 0 * garbage could be NaN). QUANT: NVFP4-quantized with global scale g on the way; a 32-column block is the four
// consecutive lanes with c = 4q..4q+3 of one token. Layouts: rows of V::XS elements (decode variant, ldmatrix), or
// wgmma's B operand (warpgroup variants; K-major, 128-byte swizzle): 64-column K blocks of NB rows x 128 B each,
// the 16-byte chunk c of row t at chunk c ^ (t & 7).
struct XChunk {
  long long row0;
  int ntok, k0, kw;
  float g;  // W4A4: the expert's activation global scale
  int permuted;  // Params::x_perm: the activations already come in the staged K order
};

// K-permutes one 16-byte group (8 columns) per 8-group: [e0 e2 e4 e6 | e1 e3 e5 e7].
__device__ __forceinline__ uint4 permute8(uint4 v) {
  return make_uint4(prmt(v.x, v.y, 0x5410), prmt(v.z, v.w, 0x5410), prmt(v.x, v.y, 0x7632), prmt(v.z, v.w, 0x7632));
}
// A 16-byte group of activations in the order the MMAs read (the chunk's activations may arrive permuted).
__device__ __forceinline__ uint4 staged_order(const XChunk& ch, uint4 v) { return ch.permuted ? v : permute8(v); }

__device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// The fixed staging map of the warpgroup variants: thread = 8-column group c of tokens t0 + j TS,
// j < N. A warp holds 32 consecutive groups of one token, so the skips below are warp-uniform. In the swizzled
// layout (chunk c & 7 of row t at (c & 7) ^ (t & 7)) t & 7 stays t0 & 7 (TS is a multiple of 8), so unit j's
// destination is unit 0's plus j * kDstStep bytes.
template <class V>
struct WgMap {
  static constexpr int G = V::KC / 8, TS = V::kThreads / G, N = V::NB / TS;
  static constexpr int kDstStep = TS * 128;  // bytes
  static_assert(V::kThreads % G == 0 && G % 32 == 0 && TS % 8 == 0 && V::NB % TS == 0, "bad lean staging map");
  int c, t0;
  __device__ __forceinline__ WgMap() : c(threadIdx.x % G), t0(threadIdx.x / G) {}
  __device__ __forceinline__ uint32_t dst(uint32_t xs_addr) const {
    return xs_addr + 2 * ((c >> 3) * (V::NB * 64) + t0 * 64 + 8 * ((c & 7) ^ (t0 & 7)));
  }
  // units with a token (0 for a warp whose groups all lie past the chunk's width)
  __device__ __forceinline__ int units(const XChunk& ch) const {
    return 8 * (c & ~31) >= ch.kw || ch.ntok <= t0 ? 0 : (ch.ntok - t0 + TS - 1) / TS;
  }
  __device__ __forceinline__ const uint16_t* src(const Params& p, const XChunk& ch) const {
    return p.x + (ch.row0 + t0) * p.x_stride + ch.k0 + 8 * c;
  }
};

// The decode variant's staging under a fixed map (thread: column group c, tokens t0, t0 + TS, ...; a warp shares
// its token and holds 32 consecutive groups): the iterations past the tokens and the warps past the chunk's width
// branch away (warp-uniform) instead of running predicated off; one 64-bit source pointer per thread, advanced by
// a stride. In two halves (load, then store), with the barrier that frees the buffer between them.
template <class V>
struct LeanStage {
  static constexpr int G = V::KC / 8, TS = V::kThreads / G, N = V::kXIters;
  static_assert(V::kThreads % G == 0 && G % 32 == 0 && N <= 8, "the lean staging needs whole warps per token");
  uint4 v[N];
  int c, t0, nj;  // nj: iterations with a token; 0 for a warp past the chunk's width

  __device__ __forceinline__ void load(const Params& p, const XChunk& ch) {
    c = threadIdx.x % G, t0 = threadIdx.x / G;
    nj = 8 * (c & ~31) >= ch.kw || ch.ntok <= t0 ? 0 : (ch.ntok - t0 + TS - 1) / TS;
    const bool col_ok = 8 * c < ch.kw && ch.k0 + 8 * c < p.K;
    const uint16_t* src = p.x + (ch.row0 + t0) * p.x_stride + ch.k0 + 8 * c;
    const long long step = TS * p.x_stride;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (j >= nj) break;
      v[j] = col_ok ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
      src += step;
    }
  }
  template <bool QUANT>
  __device__ __forceinline__ void store(uint16_t* xs, const XChunk& ch) {
    uint16_t* dst = xs + t0 * V::XS + 8 * c;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (j >= nj) break;
      if constexpr (QUANT) v[j] = nvfp4_block_values(v[j], ch.g);  // the warp is whole here (uniform branches)
      if (8 * c < ch.kw) *reinterpret_cast<uint4*>(dst + j * TS * V::XS) = staged_order(ch, v[j]);
    }
  }
};

// Unit `unit` of the expert-major order as (expert, row group, K slice): per_e = row groups x K slices per expert.
struct UnitCoords {
  int e, rg, z;
};
__device__ __forceinline__ UnitCoords unit_coords(int unit, int per_e, int split) {
  const int e = unit / per_e, rem = unit - e * per_e, rg = rem / split;
  return {e, rg, rem - rg * split};
}

// Walks the CTA's work units (expert, group of W*R row tiles, K slice; units blockIdx.x, + gridDim.x, ...)
// step by step: for each unit, each token block of NB tokens, each step of STEP 128-column records of the K slice
// (the last step of a slice may hold fewer).
// Units of experts without tokens are skipped. The producer (cp.async ring) and the consumer (MMA) each keep
// one cursor; the producer runs S - 1 records ahead, across unit boundaries, so the weight stream never drains.
struct Cursor {
  int u, e, rg, kr0, nkr, ntb, tb, kr;
  int cnt;  // the expert's tokens
  // the unit as (e, rg, z) and gridDim.x in the same mixed radix (experts, row groups, K slices), so that moving
  // on by gridDim.x units is a few adds instead of two integer divisions
  int z, de, drg, dz;
  int row0;  // the expert's first activation row
  int sub;   // P > 1: the row group within the unit (the unit's row groups are rg P .. rg P + P - 1)
  // the producer's: the record index of the unit's first row tile at kr0, and the bytes from its records
  // to the second row tile's (set at each unit's, row group's or token block's first step)
  uint32_t rec;
  int rec_step;
  bool valid;

  template <int P>
  __device__ __forceinline__ int row_group() const { return P == 1 ? rg : rg * P + sub; }

  template <int NB>
  __device__ __forceinline__ void seek(const Params& p, int unit, int row_groups, int kr_per, int n_units) {
    for (; unit < n_units; unit += gridDim.x) {
      const UnitCoords c = unit_coords(unit, row_groups * p.split, p.split);
      if (take<NB>(p, c.e, c.z, kr_per)) {
        u = unit, e = c.e, rg = c.rg, z = c.z;
        return;
      }
    }
    valid = false;
  }
  __device__ __forceinline__ void init_stride(const Params& p, int row_groups) {
    const UnitCoords d = unit_coords(gridDim.x, row_groups * p.split, p.split);
    de = d.e, drg = d.rg, dz = d.z;
  }
  // Unit (e, z) of expert e's K slice z, if it has work: the cursor stands at its first record.
  template <int NB>
  __device__ __forceinline__ bool take(const Params& p, int eu, int zu, int kr_per) {
    const int c = __ldg(p.counts + eu);
    const int k0 = zu * kr_per, nk = min(p.KR, k0 + kr_per) - k0;
    if (c > 0 && nk > 0) {
      start<NB>(c, k0, nk);
      row0 = __ldg(p.row_start + eu);
      return true;
    }
    return false;
  }
  // The cursor at the first record of a unit whose expert has `c` > 0 tokens, K slice records [k0, k0 + nk) (the
  // caller sets row0, the expert's first activation row).
  template <int NB>
  __device__ __forceinline__ void start(int c, int k0, int nk) {
    cnt = c, kr0 = k0, nkr = nk, ntb = (c + NB - 1) / NB, tb = 0, kr = 0, valid = true;
  }
  // ORDER: the CTA's k-th unit (u = k) and on until one has work: position k G + b (k even) or k G + G - 1 - b
  // (k odd) of the units of the experts with tokens, listed by `order` (16-bit expert indices in shared memory at
  // address `order`, decreasing token count); n_units: the number of those units.
  template <int NB>
  __device__ __forceinline__ void take_ordered(const Params& p, int k, int row_groups, int kr_per, int n_units,
                                               uint32_t order) {
    const int per_e = row_groups * p.split;
    for (;; ++k) {
      const int pos = k * gridDim.x + ((k & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
      if (pos >= n_units) break;
      const UnitCoords c = unit_coords(pos, per_e, p.split);  // c.e: the position in the list
      uint16_t eu;
      asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(eu) : "r"(order + 2 * c.e));
      if (take<NB>(p, eu, c.z, kr_per)) {  // else an empty K slice (split > KR / kr_per)
        u = k, e = eu, rg = c.rg, z = c.z;
        return;
      }
    }
    valid = false;
  }
  // DEAL 1: the CTA's k-th unit (u = k) and on until one has work: k = 0 the natural unit b where round 0 covers it,
  // k >= 1 position (k - 1) G + rank of the rest list. `deal`: the header (round 0's experts e0, the CTA's rank, the
  // rest's units) and after it the list (16-bit expert indices), in shared memory (deal_by_tiles).
  template <int NB>
  __device__ __forceinline__ void take_dealt(const Params& p, int k, int row_groups, int kr_per, uint32_t deal) {
    const int per_e = row_groups * p.split;
    int e0, rank, n_rest;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(e0), "=r"(rank) : "r"(deal));
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(n_rest) : "r"(deal + 8));
    if (k == 0) {
      if (static_cast<int>(blockIdx.x) < e0 * per_e) {
        const UnitCoords c = unit_coords(blockIdx.x, per_e, p.split);
        if (take<NB>(p, c.e, c.z, kr_per)) {
          u = 0, e = c.e, rg = c.rg, z = c.z;
          return;
        }
      }
      k = 1;
    }
    for (;; ++k) {
      const int pos = (k - 1) * gridDim.x + rank;
      if (pos >= n_rest) break;
      const UnitCoords c = unit_coords(pos, per_e, p.split);  // c.e: the position in the list
      uint16_t eu;
      asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(eu) : "r"(deal + 16 + 2 * c.e));
      if (take<NB>(p, eu, c.z, kr_per)) {  // else an empty K slice (split > KR / kr_per)
        u = k, e = eu, rg = c.rg, z = c.z;
        return;
      }
    }
    valid = false;
  }
  // P > 1: rg counts units of P row groups of GROUP_TILES row tiles each (the last unit may hold fewer)
  template <int NB, int STEP, int DEAL = 0, int P = 1, int GROUP_TILES = 1>
  __device__ __forceinline__ void next(const Params& p, int row_groups, int kr_per, int n_units, uint32_t order = 0) {
    if ((kr += STEP) < nkr) return;
    kr = 0;
    if (++tb < ntb) return;
    if constexpr (P > 1) {  // the unit's next row group: same expert, K slice and tokens
      if (sub + 1 < P && (rg * P + sub + 1) * GROUP_TILES < p.MT) {
        ++sub, tb = 0;
        return;
      }
      sub = 0;
    }
    if constexpr (DEAL == 1) {
      take_dealt<NB>(p, u + 1, row_groups, kr_per, order);
    } else if constexpr (DEAL == 2) {
      take_ordered<NB>(p, u + 1, row_groups, kr_per, n_units, order);
    } else {
      for (;;) {
        z += dz;
        int carry = z >= p.split;
        z -= carry ? p.split : 0;
        rg += drg + carry;
        carry = rg >= row_groups;
        rg -= carry ? row_groups : 0;
        e += de + carry;
        if (e >= p.E) {
          valid = false;
          return;
        }
        if (take<NB>(p, e, z, kr_per)) return;
      }
    }
  }
};

// The chunk a cursor stands at (its first record must start a chunk), from the cursor's own count and row start
// (loaded when it took the unit).
template <class V, bool QUANT>
__device__ __forceinline__ XChunk chunk_of(const Params& p, const Cursor& c) {
  return XChunk{c.row0 + static_cast<long long>(c.tb) * V::NB, min(V::NB, c.cnt - c.tb * V::NB), (c.kr0 + c.kr) * kRecK,
                min(V::KC, (c.nkr - c.kr) * kRecK), QUANT ? __ldg(p.act_global + c.e) : 0.f, p.x_perm};
}

// The lane's share of a record in the ring: its 16 B of codes, 4 B of metadata and its row pair's 8 B of scales.
__device__ __forceinline__ void load_lane_share(const uint8_t* rec, int lane, uint4& codes, uint32_t& meta, uint2& sc) {
  codes = *reinterpret_cast<const uint4*>(rec + 16 * lane);
  meta = *reinterpret_cast<const uint32_t*>(rec + kMetaOff + 4 * lane);
  sc = *reinterpret_cast<const uint2*>(rec + kScaleOff + 8 * (lane >> 2));
}

// MMA step s (32 columns) of a record: the four A registers, with the record's scales decoded once (RecScales);
// the metadata register of steps 2i and 2i + 1 is the same (expand_meta_imad, once per record; the selector differs).
__device__ __forceinline__ void decode_step_hoisted(const uint4& codes, const RecScales& rs, int s, uint32_t (&a)[4]) {
  const uint32_t w = s == 0 ? codes.x : s == 1 ? codes.y : s == 2 ? codes.z : codes.w;
  uint32_t f[4];
  decode_fields(w, f);
  const uint32_t lo = rs.lo[s >> 1], hi = rs.hi[s >> 1];
  if (s & 1) {
    a[0] = bf16x2_mul_half<1>(f[0], lo), a[1] = bf16x2_mul_half<1>(f[1], hi);
    a[2] = bf16x2_mul_half<1>(f[2], lo), a[3] = bf16x2_mul_half<1>(f[3], hi);
  } else {
    a[0] = bf16x2_mul_half<0>(f[0], lo), a[1] = bf16x2_mul_half<0>(f[1], hi);
    a[2] = bf16x2_mul_half<0>(f[2], lo), a[3] = bf16x2_mul_half<0>(f[3], hi);
  }
}

// One output element through a typed pointer: a bf16 or fp32 store, or an fp32 atomic add (split K).
template <bool ATOMIC, class T>
__device__ __forceinline__ void store_to(T* o, float v) {
  if constexpr (ATOMIC)
    atomicAdd(o, v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    *o = __float2bfloat16_rn(v);
  else
    *o = v;
}

// ORDER: the experts with tokens by decreasing count (ties: index order) into `order` (16-bit indices in shared
// memory): the rank of e is how many come before it. `tmp` holds the counts meanwhile (4 E bytes of shared memory
// that are free until the first chunk is staged). Every thread of the CTA calls it; returns the experts with tokens.
template <class V>
__device__ __forceinline__ int sort_experts(const Params& p, int* tmp, uint32_t order) {
  for (int e = threadIdx.x; e < p.E; e += V::kThreads) tmp[e] = __ldg(p.counts + e);
  __syncthreads();
  int active = 0;
  for (int b = 0; b < p.E; b += V::kThreads) {
    const int e = b + threadIdx.x;
    const int c = e < p.E ? tmp[e] : 0;
    if (c > 0) {
      int rank = 0;
      for (int f = 0; f < p.E; ++f) {
        const int cf = tmp[f];
        rank += cf > c || (cf == c && f < e);
      }
      asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(order + 2 * rank), "h"(static_cast<uint16_t>(e)) : "memory");
    }
    active += __syncthreads_count(c > 0);
  }
  __syncthreads();  // the order is complete, and the counts' space is free again
  return active;
}

// DEAL 1 (the decode variants): each warp works the deal out itself from the counts (no exchange between warps,
// the caller's one barrier publishes the list): two ballot passes over 32-expert slices, no sort (a unit's cost at
// decode takes few values). Class of an expert: 0 without tokens, else min(ceil(count / 8), 4). Round 0 covers
// the experts e < e0 = min(E, G / per_e) (CTA b takes natural unit b, per_e units per expert); the CTAs are ranked
// by their round-0 class (none = 0), ties by index; the rest list holds the experts >= e0 with tokens by decreasing
// class, ties by index, and warp w writes its slices w, w + W, ... of it. Writes the header {e0, rank, rest units}.
template <class V>
__device__ __forceinline__ void deal_by_tiles(const Params& p, int per_e, uint32_t deal) {
  constexpr int kClasses = 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slices = (p.E + 31) >> 5;
  const int b = blockIdx.x, G = gridDim.x;
  const int e0 = min(p.E, G / per_e);
  const int eb = b < e0 * per_e ? b / per_e : e0;  // the CTA's round-0 expert (e0: none)
  const auto class_of = [&](int e) { return e < p.E ? min((__ldg(p.counts + e) + 7) >> 3, kClasses) : -1; };
  int rest[kClasses + 1] = {}, r0[kClasses + 1] = {}, before[kClasses + 1] = {};
  int cls_b = 0;
  for (int sl = 0; sl < slices; ++sl) {
    const int e = sl * 32 + lane, c = class_of(e);
#pragma unroll
    for (int k = 0; k <= kClasses; ++k) {
      rest[k] += __popc(__ballot_sync(~0u, c == k && e >= e0));
      r0[k] += __popc(__ballot_sync(~0u, c == k && e < e0));
      before[k] += __popc(__ballot_sync(~0u, c == k && e < eb));
    }
    const int cb = __shfl_sync(~0u, c, eb & 31);
    if ((eb >> 5) == sl && eb < e0) cls_b = cb;
  }
  // the rank: the CTAs of lighter round-0 classes, then those of the same class before b
  const int idle = G - e0 * per_e;  // CTAs round 0 leaves without a unit (class 0, after the empty experts' ones)
  int rank = 0;
#pragma unroll
  for (int k = 0; k < kClasses; ++k) rank += k < cls_b ? per_e * r0[k] + (k == 0 ? idle : 0) : 0;
  if (b < e0 * per_e) {
#pragma unroll
    for (int k = 0; k <= kClasses; ++k) rank += k == cls_b ? per_e * before[k] : 0;
    rank += b - eb * per_e;
  } else {
    rank += per_e * r0[0] + (b - e0 * per_e);
  }
  int n_rest = 0;
#pragma unroll
  for (int k = 1; k <= kClasses; ++k) n_rest += rest[k];
  if (threadIdx.x == 0) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(deal), "r"(e0), "r"(rank) : "memory");
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(deal + 8), "r"(n_rest * per_e) : "memory");
  }
  // the list: class k starts after the classes above it; within a class, the slices before, then the lanes before
  int run[kClasses + 1] = {};
  const unsigned lanes_before = (1u << lane) - 1;
  for (int sl = 0; sl < slices; ++sl) {
    const int e = sl * 32 + lane, c = class_of(e);
    const bool listed = c > 0 && e >= e0;
    int pos = 0;
#pragma unroll
    for (int k = 1; k <= kClasses; ++k) {
      const unsigned m = __ballot_sync(~0u, listed && c == k);
      int above = 0;
#pragma unroll
      for (int j = k + 1; j <= kClasses; ++j) above += rest[j];
      if (c == k) pos = above + run[k] + __popc(m & lanes_before);
      run[k] += __popc(m);
    }
    if (listed && sl % V::W == warp)
      asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(deal + 16 + 2 * pos), "h"(static_cast<uint16_t>(e)) : "memory");
  }
}

// The warp's S ring mbarriers at `bars` (one arrival each: the producer lane's expect_tx), visible to the bulk copies.
template <int S>
__device__ __forceinline__ void init_ring(uint32_t bars, int lane) {
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar_init(bars + 8 * s);
    mbar_init_fence();
  }
  __syncwarp();
}

// Before waiting for the previous grid: the weight records of the first ring steps of the CTA's first unit
// (unit blockIdx.x, were its expert to have tokens: the counts may be the previous grid's output) towards L2,
// one prefetch per row tile from the warp's lane 0, so the ring's first copies do not wait for DRAM.
template <class V>
__device__ __forceinline__ void prefetch_first_unit(const Params& p, int row_groups, int kr_per, int warp, int lane) {
  constexpr int R = V::R, W = V::W;
  const int per_e = row_groups * p.split;
  if (lane != 0 || blockIdx.x >= p.E * per_e) return;
  const auto [e, rg, z] = unit_coords(blockIdx.x, per_e, p.split);
  const int k0 = z * kr_per, nk = min(min(p.KR, k0 + kr_per) - k0, (V::S - 1) * V::RK);
  if (nk <= 0) return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int rt = min(rg * V::P * (W * R) + r * W + warp, p.MT - 1);
    prefetch_l2(p.records + ((static_cast<long long>(e) * p.MT + rt) * p.KR + k0) * kRecBytes, nk * kRecBytes);
  }
}

// The producer's step: copy the next RK records of each of the warp's R row tiles into ring slot `slot` (one bulk
// copy per row tile counted on the slot's mbarrier at `bars`; nothing once the cursor is past the last unit) and
// advance the cursor and the slot. The row tiles' record index is found at the unit's (row group's, token block's)
// first step and moved on by the step; one elected lane issues the copies, so ptxas emits each as one uniform
// instruction (under `lane == 0` it looped over the lanes' possibly different operands, and the address was worked
// out per step; this form took 0.1-4.3 % less time on every row measured, 2026-12-04).
template <class V>
__device__ __forceinline__ void issue_step(const Params& p, uint8_t* ring, uint32_t bars, int& slot, Cursor& prod,
                                           int warp, int row_groups, int kr_per, int n_units, uint32_t order = 0,
                                           bool early = false) {
  constexpr int R = V::R, W = V::W, RK = V::RK;
  if (prod.valid) {
    uint8_t* dst = ring + slot * (R * RK * kRecBytes);
    const int chunks = min(RK, prod.nkr - prod.kr) * kRecChunks;  // the step's records are contiguous
    if (prod.kr == 0) {
      const int rt0 = prod.row_group<V::P>() * (W * R) + warp, rc0 = min(rt0, p.MT - 1);
      // the record index in 32 bits (the launcher checks E * MT * KR < 2^31)
      prod.rec = static_cast<uint32_t>((prod.e * p.MT + rc0) * p.KR + prod.kr0);
      prod.rec_step = R > 1 ? (min(rt0 + W, p.MT - 1) - rc0) * p.KR * kRecBytes : 0;  // idle row tiles store nothing
    }
    if (elect_one()) {
      const uint32_t bar = bars + 8 * slot;
      mbar_expect_tx(bar, R * 16 * chunks);
      const uint8_t* src = p.records + static_cast<unsigned long long>(prod.rec + prod.kr) * kRecBytes;
#pragma unroll
      for (int r = 0; r < R; ++r) bulk_copy(smem_u32(dst + r * RK * kRecBytes), src + r * prod.rec_step, 16 * chunks, bar);
    }
    if (early)  // Params::early's copies: within the unit's first token block (its count is not known yet)
      prod.kr += RK;
    else
      prod.next<V::NB, RK, V::DEAL, V::P, W * R>(p, row_groups, kr_per, n_units, order);
  }
  slot = slot == V::S - 1 ? 0 : slot + 1;
}

template <class V, bool OUT_BF16, bool ATOMIC, bool QUANT>
__global__ void __launch_bounds__(V::kThreads, V::kMinBlocks) p48_mma_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int NB = V::NB, R = V::R, W = V::W, S = V::S, KC = V::KC, RK = V::RK, NT = NB / 8;
  constexpr int kRecPerChunk = KC / kRecK, P = V::P;
  const int row_groups = (p.MT + W * R * P - 1) / (W * R * P);  // units per expert and K slice
  const int kr_per = (p.KR + p.split - 1) / p.split;
  const int n_units = p.E * row_groups * p.split;

  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);
  const int warp = uniform_warp_index(), lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  uint8_t* ring = smem + V::kXBytes + warp * (S * R * RK * kRecBytes);
  const uint32_t bars = smem_u32(smem + V::kXBytes + V::kRingBytes) + warp * (S * 8);  // the warp's mbarriers

  Cursor prod{}, cons{};
  [[maybe_unused]] const uint32_t order = smem_u32(smem + V::kOrderOff);  // DEAL 1: the deal (deal_by_tiles)
  int slot_p = 0, slot_c = 0;
  uint32_t phase = 0;  // parity of the consumer's current pass over the ring
  auto issue = [&]() { issue_step<V>(p, ring, bars, slot_p, prod, warp, row_groups, kr_per, n_units, order); };
  if (p.early) {  // see Params::early
    const int per_e = row_groups * p.split;
    // the natural first unit b (DEAL 1: where round 0 covers it) as (e, rg, z), and the mixed-radix stride
    const int b = blockIdx.x, nat_units = V::DEAL == 1 ? min(p.E, static_cast<int>(gridDim.x) / per_e) * per_e : n_units;
    Cursor nat{};
    const UnitCoords first = unit_coords(b, per_e, p.split);
    nat.e = first.e, nat.rg = first.rg, nat.z = first.z, nat.sub = 0, nat.kr = 0, nat.tb = 0;
    nat.kr0 = nat.z * kr_per;
    nat.nkr = b < nat_units ? min(p.KR, nat.kr0 + kr_per) - nat.kr0 : 0;
    if constexpr (V::DEAL == 0) prod.init_stride(p, row_groups);
    init_ring<S>(bars, lane);
    // the unit's first token block's first steps, up to S - 1, into slots 0, 1, ...
    const int n_early = max(0, min(S - 1, (nat.nkr + RK - 1) / RK));
    nat.valid = n_early > 0;
#pragma unroll
    for (int s = 0; s < S - 1; ++s)
      if (s < n_early) issue_step<V>(p, ring, bars, slot_p, nat, warp, row_groups, kr_per, 0, 0, true);
    wait_previous_grid();
    allow_next_grid();
    bool hit = false;
    if (n_early > 0) {
      const int c = __ldg(p.counts + nat.e), r0 = __ldg(p.row_start + nat.e);  // one round trip
      if (c > 0) {
        prod.u = V::DEAL == 1 ? 0 : b, prod.e = nat.e, prod.rg = nat.rg, prod.z = nat.z, prod.sub = 0;
        prod.start<NB>(c, nat.kr0, nat.nkr);
        prod.row0 = r0, prod.rec = nat.rec, prod.rec_step = nat.rec_step;
        hit = true;
      }
    }
    if constexpr (V::DEAL == 1) {  // (hit is uniform over the CTA: one expert's count)
      deal_by_tiles<V>(p, per_e, order);
      __syncthreads();  // the deal's list and header are complete
    }
    if (!hit) {
      if constexpr (V::DEAL == 1) {
        prod.take_dealt<NB>(p, n_early > 0 ? 1 : 0, row_groups, kr_per, order);
      } else {
        prod.seek<NB>(p, n_early > 0 ? b + static_cast<int>(gridDim.x) : b, row_groups, kr_per, n_units);
      }
      // the copies of a unit not taken: wait for them (the CTA may not leave with copies in flight), skip their slots
      for (int s = 0; s < n_early; ++s) mbar_wait(bars + 8 * s, 0);
      slot_c = slot_p;
      if (!prod.valid) return;
    }
    cons = prod;
    if (hit) {  // the producer stands past the copied steps
#pragma unroll
      for (int s = 0; s < S - 1; ++s)
        if (s < n_early) prod.next<NB, RK, V::DEAL, P, W * R>(p, row_groups, kr_per, n_units, order);
    }
#pragma unroll
    for (int s = 0; s < S - 1; ++s)
      if (hit ? s >= n_early : true) issue();
  } else {
    // (DEAL 1: round 0 deals the natural units, so these are the right records wherever round 0 gives the CTA one)
    prefetch_first_unit<V>(p, row_groups, kr_per, warp, lane);
    wait_previous_grid();
    allow_next_grid();
    if constexpr (V::DEAL == 1) {
      deal_by_tiles<V>(p, row_groups * p.split, order);
      __syncthreads();  // the deal's list and header are complete
      prod.take_dealt<NB>(p, 0, row_groups, kr_per, order);
      if (!prod.valid) return;
    } else {
      prod.seek<NB>(p, blockIdx.x, row_groups, kr_per, n_units);
      if (!prod.valid) return;
      prod.init_stride(p, row_groups);
    }
    cons = prod;
    init_ring<S>(bars, lane);
#pragma unroll
    for (int s = 0; s < S - 1; ++s) issue();
  }

  float acc[R][NT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.f;

  // ldmatrix row address of this lane: token (lane & 7) of an 8-token tile, 8 columns at (lane >> 3) * 8.
  const uint32_t xs_lane_addr = smem_u32(xs + (lane & 7) * V::XS + (lane >> 3) * 8);

  while (cons.valid) {
    const int kr = cons.kr, tb = cons.tb;
    const int ntok = min(NB, cons.cnt - tb * NB);
    // P > 1: a unit's later row groups re-use the chunk when it holds the whole K slice and token block
    if (kr % kRecPerChunk == 0 && (P == 1 || cons.sub == 0 || cons.ntb > 1 || cons.nkr > kRecPerChunk)) {
      const XChunk ch = chunk_of<V, QUANT>(p, cons);
      LeanStage<V> st;
      st.load(p, ch);   // in flight while the other warps finish the previous chunk
      __syncthreads();  // every warp is done with the previous chunk
      st.template store<QUANT>(xs, ch);
      __syncthreads();
    }
    mbar_wait(bars + 8 * slot_c, phase);
    phase ^= slot_c == S - 1;
    __syncwarp();  // every lane is done with the slot the producer refills now
    issue();
    const uint8_t* step_rec = ring + slot_c * (R * RK * kRecBytes);
    slot_c = slot_c == S - 1 ? 0 : slot_c + 1;
    const int nrec = min(RK, cons.nkr - kr);
    const int ntiles = (ntok + 7) >> 3;
    // the step's records against NTA 8-token tiles (a warp-uniform branch drops the second tile's MMAs at up to 8
    // tokens instead of predicating them off; they would still be issued)
    auto records = [&](auto nta) {
      constexpr int NTA = decltype(nta)::value;
#pragma unroll
      for (int j = 0; j < RK; ++j) {
        if (RK > 1 && j >= nrec) break;
        const uint8_t* rec = step_rec + j * kRecBytes;
        uint4 codes[R];
        RecScales rs[R];
        uint32_t emr[R][2];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          uint32_t meta;
          uint2 sc;
          load_lane_share(rec + r * RK * kRecBytes, lane, codes[r], meta, sc);
          rs[r] = record_scales(sc);
          emr[r][0] = expand_meta_imad(prmt(meta, 0, 0x4140));
          emr[r][1] = expand_meta_imad(prmt(meta, 0, 0x4342));
        }
        const uint32_t xk_addr = xs_lane_addr + (kr % kRecPerChunk + j) * (2 * kRecK);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t a[R][4], em[R];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            decode_step_hoisted(codes[r], rs[r], s, a[r]);
            em[r] = emr[r][s >> 1];
          }
#pragma unroll
          for (int n = 0; n < NTA; ++n) {
            if (n < ntiles) {
              uint32_t b[4];
              ldmatrix_x4(b, xk_addr + 2 * (n * 8 * V::XS + s * 32));
#pragma unroll
              for (int r = 0; r < R; ++r) {
                if (s & 1)
                  mma_sp<1>(acc[r][n], a[r], b, em[r]);
                else
                  mma_sp<0>(acc[r][n], a[r], b, em[r]);
              }
            }
          }
        }
      }
    };
    if constexpr (NT > 1) {
      if (ntiles == 1)
        records(std::integral_constant<int, 1>{});
      else
        records(std::integral_constant<int, NT>{});
    } else {
      records(std::integral_constant<int, NT>{});
    }
    if (kr + RK >= cons.nkr) {  // end of a token block: write its outputs (one base pointer)
      const float alpha = __ldg(p.alpha + cons.e) * kAlphaFold;
      using T = std::conditional_t<OUT_BF16 && !ATOMIC, __nv_bfloat16, float>;
      // the lane's outputs: tokens n * 8 + 2 t4 (+ 1) x rows 16 rt + g (+ 8)
      T* const base = reinterpret_cast<T*>(p.out) + (cons.row0 + tb * NB + 2 * t4) * p.out_stride + g;
      const long long s8 = 8 * p.out_stride;
      const int tok = ntok - 2 * t4;  // the lane's tokens are 0 (+1) below this, per tile
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int rt = cons.row_group<P>() * (W * R) + r * W + warp;
        const int mr = p.M - (rt * 16 + g);  // rows 0 and 8 of the lane exist below this
        T* o = base + rt * 16;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          if (n >= ntiles) break;  // warp-uniform
          const int tn = tok - 8 * n;  // (rows past M include the idle row tiles past MT)
          if (tn > 0 && mr > 0) store_to<ATOMIC>(o, acc[r][n][0] * alpha);
          if (tn > 1 && mr > 0) store_to<ATOMIC>(o + p.out_stride, acc[r][n][1] * alpha);
          if (tn > 0 && mr > 8) store_to<ATOMIC>(o + 8, acc[r][n][2] * alpha);
          if (tn > 1 && mr > 8) store_to<ATOMIC>(o + p.out_stride + 8, acc[r][n][3] * alpha);
          o += s8;
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.f;
      }
    }
    cons.next<NB, RK, V::DEAL, P, W * R>(p, row_groups, kr_per, n_units, order);
  }
  cp_async_wait<0>();
}

// The thread's units of chunk `ch` into the raw buffer at `buf` (unit j of thread i at 16 (j kThreads + i)), one
// cp.async group; units past the tokens are not copied; columns past K are copied as zeros (src-size 0: nothing is
// read, the row start stands in as the address). SWIZZLED (activations that arrive K-permuted): straight to the
// units' places in a swizzled buffer (`buf` = the thread's first place there, WgMap::dst), which is all the staging
// such a chunk needs.
template <class V, bool SWIZZLED = false>
__device__ __forceinline__ void prefetch_chunk(const Params& p, const XChunk& ch, const WgMap<V>& map, uint32_t buf) {
  const int nu = map.units(ch);
  const bool col_ok = ch.k0 + 8 * map.c < p.K;
  const uint16_t* src = col_ok ? map.src(p, ch) : p.x + (ch.row0 + map.t0) * p.x_stride;
  const uint32_t n = col_ok ? 16u : 0u;
  const long long step = static_cast<long long>(WgMap<V>::TS) * p.x_stride;
#pragma unroll
  for (int j = 0; j < WgMap<V>::N; ++j) {
    if (j >= nu) break;
    const uint32_t dst = SWIZZLED ? buf + j * WgMap<V>::kDstStep : buf + 16 * j * V::kThreads;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
    src += step;
  }
  cp_async_commit();
}

// Calls f(std::integral_constant<int, N>) with N = ntok rounded up to a multiple of TW, at most NB (TW = 0: NB).
template <int TW, int NB, int N = TW, class F>
__device__ __forceinline__ void with_token_width(int ntok, F&& f) {
  if constexpr (TW == 0 || N >= NB)
    f(std::integral_constant<int, NB>{});
  else if (ntok <= N)
    f(std::integral_constant<int, N>{});
  else
    with_token_width<TW, NB, N + TW>(ntok, f);
}

// The warpgroup kernel (WgVariant): the same units, cursors and weight ring as p48_mma_kernel with one row tile per
// warp; per MMA step each warp decodes its 16 rows into A registers (double-buffered: one wgmma stays in flight
// while the next step is decoded) and the warpgroup issues one wgmma.sp over all NB staged tokens.
template <class V, bool OUT_BF16, bool ATOMIC, bool QUANT>
__global__ void __launch_bounds__(V::kThreads, V::kMinBlocks) p48_wgmma_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int NB = V::NB, W = V::W, S = V::S, KC = V::KC, RK = V::RK, ND = NB / 2;
  constexpr int kRecPerChunk = KC / kRecK;
  const int row_groups = (p.MT + W - 1) / W;
  const int kr_per = (p.KR + p.split - 1) / p.split;
  // ORDER: the units of the experts with tokens only (set below, once they are counted)
  int n_units = p.E * row_groups * p.split;

  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t pad = (1024u - (smem_addr & 1023u)) & 1023u;
  const uint32_t xs_addr = smem_addr + pad;
  const uint32_t raw_addr = xs_addr + V::kXBuf * 2;  // the raw buffer after the swizzled one
  const int warp = uniform_warp_index(), lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  uint8_t* ring = smem + V::kXBytes + warp * (S * RK * kRecBytes);
  const uint32_t bars = smem_u32(smem + V::kXBytes + V::kRingBytes) + warp * (S * 8);  // the warp's mbarriers

  if constexpr (!V::ORDER) prefetch_first_unit<V>(p, row_groups, kr_per, warp, lane);
  wait_previous_grid();
  allow_next_grid();
  [[maybe_unused]] const uint32_t order = smem_addr + V::kOrderOff;  // ORDER: the experts in unit order
  if constexpr (V::ORDER) {
    n_units = sort_experts<V>(p, reinterpret_cast<int*>(smem + pad), order) * row_groups * p.split;
  }

  Cursor prod{}, cons{};
  if constexpr (V::ORDER)
    prod.take_ordered<NB>(p, 0, row_groups, kr_per, n_units, order);
  else
    prod.seek<NB>(p, blockIdx.x, row_groups, kr_per, n_units);
  if (!prod.valid) return;
  if constexpr (!V::ORDER) prod.init_stride(p, row_groups);
  cons = prod;
  int xbuf = 0;
  int slot_p = 0, slot_c = 0;
  uint32_t phase = 0;  // parity of the consumer's current pass over the ring
  init_ring<S>(bars, lane);
#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    issue_step<V>(p, ring, bars, slot_p, prod, warp, row_groups, kr_per, n_units, order);
  const WgMap<V> map;
  // this thread's units in the swizzled and the raw buffer
  const uint32_t x_dst = map.dst(xs_addr), x_raw = raw_addr + 16 * threadIdx.x;
  // K-permuted activations (W4A16): the chunks go straight to two swizzled buffers in turn (the raw buffer is the
  // second), `xnext` the one the next chunk lands in; no permutation pass and one barrier per chunk
  const bool direct = !QUANT && p.x_perm;
  int xnext = 0;
  if (direct)
    prefetch_chunk<V, true>(p, chunk_of<V, QUANT>(p, cons), map, x_dst);
  else
    prefetch_chunk<V>(p, chunk_of<V, QUANT>(p, cons), map, x_raw);

  float acc[ND];
#pragma unroll
  for (int i = 0; i < ND; ++i) acc[i] = 0.f;

  while (cons.valid) {
    const int kr = cons.kr, tb = cons.tb;
    const int cnt = cons.cnt;
    const long long row0 = cons.row0;
    const int ntok = min(NB, cnt - tb * NB);
    if (kr % kRecPerChunk == 0) {
      Cursor nx = cons;  // the next chunk (its count loads fly while this one is permuted)
      nx.next<NB, kRecPerChunk, V::DEAL>(p, row_groups, kr_per, n_units, order);
      if (direct) {
        cp_async_wait<0>();  // this thread's copies of the chunk have landed in buffer xnext
        fence_async_smem();
        wgmma_wait<0>();  // (the other buffer, which the next chunk overwrites, was this warpgroup's last chunk)
        acc_fence(acc);
        __syncthreads();
        xbuf = xnext;
        xnext ^= 1;
        if (nx.valid)
          prefetch_chunk<V, true>(p, chunk_of<V, QUANT>(p, nx), map, x_dst + xnext * (V::kXBuf * 2));
      } else {
        const XChunk ch = chunk_of<V, QUANT>(p, cons);  // the chunk the raw buffer holds
        const int nu = map.units(ch);
        cp_async_wait<0>();  // this thread's copies of the chunk have landed (it reads only its own units)
        wgmma_wait<0>();
        acc_fence(acc);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < WgMap<V>::N; ++j) {
          if (j >= nu) break;  // warp-uniform
          uint4 v = lds128(x_raw + 16 * j * V::kThreads);
          if constexpr (QUANT) v = nvfp4_block_values(v, ch.g);
          sts128(x_dst + j * WgMap<V>::kDstStep, staged_order(ch, v));
        }
        fence_async_smem();
        if (nx.valid) prefetch_chunk<V>(p, chunk_of<V, QUANT>(p, nx), map, x_raw);
        __syncthreads();
      }
    }
    mbar_wait(bars + 8 * slot_c, phase);
    phase ^= slot_c == S - 1;
    __syncwarp();
    issue_step<V>(p, ring, bars, slot_p, prod, warp, row_groups, kr_per, n_units, order);
    const uint8_t* step_rec = ring + slot_c * (RK * kRecBytes);
    slot_c = slot_c == S - 1 ? 0 : slot_c + 1;
    const int nrec = min(RK, cons.nkr - kr);
    // the step's records, one wgmma per 32 columns over NWC tokens (the first NWC / 2 accumulators)
    auto records = [&](auto nwc) {
    constexpr int NWD = decltype(nwc)::value / 2;
    float(&accw)[NWD] = reinterpret_cast<float(&)[NWD]>(acc);
#pragma unroll
    for (int j = 0; j < RK; ++j) {
      if (RK > 1 && j >= nrec) break;
      uint4 codes;
      uint32_t meta;
      uint2 sc;
      load_lane_share(step_rec + j * kRecBytes, lane, codes, meta, sc);
      // scales and metadata once per record (as the decode variant)
      const RecScales rs = record_scales(sc);
      const uint32_t emr[2] = {expand_meta_imad(prmt(meta, 0, 0x4140)), expand_meta_imad(prmt(meta, 0, 0x4342))};
      const int col0 = (kr % kRecPerChunk + j) * kRecK;  // the record's first column in the staged chunk
      uint32_t a[2][4], em[2];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        decode_step_hoisted(codes, rs, s, a[s & 1]);
        em[s & 1] = emr[s >> 1];
        const int col = col0 + 32 * s;
        const uint32_t b_addr = xs_addr + xbuf * (V::kXBuf * 2) + (col >> 6) * (NB * 128) + (col & 32) * 2;
        wgmma_fence();
        acc_fence(acc);
        if (s & 1)
          wgmma_sp<1>(accw, a[1], kDescSw128 | ((b_addr >> 4) & 0x3FFFu), em[1]);
        else
          wgmma_sp<0>(accw, a[0], kDescSw128 | ((b_addr >> 4) & 0x3FFFu), em[0]);
        wgmma_commit();
        wgmma_wait<1>();  // the wgmma of step s - 1 is done: its A registers may be decoded into again
        acc_fence(acc);
      }
    }
    };
    with_token_width<V::TW, NB>(ntok, records);
    if (kr + RK >= cons.nkr) {  // end of a token block: write its outputs
      wgmma_wait<0>();
      acc_fence(acc);
      const float alpha = __ldg(p.alpha + cons.e) * kAlphaFold;
      const int rt = cons.rg * W + warp;
      // one base pointer (tokens 2 t4 (+1), rows g (+8)), constant offsets
      using T = std::conditional_t<OUT_BF16 && !ATOMIC, __nv_bfloat16, float>;
      T* o = reinterpret_cast<T*>(p.out) + (row0 + tb * NB + 2 * t4) * p.out_stride + rt * 16 + g;
      const long long s8 = 8 * p.out_stride;
      const int tok = ntok - 2 * t4, mr = p.M - (rt * 16 + g);  // (rows past M include idle row tiles past MT)
      const int ntiles = (ntok + 7) >> 3;
#pragma unroll
      for (int n = 0; n < NB / 8; ++n) {
        if (n >= ntiles) break;  // warp-uniform
        const int tn = tok - 8 * n;
        if (tn > 0 && mr > 0) store_to<ATOMIC>(o, acc[4 * n] * alpha);
        if (tn > 1 && mr > 0) store_to<ATOMIC>(o + p.out_stride, acc[4 * n + 1] * alpha);
        if (tn > 0 && mr > 8) store_to<ATOMIC>(o + 8, acc[4 * n + 2] * alpha);
        if (tn > 1 && mr > 8) store_to<ATOMIC>(o + p.out_stride + 8, acc[4 * n + 3] * alpha);
        o += s8;
      }
#pragma unroll
      for (int i = 0; i < ND; ++i) acc[i] = 0.f;
    }
    cons.next<NB, RK, V::DEAL>(p, row_groups, kr_per, n_units, order);
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
}

// The compiled variants: MOESQ_P48_VARIANTS(X), one X(index, Variant<...> or WgVariant<...>) per variant (index =
// the `variant` argument), generated by the native build from the variant table (P48_VARIANTS in
// moesq_core/serving/kernels/p48_variants.py, which says what each variant is for) into its generated-source
// folder, with a static_assert per variant that the template's constants are the table row's fields.
#include "p48_variants.inc"
#define MOESQ_P48_COUNT(n, ...) +1
constexpr int kNumVariants = 0 MOESQ_P48_VARIANTS(MOESQ_P48_COUNT);

template <class V, bool QUANT>
auto pick_kernel(const moesq_p48_args& a) {
  if constexpr (V::SWZ)
    return a.split > 1 ? p48_wgmma_kernel<V, false, true, QUANT>
           : a.out_bf16 ? p48_wgmma_kernel<V, true, false, QUANT>
                        : p48_wgmma_kernel<V, false, false, QUANT>;
  else
    return a.split > 1 ? p48_mma_kernel<V, false, true, QUANT>
           : a.out_bf16 ? p48_mma_kernel<V, true, false, QUANT>
                        : p48_mma_kernel<V, false, false, QUANT>;
}

template <class V>
int launch(const moesq_p48_args& a) {
  const int smem_bytes = V::kSmem + V::kOrderBytesPerExpert * a.E;
  if (V::ORDER && a.E > kMaxOrderE) {
    moesq::set_last_error("p48 kernel sorts at most %d experts (got E=%d)", kMaxOrderE, a.E);
    return 1;
  }
  Params p{static_cast<const uint8_t*>(a.records), a.E, static_cast<const uint16_t*>(a.x), a.row_start, a.counts,
           a.alpha, a.out, a.M, a.K, a.MT, a.KR, a.x_stride, a.out_stride, a.split, a.act_global, a.x_perm,
           a.early_first_unit};
  auto kernel = a.act_global != nullptr ? pick_kernel<V, true>(a) : pick_kernel<V, false>(a);
  const int row_groups = (a.MT + V::W * V::R - 1) / (V::W * V::R);
  const long long units = static_cast<long long>(a.E) * ((row_groups + V::P - 1) / V::P) * a.split;
  int sms = 0, per_sm = 0;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, a.device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, V::kThreads, smem_bytes);
  if (err == cudaSuccess) {
    // Persistent: one wave of CTAs walks all units (experts without tokens are skipped on the device).
    const int grid = static_cast<int>(units < 1LL * sms * per_sm ? units : 1LL * sms * per_sm);
    // programmatic stream serialization: the kernel waits for the previous grid itself (wait_previous_grid);
    // MOESQ_P48_PDL=0 launches it plainly (for measuring what the overlap gives)
    const char* pdl = std::getenv("MOESQ_P48_PDL");
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid > 0 ? grid : 1);
    cfg.blockDim = dim3(V::kThreads);
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = static_cast<cudaStream_t>(a.stream);
    cfg.attrs = attr;
    cfg.numAttrs = pdl != nullptr && pdl[0] == '0' ? 0 : 1;
    err = cudaLaunchKernelEx(&cfg, kernel, p);
  }
  if (err != cudaSuccess) {
    moesq::set_last_error("p48 kernel launch failed: %s", cudaGetErrorString(err));
    return 3;
  }
  return 0;
}

template <class V>
void info(moesq_p48_variant_info* i) {
  *i = moesq_p48_variant_info{V::NB, V::R, V::W, V::S, V::KC, V::kSmem, V::P};
}

}  // namespace

extern "C" {

int moesq_p48_num_variants(void) { return kNumVariants; }

int moesq_p48_get_variant_info(int variant, moesq_p48_variant_info* i) {
  if (i == nullptr || variant < 0 || variant >= kNumVariants) {
    moesq::set_last_error("p48 variant %d out of range [0, %d)", variant, kNumVariants);
    return 1;
  }
  switch (variant) {
#define MOESQ_P48_INFO(n, ...) \
  case n:                      \
    info<__VA_ARGS__>(i);      \
    break;
    MOESQ_P48_VARIANTS(MOESQ_P48_INFO)
#undef MOESQ_P48_INFO
  }
  return 0;
}

int moesq_p48_gemm(int variant, const moesq_p48_args* args) {
  if (args == nullptr || variant < 0 || variant >= kNumVariants) {
    moesq::set_last_error("p48 variant %d out of range [0, %d) or null args", variant, kNumVariants);
    return 1;
  }
  const moesq_p48_args& a = *args;
  if (a.E <= 0 || a.M <= 0 || a.K <= 0 || a.K % 32 || a.MT != (a.M + 15) / 16 || a.KR != (a.K + kRecK - 1) / kRecK ||
      a.split < 1 || a.split > a.KR || (a.split > 1 && a.out_bf16) || 1LL * a.E * a.MT * a.KR >= (1LL << 31)) {
    moesq::set_last_error("p48 kernel: bad problem E=%d M=%d K=%d MT=%d KR=%d split=%d out_bf16=%d", a.E, a.M, a.K,
                          a.MT, a.KR, a.split, a.out_bf16);
    return 1;
  }
  if (cudaSetDevice(a.device) != cudaSuccess) {
    moesq::set_last_error("cudaSetDevice(%d) failed", a.device);
    return 2;
  }
  switch (variant) {
#define MOESQ_P48_LAUNCH(n, ...) \
  case n:                        \
    return launch<__VA_ARGS__>(a);
    MOESQ_P48_VARIANTS(MOESQ_P48_LAUNCH)
#undef MOESQ_P48_LAUNCH
  }
  return 1;
}

}  // extern "C"
