"""`p48-nvfp4`: paired 4:8 sparse NVFP4, 32-column UE4M3 scales, W4A4 (Blackwell sparse tensor cores; on
Hopper moesq's sparse-tensor-core kernel, moesq_core.serving.p48_hopper). Two layouts on disk.

The public release's pair-bitmask layout (`p48-nvfp4`, the default), per linear with logical weight [out, in]
(in a multiple of 32; leading expert dims allowed):

    weight_sparse_packed  uint8          [out, in/4]   dense packed row = bytes of 2 E2M1 codes (lower K in the
                                                       low nibble), i.e. one byte per pair; of every 4
                                                       consecutive bytes (an 8-column group) the 2 kept bytes,
                                                       in K order
    weight_sparse_mask    uint8          [out, in/16]  per 4-byte chunk a nibble, bit i set when byte i is kept,
                                                       exactly 2 bits set; two chunks per byte, low nibble =
                                                       lower-K chunk
    weight_scale          float8_e4m3fn  [out, in/32]  one UE4M3 scale per 32 dense columns, row-major
    weight_global_scale   float32        [1]

= 2 + 0.5 + 0.25 = 2.75 bits per weight, plus the 32-bit global scale per matrix.

The mask is written from QuantizedWeight.mask, so a kept pair whose codes all rounded to zero stays marked.
Masks that are not exactly 2 whole pairs per group are normalised: a pair counts as kept when either of its
entries is, and a group with fewer than 2 kept pairs is completed with its lowest-index unkept pairs (the
release's rule; those bytes are zero, so the weight is unchanged). More than 2 kept pairs, or a nonzero
code outside the mask, raise: that weight is not paired 4:8 and packing it would lose data.

`dense-p48` (`moesq pack --dense-layout`, the release's dense variant) stores the same weight as dense packed
NVFP4 (nvfp4.py: weight_packed, weight_scale [out, in/32], weight_global_scale; 4.25 bits per weight) with the
pruned bytes (pairs) zero; unpack recognises it by its `weight_packed` tensor. Being unmasked, it cannot tell a
kept pair that quantized to zero from a pruned one: unpack keeps the nonzero bytes of each 4-byte chunk and
completes chunks with fewer than 2 with their lowest-index zero bytes (the release's rule), so codes, scales
and global scale round trip exactly and the mask only where no kept pair is all zero. A chunk with more than
2 nonzero bytes is rejected. Its config names the format `moesq-dense-p48` (top level and config group) instead
of `nvfp4-pack-quantized`: read as plain NVFP4, the experts come out wrong, and with a format name of
moesq's own compressed-tensors' config parsing (and so transformers without moesq) refuses the pack instead.

Serving: on an sm_90 GPU the packed experts (runtime.p48_hopper: the sparse-tensor-core kernel of the native
module, else the Triton kernel) when they import, else the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moesq_core.formats.base import VLLM_PLUGIN_CARD_LINE, Layout, QuantizedWeight
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
    check_pruned_zero,
    check_qw,
    check_scale_shape,
    check_tensor,
    complete_kept,
    first_index,
    full_name,
    global_from_packed,
    global_to_packed,
    kept_to_nibble,
    nibble_popcount,
    nibble_positions,
    nibbles_to_bytes,
    primary_dims,
    select,
    spread_pairs,
    to_e4m3,
)
from moesq_core.formats.patterns import P48
from moesq_core.formats.quantizers import NVFP4ActQuantizer, NVFP4Quantizer

NAME = "p48-nvfp4"
DENSE_LAYOUT = "dense-p48"
SUFFIXES = ("weight_sparse_packed", "weight_sparse_mask", "weight_scale", "weight_global_scale")
SCALE_BLOCK = 32
IN_MULTIPLE = 32  # scales per 32 columns; mask bytes need 16
# Config marker the release writes into quantization_config when experts are stored this way.
MARKER_KEY = "paired48_sparse"
MARKER = {"layout": "pair-bitmask", "version": 1}
DENSE_CONFIG_FORMAT = "moesq-dense-p48"  # quantization_config.format of the dense layout
# Chunk nibble (bit i = byte i kept) -> which of the chunk's 8 columns are kept.
_NIB_MASK8 = torch.tensor([[v >> (i // 2) & 1 == 1 for i in range(8)] for v in range(16)])


def pair_chunks(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated (dense packed bytes [..., in/8, 4], kept bytes bool [..., in/8, 4] with exactly 2 per chunk).

    Shared with the dense variant (pack_dense), which stores the same bytes unsparsified.
    """
    lead, out, inn = check_qw(qw, NAME)
    check_divisible(inn, IN_MULTIPLE, "codes", "p48-nvfp4 needs 8-column groups and 32-column scale blocks")
    check_scale_shape(qw, (*lead, out, inn // SCALE_BLOCK))
    codes, mask = qw.codes, qw.mask.bool()
    check_nibble_codes(codes)
    check_pruned_zero(codes, mask)
    dense = nibbles_to_bytes(codes).reshape(*lead, out, inn // 8, 4)
    kept = mask.reshape(*lead, out, inn // 2, 2).any(-1).reshape(*lead, out, inn // 8, 4)
    over = kept.sum(-1) > 2
    if bool(over.any()):
        pos = first_index(over)
        col = pos[-1] * 8
        raise PackingError(
            "mask",
            f"row {pos[-2]} keeps more than 2 pairs in input columns {col}..{col + 7}; not paired 4:8",
            (*pos[:-1], col),
        )
    return dense, complete_kept(kept)


def pair_mask(nib: torch.Tensor, inn: int) -> torch.Tensor:
    """Chunk nibbles [..., in/8] -> element mask [..., in] (a kept byte keeps both columns of its pair)."""
    return _NIB_MASK8.to(nib.device)[nib.long()].reshape(*nib.shape[:-1], inn)


def pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    dense, kept = pair_chunks(qw)
    *lead, out, groups, _ = dense.shape
    nib = kept_to_nibble(kept)
    values = torch.gather(dense, -1, nibble_positions(nib)).reshape(*lead, out, groups * 2)
    mask = nibbles_to_bytes(nib)
    return {
        "weight_sparse_packed": values.contiguous(),
        "weight_sparse_mask": mask.contiguous(),
        "weight_scale": to_e4m3(qw.scales, "scales").contiguous(),
        "weight_global_scale": global_to_packed(qw.global_scale, tuple(lead)),
    }


def logical_shape(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """[..., out, in] implied by weight_sparse_packed (no validation)."""
    p = tensors["weight_sparse_packed"]
    return (*p.shape[:-1], p.shape[-1] * 4)


def unpack(tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    t = select(tensors, SUFFIXES, NAME, name)
    packed = t["weight_sparse_packed"]
    tn = lambda s: full_name(name, s)  # noqa: E731
    lead, out, inn = primary_dims(packed, tn("weight_sparse_packed"), 4, "[out, in/4]")
    check_divisible(inn, IN_MULTIPLE, tn("weight_sparse_packed"), f"{inn // 4} packed bytes per row = {inn} columns")
    check_tensor(packed, torch.uint8, packed.shape, tn("weight_sparse_packed"))
    check_tensor(t["weight_sparse_mask"], torch.uint8, (*lead, out, inn // 16), tn("weight_sparse_mask"))
    check_tensor(t["weight_scale"], torch.float8_e4m3fn, (*lead, out, inn // SCALE_BLOCK), tn("weight_scale"))
    check_tensor(t["weight_global_scale"], torch.float32, (*lead, 1), tn("weight_global_scale"))

    nib = bytes_to_nibbles(t["weight_sparse_mask"])  # [..., out, in/8], one per chunk
    bad = nibble_popcount(nib) != 2
    if bool(bad.any()):
        pos = first_index(bad)
        chunk = pos[-1]
        v = int(nib[pos])
        raise PackingError(
            tn("weight_sparse_mask"),
            f"{'high' if chunk % 2 else 'low'} nibble 0b{v:04b} has {bin(v).count('1')} bits set, needs exactly 2 "
            f"(row {pos[-2]}, input columns {chunk * 8}..{chunk * 8 + 7})",
            (*pos[:-1], chunk // 2),
        )
    dense = spread_pairs(packed.reshape(*lead, out, inn // 8, 2), nib)  # [..., out, in/8, 4]
    codes = bytes_to_nibbles(dense.reshape(*lead, out, inn // 2))
    mask = pair_mask(nib, inn)
    return QuantizedWeight(
        NAME, codes, t["weight_scale"].float(), global_from_packed(t["weight_global_scale"], lead), mask
    )


def pack_dense(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The dense variant: pruned bytes zero, 32-column scales."""
    pair_chunks(qw)  # validates paired 4:8 structure; pruned bytes are already zero
    return dense_tensors(qw, tuple(qw.codes.shape[:-2]))


def unpack_dense(tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
    t, lead, out, inn = read_dense(tensors, name, DENSE_LAYOUT, SCALE_BLOCK, IN_MULTIPLE)
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
    mask = pair_mask(kept_to_nibble(complete_kept(nonzero)), inn)
    return QuantizedWeight(
        NAME, codes, t["weight_scale"].float(), global_from_packed(t["weight_global_scale"], lead), mask
    )


@dataclass(frozen=True)
class P48Format(NVFP4Format):
    def export_layout(self, sparse: bool = True) -> Layout:
        return self.layouts[0] if sparse else self.layout(DENSE_LAYOUT)

    def config_markers(self, sparse: bool) -> dict:
        return {MARKER_KEY: dict(MARKER)} if sparse else {}

    def quantization_config(self, ignore: list[str], act_quant: bool, sparse: bool, moesq: dict) -> dict:
        qc = super().quantization_config(ignore, act_quant, sparse, moesq)
        if not sparse:  # the group's format is the one compressed-tensors validates (and refuses)
            qc["format"] = qc["config_groups"]["group_0"]["format"] = DENSE_CONFIG_FORMAT
        return qc

    def card_loader_lines(self, layout: str | None) -> tuple[str, ...]:
        return DENSE_CARD_LOADERS if layout == DENSE_LAYOUT else self.card_loaders

    def check_config(self, qc: dict, config: dict) -> list[tuple[str, str]]:
        out = super().check_config(qc, config)
        marker = qc.get(MARKER_KEY, config.get(MARKER_KEY))
        if marker is not None and marker != MARKER:
            out.append(("error", f"{MARKER_KEY} marker is {marker!r}; expected {MARKER!r}"))
        return out

    def check_layouts(self, rows: list[tuple[str, str]], qc: dict, config: dict) -> list[tuple[str, str]]:
        """Loaders pick the sparse decoder from the config marker, so it must agree with the stored layout."""
        has_marker = qc.get(MARKER_KEY, config.get(MARKER_KEY)) is not None
        sparse = [m for m, lay in rows if lay == NAME]
        dense = [m for m, lay in rows if lay == DENSE_LAYOUT]
        out = []
        if sparse and not has_marker:
            out.append(("config.json", f"{len(sparse)} expert linears (e.g. {sparse[0]}) are stored sparse "
                        f"(pair-bitmask) but quantization_config has no {MARKER_KEY} marker, so loaders would not "
                        "decode them"))
        if dense and has_marker:
            out.append((f"{dense[0]}.weight_packed", f"the config's {MARKER_KEY} marker says p48 experts are "
                        f"stored sparse, but {len(dense)} expert linears (e.g. this one) are stored dense"))
        groups = [g.get("format") for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        if dense and not (qc.get("format") == DENSE_CONFIG_FORMAT and groups and
                          all(f == DENSE_CONFIG_FORMAT for f in groups)):
            out.append(("config.json", f"{len(dense)} expert linears (e.g. {dense[0]}) are stored in the dense p48 "
                        f"layout, but quantization_config (and its config groups) do not name its format "
                        f"{DENSE_CONFIG_FORMAT!r}, so stock loaders would read them as plain NVFP4 (wrong weights); "
                        "pack it again"))
        return out


FORMAT = P48Format(
    NAME, "paired 4:8 sparse NVFP4, 32-column UE4M3 scales, W4A4 (Blackwell sparse tensor cores)",
    P48, NVFP4Quantizer(SCALE_BLOCK), NVFP4ActQuantizer(SCALE_BLOCK), 2.75,
    layouts=(
        Layout(NAME, NAME, SUFFIXES, pack, unpack, logical_shape, POSITIVE),
        Layout(DENSE_LAYOUT, NAME, DENSE_SUFFIXES, pack_dense, unpack_dense, dense_logical_shape, POSITIVE),
    ),
    scheme="W4A4", act_label="NVFP4",
    card_tags=("nvfp4", "sparse", "paired-4-8-sparsity", "compressed-tensors"),
    card_loaders=(
        "`moesq generate DIR --prompt ...` or `moesq_core.load_packed(DIR)` (the CPU reference; on a Hopper GPU "
        "moesq's sparse-tensor-core kernel).",
        VLLM_PLUGIN_CARD_LINE,
        "vLLM with the public MoESQ release's paired 4:8 patch on Blackwell GPUs (it reads the `paired48_sparse` "
        "marker).",
        "Without `import moesq_core`, transformers cannot load this layout (it raises while converting the expert "
        "weights); vLLM without moesq's plugin does not know the `paired48_sparse` marker.",
    ),
    markers=(MARKER_KEY,),
    fast_experts="moesq_core.serving.p48_hopper",
)
DENSE_CARD_LOADERS = (
    FORMAT.card_loaders[0],
    VLLM_PLUGIN_CARD_LINE,
    "The experts are stored in the public MoESQ release's dense variant (`moesq pack --dense-layout`: dense packed "
    "NVFP4 with the pruned pairs zero, 32-column scales, 4.25 bits per weight) under the config format "
    f"`{DENSE_CONFIG_FORMAT}`: compressed-tensors' config parsing, and so transformers without `import moesq_core`, "
    "refuse it (read as plain `nvfp4-pack-quantized`, its experts would come out wrong).",
)
