"""`moesq pack / verify / generate / --version` as a user runs them: JSON output, refusals that lose nothing,
a Hub push without network."""
from __future__ import annotations

import json
import shutil

from moesq_runner import moesq, moesq_here


def test_version_and_exit_codes(tmp_path):
    from moesq_core import __version__

    r = moesq("--version")
    assert r.stdout.strip() == f"moesq {__version__}"
    assert "Exit codes: 0 ok, 1 failed" in moesq("--help").stdout
    r = moesq("pack", "--max-shard-size", "lots", check=False, cwd=tmp_path)  # a bad option: a usage error
    assert r.returncode == 2
    r = moesq("pack", check=False, cwd=tmp_path)  # WORKDIR defaults to ./moesq-work, which is not there
    assert r.returncode == 1 and "not a moesq work dir" in r.stderr and not any(tmp_path.iterdir())


def test_pack_verify_generate_json(stages, tmp_path):
    wd = stages["p48-nvfp4"].root
    out = tmp_path / "model"
    moesq_here("pack", wd, "--out", out, "--json", tmp_path / "pack.json", "--quiet")
    doc = json.loads((tmp_path / "pack.json").read_text())
    assert doc["schema"] == "moesq.pack/1" and doc["format"] == "p48-nvfp4" and doc["hub"] is None
    assert set(doc["produced"]) == {"moesq", "commit", "date"} and doc["produced"]["date"].startswith("20")
    assert "moesq_pack.json" in doc["files"] and doc["bits_per_weight"] > 2.75
    r = moesq_here("verify", out, "--json", "-", "--quiet")
    v = json.loads(r.stdout)  # stdout holds only the JSON; the table went to stderr
    assert v["schema"] == "moesq.verify/1" and v["ok"] and v["checksums"] == "ok"
    r = moesq_here("generate", out, "--prompt", "Memory barriers order", "--max-new-tokens", "3", "--json", "-",
                   "--quiet")
    g = json.loads(r.stdout)
    assert g["schema"] == "moesq.generate/2" and g["new_tokens"] == 3 and g["device"] == "cpu"


def test_pack_refusals_lose_nothing(stages, tmp_path):
    wd = stages["dense-nvfp4"].root
    f = tmp_path / "existing-file"
    f.write_text("keep")
    r = moesq_here("pack", wd, "--out", f, "--overwrite", check=False)
    assert r.returncode == 1 and "existing file" in r.stderr and "Traceback" not in r.stderr
    assert f.read_text() == "keep"
    r = moesq_here("pack", wd, "--out", wd, "--overwrite", check=False)
    assert r.returncode == 1 and "is the work dir" in r.stderr
    assert (wd / "manifest.json").is_file()
    r = moesq_here("pack", wd, "--out", tmp_path / "m", "--max-shard-size", "lots", check=False)
    assert r.returncode == 2 and "--max-shard-size" in r.stderr and not (tmp_path / "m").exists()


def test_push_to_hub_without_network_keeps_the_pack(stages, tmp_path):
    wd = stages["s24-fp8"].root
    out = tmp_path / "model"
    r = moesq_here("pack", wd, "--out", out, "--push-to-hub", "someone/moesq-test", "--json", tmp_path / "p.json",
                   check=False)
    assert r.returncode == 1
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "--push-to-hub someone/moesq-test" in err[0] and "Traceback" not in r.stderr
    assert "intact" in r.stderr.replace("\n", " ")
    assert json.loads((tmp_path / "p.json").read_text())["hub"]["error"]
    assert moesq_here("verify", out, "--quiet").returncode == 0


def test_the_cards_pack_push_to_hub_as_written(stages, tmp_path):
    """`moesq pack --push-to-hub`, as the design card writes it: ./moesq-work packed into moesq-work/packed and
    pushed to <user>/<model>-moesq-<format>; offline, one error line and the pack stays."""
    shutil.copytree(stages["p48-nvfp4"].root, tmp_path / "moesq-work", ignore=shutil.ignore_patterns("packed"))
    r = moesq_here("pack", "--push-to-hub", check=False, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "-moesq-p48-nvfp4" in err[0] and "intact" in r.stderr.replace("\n", " ")
    assert moesq_here("verify", tmp_path / "moesq-work" / "packed", "--quiet").returncode == 0
