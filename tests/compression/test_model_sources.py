"""What `compress` and `--model` accept as the model to compress: an unquantized checkpoint. A checkpoint that
is already quantized (a moesq pack, an fp8 release) is refused, naming its quantization, and so is a loaded model
that no longer holds the weights of the checkpoint it names, before a work dir is made."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moesq_runner import moesq_here

TINY = {"calib": {"seq_len": 32, "n_train": 2, "n_val": 2, "n_init": 4}, "init": "rtn", "refine": None}


def _quantized_copy(src: Path, dst: Path, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_quantized_source_is_refused_before_the_work_dir(micro_path, tmp_path):
    from moesq_core import CompressConfig, compress
    from moesq_core.models import UnsupportedModelError

    # a moesq dense-fp8 pack's config, as far as it matters here
    pack = _quantized_copy(micro_path, tmp_path / "pack", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "moesq": {"format": "dense-fp8", "version": 1, "act_quant": True}})
    with pytest.raises(UnsupportedModelError, match=r"already quantized .*a moesq dense-fp8 pack; quant_method "
                                                    r"'compressed-tensors', format 'float-quantized'"):
        compress(pack, CompressConfig.from_dict(TINY), workdir=tmp_path / "wd", device="cpu")
    assert not (tmp_path / "wd").exists()
    fp8 = _quantized_copy(micro_path, tmp_path / "fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    r = moesq_here("calibrate", "--model", fp8, "-w", tmp_path / "wd2", "--quiet", check=False)
    assert r.returncode == 1 and "already quantized (quantization_config: quant_method 'fp8')" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "wd2").exists()


def test_a_loaded_model_must_hold_its_checkpoints_weights(micro_path, tmp_path):
    """compress(model_obj) reads the files model_obj was loaded from: weights changed in memory, or a model built
    with random weights from the checkpoint's config, are refused naming the tensor (they were ignored before);
    the model as loaded (here in another dtype) is the checkpoint and is accepted."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from moesq_core import CompressConfig, compress
    from moesq_core.compression.pipeline import model_source

    loaded = AutoModelForCausalLM.from_pretrained(micro_path, dtype=torch.bfloat16)
    assert model_source(loaded) == str(micro_path)
    with torch.no_grad():
        loaded.model.layers[2].mlp.experts.down_proj[5, 3, 1] += 1
    with pytest.raises(ValueError, match=r"differs from the checkpoint it names .*: model\.layers\.2\.mlp\.experts\."
                                         r"down_proj is not the checkpoint's .*save_pretrained\(DIR\)"):
        compress(loaded, CompressConfig.from_dict(TINY), workdir=tmp_path / "wd", device="cpu")
    with torch.no_grad():
        loaded.model.norm.weight.mul_(2)
    with pytest.raises(ValueError, match=r"model\.norm\.weight is not the checkpoint's"):
        model_source(loaded)
    random = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(micro_path))  # names micro_path
    with pytest.raises(ValueError, match="differs from the checkpoint it names"):
        compress(random, CompressConfig.from_dict(TINY), workdir=tmp_path / "wd", device="cpu")
    assert not (tmp_path / "wd").exists()
