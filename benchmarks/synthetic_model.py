"""Random-weight MoE checkpoints of a real model's shape, written shard by shard.

What the scale benchmarks and the host-memory tests compress: a Qwen3-MoE checkpoint in the layout released
Qwen checkpoints use (one tensor per expert projection, bf16, sharded safetensors with an index), random
weights of the shape's initializer scale, and the embedded micro model's tokenizer (its ids are a prefix of
any larger vocabulary). One decoder layer per shard, generated on `device` (a GPU makes the 57 GiB
Qwen3-30B-A3B shape take about as long as writing it) and written while the next is generated, so the whole
model is never in memory. The directory appears atomically (written under a temporary name, then renamed)
with `moesq_synthetic.json` naming its shape and seed; writing the same shape and seed again is a no-op.
"""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from moesq_core.compression.config import DEFAULT_MODEL
from moesq_core.progress import NullProgress

MARKER = "moesq_synthetic.json"

# Qwen/Qwen3-30B-A3B's config.json (architecture fields): 48 MoE layers of 128 experts (768 wide), top-8.
QWEN3_30B_A3B = dict(
    hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    vocab_size=151936, max_position_embeddings=40960, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    initializer_range=0.02,
)

# A Kimi-K2 MoE block in the Qwen3-MoE architecture: moonshotai/Kimi-K2's routed experts (384 of 7168 × 2048,
# top-8) and width; its attention (MLA), shared expert and 61 layers are not reproduced, and the vocabulary is
# cut to 32,768 (the embedded tokenizer's ids are a prefix) so one block fits a single GPU machine's disk.
KIMI_K2_BLOCK = dict(
    QWEN3_30B_A3B, hidden_size=7168, num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8,
    head_dim=128, intermediate_size=18432, moe_intermediate_size=2048, num_experts=384, num_experts_per_tok=8,
    vocab_size=32768,
)

SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "kimi-k2-block": KIMI_K2_BLOCK}


def qwen3_moe_config(**overrides) -> dict:
    """A Qwen3-MoE config.json: the embedded model's, with `overrides` (num_experts also sets
    num_local_experts, which some transformers versions read)."""
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    cfg.update(overrides)
    cfg["num_local_experts"] = cfg["num_experts"]
    return cfg


def layer_tensors(cfg: dict, layer: int, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Layer `layer`'s tensors (on the CPU, bf16)."""
    H, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, inter, std = cfg["num_experts"], cfg["moe_intermediate_size"], cfg.get("initializer_range", 0.02)

    def rnd(*shape, scale=std):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16, device=device)

    p = f"model.layers.{layer}."
    sd = {p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
          p + "self_attn.q_proj.weight": rnd(heads * hd, H), p + "self_attn.k_proj.weight": rnd(kv * hd, H),
          p + "self_attn.v_proj.weight": rnd(kv * hd, H), p + "self_attn.o_proj.weight": rnd(H, heads * hd),
          p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
          # a wider router than the projections: RMS-normalised inputs of norm ~sqrt(H) then give logits of
          # order 1, i.e. uneven but not degenerate routing
          p + "mlp.gate.weight": rnd(E, H, scale=max(std, 1.0 / H ** 0.5))}
    gate, up, down = rnd(E, inter, H), rnd(E, inter, H), rnd(E, H, inter)
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        sd.update({q + "gate_proj.weight": gate[e], q + "up_proj.weight": up[e], q + "down_proj.weight": down[e]})
    return {k: v.to("cpu", copy=True) for k, v in sd.items()}  # own storage each: safetensors refuses shared views


def write_random_qwen3_moe(out: Path | str, cfg: dict, seed: int = 0, device: str | torch.device = "cpu",
                           progress=None) -> int:
    """Write a random-weight Qwen3-MoE checkpoint of config `cfg` (see qwen3_moe_config) to `out`. Returns its
    weight bytes. An existing `out` written by this function with the same config and seed is kept as is;
    any other existing `out` is refused (nothing is overwritten)."""
    out = Path(out)
    marker = {"config": cfg, "seed": seed}
    if out.exists():
        try:
            done = json.loads((out / MARKER).read_text())
        except (OSError, ValueError):
            done = None
        if done is None or {k: done.get(k) for k in marker} != marker:
            raise FileExistsError(f"{out} exists and is not a random checkpoint of this config and seed; "
                                  "choose another path")
        return done["weight_bytes"]
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():  # an interrupted earlier write of ours (the name is ours alone)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(DEFAULT_MODEL / f, tmp / f)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    layers, total, weight_map = cfg["num_hidden_layers"], 0, {}
    shards = layers + 1

    def write(name: str, sd: dict) -> None:
        save_file(sd, str(tmp / name), metadata={"format": "pt"})

    progress = progress if progress is not None else NullProgress()
    with progress.task("random model: shards", shards) as task, ThreadPoolExecutor(max_workers=2) as pool:
        # shard i is written while shard i+1 is generated
        pending = []
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            if i < layers:
                sd = layer_tensors(cfg, i, gen, device)
            else:
                H, V = cfg["hidden_size"], cfg["vocab_size"]
                emb = (torch.randn(V, H, generator=gen, device=device) * cfg.get("initializer_range", 0.02))
                sd = {"model.embed_tokens.weight": emb.to(torch.bfloat16).cpu(),
                      "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
                if not cfg.get("tie_word_embeddings", False):
                    head = torch.randn(V, H, generator=gen, device=device) * cfg.get("initializer_range", 0.02)
                    sd["lm_head.weight"] = head.to(torch.bfloat16).cpu()
            for k, t in sd.items():
                weight_map[k] = name
                total += t.numel() * t.element_size()
            pending.append(pool.submit(write, name, sd))
            while len(pending) > 2:  # bound the shards in memory
                pending.pop(0).result()
            task.advance()
        for f in pending:
            f.result()
    if device.type == "cuda":
        # the generator's freed blocks stay reserved in this process's cache otherwise (a Kimi-K2 layer: ~64 GiB),
        # and the moesq commands that follow in other processes would run out of device memory
        torch.cuda.empty_cache()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / MARKER).write_text(json.dumps({**marker, "weight_bytes": total}, indent=2))
    tmp.rename(out)
    return total
