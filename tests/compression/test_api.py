"""The library entry point and recipes: `compress(model, CompressConfig)` and `moesq run --recipe` give the
same artifacts; the shipped recipes load and mean what they say; configs normalise and validate."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from moesq_runner import moesq_here

REPO = Path(__file__).resolve().parents[2]

TINY_RECIPE = """
format: p48-nvfp4
calib: {seq_len: 32, n_train: 2, n_val: 2, n_init: 4}
init: {method: rtn}
refine: {epochs: 1, steps_per_epoch: 2}
"""


# (a recipe, the error naming its key path): a recipe file and a CompressConfig built in Python give the same
RECIPE_ERRORS = (
    ("formt: p48-nvfp4", "formt: unknown key (did you mean format?)"),
    ("serving: {act_global_scale: 1.0}", "serving: unknown key (valid: format, act_quant,"),
    ("calib: {seq_len: 0}", "calib.seq_len: must be a positive"),
    ("calib: {seq_lem: 64}", "calib.seq_lem: unknown key (did you mean seq_len?)"),
    ("init: {method: nope}", "init: unknown method"),
    ("init: {method: rtn, option: {}}", "init.option: unknown key (did you mean options?)"),
    ("refine: {epochs: -1}", "refine.epochs: must be >= 0"),
    ("refine: {lr_logits: .inf}", "refine.lr_logits: expected a finite number, got inf"),
    ("init: {method: sgptq, options: {percdamp: x}}",
     "init.options.percdamp: expected a number, got 'x'"),
    ("init: {method: obr, options: {alpha: 2}}", "init.options.alpha: must be in [0, 1], got 2"),
    ("refine: {epochs: two}", "refine.epochs: expected an integer, got 'two'"),
    ("refine: {epoch: 2}", "refine.epoch: unknown key (did you mean epochs?)"),
    ("refine: {tau: [2.0, x]}", "refine.tau.1: expected a number, got 'x'"),
    ("refine: {e2e_steps: [1]}", "refine.e2e_steps: expected an integer or a string, got [1]"),
    ("act_quant: maybe", "act_quant: expected true or false, got 'maybe'"),
    ("format: p49", "format: unknown format 'p49'"),
    ("- a list", "expected a mapping"), ("baselines: [nope]", "baselines: unknown method"),
)


def _artifacts(wd: Path) -> dict[str, str]:
    return {str(p.relative_to(wd)): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in ("calib", "stages") for p in sorted((wd / d).rglob("*")) if p.is_file()}


def test_shipped_recipes():
    from moesq_core import CompressConfig
    from moesq_core.compression.pipeline import default_run_config

    quick = CompressConfig.from_file(REPO / "recipes" / "micro-quick.yaml")
    assert quick.to_dict() == default_run_config().to_dict()  # `moesq run`'s default is this recipe
    paper = CompressConfig.from_file(REPO / "recipes" / "qwen3-30b-a3b-p48-nvfp4.yaml")
    assert paper.model == "Qwen/Qwen3-30B-A3B" and paper.calib.seq_len == 4096
    assert paper.init.options["percdamp"] == 0.01
    # 8,192 sequences × 4,096 tokens × top-8 over 128 experts: the paper's 128 steps per epoch
    assert paper.refine.schedule(8192 * 4096 * 8, 128).steps_per_epoch == 128
    assert not paper.refine.init_split_rows  # the 512 one-shot sequences would make it 136
    assert CompressConfig.from_dict(quick.to_dict()).to_dict() == quick.to_dict()  # to_dict round-trips


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_loads(recipe):
    from moesq_core import CompressConfig

    cfg = CompressConfig.from_file(REPO / "recipes" / recipe)  # validated: every key is a real option
    assert CompressConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_config_errors_name_the_key(tmp_path):
    from moesq_core import CompressConfig

    bad = tmp_path / "bad.yaml"
    for text, msg in RECIPE_ERRORS:
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"recipe {bad}: {msg}")):
            CompressConfig.from_file(bad)
    r = moesq_here("run", "--recipe", bad.with_name("typo.yaml"), "-w", tmp_path / "w", check=False)
    assert r.returncode == 2 and "no such file" in r.stderr
    bad.write_text("refine: {epoch: 2}")
    r = moesq_here("run", "--recipe", bad, "-w", tmp_path / "w", check=False)
    assert r.returncode == 2 and "refine.epoch: unknown key (did you mean epochs?)" in r.stderr
    assert not (tmp_path / "w").exists()  # refused before the work dir is made
    with pytest.raises(ValueError, match="steps_per_epoch is a refinement option"):
        CompressConfig(refine=None).with_overrides(steps_per_epoch=3)


def test_a_config_built_in_python_is_validated_like_a_recipe():
    import dataclasses

    import yaml

    from moesq_core import CompressConfig
    from moesq_core.compression.methods.refine import RefineConfig

    names = {f.name for f in dataclasses.fields(CompressConfig)}
    for text, msg in RECIPE_ERRORS:
        fields = yaml.safe_load(text)
        if isinstance(fields, dict) and set(fields) <= names:  # an unknown keyword: Python's own TypeError
            with pytest.raises(ValueError, match="^" + re.escape(msg)):
                CompressConfig(**fields)
    with pytest.raises(ValueError, match=re.escape("calib_source: expected a string, got 3")):
        CompressConfig(calib_source=3)
    # what a recipe may give, objects too, builds the same config as the recipe's mapping
    cfg = CompressConfig(init="rtn", refine=RefineConfig(epochs=3), calib={"seq_len": 32}, baselines=["magnitude"],
                         calib_source=REPO / "recipes")
    assert cfg.to_dict() == CompressConfig.from_dict(cfg.to_dict()).to_dict()
    assert (cfg.init.name, cfg.refine.epochs, cfg.calib.seq_len, cfg.calib_source) == \
        ("rtn", 3, 32, str(REPO / "recipes"))


def test_compress_api_and_cli_recipe_give_identical_artifacts(micro_path, tmp_path):
    from moesq_core import CompressConfig, compress

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    handle = compress(micro_path, CompressConfig.from_file(recipe), workdir=tmp_path / "api", device="cpu")
    # refinement computes its rtn init inside its block loop: no init stage of its own (no baselines asked)
    assert handle.stage == "refine" and set(handle.summaries) == {"refine"}
    assert set(json.loads((tmp_path / "api" / "manifest.json").read_text())["stages"]) == {"refine"}
    summary = handle.save_pretrained(tmp_path / "api-packed")
    assert summary["bits_per_weight"] == pytest.approx(2.75, abs=0.01)
    assert (tmp_path / "api-packed" / "config.json").is_file()
    r = moesq_here("run", "--recipe", recipe, "--model", micro_path, "-w", tmp_path / "cli", "--ppl-tokens", "1024",
              "--quiet", "--device", "cpu", "--json", "-")
    out = json.loads(r.stdout)
    assert out["stage"] == "refine" and out["config"]["init"]["method"] == "rtn"
    assert _artifacts(tmp_path / "cli") == _artifacts(tmp_path / "api")
    # the API on a finished work dir only checks it
    again = compress(micro_path, CompressConfig.from_file(recipe), workdir=tmp_path / "api", device="cpu")
    assert all(s["computed_now"] == 0 for s in again.summaries.values())
    # command-line options override the recipe, and a work dir made otherwise is refused
    r = moesq_here("run", "--recipe", recipe, "-w", tmp_path / "cli", "--seq-len", "64", "--quiet", check=False)
    assert r.returncode == 1 and "seq_len: 32 (work dir) vs 64 (now)" in r.stderr


def test_compress_takes_a_loaded_model(micro_path, tmp_path):
    """A loaded transformers model is compressed from the checkpoint it was loaded from; one without a
    source is refused in one line, before a work dir is made."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moesq_core import CompressConfig, compress

    cfg = CompressConfig.from_dict({"calib": {"seq_len": 32, "n_train": 2, "n_val": 2, "n_init": 4},
                                    "init": "rtn", "refine": None})
    loaded = AutoModelForCausalLM.from_pretrained(micro_path)
    handle = compress(loaded, cfg, workdir=tmp_path / "wd", device="cpu")
    assert handle.stage == "init-rtn" and set(handle.summaries) == {"init-rtn"}
    assert json.loads((tmp_path / "wd" / "manifest.json").read_text())["model"]["source"] == str(micro_path)
    built = AutoConfig.from_pretrained(micro_path)
    built.name_or_path = ""  # a model built in memory, from no checkpoint
    unsaved = AutoModelForCausalLM.from_config(built)
    with pytest.raises(ValueError, match=r"no source checkpoint .*save_pretrained\(DIR\)"):
        compress(unsaved, cfg, workdir=tmp_path / "wd2", device="cpu")
    assert not (tmp_path / "wd2").exists()


def test_stage_commands_print_json(micro_path, tmp_path):
    wd = tmp_path / "wd"
    r = moesq_here("calibrate", "--model", micro_path, "-w", wd, "--seq-len", "32", "--n-train", "2", "--n-val", "2",
              "--n-init", "4", "--quiet", "--json", "-")
    assert json.loads(r.stdout)["calibration"]["sequences"] == {"train": 2, "val": 2, "init": 4}
    r = moesq_here("init-sgptq", "-w", wd, "--method", "rtn", "--quiet", "--device", "cpu", "--json", "-")
    out = json.loads(r.stdout)
    assert out["stage"] == "init-rtn" and out["blocks"] == 4
    assert out["config"] == {"method": "rtn", "options": {"report_errors": True}}
