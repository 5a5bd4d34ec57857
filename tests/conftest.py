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
# In a user's clone (no ../shared) the texts embedded in the package stand in.
CALIB = CALIB_TEXT if CALIB_TEXT.is_file() else REPO / "moesq_core" / "assets" / "calib-sample.txt.xz"
EVAL = EVAL_TEXT if EVAL_TEXT.is_file() else REPO / "moesq_core" / "assets" / "eval-sample.txt.xz"


def moe_block_inputs(model, tok, layer: int, n_seq: int, seq: int, chars: int) -> torch.Tensor:
    """The hidden states entering layer `layer`'s MoE block for the first n_seq × seq tokens of CALIB."""
    import lzma

    with lzma.open(CALIB, "rt") as f:
        text = f.read(chars)
    ids = tok(text, return_tensors="pt").input_ids[0][: n_seq * seq].view(n_seq, seq)
    caps = []
    h = model.model.layers[layer].mlp.register_forward_hook(
        lambda mod, inp, out: caps.append(inp[0].detach().reshape(-1, inp[0].shape[-1])))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        h.remove()
    return torch.cat(caps)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def packed_expert_linears(model, f, suffixes: tuple[str, ...]):
    """(name, load_packed's dequantized weight, the linear's tensors in the open shard `f`) for every expert
    linear of a model `load_packed` returned: what the stock decompressors are compared against."""
    for li, layer in enumerate(model.model.layers):
        ours = layer.mlp.experts
        inter = ours.gate_up_proj.shape[1] // 2
        for e in range(ours.num_experts):
            for proj, mine in (("gate_proj", ours.gate_up_proj[e, :inter]), ("up_proj", ours.gate_up_proj[e, inter:]),
                               ("down_proj", ours.down_proj[e])):
                base = f"model.layers.{li}.mlp.experts.{e}.{proj}"
                yield base, mine, {k: f.get_tensor(f"{base}.{k}") for k in suffixes}


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


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: intra-op threads only add contention on the shared 2-core CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def micro_calibrated(micro_path):
    """(model, adapter, path, calibration splits): the micro model, loaded per module (stages replace its
    experts), and a small calibration set (32-token sequences: 4 train, 2 val, 4 init)."""
    from moesq_core.calibration import CalibConfig, build_calibration, read_documents
    from moesq_core.models import load_model

    model, tok, adapter, path = load_model(micro_path)
    calib = build_calibration(tok, read_documents(CALIB, max_chars=200_000),
                              CalibConfig(seq_len=32, n_train=4, n_val=2, n_init=4))
    return model, adapter, path, calib


# -- one finished stage and one packed dir per format, shared by the checkpoint tests ----------------------------
PACK_FORMATS = ("p48-nvfp4", "dense-nvfp4", "s24-fp8")


@pytest.fixture(scope="session")
def stages(micro_path, tmp_path_factory):
    """{format: WorkDir with a finished init-rtn stage} (seconds each on the embedded model)."""
    root = tmp_path_factory.mktemp("stages")
    out = {}
    from moesq_core.calibration import CalibConfig, build_calibration, read_documents
    from moesq_core.engine import StageSpec, run_stage
    from moesq_core.formats import get_format
    from moesq_core.methods.rtn import RTN
    from moesq_core.models import load_model
    from moesq_core.pipeline import DEFAULT_CALIB
    from moesq_core.workdir import WorkDir, model_fingerprint

    for fmt in PACK_FORMATS:
        model, tok, adapter, path = load_model(micro_path)  # fresh: run_stage replaces the model's experts
        calib = build_calibration(tok, read_documents(DEFAULT_CALIB, max_chars=200_000),
                                  CalibConfig(seq_len=64, n_train=4, n_val=2, n_init=8))
        wd = WorkDir(root / fmt)
        wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)},
                {"format": fmt, "act_quant": True})
        run_stage(model, adapter, calib, StageSpec("init-rtn", get_format(fmt), lambda li: RTN(), {"method": "rtn"},
                                                   batch_size=4), wd)
        out[fmt] = wd
    return out


@pytest.fixture(scope="session")
def packs(stages, tmp_path_factory):
    """{format: (work dir, packed dir, pack summary)}."""
    from moesq_core.checkpoint.export import export_packed

    root = tmp_path_factory.mktemp("packs")
    return {fmt: (wd, root / fmt, export_packed(wd, "init-rtn", root / fmt)) for fmt, wd in stages.items()}
