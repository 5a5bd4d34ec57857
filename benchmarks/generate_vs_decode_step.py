"""`moesq generate` against the decode benchmark's step, on a Qwen3-30B-A3B-shaped packed model (one GPU).

    python benchmarks/generate_vs_decode_step.py --root DIR --out benchmarks/results  # 4 layers, batch 1 and 16
    python benchmarks/generate_vs_decode_step.py --root DIR --layers 48 --out benchmarks/results  # the whole model
    python benchmarks/generate_vs_decode_step.py --root DIR --small --device cpu --out DIR        # a CPU smoke run

Builds under --root, once (later runs reuse it): a random-weight checkpoint of Qwen3-30B-A3B's shape with
--layers decoder layers (`benchmarks/synthetic_model.py`; every layer is the real block shape), its one-shot
RTN stage (`moesq init-sgptq --method rtn`, a small calibration: the weights are random, only speed is measured)
and its pack (`moesq pack`, --format). Then, on the pack loaded once, per batch size:

- generate: `generate_batch`, the code `moesq generate` runs (prompts tokenized and left-padded, prefill, then
  the decode step replayed as a CUDA graph, the finished flags read every 8 steps); one warm-up call, then
  --repeats timed calls; the median prefill and decode tokens/s;
- step: `e2e_decode.run_decode`, the decode benchmark (the same step captured, replayed alone, timed by CUDA
  events; the median step).

generate / step is the share of the step's speed that `moesq generate` keeps while decoding. Writes
generate_vs_decode_step_<gpu>_<date>_<commit>.{json,md} into --out. Without a CUDA GPU (and without
--device cpu) it exits 2 with one line.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import lzma
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from real_size_run import SMALL  # noqa: E402  (the same architecture at a width a CPU runs in seconds)
from synthetic_model import QWEN3_30B_A3B, qwen3_moe_config, write_random_qwen3_moe  # noqa: E402

from moesq_core.compression.config import DEFAULT_EVAL  # noqa: E402
from moesq_core.formats import FORMAT_NAMES  # noqa: E402
from moesq_core.serving.bench.harness import git_commit  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="where the model, the work dir and the pack go (reused)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3-30B-A3B has 48)")
    ap.add_argument("--format", default="p48-nvfp4", choices=FORMAT_NAMES)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-chars", type=int, default=480, help="characters per prompt (about 4 per token)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls per batch size (after a warm-up)")
    ap.add_argument("--dtype", default="auto", help="generate's --dtype")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="a small width (smoke runs)")
    args = ap.parse_args(argv)
    for name in ("layers", "prompt_chars", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the first new token comes from the prefill)")
    if min(args.batches) < 1:
        ap.error("--batches must be at least 1")
    return args


def prompts(n: int, chars: int) -> list[str]:
    """n prompts from the embedded evaluation text, of slightly different lengths (so a batch is left-padded)."""
    with lzma.open(DEFAULT_EVAL, "rt") as f:
        text = " ".join(f.read(n * chars * 2).split())
    out, at = [], 0
    for i in range(n):
        size = chars - 8 * (i % 4)
        out.append(text[at:at + size])
        at += size
    return out


def build_pack(args) -> Path:
    """The random model, its init-rtn stage and its pack under --root (each step skipped when done)."""
    shape = {**QWEN3_30B_A3B, "num_hidden_layers": args.layers, **(SMALL if args.small else {})}
    tag = f"L{args.layers}{'-small' if args.small else ''}"
    model = args.root / f"qwen3-30b-a3b-{tag}"
    write_random_qwen3_moe(model, qwen3_moe_config(**shape), device=args.device)
    wd, pack = args.root / f"work-{tag}-{args.format}", args.root / f"packed-{tag}-{args.format}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cli = [sys.executable, "-m", "moesq_cli"]
    if not (pack / "moesq_pack.json").is_file():
        for argv in (["init-sgptq", "-m", model, "-w", wd, "--method", "rtn", "--format", args.format,
                      "--seq-len", "64", "--n-train", "2", "--n-val", "2", "--n-init", "8", "--device", args.device,
                      "--quiet"],
                     ["pack", wd, "--out", pack, "--overwrite", "--quiet"]):
            subprocess.run([*cli, *map(str, argv)], check=True, env=env)
    return pack


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def measure(pack, batch: int, args) -> dict:
    from moesq_core.serving.bench.e2e_decode import run_decode
    from moesq_core.serving.generate import generate_batch

    texts = prompts(batch, args.prompt_chars)
    generate_batch(pack, texts, max_new_tokens=args.new_tokens)  # warm-up: kernels compile, autotuners settle
    runs = [generate_batch(pack, texts, max_new_tokens=args.new_tokens) for _ in range(args.repeats)]
    gen = {"prompt_tokens": runs[0]["prefill"]["tokens"], "cuda_graph": runs[0]["decode"]["cuda_graph"],
           "prefill_tokens_per_s": median(r["prefill"]["tokens_per_second"] for r in runs),
           "decode_tokens_per_s": median(r["decode"]["tokens_per_second"] for r in runs),
           "decode_step_ms": median(1e3 * r["decode"]["seconds"] / r["decode"]["steps"] for r in runs),
           "tokens_per_s": median(r["tokens_per_second"] for r in runs),
           "capture_s": median(r["decode"]["capture_seconds"] for r in runs),
           "runs": [{k: r[k] for k in ("prefill", "decode", "tokens_per_second", "new_tokens")} for r in runs]}
    if "graph_error" in runs[0]["decode"]:
        gen["graph_error"] = runs[0]["decode"]["graph_error"]
    prompt_len = max(1, round(gen["prompt_tokens"] / batch))
    step = run_decode(pack.model, batch, prompt_len, args.new_tokens, 10.0, torch.Generator(pack.device).manual_seed(0))
    ratio = round(gen["decode_tokens_per_s"] / step["tokens_per_s"], 3) if gen["decode_tokens_per_s"] else None
    return {"batch": batch, "generate": gen, "step": step, "generate_vs_step": ratio}


def markdown(doc: dict) -> str:
    lines = [
        "# `moesq generate` vs the decode benchmark's step",
        "",
        f"{doc['date']} · {doc['gpu']} · torch {doc['torch']} · transformers {doc['transformers']} · commit "
        f"`{doc['commit']}` · {doc['model']}, {doc['format']}, {doc['dtype']} · {doc['new_tokens']} new tokens per "
        f"prompt, ~{doc['prompt_chars']}-character prompts",
        "",
        "generate: `generate_batch` (what `moesq generate` runs), median of the timed calls; step: "
        "`e2e_decode.run_decode` (the same step replayed alone, median step); generate / step compares decode "
        "tokens/s.",
        "",
        "| batch | prompt tokens | generate prefill tok/s | generate decode tok/s | generate ms/step | CUDA graph "
        "| step tok/s | step ms | generate / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | error: {r['error'][:160]} | | | | | | | |")
            continue
        g, s = r["generate"], r["step"]
        lines.append(f"| {r['batch']} | {g['prompt_tokens']} | {g['prefill_tokens_per_s']} "
                     f"| {g['decode_tokens_per_s']} "
                     f"| {g['decode_step_ms']} | {g['cuda_graph']} | {s['tokens_per_s']} | {s['step_ms']} "
                     f"| {r['generate_vs_step']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: generate_vs_decode_step needs a CUDA GPU (none is visible); --device cpu --small is a smoke run",
              file=sys.stderr)
        return 2
    import transformers

    from moesq_core.serving.generate import load_pack

    t0 = time.perf_counter()
    path = build_pack(args)
    build_s = time.perf_counter() - t0
    pack = load_pack(path, device=args.device, dtype=args.dtype)
    gpu = torch.cuda.get_device_name(pack.device) if pack.device.type == "cuda" else "cpu"
    date, commit = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), git_commit()
    doc = {"benchmark": "moesq generate vs the decode benchmark's step",
           "model": f"Qwen3-30B-A3B-shaped{' (small width)' if args.small else ''}, {args.layers} layers, "
                    "random weights",
           "layers": args.layers, "format": args.format, "dtype": pack.dtype, "experts_module": pack.experts_modules,
           "date": date, "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
           "commit": commit, "build_s": round(build_s, 1), "load_s": round(pack.load_seconds, 1),
           "new_tokens": args.new_tokens, "prompt_chars": args.prompt_chars, "repeats": args.repeats, "runs": []}
    slug = "h200" if "H200" in gpu else gpu.split()[-1].lower() if pack.device.type == "cuda" else "cpu"
    stem = f"generate_vs_decode_step_{slug}_{date}_{commit[:7]}"
    args.out.mkdir(parents=True, exist_ok=True)
    for batch in args.batches:
        try:
            rec = measure(pack, batch, args)
        except torch.OutOfMemoryError as e:  # the next batch size may still fit
            rec = {"batch": batch, "error": f"{type(e).__name__}: {e}"[:400]}
        doc["runs"].append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "generate"} | {"generate": {
            k: v for k, v in rec.get("generate", {}).items() if k != "runs"}}), flush=True)
        (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))  # after every batch size
    (args.out / f"{stem}.md").write_text(markdown(doc))
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
