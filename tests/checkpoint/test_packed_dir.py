"""Packed directories of every format, built once per session from the embedded model (conftest: stages, packs):
what stock tools read (compressed-tensors config and decompression), checksums that catch every flipped byte, safe
--out handling, byte-deterministic output, file modes, the model card, load_packed / generate."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import stat
from pathlib import Path

import pytest
import torch

from moesq_core.checkpoint.checksums import PACK_MANIFEST, safetensors_layout
from moesq_core.checkpoint.model_card import model_card
from moesq_core.checkpoint.verify import verify_packed_dir
from moesq_core.compression.export import check_output_dir, export_packed, input_global_scales
from moesq_core.serving.loader import load_packed

from conftest import EVAL, packed_expert_linears
from conftest import PACK_FORMATS as FORMATS


def _digests(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


# ---- what the directory holds --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_verifies_with_checksums_and_modes(packs, fmt):
    wd, out, summary = packs[fmt]
    report = verify_packed_dir(out)
    assert report.ok, report.first_error
    assert report.checksums == "ok" and report.checksum_files == len(summary["files"]) - 1
    assert oct(stat.S_IMODE(out.stat().st_mode)) == "0o755"
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in out.rglob("*")} == {"0o644"}
    assert sorted(p.name for p in out.iterdir()) == summary["files"]
    assert not list(out.parent.glob(f".{out.name}.*"))  # no temp dirs left beside it
    doc = report.to_dict()
    assert doc["schema"] == "moesq.verify/1" and doc["ok"] and doc["expert_linears"] == len(report.rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_input_global_scales_are_finite_and_positive(packs, fmt):
    from safetensors import safe_open

    wd, out, summary = packs[fmt]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        scales = [f.get_tensor(k) for k in f.keys() if k.endswith("input_global_scale")]
    if fmt == "s24-fp8":
        assert not scales  # FP8 activations are scaled per token
    else:
        assert len(scales) == 4 * 8 * 3 and all(bool(torch.isfinite(s).all() and (s > 0).all()) for s in scales)


def test_input_global_scale_fallback_never_zero():
    amax = torch.tensor([2.0, 0.0, 8.0, 0.0])
    g, n = input_global_scales(amax)
    assert n == 2 and bool((g > 0).all() and torch.isfinite(g).all())
    assert g[1] == g[3] == input_global_scales(torch.tensor([8.0]))[0][0]  # the layer's largest calibrated range
    g, n = input_global_scales(torch.zeros(3))
    assert n == 3 and torch.equal(g, torch.ones(3))
    assert input_global_scales(None) == (None, 0)


def test_fake_quantized_module_uses_the_packs_fallback_scale():
    from moesq_core.formats import get_format
    from moesq_core.serving.experts import MoesqExperts

    fmt = get_format("p48-nvfp4")
    gen = torch.Generator().manual_seed(0)
    weights = [{p: fmt.quantize(torch.randn(64 if p != "down" else 32, 32 if p != "down" else 64, generator=gen))
                for p in ("gate", "up", "down")} for _ in range(3)]
    amax = torch.tensor([2.0, 0.0, 8.0])  # expert 1 saw no calibration token
    m = MoesqExperts.from_quantized(fmt, weights, True, amax, amax)
    g, _ = input_global_scales(amax)
    assert torch.equal(m.act_global_in, g) and torch.equal(m.act_global_mid, g) and bool((g > 0).all())


def test_pack_is_byte_deterministic(stages, packs, tmp_path):
    wd, out, _ = packs["p48-nvfp4"]
    again = tmp_path / "again"
    export_packed(wd, "init-rtn", again)
    assert _digests(again) == _digests(out)


# ---- stock tools -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["p48-nvfp4", "dense-nvfp4"])
def test_standard_configs_pass_compressed_tensors_validation(packs, fmt):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    qc = json.loads((packs[fmt][1] / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.quantization_status == QuantizationStatus.COMPRESSED and parsed.format == "nvfp4-pack-quantized"
    w = parsed.config_groups["group_0"].weights
    block = 32 if fmt == "p48-nvfp4" else 16
    assert (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric, w.dynamic) == (
        4, "float", "tensor_group", block, True, False)
    assert parsed.config_groups["group_0"].input_activations.group_size == block
    assert "lm_head" in parsed.ignore and "model.layers.0.mlp.gate" in parsed.ignore
    if fmt == "p48-nvfp4":  # as the public release writes it
        assert qc["paired48_sparse"] == {"layout": "pair-bitmask", "version": 1} and qc["group_size"] == 32
        assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
        assert qc["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.float8_e4m3fn"


def test_s24_config_is_refused_cleanly_by_stock_parsing(packs):
    import pydantic
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.utils.quantization_config import CompressedTensorsConfig

    qc = json.loads((packs["s24-fp8"][1] / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "moesq-sparse24-fp8" and qc["moesq_sparse24"] == {"layout": "values-meta", "version": 1}
    assert qc["quantization_status"] == "compressed"
    with pytest.raises(pydantic.ValidationError, match="moesq-sparse24-fp8"):
        QuantizationConfig.model_validate(qc)
    with pytest.raises(pydantic.ValidationError, match="moesq-sparse24-fp8"):  # what from_pretrained parses
        CompressedTensorsConfig.from_dict(qc)


def test_dense_nvfp4_decompresses_bit_exactly_with_compressed_tensors(packs):
    """compressed-tensors' own NVFP4 decompressor on our files gives exactly load_packed's expert weights."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    out = packs["dense-nvfp4"][1]
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    model, _ = load_packed(out)
    checked = 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for base, mine, sd in packed_expert_linears(model, f, ("weight_packed", "weight_scale", "weight_global_scale")):
            theirs = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]  # bf16: its decode dtype
            assert torch.equal(theirs.float(), mine.to(theirs.dtype).float()), base
            checked += 1
    assert checked == 4 * 8 * 3


def test_load_packed_reads_tensor_by_tensor(packs, monkeypatch):
    import safetensors.torch

    def whole_file(*a, **k):
        raise AssertionError("load_packed must not read whole shards")

    monkeypatch.setattr(safetensors.torch, "load_file", whole_file)
    model, tok = load_packed(packs["dense-nvfp4"][1])
    assert tok is not None and sum(1 for _ in model.parameters()) > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_generate_loads_every_format(packs, fmt):
    from moesq_core.serving.generate import generate_text

    doc = generate_text(packs[fmt][1], ["Memory barriers order"], max_new_tokens=4, device="cpu")
    assert doc["schema"] == "moesq.generate/2" and doc["format"] == fmt and doc["new_tokens"] == 4
    assert doc["experts_module"] == ["MoesqExperts"] and isinstance(doc["completions"][0]["completion"], str)
    assert doc["dtype"] == "float32" and doc["batch_size"] == 1 and doc["decode"]["cuda_graph"] is False


# ---- model card ------------------------------------------------------------------------------------------------
def test_model_card_front_matter(packs, tmp_path):
    from huggingface_hub import ModelCard

    for fmt in FORMATS:
        card = ModelCard.load(packs[fmt][1] / "README.md")
        assert card.data.pipeline_tag == "text-generation"
        assert card.data.base_model is None  # a local source: no Hub id to name
        assert "http" not in card.text and "load_packed" in card.text  # no placeholder link; names the loader
        if fmt == "dense-nvfp4":  # loads in transformers without moesq, but wrongly: the card says so
            assert "returns experts multiplied by their global scale" in card.text
        else:
            assert "refuse" in card.text or "cannot load" in card.text
    tags = {fmt: set(ModelCard.load(packs[fmt][1] / "README.md").data.tags) for fmt in FORMATS}
    assert {"nvfp4", "sparse"} <= tags["p48-nvfp4"] and "sparse" not in tags["dense-nvfp4"]
    assert "fp8" in tags["s24-fp8"] and "nvfp4" not in tags["s24-fp8"]
    # a base model with a license and a Hub id
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# base\n")
    summary = json.loads((packs["p48-nvfp4"][1] / PACK_MANIFEST).read_text())["summary"]
    wd = packs["p48-nvfp4"][0]
    identity = dataclasses.replace(wd.identity(), model_source="Qwen/Qwen3-30B-A3B", model_path=base)
    card = ModelCard(model_card(identity, wd.load(), summary))
    assert card.data.license == "apache-2.0" and card.data.base_model == "Qwen/Qwen3-30B-A3B"
    assert card.data.base_model_relation == "quantized" and card.data.library_name == "moesq"
    assert card.data.datasets is None  # calibrated on a local file
    # calibrated on a Hub dataset: the card names it in its front matter, as the Hub links datasets
    for source, dataset in (("allenai/c4:en@train", "allenai/c4"), ("wikitext:wikitext-2-raw-v1@test", "wikitext")):
        card = ModelCard(model_card(dataclasses.replace(identity, calib_source=source), wd.load(), summary))
        assert card.data.datasets == [dataset] and f"of {source}:" in card.text


def test_the_cards_python_runs_as_written_and_the_pack_carries_its_recipe(packs, tmp_path, monkeypatch):
    """The card's Python snippets run as written on the pack (with what the README installs: no accelerate),
    the loaders it names are the current ones, and recipe.yaml loads back to the configuration that made it."""
    import re

    from moesq_core import CompressConfig

    wd, out, _ = packs["p48-nvfp4"]
    text = (out / "README.md").read_text()
    assert "device_map" not in text and "accelerate" not in text  # not a moesq dependency
    assert "Triton" not in text and "pip install moesq" not in text
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2
    for block in blocks:
        scope: dict = {}
        exec(block.replace('"DIR"', repr(str(out))), scope)
        assert type(scope["model"]).__name__.endswith("ForCausalLM")
    recipe = CompressConfig.from_file(out / "recipe.yaml")
    assert (recipe.init.name, recipe.refine, recipe.format) == ("rtn", None, "p48-nvfp4")
    assert recipe.calib == wd.identity().calib
    assert "recipe.yaml" in json.loads((out / PACK_MANIFEST).read_text())["files"]  # checksummed with the rest


def test_model_card_says_how_it_was_made_how_it_evaluated_and_how_to_load_it(micro_path, tmp_path):
    """A refined micro model, evaluated (perplexity and the shipped lm-eval task) and packed: the card carries
    the front matter, the calibration in sequences x tokens, the configuration as a recipe that loads back to
    it, the work dir's evaluation numbers for the stage and the ways to load it."""
    import re

    import yaml
    from huggingface_hub import ModelCard

    from moesq_core import CompressConfig, compress
    from moesq_core.compression.workdir import WorkDir
    from moesq_core.eval.runner import ResultCache, load_target, ppl_for_targets, resolve_targets, target_identity

    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
    from moesq_core.eval import lm_eval_tasks

    wd = tmp_path / "wd"
    cfg = CompressConfig.from_dict({"calib": {"seq_len": 32, "n_train": 4, "n_val": 2, "n_init": 4},
                                    "init": {"method": "rtn"},
                                    "refine": {"epochs": 1, "steps_per_epoch": 2, "e2e_steps": 0,
                                               "init_split_rows": False}})
    compress(micro_path, cfg, workdir=wd, device="cpu")
    targets = resolve_targets([str(wd)])
    rows = ppl_for_targets(targets, EVAL, max_tokens=1024, window=256, cache=ResultCache(wd / "eval" / "results.json"))
    scores = {}
    for t in targets:
        model, tok = load_target(t)
        res = lm_eval_tasks.evaluate_tasks(model, tok, "moesq_cloze", label=t.label, limit=8, batch_size=4,
                                           cache_dir=wd / "eval" / "lm_eval", model_id=target_identity(t))
        scores[t.label] = res.results["moesq_cloze"].metric("acc_norm")
    export_packed(WorkDir(wd), "refine", tmp_path / "packed")
    card = ModelCard.load(tmp_path / "packed" / "README.md")
    d = card.data
    assert (d.library_name, d.pipeline_tag, d.base_model) == ("moesq", "text-generation", None)  # a local source
    assert {"moesq", "moe", "quantized", "nvfp4", "sparse"} <= set(d.tags)
    text = card.text
    assert "- Calibration: 10 sequences × 32 tokens (320 tokens cut from " in text
    used = int(re.search(r"cut from ([\d,]+) documents", text).group(1).replace(",", ""))
    assert used == WorkDir(wd).load()["calibration"]["documents"] and 0 < used < 100  # not the file's 11,644
    assert "4 for refinement, 2 held out for its validation, 4 for the one-shot init" in text
    assert "calib-sample.txt.xz" in text and str(tmp_path) not in text and "/work" not in text  # no machine paths
    recipe = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    assert recipe["calib_source"] is None  # the embedded sample, as a recipe names it
    assert CompressConfig.from_dict(recipe).to_dict() == cfg.to_dict()  # the same configuration
    assert CompressConfig.from_file(tmp_path / "packed" / "recipe.yaml").to_dict() == cfg.to_dict()  # and its file
    ref, refined = (next(r["ppl"] for r in rows if r["kind"] == k) for k in ("reference", "stage"))
    assert f"| reference (base model) | {ref:.3f} |  | {EVAL.name} | 1,024 (256) |" in text
    assert f"| this model (refine) | {refined:.3f} | {refined / ref:.3f} | {EVAL.name} | 1,024 (256) |" in text
    assert f"| moesq_cloze | acc_norm | {scores['reference']:.4f} | {scores['refine']:.4f} |" in text
    for how in ("from moesq_core import load_packed", 'load_packed("DIR")', "moesq generate DIR --prompt",
                "moesq verify DIR"):
        assert how in text


def test_additional_chat_templates_are_carried(stages, micro_path, tmp_path):
    """The source's named chat templates (additional_chat_templates/*.jinja, which transformers' tokenizers read)
    go into the pack and its checksum manifest, and the pack's tokenizer has them."""
    from moesq_core.compression.workdir import WorkDir

    src = tmp_path / "model"
    shutil.copytree(micro_path, src)
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    wd = WorkDir(tmp_path / "wd")
    shutil.copytree(stages["p48-nvfp4"].root, wd.root)
    m = wd.load()
    m["model"]["path"] = str(src)
    wd.save(m)
    out = tmp_path / "pack"
    summary = export_packed(wd, "init-rtn", out)
    assert "additional_chat_templates/tool_use.jinja" in summary["files"]
    assert verify_packed_dir(out, checksums_only=True).ok
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)  # what load_packed returns (it checks the files as above)
    assert tok.chat_template["tool_use"] == "{{ messages[0]['content'] }}"


# ---- checksums -------------------------------------------------------------------------------------------------
def test_every_single_byte_flip_is_detected(packs, tmp_path):
    """200 seeded single-byte flips spread over every file of a packed dir: verify catches all of them and,
    inside a safetensors tensor's bytes, names that tensor. Every flip goes through the checksum pass; every
    20th through the full verify (checksums + structure: seconds each on a 2-core CPU)."""
    d = tmp_path / "p"
    shutil.copytree(packs["p48-nvfp4"][1], d)
    files = sorted(p for p in d.iterdir() if p.is_file())
    rng = random.Random(0)
    missed, misnamed = [], []
    for n in range(200):
        f = rng.choice(files)  # every file gets flips, small JSON files included
        data = bytearray(f.read_bytes())
        i = rng.randrange(len(data))
        orig = data[i]
        data[i] ^= rng.randrange(1, 256)
        f.write_bytes(bytes(data))
        try:
            report = verify_packed_dir(d, checksums_only=n % 20 != 0)
            if report.ok:
                missed.append((f.name, i))
            elif f.suffix == ".safetensors":
                start, ranges = safetensors_layout(packs["p48-nvfp4"][1] / f.name)
                owner = next((n for n, (a, b) in ranges.items() if a <= i - start < b), None)
                if owner is not None and report.first_error.tensor != owner:
                    misnamed.append((f.name, i, owner, str(report.first_error)))
        finally:
            data[i] = orig
            f.write_bytes(bytes(data))
    assert not missed, missed
    assert not misnamed, misnamed
    assert verify_packed_dir(d).ok


def test_changed_global_scale_is_blamed_on_the_changed_tensor(packs, tmp_path):
    """A gate/up shared-scale mismatch names the tensor that was changed, gate or up."""
    from safetensors.torch import load_file, save_file

    for proj in ("gate_proj", "up_proj"):
        d = tmp_path / proj
        shutil.copytree(packs["p48-nvfp4"][1], d)
        name = f"model.layers.2.mlp.experts.5.{proj}.weight_global_scale"
        sd = load_file(str(d / "model.safetensors"))
        sd[name] = sd[name] * 2
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        report = verify_packed_dir(d)
        assert report.first_error.tensor == name and "checksum mismatch" in report.first_error.problem
        shared = [e for e in report.errors if "share one weight global scale" in e.problem]
        assert [e.tensor for e in shared] == [name] and "changed after packing" in shared[0].problem


def test_damaged_manifest_is_reported(packs, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(packs["dense-nvfp4"][1], d)
    body = json.loads((d / PACK_MANIFEST).read_text())
    body["summary"]["bits_per_weight"] = 1.0  # a plausible edit, valid JSON
    (d / PACK_MANIFEST).write_text(json.dumps(body, sort_keys=True, indent=1) + "\n")
    report = verify_packed_dir(d)
    assert report.first_error.tensor == PACK_MANIFEST and "manifest_sha256" in report.first_error.problem
    (d / PACK_MANIFEST).unlink()  # a moesq pack without its manifest fails (its structure is still checked)
    report = verify_packed_dir(d)
    assert not report.ok and report.checksums == "absent" and report.first_error.tensor == PACK_MANIFEST
    assert report.first_error.problem.startswith("missing") and len(report.errors) == 1 and report.rows


# ---- where a pack may go ---------------------------------------------------------------------------------------
def test_out_dir_validation_loses_nothing(packs, tmp_path, micro_path):
    wd, out, _ = packs["p48-nvfp4"]
    src = Path(wd.load()["model"]["path"])
    with pytest.raises(ValueError, match="is the work dir"):
        check_output_dir(wd.root, wd.root, src, True)
    with pytest.raises(ValueError, match="inside the work dir"):
        check_output_dir(wd.root / "stages", wd.root, src, True)
    check_output_dir(wd.root / "packed", wd.root, src, True)  # the work dir's own pack slot is fine
    with pytest.raises(ValueError, match="source model"):
        check_output_dir(src, wd.root, src, True)
    with pytest.raises(ValueError, match="source model"):
        check_output_dir(src / "sub", wd.root, src, True)
    with pytest.raises(ValueError, match="contains the work dir"):
        check_output_dir(wd.root.parent, wd.root, src, True)
    f = tmp_path / "a-file"
    f.write_text("keep me")
    with pytest.raises(FileExistsError, match="existing file"):
        check_output_dir(f, wd.root, src, True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a moesq pack"):
        export_packed(wd, "init-rtn", user, overwrite=True)
    assert (user / "notes.txt").read_text() == "mine" and f.read_text() == "keep me"
    # an earlier pack plus one user file is not a pack any more
    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    (mixed / "extra.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a moesq pack"):
        export_packed(wd, "init-rtn", mixed, overwrite=True)
    assert (mixed / "extra.txt").is_file()


def test_overwrite_replaces_only_an_earlier_pack_atomically(packs, tmp_path, monkeypatch):
    wd, out, _ = packs["p48-nvfp4"]
    target = tmp_path / "target"
    shutil.copytree(out, target)
    (target / "model.safetensors").write_bytes(b"damaged earlier pack")  # still replaceable: only its own files
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_packed(wd, "init-rtn", target)
    before = _digests(target)
    import moesq_core.compression.export as export_mod

    def boom(*a, **k):
        raise RuntimeError("interrupted while writing the manifest")

    monkeypatch.setattr(export_mod, "write_manifest", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        export_packed(wd, "init-rtn", target, overwrite=True)
    assert _digests(target) == before  # the earlier pack is untouched until the new one is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no temp dirs left
    monkeypatch.undo()
    (tmp_path / ".target.tmp-mine").mkdir()  # a temp dir's name, but no marker of moesq's: never touched
    export_packed(wd, "init-rtn", target, overwrite=True)
    assert _digests(target) == _digests(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".target.tmp-mine", "target"]


@torch.no_grad()
def test_dense_p48_layout_loads_like_the_sparse_one(packs, tmp_path):
    """--dense-layout: the release's dense variant (no marker) gives the same model as the sparse layout, through
    load_packed and through from_pretrained with moesq imported; without moesq, transformers refuses it (its
    config names a format of moesq's own, which compressed-tensors' parsing refuses, as the card says), where
    it used to load the experts as plain NVFP4, wrongly."""
    import pydantic
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    import moesq_core  # noqa: F401  (routes moesq packs through transformers' loader)

    wd, sparse, _ = packs["p48-nvfp4"]
    dense = tmp_path / "dense"
    summary = export_packed(wd, "init-rtn", dense, sparse_layout=False)
    qc = json.loads((dense / "config.json").read_text())["quantization_config"]
    assert "paired48_sparse" not in qc and qc["format"] == "moesq-dense-p48"
    with pytest.raises(pydantic.ValidationError, match="moesq-dense-p48"):  # what stock from_pretrained parses
        CompressedTensorsConfig.from_dict(qc)
    card = ModelCard.load(dense / "README.md").text
    assert "paired48_sparse" not in card and "raises while converting" not in card
    assert "`moesq-dense-p48`: compressed-tensors' config parsing, and so transformers without" in card
    report = verify_packed_dir(dense)
    assert report.ok and {r.format for r in report.rows} == {"dense-p48"}
    assert summary["bits_per_weight"] == pytest.approx(4.25, abs=0.01) and summary["layout"] == "dense-p48"
    ids = torch.arange(3, 40).reshape(1, -1)
    a, b = load_packed(sparse)[0](input_ids=ids).logits, load_packed(dense)[0](input_ids=ids).logits
    assert torch.equal(a, b)
    assert torch.equal(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)(input_ids=ids).logits, a)
