"""On a Hopper GPU: a packed micro model loads through the fast experts module of its format (p48-nvfp4: the
Triton p48 kernels; s24-fp8: the CUTLASS 2:4 kernels), its logits match the CPU reference module, and it
generates text; `AutoModelForCausalLM.from_pretrained` (after `import moesq_core`) serves the same modules."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]


def _pack_micro(micro_path, root, fmt_name):
    from moesq_core.compression.calibration import CalibConfig, build_calibration, read_documents
    from moesq_core.compression.engine import StageSpec, run_stage
    from moesq_core.compression.export import export_packed
    from moesq_core.compression.methods.rtn import RTN
    from moesq_core.compression.workdir import WorkDir, model_fingerprint
    from moesq_core.formats import get_format
    from moesq_core.models import load_model

    from conftest import CALIB

    model, tok, adapter, path = load_model(micro_path)
    text = CALIB
    calib = build_calibration(tok, read_documents(text, max_chars=300_000),
                              CalibConfig(seq_len=64, n_train=4, n_val=2, n_init=8))
    wd = WorkDir(root / "wd")
    wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)},
            {"format": fmt_name, "act_quant": True})
    run_stage(model, adapter, calib,
              StageSpec("init-rtn", get_format(fmt_name), lambda li: RTN(), {"method": "rtn"}, batch_size=4),
              wd.ledger("init-rtn"))
    export_packed(wd, "init-rtn", root / "packed")
    return root / "packed", tok


@pytest.fixture(scope="module")
def packed_micro(micro_path, tmp_path_factory):
    return _pack_micro(micro_path, tmp_path_factory.mktemp("gpu-packed"), "p48-nvfp4")


@pytest.fixture(scope="module")
def packed_micro_s24(micro_path, tmp_path_factory):
    return _pack_micro(micro_path, tmp_path_factory.mktemp("gpu-packed-s24"), "s24-fp8")


@pytest.mark.parametrize("act_quant", [False, True])
@torch.no_grad()
def test_fast_path_logits_and_generation(packed_micro, act_quant):
    from moesq_core.serving.loader import load_packed
    from moesq_core.serving.p48_hopper import P48HopperExperts

    path, tok = packed_micro
    ref, _ = load_packed(path, device="cpu", act_quant=act_quant)
    fast, tok2 = load_packed(path, device="cuda", dtype=torch.float32, act_quant=act_quant)
    assert isinstance(fast.model.layers[0].mlp.experts, P48HopperExperts)
    ids = tok("The scheduler picks the next task to run on each CPU", return_tensors="pt")["input_ids"]
    a = ref(input_ids=ids).logits
    b = fast(input_ids=ids.cuda()).logits.cpu()
    rel = (a - b).norm() / a.norm()
    assert rel < 2e-3, rel
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95
    out = fast.generate(ids.cuda(), max_new_tokens=24, do_sample=False)
    text = tok2.decode(out[0, ids.shape[1]:])
    assert len(out[0]) == ids.shape[1] + 24 and text.strip()
    print(f"act_quant={act_quant} rel={float(rel):.2e} generated: {text!r}")


@torch.no_grad()
def test_s24_fast_path_logits_and_generation(packed_micro_s24):
    from moesq_core.serving.loader import load_packed
    from moesq_core.serving.s24_hopper import S24HopperExperts

    path, tok = packed_micro_s24
    ref, _ = load_packed(path, device="cpu")  # MoesqExperts: fp32 GEMMs, fake-quantized e4m3 activations
    fast, tok2 = load_packed(path, device="cuda", dtype=torch.float32)
    assert isinstance(fast.model.layers[0].mlp.experts, S24HopperExperts)
    assert not fast.model.layers[0].mlp.experts.reference
    ids = tok("The scheduler picks the next task to run on each CPU", return_tensors="pt")["input_ids"]
    a = ref(input_ids=ids).logits
    b = fast(input_ids=ids.cuda()).logits.cpu()
    rel = (a - b).norm() / a.norm()
    # the kernel rounds its GEMM outputs to bf16, which moves some activations across e4m3 rounding boundaries
    assert rel < 5e-2, rel
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    out = fast.generate(ids.cuda(), max_new_tokens=24, do_sample=False)
    text = tok2.decode(out[0, ids.shape[1]:])
    assert len(out[0]) == ids.shape[1] + 24 and text.strip()
    print(f"s24 rel={float(rel):.2e} generated: {text!r}")


@pytest.mark.parametrize("fixture, fast_module",
                         [("packed_micro", "P48HopperExperts"), ("packed_micro_s24", "S24HopperExperts")])
@torch.no_grad()
def test_from_pretrained_serves_the_fast_experts_like_load_packed(request, fixture, fast_module):
    """`import moesq_core` + `AutoModelForCausalLM.from_pretrained(pack, device_map="cuda")`: the format's fast
    experts module, and exactly load_packed's logits (the same modules on the same weights and inputs)."""
    from transformers import AutoModelForCausalLM

    import moesq_core  # noqa: F401  (routes moesq packs through transformers' loader)
    from moesq_core.serving.loader import load_packed

    path, tok = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cuda")
    ref, _ = load_packed(path, device="cuda", dtype=torch.float32)
    for ours, theirs in zip(model.model.layers, ref.model.layers, strict=True):
        assert type(ours.mlp.experts).__name__ == fast_module and type(theirs.mlp.experts) is type(ours.mlp.experts)
        assert ours.mlp.experts.act_quant
    ids = tok("The scheduler picks the next task to run on each CPU", return_tensors="pt")["input_ids"].cuda()
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
