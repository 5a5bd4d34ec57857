"""JSQ's pruning score, pinned on a hand-computed case."""
from __future__ import annotations

import math

import torch

from moesq_core.compression.methods.jsq import clip_activations, jsq_scores, range_saliency


def test_range_term_is_the_range_left_after_removing_the_weight():
    # x: 3 tokens × 2 inputs, W: 1 output row. y = x Wᵀ = [1, -3, -1].
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]])
    W = torch.tensor([[1.0, -3.0]])
    # without column 0: y − x[:,0]·1 = [0, -3, -3] -> range 3; without column 1: y + 3·x[:,1] = [1, 0, 2] -> range 2.
    # (The change of range, |4 − 3| and |4 − 2|, would give [1, 2]: the opposite order.)
    torch.testing.assert_close(range_saliency(x, W), torch.tensor([[3.0, 2.0]]))
    # budget=1 forces one input column per chunk: same result
    torch.testing.assert_close(range_saliency(x, W, budget=1), torch.tensor([[3.0, 2.0]]))


def test_score_mixes_wanda_and_the_range_term():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]])
    W = torch.tensor([[1.0, -3.0]])
    # ref_tokens = 3 (the number of tokens) makes ‖X_j‖ the plain column norm: √5 and √2.
    s = jsq_scores(W, x, rho=2.1, clip_h=0.0, range_tokens=0, ref_tokens=3)
    want = torch.tensor([[1 * math.sqrt(5) + 2.1 * 3, 3 * math.sqrt(2) + 2.1 * 2]])
    torch.testing.assert_close(s, want)


def test_activation_clipping_clamps_the_top_fraction():
    x = torch.tensor([[1.0, -10.0], [2.0, 3.0]])
    # 25 % of 4 entries = 1 entry clamped to the magnitude at that rank (10 itself): nothing changes
    torch.testing.assert_close(clip_activations(x, 0.25), x)
    # 50 %: the top 2 magnitudes (10, 3) clamp to 3, keeping signs
    torch.testing.assert_close(clip_activations(x, 0.5), torch.tensor([[1.0, -3.0], [2.0, 3.0]]))
