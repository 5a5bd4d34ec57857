"""Stage artifacts: a block's experts stored packed by the format's packer, loaded back bit-identical for every
format and method; a stage's bytes against the packed checkpoint's expert bytes; work dirs an older moesq wrote
(unpacked artifacts) are recomputed or refused, never misread."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moesq_core.compression.engine import (
    StageSpec,
    StateStore,
    capture_layer_inputs,
    gather_experts,
    load_block,
    run_stage,
    save_block,
)
from moesq_core.compression.methods.base import PROJECTIONS, ExpertData
from moesq_core.compression.methods.refine import RefineConfig, RefineMethod
from moesq_core.compression.methods.registry import get_method
from moesq_core.compression.methods.rtn import RTN
from moesq_core.compression.workdir import LAYOUT, StaleStageError, WorkDir, model_fingerprint, sha256_file
from moesq_core.formats import get_format

FORMATS = ("p48-nvfp4", "dense-nvfp4", "s24-fp8")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def block0_experts(micro_calibrated):
    """Block 0's experts with their routed training and validation tokens; expert 3 gets no tokens (the
    methods' fallback path)."""
    model, adapter, path, calib = micro_calibrated
    block = adapter.blocks(model)[0]
    stores, kw = {}, {}
    for split in ("train", "val"):
        stores[split] = StateStore(1 << 30, None)
        kw.update(capture_layer_inputs(model, calib[split], 4, stores[split]))
    train, val = (gather_experts(block, stores[s], kw) for s in ("train", "val"))
    experts = []
    for e in range(block.num_experts):
        w = block.expert_weights(e)
        experts.append(ExpertData(e, w["gate"].float(), w["up"].float(), w["down"].float(), *train.rows(e),
                                  *val.rows(e)))
    experts[3].x, experts[3].w = experts[3].x[:0], experts[3].w[:0]
    return experts


def _method(name: str):
    if name == "refine":
        return RefineMethod(get_method("sgptq"), RefineConfig(epochs=1, steps_per_epoch=2))
    return get_method(name)


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("method", ["magnitude", "sgptq", "refine"])
def test_block_round_trip_is_bit_identical(block0_experts, fmt_name, method, tmp_path):
    results = _method(method).compress_block(block0_experts, get_format(fmt_name))
    amax_in, amax_mid = torch.rand(len(results)), torch.rand(len(results))
    path = tmp_path / "block_000.safetensors"
    save_block(path, results, amax_in, amax_mid)
    back, a_in, a_mid = load_block(path)
    assert torch.equal(a_in, amax_in) and torch.equal(a_mid, amax_mid)
    for r, b in zip(results, back, strict=True):
        assert b.info == json.loads(json.dumps(r.info, default=float)) and b.latent is None
        for p in PROJECTIONS:
            want, got = r.weights()[p], b.weights()[p]
            assert got.format == fmt_name
            assert got.codes.dtype == torch.uint8 and torch.equal(got.codes, want.codes), p
            assert got.scales.dtype == torch.float32 and torch.equal(got.scales, want.scales.float()), p
            assert got.global_scale.shape == (), p
            assert torch.equal(got.global_scale, want.global_scale.float().reshape(())), p
            assert got.mask.dtype == torch.bool and torch.equal(got.mask, want.mask.bool()), p
    # stored packed: the format's packed tensors, [E, ...] per projection, and no latent values
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert not any("latent" in k or k.endswith(".codes") or k.endswith(".mask") for k in keys)
    assert {k.split(".")[0] for k in keys} == {"act_amax_in", "act_amax_mid", *PROJECTIONS}
    # byte-deterministic: resume compares checksums
    again = tmp_path / "again.safetensors"
    save_block(again, results, amax_in, amax_mid)
    assert again.read_bytes() == path.read_bytes()


def _new_wd(root: Path, path: Path, fmt: str = "p48-nvfp4") -> WorkDir:
    wd = WorkDir(root)
    wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)},
            {"format": fmt, "act_quant": True})
    return wd


def _rtn_spec(fmt: str) -> StageSpec:
    return StageSpec("init-rtn", get_format(fmt), lambda li: RTN(), {"method": "rtn"}, batch_size=4)


def _checksums(wd: WorkDir, stage: str) -> dict:
    return {k: v["sha256"] for k, v in wd.stage(stage)["blocks"].items()}


def test_stage_bytes_are_within_a_tenth_of_the_packed_experts(packs):
    """A stage's block files (headers, activation ranges, per-expert info included) against the expert tensors
    of the packed checkpoint made from it, for every format."""
    for fmt_name, (wd, packed, summary) in packs.items():
        stage_bytes = sum(f.stat().st_size for f in (wd.root / "stages" / "init-rtn").glob("*.safetensors"))
        expert_bytes = 0
        for f in packed.glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                for k in sf.keys():
                    if ".mlp.experts." in k:
                        t = sf.get_tensor(k)
                        expert_bytes += t.numel() * t.element_size()
        assert expert_bytes >= summary["expert_bytes"] > 0
        assert stage_bytes <= 1.1 * expert_bytes, (fmt_name, stage_bytes, expert_bytes, stage_bytes / expert_bytes)


def _write_old_layout(path: Path, results, amax_in, amax_mid) -> None:
    """A block artifact as moesq wrote it before the packed layout: per expert and projection the
    QuantizedWeight's state dict (a code byte and a mask byte per weight) and an fp32 latent."""
    tensors = {"act_amax_in": amax_in.float(), "act_amax_mid": amax_mid.float()}
    for e, r in enumerate(results):
        for p, qw in r.weights().items():
            tensors.update({k: v.clone() for k, v in qw.state_dict(f"{e}.{p}.").items()})
            tensors[f"{e}.latent.{p}"] = qw.dequantize().float()
    meta = json.dumps({"format": results[0].gate.format, "num_experts": len(results),
                       "info": {str(e): r.info for e, r in enumerate(results)}}, sort_keys=True)
    save_file(tensors, str(path), metadata={"moesq": meta})


def test_older_layout_is_recomputed_never_misread(micro_calibrated, tmp_path):
    from moesq_core.compression.export import export_packed

    model, adapter, path, calib = micro_calibrated
    fresh = _new_wd(tmp_path / "fresh", path)
    run_stage(model, adapter, calib, _rtn_spec("p48-nvfp4"), fresh.ledger("init-rtn"))
    assert fresh.stage("init-rtn")["layout"] == LAYOUT == fresh.load()["layout"]

    # the same stage as an older moesq left it: unpacked artifacts, a stage record without a layout
    old = _new_wd(tmp_path / "old", path)
    run_stage(model, adapter, calib, _rtn_spec("p48-nvfp4"), old.ledger("init-rtn"))
    m = old.load()
    st = m["stages"]["init-rtn"]
    del st["layout"]
    for rec in st["blocks"].values():
        f = old.root / rec["file"]
        _write_old_layout(f, *load_block(f))
        rec["sha256"] = sha256_file(f)
    old.save(m)
    block1 = old.root / st["blocks"]["1"]["file"]
    with pytest.raises(StaleStageError, match="older moesq.*layout 1.*re-run"):
        old.ledger("init-rtn").verified_block(1)
    with pytest.raises(StaleStageError, match="layout 1"):
        load_block(block1)  # the file alone is refused too
    with pytest.raises(StaleStageError, match="older moesq"):
        export_packed(old, "init-rtn", tmp_path / "packed")
    assert not (tmp_path / "packed").exists()
    # running the stage again recomputes it, to the bytes a fresh work dir gets
    assert run_stage(model, adapter, calib, _rtn_spec("p48-nvfp4"), old.ledger("init-rtn"))["computed_now"] == 4
    assert _checksums(old, "init-rtn") == _checksums(fresh, "init-rtn")
    assert old.stage("init-rtn")["layout"] == LAYOUT


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_block_work_on_the_gpu_gives_the_cpu_bytes(block0_experts, fmt_name, tmp_path):
    """The engine packs blocks, computes activation ranges and dequantizes installed experts where the model
    is: on a GPU the artifact's bytes and the installed weights must equal the CPU's."""
    from moesq_core.compression.engine import expert_activation_amax
    from moesq_core.compression.methods.base import TokenRows, row_amax
    from moesq_core.serving.experts import MoesqExperts

    fmt = get_format(fmt_name)
    results = _method("sgptq").compress_block(block0_experts, fmt)
    amax_in, amax_mid = torch.rand(len(results)), torch.rand(len(results))
    save_block(tmp_path / "cpu.safetensors", results, amax_in, amax_mid)
    save_block(tmp_path / "gpu.safetensors", results, amax_in, amax_mid, device="cuda")
    assert (tmp_path / "gpu.safetensors").read_bytes() == (tmp_path / "cpu.safetensors").read_bytes()
    ref = MoesqExperts.from_quantized(fmt, [r.weights() for r in results], True, amax_in, amax_mid)
    gpu = MoesqExperts.from_quantized(fmt, [{p: w.to("cuda") for p, w in r.weights().items()} for r in results],
                                      True, amax_in, amax_mid)
    assert torch.equal(gpu.gate_up_proj.cpu(), ref.gate_up_proj) and torch.equal(gpu.down_proj.cpu(), ref.down_proj)
    for r, ex in zip(results, block0_experts):
        if len(ex.x) == 0:
            continue
        cpu_in, cpu_mid = expert_activation_amax(fmt, r, ex.x, True)
        gpu_in, gpu_mid = expert_activation_amax(fmt, _on_device(r, "cuda"), ex.x.cuda(), True)
        assert gpu_in == cpu_in
        assert gpu_mid == pytest.approx(float(cpu_mid), rel=1e-5)  # a matmul: accumulation order may differ
        # the engine's way: rows of a token matrix on the GPU, gathered and input-quantized in one kernel
        rows = TokenRows(ex.x.cuda(), torch.arange(len(ex.x), device="cuda"))
        tok_in, tok_mid = expert_activation_amax(fmt, _on_device(r, "cuda"), rows, True,
                                                 token_amax=row_amax(rows.tokens))
        assert tok_in == cpu_in
        assert tok_mid == pytest.approx(float(cpu_mid), rel=1e-5)


def _on_device(r, device):
    from moesq_core.compression.methods.base import CompressedExpert

    return CompressedExpert(*(qw.to(device) for qw in (r.gate, r.up, r.down)), info=r.info)
