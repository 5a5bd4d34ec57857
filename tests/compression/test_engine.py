"""The blockwise engine and the work dir: resumable stages with identical artifacts, refusals of foreign work
dirs and corrupt artifacts, spilling the calibration cache, expert-parallel equal to one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moesq_core.compression.calibration import CalibConfig, build_calibration, read_documents
from moesq_core.compression.engine import SpilledChunk, StageSpec, StateStore, load_block, run_stage
from moesq_core.compression.methods.rtn import RTN
from moesq_core.compression.workdir import WorkDir, WorkDirError, model_fingerprint, sha256_file
from moesq_core.formats import get_format
from moesq_core.models import load_model

from conftest import CALIB

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def micro(micro_path):
    model, tok, adapter, path = load_model(micro_path)
    docs = read_documents(CALIB, max_chars=400_000)
    calib = build_calibration(tok, docs, CalibConfig(seq_len=64, n_train=8, n_val=4, n_init=8))
    return model, tok, adapter, path, calib


def _spec(name="init-rtn", **kw):
    return StageSpec(name, get_format("p48-nvfp4"), lambda li: RTN(), {"method": "rtn"}, batch_size=4, **kw)


def _new_wd(root: Path, path: Path) -> WorkDir:
    wd = WorkDir(root)
    wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)}, {"format": "p48-nvfp4"})
    return wd


def _checksums(wd: WorkDir, stage: str) -> dict:
    return {k: v["sha256"] for k, v in wd.stage(stage)["blocks"].items()}


class _Interrupt(Exception):
    pass


class _DiesAfter:
    """RTN that raises after n blocks: an interrupted stage."""

    def __init__(self, n):
        self.n = n

    def __call__(self, li):
        if self.n == 0:
            raise _Interrupt
        self.n -= 1
        return RTN()


def test_stage_resumes_with_identical_artifacts(micro, tmp_path):
    model, tok, adapter, path, calib = micro
    full = _new_wd(tmp_path / "full", path)
    run_stage(model, adapter, calib, _spec(), full.ledger("init-rtn"))
    want = _checksums(full, "init-rtn")
    assert len(want) == 4 and full.stage("init-rtn")["done"]

    part = _new_wd(tmp_path / "part", path)
    spec = _spec()
    spec.method_for_block = _DiesAfter(2)
    with pytest.raises(_Interrupt):
        run_stage(model, adapter, calib, spec, part.ledger("init-rtn"))
    assert len(part.stage("init-rtn")["blocks"]) == 2 and not part.stage("init-rtn")["done"]
    summary = run_stage(model, adapter, calib, _spec(), part.ledger("init-rtn"))
    assert summary["computed_now"] == 2
    assert _checksums(part, "init-rtn") == want
    # a finished stage re-run is a no-op
    assert run_stage(model, adapter, calib, _spec(), part.ledger("init-rtn"))["computed_now"] == 0


def test_a_block_written_in_the_background_is_kept_when_the_next_step_fails(micro, tmp_path, monkeypatch):
    # the artifact is written on a background thread while the block is installed and the states propagated: an
    # error there (or a stop) still finishes and records the block
    import moesq_core.compression.engine as engine

    model, tok, adapter, path, calib = micro
    full = _new_wd(tmp_path / "full", path)
    run_stage(model, adapter, calib, _spec(), full.ledger("init-rtn"))
    want = _checksums(full, "init-rtn")
    install, calls = engine.install_block, []

    def failing_install(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise _Interrupt
        return install(*a, **kw)

    part = _new_wd(tmp_path / "part", path)
    monkeypatch.setattr(engine, "install_block", failing_install)
    with pytest.raises(_Interrupt):
        run_stage(model, adapter, calib, _spec(), part.ledger("init-rtn"))
    assert sorted(part.stage("init-rtn")["blocks"]) == ["0", "1"]  # block 1 compressed, then install failed
    monkeypatch.setattr(engine, "install_block", install)
    assert run_stage(model, adapter, calib, _spec(), part.ledger("init-rtn"))["computed_now"] == 2
    assert _checksums(part, "init-rtn") == want


def test_a_failed_block_write_is_raised_and_not_recorded(micro, tmp_path, monkeypatch):
    import moesq_core.compression.engine as engine

    model, tok, adapter, path, calib = micro
    write, calls = engine.write_block, []

    def failing_write(p, *a):
        calls.append(p.name)
        if len(calls) == 2:
            raise OSError("disk full")
        return write(p, *a)

    wd = _new_wd(tmp_path / "wd", path)
    monkeypatch.setattr(engine, "write_block", failing_write)
    with pytest.raises(OSError, match="disk full"):
        run_stage(model, adapter, calib, _spec(), wd.ledger("init-rtn"))
    assert sorted(wd.stage("init-rtn")["blocks"]) == ["0"] and not wd.stage("init-rtn")["done"]
    assert len(calls) == 2  # the error stopped the stage at the next block's wait: block 2 was not written
    monkeypatch.setattr(engine, "write_block", write)
    assert run_stage(model, adapter, calib, _spec(), wd.ledger("init-rtn"))["computed_now"] == 3


def _layer_calls(model):
    """Counts of full decoder-layer passes per layer (propagation), and the hooks to remove."""
    calls, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls.get(i, 0) + 1)))
    return calls, hooks


def test_resume_starts_from_the_saved_states_and_gives_identical_artifacts(micro, tmp_path):
    model, tok, adapter, path, calib = micro
    full = _new_wd(tmp_path / "full", path)
    run_stage(model, adapter, calib, _spec(), full.ledger("init-rtn"))
    want = _checksums(full, "init-rtn")
    assert not list((full.root / "cache").glob("init-rtn-states*"))  # removed when the stage finished

    part = _new_wd(tmp_path / "part", path)
    spec = _spec(resume_every_s=0)
    spec.method_for_block = _DiesAfter(2)
    with pytest.raises(_Interrupt):
        run_stage(model, adapter, calib, spec, part.ledger("init-rtn"))
    record = json.loads((part.root / "cache" / "init-rtn-states.json").read_text())
    assert record["layer"] == 1 and sorted(record["blocks"]) == ["0", "1"]
    assert [f.name for f in (part.root / "cache").glob("init-rtn-states-L*")] == [record["file"]]  # one save kept
    calls, hooks = _layer_calls(model)
    try:
        summary = run_stage(model, adapter, calib, _spec(resume_every_s=0), part.ledger("init-rtn"))
    finally:
        for h in hooks:
            h.remove()
    # layers 0 and 1 were neither compressed nor run again: only block 2's output was propagated
    assert summary["computed_now"] == 2 and sorted(calls) == [2]
    assert _checksums(part, "init-rtn") == want
    assert not list((part.root / "cache").glob("init-rtn-states*"))


def test_saved_states_are_not_used_once_their_blocks_change(micro, tmp_path):
    model, tok, adapter, path, calib = micro
    full = _new_wd(tmp_path / "full", path)
    run_stage(model, adapter, calib, _spec(), full.ledger("init-rtn"))
    want = _checksums(full, "init-rtn")
    part = _new_wd(tmp_path / "part", path)
    spec = _spec(resume_every_s=0)
    spec.method_for_block = _DiesAfter(3)
    with pytest.raises(_Interrupt):
        run_stage(model, adapter, calib, spec, part.ledger("init-rtn"))
    # as --redo-from 1: the saved states (after layer 2) follow a dropped block
    part.ledger("init-rtn").drop_blocks_from(1)
    calls, hooks = _layer_calls(model)
    try:
        assert run_stage(model, adapter, calib, _spec(resume_every_s=0), part.ledger("init-rtn"))["computed_now"] == 3
    finally:
        for h in hooks:
            h.remove()
    assert sorted(calls) == [0, 1, 2] and _checksums(part, "init-rtn") == want
    # a truncated states file is not used either (same bytes, recomputed)
    spec = _spec(resume_every_s=0)
    spec.method_for_block = _DiesAfter(2)
    part.ledger("init-rtn").drop_blocks_from(0)
    with pytest.raises(_Interrupt):
        run_stage(model, adapter, calib, spec, part.ledger("init-rtn"))
    record = json.loads((part.root / "cache" / "init-rtn-states.json").read_text())
    raw = part.root / "cache" / record["file"]
    raw.write_bytes(raw.read_bytes()[:-8])
    assert run_stage(model, adapter, calib, _spec(), part.ledger("init-rtn"))["computed_now"] == 2
    assert _checksums(part, "init-rtn") == want


def test_corrupt_artifact_and_foreign_config_are_refused(micro, tmp_path):
    model, tok, adapter, path, calib = micro
    wd = _new_wd(tmp_path / "wd", path)
    run_stage(model, adapter, calib, _spec(), wd.ledger("init-rtn"))
    before = sha256_file(wd.manifest_path)
    with pytest.raises(WorkDirError, match="made for another model"):
        wd.init({"source": "x", "path": "x", "fingerprint": "0" * 32}, {"format": "p48-nvfp4"})
    with pytest.raises(WorkDirError, match="format: 'p48-nvfp4' \\(work dir\\) vs 's24-fp8'"):
        wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)}, {"format": "s24-fp8"})
    other = _spec()
    other.config = {"method": "rtn", "options": {"x": 1}}
    with pytest.raises(WorkDirError, match="another config"):
        run_stage(model, adapter, calib, other, wd.ledger("init-rtn"))
    # options that only bound memory (lowered after running out of it) or pick how the same numbers are computed
    # do not make it another stage
    wd.ledger("init-rtn").check_config({**_spec().config, "micro_batch_rows": 7, "chunk_gb": 0.5, "cuda_graphs": False})
    blk = wd.root / wd.stage("init-rtn")["blocks"]["2"]["file"]
    data = blk.read_bytes()
    blk.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(WorkDirError, match="corrupt or truncated.*--redo-from 2"):
        run_stage(model, adapter, calib, _spec(), wd.ledger("init-rtn"))
    assert sha256_file(wd.manifest_path) == before  # nothing lost or changed
    wd.ledger("init-rtn").drop_blocks_from(2)
    assert run_stage(model, adapter, calib, _spec(), wd.ledger("init-rtn"))["computed_now"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_store_spills_to_a_memory_mapped_file(tmp_path, dtype):
    s = StateStore(limit_bytes=100, spill_dir=tmp_path / "spill")
    ts = [torch.randn(3, 5).to(dtype) for _ in range(4)] + [torch.randn(2, 0, 7).to(dtype), torch.randn(4, 2).to(dtype)]
    for t in ts:
        s.append(t)
    assert sum(isinstance(c, SpilledChunk) for c in s.chunks) >= 2
    assert [p.name for p in (tmp_path / "spill").iterdir()] == [s.spill_path.name]  # one file for the store
    for _ in range(2):  # re-iterable, bit-exact, right shape and dtype
        got = list(s)
        assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, ts))
    s.close()
    assert not list((tmp_path / "spill").iterdir())


def test_spilled_cache_gives_identical_artifacts(micro, tmp_path):
    model, tok, adapter, path, calib = micro
    a = _new_wd(tmp_path / "a", path)
    run_stage(model, adapter, calib, _spec(), a.ledger("init-rtn"))
    b = _new_wd(tmp_path / "b", path)
    run_stage(model, adapter, calib, _spec(cache_limit_bytes=1), b.ledger("init-rtn"))
    assert _checksums(a, "init-rtn") == _checksums(b, "init-rtn")


def test_compressed_prefix_is_seen_by_later_blocks(micro, tmp_path):
    """Block 1's inputs come from the compressed block 0: its artifact differs from one computed on the
    dense prefix only through the calibration states (activation ranges)."""
    model, tok, adapter, path, calib = micro
    wd = _new_wd(tmp_path / "wd", path)
    run_stage(model, adapter, calib, _spec(), wd.ledger("init-rtn"))
    results, amax_in, amax_mid = load_block(wd.root / wd.stage("init-rtn")["blocks"]["1"]["file"])
    from moesq_core.compression.engine import capture_layer_inputs, gather_experts

    for b in adapter.blocks(model):
        b.restore_dense()
    store = StateStore(1 << 30, None)
    kw = capture_layer_inputs(model, calib["init"], 4, store)
    layer0 = model.model.layers[0]
    dense_store = StateStore(1 << 30, None)
    for h in store:
        dense_store.append(layer0(h, **kw[h.shape[0]]))
    routed = gather_experts(adapter.blocks(model)[1], dense_store, kw)
    dense_amax = torch.stack([routed.rows(e)[0].abs().amax() for e in range(len(routed.counts))])
    assert not torch.allclose(dense_amax, amax_in)


WORKER = r"""
import os, sys, torch, torch.distributed as dist
sys.path[:0] = [{repo!r}, {tests!r}, {here!r}]
from test_engine import _spec, _new_wd, _checksums, CALIB
from moesq_core.models import load_model
from moesq_core.compression.calibration import CalibConfig, build_calibration, read_documents
from moesq_core.compression.engine import run_stage
from moesq_core.compression.workdir import WorkDir
from conftest import MICRO
dist.init_process_group("gloo")
torch.set_num_threads(1)
model, tok, adapter, path = load_model(MICRO)
calib = build_calibration(tok, read_documents(CALIB, max_chars=400_000),
                          CalibConfig(seq_len=64, n_train=8, n_val=4, n_init=8))
root = {root!r}
if dist.get_rank() == 0:
    _new_wd(root, path)
dist.barrier()
run_stage(model, adapter, calib, _spec(cache_limit_bytes={cache_limit}), WorkDir(root).ledger("init-rtn"))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("cache_limit,port", [(4 << 30, 29533), (1, 29534)])
def test_expert_parallel_equals_single_process(micro, tmp_path, cache_limit, port):
    """2 ranks = 1 process; with cache_limit 1 every calibration state (and each rank's share of a layer pass
    awaiting its broadcast) goes through the spill file."""
    model, tok, adapter, path, calib = micro
    single = _new_wd(tmp_path / "single", path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU reductions depend on the thread count; compare like with like
    try:
        run_stage(model, adapter, calib, _spec(), single.ledger("init-rtn"))
    finally:
        torch.set_num_threads(threads)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), tests=str(REPO / "tests"),
                                    here=str(Path(__file__).resolve().parent), root=str(tmp_path / "ep"),
                                    cache_limit=cache_limit))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = [p.communicate(timeout=600)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    assert _checksums(WorkDir(tmp_path / "ep"), "init-rtn") == _checksums(single, "init-rtn")


def test_timings_are_kept_out_of_artifacts():
    from moesq_core.compression.engine import split_timings

    info = {"init": {"method": "sgptq", "seconds": 1.5}, "refine": {"best_epoch": 2, "seconds_block": 3.0,
                                                                      "init_seconds": 0.5, "val_loss": [1.0]}}
    clean, timings = split_timings(info)
    assert clean == {"init": {"method": "sgptq"}, "refine": {"best_epoch": 2, "val_loss": [1.0]}}
    assert timings == {"init": {"seconds": 1.5}, "refine": {"seconds_block": 3.0, "init_seconds": 0.5}}


def test_stage_identity_is_the_normalised_config():
    from moesq_core.compression.config import MethodConfig, RunConfig

    assert MethodConfig("sgptq").to_dict() == MethodConfig("sgptq", {"percdamp": 0.01, "exact_scales": True}).to_dict()
    assert MethodConfig("sgptq", {"refit": False}).to_dict() != MethodConfig("sgptq").to_dict()
    # refit is sgptq's default
    assert MethodConfig("sgptq").to_dict() == MethodConfig("sgptq", {"refit": True}).to_dict()
    assert MethodConfig("gptq").options["refit"] is False and "dense_only" not in MethodConfig("gptq").options
    with pytest.raises(ValueError, match="no option"):
        MethodConfig("rtn", {"percdamp": 0.1})
    with pytest.raises(ValueError, match="unknown method"):
        MethodConfig("nope")
    assert (RunConfig.from_options({}).to_dict()
            == RunConfig.from_options({"seq_len": 512, "format": "p48-nvfp4"}).to_dict())
    with pytest.raises(ValueError, match="seq_len must be a positive"):
        RunConfig.from_options({"seq_len": -5})
    with pytest.raises(ValueError, match="unknown format"):
        RunConfig.from_options({"format": "p24"})


def test_fingerprint_covers_weight_content(micro_path, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("MOESQ_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(micro_path, copy)
    assert model_fingerprint(copy) == model_fingerprint(micro_path)
    assert (tmp_path / "cache" / "weight-sha256.json").is_file()  # hashed once, then looked up
    f = copy / "model.safetensors"
    sd = load_file(str(f))
    name = next(k for k in sd if k.endswith("down_proj.weight"))
    sd[name] = sd[name] * 1.05
    save_file(sd, str(f), metadata={"format": "pt"})
    assert model_fingerprint(copy) != model_fingerprint(micro_path)


def test_lock_is_exclusive_and_cleans_temp_files(tmp_path):
    from moesq_core.compression.workdir import WorkDirLocked

    wd = WorkDir(tmp_path / "wd")
    wd.init({"source": "m", "path": "m", "fingerprint": "0" * 32}, {"format": "p48-nvfp4"})
    (wd.root / "stages" / "s").mkdir(parents=True)
    stale = wd.root / "stages" / "s" / ".block_000.safetensors.a1b2c3d4.tmp"
    stale.write_bytes(b"half")
    mine = wd.root / "stages" / "s" / "user.tmp"
    mine.write_bytes(b"keep")
    code = ("import sys; sys.path.insert(0, %r); from moesq_core.compression.workdir import WorkDir\n"
            "with WorkDir(%r).locked(): pass" % (str(REPO), str(wd.root)))
    with wd.locked():
        assert not stale.exists() and mine.exists()
        with wd.locked():  # re-entrant in one process
            pass
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode != 0 and "WorkDirLocked" in r.stderr and f"pid {os.getpid()}" in r.stderr
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0  # released
    assert issubclass(WorkDirLocked, WorkDirError)
    # a directory moesq did not make gets no lock file
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.txt").write_text("x")
    with pytest.raises(WorkDirError, match="not a moesq work dir"):
        with WorkDir(foreign).locked():
            pass
    assert [p.name for p in foreign.iterdir()] == ["data.txt"]


def test_block_compressed_in_expert_chunks_gives_the_same_bytes(micro_path, tmp_path, monkeypatch, one_thread):
    """A block whose dense fp32 experts do not fit the device at once is compressed chunk by chunk (a Kimi-K2
    block is 68 GB in fp32): SGPTQ and refinement write the bytes of one pass over all experts."""
    import moesq_core.compression.engine as engine
    from moesq_core.compression.methods.refine import RefineConfig
    from moesq_core.compression.pipeline import MethodConfig, run_init, run_refine

    run = {"calib_source": str(CALIB), "seq_len": 32, "n_train": 4, "n_val": 2, "n_init": 4}
    rcfg = RefineConfig(epochs=2, steps_per_epoch=2, lr_logits=0.01)
    sums = []
    for name, chunk in (("whole", None), ("chunked", 3)):
        if chunk is not None:
            monkeypatch.setattr(engine, "dense_weight_chunks", lambda experts, inter, H, device: [
                experts[i:i + chunk] for i in range(0, len(experts), chunk)])
        wd = tmp_path / name
        run_init(wd, MethodConfig("sgptq"), micro_path, run, device="cpu", batch_size=4)
        run_refine(wd, rcfg, micro_path, run, device="cpu", batch_size=4)
        w = WorkDir(wd)
        sums.append({s: _checksums(w, s) for s in ("init-sgptq", "refine")})
    assert sums[0] == sums[1] and len(sums[0]["refine"]) == 4


def test_routed_rows_are_each_experts_tokens_in_order(micro):
    """gather_experts keeps each token's MoE input once; an expert's rows are the inputs of the tokens routed
    to it, in token order across batches, with the router weight of that slot (the definition, one expert at a
    time), and only the experts asked for get rows."""
    from moesq_core.compression.engine import _moe_inputs, capture_layer_inputs, gather_experts

    model, tok, adapter, path, calib = micro
    block = adapter.blocks(model)[0]
    store = StateStore(1 << 30, None)
    kw = capture_layer_inputs(model, calib["train"], 3, store)  # batches of 3 sequences: offsets matter
    assert len(store) > 1
    routed = gather_experts(block, store, kw, experts=[0, 2, 5])
    x = torch.cat([_moe_inputs(block.layer, block.mlp, h, kw[h.shape[0]]).reshape(-1, routed.x.shape[-1])
                   for h in store])
    idx, wts = block.route(x)
    assert torch.equal(routed.x, x) and routed.x.dtype == x.dtype
    for e in range(block.num_experts):
        hit = (idx == e)
        assert routed.counts[e] == int(hit.sum())
        rows, w = routed.rows(e)
        if e in (0, 2, 5):
            token = hit.any(-1).nonzero().reshape(-1)
            assert torch.equal(rows, x[token].float()) and rows.dtype == torch.float32
            assert torch.equal(w, wts[hit].float())
        else:
            assert rows.shape == (0, x.shape[-1]) and len(w) == 0 and routed.row_count(e) == 0


@pytest.mark.gpu
def test_routed_rows_past_the_device_budget_wait_on_the_host(micro, monkeypatch):
    """When a block's per-token MoE inputs would take more than ROWS_GPU_FRACTION of the free device memory they
    are kept on the host; an expert's rows, made on the device, are the same as when they stay there."""
    import copy

    import moesq_core.compression.engine as engine
    from moesq_core.compression.engine import capture_layer_inputs, gather_experts

    model, tok, adapter, path, calib = micro
    model = copy.deepcopy(model).to("cuda")
    block = adapter.blocks(model)[0]
    store = StateStore(1 << 30, None)
    kw = capture_layer_inputs(model, calib["train"], 3, store)
    on_gpu = gather_experts(block, store, kw)
    monkeypatch.setattr(engine, "ROWS_GPU_FRACTION", 0.0)
    on_host = gather_experts(block, store, kw)
    assert on_gpu.x.is_cuda and not on_host.x.is_cuda and torch.equal(on_host.x, on_gpu.x.cpu())
    for e in range(block.num_experts):
        (a, wa), (b, wb) = on_gpu.rows(e, torch.device("cuda")), on_host.rows(e, torch.device("cuda"))
        assert b.is_cuda and torch.equal(a, b) and torch.equal(wa, wb)


def test_consecutive_chunks_fit_the_budget_in_order():
    from moesq_core.memory import consecutive_chunks

    assert consecutive_chunks("abcde", [2, 2, 1, 5, 1], 4) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert consecutive_chunks([1, 2], [9, 1], 4) == [[1], [2]]  # too large alone: a chunk of its own
    assert consecutive_chunks([], [], 4) == []


def test_dense_weight_chunks_fit_the_host_budget_on_the_cpu():
    """On the CPU a chunk's fp32 weights and results fit HOST_CHUNK_BYTES: a small block is one chunk, a
    Kimi-K2 block (384 experts of 2048 x 7168, ~1.2 GB each with its result) one expert a chunk."""
    from moesq_core.compression.engine import HOST_CHUNK_BYTES, RESULT_BYTES_PER_WEIGHT, dense_weight_chunks

    cpu = torch.device("cpu")
    assert dense_weight_chunks(list(range(64)), 64, 128, cpu) == [list(range(64))]
    assert dense_weight_chunks(list(range(384)), 2048, 7168, cpu) == [[e] for e in range(384)]
    per = 3 * 512 * 1024 * (4 + RESULT_BYTES_PER_WEIGHT)
    chunks = dense_weight_chunks(list(range(64)), 512, 1024, cpu)
    assert [e for c in chunks for e in c] == list(range(64)) and len(chunks) > 1
    assert all(len(c) * per <= HOST_CHUNK_BYTES for c in chunks)
    assert dense_weight_chunks([], 8, 8, cpu) == []


@pytest.mark.gpu
def test_dense_weight_chunks_fit_the_weights_on_a_gpu():
    """On a GPU a chunk's fp32 weights and results fit WEIGHTS_GPU_FRACTION of the free memory (the routed rows
    are the block's one token matrix, already allocated): weights that do not fit together make more chunks,
    in expert order, one expert at the least."""
    from moesq_core.compression.engine import RESULT_BYTES_PER_WEIGHT, WEIGHTS_GPU_FRACTION, dense_weight_chunks

    dev = torch.device("cuda")
    assert dense_weight_chunks(list(range(8)), 64, 64, dev) == [list(range(8))]
    free = torch.cuda.mem_get_info(dev)[0] * WEIGHTS_GPU_FRACTION
    inter = int(free // 4 // (3 * 64 * (4 + RESULT_BYTES_PER_WEIGHT)))  # a quarter of the budget per expert
    many = dense_weight_chunks(list(range(8)), inter, 64, dev)
    assert [e for c in many for e in c] == list(range(8)) and all(1 <= len(c) <= 4 for c in many) and len(many) >= 2
    assert dense_weight_chunks([5], 10 ** 9, 10 ** 4, dev) == [[5]]
