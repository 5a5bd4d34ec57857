"""Round-to-nearest baselines, and the RTN step every one-shot method ends in or falls back to.

`rtn`: masks by |w| (the pattern keeping the largest summed magnitude per group; all-ones on dense formats),
then round-to-nearest in the format. `magnitude` produces exactly the same weights: it is the name the
paper's tables give to magnitude pruning + RTN on a sparse format (a sparsity-only variant cannot be
expressed as a `QuantizedWeight`, whose values are always codes of the format). Both share one global scale
between gate and up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moesq_core.compression.methods.base import PROJECTIONS, CompressedExpert, ExpertData, ProgressFn, compress_each
from moesq_core.compression.methods.hessian import expert_hessians, relative_error
from moesq_core.formats import Format, QuantizedWeight


def check_expert(ex: ExpertData, fmt: Format) -> None:
    """Shape/finite checks of all three projections and of the calibration inputs, with clear messages."""
    for p in PROJECTIONS:
        fmt.check_weight(getattr(ex, p), f"expert {ex.index} {p}_proj")
    inter, H = ex.gate.shape
    if ex.up.shape != (inter, H) or ex.down.shape != (H, inter):
        raise ValueError(
            f"expert {ex.index}: inconsistent shapes gate {tuple(ex.gate.shape)}, up {tuple(ex.up.shape)}, "
            f"down {tuple(ex.down.shape)} (expected [I, H], [I, H], [H, I])"
        )
    shape = tuple(ex.x.shape)
    if len(shape) != 2 or shape[1] != H:
        raise ValueError(f"expert {ex.index}: calibration inputs have shape {shape}, expected [n, {H}]")
    if ex.n_rows and not all(bool(torch.isfinite(p).all()) for _, p in ex.input_pieces()):
        raise ValueError(f"expert {ex.index}: non-finite calibration inputs")


def quantize_masked(fmt: Format, weights: dict[str, torch.Tensor],
                    masks: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    """RTN of gate/up/down under given masks; gate and up share one global scale from their masked weights."""
    g = fmt.global_scale(weights["gate"] * masks["gate"], weights["up"] * masks["up"])
    return {
        "gate": fmt.quantize(weights["gate"], masks["gate"], g),
        "up": fmt.quantize(weights["up"], masks["up"], g),
        "down": fmt.quantize(weights["down"], masks["down"]),
    }


def reconstruction_errors(ex: ExpertData, q: dict[str, QuantizedWeight], weighting: str = "none",
                          hessians: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """‖(W−Ŵ)X‖²/‖WX‖² per projection (down against the dense SwiGLU intermediate); {} without tokens."""
    if ex.n_rows == 0:
        return {}
    h_in, h_mid = hessians if hessians is not None else expert_hessians(ex, weighting)
    hs = {"gate": h_in, "up": h_in, "down": h_mid}
    return {p: relative_error(getattr(ex, p), q[p].dequantize(), hs[p]) for p in PROJECTIONS}


def rtn_expert(ex: ExpertData, fmt: Format, masks: dict[str, torch.Tensor] | None = None,
               info: dict[str, Any] | None = None, report_errors: bool = True) -> CompressedExpert:
    """RTN with the given masks (magnitude masks by default); the latent is the dense weights themselves."""
    w = {p: getattr(ex, p).detach().float() for p in PROJECTIONS}
    if masks is None:
        masks = {p: fmt.magnitude_mask(w[p]) for p in PROJECTIONS}
    q = quantize_masked(fmt, w, masks)
    info = dict(info or {})
    info.setdefault("tokens", ex.n_rows)
    if report_errors:
        info["rel_err"] = reconstruction_errors(ex, q)
    return CompressedExpert(q["gate"], q["up"], q["down"], latent={p: w[p].clone() for p in PROJECTIONS}, info=info)


def fallback_no_tokens(ex: ExpertData, fmt: Format, method: str) -> CompressedExpert:
    """Experts no calibration token reached have no Hessian and no activation statistics: RTN with
    magnitude masks is the only data-free choice. Recorded in info so the log shows it."""
    return rtn_expert(ex, fmt, info={"method": method, "fallback": "rtn-magnitude (no routed tokens)"},
                      report_errors=False)


def score_masked_expert(ex: ExpertData, fmt: Format, method: str, score,
                        report_errors: bool = True) -> CompressedExpert:
    """The score-based pruning methods (Wanda, JSQ): each projection's pattern per group keeps the largest summed
    `score(W, inputs)` (gate/up scored on the routed tokens, down on the dense SwiGLU intermediate), then RTN."""
    check_expert(ex, fmt)
    if ex.n_rows == 0:
        return fallback_no_tokens(ex, fmt, method)
    x = ex.inputs()
    inputs = {"gate": x, "up": x, "down": ex.dense_intermediate(x)}
    masks = {p: fmt.patterns.best_mask(score(getattr(ex, p), inputs[p])) for p in PROJECTIONS}
    return rtn_expert(ex, fmt, masks, info={"method": method}, report_errors=report_errors)


@dataclass
class RTN:
    """Magnitude masks + round-to-nearest in the format (dense formats: plain RTN)."""

    name: str = "rtn"
    report_errors: bool = True

    def compress_block(self, experts: list[ExpertData], fmt: Format,
                       progress: ProgressFn | None = None) -> list[CompressedExpert]:
        return compress_each(experts, fmt, self.compress_expert, progress)

    def compress_expert(self, ex: ExpertData, fmt: Format) -> CompressedExpert:
        check_expert(ex, fmt)
        return rtn_expert(ex, fmt, info={"method": self.name}, report_errors=self.report_errors)


@dataclass
class Magnitude(RTN):
    """Alias of `rtn` under the name the paper's tables use for magnitude pruning + RTN."""

    name: str = "magnitude"
