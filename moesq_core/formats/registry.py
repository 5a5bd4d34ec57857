"""Named formats: a sparsity pattern set + a weight quantizer + an activation quantizer.

Algorithms are written against `Format`, never against one format. `QuantizedWeight` is the canonical
compressed state of one linear: what packers write and what the runtime dequantizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .patterns import DENSE, P48, S24, PatternSet
from .quantizers import (
    FP8ChannelQuantizer,
    FP8TokenActQuantizer,
    NVFP4ActQuantizer,
    NVFP4Quantizer,
)


@dataclass
class QuantizedWeight:
    """One compressed linear: uint8 codes (E2M1 nibbles or e4m3 bytes, pruned entries code 0),
    scales ([out, in/block] or [out, 1]), fp32 global scale (scalar) and the kept-entry mask."""

    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    mask: torch.Tensor

    @property
    def fmt(self) -> "Format":
        return get_format(self.format)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        w = self.fmt.weight.decode(self.codes, self.scales, self.global_scale)
        return w * self.mask

    def to(self, device) -> "QuantizedWeight":
        return QuantizedWeight(self.format, *(t.to(device) for t in (self.codes, self.scales, self.global_scale, self.mask)))

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {
            prefix + "codes": self.codes.contiguous(),
            prefix + "scales": self.scales.float().contiguous(),
            prefix + "global_scale": self.global_scale.float().reshape(()).contiguous(),
            prefix + "mask": self.mask.contiguous(),
        }

    @classmethod
    def from_state_dict(cls, fmt: str, sd: dict[str, torch.Tensor], prefix: str = "") -> "QuantizedWeight":
        return cls(fmt, sd[prefix + "codes"], sd[prefix + "scales"], sd[prefix + "global_scale"], sd[prefix + "mask"])


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    patterns: PatternSet
    weight: NVFP4Quantizer | FP8ChannelQuantizer
    act: NVFP4ActQuantizer | FP8TokenActQuantizer
    bits_per_weight: float  # stored bits per logical weight, scales and metadata included

    @property
    def scale_block(self) -> int:
        return self.weight.block

    def check_weight(self, w: torch.Tensor, what: str = "weight") -> None:
        """Clear errors for what the format cannot hold (shape) or should never see (NaN/Inf)."""
        if w.dim() != 2:
            raise ValueError(f"{what}: expected a 2-D weight, got shape {tuple(w.shape)}")
        self.patterns.check_shape(w.shape[-1], self.scale_block, f"{what} for format {self.name}")
        if not bool(torch.isfinite(w).all()):
            bad = (~torch.isfinite(w)).nonzero()[0].tolist()
            raise ValueError(f"{what}: non-finite value at {bad}; refusing to compress NaN/Inf weights")

    def magnitude_mask(self, w: torch.Tensor) -> torch.Tensor:
        return self.patterns.best_mask(w.detach().float().abs())

    def global_scale(self, *weights: torch.Tensor) -> torch.Tensor:
        return self.weight.global_scale(*weights)

    def quantize(self, w: torch.Tensor, mask: torch.Tensor | None = None, global_scale: torch.Tensor | None = None) -> QuantizedWeight:
        """Round-to-nearest in this format. mask defaults to magnitude selection; global scale to w's own.

        The global scale is taken from the masked weight unless given (gate/up share one: pass it).
        """
        w = w.detach().float()
        if mask is None:
            mask = self.magnitude_mask(w)
        mask = mask.bool()
        wm = w * mask
        g = self.global_scale(wm) if global_scale is None else global_scale.float().reshape(())
        scales = self.weight.block_scales(wm, g)
        codes = self.weight.encode(wm, scales, g) * mask
        return QuantizedWeight(self.name, codes.to(torch.uint8), scales, g, mask)

    def fake_quant_weight(self, w: torch.Tensor, mask: torch.Tensor | None = None, global_scale: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        """Differentiable quantize-dequantize of (masked) w; scales from w itself, detached."""
        if mask is not None:
            w = w * mask
        return self.weight.fake_quant(w, global_scale, ste=ste)

    def quant_act(self, x: torch.Tensor, global_scale: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        return self.act(x, global_scale, ste=ste)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "p48-nvfp4",
            "paired 4:8 sparse NVFP4, 32-column UE4M3 scales, W4A4 (Blackwell sparse tensor cores)",
            P48, NVFP4Quantizer(32), NVFP4ActQuantizer(32), 2.75,
        ),
        Format(
            "dense-nvfp4",
            "dense NVFP4, 16-column UE4M3 scales, W4A4 (the paper's dense baseline)",
            DENSE, NVFP4Quantizer(16), NVFP4ActQuantizer(16), 4.5,
        ),
        Format(
            "s24-fp8",
            "2:4 sparse e4m3, per-channel fp32 scales, W8A8 per-token (Hopper sparse tensor cores)",
            S24, FP8ChannelQuantizer(), FP8TokenActQuantizer(), 5.0,
        ),
    )
}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose one of: {', '.join(FORMATS)}") from None
