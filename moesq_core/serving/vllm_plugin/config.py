"""`MoesqConfig`: vLLM's quantization method `moesq` for moesq packs.

A moesq pack says `quant_method: compressed-tensors` (the config stock engines read) with a `moesq` entry
{format, version, act_quant}. vLLM asks every quantization method, custom ones first, whether it claims a
checkpoint (`override_quantization_method`): `moesq` claims a pack whose format stock vLLM cannot serve (not
`Format.stock_serving`: p48-nvfp4 in either layout, s24-fp8), leaves the others (dense-nvfp4, dense-fp8) to
stock compressed-tensors, and refuses a pack of a moesq version or format this moesq does not read. Routed
experts then get MoesqMoEMethod (moe.py); every other linear of a pack is stored unquantized, so it gets vLLM's
unquantized method.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from moesq_core.checkpoint.verify import MOESQ_VERSION
from moesq_core.formats import Format, get_format
from moesq_core.formats.base import Layout

NAME = "moesq"  # the quantization method vLLM reports for a claimed pack
PACK_METHOD = "compressed-tensors"  # the quant_method a moesq pack's config.json states
MOESQ_KEY = "moesq"


class PackConfigError(ValueError):
    """A moesq pack's quantization_config that this moesq cannot serve."""


def pack_format(qc: dict[str, Any]) -> tuple[Format, Layout, bool] | None:
    """(format, expert layout, act_quant) of a pack's quantization_config; None when it is not a moesq pack.
    PackConfigError (one line) for a moesq version or format this moesq does not read."""
    entry = qc.get(MOESQ_KEY) if isinstance(qc, dict) else None
    if not isinstance(entry, dict):
        return None
    version = entry.get("version")
    if version != MOESQ_VERSION:
        raise PackConfigError(f"moesq: this checkpoint is a moesq pack of version {version!r}, but the installed moesq "
                              f"reads version {MOESQ_VERSION}; upgrade moesq")
    try:
        fmt = get_format(entry.get("format"))
    except ValueError as e:
        raise PackConfigError(f"moesq: this checkpoint's {e}; upgrade moesq") from None
    return fmt, fmt.config_layout(qc), bool(entry.get("act_quant", True))


class MoesqConfig(QuantizationConfig):
    """The quantization_config of a moesq pack that vLLM serves through moesq."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        parsed = pack_format(config)
        if parsed is None:
            raise PackConfigError("moesq: quantization_config has no 'moesq' entry; this is not a moesq pack")
        self.config = config
        self.format, self.layout, self.act_quant = parsed

    def __repr__(self) -> str:
        return f"MoesqConfig(format={self.format.name}, layout={self.layout.name}, act_quant={self.act_quant})"

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the reference experts module runs on any Ampere or newer GPU; Hopper gets moesq's kernels

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the quantization_config of config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MoesqConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """`moesq` for a pack only moesq serves (unless the user asked for another method), else None."""
        parsed = pack_format(hf_quant_cfg)
        if parsed is None or parsed[0].stock_serving or user_quant not in (None, NAME, PACK_METHOD):
            return None
        return NAME

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            from moesq_core.serving.vllm_plugin.moe import MoesqMoEMethod

            return MoesqMoEMethod(self, layer.moe_config)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()  # a pack compresses only the routed experts
        return None
