"""`dense-fp8`: dense e4m3 weights with one fp32 scale per output channel, dynamic per-token e4m3 activations
(W8A8) — compressed-tensors' `float-quantized` format from its FP8_DYNAMIC preset, which stock serving engines
(vLLM) load.

On disk, per linear [out, in] (leading expert dims allowed):

    weight        float8_e4m3fn  [out, in]  the e4m3 values
    weight_scale  float32        [out, 1]   dequantized weight = value * scale

= 8 bits per weight plus 32 bits per row; no global scale, no activation tensors. The layout has no mask, so
a dense-fp8 QuantizedWeight must keep everything.
"""
from __future__ import annotations

import torch

from moesq_core.formats.base import Layout, QuantizedWeight
from moesq_core.formats.fp8 import ROW_SCALE, FP8Format, check_unit_global, row_scales, unit_global
from moesq_core.formats.pack_common import (
    PackingError,
    check_divisible,
    check_qw,
    check_scale_shape,
    check_tensor,
    first_index,
    full_name,
    primary_dims,
    select,
)
from moesq_core.formats.patterns import DENSE
from moesq_core.formats.quantizers import FP8ChannelQuantizer, FP8TokenActQuantizer

NAME = "dense-fp8"
SUFFIXES = ("weight", "weight_scale")


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    lead, out, inn = check_qw(qw, NAME)
    check_scale_shape(qw, (*lead, out, 1))
    check_unit_global(qw)
    pruned = ~qw.mask.bool()
    if bool(pruned.any()):
        raise PackingError("mask", f"{NAME} stores no mask, but this weight prunes entries; pack a sparse weight "
                                   "in its own format", first_index(pruned))
    nan = (qw.codes & 0x7F) == 0x7F
    if bool(nan.any()):
        pos = first_index(nan)
        raise PackingError("codes", f"e4m3 NaN code 0x{int(qw.codes[pos]):02X}", pos)
    return {"weight": qw.codes.contiguous().view(torch.float8_e4m3fn).clone(), "weight_scale": row_scales(qw)}


def logical_shape(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(tensors["weight"].shape)


def unpack(tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    t = select(tensors, SUFFIXES, NAME, name)
    tn = lambda s: full_name(name, s)  # noqa: E731
    w = t["weight"]
    lead, out, inn = primary_dims(w, tn("weight"), 1, "[out, in]")
    check_divisible(inn, 1, tn("weight"), "an empty row")
    check_tensor(w, torch.float8_e4m3fn, w.shape, tn("weight"))
    check_tensor(t["weight_scale"], torch.float32, (*lead, out, 1), tn("weight_scale"))
    codes = w.view(torch.uint8).clone()
    mask = torch.ones_like(codes, dtype=torch.bool)
    return QuantizedWeight(NAME, codes, t["weight_scale"].clone(), unit_global(lead, w.device), mask)


FORMAT = FP8Format(
    NAME, "dense e4m3, per-channel fp32 scales, W8A8 per-token (compressed-tensors float-quantized; vLLM's FP8)",
    DENSE, FP8ChannelQuantizer(), FP8TokenActQuantizer(), 8.0,
    layouts=(Layout(NAME, NAME, SUFFIXES, pack, unpack, logical_shape, ROW_SCALE, "weight"),),
    scheme="W8A8", act_label="FP8",
    stock_serving=True,
    card_tags=("fp8", "compressed-tensors"),
    card_loaders=(
        "`moesq generate DIR --prompt ...` or `moesq_core.load_packed(DIR)`.",
        "vLLM and other compressed-tensors `float-quantized` consumers (channel-wise FP8 weights, dynamic per-token "
        "FP8 activations; the standard layout).",
        "Without `import moesq_core`, transformers' `AutoModelForCausalLM.from_pretrained` runs it weights-only (no "
        "FP8 activations), not the W8A8 model the other loaders serve.",
    ),
    ct_format="float-quantized",
)
