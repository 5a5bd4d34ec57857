"""Fast routed-experts module for paired 4:8 NVFP4 (p48-nvfp4) checkpoints on Hopper GPUs.

`P48HopperExperts` is a drop-in for transformers 5.x fused experts modules
(`forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`, e.g. Qwen3MoeExperts).
Weights stay packed at 2.75 bits/weight. The grouped GEMMs run on Hopper's 2:4 sparse tensor cores
(moesq_core.serving.kernels.p48_mma, the native module) on an sm_90 GPU where that module builds, which is faster than
the Triton kernel (moesq_core.serving.kernels.p48_triton) at every measured batch size; else on the Triton kernel.
On a CUDA device one forward is seven launches and no host synchronisation, so it can be captured in a CUDA graph:

  1. per-expert token counts and segment offsets (torch scatter_add / cumsum on the device);
  2. routing scatter: each (token, slot) claims a row of its expert's segment and copies the token there,
     quantizing it to NVFP4 on the way in W4A4 (static per-expert input global scale);
  3. gate/up grouped GEMM (gate and up rows of an expert stacked, one shared weight global scale) -> fp32;
  4. SwiGLU, fused with the NVFP4 quantization of the down projection's input in W4A4;
  5. down grouped GEMM -> fp32;
  6. weighted combine of each token's k expert outputs (in slot order) -> hidden dtype.

An expert whose input_global_scale is 0 (no calibration data reached it) is quantized with the dynamic scale
of its rows in this call (as the reference MoesqExperts does); that takes an extra amax pass, chosen at load
time, then a separate quantization pass (p48_triton.nvfp4_quantize_rows); with static scales the routing scatter
already quantizes for free. `quant_in_kernel = True` has the gate/up GEMM on the sparse tensor cores quantize its
bf16 input itself instead (the kernel's in-staging NVFP4 quantization, the same operands bit for bit); it is off
because the pass plus the W4A16 GEMM was faster at every measured size on an H200 (the `p48_mma_w4a4_fused`
column of benchmarks/results/p48_kernel_bench_h200_2026-12-03_d3114ab.md).
With `reference=True` (the default off CUDA) the module runs moesq_core.serving.kernels.p48_reference instead, which
defines the numerics the GPU path reproduces up to fp32 summation order.
"""
from __future__ import annotations

import torch
from torch import nn

from moesq_core.naming import PROJECTIONS
from moesq_core.serving.kernels import p48_mma as pm
from moesq_core.serving.kernels import p48_reference as ref
from moesq_core.serving.kernels import p48_triton as pt

PROJ_KEYS = PROJECTIONS


def _global_scales(packed: list[dict[str, dict[str, torch.Tensor]]], proj: str) -> torch.Tensor:
    out = []
    for e, t in enumerate(packed):
        g = t[proj].get("input_global_scale")
        if g is not None and g.numel() != 1:
            raise ValueError(f"expert {e} {proj}: input_global_scale must hold one value, got shape {tuple(g.shape)}")
        out.append(torch.zeros(()) if g is None else g.float().reshape(()).cpu())
    return torch.stack(out)


class P48HopperExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_quant: bool, reference: bool):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.intermediate_dim = intermediate
        self.act_quant = act_quant
        self.reference = reference
        self._ref_experts: list[dict[str, ref.P48Weight]] = []
        self.gate_up: pt.P48GemmWeights | pm.P48MmaWeights | None = None
        self.down: pt.P48GemmWeights | pm.P48MmaWeights | None = None
        self.use_asm: bool | None = None  # None = the kernel default (inline PTX expansion on CUDA)
        self.quant_in_kernel = False  # W4A4, dynamic input scales, sparse-mma: True = the GEMM quantizes (module doc)
        self.kernel = "reference" if reference else "triton"  # or "sparse-mma" (native, sm_90)
        self._native = None
        # sparse-mma: both GEMM inputs arrive in the kernel's K order (p48_mma.k_order): the scatter writes the
        # hidden states so, and the gate/up rows are stored so, which puts the SwiGLU output, down's input, in it
        self.k_ordered = False

    @classmethod
    def from_packed(cls, packed: list[dict[str, dict[str, torch.Tensor]]], act_quant: bool, device=None,
                    reference: bool | None = None, kernel: str | None = None) -> "P48HopperExperts":
        """packed[e] = {"gate"|"up"|"down": {suffix: tensor}} in the release layout (weight_sparse_packed,
        weight_sparse_mask, weight_scale, weight_global_scale, input_global_scale). `kernel` ("sparse-mma" or
        "triton"; default: sparse-mma where the native module runs) picks the GPU GEMM."""
        if kernel not in (None, "sparse-mma", "triton"):
            raise ValueError(f"kernel={kernel!r}: expected 'sparse-mma' or 'triton'")
        if not packed:
            raise ValueError("P48HopperExperts.from_packed: no experts given")
        device = torch.device(device if device is not None else "cpu")
        if reference is None:
            reference = device.type != "cuda"
        for e, t in enumerate(packed):
            missing = [p for p in PROJ_KEYS if p not in t]
            if missing:
                raise ValueError(f"expert {e}: missing projection(s) {missing}")
        first = ref.expert_weights(packed[0], "expert 0")
        inter, hidden = first["gate"].codes.shape
        mod = cls(len(packed), hidden, inter, act_quant, reference)
        g_in, g_mid = _global_scales(packed, "gate"), _global_scales(packed, "down")
        if reference:
            mod._ref_experts = [first] + [ref.expert_weights(t, f"expert {e}") for e, t in enumerate(packed) if e > 0]
        else:
            pt.require_triton(device)  # routing, SwiGLU and combine are Triton kernels either way
            native = pm.load_native() if device.type == "cuda" and kernel != "triton" else None
            if kernel == "sparse-mma" and native is None:
                raise RuntimeError("kernel='sparse-mma' needs an sm_90 GPU and the native module (nvcc, CUTLASS)")
            if native is not None:
                mod.kernel, mod._native = "sparse-mma", native
                mod.k_ordered = pm.takes_permuted_activations(native)  # widths are multiples of the 32-block
                gate, up = [t["gate"] for t in packed], [t["up"] for t in packed]
                if mod.k_ordered:
                    order = pm.k_order(inter)
                    gate, up = [pm.permute_rows(t, order) for t in gate], [pm.permute_rows(t, order) for t in up]
                gate_up = pm.stack_gate_up(gate, up)
                del gate, up
                mod.gate_up = pm.P48MmaWeights.from_packed(gate_up, device, "gate/up")
                mod.down = pm.P48MmaWeights.from_packed([t["down"] for t in packed], device, "down")
                del gate_up
            else:
                gate = pt.P48GemmWeights.from_packed([t["gate"] for t in packed], device, "gate")
                up = pt.P48GemmWeights.from_packed([t["up"] for t in packed], device, "up")
                mod.gate_up = pt.stack_gate_up(gate, up)
                mod.down = pt.P48GemmWeights.from_packed([t["down"] for t in packed], device, "down")
                del gate, up
            for w, shape, what in ((mod.gate_up, (2 * inter, hidden), "gate/up"), (mod.down, (hidden, inter), "down")):
                if (w.out_features, w.in_features) != shape:
                    raise ValueError(f"{what} weights are {(w.out_features, w.in_features)}, expected {shape}")
        mod.register_buffer("g_in", g_in.to(device), persistent=False)
        mod.register_buffer("g_mid", g_mid.to(device), persistent=False)
        # Static scales fuse the quantization into the scatter / SwiGLU kernels; a 0 forces the amax pass.
        mod.static_in = bool((g_in > 0).all())
        mod.static_mid = bool((g_mid > 0).all())
        return mod

    def expert_nbytes(self) -> int:
        """Bytes of expert weights held on the device (packed), or of the decoded reference tensors."""
        if self.reference:
            return sum(t.numel() * t.element_size() for w in self._ref_experts for p in w.values()
                       for t in (p.codes, p.scales, p.global_scale))
        return self.gate_up.nbytes + self.down.nbytes

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(f"hidden_states must be [T, {self.hidden_dim}], got {tuple(hidden_states.shape)}")
        if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden_states.shape[0]:
            raise ValueError(f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
                             f"must both be [T={hidden_states.shape[0]}, k]")
        if self.reference:
            out = ref.p48_moe_ref(hidden_states, top_k_index, top_k_weights, self._ref_experts, self.act_quant)
            return out.to(device=hidden_states.device, dtype=hidden_states.dtype)
        return self._forward_fast(hidden_states, top_k_index, top_k_weights)

    def _forward_fast(self, hidden: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        T, k = idx.shape
        H, inter, E = self.hidden_dim, self.intermediate_dim, self.num_experts
        dev = hidden.device
        R = T * k
        out = torch.empty(T, H, dtype=hidden.dtype, device=dev)
        if T == 0:
            return out
        hidden = hidden.contiguous()
        flat = idx.reshape(-1).to(torch.int32).contiguous()
        counts = torch.zeros(E, dtype=torch.int32, device=dev).scatter_add_(0, flat.long(), torch.ones_like(flat))
        offsets = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).contiguous()
        cursor = torch.zeros(E, dtype=torch.int32, device=dev)
        slot_row = torch.empty(R, dtype=torch.int32, device=dev)
        row_expert = torch.empty(R, dtype=torch.int32, device=dev)
        aq = self.act_quant
        quant_in = aq and self.static_in
        xs = torch.empty(R, H, dtype=torch.bfloat16 if (not aq or quant_in) else hidden.dtype, device=dev)
        pt._route_scatter_kernel[(R,)](hidden, flat, offsets, cursor, slot_row, row_expert, xs, self.g_in,
                                       H, hidden.stride(0), xs.stride(0), TOPK=k, NBLK=8, QUANT=quant_in,
                                       PERM=self.k_ordered, num_warps=4)
        g_in = self.g_in
        active = max(1.0, pm.expected_active_experts(E, T, k))
        per = R / active
        # bf16 rows quantized by the GEMM give exactly the operands of the pre-pass (p48_mma.p48_mma_gemm_rows)
        in_kernel = (aq and not quant_in and self.quant_in_kernel and self.kernel == "sparse-mma"
                     and xs.dtype == torch.bfloat16 and pm.quantizes_activations(self._native))
        if aq and not quant_in:
            g_in = pt.dynamic_group_global(xs, row_expert, self.g_in)
            if not in_kernel:
                xs = pt.nvfp4_quantize_rows(xs, row_expert, g_in)
        alpha = 1.0 / (self.gate_up.global_scale * g_in) if aq else 1.0 / self.gate_up.global_scale
        y1 = self._gemm(xs, self.gate_up, offsets, counts, alpha, active, per, g_in if in_kernel else None,
                        self.k_ordered)
        quant_mid = aq and self.static_mid
        z = torch.empty(R, inter, dtype=torch.bfloat16 if (not aq or quant_mid) else torch.float32, device=dev)
        BR = 8
        pt._swiglu_kernel[(pt.triton.cdiv(R, BR),)](y1, z, row_expert, self.g_mid, R, inter, y1.stride(0), z.stride(0),
                                                    BR=BR, NBLK=4, QUANT=quant_mid, num_warps=4)
        g_mid = self.g_mid
        if aq and not quant_mid:
            g_mid = pt.dynamic_group_global(z, row_expert, self.g_mid)
            z = pt.nvfp4_quantize_rows(z, row_expert, g_mid)
        alpha = 1.0 / (self.down.global_scale * g_mid) if aq else 1.0 / self.down.global_scale
        y2 = self._gemm(z, self.down, offsets, counts, alpha, active, per, x_permuted=self.k_ordered)
        wts = wts.contiguous()
        BH = 256
        pt._combine_kernel[(T, pt.triton.cdiv(H, BH))](y2, slot_row, wts, out, H, y2.stride(0), out.stride(0),
                                                       TOPK=k, BH=BH, num_warps=4)
        return out

    def _gemm(self, x: torch.Tensor, w, offsets: torch.Tensor, counts: torch.Tensor, alpha: torch.Tensor,
              active: float, per: float, act_global: torch.Tensor | None = None,
              x_permuted: bool = False) -> torch.Tensor:
        """One grouped GEMM over the experts' row segments of x -> float32 [R, out]; act_global (sparse-mma
        only): the kernel quantizes x to NVFP4 with these per-expert global scales; x_permuted (sparse-mma only):
        x is in the kernel's K order."""
        R, K = x.shape
        M = w.out_features
        if self.kernel == "sparse-mma":
            cfg = pm.pick_config(M, K, active, per, x.device, experts=self.num_experts)
            y = (torch.zeros if cfg.split > 1 else torch.empty)(R, M, dtype=torch.float32, device=x.device)
            return pm.p48_mma_gemm_rows(x, w, offsets, counts, alpha, y, cfg, self._native, act_global, x_permuted)
        busy = min(self.num_experts, R)  # the Triton tiles' bound (they deal no units)
        cfg = pt.pick_config(M, K, busy, R / busy, x.device)
        y = (torch.zeros if cfg.split > 1 else torch.empty)(R, M, dtype=torch.float32, device=x.device)
        return pt.p48_gemm_rows(x, w, offsets, counts, alpha, y, cfg, self.use_asm)

    def extra_repr(self) -> str:
        path = {"reference": "reference (CPU)", "triton": "Triton p48 kernels",
                "sparse-mma": "p48 kernels on the 2:4 sparse tensor cores"}[self.kernel]
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"act_quant={self.act_quant}, path={path}")


def serves(device: torch.device, act_quant: bool, fast: bool | None) -> bool:
    """Whether this module serves p48-nvfp4 experts on `device` (serving.experts.make_experts asks): a Hopper
    GPU (sm_90), or wherever it is asked to (fast=True)."""
    if fast is not None:
        return fast
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def from_packed(packed: list[dict[str, dict[str, torch.Tensor]]], act_quant: bool, device) -> P48HopperExperts:
    return P48HopperExperts.from_packed(packed, act_quant=act_quant, device=device)
