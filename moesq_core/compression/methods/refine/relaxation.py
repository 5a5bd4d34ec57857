"""The continuous relaxation of a pattern choice (paper eq. 2): Gumbel-softmax over a pattern set.

A weight [..., O, K] under pattern set `ps` (groups of `ps.group` columns, P admissible patterns) gets logits
A [..., O, K/group, P]. Each training step draws fresh Gumbel noise G and takes
    π = softmax((gain·A + G) / τ),   Z = π · P   (soft mask, each group sums to ps.kept_per_group),
so the soft weight Z ⊙ V is differentiable in both A and V. As τ → 0 π becomes one-hot (the argmax of
gain·A + G); the exported mask is the noise-free argmax of A.
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch

from moesq_core.formats import PatternSet

Generators = Union[torch.Generator, Sequence[torch.Generator], None]


def draw(sample, shape, generator: Generators, device, dtype=torch.float32) -> torch.Tensor:
    """`sample` (torch.rand / torch.randn) of `shape`. A sequence of generators draws each index of the leading
    axis from its own generator (one per expert: an expert's numbers then do not depend on the others)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for a leading axis of {shape[0]}")
        out = torch.empty(tuple(shape), device=device, dtype=dtype)
        for o, g in zip(out, generator):  # drawn in place: no per-expert copies to stack
            sample(tuple(shape[1:]), generator=g, out=o)
        return out
    return sample(tuple(shape), generator=generator, device=device, dtype=dtype)


def gumbel_noise(shape, generator: Generators, device, dtype=torch.float32) -> torch.Tensor:
    """Standard Gumbel samples −log(−log U). U is clamped away from 0 and 1 so the result stays finite."""
    u = draw(torch.rand, shape, generator, device, dtype)
    tiny = torch.finfo(dtype).tiny
    return -torch.log(-torch.log(u.clamp(tiny, 1.0 - torch.finfo(dtype).eps)))


def pattern_probs(A: torch.Tensor, tau: float, gain: float = 1.0, noise: torch.Tensor | None = None) -> torch.Tensor:
    """π = softmax((gain·A + G)/τ) over the last (pattern) axis."""
    if tau <= 0:
        raise ValueError(f"temperature must be positive, got {tau}")
    logits = A * gain
    if noise is not None:
        logits = logits + noise
    return torch.softmax(logits / tau, dim=-1)


def soft_mask(probs: torch.Tensor, ps: PatternSet) -> torch.Tensor:
    """Z = π · P: [..., G, P] pattern probabilities -> [..., G*group] expected keep mask."""
    z = probs @ ps.pattern_matrix(probs.device, probs.dtype)
    return z.reshape(*z.shape[:-2], z.shape[-2] * ps.group)


def hard_index(A: torch.Tensor) -> torch.Tensor:
    """The exported pattern per group: argmax of the noise-free logits (ties -> lowest index)."""
    return A.argmax(-1)


def hard_mask(A: torch.Tensor, ps: PatternSet) -> torch.Tensor:
    return ps.mask_from_index(hard_index(A))


def init_logits(mask: torch.Tensor, ps: PatternSet, generator: Generators = None,
                noise: float = 0.01, match: float = 4.0) -> torch.Tensor:
    """A = noise·(N(0,1) + match·c), c the centred overlap of each pattern with the init support.

    mask: bool [..., O, K] -> fp32 [..., O, K/group, P]. fp32 on purpose: Lion's steps of ~1e-4 vanish
    against logits of ~1e-2 in bf16 (a fault of the public release).
    """
    c = ps.overlap_init(mask)
    n = draw(torch.randn, c.shape, generator, c.device)
    return noise * (n + match * c.float())


def init_gap(ps: PatternSet, noise: float = 0.01, match: float = 4.0) -> float:
    """The noise-free lead of the init's pattern over its nearest rival in init_logits:
    noise·match·(c_match − c_next), from the same overlap formula (paired 4:8 and 2:4: 0.01·4·(2 − 0) = 0.08)."""
    if ps.num_patterns < 2:
        return math.inf
    c = ps.overlap_init(ps.mask_from_index(torch.zeros(1, 1, dtype=torch.long)))[0, 0].sort(descending=True).values
    return float(noise * match * (c[0] - c[1]))
