"""The router-weighted reconstruction objective (paper eq. 4, generalised to w^p as the release ships it).

Per expert e: L_e = Σ_t w_t^p ‖ŷ_t − y_t‖² / (Σ_t w_t^p · hidden), over the tokens routed to e.
p = 0 is plain MSE, p = 1 the paper's formula, p = 2 the release's default. Tensors are batched over
experts and capacity-padded: `valid` marks real token rows, padding rows get weight 0 whatever w says.
"""
from __future__ import annotations

import torch

LOSS_POWERS = (0, 1, 2)


def check_power(p) -> int:
    if p not in LOSS_POWERS:
        raise ValueError(f"loss_power must be one of {LOSS_POWERS} (weight tokens by w^p), got {p!r}")
    return int(p)


def token_weights(w: torch.Tensor, valid: torch.Tensor, p: int) -> torch.Tensor:
    """w^p on valid rows, 0 on padding. w, valid: [E, C]."""
    p = check_power(p)
    v = valid.to(torch.float32)
    if p == 0:
        return v
    w = w.float() * v
    return w if p == 1 else w * w


def weighted_sq_error(yhat: torch.Tensor, y: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
    """Σ_t tw_t ‖ŷ_t − y_t‖² per expert: yhat, y [E, C, H], tw [E, C] -> [E]."""
    d = yhat.float() - y.float()
    return (tw * d.square().sum(-1)).sum(-1)


def normalise(num: torch.Tensor, den: torch.Tensor, hidden: int) -> torch.Tensor:
    """num / (den·hidden) per expert; experts without weighted tokens (den = 0) get 0, never NaN."""
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / (safe * hidden), torch.zeros_like(num))


def routed_loss(yhat: torch.Tensor, y: torch.Tensor, w: torch.Tensor, valid: torch.Tensor, p: int = 2) -> torch.Tensor:
    """The normalised per-expert loss [E] of one batch (all its tokens in one call)."""
    tw = token_weights(w, valid, p)
    return normalise(weighted_sq_error(yhat, y, tw), tw.sum(-1), y.shape[-1])
