"""verify_packed_dir on small packed directories built here with the real quantizers and packers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moesq_core.checkpoint.checksums import write_manifest
from moesq_core.checkpoint.verify import VerifyReport, verify_packed_dir
from moesq_core.compression.export import quantization_config
from moesq_core.formats import get_format
from moesq_core.formats.packing import pack

H, INTER, E, LAYERS = 64, 32, 2, 2  # hidden, expert intermediate, experts per layer, layers


def expert_tensors(fmt_name: str, layout: str | None, seed: int) -> dict[str, torch.Tensor]:
    """Packed tensors of all routed experts, named like a transformers checkpoint."""
    fmt = get_format(fmt_name)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        for e in range(E):
            gate, up = torch.randn(INTER, H, generator=gen), torch.randn(INTER, H, generator=gen)
            down = torch.randn(H, INTER, generator=gen)
            g = fmt.global_scale(gate, up)  # gate and up share one global scale
            qws = {"gate_proj": fmt.quantize(gate, global_scale=g), "up_proj": fmt.quantize(up, global_scale=g),
                   "down_proj": fmt.quantize(down)}
            for proj, qw in qws.items():
                base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                for suffix, t in pack(qw, layout).items():
                    out[f"{base}.{suffix}"] = t
                if fmt_name != "s24-fp8":
                    out[f"{base}.input_global_scale"] = torch.tensor([3.5])
    return out


def build_dir(root: Path, fmt_name: str = "p48-nvfp4", layout: str | None = None, shards: int = 1) -> Path:
    tensors = expert_tensors(fmt_name, layout, seed=0)
    tensors["model.embed_tokens.weight"] = torch.randn(10, H).bfloat16()
    for layer in range(LAYERS):
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(E, H).bfloat16()
    # the config moesq pack writes; the checksum manifest is rewritten after every edit (seal): these dirs test
    # the structural checks
    qc = quantization_config(fmt_name, ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"], True, layout is None)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": qc}))
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
        return seal(root)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}  # interleaved: a linear's tensors span shards
        save_file(part, str(root / fname))
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return seal(root)


def seal(root: Path) -> Path:
    """Record the directory as it is now in its checksum manifest, as if `moesq pack` had written it so."""
    (root / "moesq_pack.json").unlink(missing_ok=True)
    write_manifest(root, {})
    return root


def rewrite(root: Path, name: str, fn) -> None:
    """Apply fn to one stored tensor and write its file back."""
    from safetensors.torch import load_file

    index = root / "model.safetensors.index.json"
    fname = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    tensors = load_file(str(root / fname))
    tensors[name] = fn(tensors[name].clone())
    save_file(tensors, str(root / fname))
    seal(root)


@pytest.mark.parametrize("fmt,layout,bits", [
    ("p48-nvfp4", None, 2.75), ("p48-nvfp4", "dense-p48", 4.25), ("dense-nvfp4", None, 4.5), ("s24-fp8", None, 5.0),
])
def test_good_dir_passes(tmp_path, fmt, layout, bits):
    calls = []
    report = verify_packed_dir(build_dir(tmp_path, fmt, layout),
                               progress=lambda done, total: calls.append((done, total)))
    assert isinstance(report, VerifyReport)
    assert report.ok, report.first_error
    assert report.first_error is None and report.format == fmt
    assert len(report.rows) == LAYERS * E * 3
    assert calls[-1] == (LAYERS * E * 3, LAYERS * E * 3)
    row = report.rows[0]
    assert row.name == "model.layers.0.mlp.experts.0.gate_proj" and row.shape == (INTER, H) and row.status == "ok"
    assert row.format == (layout or fmt)
    # Stored bits/weight: the format's figure plus the per-matrix global scale or per-row scales.
    extra = 32 / (INTER * H) if fmt != "s24-fp8" else 32 / H
    assert row.bits_per_weight == pytest.approx(bits + extra, abs=1e-12)
    assert {r.shape for r in report.rows} == {(INTER, H), (H, INTER)}


def test_sharded_good_dir_passes(tmp_path):
    root = build_dir(tmp_path, shards=3)
    report = verify_packed_dir(root)
    assert report.ok, report.first_error
    assert len(report.files) == 3 and len(report.rows) == LAYERS * E * 3


def test_flipped_mask_bit_is_caught_with_position(tmp_path):
    root = build_dir(tmp_path)
    name = "model.layers.1.mlp.experts.1.up_proj.weight_sparse_mask"

    def flip(m):
        m[5, 1] ^= 0x10  # one bit of the high nibble: 2 set bits become 1 or 3
        return m

    rewrite(root, name, flip)
    report = verify_packed_dir(root)
    assert not report.ok
    err = report.first_error
    assert err.tensor == name and err.position == (5, 1)
    assert "high nibble" in err.problem and "needs exactly 2" in err.problem
    bad = [r for r in report.rows if not r.ok]
    assert [r.name for r in bad] == ["model.layers.1.mlp.experts.1.up_proj"]
    assert name in bad[0].status


@pytest.mark.parametrize("value", [float("nan"), 0.0])
def test_bad_block_scale_is_caught(tmp_path, value):
    root = build_dir(tmp_path)
    name = "model.layers.0.mlp.experts.1.gate_proj.weight_scale"

    def spoil(s):
        s = s.float()
        s[7, 1] = value
        return s.to(torch.float8_e4m3fn)

    rewrite(root, name, spoil)
    report = verify_packed_dir(root)
    assert not report.ok
    assert report.first_error.tensor == name and report.first_error.position == (7, 1)
    assert "finite and > 0" in report.first_error.problem


def test_bad_s24_row_scale_and_nan_value_are_caught(tmp_path):
    root = build_dir(tmp_path, "s24-fp8")
    base = "model.layers.0.mlp.experts.0.gate_proj"

    def nan_value(v):
        v.view(torch.uint8)[3, 4] = 0x7F
        return v

    rewrite(root, f"{base}.weight_sparse_values", nan_value)
    rewrite(root, "model.layers.1.mlp.experts.0.down_proj.weight_scale",
            lambda s: s.index_fill_(0, torch.tensor([2]), -1.0))
    report = verify_packed_dir(root)
    assert [(e.tensor, e.position) for e in report.errors] == [
        (f"{base}.weight_sparse_values", (3, 4)),
        ("model.layers.1.mlp.experts.0.down_proj.weight_scale", (2, 0)),
    ]
    assert "NaN" in report.errors[0].problem


def test_gate_up_global_scale_mismatch_is_caught(tmp_path):
    root = build_dir(tmp_path)
    name = "model.layers.1.mlp.experts.0.up_proj.weight_global_scale"
    rewrite(root, name, lambda g: g * 2)
    report = verify_packed_dir(root)
    assert not report.ok
    assert report.first_error.tensor == name
    assert "differs from gate_proj" in report.first_error.problem


def test_global_scale_nan_is_caught(tmp_path):
    root = build_dir(tmp_path, "dense-nvfp4", shards=2)
    rewrite(root, "model.layers.0.mlp.experts.0.down_proj.weight_global_scale", lambda g: g * float("nan"))
    report = verify_packed_dir(root)
    assert report.first_error.tensor == "model.layers.0.mlp.experts.0.down_proj.weight_global_scale"
    assert report.first_error.position == (0,)
    assert "weight global scale is nan" in report.first_error.problem


def test_missing_or_bad_input_scale_is_caught(tmp_path):
    from safetensors.torch import load_file

    root = build_dir(tmp_path)
    f = str(root / "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.experts.1.down_proj.input_global_scale"]
    tensors["model.layers.0.mlp.experts.1.up_proj.input_global_scale"] = torch.tensor([-1.0])
    tensors["model.layers.1.mlp.experts.0.gate_proj.input_global_scale"] = torch.tensor([0.0])  # 1/0 when served
    tensors["model.layers.1.mlp.experts.0.up_proj.input_global_scale"] = torch.tensor([float("inf")])
    save_file(tensors, f)
    seal(root)
    report = verify_packed_dir(root)
    assert [str(e) for e in report.errors] == [
        "model.layers.0.mlp.experts.1.up_proj.input_global_scale[0]: "
        "input global scale is -1.0, must be finite and > 0",
        "model.layers.1.mlp.experts.0.gate_proj.input_global_scale[0]: "
        "input global scale is 0.0, must be finite and > 0",
        "model.layers.1.mlp.experts.0.up_proj.input_global_scale[0]: input global scale is inf, must be finite and > 0",
        "model.layers.1.mlp.experts.1.down_proj.input_global_scale: missing (NVFP4 activations need it)",
    ]


def test_progress_object_protocol(tmp_path):
    """The moesq_core.progress protocol: progress.task(description, total) yields an object with advance()."""
    from contextlib import contextmanager

    class Recorder:
        def __init__(self):
            self.log = []

        @contextmanager
        def task(self, description, total):
            self.log.append(("start", total))
            rec = self

            class T:
                def advance(self, n=1):
                    rec.log.append(("advance", n))

            yield T()
            self.log.append(("end", total))

    rec = Recorder()
    assert verify_packed_dir(build_dir(tmp_path), progress=rec).ok
    n = LAYERS * E * 3
    assert rec.log == [("start", n)] + [("advance", 1)] * n + [("end", n)]


def test_truncated_shard_is_caught_naming_the_file(tmp_path):
    root = build_dir(tmp_path, shards=2)
    shard = root / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    seal(root)
    report = verify_packed_dir(root)
    assert not report.ok
    assert report.first_error.tensor == "model-00002-of-00002.safetensors"
    assert "truncated" in report.first_error.problem
    # Every expert linear has a tensor in the truncated shard (tensors are interleaved), so all rows fail.
    assert report.rows and all("model-00002-of-00002.safetensors" in r.status for r in report.rows)


def test_truncated_single_file_is_caught(tmp_path):
    root = build_dir(tmp_path)
    f = root / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    seal(root)
    report = verify_packed_dir(root)
    assert report.first_error.tensor == "model.safetensors" and not report.rows


def test_config_problems_are_caught(tmp_path):
    root = build_dir(tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    del cfg["quantization_config"]["paired48_sparse"]
    (root / "config.json").write_text(json.dumps(cfg))
    seal(root)
    report = verify_packed_dir(root)
    assert report.first_error.tensor == "config.json" and "paired48_sparse" in report.first_error.problem

    cfg["quantization_config"]["moesq"]["format"] = "int4"
    (root / "config.json").write_text(json.dumps(cfg))
    seal(root)
    assert "moesq.format is 'int4'" in verify_packed_dir(root).first_error.problem
    (root / "config.json").unlink()
    seal(root)
    assert verify_packed_dir(root).first_error.problem.startswith("missing")


def test_missing_shard_is_caught(tmp_path):
    root = build_dir(tmp_path, shards=2)
    index = root / "model.safetensors.index.json"
    wm = json.loads(index.read_text())
    wm["weight_map"]["model.layers.0.mlp.experts.0.gate_proj.weight_sparse_packed"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(wm))
    seal(root)
    report = verify_packed_dir(root)
    assert report.first_error.tensor == "model-00009-of-00009.safetensors"
    assert "does not exist" in report.first_error.problem


def test_missing_projection_is_caught(tmp_path):
    root = build_dir(tmp_path, "dense-nvfp4")
    from safetensors.torch import load_file

    tensors = load_file(str(root / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if ".experts.1.down_proj." not in k or ".layers.0." not in k}
    save_file(tensors, str(root / "model.safetensors"))
    seal(root)
    report = verify_packed_dir(root)
    assert [str(e) for e in report.errors] == ["model.layers.0.mlp.experts.1: expert has no down_proj"]


def test_dense_p48_config_must_name_its_format(tmp_path):
    """A dense-layout p48 pack whose config says plain `nvfp4-pack-quantized` (as packs of earlier versions did)
    would load wrongly in stock transformers: verify names it."""
    root = build_dir(tmp_path, "p48-nvfp4", "dense-p48")
    config = json.loads((root / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["format"] == qc["config_groups"]["group_0"]["format"] == "moesq-dense-p48"
    qc["format"], qc["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized", None
    (root / "config.json").write_text(json.dumps(config))
    report = verify_packed_dir(seal(root))
    assert not report.ok and "stock loaders would read them as plain NVFP4" in str(report.first_error)


@pytest.mark.parametrize("entry", ["file", "bytes", "tensors", "tensor digest", "summary"])
def test_a_manifest_entry_of_the_wrong_json_type_is_refused_by_verify_and_the_loaders(tmp_path, entry):
    """A manifest whose own checksum holds (re-signed by hand) but with an entry of another JSON type: verify
    and the loaders' check say which entry, one line, instead of crashing or passing."""
    import hashlib

    from moesq_core.checkpoint.checksums import ManifestCheck, canonical

    root = build_dir(tmp_path)
    body = json.loads((root / "moesq_pack.json").read_text())
    body.pop("manifest_sha256")
    weights = body["files"]["model.safetensors"]
    if entry == "file":
        body["files"]["config.json"] = "x"
    elif entry == "bytes":
        weights["bytes"] = str(weights["bytes"])
    elif entry == "tensors":
        weights["tensors"] = list(weights["tensors"].values())
    elif entry == "tensor digest":
        weights["tensors"] = {name: 5 for name in weights["tensors"]}
    else:
        body["summary"] = "x"
    body["manifest_sha256"] = hashlib.sha256(canonical(body)).hexdigest()
    (root / "moesq_pack.json").write_bytes(canonical(body))
    report = verify_packed_dir(root)
    assert not report.ok and "checksum manifest is damaged" in str(report.first_error), report.first_error
    assert "expected" in str(report.first_error)
    with pytest.raises(ValueError, match="checksum manifest is damaged: .* expected"):
        ManifestCheck(root)
