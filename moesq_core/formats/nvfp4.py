"""Building blocks shared by the NVFP4 formats (p48-nvfp4, dense-nvfp4): the compressed-tensors config and the
dense packed tensors (`weight_packed`, `weight_scale`, `weight_global_scale`) both store.

Dense packed NVFP4, per linear [out, in] with `block`-column scales:

    weight_packed         uint8          [out, in/2]      2 E2M1 codes per byte, lower K in the low nibble
    weight_scale          float8_e4m3fn  [out, in/block]  one UE4M3 scale per `block` columns
    weight_global_scale   float32        [1]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moesq_core.formats.base import Format, QuantizedWeight, compressed_tensors_config
from moesq_core.formats.pack_common import (
    check_divisible,
    check_tensor,
    full_name,
    global_to_packed,
    nibbles_to_bytes,
    primary_dims,
    select,
    to_e4m3,
)

DENSE_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
# what verify requires finite and > 0 in every NVFP4 layout
POSITIVE = (("weight_scale", "block scale"), ("weight_global_scale", "weight global scale"))


def dense_tensors(qw: QuantizedWeight, lead: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {
        "weight_packed": nibbles_to_bytes(qw.codes).contiguous(),
        "weight_scale": to_e4m3(qw.scales, "scales").contiguous(),
        "weight_global_scale": global_to_packed(qw.global_scale, lead),
    }


def dense_logical_shape(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    p = tensors["weight_packed"]
    return (*p.shape[:-1], p.shape[-1] * 2)


def read_dense(tensors: dict[str, torch.Tensor], name: str, layout: str, block: int, need: int):
    """Validated (tensors, lead dims, out, in) of a dense packed NVFP4 linear with `block`-column scales."""
    t = select(tensors, DENSE_SUFFIXES, layout, name)
    tn = lambda s: full_name(name, s)  # noqa: E731
    packed = t["weight_packed"]
    lead, out, inn = primary_dims(packed, tn("weight_packed"), 2, "[out, in/2]")
    check_divisible(
        inn, need, tn("weight_packed"), f"{inn // 2} packed bytes per row = {inn} columns, layout {layout!r}"
    )
    check_tensor(packed, torch.uint8, packed.shape, tn("weight_packed"))
    check_tensor(t["weight_scale"], torch.float8_e4m3fn, (*lead, out, inn // block), tn("weight_scale"))
    check_tensor(t["weight_global_scale"], torch.float32, (*lead, 1), tn("weight_global_scale"))
    return t, lead, out, inn


@dataclass(frozen=True)
class NVFP4Format(Format):
    """compressed-tensors `nvfp4-pack-quantized` from its NVFP4 preset with the format's block sizes, plus the
    release's top-level `group_size` copy (read by its vLLM patch)."""

    def compressed_tensors_config(self, ignore: list[str], act_quant: bool) -> dict:
        qc = compressed_tensors_config("NVFP4", "nvfp4-pack-quantized", ignore, act_quant,
                                       {"group_size": self.scale_block}, {"group_size": self.act.block})
        qc["group_size"] = self.scale_block
        return qc
