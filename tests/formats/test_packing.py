"""Packers: bit-exact round trips, byte accounting, the release's bit order, and rejection of corrupt input."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moesq_core.formats import E2M1_GRID, P48, S24, QuantizedWeight, e2m1_decode, get_format
from moesq_core.formats.packing import (
    LAYOUTS,
    PackingError,
    bits_per_weight,
    detect_layout,
    pack,
    packed_nbytes,
    unpack,
)

SETTINGS = settings(max_examples=40, deadline=None)
# (format, layout, required multiple of `in`)
CASES = [
    ("p48-nvfp4", "p48-nvfp4", 32),
    ("p48-nvfp4", "dense-p48", 32),
    ("dense-nvfp4", "dense-nvfp4", 16),
    ("s24-fp8", "s24-fp8", 8),
]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(raw(a[k]), raw(b[k])), k


def assert_same_qw(a: QuantizedWeight, b: QuantizedWeight, mask: bool = True) -> None:
    assert a.format == b.format
    fields = ("codes", "scales", "global_scale") + (("mask",) if mask else ())
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape, (f, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x, y), f


def random_qw(fmt_name: str, out: int, inn: int, seed: int, zero_frac: float, random_mask: bool, stack: int | None):
    """Quantize random weights (some entries zero, so some kept pairs quantize to all-zero codes)."""
    fmt = get_format(fmt_name)
    gen = torch.Generator().manual_seed(seed)
    qws = []
    for _ in range(stack or 1):
        w = torch.randn(out, inn, generator=gen) * torch.exp(torch.randn(out, 1, generator=gen))
        w = w * (torch.rand(out, inn, generator=gen) >= zero_frac)
        mask = None
        if random_mask and not fmt.patterns.is_dense:
            idx = torch.randint(fmt.patterns.num_patterns, (out, inn // fmt.patterns.group), generator=gen)
            mask = fmt.patterns.mask_from_index(idx)
        qws.append(fmt.quantize(w, mask))
    if stack is None:
        return qws[0]
    return QuantizedWeight(
        fmt_name,
        torch.stack([q.codes for q in qws]),
        torch.stack([q.scales for q in qws]),
        torch.stack([q.global_scale for q in qws]).reshape(stack, 1, 1),
        torch.stack([q.mask for q in qws]),
    )


def kept_pair_all_zero(qw: QuantizedWeight) -> bool:
    pairs_kept = qw.mask.reshape(*qw.mask.shape[:-1], -1, 2).any(-1)
    pairs_zero = (qw.codes.reshape(*qw.codes.shape[:-1], -1, 2) == 0).all(-1)
    return bool((pairs_kept & pairs_zero).any())


qw_cases = st.tuples(
    st.sampled_from(CASES),
    st.integers(1, 6),  # out
    st.integers(1, 4),  # in / multiple
    st.integers(0, 2**31 - 1),  # seed
    st.sampled_from([0.0, 0.3, 0.9]),  # zero fraction
    st.booleans(),  # random admissible mask instead of magnitude
    st.sampled_from([None, 1, 3]),  # stacked experts
)


@SETTINGS
@given(qw_cases)
def test_round_trip_from_quantized(case):
    (fmt, layout, mult), out, k, seed, zero_frac, random_mask, stack = case
    qw = random_qw(fmt, out, mult * k, seed, zero_frac, random_mask, stack)
    t = pack(qw, layout)
    assert set(t) == set(LAYOUTS[layout].suffixes)
    back = unpack(fmt, t)
    if layout == "dense-p48" and kept_pair_all_zero(qw):
        # The dense variant has no mask: a kept all-zero pair is indistinguishable from a pruned one.
        assert_same_qw(qw, back, mask=False)
        nonzero_pair = (qw.codes.reshape(*qw.shape[:-1], -1, 2) != 0).any(-1).repeat_interleave(2, -1)
        assert torch.equal(back.mask & nonzero_pair, qw.mask & nonzero_pair)
    else:
        assert_same_qw(qw, back)
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert_same_tensors(pack(back, layout), t)

    # Codes on the grid, masks admissible.
    if fmt == "s24-fp8":
        assert not bool(((back.codes & 0x7F) == 0x7F).any()), "NaN e4m3 code"
        assert bool(S24.match(back.mask)[1].all())
    else:
        assert int(back.codes.max()) <= 15
        mags = e2m1_decode(back.codes).abs()
        assert bool(torch.isin(mags, torch.tensor(E2M1_GRID)).all())
        if fmt == "p48-nvfp4":
            assert bool(P48.match(back.mask)[1].all())


def random_raw(layout: str, lead: tuple[int, ...], out: int, inn: int, seed: int) -> dict[str, torch.Tensor]:
    """Random valid on-disk tensors (scales positive finite e4m3, masks admissible)."""
    gen = torch.Generator().manual_seed(seed)
    rb = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)  # noqa: E731
    def pick(values, *shape):
        v = torch.tensor(values, dtype=torch.uint8)
        return v[torch.randint(len(v), shape, generator=gen)]
    pos_e4m3 = list(range(1, 0x7F))  # positive, finite, nonzero
    gs = (torch.rand(*lead, 1, generator=gen) * 1e4 + 1e-3).float()
    if layout == "p48-nvfp4":
        nib = pick([0b0011, 0b0101, 0b1001, 0b0110, 0b1010, 0b1100], *lead, out, inn // 8)
        return {
            "weight_sparse_packed": rb(*lead, out, inn // 4),
            "weight_sparse_mask": nib[..., 0::2] | (nib[..., 1::2] << 4),
            "weight_scale": pick(pos_e4m3, *lead, out, inn // 32).view(torch.float8_e4m3fn),
            "weight_global_scale": gs,
        }
    if layout in ("dense-nvfp4", "dense-p48"):
        block = 16 if layout == "dense-nvfp4" else 32
        packed = rb(*lead, out, inn // 2)
        if layout == "dense-p48":  # at most 2 nonzero bytes per 4-byte chunk
            chunks = packed.reshape(*lead, out, inn // 8, 4)
            keep = P48.mask_from_index(torch.randint(6, (*lead, out, inn // 8), generator=gen))
            keep = keep.reshape(*lead, out, inn // 8, 4, 2)[..., 0]
            packed = (chunks * keep).reshape(*lead, out, inn // 2)
        return {
            "weight_packed": packed,
            "weight_scale": pick(pos_e4m3, *lead, out, inn // block).view(torch.float8_e4m3fn),
            "weight_global_scale": gs,
        }
    nib = pick([0x4, 0x8, 0xC, 0x9, 0xD, 0xE], *lead, out, inn // 4)
    return {
        "weight_sparse_values": rb(*lead, out, inn // 2).view(torch.float8_e4m3fn),
        "weight_sparse_meta": nib[..., 0::2] | (nib[..., 1::2] << 4),
        "weight_scale": (torch.rand(*lead, out, 1, generator=gen) + 1e-3).float(),
    }


@SETTINGS
@given(st.sampled_from(CASES), st.sampled_from([(), (2,)]), st.integers(1, 5), st.integers(1, 4),
       st.integers(0, 2**31 - 1))
def test_repack_is_byte_identical(case, lead, out, k, seed):
    fmt, layout, mult = case
    t = random_raw(layout, lead, out, mult * k, seed)
    qw = unpack(fmt, t)
    assert detect_layout(fmt, t.keys()).name == layout
    assert tuple(qw.shape) == (*lead, out, mult * k)
    assert_same_tensors(pack(qw, layout), t)


@SETTINGS
@given(st.integers(1, 8), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_bits_per_weight_exact(out, k, seed):
    inn = 32 * k
    n = out * inn
    t = pack(random_qw("p48-nvfp4", out, inn, seed, 0.0, True, None))
    nbytes = t["weight_sparse_packed"].nbytes + t["weight_sparse_mask"].nbytes + t["weight_scale"].nbytes
    assert 8 * nbytes == 2.75 * n
    assert bits_per_weight(t, (out, inn)) == 2.75 + 32 / n  # + the fp32 global scale
    assert packed_nbytes(t) == n * 11 // 32 + 4

    t = pack(random_qw("dense-nvfp4", out, inn, seed, 0.0, False, None))
    assert 8 * (t["weight_packed"].nbytes + t["weight_scale"].nbytes) == 4.5 * n
    t = pack(random_qw("p48-nvfp4", out, inn, seed, 0.0, False, None), "dense-p48")
    assert 8 * (t["weight_packed"].nbytes + t["weight_scale"].nbytes) == 4.25 * n

    t = pack(random_qw("s24-fp8", out, inn, seed, 0.0, False, None))
    assert 8 * (t["weight_sparse_values"].nbytes + t["weight_sparse_meta"].nbytes) == 5 * n
    assert bits_per_weight(t, (out, inn)) == 5 + 32 * out / n  # + the fp32 row scales


def p48_example() -> QuantizedWeight:
    """One row of 32 columns, patterns 11000011, 11110000, 00111100, 00001111 (release order indices 2, 0, 3, 5)."""
    codes = torch.tensor([[
        1, 2, 0, 0, 0, 0, 3, 4,     # 11000011: pairs 0 and 3 -> bytes 0x21, 0x43, nibble 0b1001
        5, 6, 7, 9, 0, 0, 0, 0,     # 11110000: bytes 0x65, 0x97, nibble 0b0011
        0, 0, 10, 11, 0, 0, 0, 0,   # 00111100 with its second kept pair all zero: nibble 0b0110
        0, 0, 0, 0, 12, 13, 14, 15, # 00001111: nibble 0b1100
    ]], dtype=torch.uint8)
    mask = P48.mask_from_index(torch.tensor([[2, 0, 3, 5]]))
    return QuantizedWeight("p48-nvfp4", codes, torch.tensor([[3.0]]), torch.tensor(100.0), mask)


def test_p48_bit_order_matches_release():
    t = pack(p48_example())
    assert t["weight_sparse_packed"].tolist() == [[0x21, 0x43, 0x65, 0x97, 0xBA, 0x00, 0xDC, 0xFE]]
    # byte 0: low nibble = chunk 0 (0b1001), high nibble = chunk 1 (0b0011); byte 1: 0b0110 | 0b1100 << 4
    assert t["weight_sparse_mask"].tolist() == [[0b0011_1001, 0b1100_0110]]
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].float().tolist() == [[3.0]]
    assert t["weight_global_scale"].tolist() == [100.0]
    assert_same_qw(unpack("p48-nvfp4", t), p48_example())


def test_p48_dense_variant_example():
    t = pack(p48_example(), "dense-p48")
    assert t["weight_packed"].tolist() == [[0x21, 0, 0, 0x43, 0x65, 0x97, 0, 0, 0, 0xBA, 0, 0, 0, 0, 0xDC, 0xFE]]
    back = unpack("p48-nvfp4", t)
    # The kept all-zero pair (byte 2 of chunk 2) is lost; the chunk is completed with its lowest zero byte (0).
    assert back.mask.reshape(-1, 2)[:, 0].reshape(4, 4).tolist()[2] == [True, True, False, False]
    assert torch.equal(back.codes, p48_example().codes)


def test_p48_mask_completion_lowest_free_pair():
    # Group 0 keeps only pair 2 (a mask sparser than 4:8): packing completes it with pair 0 (nibble 0b0101).
    qw = p48_example()
    mask = qw.mask.clone()
    mask[0, 0:8] = torch.tensor([0, 0, 0, 0, 1, 1, 0, 0], dtype=torch.bool)
    codes = qw.codes.clone()
    codes[0, 0:8] = torch.tensor([0, 0, 0, 0, 5, 1, 0, 0], dtype=torch.uint8)
    t = pack(QuantizedWeight("p48-nvfp4", codes, qw.scales, qw.global_scale, mask))
    assert t["weight_sparse_mask"][0, 0] & 0xF == 0b0101
    assert t["weight_sparse_packed"][0, :2].tolist() == [0x00, 0x15]


def test_dense_nvfp4_example():
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    qw = QuantizedWeight("dense-nvfp4", codes, torch.tensor([[0.5]]), torch.tensor(2.0),
                         torch.ones(1, 16, dtype=torch.bool))
    t = pack(qw)
    assert t["weight_packed"].tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    assert_same_qw(unpack("dense-nvfp4", t), qw)


def test_s24_example():
    # Groups 1001 and 0110: meta nibbles 0 | 3 << 2 = 0xC and 1 | 2 << 2 = 0x9 -> byte 0x9C.
    vals = torch.tensor([1.0, 0.0, 0.0, -2.0, 0.0, 0.5, 448.0, 0.0]).to(torch.float8_e4m3fn).view(torch.uint8)
    mask = S24.mask_from_index(torch.tensor([[2, 3]]))
    qw = QuantizedWeight("s24-fp8", vals.reshape(1, 8), torch.tensor([[0.25]]), torch.tensor(1.0), mask)
    t = pack(qw)
    assert t["weight_sparse_meta"].tolist() == [[0x9C]]
    assert t["weight_sparse_values"].float().tolist() == [[1.0, -2.0, 0.5, 448.0]]
    assert t["weight_scale"].tolist() == [[0.25]]
    assert_same_qw(unpack("s24-fp8", t), qw)


def test_stacked_equals_per_expert():
    for fmt, layout, mult in CASES:
        qw = random_qw(fmt, 3, 2 * mult, 7, 0.3, True, 3)
        t = pack(qw, layout)
        for e in range(3):
            one = QuantizedWeight(fmt, qw.codes[e], qw.scales[e], qw.global_scale[e].reshape(()), qw.mask[e])
            assert_same_tensors({k: v[e] for k, v in t.items()}, pack(one, layout))


# ---- corrupt or unsupported input ----------------------------------------------------------------------------


def test_mask_nibble_with_three_bits_rejected():
    t = pack(random_qw("p48-nvfp4", 4, 64, 1, 0.0, True, None))
    bad = dict(t)
    m = t["weight_sparse_mask"].clone()
    low = int(m[2, 3]) & 0xF
    free_bit = next(b for b in range(4) if not low >> b & 1)
    m[2, 3] ^= 1 << free_bit
    bad["weight_sparse_mask"] = m
    with pytest.raises(PackingError,
                       match=r"expert\.weight_sparse_mask\[2, 3\]: low nibble 0b\d{4} has 3 bits set") as e:
        unpack("p48-nvfp4", bad, name="expert")
    assert e.value.position == (2, 3) and e.value.tensor == "expert.weight_sparse_mask"


def test_mask_nibble_with_one_bit_rejected():
    t = pack(random_qw("p48-nvfp4", 4, 64, 2, 0.0, True, None))
    m = t["weight_sparse_mask"].clone()
    high = int(m[1, 0]) >> 4
    m[1, 0] ^= (1 << next(b for b in range(4) if high >> b & 1)) << 4
    with pytest.raises(PackingError,
                       match=r"weight_sparse_mask\[1, 0\]: high nibble .* has 1 bits set.*columns 8\.\.15"):
        unpack("p48-nvfp4", {**t, "weight_sparse_mask": m})


@pytest.mark.parametrize("fmt,layout,mult", CASES)
def test_wrong_shape_rejected(fmt, layout, mult):
    t = pack(random_qw(fmt, 4, 2 * mult, 3, 0.0, False, None), layout)
    for k, v in t.items():
        cut = v[..., :-1] if v.shape[-1] > 1 else v[:-1]
        with pytest.raises(PackingError, match=k):
            unpack(fmt, {**t, k: cut})


def test_wrong_dtype_missing_and_extra_rejected():
    t = pack(random_qw("p48-nvfp4", 2, 32, 4, 0.0, False, None))
    with pytest.raises(PackingError, match=r"weight_scale: dtype is torch.float32, expected torch.float8_e4m3fn"):
        unpack("p48-nvfp4", {**t, "weight_scale": t["weight_scale"].float()})
    with pytest.raises(PackingError, match="weight_sparse_mask: missing"):
        unpack("p48-nvfp4", {k: v for k, v in t.items() if k != "weight_sparse_mask"})
    with pytest.raises(PackingError, match="weight_zero_point: unexpected"):
        unpack("p48-nvfp4", {**t, "weight_zero_point": torch.zeros(1)})
    # The activation scale is tolerated.
    unpack("p48-nvfp4", {**t, "input_global_scale": torch.ones(1)})
    with pytest.raises(ValueError, match="unknown format"):
        unpack("int4", t)


def test_s24_bad_meta_rejected():
    t = pack(random_qw("s24-fp8", 2, 16, 5, 0.0, True, None))
    m = t["weight_sparse_meta"].clone()
    m[1, 1] = (m[1, 1] & 0x0F) | (0x7 << 4)  # positions (3, 1): not increasing
    with pytest.raises(PackingError, match=r"weight_sparse_meta\[1, 1\]: high nibble 0x7 names positions \(3, 1\)"):
        unpack("s24-fp8", {**t, "weight_sparse_meta": m})


def test_dense_p48_three_nonzero_bytes_rejected():
    t = pack(random_qw("p48-nvfp4", 2, 32, 6, 0.0, True, None), "dense-p48")
    p = t["weight_packed"].clone()
    chunk = p[1, 4:8]
    chunk[chunk == 0] = 0x11
    with pytest.raises(PackingError, match=r"weight_packed\[1, 4\]: 4-byte chunk has 4 nonzero bytes"):
        unpack("p48-nvfp4", {**t, "weight_packed": p})


def test_pack_rejects_unrepresentable_weights():
    qw = random_qw("p48-nvfp4", 2, 32, 8, 0.0, True, None)
    codes = qw.codes.clone()
    pruned = (~qw.mask).nonzero()[0]
    codes[tuple(pruned)] = 3
    with pytest.raises(PackingError, match="codes.*nonzero code 3 at a position the mask prunes"):
        pack(QuantizedWeight(qw.format, codes, qw.scales, qw.global_scale, qw.mask))
    mask = qw.mask.clone()
    mask[0, :8] = True
    with pytest.raises(PackingError, match="more than 2 pairs"):
        pack(QuantizedWeight(qw.format, qw.codes, qw.scales, qw.global_scale, mask))
    with pytest.raises(PackingError, match="not an e4m3 value"):
        pack(QuantizedWeight(qw.format, qw.codes, qw.scales + 0.01, qw.global_scale, qw.mask))
    with pytest.raises(PackingError, match="input dimension 24"):
        pack(QuantizedWeight(qw.format, qw.codes[:, :24], qw.scales, qw.global_scale, qw.mask[:, :24]))
    with pytest.raises(ValueError, match="layout 'dense-nvfp4' stores format 'dense-nvfp4'"):
        pack(qw, "dense-nvfp4")
    sparse_dense = get_format("dense-nvfp4").quantize(torch.randn(2, 32), mask=qw.mask)
    with pytest.raises(PackingError, match="dense-nvfp4 stores no mask"):
        pack(sparse_dense)
    s = random_qw("s24-fp8", 2, 8, 9, 0.0, False, None)
    with pytest.raises(PackingError, match="must be 1.0"):
        pack(QuantizedWeight(s.format, s.codes, s.scales, torch.tensor(2.0), s.mask))


@pytest.mark.parametrize("fmt,layout,mult", CASES)
def test_packed_tensors_do_not_alias_the_weight(fmt, layout, mult):
    qw = random_qw(fmt, 2, mult, 11, 0.0, False, None)
    inputs = {qw.codes.untyped_storage().data_ptr(), qw.scales.untyped_storage().data_ptr(),
              qw.global_scale.untyped_storage().data_ptr(), qw.mask.untyped_storage().data_ptr()}
    for k, t in pack(qw, layout).items():
        assert t.untyped_storage().data_ptr() not in inputs, k
