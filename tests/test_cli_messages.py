"""The CLI's start-up and its messages for bad input: `--version` / `--help` without torch, every numeric option
refused out of range before any work, damaged checkpoints and full or read-only disks as one line naming the
file, Ctrl-C during start-up as one line."""
from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120", "PYTHONPATH": str(ROOT)}


def cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "moesq_cli", *map(str, args)], capture_output=True, text=True,
                          env=env or ENV, timeout=timeout, cwd=ROOT)


# -- start-up -----------------------------------------------------------------------------------------------------
_IMPORTS_AFTER = """
import sys
sys.argv = ["moesq", *sys.argv[1:]]
from moesq_cli.app import main
try:
    main()
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "numpy", "safetensors") if m in sys.modules)
print("HEAVY", heavy, file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["refine", "--help"], ["eval", "--help"],
                                  ["generate", "--help"], ["run", "--help"]])
def test_version_and_help_do_not_import_torch(args):
    r = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *args], capture_output=True, text=True, env=ENV,
                       cwd=ROOT, timeout=120)
    assert "HEAVY []" in r.stderr, r.stderr[-2000:]
    assert r.stdout.strip()


def test_help_defaults_read_from_source_match_the_objects():
    """--help reads config defaults from moesq_core's source (no torch); they must be the imported ones."""
    from moesq_cli import app as cli_app
    from moesq_core.calibration import CalibConfig
    from moesq_core.methods.refine import RefineConfig
    from moesq_core.pipeline import run_refine

    for cls in (CalibConfig, RefineConfig):
        read = cli_app._source_defaults(cls.__module__, cls.__name__)
        real = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        assert read and all(real[k] == v for k, v in read.items()), (cls, read)
    read = cli_app._source_defaults("moesq_core.pipeline", "run_refine")
    real = {k: p.default for k, p in inspect.signature(run_refine).parameters.items()}
    assert read and all(real[k] == v for k, v in read.items())
