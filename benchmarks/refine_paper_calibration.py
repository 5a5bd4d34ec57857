"""`moesq refine` at the paper's calibration on a real-size model, measured: GPU-minutes per block, peak memory,
whether the default resource options hold, and the extrapolated time of a 48-layer model.

    python benchmarks/refine_paper_calibration.py --root DIR --calib calib-docs.txt.xz --out benchmarks/results \
        --deadline-s 450                                   # one H200; rerun while it exits 3
    python benchmarks/refine_paper_calibration.py --root DIR --small --device cpu --seq-len 32 --n-train 8 \
        --n-init 4 --n-val 4 --batch-rows 64 --epochs 1    # a CPU smoke run (the embedded calibration sample)

Writes a random-weight Qwen3-30B-A3B-shaped model with --layers 2 under DIR (full width: 128 experts of
2048 × 768, top-8; `real_size_run.generate`) and runs, as a user would, one command:

    moesq refine -m MODEL -w WORK --calib CALIB --seq-len 4096 --n-train 960 --n-init 64 --n-val 128 \
        --batch-rows 2097152 --epochs 80 --e2e-steps 0 --json RESULT

960 training + 64 one-shot sequences, both trained on: 1,024 sequences of 4,096 tokens, 1,280 Lion steps of
2,097,152 routed rows per block (the paper's steps and rows per step), with no resource option (no
--micro-batch-rows, --chunk-gb, --cache-gb, --batch-size): the defaults must work. `moesq refine` calibrates the
work dir itself. Every calibration and budget option can be overridden here (same names), resource options can
be added (same names); the results record what was passed.

Resumable like real_size_run.py (DIR/refine_paper_state.json): with --deadline-s S the command is stopped with
SIGTERM after S seconds of this invocation (moesq keeps the finished blocks and resumes from them) and this
script exits with status 3: run the same command again to continue. A block's work is lost when it is stopped,
so S must leave room for the one-time costs and one whole block. At the end it writes
OUT/refine_paper_calibration.json and .md (relative paths only); see `results` for how each number is measured.
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_size_run import (  # noqa: E402
    PHASES_LINE,
    REFINE_LINE,
    State,
    block_phases,
    generate,
    model_config,
    moesq,
    refine_schedule,
    relative,
    run_step,
)

STATE_FILE = "refine_paper_state.json"
STEM = "refine_paper_calibration"
LAYERS_EXTRAPOLATED = 48  # Qwen3-30B-A3B's MoE layers
# (option, default): the measured protocol's calibration and refine budget, passed as given.
PROTOCOL = (("calib", ""), ("seq_len", 4096), ("n_train", 960), ("n_init", 64), ("n_val", 128),
            ("batch_rows", 2097152), ("epochs", 80), ("e2e_steps", "0"))
# Resource options: passed only when given (the measured run gives none).
RESOURCE = (("micro_batch_rows", int), ("chunk_gb", float), ("cache_gb", float), ("batch_size", int))
# moesq run with its GPU memory capped at a smaller card's (torch.cuda.set_per_process_memory_fraction), as a
# process of its own: `python -c CAPPED GIB moesq-args...`
CAPPED = ("import sys; from moesq_core.memory import use_expandable_segments; use_expandable_segments(); "
          "import torch; torch.cuda.set_per_process_memory_fraction(min(1.0, float(sys.argv[1]) * 2**30 / "
          "torch.cuda.get_device_properties(0).total_memory)); sys.argv = ['moesq', *sys.argv[2:]]; "
          "from moesq_cli.app import main; main()")

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
ATTEMPT_LINE = re.compile(r" moesq: moesq refine( |$)")
OOM = re.compile(r"OutOfMemoryError|out of device memory|CUDA out of memory|out of memory (refining|solving)")


def flag(opt: str) -> str:
    return "--" + opt.replace("_", "-")


def refine_command(args, model: Path, work: Path, result: Path) -> list[str]:
    """The `moesq refine` arguments: the protocol's options (all of them, as given), the resource options given."""
    out = ["refine", "-m", str(model), "-w", str(work)]
    for opt, _ in PROTOCOL:
        value = getattr(args, opt)
        if opt == "calib":
            if value:  # not given: moesq's embedded sample (smoke runs)
                out += [flag(opt), str(Path(value).resolve())]
        else:
            out += [flag(opt), str(value)]
    for opt, _ in RESOURCE:
        if getattr(args, opt) is not None:
            out += [flag(opt), str(getattr(args, opt))]
    if args.device != "auto":
        out += ["--device", args.device]
    return [*out, "--json", str(result)]


def resource_options(args) -> dict:
    return {flag(opt): getattr(args, opt) for opt, _ in RESOURCE if getattr(args, opt) is not None}


# -- reading the work dir's log ---------------------------------------------------------------------------------
def _stamp(line: str) -> float | None:
    m = STAMP.match(line)
    return _dt.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def attempts_from_log(log: Path) -> list[dict]:
    """Per `moesq refine` run in the work dir's log (each starts with its "moesq refine ..." line), the one-time
    costs it paid, in seconds, from the log lines' time stamps:

    - calibration: from the run's start to its "calibration: {...}" line (model check, tokenizer, reading and
      tokenizing the calibration text, writing the splits); absent when the work dir was already calibrated;
    - model_load: from the line before "refine schedule:" (the calibration's, or the run's start) to that line
      (the model loaded for the stage, the calibration file read, the schedule computed);
    - embedding: from the schedule line to the block loop's start (embedding the calibration set through the
      model's embeddings, with the stage's set-up: end-to-end plan, states check, saved states loaded on a
      resume). The loop's start is the first block's phases line less the sum of its phases (the engine's phase
      clock starts with the loop), or the "resuming after layer" line when there is one.
    """
    runs: list[dict] = []
    cur: dict | None = None
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        t = _stamp(line)
        if t is None:
            continue
        if ATTEMPT_LINE.search(line):
            cur = {"start": t, "last": t}
            runs.append(cur)
            continue
        if cur is None:
            continue
        if " moesq: calibration: {" in line:
            cur["calibration"] = round(t - cur["start"], 2)
        elif " moesq: refine schedule: " in line and "model_load" not in cur:
            cur["model_load"] = round(t - cur["last"], 2)
            cur["schedule_at"] = t
        elif "schedule_at" in cur and "embedding" not in cur:
            loop_start = None
            if re.search(r": refine: resuming after layer \d+", line):
                loop_start = t
            elif m := block_phase_line(line):
                loop_start = t - sum(m[1].values())
            if loop_start is not None:
                cur["embedding"] = round(max(loop_start - cur["schedule_at"], 0.0), 2)
        cur["last"] = t
    return [{k: v for k, v in r.items() if k in ("calibration", "model_load", "embedding")} for r in runs]


def block_phase_line(line: str) -> tuple[int, dict] | None:
    """(layer, phases) of an engine "refine: layer N phases (s): {...}" line."""
    m = PHASES_LINE.search(line)
    if m is None or m["stage"] != "refine":
        return None
    return int(m["layer"]), ast.literal_eval(m["phases"])


def blocks_from_log(log: Path) -> dict[int, dict]:
    """Per computed block (its last computation: a block stopped mid-way is computed again), its phases from the
    engine's line, and its compress phase split into the in-loop init and the refinement from the refine
    method's "refine: N experts in K chunk(s), init X s, refinement Y s" lines (one per engine chunk of experts,
    summed; those of a block stopped before its phases line are dropped)."""
    out: dict[int, dict] = {}
    pending: list[tuple[float, float]] = []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if ATTEMPT_LINE.search(line):
            pending = []
        elif m := REFINE_LINE.search(line):
            pending.append((float(m["init"]), float(m["train"])))
        elif got := block_phase_line(line):
            layer, phases = got
            if "compress" in phases:
                out[layer] = {"phases": phases, "compress_split": {
                    "in_loop_init": round(sum(p[0] for p in pending), 2),
                    "refinement": round(sum(p[1] for p in pending), 2), "engine_chunks": len(pending)}}
            pending = []
    return out


PEAKS_LINE = re.compile(r"moesq\.engine: refine: layer (?P<layer>\d+) peak GPU memory per phase "
                        r"\(GiB allocated, reserved\): (?P<peaks>\{.*\})")
PLAN_LINE = re.compile(r"refine memory: ~(?P<gib>[\d.]+) (?P<unit>GiB|MiB) per block at peak")


def peaks_from_log(log: Path) -> dict[int, dict]:
    """Per block, the engine's peak device memory per phase: {phase: [allocated, reserved] GiB} (torch's caching
    allocator, this process alone), from its lines (one after the block's work, one after its propagation; a later
    computation of a phase replaces an earlier one)."""
    out: dict[int, dict] = {}
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if m := PEAKS_LINE.search(line):
            out.setdefault(int(m["layer"]), {}).update(ast.literal_eval(m["peaks"]))
    return out


def plan_from_log(log: Path) -> float | None:
    """The refine memory plan's predicted peak per block (GiB), as the last run printed it."""
    got = [float(m["gib"]) / (1024 if m["unit"] == "MiB" else 1) for line in
           (log.read_text(errors="replace").splitlines() if log.is_file() else []) if (m := PLAN_LINE.search(line))]
    return got[-1] if got else None


def blocks_done(work: Path) -> int:
    """The refine stage's blocks recorded in the work dir's manifest."""
    try:
        m = json.loads((work / "manifest.json").read_text())
    except (OSError, ValueError):
        return 0
    return len(m.get("stages", {}).get("refine", {}).get("blocks", {}))


def oom_in(*logs: Path) -> bool:
    return any(OOM.search(p.read_text(errors="replace")) for p in logs if p.is_file())


# -- the results -------------------------------------------------------------------------------------------------
def state_saves(compute_s: float, between_s: float, save_s: float, layers: int = LAYERS_EXTRAPOLATED) -> int:
    """How many of the (layers - 1) moments between two blocks save the calibration states for a resume, by the
    engine's rule (StateCheckpoint.due): at least EVERY_S and SAVE_COST_RATIO × the last save's duration since the
    last save (or the stage's start), with every block taking compute_s + between_s and every save save_s."""
    from moesq_core.compression.state_checkpoint import EVERY_S, SAVE_COST_RATIO

    saves, elapsed, last = 0, 0.0, 0.0
    for _ in range(layers - 1):
        elapsed += compute_s + between_s
        if elapsed >= EVERY_S and elapsed >= SAVE_COST_RATIO * last:
            saves, elapsed, last = saves + 1, 0.0, save_s
    return saves


def extrapolate(one_time: dict, compute_s: float, between_s: float | None, save_s: float = 0.0,
                layers: int = LAYERS_EXTRAPOLATED) -> float:
    """Seconds of a `layers`-layer run: the one-time costs once, `layers` × the mean compute per block,
    (layers - 1) × what happens between two blocks (install + propagation through a layer) and the saves of the
    states for a resume that the engine's cadence makes (state_saves) × the measured save."""
    between_s = between_s or 0.0
    return (sum(one_time.values()) + layers * compute_s + (layers - 1) * between_s
            + state_saves(compute_s, between_s, save_s, layers) * save_s)


def results(root: Path, work: Path, state: dict, command: list[str], options: dict, resource: dict, cfg: dict,
            gpu: str, commit: str, date: str, calib_name: str) -> dict:
    """The results document (paths relative to `root`). gpu_min_per_block is the mean over the computed blocks
    of the work dir manifest's per-block `seconds` (StageLedger.record_block: from the block's start, which waits
    for the previous block's background artifact write, to its artifact packed: routing, dense weights, the
    in-loop init and the refinement, activation ranges, packing), / 60."""
    log = work / "logs" / "moesq.log"
    manifest = json.loads((work / "manifest.json").read_text()) if (work / "manifest.json").is_file() else {}
    stage = manifest.get("stages", {}).get("refine", {})
    timings = stage.get("block_timings", {})
    from_log = blocks_from_log(log)
    per_block = []
    for k in sorted(timings, key=int):
        rec = {"layer": int(k), "seconds": timings[k]["seconds"]}
        rec.update(from_log.get(int(k), {}))
        per_block.append(rec)
    secs = [b["seconds"] for b in per_block]
    compute_s = statistics.mean(secs) if secs else None

    # between two blocks: install, propagation of the states through the layer, saving them for a resume
    # every propagation the log shows, a resumed run's too (it propagates the loaded blocks without computing them)
    propagated = [phases for line in (log.read_text(errors="replace").splitlines() if log.is_file() else [])
                  if (got := block_phase_line(line)) and "propagate" in (phases := got[1])]
    between = [sum(ph.get(p, 0.0) for p in ("install", "propagate")) for ph in propagated]
    between_s = statistics.mean(between) if between else None
    saves = [ph["save states"] for ph in propagated if "save states" in ph]
    save_s = statistics.mean(saves) if saves else 0.0
    propagate = [ph["propagate"] for ph in propagated]
    peaks = peaks_from_log(log)
    for b in per_block:
        if b["layer"] in peaks:
            b["peak_gpu_gib"] = peaks[b["layer"]]
    torch_peak = max((r for p in peaks.values() for _, r in p.values()), default=None)
    plan_gib = plan_from_log(log)
    runs = attempts_from_log(log)
    one_time, where = {}, {}
    for key in ("model_load", "calibration", "embedding"):
        for i, r in enumerate(runs):
            if key in r:
                one_time[key], where[key] = r[key], i + 1
                break
    missing = [k for k in ("model_load", "calibration", "embedding") if k not in one_time]

    refine = state["steps"].get("refine", {})
    attempts = refine.get("attempts", [])
    gpu_peaks = [g for a in attempts for g in a.get("peak_gpu_gib", [])]
    final_rc = attempts[-1]["rc"] if attempts else None
    oom = oom_in(log, root / "commands.log")

    cal = manifest.get("calibration", {})
    seqs = cal.get("sequences", {})
    top_k = cfg["num_experts_per_tok"]
    trained = seqs.get("train", 0) + seqs.get("init", 0)
    calibration = {"source": calib_name, "sequences": seqs, "seq_len": cal.get("seq_len"), "tokens": cal.get("tokens"),
                   "documents": cal.get("documents"), "trained_sequences": trained,
                   "trained_tokens": trained * (cal.get("seq_len") or 0),
                   "routed_rows_per_block": trained * (cal.get("seq_len") or 0) * top_k}

    hours = sentence = None
    L = LAYERS_EXTRAPOLATED
    if compute_s is not None and not missing:
        total = extrapolate(one_time, compute_s, between_s, save_s, L)
        n_saves = state_saves(compute_s, between_s or 0.0, save_s, L)
        hours = round(total / 3600, 2)
        measured_on = f"{len(between)} measured" if between else "none"
        sentence = (
            f"{L}-layer time = one-time costs {sum(one_time.values()):.1f} s "
            f"(model load {one_time['model_load']:.1f} s "
            f"+ calibration tokenization {one_time['calibration']:.1f} s + embedding the calibration set "
            f"{one_time['embedding']:.1f} s; each measured once, in the first run of the command that did it, from "
            f"the work dir log's time stamps, on this {cfg['num_hidden_layers']}-layer model) "
            f"+ {L} × {compute_s:.1f} s (the mean compute per block over the "
            f"{len(secs)} blocks measured here, {', '.join(f'{s:.1f}' for s in secs)} s: the work dir manifest's "
            f"per-block seconds, which hold routing, the dense weights, the in-loop SGPTQ init, the refinement, the "
            f"activation ranges and the artifact write: its packing and the wait for the previous block's "
            f"background write) + {L - 1} × {between_s or 0.0:.2f} s (between two blocks: installing the block and "
            f"propagating the calibration states through its layer; the engine's phase lines, {measured_on}) "
            f"+ {n_saves} × {save_s:.2f} s (saving the states for a resume, {len(saves)} measured; the engine saves "
            f"once at least a minute and 20 × the last save's duration have passed, so {n_saves} of the {L - 1} "
            f"moments between blocks save) = {total:.0f} s = {hours:.2f} h on one GPU. "
            f"The first block's time includes the process's warm-up (compilation), so the mean of {len(secs)} "
            f"blocks overstates a {L}-layer run's steady state.")
    elif compute_s is None:
        sentence = "not extrapolated: no block of the refine stage was recorded in the work dir manifest"
    else:
        sentence = f"not extrapolated: the log lacks the one-time cost(s) {', '.join(missing)}"

    doc = {
        "gpu": gpu, "commit": commit, "date": date,
        "command": "moesq " + " ".join(relative(command, root)),
        "model_shape": {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_experts", "moe_intermediate_size",
                                            "num_experts_per_tok", "vocab_size")},
        "options": options, "resource_options": resource,
        "calibration": calibration,
        "schedule": refine_schedule(log),
        "blocks_measured": len(secs),
        "gpu_min_per_block": round(compute_s / 60, 3) if compute_s is not None else None,
        "gpu_min_per_block_source": "the work dir manifest's per-block seconds (stages.refine.block_timings), mean "
                                    "over the measured blocks",
        "gpu_min_per_block_after_first": round(statistics.mean(secs[1:]) / 60, 3) if len(secs) > 1 else None,
        "per_block": per_block,
        "between_blocks_s": round(between_s, 2) if between_s is not None else None,
        "state_save_s": round(save_s, 2),
        "one_time_s": one_time, "one_time_from_run": where, "one_time_per_run_s": runs,
        "plan_gib": plan_gib,
        "plan_gib_source": "the refine memory line's predicted peak per block (the work dir log)",
        "peak_gpu_gib": torch_peak,
        "peak_gpu_gib_source": "torch's peak reserved memory per block phase (the engine's log lines), max over the "
                               "measured blocks and phases",
        "peak_within_plan": (torch_peak <= plan_gib) if torch_peak is not None and plan_gib else None,
        "plan_over_peak": round(plan_gib / torch_peak, 3) if torch_peak and plan_gib else None,
        "peak_gpu_gib_nvidia_smi": max(gpu_peaks) if gpu_peaks else None,
        "peak_gpu_gib_nvidia_smi_source": "nvidia-smi memory.used (the whole GPU: every process and the CUDA "
                                          "context), sampled every 0.5 s, max over the runs",
        "gpu_memory_cap_gib": resource.get("gpu_memory_gib"),
        "propagation_s_per_layer": round(statistics.mean(propagate), 2) if propagate else None,
        "propagation_s_per_layer_source": "the engine's 'propagate' phase (running the calibration states through "
                                          "the layer with its compressed block, from and back to host memory), mean "
                                          "over every propagation in the log",
        "peak_host_gib": max((a.get("peak_host_gib", 0) for a in attempts), default=None),
        "oom": oom, "exit_status": final_rc,
        "wall_s": [a["wall_s"] for a in attempts],
        "attempts": attempts,
        "generate_wall_s": sum(a["wall_s"] for a in state["steps"].get("generate", {}).get("attempts", [])),
        "model_bytes": state["steps"].get("generate", {}).get("model_bytes"),
        "refine_result": refine.get("result"),
        "per_block_median_s": block_phases(log).get("refine"),
        "extrapolated_48_layer_hours": hours,
        "extrapolation": sentence,
    }
    return relative(doc, root)


def _cell(v) -> str:
    return "—" if v is None else str(v)


def markdown(doc: dict) -> str:
    s = doc["model_shape"]
    gmin = doc["gpu_min_per_block"]
    hours = doc["extrapolated_48_layer_hours"]
    lines = [f"# `moesq refine` at the paper's calibration: random Qwen3-MoE, {s['num_hidden_layers']} layers × "
             f"{s['num_experts']} experts of {s['hidden_size']} × {s['moe_intermediate_size']}, "
             f"top-{s['num_experts_per_tok']}",
             "", "    " + doc["command"], "",
             "| date | GPU | commit | GPU-min per block | plan GiB | peak GiB (torch, reserved) | peak GiB "
             "(nvidia-smi) | OOM | propagation s/layer | 48-layer hours (extrapolated) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
             f"| {doc['date']} | {doc['gpu']} | {doc['commit']} | {'—' if gmin is None else f'{gmin:.2f}'} | "
             f"{_cell(doc['plan_gib'])} | {_cell(doc['peak_gpu_gib'])} | {_cell(doc['peak_gpu_gib_nvidia_smi'])} | "
             f"{'yes' if doc['oom'] else 'no'} | {_cell(doc['propagation_s_per_layer'])} | "
             f"{'—' if hours is None else f'{hours:.2f}'} |", "", f"Status: {doc.get('status', 'complete')}.", ""]
    if doc.get("gpu_memory_cap_gib"):
        lines += [f"The moesq process was capped at {doc['gpu_memory_cap_gib']} GiB of GPU memory "
                  "(torch.cuda.set_per_process_memory_fraction).", ""]
    cal = doc["calibration"]
    seqs = cal["sequences"]
    lines += [f"Calibration ({cal['source']}): {seqs.get('train', 0)} training + {seqs.get('init', 0)} one-shot "
              f"(both trained on) + {seqs.get('val', 0)} validation sequences of {cal['seq_len']} tokens; "
              f"{cal['routed_rows_per_block']:,} routed rows per block "
              f"(trained tokens × top-{s['num_experts_per_tok']}). "
              f"Resource options: {doc['resource_options'] or 'none (the defaults)'}. "
              f"Runs of the command: {len(doc['wall_s'])} ({', '.join(f'{w:.0f}' for w in doc['wall_s'])} s); "
              f"exit status {doc['exit_status']}.", ""]
    if doc["schedule"]:
        lines += [f"Schedule: {doc['schedule']}", ""]
    if doc["per_block"]:
        phases = list(dict.fromkeys(p for b in doc["per_block"] for p in b.get("phases", {})))
        lines += ["Seconds per block (block seconds: the manifest's; phases: the engine's log lines; compress = "
                  "in-loop init + refinement):", "",
                  "| block | seconds | " + " | ".join(phases) + " | in-loop init | refinement |",
                  "|---" * (len(phases) + 4) + "|"]
        for b in doc["per_block"]:
            split = b.get("compress_split", {})
            lines.append(f"| {b['layer']} | {b['seconds']:.1f} | "
                         + " | ".join(f"{b.get('phases', {}).get(p, 0.0):.2f}" for p in phases)
                         + f" | {split.get('in_loop_init', '')} | {split.get('refinement', '')} |")
        lines.append("")
    peaked = [b for b in doc["per_block"] if b.get("peak_gpu_gib")]
    if peaked:
        lines += ["Peak GPU memory per phase (GiB allocated / reserved, torch's allocator):", ""]
        for b in peaked:
            lines.append(f"- block {b['layer']}: " + ", ".join(f"{k} {a} / {r}" for k, (a, r) in
                                                                b["peak_gpu_gib"].items()))
        lines.append("")
    lines += [f"Extrapolation: {doc['extrapolation']}", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="directory for the model, the work dir and the state")
    ap.add_argument("--model-dir", type=Path, default=None, help="where the generated model goes (default ROOT/model)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the generated model (default 2)")
    ap.add_argument("--small", action="store_true", help="a narrow model of the same architecture (smoke runs)")
    ap.add_argument("--device", default="auto", help="moesq's --device (auto: not passed; cpu for smoke runs)")
    for opt, default in PROTOCOL:
        ap.add_argument(flag(opt), type=type(default), default=default,
                        help=f"moesq refine {flag(opt)} (default {default or 'moesq: the embedded sample'})")
    for opt, typ in RESOURCE:
        ap.add_argument(flag(opt), type=typ, default=None, help=f"moesq refine {flag(opt)} (default: not passed)")
    ap.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="cap moesq's GPU memory at this many GiB (a smaller card's), as a per-process fraction")
    ap.add_argument("--deadline-s", type=float, default=None, help="stop (resumably, exit 3) after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help=f"results directory ({STEM}.json and .md)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.time() + args.deadline_s if args.deadline_s else None
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = model_config(argparse.Namespace(shape="qwen3-30b-a3b", small=args.small, layers=args.layers))
    options = {opt: getattr(args, opt) for opt, _ in PROTOCOL}
    resource = resource_options(args)
    if args.gpu_memory_gib is not None:
        resource["gpu_memory_gib"] = args.gpu_memory_gib
    state = State(root, {"mode": "refine-paper-calibration", "config": cfg, "device": args.device, **options,
                         "resource_options": resource}, name=STATE_FILE)
    model = (args.model_dir or root / "model").resolve()
    work, res = root / "work", root / "results"
    res.mkdir(parents=True, exist_ok=True)
    generate(state, model, cfg, args.device)
    command = refine_command(args, model, work, res / "refine.json")
    before = blocks_done(work)

    def note_blocks() -> list:
        attempts = state.step("refine")["attempts"]
        if attempts and "blocks_done" not in attempts[-1]:
            attempts[-1]["blocks_done"] = blocks_done(work)
            state.save()
        return attempts

    import torch

    from moesq_core.serving.bench.harness import git_commit

    def report(status: str) -> str:
        """Write the results as they stand (also after a stop at the deadline: what was measured so far)."""
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
        recorded = {**options, "calib": Path(args.calib).name if args.calib else "(moesq's default)"}
        doc = results(root, work, state.data, command, recorded, resource, cfg, gpu,
                      os.environ.get("MOESQ_COMMIT") or git_commit(),
                      _dt.datetime.now(_dt.timezone.utc).date().isoformat(),
                      Path(args.calib).name if args.calib else "moesq's embedded calibration sample")
        doc["status"] = status
        text = markdown(doc)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{STEM}.json").write_text(json.dumps(doc, indent=2) + "\n")
            (args.out / f"{STEM}.md").write_text(text)
            print(f"wrote {args.out / STEM}.json and .md ({status})")
        return text

    try:
        argv = (moesq(*command) if args.gpu_memory_gib is None
                else [sys.executable, "-c", CAPPED, str(args.gpu_memory_gib), *command])
        run_step(state, "refine", argv, root / "commands.log", deadline, res / "refine.json")
    except SystemExit as e:
        attempts = note_blocks()
        if e.code == 3:
            done = attempts[-1]["blocks_done"] if attempts else blocks_done(work)
            if done == before and before < args.layers:
                print(f"warning: no block finished in this run ({before} of {args.layers} done before and after); "
                      "a block stopped at the deadline is computed again from its start, so --deadline-s must leave "
                      "room for the one-time costs and a whole block", file=sys.stderr)
            report(f"partial: stopped at the deadline with {done} of {args.layers} blocks done (run the same command "
                   "again to resume)")
            raise
        if not oom_in(work / "logs" / "moesq.log", root / "commands.log"):
            raise
        print(e.code, file=sys.stderr)
        status = 1  # out of memory with these options: that is a result too
    else:
        note_blocks()
        status = 0
    print(report("complete" if status == 0 else "out of memory"))
    return status

if __name__ == "__main__":
    sys.exit(main())
