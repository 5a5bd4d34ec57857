"""moesq: compress the routed experts of MoE LLMs into hardware-native sparse low-precision formats.

Each command parses options, calls one moesq_core function and renders the result; all the work lives in
moesq_core. Errors that the user can fix are printed as one line: exit code 2 for a bad option (named), 1 for
a failure. The traceback of any error goes to the work dir's log (and to the screen with `moesq --debug`).
SIGINT / SIGTERM print what was saved and how to resume, and exit 130 / 143.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.markup import escape
from rich.table import Table

from moesq_cli import command_started
from moesq_cli.progress_display import RichProgress, console, err_console
from moesq_cli.settings import COMMAND_KEYS, as_given, config_params, key_paths, settings_panel, with_config_options
from moesq_cli.settings import source_defaults as _source_defaults  # noqa: F401  (a test checks it against the objects)

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
        from moesq_core.version import __version__

        print(f"moesq {__version__}")
        raise typer.Exit()


def _arg_default(name: str):
    """A stage function's default (moesq_core.compression.pipeline.run_refine's), for --help."""
    return _source_defaults("moesq_core.compression.pipeline", "run_refine")[name]


def _stage_kw(batch_size, cache_gb) -> dict:
    """The stage functions' run options that were given (the others keep the library's defaults)."""
    return {k: v for k, v in (("batch_size", batch_size), ("cache_limit_gb", cache_gb)) if v is not None}


_DEBUG = False  # `moesq --debug ...`: tracebacks on screen too


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Print the traceback of an error (it is always in the "
                                                               "work dir's log).")] = False,
          version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback, is_eager=True,
                                                          help="Print the moesq version and exit.")] = None):
    global _DEBUG
    _DEBUG = debug


# -- option validation (usage errors exit 2, naming the option) ------------------------------------------------
def _usage_error_on(value, check, errors):
    """value, once check(value) passed (None is not checked); an error of the types `errors` is a usage error."""
    if value is not None:
        try:
            check(value)
        except errors as e:
            raise typer.BadParameter(str(e)) from None
    return value


def _check_workdir(value: Path | None) -> Path | None:
    from moesq_core.compression.workdir import WorkDirError, check_location

    return _usage_error_on(value, check_location, WorkDirError)


def _check_model(value: str | None) -> str | None:
    """A --model that is neither a local model dir nor a Hub id is refused before torch is imported."""
    from moesq_core.paths import model_dir_or_hub_id

    return _usage_error_on(value, model_dir_or_hub_id, FileNotFoundError)


def _packed_dir(value: Path) -> Path:
    """A packed dir argument: an earlier pack that a pack killed mid-swap left aside is put back first; a path
    that is no directory is refused before torch is imported."""
    from moesq_core.compression.pack_swap import restore_interrupted_swap

    restore_interrupted_swap(value)
    if not value.is_dir():
        raise typer.BadParameter(f"{value}: no such directory")
    return value


def _check_device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise typer.BadParameter(f"{value!r} is not one of auto, cpu, cuda, cuda:N")
    return value


def _finite_float(lo: float, *, above: bool):
    """The check of a float option: finite and > lo (above) or >= lo. Integer options use typer's min/max;
    click's float ranges let nan and inf through (nan compares false, inf passes a lower bound)."""
    def check(value):
        if value is not None and not (math.isfinite(value) and (value > lo if above else value >= lo)):
            raise typer.BadParameter(f"must be {'>' if above else '>='} {lo:g} and finite, got {value}")
        return value
    return check


_non_negative_float = _finite_float(0, above=False)


def _stage_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
        raise typer.BadParameter(f"{value!r}: a stage name is letters, digits, '.', '_' and '-'")
    return value


# -- shared options -------------------------------------------------------------------------------------------
WorkdirOpt = Annotated[Path, typer.Option("--workdir", "-w", callback=_check_workdir,
                                          help="Work directory holding this run's artifacts.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", callback=_check_model, is_eager=True,
    help="Local model dir or Hugging Face id (default: the embedded micro-qwen3-moe).")]
DeviceOpt = Annotated[str, typer.Option("--device", callback=_check_device, help="auto | cpu | cuda | cuda:N.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars; only results and errors.")]
HiddenNoVerifyOpt = Annotated[bool, typer.Option("--no-verify", hidden=True, help="Load a packed dir without checking "
                                                  "its files against moesq_pack.json (the log says so).")]
# options a stage's Options panel does not show (it lists ten at most): its More options panel lists them
RedoOpt = Annotated[Optional[int], typer.Option("--redo-from", min=0, hidden=True,
                                                help="Recompute this stage from this layer on.")]
BatchOpt = Annotated[Optional[int], typer.Option(
    "--batch-size", min=1, hidden=True,
    help=f"Calibration sequences per forward pass (default {_arg_default('batch_size')}).")]
CacheOpt = Annotated[Optional[float], typer.Option(
    "--cache-gb", callback=_non_negative_float, hidden=True,
    help="GiB of calibration states kept in host memory; the rest spill to the work dir (default: all of them "
         "while they take at most half the available host memory, else as much as fits that).")]
RecipeOpt = Annotated[Optional[Path], typer.Option(
    "--recipe", help="A recipe: YAML with a config's keys (recipes/*.yaml; the Settings below); the options and "
                     "--set apply over it.")]
NprocOpt = Annotated[int, typer.Option(
    "--nproc", min=1, help="Processes sharing each block's experts (expert parallel): one per GPU, or CPU "
                           "processes with --device cpu; started under torchrun.")]
JsonOpt = Annotated[Optional[Path], typer.Option(
    "--json", help="Also write the result as JSON to this file ('-' = stdout, tables then go to stderr); "
                   "its schema (keys per command): docs/workdir.md#json-output.")]


def _produced() -> dict:
    """Where a --json result came from, so a results file can be traced to the code and the day."""
    import datetime

    from moesq_core.serving.bench.harness import git_commit
    from moesq_core.version import __version__

    return {"moesq": __version__, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _missing_as_null(obj):
    """A --json document with every non-finite float (a number that could not be computed, e.g. the
    perplexity of a diverged model) as null: JSON has no NaN or Infinity."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _missing_as_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_missing_as_null(v) for v in obj]
    return obj


def _write_json(path: Path | None, doc: dict) -> None:
    if path is None:
        return
    doc = _missing_as_null({**doc, "produced": _produced()})
    text = json.dumps(doc, indent=2, default=str, allow_nan=False) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    err_console.print(f"results → {path}")


def _out_console(json_out: Path | None):
    """Where tables go: stdout, or stderr when stdout carries the JSON."""
    return err_console if json_out is not None and str(json_out) == "-" else console

log = logging.getLogger("moesq")


def _rank() -> int:
    from moesq_core.compression.distributed import launched_rank

    return launched_rank()


def _fail(msg: str, code: int = 1):
    rank = _rank()
    if code == 2 and rank != 0:  # under torchrun every rank validates the same options; rank 0 says it
        raise typer.Exit(code)
    err_console.print(f"[bold red]error:[/] {f'rank {rank}: ' if rank else ''}{escape(msg)}", highlight=False,
                      soft_wrap=True)
    raise typer.Exit(code)


def _progress(quiet: bool):
    """Progress bars and notes; under torchrun only rank 0 shows them (the others log)."""
    from moesq_core.progress import NullProgress

    return RichProgress(quiet) if _rank() == 0 else contextlib.nullcontext(NullProgress())


@contextlib.contextmanager
def _ranks(device: str, nproc: int, workdir: Path):
    """Expert parallel. `--nproc N` (N > 1) runs this same command as N ranks under torchrun and exits with
    their status; under torchrun this process joins the process group. Yields the device to compute on."""
    from moesq_core.compression import distributed

    try:
        distributed.check_launch(nproc, device)
        distributed.rank_device(device)
        distributed.timeout()
    except ValueError as e:
        _fail(str(e), 2)
    if nproc > 1:
        code, error = distributed.launch(nproc, distributed.without_option(sys.argv[1:], "--nproc"))
        if error:
            _fail(f"{error}; {_saved_state(workdir)}")
        raise typer.Exit(code)
    with distributed.process_group(device) as dev:
        yield dev


class _Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that `except Exception` blocks do not swallow it."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def _saved_state(workdir: Path | None) -> str:
    """What an interrupted command left in the work dir, and how to go on (one line)."""
    from moesq_core.compression.workdir import WorkDir, WorkDirError

    if workdir is None or not WorkDir(workdir).exists():
        return "nothing was saved; re-run the command"
    try:
        m = WorkDir(workdir).load()
    except WorkDirError:
        return f"see {workdir}"
    parts = ["calibration" if "calibration" in m else "no calibration yet"]
    for name, st in m.get("stages", {}).items():
        total = st.get("num_blocks")
        parts.append(f"{name} {len(st['blocks'])}{f'/{total}' if total else ''} blocks"
                     f"{' (done)' if st.get('done') else ''}")
    return f"saved in {workdir}: {', '.join(parts)}; re-run the same command to resume"


def _log_traceback(workdir: Path | None) -> Path | None:
    """Write the current exception's traceback to the work dir's log; the log's path (None without one)."""
    from moesq_core.compression.workdir import WorkDirLogHandler

    log.info("traceback:\n%s", traceback.format_exc())
    return next((h.path for h in log.handlers if isinstance(h, WorkDirLogHandler) and h.path), None)


def _interrupt_inside(e: BaseException) -> BaseException | None:
    """The KeyboardInterrupt / SIGTERM an exception was raised from, if any (its cause or context chain)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (KeyboardInterrupt, _Terminated)):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _interrupted(e: BaseException, workdir: Path | None):
    """Report a SIGINT / SIGTERM as one line saying what was saved; exit 130 / 143."""
    from moesq_core.compression.distributed import launched_world

    what = "SIGINT" if isinstance(e, KeyboardInterrupt) else "SIGTERM"
    if what == "SIGTERM" and launched_world() > 1:
        what += " from torchrun: another rank failed, or the run was stopped"
    if _rank() != 0:  # rank 0 says what was saved
        raise typer.Exit(130 if what == "SIGINT" else 143)
    _log_traceback(workdir)
    err_console.print(f"[bold yellow]interrupted ({what}):[/] {_saved_state(workdir)}", highlight=False,
                      soft_wrap=True)
    raise typer.Exit(130 if what.startswith("SIGINT") else 143)


def _guard(fn):
    """Errors as one clear line (exit 1; 2 for a usage error), tracebacks to the log (and the screen with
    --debug); SIGINT / SIGTERM as one line saying what was saved (exit 130 / 143)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        workdir = kw.get("workdir")
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            command_started()
            return fn(*a, **kw)
        except (typer.Exit, typer.Abort, click.exceptions.ClickException):
            raise
        except (KeyboardInterrupt, _Terminated) as e:  # also while the command still imports torch
            _interrupted(e, workdir)
        except Exception as e:
            cause = _interrupt_inside(e)
            if cause is not None:  # a Ctrl-C that a library wrapped (e.g. in a RuntimeError from __set_name__)
                _interrupted(cause, workdir)
            _report(e, workdir)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapper


def _loaded(module: str, name: str):
    """A class of a moesq_core module the command imported, else () (nothing of an unimported module was
    raised): reporting an error does not import torch."""
    return getattr(sys.modules.get(module), name, ())


def _report(e: Exception, workdir: Path | None):
    """A command's error as one line (exit 1): what the user can fix as it is, other OS and runtime errors with
    their type, anything else as unexpected; the traceback goes to the log (and the screen with --debug)."""
    from moesq_core.compression.workdir import DiskWriteError, WorkDirError

    if isinstance(e, _loaded("moesq_core.compression.distributed", "RankZeroFailed")):  # rank 0 printed the error
        _log_traceback(workdir)
        raise typer.Exit(1)
    if isinstance(e, _loaded("moesq_core.models.errors", "CheckpointError")):  # a bad input: exit 2
        _log_traceback(workdir)
        _fail(str(e), 2)
    unsupported = _loaded("moesq_core.models.errors", "UnsupportedModelError")
    clear = (WorkDirError, DiskWriteError, unsupported, FileNotFoundError, FileExistsError, ValueError,
             _loaded("moesq_core.compression.engine", "StageOutOfMemoryError"),
             _loaded("moesq_core.compression.distributed", "PeerFailed"))
    logfile = _log_traceback(workdir)
    if isinstance(e, (WorkDirError, unsupported, FileNotFoundError, FileExistsError, ValueError, RuntimeError,
                      OSError)):
        if _DEBUG:
            traceback.print_exc()
        msg = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.strerror or e}: {e.filename}"
        if not isinstance(e, clear):
            msg = f"{type(e).__name__}: {msg}" + (f" (traceback in {logfile})" if logfile else "")
        _fail(msg)
    if _DEBUG or logfile is None:  # a bug: say so, keep the traceback
        traceback.print_exc()
    _fail(f"unexpected {type(e).__name__}: {e}" + (f" (traceback in {logfile}; --debug prints it)" if logfile else ""))


def _setup(workdir: Path | None, quiet: bool):
    from transformers.utils import logging as hf_logging

    from moesq_core.compression.workdir import setup_logging

    hf_logging.disable_progress_bar()  # moesq shows its own progress; per-load weight bars are noise
    # the log file starts once the work dir exists (see WorkDirLogHandler); under torchrun rank 0 shows warnings
    setup_logging(workdir, quiet or _rank() != 0)
    if workdir is not None:
        log.info("moesq %s", " ".join(sys.argv[1:]))


def _compress_config(settings: list, recipe: Path | None = None, base: dict | None = None):
    """The CompressConfig a command runs: the recipe (else `base`, a config mapping, else the defaults) with
    the settings applied (settings_of's [(key path, value, option or --set)]). Usage errors exit 2, naming the
    option that gave a key. Returns it with the key paths that were given: the settings' and those the recipe
    writes (a key it leaves out is not given: on an existing work dir, the work dir's value stands)."""
    from moesq_core.compression.config import CompressConfig, apply_settings, read_recipe
    from moesq_core.compression.methods.registry import method_options

    if recipe is not None and not recipe.is_file():
        _fail(f"--recipe {recipe}: no such file", 2)
    keys = {k for k, _, _ in settings}
    try:
        if recipe is not None:
            written = read_recipe(recipe)
            base = CompressConfig.from_file(recipe).to_dict()
            keys |= key_paths(written)
        d = apply_settings(base or {}, [(k, v) for k, v, _ in settings])
        init = d.get("init") if isinstance(d.get("init"), dict) else {"method": d.get("init") or "sgptq"}
        method = init.get("method", "sgptq")
        for key, _, given in settings:
            if key.startswith("init.options.") and key.rsplit(".", 1)[1] not in method_options(method):
                by = next((g for k, _, g in reversed(settings) if k == "init.method" and g != "--set"), "method")
                _fail(f"{given if given != '--set' else key} does not apply to {by} {method}", 2)
        cfg = CompressConfig.from_dict(d)
    except ValueError as e:
        _fail(as_given(str(e), settings), 2)
    return cfg, keys


def _run_options(cfg, keys) -> dict:
    """The work-dir–level settings (RunConfig.flat's names) that were given: the others are the work dir's."""
    return {k: v for k, v in cfg.run_config().flat().items() if k in keys or f"calib.{k}" in keys}


def _stage_line(stage: str, summary: dict, workdir: Path) -> str:
    line = f"stage {stage}: {summary['blocks']} blocks ({summary['computed_now']} computed now) in {workdir}"
    if "improved_on_init" in summary:
        n, of = summary["improved_on_init"]["improved"], summary["improved_on_init"]["experts"]
        line += f"; {n} of {of} experts improved on their init"
        if of and not n:
            line += (" (all ship the init: this budget is too small for refinement to pay; raise --epochs / "
                     "--steps-per-epoch)")
    return line


# -- commands ---------------------------------------------------------------------------------------------------
class _Command(typer.core.TyperCommand):
    """A command whose --help lists every option it accepts: after the Options panel (ten at most), a More
    options panel with the hidden options that set no config field (their help as the Options panel shows it),
    and for the config commands the Settings panel: every config field it takes (--set KEY=VALUE, read from the
    source), each with the hidden option that sets it."""

    def format_help(self, ctx, formatter):
        super().format_help(ctx, formatter)
        from typer import rich_utils

        command = _SETTINGS_OF.get(self.name, self.name)
        console = rich_utils._get_rich_console()
        more = [p for p in self.params
                if p.param_type_name == "option" and p.hidden and p.name not in config_params(command)]
        if more:
            rich_utils._print_options_panel(name="More options", params=more, ctx=ctx, markup_mode="rich",
                                            console=console)
        if command in COMMAND_KEYS:
            console.print(settings_panel(command))


_SETTINGS_OF = {"init": "init-sgptq"}  # `moesq init` is init-sgptq's general form


@app.command(cls=_Command)
@_guard
@with_config_options("calibrate")
def calibrate(
    model: ModelOpt = None, workdir: WorkdirOpt = Path("moesq-work"), recipe: RecipeOpt = None,
    quiet: QuietOpt = False, json_out: JsonOpt = None, settings: list = (),
):
    """Create a work dir for a model + format and build its calibration set (seeded train / val / init splits).

    Re-running with the same settings is a no-op; other settings on an existing work dir are refused. A
    calibration that was interrupted or failed (e.g. a bad --calib file) is simply run again.

    [bold]Examples[/]

      moesq calibrate -w moesq-work --seq-len 32 --n-train 2 --n-val 2 --n-init 8

      moesq calibrate --model Qwen/Qwen3-30B-A3B -w qwen3-work --calib allenai/c4:en@train
    """
    from moesq_core.compression.pipeline import run_calibrate

    _setup(workdir, quiet)
    cfg, keys = _compress_config(settings, recipe)
    with RichProgress(quiet) as p:
        info = run_calibrate(workdir, model or cfg.model, _run_options(cfg, keys), progress=p)
    if json_out is not None:
        _write_json(json_out, {"schema": "moesq.calibrate/1", "workdir": str(workdir), "calibration": info})
        if str(json_out) == "-":
            return
    console.print(f"calibration: {info['sequences']} sequences of {info['seq_len']} tokens → {workdir / info['file']}")


@app.command("init-sgptq", cls=_Command)
@_guard
@with_config_options("init-sgptq")
def init_sgptq(
    model: ModelOpt = None, workdir: WorkdirOpt = Path("moesq-work"), recipe: RecipeOpt = None,
    device: DeviceOpt = "auto", nproc: NprocOpt = 1, quiet: QuietOpt = False, json_out: JsonOpt = None,
    batch_size: BatchOpt = None, redo_from: RedoOpt = None, cache_gb: CacheOpt = None, settings: list = (),
):
    """One-shot compression of every routed expert, block by block, with SGPTQ (SparseGPT+GPTQ) unless --method says.

    `moesq init-sgptq` and `moesq init` are the same command: init-sgptq is named for its default method, init is
    the general name to use with --method. Writes stage [bold]init-<method>[/]; calibrates first if the work dir
    has no calibration yet. The stage's identity is its method with every option filled in, so defaults typed or
    not are the same stage. The method's options are init.options.* (--set init.options.percdamp=0.02).

    [bold]Examples[/]

      moesq init-sgptq -w moesq-work --seq-len 32 --n-train 2 --n-val 2 --n-init 8

      moesq init-sgptq -w moesq-work --method rtn

      moesq init-sgptq -w moesq-work --redo-from 2

      moesq init -w moesq-work --method wanda --set init.options.hessian_weighting=w
    """
    from moesq_core.compression.pipeline import init_stage_name, run_init

    _setup(workdir, quiet)
    cfg, keys = _compress_config(settings, recipe)
    mcfg, given, method, model = cfg.init, _run_options(cfg, keys), cfg.init.name, model or cfg.model
    with _ranks(device, nproc, workdir) as device, _progress(quiet) as p:
        summary = run_init(workdir, mcfg, model, given, device=device, redo_from=redo_from, progress=p,
                           **_stage_kw(batch_size, cache_gb))
    if _rank() != 0:
        return
    stage = init_stage_name(method)
    if json_out is not None:
        _write_json(json_out, {"schema": "moesq.stage/1", "workdir": str(workdir), "stage": stage,
                               "config": mcfg.to_dict(), **summary})
        if str(json_out) == "-":
            return
    console.print(_stage_line(stage, summary, workdir))


app.command("init", cls=_Command)(init_sgptq)


@app.command(cls=_Command)
@_guard
@with_config_options("refine")
def refine(
    model: ModelOpt = None, workdir: WorkdirOpt = Path("moesq-work"), recipe: RecipeOpt = None,
    stage: Annotated[str, typer.Option(callback=_stage_name,
                                       help="Stage name to write (e.g. refine-p0 for an ablation).")] = "refine",
    device: DeviceOpt = "auto", nproc: NprocOpt = 1, quiet: QuietOpt = False, json_out: JsonOpt = None,
    batch_size: BatchOpt = None, redo_from: RedoOpt = None, cache_gb: CacheOpt = None, settings: list = (),
):
    """Learn each expert's sparsity pattern jointly with its quantized values (the moesq algorithm).

    Gumbel-softmax over the format's patterns, a latent fp32 weight copy, straight-through quantization and a
    router-weighted reconstruction loss, block by block on the compressed prefix, over the routed rows of the
    training and one-shot sequences (--no-init-split-rows: the training ones). Each block starts from the
    --init method run on that block inside the loop (with the options of the work dir's init-<init> stage if
    there is one, else its defaults); ships each block's best validation epoch.

    [bold]Budget[/]: --epochs × steps per epoch. Steps per epoch are --steps-per-epoch if given; else derived
    from --batch-rows (⌈routed training rows of the block / batch rows⌉, at least 16); else the paper's 128.
    Either way they are capped so each expert averages at least 8 routed rows per step. The learning rates
    are the paper's for its 1,280 steps per block and scale with the budget (× min(cap, 1280 / steps); caps
    10 for the logits, 100 for the values), so a short run travels as far as the paper's; a raised values step
    is at most 0.025 × the RMS of the expert projection's weights (lr_budget_values_rms in a recipe; Lion
    moves every value by exactly its rate, so an absolute rate is noise on small weights). The resulting
    schedule (epochs × steps, rows per step, effective learning rates) is printed before training, with a
    warning when no pattern can change.

    [bold]End-to-end[/]: after the last block the patterns stay, and the values of every expert of every block
    are tuned together against the reference model's next-token distribution (KL on the final logits) over
    the training and one-shot calibration sequences (--e2e-batch-size per step); the best of the validation
    checks (before, and after each pass) ships. It rewrites the stage's blocks in one step (resumable) and
    holds every expert's values and Adam moments at once (~24 bytes per expert weight; --e2e-optimizer lion
    keeps one moment instead of two, ~20 bytes; --e2e-lr is the chosen one's rate). Where that does not fit the
    device (or --e2e-memory-gb), it tunes windows of consecutive blocks one after the other, the other blocks
    frozen in their compressed form, against the same KL through the rest of the model:
    --e2e-window N blocks per window, or auto (the default: the whole model where it fits, else the largest
    window that fits); each window runs the step's passes and is saved as it ends (resumable). By default (auto)
    it runs 2 passes over those sequences, at most 256 steps, when its windows fit, and says before the block
    loop whether and how it will run; --e2e-steps N sets the steps, 0 none.

    [bold]Several GPUs[/]: --nproc N (or `torchrun --nproc-per-node N $(which moesq) refine ...`) shards each
    block's experts over N processes. Every expert draws its own random numbers (seeded by --refine-seed, the
    layer and the expert) and batches are sized from the whole block, so an expert's result does not depend
    on the sharding: on the CPU the artifacts are byte-identical to one process's.

    [bold]Examples[/]

      moesq refine -w moesq-work --seq-len 32 --n-train 2 --n-val 2 --n-init 8

      moesq refine -w moesq-work --stage refine-short --epochs 2 --steps-per-epoch 4

      moesq refine -w moesq-work --stage refine-set --set refine.epochs=1 --set refine.steps_per_epoch=2

      moesq refine -w moesq-work --stage refine-windows --epochs 1 --steps-per-epoch 2 --e2e-window 2 --e2e-steps 4

      moesq refine -w moesq-work --stage refine-2proc --epochs 2 --steps-per-epoch 4 --nproc 2 --device cpu

      moesq refine --model Qwen/Qwen3-30B-A3B -w qwen3-work --device cuda
    """
    from moesq_core.compression.methods.refine import RefineConfig
    from moesq_core.compression.pipeline import run_refine

    _setup(workdir, quiet)
    cfg, keys = _compress_config(settings, recipe, {"refine": {}})
    with _ranks(device, nproc, workdir) as device, _progress(quiet) as p:
        summary = run_refine(workdir, cfg.refine or RefineConfig(), model or cfg.model, _run_options(cfg, keys),
                             init=cfg.init.name, stage=stage, device=device, redo_from=redo_from, progress=p,
                             **_stage_kw(batch_size, cache_gb))
    if _rank() != 0:
        return
    if json_out is not None:
        _write_json(json_out, {"schema": "moesq.stage/1", "workdir": str(workdir), "stage": stage, **summary})
        if str(json_out) == "-":
            return
    console.print(_stage_line(stage, summary, workdir))


@app.command(cls=_Command)
@_guard
def pack(
    workdir: Annotated[Path, typer.Argument(
        help="Work dir with a finished stage (default: moesq-work).")] = Path("moesq-work"),
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output model dir (default: WORKDIR/packed). "
                                                "Never the work dir, the source model, or a dir holding anything but "
                                                "an earlier moesq pack.")] = None,
    stage: Annotated[Optional[str], typer.Option(
        help="Stage to pack (default: refine if finished, else the last).")] = None,
    dense_layout: Annotated[bool, typer.Option(
        help="Store p48 weights densely (pruned bytes zero) instead of the sparse layout.")] = False,
    overwrite: Annotated[bool, typer.Option(
        help="Replace an earlier moesq pack in --out (atomically; nothing else is ever replaced).")] = False,
    max_shard_size: Annotated[str, typer.Option(
        help="Largest weight shard (e.g. 5GB, 500MB); more than one shard gets model.safetensors.index.json.")] = "5GB",
    push_to_hub: Annotated[Optional[str], typer.Option(
        "--push-to-hub", metavar="[REPO]",
        help="Upload to this Hub repo (created if missing); given alone (last, or before another option), to "
             "<your user>/<model>-moesq-<format>.")] = None,
    private: Annotated[bool, typer.Option(help="Make the Hub repo private (also an existing one).")] = False,
    json_out: JsonOpt = None,
    quiet: QuietOpt = False,
):
    """Write a Hugging Face–style model dir: compressed-tensors config, packed experts, untouched other weights,
    tokenizer, model card, the recipe that made it (recipe.yaml) and a checksum manifest (moesq_pack.json);
    optionally push it to the Hub.

    `moesq pack --push-to-hub` packs ./moesq-work into moesq-work/packed and uploads it to
    <your user>/<model>-moesq-<format>.

    [bold]Examples[/]

      moesq pack moesq-work --out packed-model --overwrite

      moesq pack --push-to-hub
    """
    from moesq_core.compression.workdir import WorkDir
    from moesq_core.memory import parse_size

    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        _fail(str(e), 2)
    wd = WorkDir(workdir)
    wd.load()  # not a work dir (missing, empty): said at once, before torch is imported
    _setup(workdir, quiet)
    from moesq_core.compression.export import check_output_dir, export_packed
    from moesq_core.compression.export import push_to_hub as core_push
    from moesq_core.compression.pipeline import default_stage
    if push_to_hub is not None and push_to_hub != _DEFAULT_REPO:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(push_to_hub)
        except HFValidationError as e:
            _fail(f"--push-to-hub {push_to_hub!r}: not a Hub repo id ({e})", 2)
    stage = stage or default_stage(wd)
    out = out or workdir / "packed"
    check_output_dir(out, workdir, Path(wd.load()["model"]["path"]), overwrite)  # before any progress is shown
    n_blocks = len(wd.stage(stage)["blocks"]) if wd.stage(stage) else 0
    with RichProgress(quiet) as p, p.task(f"pack {stage}", n_blocks) as t:
        summary = export_packed(wd, stage, out, overwrite=overwrite, sparse_layout=not dense_layout,
                                max_shard_bytes=max_bytes, progress=t.advance)
    doc = {"schema": "moesq.pack/1", **summary, "hub": None}
    con = _out_console(json_out)
    con.print(f"packed {stage} → {out}: {summary['bits_per_weight']:.3f} bits/weight over "
              f"{summary['expert_weights']:,} expert weights, {summary['shards']} shard(s)")
    if summary["input_scale_fallbacks"]:
        con.print(f"[yellow]note:[/] {summary['input_scale_fallbacks']} expert linears saw no calibration token; "
                  "their input global scale is the layer's calibrated one")
    if push_to_hub:
        from moesq_core.compression.export import default_repo_name

        repo = None if push_to_hub == _DEFAULT_REPO else push_to_hub
        name = default_repo_name(wd.load()["model"]["source"], summary["format"])
        try:
            doc["hub"] = core_push(out, repo, private=private, default_name=name)
        except RuntimeError as e:
            doc["hub"] = {"repo": repo, "error": str(e)}
            _write_json(json_out, doc)
            raise
        con.print(f"pushed to {doc['hub']['url']}" + "".join(f" ({n})" for n in doc["hub"]["notes"]))
    _write_json(json_out, doc)


@app.command(cls=_Command)
@_guard
def verify(
    path: Annotated[Path, typer.Argument(callback=_packed_dir,
                                         help="Packed model dir written by `moesq pack`.")],
    kernel: Annotated[bool, typer.Option(help="Also run every packed expert through its GPU kernel against the CPU "
                                              "reference: s24-fp8 (CUTLASS sparse FP8, Hopper) and p48-nvfp4 (the "
                                              "sparse-tensor-core kernel on Hopper, else Triton; W4A16, and W4A4 "
                                              "when the dir has input global scales). Needs a CUDA GPU.")] = False,
    show: Annotated[int, typer.Option(min=0, help="Rows of the per-tensor table to print (0 = all).")] = 12,
    checksums_only: Annotated[bool, typer.Option(help="Only check the files against moesq_pack.json (fast).")] = False,
    json_out: JsonOpt = None,
    quiet: QuietOpt = False,
):
    """Check a packed dir: first every file against the sha256 checksums in moesq_pack.json (naming the file and
    the tensor whose bytes changed), then every packed expert tensor: admissible sparsity, finite positive
    scales (input global scales included), gate/up sharing one global scale, shapes, bits per weight, config
    markers. Exits 1 naming the first problem (the file or tensor, and the position).

    [bold]Examples[/]

      moesq verify packed-model

      moesq verify packed-model --checksums-only --json verify.json
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
        _fail(f"verify failed: {report.first_error}")
    if kernel:
        try:
            from moesq_core.serving.kernels.verify_kernel import kernel_check_packed_dir
        except ImportError as e:
            _fail(f"the native kernel check is not available in this build ({e})")
        info: dict = {}
        with RichProgress(quiet) as p:
            results = kernel_check_packed_dir(path, progress=p, info=info)
        bad = [r for r in results if not r[2]]
        doc["kernel"] = [{"expert": r[0], "max_abs_err": r[1], "ok": bool(r[2])} for r in results]
        doc["ok"] = not bad
        how = f" ({info['kernel']})" if "kernel" in info else ""
        console.print(f"kernel check{how}: {len(results) - len(bad)}/{len(results)} expert linears match the reference")
        if bad:
            _write_json(json_out, doc)
            _fail(f"kernel mismatch on {bad[0][0]} (max abs err {bad[0][1]:.3g})")
    _write_json(json_out, doc)
    console.print("[green]verify: ok[/]")


@app.command("bench-kernel", cls=_Command)
@_guard
def bench_kernel(
    format: Annotated[str, typer.Option("--format", "-f",
                                        help="s24-fp8 (CUTLASS 2:4) or p48-nvfp4 (packed streaming).")] = "s24-fp8",
    G: Annotated[Optional[list[int]], typer.Option("--G", min=1, help="Experts per grouped GEMM (repeatable).")] = None,
    N: Annotated[Optional[list[int]], typer.Option(
        "--N", min=1, help="Tokens per expert, max of {N,3N/4,N/2,N/4} (repeatable).")] = None,
    M: Annotated[Optional[int], typer.Option("--M", min=1, help="Custom output features (with --K).")] = None,
    K: Annotated[Optional[int], typer.Option("--K", min=1, help="Custom input features (with --M).")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="CUDA-graph replays per timing (median reported).")] = 50,
    out: Annotated[Path, typer.Option("--out", "-o",
                                      help="Directory for JSON, Markdown and PNG results.")] = Path("bench-results"),
    e2e: Annotated[bool, typer.Option(help="End-to-end decode benchmark instead of kernel sweeps (p48).")] = False,
    json_out: JsonOpt = None,
):
    """Time the grouped sparse GEMMs against torch's bf16/fp8 grouped GEMMs and cuSPARSELt (same process,
    CUDA-graph replay). Default shapes: the paper's Table 8 (Qwen3-30B-A3B and Kimi-K2.5 experts). Needs a CUDA
    GPU (Hopper, sm_90, for the native kernels).

    [bold]Examples[/]

      moesq bench-kernel --G 384 --N 128

      moesq bench-kernel --format p48-nvfp4 --out p48-bench

      moesq bench-kernel --format p48-nvfp4 --e2e
    """
    import torch

    if not torch.cuda.is_available():
        _fail("bench-kernel needs a CUDA GPU (Hopper sm_90 for the native kernels); none is visible")
    if (M is None) != (K is None):
        _fail("--M and --K go together", 2)
    shapes = [(M, K)] if M is not None else None
    if e2e:
        import runpy

        sys.argv = ["e2e_decode_bench", "--out", str(out)]
        runpy.run_module("moesq_core.serving.bench.e2e_decode", run_name="__main__", alter_sys=True)
        return
    from moesq_core.serving.bench.kernel_bench import bench_kernel as core_bench

    result = core_bench(format, shapes, G or [8, 32, 128, 384], N or [16, 64, 128, 256, 1024], out, repeats)
    _out_console(json_out).print(f"results written to {out} ({len(result.get('rows', []))} rows)")
    _write_json(json_out, {"schema": "moesq.bench-kernel/1", "format": format, "out": str(out), **result})


@app.command(cls=_Command)
@_guard
def generate(
    path: Annotated[Path, typer.Argument(callback=_packed_dir,
                                         help="Packed model dir written by `moesq pack` (any format).")],
    prompt: Annotated[Optional[list[str]], typer.Option(
        "--prompt", "-p", help="Text to continue (or the user message with --chat); repeatable: the prompts run as "
                               "one batch.")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(
        "--prompts", help="File of prompts, one per line (blank lines skipped), batched with any --prompt.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 64,
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")] = False,
    temperature: Annotated[float, typer.Option(callback=_non_negative_float,
                                               help="0 = greedy; > 0 samples (seeded by --seed).")] = 0.0,
    seed: Annotated[int, typer.Option(min=0, max=2**64 - 1, help="Sampling seed.")] = 0,
    dtype: Annotated[str, typer.Option(help="auto | bf16 | fp16 | fp32 (or bfloat16 | float16 | float32) for the "
                                            "non-expert weights; auto: bf16 on a GPU, fp32 on the CPU.")] = "auto",
    device: Annotated[str, typer.Option(callback=_check_device,
                                        help="auto | cpu | cuda | cuda:N (auto: the GPU when there is one; on "
                                             "sm_90 packed p48 experts run through the fast Hopper "
                                             "module).")] = "auto",
    no_verify: HiddenNoVerifyOpt = False,
    json_out: JsonOpt = None,
    quiet: QuietOpt = False,
):
    """Load a packed checkpoint through load_packed and generate text: the first thing to try with a compressed model.

    The prompts run as one left-padded batch with a static KV cache; on a GPU each decode step replays a CUDA graph.

    [bold]Examples[/]

      moesq generate packed-model --prompt "The capital of France is" --prompt "Once upon a time" --max-new-tokens 8
    """
    _setup(None, quiet)
    from moesq_core.serving.generate import DTYPE_CHOICES, check_max_new_tokens, generate_text, read_prompts

    if dtype not in DTYPE_CHOICES:
        _fail(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}", 2)
    try:
        prompts = read_prompts(prompt or [], prompts_file)
        check_max_new_tokens(path, max_new_tokens)
    except ValueError as e:
        _fail(str(e), 2)

    with RichProgress(quiet) as p:
        doc = generate_text(path, prompts, max_new_tokens=max_new_tokens, device=device, dtype=dtype, chat=chat,
                            temperature=temperature, seed=seed, progress=p, verify=not no_verify)
    con = _out_console(json_out)
    dec = doc["decode"]
    step = "CUDA graph" if dec["cuda_graph"] else "eager"
    con.print(f"[dim]{doc['format']} on {doc['device']} ({', '.join(doc['experts_module'])}, {doc['dtype']}), loaded "
              f"in {doc['load_seconds']:.1f} s; batch {doc['batch_size']}: prefill "
              f"{doc['prefill']['tokens_per_second']} tokens/s, decode {dec['tokens_per_second']} tokens/s ({step})[/]",
              highlight=False)
    from rich.text import Text

    for c in doc["completions"]:
        con.print(Text.assemble((c["prompt"], "bold"), c["completion"]))  # Text: no markup in user text
    _write_json(json_out, doc)


@app.command("eval", cls=_Command)
@_guard
def eval_cmd(
    targets: Annotated[Optional[list[str]], typer.Argument(
        help="Work dirs (reference + finished stages), packed dirs or model dirs.")] = None,
    ppl: Annotated[Optional[Path], typer.Option("--ppl", help="Text file for perplexity (.txt/.txt.xz).")] = None,
    ppl_tokens: Annotated[int, typer.Option(min=1, help="Evaluate the first N tokens of --ppl.")] = 65536,
    window: Annotated[int, typer.Option(min=1, hidden=True, help="Perplexity window (non-overlapping).")] = 512,
    stages: Annotated[Optional[list[str]], typer.Option(
        "--stage", help="Only these stages of a work dir (repeatable).")] = None,
    tasks: Annotated[Optional[str], typer.Option(
        "--tasks", help="lm-eval tasks, comma-separated, or a preset (openllm-v1); moesq_cloze is the shipped "
                        "offline task. Needs the eval extra.")] = None,
    tasks_dir: Annotated[Optional[Path], typer.Option(help="Directory of extra task YAMLs with local data.")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="lm-eval: examples per task.")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option(min=0, hidden=True, help="lm-eval: override the shots.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="lm-eval batch size.")] = 8,
    eval_seed: Annotated[int, typer.Option("--eval-seed", min=0, max=2**32 - 1, hidden=True,
                                           help="lm-eval seed (numpy's range).")] = 1234,
    no_verify: HiddenNoVerifyOpt = False,
    json_out: JsonOpt = None,
    device: DeviceOpt = "cpu", quiet: QuietOpt = False,
):
    """Perplexity and/or lm-eval task accuracy for reference, fake-quantized (work dir stages) and packed models,
    side by side in one table. Results are cached in the first work dir, so re-runs and resumes are instant.

    Without --ppl and --tasks: perplexity on the embedded evaluation text. --tasks needs the eval extra
    (pip install -e ".\\[eval]"); moesq_cloze is the shipped offline task, other tasks download their data.

    [bold]Examples[/]

      moesq eval moesq-work packed-model --stage refine --ppl-tokens 2048

      moesq eval moesq-work --stage refine --tasks moesq_cloze --limit 8
    """
    from moesq_core.eval.runner import ResultCache, ppl_for_targets, resolve_targets

    targets = targets or ["moesq-work"]
    resolved = resolve_targets(targets, stages)  # a missing or empty dir is said at once, before torch is imported
    _setup(None, quiet)
    if tasks is not None:  # before any model is loaded
        from moesq_core.eval.lm_eval_tasks import require_lm_eval

        try:
            require_lm_eval()
        except ImportError as e:
            _fail(str(e))
    from moesq_core.compression.pipeline import DEFAULT_EVAL

    if ppl is None and tasks is None:
        ppl = DEFAULT_EVAL
    wd = next((Path(t) for t in targets if (Path(t) / "manifest.json").is_file()), None)
    cache = ResultCache(wd / "eval" / "results.json" if wd else None)
    out = {"schema": "moesq.eval/1", "ppl": None, "tasks": None}
    console = _out_console(json_out)
    with RichProgress(quiet) as p:
        if ppl is not None:
            rows = ppl_for_targets(resolved, ppl, max_tokens=ppl_tokens, window=window, device=device, cache=cache,
                                   progress=p, verify=not no_verify)
            out["ppl"] = rows
        if tasks is not None:
            out["tasks"] = _run_tasks(resolved, tasks, tasks_dir, limit, num_fewshot, batch_size, eval_seed, device,
                                      wd / "eval" / "lm_eval" if wd else None, p, console, verify=not no_verify)
    if out["ppl"]:
        ref = next((r["ppl"] for r in out["ppl"] if r["kind"] == "reference"), None)
        table = Table(title=f"perplexity — {Path(str(ppl)).name}, {out['ppl'][0]['tokens']:,} tokens, window {window}")
        for c in ("model", "kind", "perplexity", "× reference"):
            table.add_column(c, justify="right" if c != "model" else "left")
        for r in out["ppl"]:
            table.add_row(r["label"], r["kind"], f"{r['ppl']:.3f}", "" if not ref else f"{r['ppl'] / ref:.3f}")
        console.print(table)
    _write_json(json_out, out)


def _run_tasks(resolved, tasks, tasks_dir, limit, num_fewshot, batch_size, seed, device, cache_dir, progress,
               con=console, verify=True):
    try:
        from moesq_core.eval.lm_eval_tasks import evaluate_tasks
        from moesq_core.eval.recovery import recovery_table
    except ImportError as e:
        _fail(f"lm-eval support needs the 'eval' extra: pip install -e '.[eval]' in a checkout ({e})")
    from moesq_core.eval.runner import load_target, target_identity

    results = []
    for t in resolved:
        model, tok = load_target(t, device, progress=progress, verify=verify)
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
    def pct(v):
        return "" if v is None else f"{100 * v:.2f}"
    for row in table.rows:
        t.add_row(row.label, *[pct(row.scores.get(c)) for c in table.tasks], pct(row.average),
                  "" if row.recovery is None else f"{row.recovery:.2f}")
    console.print(t)
    for w in table.warnings:
        console.print(f"[yellow]warning:[/] {w}")


@app.command(cls=_Command)
@_guard
@with_config_options("run")
def run(
    model: ModelOpt = None, workdir: WorkdirOpt = Path("moesq-work"), recipe: RecipeOpt = None,
    device: DeviceOpt = "auto", nproc: NprocOpt = 1, quiet: QuietOpt = False, json_out: JsonOpt = None,
    ppl: Annotated[Optional[Path], typer.Option("--ppl", hidden=True,
                                                help="Evaluation text (default: the embedded sample).")] = None,
    ppl_tokens: Annotated[int, typer.Option(min=1, hidden=True, help="Evaluate the first N tokens.")] = 65536,
    settings: list = (),
):
    """Everything in one go: calibrate → baselines → init → refine → pack → verify → perplexity table.

    With no options it compresses the embedded micro-qwen3-moe model offline on a CPU in minutes, with the
    micro-quick recipe (256-token sequences: 64 for the one-shot stage, 64 + 8 for refinement, 2 epochs × 8
    steps refining the values on the init's support: 16 steps cannot move a sparsity pattern; then 64 end-to-end
    steps). On an existing work dir, the format and calibration settings that no option and no --recipe key
    gives are the work dir's.

    [bold]Examples[/]

      moesq run -w run-rtn --method rtn --baselines '' --no-refine --seq-len 64 --n-train 8 --n-val 4 --n-init 8 --ppl-tokens 4096
    """  # noqa: E501  (an example command line, shown and run as written: one line)
    from moesq_core.compression.pipeline import default_run_config, run_all, run_config_of

    _setup(workdir, quiet)
    if ppl is not None and not ppl.is_file():
        _fail(f"--ppl {ppl}: no such file", 2)
    cfg, keys = _compress_config(settings, recipe, None if recipe is not None else default_run_config().to_dict())
    cfg = run_config_of(workdir, cfg, keep=_run_options(cfg, keys))
    with _ranks(device, nproc, workdir) as device, _progress(quiet) as p:
        res = run_all(workdir, cfg, model, device=device, ppl=ppl, ppl_tokens=ppl_tokens, progress=p)
    if res is None:  # a rank other than 0 (rank 0 packs, evaluates and prints)
        return
    if json_out is not None:
        _write_json(json_out, {"schema": "moesq.run/1", "workdir": str(workdir), **res})
        if str(json_out) == "-":
            return
    console.print(run_table(res))
    console.print(f"verify: ok ({res['bits_per_weight']:.3f} bits/weight); packed model in {res['packed']}")


def run_table(res: dict) -> Table:
    """The perplexity table `moesq run` prints, from its result (`moesq run --json`'s document)."""
    from moesq_core.formats import get_format

    rows = res["rows"]
    ref = next(r["ppl"] for r in rows if r["kind"] == "reference")
    fmt, aq = get_format(res["config"]["format"]), res["config"]["act_quant"]
    table = Table(title=f"moesq run — {fmt.name} {fmt.scheme if aq else 'weights only'}, perplexity on "
                        f"{rows[0]['tokens']:,} tokens")
    for c in ("model", "perplexity", "× reference"):
        table.add_column(c, justify="left" if c == "model" else "right")
    for r in rows:
        table.add_row(r["label"], f"{r['ppl']:.3f}", f"{r['ppl'] / ref:.3f}")
    return table


def _reflow_help() -> None:
    """Docstrings are wrapped for the source; rich markup keeps single newlines, so each paragraph's lines are
    joined and the terminal wraps them (indented lines, the examples, stay as written)."""
    import inspect

    for info in app.registered_commands:
        paragraphs = []
        for para in (inspect.getdoc(info.callback) or "").split("\n\n"):
            lines = para.split("\n")
            indented = any(line.startswith(" ") for line in lines)
            paragraphs.append(para if indented else " ".join(line.strip() for line in lines))
        if info.name == "init":  # init-sgptq's general name: its own first line, the rest init-sgptq's
            paragraphs[0] = ("One-shot compression of every routed expert, block by block, with the method --method "
                             "names (default: sgptq).")
        info.help = "\n\n".join(paragraphs)


_reflow_help()

_DEFAULT_REPO = "<default>"  # `--push-to-hub` given without a repo


def expand_argv(argv: list[str]) -> list[str]:
    """The command line as the app parses it: `--push-to-hub` may stand alone (the card's `moesq pack
    --push-to-hub`), so alone it gets the default-repo marker."""
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == "--push-to-hub" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            argv.insert(i + 1, _DEFAULT_REPO)
            break
    return argv


def main():
    from moesq_core.memory import use_expandable_segments

    use_expandable_segments()  # before torch's first CUDA allocation
    sys.argv[1:] = expand_argv(sys.argv[1:])
    if _rank() != 0:  # under torchrun: every rank parses the same options, rank 0 prints usage errors
        try:
            code = app(standalone_mode=False)
        except (typer.TyperException, typer.Abort, click.exceptions.ClickException, click.exceptions.Abort) as e:
            sys.exit(getattr(e, "exit_code", 1))
        sys.exit(code if isinstance(code, int) else 0)
    app()


if __name__ == "__main__":
    main()
