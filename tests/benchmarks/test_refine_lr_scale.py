"""benchmarks/refine_lr_scale.py in miniature: on small random weights (RMS 0.02) an absolute values rate of the
budget rule makes every expert worse than its init, the default rate tied to the weights' scale improves them."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "refine_lr_scale.py"


def test_absolute_values_rate_loses_to_the_scaled_one(tmp_path):
    spec = importlib.util.spec_from_file_location("refine_lr_scale", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--hidden", "128", "--inter", "64", "--tokens", "1024", "--val-tokens", "256", "--steps", "4",
                     "--variant", 'absolute={"lr_budget_values_rms": null}', "--variant", "default={}",
                     "--out", str(tmp_path), "--tag", "t"]) == 0
    runs = {r["variant"]: r for r in json.loads((tmp_path / "refine_lr_scale_t.json").read_text())["runs"]}
    assert runs["absolute"]["val_ratio_mean"] > 1.05 and runs["absolute"]["improved"] <= 1
    assert runs["default"]["val_ratio_mean"] < 1.0 and runs["default"]["improved"] >= 6
