"""Packers: QuantizedWeight <-> the on-disk tensors of one linear, bit-exact in both directions.

Layouts (one module each; the module docstrings specify every byte):

    p48-nvfp4    p48.py    weight_sparse_packed, weight_sparse_mask, weight_scale (e4m3, /32), weight_global_scale
                           the public release's pair-bitmask layout, 2.75 bits/weight
    dense-nvfp4  dense.py  weight_packed, weight_scale (e4m3, /16), weight_global_scale             4.5 bits/weight
    dense-p48    dense.py  a p48-nvfp4 weight stored densely: weight_packed (pruned bytes zero),
                           weight_scale (e4m3, /32), weight_global_scale                          4.25 bits/weight
    s24-fp8      s24.py    weight_sparse_values (e4m3), weight_sparse_meta, weight_scale (fp32 per row)
                           5 bits/weight + 32 bits per row

Tensor dicts are keyed by the tensor-name suffix (the part after `<module>.`). Inputs may be one matrix
[out, in] or a stack [E, out, in]; a stack's global scales are [E, 1] on disk and [E, 1, 1] in the
QuantizedWeight. `input_global_scale` (activation side) is ignored by unpack when present.
Errors are `PackingError` (a ValueError) carrying the tensor name, the first bad position and the problem.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import QuantizedWeight
from . import dense, p48, s24
from ._common import ACTIVATION_SUFFIXES, PackingError, packed_nbytes


@dataclass(frozen=True)
class Layout:
    name: str
    format: str  # the QuantizedWeight format it stores
    suffixes: tuple[str, ...]
    scale_block: int  # dense columns per scale (0 = one per row)
    pack: Callable[[QuantizedWeight], dict[str, torch.Tensor]]
    unpack: Callable[..., QuantizedWeight]
    logical_shape: Callable[[dict[str, torch.Tensor]], tuple[int, ...]]


LAYOUTS: dict[str, Layout] = {
    lay.name: lay
    for lay in (
        Layout(p48.LAYOUT, p48.FORMAT, p48.SUFFIXES, p48.SCALE_BLOCK, p48.pack, p48.unpack, p48.logical_shape),
        Layout(dense.LAYOUT, dense.FORMAT, dense.SUFFIXES, dense.SCALE_BLOCK, dense.pack, dense.unpack, dense.logical_shape),
        Layout(dense.P48_LAYOUT, p48.FORMAT, dense.SUFFIXES, dense.P48_SCALE_BLOCK, dense.pack_p48, dense.unpack_p48, dense.logical_shape),
        Layout(s24.LAYOUT, s24.FORMAT, s24.SUFFIXES, 0, s24.pack, s24.unpack, s24.logical_shape),
    )
}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown packed layout {name!r}; choose one of: {', '.join(LAYOUTS)}") from None


def detect_layout(format_name: str, suffixes) -> Layout:
    """The layout a format's tensors are stored in. p48-nvfp4 has two: sparse (weight_sparse_packed present)
    and the dense variant (weight_packed present). A layout name is accepted as-is."""
    suffixes = set(suffixes)
    if format_name == p48.FORMAT and "weight_packed" in suffixes and "weight_sparse_packed" not in suffixes:
        return LAYOUTS[dense.P48_LAYOUT]
    if format_name in LAYOUTS:
        return LAYOUTS[format_name]
    raise ValueError(f"unknown format or layout {format_name!r}; choose one of: {', '.join(LAYOUTS)}")


def pack(qw: QuantizedWeight, layout: str | None = None) -> dict[str, torch.Tensor]:
    """QuantizedWeight -> {suffix: tensor}. layout defaults to the weight's format; pass layout="dense-p48" to
    store a p48-nvfp4 weight densely (the release's dense variant)."""
    lay = get_layout(layout or qw.format)
    if lay.format != qw.format:
        raise ValueError(f"layout {lay.name!r} stores format {lay.format!r}, but the weight is {qw.format!r}")
    return lay.pack(qw)


def unpack(format_name: str, tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    """{suffix: tensor} -> QuantizedWeight, validating dtypes, shapes and sparsity metadata.

    format_name is a format (the layout is detected from the tensors) or a layout name. `name` (the module's
    full name, e.g. "model.layers.0.mlp.experts.3.up_proj") prefixes tensor names in error messages.
    """
    return detect_layout(format_name, tensors.keys()).unpack(tensors, name)


def bits_per_weight(tensors: dict[str, torch.Tensor], shape) -> float:
    """Stored bits per logical weight of `shape` ([out, in] or [E, out, in]) over all tensors given
    (pass only the weight's tensors; input_global_scale is activation state)."""
    return 8.0 * packed_nbytes(tensors) / math.prod(shape)


__all__ = [
    "ACTIVATION_SUFFIXES", "LAYOUTS", "Layout", "PackingError", "bits_per_weight", "detect_layout",
    "get_layout", "pack", "packed_nbytes", "unpack",
]
