"""The run's identity (RunIdentity: model, format, activation quantization, calibration), read once from the
manifest, typed and validated; a stage's ledger (StageLedger: open, verified block, record block, finish) and
a block loop that resumes through it."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from moesq_core.compression.calibration import CalibConfig, build_calibration, read_documents
from moesq_core.compression.config import RunConfig
from moesq_core.compression.engine import StageSpec, run_stage
from moesq_core.compression.methods.rtn import RTN
from moesq_core.compression.pipeline import run_calibrate
from moesq_core.compression.workdir import RunIdentity, WorkDir, WorkDirError, model_fingerprint, sha256_file
from moesq_core.formats import Format, get_format
from moesq_core.models import load_model

from conftest import CALIB
from moesq_runner import moesq_here

TINY = {"seq_len": 32, "n_train": 2, "n_val": 2, "n_init": 8}


@pytest.fixture(scope="module")
def calibrated(micro_path, tmp_path_factory) -> Path:
    """A work dir calibrated on the embedded model, weights only (tiny splits)."""
    root = tmp_path_factory.mktemp("identity") / "wd"
    run_calibrate(root, micro_path, {**TINY, "act_quant": False, "format": "s24-fp8"})
    return root


def _copy(src: Path, dst: Path) -> WorkDir:
    shutil.copytree(src, dst)
    return WorkDir(dst)


def test_identity_is_read_typed_from_the_manifest(calibrated, micro_path):
    wd = WorkDir(calibrated)
    ident = wd.identity()
    assert ident.format_name == "s24-fp8" and isinstance(ident.format, Format)
    assert ident.format is get_format("s24-fp8")
    assert ident.act_quant is False
    assert ident.calib == CalibConfig(**TINY)
    assert Path(ident.calib_source).name == "calib-sample.txt.xz"
    assert isinstance(ident.model_path, Path) and ident.model_path == Path(micro_path).resolve()
    assert ident.model_fingerprint == model_fingerprint(micro_path)
    assert ident.model_source == str(micro_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.act_quant = True
    # the run config it gives is the one the work dir was made with
    assert RunConfig.from_identity(ident) == RunConfig.from_dict(wd.load()["config"])


def test_an_older_manifest_without_act_quant_quantized_activations(calibrated, tmp_path):
    wd = _copy(calibrated, tmp_path / "wd")
    m = wd.load()
    del m["config"]["act_quant"]
    wd.save(m)
    assert wd.identity().act_quant is True


DAMAGE = {
    "config.format missing": (lambda m: m["config"].pop("format"), "config.format is missing"),
    "unknown format": (lambda m: m["config"].update(format="p99-int2"), "config.format: .*p99-int2"),
    "act_quant not a bool": (lambda m: m["config"].update(act_quant="yes"), "config.act_quant must be true or false"),
    "no model": (lambda m: m.pop("model"), "'model' is missing"),
    "no fingerprint": (lambda m: m["model"].pop("fingerprint"), "model.fingerprint is missing"),
    "bad calib": (lambda m: m["config"]["calib"].update(seq_len=0), "config.calib: seq_len must be a positive"),
    "unknown calib key": (lambda m: m["config"]["calib"].update(seqlen=32), "config.calib: .*seqlen"),
    "config not an object": (lambda m: m.update(config=["p48-nvfp4"]), "'config' is not an object"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_manifest_gives_one_clear_error(calibrated, damage):
    change, match = DAMAGE[damage]
    m = json.loads((calibrated / "manifest.json").read_text())
    change(m)
    with pytest.raises(WorkDirError, match=f"manifest.json: the run's identity cannot be read \\({match}"):
        RunIdentity.from_manifest(m, calibrated / "manifest.json")
    with pytest.raises(WorkDirError, match="cannot be read"):
        RunIdentity.from_manifest([m])


def test_a_command_on_a_damaged_manifest_exits_with_one_line_and_writes_nothing(calibrated, tmp_path):
    """Before the identity was read in one place, a manifest without its format stopped the command with
    "unexpected KeyError: 'format'"."""
    wd = _copy(calibrated, tmp_path / "wd")
    m = wd.load()
    del m["config"]["format"]
    wd.save(m)
    before = sha256_file(wd.manifest_path)
    r = moesq_here("init-sgptq", "-w", wd.root, "-q", check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.format is missing" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert sha256_file(wd.manifest_path) == before
    assert not (wd.root / "stages").exists()


# -- the ledger ------------------------------------------------------------------------------------------------
def _write(data: bytes):
    return lambda path: path.write_bytes(data)


def test_ledger_opens_records_verifies_and_finishes(calibrated, tmp_path):
    wd = _copy(calibrated, tmp_path / "wd")
    ledger = wd.ledger("init-x")
    config = {"method": "x", "options": {"k": 1}}
    st = ledger.open(config, num_blocks=2)
    assert st["config"] == config and st["blocks"] == {} and not st["done"]
    assert ledger.blocks() == {} and ledger.verified_block(0) is None
    assert ledger.finished_summary(config) is None
    path = ledger.record_block(0, _write(b"block zero"), extra={"experts": 8}, timings={"seconds": 1.5})
    assert path == wd.root / "stages" / "init-x" / "block_000.safetensors" and path.read_bytes() == b"block zero"
    assert ledger.blocks() == {0: sha256_file(path)}
    assert ledger.verified_block(0) == path and ledger.verified_block(1) is None
    rec = wd.stage("init-x")
    assert rec["blocks"]["0"] == {"file": "stages/init-x/block_000.safetensors", "sha256": sha256_file(path),
                                  "experts": 8}
    assert rec["block_timings"] == {"0": {"seconds": 1.5}}  # apart from the block's record
    # resuming: the same config opens the recorded stage; another is refused, naming the difference
    assert ledger.open(config, num_blocks=2)["blocks"] == rec["blocks"]
    with pytest.raises(WorkDirError, match="another config:\n  options.k: 1 \\(work dir\\) vs 2 \\(now\\)"):
        ledger.open({"method": "x", "options": {"k": 2}}, num_blocks=2)
    ledger.record_block(1, _write(b"block one"))
    ledger.finish({"blocks": 2, "computed_now": 2, "stage_seconds": 3.0})
    rec = wd.stage("init-x")
    assert rec["done"] and rec["summary"]["blocks"] == 2 and rec["runs"][-1]["stage_seconds"] == 3.0
    assert ledger.finished_summary(config) == {"blocks": 2, "computed_now": 0}
    # --redo-from 1: block 1 forgotten and its file removed, block 0 kept
    ledger.drop_blocks_from(1)
    assert sorted(ledger.blocks()) == [0] and not (path.parent / "block_001.safetensors").exists()
    assert not wd.stage("init-x")["done"]


def test_a_failed_block_write_leaves_neither_file_nor_record(calibrated, tmp_path):
    wd = _copy(calibrated, tmp_path / "wd")
    ledger = wd.ledger("init-x")
    ledger.open({"method": "x"})

    def half_then_fail(path: Path):
        path.write_bytes(b"half a blo")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ledger.record_block(0, half_then_fail)
    assert ledger.blocks() == {} and list(ledger.dir.iterdir()) == []  # no half file, not even the temp one


def test_a_verified_read_of_a_corrupt_block_fails_naming_it(calibrated, tmp_path):
    wd = _copy(calibrated, tmp_path / "wd")
    ledger = wd.ledger("init-x")
    ledger.open({"method": "x"})
    path = ledger.record_block(3, _write(b"0123456789"))
    path.write_bytes(b"0123456788")  # one byte changed
    before = sha256_file(wd.manifest_path)
    with pytest.raises(WorkDirError, match=f"artifact {path} of stage 'init-x' is corrupt .*--redo-from 3"):
        ledger.verified_block(3)
    path.unlink()
    with pytest.raises(WorkDirError, match="recorded as finished is missing"):
        ledger.verified_block(3)
    assert sha256_file(wd.manifest_path) == before


# -- the block loop through its ledger ---------------------------------------------------------------------------
class _Stop(Exception):
    pass


def test_a_resumed_stage_skips_its_recorded_blocks(micro_path, tmp_path):
    model, tok, adapter, path = load_model(micro_path)
    calib = build_calibration(tok, read_documents(CALIB, max_chars=200_000),
                              CalibConfig(seq_len=32, n_train=2, n_val=2, n_init=4))
    wd = WorkDir(tmp_path / "wd")
    wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)}, {"format": "p48-nvfp4"})
    compressed = []

    def method_for_block(li: int):
        if len(compressed) == stop_after:
            raise _Stop
        compressed.append(li)
        return RTN()

    spec = StageSpec("init-rtn", get_format("p48-nvfp4"), method_for_block, {"method": "rtn"}, batch_size=2,
                     val_split=None)
    stop_after = 2
    with pytest.raises(_Stop):
        run_stage(model, adapter, calib, spec, wd.ledger("init-rtn"))
    ledger = wd.ledger("init-rtn")
    first = ledger.blocks()
    assert sorted(first) == [0, 1] and compressed == [0, 1]
    stop_after = None
    compressed.clear()
    summary = run_stage(model, adapter, calib, spec, ledger)
    assert compressed == [2, 3] and summary["computed_now"] == 2  # blocks 0 and 1 were loaded, not compressed
    assert {k: v for k, v in ledger.blocks().items() if k < 2} == first and wd.stage("init-rtn")["done"]
    with pytest.raises(ValueError, match="through the ledger of stage 'refine'"):
        run_stage(model, adapter, calib, spec, wd.ledger("refine"))
