"""Paired 4:8 -> 2:4 re-layout (moesq_core.serving.kernels.p48_sparse24): bit-exact against the packer and the s24
decoder on CPU, the expert forward with permuted gate/up rows equal to the p48 reference, and on a GPU the
operand run through 2:4 sparse tensor cores (cuSPARSELt via torch) against the reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moesq_core.formats import get_format
from moesq_core.formats.packing import pack, unpack
from moesq_core.serving.kernels import p48_reference as ref
from moesq_core.serving.kernels import p48_sparse24 as ps
from moesq_core.serving.kernels import s24_gemm as s24_fp8

FMT = get_format("p48-nvfp4")


def random_p48(lead, M, K, gen, random_masks=True):
    """Packed p48 tensors of random weights; masks random (not magnitude) so every pair pattern appears."""
    w = torch.randn(*lead, M, K, generator=gen)  # drawn first, then its scales
    w = w * torch.exp(torch.randn(*lead, M, K // 32, 1, generator=gen)).repeat_interleave(32, -2).reshape(*lead, M, K)
    pats = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1]],
                        dtype=torch.bool)
    pairs = pats[torch.randint(0, 6, (*lead, M, K // 8), generator=gen)]  # [..., M, K/8, 4]
    mask = pairs.repeat_interleave(2, -1).reshape(*lead, M, K) if random_masks else None
    if lead:
        packs = [pack(FMT.quantize(w[i], None if mask is None else mask[i])) for i in range(lead[0])]
        return {k: torch.stack([p[k] for p in packs]) for k in packs[0]}
    return pack(FMT.quantize(w, mask))


def test_permutation_makes_every_pair_pattern_2to4():
    perm = torch.tensor(ps.K_PERM_8)
    for pats in ([0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]):
        kept = torch.zeros(8, dtype=torch.bool)
        for p in pats:
            kept[2 * p] = kept[2 * p + 1] = True
        permuted = kept[perm]
        assert permuted[:4].sum() == 2 and permuted[4:].sum() == 2
        assert torch.equal(permuted[:4], permuted[4:])
    assert torch.equal(ps.k_permutation(16), torch.tensor([0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]))
    with pytest.raises(ValueError, match="multiple of 8"):
        ps.k_permutation(12)


@settings(max_examples=20, deadline=None)
@given(M=st.integers(1, 9), kb=st.integers(1, 4), lead=st.sampled_from([(), (2,)]), seed=st.integers(0, 2**31 - 1),
       random_masks=st.booleans())
def test_relayout_is_bit_exact(M, kb, lead, seed, random_masks):
    K = 32 * kb
    gen = torch.Generator().manual_seed(seed)
    t = random_p48(lead, M, K, gen, random_masks)
    op = ps.p48_to_2to4(t)
    assert op.codes.shape == (*lead, M, K // 4) and op.meta.shape == (*lead, M, K // 8)
    perm = ps.k_permutation(K)
    qw = unpack("p48-nvfp4", t)
    # 1. the operand's dense codes are the packer's codes with K permuted, bit for bit
    assert torch.equal(ps.dense_codes(op), qw.codes[..., perm])
    # 2. read independently with the s24 decoder (one code per value byte): the same, so the metadata is the
    #    s24 logical layout and every permuted 4-group is 2:4
    values = torch.stack((op.codes & 0xF, op.codes >> 4), -1).reshape(*lead, M, K // 2)
    assert torch.equal(s24_fp8.decompress(values, op.meta).view(torch.uint8), qw.codes[..., perm])
    i0, i1 = s24_fp8.meta_positions(op.meta)
    assert bool((i0 < i1).all())
    # 3. unscaled values exact, inverse permutation restores the p48 reference weight
    want = ref.decode_p48(t).unscaled()
    assert torch.equal(ps.unscaled_weight(op)[..., ps.inverse_permutation(perm)], want)
    # 4. the inverse re-layout gives the packed bytes back
    back = ps.to_p48(op)
    for k in ps.P48_SUFFIXES:
        a, b = back[k], t[k]
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), k


def test_relayout_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    t = random_p48((), 4, 64, gen)
    bad = dict(t)
    bad["weight_sparse_mask"] = t["weight_sparse_mask"].clone()
    bad["weight_sparse_mask"][1, 0] = 0x37  # 3 pairs kept in one group
    with pytest.raises(ValueError, match="exactly 2 pairs"):
        ps.p48_to_2to4(bad)
    with pytest.raises(ValueError, match="missing weight_scale"):
        ps.p48_to_2to4({k: v for k, v in t.items() if k != "weight_scale"})
    op = ps.p48_to_2to4(t)
    op.meta[0, 0] = 0x84  # halves disagree
    with pytest.raises(ValueError, match="same positions"):
        ps.to_p48(op)


@pytest.mark.parametrize("act_quant", [False, True])
def test_expert_forward_through_permuted_operands(act_quant):
    """gate/up rows permuted at load time + down's K permuted + the input's K permuted = the p48 reference
    expert (float64 sums; the operands are exact)."""
    gen = torch.Generator().manual_seed(1)
    H, inter = 64, 96
    t = {"gate": random_p48((), inter, H, gen), "up": random_p48((), inter, H, gen),
         "down": random_p48((), H, inter, gen)}
    t["up"]["weight_global_scale"] = t["gate"]["weight_global_scale"]
    for p in t:
        t[p]["input_global_scale"] = torch.tensor([0.0])
    x = torch.randn(7, H, generator=gen)
    want = ref.expert_forward_ref(x, ref.expert_weights(t), act_quant)

    pk_h, pk_i = ps.k_permutation(H), ps.k_permutation(inter)
    ops = {p: ps.p48_to_2to4(ps.permute_rows(t[p], pk_i) if p != "down" else t[p]) for p in t}

    def linear(v, op):  # v in the operand's permuted K order
        w, gw = ps.unscaled_weight(op).double(), op.global_scale.double()
        if not act_quant:
            return ((v.double() @ w.T) / gw).float()
        vu, g = ref.quantize_act_unscaled(v, None)  # NVFP4 32-blocks are whole 8-groups: permutation-invariant
        return ((vu.double() @ w.T) / (gw * g.double())).float()

    xp = x[:, pk_h]
    if act_quant:
        assert torch.equal(ref.quantize_act_unscaled(xp, None)[0], ref.quantize_act_unscaled(x, None)[0][:, pk_h])
    h = torch.nn.functional.silu(linear(xp, ops["gate"])) * linear(xp, ops["up"])  # in down's permuted K order
    got = linear(h, ops["down"])
    assert torch.allclose(got.float(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.gpu
def test_operand_on_sparse_tensor_cores_matches_reference():
    """The permuted operand, expanded to bf16 (exact), is accepted by the 2:4 sparse tensor-core path
    (cuSPARSELt through torch) and reproduces the p48 reference GEMM on awkward sizes."""
    if not hasattr(torch, "_cslt_compress"):
        pytest.skip("this torch has no cuSPARSELt bindings")
    gen = torch.Generator().manual_seed(2)
    for M, K, N in ((64, 128, 16), (96, 160, 24), (128, 256, 40)):
        t = random_p48((), M, K, gen)
        op = ps.p48_to_2to4(t)
        perm = ps.k_permutation(K)
        w = ps.unscaled_weight(op).to(torch.bfloat16)
        assert torch.equal(w.float(), ps.unscaled_weight(op))  # exact in bf16
        x = torch.randn(N, K, generator=gen).to(torch.bfloat16)
        comp = torch._cslt_compress(w.cuda())
        y = torch._cslt_sparse_mm(comp, x[:, perm].cuda().t(), transpose_result=True)  # [N, M] bf16
        torch.cuda.synchronize()
        got = y.float().cpu() / op.global_scale.float()
        want = ref.p48_linear_ref(x.float(), ref.decode_p48(t), act_quant=False)
        assert got.shape == want.shape == (N, M)
        assert bool(torch.isfinite(got).all())
        # bf16 output rounding (2^-8) on top of fp32 accumulation
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-3 * float(want.abs().max())), (M, K, N)
