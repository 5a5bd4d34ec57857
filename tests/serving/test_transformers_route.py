"""`AutoModelForCausalLM.from_pretrained(pack)` after `import moesq_core`: every moesq format loads with moesq's
experts modules and gives exactly load_packed's logits (W4A4 / W8A8 included); other compressed-tensors
checkpoints still go to transformers' own classes; without moesq imported, p48 and s24 packs still fail loudly;
importing moesq_core imports neither torch nor transformers."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moesq_core  # noqa: F401  (routes moesq packs through transformers' loader)
from moesq_core.serving.loader import load_packed

from conftest import PACK_FORMATS, REPO, finished_stage

FORMATS = ("p48-nvfp4", "s24-fp8", "dense-nvfp4", "dense-fp8")


@pytest.fixture(scope="module")
def route_packs(packs, micro_path, tmp_path_factory):
    """{format: packed dir} for every moesq format."""
    from moesq_core.compression.export import export_packed

    out = {fmt: packs[fmt][1] for fmt in PACK_FORMATS}
    root = tmp_path_factory.mktemp("route-packs")
    for fmt in sorted(set(FORMATS) - set(out)):
        export_packed(finished_stage(micro_path, root / f"wd-{fmt}", fmt), "init-rtn", root / fmt)
        out[fmt] = root / fmt
    return out


def _digests(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


IDS = torch.arange(5, 69).view(2, 32)


def _run(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("dtype", [torch.float32, None], ids=["fp32", "config-dtype"])
@pytest.mark.parametrize("fmt", FORMATS)
@torch.no_grad()
def test_from_pretrained_gives_load_packeds_model(route_packs, fmt, dtype):
    from transformers import AutoModelForCausalLM

    path = route_packs[fmt]
    before = _digests(path)
    model = AutoModelForCausalLM.from_pretrained(path, **({} if dtype is None else {"dtype": dtype}))
    assert _digests(path) == before  # loading writes nothing into the pack
    ref, _ = load_packed(path, dtype=model.dtype)
    for ours, theirs in zip(model.model.layers, ref.model.layers, strict=True):
        assert type(ours.mlp.experts) is type(theirs.mlp.experts)
        assert ours.mlp.experts.act_quant  # the pack's W4A4 / W8A8, as load_packed serves it
    assert not model.training and not any(m.training for m in model.modules())
    logits = model(input_ids=IDS).logits
    assert torch.equal(logits, ref(input_ids=IDS).logits)
    weights_only = load_packed(path, dtype=model.dtype, act_quant=False)[0](input_ids=IDS).logits
    assert not torch.equal(logits, weights_only)  # the activations are quantized
    assert (model.config.quantization_config.to_dict()
            == json.loads((path / "config.json").read_text())["quantization_config"])


def test_the_compressed_tensors_entries_dispatch_on_the_moesq_key(route_packs):
    """A compressed-tensors config without the `moesq` entry gets the stock config and quantizer classes."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AutoHfQuantizer, AutoQuantizationConfig
    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from moesq_core.serving.transformers_route import CompressedTensorsOrMoesqQuantizer, MoesqPackQuantizer

    assert AUTO_QUANTIZER_MAPPING["compressed-tensors"] is CompressedTensorsOrMoesqQuantizer
    qc = json.loads((route_packs["dense-fp8"] / "config.json").read_text())["quantization_config"]
    assert type(AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(qc))) is MoesqPackQuantizer
    del qc["moesq"]
    config = AutoQuantizationConfig.from_dict(qc)
    assert type(config) is CompressedTensorsConfig
    assert type(AutoHfQuantizer.from_config(config, pre_quantized=True)) is CompressedTensorsHfQuantizer


def test_a_checkpoint_without_the_moesq_entry_loads_through_compressed_tensors(route_packs, tmp_path):
    """dense-fp8's layout is standard compressed-tensors: with the `moesq` entry removed it is any other
    compressed-tensors checkpoint, which transformers' own quantizer loads (its dense experts, no moesq module)."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer

    from moesq_core.serving.experts import MoesqExperts

    plain = tmp_path / "plain"
    shutil.copytree(route_packs["dense-fp8"], plain)
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]["moesq"]
    (plain / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    assert type(model.hf_quantizer) is CompressedTensorsHfQuantizer
    assert not any(isinstance(m, MoesqExperts) for m in model.modules())


@pytest.mark.parametrize("fmt", ["p48-nvfp4", "s24-fp8"])
def test_without_moesq_stock_transformers_refuses_the_pack(route_packs, fmt):
    """The documented stock failure: without `import moesq_core`, from_pretrained raises (never random experts)."""
    r = _run(f"""
import sys
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(route_packs[fmt])!r})
except Exception as e:
    print("raised", type(e).__name__)
else:
    print("loaded")
assert "moesq_core" not in sys.modules
""")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith("raised"), r.stdout


def test_import_installs_the_route_lazily(route_packs):
    """`import moesq_core` imports neither torch nor transformers, and the route is in place whichever of
    moesq_core and transformers is imported first."""
    pack = str(route_packs["p48-nvfp4"])
    check = f"""
from transformers import AutoModelForCausalLM
from moesq_core.serving.experts import MoesqExperts
model = AutoModelForCausalLM.from_pretrained({pack!r})
assert isinstance(model.model.layers[0].mlp.experts, MoesqExperts)
"""
    first = _run("import sys, moesq_core\n"
                 "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)\n" + check)
    assert first.returncode == 0, first.stderr[-3000:]
    after = _run("import transformers.quantizers.auto\nimport moesq_core\n" + check)
    assert after.returncode == 0, after.stderr[-3000:]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_model_card_says_how_transformers_loads_the_pack(route_packs, fmt):
    card = (route_packs[fmt] / "README.md").read_text()
    loading = card[card.index("## Loading"):]
    assert "`import moesq_core`, then `transformers.AutoModelForCausalLM.from_pretrained(DIR)`" in loading


def test_install_wraps_only_transformers_own_entries_once():
    from types import SimpleNamespace

    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from moesq_core.serving.transformers_route import (
        CompressedTensorsOrMoesqConfig,
        CompressedTensorsOrMoesqQuantizer,
        install,
    )

    table = SimpleNamespace(AUTO_QUANTIZATION_CONFIG_MAPPING={"compressed-tensors": CompressedTensorsConfig},
                            AUTO_QUANTIZER_MAPPING={"compressed-tensors": CompressedTensorsHfQuantizer})
    install(table)
    install(table)  # importing moesq_core again changes nothing
    assert table.AUTO_QUANTIZATION_CONFIG_MAPPING == {"compressed-tensors": CompressedTensorsOrMoesqConfig}
    assert table.AUTO_QUANTIZER_MAPPING == {"compressed-tensors": CompressedTensorsOrMoesqQuantizer}
    foreign = SimpleNamespace(AUTO_QUANTIZATION_CONFIG_MAPPING={"compressed-tensors": dict},
                              AUTO_QUANTIZER_MAPPING={"compressed-tensors": CompressedTensorsHfQuantizer})
    with pytest.raises(RuntimeError, match="not its own classes"):
        install(foreign)
    assert foreign.AUTO_QUANTIZATION_CONFIG_MAPPING["compressed-tensors"] is dict


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.experts.3.down_proj.weight_sparse_packed",
                                    "model.embed_tokens.weight"])
def test_from_pretrained_refuses_a_changed_pack_naming_the_tensor(route_packs, tensor, tmp_path):
    """The route checks the pack against moesq_pack.json as load_packed does: an expert byte (read by moesq) and an
    embedding byte (read by transformers) are both caught."""
    from transformers import AutoModelForCausalLM

    from moesq_core.naming import SINGLE_FILE

    from test_load_verified import flip_byte

    pack = tmp_path / "pack"
    shutil.copytree(route_packs["p48-nvfp4"], pack)
    flip_byte(pack / SINGLE_FILE, tensor)
    with pytest.raises(ValueError, match=rf"{SINGLE_FILE}: {tensor}: checksum mismatch"):
        AutoModelForCausalLM.from_pretrained(pack)
