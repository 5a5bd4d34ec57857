"""The vLLM plugin's custom op on a Hopper GPU, outside vLLM (its wheel needs another torch): for p48-nvfp4 W4A16
and W4A4 and s24-fp8 W8A8, at batch 1, 16 and 64, the op over the format's fast experts module equals the CPU
reference (MoesqExperts) and the decode benchmark's step (a CUDA graph of the model's forward, moesq_core.serving.
bench.e2e_decode) runs as fast through the op as with the module called directly (within 5 %).

    pytest -q -n 0 tests/serving/test_vllm_op_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from moesq_core.formats import get_format
from moesq_core.serving.experts import MoesqExperts, make_experts
from moesq_core.serving.vllm_plugin.op import OpExperts, register_experts

from conftest import rel, routing

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]
VARIANTS = {"p48_w4a16": ("p48-nvfp4", False), "p48_w4a4": ("p48-nvfp4", True), "s24_w8a8": ("s24-fp8", True)}
TOL = {"p48-nvfp4": 1e-2, "s24-fp8": 5e-2}  # bf16 rounding; fp8 tensor cores' accumulation (test_runtime_s24)
BATCHES = (1, 16, 64)


def random_packed(fmt, E: int, H: int, inter: int, seed: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """packed[e] of random weights, quantized and packed by the format (gate and up share one global scale), with
    a calibrated input scale where the format stores one."""
    gen = torch.Generator().manual_seed(seed)
    g_act = fmt.act.global_from_amax(torch.tensor(4.0)) if fmt.act.uses_global_scale else None
    packed = []
    for _ in range(E):
        gate, up = (torch.randn(inter, H, generator=gen) / H**0.5 for _ in range(2))
        down = torch.randn(H, inter, generator=gen) / inter**0.5
        mg, mu = fmt.magnitude_mask(gate), fmt.magnitude_mask(up)
        g = fmt.global_scale(gate * mg, up * mu)
        t = {"gate": fmt.pack(fmt.quantize(gate, mg, g)), "up": fmt.pack(fmt.quantize(up, mu, g)),
             "down": fmt.pack(fmt.quantize(down))}
        for p in t:
            t[p].update(fmt.act.packed_tensors(g_act))
        packed.append(t)
    return packed


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_op_on_gpu_equals_cpu_reference(variant):
    fmt, act_quant = get_format(VARIANTS[variant][0]), VARIANTS[variant][1]
    E, H, inter, k = 16, 512, 256, 4
    packed = random_packed(fmt, E, H, inter, seed=1)
    fast = make_experts(fmt, packed, act_quant, torch.device("cuda"))
    assert not isinstance(fast, MoesqExperts), "the format's Hopper module did not serve the GPU"
    ref = MoesqExperts.from_packed(fmt, packed, act_quant)
    register_experts(f"gpu-test.{variant}", fast)
    for T in BATCHES:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
        ids, w = routing(T, E, k, seed=T)
        got = torch.ops.moesq.routed_experts(x.cuda(), ids.cuda().to(torch.int32), w.cuda(), f"gpu-test.{variant}")
        assert got.dtype == torch.bfloat16
        assert rel(got.float().cpu(), ref(x.float(), ids, w)) < TOL[fmt.name], (variant, T)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_step_through_the_op_runs_at_the_modules_speed(variant):
    from transformers import AutoModelForCausalLM

    from moesq_core.serving.bench import e2e_decode as bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):  # the benchmark's model (bench.main), 8 of its 48 layers
        model = AutoModelForCausalLM.from_config(bench.qwen3_30b_config(layers=8), dtype=torch.bfloat16).eval()
    bench.replace_experts(model, variant, gen)
    direct = {B: bench.run_decode(model, B, 128, 64, 5.0, gen) for B in BATCHES}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts = OpExperts(layer.mlp.experts, f"decode-test.{variant}.{i}")
    through_op = {B: bench.run_decode(model, B, 128, 64, 5.0, gen) for B in BATCHES}
    for B in BATCHES:
        assert direct[B]["cuda_graph"] and through_op[B]["cuda_graph"], (through_op[B].get("graph_error"))
        assert through_op[B]["step_ms"] <= 1.05 * direct[B]["step_ms"], (variant, B, direct[B], through_op[B])
