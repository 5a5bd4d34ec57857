"""The code is ruff-clean under pyproject.toml's configuration (line length, import sorting, pyflakes)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_check_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
