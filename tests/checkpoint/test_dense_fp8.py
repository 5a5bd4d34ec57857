"""dense-fp8 end to end: bit-exact packing (property-tested), the compressed-tensors config and decompressor,
load_packed equal to the work dir's fake-quantized model, and the stage commands on the embedded model."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moesq_core.formats import QuantizedWeight, get_format
from moesq_core.formats.packing import PackingError, bits_per_weight, pack, unpack

from conftest import EVAL, packed_expert_linears
from moesq_runner import SMALL, moesq_here

FMT = "dense-fp8"


def random_qw(out: int, inn: int, seed: int, zero_frac: float, stack: int | None) -> QuantizedWeight:
    fmt = get_format(FMT)
    gen = torch.Generator().manual_seed(seed)
    qws = []
    for _ in range(stack or 1):
        w = torch.randn(out, inn, generator=gen) * torch.exp(2 * torch.randn(out, 1, generator=gen))
        qws.append(fmt.quantize(w * (torch.rand(out, inn, generator=gen) >= zero_frac)))
    if stack is None:
        return qws[0]
    fields = ("codes", "scales", "global_scale", "mask")
    return QuantizedWeight(FMT, *(torch.stack([getattr(q, f) for q in qws]) for f in fields))


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.5, 1.0]),
       st.sampled_from([None, 1, 3]))
def test_round_trip_is_bit_exact(out, inn, seed, zero_frac, stack):
    qw = random_qw(out, inn, seed, zero_frac, stack)
    t = pack(qw)
    lead = () if stack is None else (stack,)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "weight": (torch.float8_e4m3fn, (*lead, out, inn)), "weight_scale": (torch.float32, (*lead, out, 1))}
    back = unpack(FMT, t)
    for f in ("codes", "scales", "mask"):
        assert torch.equal(getattr(back, f), getattr(qw, f)), f
    assert torch.equal(back.global_scale.reshape(-1), qw.global_scale.reshape(-1).float())
    assert torch.equal(back.dequantize(), qw.dequantize())
    again = pack(back)
    assert all(torch.equal(raw(again[k]), raw(t[k])) for k in t)
    assert not bool(((back.codes & 0x7F) == 0x7F).any()), "NaN e4m3 code"
    assert bits_per_weight(t, (*lead, out, inn)) == pytest.approx(8 + 32 / inn)


def test_packing_refuses_what_it_cannot_store():
    qw = random_qw(4, 16, 0, 0.0, None)
    pruned = QuantizedWeight(FMT, qw.codes * 0, qw.scales, qw.global_scale, qw.mask.clone())
    pruned.mask[1, 3] = False
    with pytest.raises(PackingError, match="stores no mask"):
        pack(pruned)
    nan = QuantizedWeight(FMT, qw.codes.clone(), qw.scales, qw.global_scale, qw.mask)
    nan.codes[2, 5] = 0x7F
    with pytest.raises(PackingError, match=r"codes\[2, 5\]: e4m3 NaN code 0x7F"):
        pack(nan)
    with pytest.raises(PackingError, match="global scale"):
        pack(QuantizedWeight(FMT, qw.codes, qw.scales, torch.tensor(2.0), qw.mask))
    t = pack(qw)
    with pytest.raises(PackingError, match=r"layer\.weight_scale: dtype is torch.float16"):
        unpack(FMT, {**t, "weight_scale": t["weight_scale"].half()}, "layer")
    with pytest.raises(PackingError, match="missing"):
        unpack(FMT, {"weight": t["weight"]}, "layer")


@pytest.fixture(scope="module")
def fp8_pack(micro_path, tmp_path_factory):
    """(work dir, packed dir) of an init-rtn stage in dense-fp8 on the embedded model."""
    from moesq_core.compression.calibration import CalibConfig, build_calibration, read_documents
    from moesq_core.compression.engine import StageSpec, run_stage
    from moesq_core.compression.export import export_packed
    from moesq_core.compression.methods.rtn import RTN
    from moesq_core.compression.pipeline import DEFAULT_CALIB
    from moesq_core.compression.workdir import WorkDir, model_fingerprint
    from moesq_core.models import load_model

    root = tmp_path_factory.mktemp("fp8")
    model, tok, adapter, path = load_model(micro_path)
    calib = build_calibration(tok, read_documents(DEFAULT_CALIB, max_chars=200_000),
                              CalibConfig(seq_len=64, n_train=4, n_val=2, n_init=8))
    wd = WorkDir(root / "wd")
    wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)},
            {"format": FMT, "act_quant": True})
    run_stage(model, adapter, calib,
              StageSpec("init-rtn", get_format(FMT), lambda li: RTN(), {"method": "rtn"}, batch_size=4),
              wd.ledger("init-rtn"))
    out = root / "packed"
    export_packed(wd, "init-rtn", out)
    return wd, out


def test_config_validates_with_compressed_tensors(fp8_pack):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    qc = json.loads((fp8_pack[1] / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == "float-quantized" and parsed.quantization_status == QuantizationStatus.COMPRESSED
    w, a = parsed.config_groups["group_0"].weights, parsed.config_groups["group_0"].input_activations
    assert (w.num_bits, w.type, w.strategy, w.symmetric, w.dynamic) == (8, "float", "channel", True, False)
    assert (a.num_bits, a.type, a.strategy, a.dynamic) == (8, "float", "token", True)
    assert "lm_head" in parsed.ignore and "model.layers.0.mlp.gate" in parsed.ignore
    assert qc["moesq"]["format"] == FMT


@torch.no_grad()
def test_compressed_tensors_decompresses_exactly_what_load_packed_serves(fp8_pack):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    from moesq_core.serving.loader import load_packed

    out = fp8_pack[1]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    model, _ = load_packed(out)
    checked = 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.endswith("input_global_scale")]  # per-token activations: nothing stored
        for base, mine, sd in packed_expert_linears(model, f, ("weight", "weight_scale")):
            theirs = FloatQuantizationCompressor.decompress(sd, scheme)["weight"]
            assert torch.equal(theirs.float(), mine.float()), base
            checked += 1
    assert checked == 4 * 8 * 3


@torch.no_grad()
def test_load_packed_equals_the_work_dirs_fake_quantized_model(fp8_pack):
    from moesq_core.checkpoint.verify import verify_packed_dir
    from moesq_core.compression.engine import load_workdir_model
    from moesq_core.serving.loader import load_packed

    wd, out = fp8_pack
    report = verify_packed_dir(out)
    assert report.ok, report.first_error
    assert {r.format for r in report.rows} == {FMT}
    assert all(r.bits_per_weight == pytest.approx(8 + 32 / r.shape[1]) for r in report.rows)
    ids = torch.arange(3, 40).reshape(1, -1)
    packed = load_packed(out)[0](input_ids=ids).logits
    fake = load_workdir_model(wd.root, "init-rtn")[0](input_ids=ids).logits
    assert torch.equal(packed, fake)


def test_verify_catches_a_nan_weight(fp8_pack, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from moesq_core.checkpoint.verify import verify_packed_dir

    bad = tmp_path / "bad"
    shutil.copytree(fp8_pack[1], bad)
    shard = bad / "model.safetensors"
    sd = load_file(str(shard))
    key = "model.layers.2.mlp.experts.5.down_proj.weight"
    w = sd[key].view(torch.uint8).clone()
    w[3, 7] = 0xFF
    sd[key] = w.view(torch.float8_e4m3fn)
    save_file(sd, str(shard), metadata={"format": "pt"})
    report = verify_packed_dir(bad)
    assert report.first_error.tensor == key and "checksum mismatch" in report.first_error.problem
    nan = [e for e in report.errors if "NaN" in e.problem]
    assert [(e.tensor, e.position) for e in nan] == [(key, (3, 7))]


def test_stage_commands_end_to_end(micro_path, tmp_path):
    """gptq → refine → pack → verify → eval, as a user runs them; the packed model is the stage's model."""
    wd = tmp_path / "wd"
    moesq_here("init-sgptq", "--model", micro_path, "-w", wd, "--method", "gptq", "--format", FMT, *SMALL, "--quiet")
    moesq_here("refine", "-w", wd, "--init", "gptq", "--epochs", "1", "--steps-per-epoch", "2", "--quiet",
               "--device", "cpu")
    r = moesq_here("pack", wd, "--out", tmp_path / "packed", "--quiet")
    assert "8.194 bits/weight" in r.stdout  # 8 bits + a 32-bit scale per row (192 columns for gate/up, 128 for down)
    assert "verify: ok" in moesq_here("verify", tmp_path / "packed", "--quiet").stdout
    moesq_here("eval", wd, tmp_path / "packed", "--ppl", EVAL, "--ppl-tokens", "2048", "--json", tmp_path / "ppl.json",
               "--quiet")
    rows = {x["label"]: x["ppl"] for x in json.loads((tmp_path / "ppl.json").read_text())["ppl"]}
    assert set(rows) == {"reference", "gptq", "refine", "packed:packed"}, rows
    assert rows["refine"] == pytest.approx(rows["packed:packed"], rel=1e-5)
    for stage in ("gptq", "refine"):  # W8A8 stays close to the reference
        assert rows["reference"] < rows[stage] < 1.05 * rows["reference"], rows
