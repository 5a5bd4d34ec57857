"""The quantization_config a pack writes does not depend on the installed compressed-tensors: vLLM 0.34 pins 0.17,
whose presets and serialisation differ from 0.20's (0.17 writes a dozen more fields), and the same stage must give
the same bytes on every release moesq admits. The expected bytes are those compressed-tensors 0.20 wrote."""
from __future__ import annotations

import hashlib
import json

import pytest

from moesq_core.formats import FORMAT_NAMES, get_format
from moesq_core.formats.base import compressed_tensors_config

P48_W4A4_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "tensor_group",
                "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
    "input_activations": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                          "strategy": "tensor_group", "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn",
                          "observer": "static_minmax"},
    "output_activations": None,
    "format": None,
}
# sha256 of every format's config.json text (json.dumps(indent=2), as pack writes it) for sparse/dense layouts and
# act_quant on/off, in FORMAT_NAMES order, with an empty `moesq` entry: what compressed-tensors 0.20.1 wrote
ALL_CONFIGS_SHA256 = "82f138b3a5e8def46aabf544c7d3ef20ce11bd84ad25c04cb418f201de47cae4"


def _config_text(name: str, sparse: bool, act_quant: bool) -> str:
    qc = get_format(name).quantization_config(["lm_head", "model.layers.0.mlp.gate"], act_quant, sparse, {})
    return json.dumps({"quantization_config": qc}, indent=2) + "\n"


def test_p48_config_group_is_the_stated_scheme_in_order():
    text = _config_text("p48-nvfp4", True, True)
    group = json.loads(text)["quantization_config"]["config_groups"]["group_0"]
    assert json.dumps(group) == json.dumps(P48_W4A4_GROUP)  # keys in the same order: the same bytes


def test_every_formats_config_has_the_same_bytes_as_before():
    texts = [_config_text(n, sparse, aq) for n in FORMAT_NAMES for sparse in (True, False) for aq in (True, False)]
    assert hashlib.sha256("".join(texts).encode()).hexdigest() == ALL_CONFIGS_SHA256


def test_installed_compressed_tensors_validates_the_config():
    with pytest.raises(Exception, match="grup_size"):
        compressed_tensors_config("NVFP4", "nvfp4-pack-quantized", [], True, {"grup_size": 32})
