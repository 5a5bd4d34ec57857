"""Hopper (sm_90) grouped GEMM that streams paired 4:8 NVFP4 (p48-nvfp4) weights: Triton kernels + launchers.

Weights stay packed at 2.75 bits/weight in GPU memory. The load-time re-layout (`P48GemmWeights`) keeps
exactly the release's bytes except for a bijective bit permutation inside each kept byte:

    release byte  b = hi_code << 4 | lo_code          (code = sign << 3 | magnitude)
    kernel  byte  b' = lo_code | hi_sign << 4 | hi_magnitude << 5

and views `weight_sparse_packed` as int32 words (4 kept bytes = the two 8-column groups of 16 dense columns,
whose two mask nibbles are one `weight_sparse_mask` byte). Same bytes per weight: 2 (values) + 0.5 (mask)
+ 0.25 (scale) = 2.75 bits, plus one fp32 global scale per matrix.

Kernel (`_p48_gemm_kernel`), one program per (expert, BM output rows, K split), looping over the expert's
tokens in tiles of BN (the count is read on the device: capacity-batched [E, C, K] or expert-sorted rows
with per-expert start rows, CUDA-graph safe, no host sync):
  * per 16 dense columns: load the int32 word, the mask byte and (per 32 columns) the e4m3 scale;
  * mask nibble -> byte-permute selectors through a 32-entry table (L1-resident);
  * expand in registers to 16 bf16 values c*s_hat*2^-7: two `prmt` per 8-column group pick the kept bytes
    into pair slots (zero bytes for pruned pairs), then per two outputs `shl, shl, lop3` place the E2M1 bits
    in bf16 fields (e2m1 * 2^-126, the 0.5 code a bf16 subnormal) and one `fma.rn.bf16x2` multiplies by
    s_hat*2^119 (bf16 FMA has no flush-to-zero: subnormals are exact) -- about 2.4 logic ops per weight;
  * dense bf16 tensor-core MMA (tl.dot, fp32 accumulation) against the activation tile, whose K order is
    permuted to the order the expansion produces (PERM below) so no register shuffles are needed;
  * epilogue: acc * alpha (alpha = 2^7/(g_w*g_a) or 2^7/g_w, per expert), plain store, or fp32 atomic add
    when the K dimension is split (SPLIT > 1) so that decode with few tokens per expert fills the GPU.

Activations: W4A16 reads bf16 as given; W4A4 quantizes them to NVFP4 (32-column blocks, static per-expert
input global scale) in a pre-pass that writes the exact unscaled values e2m1*s_a as bf16 (the quantization
is bit-identical to the CPU reference, moesq_core.serving.kernels.p48_reference); the runtime fuses that pre-pass
into the routing scatter and into the SwiGLU kernel. The GEMM numerics are those of p48_reference.

This kernel is the fallback: the per-K-step chain of loads, table gathers, expansion, layout conversion and MMA is
latency bound in this Triton formulation, so the sparse-tensor-core kernel (moesq_core.serving.kernels.p48_mma, paired
4:8 as 2:4 after a K permutation) replaces it on sm_90 where the native module builds (both measured in
benchmarks/results/p48_kernel_bench_h200_2026-12-01_8b05f4d.md).

Without a GPU, kernels run under the Triton interpreter (TRITON_INTERPRET=1); the byte expansion then uses
a plain-Triton version of the same selection (the inline PTX does not run there), which is also what
`use_asm=False` selects on the GPU.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from moesq_core.serving.kernels.p48_reference import WEIGHT_SUFFIXES
from moesq_core.triton_support import HAS_TRITON, INTERPRET, tl, triton  # noqa: F401

SCALE_BLOCK = 32
# K order inside each 16-column slice that the expansion emits (output j holds dense column PERM[j]).
PERM = (0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)
ALPHA_FOLD = 128.0


# ------------------------------------------------------------------------------------------ load-time re-layout


def relayout_kept_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Release kept bytes (hi code << 4 | lo code) -> kernel bytes (lo | hi sign << 4 | hi magnitude << 5)."""
    b = packed.to(torch.int32)
    out = (b & 0x0F) | (((b >> 7) & 1) << 4) | (((b >> 4) & 7) << 5)
    return out.to(torch.uint8)


def undo_relayout_kept_bytes(b2: torch.Tensor) -> torch.Tensor:
    """Inverse of relayout_kept_bytes."""
    b = b2.to(torch.int32)
    out = (b & 0x0F) | (((b >> 4) & 1) << 7) | (((b >> 5) & 7) << 4)
    return out.to(torch.uint8)


def selector_table() -> torch.Tensor:
    """int32 [32]: per mask nibble (16 for the low group of a word, then 16 for the high group) two prmt
    selectors, low half for the even pair slots (0, 2) and high half for the odd ones (1, 3).

    Each selector byte lane picks a kept byte of the word (the group's first kept byte is word byte 0 or 2,
    its second 1 or 3) or byte 4 (a zero register) for a pruned slot; lanes 1 and 3 are always zero so
    the bit placement can shift without collisions. Nibbles that are not exactly 2 bits select zeros.
    """
    lut = torch.zeros(32, dtype=torch.int64)
    for grp in range(2):
        for m in range(16):
            slots = [4, 4, 4, 4]
            kept = [p for p in range(4) if m >> p & 1]
            if len(kept) == 2:
                for rank, p in enumerate(kept):
                    slots[p] = 2 * grp + rank
            even = slots[0] | 4 << 4 | slots[2] << 8 | 4 << 12
            odd = slots[1] | 4 << 4 | slots[3] << 8 | 4 << 12
            lut[16 * grp + m] = even | odd << 16
    return lut.to(torch.int32)


@dataclass
class P48GemmWeights:
    """A stack of E p48 weights [E, M, K] in kernel layout (2.75 bits/weight).

    words int32 [E, M, K/16] (re-laid-out kept bytes), mask uint8 [E, M, K/16], scale uint8 [E, M, K/32]
    (e4m3 bits), global_scale float32 [E].
    """

    words: torch.Tensor
    mask: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.words.shape[0]

    @property
    def out_features(self) -> int:
        return self.words.shape[1]

    @property
    def in_features(self) -> int:
        return self.words.shape[2] * 16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.mask, self.scale, self.global_scale))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.num_experts * self.out_features * self.in_features)

    def to(self, device) -> "P48GemmWeights":
        return P48GemmWeights(*(t.to(device) for t in (self.words, self.mask, self.scale, self.global_scale)))

    @classmethod
    def from_packed(cls, tensors: list[dict[str, torch.Tensor]] | dict[str, torch.Tensor], device=None,
                    name: str = "") -> "P48GemmWeights":
        """From per-expert release tensors ({suffix: tensor}, [M, K/4] etc.) or one stacked dict ([E, M, K/4]).

        Checks dtypes and shapes (the packer validates mask popcounts when it unpacks; here a bad nibble
        would only select zeros, so the layout is checked once more cheaply).
        """
        if isinstance(tensors, dict):
            st = {s: tensors[s] for s in WEIGHT_SUFFIXES if s in tensors}
        else:
            if not tensors:
                raise ValueError(f"{name or 'p48 weights'}: no experts given")
            st = {}
            for s in WEIGHT_SUFFIXES:
                if any(s not in t for t in tensors):
                    raise ValueError(f"{name or 'p48 weights'}: an expert lacks {s}")
                st[s] = torch.stack([t[s] for t in tensors])
        missing = [s for s in WEIGHT_SUFFIXES if s not in st]
        if missing:
            raise ValueError(f"{name or 'p48 weights'}: missing {missing}")
        packed, mask, scale, g = (st[s] for s in WEIGHT_SUFFIXES)
        if packed.dim() != 3:
            raise ValueError(f"{name}.weight_sparse_packed: expected [E, out, in/4], got {tuple(packed.shape)}")
        E, M, Q = packed.shape
        K = 4 * Q
        if K % 32:
            raise ValueError(f"{name}: input dimension {K} is not a multiple of 32 (p48 scale blocks)")
        for t, dt, shape, what in ((packed, torch.uint8, (E, M, K // 4), "weight_sparse_packed"),
                                   (mask, torch.uint8, (E, M, K // 16), "weight_sparse_mask"),
                                   (scale, torch.float8_e4m3fn, (E, M, K // 32), "weight_scale")):
            if t.dtype != dt or tuple(t.shape) != shape:
                raise ValueError(f"{name}.{what}: expected {dt} {shape}, got {t.dtype} {tuple(t.shape)}")
        if g.dtype != torch.float32 or g.numel() != E:
            raise ValueError(f"{name}.weight_global_scale: expected float32 with one value per expert, got {g.dtype} "
                             f"{tuple(g.shape)}")
        pop = lambda v: sum(((v >> i) & 1) for i in range(4))  # noqa: E731
        m32 = mask.to(torch.int32)
        if bool(((pop(m32 & 15) != 2) | (pop(m32 >> 4) != 2)).any()):
            raise ValueError(f"{name}.weight_sparse_mask: a mask nibble does not have exactly 2 bits set")
        words = relayout_kept_bytes(packed).contiguous().view(torch.int32)
        dev = device if device is not None else packed.device
        return cls(words.to(dev), mask.contiguous().to(dev), scale.contiguous().view(torch.uint8).to(dev),
                   g.reshape(E).float().to(dev))


def stack_gate_up(gate: P48GemmWeights, up: P48GemmWeights) -> P48GemmWeights:
    """Rows of gate then up per expert ([E, 2I, H]); they must share one weight global scale."""
    if not torch.equal(gate.global_scale, up.global_scale):
        bad = int((gate.global_scale != up.global_scale).nonzero()[0])
        raise ValueError(f"expert {bad}: gate and up have different weight_global_scale "
                         f"({float(gate.global_scale[bad])} vs {float(up.global_scale[bad])}); p48 serving "
                         "needs the shared global scale the moesq pipeline writes")
    return P48GemmWeights(torch.cat([gate.words, up.words], 1), torch.cat([gate.mask, up.mask], 1),
                          torch.cat([gate.scale, up.scale], 1), gate.global_scale.clone())


# ------------------------------------------------------------------------------------------ Triton kernels

_ASM_GROUP = """
        prmt.b32 pe, $16, pz, {lut};
        shr.b32 pt, {lut}, 16;
        prmt.b32 po, $16, pz, pt;
        shl.b32 pt, pe, 6;  shl.b32 px, pe, 12; lop3.b32 px, pt, px, pc, 0xA8;
        fma.rn.bf16x2 px, px, $19, pnz; mov.b32 {{${a0}, ${a1}}}, px;
        shl.b32 pt, pe, 1;  shl.b32 px, pe, 11; lop3.b32 px, pt, px, pc, 0xA8;
        fma.rn.bf16x2 px, px, $19, pnz; mov.b32 {{${a2}, ${a3}}}, px;
        shl.b32 pt, po, 6;  shl.b32 px, po, 12; lop3.b32 px, pt, px, pc, 0xA8;
        fma.rn.bf16x2 px, px, $19, pnz; mov.b32 {{${a4}, ${a5}}}, px;
        shl.b32 pt, po, 1;  shl.b32 px, po, 11; lop3.b32 px, pt, px, pc, 0xA8;
        fma.rn.bf16x2 px, px, $19, pnz; mov.b32 {{${a6}, ${a7}}}, px;
"""
# $0..$15: the 16 bf16 outputs (PERM order); $16 word, $17/$18 selector pairs of the low/high group, $19 the
# scale s_hat*2^119 as bf16x2. lop3 0xA8 = (a | b) & c with c = the bf16x2 sign+exponent-low+mantissa-high
# fields 0x81C081C0; the zero lanes 1 and 3 of e/o keep the two shifted copies from overlapping there.
EXPAND_ASM = (
    "{\n        .reg .b32 pz, pc, pnz, pt, pe, po, px;\n        mov.b32 pz, 0;\n        mov.b32 pc, 0x81C081C0;\n"
    "        mov.b32 pnz, 0x80008000;\n"
    + _ASM_GROUP.format(lut="$17", a0=0, a1=1, a2=2, a3=3, a4=4, a5=5, a6=6, a7=7)
    + _ASM_GROUP.format(lut="$18", a0=8, a1=9, a2=10, a3=11, a4=12, a5=13, a6=14, a7=15)
    + "}"
)

if HAS_TRITON:

    @triton.jit
    def _prmt0(a, sel):
        """prmt.b32 d, a, 0, sel for selector nibbles 0..3 (a byte of a) or 4 (zero), in plain Triton."""
        r = tl.zeros_like(a)
        for i in tl.static_range(4):
            n = (sel >> (4 * i)) & 7
            byte = (a >> ((n & 3) * 8)) & 0xFF
            r = r | (tl.where(n < 4, byte, 0) << (8 * i))
        return r

    @triton.jit
    def _e2m1_value(mag, sgn, scale):
        """E2M1 magnitude index + sign bit (uint32) -> float32 value * scale, without subnormals."""
        bits = tl.where(mag >= 2, (mag + 252) << 22, tl.where(mag == 1, 0x3F000000, 0).to(tl.uint32))
        bits = bits | (sgn << 31)
        return (bits.to(tl.float32, bitcast=True) * scale).to(tl.bfloat16)

    @triton.jit
    def _expand_plain(w, la, lb, sc):
        """Same 16 outputs as EXPAND_ASM, in plain Triton (interpreter / use_asm=False)."""
        e_a = _prmt0(w, la)
        o_a = _prmt0(w, la >> 16)
        e_b = _prmt0(w, lb)
        o_b = _prmt0(w, lb >> 16)
        r0 = _e2m1_value(e_a & 7, (e_a >> 3) & 1, sc)
        r1 = _e2m1_value((e_a >> 16) & 7, (e_a >> 19) & 1, sc)
        r2 = _e2m1_value((e_a >> 5) & 7, (e_a >> 4) & 1, sc)
        r3 = _e2m1_value((e_a >> 21) & 7, (e_a >> 20) & 1, sc)
        r4 = _e2m1_value(o_a & 7, (o_a >> 3) & 1, sc)
        r5 = _e2m1_value((o_a >> 16) & 7, (o_a >> 19) & 1, sc)
        r6 = _e2m1_value((o_a >> 5) & 7, (o_a >> 4) & 1, sc)
        r7 = _e2m1_value((o_a >> 21) & 7, (o_a >> 20) & 1, sc)
        r8 = _e2m1_value(e_b & 7, (e_b >> 3) & 1, sc)
        r9 = _e2m1_value((e_b >> 16) & 7, (e_b >> 19) & 1, sc)
        r10 = _e2m1_value((e_b >> 5) & 7, (e_b >> 4) & 1, sc)
        r11 = _e2m1_value((e_b >> 21) & 7, (e_b >> 20) & 1, sc)
        r12 = _e2m1_value(o_b & 7, (o_b >> 3) & 1, sc)
        r13 = _e2m1_value((o_b >> 16) & 7, (o_b >> 19) & 1, sc)
        r14 = _e2m1_value((o_b >> 5) & 7, (o_b >> 4) & 1, sc)
        r15 = _e2m1_value((o_b >> 21) & 7, (o_b >> 20) & 1, sc)
        return r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15

    @triton.jit
    def _join16(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, o12, o13, o14, o15):
        """16 tensors [..] -> [.., 2, 2, 2, 2] whose row-major flattening is o0, o1, ..., o15."""
        q0 = tl.join(o0, o8)
        q1 = tl.join(o1, o9)
        q2 = tl.join(o2, o10)
        q3 = tl.join(o3, o11)
        q4 = tl.join(o4, o12)
        q5 = tl.join(o5, o13)
        q6 = tl.join(o6, o14)
        q7 = tl.join(o7, o15)
        r0 = tl.join(q0, q4)
        r1 = tl.join(q1, q5)
        r2 = tl.join(q2, q6)
        r3 = tl.join(q3, q7)
        s0 = tl.join(r0, r2)
        s1 = tl.join(r1, r3)
        return tl.join(s0, s1)

    @triton.jit
    def _load_wtile(w_base, mb_base, s_base, k0, m_ok, sg, blk, n_sg, n_blk, ok):
        """Packed words [BM, NSG] (int32), mask bytes [BM, NSG] and e4m3 scale bytes [BM, NB] of the K tile at k0."""
        sgi = k0 // 16 + sg
        wmask = m_ok[:, None] & (sgi < n_sg)[None, :] & ok
        wv = tl.load(w_base + sgi[None, :], mask=wmask, other=0)
        mb = tl.load(mb_base + sgi[None, :], mask=wmask, other=0)
        bi = k0 // 32 + blk
        sb = tl.load(s_base + bi[None, :], mask=m_ok[:, None] & (bi < n_blk)[None, :] & ok, other=0)
        return wv, mb, sb

    @triton.jit
    def _expand_tile(wv, mb, sb, lut_ptr, BM: tl.constexpr, NSG: tl.constexpr, USE_ASM: tl.constexpr):
        """-> [BM, NSG, 2, 2, 2, 2] bf16 values code*s_hat*2^-7 in PERM order per 16-column slice."""
        wv = wv.to(tl.uint32, bitcast=True)
        mb = mb.to(tl.uint32)
        la = tl.load(lut_ptr + (mb & 15)).to(tl.uint32, bitcast=True)
        lb = tl.load(lut_ptr + 16 + (mb >> 4)).to(tl.uint32, bitcast=True)
        sf = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sf = tl.reshape(tl.join(sf, sf), (BM, NSG))
        if USE_ASM:
            s16 = (sf * 6.646139978924579e35).to(tl.bfloat16)  # s_hat * 2^119, exact
            s16 = s16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            s2 = (s16 | (s16 << 16)).to(tl.uint32, bitcast=True)
            o = tl.inline_asm_elementwise(
                asm=EXPAND_ASM_C,
                constraints="=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r",
                args=[wv, la, lb, s2], dtype=(tl.int16,) * 16, is_pure=True, pack=1)
            t = _join16(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7],
                        o[8], o[9], o[10], o[11], o[12], o[13], o[14], o[15]).to(tl.bfloat16, bitcast=True)
        else:
            o = _expand_plain(wv, la, lb, sf * 0.0078125)
            t = _join16(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7],
                        o[8], o[9], o[10], o[11], o[12], o[13], o[14], o[15])
        return t

    @triton.jit
    def _p48_gemm_kernel(
        x_ptr, w_ptr, m_ptr, s_ptr, lut_ptr, alpha_ptr, row_start_ptr, count_ptr, out_ptr,
        M, K, stride_xr, stride_or,
        stride_we, stride_wm, stride_me, stride_mm, stride_se, stride_sm,
        SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        USE_ASM: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        e = tl.program_id(1)
        sp = tl.program_id(2)
        NSG: tl.constexpr = BK // 16
        NB: tl.constexpr = BK // 32
        cnt = tl.load(count_ptr + e)
        row0 = tl.load(row_start_ptr + e).to(tl.int64)
        alpha = tl.load(alpha_ptr + e)
        offs_m = pid_m * BM + tl.arange(0, BM)
        m_ok = offs_m < M
        sg = tl.arange(0, NSG)
        blk = tl.arange(0, NB)
        kk = tl.arange(0, BK)
        j = kk % 16
        t8 = j % 8
        kperm = (kk // 16) * 16 + (j // 8) * 8 + t8 // 2 + (t8 % 2) * 4
        n_sg = K // 16
        n_blk = K // 32
        nk = tl.cdiv(K, BK)
        per = tl.cdiv(nk, SPLIT)
        k_lo = sp * per * BK  # this split's K range is [k_lo, k_lo + per*BK) clipped to K by the load masks
        w_base = w_ptr + e.to(tl.int64) * stride_we + offs_m[:, None].to(tl.int64) * stride_wm
        mb_base = m_ptr + e.to(tl.int64) * stride_me + offs_m[:, None].to(tl.int64) * stride_mm
        s_base = s_ptr + e.to(tl.int64) * stride_se + offs_m[:, None].to(tl.int64) * stride_sm
        n0 = 0
        while n0 < cnt:  # the expert's token tiles; a while loop because the bound is read on the device
            offs_n = n0 + tl.arange(0, BN)
            n_ok = offs_n < cnt
            rows = row0 + offs_n
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            # PREFETCH: the next K tile's packed words, mask bytes and scales are loaded while this one is
            # expanded and multiplied (register double buffering; Triton does not pipeline these loads).
            wv, mb, sb = _load_wtile(w_base, mb_base, s_base, k_lo, m_ok, sg, blk, n_sg, n_blk, PREFETCH & (per > 0))
            for ki in tl.range(0, per, num_stages=NUM_STAGES):
                k0 = k_lo + ki * BK
                if PREFETCH:
                    wv_n, mb_n, sb_n = _load_wtile(w_base, mb_base, s_base, k0 + BK, m_ok, sg, blk, n_sg, n_blk,
                                                   ki + 1 < per)
                else:
                    wv, mb, sb = _load_wtile(w_base, mb_base, s_base, k0, m_ok, sg, blk, n_sg, n_blk, ki < per)
                t = _expand_tile(wv, mb, sb, lut_ptr, BM, NSG, USE_ASM)
                wt = tl.reshape(t, (BM, BK))
                kx = k0 + kperm
                xt = tl.load(x_ptr + rows[None, :] * stride_xr + kx[:, None],
                             mask=n_ok[None, :] & (kx < K)[:, None], other=0.0)
                if DOT_F32:  # the interpreter multiplies bf16 dot operands as raw bits; same values in fp32
                    acc = tl.dot(wt.to(tl.float32), xt.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(wt, xt.to(tl.bfloat16), acc)
                if PREFETCH:
                    wv, mb, sb = wv_n, mb_n, sb_n
            acc = acc * alpha
            optrs = out_ptr + rows[None, :] * stride_or + offs_m[:, None]
            omask = m_ok[:, None] & n_ok[None, :]
            if SPLIT == 1:
                tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)
            else:
                tl.atomic_add(optrs, acc, mask=omask)
            n0 += BN

    @triton.jit
    def _round_ue4m3(x):
        """Round x in [2^-9, 448] to the nearest e4m3 value, ties to even (integer arithmetic, so the
        interpreter, whose fp8 cast drops the carry into the exponent, gives the same bits as the GPU)."""
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
        sub = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # multiples of 2^-9 below 2^-6
        return tl.where(x >= 0.015625, normal, sub)

    @triton.jit
    def _nvfp4_unscaled(x, g):
        """x float32 [R, NB, 32], g float32 [R, 1] -> e2m1(c)*s (float32, exact), the same operations in the
        same order as formats.NVFP4Quantizer.fake_quant (IEEE division, RNE to e4m3)."""
        amax = tl.max(tl.abs(x), axis=2)
        s = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)) * g
        s = _round_ue4m3(tl.minimum(tl.maximum(s, 0.001953125), 448.0))
        sb = s[:, :, None] + tl.zeros_like(x)
        t = tl.math.div_rn(x * g[:, :, None], sb)
        a = tl.abs(t)
        mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
               + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
               + (a > 5.0).to(tl.int32))
        magf = mag.to(tl.float32)
        val = tl.where(mag < 4, magf * 0.5, tl.where(mag == 7, 6.0, magf - 2.0))
        val = tl.where(t < 0, -val, val)
        return val * sb

    @triton.jit
    def _act_quant_kernel(x_ptr, out_ptr, row_g_ptr, g_ptr, R, K, stride_x, stride_o,
                          BR: tl.constexpr, NBLK: tl.constexpr):
        """out[r] = NVFP4 unscaled values of x[r] under global scale g[row_g[r]] (bf16, exact).
        One BR x (NBLK*32) block per program: at decode sizes a K loop per row block left the GPU nearly idle
        (a few programs each making K/128 dependent load round trips)."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        r_ok = rows < R
        gi = tl.load(row_g_ptr + rows, mask=r_ok, other=0)
        g2 = tl.load(g_ptr + gi, mask=r_ok, other=1.0)[:, None]
        kc = tl.program_id(1) * (NBLK * 32) + tl.arange(0, NBLK)[:, None] * 32 + tl.arange(0, 32)[None, :]
        msk = r_ok[:, None, None] & (kc < K)[None, :, :]
        x = tl.load(x_ptr + rows[:, None, None].to(tl.int64) * stride_x + kc[None, :, :], mask=msk, other=0.0)
        q = _nvfp4_unscaled(x.to(tl.float32), g2)
        tl.store(out_ptr + rows[:, None, None].to(tl.int64) * stride_o + kc[None, :, :], q.to(tl.bfloat16), mask=msk)

    @triton.jit
    def _route_scatter_kernel(x_ptr, idx_ptr, offsets_ptr, cursor_ptr, slot_row_ptr, row_expert_ptr, xs_ptr, g_ptr,
                              H, stride_x, stride_xs, TOPK: tl.constexpr, NBLK: tl.constexpr, QUANT: tl.constexpr,
                              PERM: tl.constexpr = False):
        """One program per (token, slot): claim a row of its expert's segment, copy (and quantize) the token.
        PERM (H % 8 == 0): the row in the sparse-MMA kernel's K order (p48_mma.k_order: each 8-group as e0 e2 e4
        e6 e1 e3 e5 e7); a 32-column block holds the same values either way, so the quantization is unchanged."""
        p = tl.program_id(0)
        tok = p // TOPK
        e = tl.load(idx_ptr + p)
        pos = tl.atomic_add(cursor_ptr + e, 1)
        row = tl.load(offsets_ptr + e) + pos
        tl.store(slot_row_ptr + p, row)
        tl.store(row_expert_ptr + row, e)
        cols = tl.arange(0, NBLK)[:, None] * 32 + tl.arange(0, 32)[None, :]
        g = tl.load(g_ptr + e)
        for h0 in range(0, H, NBLK * 32):
            hc = h0 + cols
            msk = hc < H
            src = hc
            if PERM:
                i8 = hc % 8
                src = hc - i8 + tl.where(i8 < 4, 2 * i8, 2 * i8 - 7)
            x = tl.load(x_ptr + tok.to(tl.int64) * stride_x + src, mask=msk, other=0.0)
            if QUANT:
                q = _nvfp4_unscaled(x.to(tl.float32)[None, :, :], g + tl.zeros((1, 1), tl.float32))
                tl.store(xs_ptr + row.to(tl.int64) * stride_xs + hc[None, :, :], q.to(xs_ptr.dtype.element_ty),
                         mask=msk[None, :, :])
            else:
                tl.store(xs_ptr + row.to(tl.int64) * stride_xs + hc, x.to(xs_ptr.dtype.element_ty), mask=msk)

    @triton.jit
    def _swiglu_kernel(y_ptr, out_ptr, row_expert_ptr, g_ptr, R, inter, stride_y, stride_o,
                       BR: tl.constexpr, NBLK: tl.constexpr, QUANT: tl.constexpr):
        """out = silu(y[:, :inter]) * y[:, inter:], optionally NVFP4-quantized (unscaled values) with g[expert(row)]."""
        pid = tl.program_id(0)
        rows = pid * BR + tl.arange(0, BR)
        r_ok = rows < R
        cols = tl.arange(0, NBLK)[:, None] * 32 + tl.arange(0, 32)[None, :]
        if QUANT:
            ge = tl.load(row_expert_ptr + rows, mask=r_ok, other=0)
            g2 = tl.load(g_ptr + ge, mask=r_ok, other=1.0)[:, None]
        for i0 in range(0, inter, NBLK * 32):
            ic = i0 + cols
            msk = r_ok[:, None, None] & (ic < inter)[None, :, :]
            base = y_ptr + rows[:, None, None].to(tl.int64) * stride_y + ic[None, :, :]
            gate = tl.load(base, mask=msk, other=0.0).to(tl.float32)
            up = tl.load(base + inter, mask=msk, other=0.0).to(tl.float32)
            h = gate / (1.0 + tl.exp(-gate)) * up
            if QUANT:
                h = _nvfp4_unscaled(h, g2)
            tl.store(out_ptr + rows[:, None, None].to(tl.int64) * stride_o + ic[None, :, :],
                     h.to(out_ptr.dtype.element_ty), mask=msk)

    @triton.jit
    def _combine_kernel(y_ptr, slot_row_ptr, w_ptr, out_ptr, H, stride_y, stride_o,
                        TOPK: tl.constexpr, BH: tl.constexpr):
        """out[t] = sum_j w[t, j] * y[slot_row[t, j]] (fp32, j in order)."""
        tok = tl.program_id(0)
        hb = tl.program_id(1)
        h = hb * BH + tl.arange(0, BH)
        msk = h < H
        acc = tl.zeros((BH,), dtype=tl.float32)
        for jj in tl.static_range(TOPK):
            row = tl.load(slot_row_ptr + tok * TOPK + jj).to(tl.int64)
            wt = tl.load(w_ptr + tok * TOPK + jj).to(tl.float32)
            acc += wt * tl.load(y_ptr + row * stride_y + h, mask=msk, other=0.0).to(tl.float32)
        tl.store(out_ptr + tok.to(tl.int64) * stride_o + h, acc.to(out_ptr.dtype.element_ty), mask=msk)

# The asm text is read by the kernel as a global constexpr.
EXPAND_ASM_C = tl.constexpr(EXPAND_ASM) if HAS_TRITON else EXPAND_ASM


# ------------------------------------------------------------------------------------------ launchers


def require_triton(device: torch.device) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the p48 Hopper kernels need triton, which is not installed")
    if device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"the p48 kernels run on a CUDA device (or under TRITON_INTERPRET=1), got {device}")


def default_use_asm(device: torch.device) -> bool:
    return device.type == "cuda" and not INTERPRET


_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    key = torch.device(device)
    if key not in _LUT_CACHE:
        _LUT_CACHE[key] = selector_table().to(key)
    return _LUT_CACHE[key]


@dataclass(frozen=True)
class GemmConfig:
    BM: int
    BN: int
    BK: int
    split: int
    num_warps: int
    num_stages: int
    prefetch: bool = True


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


# Tile shapes per regime (BN <= 32: decode; larger: prefill), as (BM, BK, num_warps, num_stages, prefetch).
# MOESQ_P48_TILES="small:BM,BK,warps,stages,prefetch;large:..." overrides them (used by the tuning sweep).
# The defaults are the fastest of a tile sweep on an H200.
DEFAULT_TILES = {"small": (64, 64, 4, 3, True), "large": (128, 128, 8, 3, True)}


def _tiles() -> dict[str, tuple[int, int, int, int, bool]]:
    tiles = dict(DEFAULT_TILES)
    spec = os.environ.get("MOESQ_P48_TILES", "").strip()
    for part in filter(None, spec.split(";")):
        name, vals = part.split(":")
        bm, bk, warps, stages, pf = (int(v) for v in vals.split(","))
        tiles[name.strip()] = (bm, bk, warps, stages, bool(pf))
    return tiles


def pick_config(M: int, K: int, active_experts: int, rows_per_expert: float, device: torch.device) -> GemmConfig:
    """Tile shape from the (host-known, static) problem size; split K when too few programs have work."""
    BN = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64 if rows_per_expert <= 64 else 128
    BM, BK, num_warps, num_stages, prefetch = _tiles()["small" if BN <= 32 else "large"]
    while BM > 64 and BM > M:
        BM //= 2
    m_tiles = math.ceil(M / BM)
    programs = max(1, active_experts) * m_tiles
    target = 2 * _num_sms(device)
    nk = math.ceil(K / BK)
    split = 1
    if programs < target:
        split = max(1, min(nk, math.ceil(target / programs), 8))
    return GemmConfig(BM, BN, BK, split, num_warps, num_stages, prefetch)


def p48_gemm_rows(x: torch.Tensor, w: P48GemmWeights, row_start: torch.Tensor, counts: torch.Tensor,
                  alpha: torch.Tensor, out: torch.Tensor, config: GemmConfig, use_asm: bool | None = None,
                  stats: dict | None = None) -> torch.Tensor:
    """Grouped GEMM over expert row segments: for each expert e, rows row_start[e] .. row_start[e]+counts[e]
    of x [R, K] (bf16) times w[e]^T, scaled by alpha[e] (the 2^7 of the expansion is folded in here), into
    out [R, M] (float32 when config.split > 1; then out must be zero-initialised). No host synchronisation."""
    require_triton(x.device)
    if use_asm is None:
        use_asm = default_use_asm(x.device)
    R, K = x.shape
    if K != w.in_features:
        raise ValueError(f"activations have K={K}, weights K={w.in_features}")
    if out.shape != (R, w.out_features):
        raise ValueError(f"out is {tuple(out.shape)}, expected {(R, w.out_features)}")
    if config.split > 1 and out.dtype != torch.float32:
        raise ValueError("split-K accumulates with fp32 atomics: out must be float32")
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("x and out need a contiguous last dimension")
    E, M = w.num_experts, w.out_features
    grid = (triton.cdiv(M, config.BM), E, config.split)
    kernel = _p48_gemm_kernel[grid](
        x, w.words, w.mask, w.scale, _lut(x.device), (alpha.float() * ALPHA_FOLD).contiguous(),
        row_start, counts, out, M, K, x.stride(0), out.stride(0),
        w.words.stride(0), w.words.stride(1), w.mask.stride(0), w.mask.stride(1), w.scale.stride(0), w.scale.stride(1),
        config.split, BM=config.BM, BN=config.BN, BK=config.BK, USE_ASM=use_asm,
        NUM_STAGES=config.num_stages, DOT_F32=INTERPRET, PREFETCH=config.prefetch, num_warps=config.num_warps,
    )
    if stats is not None and hasattr(kernel, "n_regs"):
        stats.update(n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=getattr(kernel.metadata, "shared", None))
    return out


def nvfp4_quantize_rows(x: torch.Tensor, row_group: torch.Tensor, group_global: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] -> bf16 [R, K] of the exact unscaled NVFP4 values e2m1(c)*s (32-column blocks), row r
    quantized with global scale group_global[row_group[r]] (all > 0)."""
    require_triton(x.device)
    R, K = x.shape
    if K % 32:
        raise ValueError(f"NVFP4 activations need K % 32 == 0, got {K}")
    out = torch.empty(R, K, dtype=torch.bfloat16, device=x.device) if out is None else out
    BR, NBLK = 16, 4
    _act_quant_kernel[(triton.cdiv(R, BR), triton.cdiv(K, NBLK * 32))](
        x, out, row_group, group_global.float().contiguous(), R, K, x.stride(0), out.stride(0), BR=BR, NBLK=NBLK,
        num_warps=4)
    return out


def dynamic_group_global(x: torch.Tensor, row_group: torch.Tensor, static_global: torch.Tensor) -> torch.Tensor:
    """Per-group activation global scale: the static one where > 0, else 448*6/amax over the group's rows
    (the dynamic scale MoesqExperts/p48_reference use for an uncalibrated expert). Device ops only."""
    G = static_global.numel()
    amax = torch.zeros(G, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        amax = amax.scatter_reduce(0, row_group.long(), x.float().abs().amax(-1), reduce="amax", include_self=True)
    dyn = torch.where(amax > 0, 2688.0 / amax.clamp_min(1e-30), torch.ones_like(amax))
    return torch.where(static_global > 0, static_global.float(), dyn)


def p48_grouped_gemm(x: torch.Tensor, counts: torch.Tensor, w: P48GemmWeights, act_quant: bool = False,
                     act_global: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                     config: GemmConfig | None = None, use_asm: bool | None = None) -> torch.Tensor:
    """Capacity-batched grouped GEMM: x [E, C, K] (rows < counts[e] valid, counts on the device) -> [E, C, M].

    W4A16 (act_quant False): x as bf16, out = x @ W_deq^T. W4A4: rows quantized to NVFP4 with
    act_global[e] (> 0) first, out = Xq @ W_deq^T, both exactly as p48_reference. Rows >= counts[e] of the
    result are unspecified (zero when split-K is used).
    """
    E, C, K = x.shape
    if E != w.num_experts:
        raise ValueError(f"x has {E} experts, weights {w.num_experts}")
    dev = x.device
    xr = x.reshape(E * C, K)
    counts = counts.to(device=dev, dtype=torch.int32).contiguous()
    row_start = torch.arange(E, device=dev, dtype=torch.int32) * C
    if act_quant:
        if act_global is None:
            raise ValueError("W4A4 needs the per-expert activation global scales")
        row_group = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(C)
        xr = nvfp4_quantize_rows(xr, row_group, act_global)
        alpha = 1.0 / (w.global_scale * act_global.float())
    else:
        xr = xr.to(torch.bfloat16)
        alpha = 1.0 / w.global_scale
    if config is None:
        config = pick_config(w.out_features, K, E, C, dev)
    dtype = torch.float32 if config.split > 1 else out_dtype
    out = (torch.zeros if config.split > 1 else torch.empty)(E * C, w.out_features, dtype=dtype, device=dev)
    p48_gemm_rows(xr, w, row_start, counts, alpha, out, config, use_asm)
    return out.reshape(E, C, w.out_features).to(out_dtype)
