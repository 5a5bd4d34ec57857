"""CPU reference of the paired 4:8 NVFP4 (p48-nvfp4) grouped GEMM numerics.

This module defines what the Hopper kernel (p48_triton.py) computes, in plain torch:

  unpack   the release layout (weight_sparse_packed / weight_sparse_mask / weight_scale / weight_global_scale,
           decoded by moesq_core.formats.packing) -> E2M1 codes and UE4M3 block scales
  dequant  unscaled weight  Wu = e2m1(code) * s_hat            (exact in bf16: <= 6 significant bits)
  act      W4A16: the activations as given (bf16 on the GPU);
           W4A4:  Xu = e2m1(c_a) * s_a, NVFP4 with 32-column blocks under the static input global scale g_a
                  (bit-identical to formats.NVFP4ActQuantizer: s_a = e4m3(clamp(amax/6*g_a, 2^-9, 448)),
                  c_a = e2m1((x*g_a)/s_a); fake_quant(x) == Xu / g_a exactly). g_a = 0 (no calibration)
                  means the dynamic scale of the tensor being quantized, as MoesqExperts does.
  GEMM     Y = (Xu @ Wu^T) * alpha,  alpha = 1/(g_w*g_a) (W4A4) or 1/g_w (W4A16), fp32 accumulation.

Products of the exact operands are exact in fp32, so the GPU kernel (bf16 tensor-core MMAs with fp32
accumulation, alpha in the epilogue) differs from this reference only in the order of fp32 additions; this
is also what Blackwell's block-scaled sparse MMA computes (scales applied per 32-block, global scales folded
into one fp32 alpha). Y equals the "plain" computation x_q @ W_deq^T with W_deq = code*s_hat/g_w up to fp32
rounding (tests check that).

The MoE reference (`p48_moe_ref`) is the routed-experts forward the runtime module implements:
routing -> gate/up -> SwiGLU (-> NVFP4 of the SwiGLU output in W4A4) -> down -> weighted combine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moesq_core.formats.e2m1 import e2m1_decode
from moesq_core.formats.packing import unpack
from moesq_core.formats.quantizers import nvfp4_global_scale, nvfp4_quantize_unscaled
from moesq_core.naming import PROJECTIONS

WEIGHT_SUFFIXES = ("weight_sparse_packed", "weight_sparse_mask", "weight_scale", "weight_global_scale")
ACT_BLOCK = 32
SCALE_BLOCK = 32
PROJS = PROJECTIONS


@dataclass
class P48Weight:
    """Decoded p48 weight of one linear ([out, in]) or a stack ([E, out, in]).

    codes uint8 E2M1 nibbles (0 where pruned), scales float32 UE4M3 values [..., out, in/32],
    global_scale float32 [...] (one per matrix), input_global_scale float32 [...] (0 = dynamic).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    input_global_scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.codes.shape[-2]

    @property
    def in_features(self) -> int:
        return self.codes.shape[-1]

    def unscaled(self) -> torch.Tensor:
        """Wu = e2m1(code) * s_hat, float32, exact."""
        return e2m1_decode(self.codes) * self.scales.float().repeat_interleave(SCALE_BLOCK, dim=-1)

    def dequantize(self) -> torch.Tensor:
        """W = code * s_hat / g_w (what QuantizedWeight.dequantize gives for the same tensors)."""
        return self.unscaled() / self.global_scale.float()[..., None, None]


def decode_p48(tensors: dict[str, torch.Tensor], name: str = "") -> P48Weight:
    """{suffix: tensor} of one linear (or a stack) in the release layout -> P48Weight.

    Validation (dtypes, shapes, exactly 2 kept pairs per group) is the packer's (moesq_core.formats.packing.unpack).
    A missing input_global_scale counts as 0 (dynamic activation scale).
    """
    qw = unpack("p48-nvfp4", {k: v for k, v in tensors.items() if k in WEIGHT_SUFFIXES}, name)
    lead = qw.codes.shape[:-2]
    g = qw.global_scale.float().reshape(lead)
    gi = tensors.get("input_global_scale")
    gi = torch.zeros(lead) if gi is None else gi.float().reshape(lead)
    return P48Weight(qw.codes, qw.scales.float(), g, gi)


def quantize_act_unscaled(x: torch.Tensor, g: torch.Tensor | float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Xu, g_used): NVFP4 32-block quantization of x [..., K] with global scale g, returned unscaled
    (Xu = e2m1(c) * s, exact in bf16) together with the global scale used.

    g <= 0 or None -> the dynamic scale of x itself (448*6/amax(x)), as NVFP4ActQuantizer does without one.
    Same float32 operations, in the same order, as formats.NVFP4Quantizer.fake_quant, so
    NVFP4ActQuantizer(32)(x, g) == Xu / g bit for bit.
    """
    xf = x.float()
    if xf.shape[-1] % ACT_BLOCK:
        raise ValueError(f"activation width {xf.shape[-1]} is not a multiple of the NVFP4 block {ACT_BLOCK}")
    if g is None or float(torch.as_tensor(g)) <= 0:
        g = nvfp4_global_scale(xf.abs().amax()) if xf.numel() else torch.ones(())
    g = torch.as_tensor(g, dtype=torch.float32).reshape(())
    return nvfp4_quantize_unscaled(xf, ACT_BLOCK, g), g


def p48_alpha(w_global: torch.Tensor, act_global: torch.Tensor | None) -> torch.Tensor:
    """The epilogue factor: 1/(g_w*g_a) in W4A4, 1/g_w in W4A16 (float32)."""
    w_global = w_global.float()
    if act_global is None:
        return 1.0 / w_global
    return 1.0 / (w_global * act_global.float())


def p48_linear_ref(x: torch.Tensor, w: P48Weight, act_quant: bool) -> torch.Tensor:
    """One expert linear, kernel numerics: x [N, K] -> [N, out] float32. w is a single (unstacked) weight."""
    if w.codes.dim() != 2:
        raise ValueError(f"p48_linear_ref takes one weight [out, in], got codes of shape {tuple(w.codes.shape)}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"activation width {x.shape[-1]} != weight in_features {w.in_features}")
    if act_quant:
        xu, g = quantize_act_unscaled(x, w.input_global_scale)
        alpha = p48_alpha(w.global_scale, g)
    else:
        xu, alpha = x.float(), p48_alpha(w.global_scale, None)
    return (xu @ w.unscaled().T) * alpha


def p48_grouped_ref(x: torch.Tensor, counts: torch.Tensor, w: P48Weight, act_quant: bool) -> torch.Tensor:
    """Capacity-batched grouped GEMM: x [E, C, K], counts [E] (rows < counts[e] are valid) -> [E, C, out]
    float32 with rows >= counts[e] zero. w is a stack [E, out, K]. In W4A4 each expert's valid rows are
    quantized with that expert's input global scale (0 = dynamic over those rows)."""
    E, C, _ = x.shape
    if w.codes.dim() != 3 or w.codes.shape[0] != E:
        raise ValueError(f"expected a weight stack of {E} experts, got codes {tuple(w.codes.shape)}")
    out = torch.zeros(E, C, w.out_features, dtype=torch.float32)
    for e in range(E):
        n = int(counts[e])
        if n:
            we = P48Weight(w.codes[e], w.scales[e], w.global_scale[e], w.input_global_scale[e])
            out[e, :n] = p48_linear_ref(x[e, :n], we, act_quant)
    return out


def expert_weights(packed_expert: dict[str, dict[str, torch.Tensor]], name: str = "") -> dict[str, P48Weight]:
    """{"gate"|"up"|"down": {suffix: tensor}} -> decoded weights, checking gate/up/down shapes agree."""
    missing = [p for p in PROJS if p not in packed_expert]
    if missing:
        raise ValueError(f"{name or 'expert'}: missing projection(s) {missing}; need gate, up and down")
    w = {p: decode_p48(packed_expert[p], f"{name}.{p}" if name else p) for p in PROJS}
    if w["gate"].codes.shape != w["up"].codes.shape:
        raise ValueError(f"{name or 'expert'}: gate {tuple(w['gate'].codes.shape)} and up "
                         f"{tuple(w['up'].codes.shape)} differ")
    inter, hidden = w["gate"].codes.shape
    if tuple(w["down"].codes.shape) != (hidden, inter):
        raise ValueError(f"{name or 'expert'}: down is {tuple(w['down'].codes.shape)}, expected {(hidden, inter)}")
    return w


def expert_forward_ref(x: torch.Tensor, w: dict[str, P48Weight], act_quant: bool) -> torch.Tensor:
    """One expert on its routed rows x [n, H] -> [n, H] float32: SwiGLU MLP in kernel numerics.

    gate and up read the same input, quantized once with gate's input global scale (as the loader does).
    """
    gate = p48_linear_ref(x, w["gate"], act_quant)
    up_w = w["up"]
    up_in_gate_scale = P48Weight(up_w.codes, up_w.scales, up_w.global_scale, w["gate"].input_global_scale)
    up = p48_linear_ref(x, up_in_gate_scale, act_quant)
    return p48_linear_ref(F.silu(gate) * up, w["down"], act_quant)


def p48_moe_ref(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                experts: list[dict[str, P48Weight]], act_quant: bool) -> torch.Tensor:
    """Routed experts forward: hidden [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H] float32.

    Each token's output is sum_j w[t, j] * expert_{idx[t, j]}(x_t), summed in j order (as the GPU combine does).
    """
    T, k = top_k_index.shape
    H = hidden_states.shape[-1]
    y = torch.zeros(T, k, H, dtype=torch.float32)
    idx = top_k_index.cpu()
    for e in torch.unique(idx).tolist():
        if not 0 <= e < len(experts):
            raise ValueError(f"top_k_index holds expert {e}, but there are {len(experts)} experts")
        t, j = torch.nonzero(idx == e, as_tuple=True)
        y[t, j] = expert_forward_ref(hidden_states.cpu()[t], experts[e], act_quant)
    w = top_k_weights.cpu().float()
    out = torch.zeros(T, H, dtype=torch.float32)
    for j in range(k):
        out += w[:, j, None] * y[:, j]
    return out
