"""`moesq run` on the embedded model, recorded: the README's `moesq run` table (its rows as `moesq run` prints them)
and the run's time come from this file.

    python benchmarks/moesq_run_embedded.py     # writes benchmarks/results/moesq_run_embedded.json

Runs the console script exactly as a user does (defaults, a fresh temporary work dir, CPU), and adds the commit,
date and machine (CPU, cores, memory, torch threads, the load average before the run) to its `--json` report.
Then, for the comparison with the paper's method, the paper's SGPTQ (`--no-refit`) in a second work dir on the
very same calibration (`moesq calibrate` with `moesq run`'s settings; the manifests' calibration entries are checked
equal), evaluated on the same text: recorded as `paper_sgptq`.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from moesq_core.serving.bench.harness import git_commit  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "moesq_run_embedded.json"


def paper_sgptq(moesq: str, tmp: Path, report: dict) -> dict:
    """The paper's SGPTQ (no refit) on `moesq run`'s calibration, in its own work dir: its perplexity row."""
    c = report["config"]["calib"]

    def moesq_cmd(*args):
        subprocess.run([moesq, args[0], "-w", "paper-work", *args[1:]], cwd=tmp, check=True, capture_output=True,
                       text=True)

    moesq_cmd("calibrate", "--seq-len", str(c["seq_len"]), "--n-train", str(c["n_train"]), "--n-val", str(c["n_val"]),
              "--n-init", str(c["n_init"]), "--seed", str(c["seed"]))
    calib = [json.loads((tmp / w / "manifest.json").read_text())["calibration"] for w in ("moesq-work", "paper-work")]
    if calib[0] != calib[1]:
        raise SystemExit(f"the paper's SGPTQ work dir calibrated differently: {calib}")
    moesq_cmd("init-sgptq", "--device", "cpu", "--no-refit")
    tokens = next(r["tokens"] for r in report["rows"] if r["kind"] == "reference")
    subprocess.run([moesq, "eval", "paper-work", "--device", "cpu", "--ppl-tokens", str(tokens),
                    "--json", "paper.json"],
                   cwd=tmp, check=True, capture_output=True, text=True)
    row = next(r for r in json.loads((tmp / "paper.json").read_text())["ppl"] if r["stage"] == "init-sgptq")
    return {"command": "moesq calibrate (moesq run's settings); moesq init-sgptq --no-refit; moesq eval",
            "ppl": row["ppl"], "tokens": row["tokens"], "window": row["window"]}


def machine(load_before: float) -> dict:
    """What the run's time was measured on: the CPU, its cores, the memory, torch, and the load average (1 min)
    just before the run (anything else running skews the time)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine()) \
        if Path("/proc/cpuinfo").is_file() else platform.processor() or platform.machine()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "memory_gib": round(memory, 1), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_before": load_before}


def main() -> int:
    moesq = shutil.which("moesq") or str(Path(sys.executable).with_name("moesq"))
    load_before = round(os.getloadavg()[0], 2)
    if load_before > 0.5:
        print(f"warning: load average {load_before} before the run: its time will be longer than on an idle machine",
              file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([moesq, "run", "--workdir", "moesq-work", "--device", "cpu", "--json", "-"], cwd=tmp,
                              capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        report = json.loads(proc.stdout)
        wall = time.perf_counter() - t0
        report["paper_sgptq"] = paper_sgptq(moesq, Path(tmp), report)
    report.update({"command": "moesq run --json -", "commit": git_commit(),
                   "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   "machine": machine(load_before), "wall_seconds": round(wall, 1)})
    # results keep paths relative to the repository (the embedded model and texts live in it)
    OUT.write_text(json.dumps(report, indent=2, sort_keys=True).replace(str(REPO) + "/", "") + "\n")
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
