"""The router-weighted reconstruction objective (paper eq. 4, generalised to w^p as the release ships it).

Per expert e: L_e = Σ_t w_t^p ‖ŷ_t − y_t‖² / (Σ_t w_t^p · hidden), over the tokens routed to e.
p = 2 is the paper's eq. 4, ‖diag(w)(Y − f)‖²_F = Σ_t w_t²‖y_t − ŷ_t‖² (the norm is squared, so are the
weights), and the release's default; p = 0 is plain MSE (the paper's "uniform loss" ablation); p = 1 weights
tokens by w itself (neither the paper's formula nor its ablation). Tensors are batched over
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


def _residual(yhat: torch.Tensor, y: torch.Tensor, tw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d = ŷ − y in fp32 whatever ŷ's dtype, Σ_t tw_t ‖d_t‖² per expert)."""
    d = torch.sub(yhat, y.float())  # promotes to fp32 inside the one kernel
    return d, (torch.linalg.vector_norm(d, dim=-1).square() * tw).sum(-1)


def _grad(d: torch.Tensor, tw: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2·g_e·tw_t·d_t, the gradient of Σ_e g_e·num_e, written straight in `dtype` (no fp32 copy)."""
    gy = torch.empty(d.shape, dtype=dtype, device=d.device)
    return torch.mul(d, (2.0 * g[:, None] * tw)[..., None], out=gy)


class _WeightedSqError(torch.autograd.Function):
    """Σ_t tw_t ‖ŷ_t − y_t‖² with a hand-written backward: the [E, C, H] residual is formed once (in fp32,
    whatever ŷ's dtype) and the gradient 2·tw·g·d is written straight in ŷ's dtype — a third of the memory
    traffic of the autograd chain (cast, sub, square, sum and their backwards) on the widest tensors."""

    @staticmethod
    def forward(ctx, yhat, y, tw):
        d, num = _residual(yhat, y, tw)
        ctx.save_for_backward(d, tw)
        ctx.yhat_dtype = yhat.dtype
        return num

    @staticmethod
    def backward(ctx, g):
        d, tw = ctx.saved_tensors
        return _grad(d, tw, g, ctx.yhat_dtype), None, None


def weighted_sq_error(yhat: torch.Tensor, y: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
    """Σ_t tw_t ‖ŷ_t − y_t‖² per expert: yhat, y [E, C, H], tw [E, C] -> [E] (differentiable in yhat)."""
    return _WeightedSqError.apply(yhat, y, tw.float())


def weighted_sq_error_and_grad(yhat: torch.Tensor, y: torch.Tensor, tw: torch.Tensor,
                               scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num [E], ∂(Σ_e scale_e·num_e)/∂ŷ in ŷ's dtype) with num = weighted_sq_error(yhat, y, tw), both from
    one pass over the residual. Refinement's loss is this weighted sum with known per-expert scales, so its
    gradient can be written while ŷ and y are read for the forward (the same numbers _WeightedSqError's
    backward computes for that loss), and the backward pass starts from it instead of reading ŷ and y again."""
    tw = tw.float()
    d, num = _residual(yhat.detach(), y, tw)
    return num, _grad(d, tw, scale, yhat.dtype)


def normalise(num: torch.Tensor, den: torch.Tensor, hidden: int) -> torch.Tensor:
    """num / (den·hidden) per expert; experts without weighted tokens (den = 0) get 0, never NaN."""
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / (safe * hidden), torch.zeros_like(num))


def routed_loss(yhat: torch.Tensor, y: torch.Tensor, w: torch.Tensor, valid: torch.Tensor, p: int = 2) -> torch.Tensor:
    """The normalised per-expert loss [E] of one batch (all its tokens in one call)."""
    tw = token_weights(w, valid, p)
    return normalise(weighted_sq_error(yhat, y, tw), tw.sum(-1), y.shape[-1])
