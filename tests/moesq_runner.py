"""How the tests run `moesq`: as a user does, in a subprocess (`moesq`), or in this process (`moesq_here`, where
no process boundary is under test); the environment both use; the small calibration budgets most tests share."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from conftest import CALIB

MOESQ = shutil.which("moesq") or str(Path(sys.executable).parent / "moesq")
# where the package runs from a source tree without its console script (a GPU machine), the module form
MOESQ_CMD = [MOESQ] if Path(MOESQ).exists() else [sys.executable, "-m", "moesq_cli"]
# the shared data when it is there (CI), else the embedded samples (a user's clone)
SMALL = ["--seq-len", "64", "--n-train", "8", "--n-val", "4", "--n-init", "8", "--calib", str(CALIB)]
# offline, a wide terminal, and the weight-hash cache in a temp dir instead of the user's home
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120",
       "MOESQ_CACHE_DIR": os.environ.get("MOESQ_CACHE_DIR") or tempfile.mkdtemp(prefix="moesq-test-cache-")}

# the smallest budget a stage runs with, and the flags of a quiet CPU run
TINY_CALIB = ["--seq-len", "32", "--n-train", "2", "--n-val", "2", "--n-init", "4", "--calib", str(CALIB)]
FAST = ["--quiet", "--device", "cpu"]


def moesq(*args, check=True, timeout=900, cwd=None, env=None):
    """`moesq ARGS` in a subprocess with `env` (default ENV); raises with its output unless it exits 0 (when
    check)."""
    r = subprocess.run([*MOESQ_CMD, *map(str, args)], capture_output=True, text=True, env=env or ENV,
                       timeout=timeout, cwd=cwd)
    if check and r.returncode != 0:
        raise AssertionError(f"moesq {' '.join(map(str, args))} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def moesq_here(*args, check=True, cwd=None):
    """`moesq` run in this process (typer's runner, the same ENV): where a test needs no process boundary (not
    about start-up, signals, locks between processes or the console script), torch and transformers are imported
    once instead of per command. Returns what `moesq` does (returncode, stdout, stderr); an exception that
    escaped the command is in stderr as its traceback, as a process would print it. The loggers, the torch
    thread count, sys.argv and the working directory are restored afterwards."""
    import contextlib
    import logging
    import traceback
    import types

    from typer.testing import CliRunner

    from moesq_cli.app import app, expand_argv

    argv = expand_argv([str(a) for a in args])
    loggers = [logging.getLogger(n) for n in ("moesq", "moesq_core", "moesq.progress")]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    threads, old_argv = torch.get_num_threads(), sys.argv
    sys.argv = ["moesq", *argv]
    try:
        with contextlib.chdir(cwd or os.getcwd()):
            env = {k: ENV[k] for k in ("HF_HUB_OFFLINE", "COLUMNS", "MOESQ_CACHE_DIR")}
            res = CliRunner().invoke(app, argv, env=env)
    finally:
        sys.argv = old_argv
        torch.set_num_threads(threads)
        for lg, handlers, level, propagate in saved:
            for h in lg.handlers:
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
            lg.setLevel(level)
            lg.propagate = propagate
    stderr = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*res.exc_info))
    r = types.SimpleNamespace(returncode=res.exit_code, stdout=res.stdout, stderr=stderr)
    if check and r.returncode != 0:
        raise AssertionError(f"moesq {' '.join(argv)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r
