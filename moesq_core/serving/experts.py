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

    def set_factored(self, weights: list[dict[str, QuantizedWeight]]) -> None:
        """Hold the weights also as bf16 values and fp32 row factors (QuantizedWeight.factored) for the batched
        path's bf16 matmuls; kept only where bf16 holds every value exactly (else that path computes in fp32).
        Opt-in (the engine's install for propagation asks for it): it adds 2 bytes per weight to the module."""
        E = len(weights)
        gate_up, down = self.gate_up_proj, self.down_proj
        gu_v = torch.empty(gate_up.shape, dtype=torch.bfloat16, device=gate_up.device)
        dn_v = torch.empty(down.shape, dtype=torch.bfloat16, device=down.device)
        gu_r = torch.empty(gate_up.shape[:2], device=gate_up.device)
        dn_r = torch.empty(down.shape[:2], device=down.device)
        inter = gate_up.shape[1] // 2
        for e, w in enumerate(weights):
            for p, (vals, rows, sl) in (("gate", (gu_v, gu_r, slice(None, inter))),
                                        ("up", (gu_v, gu_r, slice(inter, None))), ("down", (dn_v, dn_r, slice(None)))):
                v, r = w[p].factored()
                vals[e, sl] = v
                if not torch.equal(vals[e, sl].float(), v.to(vals.device)):
                    return
                rows[e, sl] = r
        if E:
            for name, t in (("gate_up_values", gu_v), ("gate_up_rows", gu_r), ("down_values", dn_v),
                            ("down_rows", dn_r)):
                self.register_buffer(name, t, persistent=False)

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
    # On the factored weights (set_factored) an expert chunk holds experts of similar row counts (sorted, each at
    # least this fraction of the chunk's largest): routing is uneven (a full-width random block's hottest expert
    # gets 4x the mean), and padding every expert to the hottest one's rows made most of the work padding.
    CHUNK_FILL = 0.75

    @staticmethod
    def expert_chunks(counts: list[int], width: int, budget: int, fill: float,
                      weight_bytes: int = 0) -> list[list[int]]:
        """The experts with rows, by decreasing row count (ties: by index), in chunks whose padded fp32 rows
        (len x the first's count x width x 4 bytes) and weights (`weight_bytes` per expert) fit `budget` (one expert
        at least) and whose experts have at least `fill` x the first's count."""
        order = sorted((e for e, n in enumerate(counts) if n), key=lambda e: (-counts[e], e))
        chunks: list[list[int]] = []
        for e in order:
            if chunks:
                top = counts[chunks[-1][0]]
                if ((len(chunks[-1]) + 1) * (top * width * 4 + weight_bytes) <= budget
                        and counts[e] >= fill * top):
                    chunks[-1].append(e)
                    continue
            chunks.append([e])
        return chunks

    def _batched_globals(self, g_static: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[k, 1, 1] global scales for x [k, C, D]: the calibrated one where the expert has it, else x's own range
        (what `_global` and a dynamic quantizer give each expert; padding rows are zeros, outside the range)."""
        if not self.fmt.act.uses_global_scale:
            return None
        dynamic = self.fmt.act.global_from_amax(x.detach().abs().amax(dim=(1, 2)))
        return torch.where(g_static <= 0, dynamic, g_static).reshape(-1, 1, 1)

    def _factored(self) -> bool:
        return not self.ste and getattr(self, "gate_up_values", None) is not None

    @staticmethod
    def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b of bf16 operands with fp32 accumulation and output (bf16 tensor cores on a GPU)."""
        if a.is_cuda:
            try:
                return torch.bmm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # a torch without bmm's out_dtype: the same products in fp32
                pass
        return torch.bmm(a.float(), b.float())

    def _factored_linear(self, x: torch.Tensor, g_static: torch.Tensor, ex: torch.Tensor, proj: str) -> torch.Tensor:
        """x [k, C, D] (fp32, padding rows zero) through experts ex's `proj` ("gate_up" or "down"), the activation
        quantizer first where act_quant: the quantized operands are exact in bf16 (values x factors), so their
        bf16 product with fp32 accumulation is the fp32 one up to summation order."""
        values, rows = getattr(self, f"{proj}_values")[ex], getattr(self, f"{proj}_rows")[ex][:, None, :]
        if self.act_quant:
            xv, x_f = self.fmt.act.batched_factored(x, self._batched_globals(g_static, x))
            return self._bmm_fp32(xv.to(torch.bfloat16), values.transpose(1, 2)).mul_(x_f).mul_(rows)
        xb = x.to(torch.bfloat16)
        if torch.equal(xb.float(), x):  # e.g. a bf16 model's states
            return self._bmm_fp32(xb, values.transpose(1, 2)).mul_(rows)
        return torch.bmm(x, getattr(self, f"{proj}_proj")[ex].transpose(1, 2))

    def _routing(self, top_k_index, top_k_weights):
        """(order, expert, position within the expert's rows, token, router weight) of the routed slots sorted by
        expert (token order within one), and every expert's row count on the device."""
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        e_sorted, tok = flat[order], order // k
        wts = top_k_weights.reshape(-1)[order].float()
        counts = torch.bincount(flat, minlength=self.num_experts)
        pos = torch.arange(len(flat), device=flat.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
        return order, e_sorted, pos, tok, wts, counts

    def _forward_factored(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """The batched path on the factored weights: experts in chunks of similar row counts (expert_chunks),
        bf16 matmuls of exact operands."""
        T, H = hidden_states.shape
        k = top_k_index.shape[1]
        order, e_sorted, pos, tok, wts, counts_d = self._routing(top_k_index, top_k_weights)
        counts = counts_d.tolist()  # the one host read
        width = max(H, self.gate_up_values.shape[1])
        per_expert = (self.gate_up_values[0].numel() + self.down_values[0].numel()) * 2  # the chunk's weight copies
        rows = torch.zeros((T * k, H), dtype=torch.float32, device=hidden_states.device)
        slot_of = torch.full((self.num_experts,), -1, dtype=torch.long, device=e_sorted.device)
        for chunk in self.expert_chunks(counts, width, self.BATCH_BYTES, self.CHUNK_FILL, per_expert):
            ex = torch.tensor(chunk, device=e_sorted.device)
            slot_of.fill_(-1)
            slot_of[ex] = torch.arange(len(chunk), device=e_sorted.device)
            e = slot_of[e_sorted]
            sel = e >= 0
            e, p, t = e[sel], pos[sel], tok[sel]
            x = torch.zeros((len(chunk), counts[chunk[0]], H), dtype=torch.float32, device=hidden_states.device)
            x[e, p] = hidden_states[t].float()
            gate, up = self._factored_linear(x, self.act_global_in[ex], ex, "gate_up").chunk(2, dim=-1)
            del x
            y = self._factored_linear(F.silu(gate) * up, self.act_global_mid[ex], ex, "down")
            rows[order[sel]] = y[e, p] * wts[sel, None]
        return rows.view(T, k, H).sum(dim=1).to(hidden_states.dtype)

    def _forward_batched(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        if self._factored():
            return self._forward_factored(hidden_states, top_k_index, top_k_weights)
        T, H = hidden_states.shape
        k = top_k_index.shape[1]
        order, e_sorted, pos, tok, wts, counts = self._routing(top_k_index, top_k_weights)
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
