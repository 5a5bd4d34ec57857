"""Refinement's end-to-end step (RefineConfig.e2e_steps): the tunable experts compute what the exported
weights serve, the step lowers the validation KL against the reference model, and the stage it rewrites is
resumable: an interrupted run, and a --redo-from after it, end with the same bytes as one uninterrupted run."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from moesq_core.compression.methods.base import PROJECTIONS
from moesq_core.compression.methods.refine import RefineConfig
from moesq_core.compression.methods.refine.e2e import EndToEndTuner, TunableExperts
from moesq_core.formats import get_format
from moesq_core.serving.experts import MoesqExperts

from conftest import CALIB

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = {"calib_source": str(CALIB), "seq_len": 32, "n_train": 4, "n_val": 2, "n_init": 4}
# The runs whose end-to-end step must lower the validation KL train on 8 sequences: at 4 the step's six Lion steps
# raised it on the embedded sample (1.06 -> 1.12, in a clone without ../shared on 2026-12-04; the same code had passed
# there the day before), at 8 they lower it there (0.93 -> 0.85) and on ../shared's text.
RUN_TUNED = dict(RUN, n_train=8)
# The block loop on the training split alone: with these few calibration sequences, the default loop (training +
# one-shot sequences) leaves the end-to-end step nothing that validates better on the embedded sample (its passes
# then ship the block-wise result, as they should, but this test is about a step that helps).
RCFG = RefineConfig(epochs=1, steps_per_epoch=2, e2e_steps=6, e2e_lr=3e-3, e2e_batch_size=4, init_split_rows=False)


def _random_block(fmt, E=3, inter=64, H=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(E):
        shapes = (("gate", (inter, H)), ("up", (inter, H)), ("down", (H, inter)))
        w = {p: torch.randn(*s, generator=g) * 0.05 for p, s in shapes}
        gs = fmt.global_scale(w["gate"], w["up"])
        out.append({p: fmt.quantize(w[p], None, gs if p != "down" else None) for p in PROJECTIONS})
    return out


@pytest.mark.parametrize("act_quant", [True, False])
def test_tunable_experts_compute_what_the_export_serves(act_quant):
    fmt = get_format("p48-nvfp4")
    weights = _random_block(fmt)
    amax_in, amax_mid = torch.tensor([3.0, 2.5, 4.0]), torch.tensor([1.0, 0.5, 2.0])
    m = TunableExperts(fmt, weights, act_quant, amax_in, amax_mid)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 96, generator=g)
    idx = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(40)])
    wts = torch.rand(40, 2, generator=g)
    # the values move (as tuning moves them); the masks stay
    with torch.no_grad():
        for p in PROJECTIONS:
            m.V[p].add_(torch.randn(m.V[p].shape, generator=g) * 0.01)
    y = m(x, idx, wts)
    y.square().sum().backward()
    assert all(m.V[p].grad is not None and m.V[p].grad.abs().sum() > 0 for p in PROJECTIONS)
    exported = m.export([{} for _ in weights])
    for ce, w in zip(exported, weights):
        for p in PROJECTIONS:
            assert torch.equal(ce.weights()[p].mask, w[p].mask)  # the pattern is fixed
            assert torch.equal(ce.weights()[p].global_scale, w[p].global_scale)
    served = MoesqExperts.from_quantized(fmt, [ce.weights() for ce in exported], act_quant, amax_in, amax_mid)
    torch.testing.assert_close(served(x, idx, wts), y.detach(), rtol=0, atol=1e-6)
    # the batched path (the GPU's) trains the same: outputs and gradients within the matmuls' rounding
    grads = {p: m.V[p].grad.clone() for p in PROJECTIONS}
    m.zero_grad()
    m.batched = True
    yb = m(x, idx, wts)
    yb.square().sum().backward()
    torch.testing.assert_close(yb.detach(), y.detach(), rtol=1e-5, atol=1e-6)
    for p in PROJECTIONS:
        torch.testing.assert_close(m.V[p].grad, grads[p], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("act_quant", [True, False])
def test_frozen_experts_compute_what_serving_does_from_the_compressed_weights(act_quant):
    """A block outside the tuned window: the served module's outputs and input gradients, holding the compressed
    weights (under 0.6 of the dequantized copy's bytes) and no dequantized copy for the backward; its activation
    quantizers straight-through, like the tuned blocks', so the gradient flows through it to the window."""
    from moesq_core.compression.methods.refine.e2e import FrozenExperts

    fmt = get_format("p48-nvfp4")
    weights = _random_block(fmt)
    amax_in, amax_mid = torch.tensor([3.0, 2.5, 4.0]), torch.tensor([1.0, 0.5, 2.0])
    frozen = FrozenExperts(fmt, weights, act_quant, amax_in, amax_mid)
    served = MoesqExperts.from_quantized(fmt, weights, act_quant, amax_in, amax_mid)
    straight = MoesqExperts.from_quantized(fmt, weights, act_quant, amax_in, amax_mid)
    straight.ste = True  # what TunableExperts computes from the same weights
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(40)])
    wts = torch.rand(40, 2, generator=g)
    x = torch.randn(40, 96, generator=g)
    gate_up, down = served.stacked_linears()
    assert all(torch.equal(a, b) for a, b in zip(frozen.stacked_linears(), (gate_up, down)))
    for batched in (False, True):
        frozen.batched = served.batched = straight.batched = batched
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        ys = [m(xi, idx, wts) for m, xi in zip((frozen, straight), xs)]
        assert torch.equal(ys[0].detach(), ys[1].detach())
        torch.testing.assert_close(ys[0].detach(), served(x, idx, wts), rtol=0, atol=1e-6)
        for y in ys:
            y.square().sum().backward()
        assert torch.equal(xs[0].grad, xs[1].grad) and xs[0].grad.abs().sum() > 0
    held = sum(b.numel() * b.element_size() for n, b in frozen.named_buffers() if not n.startswith("act_"))
    assert held < 0.6 * (gate_up.numel() + down.numel()) * 4 and frozen._w is None


def _artifacts(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "stages").rglob("*.safetensors"))}


def _refine(wd, micro_path, **kw):
    from moesq_core.compression.pipeline import run_refine

    return run_refine(wd, RCFG, micro_path, RUN_TUNED, device="cpu", batch_size=4, **kw)


@pytest.fixture(scope="module")
def tuned(micro_path, tmp_path_factory):
    """A work dir whose refine stage ran with the end-to-end step, uninterrupted."""
    wd = tmp_path_factory.mktemp("e2e") / "wd"
    _refine(wd, micro_path)
    return wd


def test_end_to_end_lowers_the_validation_kl(tuned):
    from moesq_core.compression.workdir import WorkDir

    st = WorkDir(tuned).stage("refine")
    rec = st["e2e"]
    assert st["done"] and rec["steps"] == RCFG.e2e_steps
    assert rec["best_pass"] > 0 and min(rec["val_kl"][1:]) < rec["val_kl"][0]
    assert rec["val_kl"][rec["best_pass"]] == min(rec["val_kl"])
    # the stage's blocks are the tuned ones; the block-wise ones are kept for --redo-from
    assert all(b["file"].endswith(".e2e.safetensors") for b in st["blocks"].values())
    assert all(not b["file"].endswith(".e2e.safetensors") for b in st["blockwise"].values())
    # the patterns stay the block-wise result's
    from moesq_core.compression.engine import load_block

    for li, rec in st["blocks"].items():
        tuned_experts = load_block(tuned / rec["file"])[0]
        blockwise = load_block(tuned / st["blockwise"][li]["file"])[0]
        for a, b in zip(tuned_experts, blockwise):
            for p in PROJECTIONS:
                assert torch.equal(a.weights()[p].mask, b.weights()[p].mask)
        assert any(not torch.equal(a.weights()[p].codes, b.weights()[p].codes)
                   for a, b in zip(tuned_experts, blockwise) for p in PROJECTIONS)


def test_fisher_matrix_is_the_averaged_softmax_fisher_and_its_loss_the_kl_to_second_order(micro_path):
    from moesq_core.models import load_model

    model, tok, _, _ = load_model(micro_path)
    tuner = EndToEndTuner(model, {}, get_format("p48-nvfp4"), True, RefineConfig(), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 48), generator=g)
    with torch.no_grad():
        ref_h = model.model(input_ids=tokens).last_hidden_state.float()
    M = tuner._fisher(ref_h, chunk=40)  # every token (96 < 8192), in chunks that do not divide them
    with torch.no_grad():
        W = model.lm_head.weight.float()
        flat = ref_h.reshape(-1, ref_h.shape[-1])
        P = torch.softmax(flat @ W.T, -1)
        # per token Wᵀ (diag(p) − p pᵀ) W, in float64
        W64 = W.double()
        naive = sum((W64.T * p) @ W64 - torch.outer(W64.T @ p, W64.T @ p) for p in P.double()) / len(P)
        torch.testing.assert_close(M.double(), naive, rtol=1e-3, atol=1e-6)
        # hidden-state errors d, small: the mean KL over the tokens is ½ mean dᵀ F_t d, and M averages F_t over
        # the tokens (equal in expectation for d independent of the token: here random)
        d = torch.randn(flat.shape, generator=g) * 1e-2
        logp = torch.log_softmax((flat + d) @ W.T, -1)
        kl = torch.nn.functional.kl_div(logp, torch.log(P), log_target=True, reduction="batchmean")
        second_order = 0.5 * ((d @ M) * d).sum(-1).mean()
    assert abs(float(second_order) / float(kl) - 1) < 0.15


def test_end_to_end_on_the_second_order_loss_lowers_the_validation_kl(micro_path, tmp_path):
    import dataclasses

    from moesq_core.compression.pipeline import run_refine
    from moesq_core.compression.workdir import WorkDir

    rcfg = dataclasses.replace(RCFG, e2e_loss="fisher")
    run_refine(tmp_path / "wd", rcfg, micro_path, RUN_TUNED, device="cpu", batch_size=4)
    st = WorkDir(tmp_path / "wd").stage("refine")
    rec = st["e2e"]
    assert st["config"]["refine"]["e2e_loss"] == "fisher"  # part of the stage's identity (the KL, the default, is not)
    assert rec["best_pass"] > 0 and min(rec["val_kl"][1:]) < rec["val_kl"][0]


def test_interrupted_end_to_end_resumes_to_the_same_bytes_and_redo_from_restores_the_prefix(
        tuned, micro_path, tmp_path, monkeypatch):
    from moesq_core.compression.workdir import WorkDir

    wd = tmp_path / "wd"

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(EndToEndTuner, "_train", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _refine(wd, micro_path)
    st = WorkDir(wd).stage("refine")
    assert not st["done"] and "e2e" not in st and len(st["blocks"]) == 4  # the block-wise stage as it was
    assert not any(p.name.endswith(".e2e.safetensors") for p in (wd / "stages").rglob("*"))
    summary = _refine(wd, micro_path)
    assert summary["computed_now"] == 0  # the blocks were loaded, only the end-to-end step ran again
    assert _artifacts(wd) == _artifacts(tuned)
    assert WorkDir(wd).stage("refine")["blocks"] == WorkDir(tuned).stage("refine")["blocks"]

    # --redo-from on a tuned stage: the block-wise prefix comes back, the rest and the end-to-end step rerun
    summary = _refine(wd, micro_path, redo_from=3)
    assert summary["computed_now"] == 1
    assert _artifacts(wd) == _artifacts(tuned)
    assert WorkDir(wd).stage("refine")["blocks"] == WorkDir(tuned).stage("refine")["blocks"]


def test_bad_end_to_end_options_are_refused():
    for kw, name in (({"e2e_steps": -1}, "e2e_steps"), ({"e2e_lr": 0.0}, "e2e_lr"),
                     ({"e2e_batch_size": 0}, "e2e_batch_size"), ({"e2e_loss": "mse"}, "e2e_loss"),
                     ({"e2e_optimizer": "sgd"}, "e2e_optimizer")):
        with pytest.raises(ValueError, match=name):
            RefineConfig(**kw)


def test_e2e_recipe_is_micro_quick_with_the_end_to_end_step():
    from moesq_core import CompressConfig

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    quick = CompressConfig.from_file(recipes / "micro-quick.yaml").to_dict()
    e2e = CompressConfig.from_file(recipes / "micro-quick-e2e.yaml").to_dict()
    assert e2e["refine"]["e2e_steps"] > 0
    assert {k: v for k, v in e2e.items() if k != "refine"} == {k: v for k, v in quick.items() if k != "refine"}
    plain = lambda c: {k: v for k, v in c["refine"].items() if not k.startswith("e2e_")}  # noqa: E731
    assert plain(e2e) == plain(quick)  # the same block-wise refinement


def test_stage_identity_without_the_end_to_end_step_is_unchanged():
    from moesq_core.compression.config import MethodConfig, refine_identity

    plain = refine_identity(RefineConfig(e2e_steps=0, e2e_lr=5e-4), MethodConfig("rtn"))["refine"]
    assert not any(k.startswith("e2e_") for k in plain)  # a stage recorded before the e2e options matches
    ident = refine_identity(RCFG, MethodConfig("rtn"))["refine"]
    assert ident["e2e_steps"] == RCFG.e2e_steps
    # stages from before them: the KL, the device's memory
    assert "e2e_loss" not in ident and "e2e_memory_gb" not in ident and "e2e_optimizer" not in ident  # nor Adam
    assert refine_identity(RefineConfig(e2e_optimizer="lion"), MethodConfig("rtn"))["refine"]["e2e_optimizer"] == "lion"
    assert refine_identity(RefineConfig(), MethodConfig("rtn"))["refine"]["e2e_steps"] == "auto"
    assert refine_identity(RefineConfig(e2e_memory_gb=2.0), MethodConfig("rtn"))["refine"]["e2e_memory_gb"] == 2.0


@pytest.mark.parametrize("with_init_split", [True, False])
def test_block_loop_routes_the_one_shot_split_when_asked(micro_path, tmp_path, with_init_split):
    """init_split_rows (the default): the in-loop init and block-wise training see the training and the one-shot
    sequences' routed rows (every token reaches top-k experts); off, the training split's alone. The option is
    part of the stage identity only when on (stages recorded before it existed ran with it off)."""
    from moesq_core.compression.config import MethodConfig, refine_identity
    from moesq_core.compression.engine import load_block
    from moesq_core.compression.pipeline import run_refine
    from moesq_core.compression.workdir import WorkDir

    rcfg = RefineConfig(epochs=1, steps_per_epoch=2, init_split_rows=with_init_split)
    assert RefineConfig().init_split_rows
    run_refine(tmp_path / "wd", rcfg, micro_path, RUN, device="cpu", batch_size=4)
    st = WorkDir(tmp_path / "wd").stage("refine")
    top_k = 2  # the micro model's experts per token
    seqs = RUN["n_train"] + (RUN["n_init"] if with_init_split else 0)
    for rec in st["blocks"].values():
        info = [ce.info["refine"] for ce in load_block(tmp_path / "wd" / rec["file"])[0]]
        assert sum(i["n_train"] for i in info) == seqs * RUN["seq_len"] * top_k
        assert sum(i["n_val"] for i in info) == RUN["n_val"] * RUN["seq_len"] * top_k  # held out either way
    assert ("init_split_rows" in st["config"]["refine"]) == with_init_split
    assert st["config"] == refine_identity(rcfg, MethodConfig("sgptq"))


def test_auto_length_is_two_passes_over_the_calibration_capped():
    from moesq_core.compression.methods.refine.trainer import E2E_AUTO_MAX_STEPS

    auto = RefineConfig()
    assert auto.e2e_steps == "auto" and auto.e2e_batch_size == 4
    assert auto.e2e_steps_for(128) == 64  # moesq run's 64 training + 64 one-shot sequences
    assert auto.e2e_steps_for(9) == 6  # ⌈9 / 4⌉ steps per pass
    assert auto.e2e_steps_for(768) == E2E_AUTO_MAX_STEPS == 256
    assert RefineConfig(e2e_steps=10).e2e_steps_for(768) == 10
    assert RefineConfig(e2e_steps=0).e2e_steps_for(768) == 0
    for bad in ("many", True, 2.5):
        with pytest.raises(ValueError, match="e2e_steps"):
            RefineConfig(e2e_steps=bad)
    with pytest.raises(ValueError, match="e2e_memory_gb"):
        RefineConfig(e2e_memory_gb=0)


def test_memory_estimate_counts_every_expert_weight_and_refuses_a_qwen3_30b_on_one_gpu(micro_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from moesq_core.compression.methods.refine.e2e import STATE_BYTES_PER_WEIGHT, memory_need_bytes
    from moesq_core.models import load_model
    from moesq_core.models.adapter import adapter_for

    model, _, adapter, _ = load_model(micro_path, lazy=True)
    c = model.config
    experts = c.num_hidden_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    need = memory_need_bytes(model, adapter, 4, 256)
    floor = experts * (4 + STATE_BYTES_PER_WEIGHT["adam"]) + 4 * 256 * 3 * c.vocab_size * 4  # + the batch's logits
    assert floor < need < 2 * floor
    # Qwen3-30B-A3B's shape (48 layers, 128 experts of 2048 x 768), built on the meta device: no memory
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                               num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, vocab_size=151936, intermediate_size=6144)
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    assert memory_need_bytes(big, adapter_for(big), 4, 512) > 600 * 2**30  # > 4 H200s


def test_auto_end_to_end_runs_where_it_fits_and_is_skipped_with_a_reason_where_not(micro_path, tmp_path, caplog):
    from moesq_core.compression.pipeline import run_refine
    from moesq_core.compression.workdir import WorkDir

    from test_block_loop import Recorder

    seqs = RUN["n_train"] + RUN["n_init"]
    fits = Recorder()
    run_refine(tmp_path / "fits", RefineConfig(epochs=1, steps_per_epoch=2), micro_path, RUN, device="cpu",
               batch_size=4, progress=fits)
    st = WorkDir(tmp_path / "fits").stage("refine")
    assert st["e2e"]["steps"] == RefineConfig().e2e_steps_for(seqs) == 4
    assert any("end-to-end: 4 steps × 4 of 8 sequences" in line and "auto" in line for line in fits.notes)

    tight = Recorder()
    with caplog.at_level("WARNING", logger="moesq"):
        run_refine(tmp_path / "tight", RefineConfig(epochs=1, steps_per_epoch=2, e2e_memory_gb=1e-4), micro_path,
                   RUN, device="cpu", batch_size=4, progress=tight)
    st = WorkDir(tmp_path / "tight").stage("refine")
    assert st["done"] and "e2e" not in st and "blockwise" not in st
    assert "skipped" in st["summary"]["finalize"]
    assert any("end-to-end: skipped" in line and "GiB allowed (e2e_memory_gb)" in line for line in tight.notes)
    assert "end-to-end step skipped" in caplog.text
    # the block-wise blocks are those of the run that tuned end to end afterwards
    fits_bw = WorkDir(tmp_path / "fits").stage("refine")["blockwise"]
    assert {li: b["sha256"] for li, b in st["blocks"].items()} == {li: b["sha256"] for li, b in fits_bw.items()}

    # a number of steps runs even where the estimate is larger, with a warning
    forced = Recorder()
    run_refine(tmp_path / "forced", RefineConfig(epochs=1, steps_per_epoch=2, e2e_steps=3, e2e_memory_gb=1e-4),
               micro_path, RUN, device="cpu", batch_size=4, progress=forced)
    assert WorkDir(tmp_path / "forced").stage("refine")["e2e"]["steps"] == 3
    assert any("may not fit" in line for line in forced.notes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act_quant", [True, False])
def test_tunable_experts_on_cuda_match_the_cpu_reference(act_quant):
    """The end-to-end step's forward and gradient on the GPU (batched experts forward) against the CPU's."""
    fmt = get_format("p48-nvfp4")
    weights = _random_block(fmt, E=5, inter=96, H=160)
    amax_in, amax_mid = torch.tensor([3.0, 2.5, 4.0, 1.5, 2.0]), torch.tensor([1.0, 0.5, 2.0, 0.7, 1.2])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(77, 160, generator=g)  # awkward row count
    idx = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(77)])
    wts = torch.rand(77, 2, generator=g)
    out = {}
    for dev in ("cpu", "cuda"):
        m = TunableExperts(fmt, weights, act_quant, amax_in, amax_mid, device=dev)
        y = m(x.to(dev), idx.to(dev), wts.to(dev))
        y.square().sum().backward()
        out[dev] = (y.detach().cpu(), {p: m.V[p].grad.cpu() for p in PROJECTIONS})
    torch.testing.assert_close(out["cuda"][0], out["cpu"][0], rtol=1e-4, atol=1e-5)
    for p in PROJECTIONS:
        torch.testing.assert_close(out["cuda"][1][p], out["cpu"][1][p], rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_end_to_end_on_cuda_plans_from_the_gpu_memory_and_ships_the_best_validating_pass(micro_path, tmp_path):
    """On 8 calibration sequences of 32 tokens a pass may validate worse than the block-wise result (seen on the
    H200 in bf16); what must hold is the plan and the choice. That the step helps on real calibration sizes is
    in the GPU tables (README, accuracy)."""
    from moesq_core.compression.pipeline import run_refine
    from moesq_core.compression.workdir import WorkDir

    run_refine(tmp_path / "wd", RefineConfig(epochs=1, steps_per_epoch=2, init_split_rows=False),
               micro_path, RUN, device="cuda", batch_size=4)
    st = WorkDir(tmp_path / "wd").stage("refine")
    rec = st["e2e"]
    assert rec["steps"] == RefineConfig().e2e_steps_for(RUN["n_train"] + RUN["n_init"])
    assert rec["val_kl"][rec["best_pass"]] == min(rec["val_kl"]) and len(rec["val_kl"]) == rec["passes"] + 1
    tuned = all(b["file"].endswith(".e2e.safetensors") for b in st["blocks"].values())
    assert tuned == (rec["best_pass"] > 0)


# -- windows: the step where the whole model does not fit ---------------------------------------------------------
# Most of these tune a copy of the `tuned` work dir's block-wise stage (its end-to-end step undone) directly: the
# block loop is most of a run's time on the CPU, and the end-to-end step is what they are about.
def _blockwise_copy(tuned: Path, dst: Path) -> Path:
    """A copy of a work dir whose refine stage tuned end to end, set back to what its block loop left."""
    import json
    import shutil

    shutil.copytree(tuned, dst)
    m = json.loads((dst / "manifest.json").read_text())
    st = m["stages"]["refine"]
    st["blocks"], st["done"] = st.pop("blockwise"), False
    del st["e2e"]
    (dst / "manifest.json").write_text(json.dumps(m))
    for f in (dst / "stages").rglob("*.e2e.safetensors"):
        f.unlink()
    return dst


def _tune(wd: Path, windows, rcfg=RCFG) -> dict:
    """The refine stage's end-to-end step in `windows`, as the stage's finalize runs it."""
    from moesq_core.compression import pipeline
    from moesq_core.compression.workdir import WorkDir

    w = WorkDir(wd)
    identity = w.identity()
    model, adapter = pipeline._load_for_stage(identity, "cpu")
    return pipeline.tune_end_to_end(w.ledger("refine"), identity, model, adapter, pipeline.load_calibration(w), rcfg,
                                    windows=windows)


@pytest.fixture(scope="module")
def tuned_in_windows(tuned, tmp_path_factory):
    """`tuned`'s block loop, then the end-to-end step in windows of 2 blocks, uninterrupted."""
    wd = _blockwise_copy(tuned, tmp_path_factory.mktemp("e2e-w2") / "wd")
    _tune(wd, [[0, 1], [2, 3]])
    return wd


def test_a_window_of_the_whole_model_is_the_whole_model_step(tuned, tmp_path):
    from moesq_core.compression.workdir import WorkDir

    wd = _blockwise_copy(tuned, tmp_path / "wd")
    _tune(wd, [[0, 1, 2, 3]])
    assert _artifacts(wd) == _artifacts(tuned)
    ours, theirs = WorkDir(wd).stage("refine"), WorkDir(tuned).stage("refine")
    assert ours["blocks"] == theirs["blocks"] and ours["e2e"] == theirs["e2e"]


def test_windows_of_two_blocks_lower_the_validation_kl(tuned_in_windows):
    from moesq_core.compression.workdir import WorkDir

    st = WorkDir(tuned_in_windows).stage("refine")
    rec = st["e2e"]
    assert "e2e_windows" not in st
    assert [w["layers"] for w in rec["windows"]] == [[0, 1], [2, 3]] and rec["steps"] == RCFG.e2e_steps
    first, last = rec["windows"]
    # the second window starts where the first ended, and the model ends closer to the reference than block-wise
    assert last["val_kl"][0] == pytest.approx(min(first["val_kl"]), rel=1e-4)
    assert min(last["val_kl"]) < first["val_kl"][0] and rec["best_pass"] > 0
    assert any(b["file"].endswith(".e2e.safetensors") for b in st["blocks"].values())
    assert all(not b["file"].endswith(".e2e.safetensors") for b in st["blockwise"].values())


def test_windows_of_one_block_lower_the_validation_kl(tuned, tmp_path):
    import dataclasses

    from moesq_core.compression.workdir import WorkDir

    wd = _blockwise_copy(tuned, tmp_path / "wd")
    _tune(wd, [[0], [1], [2], [3]], dataclasses.replace(RCFG, e2e_steps=3))  # one pass each
    rec = WorkDir(wd).stage("refine")["e2e"]
    assert [w["layers"] for w in rec["windows"]] == [[0], [1], [2], [3]]
    assert min(rec["windows"][-1]["val_kl"]) < rec["windows"][0]["val_kl"][0]


def _interrupted_in_second_window(wd: Path, monkeypatch, rcfg=RCFG) -> list:
    """Tune `wd` in windows [[0, 1], [2, 3]], interrupted as the second window starts; returns the list the windows
    each later `_train` call appends to (cleared: what a resumed run trains)."""
    real, calls = EndToEndTuner._train, []

    def second_window_interrupted(self, *a, **k):
        calls.append(sorted(self.modules))
        if calls == [[0, 1], [2, 3]]:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(EndToEndTuner, "_train", second_window_interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tune(wd, [[0, 1], [2, 3]], rcfg)
    calls.clear()
    return calls


def test_a_windowed_step_interrupted_mid_window_resumes_at_that_window_to_the_same_bytes(
        tuned, tuned_in_windows, tmp_path, monkeypatch):
    from moesq_core.compression.workdir import WorkDir

    wd = _blockwise_copy(tuned, tmp_path / "wd")
    calls = _interrupted_in_second_window(wd, monkeypatch)
    st = WorkDir(wd).stage("refine")
    assert "e2e" not in st and [w["summary"]["layers"] for w in st["e2e_windows"]["done"]] == [[0, 1]]  # saved
    assert st["blocks"] == WorkDir(tuned).stage("refine")["blockwise"]  # the stage's blocks are still block-wise
    _tune(wd, [[0, 1], [2, 3]])
    assert calls == [[2, 3]]  # only the window it was in ran again
    assert _artifacts(wd) == _artifacts(tuned_in_windows)
    ours, theirs = WorkDir(wd).stage("refine"), WorkDir(tuned_in_windows).stage("refine")
    assert ours["blocks"] == theirs["blocks"] and ours["e2e"] == theirs["e2e"]


def test_redo_from_drops_an_interrupted_steps_windows_and_another_plan_on_resume_starts_again(
        tuned, tmp_path, monkeypatch):
    from moesq_core.compression.workdir import WorkDir

    wd = _blockwise_copy(tuned, tmp_path / "wd")
    real, calls = EndToEndTuner._train, []

    def second_window_interrupted(self, *a, **k):
        calls.append(sorted(self.modules))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(EndToEndTuner, "_train", second_window_interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tune(wd, [[0, 1], [2, 3]])
    ledger = WorkDir(wd).ledger("refine")
    saved = list((wd / "stages").rglob("*.e2e.safetensors"))
    assert len(saved) == 2 and [s for s, _ in ledger.finished_windows([[0, 1], [2, 3]])][0]["layers"] == [0, 1]
    ledger.drop_blocks_from(3)  # --redo-from 3: the tuned windows go with the blocks from 3 on
    st = ledger.record()
    assert "e2e_windows" not in st and not any(p.exists() for p in saved) and sorted(st["blocks"]) == ["0", "1", "2"]
    # a window recorded under another plan (the device's memory changed between the runs) is forgotten
    path = ledger.write_artifact(0, lambda tmp: tmp.write_bytes(b"x"), variant="e2e")
    ledger.record_window([[0], [1], [2], [3]], {0: path}, {"layers": [0]})
    assert len(ledger.finished_windows([[0], [1], [2], [3]])) == 1
    assert ledger.finished_windows([[0, 1], [2, 3]]) == [] and not path.exists()
    assert "e2e_windows" not in ledger.record()


def test_auto_window_is_the_largest_that_fits(micro_path):
    from moesq_core.compression.methods.refine.e2e import e2e_window_plan, memory_need_bytes, window_need_bytes
    from moesq_core.models import load_model

    model, _, adapter, _ = load_model(micro_path, lazy=True)
    whole = e2e_window_plan(model, adapter, 4, 256, "auto", None)
    assert whole.windows == [[0, 1, 2, 3]] and whole.fits and whole.describe() == "the whole model at once"
    assert whole.need_bytes == memory_need_bytes(model, adapter, 4, 256)
    need = {w: max(window_need_bytes(model, adapter, 4, 256, list(range(s, min(s + w, 4)))) for s in range(0, 4, w))
            for w in (1, 2, 3, 4)}
    assert need[1] < need[2] < need[3] < need[4]
    for w in (1, 2, 3, 4):
        plan = e2e_window_plan(model, adapter, 4, 256, "auto", need[w])
        assert len(plan.windows[0]) == w and plan.fits and plan.need_bytes == need[w]
    plan = e2e_window_plan(model, adapter, 4, 256, "auto", need[1] - 1)
    assert not plan.fits and len(plan.windows) == 4
    three = e2e_window_plan(model, adapter, 4, 256, 3, None)
    assert three.windows == [[0, 1, 2], [3]] and three.describe() == "2 windows of 3 blocks: layers 0-2, 3"
    assert e2e_window_plan(model, adapter, 4, 256, 9, None).windows == [[0, 1, 2, 3]]
    import dataclasses

    many = dataclasses.replace(three, windows=[[i] for i in range(48)])
    assert many.describe() == "48 windows of 1 block: layers 0, 1, …, 47"


def test_auto_end_to_end_plans_windows_where_the_whole_model_does_not_fit_and_says_so(micro_path):
    """e2e_memory_gb between what windows of 2 blocks and of 3 need: auto plans windows of 2, and its line (the
    one refinement prints before the block loop) names them."""
    from moesq_core.compression.methods.refine.e2e import window_need_bytes
    from moesq_core.compression.pipeline import plan_end_to_end
    from moesq_core.models import load_model

    model, _, adapter, _ = load_model(micro_path, lazy=True)
    calib = {"train": torch.zeros(8, 32, dtype=torch.long), "init": torch.zeros(4, 32, dtype=torch.long)}
    two = max(window_need_bytes(model, adapter, 4, 32, w) for w in ([0, 1], [2, 3]))
    three = window_need_bytes(model, adapter, 4, 32, [0, 1, 2])
    e2e = plan_end_to_end(RefineConfig(e2e_memory_gb=(two + three) / 2 / 2**30), model, adapter, calib)
    assert e2e["windows"] == [[0, 1], [2, 3]] and e2e["steps"] == 6
    assert ("6 steps × 4 of 12 sequences per window after the last block, 2 windows of 2 blocks: layers 0-1, 2-3 "
            "(auto: the largest window that fits: ~") in e2e["line"]
    e2e = plan_end_to_end(RefineConfig(e2e_window=1, e2e_steps=4), model, adapter, calib)
    assert e2e["windows"] == [[0], [1], [2], [3]] and "4 windows of 1 block: layers 0, 1, 2, 3 (~" in e2e["line"]
    e2e = plan_end_to_end(RefineConfig(), model, adapter, calib)
    assert e2e["windows"] == [[0, 1, 2, 3]] and "after the last block, the whole model at once (auto: ~" in e2e["line"]


@pytest.mark.slow
def test_refine_with_e2e_window_runs_the_planned_windows_and_the_whole_model_window_is_the_default_step(
        tuned, tuned_in_windows, micro_path, tmp_path):
    """The option through refinement: windows of 2 give the bytes of the step tuned in those windows directly; a
    window of the whole model those of the default run."""
    import dataclasses

    from moesq_core.compression.pipeline import run_refine
    from moesq_core.compression.workdir import WorkDir

    from test_block_loop import Recorder

    for window, same_as, named in ((2, tuned_in_windows, "2 windows of 2 blocks: layers 0-1, 2-3"),
                                   (4, tuned, "the whole model at once")):
        notes = Recorder()
        wd = tmp_path / f"w{window}"
        run_refine(wd, dataclasses.replace(RCFG, e2e_window=window), micro_path, RUN_TUNED, device="cpu", batch_size=4,
                   progress=notes)
        assert _artifacts(wd) == _artifacts(same_as)
        assert WorkDir(wd).stage("refine")["config"]["refine"]["e2e_window"] == window
        assert any(line.startswith("refine end-to-end: ") and named in line for line in notes.notes), notes.notes


def test_bad_e2e_window_exits_2_with_one_line(tmp_path):
    from moesq_runner import moesq_here

    for value in ("0", "-1", "many", "2.5"):
        r = moesq_here("refine", "-w", tmp_path / "wd", "--e2e-window", value, check=False)
        assert r.returncode == 2, r.stderr
        errors = [line for line in r.stderr.splitlines() if "e2e_window" in line]
        assert len(errors) == 1 and "refine.e2e_window: must be a number of blocks >= 1 or 'auto', got" in errors[0]
        assert "Traceback" not in r.stderr and not (tmp_path / "wd").exists()


def test_bad_e2e_window_is_refused_by_the_config():
    for bad in (0, -1, "many", True, 2.5):
        with pytest.raises(ValueError, match="e2e_window"):
            RefineConfig(e2e_window=bad)
    assert RefineConfig(e2e_window=3).e2e_window == 3


def test_optimizer_state_bytes_follow_the_optimizer_and_lion_gets_larger_windows_in_the_same_memory(micro_path):
    """Lion holds one fp32 moment per expert weight where Adam holds two: 4 bytes less per tuned weight in the
    window plan, so a memory where Adam's plan takes windows of 2 blocks gives Lion windows of 3, and the line
    refinement prints says so."""
    from moesq_core.compression.methods.refine import e2e
    from moesq_core.compression.methods.refine.trainer import E2E_OPTIMIZERS
    from moesq_core.compression.pipeline import plan_end_to_end
    from moesq_core.models import load_model

    assert e2e.STATE_BYTES_PER_WEIGHT == {"adam": 21, "lion": 17}  # V, grad, moments, forward's weights, mask
    assert set(e2e.STATE_BYTES_PER_WEIGHT) == set(E2E_OPTIMIZERS)
    model, _, adapter, _ = load_model(micro_path, lazy=True)
    c = model.config
    per_block = c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    for layers in ([0], [0, 1], [0, 1, 2, 3]):
        adam, lion = (e2e.window_need_bytes(model, adapter, 4, 32, layers, o) for o in ("adam", "lion"))
        assert adam - lion == 4 * per_block * len(layers)
    assert e2e.memory_need_bytes(model, adapter, 4, 32) == e2e.memory_need_bytes(model, adapter, 4, 32, "adam")
    need = {(o, w): e2e.e2e_window_plan(model, adapter, 4, 32, w, None, o).need_bytes
            for o in ("adam", "lion") for w in (2, 3)}
    assert need["lion", 3] < need["adam", 3]
    have = max(need["adam", 2], need["lion", 3])
    assert have < need["adam", 3]  # the micro model: Lion's window of 3 fits where Adam's does not
    assert [len(w) for w in e2e.e2e_window_plan(model, adapter, 4, 32, "auto", have, "adam").windows] == [2, 2]
    assert [len(w) for w in e2e.e2e_window_plan(model, adapter, 4, 32, "auto", have, "lion").windows] == [3, 1]
    calib = {"train": torch.zeros(8, 32, dtype=torch.long), "init": torch.zeros(4, 32, dtype=torch.long)}
    line = plan_end_to_end(RefineConfig(e2e_memory_gb=have / 2**30, e2e_optimizer="lion"), model, adapter,
                           calib)["line"]
    assert "per window with Lion after the last block, 2 windows of 3 blocks: layers 0-2, 3 " in line, line


def test_adam_is_the_default_and_steps_as_torch_adam_did():
    """e2e_optimizer "adam" (the default) is torch.optim.Adam at e2e_lr, as the step always ran: the same bytes
    after a few steps; Lion at the same rate moves the values otherwise."""
    from moesq_core.compression.methods.refine.e2e import make_optimizer

    assert RefineConfig().e2e_optimizer == "adam"
    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(64, 32, generator=g), [torch.randn(64, 32, generator=g) for _ in range(5)]
    out = {}
    for name, make in (("torch", lambda p: torch.optim.Adam(p, lr=1e-3)),
                       ("adam", lambda p: make_optimizer("adam", p, 1e-3)),
                       ("lion", lambda p: make_optimizer("lion", p, 1e-3))):
        v = torch.nn.Parameter(start.clone())
        opt = make([v])
        for gr in grads:
            v.grad = gr.clone()
            opt.step()
        out[name] = v.detach()
    assert torch.equal(out["adam"], out["torch"]) and not torch.equal(out["lion"], out["adam"])
    lion = make_optimizer("lion", [torch.nn.Parameter(start.clone())], 1e-3)
    assert type(lion).__name__ == "Lion" and lion.param_groups[0]["weight_decay"] == 0.0


LION = RefineConfig(**{**RCFG.__dict__, "e2e_optimizer": "lion", "e2e_lr": 1e-3})


def test_lion_windowed_step_lowers_the_kl_and_resumes_mid_window_to_the_same_bytes(tuned, tmp_path, monkeypatch):
    """The end-to-end step with Lion in windows of 2 blocks: it lowers the validation KL, differs from Adam's,
    and a run interrupted in its second window resumes there to the bytes of the uninterrupted run."""
    from moesq_core.compression.workdir import WorkDir

    whole = _blockwise_copy(tuned, tmp_path / "whole")
    _tune(whole, [[0, 1], [2, 3]], LION)
    rec = WorkDir(whole).stage("refine")["e2e"]
    assert min(rec["windows"][-1]["val_kl"]) < rec["windows"][0]["val_kl"][0] and rec["best_pass"] > 0

    wd = _blockwise_copy(tuned, tmp_path / "wd")
    calls = _interrupted_in_second_window(wd, monkeypatch, LION)
    _tune(wd, [[0, 1], [2, 3]], LION)
    assert calls == [[2, 3]]  # only the window it was in ran again
    assert _artifacts(wd) == _artifacts(whole)
    ours, theirs = WorkDir(wd).stage("refine"), WorkDir(whole).stage("refine")
    assert ours["blocks"] == theirs["blocks"] and ours["e2e"] == theirs["e2e"]
    assert _artifacts(whole) != _artifacts(tuned)  # not Adam's bytes (tuned: the whole model with Adam)


def test_bad_e2e_optimizer_exits_2_with_one_line(tmp_path):
    from moesq_runner import moesq_here

    r = moesq_here("refine", "-w", tmp_path / "wd", "--set", "refine.e2e_optimizer=sgd", check=False)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "e2e_optimizer" in line]
    assert len(errors) == 1 and "refine.e2e_optimizer: must be one of adam, lion, got 'sgd'" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "wd").exists()
