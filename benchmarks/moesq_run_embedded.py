"""`moesq run` on the embedded model, recorded: the README's "What a run looks like" table comes from this file.

    python benchmarks/moesq_run_embedded.py     # writes benchmarks/results/moesq_run_embedded.json

Runs the console script exactly as a user does (defaults, a fresh temporary work dir, CPU), and adds the commit,
date and machine to its `--json` report.
"""
from __future__ import annotations

import datetime as dt
import json
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
from moesq_core.bench.harness import git_commit  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "moesq_run_embedded.json"


def main() -> int:
    moesq = shutil.which("moesq") or str(Path(sys.executable).with_name("moesq"))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([moesq, "run", "--workdir", "moesq-work", "--device", "cpu", "--json", "-"], cwd=tmp,
                              capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        report = json.loads(proc.stdout)
    report.update({"command": "moesq run --json -", "commit": git_commit(),
                   "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
                   "wall_seconds": round(time.perf_counter() - t0, 1)})
    # results keep paths relative to the repository (the embedded model and texts live in it)
    OUT.write_text(json.dumps(report, indent=2, sort_keys=True).replace(str(REPO) + "/", "") + "\n")
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
