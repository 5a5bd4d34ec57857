"""Random-weight checkpoints of a real model's shape (what the scale benchmarks compress) and the parallel,
cached weight hashing that fingerprints them."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moesq_core.compression.workdir import WEIGHT_HASH_CACHE, sha256_file, weight_files_sha256
from moesq_core.models import load_model

from conftest import benchmark_module

synthetic = benchmark_module("synthetic_model")  # benchmarks/synthetic_model.py
MARKER = synthetic.MARKER
QWEN3_30B_A3B = synthetic.QWEN3_30B_A3B
qwen3_moe_config = synthetic.qwen3_moe_config
write_random_qwen3_moe = synthetic.write_random_qwen3_moe

SMALL = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, vocab_size=8192)


def small_config(**kw):
    return qwen3_moe_config(**{**QWEN3_30B_A3B, **SMALL, **kw})


def test_random_checkpoint_loads_and_matches_its_shape(tmp_path):
    cfg = small_config()
    size = write_random_qwen3_moe(tmp_path / "m", cfg, seed=3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert size == params  # untied embeddings: lm_head is its own tensor
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == size
    assert len(set(index["weight_map"].values())) == cfg["num_hidden_layers"] + 1  # a shard per layer + embeddings
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]
    logits = model(torch.randint(0, 8192, (1, 16))).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0
    # moesq reads it lazily like a released checkpoint
    lazy, _, adapter, _ = load_model(tmp_path / "m", lazy=True)
    assert adapter.family == "qwen3-moe" and lazy.config.num_experts == 8


def test_the_same_shape_and_seed_is_kept_and_another_is_refused(tmp_path):
    cfg = small_config()
    out = tmp_path / "m"
    size = write_random_qwen3_moe(out, cfg, seed=0)
    before = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert write_random_qwen3_moe(out, cfg, seed=0) == size
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == before  # nothing rewritten
    with pytest.raises(FileExistsError, match="not a random checkpoint of this config and seed"):
        write_random_qwen3_moe(out, cfg, seed=1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        write_random_qwen3_moe(tmp_path / "mine", cfg)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert json.loads((out / MARKER).read_text())["weight_bytes"] == size


def test_seeds_give_different_weights_and_a_seed_the_same(tmp_path):
    cfg = small_config(num_hidden_layers=1)
    a, b, c = (write_random_qwen3_moe(tmp_path / n, cfg, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    shard = "model-00001-of-00002.safetensors"
    assert sha256_file(tmp_path / "a" / shard) == sha256_file(tmp_path / "b" / shard)
    assert sha256_file(tmp_path / "a" / shard) != sha256_file(tmp_path / "c" / shard)


def test_weight_hashes_are_computed_in_parallel_once_and_follow_rewrites(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESQ_CACHE_DIR", str(tmp_path / "cache"))
    files = []
    for i in range(5):
        f = tmp_path / f"w{i}.bin"
        f.write_bytes(bytes([i]) * (3 << 20))
        files.append(f)
    digests = weight_files_sha256(files)
    assert digests == [sha256_file(f) for f in files]
    cache = json.loads((tmp_path / "cache" / WEIGHT_HASH_CACHE).read_text())
    assert len(cache) == 5
    import moesq_core.compression.workdir as wdmod

    calls = []
    real = wdmod.sha256_file
    monkeypatch.setattr(wdmod, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    assert weight_files_sha256(files) == digests and calls == []  # all from the cache
    files[2].write_bytes(b"changed")
    again = weight_files_sha256(files)
    assert calls == [files[2]] and again[2] == sha256_file(files[2]) and again[:2] == digests[:2]
