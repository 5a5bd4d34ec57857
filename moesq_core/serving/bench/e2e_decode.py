"""End-to-end decode benchmark: a Qwen3-30B-A3B-shaped MoE (from its config, random weights) with routed
experts as bf16 (transformers' grouped_mm), fp8 (torch._scaled_grouped_mm, rowwise scales), moesq s24-fp8
(S24HopperExperts: CUTLASS 2:4 sparse fp8, W8A8) and moesq p48 packed (P48HopperExperts, W4A16 and W4A4),
on one Hopper GPU.

    moesq bench-kernel --e2e --out DIR
    python -m moesq_core.serving.bench.e2e_decode --out DIR [--layers 48] [--batches 1 16 64] [--variants bf16 s24 ...]

Decode loop: `moesq generate`'s decode step (moesq_core.serving.decode_step: the model's own forward over a
StaticCache, greedy argmax, next-token and position update on static buffers) captured in a CUDA graph; the
prompt (128 random tokens per sequence) is prefilled eagerly, then the step is replayed; tokens/s = batch /
median step time (`moesq generate` adds the prefill and a host read of the finished flags every 8 steps).
Expert memory = bytes of the routed experts' weights on the GPU. Weights are random, so the benchmark measures
speed only (the routers spread tokens ~uniformly).
Writes e2e_decode.{json,md,png}.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from moesq_core.serving.bench.harness import git_commit
from moesq_core.serving.bench.p48_bench import random_p48_tensors
from moesq_core.serving.p48_hopper import P48HopperExperts
from moesq_core.serving.s24_hopper import S24HopperExperts

VARIANTS = ("bf16", "fp8", "s24_w8a8", "p48_w4a16", "p48_w4a4")


def qwen3_30b_config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def _quant_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.float().abs().amax(-1).clamp_min(1e-12)
    s = amax / 448.0
    return (x.float() / s[:, None]).to(torch.float8_e4m3fn), s


class Fp8Experts(nn.Module):
    """Routed experts with e4m3 weights (per-channel fp32 scales) and dynamic per-token e4m3 activations,
    through torch._scaled_grouped_mm; routing as transformers' grouped_mm path (sort, histc, cumsum)."""

    def __init__(self, E: int, H: int, inter: int, gen: torch.Generator, device):
        super().__init__()
        self.num_experts = E

        def rand_w(*shape):
            return (torch.randn(*shape, generator=gen, device=device) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)

        self.w13 = rand_w(E, 2 * inter, H)
        self.s13 = torch.rand(E, 2 * inter, generator=gen, device=device) * 1e-3 + 1e-4
        self.w2 = rand_w(E, H, inter)
        self.s2 = torch.rand(E, H, generator=gen, device=device) * 1e-3 + 1e-4

    def expert_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2))

    def forward(self, hidden, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        ids_g, perm = torch.sort(ids)
        x = hidden[perm // k]
        counts = torch.histc(ids_g.int(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xq, sx = _quant_rows_fp8(x)
        h = torch._scaled_grouped_mm(xq, self.w13.transpose(-2, -1), sx, self.s13, offs=offs,
                                     out_dtype=torch.bfloat16, use_fast_accum=True)
        g, u = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(g) * u
        aq, sa = _quant_rows_fp8(a)
        y = torch._scaled_grouped_mm(aq, self.w2.transpose(-2, -1), sa, self.s2, offs=offs,
                                     out_dtype=torch.bfloat16, use_fast_accum=True)
        y = y * top_k_weights.reshape(-1)[perm, None].to(y.dtype)
        out = torch.empty_like(y)
        out[perm] = y
        return out.view(T, k, -1).sum(1)


def random_p48_experts(E: int, H: int, inter: int, gen: torch.Generator, device, act_quant: bool) -> P48HopperExperts:
    gate = random_p48_tensors(E, inter, H, gen, device)
    up = random_p48_tensors(E, inter, H, gen, device)
    up["weight_global_scale"] = gate["weight_global_scale"]  # gate and up share one global scale
    down = random_p48_tensors(E, H, inter, gen, device)
    g_in = torch.full((1,), 2688.0 / 8.0, device=device)
    g_mid = torch.full((1,), 2688.0 / 4.0, device=device)
    packed = []
    for e in range(E):
        d = {p: {k: v[e] for k, v in t.items()} for p, t in (("gate", gate), ("up", up), ("down", down))}
        for p in ("gate", "up"):
            d[p]["input_global_scale"] = g_in
        d["down"]["input_global_scale"] = g_mid
        packed.append(d)
    mod = P48HopperExperts.from_packed(packed, act_quant=act_quant, device=device)
    del gate, up, down, packed
    return mod


def random_s24_stack(E: int, M: int, K: int, gen: torch.Generator, device) -> tuple[torch.Tensor, ...]:
    """Random packed s24-fp8 tensors for E experts of an [M, K] linear: values [E, M, K/2] (finite e4m3),
    metadata [E, M, K/8] (a random valid 2-of-4 pattern per group), scales [E, M]."""
    values = (torch.randn(E, M, K // 2, generator=gen, device=device) * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
    nibbles = torch.tensor([0x4, 0x8, 0xC, 0x9, 0xD, 0xE], dtype=torch.uint8, device=device)
    nib = nibbles[torch.randint(0, 6, (E, M, K // 4), generator=gen, device=device)]
    meta = (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous()
    scale = torch.rand(E, M, generator=gen, device=device) * 1e-3 + 1e-4
    return values, meta, scale


def random_s24_experts(E: int, H: int, inter: int, gen: torch.Generator, device) -> S24HopperExperts:
    return S24HopperExperts(random_s24_stack(E, 2 * inter, H, gen, device), random_s24_stack(E, H, inter, gen, device),
                            device)


def expert_bytes(model) -> int:
    total = 0
    for layer in model.model.layers:
        ex = layer.mlp.experts
        if hasattr(ex, "expert_nbytes"):
            total += ex.expert_nbytes()
        else:
            total += sum(p.numel() * p.element_size() for p in ex.parameters())
    return total


def run_decode(model, batch: int, prompt: int, max_steps: int, budget_s: float, gen: torch.Generator) -> dict:
    """Time `moesq generate`'s decode step (moesq_core.serving.decode_step) on `batch` random prompts of `prompt`
    tokens: captured in a CUDA graph (one eager warm-up step timed), prefilled, then replayed up to `max_steps`
    times or `budget_s` seconds; the median step gives tokens/s."""
    from moesq_core.serving.decode_step import DecodeStep

    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    max_len = prompt + max_steps + 8
    step = DecodeStep(model, batch, max_len)
    rec: dict = {"batch": batch, "prompt": prompt, "cuda_graph": False}
    with torch.no_grad():
        if cuda:
            rec["cuda_graph"] = step.capture()
            rec["eager_step_ms"] = step.eager_step_ms
            if step.graph_error:  # report eager timing rather than nothing
                rec["graph_error"] = step.graph_error
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=gen, device=dev)
        sync()
        t0 = time.perf_counter()
        step.prefill(ids, torch.ones_like(ids))
        sync()
        rec["prefill_s"] = round(time.perf_counter() - t0, 3)
        step.step()
        sync()
        times = []
        t_start = time.perf_counter()
        while len(times) < max_steps and int(step.slot) < max_len - 1:
            t1 = time.perf_counter()
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step.step()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                step.step()
                times.append((time.perf_counter() - t1) * 1e3)
            if time.perf_counter() - t_start > budget_s and len(times) >= 3:
                break
    ms = statistics.median(times)
    rec.update({"steps": len(times), "step_ms": round(ms, 3), "tokens_per_s": round(batch * 1e3 / ms, 2)})
    del step
    return rec


def replace_experts(model, variant: str, gen: torch.Generator):
    cfg = model.config
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dev = torch.device("cuda")
    for layer in model.model.layers:
        if variant == "bf16":
            continue
        layer.mlp.experts = None
        gc.collect()
        torch.cuda.empty_cache()
        if variant == "fp8":
            layer.mlp.experts = Fp8Experts(E, H, inter, gen, dev)
        elif variant == "s24_w8a8":
            layer.mlp.experts = random_s24_experts(E, H, inter, gen, dev)
        elif variant in ("p48_w4a16", "p48_w4a4"):
            layer.mlp.experts = random_p48_experts(E, H, inter, gen, dev, act_quant=variant == "p48_w4a4")
        else:
            raise ValueError(variant)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=3.0, help="stop timing a configuration after this long")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cfg = qwen3_30b_config(args.layers)
    t0 = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    model.config._experts_implementation = "grouped_mm"
    with torch.no_grad():
        for layer in model.model.layers:  # experts are torch.empty: give them real random values
            layer.mlp.experts.gate_up_proj.normal_(0, 0.02, generator=gen)
            layer.mlp.experts.down_proj.normal_(0, 0.02, generator=gen)
    torch.cuda.synchronize()
    result = {
        "model": "Qwen3-30B-A3B-shaped (config), random weights",
        "layers": args.layers, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "transformers": transformers.__version__,
        "commit": git_commit(), "build_s": round(time.perf_counter() - t0, 1),
        "loop": "prefill eager; one greedy decode step captured in a CUDA graph and replayed (median step)",
        "runs": [],
    }
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        try:
            replace_experts(model, variant, gen)
        except Exception as e:
            result["runs"].append({"variant": variant, "error": f"install: {type(e).__name__}: {e}"[:400]})
            continue
        eb = expert_bytes(model)
        for b in args.batches:
            try:
                rec = run_decode(model, b, args.prompt, args.steps, args.budget_s, gen)
            except Exception as e:
                rec = {"batch": b, "error": f"{type(e).__name__}: {e}"[:400]}
            rec["variant"] = variant
            rec["expert_GiB"] = round(eb / 2**30, 3)
            result["runs"].append(rec)
            print(json.dumps(rec), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            (out / "e2e_decode.json").write_text(json.dumps(result, indent=1))
    result["speedup_vs_bf16"] = speedups(result["runs"])
    (out / "e2e_decode.json").write_text(json.dumps(result, indent=1))
    (out / "e2e_decode.md").write_text(markdown(result))
    try:
        plot(result, out / "e2e_decode.png")
    except Exception as e:
        print(f"plot skipped: {e}")
    return 0


def speedups(runs: list[dict]) -> dict:
    base = {r["batch"]: r["tokens_per_s"] for r in runs if r.get("variant") == "bf16" and "tokens_per_s" in r}
    sp = {}
    for r in runs:
        if "tokens_per_s" in r and r["batch"] in base and r["variant"] != "bf16":
            sp[f"{r['variant']}@{r['batch']}"] = round(r["tokens_per_s"] / base[r["batch"]], 3)
    return sp


def markdown(result: dict) -> str:
    lines = [
        "# End-to-end decode: Qwen3-30B-A3B-shaped model, experts bf16 / fp8 / s24-fp8 / p48 packed",
        "",
        f"{result['date']} · {result['gpu']} · torch {result['torch']} · transformers {result['transformers']} · "
        f"commit `{result['commit']}` · {result['layers']} layers, {result['experts']} experts, top-{result['top_k']}",
        "",
        f"Loop: {result['loop']}.",
        "",
        "| experts | batch | tokens/s | ms/token (step) | expert GiB | CUDA graph | eager step ms | vs bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sp = result.get("speedup_vs_bf16", {})
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r.get('variant')} | {r.get('batch', '–')} | error: {r['error'][:120]} | | | | | |")
            continue
        key = f"{r['variant']}@{r['batch']}"
        lines.append(f"| {r['variant']} | {r['batch']} | {r['tokens_per_s']} | {r['step_ms']} | {r['expert_GiB']} | "
                     f"{r['cuda_graph']} | {r.get('eager_step_ms', '–')} | {sp.get(key, '–')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = []
    for r in result["runs"]:
        if "tokens_per_s" in r and r["variant"] not in variants:
            variants.append(r["variant"])
    batches = sorted({r["batch"] for r in result["runs"] if "tokens_per_s" in r})
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        ys = [next((r["tokens_per_s"] for r in result["runs"] if r.get("variant") == v and r["batch"] == b
                    and "tokens_per_s" in r), 0) for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], ys, width, label=v)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Qwen3-30B-A3B-shaped decode · {result['gpu']} · {result['date'][:10]} · {result['commit'][:12]}",
                 fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
