"""`s24-fp8` on disk: 2:4 sparse e4m3 with per-row fp32 scales (Hopper sparse tensor cores). Our own layout.

Per linear with logical weight [out, in] (in a multiple of 8; leading expert dims allowed):

    weight_sparse_values  float8_e4m3fn  [out, in/2]   the 2 kept e4m3 values of every 4 consecutive columns,
                                                       in K order
    weight_sparse_meta    uint8          [out, in/8]   per 4-group a nibble i0 | i1 << 2, i0 < i1 the kept
                                                       positions (0..3); two groups per byte, low nibble =
                                                       lower-K group. Valid nibbles: 0x4 (0,1), 0x8 (0,2),
                                                       0xC (0,3), 0x9 (1,2), 0xD (1,3), 0xE (2,3)
    weight_scale          float32        [out, 1]      dequantized weight = value * scale

= 4 + 1 = 5 bits per weight plus 32 bits per row. There is no global scale (the format's is always 1).
This is the logical, tile-independent form (the same 2-bit indices as PTX's sparse metadata, but not in
CUTLASS's reordered metadata layout): the native kernel re-lays it out for CUTLASS at load time.

Masks come from QuantizedWeight.mask; a group with fewer than 2 kept entries is completed with its
lowest-index unkept positions (their codes are 0, so the weight is unchanged). More than 2 kept entries, or
a nonzero code outside the mask, raise.
"""
from __future__ import annotations

import torch

from ..formats import QuantizedWeight
from ._common import (
    PackingError,
    bytes_to_nibbles,
    check_divisible,
    check_pruned_zero,
    check_qw,
    check_scale_shape,
    check_tensor,
    complete_kept,
    first_index,
    full_name,
    kept_to_nibble,
    nibble_positions,
    nibble_to_kept,
    nibbles_to_bytes,
    select,
    spread_pairs,
)

LAYOUT = "s24-fp8"
FORMAT = "s24-fp8"
SUFFIXES = ("weight_sparse_values", "weight_sparse_meta", "weight_scale")
IN_MULTIPLE = 8  # 4-groups, two per metadata byte
# config.json: quantization_config.format and marker for this layout. The format name is ours, so stock
# compressed-tensors consumers refuse it instead of loading it as dense channel-wise FP8.
CONFIG_FORMAT = "moesq-sparse24-fp8"
MARKER_KEY = "moesq_sparse24"
MARKER = {"layout": "values-meta", "version": 1}
# meta nibble i0 | i1 << 2 -> slot bitmask 1 << i0 | 1 << i1 (0 for invalid nibbles, which unpack rejects first)
_META_TO_KEPT = torch.tensor([(1 << (m & 3) | 1 << (m >> 2)) if (m & 3) < (m >> 2) else 0 for m in range(16)], dtype=torch.uint8)


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    lead, out, inn = check_qw(qw, FORMAT)
    check_divisible(inn, IN_MULTIPLE, "codes", "s24-fp8 needs 4-column groups, two per metadata byte")
    check_scale_shape(qw, (*lead, out, 1))
    g = qw.global_scale.float()
    if bool((g != 1).any()):
        raise PackingError("global_scale", f"s24-fp8 stores no global scale, so it must be 1.0 (got {g.flatten()[0].item()})")
    codes, mask = qw.codes, qw.mask.bool()
    check_pruned_zero(codes, mask)
    kept = mask.reshape(*lead, out, inn // 4, 4)
    over = kept.sum(-1) > 2
    if bool(over.any()):
        pos = first_index(over)
        raise PackingError("mask", f"row {pos[-2]} keeps more than 2 of input columns {pos[-1] * 4}..{pos[-1] * 4 + 3}; not 2:4", (*pos[:-1], pos[-1] * 4))
    pos = nibble_positions(kept_to_nibble(complete_kept(kept)))  # [..., in/4, 2]
    values = torch.gather(codes.reshape(*lead, out, inn // 4, 4), -1, pos).reshape(*lead, out, inn // 2)
    meta = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8)
    scale = qw.scales.float()
    if not bool(torch.isfinite(scale).all()):
        bad = ~torch.isfinite(scale)
        raise PackingError("scales", f"non-finite scale {scale[bad][0].item()}", first_index(bad))
    return {
        "weight_sparse_values": values.contiguous().view(torch.float8_e4m3fn),
        "weight_sparse_meta": nibbles_to_bytes(meta).contiguous(),
        "weight_scale": scale.clone(),  # never alias the QuantizedWeight's tensors
    }


def logical_shape(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    v = tensors["weight_sparse_values"]
    return (*v.shape[:-1], v.shape[-1] * 2)


def unpack(tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    t = select(tensors, SUFFIXES, LAYOUT, name)
    tn = lambda s: full_name(name, s)  # noqa: E731
    values = t["weight_sparse_values"]
    if values.dim() < 2:
        raise PackingError(tn("weight_sparse_values"), f"expected [out, in/2], got shape {tuple(values.shape)}")
    *lead, out, cols = values.shape
    lead = tuple(lead)
    inn = cols * 2
    check_divisible(inn, IN_MULTIPLE, tn("weight_sparse_values"), f"{cols} values per row = {inn} columns")
    check_tensor(values, torch.float8_e4m3fn, values.shape, tn("weight_sparse_values"))
    check_tensor(t["weight_sparse_meta"], torch.uint8, (*lead, out, inn // 8), tn("weight_sparse_meta"))
    check_tensor(t["weight_scale"], torch.float32, (*lead, out, 1), tn("weight_scale"))

    nib = bytes_to_nibbles(t["weight_sparse_meta"])  # [..., out, in/4]
    kept = _META_TO_KEPT.to(nib.device)[nib.long()]  # the same groups as 4-slot bitmask nibbles
    bad = kept == 0
    if bool(bad.any()):
        pos = first_index(bad)
        grp, v = pos[-1], int(nib[pos])
        raise PackingError(
            tn("weight_sparse_meta"),
            f"{'high' if grp % 2 else 'low'} nibble 0x{v:X} names positions ({v & 3}, {v >> 2}); "
            f"needs two distinct increasing positions (row {pos[-2]}, input columns {grp * 4}..{grp * 4 + 3})",
            (*pos[:-1], grp // 2),
        )
    codes = spread_pairs(values.view(torch.uint8).reshape(*lead, out, inn // 4, 2), kept)
    mask = nibble_to_kept(kept)
    g = torch.ones((), dtype=torch.float32) if not lead else torch.ones(*lead, 1, 1, dtype=torch.float32)
    return QuantizedWeight(
        FORMAT, codes.reshape(*lead, out, inn), t["weight_scale"].clone(), g.to(values.device), mask.reshape(*lead, out, inn)
    )
