"""JSQ (Guo et al., ICML 2024, "Compressing LLMs by joint sparsification and quantization"), the pruning
part, then round-to-nearest in the format.

Score per weight (the public JSQ code's metric, rho = 2.1, clip 1 %):
    S_ij = |W_ij|·‖X̃_j‖₂ + rho·range_t( (X̃ W_{-j}ᵀ)_{t,i} )
where X̃ are the calibration inputs with their top `clip_h` fraction of |entries| clamped to that
percentile ("activation editing", computed on the statistics only, the forward pass is unchanged), and the
second term is the range over tokens of output i when input column j is removed. It is that range itself, not
its change |range(y) − range(y − x_j W_ij)|: the authors' public code scores ss[i, j] = max_t − min_t of the
output with W[:, j] zeroed, and within one output row (where the pattern choice happens) range(y) is a
constant, so the change would reverse the order for weights whose removal shrinks the range — it would keep
the outlier-producing weights the paper sets out to prune (pruning them is what makes the pruned layer
"quantization friendly"). The pattern keeping the largest summed score wins.

Adaptations to MoE experts (documented, not in the paper):
- The paper averages activations over calibration sequences position-wise (a 2048-row "mean sequence") for
  the range term and sums ‖X_j‖² per sequence. An expert's routed tokens have no sequence structure, so the
  range is taken over (at most `range_tokens`, evenly subsampled) routed tokens and ‖X_j‖₂ is rescaled to
  `ref_tokens` = 2048 tokens (√(2048·mean_t x_tj²)), which keeps rho's balance independent of how many tokens
  an expert received.
- JSQ's SmoothQuant-style smoothing before quantization needs to rescale the RMSNorm feeding the router and
  all experts; it is not applied (weights are quantized as they are, like every other method here).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moesq_core.compression.methods.base import CompressedExpert, ExpertData, ProgressFn, compress_each
from moesq_core.compression.methods.rtn import score_masked_expert
from moesq_core.formats import Format


def clip_activations(x: torch.Tensor, clip_h: float = 0.01) -> torch.Tensor:
    """Clamp the largest `clip_h` fraction of |x| entries (over the whole matrix) to the magnitude at
    that rank, keeping signs."""
    k = int(clip_h * x.numel())
    if k <= 0:
        return x
    thr = torch.topk(x.detach().abs().flatten().float(), k).values[-1]
    return x.clamp(-thr, thr)


def range_saliency(x: torch.Tensor, W: torch.Tensor, budget: int = 1 << 24) -> torch.Tensor:
    """ss[i, j] = max_t − min_t of (x W_{-j}ᵀ)[t, i], W_{-j} = W with column j zeroed.

    (x W_{-j}ᵀ)[t, i] = y[t, i] − x[t, j]·W[i, j]: a rank-1 correction of the full output, evaluated for
    chunks of input columns so the [T, out, chunk] temporary stays under `budget` elements.
    """
    x = x.float()
    W = W.float()
    T, cin = x.shape
    out = W.shape[0]
    y = x @ W.T  # [T, out]
    ss = torch.empty_like(W)
    step = max(1, budget // max(1, T * out))
    for s in range(0, cin, step):
        e = min(s + step, cin)
        z = y[:, :, None] - x[:, None, s:e] * W[None, :, s:e]  # [T, out, c]
        ss[:, s:e] = z.amax(0) - z.amin(0)
    return ss


def jsq_scores(W: torch.Tensor, x: torch.Tensor, rho: float = 2.1, clip_h: float = 0.01,
               range_tokens: int = 1024, ref_tokens: int = 2048) -> torch.Tensor:
    xc = clip_activations(x.float(), clip_h)
    norm = (xc.to(torch.float64).pow(2).mean(0) * ref_tokens).sqrt().float()
    n = xc.shape[0]
    if range_tokens and n > range_tokens:
        xc = xc[torch.linspace(0, n - 1, range_tokens, device=x.device).round().long()]
    return W.detach().float().abs() * norm[None, :] + rho * range_saliency(xc, W)


@dataclass
class JSQ:
    name: str = "jsq"
    rho: float = 2.1
    clip_h: float = 0.01
    range_tokens: int = 1024
    ref_tokens: int = 2048
    report_errors: bool = True

    def compress_expert(self, ex: ExpertData, fmt: Format) -> CompressedExpert:
        return score_masked_expert(
            ex, fmt, self.name,
            lambda W, x: jsq_scores(W, x, self.rho, self.clip_h, self.range_tokens, self.ref_tokens),
            self.report_errors)

    def compress_block(self, experts: list[ExpertData], fmt: Format,
                       progress: ProgressFn | None = None) -> list[CompressedExpert]:
        return compress_each(experts, fmt, self.compress_expert, progress)
