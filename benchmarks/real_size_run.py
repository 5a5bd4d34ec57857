"""A real-size run: a random-weight model of a real MoE's shape through every moesq command, measured.

    # 48-layer Qwen3-30B-A3B shape (57 GiB)
    python benchmarks/real_size_run.py --root DIR --nproc 2 --out benchmarks/results
    python benchmarks/real_size_run.py --root DIR --scaling --layers 3 --nproc 2 --out benchmarks/results
    # one Kimi-K2 block
    python benchmarks/real_size_run.py --root DIR --shape kimi-k2-block --skip-init --out benchmarks/results
    # the same, paper SGPTQ stage
    python benchmarks/real_size_run.py --root DIR --shape kimi-k2-block --no-refit --out benchmarks/results
    # a smoke run
    python benchmarks/real_size_run.py --root DIR --layers 2 --small --device cpu --nproc 2

Pipeline mode writes the model under DIR (generated on the GPU when there is one; `moesq_core.serving.bench.
synthetic_model`) and runs, as a user would, `moesq calibrate → init-sgptq → refine (a reduced budget) →
pack → verify → eval --ppl` on one work dir, each as its own process, recording per command the wall time,
the peak host memory of its process tree (RSS summed over torchrun's ranks, sampled every 0.5 s), the peak
GPU memory in use per GPU (nvidia-smi, sampled likewise), and at the end the sizes of the model, the work dir
and the packed model.

Scaling mode runs `init-sgptq` and `refine` (same budget) on a `--layers`-layer model with 1 process and
with `--nproc` processes (expert parallel, one GPU each), each on its own work dir, and reports the speedup
of the per-block compute time (blocks after the first, whose time includes one-time compilation and warm-up).

Resumable: progress is kept in DIR/real_size_state.json. With `--deadline-s S` a command still running after S
seconds of this invocation is stopped with SIGTERM (moesq stops cleanly at a block boundary; the stage
resumes) and this script exits with status 3: run the same command again to continue. Results (JSON +
Markdown, relative paths only) are written to --out when every step has finished.
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import json
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from synthetic_model import SHAPES, qwen3_moe_config, write_random_qwen3_moe  # noqa: E402

from moesq_core.compression.config import ASSETS  # noqa: E402
from moesq_core.serving.bench.harness import git_commit  # noqa: E402

GIB = 2 ** 30
EVAL_TEXT = ASSETS / "eval-sample.txt.xz"
# Calibration and refine-budget options; recorded in the state (a resumed run must use the same) and the results.
BUDGET_OPTIONS = ("epochs", "steps_per_epoch", "batch_rows", "e2e_steps", "calib", "n_train", "seq_len", "n_val",
                  "n_init")
PIPELINE = ("generate", "calibrate", "init-sgptq", "refine", "pack", "verify", "eval")
# A smoke-test shape: the same architecture at a width a CPU runs in seconds.
SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
             moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4, vocab_size=8192)


class Peaks:
    """Samples the peak RSS of a process tree and the GPU memory in use while a command runs."""

    def __init__(self, pid: int, interval: float = 0.5):
        self.pid, self.interval, self.host, self.gpu = pid, interval, 0, []
        self._stop = threading.Event()
        self._smi = shutil.which("nvidia-smi")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        self.host = max(self.host, rss)
        if self._smi:
            try:
                out = subprocess.run([self._smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
                used = [int(x) * 2 ** 20 for x in out]
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self.gpu = [max(a, b) for a, b in zip(used, self.gpu)] + used[len(self.gpu):]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_command(argv: list[str], log: Path, deadline: float | None) -> dict:
    """Run one command in its own session, logging its output; stop it with SIGTERM at the deadline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ moesq {' '.join(argv[3:])}\n")
        f.flush()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        peaks = Peaks(proc.pid)
        stopped = False
        while proc.poll() is None:
            if deadline is not None and time.time() > deadline and not stopped:
                os.killpg(proc.pid, signal.SIGTERM)
                stopped = True
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.2)
        peaks.stop()
    return {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2), "stopped": stopped,
            "peak_host_gib": round(peaks.host / GIB, 2), "peak_gpu_gib": [round(g / GIB, 2) for g in peaks.gpu]}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


class State:
    """The run's progress (DIR/real_size_state.json, or DIR/`name`), written after every command."""

    def __init__(self, root: Path, args: dict, name: str = "real_size_state.json"):
        self.path = root / name
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"args": args, "steps": {}}
        if self.data["args"] != args:
            raise SystemExit(f"{self.path} belongs to a run with other options {self.data['args']}; "
                             "give the same options or another --root")

    def step(self, name: str) -> dict:
        return self.data["steps"].setdefault(name, {"done": False, "attempts": []})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)


def moesq(*args: str) -> list[str]:
    return [sys.executable, "-m", "moesq_cli", *args]


def relative(obj, root: Path):
    """`obj` with absolute paths made relative to the run's root (or reduced to their file name): results
    files hold no machine paths."""
    if isinstance(obj, dict):
        return {k: relative(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [relative(v, root) for v in obj]
    if isinstance(obj, str) and obj.startswith("/"):
        p = Path(obj)
        return str(p.relative_to(root)) if p.is_relative_to(root) else p.name
    return obj


def run_step(state: State, name: str, argv: list[str], log: Path, deadline: float | None,
             json_file: Path | None = None) -> dict:
    """Run a step unless done; record it. Exits with status 3 when the deadline stopped it."""
    rec = state.step(name)
    if rec["done"]:
        return rec
    attempt = run_command(argv, log, deadline)
    rec["attempts"].append(attempt)
    if json_file is not None and json_file.exists():
        rec["result"] = relative(json.loads(json_file.read_text()), state.path.parent)
    rec["done"] = attempt["rc"] == 0
    state.save()
    if attempt["stopped"]:
        print(f"{name}: stopped at the deadline after {attempt['wall_s']:.0f} s; run the same command again to resume")
        raise SystemExit(3)
    if attempt["rc"] != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{name} failed (exit {attempt['rc']}); the end of {log.name}:\n{tail}")
    print(f"{name}: {attempt['wall_s']:.1f} s, peak host {attempt['peak_host_gib']} GiB, "
          f"peak GPU {attempt['peak_gpu_gib']} GiB", flush=True)
    return rec


def model_config(args) -> dict:
    over = {**SHAPES[args.shape], **(SMALL if args.small else {})}
    if args.layers:
        over["num_hidden_layers"] = args.layers
    return qwen3_moe_config(**over)


def generate(state: State, model: Path, cfg: dict, device: str) -> None:
    rec = state.step("generate")
    if rec["done"]:
        return
    t0 = time.perf_counter()
    gen_device = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    # In a child process: the GPU memory the generator touched is this driver's for as long as it lives, and
    # every moesq command after it needs the whole GPU.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        size = pool.apply(write_random_qwen3_moe, (model, cfg), {"seed": 0, "device": gen_device})
    rec.update(done=True, model_bytes=size, attempts=[{"rc": 0, "wall_s": round(time.perf_counter() - t0, 2)}])
    state.save()
    print(f"generate: {size / GIB:.1f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)


def stage_args(args, nproc: int) -> list[str]:
    return ["--device", args.device, *(["--nproc", str(nproc)] if nproc > 1 else []),
            *(["--n-train", str(args.n_train)] if args.n_train else [])]


def calib_args(args) -> list[str]:
    return [arg for opt in ("calib", "n_train", "seq_len", "n_val", "n_init") if getattr(args, opt)
            for arg in (f"--{opt.replace('_', '-')}", str(getattr(args, opt)))]


def refine_args(args) -> list[str]:
    budget = (["--batch-rows", str(args.batch_rows)] if args.batch_rows
              else ["--steps-per-epoch", str(args.steps_per_epoch)])
    return ["--epochs", str(args.epochs), *budget, *(["--e2e-steps", args.e2e_steps] if args.e2e_steps else [])]


PHASES_LINE = re.compile(r"moesq\.engine: (?P<stage>[\w-]+): layer (?P<layer>\d+) phases \(s\): (?P<phases>\{.*\})")
REFINE_LINE = re.compile(r"refine: \d+ experts in \d+ chunk\(s\)(?: and \d+ out-of-memory retries)?, "
                         r"init (?P<init>[\d.]+) s, "
                         r"refinement (?P<train>[\d.]+) s")


def refine_schedule(log: Path) -> str | None:
    """The schedule refine printed before training (its last run's), as the user saw it."""
    lines = [m[1] for line in (log.read_text(errors="replace").splitlines() if log.is_file() else [])
             if (m := re.search(r"refine schedule: (.*)", line))]
    return lines[-1] if lines else None


def block_phases(log: Path) -> dict:
    """Per stage, the median seconds per block of each phase over the blocks computed after the first (its time
    carries the process's warm-up), from the engine's per-block log lines; refine's compress split into its
    in-loop init and the refinement. Blocks only loaded or propagated on a resume (no compress phase) are left out."""
    blocks: dict[str, dict[int, dict]] = {}
    split: dict[str, list] = {"in_loop_init": [], "refinement": []}
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if m := PHASES_LINE.search(line):
            phases = ast.literal_eval(m["phases"])
            if "compress" in phases:
                blocks.setdefault(m["stage"], {})[int(m["layer"])] = phases
        elif m := REFINE_LINE.search(line):
            split["in_loop_init"].append(float(m["init"]))
            split["refinement"].append(float(m["train"]))
    out = {}
    for stage, by_layer in blocks.items():
        rows = [by_layer[k] for k in sorted(by_layer)]
        later = rows[1:] or rows
        names = list(dict.fromkeys(k for r in rows for k in r))
        med = {k: round(statistics.median(r.get(k, 0.0) for r in later), 2) for k in names}
        out[stage] = {"blocks": len(rows), "total": round(statistics.median(sum(r.values()) for r in later), 2),
                      "first_block": round(sum(rows[0].values()), 2), **med}
        if stage == "refine":
            out[stage].update({k: round(statistics.median(v[1:] or v), 2) for k, v in split.items() if v})
    return out


def pipeline(args, root: Path, deadline: float | None) -> dict:
    model, wd, res = args.model_dir or root / "model", root / "work", root / "results"
    res.mkdir(parents=True, exist_ok=True)
    log = root / "commands.log"
    cfg = model_config(args)
    state = State(root, {"mode": "pipeline", "config": cfg, "nproc": args.nproc, "device": args.device,
                         "skip_init": args.skip_init, "no_refit": args.no_refit,
                         **{k: getattr(args, k) for k in BUDGET_OPTIONS}, "ppl_tokens": args.ppl_tokens})
    generate(state, model, cfg, args.device)
    m, w = str(model), str(wd)
    steps = {
        "calibrate": moesq("calibrate", "-m", m, "-w", w, "--quiet", "--json", str(res / "calibrate.json"),
                           *calib_args(args)),
        "init-sgptq": moesq("init-sgptq", "-m", m, "-w", w, *stage_args(args, args.nproc),
                            *(["--no-refit"] if args.no_refit else []), "--quiet",
                            "--json", str(res / "init-sgptq.json")),
        "refine": moesq("refine", "-m", m, "-w", w, *stage_args(args, args.nproc), *refine_args(args), "--quiet",
                        "--json", str(res / "refine.json")),
        "pack": moesq("pack", w, "--quiet", "--json", str(res / "pack.json")),
        "verify": moesq("verify", str(wd / "packed"), "--quiet", "--json", str(res / "verify.json")),
        "eval": moesq("eval", str(wd / "packed"), "--ppl", str(EVAL_TEXT), "--ppl-tokens", str(args.ppl_tokens),
                      "--device", "cpu" if args.device == "cpu" else "cuda", "--quiet", "--json",
                      str(res / "eval.json")),
    }
    if args.skip_init:  # refine computes its SGPTQ init inside the block loop and reports its time anyway
        del steps["init-sgptq"]
    for name, argv in steps.items():
        run_step(state, name, argv, log, deadline, res / f"{name}.json")
    sizes = {"model": state.step("generate")["model_bytes"], "packed": dir_bytes(wd / "packed"),
             "workdir_without_packed": dir_bytes(wd) - dir_bytes(wd / "packed"),
             **{f"stage {p.name}": dir_bytes(p) for p in sorted((wd / "stages").iterdir())},
             "calibration": dir_bytes(wd / "calib"), "state cache": dir_bytes(wd / "cache")}
    return {"steps": state.data["steps"], "sizes_bytes": sizes,
            "per_block_median_s": block_phases(wd / "logs" / "moesq.log"),
            "refine_schedule": refine_schedule(wd / "logs" / "moesq.log")}


def scaling(args, root: Path, deadline: float | None) -> dict:
    model, log = args.model_dir or root / "model", root / "commands.log"
    cfg = model_config(args)
    state = State(root, {"mode": "scaling", "config": cfg, "nproc": args.nproc, "device": args.device,
                         "stages": args.stages,
                         **{k: getattr(args, k) for k in BUDGET_OPTIONS}})
    generate(state, model, cfg, args.device)
    out = {}
    for n in (1, args.nproc):
        wd, res = root / f"work-n{n}", root / f"results-n{n}"
        res.mkdir(parents=True, exist_ok=True)
        common = ["-m", str(model), "-w", str(wd), *stage_args(args, n), "--quiet"]
        for stage, extra in (("init-sgptq", []), ("refine", refine_args(args))):
            if stage not in args.stages:
                continue
            rec = run_step(state, f"{stage} n{n}", moesq(stage, *common, *extra, "--json", str(res / f"{stage}.json")),
                           log, deadline, res / f"{stage}.json")
            manifest = json.loads((wd / "manifest.json").read_text())
            blocks = manifest["stages"][stage].get("block_timings", {})
            secs = [blocks[k]["seconds"] for k in sorted(blocks, key=int)]
            out.setdefault(stage, {})[n] = {"block_seconds": secs,
                                           "compress_seconds": rec["result"]["compress_seconds"],
                                           "stage_seconds": rec["result"]["stage_seconds"],
                                           "phase_seconds": rec["result"].get("phase_seconds"),
                                           "wall_s": sum(a["wall_s"] for a in rec["attempts"]),
                                           "peak_gpu_gib": rec["attempts"][-1]["peak_gpu_gib"]}
    for stage, by_n in out.items():
        one, many = by_n[1], by_n[args.nproc]
        # expert parallel must write what one process writes
        shas = [{k: v["sha256"] for k, v in json.loads((root / f"work-n{n}" / "manifest.json").read_text())
                 ["stages"][stage]["blocks"].items()} for n in (1, args.nproc)]
        by_n["same_artifacts"] = shas[0] == shas[1]
        def steady(r):  # the first block's time includes compilation and warm-up
            later = r["block_seconds"][1:] or r["block_seconds"]
            return sum(later) / len(later)
        by_n["speedup_per_block_after_first"] = round(steady(one) / steady(many), 3)
        by_n["speedup_compress_seconds"] = round(one["compress_seconds"] / many["compress_seconds"], 3)
    return {"scaling": out, "steps": state.data["steps"]}


def header(args, cfg: dict) -> dict:
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
            "gpus": gpus, "torch": torch.__version__, "cpus": os.cpu_count(), "model_shape":
            {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_experts", "moe_intermediate_size",
                                 "num_experts_per_tok", "vocab_size")},
            "tokenizer": "the embedded micro model's (random weights: perplexities are not meaningful)",
            "options": relative({k: getattr(args, k) for k in ("shape", "skip_init", "no_refit", "nproc", "device",
                                                               *BUDGET_OPTIONS, "ppl_tokens",
                                                               *(("stages",) if args.scaling else ()))},
                                args.root.resolve())}


def markdown(doc: dict) -> str:
    h = doc["header"]
    s = h["model_shape"]
    lines = [f"# Real-size run — {'scaling' if 'scaling' in doc else 'pipeline'}: "
             f"random Qwen3-MoE ({h['options'].get('shape', 'qwen3-30b-a3b')} shape), "
             f"{s['num_hidden_layers']} layers × {s['num_experts']} experts of {s['hidden_size']} × "
             f"{s['moe_intermediate_size']}, top-{s['num_experts_per_tok']}", "",
             f"{h['date'][:10]} · {', '.join(h['gpus']) or 'CPU'} · torch {h['torch']} · commit {h['commit']} · "
             f"options {json.dumps(h['options'])}", ""]
    if "scaling" in doc:
        n = h["options"]["nproc"]
        lines += [f"| stage | 1 process: s/block | {n} processes: s/block | speedup per block (after the first) | "
                  "speedup of the compute time | artifacts equal |", "| --- | --- | --- | --- | --- | --- |"]
        for stage, r in doc["scaling"].items():
            def blocks(k):
                return ", ".join(f"{v:.1f}" for v in (r[str(k)] if str(k) in r else r[k])["block_seconds"])
            lines.append(f"| {stage} | {blocks(1)} | {blocks(n)} | **{r['speedup_per_block_after_first']:.2f}×** | "
                         f"{r['speedup_compress_seconds']:.2f}× | {r.get('same_artifacts', '—')} |")
        for stage, r in doc["scaling"].items():
            one, many = (r[str(k)] if str(k) in r else r[k] for k in (1, n))
            if one.get("phase_seconds") and many.get("phase_seconds"):
                phases = list(dict.fromkeys([*one["phase_seconds"], *many["phase_seconds"]]))
                lines += ["", f"{stage}, seconds per phase summed over the blocks (rank 0; the device synchronised at "
                          "each phase):", "", "| processes | " + " | ".join(phases) + " |",
                          "|---" * (len(phases) + 1) + "|"]
                lines += [f"| {k} | " + " | ".join(f"{x['phase_seconds'].get(p, 0):.1f}" for p in phases) + " |"
                          for k, x in ((1, one), (n, many))]
        return "\n".join(lines) + "\n"
    lines += ["| command | wall s | peak host GiB (all ranks) | peak GPU GiB (per GPU) | result |",
              "| --- | --- | --- | --- | --- |"]
    for name, rec in doc["steps"].items():
        wall = sum(a["wall_s"] for a in rec["attempts"])
        last = rec["attempts"][-1]
        r = rec.get("result", {})
        what = {"init-sgptq": lambda: f"{r['blocks']} blocks, compute {r['compress_seconds']:.0f} s",
                "refine": lambda: f"{r['blocks']} blocks, compute {r['compress_seconds']:.0f} s",
                "generate": lambda: f"{rec['model_bytes'] / GIB:.1f} GiB",
                "pack": lambda: (f"{r['bytes'] / GIB:.2f} GiB, {r['bits_per_weight']:.3f} bits/weight, "
                                 f"{r['shards']} shards"),
                "verify": lambda: f"ok={r.get('ok')}, {r.get('bits_per_weight', '')} bits/weight",
                "eval": lambda: f"perplexity {r['ppl'][0]['ppl']:.1f} over {r['ppl'][0]['tokens']} tokens",
                }.get(name, lambda: "")
        try:
            summary = what()
        except (KeyError, TypeError):
            summary = ""
        lines.append(f"| {name} | {wall:.1f}"
                     f"{' (' + str(len(rec['attempts'])) + ' runs)' if len(rec['attempts']) > 1 else ''} | "
                     f"{last.get('peak_host_gib', '')} | {last.get('peak_gpu_gib', '')} | {summary} |")
    if doc.get("refine_schedule"):
        lines += ["", f"Refine schedule: {doc['refine_schedule']}"]
    per_block = doc.get("per_block_median_s") or {}
    if per_block:
        phases = list(dict.fromkeys(k for v in per_block.values() for k in v if k != "blocks"))
        lines += ["", "Seconds per block (median over the blocks computed after the first; the work dir's log):", "",
                  "| stage | blocks | " + " | ".join(phases) + " |", "|---" * (len(phases) + 2) + "|"]
        lines += [f"| {st} | {v['blocks']} | " + " | ".join(f"{v[p]:.2f}" if p in v else "" for p in phases) + " |"
                  for st, v in per_block.items()]
    lines += ["", "| bytes | GiB |", "| --- | --- |"]
    lines += [f"| {k} | {v / GIB:.2f} |" for k, v in doc["sizes_bytes"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="directory for the model, work dirs and state")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where the generated model goes (default ROOT/model), e.g. another file system than the "
                         "work dirs'")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                    help="the model shape (kimi-k2-block: one Kimi-K2 MoE block)")
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (default: the shape's: 48, or 1 for kimi-k2-block)")
    ap.add_argument("--small", action="store_true", help="a narrow model of the same architecture (smoke runs)")
    ap.add_argument("--scaling", action="store_true", help="1 vs --nproc processes on init-sgptq and refine")
    ap.add_argument("--stages", type=lambda v: v.split(","), default=["init-sgptq", "refine"],
                    help="scaling: the stages to time, comma-separated (default init-sgptq,refine)")
    ap.add_argument("--nproc", type=int, default=1, help="expert-parallel processes (one per GPU)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--skip-init", action="store_true",
                    help="pipeline: leave out the separate init-sgptq command (refine runs SGPTQ per block itself)")
    ap.add_argument("--no-refit", action="store_true",
                    help="init-sgptq --no-refit (the paper's SGPTQ); refine's in-loop init takes the stage's options")
    ap.add_argument("--epochs", type=int, default=1, help="refine epochs (reduced budget)")
    ap.add_argument("--steps-per-epoch", type=int, default=8, help="refine steps per epoch (reduced budget)")
    ap.add_argument("--batch-rows", type=int, default=0,
                    help="refine: routed rows per optimizer step (replaces --steps-per-epoch; the paper's: 2097152)")
    ap.add_argument("--e2e-steps", default="", help="refine --e2e-steps (default: moesq's)")
    ap.add_argument("--calib", default="",
                    help="calibration text for moesq calibrate (default: moesq's embedded sample)")
    ap.add_argument("--n-train", type=int, default=0, help="calibration training sequences (default: moesq's)")
    ap.add_argument("--seq-len", type=int, default=0, help="calibration tokens per sequence (default: moesq's)")
    ap.add_argument("--n-val", type=int, default=0, help="calibration validation sequences (default: moesq's)")
    ap.add_argument("--n-init", type=int, default=0, help="calibration one-shot sequences (default: moesq's)")
    ap.add_argument("--tag", default="", help="a word added to the results' file names (e.g. full-budget)")
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--deadline-s", type=float, default=None, help="stop (resumably) after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="results directory (JSON + Markdown)")
    args = ap.parse_args(argv)
    if args.no_refit and (args.skip_init or args.scaling):
        ap.error("--no-refit sets the init-sgptq stage's options: it needs that stage (not --skip-init or --scaling)")
    deadline = time.time() + args.deadline_s if args.deadline_s else None
    args.root.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args)
    doc = scaling(args, args.root, deadline) if args.scaling else pipeline(args, args.root, deadline)
    doc = {"header": header(args, cfg), **doc}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        gpu = "h200" if any("H200" in g for g in doc["header"]["gpus"]) else ("gpu" if doc["header"]["gpus"] else "cpu")
        n = len(doc["header"]["gpus"])
        stem = (f"real_size_{'scaling' if args.scaling else 'run'}_"
                f"{'' if args.shape == 'qwen3-30b-a3b' else args.shape + '_'}"
                f"{args.tag + '_' if args.tag else ''}{gpu}{f'x{n}' if n > 1 else ''}_"
                f"{doc['header']['date'][:10]}_{doc['header']['commit']}")
        (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=2))
        (args.out / f"{stem}.md").write_text(markdown(doc))
        print(f"wrote {args.out / stem}.json and .md")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
