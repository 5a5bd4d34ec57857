"""Weight and activation quantizers: NVFP4 (E2M1 values + UE4M3 block scales + fp32 global scale) and FP8.

Every quantizer works on float32 and returns float32 tensors whose values are exactly representable in the
target format, so CPU and GPU give identical numbers. `ste=True` passes gradients straight through the
rounding (scales are detached), which is what refinement trains through.

All weight quantizers share one interface (solvers and the refine trainer ask it instead of testing types):
`block` (input columns per scale, 0 = one per row), `max_value` (the largest magnitude a code holds),
`rounds_scales` (stored scales are a rounded projection of the fp32 ones), `global_scale(s)`,
`block_scales`, `unrounded_block_scales`, `round_scales`, `encode`/`decode`, `code_values` (float value of every
uint8 code), `column` (the quantizer one column of a scale block sees) and `fake_quant`. Weights may carry leading
(expert) dimensions throughout. Activation quantizers share `uses_global_scale`, `global_from_amax`,
`batched`, `swiglu_quant`, `packed_tensors` and `__call__`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moesq_core.formats.e2m1 import E2M1_GRID, E2M1_MAX, e2m1_decode, e2m1_encode, round_e2m1
from moesq_core.formats.e4m3 import E4M3_MAX, E4M3_MIN_SUBNORMAL, round_e4m3, round_ue4m3_scale


def _ste(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    return x + (xq - x).detach()


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """g = 448 * 6 / amax; 1.0 for an all-zero tensor."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax.clamp_min(1e-30), torch.ones_like(amax))


def act_global_from_amax(amax: torch.Tensor | None) -> torch.Tensor | None:
    """Calibrated activation global scales g = 448*6/amax; 0 where no range was seen (dynamic then)."""
    if amax is None:
        return None
    amax = amax.float()
    return torch.where(amax > 0, nvfp4_global_scale(amax), torch.zeros_like(amax))


def input_global_scales(amax: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """Static activation global scales per expert [E] and how many fell back.

    An expert no calibration token reached has no range; serving engines compute 1/scale and take the max over
    a layer's experts, so 0 or inf would break the whole layer. Such experts get the layer-level scale
    calibrated from the largest range seen in the layer, or 1.0 when the layer saw none."""
    if amax is None:
        return None, 0
    g = act_global_from_amax(amax).float().reshape(-1)
    ok = torch.isfinite(g) & (g > 0)
    if bool(ok.all()):
        return g, 0
    seen = amax.float().reshape(-1)[ok]
    fallback = act_global_from_amax(seen.max().reshape(1))[0] if seen.numel() else torch.tensor(1.0)
    if not (torch.isfinite(fallback) and fallback > 0):
        fallback = torch.tensor(1.0)
    return torch.where(ok, g, fallback), int((~ok).sum())


def nvfp4_quantize_unscaled(x: torch.Tensor, block: int, g: torch.Tensor) -> torch.Tensor:
    """E2M1 values times their stored UE4M3 block scale (exact; divide by g for the quantized x).

    The one NVFP4 quantization: weights, activations and the kernels' CPU reference all go through it."""
    xf = x.float().detach()
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // block, block)
    s = round_ue4m3_scale(blocks.abs().amax(-1) / E2M1_MAX * g).unsqueeze(-1)
    g = g.unsqueeze(-1) if torch.is_tensor(g) and g.dim() else g  # g broadcasts over x: over its blocks too
    return round_e2m1(blocks * g / s).mul_(s).reshape(xf.shape)


def swiglu_quant_reference(act, gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor | None, ste: bool,
                           out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops of `swiglu_quant` for activation quantizer `act`: h = silu(gate) ⊙ up in fp32, its range per
    expert, act.batched(h, g) cast to out_dtype."""
    h = F.silu(gate.float()) * up.float()
    return act.batched(h, g, ste=ste).to(out_dtype), h.detach().abs().amax(dim=(1, 2))


@dataclass(frozen=True)
class NVFP4Quantizer:
    """E2M1 values, one UE4M3 scale per `block` consecutive input columns, one fp32 global scale per tensor."""

    block: int
    max_value = E2M1_MAX
    rounds_scales = True  # stored scales are UE4M3 projections of the fp32 ones

    def global_scale(self, *weights: torch.Tensor) -> torch.Tensor:
        """One global scale for all given tensors (gate and up of an expert share one)."""
        amax = torch.stack([w.detach().float().abs().amax() for w in weights]).amax()
        return nvfp4_global_scale(amax)

    def global_scales(self, *weights: torch.Tensor) -> torch.Tensor:
        """`global_scale` per index of the leading (expert) dimension: [E] for weights [E, ...]."""
        amax = torch.stack([w.detach().float().abs().flatten(1).amax(1) for w in weights]).amax(0)
        return nvfp4_global_scale(amax)

    def block_scales(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Stored (e4m3-projected) block scales [..., in/block] of w under global scale g."""
        blocks = w.detach().float().reshape(*w.shape[:-1], -1, self.block)
        return round_ue4m3_scale(blocks.abs().amax(-1) / E2M1_MAX * g)

    def unrounded_block_scales(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The fp32 block scales before the UE4M3 projection (2^-9 for an all-zero block)."""
        amax = w.detach().float().reshape(*w.shape[:-1], -1, self.block).abs().amax(-1)
        return torch.where(amax > 0, amax / E2M1_MAX * g, torch.full_like(amax, E4M3_MIN_SUBNORMAL))

    def round_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """fp32 scales -> the stored ones (UE4M3)."""
        return round_ue4m3_scale(scales)

    def expand(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.repeat_interleave(self.block, dim=-1) if self.block > 1 else scales

    def column(self) -> "NVFP4Quantizer":
        """The quantizer of one column (a column of a block shares the block's scale: same numbers)."""
        return replace(self, block=1)

    def code_values(self) -> torch.Tensor:
        """float32 value of each of the 16 codes (sign << 3 | magnitude index)."""
        grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
        return torch.cat([grid, -grid])

    def encode(self, w: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """uint8 E2M1 codes of w under given scales."""
        return e2m1_encode(w.float() * g / self.expand(scales))

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return e2m1_decode(codes) * self.expand(scales) / g

    def decode_factored(self, codes: torch.Tensor, scales: torch.Tensor,
                        g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [..., out, in], row factors [..., out]) with decode = values x the row factor: E2M1 values times
        their UE4M3 block scale (at most 6 significant bits: exact in bf16) and 1/g."""
        values = e2m1_decode(codes) * self.expand(scales)
        return values, (1.0 / torch.as_tensor(g, dtype=torch.float32, device=values.device)).expand(values.shape[:-1])

    def fake_quant(self, w: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        """Quantize-dequantize with scales computed from w itself (detached)."""
        wf = w.float()
        if g is None:
            g = self.global_scale(wf)
        q = nvfp4_quantize_unscaled(wf, self.block, g) / g
        return _ste(wf, q) if ste else q


@dataclass(frozen=True)
class NVFP4ActQuantizer:
    """Dynamic NVFP4 activations: per token, `block` elements along K share a UE4M3 scale.

    The global scale is the tensor's own (dynamic) unless a calibrated static one is given: serving with a
    fixed 1.0 pushes small activations into e4m3 subnormals (a fault of the public release).
    """

    block: int = 32
    uses_global_scale = True

    def __call__(self, x: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        return NVFP4Quantizer(self.block).fake_quant(x, g, ste=ste)

    def global_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """Global scale(s) for activations of range amax (1.0 where amax is 0)."""
        return nvfp4_global_scale(amax.float())

    def batched(self, x: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        """x [E, C, D] with per-expert global scales g [E, 1, 1] (default: each expert's own amax)."""
        if g is None:
            g = nvfp4_global_scale(x.detach().abs().amax(dim=(1, 2))).reshape(-1, 1, 1)
        return self(x, g, ste=ste)

    def batched_factored(self, x: torch.Tensor, g: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`batched(x, g)` as (values, factors) with batched = values x factors: the E2M1 values times their UE4M3
        block scale (exact in bf16) and 1/g [E, 1, 1] (no gradient)."""
        if g is None:
            g = nvfp4_global_scale(x.detach().abs().amax(dim=(1, 2))).reshape(-1, 1, 1)
        return nvfp4_quantize_unscaled(x, self.block, g), 1.0 / g

    @property
    def fused_swiglu_block(self) -> int:
        """The scale block of the arithmetic a fused SwiGLU + NVFP4 activation kernel computes for this quantizer
        (refinement's swiglu_quant_triton)."""
        return self.block

    def swiglu_quant(self, gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False,
                     out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(batched(silu(gate) ⊙ up, g) in out_dtype, amax of silu(gate) ⊙ up per expert [E]) from the gate and up
        matmul outputs [E, C, D] (h in fp32), by the torch ops (swiglu_quant_reference)."""
        return swiglu_quant_reference(self, gate, up, g, ste, out_dtype)

    def packed_tensors(self, g: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """What a packed linear stores for its input: the static global scale (1.0 when none)."""
        return {"input_global_scale": (g if g is not None else torch.tensor(1.0)).float().reshape(1).clone()}


@dataclass(frozen=True)
class FP8ChannelQuantizer:
    """e4m3 values with one fp32 scale per output channel (row): s = amax_row / 448."""

    block: int = 0  # 0 = the whole row shares one scale
    max_value = E4M3_MAX
    rounds_scales = False  # fp32 scales are stored as they are

    def global_scale(self, *weights: torch.Tensor) -> torch.Tensor:
        return torch.ones((), dtype=torch.float32)

    def global_scales(self, *weights: torch.Tensor) -> torch.Tensor:
        """[E] ones for weights [E, ...] (FP8 has no global scale)."""
        return torch.ones(weights[0].shape[0], dtype=torch.float32, device=weights[0].device)

    def block_scales(self, w: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        amax = w.detach().float().abs().amax(-1, keepdim=True)
        return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))

    unrounded_block_scales = block_scales

    def round_scales(self, scales: torch.Tensor) -> torch.Tensor:
        return scales

    def expand(self, scales: torch.Tensor) -> torch.Tensor:
        return scales

    def column(self) -> "FP8ChannelQuantizer":
        return self

    def code_values(self) -> torch.Tensor:
        """float32 value of each of the 256 e4m3 bit patterns (NaN for the two NaN codes)."""
        return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()

    def encode(self, w: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 bit patterns of the float8_e4m3fn values."""
        return round_e4m3(w.float() / scales).to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).float() * scales

    def decode_factored(self, codes: torch.Tensor, scales: torch.Tensor,
                        g: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, row factors) with decode = values x the row factor: the e4m3 values (exact in bf16) and the
        per-channel scales."""
        return codes.view(torch.float8_e4m3fn).float(), scales.float().reshape(scales.shape[:-1])

    def fake_quant(self, w: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        wf = w.float()
        s = self.block_scales(wf)
        q = round_e4m3(wf.detach() / s) * s
        return _ste(wf, q) if ste else q


@dataclass(frozen=True)
class FP8TokenActQuantizer:
    """Dynamic per-token e4m3 activations (W8A8): no global scale, nothing stored."""

    uses_global_scale = False

    def __call__(self, x: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        return FP8ChannelQuantizer().fake_quant(x, ste=ste)

    def global_from_amax(self, amax: torch.Tensor) -> None:
        return None

    def batched(self, x: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        return self(x, ste=ste)

    def batched_factored(self, x: torch.Tensor, g: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`batched(x)` as (values, factors): the e4m3 values (exact in bf16) and each token's scale [.., C, 1]."""
        xf = x.detach().float()
        s = FP8ChannelQuantizer().block_scales(xf)
        return round_e4m3(xf / s), s

    def swiglu_quant(self, gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False,
                     out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """As NVFP4ActQuantizer.swiglu_quant, through the torch ops (no fused kernel for per-token FP8)."""
        return swiglu_quant_reference(self, gate, up, g, ste, out_dtype)

    def packed_tensors(self, g: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return {}
