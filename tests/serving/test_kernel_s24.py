"""s24-fp8 grouped GEMM: CPU reference and load-time re-layout (CI), and the Hopper kernel against them (GPU).

GPU tests need an sm_90 GPU and the native build (`python -m moesq_core.serving.kernels.native_build`); they skip on
machines without CUDA or with another GPU, and fail (not skip) on a Hopper GPU whose build is missing.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moesq_core.formats import get_format
from moesq_core.formats import s24_fp8 as s24_packing
from moesq_core.serving.kernels import s24_gemm as s24

# ------------------------------------------------------------------------------------------------ helpers

E4M3_POS = torch.arange(0x01, 0x7F, dtype=torch.uint8)  # finite positive e4m3 codes (0x7F is NaN), none zero


def random_nonzero_e4m3(shape, gen) -> torch.Tensor:
    """e4m3 bit patterns drawn from all finite nonzero codes with random sign (no zeros: they hide bugs)."""
    idx = torch.randint(0, len(E4M3_POS), shape, generator=gen)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7
    return (E4M3_POS[idx] | sign).view(torch.float8_e4m3fn)


def random_packed(E, M, K, gen, scale_range=(1e-3, 1e-1)):
    """Random packed s24-fp8 experts: every 4-group keeps 2 random positions with nonzero values."""
    pats = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
    choice = torch.randint(0, 6, (E, M, K // 4), generator=gen)
    pos = pats[choice]  # [E, M, K/4, 2]
    nib = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8)
    meta = nib[..., 0::2] | (nib[..., 1::2] << 4)
    values = random_nonzero_e4m3((E, M, K // 2), gen)
    lo, hi = scale_range
    scale = (lo + (hi - lo) * torch.rand(E, M, 1, generator=gen)).float()
    return values, meta.contiguous(), scale


def random_activations(E, cap, K, gen):
    x = torch.randn(E, cap, K, generator=gen) * torch.exp(torch.randn(E, cap, 1, generator=gen))
    x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
    return s24.quantize_activations(x)


# ------------------------------------------------------------------------------------------------ CPU tests


@settings(max_examples=25, deadline=None)
@given(E=st.integers(1, 3), M=st.integers(1, 9), kq=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_decompress_inverts_packer(E, M, kq, seed):
    """decompress(pack(qw)) reproduces the packer's dense codes (the packer is the on-disk contract)."""
    K = 8 * kq
    gen = torch.Generator().manual_seed(seed)
    fmt = get_format("s24-fp8")
    w = torch.randn(E, M, K, generator=gen)
    qws = [fmt.quantize(w[e]) for e in range(E)]
    packed = [s24_packing.pack(q) for q in qws]
    values = torch.stack([p["weight_sparse_values"] for p in packed])
    meta = torch.stack([p["weight_sparse_meta"] for p in packed])
    dense = s24.decompress(values, meta)
    want = torch.stack([q.codes for q in qws])
    assert torch.equal(dense.view(torch.uint8), want)


def test_decompress_rejects_bad_metadata():
    values = torch.zeros(1, 4, dtype=torch.uint8).view(torch.float8_e4m3fn)
    meta = torch.tensor([[0x11]], dtype=torch.uint8)  # (1, 0): i0 > i1
    with pytest.raises(ValueError, match="i0 < i1"):
        s24.decompress(values, meta)


def cutlass_meta_by_formula(meta: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """CUTLASS's layout written out from Sm90GemmSparseConfig::fill_layoutE for 8-bit A, MinTileShapeK = 128:
    logical index of (m, k) = m*128 + k%128 + (k//128)*M64*128 (then per expert M64*K128), 8 logical
    elements per metadata byte, 4 per nibble (low nibble first)."""
    E = meta.shape[0]
    m64, k128 = -(-M // 64) * 64, -(-K // 128) * 128
    out = torch.full((E, m64 * k128 // 8), 0x44, dtype=torch.uint8)
    out_nib = torch.stack((out & 0xF, out >> 4), -1).flatten(-2)  # nibble view
    nib = torch.stack((meta & 0xF, meta >> 4), -1).flatten(-2)  # [E, M, K/4]
    m = torch.arange(M)[:, None]
    k = torch.arange(0, K, 4)[None, :]
    idx = m * 128 + k % 128 + (k // 128) * m64 * 128  # logical element index of each group's first element
    out_nib[:, (idx // 4).flatten()] = nib.reshape(E, -1)
    packed = out_nib[:, 0::2] | (out_nib[:, 1::2] << 4)
    return packed.reshape(E, k128 // 128, m64, 16)


@pytest.mark.parametrize("M,K", [(8, 32), (64, 128), (72, 160), (136, 384), (200, 32)])
def test_relayout_matches_cutlass_layout_formula(M, K):
    gen = torch.Generator().manual_seed(M * 1000 + K)
    _, meta, _ = random_packed(2, M, K, gen)
    got = s24.relayout_meta(meta, K)
    assert got.shape == (2, -(-K // 128), -(-M // 64) * 64, 16)
    assert torch.equal(got, cutlass_meta_by_formula(meta, M, K))
    assert torch.equal(s24.unrelayout_meta(got, M, K), meta)


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 130), kq=st.integers(1, 40), lead=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_relayout_round_trip(M, kq, lead, seed):
    K = 8 * kq
    gen = torch.Generator().manual_seed(seed)
    meta = torch.randint(0, 256, (lead, M, K // 8), generator=gen, dtype=torch.uint8)
    got = s24.relayout_meta(meta, K)
    assert torch.equal(s24.unrelayout_meta(got, M, K), meta)
    # padding is the valid (0,1)(0,1) pattern and every logical byte appears exactly once
    assert int((got != 0x44).sum()) == int((meta != 0x44).sum())


def test_quantize_activations():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=gen) * 10
    x[1, 2] = 0
    xq, sx = s24.quantize_activations(x)
    assert xq.dtype == torch.float8_e4m3fn and sx.shape == (3, 5)
    assert sx[1, 2] == 1.0 and bool((xq[1, 2].float() == 0).all())
    amax = (xq.float().abs().amax(-1))
    assert torch.allclose(amax[sx != 1], torch.full_like(amax[sx != 1], 448.0))
    err = (xq.float() * sx[..., None] - x).abs()
    assert bool((err <= x.abs() * 2**-4 + sx[..., None] * 2**-9).all())  # e4m3: 3 mantissa bits


def test_reference_against_dequantized_weights():
    """The reference equals the format's own dequantization route: bf16(xdeq @ Wdeq^T) up to rounding."""
    gen = torch.Generator().manual_seed(1)
    E, M, K, cap = 3, 24, 64, 7
    values, meta, scale = random_packed(E, M, K, gen)
    xq, sx = random_activations(E, cap, K, gen)
    counts = torch.tensor([0, 1, cap], dtype=torch.int32)
    ref = s24.reference_grouped_gemm(values, meta, scale, xq, sx, counts)
    assert ref.shape == (E, cap, M) and ref.dtype == torch.bfloat16
    fmt = get_format("s24-fp8")
    for e in range(E):
        qw = s24_packing.unpack({"weight_sparse_values": values[e], "weight_sparse_meta": meta[e],
                                 "weight_scale": scale[e]})
        wdeq = fmt.weight.decode(qw.codes, qw.scales) * qw.mask
        c = int(counts[e])
        want = (xq[e, :c].double() * sx[e, :c, None].double()) @ wdeq.double().T
        got = ref[e, :c].double()
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-6 * float(want.abs().max() if c else 1))
        assert bool((ref[e, c:] == 0).all())


def test_prepare_weights_checks_kernel_shapes():
    gen = torch.Generator().manual_seed(2)
    values, meta, scale = random_packed(1, 12, 64, gen)  # M = 12: not a multiple of 8
    with pytest.raises(ValueError, match="multiple of 8"):
        s24.prepare_weights(values, meta, scale)
    values, meta, scale = random_packed(1, 16, 40, gen)  # K = 40: not a multiple of 32
    with pytest.raises(ValueError, match="multiple of 32"):
        s24.prepare_weights(values, meta, scale)
    values, meta, scale = random_packed(2, 16, 64, gen)
    w = s24.prepare_weights(values, meta, scale)
    assert (w.E, w.M, w.K) == (2, 16, 64) and w.meta.shape == (2, 1, 64, 16) and w.scale.shape == (2, 16)


def test_gpu_entry_points_raise_clearly_without_hopper():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has a Hopper GPU")
    gen = torch.Generator().manual_seed(3)
    w = s24.prepare_weights(*random_packed(1, 16, 64, gen))
    xq, sx = random_activations(1, 4, 64, gen)
    with pytest.raises(RuntimeError, match="s24-fp8 kernel"):
        s24.grouped_gemm(w, xq, sx, torch.tensor([4], dtype=torch.int32))


def test_native_build_says_what_is_missing(monkeypatch, tmp_path, capsys):
    """Without nvcc the first use (and the build command) stops with a message naming the fix."""
    from moesq_core.serving.kernels import native_build as nb

    monkeypatch.setenv("MOESQ_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOESQ_NATIVE_EXT", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(nb, "NVCC_FALLBACKS", ())
    monkeypatch.setattr(nb, "_module", None)
    with pytest.raises(nb.NativeBuildError, match="nvcc not found.*CUDA toolkit"):
        nb.load_extension()
    assert nb.main([]) == 1
    assert "error: nvcc not found" in capsys.readouterr().err
    assert nb.build_dir().parent == tmp_path / "cache" and nb.build_dir().name.startswith("sm90a-")
    monkeypatch.setenv("MOESQ_CUTLASS_DIR", str(tmp_path))
    with pytest.raises(nb.NativeBuildError, match="MOESQ_CUTLASS_DIR"):
        nb.find_cutlass()
    monkeypatch.setenv("MOESQ_NATIVE_EXT", str(tmp_path / "missing.so"))
    with pytest.raises(nb.NativeBuildError, match="no such file"):
        nb.load_extension()


def test_native_build_runs_as_many_compilers_as_the_memory_holds():
    # one CUTLASS unit's compiler peaks near 5 GB: 16 cores with 24 GiB free run 4 at a time, not 16
    from moesq_core.serving.kernels import native_build as nb

    GiB = 1 << 30
    assert nb.default_jobs(16, 24 * GiB, 12) == 4
    assert nb.default_jobs(16, 128 * GiB, 12) == 12  # never more than the units
    assert nb.default_jobs(2, 128 * GiB, 12) == 2
    assert nb.default_jobs(16, 1 * GiB, 12) == 1  # one at a time rather than none
    assert nb.default_jobs(None, None, 12) == 1 and nb.default_jobs(8, None, 12) == 8
    available = nb.available_memory_bytes()
    assert available is None or available > 0


# ------------------------------------------------------------------------------------------------ GPU tests

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")


def _variants():
    return s24.variants() if HOPPER else []


def run_and_compare(values, meta, scale, xq, sx, counts, variant, max_clusters=0):
    """Run one variant on poisoned output; check valid rows against the reference, skipped tiles untouched."""
    dev = torch.device("cuda")
    w = s24.prepare_weights(values, meta, scale, dev)
    E, cap, M = xq.shape[0], xq.shape[1], values.shape[1]
    out = torch.full((E, cap, M), float("nan"), dtype=torch.bfloat16, device=dev)
    s24.grouped_gemm(w, xq.to(dev), sx.to(dev), counts.to(dev), out, variant=variant.index, max_clusters=max_clusters)
    torch.cuda.synchronize()
    got = out.cpu()
    ref = s24.reference_grouped_gemm(values, meta, scale, xq, sx, counts)
    wabs = s24.decompress(values, meta).float().abs().double()
    span = variant.tile_n * variant.cluster_n
    worst = 0.0
    for e in range(E):
        c = int(counts[e])
        if c:
            g, r = got[e, :c].double(), ref[e, :c].double()
            assert bool(torch.isfinite(g).all()), f"{variant.name}: expert {e} has unwritten/NaN rows among {c}"
            absdot = (xq[e, :c].float().abs().double() @ wabs[e].T) * scale[e, :, 0].double() * sx[e, :c, None].double()
            err = (g - r).abs()
            tol = s24.error_bound(r, absdot, variant.fast_accum)
            bad = err > tol
            assert not bool(bad.any()), (
                f"{variant.name}: expert {e} row/col {bad.nonzero()[0].tolist()} got {g[bad][0]} want {r[bad][0]}")
            worst = max(worst, float((err / (absdot + 1e-30)).max()))
        # tiles wholly past the count must be skipped: their rows keep the poison
        edge = min(cap, -(-c // span) * span)
        assert bool(torch.isnan(got[e, edge:].float()).all()), f"{variant.name}: expert {e} wrote rows past {edge}"
    return worst


@gpu
@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("M,K,cap", [(8, 32, 1), (72, 160, 17), (200, 288, 40), (128, 256, 150)])
def test_kernel_matches_reference_all_variants(M, K, cap):
    gen = torch.Generator().manual_seed(M * 7 + K * 13 + cap)
    E = 5
    values, meta, scale = random_packed(E, M, K, gen)
    xq, sx = random_activations(E, cap, K, gen)
    counts = torch.tensor([0, 1, cap, max(cap // 2, 1), max(cap - 1, 0)], dtype=torch.int32)
    for v in _variants():
        run_and_compare(values, meta, scale, xq, sx, counts, v)


@gpu
@pytest.mark.gpu
@pytest.mark.hopper
def test_kernel_persistent_walk_over_many_experts():
    """One persistent cluster walks every work unit of 37 experts (exercises the scheduler's expert cursor)."""
    gen = torch.Generator().manual_seed(11)
    E, M, K, cap = 37, 264, 128, 70
    values, meta, scale = random_packed(E, M, K, gen)
    xq, sx = random_activations(E, cap, K, gen)
    counts = torch.randint(0, cap + 1, (E,), generator=gen, dtype=torch.int32)
    counts[::7] = 0
    for v in _variants():
        for mc in (1, 3, 0):
            run_and_compare(values, meta, scale, xq, sx, counts, v, max_clusters=mc)


@gpu
@pytest.mark.gpu
@pytest.mark.hopper
def test_relayout_matches_cutlass_compressor():
    gen = torch.Generator().manual_seed(5)
    for E, M, K in [(1, 8, 32), (3, 72, 160), (2, 136, 384)]:
        values, meta, _ = random_packed(E, M, K, gen)
        dense = s24.decompress(values, meta).cuda()
        cv, cm = s24.cutlass_compress(dense)
        assert torch.equal(cv.view(torch.uint8).cpu(), values.view(torch.uint8))
        cm, ours = cm.cpu(), s24.relayout_meta(meta, K)
        # every logical byte sits where CUTLASS puts it; CUTLASS pads with 0, we pad with a valid (0,1) pattern
        assert torch.equal(s24.unrelayout_meta(cm, M, K), meta)
        written = s24.relayout_meta(torch.full_like(meta, 0xFF), K) == 0xFF
        assert torch.equal(cm[written], ours[written])
        assert bool((cm[~written] == 0).all()) and bool((ours[~written] == 0x44).all())


@gpu
@pytest.mark.gpu
@pytest.mark.hopper
def test_kernel_cuda_graph_reads_counts_on_device():
    """Capture once, change the counts in place, replay: the output follows the new counts (no host sync)."""
    gen = torch.Generator().manual_seed(7)
    E, M, K, cap = 6, 256, 512, 48
    values, meta, scale = random_packed(E, M, K, gen)
    xq, sx = random_activations(E, cap, K, gen)
    dev = torch.device("cuda")
    w = s24.prepare_weights(values, meta, scale, dev)
    xq_d, sx_d = xq.to(dev), sx.to(dev)
    counts_d = torch.full((E,), cap, dtype=torch.int32, device=dev)
    out = torch.empty(E, cap, M, dtype=torch.bfloat16, device=dev)
    s24.grouped_gemm(w, xq_d, sx_d, counts_d, out)  # tunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s24.grouped_gemm(w, xq_d, sx_d, counts_d, out)
    for trial in range(3):
        counts = torch.randint(0, cap + 1, (E,), generator=gen, dtype=torch.int32)
        counts[trial] = 0
        counts_d.copy_(counts)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = s24.reference_grouped_gemm(values, meta, scale, xq, sx, counts)
        got = out.cpu()
        for e in range(E):
            c = int(counts[e])
            g, r = got[e, :c].double(), ref[e, :c].double()
            assert bool(torch.isfinite(g).all())
            assert float((g - r).norm()) <= 1e-2 * float(r.norm()) + 1e-30


@gpu
@pytest.mark.gpu
@pytest.mark.hopper
def test_kernel_is_deterministic():
    gen = torch.Generator().manual_seed(9)
    E, M, K, cap = 4, 384, 1024, 64
    values, meta, scale = random_packed(E, M, K, gen)
    xq, sx = random_activations(E, cap, K, gen)
    dev = torch.device("cuda")
    w = s24.prepare_weights(values, meta, scale, dev)
    counts = torch.tensor([64, 3, 0, 40], dtype=torch.int32, device=dev)
    for v in _variants():
        a = s24.grouped_gemm(w, xq.to(dev), sx.to(dev), counts, variant=v.name)
        b = s24.grouped_gemm(w, xq.to(dev), sx.to(dev), counts, variant=v.name)
        torch.cuda.synchronize()
        for e, c in enumerate(counts.tolist()):
            assert torch.equal(a[e, :c], b[e, :c]), v.name


@gpu
@pytest.mark.gpu
@pytest.mark.hopper
def test_native_module_checks_tensors():
    """The extension checks every tensor before taking a pointer (dtype, device, shape) and raises ValueError."""
    gen = torch.Generator().manual_seed(12)
    values, meta, scale = random_packed(2, 64, 128, gen)
    xq, sx = random_activations(2, 8, 128, gen)
    dev = torch.device("cuda")
    w = s24.prepare_weights(values, meta, scale, dev)
    counts = torch.tensor([8, 3], dtype=torch.int32, device=dev)
    out = torch.empty(2, 8, 64, dtype=torch.bfloat16, device=dev)
    mod = s24.native_module()
    with pytest.raises(ValueError, match="activations"):
        mod.s24_gemm(0, w.values, w.meta, xq.float().to(dev), w.scale, sx.to(dev), counts, out)
    with pytest.raises(ValueError, match="counts"):
        mod.s24_gemm(0, w.values, w.meta, xq.to(dev), w.scale, sx.to(dev), counts.long(), out)
    with pytest.raises(ValueError, match="activation scales .* cpu"):
        mod.s24_gemm(0, w.values, w.meta, xq.to(dev), w.scale, sx, counts, out)
    with pytest.raises(ValueError, match="out"):
        mod.s24_gemm(0, w.values, w.meta, xq.to(dev), w.scale, sx.to(dev), counts, out[:, :4])
    with pytest.raises(RuntimeError, match="variant"):
        mod.s24_gemm(99, w.values, w.meta, xq.to(dev), w.scale, sx.to(dev), counts, out)
    mod.s24_gemm(0, w.values, w.meta, xq.to(dev), w.scale, sx.to(dev), counts, out)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out[0].float()).all())


def _write_packed_dir(path, E=3, M=72, K=160, seed=0):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for proj, (m, k) in (("gate_proj", (M, K)), ("down_proj", (K, M * 4 // 3 // 32 * 32 or 32))):
        values, meta, scale = random_packed(E, m, k, gen)
        for e in range(E):
            name = f"model.layers.0.mlp.experts.{e}.{proj}"
            tensors[f"{name}.weight_sparse_values"] = values[e].contiguous()
            tensors[f"{name}.weight_sparse_meta"] = meta[e].contiguous()
            tensors[f"{name}.weight_scale"] = scale[e].contiguous()
    save_file(tensors, str(path / "model.safetensors"))


def test_kernel_check_raises_clearly_without_hopper(tmp_path):
    if HOPPER:
        pytest.skip("this machine has a Hopper GPU")
    from moesq_core.serving.kernels.verify_kernel import kernel_check_packed_dir

    _write_packed_dir(tmp_path)
    with pytest.raises(RuntimeError, match="kernel check of .* impossible"):
        kernel_check_packed_dir(tmp_path)


@gpu
@pytest.mark.gpu
@pytest.mark.hopper
def test_kernel_check_packed_dir(tmp_path):
    from moesq_core.serving.kernels.verify_kernel import kernel_check_packed_dir

    _write_packed_dir(tmp_path)
    res = kernel_check_packed_dir(tmp_path)
    assert len(res) == 6
    assert all(ok for _, _, ok in res), res
    assert {n.rsplit(".", 1)[-1] for n, _, _ in res} == {"gate_proj", "down_proj"}


# ------------------------------------------------------------------------------------------------ bench plumbing (CPU)


def test_bench_token_pattern_and_packing():
    from moesq_core.serving.bench.harness import pack_logical, random_2to4_dense_e4m3, token_counts

    assert token_counts(16, 6) == [16, 12, 8, 4, 16, 12]
    assert token_counts(2, 4) == [2, 1, 1, 1]
    gen = torch.Generator().manual_seed(0)
    dense, scale = random_2to4_dense_e4m3(2, 16, 64, gen, "cpu")
    assert bool((((dense.view(torch.uint8) & 0x7F) != 0).view(2, 16, 16, 4).sum(-1) == 2).all())
    values, meta = pack_logical(dense)
    assert torch.equal(s24.decompress(values, meta).view(torch.uint8), dense.view(torch.uint8))
    assert scale.shape == (2, 16) and bool((scale > 0).all())


def test_bench_reports_from_synthetic_rows(tmp_path):
    from moesq_core.serving.bench import kernel_bench as kb

    rows = []
    for (name, (M, K)) in kb.PAPER_SHAPES.items():
        for G in (8, 128):
            for N in (16, 1024):
                base = {"bf16_grouped_mm": {"us": 100.0}, "fp8_grouped_mm": {"us": 80.0},
                        "cusparselt_fp8_loop": {"error": "RuntimeError: x"}}
                ours = {"us": 40.0 if N == 16 else 60.0, "tflops": 1700.0 if N == 1024 else 10.0, "weight_TBps": 3.9,
                        "variant": "coop_m128n16k256"}
                row = {"shape": name, "M": M, "K": K, "G": G, "N": N, "methods": {**base, "s24_fp8": ours}}
                row["methods"]["s24_fp8"]["speedup"] = 80.0 / ours["us"]
                rows.append(row)
    t = kb.targets(rows)
    assert t["decode_N_le_64"]["met"] and t["decode_N_le_64"]["min"] == pytest.approx(2.0)
    assert t["N_ge_256"]["met"] and t["N_ge_256"]["geomean"] == pytest.approx(80 / 60)
    assert t["kimi_gate_up_N1024_tflops"]["met"]
    result = {"format": "s24-fp8", "date": "2026-11-29T00:00:00+00:00", "gpu": "test", "sm_count": 1, "torch": "x",
              "cuda": "y", "commit": "abc", "repeats": 1, "token_pattern": "p", "timing": "t",
              "methods": {"bf16_grouped_mm": "a", "fp8_grouped_mm": "b", "cusparselt_fp8_loop": "c", "s24_fp8": "d"},
              "rows": rows, "targets": t}
    md = kb.markdown(result)
    assert "| decode N ≤ 64" in md and "Kimi-K2.5 gate/up" in md and "err" in md
    kb.heatmap(result, tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no kernel benchmark"):
        kb.bench_kernel("dense-nvfp4", None, [8], [16], tmp_path)
