"""`AutoModelForCausalLM.from_pretrained(pack)` for moesq packs, once `moesq_core` is imported.

transformers picks a checkpoint's loader from `quantization_config.quant_method` alone, and a moesq pack says
`compressed-tensors` (its config is the one serving engines read; a method name of moesq's own would make
transformers without moesq load random experts after a warning instead of failing). So `install` replaces
transformers' two `compressed-tensors` entries (the config class and the quantizer in
`transformers.quantizers.auto`) with classes that send a config holding a `moesq` entry to moesq and every other
config to the stock classes, unchanged. `import moesq_core` calls `install` when transformers imports that
module (or at once if it already has), so importing moesq_core imports neither transformers nor torch.

A moesq pack then loads like `load_packed`: transformers builds the model and loads every non-expert tensor;
each MoE block's routed experts become the module the pack's format serves them with (Format.make_experts, via
the loader's `install_packed_experts`), built on the device transformers put the block's router on (a fast GPU
module where the format has one), with the pack's activation quantization (`moesq.act_quant`). The packed expert
tensors are never loaded into transformers' dense experts modules.
"""
from __future__ import annotations

import copy
import logging
import re
from pathlib import Path

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
from transformers.utils.quantization_config import CompressedTensorsConfig, QuantizationConfigMixin

log = logging.getLogger(__name__)
ROUTED_METHOD = "compressed-tensors"  # the quant_method moesq packs write
MOESQ_KEY = "moesq"  # the quantization_config entry that marks a moesq pack


def is_moesq_config(config) -> bool:
    """Whether a quantization_config (as in config.json) is a moesq pack's."""
    if isinstance(config, dict):
        config = config.get("quantization_config", config)  # the nesting CompressedTensorsConfig.from_dict accepts
    return isinstance(config, dict) and isinstance(config.get(MOESQ_KEY), dict)


class MoesqPackConfig(QuantizationConfigMixin):
    """A moesq pack's quantization_config, kept exactly as config.json has it (moesq's own layouts, e.g.
    s24-fp8's, are not formats compressed-tensors parses); `to_dict` gives it back unchanged."""

    def __init__(self, config: dict):
        from moesq_core.formats import get_format

        self.quant_method = config.get("quant_method", ROUTED_METHOD)
        self.config = copy.deepcopy(config)
        self.format = get_format(config[MOESQ_KEY]["format"])  # an unknown format: a clear error
        self.act_quant = bool(config[MOESQ_KEY].get("act_quant", True))

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        config = cls(config_dict.get("quantization_config", config_dict))
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict:
        return copy.deepcopy(self.config)


class CompressedTensorsOrMoesqConfig(CompressedTensorsConfig):
    """transformers' `compressed-tensors` config entry while moesq is imported: a moesq pack's config becomes a
    MoesqPackConfig, any other a stock CompressedTensorsConfig."""

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        if is_moesq_config(config_dict):
            return MoesqPackConfig.from_dict(config_dict, return_unused_kwargs=return_unused_kwargs, **kwargs)
        return CompressedTensorsConfig.from_dict(config_dict, return_unused_kwargs=return_unused_kwargs, **kwargs)


class CompressedTensorsOrMoesqQuantizer(CompressedTensorsHfQuantizer):
    """transformers' `compressed-tensors` quantizer entry while moesq is imported: a MoesqPackQuantizer for a
    moesq pack's config, a stock CompressedTensorsHfQuantizer for any other."""

    def __new__(cls, quantization_config, **kwargs):
        if isinstance(quantization_config, MoesqPackConfig):
            return MoesqPackQuantizer(quantization_config, **kwargs)
        return CompressedTensorsHfQuantizer(quantization_config, **kwargs)


class PendingExperts(nn.Module):
    """Stands in for a block's routed experts while transformers loads the other weights: it holds no tensor,
    so the pack's expert tensors go to no dense module (and nothing is allocated or randomly initialised)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, *args, **kwargs):
        raise RuntimeError("the moesq experts of this block were not installed (the model did not finish loading)")


def _block_device(block) -> torch.device:
    """Where transformers put a block's own weights (its router), where its experts go too."""
    params = list(block.mlp.parameters()) or list(block.layer.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type == "meta":
        raise ValueError(f"{block.prefix}: the device_map offloads this block; a moesq pack's experts cannot be "
                         "offloaded: use a device_map that keeps the model on its devices")
    return device


class MoesqPackQuantizer(HfQuantizer):
    """Loads a moesq pack inside `from_pretrained` (see the module docstring)."""

    requires_calibration = True  # packs only: refuses to quantize a model on load
    quantization_config: MoesqPackConfig

    def _convert_model_for_quantization(self, model):
        """No module patching: the experts become moesq modules."""

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from moesq_core.models import adapter_for

        if not checkpoint_files:
            raise ValueError("a moesq pack loads from its directory's safetensors files, and from_pretrained passed "
                             "none (a state_dict= argument?): pass the pack's directory or Hub id, or use "
                             "moesq_core.load_packed")
        self.pack_dir = Path(checkpoint_files[0]).parent
        ignored = set(model._keys_to_ignore_on_load_unexpected or ())
        for block in adapter_for(model.config).blocks(model):
            block.mlp.experts = PendingExperts(block.num_experts)
            ignored.add("^" + re.escape(block.prefix + "."))  # the packed tensors, read after loading
        model._keys_to_ignore_on_load_unexpected = ignored

    def _process_model_after_weight_loading(self, model, **kwargs):
        from moesq_core.checkpoint.checksums import ManifestCheck
        from moesq_core.models import adapter_for
        from moesq_core.serving.loader import _PackedTensors, install_packed_experts

        qc = self.quantization_config
        check = ManifestCheck(self.pack_dir)  # as load_packed(verify=True): what is loaded is what `moesq pack` wrote
        reader = _PackedTensors(self.pack_dir, check)
        installed = set()
        for block in adapter_for(model.config).blocks(model):
            device = _block_device(block)
            installed.update(install_packed_experts(block, reader, qc.format, qc.act_quant, device))
            block.mlp.experts.to(device).train(block.mlp.training)
        for name in reader.names():  # transformers read these itself: check the same bytes (mapped, cached) here
            if name not in installed:
                reader.get(name)
        log.info("%s: %d files checked against the checksum manifest while loading", self.pack_dir, check.finish())
        return model

    def is_serializable(self) -> bool:
        log.warning("a model loaded from a moesq pack is not saved by save_pretrained: the pack itself is the "
                    "checkpoint (`moesq pack` writes it)")
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def install(auto_module) -> None:
    """Wrap the `compressed-tensors` entries of transformers.quantizers.auto (idempotent)."""
    configs, quantizers = auto_module.AUTO_QUANTIZATION_CONFIG_MAPPING, auto_module.AUTO_QUANTIZER_MAPPING
    entries = configs.get(ROUTED_METHOD), quantizers.get(ROUTED_METHOD)
    if entries == (CompressedTensorsOrMoesqConfig, CompressedTensorsOrMoesqQuantizer):
        return
    if entries != (CompressedTensorsConfig, CompressedTensorsHfQuantizer):
        raise RuntimeError(f"transformers' {ROUTED_METHOD!r} entries are not its own classes ("
                           f"{', '.join(getattr(e, '__name__', repr(e)) for e in entries)}); "
                           "moesq does not replace them")
    configs[ROUTED_METHOD] = CompressedTensorsOrMoesqConfig
    quantizers[ROUTED_METHOD] = CompressedTensorsOrMoesqQuantizer
