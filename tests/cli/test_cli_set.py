"""The thin CLI over the configs: at most ten options in each command's --help, any config field by `--set KEY`
(a recipe's key path) or a recipe, each checked as a config is (exit 2 naming the key), the options of earlier
versions accepted hidden with the same result, and --help listing the settings from the dataclasses."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest

from moesq_runner import moesq_here

TINY = ["--seq-len", "32", "--n-train", "2", "--n-val", "2", "--n-init", "8"]
TINY_SET = ["--set", "calib.seq_len=32", "--set", "calib.n_train=2", "--set", "calib.n_val=2",
            "--set", "calib.n_init=8"]
TINY_YAML = "calib: {seq_len: 32, n_train: 2, n_val: 2, n_init: 8}\n"
FAST = ["--device", "cpu", "--quiet"]


def _commands():
    import typer.main

    from moesq_cli.app import app

    return typer.main.get_command(app).commands


def test_each_command_shows_at_most_ten_options():
    shown = {name: [p.opts[0] for p in cmd.params if p.param_type_name == "option" and not p.hidden]
             for name, cmd in _commands().items()}
    assert {"calibrate", "init-sgptq", "init", "refine", "run", "pack", "verify", "eval", "generate"} <= set(shown)
    assert all(len(opts) <= 10 for opts in shown.values()), {k: len(v) for k, v in shown.items()}
    for name in ("calibrate", "init-sgptq", "refine", "run"):
        assert {"--set", "--recipe", "--workdir", "--model"} <= set(shown[name]), shown[name]


def test_every_earlier_option_is_accepted_and_sets_a_known_key():
    from moesq_cli.settings import FLAGS, all_settings

    commands = _commands()
    for flag, (key, names, *_) in FLAGS.items():
        assert key in all_settings(), (flag, key)
        for name in names:
            opts = {o for p in commands[name].params for o in (*p.opts, *p.secondary_opts)}
            assert set(re.findall(r"-[-\w]+", flag)) <= opts, (name, flag)


def test_settings_are_the_dataclasses_fields():
    """Every field of the configs is a setting (and nothing else is), with the imported default."""
    from moesq_cli.settings import all_settings
    from moesq_core.compression.calibration import CalibConfig
    from moesq_core.compression.methods.refine import RefineConfig
    from moesq_core.compression.methods.registry import METHODS, method_options

    keys = set(all_settings())
    for prefix, cls in (("calib.", CalibConfig), ("refine.", RefineConfig)):
        fields = dataclasses.fields(cls)
        assert {k for k in keys if k.startswith(prefix)} == {prefix + f.name for f in fields}
        for f in fields:
            if f.default is not dataclasses.MISSING and all_settings()[prefix + f.name].default != "-":
                shown = all_settings()[prefix + f.name].default
                assert shown == ("null" if f.default is None else str(f.default).lower() if isinstance(f.default, bool)
                                 else str(f.default)), (f.name, shown)
    assert {k for k in keys if k.startswith("init.options.")} == {f"init.options.{o}" for m in METHODS
                                                                   for o in method_options(m)}
    assert {"format", "act_quant", "calib_source", "init.method", "refine", "baselines"} <= keys


def test_every_setting_has_a_help_text():
    """A setting's help is its config field's trailing comment (and comment lines right below it): a field without
    one, or whose comment was moved onto a line of its own above it, would be listed bare."""
    from moesq_cli.settings import all_settings

    bare = [key for key, s in all_settings().items() if not s.help.strip()]
    assert not bare, bare


def test_help_lists_the_settings_with_type_default_and_help():
    r = moesq_here("refine", "--help")
    out = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", r.stdout))
    assert "Settings: --set KEY=VALUE" in out
    assert "refine.epochs int 10 passes over the training tokens per block" in out
    assert "calib.seq_len int 512 tokens per calibration sequence" in out
    assert "refine.e2e_steps int | str auto" in out and "init.method" in out
    assert "init.options.percdamp" not in out  # refine's in-loop init takes the init stage's options
    out = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", moesq_here("init-sgptq", "--help").stdout))
    assert "init.options.percdamp float 0.01 Hessian damping" in out and "refine.epochs int" not in out
    # hidden from the Options panel, named below the key they set
    text = moesq_here("init-sgptq", "--help").stdout
    under = _options_under_keys(text)
    assert under["init.options.percdamp"] == ["--percdamp"] and under["format"] == ["--format, -f"]
    assert under["init.options.exact_scales"] == ["--exact-scales", "--fp32-scales"]
    assert under["calib.seed"] == ["--seed"]
    assert "--percdamp" not in _options_panel(text)
    refine_keys = _options_under_keys(moesq_here("refine", "--help").stdout)
    assert refine_keys["refine.train_support"] == ["--values-only: false"]


def _options_panel(help_text: str) -> str:
    return help_text.split("╭─ Options ")[1].split("╰")[0]


def _options_under_keys(help_text: str) -> dict[str, list[str]]:
    """The Settings panel's keys, each with the options listed below it."""
    out: dict[str, list[str]] = {}
    key = None
    for line in help_text.split("╭─ Settings")[1].splitlines()[2:]:
        if line[3:5] == "  " and line[5:6] == "-":
            out[key].append(re.split(r"\s{2,}", line[5:])[0])
        elif line[3:4].strip():
            key = re.split(r"\s{2,}", line[3:])[0]
            out[key] = []
    return out


def test_every_option_of_every_command_is_in_its_help():
    """Every option a command accepts is in its --help, hidden ones included: the Options panel shows ten at
    most, the More options panel the others that set no config field (each with its help), the Settings panel
    each config field with the options that set it."""
    import typer.main

    from moesq_cli.app import app
    from moesq_cli.settings import config_params

    group = typer.main.get_command(app)
    for name, cmd in [("", group), *_commands().items()]:
        out = moesq_here(*([name] if name else []), "--help").stdout
        words = set(re.findall(r"(?<![\w-])-{1,2}[A-Za-z][\w-]*", out))
        options = [p for p in cmd.params if p.param_type_name == "option"]
        accepted = {o for p in options for o in (*p.opts, *p.secondary_opts)}
        assert accepted <= words, (name, sorted(accepted - words))
        more = [p for p in options if p.hidden and p.name not in config_params({"init": "init-sgptq"}.get(name, name))]
        assert all(p.help for p in more), (name, [p.name for p in more if not p.help])
        for p in more:
            assert p.opts[0] not in _options_panel(out), (name, p.opts)
            assert p.opts[0] in out.split("╭─ More options ")[1], (name, p.opts)
        if "╭─ Settings" in out:  # each option that sets a key, below it
            under = {o.split(":")[0] for opts in _options_under_keys(out).values() for line in opts
                     for o in line.split(", ")}
            hidden = {o for p in options if p.hidden and p not in more for o in (*p.opts, *p.secondary_opts)}
            assert hidden <= under, (name, sorted(hidden - under))


@pytest.mark.parametrize("args, says", [
    (["calibrate", "--set", "calib.seq_lne=3"], "calib.seq_lne: unknown key (did you mean calib.seq_len?)"),
    (["calibrate", "--set", "refin.epochs=3"], "refin.epochs: unknown key"),
    (["calibrate", "--set", "refine.epochs=3"], "refine.epochs: not a setting of `moesq calibrate`"),
    (["calibrate", "--set", "calib.seq_len"], "expected KEY=VALUE"),
    (["calibrate", "--set", "calib.seq_len=0"], "calib.seq_len: must be a positive number"),
    (["calibrate", "--set", "format=p49"], "format: unknown format 'p49'"),
    (["calibrate", "--set", "act_quant=maybe"], "act_quant: expected true or false, got 'maybe'"),
    (["init-sgptq", "--set", "init.method=nope"], "init: unknown method 'nope'"),
    (["init-sgptq", "--set", "init.options.percdamp=x"], "init.options.percdamp: expected a number, got 'x'"),
    (["init-sgptq", "--set", "init.options.percdamp=.nan"], "init.options.percdamp: expected a finite number"),
    (["init-sgptq", "--set", "init.method=rtn", "--set", "init.options.refit=true"],
     "init.options.refit does not apply to method rtn"),
    (["refine", "--set", "refine.epochs=two"], "refine.epochs: expected an integer, got 'two'"),
    (["refine", "--set", "refine.lr_logits=-1"], "refine: learning rates must be positive"),
    (["refine", "--set", "refine.e2e_memory_gb=0"], "refine.e2e_memory_gb: must be > 0"),
    (["refine", "--set", "refine.steps_per_epoch=2", "--set", "refine.batch_rows=9"],
     "refine: steps_per_epoch and batch_rows exclude each other"),
    (["refine", "--set", "init.options.percdamp=0.1"], "init.options.percdamp: not a setting of `moesq refine`"),
    (["run", "--set", "refine=false", "--set", "refine.epochs=2"], "refine.epochs: this config has no refinement"),
    (["run", "--set", "baselines=[magnitude, nope]"], "baselines: unknown method 'nope'"),
])
def test_bad_settings_exit_2_naming_the_key_before_any_work(args, says, tmp_path):
    wd = tmp_path / "wd"
    r = moesq_here(*args, "-w", wd, "--quiet", check=False)
    assert r.returncode == 2 and says in re.sub(r"\s*│\s*", " ", r.stderr), r.stderr
    assert "Traceback" not in r.stderr and not wd.exists()


def test_apply_settings_over_a_recipe():
    from moesq_core.compression.config import CompressConfig, apply_settings

    base = CompressConfig.from_file(Path(__file__).parents[2] / "recipes" / "qwen3-30b-a3b-p48-nvfp4.yaml").to_dict()
    cfg = CompressConfig.from_dict(apply_settings(base, [("refine.steps_per_epoch", 4), ("init.method", "obr"),
                                                         ("calib.seq_len", 64), ("format", "s24-fp8")]))
    assert cfg.refine.steps_per_epoch == 4 and cfg.refine.batch_rows is None  # one of the two replaces the other
    assert cfg.refine.epochs == 10 and cfg.calib.seq_len == 64 and cfg.calib.n_train == 8192
    assert cfg.init.name == "obr" and "refit" not in cfg.init.options  # sgptq's options went with it
    assert CompressConfig.from_dict(apply_settings(base, [("refine", False)])).refine is None
    assert CompressConfig.from_dict(apply_settings({}, [("refine", True)])).refine is not None


def _stage(wd: Path, stage: str) -> tuple[dict, dict, dict]:
    """The work dir's run config, the stage's normalised config, and the sha256 of its artifacts."""
    m = json.loads((wd / "manifest.json").read_text())
    files = {str(p.relative_to(wd)): hashlib.sha256(p.read_bytes()).hexdigest()
             for d in ("calib", f"stages/{stage}") for p in sorted((wd / d).rglob("*")) if p.is_file()}
    return m["config"], m["stages"][stage]["config"], files


def test_an_option_set_and_a_recipe_make_the_same_stage(tmp_path):
    """The same settings by the earlier options, by --set and by a recipe: the same work dir config, stage
    identity and byte-identical artifacts (the embedded model, a tiny budget)."""
    old = ["--percdamp", "0.02", "--no-refit", "--hessian-weighting", "w"]
    new = ["--set", "init.options.percdamp=0.02", "--set", "init.options.refit=false",
           "--set", "init.options.hessian_weighting=w"]
    recipe = tmp_path / "init.yaml"
    recipe.write_text(TINY_YAML
                      + "init: {method: sgptq, options: {percdamp: 0.02, refit: false, hessian_weighting: w}}\n")
    made = []
    for name, args in (("old", [*TINY, *old]), ("set", [*TINY_SET, *new]), ("recipe", ["--recipe", recipe])):
        moesq_here("init-sgptq", "-w", tmp_path / name, *args, *FAST)
        made.append(_stage(tmp_path / name, "init-sgptq"))
    assert made[0][1]["options"]["percdamp"] == 0.02 and made[0][1]["options"]["refit"] is False
    assert made[0] == made[1] == made[2]

    old = ["--epochs", "1", "--steps-per-epoch", "2", "--lr-logits", "1e-3", "--e2e-steps", "2",
           "--e2e-batch-size", "2", "--no-init-split-rows", "--refine-seed", "3"]
    new = ["--set", "refine.epochs=1", "--set", "refine.steps_per_epoch=2", "--set", "refine.lr_logits=1e-3",
           "--set", "refine.e2e_steps=2", "--set", "refine.e2e_batch_size=2", "--set", "refine.init_split_rows=false",
           "--set", "refine.seed=3"]
    recipe = tmp_path / "refine.yaml"
    recipe.write_text(TINY_YAML + "refine: {epochs: 1, steps_per_epoch: 2, lr_logits: 1.0e-3, e2e_steps: 2, "
                                  "e2e_batch_size: 2, init_split_rows: false, seed: 3}\n")
    made = []
    for name, args in (("r-old", [*TINY, *old]), ("r-set", [*TINY_SET, *new]), ("r-recipe", ["--recipe", recipe])):
        moesq_here("refine", "-w", tmp_path / name, *args, *FAST)
        made.append(_stage(tmp_path / name, "refine"))
    refine = made[0][1]["refine"]
    assert refine["lr_logits"] == 1e-3 and refine["e2e_steps"] == 2 and refine["seed"] == 3
    assert "init_split_rows" not in refine
    assert made[0] == made[1] == made[2]


def test_a_recipe_gives_only_the_keys_it_writes(tmp_path):
    """On a work dir made with other calibration settings (another text, a tiny budget), a recipe that writes no
    calibration key runs the stage on the work dir's calibration, as the same options without a recipe would
    (`init-sgptq`, and `run` past its one-shot stage); a recipe key that differs from the work dir's is refused,
    naming only that key."""
    calib = tmp_path / "text.txt.xz"
    calib.write_bytes((Path(__file__).parents[2] / "moesq_core" / "assets" / "calib-sample.txt.xz").read_bytes())
    wd = tmp_path / "wd"
    moesq_here("calibrate", "-w", wd, *TINY, "--calib", calib, "--set", "act_quant=false", "--quiet")
    made = json.loads((wd / "manifest.json").read_text())["config"]

    stage_only = tmp_path / "rtn.yaml"
    stage_only.write_text("init: {method: rtn}\nrefine: {epochs: 1, steps_per_epoch: 2}\n")
    moesq_here("init-sgptq", "-w", wd, "--recipe", stage_only, *FAST)
    same = tmp_path / "same.yaml"  # writes the work dir's values: given, and they agree
    same.write_text(TINY_YAML + "act_quant: false\ninit: rtn\n")
    moesq_here("init-sgptq", "-w", wd, "--recipe", same, *FAST)
    run = tmp_path / "run.yaml"
    run.write_text("init: rtn\nbaselines: []\nrefine: null\n")
    r = moesq_here("run", "-w", wd, "--recipe", run, "--ppl-tokens", "1024", *FAST)
    assert "verify: ok" in r.stdout
    assert json.loads((wd / "manifest.json").read_text())["config"] == made
    assert json.loads((wd / "manifest.json").read_text())["stages"]["init-rtn"]["done"]

    other = tmp_path / "other.yaml"
    other.write_text("calib: {seq_len: 64}\ninit: rtn\n")
    for command in ("init-sgptq", "refine", "run"):
        r = moesq_here(command, "-w", wd, "--recipe", other, *FAST, check=False)
        assert r.returncode == 1 and "calib.seq_len: 32 (work dir) vs 64 (now)" in r.stderr, r.stderr
        assert "calib_source" not in r.stderr and "n_train" not in r.stderr and "act_quant" not in r.stderr
    assert json.loads((wd / "manifest.json").read_text())["config"] == made
