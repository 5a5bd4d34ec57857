"""What every format is: `QuantizedWeight` (the canonical compressed state of one linear), `Layout` (one way
of storing it on disk) and `Format`, the interface everything outside this package calls.

A format owns everything format-specific: its pattern set, weight and activation quantizers, its layouts
(packer/unpacker), the compressed-tensors `quantization_config` it exports, its verify rules and the runtime
module that serves it. Solvers, the refine trainer, the engine, export, verify, the loader and the CLI call
these methods and never branch on a format's type or name. One module per format (p48_nvfp4.py, …) builds
its `FORMAT`; registry.py lists the modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from moesq_core.formats.patterns import PatternSet


@dataclass
class QuantizedWeight:
    """One compressed linear: uint8 codes (E2M1 nibbles or e4m3 bytes, pruned entries code 0),
    scales ([out, in/block] or [out, 1]), fp32 global scale (scalar) and the kept-entry mask."""

    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    mask: torch.Tensor

    @property
    def fmt(self) -> "Format":
        from moesq_core.formats.registry import get_format

        return get_format(self.format)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        w = self.fmt.weight.decode(self.codes, self.scales, self.global_scale)
        return w * self.mask

    def factored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [out, in], row factors [out]), fp32: the weight is values x the row factor (up to the rounding
        of that product), with values the format's codes times their block scales, which bf16 holds exactly in
        the four formats (a matmul can then run on bf16 tensor cores with fp32 accumulation, as exactly as in fp32)."""
        values, rows = self.fmt.weight.decode_factored(self.codes, self.scales, self.global_scale)
        return values * self.mask, rows

    def to(self, device) -> "QuantizedWeight":
        return QuantizedWeight(
            self.format, *(t.to(device) for t in (self.codes, self.scales, self.global_scale, self.mask))
        )

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {
            prefix + "codes": self.codes.contiguous(),
            prefix + "scales": self.scales.float().contiguous(),
            prefix + "global_scale": self.global_scale.float().reshape(()).contiguous(),
            prefix + "mask": self.mask.contiguous(),
        }

    @classmethod
    def from_state_dict(cls, fmt: str, sd: dict[str, torch.Tensor], prefix: str = "") -> "QuantizedWeight":
        return cls(fmt, sd[prefix + "codes"], sd[prefix + "scales"], sd[prefix + "global_scale"], sd[prefix + "mask"])


@dataclass(frozen=True)
class Layout:
    """One on-disk layout of a format's weights: the tensors it writes per linear (keyed by the suffix after
    `<module>.`; the first is the primary one, whose presence identifies the layout), its packer/unpacker
    (bit-exact both ways) and what verify checks beyond unpacking."""

    name: str
    format: str  # the QuantizedWeight format it stores
    suffixes: tuple[str, ...]
    pack: Callable[["QuantizedWeight"], dict[str, torch.Tensor]]
    unpack: Callable[..., "QuantizedWeight"]
    logical_shape: Callable[[dict[str, torch.Tensor]], tuple[int, ...]]
    positive: tuple[tuple[str, str], ...] = ()  # (suffix, what): scales that must be finite and > 0
    fp8_values: str | None = None  # an e4m3 value tensor whose NaN codes are refused


def group_size(qc: dict[str, Any]) -> Any:
    """The scale group size a quantization_config states (top level, as the release writes it, or the weights')."""
    if "group_size" in qc:
        return qc["group_size"]
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and "group_size" in weights:
            return weights["group_size"]
    return None


# compressed-tensors' preset schemes that packs state (weights, input activations), written out rather than taken
# from its `preset_name_to_scheme`: its presets' defaults and its serialisation change between releases (0.17 writes
# a dozen more fields than 0.20), and the same stage must give the same bytes on every release moesq admits. Field
# order and omissions are those compressed-tensors 0.20 writes; its own classes validate the result.
_PRESETS = {
    "NVFP4": (
        {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
         "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
        {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
         "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn", "observer": "static_minmax"},
    ),
    "FP8_DYNAMIC": (
        {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel",
         "dynamic": False},
        {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "token", "dynamic": True},
    ),
}


def compressed_tensors_config(preset: str, ct_format: str, ignore: list[str], act_quant: bool,
                              weights: dict | None = None, acts: dict | None = None) -> dict:
    """A compressed-tensors quantization_config (compressed) of one of its presets (`_PRESETS`); `weights`/`acts`
    override fields of the preset's arguments. Validated by the installed compressed-tensors' own classes (a field
    it does not know raises), so stock consumers parse it."""
    from compressed_tensors.quantization import QuantizationConfig

    w, a = _PRESETS[preset]
    qc = {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**w, **(weights or {})},
            "input_activations": {**a, **(acts or {})} if act_quant else None,
            "output_activations": None,
            "format": None,
        }},
        "quant_method": "compressed-tensors",
        "format": ct_format,
        "quantization_status": "compressed",
        "ignore": list(ignore),
    }
    QuantizationConfig.model_validate(qc)
    return qc


# The model card line of packs that moesq's vLLM plugin serves (formats that are not `stock_serving`).
VLLM_PLUGIN_CARD_LINE = (
    "vLLM: install moesq with its `vllm` extra (`pip install \".[vllm]\"` in a clone of moesq), then "
    "`vllm serve DIR`: moesq's vLLM plugin claims this pack (vLLM reports the quantization `moesq`) and runs its "
    "routed experts with moesq's modules, one custom op per MoE layer. Verified against vLLM 0.34.0's Python layers "
    "on a CPU: the claim, the loading of every expert tensor through vLLM's weight loader (tensor parallel 2 and 4 "
    "included) and the op against moesq's reference; not verified: a run of vLLM itself on a GPU, and expert "
    "parallelism (refused)."
)


@dataclass(frozen=True)
class Format:
    """A named format. Subclasses (one per format module) override the hooks that differ."""

    name: str
    description: str
    patterns: PatternSet
    weight: Any  # a weight quantizer (quantizers.py): NVFP4Quantizer, FP8ChannelQuantizer
    act: Any  # an activation quantizer: NVFP4ActQuantizer, FP8TokenActQuantizer
    bits_per_weight: float  # stored bits per logical weight, scales and metadata included
    layouts: tuple[Layout, ...]  # the first is the default
    scheme: str  # what runs with activation quantization on, e.g. "W4A4"
    act_label: str  # the activation number format, e.g. "NVFP4"
    card_tags: tuple[str, ...] = ()  # Hub tags of a packed model
    card_loaders: tuple[str, ...] = ()  # model card lines: what loads a packed model
    markers: tuple[str, ...] = ()  # quantization_config keys only this format writes
    # The module (dotted name) of a faster experts module for some devices, which the serving wing imports (the
    # formats import nothing that runs them): it defines serves(device, act_quant, fast) and from_packed(packed,
    # act_quant, device). None: the reference module serves everywhere.
    fast_experts: str | None = None
    # Stock compressed-tensors engines (vLLM) serve this format's packs as they are, so moesq's vLLM plugin leaves
    # them to the engine; False: only moesq (its loader, its vLLM plugin) serves them.
    stock_serving: bool = False

    # -- numerics ----------------------------------------------------------------------------------------
    @property
    def scale_block(self) -> int:
        return self.weight.block

    def check_weight(self, w: torch.Tensor, what: str = "weight") -> None:
        """Clear errors for what the format cannot hold (shape) or should never see (NaN/Inf)."""
        if w.dim() != 2:
            raise ValueError(f"{what}: expected a 2-D weight, got shape {tuple(w.shape)}")
        self.patterns.check_shape(w.shape[-1], self.scale_block, f"{what} for format {self.name}")
        if not bool(torch.isfinite(w).all()):
            bad = (~torch.isfinite(w)).nonzero()[0].tolist()
            raise ValueError(f"{what}: non-finite value at {bad}; refusing to compress NaN/Inf weights")

    def magnitude_mask(self, w: torch.Tensor) -> torch.Tensor:
        return self.patterns.best_mask(w.detach().float().abs())

    def global_scale(self, *weights: torch.Tensor) -> torch.Tensor:
        return self.weight.global_scale(*weights)

    def quantize(
        self, w: torch.Tensor, mask: torch.Tensor | None = None, global_scale: torch.Tensor | None = None
    ) -> QuantizedWeight:
        """Round-to-nearest in this format. mask defaults to magnitude selection; global scale to w's own.

        The global scale is taken from the masked weight unless given (gate/up share one: pass it).
        """
        w = w.detach().float()
        if mask is None:
            mask = self.magnitude_mask(w)
        mask = mask.bool()
        wm = w * mask
        g = self.global_scale(wm) if global_scale is None else global_scale.float().reshape(())
        scales = self.weight.block_scales(wm, g)
        codes = self.weight.encode(wm, scales, g) * mask
        return QuantizedWeight(self.name, codes.to(torch.uint8), scales, g, mask)

    def fake_quant_weight(
        self,
        w: torch.Tensor,
        mask: torch.Tensor | None = None,
        global_scale: torch.Tensor | None = None,
        ste: bool = False,
    ) -> torch.Tensor:
        """Differentiable quantize-dequantize of (masked) w; scales from w itself, detached."""
        if mask is not None:
            w = w * mask
        return self.weight.fake_quant(w, global_scale, ste=ste)

    def quant_act(self, x: torch.Tensor, global_scale: torch.Tensor | None = None, ste: bool = False) -> torch.Tensor:
        return self.act(x, global_scale, ste=ste)

    # -- storage -----------------------------------------------------------------------------------------
    def layout(self, name: str | None = None) -> Layout:
        if name is None:
            return self.layouts[0]
        for lay in self.layouts:
            if lay.name == name:
                return lay
        raise ValueError(
            f"format {self.name!r} has no layout {name!r}; its layouts: {', '.join(lay.name for lay in self.layouts)}"
        )

    def export_layout(self, sparse: bool = True) -> Layout:
        """The layout `moesq pack` writes (sparse=False: `--dense-layout`, where the format has a dense variant)."""
        return self.layouts[0]

    def config_layout(self, qc: dict) -> Layout:
        """The layout a pack with this quantization_config stores its experts in (before any tensor is read): the
        sparse one where the config carries every marker of the format, else the dense variant (`moesq verify`
        checks that the two agree)."""
        return self.export_layout(sparse=all(k in qc for k in self.markers))

    def detect_layout(self, suffixes) -> Layout:
        """The layout tensors with these suffixes are in: the default unless its primary tensor is absent and
        another layout's is present."""
        suffixes = set(suffixes)
        first = self.layouts[0]
        if first.suffixes[0] not in suffixes:
            for lay in self.layouts[1:]:
                if lay.suffixes[0] in suffixes:
                    return lay
        return first

    def pack(self, qw: QuantizedWeight, layout: str | None = None) -> dict[str, torch.Tensor]:
        return self.layout(layout).pack(qw)

    def unpack(self, tensors: dict[str, torch.Tensor], name: str = "") -> QuantizedWeight:
        return self.detect_layout(tensors.keys()).unpack(tensors, name)

    def card_loader_lines(self, layout: str | None) -> tuple[str, ...]:
        """The model card's lines on what loads a pack whose experts are in `layout` (a Layout's name)."""
        return self.card_loaders

    # -- compressed-tensors config -----------------------------------------------------------------------
    def compressed_tensors_config(self, ignore: list[str], act_quant: bool) -> dict:
        raise NotImplementedError(f"format {self.name} exports no compressed-tensors config")

    def config_markers(self, sparse: bool) -> dict:
        """quantization_config entries beside compressed-tensors' own that say how the experts are stored."""
        return {}

    def quantization_config(self, ignore: list[str], act_quant: bool, sparse: bool, moesq: dict) -> dict:
        """config.json's quantization_config: compressed-tensors' part, the `moesq` entry, the format's markers."""
        qc = self.compressed_tensors_config(ignore, act_quant)
        qc["moesq"] = moesq
        qc.update(self.config_markers(sparse))
        return qc

    # -- verify ------------------------------------------------------------------------------------------
    def check_config(self, qc: dict, config: dict) -> list[tuple[str, str]]:
        """Problems of a packed model's quantization_config for this format: ("error" | "warning", message)."""
        out = []
        if self.scale_block:  # block-scaled formats state their block as group_size
            gs = group_size(qc)
            if gs is None:
                out.append(("warning", "quantization_config has no group_size"))
            elif gs != self.scale_block:
                out.append(
                    ("error", f"group_size is {gs!r}, but {self.name} uses {self.scale_block}-column scale blocks")
                )
        return out

    def check_layouts(self, rows: list[tuple[str, str]], qc: dict, config: dict) -> list[tuple[str, str]]:
        """Problems of the stored layouts as a whole: rows = (module, layout name); returns (tensor, problem)."""
        return []

    def check_tensors(self, module: str, layout: Layout, tensors: dict[str, torch.Tensor]):
        """The first value problem of one unpacked linear's tensors (a PackingError), or None: NaN e4m3 values,
        scales not finite and > 0, and the activation's stored input scale (serving engines divide by it)."""
        from moesq_core.formats.pack_common import PackingError, first_index

        if layout.fp8_values is not None:
            v = tensors[layout.fp8_values].view(torch.uint8)
            nan = (v & 0x7F) == 0x7F
            if bool(nan.any()):
                pos = first_index(nan)
                return PackingError(f"{module}.{layout.fp8_values}", f"e4m3 NaN code 0x{int(v[pos]):02X}", pos)
        checks = list(layout.positive)
        inp = tensors.get("input_global_scale")
        if inp is None:
            if self.act.uses_global_scale:
                return PackingError(f"{module}.input_global_scale", f"missing ({self.act_label} activations need it)")
        else:
            if inp.dtype != torch.float32 or tuple(inp.shape) != (1,):
                return PackingError(
                    f"{module}.input_global_scale", f"is {inp.dtype} {tuple(inp.shape)}, expected float32 (1,)"
                )
            checks.append(("input_global_scale", "input global scale"))
        for suffix, what in checks:
            f = tensors[suffix].float()
            bad = ~(torch.isfinite(f) & (f > 0))
            if bool(bad.any()):
                pos = first_index(bad)
                return PackingError(f"{module}.{suffix}", f"{what} is {f[pos].item()}, must be finite and > 0", pos)
        return None
