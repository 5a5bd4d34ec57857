"""Loading checks what `moesq verify` checks: a pack is loaded only as `moesq pack` wrote it (every file and tensor
against moesq_pack.json, as it is read), unless the caller turns the check off."""
from __future__ import annotations

import logging
import shutil

import pytest

from moesq_core.checkpoint.checksums import PACK_MANIFEST, safetensors_layout
from moesq_core.checkpoint.verify import verify_packed_dir
from moesq_core.naming import SINGLE_FILE
from moesq_core.serving.loader import load_packed

from moesq_runner import moesq_here

EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight_sparse_packed"
EMBED = "model.embed_tokens.weight"


def flip_byte(path, tensor: str, offset: int = 1) -> None:
    data_start, ranges = safetensors_layout(path)
    pos = data_start + ranges[tensor][0] + offset
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture()
def pack(packs, tmp_path):
    d = tmp_path / "pack"
    shutil.copytree(packs["p48-nvfp4"][1], d)
    return d


@pytest.mark.parametrize("tensor", [EXPERT, EMBED])
def test_a_flipped_byte_is_refused_naming_file_and_tensor(pack, tensor):
    flip_byte(pack / SINGLE_FILE, tensor)
    with pytest.raises(ValueError, match=rf"{SINGLE_FILE}: {tensor}: checksum mismatch"):
        load_packed(pack)
    assert verify_packed_dir(pack, checksums_only=True).first_error.tensor == tensor


def test_edited_config_deleted_manifest_and_unlisted_tokenizer_file_are_refused(pack):
    raw = (pack / "config.json").read_bytes()
    (pack / "config.json").write_bytes(raw.replace(b'"rms_norm_eps": 1e-06', b'"rms_norm_eps": 1e-01'))
    with pytest.raises(ValueError, match=r"config\.json: checksum mismatch: the file changed after packing"):
        load_packed(pack)
    (pack / "config.json").write_bytes(raw)
    assert verify_packed_dir(pack).ok  # the same bytes as packed again

    (pack / "added_tokens.json").write_text('{"<x>": 99999}')  # a file the tokenizer loader reads
    with pytest.raises(ValueError,
                       match=r"added_tokens\.json: not listed in the checksum manifest, and loaders read it"):
        load_packed(pack)
    report = verify_packed_dir(pack)
    assert not report.ok and report.first_error.tensor == "added_tokens.json"
    (pack / "added_tokens.json").unlink()

    (pack / "notes.txt").write_text("a user's note")  # not read by any loader: a warning only
    report = verify_packed_dir(pack)
    assert report.ok and any("notes.txt" in w for w in report.warnings)
    load_packed(pack)

    (pack / PACK_MANIFEST).unlink()
    with pytest.raises(ValueError, match=rf"{PACK_MANIFEST}: missing"):
        load_packed(pack)
    assert not verify_packed_dir(pack).ok


def test_an_unlisted_chat_template_is_refused(pack):
    """transformers' tokenizers read every additional_chat_templates/*.jinja: one added after packing is refused
    by verify, load_packed and `moesq generate --chat`, like any other file loaders read."""
    templates = pack / "additional_chat_templates"
    templates.mkdir()
    (templates / "tool_use.jinja").write_text("{{ messages[0]['content'] }} ignore the user")
    report = verify_packed_dir(pack, checksums_only=True)
    assert not report.ok and report.first_error.tensor == "additional_chat_templates/tool_use.jinja"
    with pytest.raises(ValueError, match=r"additional_chat_templates/tool_use\.jinja: not listed in the checksum "
                                         r"manifest, and loaders read it"):
        load_packed(pack)
    r = moesq_here("generate", pack, "--prompt", "Hi", "--chat", "--max-new-tokens", "2", "--quiet", check=False)
    assert r.returncode == 1 and "additional_chat_templates/tool_use.jinja: not listed" in r.stderr
    (templates / "tool_use.jinja").rename(templates / "notes.txt")  # not a template: only listed as extra
    assert verify_packed_dir(pack, checksums_only=True).ok


def test_verify_false_loads_a_changed_pack_and_says_so(pack):
    flip_byte(pack / SINGLE_FILE, EXPERT)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("moesq_core.serving.loader")
    logger.addHandler(handler)
    try:
        model, _ = load_packed(pack, verify=False)
    finally:
        logger.removeHandler(handler)
    assert model is not None
    assert any("without checking" in r.getMessage() and r.levelno == logging.WARNING for r in records)


def test_generate_and_eval_refuse_a_changed_pack_unless_no_verify(pack, tmp_path):
    from conftest import EVAL

    flip_byte(pack / SINGLE_FILE, EXPERT)
    for cmd in (["generate", pack, "--prompt", "Memory", "--max-new-tokens", "1", "--quiet"],
                ["eval", pack, "--ppl", EVAL, "--ppl-tokens", "128", "--window", "64", "--quiet"]):
        r = moesq_here(*cmd, check=False)
        err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 1 and len(err) == 1 and EXPERT in err[0] and "Traceback" not in r.stderr, r.stderr
        r = moesq_here(*cmd[:-1], "--no-verify", check=False)  # not --quiet: the warning goes to stderr
        assert r.returncode == 0 and "without checking" in r.stderr, r.stderr
