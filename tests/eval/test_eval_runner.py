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
