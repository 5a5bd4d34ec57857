"""The calibration states' propagation through one compressed decoder layer, timed: what every block of a blockwise
stage pays between two blocks (`engine.propagate`), on a full-width Qwen3-30B-A3B layer.

    python benchmarks/propagation_speed.py --out benchmarks/results            # a GPU (defaults: the paper's batch)
    python benchmarks/propagation_speed.py --small --device cpu --batches 2 --seq-len 64 --out OUT   # a smoke run

One decoder layer of the shape (random weights in bf16, the router at the synthetic checkpoints' scale: uneven
routing, as `synthetic_model` writes it), its experts compressed by round-to-nearest in --format and installed as
the engine installs a block (`MoesqExperts.from_quantized` and `set_factored` on the device, static activation
ranges), the states of
--batches batches of --batch-size random sequences of --seq-len tokens held in host memory as a GPU stage holds
them. In one process, for each variant:
- `factored` (the default on a GPU): the experts' bf16 matmuls on the factored weights, experts chunked by row count;
- `factored-pageable`: the same, the states in pageable host memory (engine.PIN_HELD_STATES off, as before);
- `fp32-padded-pageable` (what ran before): fp32 matmuls, every expert of a chunk padded to the chunk's hottest
  one, the states in pageable host memory;
the seconds per batch of `engine.propagate` (reading each batch from host memory, the layer, writing it back), of
the layer alone on a batch already on the device, and of the experts module alone; and the two variants' outputs
compared. `s_per_layer_paper` = seconds per batch x the batches of the paper's calibration (1,152 sequences of
4,096 tokens at batch 8: 144). Writes OUT/propagation_speed.json and .md (relative paths only).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic_model import QWEN3_30B_A3B, qwen3_moe_config  # noqa: E402

from moesq_core.compression import engine  # noqa: E402
from moesq_core.formats import get_format  # noqa: E402
from moesq_core.models.adapter import adapter_for  # noqa: E402
from moesq_core.naming import PROJECTIONS  # noqa: E402
from moesq_core.serving.bench.harness import git_commit  # noqa: E402
from moesq_core.serving.experts import MoesqExperts  # noqa: E402

STEM = "propagation_speed"
PAPER_BATCHES = 1152 // 8  # 960 training + 64 one-shot + 128 validation sequences of 4,096 tokens, batch 8
SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=64,
             num_experts=16)
FACTORED = ("gate_up_values", "gate_up_rows", "down_values", "down_rows")


def build_layer(args, device: torch.device):
    """(model, its MoE block with a compressed experts module installed, the module's weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = qwen3_moe_config(**{**QWEN3_30B_A3B, "num_hidden_layers": 1, "vocab_size": 32768,
                              **(SMALL if args.small else {})})
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device.type == "cuda"
                                                 else torch.float32).eval()
    H, inter, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    with torch.no_grad():  # synthetic_model's router scale: logits of order 1, uneven routing
        model.model.layers[0].mlp.gate.weight.normal_(0, max(0.02, H ** -0.5))
    block = adapter_for(model).blocks(model)[0]
    fmt = get_format(args.format)
    weights = [{p: fmt.quantize(torch.randn(*((inter, H) if p != "down" else (H, inter)), device=device) * 0.02)
                for p in PROJECTIONS} for _ in range(E)]
    module = MoesqExperts.from_quantized(fmt, weights, True, torch.full((E,), 8.0, device=device),
                                         torch.full((E,), 0.5, device=device))
    module.set_factored(weights)  # as the engine installs a block on a GPU
    if device.type != "cuda":  # the GPU path, run on the CPU (a smoke run)
        module.batched = True
    block.set_experts(module)
    return model, block, module


def set_variant(module: MoesqExperts, factored: dict, name: str) -> None:
    for n, t in factored.items():
        if name == "factored":  # else the fp32 path
            module.register_buffer(n, t, persistent=False)
        elif hasattr(module, n):
            delattr(module, n)


def measure(args) -> dict:
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, block, module = build_layer(args, device)
    factored = {n: getattr(module, n) for n in FACTORED}
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (args.batches * args.batch_size, args.seq_len),
                           generator=torch.Generator().manual_seed(args.seed + 1))
    store = engine.StateStore(1 << 50, None, engine.STATES_HOME)
    kwargs_by_bs = engine.capture_layer_inputs(model, tokens, args.batch_size, store)
    layer = block.layer
    h = store[0]
    kw = kwargs_by_bs[h.shape[0]]
    with torch.no_grad():
        x = engine._moe_inputs(layer, block.mlp, h, kw).reshape(-1, h.shape[-1])
        idx, wts = block.route(x)
    counts = torch.bincount(idx.reshape(-1), minlength=module.num_experts).float()

    def timed(fn, reps: int) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    variants, outputs = {}, {}
    for name in ("factored", "factored-pageable", "fp32-padded-pageable"):
        set_variant(module, factored, name.removesuffix("-pageable"))
        with torch.no_grad():
            outputs[name] = module(x, idx, wts).float()
            experts_s = timed(lambda: module(x, idx, wts), args.reps)
            layer_s = timed(lambda: layer(h, **kw), args.reps)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        engine.PIN_HELD_STATES = not name.endswith("-pageable")
        source = store
        if not engine.PIN_HELD_STATES:  # the states as pageable host memory, read and written so
            source = engine.StateStore(1 << 50, None, engine.STATES_HOME)
            for i in range(len(store)):
                source.append(store[i])
        sync()
        t0 = time.perf_counter()
        engine.propagate(layer, source, kwargs_by_bs, None, f"propagating ({name})").close()
        sync()
        per_batch = (time.perf_counter() - t0) / args.batches
        engine.PIN_HELD_STATES = True
        variants[name] = {"s_per_batch": round(per_batch, 4), "layer_s_per_batch": round(layer_s, 4),
                          "experts_s_per_batch": round(experts_s, 4),
                          "s_per_layer_paper": round(per_batch * PAPER_BATCHES, 1),
                          "peak_gpu_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                                           if device.type == "cuda" else None)}
    set_variant(module, factored, "factored")
    ref = outputs["fp32-padded-pageable"]
    del outputs["factored-pageable"]
    read_s = sum(timed(lambda i=i: store[i], 1) for i in range(min(len(store), 4))) / min(len(store), 4)
    write_s = timed(lambda: h.to("cpu"), 2)
    return {
        "variants": variants,
        "speedup_propagation": round(variants["fp32-padded-pageable"]["s_per_batch"]
                                     / variants["factored"]["s_per_batch"], 2),
        "speedup_experts": round(variants["fp32-padded-pageable"]["experts_s_per_batch"]
                                 / variants["factored"]["experts_s_per_batch"], 2),
        "experts_rel_diff": float((outputs["factored"] - ref).norm() / ref.norm()),
        "read_batch_s": round(read_s, 4), "write_batch_s": round(write_s, 4),
        "batch_mib": round(h.numel() * h.element_size() / 2**20, 1),
        "rows_per_expert": {"max": int(counts.max()), "mean": round(float(counts.mean()), 1),
                            "min": int(counts.min())},
    }


def markdown(doc: dict) -> str:
    lines = [f"# Propagation through one compressed {doc['shape']} layer ({doc['format']})", "",
             f"    {doc['command']}", "",
             f"{doc['date']}, {doc['gpu']}, commit {doc['commit']}: {doc['batches']} batches of {doc['batch_size']} "
             f"x {doc['seq_len']} tokens ({doc['batch_mib']} MiB of states each), held in host memory.", "",
             "| variant | s per batch (propagate) | layer alone | experts alone | s per layer at the paper's "
             "calibration (144 batches) | peak GPU GiB |", "| --- | --- | --- | --- | --- | --- |"]
    for name, v in doc["variants"].items():
        lines.append(f"| {name} | {v['s_per_batch']} | {v['layer_s_per_batch']} | {v['experts_s_per_batch']} | "
                     f"{v['s_per_layer_paper']} | {v['peak_gpu_gib']} |")
    r = doc["rows_per_expert"]
    lines += ["", f"Speedup (factored over fp32-padded-pageable): propagation {doc['speedup_propagation']}x, experts "
              f"{doc['speedup_experts']}x; experts' outputs differ by {doc['experts_rel_diff']:.2e} (relative norm). "
              f"Routed rows per expert in a batch: max {r['max']}, mean {r['mean']}, min {r['min']}. Reading one "
              f"batch from host memory {doc['read_batch_s']} s, writing one back {doc['write_batch_s']} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for propagation_speed.json and .md")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--format", default="p48-nvfp4")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="a narrow layer of the same architecture (smoke runs)")
    args = ap.parse_args(argv)
    cmd = ["python", "benchmarks/propagation_speed.py", *(argv if argv is not None else sys.argv[1:])]
    out = args.out
    cmd = [a if a != str(out) else out.name for a in cmd]
    doc = {"benchmark": STEM, "date": _dt.date.today().isoformat(), "commit": git_commit(),
           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "shape": "qwen3-30b-a3b" + (" (small)" if args.small else ""), "format": args.format,
           "batches": args.batches, "batch_size": args.batch_size, "seq_len": args.seq_len,
           "command": " ".join(cmd), **measure(args)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STEM}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{STEM}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
