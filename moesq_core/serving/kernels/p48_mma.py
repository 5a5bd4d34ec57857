"""p48-nvfp4 grouped GEMM on Hopper's 2:4 sparse tensor cores (native/src/p48_gemm.cu): weight layout + launcher.

Paired 4:8 is 2:4 after the K permutation of moesq_core.serving.kernels.p48_sparse24 (inside every 8-group
[e0 e2 e4 e6 | e1 e3 e5 e7]), so the kernel runs `mma.sp.m16n8k32` with the weights as the sparse bf16 A
operand (decoded in registers: E2M1 x UE4M3 is exact in bf16) and the activations as B; it permutes the
activations' K while staging them, so callers pass x in natural order (the calling convention of
p48_triton.p48_gemm_rows: rows of x, per-expert start rows and counts on the device, alpha per expert).
In W4A4 it can also quantize the activations to NVFP4 while staging them (`act_global`), instead of a separate
p48_triton.nvfp4_quantize_rows pass, with bit-identical operands.

Weight layout (`P48MmaWeights.records`, uint8 [E, MT, KR, 704], built once at load time from the 2:4 operand
of p48_sparse24.p48_to_2to4): one record holds 16 output rows x 128 (permuted) input columns, the unit one warp
streams per step, as three parts, each ordered by the lane that reads it (lane = 4 g + t, g = lane // 4):

    codes  512 B  lane-major, 16 B per lane = 4 words, one per 32-column MMA step s: the 8 codes of the lane's
                  four A registers (rows g, g+8 x 4-groups t, t+4 of the step); the low codes fill bits 0-15,
                  its code bits at CODE_BITS[r] (magnitude bits 0-2 and sign of the low code, then of the high
                  code), placed so that 9 integer operations per word put all eight codes in bf16 fields
    meta   128 B  4 B per lane: two 16-bit roles (the steps 2*i + t//2 for role i, i.e. selector t//2), each two
                  bytes of 8-group nibbles that expand to one mma.sp metadata register. For m16n8k32 with 16-bit
                  types the selector picks lanes 2*sel and 2*sel+1 of every quad, and lane 2*sel + h holds K
                  columns 16h..16h+15 of rows g (bits 0-15) and g+8 (bits 16-31) (the
                  one-row-per-lane reading fails the GPU tests)
    scales  64 B  8 B per row pair (g, g+8): per step s the scales of row g and row g+8, re-encoded from UE4M3
                  to 5 exponent / 3 mantissa bits without subnormals (SCALE_BYTE), so that one integer
                  multiply-add gives the bf16 bits of s * 2^119: (byte << 4) + 0x7600 (a zero scale, byte 0,
                  zeroes its block's codes instead)

Rows are padded to a multiple of 16 and columns to a multiple of 128 with zero codes, zero scales and a valid
2:4 pattern. Bytes: exactly the packed 2.75 bits per weight (+ padding), plus the fp32 global scale per expert.

The kernel's compiled variants are the table p48_variants.P48_VARIANTS (index = MmaConfig.variant), from which the
native build generates the kernel's variant list; pick_config picks one per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moesq_core.serving.kernels.p48_reference import WEIGHT_SUFFIXES
from moesq_core.serving.kernels.p48_sparse24 import P48As24, p48_to_2to4
from moesq_core.serving.kernels.p48_variants import MAX_ORDER_EXPERTS, P48_VARIANTS

RECORD_ROWS = 16
RECORD_K = 128
RECORD_BYTES = 704
CODES_BYTES, META_BYTES, SCALE_BYTES = 512, 128, 64
ALPHA_FOLD = 128.0  # the in-register decode yields e2m1 * s * 2^-7
PAD_NIBBLE = 0b0100  # kept positions 0 and 1 (a valid 2:4 pattern for zero-padded groups)
LIST_DEAL_ACTIVE = 0.8  # pick_config: variant 5 when fewer experts than this share are expected to have tokens
EARLY_FIRST_UNIT_ACTIVE = 0.5  # pick_config: early_first_unit off when fewer experts than this share are expected
# to have tokens
# Per A register r, the word bits of its two codes: (magnitude bit 0, 1, 2, sign) of the low code (the register's
# low bf16), then of the high code. The kernel's decode_fields moves them to the bf16 fields (magnitude at bits 6-8
# and 22-24, signs at 15 and 31): register 0 by a shift left by 6, 1 by a rotate left by 12, 2 by a shift left by 2,
# each then masked; register 3 keeps six bits in place and takes two from 8 bits higher.
CODE_BITS = ((0, 1, 2, 9, 16, 17, 18, 25), (26, 27, 28, 3, 10, 11, 12, 19), (4, 5, 6, 13, 20, 21, 22, 29),
             (14, 7, 8, 15, 30, 23, 24, 31))


def _code_luts() -> tuple[torch.Tensor, torch.Tensor]:
    """CODE_BITS as lookup tables: pack[r, c] = the word bits of register r's code byte c (low code | high code << 4);
    unpack[j, v] = the code bytes (register r's at bits 8r..8r+7) that byte j of a word with value v holds. int32
    (bit 31 wraps to the sign), so the tables and what they build take half the memory of int64."""
    where = [0] * 32  # word bit -> its place in the four code bytes
    for r, bits in enumerate(CODE_BITS):
        for i, pos in enumerate(bits):
            where[pos] = 8 * r + i
    set_bits = [[b for b in range(8) if v >> b & 1] for v in range(256)]
    pack = [[sum(1 << bits[b] for b in set_bits[v]) for v in range(256)] for bits in CODE_BITS]
    unpack = [[sum(1 << where[8 * j + b] for b in set_bits[v]) for v in range(256)] for j in range(4)]
    return (torch.tensor(pack, dtype=torch.int64).to(torch.int32),
            torch.tensor(unpack, dtype=torch.int64).to(torch.int32))


_PACK_LUT, _UNPACK_LUT = _code_luts()


def _scale_byte_table() -> torch.Tensor:
    """UE4M3 bits -> record scale byte: 8 (e + 10) + m for s = 2^e (1 + m/8), e in [-9, 8]; 0 for zero."""
    out = torch.zeros(256, dtype=torch.uint8)
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    for b in range(256):
        v = float(vals[b])
        if v > 0 and v == v and v != float("inf"):
            m, e = math.frexp(v)  # v = m 2^e, m in [0.5, 1)
            out[b] = 8 * (e - 1 + 10) + int(round((2 * m - 1) * 8))
    return out


SCALE_BYTE = _scale_byte_table()


@dataclass
class P48MmaWeights:
    """E p48 weights [E, M, K] in the sparse-tensor-core record layout; global_scale float32 [E]."""

    records: torch.Tensor  # uint8 [E, MT, KR, 704]
    global_scale: torch.Tensor  # float32 [E]
    out_features: int
    in_features: int

    @property
    def num_experts(self) -> int:
        return self.records.shape[0]

    @property
    def nbytes(self) -> int:
        return self.records.numel() + self.global_scale.numel() * 4

    def to(self, device) -> "P48MmaWeights":
        return P48MmaWeights(self.records.to(device), self.global_scale.to(device), self.out_features, self.in_features)

    @classmethod
    def from_packed(cls, tensors: list[dict[str, torch.Tensor]] | dict[str, torch.Tensor], device=None,
                    name: str = "") -> "P48MmaWeights":
        """From per-expert release tensors ({suffix: [M, K/4] ...}) or one stacked dict ([E, M, K/4] ...); the
        layout is built on `device` (default: where the tensors are)."""
        if isinstance(tensors, dict):
            st = {s: tensors[s] for s in WEIGHT_SUFFIXES if s in tensors}
        else:
            if not tensors:
                raise ValueError(f"{name or 'p48 weights'}: no experts given")
            missing = [s for s in WEIGHT_SUFFIXES if any(s not in t for t in tensors)]
            if missing:
                raise ValueError(f"{name or 'p48 weights'}: an expert lacks {', '.join(missing)}")
            st = {s: torch.stack([t[s] for t in tensors]) for s in WEIGHT_SUFFIXES}
        packed = st.get("weight_sparse_packed")
        if packed is None or packed.dim() != 3:
            raise ValueError(f"{name or 'p48 weights'}.weight_sparse_packed: expected [E, out, in/4]")
        E = packed.shape[0]
        g = st.get("weight_global_scale")
        if g is None or g.dtype != torch.float32 or g.numel() != E:
            raise ValueError(f"{name or 'p48 weights'}.weight_global_scale: expected float32 with one value per expert")
        scales = st.get("weight_scale")
        if (scales is None or scales.dtype != torch.float8_e4m3fn
                or tuple(scales.shape) != (*packed.shape[:2], packed.shape[2] // 8)):
            raise ValueError(f"{name or 'p48 weights'}.weight_scale: expected float8_e4m3fn [E, out, in/32]")
        dev = torch.device(device) if device is not None else packed.device
        st = {k: v.to(dev) for k, v in st.items()}
        try:
            op = p48_to_2to4(st)
        except ValueError as e:
            raise ValueError(f"{name or 'p48 weights'}: {e}") from None
        M, K = op.codes.shape[-2], op.in_features
        return cls(build_records(op), g.reshape(E).float().to(dev), M, K)


ROW_SUFFIXES = ("weight_sparse_packed", "weight_sparse_mask", "weight_scale")  # one row per output feature


def permute_rows(packed: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """One projection's release tensors with its output rows in `order` (row j = row order[j]): its GEMM then
    writes its outputs in that order. The per-tensor scales pass through."""
    return {s: (t.index_select(0, order.to(t.device)) if s in ROW_SUFFIXES else t) for s, t in packed.items()}


def stack_gate_up(gate: list[dict[str, torch.Tensor]],
                  up: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Per expert, gate's rows then up's rows ([2I, H]); both must share the weight global scale (one epilogue
    factor per expert)."""
    out = []
    for e, (a, b) in enumerate(zip(gate, up)):
        ga, gb = a["weight_global_scale"].float().reshape(-1), b["weight_global_scale"].float().reshape(-1)
        if not torch.equal(ga, gb):
            raise ValueError(f"expert {e}: gate and up have different weight_global_scale ({float(ga[0])} vs "
                             f"{float(gb[0])}); p48 serving needs the shared global scale the moesq pipeline writes")
        out.append({s: (torch.cat([a[s], b[s]], 0) if s != "weight_global_scale" else a[s]) for s in WEIGHT_SUFFIXES})
    return out


# ------------------------------------------------------------------------------------------ layout


def _pad(t: torch.Tensor, rows: int, cols: int, value: int) -> torch.Tensor:
    *lead, M, C = t.shape
    if (M, C) == (rows, cols):
        return t
    out = torch.full((*lead, rows, cols), value, dtype=t.dtype, device=t.device)
    out[..., :M, :C] = t
    return out


def build_records(op: P48As24) -> torch.Tensor:
    """The 2:4 operand (p48_sparse24.P48As24, stack [E, M, K]) -> records uint8 [E, MT, KR, 704]."""
    codes, meta = op.codes, op.meta
    if codes.dim() != 3:
        raise ValueError(f"expected a stack of weights [E, M, K/4], got codes {tuple(codes.shape)}")
    E, M, K = codes.shape[0], codes.shape[1], op.in_features
    MT, KR = math.ceil(M / RECORD_ROWS), math.ceil(K / RECORD_K)
    Mp, Kp = MT * RECORD_ROWS, KR * RECORD_K
    sc8 = op.scales.contiguous().view(torch.uint8)
    bad = ((sc8 & 0x80) != 0) | ((sc8 & 0x7F) == 0x7F)
    if bool(bad.any()):
        raise ValueError(f"weight_scale: {int(bad.sum())} block scales are negative or NaN (expected UE4M3)")
    codes = codes.masked_fill((sc8 == 0).repeat_interleave(8, -1), 0)  # a zero scale's block decodes to zeros
    codes = _pad(codes, Mp, Kp // 4, 0)
    nib = _pad(meta & 0xF, Mp, Kp // 8, PAD_NIBBLE)  # one 2:4 nibble per permuted 8-group
    sc = _pad(SCALE_BYTE.to(sc8.device)[sc8.long()], Mp, Kp // 32, 0)

    # codes: [E, MT, (ra, g), KR, s, (rb, t)] -> [E, MT, KR, g, t, s, (rb, ra)]: register r = 2 rb + ra holds
    # row g + 8 ra, 4-group t + 4 rb of step s
    c = codes.reshape(E, MT, 2, 8, KR, 4, 2, 4).permute(0, 1, 4, 3, 7, 5, 6, 2).reshape(E, MT, KR, 8, 4, 4, 4)
    lut = _PACK_LUT.to(c.device)
    word = lut[0][c[..., 0].int()] | lut[1][c[..., 1].int()] | lut[2][c[..., 2].int()] | lut[3][c[..., 3].int()]
    codes_part = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
    codes_part = codes_part.reshape(E, MT, KR, CODES_BYTES)

    # metadata: byte (s, row, j) = nibble of 8-group 2j | nibble of 8-group 2j+1 << 4, step s = 2 role + sel
    n = nib.reshape(E, MT, 16, KR, 4, 4).permute(0, 1, 3, 4, 2, 5)  # [E, MT, KR, s, row, q]
    pb = (n[..., 0::2] | (n[..., 1::2] << 4)).reshape(E, MT, KR, 2, 2, 2, 8, 2)  # [.., role, sel, row hi, g, j]
    # lane (g, sel, h): rows g (byte 0) and g+8 (byte 1), the two 8-groups of column half h
    meta_part = pb.permute(0, 1, 2, 6, 4, 7, 3, 5).reshape(E, MT, KR, META_BYTES)  # [.., g, sel, h=j, role, row hi]

    # scales: [E, MT, (j, g), KR, s] -> [E, MT, KR, g, s, j]
    scale_part = sc.reshape(E, MT, 2, 8, KR, 4).permute(0, 1, 4, 3, 5, 2).reshape(E, MT, KR, SCALE_BYTES)
    return torch.cat([codes_part, meta_part, scale_part], -1).contiguous()


def records_to_2to4(records: torch.Tensor, M: int, K: int, global_scale: torch.Tensor) -> P48As24:
    """Inverse of build_records (cropped to [E, M, K]): for round-trip checks."""
    E, MT, KR, _ = records.shape
    codes_part, meta_part, scale_part = records.split([CODES_BYTES, META_BYTES, SCALE_BYTES], -1)
    b = codes_part.reshape(E, MT, KR, 8, 4, 4, 4)  # [.., g, t, s, byte]
    lut = _UNPACK_LUT.to(b.device)
    byte_codes = lut[0][b[..., 0].int()] | lut[1][b[..., 1].int()] | lut[2][b[..., 2].int()] | lut[3][b[..., 3].int()]
    c = torch.stack([(byte_codes >> (8 * r)) & 0xFF for r in range(4)], -1).to(torch.uint8)
    c = c.reshape(E, MT, KR, 8, 4, 4, 2, 2)  # [.., g, t, s, rb, ra]
    codes = c.permute(0, 1, 7, 3, 2, 5, 6, 4).reshape(E, MT * 16, KR * 32)
    pb = meta_part.reshape(E, MT, KR, 8, 2, 2, 2, 2).permute(0, 1, 2, 6, 4, 7, 3, 5)
    pb = pb.reshape(E, MT, KR, 4, 16, 2)  # [.., s, row, j]
    n = torch.stack([pb & 0xF, pb >> 4], -1).reshape(E, MT, KR, 4, 16, 4).permute(0, 1, 4, 2, 3, 5)
    nib = n.reshape(E, MT * 16, KR * 16)
    sc = scale_part.reshape(E, MT, KR, 8, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(E, MT * 16, KR * 4)
    inverse = torch.zeros(256, dtype=torch.uint8)
    inverse[SCALE_BYTE.long()] = torch.arange(256, dtype=torch.uint8)
    inverse[0] = 0
    sc = inverse.to(sc.device)[sc.long()]
    return P48As24(codes[:, :M, : K // 4].contiguous(), (nib | (nib << 4))[:, :M, : K // 8].contiguous(),
                   sc[:, :M, : K // 32].contiguous().view(torch.float8_e4m3fn), global_scale.reshape(E, 1))


# ------------------------------------------------------------------------------------------ launcher


@dataclass(frozen=True)
class MmaConfig:
    variant: int  # index into p48_variants.P48_VARIANTS (the kernel's compiled variants)
    split: int  # K slices (> 1: fp32 atomics into a zeroed output)
    # mma.sp variants: each CTA copies its natural first unit's first weights before it waits for the previous
    # grid, and skips them when that expert has no token (pick_config: off where few experts are expected to have
    # tokens, EARLY_FIRST_UNIT_ACTIVE)
    early_first_unit: bool = True


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def pick_config(M: int, K: int, active_experts: float, rows_per_expert: float, device: torch.device,
                experts: int | None = None) -> MmaConfig:
    """The kernel variant, split K and early_first_unit for one grouped GEMM of `active_experts` (an estimate is
    fine) experts with `rows_per_expert` rows on average, out of `experts` (None: unknown, e.g. the kernel bench).

    Up to 16 rows per expert mma.sp: variant 0; 4 when a unit's K slice fits one staged chunk and two row groups per
    unit do not lengthen the busiest CTA's walk (_row_group_pairs_pay); 5 (units dealt from a list of the experts
    with tokens) when fewer than LIST_DEAL_ACTIVE of the `experts` are expected to get a token, or when more than 8
    rows per expert spread the counts over several 8-token tiles and no row-group pairs apply — the fixed deal
    gives each CTA the units b, b + G, ... whether their experts have tokens or not, so their load follows where
    the empty or equal experts fall. Above 16 rows, wgmma.sp with 4 warpgroups: 64 tokens per pass up to 64 rows
    per expert (1); above, 128 tokens per pass (2), with the units dealt by decreasing token count and the wgmma's N
    fitted to each expert's tokens (3) where K >= 1024 and the experts are few enough to sort (at smaller K the
    many short units are balanced already and do not repay the sort). Split K only when too few CTAs have work.
    early_first_unit is on unless fewer than EARLY_FIRST_UNIT_ACTIVE of the `experts` are expected to have tokens,
    where most CTAs' first units are empty and the early copies only delay the real first one.
    Each rule won head to head on an H200 (benchmarks/results/README.md, "p48 variants"; native/docs/p48.md)."""
    if rows_per_expert <= 16:
        variant = 0
    elif rows_per_expert <= 64:
        variant = 1
    else:
        variant = 3 if K >= 1024 and active_experts <= MAX_ORDER_EXPERTS else 2
    ctas = max(1, active_experts) * math.ceil(M / P48_VARIANTS[variant].rows_per_cta)
    target = 2 * _num_sms(device)
    split = 1
    if ctas < target:
        split = max(1, min(math.ceil(K / RECORD_K), math.ceil(target / ctas), 4))
    early = experts is None or active_experts >= EARLY_FIRST_UNIT_ACTIVE * experts
    listable = experts is not None and experts <= MAX_ORDER_EXPERTS
    if variant == 0 and listable and active_experts < LIST_DEAL_ACTIVE * experts:
        return MmaConfig(5, split, early)
    if variant == 0 and _row_group_pairs_pay(M, K, active_experts, split, target):
        variant = 4
    elif variant == 0 and listable and rows_per_expert > 8 and _slice_k(K, split) > P48_VARIANTS[5].k_chunk:
        variant = 5
    return MmaConfig(variant, split, early)


def expected_active_experts(experts: int, tokens: int, top_k: int) -> float:
    """How many of `experts` get at least one of `tokens` tokens that each pick `top_k` distinct experts, were the
    picks uniform: experts (1 - (1 - top_k / experts)^tokens). (A sharper estimate than min(experts, rows) for
    deciding how the units are dealt; the counts themselves stay on the device.)"""
    if experts <= 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - min(top_k, experts) / experts) ** tokens)


def _slice_k(K: int, split: int) -> int:
    """The columns of one K slice (whole records)."""
    return math.ceil(math.ceil(K / RECORD_K) / split) * RECORD_K


def _row_group_pairs_pay(M: int, K: int, active_experts: float, split: int, ctas: int) -> bool:
    """Variant 4 stages a unit's activations once for its two row groups, which only saves work when one chunk holds
    the unit's K slice (elsewhere nothing is re-used and there are half as many units to deal). Its units are
    twice as long, so it is taken only when the busiest of `ctas` CTAs walks no more row groups than with one per
    unit."""
    pairs = P48_VARIANTS[4]
    if _slice_k(K, split) > pairs.k_chunk:
        return False
    groups, per_unit = math.ceil(M / pairs.rows_per_cta), pairs.row_groups_per_unit
    slices = max(1, math.ceil(active_experts)) * split
    walk = per_unit * math.ceil(slices * math.ceil(groups / per_unit) / ctas)
    return groups > 1 and walk <= math.ceil(slices * groups / ctas)


def load_native():
    """The native module when it can run here (an sm_90 GPU and a build), else None."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return None
    from moesq_core.serving.kernels.native_build import NativeBuildError, load_extension

    try:
        mod = load_extension()
    except NativeBuildError:
        return None
    return mod if hasattr(mod, "p48_gemm") else None


def k_order(n: int, device=None) -> torch.Tensor:
    """The kernel's K order of n columns (n % 8 == 0): position j holds natural column k_order(n)[j], each 8-group
    as [e0 e2 e4 e6 | e1 e3 e5 e7] (paired 4:8 as 2:4). x[:, k_order(K)] is what `x_permuted` takes; a weight
    whose rows are so ordered writes its outputs in that order."""
    if n % 8:
        raise ValueError(f"k_order: {n} columns is not a multiple of 8")
    group = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7], device=device)
    return (torch.arange(0, n, 8, device=device).unsqueeze(1) + group).reshape(-1)


def p48_mma_gemm_rows(x: torch.Tensor, w: P48MmaWeights, row_start: torch.Tensor, counts: torch.Tensor,
                      alpha: torch.Tensor, out: torch.Tensor, config: MmaConfig, native=None,
                      act_global: torch.Tensor | None = None, x_permuted: bool = False) -> torch.Tensor:
    """Grouped GEMM over expert row segments (p48_triton.p48_gemm_rows's convention): for each expert e, rows
    row_start[e] .. row_start[e]+counts[e] of x [R, K] (bf16) times w[e]^T, times alpha[e], into out [R, M]
    (float32 and zero-initialised when config.split > 1). No host synchronisation.

    act_global (float32 [E], every value > 0): W4A4 with the NVFP4 activation quantization inside the kernel:
    it quantizes each staged row of x with act_global[e] exactly as p48_triton.nvfp4_quantize_rows does, so the
    result equals that pre-pass followed by this GEMM bit for bit (x must hold the bf16 activations the
    pre-pass would read; alpha stays 1/(g_w * g_a)).

    x_permuted: x holds the activations in the kernel's K order (x_natural[:, k_order(K)]), e.g. the SwiGLU of a
    gate/up GEMM whose weight rows were put in that order at load time; the result is the same bit for bit, and
    the 128-token passes stage such a chunk with one copy instead of a copy and a permutation."""
    mod = native if native is not None else load_native()
    if mod is None:
        raise RuntimeError("the p48 sparse-tensor-core kernel needs an sm_90 GPU and the native module")
    if x.shape[-1] != w.in_features or out.shape != (x.shape[0], w.out_features):
        raise ValueError(f"x {tuple(x.shape)} / out {tuple(out.shape)} do not fit weights "
                         f"[{w.out_features}, {w.in_features}]")
    alpha = alpha.float().contiguous()
    if not _folds_alpha(mod):  # a module built from older sources wants the decode's 2^7 in alpha
        alpha = alpha * ALPHA_FOLD
    args = (config.variant, w.records, x, row_start, counts, alpha, out, w.out_features, w.in_features, config.split)
    kwargs = {} if config.early_first_unit else {"early_first_unit": False}
    if x_permuted:
        if not takes_permuted_activations(mod):
            raise RuntimeError("this build of the native module cannot take K-permuted activations: rebuild it "
                               "(python -m moesq_core.serving.kernels.native_build)")
        kwargs["x_permuted"] = True
    if act_global is None:  # W4A16 (or a pre-quantized x): the call every build of the module takes
        mod.p48_gemm(*args, **kwargs)
    else:
        if not quantizes_activations(mod):
            raise RuntimeError("this build of the native module cannot quantize activations in the p48 kernel: "
                               "rebuild it (python -m moesq_core.serving.kernels.native_build) or quantize x first")
        mod.p48_gemm(*args, act_global.float().contiguous(), **kwargs)
    return out


def _folds_alpha(native) -> bool:
    """Whether the native module applies the decode's 2^7 itself (saves a launch per call); older builds do not."""
    return "alpha as given" in (getattr(getattr(native, "p48_gemm", None), "__doc__", None) or "")


def takes_permuted_activations(native) -> bool:
    """Whether the native module's p48 kernel takes `x_permuted` (older builds do not)."""
    return "x_permuted" in (getattr(getattr(native, "p48_gemm", None), "__doc__", None) or "")


def quantizes_activations(native) -> bool:
    """Whether the native module's p48 kernel takes `act_global` (W4A4 quantization in the kernel); a module
    built from older sources (e.g. $MOESQ_NATIVE_EXT) does not."""
    return "act_global" in (getattr(getattr(native, "p48_gemm", None), "__doc__", None) or "")
