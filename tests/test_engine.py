"""The blockwise engine and the work dir: resumable stages with identical artifacts, refusals of foreign work
dirs and corrupt artifacts, spilling the calibration cache, expert-parallel equal to one process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moesq_core.calibration import CalibConfig, build_calibration, read_documents
from moesq_core.engine import StageSpec, StateStore, load_block, run_stage
from moesq_core.formats import get_format
from moesq_core.methods.rtn import RTN
from moesq_core.models import load_model
from moesq_core.workdir import WorkDir, WorkDirError, model_fingerprint, sha256_file

from conftest import CALIB_TEXT

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def micro(micro_path):
    model, tok, adapter, path = load_model(micro_path)
    docs = read_documents(CALIB_TEXT, max_chars=400_000)
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
    run_stage(model, adapter, calib, _spec(), full)
    want = _checksums(full, "init-rtn")
    assert len(want) == 4 and full.stage("init-rtn")["done"]

    part = _new_wd(tmp_path / "part", path)
    spec = _spec()
    spec.method_for_block = _DiesAfter(2)
    with pytest.raises(_Interrupt):
        run_stage(model, adapter, calib, spec, part)
    assert len(part.stage("init-rtn")["blocks"]) == 2 and not part.stage("init-rtn")["done"]
    summary = run_stage(model, adapter, calib, _spec(), part)
    assert summary["computed_now"] == 2
    assert _checksums(part, "init-rtn") == want
    # a finished stage re-run is a no-op
    assert run_stage(model, adapter, calib, _spec(), part)["computed_now"] == 0


def test_corrupt_artifact_and_foreign_config_are_refused(micro, tmp_path):
    model, tok, adapter, path, calib = micro
    wd = _new_wd(tmp_path / "wd", path)
    run_stage(model, adapter, calib, _spec(), wd)
    before = sha256_file(wd.manifest_path)
    with pytest.raises(WorkDirError, match="made for another model"):
        wd.init({"source": "x", "path": "x", "fingerprint": "0" * 32}, {"format": "p48-nvfp4"})
    with pytest.raises(WorkDirError, match="format: 'p48-nvfp4' \\(work dir\\) vs 's24-fp8'"):
        wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)}, {"format": "s24-fp8"})
    other = _spec()
    other.config = {"method": "rtn", "options": {"x": 1}}
    with pytest.raises(WorkDirError, match="another config"):
        run_stage(model, adapter, calib, other, wd)
    blk = wd.root / wd.stage("init-rtn")["blocks"]["2"]["file"]
    data = blk.read_bytes()
    blk.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(WorkDirError, match="corrupt or truncated.*--redo-from 2"):
        run_stage(model, adapter, calib, _spec(), wd)
    assert sha256_file(wd.manifest_path) == before  # nothing lost or changed
    wd.drop_blocks_from("init-rtn", 2)
    assert run_stage(model, adapter, calib, _spec(), wd)["computed_now"] == 2


def test_state_store_spills_to_disk(tmp_path):
    s = StateStore(limit_bytes=100, spill_dir=tmp_path / "spill")
    ts = [torch.randn(3, 5) for _ in range(4)]
    for t in ts:
        s.append(t)
    assert sum(isinstance(c, Path) for c in s.chunks) >= 3
    assert all(torch.equal(a, b) for a, b in zip(s, ts))
    s.close()
    assert not list((tmp_path / "spill").iterdir())


def test_spilled_cache_gives_identical_artifacts(micro, tmp_path):
    model, tok, adapter, path, calib = micro
    a = _new_wd(tmp_path / "a", path)
    run_stage(model, adapter, calib, _spec(), a)
    b = _new_wd(tmp_path / "b", path)
    run_stage(model, adapter, calib, _spec(cache_limit_bytes=1), b)
    assert _checksums(a, "init-rtn") == _checksums(b, "init-rtn")


def test_compressed_prefix_is_seen_by_later_blocks(micro, tmp_path):
    """Block 1's inputs come from the compressed block 0: its artifact differs from one computed on the
    dense prefix only through the calibration states (activation ranges)."""
    model, tok, adapter, path, calib = micro
    wd = _new_wd(tmp_path / "wd", path)
    run_stage(model, adapter, calib, _spec(), wd)
    results, amax_in, amax_mid = load_block(wd.root / wd.stage("init-rtn")["blocks"]["1"]["file"])
    from moesq_core.engine import capture_layer_inputs, gather_experts

    for b in adapter.blocks(model):
        b.restore_dense()
    store = StateStore(1 << 30, None)
    kw = capture_layer_inputs(model, calib["init"], 4, store)
    layer0 = model.model.layers[0]
    dense_store = StateStore(1 << 30, None)
    for h in store:
        dense_store.append(layer0(h, **kw[h.shape[0]]))
    xs, _ = gather_experts(adapter.blocks(model)[1], dense_store, kw)
    dense_amax = torch.stack([torch.cat(x).abs().amax() for x in xs])
    assert not torch.allclose(dense_amax, amax_in)


WORKER = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
from test_engine import _spec, _new_wd, _checksums
from moesq_core.models import load_model
from moesq_core.calibration import CalibConfig, build_calibration, read_documents
from moesq_core.engine import run_stage
from moesq_core.workdir import WorkDir
from conftest import CALIB_TEXT, MICRO
dist.init_process_group("gloo")
torch.set_num_threads(1)
model, tok, adapter, path = load_model(MICRO)
calib = build_calibration(tok, read_documents(CALIB_TEXT, max_chars=400_000), CalibConfig(seq_len=64, n_train=8, n_val=4, n_init=8))
root = {root!r}
if dist.get_rank() == 0:
    _new_wd(root, path)
dist.barrier()
run_stage(model, adapter, calib, _spec(), WorkDir(root))
dist.destroy_process_group()
"""


def test_expert_parallel_equals_single_process(micro, tmp_path):
    model, tok, adapter, path, calib = micro
    single = _new_wd(tmp_path / "single", path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU reductions depend on the thread count; compare like with like
    try:
        run_stage(model, adapter, calib, _spec(), single)
    finally:
        torch.set_num_threads(threads)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), tests=str(REPO / "tests"), root=str(tmp_path / "ep")))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = [p.communicate(timeout=600)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    assert _checksums(WorkDir(tmp_path / "ep"), "init-rtn") == _checksums(single, "init-rtn")
