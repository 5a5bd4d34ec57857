"""Weight and activation quantizers: NVFP4 (E2M1 values + UE4M3 block scales + fp32 global scale) and FP8.

Every quantizer works on float32 and returns float32 tensors whose values are exactly representable in the
target format, so CPU and GPU give identical numbers. `ste=True` passes gradients straight through the
rounding (scales are detached), which is what refinement trains through.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .e2m1 import E2M1_MAX, e2m1_decode, e2m1_encode
from .e4m3 import E4M3_MAX, round_e4m3, round_ue4m3_scale


def _ste(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    return x + (xq - x).detach()


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """g = 448 * 6 / amax; 1.0 for an all-zero tensor."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax.clamp_min(1e-30), torch.ones_like(amax))


@dataclass(frozen=True)
class NVFP4Quantizer:
    """E2M1 values, one UE4M3 scale per `block` consecutive input columns, one fp32 global scale per tensor."""

    block: int

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

    def expand(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.repeat_interleave(self.block, dim=-1)

    def encode(self, w: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """uint8 E2M1 codes of w under given scales."""
        return e2m1_encode(w.float() * g / self.expand(scales))

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return e2m1_decode(codes) * self.expand(scales) / g

    def fake_quant(self, w: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        """Quantize-dequantize with scales computed from w itself (detached)."""
        wf = w.float()
        if g is None:
            g = self.global_scale(wf)
        s = self.expand(self.block_scales(wf, g))
        q = e2m1_decode(e2m1_encode(wf.detach() * g / s)) * s / g
        return _ste(wf, q) if ste else q


@dataclass(frozen=True)
class NVFP4ActQuantizer:
    """Dynamic NVFP4 activations: per token, `block` elements along K share a UE4M3 scale.

    The global scale is the tensor's own (dynamic) unless a calibrated static one is given: serving with a
    fixed 1.0 pushes small activations into e4m3 subnormals (a fault of the public release).
    """

    block: int = 32

    def __call__(self, x: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        return NVFP4Quantizer(self.block).fake_quant(x, g, ste=ste)


@dataclass(frozen=True)
class FP8ChannelQuantizer:
    """e4m3 values with one fp32 scale per output channel (row): s = amax_row / 448."""

    block: int = 0  # 0 = the whole row shares one scale

    def global_scale(self, *weights: torch.Tensor) -> torch.Tensor:
        return torch.ones((), dtype=torch.float32)

    def global_scales(self, *weights: torch.Tensor) -> torch.Tensor:
        """[E] ones for weights [E, ...] (FP8 has no global scale)."""
        return torch.ones(weights[0].shape[0], dtype=torch.float32, device=weights[0].device)

    def block_scales(self, w: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        amax = w.detach().float().abs().amax(-1, keepdim=True)
        return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))

    def expand(self, scales: torch.Tensor) -> torch.Tensor:
        return scales

    def encode(self, w: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 bit patterns of the float8_e4m3fn values."""
        return round_e4m3(w.float() / scales).to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).float() * scales

    def fake_quant(self, w: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        wf = w.float()
        s = self.block_scales(wf)
        q = round_e4m3(wf.detach() / s) * s
        return _ste(wf, q) if ste else q


@dataclass(frozen=True)
class FP8TokenActQuantizer:
    """Dynamic per-token e4m3 activations (W8A8)."""

    def __call__(self, x: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        return FP8ChannelQuantizer().fake_quant(x, ste=ste)
