"""The reference moesq experts module: a drop-in for transformers 5.x fused experts
(`forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`).

It holds each expert's compressed weights dequantized (exactly the values pack writes), and applies the
format's activation quantizer at the expert input and at the SwiGLU output when `act_quant` is on (W4A4 /
W8A8). Activation global scales (formats whose activation quantizer has one, e.g. NVFP4) are static,
calibrated per expert (g = 448*6/amax of the calibration inputs, exactly the `input_global_scale` pack
writes), like serving does; an expert without one (g = 0, no calibration token reached it) falls back to the
tensor's own (dynamic) scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Format, QuantizedWeight, get_format
from ..formats.quantizers import input_global_scales
from ..naming import PROJECTIONS, expert_linear


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

    @classmethod
    def from_packed(cls, fmt: Format, packed: list[dict[str, dict[str, torch.Tensor]]], act_quant: bool,
                    prefix: str = "") -> "MoesqExperts":
        """From packed[e] = {"gate"|"up"|"down": {suffix: tensor}} in any of the format's layouts, with the stored
        input global scales (0 where none is stored: dynamic, or the format has none)."""
        weights, g_in, g_mid = [], [], []
        for e, t in enumerate(packed):
            weights.append({p: fmt.unpack(t[p], expert_linear(prefix, e, p)) for p in PROJECTIONS})
            for lst, p in ((g_in, "gate"), (g_mid, "down")):
                g = t[p].get("input_global_scale")
                lst.append(g.float().reshape(()) if g is not None else torch.zeros(()))
        ref = cls.from_quantized(fmt, weights, act_quant)
        ref.act_global_in.copy_(torch.stack(g_in))
        ref.act_global_mid.copy_(torch.stack(g_mid))
        return ref

    def extra_repr(self) -> str:
        return f"format={self.fmt.name}, experts={self.num_experts}, act_quant={self.act_quant}"

    def _global(self, g: torch.Tensor) -> torch.Tensor | None:
        # A calibrated static scale where the activation quantizer takes one; else dynamic (None).
        if not self.fmt.act.uses_global_scale or float(g) <= 0:
            return None
        return g

    ste = False  # straight-through activation quantizers (TunableExperts trains through them)

    def expert_linears(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) weights."""
        return self.gate_up_proj[e], self.down_proj[e]

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.expert_linears(e)
        x = x.float()
        if self.act_quant:
            x = self.fmt.quant_act(x, self._global(self.act_global_in[e]), ste=self.ste)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        h = F.silu(gate) * up
        if self.act_quant:
            h = self.fmt.quant_act(h, self._global(self.act_global_mid[e]), ste=self.ste)
        return F.linear(h, down)

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
