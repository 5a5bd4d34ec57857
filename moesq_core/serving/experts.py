"""The reference moesq experts module: a drop-in for transformers 5.x fused experts
(`forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`).

It holds each expert's compressed weights dequantized (exactly the values pack writes), and applies the
format's activation quantizer at the expert input and at the SwiGLU output when `act_quant` is on (W4A4 /
W8A8). Activation global scales (formats whose activation quantizer has one, e.g. NVFP4) are static,
calibrated per expert (g = 448*6/amax of the calibration inputs, exactly the `input_global_scale` pack
writes), like serving does; an expert without one (g = 0, no calibration token reached it) falls back to the
tensor's own (dynamic) scale.

`make_experts` builds the module serving a pack's experts: the format's faster module where it names one
(`Format.fast_experts`) that serves the device, else this one.
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from moesq_core.formats import Format, QuantizedWeight, get_format
from moesq_core.formats.quantizers import input_global_scales
from moesq_core.naming import PROJECTIONS, expert_linear

log = logging.getLogger("moesq.serving")


@functools.lru_cache(maxsize=None)
def _fast_module(name: str):
    """The format's fast experts module, or None when it cannot import (said once: it is optional)."""
    try:
        return importlib.import_module(name)
    except Exception as e:
        log.warning("%s unavailable (%s); using the reference module", name, e)
        return None


def make_experts(fmt: Format, packed: list[dict[str, dict[str, torch.Tensor]]], act_quant: bool,
                 device: torch.device, fast: bool | None = None, prefix: str = "") -> nn.Module:
    """The experts module serving packed[e] = {"gate"|"up"|"down": {suffix: tensor}} on `device`: the format's
    fast module (Format.fast_experts) where it serves `device` (fast=None: it decides; True: asks it to even so;
    an import error then raises), else the reference MoesqExperts (always with fast=False)."""
    if fmt.fast_experts is not None and fast is not False and (fast or device.type == "cuda"):
        module = importlib.import_module(fmt.fast_experts) if fast else _fast_module(fmt.fast_experts)
        if module is not None and module.serves(device, act_quant, fast):
            return module.from_packed(packed, act_quant=act_quant, device=device)
    return MoesqExperts.from_packed(fmt, packed, act_quant, prefix)


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
        self.register_buffer("act_global_in",
                             torch.zeros(E) if act_global_in is None else act_global_in.float().clone())
        self.register_buffer("act_global_mid",
                             torch.zeros(E) if act_global_mid is None else act_global_mid.float().clone())

    @classmethod
    def from_quantized(cls, fmt: Format | str, weights: list[dict[str, QuantizedWeight]], act_quant: bool,
                       act_amax_in: torch.Tensor | None = None,
                       act_amax_mid: torch.Tensor | None = None) -> "MoesqExperts":
        """From per-expert QuantizedWeights and calibrated activation ranges (amax; 0 = none). Experts without a
        range get the fallback scale that `moesq pack` writes, so this module computes what the pack serves."""
        # filled expert by expert: stacking per-expert copies held the block's dequantized weights twice
        gate_up = down = None
        for e, w in enumerate(weights):
            g, u, d = (w[p].dequantize().float() for p in PROJECTIONS)
            if gate_up is None:
                gate_up = torch.empty((len(weights), g.shape[0] + u.shape[0], g.shape[1]), device=g.device)
                down = torch.empty((len(weights), *d.shape), device=d.device)
            gate_up[e, : g.shape[0]], gate_up[e, g.shape[0] :], down[e] = g, u, d
            del g, u, d
        return cls(fmt, gate_up, down, act_quant, input_global_scales(act_amax_in)[0],
                   input_global_scales(act_amax_mid)[0])

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

    def stacked_linears(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' (gate_up [E, 2I, H], down [E, H, I]) weights."""
        return self.gate_up_proj, self.down_proj

    def expert_linears(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) weights."""
        gate_up, down = self.stacked_linears()
        return gate_up[e], down[e]

    def static_globals(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per expert, the (input, SwiGLU-output) quantizers' global scales as `_global` gives them, read from
        the device once for all experts: per expert, each read was a host sync that left the GPU idle."""
        E = self.num_experts
        if not (self.act_quant and self.fmt.act.uses_global_scale):
            return [(None, None)] * E
        static = (~(torch.stack([self.act_global_in, self.act_global_mid]) <= 0)).tolist()
        return [(self.act_global_in[e] if static[0][e] else None, self.act_global_mid[e] if static[1][e] else None)
                for e in range(E)]

    def expert_forward(self, e: int, x: torch.Tensor, globals_: tuple | None = None) -> torch.Tensor:
        """Expert e on its rows x; globals_ = static_globals()[e] where the caller has them."""
        gate_up, down = self.expert_linears(e)
        x = x.float()
        if self.act_quant:
            g_in, g_mid = globals_ if globals_ is not None else (self._global(self.act_global_in[e]),
                                                                 self._global(self.act_global_mid[e]))
            x = self.fmt.quant_act(x, g_in, ste=self.ste)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        h = F.silu(gate) * up
        if self.act_quant:
            h = self.fmt.quant_act(h, g_mid, ste=self.ste)
        return F.linear(h, down)

    # Batched over experts (rows padded per expert, bmm): on a GPU the per-expert loop launches ~70 small
    # kernels per expert and batch (~230k per decoder-layer pass of a full-width block's calibration set), which
    # dominated the engine's propagation. Same quantizer arithmetic, matmuls batched (the last bits may differ
    # from the loop's). None (the default): batched on CUDA, the CPU keeping the loop (exact reference).
    batched: bool | None = None
    BATCH_BYTES = 1 << 30  # padded fp32 rows per expert chunk of the batched path

    def _batched_globals(self, g_static: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[k, 1, 1] global scales for x [k, C, D]: the calibrated one where the expert has it, else x's own range
        (what `_global` and a dynamic quantizer give each expert; padding rows are zeros, outside the range)."""
        if not self.fmt.act.uses_global_scale:
            return None
        dynamic = self.fmt.act.global_from_amax(x.detach().abs().amax(dim=(1, 2)))
        return torch.where(g_static <= 0, dynamic, g_static).reshape(-1, 1, 1)

    def _forward_batched(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        T, H = hidden_states.shape
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        e_sorted, tok = flat[order], order // k
        wts = top_k_weights.reshape(-1)[order].float()
        counts = torch.bincount(flat, minlength=self.num_experts)
        pos = torch.arange(len(flat), device=flat.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
        C = max(int(counts.max()), 1)  # the one host read
        gate_up_w, down_w = self.stacked_linears()
        width = max(H, gate_up_w.shape[1])
        step = max(1, self.BATCH_BYTES // (C * width * 4))
        # each (token, slot) row written once, then summed over the slots in a fixed order: deterministic on a GPU,
        # where an index_add_ with repeated tokens adds in whatever order its atomics land
        rows = torch.zeros((T * k, H), dtype=torch.float32, device=hidden_states.device)
        for lo in range(0, self.num_experts, step):
            hi = min(lo + step, self.num_experts)
            sel = (e_sorted >= lo) & (e_sorted < hi)
            e, p, t = e_sorted[sel] - lo, pos[sel], tok[sel]
            x = torch.zeros((hi - lo, C, H), dtype=torch.float32, device=hidden_states.device)
            x[e, p] = hidden_states[t].float()
            if self.act_quant:
                x = self.fmt.act.batched(x, self._batched_globals(self.act_global_in[lo:hi], x), ste=self.ste)
            gate, up = torch.bmm(x, gate_up_w[lo:hi].transpose(1, 2)).chunk(2, dim=-1)
            h = F.silu(gate) * up
            if self.act_quant:
                h = self.fmt.act.batched(h, self._batched_globals(self.act_global_mid[lo:hi], h), ste=self.ste)
            y = torch.bmm(h, down_w[lo:hi].transpose(1, 2))
            rows[order[sel]] = y[e, p] * wts[sel, None]
        return rows.view(T, k, H).sum(dim=1).to(hidden_states.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.batched or (self.batched is None and hidden_states.is_cuda):
            return self._forward_batched(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tok = order // top_k_index.shape[1]
        wts = top_k_weights.reshape(-1)[order].float()
        globals_ = self.static_globals()
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = tok[start : start + n]
                y = self.expert_forward(e, hidden_states[idx], globals_[e]) * wts[start : start + n, None]
                out.index_add_(0, idx, y)
            start += n
        return out.to(hidden_states.dtype)
