"""The reference moesq experts module: a drop-in for transformers 5.x fused experts
(`forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`).

It holds each expert's compressed weights dequantized (exactly the values pack writes), and applies the
format's activation quantizer at the expert input and at the SwiGLU output when `act_quant` is on (W4A4 /
W8A8). Activation global scales are static, calibrated per expert (g = 448*6/amax of the calibration
inputs), like serving does; experts without one fall back to the tensor's own (dynamic) scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Format, QuantizedWeight, get_format
from ..formats.quantizers import nvfp4_global_scale


class MoesqExperts(nn.Module):
    def __init__(self, fmt: Format | str, gate_up: torch.Tensor, down: torch.Tensor, act_quant: bool,
                 act_amax_in: torch.Tensor | None = None, act_amax_mid: torch.Tensor | None = None):
        super().__init__()
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.num_experts = gate_up.shape[0]
        self.act_quant = act_quant
        self.register_buffer("gate_up_proj", gate_up.float().contiguous())  # [E, 2I, H], gate rows first
        self.register_buffer("down_proj", down.float().contiguous())  # [E, H, I]
        E = self.num_experts
        self.register_buffer("act_amax_in", torch.zeros(E) if act_amax_in is None else act_amax_in.float().clone())
        self.register_buffer("act_amax_mid", torch.zeros(E) if act_amax_mid is None else act_amax_mid.float().clone())

    @classmethod
    def from_quantized(cls, fmt: Format | str, weights: list[dict[str, QuantizedWeight]], act_quant: bool,
                       act_amax_in=None, act_amax_mid=None) -> "MoesqExperts":
        gate_up = torch.stack([torch.cat([w["gate"].dequantize(), w["up"].dequantize()]) for w in weights])
        down = torch.stack([w["down"].dequantize() for w in weights])
        return cls(fmt, gate_up, down, act_quant, act_amax_in, act_amax_mid)

    def _global(self, amax: torch.Tensor) -> torch.Tensor | None:
        # The FP8 activation quantizer has no global scale; NVFP4's is static when calibrated.
        if self.fmt.weight.__class__.__name__ != "NVFP4Quantizer" or float(amax) <= 0:
            return None
        return nvfp4_global_scale(amax)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.act_quant:
            x = self.fmt.quant_act(x, self._global(self.act_amax_in[e]))
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.silu(gate) * up
        if self.act_quant:
            h = self.fmt.quant_act(h, self._global(self.act_amax_mid[e]))
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
