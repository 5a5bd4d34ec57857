"""Packers: QuantizedWeight <-> the on-disk tensors of one linear, bit-exact in both directions.

A thin facade over the formats: each format module (moesq_core.formats.<format>) owns its layouts, and its
docstring specifies every byte; `LAYOUTS` lists them all by name (a format's default layout has the format's
name; p48-nvfp4 also has `dense-p48`, the release's dense variant).

Tensor dicts are keyed by the tensor-name suffix (the part after `<module>.`). Inputs may be one matrix
[out, in] or a stack [E, out, in]; a stack's global scales are [E, 1] on disk and [E, 1, 1] in the
QuantizedWeight. `input_global_scale` (activation side) is ignored by unpack when present.
Errors are `PackingError` (a ValueError) carrying the tensor name, the first bad position and the problem.
"""
from __future__ import annotations

import math

import torch

from moesq_core.formats import QuantizedWeight, get_format
from moesq_core.formats.base import Layout
from moesq_core.formats.pack_common import ACTIVATION_SUFFIXES, PackingError, packed_nbytes
from moesq_core.formats.registry import formats

LAYOUTS: dict[str, Layout] = {lay.name: lay for fmt in formats().values() for lay in fmt.layouts}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown packed layout {name!r}; choose one of: {', '.join(LAYOUTS)}") from None


def detect_layout(format_name: str, suffixes) -> Layout:
    """The layout a format's tensors are stored in (the format decides from the suffixes present, e.g. p48-nvfp4's
    dense variant by its weight_packed tensor). A layout name is accepted as-is."""
    if format_name in formats():
        return get_format(format_name).detect_layout(suffixes)
    if format_name in LAYOUTS:
        return LAYOUTS[format_name]
    raise ValueError(f"unknown format or layout {format_name!r}; choose one of: {', '.join(LAYOUTS)}")


def pack(qw: QuantizedWeight, layout: str | None = None) -> dict[str, torch.Tensor]:
    """QuantizedWeight -> {suffix: tensor}. layout defaults to the weight's format's default; pass e.g.
    layout="dense-p48" to store a p48-nvfp4 weight densely (the release's dense variant)."""
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
