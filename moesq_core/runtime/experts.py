"""The reference moesq experts module: a drop-in for transformers 5.x fused experts
(`forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`).

It holds each expert's compressed weights dequantized (exactly the values pack writes), and applies the
format's activation quantizer at the expert input and at the SwiGLU output when `act_quant` is on (W4A4 /
W8A8). NVFP4 activation global scales are static, calibrated per expert (g = 448*6/amax of the calibration
inputs, exactly the `input_global_scale` pack writes), like serving does; an expert without one (g = 0,
no calibration token reached it) falls back to the tensor's own (dynamic) scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Format, QuantizedWeight, get_format
from ..formats.quantizers import NVFP4ActQuantizer, nvfp4_global_scale


def act_global_from_amax(amax: torch.Tensor | None) -> torch.Tensor | None:
    """Calibrated activation global scales g = 448*6/amax; 0 where no range was seen (dynamic then)."""
    if amax is None:
        return None
    amax = amax.float()
    return torch.where(amax > 0, nvfp4_global_scale(amax), torch.zeros_like(amax))


def input_global_scales(amax: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """Static activation global scales per expert [E] and how many fell back.

    An expert no calibration token reached has no range; serving engines compute 1/scale and take the max over
    a layer's experts, so 0 or inf would break the whole layer. Such experts get the layer-level scale
    calibrated from the largest range seen in the layer, or 1.0 when the layer saw none."""
    if amax is None:
        return None, 0
    g = act_global_from_amax(amax).float().reshape(-1)
    ok = torch.isfinite(g) & (g > 0)
    if bool(ok.all()):
        return g, 0
    seen = amax.float().reshape(-1)[ok]
    fallback = act_global_from_amax(seen.max().reshape(1))[0] if seen.numel() else torch.tensor(1.0)
    if not (torch.isfinite(fallback) and fallback > 0):
        fallback = torch.tensor(1.0)
    return torch.where(ok, g, fallback), int((~ok).sum())


class MoesqExperts(nn.Module):
    def __init__(self, fmt: Format | str, gate_up: torch.Tensor, down: torch.Tensor, act_quant: bool,
                 act_global_in: torch.Tensor | None = None, act_global_mid: torch.Tensor | None = None):
        super().__init__()
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.num_experts = gate_up.shape[0]
        self.act_quant = act_quant
        self.register_buffer("gate_up_proj", gate_up.float().contiguous())  # [E, 2I, H], gate rows first
        self.register_buffer("down_proj", down.float().contiguous())  # [E, H, I]
        E = self.num_experts
        self.register_buffer("act_global_in", torch.zeros(E) if act_global_in is None else act_global_in.float().clone())
        self.register_buffer("act_global_mid", torch.zeros(E) if act_global_mid is None else act_global_mid.float().clone())

    @classmethod
    def from_quantized(cls, fmt: Format | str, weights: list[dict[str, QuantizedWeight]], act_quant: bool,
                       act_amax_in: torch.Tensor | None = None, act_amax_mid: torch.Tensor | None = None) -> "MoesqExperts":
        """From per-expert QuantizedWeights and calibrated activation ranges (amax; 0 = none). Experts without a
        range get the fallback scale that `moesq pack` writes, so this module computes what the pack serves."""
        gate_up = torch.stack([torch.cat([w["gate"].dequantize(), w["up"].dequantize()]) for w in weights])
        down = torch.stack([w["down"].dequantize() for w in weights])
        return cls(fmt, gate_up, down, act_quant, input_global_scales(act_amax_in)[0], input_global_scales(act_amax_mid)[0])

    def _global(self, g: torch.Tensor) -> torch.Tensor | None:
        # The FP8 activation quantizer has no global scale; NVFP4's is static when calibrated.
        if not isinstance(self.fmt.act, NVFP4ActQuantizer) or float(g) <= 0:
            return None
        return g

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.act_quant:
            x = self.fmt.quant_act(x, self._global(self.act_global_in[e]))
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.silu(gate) * up
        if self.act_quant:
            h = self.fmt.quant_act(h, self._global(self.act_global_mid[e]))
        return F.linear(h, self.down_proj[e])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tok = order // top_k_index.shape[1]
        wts = top_k_weights.reshape(-1)[order].float()
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = tok[start : start + n]
                y = self.expert_forward(e, hidden_states[idx]) * wts[start : start + n, None]
                out.index_add_(0, idx, y)
            start += n
        return out.to(hidden_states.dtype)
