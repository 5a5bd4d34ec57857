"""Model adapters on small random configs of every supported family (built offline) and on the shared
models: block discovery, exact routing, expert weights, and swapping in the moesq experts module."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from moesq_core.models import UnsupportedModelError, adapter_for, load_model
from moesq_core.serving.experts import MoesqExperts


def _configs():
    from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                  max_position_embeddings=64)
    return {
        "qwen3-moe": Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                    num_experts_per_tok=2, head_dim=32, norm_topk_prob=True),
        "qwen2-moe": Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                    num_experts_per_tok=2, shared_expert_intermediate_size=48),
        "mixtral": MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
        "deepseek-v3": DeepseekV3Config(**common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                        n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=None,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
        "olmoe": OlmoeConfig(**common, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    }


@pytest.fixture(scope="module", params=list(_configs()))
def family_model(request):
    torch.manual_seed(0)
    cfg = _configs()[request.param]
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random, non-degenerate routers and experts
        for name, p in model.named_parameters():
            if "gate" in name or "experts" in name or "correction_bias" in name:
                p.normal_(0, 0.5)
    return request.param, model


def test_adapter_found_and_blocks(family_model):
    family, model = family_model
    adapter = adapter_for(model)
    assert adapter.family == family
    blocks = adapter.blocks(model)
    expect = 1 if family == "deepseek-v3" else 2  # first_k_dense_replace=1 keeps layer 0 dense
    assert len(blocks) == expect
    b = blocks[0]
    w = b.expert_weights(0)
    E, two_i, H = b.dense_experts.gate_up_proj.shape
    assert w["gate"].shape == (two_i // 2, H) and w["down"].shape == (H, two_i // 2)


@torch.no_grad()
def test_routing_and_swap_reproduce_the_block_exactly(family_model):
    family, model = family_model
    adapter = adapter_for(model)
    b = adapter.blocks(model)[0]
    x = torch.randn(3, 7, model.config.hidden_size)
    ref = b.mlp(x)
    idx, wts = b.route(x)
    assert idx.shape == wts.shape == (21, model.config.num_experts_per_tok)
    if family == "deepseek-v3":
        assert torch.allclose(wts.sum(-1), torch.full((21,), 2.5), atol=1e-5)  # renormalised × scaling factor
    ex = b.dense_experts
    module = MoesqExperts("p48-nvfp4", ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone(), act_quant=False)
    b.set_experts(module)
    try:
        out = b.mlp(x)
    finally:
        b.restore_dense()
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)  # summation order differs
    assert b.mlp.experts is ex


def test_non_moe_and_unknown_models_are_refused():
    from transformers import LlamaConfig

    with pytest.raises(UnsupportedModelError, match="dense \\(non-MoE\\) model.*qwen3-moe"):
        adapter_for(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64))


def test_wrong_model_id_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not-a-dir"):
        load_model(str(tmp_path / "not-a-dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="could not be found locally nor downloaded"):
        load_model("nonexistent-org-xyz/nonexistent-model-xyz")


@torch.no_grad()
def test_shared_micro_model_routes_like_the_model(micro_path):
    model, tok, adapter, _ = load_model(micro_path)
    blocks = adapter.blocks(model)
    assert adapter.family == "qwen3-moe" and len(blocks) == 4 and blocks[0].num_experts == 8
    ids = tok("The kernel schedules tasks on every CPU.", return_tensors="pt")["input_ids"]
    ref = model(input_ids=ids).logits
    for b in blocks:
        ex = b.dense_experts
        b.set_experts(MoesqExperts("p48-nvfp4", ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone(), False))
    assert torch.allclose(model(input_ids=ids).logits, ref, atol=1e-4)


@pytest.mark.parametrize("fmt", ["p48-nvfp4", "s24-fp8"])
def test_experts_forward_reads_the_static_scales_once_and_computes_what_each_expert_does(fmt):
    # forward takes every expert's static/dynamic quantizer choice from one read of the scales; the result must be
    # exactly the per-expert path's, including experts with no calibrated scale (0: dynamic) and unused experts
    torch.manual_seed(0)
    E, H, inter, T, k = 5, 64, 32, 40, 2
    gate_up, down = torch.randn(E, 2 * inter, H) * 0.1, torch.randn(E, H, inter) * 0.1
    g_in = torch.tensor([2000.0, 0.0, 350.0, 0.0, 90.0])
    g_mid = torch.tensor([0.0, 800.0, 60.0, 0.0, 1500.0])
    module = MoesqExperts(fmt, gate_up, down, act_quant=True, act_global_in=g_in, act_global_mid=g_mid)
    x = torch.randn(T, H)
    idx = torch.randint(0, E - 1, (T, k))  # expert E-1 gets no token
    w = torch.rand(T, k)
    expected = torch.zeros(T, H)
    # each expert on all its rows at once (a dynamic scale is taken over them), scales read per expert
    for e in range(E):
        t, j = (idx == e).nonzero(as_tuple=True)
        if len(t):
            expected.index_add_(0, t, module.expert_forward(e, x[t]) * w[t, j, None])
    got = module(x, idx, w)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    sg = module.static_globals()
    uses = module.fmt.act.uses_global_scale
    assert [a is not None for a, _ in sg] == ([bool(v > 0) for v in g_in] if uses else [False] * E)
    assert [b is not None for _, b in sg] == ([bool(v > 0) for v in g_mid] if uses else [False] * E)


@pytest.mark.parametrize("fmt", ["p48-nvfp4", "s24-fp8", "dense-nvfp4"])
def test_experts_batched_forward_equals_the_per_expert_loop(fmt, monkeypatch):
    # the GPU's batched path (rows padded per expert, bmm), run here on the CPU against the loop: same quantizer
    # arithmetic per expert (static and dynamic scales, an expert without rows), matmuls batched; in chunks of
    # experts too
    torch.manual_seed(1)
    E, H, inter, T, k = 6, 64, 32, 50, 2
    module = MoesqExperts(fmt, torch.randn(E, 2 * inter, H) * 0.1, torch.randn(E, H, inter) * 0.1, act_quant=True,
                          act_global_in=torch.tensor([2000.0, 0.0, 350.0, 0.0, 90.0, 10.0]),
                          act_global_mid=torch.tensor([0.0, 800.0, 60.0, 0.0, 1500.0, 0.0]))
    x = torch.randn(T, H)
    idx = torch.randint(0, E - 1, (T, k))  # expert E-1 gets no row
    idx[:5] = torch.tensor([0, 1])  # an uneven load
    w = torch.rand(T, k)
    want = module(x, idx, w)
    assert module.batched is None  # auto by default: the loop on the CPU
    torch.testing.assert_close(module(x, idx, w), want, rtol=0, atol=0)
    module.batched = True
    got = module(x, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the matmuls' rounding apart (~1e-7 here)
    assert (got == want).float().mean() > 0.9
    assert module(x.bfloat16(), idx, w).dtype == torch.bfloat16
    monkeypatch.setattr(MoesqExperts, "BATCH_BYTES", 1)  # one expert per chunk
    torch.testing.assert_close(module(x, idx, w), got, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["p48-nvfp4", "s24-fp8"])
def test_experts_on_cuda_batch_when_auto_and_match_the_loop_and_the_cpu(fmt):
    torch.manual_seed(2)
    E, H, inter, T, k = 16, 256, 128, 700, 4
    module = MoesqExperts(fmt, torch.randn(E, 2 * inter, H) * 0.05, torch.randn(E, H, inter) * 0.05, act_quant=True,
                          act_global_in=torch.rand(E) * 500 * (torch.rand(E) > 0.3),
                          act_global_mid=torch.rand(E) * 800 * (torch.rand(E) > 0.3))
    x = torch.randn(T, H)
    idx = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])  # expert E-1 gets no row
    w = torch.rand(T, k)
    cpu = module(x, idx, w)
    gpu = module.to("cuda")
    gpu.batched = None  # auto: batched on CUDA
    batched = gpu(x.cuda(), idx.cuda(), w.cuda())
    assert torch.equal(gpu(x.cuda(), idx.cuda(), w.cuda()), batched)  # deterministic (no atomics in the sum)
    gpu.batched = False
    loop = gpu(x.cuda(), idx.cuda(), w.cuda())
    # relative error over the whole output: a matmul rounding can move an activation code that sits on a
    # rounding boundary, which a per-element tolerance would flag (an FP8 code step is 1/8 of the value: a few such
    # moves gave 1.2e-4 on the H200)
    for other in (loop.cpu(), cpu):
        assert ((batched.cpu() - other).norm() / other.norm()).item() < 3e-4
