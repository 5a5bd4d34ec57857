"""p48-nvfp4 on the 2:4 sparse tensor cores (moesq_core.serving.kernels.p48_mma, native/src/p48_gemm.cu): the record
layout round-trips bit for bit, the kernel's register decode (emulated with the same integer operations on
the CPU) gives the reference's values, the variant table renders the kernel's variant list, and on an H200/H100
the kernel matches the CPU reference on awkward sizes with poisoned outputs.

The GPU tests' kernel matrix is generated from the variant table (p48_variants.P48_VARIANTS, `variant_matrix`):
by default every variant with every option of a test (act_quant on and off, split K, ...) on shapes that rotate
over the variants; the whole variants x options x shapes product with `pytest --full-matrix` (the full_matrix
mark)."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moesq_core.serving.bench.p48_bench import random_p48_tensors
from moesq_core.serving.kernels import native_build as nb
from moesq_core.serving.kernels import p48_mma as pm
from moesq_core.serving.kernels import p48_sparse24 as ps
from moesq_core.serving.kernels import p48_variants as pv

from conftest import P48GroupedCase


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@settings(max_examples=20, deadline=None)
@given(E=st.integers(1, 3), M=st.integers(1, 40), kb=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_records_round_trip_bit_exact(E, M, kb, seed):
    K = 32 * kb
    t = random_p48_tensors(E, M, K, torch.Generator().manual_seed(seed), "cpu")
    w = pm.P48MmaWeights.from_packed(t)
    assert w.records.shape == (E, -(-M // 16), -(-K // 128), pm.RECORD_BYTES)
    if M % 16 == 0 and K % 128 == 0:  # no padding: exactly the packed bytes
        assert w.records.numel() == sum(t[s].numel() * t[s].element_size() for s in ps.P48_SUFFIXES[:3])
    back = pm.records_to_2to4(w.records, M, K, w.global_scale)
    op = ps.p48_to_2to4(t)
    for a, b in ((back.codes, op.codes), (back.meta, op.meta), (back.scales, op.scales)):
        assert torch.equal(_u8(a), _u8(b))
    released = ps.to_p48(back)
    for s in ps.P48_SUFFIXES:
        assert torch.equal(_u8(released[s]).reshape(-1), _u8(t[s]).reshape(-1)), s


def _decode_word(ww):
    """The kernel's decode_fields on a code word (int64 tensor or int < 2^32): the four A registers' bf16x2 fields."""
    rot12 = ((ww << 12) | (ww >> 20)) & 0xFFFFFFFF
    return [(ww << 6) & 0x81C081C0, rot12 & 0x81C081C0, (ww << 2) & 0x81C081C0,
            (ww & 0x81808180) | ((ww >> 8) & 0x00400040)]


def test_code_bits_decode_every_code_into_bf16_fields():
    """Every code byte of every register, alone in a word or beside random codes of the other three: the decode puts
    the low code's magnitude at bits 6-8 and sign at 15, the high code's at 22-24 and 31, and nothing else."""
    assert sorted(b for bits in pm.CODE_BITS for b in bits) == list(range(32))
    g = torch.Generator().manual_seed(0)
    for r in range(4):
        for c in range(256):
            others = torch.randint(0, 256, (8, 4), generator=g, dtype=torch.uint8)
            others[:, r] = c
            others[0] = 0
            others[0, r] = c
            word = sum(pm._PACK_LUT[q][others[:, q].int()].to(torch.int64) & 0xFFFFFFFF for q in range(4))
            for w in word.tolist():
                got = _decode_word(w)[r]
                want = ((c & 7) << 6) | ((c >> 3 & 1) << 15) | ((c >> 4 & 7) << 22) | ((c >> 7) << 31)
                assert got == want, (r, c, hex(w))


def _emulate_decode(records: torch.Tensor) -> torch.Tensor:
    """The kernel's decode of every record, with its integer operations: float32 [E, MT*16, KR*128], the
    values e2m1 * s * 2^-7 in permuted K order (the metadata placing each lane's two values per 4-group)."""
    E, MT, KR, _ = records.shape
    rec = records.to(torch.int64)
    words = rec[..., :512].reshape(E, MT, KR, 32, 4, 4)
    w = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24  # [.., lane, s]
    sc = rec[..., 640:].reshape(E, MT, KR, 8, 4, 2)  # [.., g, s, row hi]
    scale_bits = (sc << 4) + 0x7600  # the kernel's integer multiply-add: bf16 bits of s * 2^119
    scale_bf16 = (scale_bits << 16).to(torch.int32).view(torch.float32)
    meta = rec[..., 512:640].reshape(E, MT, KR, 32, 4)  # [.., lane, byte]
    out = torch.zeros(E, MT * 16, KR * 128)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for s in range(4):
            ww = w[..., lane, s]
            regs = _decode_word(ww)
            for r in range(4):
                bits = regs[r] & 0xFFFFFFFF
                halves = [bits & 0xFFFF, bits >> 16]
                row_hi, grp = r & 1, t + 4 * (r >> 1)
                vals = [((h << 16).to(torch.int32).view(torch.float32)) * scale_bf16[..., g, s, row_hi] for h in halves]
                # metadata of this 4-group: from the supplying lane of step s (lane 2*sel + half holds rows g / g+8
                # in bytes 0 / 1 of role s // 2; the 8-group's nibble is nibble (grp // 2) % 2 of the byte)
                sel, half = s % 2, grp // 4
                byte = meta[..., 4 * g + 2 * sel + half, 2 * (s // 2) + row_hi]
                nib = (byte >> (4 * ((grp // 2) % 2))) & 0xF
                i0, i1 = nib & 3, nib >> 2
                row = g + 8 * row_hi
                rows = torch.arange(MT) * 16 + row
                for kr in range(KR):
                    base = kr * 128 + s * 32 + 4 * grp
                    for v, idx in zip(vals, (i0, i1)):
                        col = base + idx[:, :, kr]  # [E, MT]
                        out[torch.arange(E)[:, None], rows[None, :], col] = v[:, :, kr]
    return out


def test_register_decode_matches_reference_values():
    E, M, K = 2, 24, 160
    t = random_p48_tensors(E, M, K, torch.Generator().manual_seed(3), "cpu")
    w = pm.P48MmaWeights.from_packed(t)
    full = _emulate_decode(w.records)
    want = ps.unscaled_weight(ps.p48_to_2to4(t)) / pm.ALPHA_FOLD
    assert torch.equal(full[:, :M, :K], want)
    assert not full[:, M:].any() and not full[:, :, K:].any()  # padding decodes to zeros


def test_scale_encoding_is_exact_and_zero_scales_zero_their_block():
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ok = (v > 0) & ~v.isnan()
    bits = (pm.SCALE_BYTE.long() << 4) + 0x7600
    got = (bits << 16).to(torch.int32).view(torch.float32)
    assert torch.equal(got[ok], v[ok] * 2.0**119)
    t = random_p48_tensors(1, 16, 128, torch.Generator().manual_seed(1), "cpu")
    sc = t["weight_scale"].view(torch.uint8).clone()
    sc[0, 3, 1] = 0
    t["weight_scale"] = sc.view(torch.float8_e4m3fn)
    full = _emulate_decode(pm.P48MmaWeights.from_packed(t).records)
    want = ps.unscaled_weight(ps.p48_to_2to4(t)) / pm.ALPHA_FOLD
    assert torch.equal(full, want) and not full[0, 3, 32:64].any()


def test_from_packed_rejects_bad_input():
    t = random_p48_tensors(2, 16, 64, torch.Generator().manual_seed(0), "cpu")
    neg = t["weight_scale"].view(torch.uint8) | 0x80
    with pytest.raises(ValueError, match="negative or NaN"):
        pm.P48MmaWeights.from_packed(dict(t, weight_scale=neg.view(torch.float8_e4m3fn)))
    bad = dict(t, weight_sparse_mask=t["weight_sparse_mask"] | 0xFF)
    with pytest.raises(ValueError, match="exactly 2 pairs"):
        pm.P48MmaWeights.from_packed(bad, name="gate")
    with pytest.raises(ValueError, match="weight_global_scale"):
        pm.P48MmaWeights.from_packed(dict(t, weight_global_scale=t["weight_global_scale"][:1]))
    gate = [{s: v[e] for s, v in t.items()} for e in range(2)]
    up = [dict(x, weight_global_scale=x["weight_global_scale"] * 2) for x in gate]
    with pytest.raises(ValueError, match="different weight_global_scale"):
        pm.stack_gate_up(gate, up)


def test_k_order_is_the_kernels_staging_permutation():
    """k_order(n): per 8-group [e0 e2 e4 e6 | e1 e3 e5 e7] (the pairs' first halves, then their second halves:
    paired 4:8 as 2:4), a permutation of range(n); n must be a multiple of 8."""
    assert pm.k_order(16).tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    order = pm.k_order(1056)
    assert sorted(order.tolist()) == list(range(1056))
    with pytest.raises(ValueError, match="multiple of 8"):
        pm.k_order(12)


def test_permute_rows_moves_whole_rows_and_keeps_the_scales():
    """Release tensors of one projection (with the per-tensor scales the packer writes) in a new row order: row j
    is row order[j] in every per-row tensor, bit for bit; the decoded weight is the natural one's rows."""
    from moesq_core.serving.kernels import p48_reference as ref

    t = {k: v[0] for k, v in random_p48_tensors(1, 24, 64, torch.Generator().manual_seed(3), "cpu").items()}
    t["input_global_scale"] = torch.tensor([7.5])
    order = pm.k_order(24)
    moved = pm.permute_rows(t, order)
    assert set(moved) == set(t)
    for s in pm.ROW_SUFFIXES:
        assert torch.equal(moved[s].view(torch.uint8), t[s].view(torch.uint8)[order])
    for s in ("weight_global_scale", "input_global_scale"):
        assert moved[s] is t[s]
    natural, permuted = (ref.decode_p48(d, "gate") for d in (t, moved))
    assert torch.equal(permuted.codes, natural.codes[order]) and torch.equal(permuted.scales, natural.scales[order])


def test_pick_config_splits_only_small_grids():
    cpu = torch.device("cpu")
    assert pm.pick_config(1536, 2048, 128, 1, cpu) == pm.MmaConfig(0, 1)
    assert pm.pick_config(1536, 2048, 128, 9, cpu).variant == 0
    assert pm.pick_config(1536, 2048, 128, 16, cpu) == pm.MmaConfig(0, 1)
    assert pm.pick_config(1536, 2048, 128, 17, cpu).variant == 1
    assert pm.pick_config(1536, 2048, 128, 64, cpu).variant == 1
    assert pm.pick_config(1536, 2048, 128, 65, cpu).variant == 3
    assert pm.pick_config(1536, 2048, 128, 256, cpu).variant == 3
    assert pm.pick_config(2048, 768, 128, 128, cpu).variant == 2  # short units: the sort does not pay
    assert pm.pick_config(1536, 2048, 5000, 256, cpu).variant == 2  # too many experts to sort in the kernel
    assert [v.orders_experts for v in pv.P48_VARIANTS] == [False, False, False, True, False, True]
    assert pm.pick_config(1536, 2048, 2, 4, cpu).split > 1


def test_pick_config_pairs_row_groups_only_where_the_chunk_is_reused_and_the_walk_not_longer():
    cpu = torch.device("cpu")
    pairs, decode = pv.P48_VARIANTS[4], pv.P48_VARIANTS[0]
    assert pairs.row_groups_per_unit == 2 and pairs.tokens_per_block == decode.tokens_per_block
    # Qwen3-30B-A3B down (K = 768: one chunk), every expert with tokens: 1024 single or 512 paired units on 264 CTAs
    assert pm.pick_config(2048, 768, 128, 1, cpu) == pm.MmaConfig(4, 1)
    assert pm.pick_config(2048, 768, 128, 16, cpu) == pm.MmaConfig(4, 1)
    assert pm.pick_config(2048, 768, 128, 17, cpu).variant == 1
    # 640 units: 3 row groups for the busiest CTA, 2 pairs (4) if paired
    assert pm.pick_config(2048, 768, 80, 1.6, cpu) == pm.MmaConfig(0, 1)
    # few experts: split K already spreads them, pairs would double the walk
    assert pm.pick_config(2048, 768, 8, 1, cpu).variant == 0
    # K past one chunk (nothing to re-use), one row group per expert
    assert pm.pick_config(1536, 2048, 128, 16, cpu).variant == 0
    assert pm.pick_config(7168, 2048, 48, 1, cpu).variant == 0
    assert pm.pick_config(256, 768, 128, 1, cpu).variant == 0


def test_pick_config_deals_from_a_list_when_many_experts_are_likely_empty():
    cpu = torch.device("cpu")
    listed = pv.P48_VARIANTS[5]
    assert listed.tokens_per_block == pv.P48_VARIANTS[0].tokens_per_block and listed.orders_experts
    assert listed.instruction == pv.MMA_SP
    # 16 tokens routed top-8 over 128 experts: ~82 expected to have tokens
    active = pm.expected_active_experts(128, 16, 8)
    assert 80 < active < 84
    assert pm.pick_config(1536, 2048, active, 128 / active, cpu, experts=128) == pm.MmaConfig(5, 1)
    assert pm.pick_config(2048, 768, active, 128 / active, cpu, experts=128) == pm.MmaConfig(5, 1)
    # one token: its 8 experts exactly; split K spreads them, the list deals the split units
    assert pm.expected_active_experts(128, 1, 8) == pytest.approx(8)
    assert pm.pick_config(1536, 2048, 8, 1, cpu, experts=128).variant == 5
    # 64 tokens: nearly every expert has tokens, the fixed deal stays (and the pairs at K = 768)
    active = pm.expected_active_experts(128, 64, 8)
    assert active > 0.8 * 128
    assert pm.pick_config(1536, 2048, active, 512 / active, cpu, experts=128).variant == 0
    assert pm.pick_config(2048, 768, active, 512 / active, cpu, experts=128).variant == 4
    # without the experts' number nothing changes
    assert pm.pick_config(1536, 2048, 82, 1.5, cpu).variant == 0
    # every expert busy, more than one 8-token tile per expert and units longer than a chunk: the list balances the
    # tile counts (Qwen3-30B-A3B and Kimi-K2.5 gate/up); at K = 768 the row-group pairs stay; one tile: the fixed deal
    assert pm.pick_config(1536, 2048, 128, 16, cpu, experts=128) == pm.MmaConfig(5, 1, True)
    assert pm.pick_config(4096, 7168, 48, 12, cpu, experts=48).variant == 5
    assert pm.pick_config(2048, 768, 128, 16, cpu, experts=128).variant == 4
    assert pm.pick_config(1536, 2048, 128, 8, cpu, experts=128).variant == 0
    assert pm.pick_config(1536, 2048, 128, 16, cpu, experts=pm.MAX_ORDER_EXPERTS + 1).variant == 0
    # past decode sizes, or more experts than a CTA can list
    assert pm.pick_config(1536, 2048, 40, 30, cpu, experts=128).variant == 1
    assert pm.pick_config(1536, 2048, 100, 1, cpu, experts=pm.MAX_ORDER_EXPERTS + 1).variant == 0
    assert pm.expected_active_experts(0, 4, 2) == 0.0 and pm.expected_active_experts(8, 0, 2) == 0.0
    assert pm.expected_active_experts(4, 3, 8) == pytest.approx(4)  # top-k past the experts: all of them


def test_pick_config_copies_the_first_unit_early_unless_most_experts_are_likely_empty():
    cpu = torch.device("cpu")
    assert pm.MmaConfig(0, 1).early_first_unit  # the kernel bench's calls and every explicit config
    assert pm.pick_config(1536, 2048, 128, 16, cpu).early_first_unit  # no experts' number: every expert busy
    # 16 tokens routed top-8 over 128 experts: ~82 busy, above half: on (and the list deal)
    active = pm.expected_active_experts(128, 16, 8)
    assert pm.pick_config(2048, 768, active, 128 / active, cpu, experts=128) == pm.MmaConfig(5, 1, True)
    # one token: 8 of 128 busy, most CTAs' first units are empty: off
    cfg = pm.pick_config(1536, 2048, 8, 1, cpu, experts=128)
    assert cfg.variant == 5 and not cfg.early_first_unit
    edge = pm.EARLY_FIRST_UNIT_ACTIVE * 128
    assert pm.pick_config(1536, 2048, edge, 1, cpu, experts=128).early_first_unit
    assert not pm.pick_config(1536, 2048, edge - 1, 1, cpu, experts=128).early_first_unit


# ------------------------------------------------------------------------------------------ variant table

# The X-macro lines p48_gemm.cu held by hand before the table was generated: the same kernels at the same indices.
HAND_WRITTEN_VARIANTS = """
  X(0, Variant<16, 2, 8, 3, 1024, 2>)
  X(1, WgVariant<64, 4, 3, 512, 2>)
  X(2, WgVariant<128, 4, 3, 256, 2>)
  X(3, WgVariant<128, 4, 3, 256, 2, 32, true>)
  X(4, Variant<16, 2, 8, 3, 1024, 2, 2>)
  X(5, Variant<16, 2, 8, 3, 1024, 2, 1, 1>)
"""
P48_SOURCE = nb.NATIVE_DIR / "src" / "p48_gemm.cu"


def _macro_entries(text: str) -> list[str]:
    """The X(...) entries of the MOESQ_P48_VARIANTS definition in `text`, whitespace removed."""
    m = re.search(r"#define MOESQ_P48_VARIANTS\(X\)((?:[^\n]*\\\n)*[^\n]*)", text)
    assert m, "no MOESQ_P48_VARIANTS definition"
    return [re.sub(r"\s+", "", x) for x in re.findall(r"X\(\d+,[^)]*\)", m.group(1))]


def test_generated_variant_macro_is_the_kernels_variant_list():
    """The include the build generates from the table holds the hand-written list's X lines (modulo whitespace),
    and the kernel source includes it instead of defining its own."""
    text = pv.variants_include()
    assert _macro_entries(text) == [re.sub(r"\s+", "", x) for x in HAND_WRITTEN_VARIANTS.strip().splitlines()]
    assert nb.generated_sources() == {pv.INCLUDE_NAME: text}
    cu = P48_SOURCE.read_text()
    assert f'#include "{pv.INCLUDE_NAME}"' in cu and "#define MOESQ_P48_VARIANTS" not in cu


def _cpp_templates() -> dict[str, tuple[list[tuple[str, str | None]], str]]:
    """The kernel's variant templates as p48_gemm.cu declares them: {struct name: ([(parameter without its trailing
    underscore, default or None)], struct body)}."""
    out = {}
    for m in re.finditer(r"template <([^>]*)>\s*struct (\w*Variant) \{(.*?)\n\};", P48_SOURCE.read_text(), re.S):
        params = []
        for p in m.group(1).split(","):
            decl, _, default = p.partition("=")
            params.append((decl.split()[-1].rstrip("_"), default.strip() or None))
        out[m.group(2)] = (params, m.group(3))
    return out


def test_template_arguments_mean_the_table_fields():
    """Each row's template, parsed back against the declarations in p48_gemm.cu (their parameter order and
    defaults), gives the row's fields under the parameters' meaning there; every constant the generated
    static_asserts compare is one the template defines."""
    templates = _cpp_templates()
    assert set(templates) == {name for name, _ in pv.TEMPLATES.values()} == {"Variant", "WgVariant"}
    meaning = {  # template parameter -> its value for a row
        "NB": lambda r: r.tokens_per_block, "R": lambda r: r.row_tiles_per_warp, "W": lambda r: r.warps,
        "WG": lambda r: r.warps // 4, "S": lambda r: r.stages, "KC": lambda r: r.k_chunk,
        "RK": lambda r: r.records_per_step, "P": lambda r: r.row_groups_per_unit, "DEAL": lambda r: r.deal,
        "TW": lambda r: r.token_width_step, "ORDER": lambda r: "true" if r.deal == 2 else "false",
    }
    for i, row in enumerate(pv.P48_VARIANTS):
        m = re.fullmatch(r"(\w+)<([^<>]*)>", row.template())
        assert m and (m.group(1) == "WgVariant") == (row.instruction == pv.WGMMA_SP), row.template()
        params, body = templates[m.group(1)]
        args = [a.strip() for a in m.group(2).split(",")]
        assert len(args) <= len(params) and all(d is not None for _, d in params[len(args):]), row.template()
        parsed = dict(zip([p for p, _ in params], args + [d for _, d in params[len(args):]]))
        assert parsed == {p: str(meaning[p](row)) for p, _ in params}, (i, row.template())
        for name in row.constants():
            assert re.search(rf"\b{name}\s*=[^=]", body), (m.group(1), name)
    with pytest.raises(ValueError, match="wgmma.sp variant"):
        pv.P48Variant(pv.WGMMA_SP, 64, 16, 2, 3, 512, 2)  # one row tile per warp in the warpgroup kernel
    with pytest.raises(ValueError, match="mma.sp variant"):
        pv.P48Variant(pv.MMA_SP, 16, 8, 2, 3, 1024, 2, deal=2)  # the sorted deal is the warpgroup kernel's


def _syntax_check(nvcc: Path, generated: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """nvcc's front ends over p48_gemm.cu with the include from `generated` (templates instantiated, no code)."""
    return subprocess.run([str(nvcc), "-fdevice-syntax-only", "-std=c++17", "--expt-relaxed-constexpr", nb.GENCODE,
                           "-I", str(nb.NATIVE_DIR / "include"), "-I", str(nb.NATIVE_DIR / "src"), "-I", str(generated),
                           "-c", str(P48_SOURCE), "-o", str(tmp_path / "p48.o")], capture_output=True, text=True)


def test_kernel_source_compiles_with_the_generated_variants(monkeypatch, tmp_path):
    """No GPU needed: p48_gemm.cu with the generated include passes nvcc's front ends (every variant's kernels
    instantiated, the static_asserts hold); a template parameter order the kernel does not have (P and DEAL
    swapped in the renderer) fails the generated static_assert of the row it changes."""
    try:
        nvcc = nb.find_nvcc()
    except nb.NativeBuildError:
        pytest.skip("needs nvcc")
    monkeypatch.setenv("MOESQ_NATIVE_CACHE", str(tmp_path))
    r = _syntax_check(nvcc, nb.write_generated(), tmp_path)
    if "fdevice-syntax-only" in r.stderr:
        pytest.skip(f"this nvcc has no -fdevice-syntax-only: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr[-3000:]
    name, params = pv.TEMPLATES[pv.MMA_SP]
    monkeypatch.setitem(pv.TEMPLATES, pv.MMA_SP, (name, (*params[:-2], params[-1], params[-2])))
    assert "X(4, Variant<16, 2, 8, 3, 1024, 2, 0, 2>)" in pv.variants_include()
    r = _syntax_check(nvcc, nb.write_generated(), tmp_path)
    assert r.returncode != 0 and "p48 variant 4 is not its row of P48_VARIANTS" in r.stderr, r.stderr[-3000:]


def test_native_build_generates_the_variant_include_without_a_compiler(monkeypatch, tmp_path, capsys):
    """`native_build --generate` writes the include into the cache's generated folder without nvcc or a C++
    compiler; a changed row gives a new folder and build key, and a new command line for the p48 unit alone."""
    def no_compiler():
        raise AssertionError("--generate looked for a compiler")

    monkeypatch.setenv("MOESQ_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(nb, "find_nvcc", no_compiler)
    monkeypatch.setattr(nb, "find_cxx", no_compiler)
    assert nb.main(["--generate"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder.parent == tmp_path / "generated"
    assert (folder / pv.INCLUDE_NAME).read_text() == pv.variants_include()
    key, units = nb.build_key(), dict(nb.compile_units("nvcc", ["-O3"], "c++", ["-O2"], folder))
    changed = (dataclasses.replace(pv.P48_VARIANTS[0], stages=4), *pv.P48_VARIANTS[1:])
    monkeypatch.setattr(pv, "P48_VARIANTS", changed)
    assert nb.main(["--generate"]) == 0
    folder2 = Path(capsys.readouterr().out.strip())
    assert folder2 != folder and "X(0, Variant<16, 2, 8, 4, 1024, 2>)" in (folder2 / pv.INCLUDE_NAME).read_text()
    assert nb.build_key() != key
    units2 = dict(nb.compile_units("nvcc", ["-O3"], "c++", ["-O2"], folder2))
    assert [n for n in units if units[n] != units2[n]] == ["p48"]
    assert nb._unit_digest(units["p48"]) != nb._unit_digest(units2["p48"])


# ------------------------------------------------------------------------------------------ GPU kernel


VARIANTS = list(range(len(pv.P48_VARIANTS)))
MMA_VARIANTS = [i for i, v in enumerate(pv.P48_VARIANTS) if v.instruction == pv.MMA_SP]
ORDERED_VARIANTS = [i for i, v in enumerate(pv.P48_VARIANTS) if v.orders_experts]


def variant_matrix(variants: list[int], options: list[tuple] = ((),), shapes: list[tuple] = ((),),
                   per_variant: int | None = None) -> list:
    """One GPU test's kernel matrix, generated from the variant table: pytest params (variant, *option, *shape)
    for every variant x option x shape. The default run takes, for the i-th of `variants`, `per_variant` of the
    options (all by default; else options i * per_variant, ... cyclically), option q on shape (i + q) mod
    len(shapes): every variant runs with every option it is given, and the shapes rotate over the variants, so
    that each (option, shape) pair runs once where there are enough variants. The rest carries the full_matrix
    mark (run only with `pytest --full-matrix`)."""
    k = per_variant or len(options)
    out = []
    for i, v in enumerate(variants):
        chosen = {(i * k + j) % len(options) for j in range(k)}
        for q, option in enumerate(options):
            for s, shape in enumerate(shapes):
                default = q in chosen and s == (i + q) % len(shapes)
                out.append(pytest.param(v, *option, *shape, marks=() if default else pytest.mark.full_matrix))
    return out


def _native_or_skip():
    native = pm.load_native()
    if native is None:
        pytest.skip("needs the native module on an sm_90 GPU")
    return native


def _unstack(t: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [{s: v[e] for s, v in t.items()} for e in range(t["weight_sparse_packed"].shape[0])]


def _gpu_case(E, M, K, counts, act_quant, split, variant, out_dtype, seed, spread=0.0):
    """The kernel (NVFP4 pre-pass in W4A4) against p48_reference; in W4A4 also the in-kernel quantization,
    which must give the pre-pass path's outputs bit for bit (up to the order of split-K's atomic adds)."""
    native = _native_or_skip()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    t = random_p48_tensors(E, M, K, gen, "cpu")
    case = P48GroupedCase(_unstack(t), counts, act_quant, gen, spread)
    W = pm.P48MmaWeights.from_packed(t, dev)
    split = min(split, W.records.shape[2])
    cfg, alpha, poisoned = pm.MmaConfig(variant, split), case.alpha(W.global_scale), split == 1
    out = case.output(poisoned, out_dtype)
    pm.p48_mma_gemm_rows(case.gemm_input(), W, case.row_start, case.counts, alpha, out, cfg, native)
    tol = 2e-5 if out_dtype == torch.float32 else 8e-3
    case.check(out, tol, poisoned)
    if act_quant:
        fused = case.output(poisoned, out_dtype)
        pm.p48_mma_gemm_rows(case.x, W, case.row_start, case.counts, alpha, fused, cfg, native,
                             act_global=case.act_global)
        case.check(fused, tol, poisoned)
        if poisoned:
            torch.testing.assert_close(fused, out, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(fused, out, rtol=1e-6, atol=1e-6 * float(out.abs().max()))


REFERENCE_SHAPES = [
    (3, 72, 96, [19, 0, 3]),  # K < one record, M not a multiple of 16, an empty expert
    (5, 200, 352, [1, 40, 17, 0, 130]),  # K not a multiple of 128, several token passes
    (2, 1536, 2048, [16, 5]),  # the Qwen3-30B-A3B gate/up shape
    (1, 48, 64, [1]),  # N = 1
    # token counts on both sides of every wgmma width step (32) and pass (64 / 128), stale rows between
    (17, 136, 416, [1, 16, 17, 31, 32, 33, 48, 49, 63, 64, 65, 96, 97, 127, 128, 129, 200]),
    # five 256-row groups (two per unit in variant 4: the last unit holds one), one chunk per K slice (re-used by a
    # unit's second row group up to 16 tokens), several token passes
    (6, 1160, 768, [3, 16, 0, 17, 1, 40]),
]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant,split,act_quant,E,M,K,counts", variant_matrix(
    VARIANTS, [(split, act_quant) for split in (1, 3) for act_quant in (False, True)], REFERENCE_SHAPES))
def test_gpu_kernel_matches_reference(E, M, K, counts, act_quant, split, variant):
    _gpu_case(E, M, K, counts, act_quant, split, variant, torch.float32, seed=E + M + K)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant,fused,E,M,K,counts", variant_matrix(VARIANTS, [(False,), (True,)], [
    (5, 200, 352, [1, 40, 17, 0, 130]),  # K not a multiple of 128 (a narrow last chunk), several token passes
    (3, 136, 1056, [128, 33, 97]),  # five 256-column chunks, the last narrow: both swizzled buffers in turn
    (17, 72, 416, [1, 16, 17, 31, 32, 33, 48, 49, 63, 64, 65, 96, 97, 127, 128, 129, 200]),
]))
def test_gpu_permuted_activations_give_the_same_outputs(E, M, K, counts, fused, variant):
    """x handed over in the kernel's K order (x_permuted) gives the natural call's outputs bit for bit, poisoned
    rows untouched: W4A16 (where the 128-token passes copy such chunks straight into their swizzled buffers) and
    W4A4 with the quantization in the kernel."""
    native = _native_or_skip()
    if not pm.takes_permuted_activations(native):
        pytest.skip("this build of the native module predates x_permuted")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(E * K + M)
    t = random_p48_tensors(E, M, K, gen, "cpu")
    case = P48GroupedCase(_unstack(t), counts, fused, gen, 2.0 if fused else 0.0)
    W = pm.P48MmaWeights.from_packed(t, dev)
    cfg, alpha = pm.MmaConfig(variant, 1), case.alpha(W.global_scale)
    act_global = case.act_global if fused else None
    natural, permuted = case.output(True), case.output(True)
    pm.p48_mma_gemm_rows(case.x, W, case.row_start, case.counts, alpha, natural, cfg, native, act_global)
    xp = case.x[:, pm.k_order(K, dev)].contiguous()
    pm.p48_mma_gemm_rows(xp, W, case.row_start, case.counts, alpha, permuted, cfg, native, act_global, x_permuted=True)
    case.check(permuted, 2e-5, True)
    torch.testing.assert_close(permuted, natural, rtol=0, atol=0, equal_nan=True)


SPLIT_DTYPES = [(1, torch.float32), (1, torch.bfloat16), (2, torch.float32)]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant,split,out_dtype,E,M,K,counts", variant_matrix(MMA_VARIANTS, SPLIT_DTYPES, [
    (5, 200, 384, [1, 40, 17, 0, 130]),  # several token passes, an empty expert; a one-record last step
    (3, 2048, 768, [16, 12, 4]),  # the Qwen3-30B-A3B down shape, decode-sized
    (6, 72, 128, [33, 1, 8, 9, 0, 16]),  # one record per K slice
]))
def test_gpu_k_ordered_w4a16_equals_natural(E, M, K, counts, split, out_dtype, variant):
    """K a multiple of 128 (whole records, no narrow last chunk), x in the kernel's K order, W4A16: the decode path
    gives the natural call's outputs bit for bit, poisoned rows untouched."""
    native = _native_or_skip()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(E * K + M + split)
    t = random_p48_tensors(E, M, K, gen, "cpu")
    case = P48GroupedCase(_unstack(t), counts, False, gen, 0.0)
    W = pm.P48MmaWeights.from_packed(t, dev)
    split = min(split, W.records.shape[2])
    cfg, alpha, poisoned = pm.MmaConfig(variant, split), case.alpha(W.global_scale), split == 1
    natural, permuted = case.output(poisoned, out_dtype), case.output(poisoned, out_dtype)
    pm.p48_mma_gemm_rows(case.x, W, case.row_start, case.counts, alpha, natural, cfg, native)
    xp = case.x[:, pm.k_order(K, dev)].contiguous()
    pm.p48_mma_gemm_rows(xp, W, case.row_start, case.counts, alpha, permuted, cfg, native, x_permuted=True)
    case.check(permuted, 2e-5 if out_dtype == torch.float32 else 8e-3, poisoned)
    if poisoned:
        torch.testing.assert_close(permuted, natural, rtol=0, atol=0, equal_nan=True)
    else:  # split K: the atomic adds land in any order
        torch.testing.assert_close(permuted, natural, rtol=1e-6, atol=1e-6 * float(natural.abs().max()))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_programmatic_launch_reads_what_the_previous_kernel_wrote(variant, monkeypatch):
    """The kernels are launched so that they may start while the previous kernel runs (MOESQ_P48_PDL, on by
    default): the activations, counts and row starts written by the kernels just before (a long elementwise kernel,
    then small copies) must be what the GEMM reads, with or without the early copies of the first weights; the
    plain launch gives the same outputs bit for bit."""
    native = _native_or_skip()
    dev = torch.device("cuda")
    E, M, K, counts = 6, 264, 1024, [16, 1, 0, 97, 8, 33]
    gen = torch.Generator().manual_seed(3)
    t = random_p48_tensors(E, M, K, gen, "cpu")
    case = P48GroupedCase(_unstack(t), counts, False, gen, 0.0)
    W = pm.P48MmaWeights.from_packed(t, dev)
    alpha = case.alpha(W.global_scale)
    outs = []
    for pdl, early in (("1", True), ("0", True), ("1", False)):
        monkeypatch.setenv("MOESQ_P48_PDL", pdl)
        cfg = pm.MmaConfig(variant, 1, early)
        x = torch.zeros_like(case.x)
        cnt, start = torch.zeros_like(case.counts), torch.zeros_like(case.row_start)
        big = torch.empty(1 << 26, device=dev).uniform_()  # keeps the stream busy right before the writes
        big.mul_(2).add_(1)
        x.copy_(case.x), cnt.copy_(case.counts), start.copy_(case.row_start)
        out = case.output(True)
        pm.p48_mma_gemm_rows(x, W, start, cnt, alpha, out, cfg, native)
        case.check(out, 2e-5, True)
        outs.append(out)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_kernel_bf16_output(variant):
    _gpu_case(4, 520, 1024, [9, 16, 0, 77], False, 1, variant, torch.bfloat16, seed=11)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant,split,out_dtype,E,M,K,counts", variant_matrix(VARIANTS, SPLIT_DTYPES, [
    (4, 40, 224, [0, 33, 1, 16]),  # K not a multiple of 128, an empty expert, N = 1, several 16-token passes
    (2, 1536, 2048, [16, 3]),  # the Qwen3-30B-A3B gate/up shape
    (1, 16, 32, [1]),  # one 32-column block
]))
def test_gpu_in_kernel_activation_quant_equals_prepass(E, M, K, counts, split, variant, out_dtype):
    """Activations spread over the whole NVFP4 scale range (subnormal UE4M3 scales, the 448 clamp)."""
    _gpu_case(E, M, K, counts, True, split, variant, out_dtype, seed=7 * E + K, spread=4.0)


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_compiled_variants_are_the_table():
    """The module's variants (moesq_p48_num_variants and moesq_p48_get_variant_info, through p48_variants()) are
    the table's rows, index for index."""
    native = _native_or_skip()
    compiled = native.p48_variants()
    assert [v["index"] for v in compiled] == VARIANTS
    for info, row in zip(compiled, pv.P48_VARIANTS):
        got = tuple(info[k] for k in ("tokens_per_block", "row_tiles_per_warp", "warps", "stages", "k_chunk",
                                      "row_groups_per_unit"))
        assert got == (row.tokens_per_block, row.row_tiles_per_warp, row.warps, row.stages, row.k_chunk,
                       row.row_groups_per_unit), (info, row)
        assert 16 * info["warps"] * info["row_tiles_per_warp"] == row.rows_per_cta


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_variants_agree_bit_for_bit():
    """The variants of one instruction (P48Variant.instruction: mma.sp or wgmma.sp) run the same MMAs in the same K
    order per output: equal fp32 outputs (poisoned rows left alone), whatever the tokens per pass and however
    the activations are staged; every variant matches the reference."""
    native = _native_or_skip()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(21)
    counts = [1, 0, 200, 64, 17, 129, 8]
    t = random_p48_tensors(len(counts), 264, 608, gen, "cpu")
    case = P48GroupedCase(_unstack(t), counts, False, gen)
    W = pm.P48MmaWeights.from_packed(t, dev)
    outs = []
    for v in VARIANTS:
        out = case.output(True)
        pm.p48_mma_gemm_rows(case.x, W, case.row_start, case.counts, case.alpha(W.global_scale), out,
                             pm.MmaConfig(v, 1), native)
        case.check(out, 2e-5, True)
        outs.append(out)
    first = {}
    for v, out in zip(VARIANTS, outs):
        a = first.setdefault(pv.P48_VARIANTS[v].instruction, v)
        torch.testing.assert_close(out, outs[a], rtol=0, atol=0, equal_nan=True, msg=f"variant {v} vs {a}")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant,x_permuted", variant_matrix(VARIANTS, [(False,), (True,)]))
def test_gpu_kernel_ignores_x_past_k_and_stale_staging(variant, x_permuted):
    """x is a view into wider rows whose extra columns are inf, and the previous launch left inf in shared
    memory where this one stages its K padding: neither may reach the outputs (0 * inf = NaN). x_permuted: the
    K-ordered W4A16 activations, staged as they are."""
    native = _native_or_skip()
    if x_permuted and not pm.takes_permuted_activations(native):
        pytest.skip("this build of the native module predates x_permuted")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(variant)
    wide = random_p48_tensors(2, 64, 1024, gen, "cpu")
    Ww = pm.P48MmaWeights.from_packed(wide, dev)
    xw = torch.full((2 * 200, 1024), float("inf"), dtype=torch.bfloat16, device=dev)
    rs = torch.tensor([0, 200], dtype=torch.int32, device=dev)
    cnt = torch.tensor([200, 200], dtype=torch.int32, device=dev)
    pm.p48_mma_gemm_rows(xw, Ww, rs, cnt, Ww.global_scale, torch.zeros(400, 64, device=dev), pm.MmaConfig(variant, 1),
                         native, x_permuted=x_permuted)
    counts = [130, 7, 0, 1]
    t = random_p48_tensors(len(counts), 40, 160, gen, "cpu")
    case = P48GroupedCase(_unstack(t), counts, False, gen)
    W = pm.P48MmaWeights.from_packed(t, dev)
    x = torch.full((case.x.shape[0], 256), float("inf"), dtype=torch.bfloat16, device=dev)
    x[:, :160] = case.x[:, pm.k_order(160, dev)] if x_permuted else case.x
    out = case.output(True)
    pm.p48_mma_gemm_rows(x[:, :160], W, case.row_start, case.counts, case.alpha(W.global_scale), out,
                         pm.MmaConfig(variant, 1), native, x_permuted=x_permuted)
    case.check(out, 2e-5, True)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_in_kernel_activation_quant_zero_rows_and_cuda_graph(variant):
    """All-zero and single-nonzero blocks quantize like the pre-pass; the W4A4 launch replays in a CUDA graph
    (the bulk-copy rings wait on mbarriers; the warpgroup variants also stage with cp.async one chunk ahead)."""
    native = _native_or_skip()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    t = random_p48_tensors(3, 48, 256, gen, "cpu")
    W = pm.P48MmaWeights.from_packed(t, dev)
    case = P48GroupedCase(_unstack(t), [5, 2, 9], True, gen, spread=2.0)
    x = case.x.view(3, case.C, 256)
    x[0, 1] = 0  # an all-zero token
    x[2, 3, 32:64] = 0
    x[2, 3, 40] = -1e-3  # one nonzero value in a block
    cfg, alpha = pm.MmaConfig(variant, 1), case.alpha(W.global_scale)
    want = case.output(True)
    pm.p48_mma_gemm_rows(case.gemm_input(), W, case.row_start, case.counts, alpha, want, cfg, native)
    out = case.output(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pm.p48_mma_gemm_rows(case.x, W, case.row_start, case.counts, alpha, out, cfg, native,
                             act_global=case.act_global)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert not out.view(3, case.C, 48)[0, 1].any()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant,act_quant,split",
                         variant_matrix(VARIANTS, [(False, 1), (True, 1), (False, 2)], per_variant=1))
def test_gpu_kernel_many_experts_few_active(variant, act_quant, split):
    """More experts than a CTA has threads, most without tokens (the first and the last with): CTAs skip the
    experts without tokens, and some are left without work."""
    gen = torch.Generator().manual_seed(300 + variant)
    counts = [0] * 300
    for e, n in ((0, 3), (1, 16), (7, 1), (130, 9), (255, 2), (256, 5), (257, 16), (299, 1)):
        counts[e] = n
    _gpu_case(300, 264, 640, counts, act_quant, split, variant, torch.float32,
              seed=int(torch.randint(0, 99, (1,), generator=gen)))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant,E,M,K,split", variant_matrix(MMA_VARIANTS, [
    (300, 64, 256, 1),  # more units than CTAs: a CTA whose first expert is empty takes a later unit
    (300, 520, 640, 2),  # two 256-row groups and a partial third, K slices
    (300, 40, 128, 1),  # one record per unit: fewer early steps than the ring holds
    (5, 264, 384, 1),  # fewer units than CTAs: the CTAs of the empty experts have nothing else to do
], per_variant=2))
def test_gpu_early_first_unit_gives_the_same_outputs(variant, E, M, K, split):
    """early_first_unit on and off give the same outputs (bit for bit without split K), the reference's, and
    leave the rows of experts without tokens alone, whether a CTA's natural first expert has tokens or not (its
    early copies are then waited for and skipped)."""
    native = _native_or_skip()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(E * M + K + variant)
    choices = torch.tensor([0, 0, 0, 1, 7, 16])  # half the experts without tokens
    counts = choices[torch.randint(0, len(choices), (E,), generator=gen)].tolist()
    counts[0], counts[-1] = 0, 3
    t = random_p48_tensors(E, M, K, gen, "cpu")
    case = P48GroupedCase(_unstack(t), counts, False, gen)
    W = pm.P48MmaWeights.from_packed(t, dev)
    alpha, poisoned, outs = case.alpha(W.global_scale), split == 1, []
    for early in (True, False):
        out = case.output(poisoned)
        pm.p48_mma_gemm_rows(case.x, W, case.row_start, case.counts, alpha, out, pm.MmaConfig(variant, split, early),
                             native)
        case.check(out, 2e-5, poisoned)
        outs.append(out)
    if poisoned:
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)
    else:  # split K: the atomic adds land in any order
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6 * float(outs[1].abs().max()))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("variant,split", variant_matrix(ORDERED_VARIANTS, [(1,), (2,)], per_variant=1))
def test_gpu_ordered_deal_sorts_more_experts_than_threads_with_ties(variant, split):
    """The variants that deal units by decreasing token count sort the experts in the kernel: more experts than
    a CTA has threads (several rounds of the rank pass), many equal counts (ties go by index), empty experts."""
    gen = torch.Generator().manual_seed(700 + variant)
    choices = torch.tensor([0, 0, 1, 5, 64, 65, 130])
    counts = choices[torch.randint(0, len(choices), (700,), generator=gen)].tolist()
    _gpu_case(700, 40, 160, counts, False, split, variant, torch.float32, seed=variant)


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_ordered_deal_refuses_more_experts_than_it_can_sort():
    native = _native_or_skip()
    dev = torch.device("cuda")
    E = pm.MAX_ORDER_EXPERTS + 1
    t = random_p48_tensors(E, 16, 32, torch.Generator().manual_seed(0), "cpu")
    W = pm.P48MmaWeights.from_packed(t, dev)
    x = torch.zeros(E, 32, dtype=torch.bfloat16, device=dev)
    rs = torch.arange(E, dtype=torch.int32, device=dev)
    cnt = torch.ones(E, dtype=torch.int32, device=dev)
    ordered = ORDERED_VARIANTS[0]
    with pytest.raises(RuntimeError, match="sorts at most"):
        pm.p48_mma_gemm_rows(x, W, rs, cnt, W.global_scale, torch.zeros(E, 16, device=dev),
                             pm.MmaConfig(ordered, 1), native)
    assert not pv.P48_VARIANTS[pm.pick_config(16, 2048, E, 128, dev).variant].orders_experts


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_kernel_rejects_bad_arguments():
    native = _native_or_skip()
    dev = torch.device("cuda")
    t = random_p48_tensors(2, 32, 256, torch.Generator().manual_seed(0), "cpu")
    W = pm.P48MmaWeights.from_packed(t, dev)
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=dev)
    rs, cnt = torch.zeros(2, dtype=torch.int32, device=dev), torch.ones(2, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="float32"):
        pm.p48_mma_gemm_rows(x, W, rs, cnt, W.global_scale, torch.zeros(4, 32, dtype=torch.bfloat16, device=dev),
                             pm.MmaConfig(0, 2), native)
    with pytest.raises(ValueError, match="x:"):
        pm.p48_mma_gemm_rows(x.float(), W, rs, cnt, W.global_scale, torch.zeros(4, 32, device=dev),
                             pm.MmaConfig(0, 1), native)
    with pytest.raises(ValueError, match="act_global"):
        pm.p48_mma_gemm_rows(x, W, rs, cnt, W.global_scale, torch.zeros(4, 32, device=dev), pm.MmaConfig(0, 1),
                             native, act_global=torch.ones(3, device=dev))


def test_native_build_reuses_objects_of_unchanged_units(monkeypatch, tmp_path):
    from moesq_core.serving.kernels import native_build as nb

    (tmp_path / "include").mkdir()
    (tmp_path / "src").mkdir()
    for name, text in (("include/a.h", "int a;"), ("src/one.cu", "1"), ("src/two.cu", "2"), ("src/v.def", "V")):
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(nb, "NATIVE_DIR", tmp_path)
    one = ["nvcc", "-O3", "-c", str(tmp_path / "src/one.cu")]
    two = ["nvcc", "-O3", "-c", str(tmp_path / "src/two.cu")]
    d1, d2 = nb._unit_digest(one), nb._unit_digest(two)
    (tmp_path / "src/two.cu").write_text("2 changed")
    assert nb._unit_digest(one) == d1 and nb._unit_digest(two) != d2  # another unit's source: no recompile
    (tmp_path / "include/a.h").write_text("int b;")
    assert nb._unit_digest(one) != d1  # a header: every unit
    assert nb._unit_digest([*one[:-1], "-DX", one[-1]]) != nb._unit_digest(one)  # flags


def test_bench_targets_and_table_include_the_native_kernel():
    from moesq_core.serving.bench import p48_bench as pb

    def row(N, us, tbps, vs8):
        return {"shape": "Qwen3-30B-A3B gate/up", "G": 128, "N": N,
                "methods": {"fp8_grouped_mm": {"us": us * vs8},
                            "p48_mma_w4a16": {"us": us, "weight_TBps": tbps, "speedup_vs_fp8": vs8}}}

    rows = [row(1, 50.0, 2.7, 3.0), row(16, 60.0, 2.4, 2.5), row(128, 100.0, 1.5, 1.1)]
    t = pb.targets(rows, "p48_mma_w4a16")
    assert t["N_le_16_TBps"] == {"min": 2.4, "max": 2.7, "target": 2.5, "met": False}
    assert t["N_le_16_speedup_vs_fp8"]["met"] and t["N_128_speedup_vs_fp8"]["met"]
    result = {"date": "d", "gpu": "H200", "sm_count": 132, "torch": "t", "cuda": "c", "triton": "3", "commit": "abc",
              "repeats": 20, "token_pattern": "p", "methods": {"fp8_grouped_mm": "", "p48_mma_w4a16": ""},
              "rows": rows, "targets_p48_mma_w4a16": t}
    md = pb.markdown(result)
    assert "| p48_mma_w4a16 TB/s | p48_mma_w4a16 vs fp8 |" in md
    assert "| Qwen3-30B-A3B gate/up | 128 | 16 | – | 150.0 | 60.0 | 2.4 | 2.5 |" in md
    assert "p48_mma_w4a16 N_le_16_TBps: min=2.4, max=2.7, target=2.5, met=False" in md
    fused = {**result, "methods": {**result["methods"], "p48_mma_w4a4_fused": ""}}
    assert "| p48_mma_w4a4_fused TB/s | p48_mma_w4a4_fused vs fp8 |" in pb.markdown(fused)
    assert "p48_mma_w4a4_fused" in pb.MMA_METHODS and "p48_mma_w4a4" in pb.MMA_METHODS  # the pre-pass path stays


def _kernel_matrices() -> dict[str, tuple[list[str], list]]:
    """{test name: (parameter names, params as pytest.param)} of this file's tests parametrized over the variants."""
    out = {}
    for name, fn in globals().items():
        for mark in getattr(fn, "pytestmark", []) if name.startswith("test_gpu") else []:
            if mark.name == "parametrize" and mark.args[0].split(",")[0] == "variant":
                params = [p if hasattr(p, "marks") else pytest.param(p) for p in mark.args[1]]
                out[name] = (mark.args[0].split(","), params)
    return out


def test_default_gpu_matrix_runs_every_variant_with_every_option():
    """CPU: the default part of each generated kernel matrix runs every variant of its test (all, the mma.sp ones
    or the ordering ones, as the table says) and the full matrix is each combination once; the reference test's
    default runs each variant with act_quant on and off, split K off (poisoned outputs) and on, and every shape."""
    matrices = _kernel_matrices()
    assert len(matrices) >= 10 and "test_gpu_kernel_matches_reference" in matrices
    for name, (_, params) in matrices.items():
        default = [p for p in params if not p.marks]
        assert {p.values[0] for p in default} == {p.values[0] for p in params}, name
        assert len({repr(p.values) for p in params}) == len(params), name
    names, params = matrices["test_gpu_kernel_matches_reference"]
    assert {p.values[0] for p in params} == set(VARIANTS) and len(params) == len(VARIANTS) * 4 * len(REFERENCE_SHAPES)
    default = [dict(zip(names, p.values)) for p in params if not p.marks]
    for v in VARIANTS:
        assert {(c["split"], c["act_quant"]) for c in default if c["variant"] == v} == {(1, False), (1, True),
                                                                                        (3, False), (3, True)}
    assert {(c["E"], c["M"], c["K"]) for c in default} == {s[:3] for s in REFERENCE_SHAPES}
    assert {p.values[0] for p in matrices["test_gpu_early_first_unit_gives_the_same_outputs"][1]} == set(MMA_VARIANTS)


def test_full_matrix_runs_only_with_its_option():
    """pytest -m "gpu or hopper" collects the default matrix; --full-matrix adds exactly the marked rest (the
    option, not -m, selects it: the usual GPU command keeps the default)."""
    marked = sum(1 for _, params in _kernel_matrices().values() for p in params if p.marks)
    assert marked > 0

    def collected(*extra: str) -> int:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            "-m", "gpu or hopper", *extra, __file__], capture_output=True, text=True, cwd=nb.REPO_ROOT)
        m = re.search(r"(\d+)(?:/\d+)? tests? collected", r.stdout)
        assert m, r.stdout[-2000:] + r.stderr[-2000:]
        return int(m.group(1))

    assert collected("--full-matrix") - collected() == marked


# ------------------------------------------------------------------------------------------ moesq verify --kernel


def test_kernel_check_of_p48_dir_without_gpu_says_why(packs, monkeypatch):
    from moesq_core.serving.kernels.verify_kernel import kernel_check_packed_dir

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="kernel check of .* impossible: no CUDA GPU"):
        kernel_check_packed_dir(packs["p48-nvfp4"][1])


def test_verify_kernel_cli_without_gpu_is_one_clear_line(packs):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from moesq_runner import moesq

    r = moesq("verify", packs["p48-nvfp4"][1], "--kernel", "--quiet", check=False)
    assert r.returncode == 1
    assert "kernel check of" in r.stderr and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def _p48_linears(packed_dir) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(packed_dir / "model.safetensors"), framework="pt") as f:
        return {k.rsplit(".", 1)[0] for k in f.keys() if k.endswith(".weight_sparse_packed")}


def _check_embedded_model(packed_dir, kernel: str):
    from moesq_core.serving.kernels.verify_kernel import kernel_check_packed_dir

    info: dict = {}
    res = kernel_check_packed_dir(packed_dir, info=info)
    assert info["p48_kernel"] == kernel
    names = _p48_linears(packed_dir)
    # every packed expert linear, in W4A16 and (the pack carries input global scales) W4A4
    assert {n for n, _, _ in res} == names | {f"{n} (W4A4)" for n in names}
    assert all(ok for _, _, ok in res), [r for r in res if not r[2]][:5]
    return res


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_kernel_check_embedded_model_on_sparse_tensor_cores(packs):
    _native_or_skip()
    _check_embedded_model(packs["p48-nvfp4"][1], "sparse-mma")


@pytest.mark.gpu
def test_gpu_kernel_check_embedded_model_on_triton(packs, monkeypatch):
    monkeypatch.setattr(pm, "load_native", lambda: None)  # as on a machine without the native build
    _check_embedded_model(packs["p48-nvfp4"][1], "triton")


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_kernel_check_flags_a_wrong_output(packs, monkeypatch):
    """One output of one expert off by 1 %: the check names that tensor (and no other)."""
    _native_or_skip()
    real = pm.p48_mma_gemm_rows

    def off_by_a_little(x, w, row_start, counts, alpha, out, config, native=None, act_global=None):
        real(x, w, row_start, counts, alpha, out, config, native, act_global)
        out[0, 3] *= 1.01  # expert 0's first row (it has tokens in every grouped call)
        return out

    monkeypatch.setattr(pm, "p48_mma_gemm_rows", off_by_a_little)
    from moesq_core.serving.kernels.verify_kernel import kernel_check_packed_dir

    res = kernel_check_packed_dir(packs["p48-nvfp4"][1])
    bad = [n for n, _, ok in res if not ok]
    assert bad and all(".experts.0." in n for n in bad), bad
