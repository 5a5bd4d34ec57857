"""Dense packed NVFP4 on disk: `dense-nvfp4`, and `dense-p48`, the release's dense variant of p48.

`dense-nvfp4` (compressed-tensors `nvfp4-pack-quantized`), per linear [out, in], in a multiple of 16:

    weight_packed         uint8          [out, in/2]   2 E2M1 codes per byte, lower K in the low nibble
    weight_scale          float8_e4m3fn  [out, in/16]  one UE4M3 scale per 16 columns
    weight_global_scale   float32        [1]

= 4 + 0.5 = 4.5 bits per weight. The layout has no mask, so a dense-nvfp4 QuantizedWeight must keep everything.

`dense-p48` stores a `p48-nvfp4` QuantizedWeight with the same three tensors but 32-column scales
(weight_scale [out, in/32], 4.25 bits per weight) and the pruned bytes (pairs) zero. Choose it with
`pack(qw, layout="dense-p48")`; `unpack("p48-nvfp4", tensors)` recognises it by its `weight_packed` tensor.
Being unmasked, it cannot tell a kept pair that quantized to zero from a pruned one: unpack keeps the nonzero
bytes of each 4-byte chunk and completes chunks with fewer than 2 with their lowest-index zero bytes (the
release's rule), so codes, scales and global scale round trip exactly and the mask only where no kept pair is
all zero. A chunk with more than 2 nonzero bytes is rejected.
"""
from __future__ import annotations

import torch

from ..formats import QuantizedWeight
from . import p48
from ._common import (
    PackingError,
    bytes_to_nibbles,
    check_divisible,
    check_nibble_codes,
    check_qw,
    check_scale_shape,
    check_tensor,
    complete_kept,
    first_index,
    full_name,
    global_from_packed,
    global_to_packed,
    kept_to_nibble,
    nibbles_to_bytes,
    select,
    to_e4m3,
)

LAYOUT = "dense-nvfp4"
FORMAT = "dense-nvfp4"
P48_LAYOUT = "dense-p48"
SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
SCALE_BLOCK = 16
P48_SCALE_BLOCK = p48.SCALE_BLOCK


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    lead, out, inn = check_qw(qw, FORMAT)
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
    return _tensors(qw, lead)


def pack_p48(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """A p48-nvfp4 QuantizedWeight, stored densely (pruned bytes zero, 32-column scales)."""
    p48.pair_chunks(qw)  # validates paired 4:8 structure; pruned bytes are already zero
    return _tensors(qw, tuple(qw.codes.shape[:-2]))


def _tensors(qw: QuantizedWeight, lead: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {
        "weight_packed": nibbles_to_bytes(qw.codes).contiguous(),
        "weight_scale": to_e4m3(qw.scales, "scales").contiguous(),
        "weight_global_scale": global_to_packed(qw.global_scale, lead),
    }


def logical_shape(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    p = tensors["weight_packed"]
    return (*p.shape[:-1], p.shape[-1] * 2)


def _read(tensors: dict[str, torch.Tensor], name: str, layout: str, block: int, need: int):
    t = select(tensors, SUFFIXES, layout, name)
    tn = lambda s: full_name(name, s)  # noqa: E731
    packed = t["weight_packed"]
    if packed.dim() < 2:
        raise PackingError(tn("weight_packed"), f"expected [out, in/2], got shape {tuple(packed.shape)}")
    *lead, out, cols = packed.shape
    lead = tuple(lead)
    inn = cols * 2
    check_divisible(inn, need, tn("weight_packed"), f"{cols} packed bytes per row = {inn} columns, layout {layout!r}")
    check_tensor(packed, torch.uint8, packed.shape, tn("weight_packed"))
    check_tensor(t["weight_scale"], torch.float8_e4m3fn, (*lead, out, inn // block), tn("weight_scale"))
    check_tensor(t["weight_global_scale"], torch.float32, (*lead, 1), tn("weight_global_scale"))
    return t, lead, out, inn


def unpack(tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    t, lead, out, inn = _read(tensors, name, LAYOUT, SCALE_BLOCK, SCALE_BLOCK)
    codes = bytes_to_nibbles(t["weight_packed"])
    mask = torch.ones_like(codes, dtype=torch.bool)
    return QuantizedWeight(FORMAT, codes, t["weight_scale"].float(), global_from_packed(t["weight_global_scale"], lead), mask)


def unpack_p48(tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    t, lead, out, inn = _read(tensors, name, P48_LAYOUT, P48_SCALE_BLOCK, p48.IN_MULTIPLE)
    packed = t["weight_packed"]
    chunks = packed.reshape(*lead, out, inn // 8, 4)
    nonzero = chunks != 0
    over = nonzero.sum(-1) > 2
    if bool(over.any()):
        pos = first_index(over)
        raise PackingError(
            full_name(name, "weight_packed"),
            f"4-byte chunk has {int(nonzero[pos].sum())} nonzero bytes, paired 4:8 allows 2 "
            f"(row {pos[-2]}, input columns {pos[-1] * 8}..{pos[-1] * 8 + 7})",
            (*pos[:-1], pos[-1] * 4),
        )
    codes = bytes_to_nibbles(packed)
    mask = p48.pair_mask(kept_to_nibble(complete_kept(nonzero)), inn)
    return QuantizedWeight(
        p48.FORMAT, codes, t["weight_scale"].float(), global_from_packed(t["weight_global_scale"], lead), mask
    )
