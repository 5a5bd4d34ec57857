"""benchmarks/refine_paper_calibration.py: `moesq refine` at the paper's calibration, measured and resumable. The
end-to-end run is the script's CPU smoke mode (a narrow model, tiny calibration); the result assembly is also
checked on a recorded work dir whose log lines have the engine's and the refine method's formats."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from conftest import benchmark_module, run_benchmark_script

SMOKE = ["--small", "--device", "cpu", "--seq-len", "32", "--n-train", "8", "--n-init", "4", "--n-val", "4",
         "--batch-rows", "64", "--epochs", "1"]
KEYS = {"gpu", "commit", "date", "command", "blocks_measured", "gpu_min_per_block", "per_block", "peak_gpu_gib", "oom",
        "extrapolated_48_layer_hours", "extrapolation", "calibration", "schedule", "wall_s", "resource_options",
        "plan_gib", "propagation_s_per_layer"}


def run(*args, check=True, timeout=600):
    return run_benchmark_script("refine_paper_calibration", *args, check=check, timeout=timeout,
                                env={"MOESQ_COMMIT": "abc1234"})


def _script():
    return benchmark_module("refine_paper_calibration")


def test_the_measured_command_is_the_papers_calibration_with_default_resources(tmp_path):
    rpc = _script()
    args = rpc.parse_args(["--root", str(tmp_path), "--calib", str(tmp_path / "calib-docs.txt.xz")])
    cmd = rpc.refine_command(args, Path("/r/model"), Path("/r/work"), Path("/r/results/refine.json"))
    assert cmd == ["refine", "-m", "/r/model", "-w", "/r/work", "--calib", str(tmp_path / "calib-docs.txt.xz"),
                   "--seq-len", "4096", "--n-train", "960", "--n-init", "64", "--n-val", "128",
                   "--batch-rows", "2097152", "--epochs", "80", "--e2e-steps", "0", "--json", "/r/results/refine.json"]
    assert rpc.resource_options(args) == {}
    # every option is overridable under moesq's name; resource options are passed (and recorded) only when given
    args = rpc.parse_args(["--root", str(tmp_path), "--epochs", "2", "--chunk-gb", "40", "--micro-batch-rows", "65536",
                           "--device", "cuda"])
    cmd = rpc.refine_command(args, Path("/m"), Path("/w"), Path("/j"))
    assert "--calib" not in cmd and cmd[cmd.index("--epochs") + 1] == "2"
    assert cmd[-8:] == ["--micro-batch-rows", "65536", "--chunk-gb", "40.0", "--device", "cuda", "--json", "/j"]
    assert rpc.resource_options(args) == {"--micro-batch-rows": 65536, "--chunk-gb": 40.0}


E = "INFO moesq.engine: refine: "
R = "INFO moesq_core.compression.methods.refine: refine: "
M = "INFO moesq: "
SCHEDULE = ("refine schedule: 80 epochs × 16 steps = 1280 Lion steps per block, ~2,097,152 routed rows per step; lr(A) "
            "0.00025, lr(V) 5e-05 (from 1024 training + one-shot sequences × 4096 tokens × top-8 ≈ 33,554,432 routed "
            "rows over 128 experts per block)")


def _recorded_work_dir(root: Path) -> Path:
    """A work dir as two runs of the paper-calibration command leave it: the first calibrates and computes
    block 0, is stopped in block 1; the second resumes from the saved states and computes block 1 in two engine
    chunks. Log lines in the formats of pipeline.py, engine.py, state_checkpoint.py and methods/refine."""
    work = root / "work"
    (work / "logs").mkdir(parents=True)
    cal = {"file": "calib/calibration.safetensors", "sha256": "0" * 64,
           "sequences": {"train": 960, "val": 128, "init": 64}, "seq_len": 4096, "tokens": 1152 * 4096,
           "documents": 9000}
    (work / "manifest.json").write_text(json.dumps({"calibration": cal, "stages": {"refine": {
        "blocks": {"0": {"file": "stages/refine/block_000.safetensors"},
                   "1": {"file": "stages/refine/block_001.safetensors"}},
        "block_timings": {"0": {"seconds": 300.0}, "1": {"seconds": 240.0}}}}}))
    start = (f"{M}moesq refine -m {root}/model -w {work} --calib /data/calib-docs.txt.xz --seq-len 4096 "
             f"--json {root}/r.json")
    lines = [
        f"2026-12-05 10:00:00,000 {start}",
        f"2026-12-05 10:00:30,000 {M}calibration: {cal}",
        f"2026-12-05 10:00:42,500 {M}{SCHEDULE}",
        f"2026-12-05 10:00:42,600 {M}calibration states: 17.2 GiB per copy; up to 4.0 GiB in cuda memory",
        f"2026-12-05 10:00:42,700 {M}refine memory: ~70.5 GiB per block at peak on cuda:0 of 138.0 GiB available "
        "(resident weights ~3.1 GiB + the largest phase: refinement ~67.4 GiB)",
        "2026-12-05 10:01:10,000 INFO moesq.progress: refine: layer 0 steps 1/1280 (0 %)",
        f"2026-12-05 10:06:00,000 {R}128 experts in 1 chunk(s), init 4.0 s, refinement 290.0 s (80 epochs × 16 steps)",
        "2026-12-05 10:06:05,000 INFO moesq.engine: refine: layer 0, 128 experts compressed in 300.0 s (rank 0 of 1)",
        "2026-12-05 10:06:20,000 INFO moesq.engine: refine: calibration states after layer 0 saved for resuming "
        "(19.33 GB in 9.5 s)",
        # the block loop started at 10:06:20 - 320 s = 10:01:00: embedding took 17.5 s after the schedule line
        f"2026-12-05 10:06:20,000 {E}layer 0 phases (s): {{'other': 0.0, 'write': 1.0, 'route': 2.0, 'weights': 1.0, "
        "'compress': 294.0, 'ranges': 2.0, 'gather': 0.0, 'wait': 0.0, 'install': 0.5, "
        "'propagate': 10.0, 'save states': 9.5}",
        f"2026-12-05 10:06:09,001 {E}layer 0 peak GPU memory per phase (GiB allocated, reserved): "
        "{'route': [22.0, 23.5], 'compress': [66.1, 68.0]}",
        f"2026-12-05 10:06:20,001 {E}layer 0 peak GPU memory per phase (GiB allocated, reserved): "
        "{'propagate': [30.2, 31.0]}",
        f"2026-12-05 10:09:00,000 {R}64 experts in 1 chunk(s), init 2.0 s, refinement 100.0 s (block 1, stopped)",
        "Traceback (most recent call last):",
        f"2026-12-05 10:10:00,000 {start}",
        f"2026-12-05 10:10:05,000 {M}calibration already done: {work}/calib/calibration.safetensors",
        f"2026-12-05 10:10:15,000 {M}{SCHEDULE}",
        f"2026-12-05 10:10:40,000 {E}resuming after layer 0 from its saved calibration states (the finished blocks "
        "up to it are installed, not run)",
        f"2026-12-05 10:12:40,000 {R}64 experts in 1 chunk(s), init 1.5 s, refinement 110.0 s (80 epochs × 16 steps)",
        f"2026-12-05 10:14:40,000 {R}64 experts in 1 chunk(s), init 1.5 s, refinement 115.0 s (80 epochs × 16 steps)",
        f"2026-12-05 10:14:45,000 {E}layer 1 phases (s): {{'write': 1.0, 'route': 2.0, 'weights': 1.0, "
        "'compress': 228.0, 'ranges': 2.0, 'install': 0.4}",
        f"2026-12-05 10:14:46,000 {E}done, {{'blocks': 2, 'computed_now': 1}}",
    ]
    (work / "logs" / "moesq.log").write_text("\n".join(lines) + "\n")
    (root / "commands.log").write_text(f"\n$ moesq refine -m {root}/model\ninterrupted (SIGTERM): saved in {work}\n")
    return work


def test_results_from_a_recorded_work_dir(tmp_path):
    rpc = _script()
    root = tmp_path / "root"
    work = _recorded_work_dir(root)
    state = {"steps": {"generate": {"done": True, "model_bytes": 3 * 2 ** 30, "attempts": [{"rc": 0, "wall_s": 8.0}]},
                       "refine": {"done": True, "attempts": [
                           {"rc": -15, "wall_s": 540.0, "stopped": True, "peak_host_gib": 30.0,
                            "peak_gpu_gib": [120.5]},
                           {"rc": 0, "wall_s": 300.0, "stopped": False, "peak_host_gib": 31.0,
                            "peak_gpu_gib": [118.0]}]}}}
    cfg = {"num_hidden_layers": 2, "hidden_size": 2048, "num_experts": 128, "moe_intermediate_size": 768,
           "num_experts_per_tok": 8, "vocab_size": 151936}
    command = ["refine", "-m", str(root / "model"), "-w", str(work), "--calib", "/data/calib-docs.txt.xz",
               "--json", str(root / "results" / "refine.json")]
    doc = rpc.results(root, work, state, command, {"calib": "/data/calib-docs.txt.xz", "seq_len": 4096}, {}, cfg,
                      "NVIDIA H200", "abc1234", "2026-12-05", "calib-docs.txt.xz")
    assert KEYS <= set(doc)
    assert doc["command"] == ("moesq refine -m model -w work --calib calib-docs.txt.xz --json results/refine.json")
    assert doc["blocks_measured"] == 2
    assert doc["gpu_min_per_block"] == pytest.approx(statistics.mean([300.0, 240.0]) / 60, abs=1e-3) == 4.5
    b0, b1 = doc["per_block"]
    assert (b0["layer"], b0["seconds"], b1["seconds"]) == (0, 300.0, 240.0)
    assert b0["phases"]["compress"] == 294.0 and b0["phases"]["propagate"] == 10.0
    assert b0["compress_split"] == {"in_loop_init": 4.0, "refinement": 290.0, "engine_chunks": 1}
    # block 1: the two chunks of the run that finished it, not the stopped run's partial chunk
    assert b1["compress_split"] == {"in_loop_init": 3.0, "refinement": 225.0, "engine_chunks": 2}
    # one-time costs from the time stamps: calibration 30 s, model load 12.5 s (calibration line → schedule line),
    # embedding 17.5 s (schedule line → the loop's start: block 0's phases line less its 320 s of phases)
    assert doc["one_time_s"] == {"model_load": 12.5, "calibration": 30.0, "embedding": 17.5}
    assert doc["one_time_per_run_s"][1] == {"model_load": 10.0, "embedding": 25.0}  # the resumed run: no calibration
    between = 0.5 + 10.0  # install + propagate, block 0 (the last block propagates nothing)
    assert doc["between_blocks_s"] == between and doc["state_save_s"] == 9.5
    # a save after every block: 280.5 s per block is past both a minute and 20 × the 9.5 s save
    total = 30.0 + 12.5 + 17.5 + 48 * 270.0 + 47 * between + 47 * 9.5
    assert doc["extrapolated_48_layer_hours"] == round(total / 3600, 2)
    assert rpc.extrapolate(doc["one_time_s"], 270.0, between, 9.5) == pytest.approx(total)
    for number in ("60.0 s", "48 × 270.0 s", "47 × 10.50 s", "47 × 9.50 s", f"{total:.0f} s", "300.0, 240.0"):
        assert number in doc["extrapolation"]
    assert doc["peak_gpu_gib_nvidia_smi"] == 120.5 and doc["oom"] is False and doc["exit_status"] == 0
    # torch's peak reserved memory over the blocks' phases, against the plan the refine memory line printed
    assert doc["peak_gpu_gib"] == 68.0 and doc["plan_gib"] == 70.5 and doc["peak_within_plan"] is True
    assert doc["plan_over_peak"] == round(70.5 / 68.0, 3)
    assert b0["peak_gpu_gib"]["compress"] == [66.1, 68.0] and b0["peak_gpu_gib"]["propagate"] == [30.2, 31.0]
    assert "peak_gpu_gib" not in b1
    assert doc["propagation_s_per_layer"] == 10.0
    assert doc["wall_s"] == [540.0, 300.0] and doc["resource_options"] == {}
    assert doc["calibration"]["routed_rows_per_block"] == (960 + 64) * 4096 * 8 == 33554432
    assert doc["schedule"].startswith("80 epochs × 16 steps = 1280 Lion steps per block")
    text = json.dumps(doc) + rpc.markdown(doc)
    assert str(tmp_path) not in text and "/data" not in text  # relative paths only
    assert "| 2026-12-05 | NVIDIA H200 | abc1234 | 4.50 | 70.5 | 68.0 | 120.5 | no | 10.0 |" in rpc.markdown(doc)
    # an out-of-memory error in the log is reported
    with open(work / "logs" / "moesq.log", "a") as f:
        f.write("2026-12-05 10:20:00,000 INFO moesq: traceback:\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    assert rpc.results(root, work, state, command, {}, {}, cfg, "NVIDIA H200", "abc1234", "2026-12-05", "c")["oom"]


def test_smoke_run_stops_at_the_deadline_resumes_and_writes_results(tmp_path):
    """The CPU smoke mode end to end (~20 s): stopped at once by the deadline (exit 3), rerun to the end."""
    root, out = tmp_path / "run", tmp_path / "out"
    r = run("--root", root, *SMOKE, "--deadline-s", "2", "--out", out, check=False)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "run the same command again to resume" in r.stdout
    state = json.loads((root / "refine_paper_state.json").read_text())
    assert state["steps"]["generate"]["done"] and not state["steps"]["refine"]["done"]
    assert state["steps"]["refine"]["attempts"][0]["stopped"]
    partial = json.loads((out / "refine_paper_calibration.json").read_text())  # what was measured so far
    assert partial["status"].startswith("partial: stopped at the deadline with 0 of 2 blocks done")
    assert "Status: partial" in (out / "refine_paper_calibration.md").read_text()
    assert not (root / "real_size_state.json").exists()
    r = run("--root", root, *SMOKE, "--out", out)
    doc = json.loads((out / "refine_paper_calibration.json").read_text())
    md = (out / "refine_paper_calibration.md").read_text()
    assert KEYS <= set(doc) and doc["status"] == "complete"
    assert doc["gpu"] == "cpu" and doc["commit"] == "abc1234" and doc["blocks_measured"] == 2
    assert doc["command"] == ("moesq refine -m model -w work --seq-len 32 --n-train 8 --n-init 4 --n-val 4 "
                              "--batch-rows 64 --epochs 1 --e2e-steps 0 --device cpu --json results/refine.json")
    timings = json.loads((root / "work" / "manifest.json").read_text())["stages"]["refine"]["block_timings"]
    assert doc["gpu_min_per_block"] == pytest.approx(statistics.mean(t["seconds"] for t in timings.values()) / 60,
                                                     abs=1e-3)
    assert [b["seconds"] for b in doc["per_block"]] == [timings["0"]["seconds"], timings["1"]["seconds"]]
    assert all(b["compress_split"]["engine_chunks"] >= 1 for b in doc["per_block"])
    assert len(doc["wall_s"]) == 2 and doc["oom"] is False and doc["exit_status"] == 0
    assert doc["resource_options"] == {} and doc["peak_gpu_gib"] is None
    assert set(doc["one_time_s"]) == {"model_load", "calibration", "embedding"}
    assert doc["extrapolated_48_layer_hours"] is not None and "48 ×" in doc["extrapolation"]
    assert doc["calibration"]["routed_rows_per_block"] == (8 + 4) * 32 * 4
    assert "Lion steps per block" in doc["schedule"]
    assert str(tmp_path) not in json.dumps(doc) + md and "/tmp" not in md
    assert ("| date | GPU | commit | GPU-min per block | plan GiB | peak GiB (torch, reserved) | peak GiB (nvidia-smi) "
            "| OOM | propagation s/layer | 48-layer hours") in md
    # a finished run is not redone; other options on the same root are refused
    again = run("--root", root, *SMOKE)
    assert "refine:" not in again.stdout.split("#")[0]
    bad = run("--root", root, *SMOKE[:-2], "--epochs", "2", check=False)
    assert bad.returncode != 0 and "other options" in bad.stderr


def test_extrapolation_counts_the_state_saves_the_engine_makes():
    rpc = _script()
    # the engine saves once a minute and 20 × the last save have passed: 27 s saves after 367 s blocks come every
    # second block (the first after block 0), 24 of the 47 moments between 48 blocks
    assert rpc.state_saves(342.0, 25.0, 27.0) == 24
    assert rpc.state_saves(342.0, 25.0, 0.0) == 47  # free saves: after every block
    assert rpc.state_saves(20.0, 5.0, 1.0) == 15  # a minute apart at least: every third 25 s block
    assert rpc.extrapolate({"x": 10.0}, 342.0, 25.0, 27.0) == pytest.approx(10 + 48 * 342 + 47 * 25 + 24 * 27)
