"""The stage commands as a user runs them, on one work dir: init-sgptq then refine (and the reverse), a
redo of a stage another command started, refine's default budget, and everything that must lose or mix up
nothing: foreign model weights, a second process, interrupted writes, a failed calibration, bad options,
signals, and SIGKILL at random points of every stage (calibration included) resuming to identical bytes."""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from moesq_runner import ENV, FAST, MOESQ, TINY_CALIB, moesq, moesq_here

# a tiny calibration set (fast, and refine's default budget derives only a few steps from it)
# a refinement budget small enough for a test (1 epoch of 2 steps per block)
SHORT = ["--epochs", "1", "--steps-per-epoch", "2"]


def _manifest(wd: Path) -> dict:
    return json.loads((wd / "manifest.json").read_text())


def _artifacts(wd: Path) -> dict[str, str]:
    """sha256 of every artifact (calibration and stage blocks) on disk."""
    return {str(p.relative_to(wd)): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in ("calib", "stages") for p in sorted((wd / d).rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def sgptq_workdir(tmp_path_factory, micro_path) -> Path:
    """A work dir calibrated on the small split and with init-sgptq done (made once; tests copy it)."""
    wd = tmp_path_factory.mktemp("base") / "wd"
    moesq_here("init-sgptq", "--model", micro_path, "-w", wd, *TINY_CALIB, *FAST)
    return wd


@pytest.fixture
def wd(sgptq_workdir, tmp_path) -> Path:
    dst = tmp_path / "wd"
    shutil.copytree(sgptq_workdir, dst)
    return dst


def test_init_then_refine_with_default_budget_then_redo(wd):
    """`init-sgptq` then `refine` (no budget options) on one work dir, then `init-sgptq --redo-from` on it."""
    r = moesq_here("refine", "-w", wd, *FAST)
    assert "stage refine: 4 blocks (4 computed now)" in r.stdout
    # the schedule is printed before training: 10 epochs (default) × steps derived from the data
    sched = next(line for line in r.stderr.splitlines() if line.startswith("refine schedule:"))
    # the block loop routes the training and one-shot sequences: (2 + 4) × 32 tokens × top-2 = 384 routed rows
    # over 8 experts, 48 rows each, capped at 8 rows per step
    assert "10 epochs × 6 steps" in sched and "from 6 training + one-shot sequences" in sched, sched
    assert _manifest(wd)["stages"]["refine"]["config"]["refine"]["steps_per_epoch"] is None
    # refinement ran its init inside the block loop with the options of the work dir's init-sgptq stage
    assert _manifest(wd)["stages"]["refine"]["config"]["init"] == _manifest(wd)["stages"]["init-sgptq"]["config"]
    before = _artifacts(wd)
    # typed options or defaults: the same init-sgptq stage
    r = moesq_here("init-sgptq", "-w", wd, "--percdamp", "0.01", "--exact-scales", *FAST)
    assert "(0 computed now)" in r.stdout
    r = moesq_here("init-sgptq", "-w", wd, "--redo-from", "2", *FAST)
    assert "(2 computed now)" in r.stdout
    assert _artifacts(wd) == before  # recomputed blocks are byte-identical
    assert moesq_here("refine", "-w", wd, *FAST).stdout.count("(0 computed now)") == 1


def test_refine_on_the_training_split_alone(wd):
    r = moesq_here("refine", "-w", wd, "--stage", "refine-train", "--no-init-split-rows", *SHORT, *FAST)
    sched = next(line for line in r.stderr.splitlines() if line.startswith("refine-train schedule:"))
    assert "from 2 training sequences" in sched, sched
    assert "init_split_rows" not in _manifest(wd)["stages"]["refine-train"]["config"]["refine"]


def test_refine_says_how_many_experts_improved_on_their_init(wd):
    from moesq_core.compression.engine import block_info

    r = moesq_here("refine", "-w", wd, *SHORT, *FAST)
    m = re.search(r"stage refine: 4 blocks \(4 computed now\) in .+?; (\d+) of (\d+) experts improved on their init",
                  " ".join(r.stdout.split()))  # the console wraps long lines
    assert m, r.stdout
    blocks = _manifest(wd)["stages"]["refine"]["blocks"].values()
    infos = [i for rec in blocks for i in block_info(wd / rec["file"]).values()]
    assert int(m.group(2)) == len(infos) == 32
    assert int(m.group(1)) == sum(i["refine"]["best_epoch"] > 0 for i in infos)
    # where every expert ships its init, the line says the budget did not pay
    from moesq_cli.app import _stage_line

    stats = {"blocks": 4, "computed_now": 4, "improved_on_init": {"improved": 0, "experts": 32}}
    line = _stage_line("refine", stats, wd)
    assert line.endswith("; 0 of 32 experts improved on their init (all ship the init: this budget is too small for "
                         "refinement to pay; raise --epochs / --steps-per-epoch)")


def test_run_evaluates_the_stages_it_made_only(wd):
    """`moesq run` on a work dir holding another finished stage (init-sgptq): its table has the reference, the
    stages of this run's config and the pack, not the other stage."""
    r = moesq_here("run", "-w", wd, "--method", "rtn", "--baselines", "", "--no-refine", "--ppl-tokens", "512",
                   *FAST, "--json", "-")
    rows = [row["label"] for row in json.loads(r.stdout)["rows"]]
    assert rows == ["reference", "rtn", "packed:packed"], rows


def test_refine_then_init(uninterrupted, tmp_path):
    """The reverse order: refine from nothing calibrates and refines (its init runs inside its block loop, no
    init stage is written: `uninterrupted` ran that command); init-sgptq afterwards is a baseline stage of its
    own and leaves refine as it is."""
    wd = tmp_path / "wd"
    shutil.copytree(uninterrupted[3], wd)
    assert set(_manifest(wd)["stages"]) == {"refine"}
    init = _manifest(wd)["stages"]["refine"]["config"]["init"]
    assert init["method"] == "sgptq" and init["options"]["refit"] is True  # part of refine's identity, normalised
    before = _artifacts(wd)
    r = moesq_here("init-sgptq", "-w", wd, *FAST)
    assert "stage init-sgptq: 4 blocks (4 computed now)" in r.stdout
    r = moesq_here("init-sgptq", "-w", wd, "--redo-from", "3", *FAST)
    assert "(1 computed now)" in r.stdout
    # the init stage made with refine's init options: refine is the same stage, only checked
    assert "(0 computed now)" in moesq_here("refine", "-w", wd, *SHORT, *FAST).stdout
    assert {k: v for k, v in _artifacts(wd).items() if "init-sgptq" not in k} == before


def test_refit_is_part_of_the_stage_identity(wd):
    before = (wd / "manifest.json").read_bytes()
    r = moesq_here("init-sgptq", "-w", wd, "--no-refit", *FAST, check=False)  # refit is sgptq's default
    assert r.returncode == 1 and "options.refit: True (work dir) vs False (now)" in r.stderr
    assert (wd / "manifest.json").read_bytes() == before
    assert _manifest(wd)["stages"]["init-sgptq"]["config"]["options"]["refit"] is True
    r = moesq_here("init-sgptq", "-w", wd, "--method", "rtn", "--refit", *FAST, check=False)
    assert r.returncode == 2 and "--refit/--no-refit does not apply to --method rtn" in r.stderr
    # how the refit's least squares are solved is part of the identity too (cg is the default)
    assert _manifest(wd)["stages"]["init-sgptq"]["config"]["options"]["solve"] == "cg"
    r = moesq_here("init-sgptq", "-w", wd, "--solve", "exact", *FAST, check=False)
    assert r.returncode == 1 and "options.solve: 'cg' (work dir) vs 'exact' (now)" in r.stderr, r.stderr
    r = moesq_here("init-sgptq", "-w", wd, "--solve", "lu", *FAST, check=False)
    assert r.returncode == 2 and "init.options.solve: must be one of cg, exact, got 'lu'" in r.stderr
    r = moesq_here("init-sgptq", "-w", wd, "--method", "rtn", "--solve", "cg", *FAST, check=False)
    assert r.returncode == 2 and "--solve does not apply to --method rtn" in r.stderr
    assert (wd / "manifest.json").read_bytes() == before


def _changed_copy(src: Path, dst: Path, factor: float) -> Path:
    """A copy of the model with every floating-point weight scaled (same names, shapes and config)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    sd = {k: (v * factor).to(v.dtype) if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
    save_file(sd, str(f), metadata={"format": "pt"})
    return dst


def test_other_weights_are_refused(wd, micro_path, tmp_path):
    before = (wd / "manifest.json").read_bytes()
    other = _changed_copy(micro_path, tmp_path / "other", 1.05)
    r = moesq_here("init-sgptq", "--model", other, "-w", wd, *FAST, check=False)
    assert r.returncode == 1 and "was made for another model" in r.stderr and "other weights" in r.stderr
    assert (wd / "manifest.json").read_bytes() == before
    # the model a work dir was made from, changed in place afterwards
    copy = tmp_path / "copy"
    shutil.copytree(micro_path, copy)
    wd2 = tmp_path / "wd2"
    moesq_here("calibrate", "--model", copy, "-w", wd2, *TINY_CALIB, "--quiet")
    _changed_copy(micro_path, tmp_path / "tmpmodel", 0.95)
    shutil.copy(tmp_path / "tmpmodel" / "model.safetensors", copy / "model.safetensors")
    r = moesq_here("init-sgptq", "-w", wd2, "--method", "rtn", *FAST, check=False)
    assert r.returncode == 1 and "changed since this work dir was made" in r.stderr
    assert "init-rtn" not in _manifest(wd2)["stages"]


def test_second_process_is_refused_while_one_holds_the_lock(wd):
    from moesq_core.compression.workdir import WorkDir

    before = (wd / "manifest.json").read_bytes()
    with WorkDir(wd).locked():
        r = moesq("refine", "-w", wd, *SHORT, *FAST, check=False)
    assert r.returncode == 1 and "in use by another moesq process" in r.stderr
    assert (wd / "manifest.json").read_bytes() == before


def test_interrupted_calibration_and_temp_files(micro_path, tmp_path):
    """What a kill during calibration leaves (a manifest without calibration, temp files) is resumed by any
    stage command, even with other calibration options; only moesq's own temp names are removed."""
    wd = tmp_path / "wd"
    moesq_here("calibrate", "--model", micro_path, "-w", wd, *TINY_CALIB, "--quiet")
    m = _manifest(wd)
    del m["calibration"]
    (wd / "manifest.json").write_text(json.dumps(m))
    (wd / "calib" / "calibration.safetensors").rename(wd / "calib" / ".calibration.safetensors.k3j_x9a0.tmp")
    (wd / "cache" / "init-rtn-rank0").mkdir(parents=True)
    (wd / "cache" / "init-rtn-rank0" / "tmpab12cd34.pt").write_bytes(b"x")
    (wd / "cache" / "refine-rank0").mkdir(parents=True)
    (wd / "cache" / "refine-rank0" / "tmpe_tprqyf.states").write_bytes(b"x")  # StateStore's spill (mkstemp)
    (wd / "cache" / "refine-rank0" / "mine.states").write_text("mine")
    (wd / "notes.tmp").write_text("mine")
    r = moesq_here("init-sgptq", "-w", wd, "--method", "rtn", "--n-init", "6", *FAST)
    assert "4 computed now" in r.stdout
    assert _manifest(wd)["config"]["calib"]["n_init"] == 6 and _manifest(wd)["calibration"]["sequences"]["init"] == 6
    assert not list(wd.rglob("*.k3j_x9a0.tmp")) and not list(wd.rglob("tmpab12cd34.pt"))
    assert not list(wd.rglob("tmpe_tprqyf.states"))
    assert (wd / "notes.tmp").read_text() == "mine"
    assert (wd / "cache" / "refine-rank0" / "mine.states").read_text() == "mine"


def test_failed_calibration_leaves_nothing(micro_path, tmp_path):
    wd = tmp_path / "wd"
    for name, data in (("binary.txt", bytes(range(256)) * 20), ("empty.txt", b""), ("nul.txt", b"abc\0def")):
        f = tmp_path / name
        f.write_bytes(data)
        r = moesq_here("calibrate", "--model", micro_path, "-w", wd, "--calib", f, "--quiet", check=False)
        assert r.returncode == 1 and str(f) in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not wd.exists()
    moesq_here("calibrate", "--model", micro_path, "-w", wd, *TINY_CALIB, "--quiet")
    assert "calibration" in _manifest(wd)


def test_bad_options_never_touch_the_manifest(wd):
    before = (wd / "manifest.json").read_bytes()
    cases = [
        (["refine", "-w", wd, "--steps-per-epoch", "4", "--batch-rows", "100"], 2,
         "--steps-per-epoch and --batch-rows"),
        (["refine", "-w", wd, "--micro-batch-rows", "0"], 2, "--micro-batch-rows"),
        (["refine", "-w", wd, "--values-only", "--support-only"], 2, "--values-only and --support-only"),
        (["refine", "-w", wd, "--seq-len", "128"], 1, "seq_len: 32 (work dir) vs 128 (now)"),
        (["refine", "-w", wd, "--init", "nope"], 2, "--init"),
        (["init-sgptq", "-w", wd, "--redo-from", "9"], 1, "--redo-from 9"),
        (["init-sgptq", "-w", wd, "--method", "gptq"], 1, "sparse"),
        (["init-sgptq", "-w", wd, "--hessian-weighting", "w3"], 2, "--hessian-weighting"),
    ]
    for args, code, text in cases:
        r = moesq_here(*args, *FAST, check=False)
        assert r.returncode == code and text in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert (wd / "manifest.json").read_bytes() == before
    assert "refine" not in _manifest(wd)["stages"]


@pytest.mark.parametrize("args, option", [
    (["calibrate", "-w", "/etc/passwd/x"], "--workdir"),
    (["init-sgptq", "--batch-size", "0"], "--batch-size"),
    (["init-sgptq", "--seq-len", "-5"], "--seq-len"),
    (["calibrate", "--n-train", "0"], "--n-train"),
    (["calibrate", "--n-val", "0"], "--n-val"),
    (["calibrate", "--format", "p24"], "--format"),
    (["calibrate", "--calib", "no/such/file.txt.xz"], "--calib"),
    (["refine", "--lr-values", "-1"], "--lr-values"),
    (["refine", "--loss-power", "3"], "--loss-power"),
    (["refine", "--chunk-gb", "0"], "--chunk-gb"),
    (["refine", "--stage", "../x"], "--stage"),
    (["init-sgptq", "--device", "tpu"], "--device"),
    (["init-sgptq", "--cache-gb", "-1"], "--cache-gb"),
    (["run", "--baselines", "magnitude,nope"], "--baselines"),
])
def test_usage_errors_name_the_option(args, option, tmp_path):
    r = moesq_here(*args, check=False, cwd=tmp_path)
    assert r.returncode == 2 and option in _flat(r.stderr) and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "moesq-work").exists()


def test_workdir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = moesq_here("refine", "-w", f, check=False)
    assert r.returncode == 2 and "is a file" in _flat(r.stderr) and f.read_text() == "x"


def _flat(text: str) -> str:
    """Text of an error panel without its box and line wrapping."""
    return " ".join(text.replace("│", " ").split())


def _wait_for(pred, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if pred():
                return True
        except (FileNotFoundError, KeyError, json.JSONDecodeError):
            pass
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_says_what_was_saved(wd, sig, code):
    p = subprocess.Popen([MOESQ, "refine", "-w", str(wd), *SHORT, *FAST], env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: len(_manifest(wd)["stages"]["refine"]["blocks"]) >= 1)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    if p.returncode == 0:  # finished before the signal arrived
        pytest.skip("the stage finished before the signal")
    assert p.returncode == code, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"interrupted ({sig.name})")
    assert "refine " in line and "/4 blocks" in line and "re-run" in line
    assert "Traceback" not in err
    assert "Traceback" in (wd / "logs" / "moesq.log").read_text()  # kept, not swallowed
    assert not list(wd.rglob("*.tmp"))
    moesq_here("refine", "-w", wd, *SHORT, *FAST)


# -- kill at random points, resume, compare bytes --------------------------------------------------------
KILL_CMD = ["refine", *TINY_CALIB, *SHORT, *FAST]


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, micro_path):
    """Artifacts of one uninterrupted calibrate → refine (`moesq refine --model` on a new work dir), its wall
    time, the time at which its calibration was recorded (so kills can aim at the calibration phase too) and
    the work dir (tests copy it)."""
    wd = tmp_path_factory.mktemp("ref") / "wd"
    t0 = time.time()
    p = subprocess.Popen([MOESQ, *KILL_CMD, "--model", str(micro_path), "-w", str(wd)], env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: p.poll() is not None or "calibration" in _manifest(wd))
    t_calib = time.time() - t0
    assert p.wait(timeout=1200) == 0, p.stderr.read()
    return _artifacts(wd), time.time() - t0, t_calib, wd


def _state(wd: Path) -> str:
    """Where a killed run stopped (for the failure message)."""
    try:
        m = _manifest(wd)
    except (FileNotFoundError, json.JSONDecodeError):
        return "before the work dir existed" if not wd.exists() else "work dir without manifest"
    if "calibration" not in m:
        return "during calibration"
    return ", ".join(f"{k}:{len(v['blocks'])}" for k, v in m["stages"].items()) or "calibrated"


def _kill_and_resume(micro_path, wd: Path, seed: int, uninterrupted, kills: int = 2) -> list[str]:
    want, seconds, t_calib, _ = uninterrupted
    rng = random.Random(seed)
    stops = []
    for k in range(kills):
        # the first kill aims at the end of start-up and calibration, the others anywhere in the run
        at = rng.uniform(0.6 * t_calib, 1.05 * t_calib) if k == 0 else rng.uniform(0.5, seconds)
        p = subprocess.Popen([MOESQ, *KILL_CMD, "--model", str(micro_path), "-w", str(wd)], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            p.wait(timeout=at)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
        stops.append(_state(wd))
    moesq(*KILL_CMD, "--model", micro_path, "-w", wd)
    assert _artifacts(wd) == want, f"seed {seed}: killed at {stops}"
    assert not list(wd.rglob("*.tmp")) and not list(wd.rglob("tmp*.pt"))
    return stops


def test_kill_anywhere_resumes_to_identical_artifacts(micro_path, tmp_path, uninterrupted):
    _kill_and_resume(micro_path, tmp_path / "wd", 0, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 9))
def test_kill_anywhere_resumes_to_identical_artifacts_many_seeds(micro_path, tmp_path, uninterrupted, seed):
    _kill_and_resume(micro_path, tmp_path / "wd", seed, uninterrupted, kills=3)
