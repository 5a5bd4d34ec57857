"""Wanda (Sun et al. 2023): prune by |W_ij|·‖X_j‖₂, pick each group's pattern by that score, then RTN.

No weight update. gate and up are scored with the tokens routed to the expert, down with the dense SwiGLU
intermediate. ‖X_j‖₂² is the diagonal of the (optionally router-weighted) Hessian up to a constant, so
`hessian_weighting` applies here too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moesq_core.compression.methods.base import CompressedExpert, ExpertData, ProgressFn, compress_each
from moesq_core.compression.methods.hessian import check_weighting, input_sq_norms
from moesq_core.compression.methods.rtn import score_masked_expert
from moesq_core.formats import Format


def wanda_scores(W: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None = None,
                 weighting: str = "none") -> torch.Tensor:
    """|W_ij|·‖X_j‖₂ for W [out, in], x [n, in]."""
    return W.detach().float().abs() * input_sq_norms(x, w, weighting).sqrt()[None, :]


@dataclass
class Wanda:
    name: str = "wanda"
    hessian_weighting: str = "none"  # router weighting of the input norms: none | w | w2
    report_errors: bool = True

    def __post_init__(self):
        check_weighting(self.hessian_weighting)

    def compress_expert(self, ex: ExpertData, fmt: Format) -> CompressedExpert:
        return score_masked_expert(ex, fmt, self.name, lambda W, x: wanda_scores(W, x, ex.w, self.hessian_weighting),
                                   self.report_errors)

    def compress_block(self, experts: list[ExpertData], fmt: Format,
                       progress: ProgressFn | None = None) -> list[CompressedExpert]:
        return compress_each(experts, fmt, self.compress_expert, progress)
