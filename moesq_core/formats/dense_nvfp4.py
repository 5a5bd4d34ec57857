"""`dense-nvfp4`: dense NVFP4 with 16-column UE4M3 scales, W4A4 (the paper's dense baseline).

On disk (compressed-tensors `nvfp4-pack-quantized`), per linear [out, in], in a multiple of 16:

    weight_packed         uint8          [out, in/2]   2 E2M1 codes per byte, lower K in the low nibble
    weight_scale          float8_e4m3fn  [out, in/16]  one UE4M3 scale per 16 columns
    weight_global_scale   float32        [1]

= 4 + 0.5 = 4.5 bits per weight. The layout has no mask, so a dense-nvfp4 QuantizedWeight must keep everything.
"""
from __future__ import annotations

import torch

from moesq_core.formats.base import Layout, QuantizedWeight
from moesq_core.formats.nvfp4 import (
    DENSE_SUFFIXES,
    POSITIVE,
    NVFP4Format,
    dense_logical_shape,
    dense_tensors,
    read_dense,
)
from moesq_core.formats.pack_common import (
    PackingError,
    bytes_to_nibbles,
    check_divisible,
    check_nibble_codes,
    check_qw,
    check_scale_shape,
    first_index,
    global_from_packed,
)
from moesq_core.formats.patterns import DENSE
from moesq_core.formats.quantizers import NVFP4ActQuantizer, NVFP4Quantizer

NAME = "dense-nvfp4"
SCALE_BLOCK = 16


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    lead, out, inn = check_qw(qw, NAME)
    check_divisible(inn, SCALE_BLOCK, "codes", "dense-nvfp4 has 16-column scale blocks")
    check_scale_shape(qw, (*lead, out, inn // SCALE_BLOCK))
    check_nibble_codes(qw.codes)
    pruned = ~qw.mask.bool()
    if bool(pruned.any()):
        raise PackingError(
            "mask",
            "dense-nvfp4 stores no mask, but this weight prunes entries; pack a sparse weight in its own format",
            first_index(pruned),
        )
    return dense_tensors(qw, lead)


def unpack(tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    t, lead, out, inn = read_dense(tensors, name, NAME, SCALE_BLOCK, SCALE_BLOCK)
    codes = bytes_to_nibbles(t["weight_packed"])
    mask = torch.ones_like(codes, dtype=torch.bool)
    return QuantizedWeight(
        NAME, codes, t["weight_scale"].float(), global_from_packed(t["weight_global_scale"], lead), mask
    )


FORMAT = NVFP4Format(
    NAME, "dense NVFP4, 16-column UE4M3 scales, W4A4 (the paper's dense baseline)",
    DENSE, NVFP4Quantizer(SCALE_BLOCK), NVFP4ActQuantizer(SCALE_BLOCK), 4.5,
    layouts=(Layout(NAME, NAME, DENSE_SUFFIXES, pack, unpack, dense_logical_shape, POSITIVE),),
    scheme="W4A4", act_label="NVFP4",
    stock_serving=True,
    card_tags=("nvfp4", "compressed-tensors"),
    card_loaders=(
        "`moesq generate DIR --prompt ...` or `moesq_core.load_packed(DIR)`.",
        "vLLM and other compressed-tensors `nvfp4-pack-quantized` consumers (standard layout).",
        "Without `import moesq_core`, transformers' `AutoModelForCausalLM.from_pretrained` loads it without an error "
        "but returns experts multiplied by their global scale (wrong outputs).",
    ),
)
