"""P48HopperExperts: the reference path against the project's reference experts module and against the
micro model with the same dequantized weights (CPU), the fast path under the Triton interpreter, and on a GPU
the fast path in the micro model (logits, CUDA-graph replay)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moesq_core.formats import get_format
from moesq_core.formats.packing import pack, unpack
from moesq_core.serving.experts import MoesqExperts
from moesq_core.serving.kernels import p48_mma as pm
from moesq_core.serving.p48_hopper import P48HopperExperts

from conftest import (
    assert_experts_module_rejects_bad_inputs,
    assert_graph_replays,
    rel,
    routing,
    run_triton_interpreted,
)

FMT = get_format("p48-nvfp4")
REPO = Path(__file__).resolve().parents[2]
SHARED_MICRO = REPO.parent / "shared" / "models" / "micro-qwen3-moe"
ASSET_MICRO = REPO / "moesq_core" / "assets" / "micro-qwen3-moe"


def micro_model_path() -> Path:
    for p in (SHARED_MICRO, ASSET_MICRO):
        if (p / "config.json").is_file():
            return p
    pytest.skip("micro-qwen3-moe not found")


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor, g_in: torch.Tensor, g_mid: torch.Tensor):
    """Fused expert weights [E, 2I, H] / [E, H, I] -> packed[e] = {gate, up, down: {suffix: tensor}} (RTN,
    magnitude masks, gate and up sharing one global scale)."""
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    packed = []
    for e in range(E):
        gw, uw, dw = gate_up[e, :inter].float(), gate_up[e, inter:].float(), down[e].float()
        mg, mu = FMT.magnitude_mask(gw), FMT.magnitude_mask(uw)
        g = FMT.global_scale(gw * mg, uw * mu)
        t = {"gate": pack(FMT.quantize(gw, mg, g)), "up": pack(FMT.quantize(uw, mu, g)), "down": pack(FMT.quantize(dw))}
        for p in ("gate", "up"):
            t[p]["input_global_scale"] = g_in[e].reshape(1).float()
        t["down"]["input_global_scale"] = g_mid[e].reshape(1).float()
        packed.append(t)
    return packed


def dequantized(packed) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.stack([torch.cat([unpack("p48-nvfp4", t["gate"]).dequantize(),
                                      unpack("p48-nvfp4", t["up"]).dequantize()]) for t in packed])
    down = torch.stack([unpack("p48-nvfp4", t["down"]).dequantize() for t in packed])
    return gate_up, down


def random_experts(E=6, H=64, inter=96, seed=0, dynamic=(2,)):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * inter, H, generator=g) * 0.08
    down = torch.randn(E, H, inter, generator=g) * 0.08
    g_in = torch.full((E,), 2688.0 / 4.0)
    g_mid = torch.full((E,), 2688.0 / 0.5)
    for e in dynamic:  # no calibration data: dynamic activation scale
        g_in[e] = 0.0
        g_mid[(e + 1) % E] = 0.0
    return quantize_experts(gate_up, down, g_in, g_mid), g_in, g_mid


@pytest.mark.parametrize("act_quant", [False, True])
def test_reference_path_matches_moesq_experts(act_quant):
    packed, g_in, g_mid = random_experts()
    fast = P48HopperExperts.from_packed(packed, act_quant, "cpu")
    assert fast.reference
    gate_up, down = dequantized(packed)
    base = MoesqExperts(FMT, gate_up, down, act_quant, g_in, g_mid)
    x = torch.randn(11, 64)
    idx, w = routing(11, 6, 2)
    a, b = fast(x, idx, w), base(x, idx, w)
    assert a.shape == b.shape == (11, 64)
    assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_rejects_bad_inputs():
    packed, _, _ = random_experts(E=3)
    assert_experts_module_rejects_bad_inputs(P48HopperExperts.from_packed, packed, False, "cpu")


def _load_micro(device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(micro_model_path(), dtype=dtype).to(device).eval()
    return model


def _calibrate_and_pack(model, ids):
    """Static input global scales from a forward pass (per layer, shared by that layer's experts)."""
    amax = {}
    hooks = []
    layers = model.model.layers
    for i, layer in enumerate(layers):
        def hook(mod, args, i=i):
            amax[i] = args[0].detach().abs().amax().float().cpu()
        hooks.append(layer.mlp.experts.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    packed = []
    for i, layer in enumerate(layers):
        ex = layer.mlp.experts
        E = ex.gate_up_proj.shape[0]
        g_in = torch.full((E,), 2688.0 / float(amax[i]))
        g_mid = torch.where(torch.arange(E) % 2 == 0, torch.tensor(2688.0 / 0.3), torch.tensor(0.0))
        packed.append(quantize_experts(ex.gate_up_proj.detach().cpu(), ex.down_proj.detach().cpu(), g_in, g_mid))
    return packed


def test_micro_model_reference_logits_match_dequantized_model():
    model = _load_micro()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    packed = _calibrate_and_pack(model, ids)
    with torch.no_grad():
        for layer, p in zip(model.model.layers, packed):
            gu, dn = dequantized(p)
            layer.mlp.experts.gate_up_proj.copy_(gu)
            layer.mlp.experts.down_proj.copy_(dn)
        want = model(ids).logits
        for layer, p in zip(model.model.layers, packed):
            layer.mlp.experts = P48HopperExperts.from_packed(p, act_quant=False, device="cpu")
        got = model(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-5


_INTERP_SCRIPT = r"""
import torch
from conftest import routing
from test_runtime_p48 import random_experts
from moesq_core.serving.p48_hopper import P48HopperExperts
packed, _, _ = random_experts(E=5, H=64, inter=96, dynamic=(1,))
worst = 0.0
for aq in (False, True):
    ref_ = P48HopperExperts.from_packed(packed, aq, "cpu")
    fast = P48HopperExperts.from_packed(packed, aq, "cpu", reference=False)
    fast.use_asm = False
    for T, k in ((1, 1), (7, 2), (13, 3)):
        # bf16-representable inputs (the fast path's own dtype), drawn the same on every run
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).float()
        idx, w = routing(T, 5, k, seed=T)
        a, b = ref_(x, idx, w), fast(x, idx, w)
        tol = 0.0 if aq else 1e-2  # W4A16 feeds bf16 activations to the MMA; W4A4 values are exact in bf16
        err = ((a - b).norm() / a.norm()).item()
        assert err <= tol + 1e-6, (aq, T, k, err)
        worst = max(worst, err)
print("WORST", worst)
"""


@pytest.mark.slow
def test_fast_path_under_triton_interpreter():
    run_triton_interpreted(_INTERP_SCRIPT)


# ------------------------------------------------------------------------------------------ GPU


def _kernel_or_skip(kernel: str) -> str:
    if kernel == "sparse-mma":
        from moesq_core.serving.kernels.p48_mma import load_native

        if load_native() is None:
            pytest.skip("the sparse-tensor-core kernel needs an sm_90 GPU and the native module")
    return kernel


def test_rejects_unknown_kernel():
    packed, _, _ = random_experts(E=2, dynamic=())
    with pytest.raises(ValueError, match="kernel="):
        P48HopperExperts.from_packed(packed, False, "cpu", kernel="cutlass")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["sparse-mma", "triton"])
@pytest.mark.parametrize("act_quant", [False, True])
def test_gpu_micro_model_logits(act_quant, kernel):
    kernel = _kernel_or_skip(kernel)
    cpu = _load_micro()
    ids = torch.randint(0, cpu.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    packed = _calibrate_and_pack(cpu, ids)
    with torch.no_grad():
        for layer, p in zip(cpu.model.layers, packed):
            gu, dn = dequantized(p)
            layer.mlp.experts.gate_up_proj.copy_(gu)
            layer.mlp.experts.down_proj.copy_(dn)
        dense_ref = cpu(ids).logits  # fp32, dequantized weights, no activation quantization
        if act_quant:  # the CPU reference path defines the W4A4 numerics
            for layer, p in zip(cpu.model.layers, packed):
                layer.mlp.experts = P48HopperExperts.from_packed(p, act_quant=True, device="cpu")
            want = cpu(ids).logits
        else:
            want = dense_ref
    # W4A16 serves the bf16 model; W4A4 runs the model in fp32 so the quantized activations see the same
    # inputs as the CPU reference (in bf16, input differences flip E2M1 codes and are amplified layer by layer)
    dtype = torch.float32 if act_quant else torch.bfloat16
    gpu = _load_micro("cuda", dtype)
    with torch.no_grad():
        for layer, p in zip(gpu.model.layers, packed):
            layer.mlp.experts = P48HopperExperts.from_packed(p, act_quant=act_quant, device="cuda", kernel=kernel)
            assert layer.mlp.experts.kernel == kernel
        got = gpu(ids.cuda()).logits.float().cpu()
    err = rel(got, want)
    assert err < (1e-2 if act_quant else 3e-2), err
    top_agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert top_agree > 0.9, top_agree


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["sparse-mma", "triton"])
@pytest.mark.parametrize("act_quant", [False, True])
def test_gpu_module_matches_reference_and_replays_in_cuda_graph(act_quant, kernel, monkeypatch):
    kernel = _kernel_or_skip(kernel)
    packed, _, _ = random_experts(E=8, H=128, inter=192, dynamic=(3,))
    ref_ = P48HopperExperts.from_packed(packed, act_quant, "cpu")
    fast = P48HopperExperts.from_packed(packed, act_quant, "cuda", kernel=kernel)
    assert fast.kernel == kernel
    # sparse-mma: both GEMMs take their inputs in the kernel's K order (scatter; gate/up rows stored permuted)
    assert fast.k_ordered == (kernel == "sparse-mma")
    T, k = 9, 3
    gen = torch.Generator().manual_seed(5)  # inputs fixed: the CPU reference tolerance is for bf16 rounding
    xs = [torch.randn(T, 128, generator=gen) for _ in range(3)]
    routes = [routing(T, 8, k, seed=s) for s in range(3)]
    got = assert_graph_replays(fast, ref_, xs, routes, tol=1e-2, eager_tol=1e-6)
    if kernel == "sparse-mma":
        # the natural order through the same kernels gives the same outputs (the permutation is exact)
        natural = P48HopperExperts.from_packed(packed, act_quant, "cuda", kernel=kernel)
        natural.k_ordered = False
        natural.gate_up = pm.P48MmaWeights.from_packed(
            pm.stack_gate_up([t["gate"] for t in packed], [t["up"] for t in packed]), "cuda", "gate/up")
        x, (idx, w) = xs[0].to(torch.bfloat16).cuda(), routes[0]
        assert rel(natural(x, idx.cuda(), w.cuda()).float().cpu(), fast(x, idx.cuda(), w.cuda()).float().cpu()) <= 1e-6
    if act_quant and kernel == "sparse-mma":
        # expert 3 has no static input scale: its bf16 rows are quantized inside the gate/up GEMM, which must
        # give the operands of the separate quantization pass (outputs equal up to the order of split-K's atomics)
        from moesq_core.serving.kernels import p48_triton as pt

        passes = []
        real = pt.nvfp4_quantize_rows
        monkeypatch.setattr(pt, "nvfp4_quantize_rows", lambda *a, **kw: passes.append(1) or real(*a, **kw))
        fast.quant_in_kernel = False
        x, (idx, w) = xs[-1].to(torch.bfloat16).cuda(), routes[-1]
        with_pass = fast(x, idx.cuda(), w.cuda()).float().cpu()
        assert len(passes) == 2  # the gate/up input and (expert 4 is uncalibrated at the SwiGLU) the down input
        fast.quant_in_kernel = True
        assert rel(fast(x, idx.cuda(), w.cuda()).float().cpu(), with_pass) <= 1e-6
        assert len(passes) == 3  # the down input only
        assert rel(got, with_pass) <= 1e-6
        # at 24 rows per expert too
        idx2, w2 = routing(64, 8, k, seed=9)
        x2 = torch.randn(64, 128, dtype=torch.bfloat16, device="cuda")
        in_kernel = fast(x2, idx2.cuda(), w2.cuda()).float().cpu()
        assert len(passes) == 4
        fast.quant_in_kernel = False
        assert rel(fast(x2, idx2.cuda(), w2.cuda()).float().cpu(), in_kernel) <= 1e-6
        assert len(passes) == 6


_SCATTER_PERM_SCRIPT = r"""
import torch
from moesq_core.serving.kernels import p48_mma as pm, p48_triton as pt
torch.manual_seed(0)
T, k, E, H = 7, 3, 5, 96 + 64  # H not a multiple of the kernel's 256-column step
x = torch.randn(T, H).to(torch.bfloat16) * 3
idx = torch.randint(0, E, (T * k,), dtype=torch.int32)
counts = torch.bincount(idx.long(), minlength=E).to(torch.int32)
offsets = (torch.cumsum(counts, 0) - counts).to(torch.int32)
g = torch.rand(E) * 100 + 50
for quant in (False, True):
    outs = []
    for perm in (False, True):
        cursor = torch.zeros(E, dtype=torch.int32)
        slot_row, row_expert = (torch.empty(T * k, dtype=torch.int32) for _ in range(2))
        xs = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16)
        pt._route_scatter_kernel[(T * k,)](x, idx, offsets, cursor, slot_row, row_expert, xs, g, H, x.stride(0),
                                           xs.stride(0), TOPK=k, NBLK=8, QUANT=quant, PERM=perm)
        outs.append((xs, slot_row, row_expert))
    (nat, s0, r0), (per, s1, r1) = outs
    assert torch.equal(s0, s1) and torch.equal(r0, r1)
    assert torch.equal(per.view(torch.int16), nat[:, pm.k_order(H)].view(torch.int16)), quant
print("OK")
"""


def test_route_scatter_writes_the_kernel_k_order_under_interpreter():
    """The routing scatter with PERM writes each row in the sparse-MMA kernel's K order: the natural row's values
    at p48_mma.k_order, bit for bit, NVFP4-quantized (32-column blocks) or not; same slots either way."""
    assert run_triton_interpreted(_SCATTER_PERM_SCRIPT).strip().endswith("OK")
