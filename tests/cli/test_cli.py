"""The installed `moesq` command as a user meets it: help texts and kill-and-resume with identical artifacts in a
subprocess; a small end-to-end pipeline on the shared micro model and clear errors for bad input in this process
(`moesq_here`, as other test files use it where no process boundary is tested)."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import EVAL
from moesq_runner import ENV, MOESQ, SMALL, moesq, moesq_here


@pytest.mark.parametrize("cmd", ["", "calibrate", "init-sgptq", "refine", "pack", "verify", "bench-kernel", "eval",
                                 "run"])
def test_help(cmd):
    r = moesq(*([cmd] if cmd else []), "--help")
    assert "Usage: moesq" in r.stdout and len(r.stdout) > 300


def _checksums(wd: Path, stage: str) -> dict:
    m = json.loads((wd / "manifest.json").read_text())
    return {k: v["sha256"] for k, v in m["stages"][stage]["blocks"].items()}


def test_pipeline_pack_verify_eval(micro_path, tmp_path):
    wd = tmp_path / "wd"
    moesq_here("init-sgptq", "--model", micro_path, "-w", wd, "--method", "rtn", *SMALL, "--quiet")
    r = moesq_here("pack", wd, "--out", tmp_path / "packed", "--quiet")
    assert "2.75" in r.stdout
    r = moesq_here("verify", tmp_path / "packed", "--quiet")
    assert "verify: ok" in r.stdout
    r = moesq_here("eval", wd, tmp_path / "packed", "--ppl", EVAL, "--ppl-tokens", "2048", "--json",
              tmp_path / "ppl.json", "--quiet")
    rows = {x["label"]: x["ppl"] for x in json.loads((tmp_path / "ppl.json").read_text())["ppl"]}
    assert set(rows) == {"reference", "rtn", "packed:packed"}
    assert rows["rtn"] == pytest.approx(rows["packed:packed"], rel=1e-5)  # the packed model is the fake-quantized one
    assert rows["reference"] < rows["rtn"]
    # a flipped metadata byte in the packed model is caught and named
    from safetensors.torch import load_file, save_file

    shard = tmp_path / "packed" / "model.safetensors"
    sd = load_file(str(shard))
    key = next(k for k in sd if k.endswith("layers.1.mlp.experts.3.up_proj.weight_sparse_mask"))
    sd[key][2, 1] = 0x77  # 3 bits set in each nibble: not a paired 4:8 mask
    save_file(sd, str(shard), metadata={"format": "pt"})
    r = moesq_here("verify", tmp_path / "packed", "--quiet", check=False)
    assert r.returncode == 1 and "layers.1.mlp.experts.3.up_proj" in r.stdout + r.stderr


def test_killed_stage_resumes_to_identical_artifacts(micro_path, tmp_path):
    ref = tmp_path / "ref"
    args = ["init-sgptq", "--model", micro_path, "--method", "sgptq", *SMALL, "--quiet", "--device", "cpu"]
    moesq_here(*args, "-w", ref)  # the reference in this process; the killed and resumed run as a user's
    want = _checksums(ref, "init-sgptq")
    wd = tmp_path / "wd"
    p = subprocess.Popen([MOESQ, *map(str, args), "-w", str(wd)], env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:  # kill it once at least one block is recorded, mid-stage
        try:
            if len(_checksums(wd, "init-sgptq")) >= 1:
                break
        except (FileNotFoundError, KeyError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = len(_checksums(wd, "init-sgptq"))
    assert 1 <= done <= 4
    moesq(*args, "-w", wd)
    assert _checksums(wd, "init-sgptq") == want


def test_bad_inputs_get_clear_errors(micro_path, tmp_path):
    # a wrong model id / path
    r = moesq_here("calibrate", "--model", tmp_path / "nope", "-w", tmp_path / "a", check=False)
    assert r.returncode == 2 and "no such directory" in r.stdout + r.stderr  # a bad --model, before any work
    # a non-MoE model
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = tmp_path / "dense"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=64)).save_pretrained(dense)
    r = moesq_here("calibrate", "--model", dense, "-w", tmp_path / "b", check=False)
    assert r.returncode == 1 and "dense (non-MoE) model" in r.stdout + r.stderr
    assert not (tmp_path / "b").exists()
    # a work dir from another config is refused and left as it was
    wd = tmp_path / "wd"
    moesq_here("calibrate", "--model", micro_path, "-w", wd, *SMALL, "--quiet")
    before = (wd / "manifest.json").read_text()
    r = moesq_here("calibrate", "--model", micro_path, "-w", wd, *SMALL, "--format", "s24-fp8", check=False)
    assert r.returncode == 1 and "format: 'p48-nvfp4' (work dir) vs 's24-fp8' (now)" in r.stdout + r.stderr
    assert (wd / "manifest.json").read_text() == before
    # no --model: still checked
    r = moesq_here("init-sgptq", "-w", wd, "--method", "rtn", "--seq-len", "128", check=False)
    assert r.returncode == 1 and "seq_len: 64 (work dir) vs 128 (now)" in r.stdout + r.stderr
    assert (wd / "manifest.json").read_text() == before
    # a bad end-to-end length or memory budget is refused before the work dir is touched
    for opt, val, msg in (("--e2e-steps", "many", "a number of steps >= 0 or 'auto'"), ("--e2e-steps", "-3", "got -3"),
                          ("--e2e-memory-gb", "0", "must be > 0")):
        r = moesq_here("refine", "-w", wd, opt, val, check=False)
        assert r.returncode == 2 and msg in r.stdout + r.stderr, (opt, val)
        assert (wd / "manifest.json").read_text() == before and "refine" not in json.loads(before)["stages"]
    # a truncated calibration artifact
    calib = wd / "calib" / "calibration.safetensors"
    calib.write_bytes(calib.read_bytes()[:100])
    r = moesq_here("init-sgptq", "-w", wd, "--method", "rtn", check=False)
    assert r.returncode == 1 and "corrupt" in r.stdout + r.stderr


def _save_variant(src: Path, dst: Path, edit) -> Path:
    """A copy of the micro model with edited weights (NaNs) or config."""
    from moesq_core.models import load_model

    model, tok, _, _ = load_model(src)
    edit(model)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


def test_nan_weights_and_unholdable_dims(micro_path, tmp_path):
    def poison(model):
        with torch.no_grad():
            model.model.layers[2].mlp.experts.down_proj[5, 7, 3] = float("nan")

    nan_model = _save_variant(micro_path, tmp_path / "nan", poison)
    r = moesq_here("init-sgptq", "--model", nan_model, "-w", tmp_path / "w1", "--method", "rtn", *SMALL, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "layer 2 expert 5 down" in out and "non-finite" in out
    # hidden size 48 is not a multiple of the p48 scale block (32)
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    odd = tmp_path / "odd"
    Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=48, intermediate_size=64, moe_intermediate_size=64, num_experts=4,
                                       num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=24, vocab_size=8192)).save_pretrained(odd)
    AutoTokenizer.from_pretrained(micro_path).save_pretrained(odd)
    r = moesq_here("init-sgptq", "--model", odd, "-w", tmp_path / "w2", "--method", "rtn", *SMALL, check=False)
    assert r.returncode == 1 and "not a multiple of 32" in r.stdout + r.stderr
