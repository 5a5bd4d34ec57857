"""The library entry point: `compress(model, config, workdir=...)` runs calibrate → baselines → refine (each
block's init computed inside refinement's block loop) or the init alone, as the config says, resumably, in a
work dir, and returns a handle whose `save_pretrained(out)` writes the packed model.

    from moesq_core import compress, CompressConfig
    handle = compress("Qwen/Qwen3-30B-A3B", CompressConfig.from_file("recipes/qwen3-30b-a3b-p48-nvfp4.yaml"),
                      workdir="qwen3-work")
    handle.save_pretrained("qwen3-p48")

`run_all` is `moesq run`: compress, then pack, verify and evaluate. The CLI's stage commands call the functions
compress runs (moesq_core.pipeline).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import distributed
from .calibration import CalibConfig
from .config import DEFAULT_EVAL, CompressConfig, MethodConfig


def default_run_config() -> CompressConfig:
    """What `moesq run` does with no options (recipes/micro-quick.yaml): a small budget on the embedded model —
    256-token sequences, 64 for the one-shot stages, 64 + 8 for refinement (2 epochs × 8 steps, SGPTQ computed
    inside its block loop, then the automatic end-to-end step on the KL's second-order form, the cheaper one on a
    CPU), magnitude and SGPTQ alone as the baselines."""
    from .methods.refine import RefineConfig

    return CompressConfig(calib=CalibConfig(seq_len=256, n_train=64, n_val=8, n_init=64), init=MethodConfig("sgptq"),
                          refine=RefineConfig(epochs=2, steps_per_epoch=8, e2e_loss="fisher"),
                          baselines=("magnitude", "sgptq"))


@dataclass
class CompressedModel:
    """A finished compression in a work dir: `stage` is what `save_pretrained` packs."""

    workdir: Path
    stage: str
    config: CompressConfig
    summaries: dict  # stage -> its summary (blocks, computed_now, timings)

    def save_pretrained(self, out: str | Path, *, overwrite: bool = False, dense_layout: bool = False,
                        progress=None) -> dict:
        """Write the Hugging Face–style packed model dir (moesq pack); returns the export summary."""
        from .checkpoint.export import export_packed
        from .workdir import WorkDir

        kw = {"progress": progress} if progress is not None else {}
        return export_packed(WorkDir(self.workdir), self.stage, Path(out), overwrite=overwrite,
                             sparse_layout=not dense_layout, **kw)


def model_source(model) -> str | Path | None:
    """What `compress` reads the model from: a local dir or Hub id as given; a loaded transformers model
    (PreTrainedModel) as the checkpoint it was loaded from (its `name_or_path`), since moesq reads the weights
    shard by shard and needs the tokenizer files beside them. In-memory changes to a loaded model are not seen:
    save it (with its tokenizer) and pass the directory."""
    if model is None or isinstance(model, (str, Path)):
        return model
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "save_pretrained"):
        raise ValueError(f"model must be a local dir, a Hub id or a loaded transformers model, got {type(model).__name__}")
    source = getattr(model, "name_or_path", None) or getattr(config, "name_or_path", None)
    if not source:
        raise ValueError("the loaded model has no source checkpoint (its name_or_path is empty), and moesq needs "
                         "its files and tokenizer: save both with save_pretrained(DIR) and pass DIR")
    return source


def compress(model=None, config: CompressConfig | str | Path | None = None,
             workdir: str | Path = "moesq-work", *, device: str | None = None, batch_size: int = 8,
             cache_limit_gb: float = 4.0, progress=None) -> CompressedModel:
    """Compress `model` (a local dir, a Hub id or a loaded transformers model: see `model_source`; default: the
    config's `model`, else the embedded micro model) as `config` says (a CompressConfig or a recipe file;
    default: `moesq run`'s). Resumable: finished stages are only checked, an interrupted one continues at its
    first unfinished block. A work dir made for another model or run config is refused."""
    from . import pipeline
    from .workdir import WorkDir

    model = model_source(model)
    if config is None:
        config = default_run_config()
    elif not isinstance(config, CompressConfig):
        config = CompressConfig.from_file(config)
    pipeline._check_run_args(device, batch_size, None, cache_limit_gb)
    wd = WorkDir(workdir)
    summaries = {}
    with pipeline._command_lock(wd):
        distributed.main_first(pipeline.open_workdir, wd, model or config.model, config.run_config().flat(),
                               progress=progress)
        # One-shot stages: the baselines (the init method among them as configured), and the init itself when
        # there is no refinement (refinement computes its init inside its own block loop).
        one_shot = [config.init if b == config.init.name else MethodConfig(b) for b in config.baselines]
        if config.refine is None and config.init.name not in config.baselines:
            one_shot.append(config.init)
        for mcfg in one_shot:
            summaries[pipeline.init_stage_name(mcfg.name)] = pipeline.compress(
                wd, mcfg, device=device, batch_size=batch_size, progress=progress, cache_limit_gb=cache_limit_gb)
        stage = pipeline.init_stage_name(config.init.name)
        if config.refine is not None:
            stage = "refine"
            summaries[stage] = pipeline.refine(wd, config.refine, init=config.init, device=device,
                                               batch_size=batch_size, progress=progress,
                                               cache_limit_gb=cache_limit_gb)
    return CompressedModel(wd.root, stage, config, summaries)


def run_all(workdir: str | Path, config=None, model: str | Path | None = None, *, device: str | None = None,
            ppl: str | Path | None = None, ppl_tokens: int = 65536, progress=None) -> dict:
    """`moesq run`: compress (calibrate → baselines → init → refine, as the CompressConfig says; default: the
    micro-quick recipe) → pack → verify → perplexity of the reference, every stage and the packed model.
    Returns {stage, config, packed, rows, bits_per_weight} (None on the ranks other than 0 under torchrun)."""
    from . import pipeline
    from .checkpoint.verify import verify_packed_dir
    from .eval.runner import ResultCache, ppl_for_targets, resolve_targets
    from .progress import NullProgress
    from .workdir import WorkDir, atomic_path

    progress = progress or NullProgress()
    wd = WorkDir(workdir)
    with pipeline._command_lock(wd):
        handle = compress(model, config, workdir, device=device, progress=progress)
        if not distributed.is_main_process():
            return None  # expert parallel: rank 0 packs, verifies and evaluates
        out = wd.root / "packed"
        with progress.task(f"pack {handle.stage}", len(wd.stage(handle.stage)["blocks"])) as t:
            handle.save_pretrained(out, overwrite=True, progress=t.advance)
        report = verify_packed_dir(out, progress=progress)
        if not report.ok:
            raise RuntimeError(f"verify failed on the packed model: {report.first_error}")
        targets = resolve_targets([str(wd.root), str(out)])
        rows = ppl_for_targets(targets, ppl or DEFAULT_EVAL, max_tokens=ppl_tokens, device="cpu",
                               cache=ResultCache(wd.root / "eval" / "results.json"), progress=progress)
        (wd.root / "eval").mkdir(exist_ok=True)
        with atomic_path(wd.root / "eval" / "run_table.json") as tmp:
            tmp.write_text(json.dumps(rows, indent=2))
    return {"stage": handle.stage, "config": handle.config.to_dict(), "packed": str(out), "rows": rows,
            "bits_per_weight": report.bits_per_weight}
