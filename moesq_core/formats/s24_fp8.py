"""`s24-fp8`: 2:4 sparse e4m3 with per-row fp32 scales, W8A8 per-token (Hopper sparse tensor cores).

On disk, our own layout, per linear with logical weight [out, in] (in a multiple of 8; leading expert dims allowed):

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

config.json: quantization_config.format `moesq-sparse24-fp8` (also the config group's) and a `moesq_sparse24`
marker: the format name is ours, so stock compressed-tensors consumers refuse it instead of loading it as dense
channel-wise FP8. Serving: on an sm_90 GPU the CUTLASS 2:4 experts (runtime.s24_hopper, W8A8 only), else the
reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moesq_core.formats.base import VLLM_PLUGIN_CARD_LINE, Layout, QuantizedWeight
from moesq_core.formats.fp8 import ROW_SCALE, FP8Format, check_unit_global, row_scales, unit_global
from moesq_core.formats.pack_common import (
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
    primary_dims,
    select,
    spread_pairs,
)
from moesq_core.formats.patterns import S24
from moesq_core.formats.quantizers import FP8ChannelQuantizer, FP8TokenActQuantizer

NAME = "s24-fp8"
SUFFIXES = ("weight_sparse_values", "weight_sparse_meta", "weight_scale")
IN_MULTIPLE = 8  # 4-groups, two per metadata byte
CONFIG_FORMAT = "moesq-sparse24-fp8"
MARKER_KEY = "moesq_sparse24"
MARKER = {"layout": "values-meta", "version": 1}
# meta nibble i0 | i1 << 2 -> slot bitmask 1 << i0 | 1 << i1 (0 for invalid nibbles, which unpack rejects first)
_META_TO_KEPT = torch.tensor(
    [(1 << (m & 3) | 1 << (m >> 2)) if (m & 3) < (m >> 2) else 0 for m in range(16)], dtype=torch.uint8
)


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    lead, out, inn = check_qw(qw, NAME)
    check_divisible(inn, IN_MULTIPLE, "codes", "s24-fp8 needs 4-column groups, two per metadata byte")
    check_scale_shape(qw, (*lead, out, 1))
    check_unit_global(qw)
    codes, mask = qw.codes, qw.mask.bool()
    check_pruned_zero(codes, mask)
    kept = mask.reshape(*lead, out, inn // 4, 4)
    over = kept.sum(-1) > 2
    if bool(over.any()):
        pos = first_index(over)
        raise PackingError(
            "mask",
            f"row {pos[-2]} keeps more than 2 of input columns {pos[-1] * 4}..{pos[-1] * 4 + 3}; not 2:4",
            (*pos[:-1], pos[-1] * 4),
        )
    pos = nibble_positions(kept_to_nibble(complete_kept(kept)))  # [..., in/4, 2]
    values = torch.gather(codes.reshape(*lead, out, inn // 4, 4), -1, pos).reshape(*lead, out, inn // 2)
    meta = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8)
    scale = row_scales(qw)
    return {
        "weight_sparse_values": values.contiguous().view(torch.float8_e4m3fn),
        "weight_sparse_meta": nibbles_to_bytes(meta).contiguous(),
        "weight_scale": scale,
    }


def logical_shape(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    v = tensors["weight_sparse_values"]
    return (*v.shape[:-1], v.shape[-1] * 2)


def unpack(tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    t = select(tensors, SUFFIXES, NAME, name)
    tn = lambda s: full_name(name, s)  # noqa: E731
    values = t["weight_sparse_values"]
    lead, out, inn = primary_dims(values, tn("weight_sparse_values"), 2, "[out, in/2]")
    check_divisible(inn, IN_MULTIPLE, tn("weight_sparse_values"), f"{inn // 2} values per row = {inn} columns")
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
    return QuantizedWeight(
        NAME,
        codes.reshape(*lead, out, inn),
        t["weight_scale"].clone(),
        unit_global(lead, values.device),
        mask.reshape(*lead, out, inn),
    )


@dataclass(frozen=True)
class S24Format(FP8Format):
    def compressed_tensors_config(self, ignore: list[str], act_quant: bool) -> dict:
        qc = super().compressed_tensors_config(ignore, act_quant)
        # the group's format too, which compressed-tensors' parsing (and so transformers) validates against its
        # known formats and refuses, instead of loading the experts as dense FP8
        qc["config_groups"]["group_0"]["format"] = self.ct_format
        return qc

    def config_markers(self, sparse: bool) -> dict:
        return {MARKER_KEY: dict(MARKER)}

    def check_config(self, qc: dict, config: dict) -> list[tuple[str, str]]:
        out = super().check_config(qc, config)
        if qc.get(MARKER_KEY) != MARKER:
            out.append(("error", f"quantization_config.{MARKER_KEY} is {qc.get(MARKER_KEY)!r}; expected {MARKER!r}"))
        return out


FORMAT = S24Format(
    NAME, "2:4 sparse e4m3, per-channel fp32 scales, W8A8 per-token (Hopper sparse tensor cores)",
    S24, FP8ChannelQuantizer(), FP8TokenActQuantizer(), 5.0,
    layouts=(Layout(NAME, NAME, SUFFIXES, pack, unpack, logical_shape, ROW_SCALE, "weight_sparse_values"),),
    scheme="W8A8", act_label="FP8",
    card_tags=("fp8", "sparse", "2-4-sparsity"),
    card_loaders=(
        "`moesq generate DIR --prompt ...` or `moesq_core.load_packed(DIR)`.",
        VLLM_PLUGIN_CARD_LINE,
        "This is moesq's own layout (format `moesq-sparse24-fp8`, marker `moesq_sparse24`); compressed-tensors' "
        "config parsing, and so transformers without `import moesq_core`, refuse it.",
    ),
    markers=(MARKER_KEY,),
    fast_experts="moesq_core.serving.s24_hopper",
    ct_format=CONFIG_FORMAT,
    ct_format_note=" so that stock loaders refuse it instead of reading it as dense FP8",
)
