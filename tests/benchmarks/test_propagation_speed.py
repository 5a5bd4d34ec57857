"""benchmarks/propagation_speed.py: its smoke command runs as written (the engine's propagate on a narrow layer, the
factored and the fp32-padded experts paths) and writes results that agree with themselves."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_command_runs_and_compares_the_two_paths(tmp_path):
    out = tmp_path / "OUT"
    cmd = [sys.executable, "benchmarks/propagation_speed.py", "--small", "--device", "cpu", "--batches", "2",
           "--seq-len", "64", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    doc = json.loads((out / "propagation_speed.json").read_text())
    assert set(doc["variants"]) == {"factored", "factored-pageable", "fp32-padded-pageable"}
    assert doc["experts_rel_diff"] < 1e-4  # the same experts, two matmul paths
    for v in doc["variants"].values():
        assert v["s_per_batch"] > 0 and abs(v["s_per_layer_paper"] - v["s_per_batch"] * 144) <= 0.1
    assert doc["rows_per_expert"]["max"] >= doc["rows_per_expert"]["mean"] >= doc["rows_per_expert"]["min"]
    assert str(tmp_path) not in (out / "propagation_speed.json").read_text()  # relative paths only
    assert (out / "propagation_speed.md").read_text().startswith("# Propagation through one compressed")
