"""pack → verify → load: the packed model's logits equal the fake-quantized work-dir model's; bad packed
dirs get clear errors."""
from __future__ import annotations

import json

import pytest
import torch

from moesq_core.checkpoint.verify import verify_packed_dir
from moesq_core.compression.engine import load_workdir_model
from moesq_core.compression.export import export_packed
from moesq_core.serving.loader import load_packed


@pytest.fixture(scope="module", params=["p48-nvfp4", "s24-fp8"])
def packed(request, stages, tmp_path_factory):
    fmt = request.param
    wd = stages[fmt]
    out = tmp_path_factory.mktemp(f"sharded-{fmt}") / "packed"
    summary = export_packed(wd, "init-rtn", out, max_shard_bytes=3 << 20)  # several shards + an index
    from transformers import AutoTokenizer

    return fmt, wd, out, summary, AutoTokenizer.from_pretrained(out)


def test_packed_dir_layout_and_verify(packed):
    fmt, wd, out, summary, tok = packed
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["moesq"]["format"] == fmt
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"] and "model.layers.0.mlp.gate" in qc["ignore"]
    if fmt == "p48-nvfp4":
        assert qc["paired48_sparse"] == {"layout": "pair-bitmask", "version": 1} and qc["group_size"] == 32
        # 2.75 bits per weight + one fp32 global scale per linear (128x192 here)
        assert summary["bits_per_weight"] == pytest.approx(2.75 + 32 / (128 * 192))
    assert (out / "model.safetensors.index.json").is_file() and summary["shards"] > 1
    assert (out / "tokenizer.json").is_file() and "bits per weight" in (out / "README.md").read_text()
    report = verify_packed_dir(out)
    assert report.ok, report.first_error


@torch.no_grad()
def test_packed_logits_match_fake_quantized(packed):
    fmt, wd, out, summary, tok = packed
    ids = tok("Memory barriers order loads and stores across CPUs. " * 4, return_tensors="pt")["input_ids"]
    fake, _ = load_workdir_model(wd.root, "init-rtn")
    real, tok2 = load_packed(out)
    assert tok2 is not None
    a, b = fake(input_ids=ids).logits, real(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def test_packed_load_errors(packed, tmp_path):
    fmt, wd, out, summary, tok = packed
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_packed(tmp_path)
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{shard.name}: size is \d+ bytes, the pack wrote"):
        load_packed(bad)  # the checksum manifest's sizes
    with pytest.raises(ValueError, match="truncated"):
        load_packed(bad, verify=False)  # safetensors' own check
    report = verify_packed_dir(bad)
    assert not report.ok and shard.name in str(report.first_error)


def test_pack_refuses_unfinished_stage_and_existing_output(packed, tmp_path):
    fmt, wd, out, summary, tok = packed
    from moesq_core.compression.workdir import WorkDirError

    with pytest.raises(WorkDirError, match="not finished"):
        export_packed(wd, "refine", tmp_path / "x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_packed(wd, "init-rtn", out)


def test_push_to_hub_without_network_keeps_local_dir(packed, monkeypatch):
    fmt, wd, out, summary, tok = packed
    from moesq_core.compression.export import push_to_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(RuntimeError, match="packed model is intact"):
        push_to_hub(out, "someone/moesq-test", token="hf_invalid")
    assert sorted(p.name for p in out.iterdir()) == before
