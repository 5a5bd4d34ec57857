"""benchmarks/moesq_run_embedded.py's comparison row: the paper's SGPTQ on `moesq run`'s very calibration."""
import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moesq_run_embedded.py"
MOESQ = shutil.which("moesq") or str(Path(sys.executable).parent / "moesq")


def load_script():
    spec = importlib.util.spec_from_file_location("moesq_run_embedded", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def calib_report(seed: int) -> dict:
    """The parts of a `moesq run --json` report the paper's row reads (the README's small calibration)."""
    return {"config": {"calib": {"seq_len": 32, "n_train": 2, "n_val": 2, "n_init": 8, "seed": seed}},
            "rows": [{"kind": "reference", "tokens": 512}]}


@pytest.mark.slow
def test_the_paper_sgptq_row_runs_on_the_same_calibration(tmp_path):
    mod = load_script()
    subprocess.run([MOESQ, "calibrate", "-w", "moesq-work", "--seq-len", "32", "--n-train", "2", "--n-val", "2",
                    "--n-init", "8"], cwd=tmp_path, check=True, capture_output=True)
    row = mod.paper_sgptq(MOESQ, tmp_path, calib_report(0))
    assert row["tokens"] == 512 and math.isfinite(row["ppl"]) and row["ppl"] > 1
    assert (tmp_path / "paper-work" / "stages" / "init-sgptq").is_dir()


@pytest.mark.slow
def test_a_different_calibration_is_refused(tmp_path):
    mod = load_script()
    subprocess.run([MOESQ, "calibrate", "-w", "moesq-work", "--seq-len", "32", "--n-train", "2", "--n-val", "2",
                    "--n-init", "8", "--seed", "1"], cwd=tmp_path, check=True, capture_output=True)
    with pytest.raises(SystemExit, match="calibrated differently"):
        mod.paper_sgptq(MOESQ, tmp_path, calib_report(0))
