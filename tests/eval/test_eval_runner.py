"""The perplexity rows of `moesq eval` / `moesq run`: a target that computes exactly what one evaluated before it
(a packed dir and its stage on the CPU) takes that perplexity, and only then."""
from __future__ import annotations

import pytest
import torch

from moesq_core.eval.perplexity import load_eval_tokens, perplexity
from moesq_core.eval.runner import computation_fingerprint, load_target, ppl_for_targets, resolve_targets

from conftest import EVAL

TOKENS = 2048


@pytest.mark.parametrize("fmt", ["p48-nvfp4", "dense-nvfp4"])
def test_packed_dir_takes_its_stages_perplexity_and_it_is_the_evaluated_one(packs, fmt):
    wd, out, _ = packs[fmt]
    rows = {r["label"]: r for r in ppl_for_targets(resolve_targets([str(wd.root), str(out)]), EVAL, max_tokens=TOKENS)}
    packed, stage = rows["packed:packed" if "packed:packed" in rows else f"packed:{out.name}"], rows["rtn"]
    assert packed["same_as"] == "rtn" and "same_as" not in stage and "same_as" not in rows["reference"]
    model, tok = load_target(resolve_targets([str(out)])[0])  # the packed model, evaluated after all
    assert perplexity(model, load_eval_tokens(tok, EVAL, TOKENS), 512) == packed["ppl"] == stage["ppl"]
    assert rows["reference"]["ppl"] < stage["ppl"]


def test_fingerprint_sees_one_weight_bit_a_module_setting_and_the_tokens(packs):
    wd, out, _ = packs["p48-nvfp4"]
    model, tok = load_target(resolve_targets([str(out)])[0])
    tokens = load_eval_tokens(tok, EVAL, TOKENS)
    base = computation_fingerprint(model, tokens)
    assert computation_fingerprint(model, tokens) == base
    experts = model.model.layers[1].mlp.experts
    w = experts.down_proj.view(torch.int32)
    w[3, 5, 7] ^= 1  # one mantissa bit of one expert weight
    assert computation_fingerprint(model, tokens) != base
    w[3, 5, 7] ^= 1
    experts.act_quant = False  # weights only: another computation on the same tensors
    assert computation_fingerprint(model, tokens) != base
    experts.act_quant = True
    assert computation_fingerprint(model, tokens) == base
    assert computation_fingerprint(model, tokens[:-1]) != base


def _edit_pack_config(pack, edit) -> None:
    """Change the pack's config.json and record it in its checksum manifest, as if the pack were written so."""
    import json

    from moesq_core.checkpoint.checksums import PACK_MANIFEST, write_manifest

    config = json.loads((pack / "config.json").read_text())
    edit(config)
    (pack / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_manifest(pack, json.loads((pack / PACK_MANIFEST).read_text())["summary"])


def test_a_cached_perplexity_is_for_the_packs_content(packs, tmp_path):
    """The cache is keyed on what loading reads: a pack whose config.json changed is evaluated again (not the
    cached number reprinted), one changed after packing is refused as loading refuses it, and one whose config
    lost quantization_config is refused, not evaluated as a reference model."""
    import shutil

    from moesq_core.eval.runner import ResultCache

    pack = tmp_path / "pack"
    shutil.copytree(packs["p48-nvfp4"][1], pack)
    cache = ResultCache(tmp_path / "results.json")
    ppl = lambda: ppl_for_targets(resolve_targets([str(pack)]), EVAL, max_tokens=256, window=128,  # noqa: E731
                                  cache=cache)[0]["ppl"]
    w4a4, packed_config = ppl(), (pack / "config.json").read_bytes()
    _edit_pack_config(pack, lambda c: c["quantization_config"]["moesq"].update(act_quant=False))
    weights_only = ppl()
    assert weights_only != w4a4
    (pack / "config.json").write_bytes(packed_config)  # the first result's content, but not what the manifest says
    with pytest.raises(ValueError, match=r"config\.json: .*run `moesq verify"):
        ppl()
    _edit_pack_config(pack, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match="no quantization_config.moesq"):
        resolve_targets([str(packs["p48-nvfp4"][0].root), str(pack)])
