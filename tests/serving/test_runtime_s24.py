"""S24HopperExperts: the reference path against the project's reference experts module (random experts and the
micro model, CPU), its capacity modes, input checks, and on a Hopper GPU the kernel path against the reference
path (eager and CUDA-graph replay with changing routes)."""
from __future__ import annotations

import pytest
import torch

from moesq_core.formats import get_format
from moesq_core.formats.packing import pack, unpack
from moesq_core.serving import s24_hopper
from moesq_core.serving.experts import MoesqExperts
from moesq_core.serving.s24_hopper import S24HopperExperts

from conftest import assert_experts_module_rejects_bad_inputs, assert_graph_replays, rel, routing

FMT = get_format("s24-fp8")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor):
    """Fused expert weights [E, 2I, H] / [E, H, I] -> (packed[e] = {gate, up, down: {suffix: tensor}}, the
    QuantizedWeights for the reference module). RTN with magnitude 2:4 masks."""
    inter = gate_up.shape[1] // 2
    packed, qws = [], []
    for e in range(gate_up.shape[0]):
        q = {"gate": FMT.quantize(gate_up[e, :inter].float()), "up": FMT.quantize(gate_up[e, inter:].float()),
             "down": FMT.quantize(down[e].float())}
        qws.append(q)
        packed.append({p: pack(w) for p, w in q.items()})
    return packed, qws


def random_experts(E=6, H=64, inter=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_experts(torch.randn(E, 2 * inter, H, generator=g) * 0.08,
                            torch.randn(E, H, inter, generator=g) * 0.08)


# ------------------------------------------------------------------------------------------------ CPU


def test_reference_path_matches_moesq_experts():
    packed, qws = random_experts()
    mod = S24HopperExperts.from_packed(packed, True, "cpu")
    assert mod.reference and (mod.num_experts, mod.hidden_dim, mod.intermediate_dim) == (6, 64, 96)
    base = MoesqExperts.from_quantized(FMT, qws, act_quant=True)
    gen = torch.Generator().manual_seed(0)
    for T, k in ((1, 1), (11, 2), (23, 4)):
        x = torch.randn(T, 64, generator=gen) * 3
        idx, w = routing(T, 6, k, seed=T)
        a, b = mod(x, idx, w), base(x, idx, w)
        assert a.shape == b.shape == (T, 64)
        # differences: the GEMM outputs are rounded to bf16 (as the kernel writes them), which moves some
        # SwiGLU outputs across an e4m3 rounding boundary: up to ~4 % on one token, about the W8A8 quantization
        # noise itself (test_reference_path_matches_token_by_token_numerics checks the numerics exactly)
        assert rel(a, b) < 6e-2, (T, k, rel(a, b))


def _token_by_token(qws, x, idx, w):
    """The serving numerics written out per (token, slot): e4m3 per-token activations, exact GEMM sums then
    the two scales, bf16 GEMM outputs, fp32 SwiGLU, slot-order fp32 combine."""
    from moesq_core.serving.kernels.s24_gemm import quantize_activations

    def gemm(xrow, qw):
        xq, sx = quantize_activations(xrow[None])
        acc = (xq.double() @ qw.codes.view(torch.float8_e4m3fn).double().T).float()
        return ((acc * qw.scales.reshape(1, -1).float()) * sx[:, None]).to(torch.bfloat16)[0].float()

    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            q = qws[int(idx[t, j])]
            a = torch.nn.functional.silu(gemm(x[t], q["gate"])) * gemm(x[t], q["up"])
            out[t] += gemm(a, q["down"]) * w[t, j].float()
    return out


def test_reference_path_matches_token_by_token_numerics():
    packed, qws = random_experts(E=5, H=32, inter=64, seed=2)
    mod = S24HopperExperts.from_packed(packed, True, "cpu")
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(1)) * 2
    idx, w = routing(13, 5, 3, seed=5)
    assert torch.allclose(mod(x, idx, w), _token_by_token(qws, x, idx, w), rtol=1e-6, atol=1e-6)


def test_unpacked_weights_are_the_packed_ones():
    """The module holds the packed tensors unchanged (gate rows then up rows per expert)."""
    packed, qws = random_experts(E=2, H=32, inter=16)
    mod = S24HopperExperts.from_packed(packed, True, "cpu")
    v, m, s = mod._ref["gate_up"]
    for e in range(2):
        for half, p in enumerate(("gate", "up")):
            rows = slice(half * 16, (half + 1) * 16)
            qw = unpack("s24-fp8", {"weight_sparse_values": v[e, rows], "weight_sparse_meta": m[e, rows],
                                    "weight_scale": s[e, rows, None]})
            assert torch.equal(qw.codes, qws[e][p].codes)


def test_static_and_dynamic_capacity_agree(monkeypatch):
    """Capacity T (decode, graph capture) and capacity = largest count (large eager calls) give equal outputs."""
    packed, _ = random_experts(E=5, H=32, inter=64, seed=1)
    mod = S24HopperExperts.from_packed(packed, True, "cpu")
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    idx, w = routing(40, 5, 2, seed=3)
    a = mod(x, idx, w)
    monkeypatch.setattr(s24_hopper, "STATIC_CAPACITY_TOKENS", 8)
    b = mod(x, idx, w)
    assert torch.equal(a, b)
    assert torch.equal(mod(x[:0], idx[:0], w[:0]), x[:0])


def test_rejects_bad_inputs():
    packed, _ = random_experts(E=3)
    with pytest.raises(ValueError, match="W8A8"):
        S24HopperExperts.from_packed(packed, False, "cpu")
    assert_experts_module_rejects_bad_inputs(S24HopperExperts.from_packed, packed, True, "cpu")
    bad = [{p: dict(d) for p, d in t.items()} for t in packed]
    del bad[2]["down"]["weight_scale"]
    with pytest.raises(ValueError, match="weight_scale"):
        S24HopperExperts.from_packed(bad, True, "cpu")
    assert not s24_hopper.available("cpu")


def test_kernel_path_needs_hopper():
    if HOPPER:
        pytest.skip("this machine has a Hopper GPU")
    packed, _ = random_experts(E=2)
    with pytest.raises(RuntimeError, match="s24-fp8 kernel"):
        S24HopperExperts.from_packed(packed, True, "cpu", reference=False)


def _load_micro(device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from conftest import MICRO

    if not (MICRO / "config.json").is_file():
        pytest.skip(f"micro model not found at {MICRO}")
    return AutoModelForCausalLM.from_pretrained(MICRO, dtype=dtype).to(device).eval()


def _micro_packed(model):
    return [quantize_experts(layer.mlp.experts.gate_up_proj.detach().cpu(), layer.mlp.experts.down_proj.detach().cpu())
            for layer in model.model.layers]


@torch.no_grad()
def test_micro_model_reference_logits_match_reference_module():
    model = _load_micro()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    per_layer = _micro_packed(model)
    for layer, (_, qws) in zip(model.model.layers, per_layer):
        layer.mlp.experts = MoesqExperts.from_quantized(FMT, qws, act_quant=True)
    want = model(ids).logits
    for layer, (packed, _) in zip(model.model.layers, per_layer):
        layer.mlp.experts = S24HopperExperts.from_packed(packed, True, "cpu")
    got = model(ids).logits
    # only the bf16 rounding of the GEMM outputs differs (it moves some activations across e4m3 boundaries)
    assert rel(got, want) < 5e-2, rel(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.hopper
@torch.no_grad()
def test_gpu_module_matches_reference_and_replays_in_cuda_graph():
    E, H, inter = 8, 128, 192
    packed, _ = random_experts(E=E, H=H, inter=inter, seed=4)
    ref = S24HopperExperts.from_packed(packed, True, "cpu")
    fast = S24HopperExperts.from_packed(packed, True, "cuda")
    assert not fast.reference and fast.expert_nbytes() > 0
    assert fast.fused_routing
    gen = torch.Generator().manual_seed(5)
    T, k = 9, 3
    xs = [torch.randn(T, H, generator=gen) * (1 + s) for s in range(3)]
    routes = [routing(T, E, k, seed=s) for s in range(3)]
    outs = {}
    for fused in (False, True):  # the torch-op routing, then the fused Triton kernels (the default)
        fast.fused_routing = fused
        # the fp8 tensor cores add with fewer bits than fp32 between promotions (s24_fp8.error_bound), so the
        # bf16 GEMM outputs often differ from the float64 reference in the last bit and some SwiGLU outputs
        # cross e4m3 boundaries: ~1-2 % here, against O(1) for a wrong row, expert or scale
        outs[fused] = assert_graph_replays(fast, ref, xs, routes, tol=5e-2)
    # same GEMMs, same e4m3 codes (scales may differ in the last bit, sigmoid by an ulp): nearly equal
    assert rel(outs[True], outs[False]) < 1e-3, rel(outs[True], outs[False])
    # a prefill-sized eager call (capacity from the counts) against the reference
    T2 = 300
    x = torch.randn(T2, H, generator=gen)
    idx, w = routing(T2, E, 2, seed=9)
    got = fast(x.cuda(), idx.cuda(), w.cuda()).float().cpu()
    assert rel(got, ref(x, idx, w)) < 5e-2


@pytest.mark.gpu
@pytest.mark.hopper
@torch.no_grad()
def test_gpu_fused_routing_kernels_match_torch_ops():
    """route_quant: the per-token e4m3 quantization bit for bit, every (token, slot) in its expert's slab, counts;
    swiglu_quant and combine against the torch ops, on awkward sizes."""
    from moesq_core.serving.kernels import s24_route
    from moesq_core.serving.kernels.s24_gemm import quantize_activations

    E, H, inter, T, k = 5, 200, 72, 13, 3
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(T, H, generator=gen) * torch.exp(torch.randn(T, 1, generator=gen))).to(torch.bfloat16).cuda()
    x[4] = 0  # an all-zero token: scale 1
    idx, w = routing(T, E, k, seed=6)
    idx, w = idx.cuda(), w.cuda()
    xq, sx, counts, row = s24_route.route_quant(x, idx, E, T)
    assert torch.equal(counts.cpu(), torch.bincount(idx.flatten().cpu(), minlength=E).int())
    e_of, pos = row // T, row % T
    assert torch.equal(e_of.cpu(), idx.flatten().cpu())
    assert bool((pos < counts.long()[e_of]).all())
    assert len(set(row.tolist())) == T * k
    wq, ws = quantize_activations(x)
    tok = torch.arange(T * k, device="cuda") // k
    assert torch.equal(xq.view(E * T, H)[row].view(torch.uint8), wq[tok].view(torch.uint8))
    # torch divides by the scalar 448 as a multiply by its reciprocal on CUDA; the kernel divides exactly
    assert torch.allclose(sx.view(-1)[row], ws[tok], rtol=2**-23, atol=0)
    assert float(ws[4]) == 1.0
    y1 = (torch.randn(E, T, 2 * inter, generator=gen) * 3).to(torch.bfloat16).cuda()
    xq2, sx2 = s24_route.swiglu_quant(y1, row, inter)
    h = y1.view(E * T, 2 * inter)[row].float()
    aq, sa = quantize_activations(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:])
    got = xq2.view(E * T, inter)[row].float() * sx2.view(-1)[row, None]
    want = aq.float() * sa[:, None]
    same = (xq2.view(E * T, inter)[row].view(torch.uint8) == aq.view(torch.uint8)).float().mean().item()
    assert same > 0.99 and rel(got, want) < 1e-2, (same, rel(got, want))  # sigmoid may differ by an ulp
    y2 = torch.randn(E, T, H, generator=gen).to(torch.bfloat16).cuda()
    for dtype in (torch.bfloat16, torch.float32):
        out = s24_route.combine(y2, row, w, dtype)
        ref_out = (y2.view(E * T, H)[row].float() * w.reshape(-1, 1).float()).view(T, k, H).sum(1)
        assert out.dtype == dtype
        assert torch.allclose(out.float(), ref_out.to(dtype).float(),
                              rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.hopper
@torch.no_grad()
def test_gpu_micro_model_logits_match_cpu_reference():
    cpu = _load_micro()
    ids = torch.randint(0, cpu.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    per_layer = _micro_packed(cpu)
    for layer, (packed, _) in zip(cpu.model.layers, per_layer):
        layer.mlp.experts = S24HopperExperts.from_packed(packed, True, "cpu")
    want = cpu(ids).logits
    gpu = _load_micro("cuda", torch.float32)
    for layer, (packed, _) in zip(gpu.model.layers, per_layer):
        layer.mlp.experts = S24HopperExperts.from_packed(packed, True, "cuda")
    got = gpu(ids.cuda()).logits.float().cpu()
    # the modules match closely on equal inputs (test above); through the model, fp32 differences of the
    # attention layers move a few activations across e4m3 rounding boundaries (measured: 1.4 % on the H200)
    assert rel(got, want) < 5e-2, rel(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9
