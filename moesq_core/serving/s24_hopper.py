"""Routed-experts module for 2:4 sparse FP8 (s24-fp8) checkpoints on Hopper GPUs: the CUTLASS grouped GEMM.

`S24HopperExperts` is a drop-in for transformers 5.x fused experts modules
(`forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`). The format is W8A8:
weights 2:4 sparse e4m3 with one fp32 scale per output channel (the packed tensors as they are on disk, the
metadata re-laid out once at load time), activations e4m3 with one dynamic scale per token at the expert
input and at the SwiGLU output. One forward runs on the device without a host synchronisation, so it can be
captured in a CUDA graph:

  1. routing: per-expert token counts (scatter_add) and each (token, slot)'s row in its expert's slab (a stable
     sort of the flat expert ids; rank = sorted position - segment start);
  2. each token is quantized to e4m3 once and scattered into the capacity-batched input X [E, capacity, H];
  3. gate/up grouped GEMM (each expert's gate rows then up rows, one weight stack) -> bf16 [E, capacity, 2I];
  4. the T*k valid rows are gathered, SwiGLU in fp32, quantized per row and scattered into [E, capacity, I];
  5. down grouped GEMM -> bf16 [E, capacity, H];
  6. combine: each token's k rows gathered, weighted and summed in slot order in fp32 -> hidden dtype.

On CUDA, steps 1-2, 4 and 6 are three fused Triton kernels (moesq_core.serving.kernels.s24_route), so a layer is five
launches; `fused_routing = False` runs them as torch ops instead (the dataflow of the reference path).
The GEMMs read the counts on the device and skip the tiles past them. Capacity is T (an expert gets a token at
most once) while a CUDA graph is being captured or when T <= STATIC_CAPACITY_TOKENS; larger eager calls
(prefill) size it to the largest count instead, which costs one host read.

With `reference=True` (the default off CUDA) the same dataflow runs on any device with
`s24_fp8.reference_grouped_gemm` (exact products, float64 sums, the kernel's bf16 output rounding) in place
of the kernel: it defines the numerics the GPU path reproduces up to fp32 accumulation order.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from moesq_core.naming import PROJECTIONS
from moesq_core.serving.kernels import s24_gemm as s24
from moesq_core.serving.kernels import s24_route

log = logging.getLogger("moesq.runtime")
PROJ_KEYS = PROJECTIONS
SUFFIXES = ("weight_sparse_values", "weight_sparse_meta", "weight_scale")
STATIC_CAPACITY_TOKENS = 128


def available(device: torch.device | str) -> bool:
    """True when `device` is a Hopper GPU and the native s24-fp8 kernels load (built on first use); logs why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    try:
        s24.check_device(device)
    except Exception as e:  # the fast module is optional: say why it is not used
        log.warning("s24-fp8 Hopper experts unavailable (%s); using the reference module", e)
        return False
    return True


def _stack(packed: list[dict[str, dict[str, torch.Tensor]]], projs: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """Per-expert packed tensors -> (values [E, M, K/2], meta [E, M, K/8], scale [E, M]); several projections
    are stacked along M (gate then up)."""
    out = []
    for suffix in SUFFIXES:
        per_e = []
        for e, t in enumerate(packed):
            parts = []
            for p in projs:
                if suffix not in t[p]:
                    raise ValueError(f"expert {e} {p}: missing {suffix} "
                                     f"(an s24-fp8 linear needs {', '.join(SUFFIXES)})")
                parts.append(t[p][suffix])
            per_e.append(torch.cat(parts))
        out.append(torch.stack(per_e))
    values, meta, scale = out
    return values, meta, scale.reshape(values.shape[0], values.shape[1]).float()


class S24HopperExperts(nn.Module):
    def __init__(self, gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 down: tuple[torch.Tensor, torch.Tensor, torch.Tensor], device=None, reference: bool | None = None):
        """gate_up / down: (values [E, M, K/2] e4m3, meta [E, M, K/8] uint8 as packed, scale [E, M] fp32), the
        gate/up stack holding each expert's gate rows then its up rows (M = 2I, K = H; down M = H, K = I)."""
        super().__init__()
        device = torch.device(device if device is not None else gate_up[0].device)
        self.reference = device.type != "cuda" if reference is None else reference
        E, two_i, half_h = gate_up[0].shape
        H, inter = 2 * half_h, two_i // 2
        if two_i % 2 or tuple(down[0].shape) != (E, H, inter // 2):
            raise ValueError(f"down weights are {tuple(down[0].shape)}, expected {(E, H, inter // 2)} for gate/up "
                             f"{tuple(gate_up[0].shape)}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, inter
        if self.reference:
            for v, m, _ in (gate_up, down):
                s24.decompress(v, m)  # validates the metadata now rather than at the first forward
            self._ref = {"gate_up": tuple(t.to(device) for t in gate_up), "down": tuple(t.to(device) for t in down)}
        else:
            s24.check_device(device)
            self.gate_up = s24.prepare_weights(*gate_up, device=device)
            self.down = s24.prepare_weights(*down, device=device)
        self.fused_routing = not self.reference and s24_route.available(device)

    @classmethod
    def from_packed(cls, packed: list[dict[str, dict[str, torch.Tensor]]], act_quant: bool = True, device=None,
                    reference: bool | None = None) -> "S24HopperExperts":
        """packed[e] = {"gate"|"up"|"down": {weight_sparse_values, weight_sparse_meta, weight_scale}}."""
        if not packed:
            raise ValueError("S24HopperExperts.from_packed: no experts given")
        if not act_quant:
            raise ValueError("s24-fp8 serving is W8A8 (the sparse tensor cores take e4m3 activations); "
                             "act_quant=False needs the reference module")
        for e, t in enumerate(packed):
            missing = [p for p in PROJ_KEYS if p not in t]
            if missing:
                raise ValueError(f"expert {e}: missing projection(s) {missing}")
        return cls(_stack(packed, ("gate", "up")), _stack(packed, ("down",)), device, reference)

    act_quant = True  # W8A8 always (for callers that inspect experts modules)

    def expert_nbytes(self) -> int:
        """Bytes of expert weights held (kernel layout on the GPU, packed layout in the reference)."""
        if self.reference:
            return sum(t.numel() * t.element_size() for w in self._ref.values() for t in w)
        return self.gate_up.nbytes() + self.down.nbytes()

    def _gemm(self, which: str, xq: torch.Tensor, sx: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.reference:
            v, m, s = self._ref[which]
            return s24.reference_grouped_gemm(v, m, s, xq, sx, counts)
        return s24.grouped_gemm(self.gate_up if which == "gate_up" else self.down, xq, sx, counts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(f"hidden_states must be [T, {self.hidden_dim}], got {tuple(hidden_states.shape)}")
        if (top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2
                or top_k_index.shape[0] != hidden_states.shape[0]):
            raise ValueError(f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
                             f"must both be [T={hidden_states.shape[0]}, k]")
        T, k = top_k_index.shape
        E, H, inter = self.num_experts, self.hidden_dim, self.intermediate_dim
        dev = hidden_states.device
        if T == 0:
            return torch.zeros_like(hidden_states)
        R = T * k
        capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        flat = top_k_index.reshape(-1).long()
        counts = None
        if capturing or T <= STATIC_CAPACITY_TOKENS:
            cap = T
        else:  # large eager call (prefill): size the slabs to the largest count (one host read)
            counts = torch.zeros(E, dtype=torch.int32, device=dev).scatter_add_(
                0, flat, torch.ones(R, dtype=torch.int32, device=dev))
            cap = max(int(counts.max()), 1)
        if self.fused_routing:
            xq, sx, counts, row = s24_route.route_quant(hidden_states, top_k_index, E, cap)
            y1 = self._gemm("gate_up", xq, sx, counts)
            xq2, sx2 = s24_route.swiglu_quant(y1, row, inter)
            y2 = self._gemm("down", xq2, sx2, counts)
            return s24_route.combine(y2, row, top_k_weights, hidden_states.dtype)
        # 1. routing, on the device
        if counts is None:
            counts = torch.zeros(E, dtype=torch.int32, device=dev).scatter_add_(
                0, flat, torch.ones(R, dtype=torch.int32, device=dev))
        order = torch.argsort(flat, stable=True)
        starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
        rank = torch.empty(R, dtype=torch.int64, device=dev)
        rank[order] = torch.arange(R, device=dev) - starts[flat[order]]
        row = flat * cap + rank  # [R] row of (token, slot) in the [E * cap] slabs
        token = torch.arange(R, device=dev) // k
        # 2. quantize each token once, scatter into the expert slabs
        xq, sx = s24.quantize_activations(hidden_states)
        X = torch.empty(E * cap, H, dtype=torch.uint8, device=dev)
        SX = torch.ones(E * cap, dtype=torch.float32, device=dev)
        X[row] = xq.view(torch.uint8)[token]
        SX[row] = sx[token]
        # 3. gate/up
        y1 = self._gemm("gate_up", X.view(E, cap, H).view(torch.float8_e4m3fn), SX.view(E, cap), counts)
        # 4. SwiGLU on the valid rows, quantize, scatter
        h = y1.view(E * cap, 2 * inter)[row].float()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        aq, sa = s24.quantize_activations(a)
        X2 = torch.empty(E * cap, inter, dtype=torch.uint8, device=dev)
        SX2 = torch.ones(E * cap, dtype=torch.float32, device=dev)
        X2[row] = aq.view(torch.uint8)
        SX2[row] = sa
        # 5. down
        y2 = self._gemm("down", X2.view(E, cap, inter).view(torch.float8_e4m3fn), SX2.view(E, cap), counts)
        # 6. combine in slot order
        y = y2.view(E * cap, H)[row].float() * top_k_weights.reshape(R, 1).float()
        return y.view(T, k, H).sum(1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        path = "reference" if self.reference else "CUTLASS s24-fp8 kernels" + (
            ", fused Triton routing" if self.fused_routing else "")
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"W8A8, path={path}")


def serves(device: torch.device, act_quant: bool, fast: bool | None) -> bool:
    """Whether this module serves s24-fp8 experts on `device` (serving.experts.make_experts asks): with
    activation quantization (W8A8) on a Hopper GPU whose native kernels load, unless fast=False."""
    return act_quant and fast is not False and device.type == "cuda" and available(device)


def from_packed(packed: list[dict[str, dict[str, torch.Tensor]]], act_quant: bool, device) -> S24HopperExperts:
    return S24HopperExperts.from_packed(packed, act_quant=act_quant, device=device)
