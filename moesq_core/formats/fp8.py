"""Building blocks shared by the FP8 formats (s24-fp8, dense-fp8): e4m3 weights with one fp32 scale per output
row (`weight_scale` float32 [out, 1], dequantized weight = value * scale), no global scale, dynamic per-token
e4m3 activations (nothing stored for them), and a compressed-tensors config from its FP8_DYNAMIC preset
(channel-wise weights, dynamic per-token activations)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moesq_core.formats.base import Format, QuantizedWeight, compressed_tensors_config
from moesq_core.formats.pack_common import PackingError, first_index

ROW_SCALE = (("weight_scale", "row scale"),)  # what verify requires finite and > 0


def check_unit_global(qw: QuantizedWeight) -> None:
    g = qw.global_scale.float()
    if bool((g != 1).any()):
        raise PackingError(
            "global_scale", f"{qw.format} stores no global scale, so it must be 1.0 (got {g.flatten()[0].item()})"
        )


def row_scales(qw: QuantizedWeight) -> torch.Tensor:
    """The fp32 row scales to store (a copy: never alias the QuantizedWeight's tensors)."""
    scale = qw.scales.float()
    if not bool(torch.isfinite(scale).all()):
        bad = ~torch.isfinite(scale)
        raise PackingError("scales", f"non-finite scale {scale[bad][0].item()}", first_index(bad))
    return scale.clone()


def unit_global(lead: tuple[int, ...], device) -> torch.Tensor:
    """The global scale of an unpacked FP8 weight: 1 (a scalar, or [*lead, 1, 1] for a stack)."""
    g = torch.ones((), dtype=torch.float32) if not lead else torch.ones(*lead, 1, 1, dtype=torch.float32)
    return g.to(device)


@dataclass(frozen=True)
class FP8Format(Format):
    ct_format: str = "float-quantized"  # quantization_config.format
    ct_format_note: str = ""  # why, in verify's message when it differs

    def compressed_tensors_config(self, ignore: list[str], act_quant: bool) -> dict:
        return compressed_tensors_config("FP8_DYNAMIC", self.ct_format, ignore, act_quant)

    def check_config(self, qc: dict, config: dict) -> list[tuple[str, str]]:
        out = super().check_config(qc, config)
        if qc.get("format") != self.ct_format:
            out.append(("error", f"quantization_config.format is {qc.get('format')!r}; {self.name} must be "
                                 f"{self.ct_format!r}{self.ct_format_note}"))
        return out
