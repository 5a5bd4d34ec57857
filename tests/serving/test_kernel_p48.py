"""p48-nvfp4 grouped GEMM: CPU reference vs plain dequantized math, the load-time re-layout, the inline-PTX
expansion (run through a small PTX interpreter on the CPU), the plain-Triton kernel under the Triton
interpreter, and the GPU kernel vs the CPU reference on awkward sizes with poisoned outputs."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moesq_core.formats import get_format
from moesq_core.formats.packing import pack, unpack
from moesq_core.formats.quantizers import NVFP4ActQuantizer
from moesq_core.serving.kernels import p48_reference as ref
from moesq_core.serving.kernels import p48_triton as pt

from conftest import P48GroupedCase, run_triton_interpreted

FMT = get_format("p48-nvfp4")


def packed_weight(out: int, inn: int, seed: int, scale: float = 0.05, global_scale=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inn, generator=g) * scale
    # heavy-tailed rows so block scales spread over the e4m3 range
    w = w * torch.exp(torch.randn(out, 1, generator=g))
    return pack(FMT.quantize(w, global_scale=global_scale))


def stacked(ws: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([w[k] for w in ws]) for k in ws[0]}


# ------------------------------------------------------------------------------------------ reference numerics


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), blocks=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       log_scale=st.floats(-12.0, 8.0), calibrated=st.booleans())
def test_act_quant_matches_format_quantizer(rows, blocks, seed, log_scale, calibrated):
    x = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    g = torch.tensor(2688.0 / (x.abs().max().item() * 1.7 + 1e-30)) if calibrated else None
    xu, g_used = ref.quantize_act_unscaled(x, g)
    fq = NVFP4ActQuantizer(32)(x, g)
    assert torch.equal(xu / g_used, fq)  # bit-identical to the format's quantizer
    assert torch.equal(xu.to(torch.bfloat16).float(), xu)  # exact in bf16, as the kernel consumes it


@pytest.mark.parametrize("act_quant", [False, True])
def test_linear_ref_matches_plain_dequantized(act_quant):
    w = packed_weight(48, 96, 1)
    w["input_global_scale"] = torch.tensor([2688.0 / 3.0])
    x = torch.randn(7, 96)
    dec = ref.decode_p48(w)
    y = ref.p48_linear_ref(x, dec, act_quant)
    w_plain = unpack("p48-nvfp4", w).dequantize()  # code * s_hat / g as the packer decodes it
    xq = NVFP4ActQuantizer(32)(x, w["input_global_scale"].reshape(())) if act_quant else x
    plain = xq @ w_plain.T
    assert torch.allclose(y, plain, rtol=1e-5, atol=1e-6 * plain.abs().max().item())
    assert torch.equal(dec.dequantize(), w_plain)


def test_grouped_ref_is_per_expert():
    ws = [packed_weight(40, 64, s) for s in range(3)]
    for w in ws:
        w["input_global_scale"] = torch.tensor([500.0])
    st_ = ref.decode_p48(stacked(ws))
    x = torch.randn(3, 5, 64)
    counts = torch.tensor([5, 0, 2])
    out = ref.p48_grouped_ref(x, counts, st_, True)
    for e in range(3):
        n = int(counts[e])
        assert torch.equal(out[e, :n], ref.p48_linear_ref(x[e, :n], ref.decode_p48(ws[e]), True))
        assert not out[e, n:].any()


def test_decode_rejects_bad_mask():
    w = packed_weight(16, 32, 0)
    w["weight_sparse_mask"][3, 1] = 0x37  # low nibble 0b0111: three pairs kept
    with pytest.raises(ValueError, match="exactly 2"):
        ref.decode_p48(w)


# ------------------------------------------------------------------------------------------ re-layout and PTX


def test_relayout_is_a_byte_bijection():
    b = torch.arange(256, dtype=torch.uint8)
    r = pt.relayout_kept_bytes(b)
    assert len(set(r.tolist())) == 256
    assert torch.equal(pt.undo_relayout_kept_bytes(r), b)


def test_gemm_weights_keep_2_75_bits():
    ws = [packed_weight(64, 256, s) for s in range(2)]
    W = pt.P48GemmWeights.from_packed(ws)
    assert W.words.dtype == torch.int32 and tuple(W.words.shape) == (2, 64, 16)
    # 2.75 bits per weight plus one fp32 global scale per matrix
    assert W.bits_per_weight == pytest.approx(2.75 + 32 / (64 * 256))
    bad = dict(ws[0])
    bad["weight_sparse_mask"] = bad["weight_sparse_mask"].clone()
    bad["weight_sparse_mask"][0, 0] = 0x0F
    with pytest.raises(ValueError, match="exactly 2 bits"):
        pt.P48GemmWeights.from_packed([bad, ws[1]])


_M32 = (1 << 32) - 1


def _bf16_bits_to_f64(h: torch.Tensor) -> torch.Tensor:
    return (h.to(torch.int32) << 16).view(torch.float32).double()


def _f64_to_bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def run_ptx(asm: str, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Execute the PTX subset the expansion uses (mov, prmt, shr/shl, lop3, fma.rn.bf16x2), vectorised over
    int64 tensors holding 32-bit registers; returns the 16-bit outputs $0.. ."""
    regs: dict[str, torch.Tensor] = {f"${k}": v.to(torch.int64) & _M32 for k, v in inputs.items()}
    shape = next(iter(inputs.values())).shape

    def val(op: str) -> torch.Tensor:
        op = op.strip()
        if op in regs:
            return regs[op]
        return torch.full(shape, int(op, 0) & _M32, dtype=torch.int64)

    body = asm.replace("{", " ").replace("}", " ")
    for stmt in [s.strip() for s in body.split(";")]:
        if not stmt or stmt.startswith(".reg"):
            continue
        m = re.match(r"(\S+)\s+(.*)", stmt, re.S)
        opc, rest = m.group(1), m.group(2)
        ops = [t.strip() for t in rest.split(",")]
        if opc == "mov.b32" and len(ops) == 2:
            regs[ops[0]] = val(ops[1])
            continue
        if opc == "mov.b32":  # {$a, $b}, x: the low half to $a (braces were stripped above)
            x = val(ops[2])
            regs[ops[0]] = x & 0xFFFF
            regs[ops[1]] = x >> 16
            continue
        if opc == "prmt.b32":
            d, a, b, c = ops
            a, b, c = val(a), val(b), val(c)
            src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
            out = torch.zeros(shape, dtype=torch.int64)
            for i in range(4):
                sel = (c >> (4 * i)) & 0xF
                byte = torch.zeros(shape, dtype=torch.int64)
                for s_ in range(8):
                    byte = torch.where((sel & 7) == s_, src[s_], byte)
                byte = torch.where((sel & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
                out |= byte << (8 * i)
            regs[d] = out & _M32
        elif opc in ("shl.b32", "shr.b32"):
            d, a, n = ops
            regs[d] = ((val(a) << int(n)) if opc == "shl.b32" else (val(a) >> int(n))) & _M32
        elif opc == "lop3.b32":
            d, a, b, c, lut = ops
            a, b, c, lut = val(a), val(b), val(c), int(lut, 0)
            out = torch.zeros(shape, dtype=torch.int64)
            for bit in range(32):
                idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
                out |= ((lut >> idx) & 1) << bit
            regs[d] = out
        elif opc == "fma.rn.bf16x2":
            d, a, b, c = ops
            a, b, c = val(a), val(b), val(c)
            halves = []
            for sh in (0, 16):
                r = (_bf16_bits_to_f64((a >> sh) & 0xFFFF) * _bf16_bits_to_f64((b >> sh) & 0xFFFF)
                     + _bf16_bits_to_f64((c >> sh) & 0xFFFF))
                halves.append(_f64_to_bf16_bits(r))
            regs[d] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"PTX op {opc} not emulated")
    return {k: regs[f"${k}"] for k in range(16)}


def test_ptx_expansion_matches_reference_dequant():
    """The exact EXPAND_ASM text, interpreted: 16 outputs per word = code * s_hat * 2^-7 in PERM order, for
    every mask pair, random kept bytes and every positive e4m3 scale."""
    gen = torch.Generator().manual_seed(0)
    valid = [m for m in range(16) if bin(m).count("1") == 2]
    pairs = torch.tensor([(a, b) for a in valid for b in valid])  # 36 (low, high) nibble pairs
    n = 2048
    choice = torch.randint(0, len(pairs), (n, 2), generator=gen)  # two words per row (32 columns)
    nib = pairs[choice]  # [n, 2, 2]
    mask = (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8)  # [n, 2] weight_sparse_mask of a 32-column row
    kept = torch.randint(0, 256, (n, 8), generator=gen, dtype=torch.int64).to(torch.uint8)
    scale_bits = torch.arange(n) % 126 + 1  # all positive finite e4m3 values, subnormals included
    scale = scale_bits.to(torch.uint8).view(torch.float8_e4m3fn).reshape(n, 1)
    tensors = {"weight_sparse_packed": kept, "weight_sparse_mask": mask, "weight_scale": scale,
               "weight_global_scale": torch.ones(1)}
    want = ref.decode_p48(tensors).unscaled() * 2.0**-7  # [n, 32]

    words = pt.relayout_kept_bytes(kept).contiguous().view(torch.int32).to(torch.int64) & _M32  # [n, 2]
    lut = pt.selector_table().to(torch.int64) & _M32
    m = mask.to(torch.int64)
    s16 = (scale.float() * 2.0**119).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    s2 = (s16 | (s16 << 16)).expand(n, 2)
    outs = run_ptx(pt.EXPAND_ASM, {16: words, 17: lut[m & 15], 18: lut[16 + (m >> 4)], 19: s2})
    got = torch.stack([(outs[j].to(torch.int32) << 16).view(torch.float32) for j in range(16)], -1)  # [n, 2, 16]
    perm = torch.tensor(pt.PERM)
    want_perm = want.reshape(n, 2, 16)[..., perm]
    assert torch.equal(got, want_perm)


# ------------------------------------------------------------------------------------------ Triton interpreter


_INTERP_SCRIPT = r"""
import sys, torch
from moesq_core.serving.kernels import p48_reference as ref, p48_triton as pt
from test_kernel_p48 import packed_weight, stacked
torch.manual_seed(0)
E, M, K, C = 3, 80, 96, 19
ws = [packed_weight(M, K, 10 + s) for s in range(E)]
for w in ws:
    w["input_global_scale"] = torch.tensor([700.0])
W = pt.P48GemmWeights.from_packed(ws)
dec = ref.decode_p48(stacked(ws))
x = torch.randn(E, C, K).to(torch.bfloat16)
counts = torch.tensor([19, 0, 3], dtype=torch.int32)
g_a = torch.full((E,), 700.0)
worst = 0.0
for aq in (False, True):
    want = ref.p48_grouped_ref(x, counts, dec, aq)
    for split in (1, 2):
        cfg = pt.GemmConfig(BM=64, BN=16, BK=64, split=split, num_warps=4, num_stages=2)
        got = pt.p48_grouped_gemm(x, counts, W, act_quant=aq, act_global=g_a, config=cfg, use_asm=False)
        for e in range(E):
            n = int(counts[e])
            if n:
                err = ((got[e, :n] - want[e, :n]).norm() / want[e, :n].norm()).item()
                worst = max(worst, err)
print("WORST", worst)
"""


@pytest.mark.slow
def test_plain_triton_kernel_under_interpreter():
    worst = float(run_triton_interpreted(_INTERP_SCRIPT).split("WORST")[1])
    assert worst < 1e-6


_ACT_QUANT_SCRIPT = """
import torch
import moesq_core.serving.kernels.p48_triton as pt
import moesq_core.serving.kernels.p48_reference as ref
torch.manual_seed(0)
# 37 rows (a partial row block) x 416 columns (three full 128-column blocks and a partial one)
x = torch.randn(37, 416) * torch.exp(torch.randn(37, 1) * 3)
groups = torch.randint(0, 4, (37,), dtype=torch.int32)
g = torch.tensor([10.0, 300.0, 4000.0, 1e5])
got = pt.nvfp4_quantize_rows(x, groups, g).float()
bad = 0
for r in range(37):
    want, _ = ref.quantize_act_unscaled(x[r : r + 1], g[groups[r]])
    bad += int(not torch.equal(got[r : r + 1], want))
print("BAD", bad)
"""


def test_activation_quant_kernel_under_interpreter():
    """The NVFP4 pre-pass (one program per 16 rows x 128 columns) equals the reference quantizer bit for bit,
    including the partial row and column blocks."""
    assert int(run_triton_interpreted(_ACT_QUANT_SCRIPT).split("BAD")[1]) == 0


# ------------------------------------------------------------------------------------------ GPU kernel


def _gpu_case(E, M, K, counts, act_quant, split, use_asm, seed):
    dev = torch.device("cuda")
    ws = [packed_weight(M, K, seed * 31 + s) for s in range(E)]
    case = P48GroupedCase(ws, counts, act_quant, torch.Generator().manual_seed(seed))
    W = pt.P48GemmWeights.from_packed(ws, dev)
    cfg = pt.pick_config(M, K, E, case.C, dev)
    cfg = pt.GemmConfig(cfg.BM, cfg.BN, cfg.BK, split, cfg.num_warps, cfg.num_stages)
    out = case.output(poisoned=split == 1)
    pt.p48_gemm_rows(case.gemm_input(), W, case.row_start, case.counts, case.alpha(W.global_scale), out, cfg, use_asm)
    case.check(out, 2e-6, poisoned=split == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("use_asm", [True, False])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("E,M,K,counts", [
    (3, 80, 96, [19, 0, 3]),
    (5, 200, 224, [1, 40, 17, 0, 130]),
    (2, 1536, 2048, [16, 5]),
])
def test_gpu_kernel_matches_reference(E, M, K, counts, act_quant, split, use_asm):
    _gpu_case(E, M, K, counts, act_quant, split, use_asm, seed=E + M)


@pytest.mark.gpu
def test_gpu_activation_quant_bit_exact():
    dev = torch.device("cuda")
    x = torch.randn(37, 320) * torch.exp(torch.randn(37, 1) * 3)
    groups = torch.randint(0, 4, (37,), dtype=torch.int32)
    g = torch.tensor([10.0, 300.0, 4000.0, 1e5])
    got = pt.nvfp4_quantize_rows(x.to(dev), groups.to(dev), g.to(dev)).cpu().float()
    for r in range(37):
        want, _ = ref.quantize_act_unscaled(x[r : r + 1], g[groups[r]])
        assert torch.equal(got[r : r + 1], want), f"row {r}"
