"""The stages as functions the CLI calls: calibrate -> init (one-shot method) -> refine -> pack -> eval.

Each stage checks the work dir (same model, same normalised config), skips what is finished and resumes
what is not, holding the work dir's lock. A stage whose prerequisites are missing runs them first, so
`moesq refine --model M` works from nothing. Every option is validated before the work dir is touched.

The library entry point is here too: `compress(model, config, workdir=...)` runs calibrate → baselines →
refine (each block's init computed inside refinement's block loop) or the init alone, as the config says,
resumably, in a work dir, and returns a handle whose `save_pretrained(out)` writes the packed model.

    from moesq_core import compress, CompressConfig
    handle = compress("Qwen/Qwen3-30B-A3B", CompressConfig.from_file("recipes/qwen3-30b-a3b-p48-nvfp4.yaml"),
                      workdir="qwen3-work")
    handle.save_pretrained("qwen3-p48")

`run_all` is `moesq run`: compress, then pack, verify and evaluate.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moesq_core.compression import distributed
from moesq_core.compression.calibration import (
    CalibConfig,
    build_calibration,
    dataset_label,
    is_dataset,
    read_documents,
)
from moesq_core.compression.config import (  # noqa: F401
    ASSETS,
    DEFAULT_CALIB,
    DEFAULT_EVAL,
    DEFAULT_MODEL,
    CompressConfig,
    MethodConfig,
    RunConfig,
    refine_identity,
)
from moesq_core.compression.engine import StageSpec, run_stage
from moesq_core.compression.workdir import (
    RunIdentity,
    StageLedger,
    WorkDir,
    WorkDirError,
    _diff,
    atomic_path,
    model_fingerprint,
    sha256_file,
)
from moesq_core.models import load_model
from moesq_core.progress import NullProgress, note

log = logging.getLogger("moesq")

CALIB_FILE = "calib/calibration.safetensors"


def _device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA GPU is visible; use --device cpu (or auto)")
    return dev


def _dtype(device: torch.device) -> torch.dtype:
    # fp32 on CPU (exact reference), bf16 on GPU (the models' native precision)
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _locked(workdir: WorkDir):
    """The work dir's lock; under torch.distributed only rank 0 takes it (the ranks of one run share it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return contextlib.nullcontext(workdir)
    return workdir.locked()


def _command_lock(workdir: WorkDir) -> contextlib.ExitStack:
    """Hold the lock for a whole command when the work dir exists (a new one is locked once created), and put
    back the earlier pack of WORKDIR/packed that a pack killed mid-swap left aside."""
    from moesq_core.compression.pack_swap import PACKED_SLOT, restore_interrupted_swap

    stack = contextlib.ExitStack()
    workdir.check_usable()
    if workdir.root.is_dir():
        stack.enter_context(_locked(workdir))
        restore_interrupted_swap(workdir.root / PACKED_SLOT)
    return stack


# -- calibrate ---------------------------------------------------------------------------------------------
def _model_info(model_source: str | Path) -> tuple[Path, dict]:
    from transformers import AutoConfig

    from moesq_core.models.adapter import adapter_for, check_unquantized, read_config, resolve_model_path

    path = resolve_model_path(str(model_source))
    config = AutoConfig.from_pretrained(path)
    check_unquantized(config, model_source)  # refuse quantized and non-MoE models before any work
    adapter = adapter_for(config)
    return path, {"source": str(model_source), "path": str(path.resolve()), "fingerprint": model_fingerprint(path),
                  "family": adapter.family, "model_type": read_config(path).get("model_type")}


def _check_calibration(workdir: WorkDir, m: dict) -> dict | None:
    """The recorded calibration if its file is there and intact; None if there is none to keep."""
    info = m.get("calibration")
    if not info:
        return None
    path = workdir.path_of(info.get("file"), "calibration.file")
    if not path.is_file():
        return None
    if sha256_file(path) != info["sha256"]:
        raise WorkDirError(f"{path} is corrupt or truncated (checksum mismatch); "
                           "delete it and re-run `moesq calibrate`")
    return info


def calibrate(workdir: WorkDir, model_source: str | Path, cfg: RunConfig, progress=None, dataset=None) -> dict:
    """Create (or check) the work dir for this model + config and write the calibration token splits (from
    `dataset`, a `datasets.Dataset` whose label is cfg.calib_source, when given; else from cfg.calib_source).

    Everything that can fail (model, format, calibration text, too few sequences) is checked before the work
    dir is written; a work dir whose calibration was interrupted or failed is calibrated again."""
    progress = progress or NullProgress()
    from transformers import AutoTokenizer

    workdir.check_usable()
    path, model_info = _model_info(model_source)
    if workdir.exists():
        m = workdir.load()
        if "calibration" in m or m.get("stages"):
            workdir.check_matches(model_info, cfg.to_dict())
        info = _check_calibration(workdir, m)
        if info is not None:
            log.info("calibration already done: %s", workdir.root / info["file"])
            return info
    tok = AutoTokenizer.from_pretrained(path)
    with progress.task("calibrate: reading and tokenizing", None) as t:
        docs = read_documents(cfg.calib_source if dataset is None else dataset, text_column=cfg.calib.text_column)
        counts: dict = {}
        splits = build_calibration(tok, docs, cfg.calib, counts)
        t.advance()
    with _locked(workdir):
        m = workdir.init(model_info, cfg.to_dict())
        info = _check_calibration(workdir, m)
        if info is not None:  # another process finished it meanwhile
            return info
        calib_path = workdir.root / CALIB_FILE
        with atomic_path(calib_path) as tmp:
            save_file(splits, str(tmp))
        info = {"file": CALIB_FILE, "sha256": sha256_file(calib_path),
                "sequences": {k: int(v.shape[0]) for k, v in splits.items()}, "seq_len": cfg.calib.seq_len,
                "tokens": int(sum(v.numel() for v in splits.values())),
                "documents": counts["documents"]}
        m = workdir.load()
        m["calibration"] = info
        workdir.save(m)
    log.info("calibration: %s", info)
    return info


def open_workdir(workdir: WorkDir | str | Path, model: str | Path | None = None, options: dict | None = None,
                 defaults: dict | None = None, progress=None, dataset=None) -> WorkDir:
    """The work dir for a stage command, calibrated: created when new, calibrated when its calibration never
    finished (`dataset`: a `datasets.Dataset` to calibrate on, options' calib_source its label). Run options
    given (RUN_OPTIONS; None = not given) must match those an existing work dir was made with; they are refused
    otherwise, naming the differences, and nothing is written."""
    wd = workdir if isinstance(workdir, WorkDir) else WorkDir(workdir)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    wd.check_usable()
    if wd.exists():
        m = wd.load()
        identity = RunIdentity.from_manifest(m, wd.manifest_path)
        recorded = RunConfig.from_identity(identity)
        if "calibration" in m or m.get("stages"):
            wanted = RunConfig.from_options({**recorded.flat(), **options})
            problems = _diff(recorded.to_dict(), wanted.to_dict())
            if problems:
                raise WorkDirError(f"{wd.root} was made with other settings:\n  " + "\n  ".join(problems)
                                   + "\nUse another --workdir, or leave these settings out (options or recipe keys) "
                                   "to use the work dir's.")
            if model is None and _check_calibration(wd, m) is not None:
                return wd
            cfg = recorded
        else:  # an interrupted or failed calibration: nothing depends on its settings, the ones given now count
            cfg = RunConfig.from_options({**recorded.flat(), **options})
        source = model or identity.model_source
    else:
        cfg = RunConfig.from_options(options, defaults)
        source = model or DEFAULT_MODEL
    calibrate(wd, source, cfg, progress, dataset)
    return wd


def load_calibration(workdir: WorkDir) -> dict[str, torch.Tensor]:
    m = workdir.load()
    if "calibration" not in m:
        raise WorkDirError(f"{workdir.root} has no calibration yet; run `moesq calibrate` first")
    path = workdir.path_of(m["calibration"].get("file"), "calibration.file")
    if not path.is_file() or sha256_file(path) != m["calibration"]["sha256"]:
        raise WorkDirError(f"{path} is missing or corrupt (checksum mismatch); delete it and re-run `moesq calibrate`")
    return load_file(str(path))


# -- one-shot methods and refinement ------------------------------------------------------------------------
def _load_for_stage(identity: RunIdentity, device: str | None):
    """(model, adapter): the run's model, checked to be the one the work dir was made for."""
    dev = _device(device)
    path = identity.model_path
    if not (path / "config.json").is_file():
        raise WorkDirError(f"the model this work dir was made for ({identity.model_source}) is no longer at {path}")
    if model_fingerprint(path) != identity.model_fingerprint:
        raise WorkDirError(f"the model at {path} changed since this work dir was made (its weights or config "
                           "differ); restore it, or use another --workdir for the changed model")
    # lazily: host memory stays bounded by a few blocks, not the model
    model, tok, adapter, _ = load_model(path, dtype=_dtype(dev), device=dev, lazy=True)
    return model, adapter


def init_stage_name(method: str) -> str:
    return f"init-{method}"


def init_stage(workdir: WorkDir, method: str | MethodConfig = "sgptq", options: dict | None = None, *,
             device: str | None = None, batch_size: int = 8, redo_from: int | None = None, progress=None,
             cache_limit_gb: float | None = None, disk_free_bytes: int | None = None) -> dict:
    """The one-shot stage `init-<method>` (sgptq, rtn, magnitude, wanda, jsq, obr, gptq). A finished stage
    with the same normalised config is only checked (checksums), not recomputed. Refuses (StatesDiskError) before
    any work when the work dir's disk cannot hold the calibration states (disk_free_bytes: its free bytes; None
    measures them)."""
    mcfg = method if isinstance(method, MethodConfig) else MethodConfig(method, dict(options or {}))
    _check_run_args(device, batch_size, redo_from, cache_limit_gb)
    name = init_stage_name(mcfg.name)
    with _locked(workdir):
        identity, ledger = workdir.identity(), workdir.ledger(name)
        fmt = identity.format
        mcfg.check_format(fmt)
        if redo_from is None:
            done = ledger.finished_summary(mcfg.to_dict())
            if done is not None:
                return done
        else:
            ledger.check_config(mcfg.to_dict())
        model, adapter = _load_for_stage(identity, device)
        calib = load_calibration(workdir)
        from moesq_core.compression.preflight import check_stage_states
        states = check_stage_states(ledger, ["init"], calib, model, sized_split="init", batch_size=batch_size,
                                    cache_limit_bytes=_cache_bytes(cache_limit_gb), disk_free_bytes=disk_free_bytes)
        note(progress, states.line)
        spec = StageSpec(
            name=name, fmt=fmt, method_for_block=lambda li: mcfg.build(), config=mcfg.to_dict(),
            compress_split="init", val_split=None, act_quant=identity.act_quant, batch_size=batch_size,
            cache_limit_bytes=states.cache_limit_bytes, memory_options=_memory_options(mcfg))
        return run_stage(model, adapter, calib, spec, ledger, progress, redo_from)


def _memory_options(init: MethodConfig, refine: bool = False) -> tuple[str, ...]:
    """The options that lower a stage's memory, most effective first (for its out-of-memory message)."""
    chunk = ("the method option chunk_gb",) if "chunk_gb" in init.options else ()
    return (("--micro-batch-rows", "--chunk-gb") if refine else ()) + chunk + ("--batch-size", "--cache-gb")


def _check_run_args(device, batch_size: int, redo_from: int | None, cache_limit_gb: float | None) -> None:
    _device(device)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 sequence, got {batch_size}")
    if redo_from is not None and redo_from < 0:
        raise ValueError(f"redo_from must be a layer index >= 0, got {redo_from}")
    if cache_limit_gb is not None and not cache_limit_gb >= 0:
        raise ValueError(f"cache_limit_gb must be >= 0 GiB (or None: sized from the free host memory), "
                         f"got {cache_limit_gb}")


def _cache_bytes(cache_limit_gb: float | None) -> int | None:
    return None if cache_limit_gb is None else int(cache_limit_gb * 2**30)


def _routing(identity: RunIdentity) -> tuple[int, int]:
    """(experts per token, routed experts per block) from the work dir's model config."""
    from moesq_core.models.adapter import read_config

    cfg = read_config(identity.model_path)
    top_k = cfg.get("num_experts_per_tok") or 1
    return top_k, cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 1


def refine_schedule(workdir: WorkDir, identity: RunIdentity, rcfg) -> str:
    """The per-block refinement schedule, estimated from the calibration (training sequences × tokens ×
    top-k routed rows, spread over the experts), as one line."""
    cal = workdir.load()["calibration"]
    top_k, n_exp = _routing(identity)
    seqs = cal["sequences"]["train"] + (cal["sequences"]["init"] if rcfg.init_split_rows else 0)
    rows = seqs * cal["seq_len"] * top_k
    what = "training + one-shot" if rcfg.init_split_rows else "training"
    return (f"{rcfg.schedule(rows, n_exp)} (from {seqs} {what} sequences × "
            f"{cal['seq_len']} tokens × top-{top_k} ≈ {rows:,} routed rows over {n_exp} experts per block)")


def refine(workdir: WorkDir, config=None, *, init: str | MethodConfig = "sgptq", device: str | None = None,
           batch_size: int = 8, redo_from: int | None = None, progress=None, cache_limit_gb: float | None = None,
           stage: str = "refine", disk_free_bytes: int | None = None) -> dict:
    """The refinement stage (a RefineConfig, or a dict of its fields). As in Algorithm 1, each block's init is
    computed inside the block loop: the one-shot method `init` (a MethodConfig, or a method name with its
    defaults) runs on the block's training tokens (and the one-shot split's: RefineConfig.init_split_rows) on
    the refined prefix, then refinement starts from it. Prints (progress.note) its schedule before training.
    Refuses (StatesDiskError) before any work when the work dir's disk cannot hold the calibration states
    (disk_free_bytes: its free bytes; None measures them)."""
    from moesq_core.compression.methods.refine import RefineConfig, RefineMethod

    rcfg = config if isinstance(config, RefineConfig) else RefineConfig(**dict(config or {}))
    mcfg = init if isinstance(init, MethodConfig) else MethodConfig(init)
    _check_run_args(device, batch_size, redo_from, cache_limit_gb)
    stage_config = refine_identity(rcfg, mcfg)
    with _locked(workdir):
        run, ledger = workdir.identity(), workdir.ledger(stage)
        fmt = run.format
        mcfg.check_format(fmt)
        if redo_from is None:
            done = ledger.finished_summary(stage_config)
            if done is not None:
                return {**done, "improved_on_init": improved_on_init(ledger)}
        else:
            ledger.check_config(stage_config)
        model, adapter = _load_for_stage(run, device)
        calib = load_calibration(workdir)
        note(progress, f"{stage} schedule: {refine_schedule(workdir, run, rcfg)}")
        # decided once, by the process that runs the step (under torchrun the others only wait for it)
        e2e = plan_end_to_end(rcfg, model, adapter, calib) if rcfg.e2e_steps and distributed.is_main_process() else None
        if e2e is not None:
            note(progress, f"{stage} end-to-end: {e2e['line']}")

        def end_to_end(model, adapter, ledger, progress):
            if not e2e["steps"]:
                return {"skipped": e2e["line"]}
            return tune_end_to_end(ledger, run, model, adapter, calib,
                                   dataclasses.replace(rcfg, e2e_steps=e2e["steps"]), progress, e2e["windows"])
        split = "train"
        if rcfg.init_split_rows:  # one split the block loop routes: the training and the one-shot sequences
            split = "train+init"
            calib = {**calib, split: torch.cat([calib["train"], calib["init"]])}
        from moesq_core.compression.preflight import check_stage_states
        states = check_stage_states(ledger, [split, "val"], calib, model, sized_split="train", batch_size=batch_size,
                                    cache_limit_bytes=_cache_bytes(cache_limit_gb), disk_free_bytes=disk_free_bytes)
        note(progress, states.line)
        plan = refine_memory(rcfg, fmt, model, adapter, _routing(run)[0], calib[split], calib["val"], batch_size,
                             e2e_bytes=e2e["need_bytes"] if e2e and e2e["steps"] else None)
        note(progress, f"{stage} memory: {plan}")
        spec = StageSpec(
            name=stage, fmt=fmt, method_for_block=lambda li: RefineMethod(mcfg.build(), rcfg), config=stage_config,
            compress_split=split, val_split="val", act_quant=run.act_quant, batch_size=batch_size,
            cache_limit_bytes=states.cache_limit_bytes, memory_options=_memory_options(mcfg, refine=True),
            finalize=end_to_end if rcfg.e2e_steps else None)
        summary = run_stage(model, adapter, calib, spec, ledger, progress, redo_from)
        return {**summary, "improved_on_init": improved_on_init(ledger)}


def refine_memory(rcfg, fmt, model, adapter, top_k: int, trained: torch.Tensor, held_out: torch.Tensor,
                  batch_size: int = 8, e2e_bytes: int | None = None) -> str:
    """What a block of the refine stage holds on the model's device at its peak, from the calibration token counts
    (the sequences the block loop trains on and validates on), checked before the block loop: one line, or
    RefineMemoryError naming the bytes and the options that lower them. Every device consumer of a block is
    counted beside what stays resident (the model's weights on the device, the block's dense experts): the
    refinement (methods/refine/trainer.py `refine_memory_plan`: the token matrix, the routed rows, one
    micro-batch, the experts' state, chunked where they do not fit), the in-loop init (its experts chunked into
    half the free memory, methods/batching.py), the activation-range pass (engine.amax_pass_bytes beside the
    token matrix and the dense and compressed experts) and the propagation (engine.propagation_bytes, one batch of
    `batch_size` sequences, beside the installed block); writing packs 64 MiB at a time. The end-to-end step
    after the last block is planned by plan_end_to_end: `e2e_bytes`, its need where it runs, is named too."""
    from moesq_core.compression.engine import (
        PACK_CHUNK_BYTES,
        RESULT_BYTES_PER_WEIGHT,
        amax_pass_bytes,
        installed_block_bytes,
        propagation_bytes,
    )
    from moesq_core.compression.methods.refine.trainer import (
        REFINE_GPU_FRACTION,
        RefineMemoryError,
        refine_bytes_per_expert,
        refine_memory_plan,
        refine_shared_bytes,
    )
    from moesq_core.memory import device_available_bytes, size

    device = next(model.parameters()).device
    blocks = adapter.blocks(model)
    if not blocks:
        return "no MoE block"
    experts = max(b.num_experts for b in blocks)
    H = blocks[0].dense_experts.gate_up_proj.shape[-1]
    inter = max(b.dense_experts.down_proj.shape[-1] for b in blocks)
    tokens = trained.numel() + held_out.numel()
    token_bytes = _dtype(device).itemsize
    available = device_available_bytes(device) if device.type == "cuda" else None
    refinement = refine_memory_plan(fmt, rcfg, experts=experts, H=H, inter=inter, tokens=tokens,
                                    token_bytes=token_bytes, routed_rows=tokens * top_k, available=available,
                                    device=str(device), sequences=trained.shape[0] + held_out.shape[0])
    after = "" if e2e_bytes is None else f"; after the last block, the end-to-end step ~{size(e2e_bytes)}"
    if device.type != "cuda":
        return refinement + after
    weights = 3 * inter * H
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p.device == device)
    resident += experts * weights * token_bytes  # the block's dense experts, loaded while it is compressed
    matrix = tokens * H * token_bytes  # the block's token matrix, held from routing to the activation ranges
    dense_fp32 = experts * weights * 4  # the experts' fp32 copies the methods get (engine: dense_weight_chunks)
    phases = {
        "activation ranges": matrix + dense_fp32 + experts * weights * RESULT_BYTES_PER_WEIGHT
        + amax_pass_bytes(H, inter),
        "propagation": installed_block_bytes(experts, H, inter)
        + propagation_bytes(batch_size * trained.shape[1], top_k, H, inter),
        "writing": experts * weights * RESULT_BYTES_PER_WEIGHT + PACK_CHUNK_BYTES,
    }
    others = max(phases.values())
    if available is not None and resident + others > available:
        worst = max(phases, key=phases.get)
        raise RefineMemoryError(
            f"refine: a block's {worst} needs ~{size(phases[worst])} on {device} beside ~{size(resident)} of resident "
            f"weights, and {size(available)} is available: lower --n-train/--n-init/--n-val, --seq-len or "
            f"--batch-size")
    refine_need = (refine_shared_bytes(H, inter, tokens, token_bytes, tokens * top_k, rcfg.micro_batch_rows,
                                       rcfg.compute_dtype_on(device).itemsize)
                   + experts * refine_bytes_per_expert(fmt, inter, H))
    if available is not None and rcfg.chunk_gb is None:
        refine_need = min(refine_need, int(available * REFINE_GPU_FRACTION))  # chunked into that (refine_chunks)
    phases = {"refinement": refine_need, **phases}
    peak = resident + max(phases.values())
    where = f"{size(available)} available" if available is not None else "free memory unknown"
    parts = ", ".join(f"{k} ~{size(v)}" for k, v in phases.items())
    return (f"~{size(peak)} per block at peak on {device} of {where} (resident weights ~{size(resident)} + the "
            f"largest phase: {parts}; in-loop init: chunked into half the free memory{after}). "
            f"Refinement: {refinement}")


def improved_on_init(ledger: StageLedger) -> dict:
    """How many of a refine stage's experts ship refined weights, i.e. validated better than their init in some
    epoch or end-to-end pass (the others ship the init: at a budget too small for the model, refinement then only
    cost time)."""
    from moesq_core.compression.engine import block_info

    improved = experts = 0
    for rec in (ledger.record() or {}).get("blocks", {}).values():
        for info in block_info(ledger.workdir.path_of(rec.get("file"), f"stages.{ledger.name}.blocks.file")).values():
            experts += 1
            improved += int((info.get("refine") or {}).get("best_epoch", 0) > 0
                            or (info.get("e2e") or {}).get("best_pass", 0) > 0)
    return {"experts": experts, "improved": improved}


def plan_end_to_end(rcfg, model, adapter, calib: dict[str, torch.Tensor]) -> dict:
    """The end-to-end step's length and windows on this model and calibration: {"steps", "windows", "need_bytes",
    "available_bytes", "line"}. The windows (RefineConfig.e2e_window; methods/refine/e2e.py e2e_window_plan) come
    from what the model's device has available (or rcfg.e2e_memory_gb): "auto" tunes the whole model at once where
    it fits, else the largest window of consecutive blocks that fits. With e2e_steps "auto" the step runs only when
    its windows fit; a number of steps runs regardless, with a warning when it looks too big."""
    from moesq_core.compression.methods.refine.e2e import e2e_window_plan
    from moesq_core.memory import device_available_bytes

    sequences = len(calib["train"]) + len(calib["init"])
    steps = rcfg.e2e_steps_for(sequences)
    device = next(model.parameters()).device
    gib = lambda b: f"{b / 2**30:.3g} GiB"  # noqa: E731
    if rcfg.e2e_memory_gb is not None:
        have, source = int(rcfg.e2e_memory_gb * 2**30), "allowed (e2e_memory_gb)"
    else:
        have, source = device_available_bytes(device), f"available on {device}"
    plan = e2e_window_plan(model, adapter, rcfg.e2e_batch_size, calib["train"].shape[1], rcfg.e2e_window, have,
                           rcfg.e2e_optimizer)
    need = plan.need_bytes
    where = f"{gib(have)} {source}" if have is not None else f"{device}'s free memory unknown"
    out = {"steps": steps, "windows": plan.windows, "need_bytes": need, "available_bytes": have}
    if rcfg.e2e_steps == "auto" and not plan.fits:
        what = ("tuning every expert of the model at once" if plan.whole
                else "tuning even one block at a time" if plan.auto else f"tuning {plan.describe()}")
        line = (f"skipped: {what} needs ~{gib(need)}, {where} "
                "(--e2e-steps N runs it anyway; --e2e-steps 0 silences this)")
        log.warning("end-to-end step %s", line)
        return {**out, "steps": 0, "line": line}
    per = "" if plan.whole else " per window"
    auto = "auto: " if rcfg.e2e_steps == "auto" else ""
    if plan.auto and not plan.whole:
        auto += "the largest window that fits: "
    if rcfg.e2e_optimizer != "adam":
        per += f" with {rcfg.e2e_optimizer.capitalize()}"
    line = (f"{steps} steps × {rcfg.e2e_batch_size} of {sequences} sequences{per} after the last block, "
            f"{plan.describe()} ({auto}~{gib(need)} of {where})")
    if not plan.fits:
        log.warning("end-to-end step: ~%s needed, %s: it may run out of memory", gib(need), where)
        line += " — may not fit"
    return {**out, "line": line}


def tune_end_to_end(ledger: StageLedger, identity: RunIdentity, model, adapter, calib: dict[str, torch.Tensor],
                    rcfg, progress=None, windows: list[list[int]] | None = None) -> dict:
    """Refinement's end-to-end step (RefineConfig.e2e_steps) on a stage whose blocks are all saved: tunes the
    values of the blocks' experts (methods/refine/e2e.py), every block together or window by window (`windows`:
    lists of consecutive MoE layers; None: one window, the whole model), on the training and one-shot splits,
    validating on the validation split, then writes the tuned blocks next to the block-wise ones and switches
    the stage to them in one manifest write. Each finished window's blocks are saved and recorded as it ends, so
    an interrupted run resumes at the window it was in (the same bytes as one uninterrupted run); until the
    switch the stage's blocks stay the block-wise ones. Done once: a stage that records it returns its record."""
    from moesq_core.compression.engine import load_block, pack_block, write_block
    from moesq_core.compression.methods.refine.e2e import EndToEndTuner

    st = ledger.record()
    if "e2e" in st:
        return st["e2e"]
    blocks = {b.layer_index: (b, *load_block(ledger.verified_block(b.layer_index))) for b in adapter.blocks(model)}
    windows = windows or [sorted(blocks)]
    device = next(model.parameters()).device
    train = torch.cat([calib["train"], calib["init"]])
    paths: dict[int, Path] = {}

    def write(result_blocks, li) -> Path:
        packed = pack_block(result_blocks[li], *blocks[li][2:])
        return ledger.write_artifact(li, lambda tmp: write_block(tmp, *packed), variant="e2e")

    finished = ledger.finished_windows(windows)  # [] where none, or (their files removed) planned otherwise
    for summary, done in finished:  # a resumed run: the windows tuned before it was interrupted
        for li, path in done.items():
            blocks[li] = (blocks[li][0], *load_block(path))
            paths[li] = path
    if finished:
        log.info("end-to-end step: resuming at window %d of %d (layers %s)", len(finished) + 1, len(windows),
                 windows[len(finished)])

    def on_window(layers, result) -> dict:
        """Save a tuned window and record it; its blocks then serve from what was written (as on resume)."""
        tuned = {}
        if result.summary["best_pass"] > 0:
            for li in layers:
                paths[li] = tuned[li] = write(result.blocks, li)
        ledger.record_window(windows, tuned, {"layers": layers, **result.summary})
        return {li: load_block(path)[0] for li, path in tuned.items()}

    result = EndToEndTuner(model, blocks, identity.format, identity.act_quant, rcfg, device).run(
        train, calib["val"], progress, windows=windows, finished=[s for s, _ in finished], on_window=on_window)
    if len(windows) == 1 and result.summary["best_pass"] > 0:
        for li in blocks:
            paths[li] = write(result.blocks, li)
    ledger.replace_blocks(paths, result.summary)
    return result.summary


# -- what the stage commands run ------------------------------------------------------------------------------
def run_calibrate(workdir: str | Path, model: str | Path | None = None, options: dict | None = None,
                  progress=None) -> dict:
    """`moesq calibrate`: the work dir created (or checked) and calibrated; returns the calibration record."""
    wd = WorkDir(workdir)
    with _command_lock(wd):
        wd = open_workdir(wd, model, options, progress=progress)
        return wd.load()["calibration"]


def run_init(workdir: str | Path, method: MethodConfig, model: str | Path | None = None,
             options: dict | None = None, *, device: str | None = None, batch_size: int = 8,
             redo_from: int | None = None, cache_limit_gb: float | None = None, progress=None) -> dict:
    """`moesq init-sgptq`: calibrate if needed, then the one-shot stage of `method`."""
    _check_run_args(device, batch_size, redo_from, cache_limit_gb)
    wd = WorkDir(workdir)
    with _command_lock(wd):
        wd = distributed.main_first(open_workdir, wd, model, options, progress=progress)
        return init_stage(wd, method, device=device, batch_size=batch_size, redo_from=redo_from, progress=progress,
                        cache_limit_gb=cache_limit_gb)


def recorded_init(wd: WorkDir, init: str) -> MethodConfig:
    """The init refinement runs inside its block loop: the options of the work dir's init stage of that method
    when there is one (`moesq init-sgptq --percdamp 0.05` then `moesq refine`), else the method's defaults."""
    st = wd.stage(init_stage_name(init))
    return MethodConfig(init, st["config"].get("options", {})) if st else MethodConfig(init)


def run_refine(workdir: str | Path, config, model: str | Path | None = None, options: dict | None = None, *,
               init: str = "sgptq", stage: str = "refine", device: str | None = None, batch_size: int = 8,
               redo_from: int | None = None, cache_limit_gb: float | None = None, progress=None) -> dict:
    """`moesq refine`: calibrate if needed, then refinement (its init computed per block, see `refine`)."""
    from moesq_core.compression.methods.refine import RefineConfig

    rcfg = config if isinstance(config, RefineConfig) else RefineConfig(**dict(config or {}))
    MethodConfig(init)  # an unknown init method is refused before anything runs
    _check_run_args(device, batch_size, redo_from, cache_limit_gb)
    wd = WorkDir(workdir)
    with _command_lock(wd):
        wd = distributed.main_first(open_workdir, wd, model, options, progress=progress)
        return refine(wd, rcfg, init=recorded_init(wd, init), device=device, batch_size=batch_size,
                      redo_from=redo_from, progress=progress, cache_limit_gb=cache_limit_gb, stage=stage)


def run_config_of(workdir: str | Path, config, keep=()):
    """`config` (a CompressConfig) with an existing work dir's run config (format, activation quantization,
    calibration) in place of its own, except the run options named in `keep` (RunConfig.flat's names: those
    given, which the work dir then checks): what `moesq run` does on a work dir another command made. A new
    work dir keeps the config's."""
    wd = WorkDir(workdir)
    if not wd.exists():
        return config
    given = {k: v for k, v in config.run_config().flat().items() if k in keep}
    rec = RunConfig.from_options({**RunConfig.from_identity(wd.identity()).flat(), **given})
    return dataclasses.replace(config, format=rec.format, act_quant=rec.act_quant, calib=rec.calib,
                               calib_source=rec.calib_source)


def finished_stages(workdir: WorkDir) -> list[str]:
    return [k for k, v in workdir.load()["stages"].items() if v.get("done")]


def default_stage(workdir: WorkDir) -> str:
    """The stage `pack` and `eval` use by default: refine if finished, else the last finished init stage."""
    done = finished_stages(workdir)
    if not done:
        raise WorkDirError(f"{workdir.root} has no finished compression stage yet; "
                           "run `moesq init-sgptq` or `moesq refine`")
    return "refine" if "refine" in done else done[-1]


def default_run_config() -> CompressConfig:
    """What `moesq run` does with no options (recipes/micro-quick.yaml): a small budget on the embedded model —
    256-token sequences, 64 for the one-shot stages, 64 + 8 for refinement (2 epochs × 8 steps, SGPTQ computed
    inside its block loop, then the automatic end-to-end step on the KL's second-order form, the cheaper one on a
    CPU), magnitude and SGPTQ alone as the baselines."""
    from moesq_core.compression.methods.refine import RefineConfig

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
        from moesq_core.compression.export import export_packed

        kw = {"progress": progress} if progress is not None else {}
        return export_packed(WorkDir(self.workdir), self.stage, Path(out), overwrite=overwrite,
                             sparse_layout=not dense_layout, **kw)


def model_source(model) -> str | Path | None:
    """What `compress` reads the model from: a local dir or Hub id as given; a loaded transformers model
    (PreTrainedModel) as the checkpoint it was loaded from (its `name_or_path`), since moesq reads the weights
    shard by shard (and again in every stage and on resume) and needs the tokenizer files beside them. So the
    model must hold exactly that checkpoint's weights: one changed in memory, or built with random weights
    (`from_config`), is refused naming the first tensor that differs (models.adapter.checkpoint_difference; it reads
    the checkpoint once). Save such a model with its tokenizer (save_pretrained(DIR)) and pass DIR."""
    if model is None or isinstance(model, (str, Path)):
        return model
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "save_pretrained"):
        raise ValueError("model must be a local dir, a Hub id or a loaded transformers model, "
                         f"got {type(model).__name__}")
    source = getattr(model, "name_or_path", None) or getattr(config, "name_or_path", None)
    if not source:
        raise ValueError("the loaded model has no source checkpoint (its name_or_path is empty), and moesq needs "
                         "its files and tokenizer: save both with save_pretrained(DIR) and pass DIR")
    from transformers import AutoConfig

    from moesq_core.models.adapter import check_unquantized, checkpoint_difference, resolve_model_path

    check_unquantized(model, source)
    path = resolve_model_path(str(source))
    check_unquantized(AutoConfig.from_pretrained(path), source)
    changed = checkpoint_difference(model, path)
    if changed is not None:
        raise ValueError(f"the loaded model differs from the checkpoint it names ({source}): {changed} is not the "
                         "checkpoint's (changed in memory, or a model built with random weights); moesq compresses "
                         "from files, which it reads block by block and resumes from: save the model and its "
                         "tokenizer with save_pretrained(DIR) and pass DIR")
    return source


def compress(model=None, config: CompressConfig | str | Path | None = None,
             workdir: str | Path = "moesq-work", *, device: str | None = None, batch_size: int = 8,
             cache_limit_gb: float | None = None, progress=None, calib=None) -> CompressedModel:
    """Compress `model` (a local dir, a Hub id or a loaded transformers model: see `model_source`; default: the
    config's `model`, else the embedded micro model) as `config` says (a CompressConfig or a recipe file;
    default: `moesq run`'s). `calib`, a `datasets.Dataset`, is the calibration text instead of the config's
    calib_source (its column `calib.text_column`, else "text", else its first text column). Resumable: finished
    stages are only checked, an interrupted one continues at its first unfinished block. A work dir made for
    another model or run config is refused."""

    model = model_source(model)
    if config is None:
        config = default_run_config()
    elif not isinstance(config, CompressConfig):
        config = CompressConfig.from_file(config)
    _check_run_args(device, batch_size, None, cache_limit_gb)
    options = config.run_config().flat()
    if calib is not None:
        if not is_dataset(calib):
            raise ValueError(f"calib must be a datasets.Dataset, got {type(calib).__name__} (a file, dir or Hub "
                             "dataset name goes in the config's calib_source)")
        options["calib_source"] = dataset_label(calib)
    wd = WorkDir(workdir)
    summaries = {}
    with _command_lock(wd):
        distributed.main_first(open_workdir, wd, model or config.model, options, progress=progress,
                               dataset=calib)
        # One-shot stages: the baselines (the init method among them as configured), and the init itself when
        # there is no refinement (refinement computes its init inside its own block loop).
        one_shot = [config.init if b == config.init.name else MethodConfig(b) for b in config.baselines]
        if config.refine is None and config.init.name not in config.baselines:
            one_shot.append(config.init)
        for mcfg in one_shot:
            summaries[init_stage_name(mcfg.name)] = init_stage(
                wd, mcfg, device=device, batch_size=batch_size, progress=progress, cache_limit_gb=cache_limit_gb)
        stage = init_stage_name(config.init.name)
        if config.refine is not None:
            stage = "refine"
            summaries[stage] = refine(wd, config.refine, init=config.init, device=device,
                                               batch_size=batch_size, progress=progress,
                                               cache_limit_gb=cache_limit_gb)
    return CompressedModel(wd.root, stage, config, summaries)


def run_all(workdir: str | Path, config=None, model: str | Path | None = None, *, device: str | None = None,
            ppl: str | Path | None = None, ppl_tokens: int = 65536, progress=None) -> dict:
    """`moesq run`: compress (calibrate → baselines → init → refine, as the CompressConfig says; default: the
    micro-quick recipe) → pack → verify → perplexity of the reference, the stages this config makes (other
    stages of the work dir are left out) and the packed model.
    Returns {stage, config, packed, rows, bits_per_weight} (None on the ranks other than 0 under torchrun)."""
    from moesq_core.checkpoint.verify import verify_packed_dir
    from moesq_core.eval.runner import ResultCache, ppl_for_targets, resolve_targets
    from moesq_core.progress import NullProgress

    progress = progress or NullProgress()
    wd = WorkDir(workdir)
    with _command_lock(wd):
        handle = compress(model, config, workdir, device=device, progress=progress)
        if not distributed.is_main_process():
            return None  # expert parallel: rank 0 packs, verifies and evaluates
        out = wd.root / "packed"
        with progress.task(f"pack {handle.stage}", len(wd.stage(handle.stage)["blocks"])) as t:
            handle.save_pretrained(out, overwrite=True, progress=t.advance)
        report = verify_packed_dir(out, progress=progress)
        if not report.ok:
            raise RuntimeError(f"verify failed on the packed model: {report.first_error}")
        targets = resolve_targets([str(wd.root), str(out)], stages=list(handle.summaries))  # this run's, not others'
        rows = ppl_for_targets(targets, ppl or DEFAULT_EVAL, max_tokens=ppl_tokens, device="cpu",
                               cache=ResultCache(wd.root / "eval" / "results.json"), progress=progress)
        (wd.root / "eval").mkdir(exist_ok=True)
        with atomic_path(wd.root / "eval" / "run_table.json") as tmp:
            tmp.write_text(json.dumps(rows, indent=2))
    return {"stage": handle.stage, "config": handle.config.to_dict(), "packed": str(out), "rows": rows,
            "bits_per_weight": report.bits_per_weight}
