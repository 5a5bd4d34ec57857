"""The stages as functions the CLI calls: calibrate -> init (one-shot method) -> refine -> pack -> eval.

Each stage checks the work dir (same model, same config), skips what is finished and resumes what is not.
A stage whose prerequisites are missing runs them first with the options given, so
`moesq refine --model M` works from nothing.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .calibration import CalibConfig, build_calibration, read_documents
from .engine import StageSpec, load_block, run_stage
from .formats import get_format
from .methods.base import CompressedExpert, ExpertData
from .models import load_model
from .progress import NullProgress
from .workdir import WorkDir, WorkDirError, atomic_path, model_fingerprint, sha256_file

log = logging.getLogger("moesq")

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = ASSETS / "micro-qwen3-moe"
DEFAULT_CALIB = ASSETS / "calib-sample.txt.xz"
DEFAULT_EVAL = ASSETS / "eval-sample.txt.xz"
CALIB_FILE = "calib/calibration.safetensors"


@dataclass
class RunConfig:
    """Work-dir–level settings: a work dir holds one model, one format, one calibration set."""

    format: str = "p48-nvfp4"
    act_quant: bool = True  # W4A4 / W8A8 (the format's activation quantizer) vs weights only
    calib: CalibConfig = field(default_factory=CalibConfig)
    calib_source: str = str(DEFAULT_CALIB)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["calib"] = self.calib.to_dict()
        return d


def _device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dtype(device: torch.device) -> torch.dtype:
    # fp32 on CPU (exact reference), bf16 on GPU (the models' native precision)
    return torch.float32 if device.type == "cpu" else torch.bfloat16


# -- calibrate ---------------------------------------------------------------------------------------------
def calibrate(workdir: WorkDir, model_source: str | Path, cfg: RunConfig, progress=None) -> dict:
    """Create (or check) the work dir for this model + config and write the calibration token splits."""
    progress = progress or NullProgress()
    from .models.adapter import adapter_for, read_config, resolve_model_path
    from transformers import AutoConfig, AutoTokenizer

    get_format(cfg.format)
    path = resolve_model_path(str(model_source))
    adapter = adapter_for(AutoConfig.from_pretrained(path))  # refuse non-MoE before any work
    model_info = {"source": str(model_source), "path": str(path.resolve()), "fingerprint": model_fingerprint(path),
                  "family": adapter.family, "model_type": read_config(path).get("model_type")}
    m = workdir.init(model_info, cfg.to_dict())
    calib_path = workdir.root / CALIB_FILE
    if m.get("calibration", {}).get("sha256") and calib_path.is_file():
        if sha256_file(calib_path) != m["calibration"]["sha256"]:
            raise WorkDirError(f"{calib_path} is corrupt or truncated (checksum mismatch); delete it and re-run `moesq calibrate`")
        log.info("calibration already done: %s", calib_path)
        return m["calibration"]
    tok = AutoTokenizer.from_pretrained(path)
    with progress.task("calibrate: reading and tokenizing", None) as t:
        docs = read_documents(cfg.calib_source)
        splits = build_calibration(tok, docs, cfg.calib)
        t.advance()
    with atomic_path(calib_path) as tmp:
        save_file(splits, str(tmp))
    info = {"file": CALIB_FILE, "sha256": sha256_file(calib_path),
            "sequences": {k: int(v.shape[0]) for k, v in splits.items()}, "seq_len": cfg.calib.seq_len,
            "tokens": int(sum(v.numel() for v in splits.values())), "documents": len(docs)}
    m = workdir.load()
    m["calibration"] = info
    workdir.save(m)
    log.info("calibration: %s", info)
    return info


def load_calibration(workdir: WorkDir) -> dict[str, torch.Tensor]:
    m = workdir.load()
    if "calibration" not in m:
        raise WorkDirError(f"{workdir.root} has no calibration yet; run `moesq calibrate` first")
    path = workdir.root / m["calibration"]["file"]
    if not path.is_file() or sha256_file(path) != m["calibration"]["sha256"]:
        raise WorkDirError(f"{path} is missing or corrupt (checksum mismatch); delete it and re-run `moesq calibrate`")
    return load_file(str(path))


# -- one-shot methods and refinement ------------------------------------------------------------------------
class StoredInit:
    """An init 'method' that returns a finished stage's stored results for one block (refinement starts
    from the init stage's artifacts instead of recomputing them)."""

    name = "stored"

    def __init__(self, results: list[CompressedExpert]):
        self.results = results

    def compress_block(self, experts: list[ExpertData], fmt, progress=None) -> list[CompressedExpert]:
        out = [self.results[ex.index] for ex in experts]
        if progress:
            progress(len(out))
        return out


def _load_for_stage(workdir: WorkDir, device: str | None):
    m = workdir.load()
    dev = _device(device)
    model, tok, adapter, _ = load_model(m["model"]["path"], dtype=_dtype(dev), device=dev)
    if model_fingerprint(Path(m["model"]["path"])) != m["model"]["fingerprint"]:
        raise WorkDirError(f"the model at {m['model']['path']} changed since this work dir was made")
    return model, adapter, m


def init_stage_name(method: str) -> str:
    return f"init-{method}"


def compress(workdir: WorkDir, method: str = "sgptq", options: dict | None = None, *, device: str | None = None,
             batch_size: int = 8, redo_from: int | None = None, progress=None, cache_limit_gb: float = 4.0) -> dict:
    """The one-shot stage `init-<method>` (sgptq, rtn, magnitude, wanda, jsq, obr, gptq)."""
    from .methods.registry import get_method

    options = dict(options or {})
    m = workdir.load()
    fmt = get_format(m["config"]["format"])
    get_method(method, **options)  # validate options before loading anything
    model, adapter, m = _load_for_stage(workdir, device)
    calib = load_calibration(workdir)
    spec = StageSpec(
        name=init_stage_name(method), fmt=fmt, method_for_block=lambda li: get_method(method, **options),
        config={"method": method, "options": options}, compress_split="init", val_split=None,
        act_quant=m["config"]["act_quant"], batch_size=batch_size, cache_limit_bytes=int(cache_limit_gb * 2**30))
    return run_stage(model, adapter, calib, spec, workdir, progress, redo_from)


def refine(workdir: WorkDir, config: dict | None = None, *, init: str = "sgptq", device: str | None = None,
           batch_size: int = 8, redo_from: int | None = None, progress=None, cache_limit_gb: float = 4.0,
           stage: str = "refine") -> dict:
    """The refinement stage, initialised from the finished `init-<init>` stage's artifacts."""
    from .methods.refine import RefineConfig, RefineMethod

    config = dict(config or {})
    rcfg = RefineConfig(**config)
    init_stage = init_stage_name(init)
    st = workdir.stage(init_stage)
    if st is None or not st.get("done"):
        raise WorkDirError(f"refinement starts from stage {init_stage!r}, which is not finished in {workdir.root}")
    m = workdir.load()
    fmt = get_format(m["config"]["format"])
    model, adapter, m = _load_for_stage(workdir, device)
    calib = load_calibration(workdir)

    def method_for_block(li: int):
        results, _, _ = load_block(workdir.verified_block(init_stage, li))
        return RefineMethod(StoredInit(results), rcfg)

    spec = StageSpec(
        name=stage, fmt=fmt, method_for_block=method_for_block,
        config={"method": "refine", "init": init_stage, "refine": json.loads(json.dumps(asdict(rcfg)))},
        compress_split="train", val_split="val", act_quant=m["config"]["act_quant"], batch_size=batch_size,
        cache_limit_bytes=int(cache_limit_gb * 2**30))
    return run_stage(model, adapter, calib, spec, workdir, progress, redo_from)


def finished_stages(workdir: WorkDir) -> list[str]:
    return [k for k, v in workdir.load()["stages"].items() if v.get("done")]


def default_stage(workdir: WorkDir) -> str:
    """The stage `pack` and `eval` use by default: refine if finished, else the last finished init stage."""
    done = finished_stages(workdir)
    if not done:
        raise WorkDirError(f"{workdir.root} has no finished compression stage yet; run `moesq init-sgptq` or `moesq refine`")
    return "refine" if "refine" in done else done[-1]
