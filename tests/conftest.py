"""Shared test fixtures. The shared real models live at ../shared relative to the repo root (as in CI)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# The micro model is also embedded in the package (the default of `moesq run`); use that copy when ../shared
# is not there (e.g. on the GPU machine).
MICRO = SHARED / "models" / "micro-qwen3-moe"
if not MICRO.is_dir():
    MICRO = REPO / "moesq_core" / "assets" / "micro-qwen3-moe"
TINY = SHARED / "models" / "tiny-qwen3-moe"
EVAL_TEXT = SHARED / "data" / "eval-docs.txt.xz"
CALIB_TEXT = SHARED / "data" / "calib-docs.txt.xz"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    hopper = has_gpu and torch.cuda.get_device_capability() == (9, 0)
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "hopper" in item.keywords and not hopper:
            item.add_marker(pytest.mark.skip(reason="needs a Hopper (sm_90) GPU"))


@pytest.fixture(scope="session")
def micro_path() -> Path:
    if not MICRO.is_dir():
        pytest.skip(f"shared model not found at {MICRO}")
    return MICRO


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    if not TINY.is_dir():
        pytest.skip(f"shared model not found at {TINY}")
    return TINY
