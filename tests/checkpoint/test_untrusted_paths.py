"""Paths read from a work dir's manifest, a pack's checksum manifest or its index stay inside their directory:
a crafted entry is refused with one line naming it, and nothing outside is read, hashed or deleted."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from moesq_core.checkpoint.checksums import PACK_MANIFEST, canonical, file_digest
from moesq_core.checkpoint.verify import verify_packed_dir
from moesq_core.compression.workdir import WorkDir
from moesq_core.naming import INDEX_FILE, SINGLE_FILE
from moesq_core.paths import UnsafePathError, inside
from moesq_core.serving.loader import load_packed


def test_inside_refuses_what_leaves_the_directory(tmp_path):
    root = tmp_path / "d"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_text("x")
    (tmp_path / "outside").write_text("secret")
    os.symlink(tmp_path / "outside", root / "link-out")
    os.symlink(tmp_path, root / "dir-out")
    os.symlink("sub/f", root / "link-in")
    assert inside(root, "sub/f", "e") == root / "sub" / "f"
    assert inside(root, "link-in", "e") == root / "link-in"  # a symlink that stays inside is fine
    for bad in ["../outside", str(tmp_path / "outside"), "sub/../../outside", "link-out", "dir-out/outside", ".",
                "", None]:
        with pytest.raises(UnsafePathError, match=r"^entry X: "):
            inside(root, bad, "entry X")


def _crafted_workdir(tmp_path, files: list[str], layout: int) -> WorkDir:
    wd = WorkDir(tmp_path / "wd")
    wd.init({"source": "m", "path": "m", "fingerprint": "f"}, {"format": "p48-nvfp4"})
    m = wd.load()
    m["stages"]["init-sgptq"] = {"config": {"method": "sgptq"}, "layout": layout, "done": True,
                                 "blocks": {str(i): {"file": f, "sha256": "0" * 64} for i, f in enumerate(files)}}
    wd.save(m)
    return wd


@pytest.mark.parametrize("layout", [1, 2])
def test_crafted_workdir_manifest_deletes_nothing_outside(tmp_path, layout):
    """A stage of an older layout is removed when its stage runs again (StageLedger.open), a --redo-from removes the
    blocks after it (drop_blocks_from): neither may follow a `..` or absolute path out of the work dir."""
    victims = [tmp_path / "victim-rel", tmp_path / "victim-abs"]
    for v in victims:
        v.write_text("keep")
    wd = _crafted_workdir(tmp_path, ["stages/init-sgptq/block_000.safetensors", "../victim-rel",
                                     str(victims[1])], layout)
    (wd.root / "stages" / "init-sgptq").mkdir(parents=True)
    (wd.root / "stages" / "init-sgptq" / "block_000.safetensors").write_text("artifact")
    with pytest.raises(UnsafePathError, match=r"manifest.json stages\.init-sgptq\.blocks\.1\.file: '\.\./victim-rel'"):
        if layout == 1:
            wd.ledger("init-sgptq").open({"method": "sgptq"})
        else:
            wd.ledger("init-sgptq").drop_blocks_from(0)
    assert all(v.read_text() == "keep" for v in victims)
    # every path is checked before anything is removed: the work dir's own artifact is still there too
    assert (wd.root / "stages" / "init-sgptq" / "block_000.safetensors").is_file()


def test_crafted_workdir_manifest_reads_nothing_outside(tmp_path):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"not yours")
    wd = _crafted_workdir(tmp_path, [str(outside)], 2)
    m = wd.load()
    m["stages"]["init-sgptq"]["blocks"]["0"]["sha256"] = hashlib.sha256(b"not yours").hexdigest()
    wd.save(m)
    with pytest.raises(UnsafePathError, match="blocks.0.file"):
        wd.ledger("init-sgptq").verified_block(0)


def _reseal(root, files: dict) -> None:
    """Write a manifest listing `files` with a valid manifest_sha256 (what a crafted pack would carry)."""
    body = json.loads((root / PACK_MANIFEST).read_text())
    body.pop("manifest_sha256")
    body["files"] = files
    body["manifest_sha256"] = hashlib.sha256(canonical(body)).hexdigest()
    (root / PACK_MANIFEST).write_bytes(canonical(body))


def test_verify_hashes_no_manifest_entry_outside_the_pack(packs, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(packs["s24-fp8"][1], d)
    outside = tmp_path / "outside.txt"
    outside.write_text("a file of the user's")
    files = json.loads((d / PACK_MANIFEST).read_text())["files"]
    files["../outside.txt"] = file_digest(outside)  # its right digest: before the fix it passed, read and hashed
    _reseal(d, files)
    report = verify_packed_dir(d, checksums_only=True)
    assert not report.ok and report.checksum_files == len(files) - 1
    assert report.first_error.tensor == "../outside.txt" and "outside" in report.first_error.problem


def test_crafted_index_reads_no_weights_outside_the_pack(packs, tmp_path):
    d, elsewhere = tmp_path / "p", tmp_path / "elsewhere"
    shutil.copytree(packs["s24-fp8"][1], d)
    elsewhere.mkdir()
    shutil.move(d / SINGLE_FILE, elsewhere / SINGLE_FILE)
    from safetensors import safe_open

    with safe_open(str(elsewhere / SINGLE_FILE), "pt") as f:
        names = list(f.keys())
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {n: "../elsewhere/model.safetensors"
                                                                           for n in names}}))
    with pytest.raises(ValueError, match=r"weight_map\[.*'\.\./elsewhere/model\.safetensors' points outside"):
        load_packed(d, verify=False)  # before the fix: loaded the weights from ../elsewhere
    report = verify_packed_dir(d)
    assert any(e.tensor == INDEX_FILE and "points outside" in e.problem for e in report.errors)


def test_a_hub_cache_snapshot_may_link_into_its_repos_blobs(tmp_path):
    repo = tmp_path / "models--someone--pack"
    snap = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "blobs" / "b1").write_text("{}")
    (tmp_path / "elsewhere").write_text("x")
    os.symlink("../../blobs/b1", snap / "config.json")
    os.symlink(tmp_path / "elsewhere", snap / "model.safetensors")
    assert inside(snap, "config.json", "e") == snap / "config.json"
    with pytest.raises(UnsafePathError, match="outside"):
        inside(snap, "model.safetensors", "e")
