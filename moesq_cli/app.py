"""moesq: compress the routed experts of MoE LLMs into hardware-native sparse low-precision formats.

Each command parses options, calls one moesq_core function and renders the result; all the work lives in
moesq_core. Errors that the user can fix are printed as one message with exit code 1 (2 for usage).
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from .progress import RichProgress, console, err_console

app = typer.Typer(
    name="moesq", no_args_is_help=True, rich_markup_mode="rich", pretty_exceptions_enable=False,
    help="Compress the routed experts of Mixture-of-Experts LLMs into hardware-native sparse low-precision "
         "formats (paired 4:8 NVFP4 for Blackwell, 2:4 FP8 for Hopper) and run them.\n\n"
         "Stages: [bold]calibrate[/] → [bold]init-sgptq[/] → [bold]refine[/] → [bold]pack[/] → [bold]verify[/] / "
         "[bold]eval[/]. Every stage writes resumable artifacts to a work dir; [bold]run[/] chains them. "
         "With no --model, the embedded micro-qwen3-moe model and calibration sample are used (offline).\n\n"
         "Exit codes: 0 ok, 1 failed (the error names what and where), 2 usage error (a bad option).",
)


def _version_callback(value: bool):
    if value:
        from moesq_core import __version__

        print(f"moesq {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback, is_eager=True,
                                                          help="Print the moesq version and exit.")] = None):
    pass

# -- shared options -------------------------------------------------------------------------------------------
WorkdirOpt = Annotated[Path, typer.Option("--workdir", "-w", help="Work directory holding this run's artifacts.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Local model dir or Hugging Face id (default: the embedded micro-qwen3-moe).")]
FormatOpt = Annotated[Optional[str], typer.Option("--format", "-f", help="p48-nvfp4 (default) | dense-nvfp4 | s24-fp8.")]
ActQuantOpt = Annotated[Optional[bool], typer.Option("--act-quant/--weights-only",
                                                     help="Quantize activations too (W4A4 / W8A8, default), or weights only.")]
CalibOpt = Annotated[Optional[str], typer.Option(
    "--calib", help="Calibration text: .txt/.txt.xz (blank-line separated), .jsonl ('text'), a dir, or an HF "
                    "dataset 'name[:config][@split]' (default: the embedded sample).")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per calibration sequence (default 512).")]
NTrainOpt = Annotated[Optional[int], typer.Option("--n-train", help="Refinement sequences (default 128).")]
NValOpt = Annotated[Optional[int], typer.Option("--n-val", help="Held-out sequences; refinement picks its best epoch on them (default 16).")]
NInitOpt = Annotated[Optional[int], typer.Option("--n-init", help="Sequences for the one-shot (SGPTQ) stage (default 64).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed for the calibration splits (default 0).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cpu | cuda | cuda:N.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars; only results and errors.")]
RedoOpt = Annotated[Optional[int], typer.Option("--redo-from", help="Recompute this stage from this layer on.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Calibration sequences per forward pass.")]
CacheOpt = Annotated[float, typer.Option("--cache-gb", help="Calibration states kept in memory; the rest spill to the work dir.")]

log = logging.getLogger("moesq")


def _fail(msg: str, code: int = 1):
    err_console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


def _guard(fn):
    """Turn expected failures (bad input, foreign work dir, missing files) into one clear message."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        from moesq_core.models import UnsupportedModelError
        from moesq_core.workdir import WorkDirError

        try:
            return fn(*a, **kw)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except (WorkDirError, UnsupportedModelError, FileNotFoundError, FileExistsError, ValueError, RuntimeError) as e:
            log.info("failed: %s: %s", type(e).__name__, e)  # to the work-dir log; the user sees _fail's line
            _fail(str(e))

    return wrapper


def _setup(workdir: Path | None, quiet: bool):
    from transformers.utils import logging as hf_logging

    from moesq_core.workdir import setup_logging

    hf_logging.disable_progress_bar()  # moesq shows its own progress; per-load weight bars are noise

    setup_logging(workdir if workdir and workdir.exists() else None, quiet)
    if workdir is not None:
        log.info("moesq %s", " ".join(sys.argv[1:]))


def _given(fmt, act_quant, calib, seq_len, n_train, n_val, n_init, seed) -> dict:
    """The work-dir–level options the user actually gave (None = not given)."""
    return {k: v for k, v in dict(format=fmt, act_quant=act_quant, calib_source=calib, seq_len=seq_len,
                                  n_train=n_train, n_val=n_val, n_init=n_init, seed=seed).items() if v is not None}


def _run_config(given: dict, **defaults):
    """RunConfig from the given options over the defaults (a command may have its own, e.g. `run`)."""
    from moesq_core.calibration import CalibConfig
    from moesq_core.pipeline import DEFAULT_CALIB, RunConfig

    opts = {**defaults, **given}
    calib_keys = ("seq_len", "n_train", "n_val", "n_init", "seed")
    return RunConfig(format=opts.get("format", "p48-nvfp4"), act_quant=opts.get("act_quant", True),
                     calib_source=str(opts.get("calib_source", DEFAULT_CALIB)),
                     calib=CalibConfig(**{k: opts[k] for k in calib_keys if k in opts}))


def _ensure_calibrated(workdir, model, given: dict, progress, **defaults):
    """Open the work dir, creating and calibrating it when new. Options given for an existing work dir must
    match what it was made with (they are refused otherwise, naming the differences)."""
    from moesq_core.pipeline import DEFAULT_MODEL, calibrate
    from moesq_core.workdir import WorkDir, WorkDirError, setup_logging

    wd = WorkDir(workdir)
    if wd.exists():
        recorded = wd.load()["config"]
        flat = {**{k: v for k, v in recorded.items() if k != "calib"}, **recorded.get("calib", {})}
        diffs = [f"{k}: {flat.get(k)!r} (work dir) vs {v!r} (now)" for k, v in given.items()
                 if str(flat.get(k)) != str(v)]
        if diffs:
            raise WorkDirError(f"{workdir} was made with other settings:\n  " + "\n  ".join(diffs)
                               + "\nUse another --workdir, or leave these options out to use the work dir's.")
        if model is None:
            return wd
        cfg = _run_config({**flat, **given})
    else:
        cfg = _run_config(given, **defaults)
    info = calibrate(wd, model or DEFAULT_MODEL, cfg, progress)
    setup_logging(workdir, progress.quiet)
    log.info("calibration ready: %s", info)
    return wd


# -- commands ---------------------------------------------------------------------------------------------------
@app.command()
@_guard
def calibrate(
    model: ModelOpt = None, workdir: WorkdirOpt = Path("moesq-work"), format: FormatOpt = None,
    act_quant: ActQuantOpt = None, calib: CalibOpt = None, seq_len: SeqLenOpt = None, n_train: NTrainOpt = None,
    n_val: NValOpt = None, n_init: NInitOpt = None, seed: SeedOpt = None, quiet: QuietOpt = False,
):
    """Create a work dir for a model + format and build its calibration set (seeded train / val / init splits).

    Re-running with the same settings is a no-op; other settings on an existing work dir are refused.
    """
    _setup(workdir, quiet)
    from moesq_core.pipeline import DEFAULT_MODEL

    given = _given(format, act_quant, calib, seq_len, n_train, n_val, n_init, seed)
    with RichProgress(quiet) as p:
        wd = _ensure_calibrated(workdir, model or DEFAULT_MODEL, given, p)
    info = wd.load()["calibration"]
    console.print(f"calibration: {info['sequences']} sequences of {info['seq_len']} tokens → {workdir / info['file']}")


def _method_options(method, percdamp, hessian_weighting, exact_scales):
    opts = {}
    if method in ("sgptq", "gptq", "obr"):
        opts["percdamp"] = percdamp
        opts["hessian_weighting"] = hessian_weighting
    if method in ("sgptq", "gptq"):
        opts["exact_scales"] = exact_scales
    return opts


@app.command("init-sgptq")
@_guard
def init_sgptq(
    model: ModelOpt = None, workdir: WorkdirOpt = Path("moesq-work"),
    method: Annotated[str, typer.Option(help="sgptq | gptq | obr | jsq | wanda | rtn | magnitude.")] = "sgptq",
    percdamp: Annotated[float, typer.Option(help="Hessian damping as a fraction of mean(diag H).")] = 0.01,
    hessian_weighting: Annotated[str, typer.Option(help="Router weighting of the Hessian: none | w | w2.")] = "none",
    exact_scales: Annotated[bool, typer.Option("--exact-scales/--fp32-scales",
                                               help="GPTQ with the final E4M3 block scales (export-exact) or fp32 scales projected afterwards.")] = True,
    format: FormatOpt = None, act_quant: ActQuantOpt = None, calib: CalibOpt = None,
    seq_len: SeqLenOpt = None, n_train: NTrainOpt = None, n_val: NValOpt = None, n_init: NInitOpt = None, seed: SeedOpt = None,
    device: DeviceOpt = "auto", batch_size: BatchOpt = 8, redo_from: RedoOpt = None, cache_gb: CacheOpt = 4.0,
    quiet: QuietOpt = False,
):
    """One-shot compression of every routed expert, block by block (SparseGPT+GPTQ by default).

    Writes stage [bold]init-<method>[/]; calibrates first if the work dir has no calibration yet.
    """
    _setup(workdir, quiet)
    from moesq_core.pipeline import compress

    given = _given(format, act_quant, calib, seq_len, n_train, n_val, n_init, seed)
    with RichProgress(quiet) as p:
        wd = _ensure_calibrated(workdir, model, given, p)
        summary = compress(wd, method, _method_options(method, percdamp, hessian_weighting, exact_scales),
                           device=device, batch_size=batch_size, redo_from=redo_from, progress=p, cache_limit_gb=cache_gb)
    console.print(f"stage init-{method}: {summary['blocks']} blocks ({summary['computed_now']} computed now) in {workdir}")


@app.command()
@_guard
def refine(
    model: ModelOpt = None, workdir: WorkdirOpt = Path("moesq-work"),
    epochs: Annotated[int, typer.Option(help="Passes over the training tokens per block.")] = 10,
    steps_per_epoch: Annotated[Optional[int], typer.Option(help="Optimizer steps per epoch (default: from --batch-rows if given, else the paper's 128; capped so each expert averages ≥ 8 rows per step).")] = None,
    batch_rows: Annotated[Optional[int], typer.Option(help="Routed token rows per optimizer step over the block (the paper's: 2097152); derives the steps per epoch, at least 16.")] = None,
    micro_batch_rows: Annotated[int, typer.Option(help="Rows per forward/backward (memory bound).")] = 8 * 4096 * 8,
    lr_logits: Annotated[float, typer.Option(help="Lion learning rate of the pattern logits A.")] = 2.5e-4,
    lr_values: Annotated[float, typer.Option(help="Lion learning rate of the latent weights V.")] = 5e-5,
    loss_power: Annotated[int, typer.Option(help="Token weight w^p in the loss: 0 uniform, 1 paper, 2 release.")] = 2,
    values_only: Annotated[bool, typer.Option(help="Ablation: keep the init's support, learn values only.")] = False,
    support_only: Annotated[bool, typer.Option(help="Ablation: learn the support only, values stay.")] = False,
    refine_seed: Annotated[int, typer.Option(help="Seed of the Gumbel noise and the init of A.")] = 0,
    stage: Annotated[str, typer.Option(help="Stage name to write (e.g. refine-p0 for an ablation).")] = "refine",
    init: Annotated[str, typer.Option(help="Init method whose stage refinement starts from.")] = "sgptq",
    format: FormatOpt = None, act_quant: ActQuantOpt = None, calib: CalibOpt = None,
    seq_len: SeqLenOpt = None, n_train: NTrainOpt = None, n_val: NValOpt = None, n_init: NInitOpt = None, seed: SeedOpt = None,
    device: DeviceOpt = "auto", batch_size: BatchOpt = 8, redo_from: RedoOpt = None, cache_gb: CacheOpt = 4.0,
    quiet: QuietOpt = False,
):
    """Learn each expert's sparsity pattern jointly with its quantized values (the moesq algorithm).

    Gumbel-softmax over the format's patterns, a latent fp32 weight copy, straight-through quantization and a
    router-weighted reconstruction loss, block by block on the compressed prefix. Starts from stage
    init-<init> (run first if missing); ships each block's best validation epoch.
    """
    _setup(workdir, quiet)
    from moesq_core.pipeline import compress, refine as core_refine

    if values_only and support_only:
        _fail("--values-only and --support-only exclude each other", 2)
    given = _given(format, act_quant, calib, seq_len, n_train, n_val, n_init, seed)
    rcfg = dict(epochs=epochs, steps_per_epoch=steps_per_epoch, batch_rows=batch_rows, micro_batch_rows=micro_batch_rows,
                lr_logits=lr_logits, lr_values=lr_values, loss_power=loss_power, train_support=not values_only,
                train_values=not support_only, seed=refine_seed)
    with RichProgress(quiet) as p:
        wd = _ensure_calibrated(workdir, model, given, p)
        compress(wd, init, {}, device=device, batch_size=batch_size, progress=p, cache_limit_gb=cache_gb)
        summary = core_refine(wd, rcfg, init=init, device=device, batch_size=batch_size, redo_from=redo_from,
                              progress=p, stage=stage, cache_limit_gb=cache_gb)
    console.print(f"stage {stage}: {summary['blocks']} blocks ({summary['computed_now']} computed now) in {workdir}")


JsonOpt = Annotated[Optional[Path], typer.Option(
    "--json", help="Also write the result as JSON to this file ('-' = stdout, tables then go to stderr); "
                   "schema in the README (JSON output).")]


def _write_json(path: Path | None, doc: dict) -> None:
    if path is None:
        return
    text = json.dumps(doc, indent=2, default=str) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    err_console.print(f"results → {path}")


def _out_console(json_out: Path | None):
    """Where tables go: stdout, or stderr when stdout carries the JSON."""
    return err_console if json_out is not None and str(json_out) == "-" else console


@app.command()
@_guard
def pack(
    workdir: Annotated[Path, typer.Argument(help="Work dir with a finished stage.")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output model dir (default: WORKDIR/packed). "
                                                "Never the work dir, the source model, or a dir holding anything but an earlier moesq pack.")] = None,
    stage: Annotated[Optional[str], typer.Option(help="Stage to pack (default: refine if finished, else the last).")] = None,
    dense_layout: Annotated[bool, typer.Option(help="Store p48 weights densely (pruned bytes zero) instead of the sparse layout.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an earlier moesq pack in --out (atomically; nothing else is ever replaced).")] = False,
    max_shard_size: Annotated[str, typer.Option(help="Largest weight shard (e.g. 5GB, 500MB); more than one shard gets model.safetensors.index.json.")] = "5GB",
    push_to_hub: Annotated[Optional[str], typer.Option("--push-to-hub", help="Upload to this Hub repo (created if missing).")] = None,
    private: Annotated[bool, typer.Option(help="Make the Hub repo private (also an existing one).")] = False,
    json_out: JsonOpt = None,
    quiet: QuietOpt = False,
):
    """Write a Hugging Face–style model dir: compressed-tensors config, packed experts, untouched other weights,
    tokenizer, model card and a checksum manifest (moesq_pack.json); optionally push it to the Hub.

    Example: [bold]moesq pack moesq-work --out packed-model --overwrite[/]
    """
    _setup(workdir, quiet)
    from moesq_core.checkpoint.export import check_output_dir, export_packed, parse_size, push_to_hub as core_push
    from moesq_core.pipeline import default_stage
    from moesq_core.workdir import WorkDir

    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        _fail(str(e), 2)
    if push_to_hub is not None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(push_to_hub)
        except HFValidationError as e:
            _fail(f"--push-to-hub {push_to_hub!r}: not a Hub repo id ({e})", 2)
    wd = WorkDir(workdir)
    stage = stage or default_stage(wd)
    out = out or workdir / "packed"
    check_output_dir(out, workdir, Path(wd.load()["model"]["path"]), overwrite)  # before any progress is shown
    ppl = _known_ppl(workdir, stage)
    n_blocks = len(wd.stage(stage)["blocks"]) if wd.stage(stage) else 0
    with RichProgress(quiet) as p, p.task(f"pack {stage}", n_blocks) as t:
        summary = export_packed(wd, stage, out, overwrite=overwrite, sparse_layout=not dense_layout, ppl=ppl,
                                max_shard_bytes=max_bytes, progress=t.advance)
    doc = {"schema": "moesq.pack/1", **summary, "hub": None}
    con = _out_console(json_out)
    con.print(f"packed {stage} → {out}: {summary['bits_per_weight']:.3f} bits/weight over "
              f"{summary['expert_weights']:,} expert weights, {summary['shards']} shard(s)")
    if summary["input_scale_fallbacks"]:
        con.print(f"[yellow]note:[/] {summary['input_scale_fallbacks']} expert linears saw no calibration token; "
                  "their input global scale is the layer's calibrated one")
    if push_to_hub:
        try:
            doc["hub"] = core_push(out, push_to_hub, private=private)
        except RuntimeError as e:
            doc["hub"] = {"repo": push_to_hub, "error": str(e)}
            _write_json(json_out, doc)
            raise
        con.print(f"pushed to {doc['hub']['url']}" + "".join(f" ({n})" for n in doc["hub"]["notes"]))
    _write_json(json_out, doc)


def _known_ppl(workdir: Path, stage: str) -> dict | None:
    path = workdir / "eval" / "results.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text())
    got = {r["label"]: r["ppl"] for r in rows.values() if r.get("kind") in ("reference", "stage") and
           (r.get("kind") == "reference" or r.get("stage") == stage)}
    return got or None


@app.command()
@_guard
def verify(
    path: Annotated[Path, typer.Argument(help="Packed model dir written by `moesq pack`.")],
    kernel: Annotated[bool, typer.Option(help="Also run every packed s24-fp8 expert through the Hopper kernel.")] = False,
    show: Annotated[int, typer.Option(help="Rows of the per-tensor table to print (0 = all).")] = 12,
    checksums_only: Annotated[bool, typer.Option(help="Only check the files against moesq_pack.json (fast).")] = False,
    json_out: JsonOpt = None,
    quiet: QuietOpt = False,
):
    """Check a packed dir: first every file against the sha256 checksums in moesq_pack.json (naming the file and
    the tensor whose bytes changed), then every packed expert tensor: admissible sparsity, finite positive
    scales (input global scales included), gate/up sharing one global scale, shapes, bits per weight, config
    markers. Exits 1 naming the first bad tensor.

    Example: [bold]moesq verify moesq-work/packed[/]
    """
    from moesq_core.checkpoint.verify import verify_packed_dir

    console = _out_console(json_out)
    with RichProgress(quiet) as p:
        report = verify_packed_dir(path, progress=p, checksums_only=checksums_only)
    doc = report.to_dict()
    table = Table(title=f"moesq verify {path}")
    for c in ("tensor", "shape", "layout", "bits/weight", "status"):
        table.add_column(c)
    rows = report.rows if show == 0 else report.rows[:show]
    for r in rows:
        table.add_row(r.name, "×".join(map(str, r.shape)), r.format,
                      "" if r.bits_per_weight is None else f"{r.bits_per_weight:.3f}",
                      "[green]ok[/]" if r.ok else f"[red]{r.status}[/]")
    console.print(table)
    if show and len(report.rows) > show:
        console.print(f"… {len(report.rows) - show} more rows (--show 0 prints all)")
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    bpw = report.bits_per_weight
    sums = {"ok": f"checksums ok ({report.checksum_files} files)", "failed": "checksums FAILED",
            "absent": "no checksum manifest"}[report.checksums]
    console.print(f"{sums}; {report.num_linears} expert linears, format {report.format}, "
                  f"{'' if bpw is None else f'{bpw:.3f} bits/weight, '}{len(report.errors)} error(s)")
    if not report.ok:
        _write_json(json_out, doc)
        _fail(f"first bad tensor: {report.first_error}")
    if kernel:
        try:
            from moesq_core.kernels.verify_kernel import kernel_check_packed_dir
        except ImportError as e:
            _fail(f"the native kernel check is not available in this build ({e})")
        results = kernel_check_packed_dir(path)
        bad = [r for r in results if not r[2]]
        doc["kernel"] = [{"expert": r[0], "max_abs_err": r[1], "ok": bool(r[2])} for r in results]
        doc["ok"] = not bad
        console.print(f"kernel check: {len(results) - len(bad)}/{len(results)} experts match the reference")
        if bad:
            _write_json(json_out, doc)
            _fail(f"kernel mismatch on {bad[0][0]} (max abs err {bad[0][1]:.3g})")
    _write_json(json_out, doc)
    console.print("[green]verify: ok[/]")


@app.command("bench-kernel")
@_guard
def bench_kernel(
    format: Annotated[str, typer.Option("--format", "-f", help="s24-fp8 (CUTLASS 2:4) or p48-nvfp4 (packed streaming).")] = "s24-fp8",
    G: Annotated[Optional[list[int]], typer.Option("--G", help="Experts per grouped GEMM (repeatable).")] = None,
    N: Annotated[Optional[list[int]], typer.Option("--N", help="Tokens per expert, max of {N,3N/4,N/2,N/4} (repeatable).")] = None,
    M: Annotated[Optional[int], typer.Option("--M", help="Custom output features (with --K).")] = None,
    K: Annotated[Optional[int], typer.Option("--K", help="Custom input features (with --M).")] = None,
    repeats: Annotated[int, typer.Option(help="CUDA-graph replays per timing (median reported).")] = 50,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for JSON, Markdown and PNG results.")] = Path("bench-results"),
    e2e: Annotated[bool, typer.Option(help="End-to-end decode benchmark instead of kernel sweeps (p48).")] = False,
    json_out: JsonOpt = None,
):
    """Time the grouped sparse GEMMs against torch's bf16/fp8 grouped GEMMs and cuSPARSELt (same process,
    CUDA-graph replay). Default shapes: the paper's Table 8 (Qwen3-30B-A3B and Kimi-K2.5 experts)."""
    import torch

    if not torch.cuda.is_available():
        _fail("bench-kernel needs a CUDA GPU (Hopper sm_90 for the native kernels); none is visible")
    if (M is None) != (K is None):
        _fail("--M and --K go together", 2)
    shapes = [(M, K)] if M is not None else None
    if e2e:
        import runpy

        sys.argv = ["e2e_decode_bench", "--out", str(out)]
        runpy.run_module("moesq_core.bench.e2e_decode", run_name="__main__", alter_sys=True)
        return
    from moesq_core.bench.kernel_bench import bench_kernel as core_bench

    result = core_bench(format, shapes, G or [8, 32, 128, 384], N or [16, 64, 128, 256, 1024], out, repeats)
    _out_console(json_out).print(f"results written to {out} ({len(result.get('rows', []))} rows)")
    _write_json(json_out, {"schema": "moesq.bench-kernel/1", "format": format, "out": str(out), **result})


@app.command()
@_guard
def generate(
    path: Annotated[Path, typer.Argument(help="Packed model dir written by `moesq pack` (any format).")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue (or the user message with --chat).")],
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = False,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples (seeded by --seed).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16 for the non-expert weights.")] = "float32",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N (auto: the GPU when there is one; on "
                                              "sm_90 packed p48 experts run through the fast Hopper module).")] = "auto",
    json_out: JsonOpt = None,
    quiet: QuietOpt = False,
):
    """Load a packed checkpoint through load_packed and generate text: the first thing to try with a compressed model.

    Example: [bold]moesq generate moesq-work/packed --prompt "The capital of France is" --max-new-tokens 16[/]
    """
    _setup(None, quiet)
    from moesq_core.checkpoint.generate import DTYPES, generate_text

    if max_new_tokens < 1:
        _fail(f"--max-new-tokens must be at least 1, got {max_new_tokens}", 2)
    if temperature < 0:
        _fail(f"--temperature must be >= 0, got {temperature}", 2)
    if dtype not in DTYPES:
        _fail(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}", 2)

    with RichProgress(quiet) as p:
        doc = generate_text(path, prompt, max_new_tokens=max_new_tokens, device=device, dtype=dtype, chat=chat,
                            temperature=temperature, seed=seed, progress=p)
    con = _out_console(json_out)
    con.print(f"[dim]{doc['format']} on {doc['device']} ({', '.join(doc['experts_module'])}), loaded in "
              f"{doc['load_seconds']:.1f} s, {doc['tokens_per_second']} tokens/s[/]", highlight=False)
    from rich.text import Text

    con.print(Text.assemble((doc["prompt"], "bold"), doc["completion"]))  # Text: no markup in user text
    _write_json(json_out, doc)


@app.command("eval")
@_guard
def eval_cmd(
    targets: Annotated[Optional[list[str]], typer.Argument(help="Work dirs (reference + finished stages), packed dirs or model dirs.")] = None,
    ppl: Annotated[Optional[Path], typer.Option("--ppl", help="Text file for perplexity (.txt/.txt.xz).")] = None,
    ppl_tokens: Annotated[int, typer.Option(help="Evaluate the first N tokens of --ppl.")] = 65536,
    window: Annotated[int, typer.Option(help="Perplexity window (non-overlapping).")] = 512,
    stages: Annotated[Optional[list[str]], typer.Option("--stage", help="Only these stages of a work dir (repeatable).")] = None,
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="lm-eval tasks, comma-separated, or a preset (openllm-v1); moesq_cloze is the shipped offline task.")] = None,
    tasks_dir: Annotated[Optional[Path], typer.Option(help="Directory of extra task YAMLs with local data.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="lm-eval: examples per task.")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option(help="lm-eval: override the shots.")] = None,
    batch_size: Annotated[int, typer.Option(help="lm-eval batch size.")] = 8,
    eval_seed: Annotated[int, typer.Option("--eval-seed", help="lm-eval seed.")] = 1234,
    json_out: JsonOpt = None,
    device: DeviceOpt = "cpu", quiet: QuietOpt = False,
):
    """Perplexity and/or lm-eval task accuracy for reference, fake-quantized (work dir stages) and packed models,
    side by side in one table. Results are cached in the first work dir, so re-runs and resumes are instant."""
    _setup(None, quiet)
    from moesq_core.eval.runner import ResultCache, ppl_for_targets, resolve_targets
    from moesq_core.pipeline import DEFAULT_EVAL

    targets = targets or ["moesq-work"]
    if ppl is None and tasks is None:
        ppl = DEFAULT_EVAL
    resolved = resolve_targets(targets, stages)
    wd = next((Path(t) for t in targets if (Path(t) / "manifest.json").is_file()), None)
    cache = ResultCache(wd / "eval" / "results.json" if wd else None)
    out = {"schema": "moesq.eval/1", "ppl": None, "tasks": None}
    console = _out_console(json_out)
    with RichProgress(quiet) as p:
        if ppl is not None:
            rows = ppl_for_targets(resolved, ppl, max_tokens=ppl_tokens, window=window, device=device, cache=cache, progress=p)
            out["ppl"] = rows
        if tasks is not None:
            out["tasks"] = _run_tasks(resolved, tasks, tasks_dir, limit, num_fewshot, batch_size, eval_seed, device,
                                      wd / "eval" / "lm_eval" if wd else None, p, console)
    if out["ppl"]:
        ref = next((r["ppl"] for r in out["ppl"] if r["kind"] == "reference"), None)
        table = Table(title=f"perplexity — {Path(str(ppl)).name}, {out['ppl'][0]['tokens']:,} tokens, window {window}")
        for c in ("model", "kind", "perplexity", "× reference"):
            table.add_column(c, justify="right" if c != "model" else "left")
        for r in out["ppl"]:
            table.add_row(r["label"], r["kind"], f"{r['ppl']:.3f}", "" if not ref else f"{r['ppl'] / ref:.3f}")
        console.print(table)
    _write_json(json_out, out)


def _run_tasks(resolved, tasks, tasks_dir, limit, num_fewshot, batch_size, seed, device, cache_dir, progress, con=console):
    try:
        from moesq_core.eval.lm_eval_tasks import evaluate_tasks
        from moesq_core.eval.recovery import recovery_table
    except ImportError as e:
        _fail(f"lm-eval support needs the 'eval' extra: pip install 'moesq[eval]' ({e})")
    from moesq_core.eval.runner import load_target, target_identity

    results = []
    for t in resolved:
        model, tok = load_target(t, device, progress=progress)
        if tok is None:
            _fail(f"{t.path} has no tokenizer files; lm-eval needs one")
        with _TaskBars(progress, t.label) as bars:
            results.append(evaluate_tasks(model, tok, tasks, label=t.label, tasks_dir=tasks_dir, limit=limit,
                                          num_fewshot=num_fewshot, batch_size=batch_size, seed=seed,
                                          cache_dir=cache_dir, progress=bars, model_id=target_identity(t)))
        del model
    ref = next((t.label for t in resolved if t.kind == "reference"), resolved[0].label)
    table = recovery_table(results, ref)
    _render_recovery(table, con)
    return {"results": [r.to_dict() for r in results], "table": table.to_dict()}


class _TaskBars:
    """Turns lm-eval progress events into one rich bar per task (requests done / total)."""

    def __init__(self, progress, label):
        self.progress, self.label, self.ctx, self.bar, self.done = progress, label, None, None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._close()

    def _close(self):
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
            self.ctx = None

    def __call__(self, ev):
        if ev.kind == "requests":
            if self.ctx is None:
                self.ctx = self.progress.task(f"lm-eval {self.label}: {ev.task} ({ev.request_type})", ev.total)
                self.bar, self.done = self.ctx.__enter__(), 0
            self.bar.advance(ev.done - self.done)
            self.done = ev.done
        elif ev.kind in ("task_done", "task_cached"):
            self._close()


def _render_recovery(table, console=console) -> None:
    t = Table(title=f"lm-eval accuracy (%), recovery vs {table.reference}")
    t.add_column("model")
    for c in table.tasks:
        t.add_column(f"{c} ({table.metrics.get(c, '')})", justify="right")
    t.add_column("average", justify="right")
    t.add_column("recovery %", justify="right")
    pct = lambda v: "" if v is None else f"{100 * v:.2f}"
    for row in table.rows:
        t.add_row(row.label, *[pct(row.scores.get(c)) for c in table.tasks], pct(row.average),
                  "" if row.recovery is None else f"{row.recovery:.2f}")
    console.print(t)
    for w in table.warnings:
        console.print(f"[yellow]warning:[/] {w}")


@app.command()
@_guard
def run(
    model: ModelOpt = None, workdir: WorkdirOpt = Path("moesq-work"), format: FormatOpt = None,
    act_quant: ActQuantOpt = None, calib: CalibOpt = None,
    ppl: Annotated[Optional[Path], typer.Option("--ppl", help="Evaluation text (default: the embedded sample).")] = None,
    ppl_tokens: Annotated[int, typer.Option(help="Evaluate the first N tokens.")] = 65536,
    method: Annotated[str, typer.Option(help="One-shot init method.")] = "sgptq",
    baselines: Annotated[str, typer.Option(help="Extra one-shot baselines to compare, comma-separated ('' for none). "
                                                "On sparse formats rtn and magnitude are the same weights.")] = "magnitude",
    refine_stage: Annotated[bool, typer.Option("--refine/--no-refine", help="Run refinement after the init.")] = True,
    epochs: Annotated[int, typer.Option(help="Refinement epochs.")] = 2,
    steps_per_epoch: Annotated[int, typer.Option(help="Refinement optimizer steps per epoch.")] = 8,
    seq_len: SeqLenOpt = None, n_train: NTrainOpt = None, n_val: NValOpt = None, n_init: NInitOpt = None,
    seed: SeedOpt = None, device: DeviceOpt = "auto", quiet: QuietOpt = False,
):
    """Everything in one go: calibrate → baselines → init → refine → pack → verify → perplexity table.

    With no options it compresses the embedded micro-qwen3-moe model offline on a CPU in minutes. Defaults
    here are a small budget; use the stage commands for the paper's settings.
    """
    _setup(workdir, quiet)
    from moesq_core.checkpoint.export import export_packed
    from moesq_core.checkpoint.verify import verify_packed_dir
    from moesq_core.eval.runner import ResultCache, ppl_for_targets, resolve_targets
    from moesq_core.pipeline import DEFAULT_EVAL, compress, refine as core_refine

    given = _given(format, act_quant, calib, seq_len, n_train, n_val, n_init, seed)
    base = [b for b in baselines.split(",") if b and b != method]
    with RichProgress(quiet) as p:
        # a small default budget: 256-token sequences, 64 for the one-shot stage, 64 + 8 for refinement
        wd = _ensure_calibrated(workdir, model, given, p, seq_len=256, n_train=64, n_val=8, n_init=64)
        cfg = wd.load()["config"]
        for b in base:
            compress(wd, b, {}, device=device, progress=p)
        compress(wd, method, {}, device=device, progress=p)
        stage = f"init-{method}"
        if refine_stage:
            core_refine(wd, dict(epochs=epochs, steps_per_epoch=steps_per_epoch), init=method, device=device, progress=p)
            stage = "refine"
        out = workdir / "packed"
        with p.task(f"pack {stage}", None):
            export_packed(wd, stage, out, overwrite=True)
        report = verify_packed_dir(out)
        if not report.ok:
            _fail(f"verify failed on the packed model: {report.first_error}")
        targets = resolve_targets([str(workdir), str(out)])
        rows = ppl_for_targets(targets, ppl or DEFAULT_EVAL, max_tokens=ppl_tokens, device="cpu",
                               cache=ResultCache(workdir / "eval" / "results.json"), progress=p)
    ref = next(r["ppl"] for r in rows if r["kind"] == "reference")
    fmt_name, aq = cfg["format"], cfg["act_quant"]
    table = Table(title=f"moesq run — {fmt_name}{(' W4A4' if 'nvfp4' in fmt_name else ' W8A8') if aq else ' weights only'}, perplexity on "
                        f"{rows[0]['tokens']:,} tokens")
    for c in ("model", "perplexity", "× reference"):
        table.add_column(c, justify="left" if c == "model" else "right")
    for r in rows:
        table.add_row(r["label"], f"{r['ppl']:.3f}", f"{r['ppl'] / ref:.3f}")
    console.print(table)
    console.print(f"verify: ok ({report.bits_per_weight:.3f} bits/weight); packed model in {out}")
    (workdir / "eval").mkdir(exist_ok=True)
    (workdir / "eval" / "run_table.json").write_text(json.dumps(rows, indent=2))


def main():
    app()


if __name__ == "__main__":
    main()
