"""p48 sparse-tensor-core kernel variants head to head in one process (H100/H200), with torch's fp8 grouped GEMM.

    python benchmarks/p48_variants.py --variants 2 3 --N 64 128 256 --out DIR
    python benchmarks/p48_variants.py --profile 2 --N 128 --shape 0      # one launch, for `ncu -k regex:p48 -c 1`
    python benchmarks/p48_variants.py --variants 0 5 --N 16 64 --routed 8 --out DIR   # counts of a routed batch
    python benchmarks/p48_variants.py --variants 0 4 --compare-early --out DIR   # early_first_unit on and off

Rows: the kernel bench's shapes (Qwen3-30B-A3B with G = 128, Kimi-K2.5 with G = 48) x N, token counts
{N, 3N/4, N/2, N/4} per expert, as moesq_core.serving.bench.p48_bench; with --routed k instead those of a batch of N
tokens routed to k experts each, uniformly at random (seeded; some experts get none, as in serving; TB/s then still
counts every expert's bytes, so compare the µs). Per row: the fp8 baseline once, then every variant
(W4A16; with --fused also W4A4 quantized in the kernel) checked against p48_reference and timed with
moesq_core.serving.bench.harness.graph_time (CUDA graphs, weight copies rotated past L2, median), in `--rounds` rounds
of alternating order; each variant's W4A16 output is compared bit for bit with the first variant's. Writes
p48_variants.json / .md into --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesq_core.serving.bench.harness import BASELINES, copies_for, graph_time, new_row, run_header, time_gemm  # noqa: E402
from moesq_core.serving.bench.p48_bench import P48Bench  # noqa: E402
from moesq_core.serving.kernels import p48_mma as pm  # noqa: E402

SHAPES = [("Qwen3-30B-A3B gate/up", 1536, 2048, 128), ("Qwen3-30B-A3B down", 2048, 768, 128),
          ("Kimi-K2.5 gate/up", 4096, 7168, 48), ("Kimi-K2.5 down", 7168, 2048, 48)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--N", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--shape", type=int, nargs="+", default=list(range(len(SHAPES))), help="indices into SHAPES")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fused", action="store_true", help="also W4A4 with the quantization in the kernel")
    ap.add_argument("--x-permuted", action="store_true",
                    help="hand the kernel the activations in its K order (as the runtime's GEMMs get them)")
    ap.add_argument("--routed", type=int, default=None, metavar="K",
                    help="token counts of N tokens routed to K experts each at random, not the bench's pattern")
    ap.add_argument("--compare-early", action="store_true",
                    help="also time each variant with early_first_unit off (rows '<v>-late')")
    ap.add_argument("--profile", type=int, default=None, help="run this variant once per row (for ncu), no timing")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    native = pm.load_native()
    if native is None:
        print("the native p48 kernel cannot run here (needs sm_90 and nvcc)", file=sys.stderr)
        return 1
    if args.profile is not None:
        for i in args.shape:
            name, M, K, G = SHAPES[i]
            for n in args.N:
                prob, gen, _ = new_row(name, M, K, G, n, 0, device)
                ours = P48Bench(prob, gen, device, native)
                if args.x_permuted:
                    ours.use_permuted_activations()
                ours.config = pm.MmaConfig(args.profile, ours.config.split)
                run = ours.call(ours.add_copy(), False, True)
                run()
                torch.cuda.synchronize()
                print(f"profiled {name} N={n} variant {args.profile} split {ours.config.split}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    # (key, variant, early_first_unit) per timed method
    methods = [(str(v), v, True) for v in args.variants]
    if args.compare_early:
        methods = [m for v in args.variants for m in ((str(v), v, True), (f"{v}-late", v, False))]
    result = {**run_header("p48-nvfp4", device, args.repeats), "variants": [m[0] for m in methods],
              "rounds": args.rounds,
              "x_permuted": args.x_permuted, "routed_top_k": args.routed,
              "ptx_info": native.p48_variants(), "rows": []}
    for i in args.shape:
        name, M, K, G = SHAPES[i]
        for n in args.N:
            prob, gen, row = new_row(name, M, K, G, n, 0, device)
            if args.routed is not None:
                prob.counts = routed_counts(n, G, args.routed, seed=n * 7919 + G)
                row.update(tokens=prob.tokens, routed_top_k=args.routed, counts=prob.counts)
            f = BASELINES["fp8_grouped_mm"](prob, gen, device)
            row["fp8_us"] = round(time_gemm(f, args.repeats).median_us, 3)
            del f
            torch.cuda.empty_cache()
            ours = P48Bench(prob, gen, device, native)
            if args.x_permuted:
                ours.use_permuted_activations()
            ours.add_copy()
            split = ours.config.split
            row["picked"] = ours.config.__dict__
            first = None
            for key, v, early in methods:  # check every variant before timing any
                ours.config = pm.MmaConfig(v, split, early)
                rec = row["methods"].setdefault(key, {})
                rec["err"] = ours.verify(False, True)
                out = ours.out.clone()
                first = out if first is None else first
                rec["bit_equal_to_first"] = bool(torch.equal(out, first))
                if args.fused:
                    rec["fused_err"] = ours.verify(True, True, True)
            while len(ours.copies) < copies_for(ours.weight_bytes):
                ours.add_copy()
            for r in range(args.rounds):
                order = methods if r % 2 == 0 else methods[::-1]
                for key, v, early in order:
                    ours.config = pm.MmaConfig(v, split, early)
                    rec = row["methods"][key]
                    t = graph_time([ours.call(w, False, True) for w in ours.copies], args.repeats)
                    rec.setdefault("us_rounds", []).append(round(t.median_us, 3))
                    if args.fused:
                        t = graph_time([ours.call(w, True, True, True) for w in ours.copies], args.repeats)
                        rec.setdefault("fused_us_rounds", []).append(round(t.median_us, 3))
            for key, _, _ in methods:
                rec = row["methods"][key]
                rec["us"] = min(rec["us_rounds"])
                rec["TBps"] = round(ours.weight_bytes / (rec["us"] * 1e-6) / 1e12, 3)
                rec["vs_fp8"] = round(row["fp8_us"] / rec["us"], 3)
                if args.fused:
                    rec["fused_us"] = min(rec["fused_us_rounds"])
            row["weight_bytes"] = ours.weight_bytes
            result["rows"].append(row)
            del ours
            torch.cuda.empty_cache()
            print(f"{name:24s} N={n:4d} fp8 {row['fp8_us']:7.1f} | " + " | ".join(
                f"v{k} {row['methods'][k]['us']:7.1f} {row['methods'][k]['TBps']:.2f}TB/s"
                + (f" fused {row['methods'][k]['fused_us']:7.1f}" if args.fused else "")
                + ("" if row['methods'][k]['bit_equal_to_first'] else " NOT-EQUAL")
                for k, _, _ in methods), flush=True)
            (args.out / "p48_variants.json").write_text(json.dumps(result, indent=1))
    (args.out / "p48_variants.md").write_text(markdown(result))
    return 0


def routed_counts(tokens: int, experts: int, top_k: int, seed: int) -> list[int]:
    """Tokens per expert when each of `tokens` tokens picks `top_k` distinct experts uniformly at random."""
    if not 1 <= top_k <= experts:
        raise SystemExit(f"--routed: top-k {top_k} must lie in [1, {experts}]")
    gen = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    return torch.bincount(picks.flatten(), minlength=experts).tolist()


def markdown(result: dict) -> str:
    vs = [str(v) for v in result["variants"]]
    fused = any("fused_us" in r["methods"][v] for r in result["rows"] for v in vs)
    lines = [f"# p48 kernel variants head to head ({', '.join('v' + v for v in vs)})", "",
             f"{result['date']} · {result['gpu']} · torch {result['torch']} · commit `{result['commit']}` · median of "
             f"{result['repeats']} CUDA-graph replays, best of {result['rounds']} rounds (alternating order), W4A16 "
             "bf16 output" + (", W4A4 fused = quantization in the kernel" if fused else "")
             + (", activations handed over in the kernel's K order" if result.get("x_permuted") else "")
             + (f", token counts of N tokens routed to {result['routed_top_k']} experts each at random (TB/s over every"
                " expert's bytes)" if result.get("routed_top_k") else ""), "",
             "| shape | G | N | fp8 µs | " + " | ".join(f"v{v} µs" for v in vs) + " | "
             + " | ".join(f"v{v} TB/s" for v in vs) + " | " + " | ".join(f"v{v} vs fp8" for v in vs)
             + (" | " + " | ".join(f"v{v} fused µs" for v in vs) if fused else "") + " | bit-equal |",
             "|---|---|---|---|" + "---|" * (3 * len(vs) + (len(vs) if fused else 0) + 1)]
    for r in result["rows"]:
        m = r["methods"]
        cells = ([f"{m[v]['us']:.1f}" for v in vs] + [f"{m[v]['TBps']:.2f}" for v in vs]
                 + [f"{m[v]['vs_fp8']:.2f}" for v in vs])
        if fused:
            cells += [f"{m[v]['fused_us']:.1f}" for v in vs]
        eq = "yes" if all(m[v]["bit_equal_to_first"] for v in vs) else "NO"
        lines.append(f"| {r['shape']} | {r['G']} | {r['N']} | {r['fp8_us']:.1f} | " + " | ".join(cells) + f" | {eq} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
