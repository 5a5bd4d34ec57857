"""Accuracy table: perplexity of every compression method on the shared models, one calibration budget for all.

    python benchmarks/accuracy_table.py --models micro --workdir-root /tmp/moesq-acc --out benchmarks/results
    python benchmarks/accuracy_table.py --models tiny --rows core --ppl-tokens 65536
    # `moesq run`'s model, texts and budget (W4A4, 256-token sequences, 2 × 8 refinement steps):
    python benchmarks/accuracy_table.py --models embedded --tag run-budget --acts wa --seq-len 256 \
        --n-train 64 --n-val 8 --n-init 64 --epochs 2 --steps-per-epoch 8 --rows reference,sgptq,budget,paper-budget

For each model it builds (or resumes) one work dir per (format, activation setting) under
`--workdir-root/<model>/`, runs the requested stages there with the pipeline's own functions, evaluates
perplexity on the evaluation text (first `--ppl-tokens` tokens, non-overlapping `--window`-token windows, fp32
on CPU, expert weights fake-quantized) and writes `<out>/accuracy_<model>[_<tag>].json` and `.md` after every
finished row, so an interrupted run leaves a valid partial table (missing rows are listed as such). Re-running
skips finished stages (work dir manifest) and finished evaluations (a result cache keyed by the stage's
artifact checksums). The shared models are read from `../shared` next to the checkout; `embedded` is the
packaged micro model with the packaged calibration and evaluation samples.

Rows (`--rows`, comma-separated names or the groups `all`, `core`, `ablations`, `budget`, `paper-budget`,
`fp8`, `e2e`, `e2e-window`, `e2e-optimizer`, `gpu`): see ROWS/DESCRIPTION below — reference; dense NVFP4 RTN /
GPTQ; paired 4:8 magnitude, Wanda, JSQ, OBR, SGPTQ (export-exact scales, fp32 scales, refit); refinement (default,
other seeds, the paper's raw rates, values-first, ablations, from SGPTQ-refit, at ¼ and 1× the paper's 1,280 steps,
with end-to-end tuning after the last block, of the whole model or in windows of blocks, with Adam or Lion); the
release-faithful
configuration (recipes/release-faithful.yaml, minus the serving-time activation scale); s24-fp8 SGPTQ / refine.
Every compressed row is run weights-only ("wo") and/or with the format's activation quantizer ("wa": W4A4 for
NVFP4, W8A8 for FP8), each in its own work dir (a work dir holds one activation setting). Refinement rows
report the fraction of sparsity groups whose pattern differs from their init's.

Work dirs are scratch: keep them outside the repository (default /tmp/moesq-accuracy).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesq_core.compression import pipeline  # noqa: E402
from moesq_core.compression.calibration import CalibConfig  # noqa: E402
from moesq_core.compression.config import MethodConfig  # noqa: E402
from moesq_core.compression.engine import StageSpec, run_stage  # noqa: E402
from moesq_core.compression.methods.refine import RefineConfig  # noqa: E402
from moesq_core.compression.methods.registry import get_method  # noqa: E402
from moesq_core.compression.workdir import WorkDir  # noqa: E402
from moesq_core.eval.runner import EvalTarget, ResultCache, ppl_for_targets  # noqa: E402
from moesq_core.serving.bench.harness import git_commit  # noqa: E402

log = logging.getLogger("accuracy_table")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"  # the shared models and texts sit next to the checkout (as the tests expect; --shared)
MODELS = {"micro": "models/micro-qwen3-moe", "tiny": "models/tiny-qwen3-moe"}
CALIB = "data/calib-docs.txt.xz"
EVAL = "data/eval-docs.txt.xz"


def model_path(model: str) -> Path:
    return pipeline.DEFAULT_MODEL if model == "embedded" else SHARED / MODELS[model]


def texts(model: str) -> tuple[Path, Path]:
    """(calibration, evaluation) text: `moesq run`'s embedded samples for the embedded model, else the shared ones."""
    if model == "embedded":
        return pipeline.DEFAULT_CALIB, pipeline.DEFAULT_EVAL
    return SHARED / CALIB, SHARED / EVAL


DEVICE = "cpu"  # where stages run (--device); evaluation is fp32 on --eval-device (default the CPU)
PAPER = {"epochs": 10, "steps_per_epoch": 128}  # the paper's 1,280 steps per block
QUARTER = {"epochs": 10, "steps_per_epoch": 32}  # a quarter of it
E2E = {"e2e_steps": 64, "e2e_batch_size": 4}  # end-to-end tuning after the last block (lr: RefineConfig's)
E2E_128 = {"e2e_steps": 128, "e2e_batch_size": 4}
E2E_256 = {"e2e_steps": 256, "e2e_batch_size": 4}
SPLIT = {"init_split_rows": True}  # RefineConfig's default; tables begun before it existed run with it off
# moesq's refinement defaults for the fields a table's base protocol may pin otherwise (tables begun before the
# end-to-end step's "auto" and the values' RMS cap run their base rows without them; these rows say what a
# default run does on that protocol)
DEFAULTS = {k: getattr(RefineConfig(), k) for k in ("init_split_rows", "lr_budget_values_rms", "e2e_steps",
                                                    "e2e_lr", "e2e_batch_size", "e2e_loss")}
RELEASE = {"lr_budget_steps": None, "logits_dtype": "bfloat16", "ship": "last", "shared_gate_up_global": False,
           "init_split_rows": False}

# name -> (format, kind, method, options); kind: reference | init | refine. For refine rows `method` is the
# init row refinement starts from and `options` are RefineConfig fields over the command line's.
ROWS: dict[str, tuple[str | None, str, str | None, dict]] = {
    "reference": (None, "reference", None, {}),
    "dense-rtn": ("dense-nvfp4", "init", "rtn", {}),
    "dense-gptq": ("dense-nvfp4", "init", "gptq", {}),
    "magnitude": ("p48-nvfp4", "init", "magnitude", {}),
    "wanda": ("p48-nvfp4", "init", "wanda", {}),
    "jsq": ("p48-nvfp4", "init", "jsq", {}),
    "obr": ("p48-nvfp4", "init", "obr", {}),
    "sgptq": ("p48-nvfp4", "init", "sgptq", {}),
    "sgptq-paper": ("p48-nvfp4", "init", "sgptq", {"refit": False}),
    # the release's SGPTQ: fp32 scales, and no refit (which moesq's registry turns on by default)
    "sgptq-fp32scales": ("p48-nvfp4", "init", "sgptq", {"exact_scales": False, "refit": False}),
    "sgptq-refit": ("p48-nvfp4", "init", "sgptq", {"refit": True}),
    "refine": ("p48-nvfp4", "refine", "sgptq", {}),
    "refine-seed1": ("p48-nvfp4", "refine", "sgptq", {"seed": 1}),
    "refine-paper-lr": ("p48-nvfp4", "refine", "sgptq", {"lr_budget_steps": None}),
    "refine-values-first": ("p48-nvfp4", "refine", "sgptq", {"values_first": 0.5}),
    "refine-logits-cap25": ("p48-nvfp4", "refine", "sgptq", {"lr_budget_cap_logits": 25.0}),
    "refine-logits-cap100": ("p48-nvfp4", "refine", "sgptq", {"lr_budget_cap_logits": 100.0}),
    "refine-p0": ("p48-nvfp4", "refine", "sgptq", {"loss_power": 0}),
    "refine-values": ("p48-nvfp4", "refine", "sgptq", {"train_support": False}),
    "refine-support": ("p48-nvfp4", "refine", "sgptq", {"train_values": False}),
    "refine-refit": ("p48-nvfp4", "refine", "sgptq-refit", {}),
    "refine-refit-seed1": ("p48-nvfp4", "refine", "sgptq-refit", {"seed": 1}),
    "refine-refit-values": ("p48-nvfp4", "refine", "sgptq-refit", {"train_support": False}),
    "refine-quarter": ("p48-nvfp4", "refine", "sgptq", QUARTER),
    "refine-quarter-paper-lr": ("p48-nvfp4", "refine", "sgptq", {**QUARTER, "lr_budget_steps": None}),
    "refine-paper": ("p48-nvfp4", "refine", "sgptq", PAPER),
    "refine-refit-quarter": ("p48-nvfp4", "refine", "sgptq-refit", QUARTER),
    "refine-refit-e2e": ("p48-nvfp4", "refine", "sgptq-refit", E2E),
    "refine-split": ("p48-nvfp4", "refine", "sgptq-refit", SPLIT),
    "refine-e2e": ("p48-nvfp4", "refine", "sgptq-refit", {**SPLIT, **E2E}),
    "refine-e2e-seed1": ("p48-nvfp4", "refine", "sgptq-refit", {**SPLIT, **E2E, "seed": 1}),
    # the end-to-end step with Lion (one moment per weight instead of Adam's two) at rates below Adam's 1e-3
    **{f"refine-e2e-lion{lr}{s}": ("p48-nvfp4", "refine", "sgptq-refit",
                                   {**SPLIT, **E2E, "e2e_optimizer": "lion", "e2e_lr": float(lr), **seed})
       for lr in ("1e-3", "3e-4", "1e-4") for s, seed in (("", {}), ("-seed1", {"seed": 1}))},
    "refine-e2e-128": ("p48-nvfp4", "refine", "sgptq-refit", {**SPLIT, **E2E_128}),
    "refine-e2e-128-seed1": ("p48-nvfp4", "refine", "sgptq-refit", {**SPLIT, **E2E_128, "seed": 1}),
    "refine-e2e-256": ("p48-nvfp4", "refine", "sgptq-refit", {**SPLIT, **E2E_256}),
    "refine-default": ("p48-nvfp4", "refine", "sgptq", DEFAULTS),
    "refine-default-seed1": ("p48-nvfp4", "refine", "sgptq", {**DEFAULTS, "seed": 1}),
    "refine-default-w2": ("p48-nvfp4", "refine", "sgptq", {**DEFAULTS, "e2e_window": 2}),
    "refine-default-w2-seed1": ("p48-nvfp4", "refine", "sgptq", {**DEFAULTS, "e2e_window": 2, "seed": 1}),
    "refine-default-w1": ("p48-nvfp4", "refine", "sgptq", {**DEFAULTS, "e2e_window": 1}),
    "release-faithful": ("p48-nvfp4", "refine", "sgptq-fp32scales", RELEASE),
    "release-faithful-paper": ("p48-nvfp4", "refine", "sgptq-fp32scales", {**RELEASE, **PAPER}),
    "s24-sgptq": ("s24-fp8", "init", "sgptq", {}),
    "s24-refine": ("s24-fp8", "refine", "s24-sgptq", {}),
    "s24-refine-default": ("s24-fp8", "refine", "s24-sgptq", DEFAULTS),
}
DESCRIPTION = {
    "reference": "reference (bf16 weights evaluated in fp32)",
    "dense-rtn": "dense NVFP4 (16-blocks), RTN",
    "dense-gptq": "dense NVFP4 (16-blocks), GPTQ",
    "magnitude": "paired 4:8 NVFP4, magnitude + RTN",
    "wanda": "paired 4:8 NVFP4, Wanda + RTN",
    "jsq": "paired 4:8 NVFP4, JSQ",
    "obr": "paired 4:8 NVFP4, OBR (no rotation)",
    "sgptq": "paired 4:8 NVFP4, SGPTQ as moesq runs it (its registry default: refit; export-exact E4M3 scales)",
    "sgptq-paper": "paired 4:8 NVFP4, SGPTQ as in the paper (no refit; export-exact E4M3 scales)",
    "sgptq-fp32scales": "paired 4:8 NVFP4, SGPTQ (fp32 scales, projected after; the release)",
    "sgptq-refit": "paired 4:8 NVFP4, SGPTQ-refit (SparseGPT support, masked least squares, GPTQ)",
    "refine": "paired 4:8 NVFP4, moesq refine on the table's protocol (p=2, support+values, lr budget rule; "
              "block-wise only unless the protocol says otherwise)",
    "refine-seed1": "paired 4:8 NVFP4, refine, refine seed 1",
    "refine-default": "paired 4:8 NVFP4, moesq refine with every default (block loop on the training + one-shot "
                      "sequences, values' step ≤ 0.025 × weight RMS, end-to-end step auto: 2 passes of 4 sequences, "
                      "at most 256 steps)",
    "refine-default-seed1": "paired 4:8 NVFP4, refine-default with refine seed 1",
    "refine-default-w2": "paired 4:8 NVFP4, refine-default with its end-to-end step in windows of 2 blocks",
    "refine-default-w2-seed1": "paired 4:8 NVFP4, refine-default-w2 with refine seed 1",
    "refine-default-w1": "paired 4:8 NVFP4, refine-default with its end-to-end step in windows of 1 block",
    "refine-paper-lr": "paired 4:8 NVFP4, refine with the paper's raw lrs (no budget rule)",
    "refine-values-first": "paired 4:8 NVFP4, refine, values only for the first half of the steps",
    "refine-logits-cap25": "paired 4:8 NVFP4, refine, budget rule with the logits' multiplier capped at 25 (not 10)",
    "refine-logits-cap100": "paired 4:8 NVFP4, refine, budget rule with the logits' multiplier capped at 100",
    "refine-refit": "paired 4:8 NVFP4, refine (default) from SGPTQ-refit",
    "refine-refit-seed1": "paired 4:8 NVFP4, refine (default) from SGPTQ-refit, refine seed 1",
    "refine-refit-values": "paired 4:8 NVFP4, refine values only from SGPTQ-refit",
    "refine-quarter": "paired 4:8 NVFP4, refine (default) at 1/4 of the paper's budget (10 × 32 steps)",
    "refine-quarter-paper-lr": "paired 4:8 NVFP4, refine at 1/4 of the paper's budget with the paper's raw lrs",
    "refine-paper": "paired 4:8 NVFP4, refine (default) at the paper's budget (10 × 128 steps)",
    "refine-refit-quarter": "paired 4:8 NVFP4, refine from SGPTQ-refit at 1/4 of the paper's budget",
    "refine-refit-e2e": "paired 4:8 NVFP4, refine (default) from SGPTQ-refit + end-to-end tuning of the values "
                        "(64 steps × 4 sequences, KL to the reference's logits)",
    "refine-split": "paired 4:8 NVFP4, refine (default: the block loop routes the training and one-shot sequences) "
                    "from SGPTQ-refit",
    "refine-e2e": "paired 4:8 NVFP4, refine (default: the block loop routes the training and one-shot sequences) "
                  "from SGPTQ-refit + end-to-end tuning (64 steps × 4 sequences)",
    "refine-e2e-seed1": "paired 4:8 NVFP4, refine-e2e with refine seed 1",
    **{f"refine-e2e-lion{lr}": f"paired 4:8 NVFP4, refine-e2e with Lion (one moment) at lr {lr} in place of Adam at "
                               "1e-3" for lr in ("1e-3", "3e-4", "1e-4")},
    **{f"refine-e2e-lion{lr}-seed1": f"paired 4:8 NVFP4, refine-e2e-lion{lr} with refine seed 1"
       for lr in ("1e-3", "3e-4", "1e-4")},
    "refine-e2e-128": "paired 4:8 NVFP4, refine (default, training + one-shot sequences) from SGPTQ-refit + "
                      "end-to-end tuning (128 steps × 4 sequences)",
    "refine-e2e-128-seed1": "paired 4:8 NVFP4, refine-e2e-128 with refine seed 1",
    "refine-e2e-256": "paired 4:8 NVFP4, refine (default, training + one-shot sequences) from SGPTQ-refit + "
                      "end-to-end tuning (256 steps × 4 sequences)",
    "release-faithful": "paired 4:8 NVFP4, release-faithful (fp32 SGPTQ scales, paper lrs, bf16 logits, last epoch, "
                        "separate gate/up globals)",
    "release-faithful-paper": "paired 4:8 NVFP4, release-faithful at the paper's budget (10 × 128 steps)",
    "refine-p0": "paired 4:8 NVFP4, refine ablation: uniform loss (p=0)",
    "refine-values": "paired 4:8 NVFP4, refine ablation: values only (support frozen)",
    "refine-support": "paired 4:8 NVFP4, refine ablation: support only (values frozen)",
    "s24-sgptq": "2:4 FP8, SGPTQ",
    "s24-refine": "2:4 FP8, moesq refine",
    "s24-refine-default": "2:4 FP8, moesq refine with every default (see refine-default)",
}
GROUPS = {
    "all": [r for r in ROWS if not r.startswith("s24")] + ["s24-sgptq", "s24-refine"],
    "p48": [r for r in ROWS if not r.startswith("s24")],
    "core": ["reference", "dense-rtn", "magnitude", "wanda", "jsq", "obr", "sgptq", "sgptq-fp32scales", "refine"],
    "ablations": ["refine-p0", "refine-values", "refine-support"],
    "budget": ["refine-split", "refine-paper-lr", "refine-values-first", "refine-logits-cap25", "refine-logits-cap100",
               "refine-seed1", "sgptq-refit", "refine-refit", "refine-refit-seed1", "refine-refit-values",
               "release-faithful"],
    "paper-budget": ["refine-quarter", "refine-quarter-paper-lr", "refine-refit-quarter", "refine-paper",
                     "release-faithful-paper"],
    "fp8": ["s24-sgptq", "s24-refine"],
    # the rows of one table at a larger calibration set on the GPU: baselines, moesq's default refinement (two
    # seeds) with its ablations and the end-to-end step, the release-faithful configuration, ¼ and 1× the budget
    "gpu": ["reference", "dense-rtn", "magnitude", "wanda", "jsq", "obr", "sgptq-paper", "sgptq", "release-faithful",
            "refine-default", "refine-default-seed1",
            "refine", "refine-seed1", "refine-p0", "refine-values", "refine-support", "refine-e2e",
            "refine-e2e-seed1", "refine-e2e-128", "refine-e2e-128-seed1", "refine-quarter", "refine-paper"],
    "e2e": ["refine-refit-e2e", "refine-e2e", "refine-e2e-128", "refine-e2e-256"],
    # the end-to-end step's optimizer: Adam against Lion at three rates, two seeds each
    "e2e-optimizer": ["reference", "sgptq-refit", "refine-e2e", "refine-e2e-seed1",
                      *(f"refine-e2e-lion{lr}{s}" for lr in ("1e-3", "3e-4", "1e-4") for s in ("", "-seed1"))],
    # the end-to-end step in windows against the whole-model step (and, in each row's e2e line, block-wise)
    "e2e-window": ["reference", "sgptq", "refine-default", "refine-default-seed1", "refine-default-w2",
                   "refine-default-w2-seed1", "refine-default-w1"],
}
ACT_NAMES = {"dense-nvfp4": "W4A4", "p48-nvfp4": "W4A4", "s24-fp8": "W8A8"}


def e2e_kl(r: dict) -> str:
    """An end-to-end record's validation KL before → shipped, in words (a windowed step: from the first window's
    start to the last window's shipped pass)."""
    if "windows" in r:
        first, last = r["windows"][0], r["windows"][-1]
        return (f"val KL {first['val_kl'][0]:.4f} → {last['val_kl'][last['best_pass']]:.4f} "
                f"({len(r['windows'])} windows, {r['steps']} steps each)")
    return (f"val KL {r['val_kl'][0]:.4f} → {r['val_kl'][r['best_pass']]:.4f} "
            f"(pass {r['best_pass']} of {r['passes']}, {r['steps']} steps)")


def stage_name(row: str) -> str:
    fmt, kind, method, opts = ROWS[row]
    if kind == "refine":
        return "refine" if row in ("refine", "s24-refine") else row
    if opts:  # a variant of a method (e.g. sgptq-refit): its own stage next to the method's own
        return f"init-{row}"
    return pipeline.init_stage_name(method)


def expand_rows(spec: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        names = GROUPS.get(part, [part])
        for n in names:
            if n not in ROWS:
                raise SystemExit(f"unknown row {n!r}; rows: {', '.join(ROWS)}; groups: {', '.join(GROUPS)}")
            if n not in out:
                out.append(n)
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name(0)}" if DEVICE.startswith("cuda") and torch.cuda.is_available() else ""
    return f"{platform.node()}: {cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}{gpu}"


def workdir_for(root: Path, model: str, fmt: str, act: bool, calib: CalibConfig) -> WorkDir:
    wd = WorkDir(root / model / f"{fmt}-{'wa' if act else 'wo'}")
    if not (wd.root / "manifest.json").is_file() or "calibration" not in wd.load():
        cfg = pipeline.RunConfig(format=fmt, act_quant=act, calib=calib, calib_source=str(texts(model)[0]))
        pipeline.calibrate(wd, model_path(model), cfg)
    return wd


def compress_stage(wd: WorkDir, method: str, options: dict, name: str, batch_size: int) -> None:
    """pipeline.init_stage under a chosen stage name (two variants of one method in one work dir)."""
    if name == pipeline.init_stage_name(method):
        pipeline.init_stage(wd, method, options, device=DEVICE, batch_size=batch_size)
        return
    identity = wd.identity()
    get_method(method, **options)
    model, adapter = pipeline._load_for_stage(identity, DEVICE)
    calib = pipeline.load_calibration(wd)
    spec = StageSpec(name=name, fmt=identity.format, method_for_block=lambda li: get_method(method, **options),
                     config={"method": method, "options": options}, compress_split="init", val_split=None,
                     act_quant=identity.act_quant, batch_size=batch_size)
    run_stage(model, adapter, calib, spec, wd.ledger(name))


def ensure_stage(wd: WorkDir, row: str, refine_cfg: dict, batch_size: int) -> dict:
    """Run the row's stage (and the init it needs) unless finished; returns the stage's manifest entry."""
    fmt, kind, method, opts = ROWS[row]
    name = stage_name(row)
    st = wd.stage(name)
    if st and st.get("done"):
        return st
    if kind == "refine":
        ensure_stage(wd, method, refine_cfg, batch_size)  # the init row alone, for the table
        _, _, init_method, init_opts = ROWS[method]  # refinement runs this init inside its block loop
        pipeline.refine(wd, {**refine_cfg, **opts}, init=MethodConfig(init_method, init_opts), device=DEVICE,
                        batch_size=batch_size, stage=name)
    else:
        compress_stage(wd, method, opts, name, batch_size)
    return wd.stage(name)


def patterns_changed(wd: WorkDir, stage: str) -> float | None:
    """Fraction of the sparsity groups whose refined pattern differs from the init's (from the stage's blocks)."""
    from moesq_core.compression.engine import load_block

    changed = total = 0
    for rec in wd.stage(stage)["blocks"].values():  # the stage's blocks (end-to-end tuning keeps the patterns)
        for ce in load_block(wd.root / rec["file"])[0]:
            r = ce.info.get("refine", {})
            changed, total = changed + r.get("groups_changed", 0), total + r.get("groups", 0)
    return changed / total if total else None


def command_line(args: list[str]) -> str:
    """The invocation as recorded in the tables: an absolute --workdir-root, --out or --shared becomes its last
    part (the committed results hold no machine paths)."""
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a in ("--workdir-root", "--out", "--shared") and Path(out[i + 1]).is_absolute():
            out[i + 1] = Path(out[i + 1]).name
    return " ".join(["python", "benchmarks/accuracy_table.py", *out])


def blockwise_ppl(wd: WorkDir, stage: str, eval_text, args, cache) -> float:
    """Perplexity of a stage's block-wise result before its end-to-end tuning (the blocks it keeps under
    "blockwise"), evaluated as a scratch stage `<stage>-blockwise` of the (scratch) work dir: the before/after
    pair of one run."""
    bw = f"{stage}-blockwise"
    with wd.locked():
        m = wd.load()
        st = m["stages"][stage]
        m["stages"][bw] = {**{k: v for k, v in st.items() if k not in ("e2e", "blockwise")}, "blocks": st["blockwise"]}
        wd.save(m)
    return ppl_for_targets([EvalTarget(bw, "stage", str(wd.root), bw)], eval_text, max_tokens=args.ppl_tokens,
                           window=args.window, device=args.eval_device, cache=cache)[0]["ppl"]


def same_refine(old: dict | None, new: dict) -> bool:
    """The same refinement protocol: equal configs, where a table written before the end-to-end options
    existed (no e2e_* keys) counts as having none, one written before `init_split_rows` or
    `lr_budget_values_rms` existed as having them off (LEGACY_REFINE), and `compile` and `chunk_gb` are
    not compared (the speed on CUDA, the memory per chunk: CPU results are the same whatever they say)."""
    if old is None:
        return False
    old = {**LEGACY_REFINE, **old, **{k: new.get(k) for k in ("compile", "chunk_gb")}}
    return old == new


# What a table written before a RefineConfig field existed ran with: no end-to-end step, the training split
# alone, no cap on the values' step.
LEGACY_REFINE = {"e2e_steps": 0, "e2e_lr": 1e-3, "e2e_batch_size": 8, "e2e_loss": "kl", "e2e_memory_gb": None,
                 "e2e_optimizer": "adam",
                 "init_split_rows": False, "lr_budget_values_rms": None}


def rel(path) -> str:
    """A path as written into the committed tables: relative to the repository (never a machine path)."""
    import os

    p = Path(path).resolve()
    return os.path.relpath(p, REPO) if REPO.parent in p.parents else p.name


def fmt_ppl(x):
    return "—" if x is None else f"{x:.2f}"


def write_outputs(out_dir: Path, stem: str, meta: dict, rows: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "rows": rows}
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    ref = (rows.get("reference") or {}).get("ppl")
    lines = [f"# Perplexity accuracy table: {meta['model']} ({meta['model_path']})", "",
             f"- command: `{meta['command']}`", f"- commit: {meta['commit']}  date: {meta['date']}",
             f"- machine: {meta['machine']}",
             f"- evaluation: {meta['eval']['file']}, first {meta['eval']['tokens']} tokens, "
             f"{meta['eval']['window']}-token windows, fp32 on {meta['eval']['device'].upper()}, "
             "expert weights fake-quantized"
             + ("" if meta["eval"]["tokens"] == 65536 else " (REDUCED from the standard 65,536 tokens)"),
             f"- calibration ({meta['calibration']['source']}): {json.dumps(meta['calibration']['config'])} "
             "— the same splits for every method (one-shot methods use `init`; refinement `train`/`val`, and with "
             "`init_split_rows` `init` too)",
             f"- refinement (rows override some fields, see `options` in the JSON): {json.dumps(meta['refine'])}",
             f"- seeds: calibration split {meta['calibration']['config']['seed']}, refinement {meta['refine']['seed']} "
             "unless the row says otherwise", "",
             "| row | method | weights only | wo / ref | W4A4 (W8A8 for fp8) | wa / ref | patterns changed (wo / wa) "
             "| stage s (wo / wa) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    missing = []
    for name in meta["rows_requested"]:
        r = rows.get(name)
        if name == "reference":
            p = (r or {}).get("ppl")
            lines.append(f"| reference | {DESCRIPTION[name]} | {fmt_ppl(p)} | 1.000 | {fmt_ppl(p)} | 1.000 | — | — |")
            if p is None:
                missing.append("reference")
            continue
        cells, secs, changed = [], [], []
        for act in ("wo", "wa"):
            c = (r or {}).get(act) or {}
            p = c.get("ppl")
            cells += [fmt_ppl(p), "—" if p is None or ref is None else f"{p / ref:.3f}"]
            secs.append("—" if c.get("stage_seconds") is None else f"{c['stage_seconds']:.0f}")
            changed.append("—" if c.get("patterns_changed") is None else f"{100 * c['patterns_changed']:.2f} %")
            if p is None and act in meta.get("acts", ("wo", "wa")):
                missing.append(f"{name} ({act})")
        lines.append(f"| {name} | {DESCRIPTION[name]} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | "
                     f"{' / '.join(changed)} | {' / '.join(secs)} |")
    lines += ["", "Stage seconds: the work dir manifest's `stage_seconds` (compression incl. routing of the "
              "calibration states; for refine rows excluding the shared SGPTQ init).", ""]
    lines.append("Missing rows: " + (", ".join(missing) if missing else "none") + ".")
    e2e = [(name, act, c) for name in meta["rows_requested"] for act, c in (rows.get(name) or {}).items()
           if isinstance(c, dict) and c.get("e2e")]
    if e2e:
        lines += ["", "End-to-end tuning (rows `*-e2e`): the same run's block-wise result before it, and the KL to the "
                  "reference on the validation sequences before / after (the shipped pass):", ""]
        for name, act, c in e2e:
            bw = c.get("blockwise")
            lines.append(f"- {name} ({act}): ppl {fmt_ppl(bw)} → {fmt_ppl(c['ppl'])}"
                         + (f" ({c['ppl'] / bw:.3f}×)" if bw else "") + f"; {e2e_kl(c['e2e'])}")
    if meta.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in meta["notes"]]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="micro,tiny",
                    help="comma-separated: micro, tiny (the shared models and texts), embedded (the packaged micro "
                         "model with its calibration and evaluation samples, as `moesq run` uses them)")
    ap.add_argument("--tag", default="",
                    help="output name suffix: accuracy_<model>[_<tag>].json/.md (one file per protocol)")
    ap.add_argument("--rows", default="all", help=f"rows or groups ({', '.join(GROUPS)})")
    ap.add_argument("--acts", default="wo,wa", help="wo (weights only), wa (W4A4 / W8A8), or both")
    ap.add_argument("--workdir-root", type=Path, default=Path("/tmp/moesq-accuracy"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    ap.add_argument("--ppl-tokens", type=int, default=65536)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--n-init", type=int, default=64)
    ap.add_argument("--n-train", type=int, default=64)
    ap.add_argument("--n-val", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps-per-epoch", type=int, default=32)
    ap.add_argument("--refine-opt", action="append", default=[], metavar="KEY=JSON",
                    help="extra RefineConfig field, e.g. lr_logits=1e-3 (repeatable)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="device the compression stages run on (cpu, cuda); "
                                                    "refinement on CUDA computes its matmuls in bf16")
    ap.add_argument("--eval-device", default="cpu", help="device of the fp32 perplexity evaluation (cpu, cuda)")
    ap.add_argument("--shared", type=Path, default=None,
                    help="folder holding models/{micro,tiny}-qwen3-moe and data/ "
                         "(default: ../shared next to the checkout)")
    ap.add_argument("--merge", action="append", default=[], type=Path, metavar="JSON",
                    help="accuracy_<model>.json of another run of this script (e.g. rows run in parallel under another "
                         "--workdir-root) whose rows are merged in; it must use the same protocol (repeatable)")
    ap.add_argument("--no-run", action="store_true",
                    help="compute nothing: only rewrite the table from the existing JSON (+ --merge); --rows then only "
                         "adds row names to the list of requested rows (so missing ones are reported)")
    ap.add_argument("--note", action="append", default=[], help="a note written into the table (repeatable)")
    args = ap.parse_args(argv)
    global DEVICE, SHARED
    DEVICE = args.device
    if args.shared is not None:
        SHARED = args.shared.resolve()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    root = args.workdir_root.resolve()
    if root == REPO or REPO in root.parents:
        raise SystemExit(f"--workdir-root {root} is inside the repository; work dirs must not be committed")
    rows_req = expand_rows(args.rows)
    acts = [a.strip() for a in args.acts.split(",") if a.strip()]
    if not set(acts) <= {"wo", "wa"}:
        raise SystemExit("--acts takes wo and/or wa")
    calib = CalibConfig(seq_len=args.seq_len, n_train=args.n_train, n_val=args.n_val, n_init=args.n_init,
                        seed=args.seed)
    refine_cfg = {"epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch}
    for kv in args.refine_opt:
        k, _, v = kv.partition("=")
        refine_cfg[k] = json.loads(v)

    full_refine = json.loads(json.dumps(asdict(RefineConfig(**refine_cfg))))  # as stored in JSON (tuples -> lists)
    root.mkdir(parents=True, exist_ok=True)

    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        if model not in (*MODELS, "embedded"):
            raise SystemExit(f"unknown model {model!r}; choose from {', '.join(MODELS)}, embedded")
        # one result cache per model: concurrent runs for different models must not overwrite each other's
        (root / model).mkdir(parents=True, exist_ok=True)
        cache = ResultCache(root / model / "ppl_cache.json")
        stem = f"accuracy_{model}" + (f"_{args.tag}" if args.tag else "")
        calib_text, eval_text = texts(model)
        out_json = args.out / f"{stem}.json"
        old = json.loads(out_json.read_text()) if out_json.is_file() else {}
        same_protocol = (old.get("eval", {}).get("tokens") == args.ppl_tokens
                         and old.get("calibration", {}).get("config") == calib.to_dict()
                         and same_refine(old.get("refine"), full_refine))
        rows: dict = old.get("rows", {}) if same_protocol else {}
        meta = {
            "model": model, "model_path": rel(model_path(model)), "acts": acts,
            "command": command_line(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "device": args.device,
            "eval": {"file": rel(eval_text), "tokens": args.ppl_tokens, "window": args.window, "dtype": "float32",
                     "device": args.eval_device},
            "calibration": {"source": rel(calib_text), "config": calib.to_dict()},
            "refine": full_refine,
            "rows_requested": list(dict.fromkeys([*(old.get("rows_requested", []) if same_protocol else []),
                                                  *rows_req])),
            # a table's notes describe its rows: kept when a later run of the same protocol adds rows
            "notes": list(dict.fromkeys([*(old.get("notes", []) if same_protocol else []), *args.note])),
        }
        if args.no_run and same_protocol:  # nothing computed here: the table keeps the provenance of its runs
            meta.update({k: old[k] for k in ("command", "commit", "date", "machine", "device", "model_path", "eval",
                                             "calibration")
                         if k in old})
        for src in args.merge:
            other = json.loads(src.read_text())
            if other.get("model") != model:
                continue
            if not (other["eval"]["tokens"] == args.ppl_tokens and other["calibration"]["config"] == calib.to_dict()
                    and same_refine(other["refine"], full_refine)):
                raise SystemExit(f"{src}: different protocol (eval tokens, calibration or refine config); not merged")
            for name, r in other["rows"].items():
                if name == "reference":
                    rows.setdefault(name, r)
                    continue
                for act, cell in r.items():
                    if "ppl" in cell and "ppl" not in rows.get(name, {}).get(act, {}):
                        rows.setdefault(name, {})[act] = {"commit": other.get("commit"), **cell,
                                                          "merged_from": src.name}
            meta["rows_requested"] += [n for n in other["rows"] if n not in meta["rows_requested"]]
            meta["notes"] = meta["notes"] + [f"rows marked merged_from in the JSON were run by `{other['command']}` "
                                             "(same calibration seed and config)"]
        meta["rows_requested"] = [r for r in ROWS if r in meta["rows_requested"]]
        write_outputs(args.out, stem, meta, rows)
        if args.no_run:
            continue
        for row in rows_req:
            fmt, kind, method, opts = ROWS[row]
            if row == "reference":
                t0 = time.perf_counter()
                res = ppl_for_targets([EvalTarget("reference", "reference", str(model_path(model)))], eval_text,
                                      max_tokens=args.ppl_tokens, window=args.window, device=args.eval_device,
                                      cache=cache)[0]
                rows["reference"] = {"ppl": res["ppl"], "tokens": res["tokens"],
                                     "eval_seconds": round(time.perf_counter() - t0, 1)}
                log.info("%s reference: ppl %.3f", model, res["ppl"])
                write_outputs(args.out, stem, meta, rows)
                continue
            for act in acts:
                wd = workdir_for(root, model, fmt, act == "wa", calib)
                t0 = time.perf_counter()
                try:
                    st = ensure_stage(wd, row, refine_cfg, args.batch_size)
                except Exception as e:  # keep going: one failing method must not cost the other rows
                    log.exception("%s %s (%s) failed", model, row, act)
                    rows.setdefault(row, {})[act] = {"error": f"{type(e).__name__}: {e}"}
                    write_outputs(args.out, stem, meta, rows)
                    continue
                t_stage = time.perf_counter() - t0
                name = stage_name(row)
                t1 = time.perf_counter()
                res = ppl_for_targets([EvalTarget(f"{row}:{act}", "stage", str(wd.root), name)], eval_text,
                                      max_tokens=args.ppl_tokens, window=args.window, device=args.eval_device,
                                      cache=cache)[0]
                summ = st.get("summary", {})
                cell = {"ppl": res["ppl"], "tokens": res["tokens"], "stage": name,
                        "format": fmt, "act_quant": act == "wa", "method": "refine" if kind == "refine" else method,
                        "init": method if kind == "refine" else None, "options": opts,
                        "patterns_changed": patterns_changed(wd, name) if kind == "refine" else None,
                        "stage_seconds": summ.get("stage_seconds"), "compress_seconds": summ.get("compress_seconds"),
                        "e2e": st.get("e2e"),
                        "wall_seconds_this_run": round(t_stage, 1), "eval_seconds": round(time.perf_counter() - t1, 1)}
                if st.get("e2e") and st.get("blockwise"):
                    cell["blockwise"] = blockwise_ppl(wd, name, eval_text, args, cache)
                rows.setdefault(row, {})[act] = cell
                log.info("%s %s (%s): ppl %.3f (stage %s s)", model, row, act, res["ppl"], summ.get("stage_seconds"))
                write_outputs(args.out, stem, meta, rows)


if __name__ == "__main__":
    main()
