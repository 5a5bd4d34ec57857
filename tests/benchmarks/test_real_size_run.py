"""benchmarks/real_size_run.py: the real-size run's driver (every moesq command on one work dir, measured,
resumable) on a narrow model of the same architecture, on the CPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import benchmark_module, run_benchmark_script

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["--layers", "2", "--small", "--device", "cpu", "--n-train", "4", "--ppl-tokens", "1024"]


def run(*args, check=True, timeout=1200):
    return run_benchmark_script("real_size_run", *args, check=check, timeout=timeout)


def _driver():
    """The driver script as a module."""
    return benchmark_module("real_size_run")


def test_results_hold_no_machine_paths(tmp_path):
    relative = _driver().relative
    root = tmp_path / "root"
    doc = {"path": str(root / "work" / "packed"), "file": "/somewhere/else/eval.txt", "n": 3,
           "rows": [{"workdir": str(root / "work")}], "label": "packed:packed"}
    assert relative(doc, root) == {"path": "work/packed", "file": "eval.txt", "n": 3, "rows": [{"workdir": "work"}],
                                   "label": "packed:packed"}


def test_per_block_phases_come_from_the_engine_log(tmp_path):
    # the H200 log's lines (one resume: blocks 1 and 2 of refine were only installed and propagated there)
    block_phases = _driver().block_phases
    log = tmp_path / "moesq.log"
    E = "2026-12-01 20:15:47,214 INFO moesq.engine: "
    R = "2026-12-01 20:25:37,457 INFO moesq_core.compression.methods.refine: refine: 128 experts in 1 chunk(s), "
    log.write_text("\n".join([
        E + "init-sgptq: layer 0 phases (s): {'route': 1.43, 'compress': 9.11, 'write': 1.28, 'propagate': 0.55}",
        E + "init-sgptq: layer 1 phases (s): {'route': 0.1, 'compress': 7.04, 'write': 1.23, 'propagate': 0.77}",
        E + "init-sgptq: layer 2 phases (s): {'route': 0.08, 'compress': 6.43, 'write': 1.25, 'propagate': 0.69}",
        R + "init 8.9 s, refinement 47.7 s (1 epochs × 8 steps)",
        E + "refine: layer 0 phases (s): {'compress': 57.0, 'propagate': 1.78}",
        E + "refine: layer 1 phases (s): {'install': 0.88, 'propagate': 2.07}",
        R + "init 8.1 s, refinement 1.0 s (1 epochs × 8 steps)",
        E + "refine: layer 2 phases (s): {'install': 0.2, 'compress': 9.2, 'propagate': 1.9}",
        "a line of something else"]) + "\n")
    got = block_phases(log)
    assert got["init-sgptq"] == {"blocks": 3, "total": 8.79, "first_block": 12.37, "route": 0.09, "compress": 6.73,
                                 "write": 1.24, "propagate": 0.73}
    assert got["refine"] == {"blocks": 2, "total": 11.3, "first_block": 58.78, "compress": 9.2, "propagate": 1.9,
                             "install": 0.2, "in_loop_init": 8.1, "refinement": 1.0}
    assert block_phases(tmp_path / "missing.log") == {}


def test_budget_options_reach_calibrate_and_refine(tmp_path):
    """The full-budget run's options: calibration sizes go to calibrate, --batch-rows replaces the steps per epoch,
    and the schedule refine printed is read back from the work dir's log."""
    drv = _driver()
    import argparse

    args = argparse.Namespace(n_train=960, seq_len=4096, n_val=128, n_init=0, epochs=80, steps_per_epoch=8,
                              batch_rows=2097152, e2e_steps="0")
    args.calib = ""
    assert drv.calib_args(args) == ["--n-train", "960", "--seq-len", "4096", "--n-val", "128"]
    assert drv.refine_args(args) == ["--epochs", "80", "--batch-rows", "2097152", "--e2e-steps", "0"]
    args.batch_rows, args.e2e_steps = 0, ""
    assert drv.refine_args(args) == ["--epochs", "80", "--steps-per-epoch", "8"]
    log = tmp_path / "moesq.log"
    log.write_text("2026-12-02 09:17:49,099 INFO moesq: "
                   "refine schedule: 2 epochs × 16 steps = 32 Lion steps per block\n"
                   "2026-12-02 10:17:49,099 INFO moesq: "
                   "refine schedule: 80 epochs × 16 steps = 1280 Lion steps per block\n")
    assert drv.refine_schedule(log) == "80 epochs × 16 steps = 1280 Lion steps per block"
    assert drv.refine_schedule(tmp_path / "missing.log") is None


@pytest.mark.slow
def test_pipeline_runs_every_command_resumes_after_a_deadline_and_writes_results(tmp_path):
    root, out = tmp_path / "run", tmp_path / "out"
    # stopped almost at once: exit 3 and a line saying how to resume, nothing recorded as done past the stop
    r = run("--root", root, *SMOKE, "--deadline-s", "3", "--out", out, check=False)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "run the same command again to resume" in r.stdout
    state = json.loads((root / "real_size_state.json").read_text())
    assert state["steps"]["generate"]["done"]
    assert not all(s["done"] for s in state["steps"].values()) and not out.exists()
    # the same command (no deadline) finishes the run
    r = run("--root", root, *SMOKE, "--out", out)
    state = json.loads((root / "real_size_state.json").read_text())
    assert [k for k, s in state["steps"].items() if s["done"]] == ["generate", "calibrate", "init-sgptq", "refine",
                                                                  "pack", "verify", "eval"]
    (js,) = out.glob("real_size_run_cpu_*.json")
    doc = json.loads(js.read_text())
    assert doc["steps"]["verify"]["result"]["ok"] is True
    assert doc["steps"]["eval"]["result"]["ppl"][0]["tokens"] == 1024
    assert doc["steps"]["refine"]["attempts"][-1]["peak_host_gib"] > 0
    assert doc["sizes_bytes"]["packed"] > 0 and doc["sizes_bytes"]["model"] > doc["sizes_bytes"]["packed"]
    text = js.read_text() + js.with_suffix(".md").read_text()
    assert str(tmp_path) not in text  # relative paths only
    assert "| verify |" in js.with_suffix(".md").read_text()
    # a finished run is not redone; other options on the same root are refused
    again = run("--root", root, *SMOKE)
    assert "calibrate:" not in again.stdout
    bad = run("--root", root, *SMOKE[:-2], "--ppl-tokens", "2048", check=False)
    assert bad.returncode != 0 and "other options" in bad.stderr


@pytest.mark.slow
def test_scaling_reports_one_against_two_processes(tmp_path):
    out = tmp_path / "out"
    run("--root", tmp_path / "s", *SMOKE, "--scaling", "--stages", "init-sgptq", "--nproc", "2", "--out", out,
        "--model-dir", tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "config.json").exists() and not (tmp_path / "s" / "model").exists()
    (js,) = out.glob("real_size_scaling_cpu_*.json")
    doc = json.loads(js.read_text())
    r = doc["scaling"]["init-sgptq"]
    assert len(r["1"]["block_seconds"]) == 2 and len(r["2"]["block_seconds"]) == 2
    assert r["speedup_per_block_after_first"] > 0 and r["same_artifacts"] is True
    # both work dirs hold the same artifacts (expert parallel writes what one process writes)
    a, b = (json.loads((tmp_path / "s" / f"work-n{n}" / "manifest.json").read_text())["stages"]["init-sgptq"]["blocks"]
            for n in (1, 2))
    assert {k: v["sha256"] for k, v in a.items()} == {k: v["sha256"] for k, v in b.items()}


def test_kimi_k2_block_shape():
    """--shape kimi-k2-block: one block of Kimi-K2's routed experts (384 of 7168 × 2048, top-8)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from real_size_run import main, model_config
    finally:
        sys.path.pop(0)
    import argparse

    cfg = model_config(argparse.Namespace(shape="kimi-k2-block", small=False, layers=0))
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"],
            cfg["num_experts_per_tok"], cfg["num_local_experts"]) == (1, 7168, 2048, 384, 8, 384)
    with pytest.raises(SystemExit):
        main(["--root", "unused", "--shape", "kimi-k3"])
    for extra in ("--skip-init", "--scaling"):  # --no-refit sets the options of an init-sgptq stage those lack
        with pytest.raises(SystemExit):
            main(["--root", "unused", "--no-refit", extra])


@pytest.mark.slow
def test_kimi_block_pipeline_without_the_separate_init(tmp_path):
    """--shape kimi-k2-block --skip-init (narrowed with --small): refine computes the SGPTQ init itself, then
    pack, verify and eval run on its stage."""
    out = tmp_path / "out"
    run("--root", tmp_path / "k", "--shape", "kimi-k2-block", "--skip-init", *SMOKE[2:], "--out", out,
        "--seq-len", "64", "--batch-rows", "256", "--e2e-steps", "0", "--tag", "budget")
    (js,) = out.glob("real_size_run_kimi-k2-block_budget_cpu_*.json")
    doc = json.loads(js.read_text())
    assert list(doc["steps"]) == ["generate", "calibrate", "refine", "pack", "verify", "eval"]
    assert doc["header"]["model_shape"]["num_hidden_layers"] == 1 and doc["header"]["options"]["skip_init"]
    assert doc["steps"]["verify"]["result"]["ok"] is True
    assert "stage init-sgptq" not in doc["sizes_bytes"] and doc["sizes_bytes"]["stage refine"] > 0
    assert doc["header"]["options"]["batch_rows"] == 256 and "Lion steps per block" in doc["refine_schedule"]


@pytest.mark.slow
def test_kimi_block_pipeline_with_the_papers_sgptq_stage(tmp_path):
    """--no-refit: the init-sgptq stage is the paper's SGPTQ, and refine's in-loop init takes that stage's options."""
    out = tmp_path / "out"
    run("--root", tmp_path / "k", "--shape", "kimi-k2-block", "--no-refit", *SMOKE[2:], "--out", out)
    (js,) = out.glob("real_size_run_kimi-k2-block_cpu_*.json")
    doc = json.loads(js.read_text())
    assert list(doc["steps"]) == ["generate", "calibrate", "init-sgptq", "refine", "pack", "verify", "eval"]
    assert doc["header"]["options"]["no_refit"] and doc["steps"]["verify"]["result"]["ok"] is True
    stages = json.loads((tmp_path / "k" / "work" / "manifest.json").read_text())["stages"]
    assert stages["init-sgptq"]["config"]["options"]["refit"] is False
    assert stages["refine"]["config"]["init"]["options"]["refit"] is False
