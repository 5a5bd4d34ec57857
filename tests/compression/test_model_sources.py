"""What `compress` and `--model` accept as the model to compress: an unquantized checkpoint. A checkpoint that
is already quantized (a moesq pack, an fp8 release) is refused, naming its quantization, before a work dir is
made."""
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
