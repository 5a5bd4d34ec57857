"""Render the docs' result tables from the committed results files.

Every table of numbers in README.md and docs/*.md (the pages) sits between `<!-- results:NAME -->` and
`<!-- /results:NAME -->` and is produced here from benchmarks/results/*.json, so no page can drift from what was
measured. A table may sit on any page, and on several; every table here sits on at least one. Links to results
files are written relative to the page:

    python benchmarks/render_readme.py           # rewrite the tables in every page
    python benchmarks/render_readme.py --check   # exit 1 naming the pages and tables that differ (tests run this)
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """The pages whose tables are rendered: README.md, then docs/*.md by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def link(name: str) -> str:
    return f"[`{name}`](benchmarks/results/{name})"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def pct(x) -> str:
    return "—" if x is None else f"{100 * x:.2f} %"


# -- `moesq run` on the embedded model ---------------------------------------------------------------------
RUN_FILE = "moesq_run_embedded.json"


def render_run() -> str:
    """The table `moesq run` prints (its rows and labels, as recorded by `moesq run --json`), then what the rows
    are, the run's time and machine, and the paper's SGPTQ on the same calibration for comparison."""
    d = load(RUN_FILE)
    rows = d["rows"]
    ref = next(r["ppl"] for r in rows if r["kind"] == "reference")
    out = table(["model", "perplexity", "× reference"],
                [[r["label"], f"{r['ppl']:.3f}", f"{r['ppl'] / ref:.3f}"] for r in rows])
    refine = d["config"].get("refine") or {}
    stage = next((r for r in rows if r["stage"] == "refine"), None)
    baselines = [r["label"] for r in rows if r["kind"] == "stage" and r["stage"] != "refine"]
    packed = next((r["label"] for r in rows if r["kind"] == "packed"), None)
    parts = []
    if baselines:
        parts.append(f"{' and '.join(f'`{b}`' for b in baselines)}: one-shot baselines")
    if stage:
        what = f"`refine`: {refine.get('epochs')} epochs × {refine.get('steps_per_epoch')} steps per block"
        steps = refine.get("e2e_steps")
        if steps == "auto":  # the step's automatic length on this calibration (RefineConfig.e2e_steps_for)
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from moesq_core.compression.methods.refine import RefineConfig

            cal = d["config"]["calib"]
            steps = RefineConfig(e2e_batch_size=refine["e2e_batch_size"]).e2e_steps_for(cal["n_train"] + cal["n_init"])
        if steps:
            what += f", then {steps} end-to-end steps × {refine.get('e2e_batch_size')} sequences"
        parts.append(what)
    if packed:
        parts.append(f"`{packed}`: the packed model, loaded back from disk")
    m = d["machine"]
    text = (f"\n\n{'; '.join(parts)}. {d['wall_seconds']:.0f} s on {m['cpu_count']} cores ({m['cpu']}), "
            f"{m['memory_gib']:.0f} GiB, torch {m['torch']} on {m['torch_threads']} threads (from "
            f"{link(RUN_FILE)}: `moesq run --json` in a fresh temporary directory, commit {d['commit']}); "
            f"`verify`: {d['bits_per_weight']:.3f} bits per expert weight.")
    sgptq = next((r["ppl"] for r in rows if r["stage"] == "init-sgptq"), None)
    if stage and sgptq and d.get("paper_sgptq"):
        p = d["paper_sgptq"]["ppl"]
        text += (f" For comparison, the paper's SGPTQ (`moesq init-sgptq --no-refit` on the same calibration) gives "
                 f"{p:.3f} ({p / ref:.3f}× the reference): refine is {stage['ppl'] / p:.3f}× it and "
                 f"{stage['ppl'] / sgptq:.3f}× moesq's default SGPTQ (with refit), its init.")
    return out + text


# -- accuracy ----------------------------------------------------------------------------------------------
def _acc_row(d: dict, row: str, acts: str = "wa") -> dict:
    r = d["rows"][row]
    return r if "ppl" in r else r[acts]


METHODS = [
    ("reference", "reference"), ("dense-rtn", "dense NVFP4 RTN (4.5 bits)"), ("magnitude", "magnitude + RTN"),
    ("wanda", "Wanda"), ("jsq", "JSQ"), ("obr", "OBR (no rotation)"),
    ("sgptq-fp32scales", "SGPTQ, fp32 scales (the release's)"), ("sgptq", "SGPTQ, export-exact"),
    ("refine", "**moesq refine**"),
]


def render_methods() -> str:
    files = ["accuracy_micro.json", "accuracy_tiny.json"]
    ds = [load(f) for f in files]
    rows = []
    for row, label in METHODS:
        cells = []
        for d in ds:
            for acts in ("wo", "wa"):
                r = d["rows"][row]
                ppl = r["ppl"] if "ppl" in r else r[acts]["ppl"]
                s = f"{ppl:.2f}"
                cells.append(f"**{s}**" if label.startswith("**") else s)
        rows.append([label, *cells])
    return table(["method", "micro, weights only", "micro, W4A4", "tiny, weights only", "tiny, W4A4"], rows) + (
        "\n\nFrom " + " and ".join(link(f.replace(".json", ".md")) for f in files) + ".")


GPU_TABLES = ["accuracy_micro_gpu512.json", "accuracy_tiny_gpu512.json"]
GPU_ROWS = [
    ("reference", "reference"), ("dense-rtn", "dense NVFP4 RTN (4.5 bits)"), ("magnitude", "magnitude + RTN"),
    ("wanda", "Wanda"), ("jsq", "JSQ"), ("obr", "OBR (no rotation)"), ("sgptq-paper", "SGPTQ (the paper's, no refit)"),
    ("sgptq", "SGPTQ-refit (moesq's default init)"),
    ("release-faithful", "release-faithful (recipes/release-faithful.yaml)"),
    ("refine-default", "**moesq refine** (every default: block-wise, then the end-to-end step, auto: 256 steps here)"),
    ("refine-default-seed1", "&nbsp;&nbsp;seed 1"),
    ("refine", "moesq refine, block-wise only (`--e2e-steps 0`; before the values' RMS cap)"),
    ("refine-seed1", "&nbsp;&nbsp;seed 1"),
    ("refine-p0", "&nbsp;&nbsp;ablation: uniform loss"), ("refine-values", "&nbsp;&nbsp;ablation: values only"),
    ("refine-support", "&nbsp;&nbsp;ablation: support only"),
    ("refine-quarter", "&nbsp;&nbsp;¼ of the paper's budget (320 steps)"),
    ("refine-paper", "&nbsp;&nbsp;the paper's budget (1,280 steps)"),
    ("refine-e2e", "&nbsp;&nbsp;+ 64 end-to-end steps"), ("refine-e2e-seed1", "&nbsp;&nbsp;&nbsp;&nbsp;seed 1"),
    ("refine-e2e-128", "&nbsp;&nbsp;+ 128 end-to-end steps"),
    ("refine-e2e-128-seed1", "&nbsp;&nbsp;&nbsp;&nbsp;seed 1"),
]


GPU_SUMMARY_ROWS = [  # the README's table: the one-shot methods and moesq's default refinement
    ("reference", "reference"), ("dense-rtn", "dense NVFP4 RTN (4.5 bits)"), ("magnitude", "magnitude + RTN"),
    ("wanda", "Wanda"), ("obr", "OBR (no rotation)"), ("sgptq-paper", "SGPTQ (the paper's, no refit)"),
    ("sgptq", "SGPTQ-refit (moesq's default init)"),
    ("refine-default", "**moesq refine** (every default: block-wise, then the end-to-end step)"),
]


def render_accuracy_summary() -> str:
    ds = [load(f) for f in GPU_TABLES]
    rows = [[label, *[f"{_acc_row(d, row)['ppl']:.2f} ({_acc_row(d, row)['ppl'] / d['rows']['reference']['ppl']:.3f}×)"
                      for d in ds]] for row, label in GPU_SUMMARY_ROWS]
    c = ds[0]["calibration"]["config"]
    return table(["W4A4", "micro: perplexity (× reference)", "tiny: perplexity (× reference)"], rows) + (
        f"\n\nNVIDIA H200; calibration {c['n_train']} training + {c['n_init']} one-shot + {c['n_val']} validation "
        f"sequences of {c['seq_len']} tokens. From "
        + " and ".join(link(f.replace(".json", ".md")) for f in GPU_TABLES) + ".")


def render_accuracy_gpu() -> str:
    ds = [load(f) for f in GPU_TABLES]
    rows = []
    for row, label in GPU_ROWS:
        cells = []
        for d in ds:
            if row not in d["rows"]:
                cells += ["not run", ""]
                continue
            r = _acc_row(d, row)
            cells += [f"{r['ppl']:.2f} ({r['ppl'] / d['rows']['reference']['ppl']:.3f}×)",
                      pct(r.get("patterns_changed"))]
        rows.append([label, *cells])
    c = ds[0]["calibration"]["config"]
    return table(["W4A4", "micro: perplexity (× reference)", "patterns changed", "tiny: perplexity (× reference)",
                  "patterns changed"], rows) + (
        f"\n\nNVIDIA H200; calibration {c['n_train']} training + {c['n_init']} one-shot + {c['n_val']} validation "
        f"sequences of {c['seq_len']} tokens; refinement {ds[0]['refine']['epochs']} × "
        f"{ds[0]['refine']['steps_per_epoch']} "
        "steps per block unless the row says otherwise; end-to-end steps (4 sequences each) tune every expert's values "
        "together after the last block, patterns fixed; the same evaluation text for every row. From "
        + " and ".join(link(f.replace(".json", ".md")) for f in GPU_TABLES)
        + f", read in {link('accuracy_gpu512_reading.md')}.")


# -- GPU speed ---------------------------------------------------------------------------------------------
E2E_FILE = "e2e_decode_h200_2026-12-04_709905c.json"
SOLVER_FILE = "solvers_h200_2026-12-01_9c83099.json"
SOLVER_KIMI_FILE = "solvers_h200_2026-12-01_5147589.json"  # Kimi-K2 chunk, CG tolerance 1e-5
REFINE_FILE = "refine_h200_2026-12-04_6f3c9cd.json"
REFINE_CACHED_FILE = "refine_h200_2026-12-01_202e777.json"
REFINE_BEFORE_FILE = "refine_h200_2026-12-01_75a3a44.json"
S24_FILE = "s24_fp8_kernel_bench.json"
P48_FILE = "p48_kernel_bench_h200_2026-12-04_80aa119.json"  # the native kernel (no Triton columns)
P48_TRITON_FILE = "p48_kernel_bench_h200_2026-12-01_8b05f4d.json"  # the Triton kernel's last measurement


def render_decode() -> str:
    d = load(E2E_FILE)
    by = {(r["variant"], r["batch"]): r for r in d["runs"]}
    batches = sorted({b for _, b in by})
    names = {"bf16": "bf16 (torch grouped GEMM)", "fp8": "fp8 (torch scaled grouped GEMM)",
             "s24_w8a8": "**s24-fp8** (`S24HopperExperts`, W8A8)",
             "p48_w4a16": "**p48-nvfp4** (`P48HopperExperts`, sparse-tensor-core kernel, W4A16)",
             "p48_w4a4": "p48-nvfp4 (`P48HopperExperts`, sparse-tensor-core kernel, W4A4)"}
    rows = []
    for v in dict.fromkeys(v for v, _ in by):
        cells = [f"{by[v, b]['tokens_per_s'] / by['bf16', b]['tokens_per_s']:.2f}×" for b in batches]
        rows.append([names.get(v, v), f"{by[v, batches[0]]['expert_GiB']:.1f}", *cells])
    return table(["experts", "expert GiB", *[f"batch {b} vs bf16" for b in batches]], rows) + (
        f"\n\n{d['gpu']}, {d['layers']} layers × {d['experts']} experts, top-{d['top_k']}, one decode step in a CUDA "
        f"graph; {link(E2E_FILE.replace('.json', '.md'))} (commit {d['commit']}).")


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def render_kernels() -> str:
    rows = []
    s24 = load(S24_FILE)
    t = s24["targets"]
    rows.append(["s24-fp8 CUTLASS grouped GEMM vs the best of torch bf16/fp8 and cuSPARSELt",
                 f"N ≤ 64: geomean {t['decode_N_le_64']['geomean']:.2f}× (min {t['decode_N_le_64']['min']:.2f}×); "
                 f"N ≥ 256: geomean {t['N_ge_256']['geomean']:.2f}× "
                 f"({s24['targets_fast_accum']['N_ge_256']['geomean']:.2f}× with fast accumulation)",
                 link(S24_FILE.replace(".json", ".md"))])
    kernels = {"p48_mma_w4a16": ("p48-nvfp4 sparse-tensor-core grouped GEMM (`mma.sp` up to 16 rows per expert, "
                                 "`wgmma.sp` above, as `pick_config` picks; W4A16, activations in the kernel's K "
                                 "order as the runtime hands them over; the runtime's on sm_90)", P48_FILE),
               "p48_w4a16": ("p48-nvfp4 Triton grouped GEMM (W4A16; the fallback)", P48_TRITON_FILE)}
    for m, (name, f) in kernels.items():
        p48 = load(f)

        def col(n_ok, key):
            return [r["methods"][m][key] for r in p48["rows"] if n_ok(r["N"]) and m in r["methods"]]
        tbps, vs8 = col(lambda n: n <= 16, "weight_TBps"), col(lambda n: n <= 16, "speedup_vs_fp8")
        larger = [(n, col(lambda x, n=n: x == n, "speedup_vs_fp8")) for n in (64, 128, 256)]
        above = "; ".join(f"N = {n}: {min(v):.2f}–{max(v):.2f}× fp8" for n, v in larger if v)
        rows.append([name, f"N ≤ 16: {min(tbps):.2f}–{max(tbps):.2f} TB/s of packed bytes, "
                           f"{min(vs8):.2f}–{max(vs8):.2f}× torch fp8; {above}", link(f.replace(".json", ".md"))])
    return table(["kernel", "measured on an H200", "file"], rows)


def render_compression() -> str:
    rows = []
    d = load(SOLVER_FILE)
    names = {"sgptq": "sgptq (default: with refit)"}
    for m, r in d["results"].items():
        if "block_s_extrapolated" in r:
            continue
        rows.append([f"{names.get(m, m)} ({r['format']}), one Qwen3-30B-A3B block",
                     f"{r['batched_block_s']:.2f} s measured",
                     f"{r['per_expert_block_s_extrapolated']:.0f} s", link(SOLVER_FILE.replace(".json", ".md"))])
    kimi = load(SOLVER_KIMI_FILE)["results"]
    for m in ("sgptq", "obr", "gptq"):
        k = kimi.get(f"{m}_kimi_k2")
        if k:
            rows.append([f"{names.get(m, m)}, one Kimi-K2 block (384 experts of 7168 × 2048)",
                         f"≈ {k['block_s_extrapolated']:.0f} s (one chunk of {k['experts_timed']} experts timed, "
                         f"extrapolated; CG tolerance 1e-5)", "—", link(SOLVER_KIMI_FILE.replace(".json", ".md"))])
    now = load(REFINE_FILE)["variants"]["grad-fwd"]  # the default trainer: tokens held once, targets per micro-batch
    variants = load(REFINE_CACHED_FILE)["variants"]
    c = variants["grad-fwd"]  # the trainer that cached targets and quantized inputs per routed row
    before = load(REFINE_BEFORE_FILE)
    b, e = before["variants"]["compile"], before["variants"]["eager"]
    gpu_min = lambda v: v["paper_budget_extrapolated"]["gpu_min_per_block"]  # noqa: E731
    rows.append(["refine at the paper's budget, one Qwen3-30B-A3B block (the trainer's step alone)",
                 f"≈ {gpu_min(now):.1f} GPU-min (step {now['step_s_median']:.3f} s measured over one token matrix, the "
                 f"targets and quantized inputs computed per micro-batch, nothing cached per routed row; the budget "
                 f"extrapolated)",
                 f"— (before: caching 12 bytes per routed row and hidden unit, {c['step_s_median']:.3f} s ≈ "
                 f"{gpu_min(c):.1f} GPU-min, which ran the paper's calibration only in chunks; "
                 f"commit {before['commit']}: "
                 f"compiled step {b['step_s_median']:.3f} s ≈ {gpu_min(b):.1f} GPU-min, "
                 f"eager {e['step_s_median']:.3f} s "
                 f"≈ {gpu_min(e):.1f})",
                 link(REFINE_FILE.replace(".json", ".md"))])
    for stage, f in (("init-sgptq", SCALING_INIT_FILE), ("refine", SCALING_REFINE_FILE)):
        d = load(f)
        r = d["scaling"][stage]
        n = d["header"]["options"]["nproc"]

        def steady(x):  # blocks after the first (its time includes compilation and warm-up)
            later = x["block_seconds"][1:]
            return sum(later) / len(later)

        what = "8 Lion steps, the in-loop SGPTQ init included" if stage == "refine" else "SGPTQ with refit"
        rows.append([f"`moesq {stage}` through the CLI ({what}), per Qwen3-30B-A3B block after the first "
                     f"(lazily opened {d['header']['model_shape']['num_hidden_layers']}-layer model, routing, writing)",
                     f"1 H200: {steady(r['1']):.1f} s; {n} H200s (expert parallel): {steady(r[str(n)]):.1f} s "
                     f"({r['speedup_per_block_after_first']:.2f}×, commit {d['header']['commit']})", "—",
                     link(f.replace(".json", ".md"))])
    k = load(REAL_KIMI_FILE)
    st, ph = k["steps"], k["init_sgptq_phase_seconds"]
    peak = lambda s: (f"peak host {st[s]['attempts'][-1]['peak_host_gib']:.1f} GiB, "  # noqa: E731
                      f"GPU {st[s]['attempts'][-1]['peak_gpu_gib'][0]:.1f} GiB")
    rows.append(["`moesq init-sgptq` then `moesq refine` (8 Lion steps) through the CLI, one Kimi-K2 block "
                 "(384 experts of 7168 × 2048; the paper's SGPTQ, `--no-refit`)",
                 f"init-sgptq {st['init-sgptq']['attempts'][-1]['wall_s']:.0f} s (solver {ph['compress']:.0f} s; "
                 f"{peak('init-sgptq')}); refine compressed the block in {k['refine_block_compressed_s']:.0f} s "
                 f"({peak('refine')}) and was stopped while writing it (commit {k['commit']})", "—",
                 link(REAL_KIMI_FILE.replace(".json", ".md"))])
    r48 = load(REAL_48_FILE)
    st, pb = r48["steps"], r48["per_block_median_s"]
    compressing = ("calibrate", "init-sgptq", "refine", "pack", "verify")
    rows.append([f"`moesq calibrate`, `init-sgptq`, `refine` (8 Lion steps), `pack`, `verify`, `eval` through the CLI, "
                 f"the whole {r48['header']['model_shape']['num_hidden_layers']}-layer Qwen3-30B-A3B-shaped model "
                 f"({st['generate']['model_bytes'] / 2**30:.1f} GiB, opened lazily)",
                 f"init-sgptq {st['init-sgptq']['attempts'][-1]['wall_s'] / 60:.1f} min "
                 f"({pb['init-sgptq']['total']:.1f} s per block), "
                 f"refine {pb['refine']['total']:.1f} s per block "
                 f"(in-loop SGPTQ {pb['refine']['in_loop_init']:.1f} s), "
                 f"resumed across {len(st['refine']['attempts'])} device calls; "
                 f"packed {r48['sizes_bytes']['packed'] / 2**30:.2f} GiB "
                 f"({st['pack']['result']['bits_per_weight']:.3f} bits/weight), verify ok; peak host "
                 f"{max(a['peak_host_gib'] for s in compressing for a in st[s]['attempts']):.1f} GiB "
                 "while compressing, "
                 f"GPU {max(a['peak_gpu_gib'][0] for s in compressing for a in st[s]['attempts']):.0f} GiB "
                 f"(commit {r48['header']['commit']})",
                 "—", link(REAL_48_FILE.replace(".json", ".md"))])
    fb, pc = load(FULL_BUDGET_FILE), load(PAPER_CALIB_FILE)
    b0 = pc["per_block"][0]
    rows.append(["`moesq refine` through the CLI at the paper's steps and rows per step "
                 "(1,280 × 2,097,152 routed rows; "
                 f"{pc['calibration']['trained_sequences']} × {pc['calibration']['seq_len']}-token calibration), "
                 "one Qwen3-30B-A3B block, default resource options",
                 f"one chunk, no out-of-memory: {b0['seconds']:.0f} s = {pc['gpu_min_per_block']:.1f} GPU-min "
                 "for block 0 "
                 f"(in-loop SGPTQ {b0['in_loop_init_s']:.0f} s, refinement {b0['refinement_s']:.0f} s, "
                 f"{b0['routed_rows_per_s'] / 1e6:.1f} M routed rows/s), "
                 f"≈ {pc['gpu_min_per_block_steady_estimate']:.2f} "
                 f"GPU-min without its compilation; {pc['blocks_measured']} of 2 blocks measured "
                 f"(commit {pc['commit']}; "
                 f"before: chunks of {fb['after']['engine_chunk_experts']} experts, "
                 f"≈ {fb['extrapolated_min_per_block']['value']} "
                 f"min per block, commit {fb['commit']})",
                 "—", link(PAPER_CALIB_FILE.replace(".json", ".md"))])
    h100 = load(PAPER_CALIB_H100_FILE)
    b0, split = h100["per_block"][0], h100["per_block"][0]["compress_split"]
    rows.append(["the same on an H100 80GB",
                 f"{'no' if not h100['oom'] else 'an'} out-of-memory: {b0['seconds']:.0f} s = "
                 f"{h100['gpu_min_per_block']:.2f} GPU-min for block 0 (in-loop SGPTQ {split['in_loop_init']:.0f} s, "
                 f"refinement {split['refinement']:.0f} s), peak {h100['peak_gpu_gib']:.1f} GiB (torch, reserved) "
                 f"within the plan's {h100['plan_gib']:.1f}; propagating the states through the layer "
                 f"{h100['propagation_s_per_layer']:.1f} s; {h100['blocks_measured']} of 2 blocks measured "
                 f"(commit {h100['commit']})",
                 "—", link(PAPER_CALIB_H100_FILE.replace(".json", ".md"))])
    return table(["work", "batched (moesq)", "per-expert path (extrapolated)", "file"], rows)


REAL_48_FILE = "real_size_run_h200_2026-12-01_bbae3ec.json"
FULL_BUDGET_FILE = "refine_full_budget_h200_2026-12-02_1347c3a.json"
PAPER_CALIB_FILE = "refine_paper_calibration.json"
PAPER_CALIB_H100_FILE = "refine_paper_calibration_h100.json"
REAL_KIMI_FILE = "real_size_kimi_h200_2026-12-01_171ed46.json"
SCALING_INIT_FILE = "real_size_scaling_h200x2_2026-12-01_8aed194.json"
SCALING_REFINE_FILE = "real_size_scaling_h200x2_2026-12-01_db264ec.json"
WORKDIR_FILE = "workdir_bytes.json"


def render_workdir() -> str:
    """The current layout's rows (older layouts' are history, in the results file)."""
    d = load(WORKDIR_FILE)
    layout = max(st["layout"] for r in d["rows"] for st in r["stages"].values())
    rows = [[r["label"].removesuffix(", after"), stage, f"{st['bytes']:,}", f"{st['bytes_per_weight']:.3f}",
             f"{st['x_packed_experts']:.2f}×"]
            for r in d["rows"] for stage, st in r["stages"].items() if st["layout"] == layout]
    return table(["work dir", "stage", "bytes", "bytes / expert weight", "× packed experts"], rows) + (
        f"\n\nFrom {link(WORKDIR_FILE.replace('.json', '.md'))} (commit {d['commit']}; the runs' settings are there).")


TABLES = {"run": render_run, "workdir": render_workdir, "accuracy-methods": render_methods,
          "accuracy-gpu": render_accuracy_gpu, "accuracy-summary": render_accuracy_summary,
          "decode": render_decode, "kernels": render_kernels, "compression": render_compression}


MARKER = re.compile(r"^<!-- results:([\w-]+) -->$", re.M)  # a marker is a line of its own


def _relative_links(text: str, page: Path) -> str:
    """Links to the repo's files written from the root, made relative to `page`'s folder."""
    up = "../" * len(page.resolve().parent.relative_to(ROOT).parts)
    return text.replace("](benchmarks/results/", f"]({up}benchmarks/results/") if up else text


def render(text: str, page: Path = README) -> tuple[str, list[str]]:
    """`page`'s text with every marked table re-rendered, and the names of the tables that changed."""
    changed = []
    for name in dict.fromkeys(MARKER.findall(text)):
        if name not in TABLES:
            raise SystemExit(f"{page.name}: <!-- results:{name} --> names no table (known: {', '.join(TABLES)})")
        pat = re.compile(rf"^<!-- results:{re.escape(name)} -->$(.*?)^<!-- /results:{re.escape(name)} -->$",
                         re.S | re.M)
        new = "\n" + _relative_links(TABLES[name](), page) + "\n"
        for m in reversed(list(pat.finditer(text))):
            if m.group(1) != new:
                changed.append(name)
            text = text[: m.start(1)] + new + text[m.end(1):]
    return text, list(dict.fromkeys(changed))


def render_pages(paths: list[Path] | None = None) -> dict[Path, tuple[str, list[str]]]:
    """{page: (rendered text, changed tables)} for every page; refuses a table that sits on no page."""
    out = {p: render(p.read_text(), p) for p in (paths or pages())}
    if paths is None:
        placed = {n for p in out for n in MARKER.findall(p.read_text())}
        missing = [n for n in TABLES if n not in placed]
        if missing:
            raise SystemExit(f"no page has a <!-- results:NAME --> block for: {', '.join(missing)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's tables differ from the results")
    args = ap.parse_args(argv)
    rendered = render_pages()
    stale = {p: changed for p, (_, changed) in rendered.items() if changed}
    if args.check:
        for p, changed in stale.items():
            print(f"{p.relative_to(ROOT)} tables out of date: {', '.join(changed)} "
                  "(run python benchmarks/render_readme.py)")
        return 1 if stale else 0
    for p, (text, changed) in rendered.items():
        if changed:
            p.write_text(text)
            print(f"rendered {p.relative_to(ROOT)}: {', '.join(changed)}")
    if not stale:
        print("rendered: nothing changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
