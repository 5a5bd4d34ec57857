"""Fused Gumbel-softmax relaxation of sparsity patterns for refinement (Triton; forward and backward).

Computes, per group of `group` weights with P pattern logits (moesq_core.compression.methods.refine.relaxation is the
reference and says what the terms mean):

    G = −log(−log U)                      (U uniform noise, clamped as relaxation.gumbel_noise does)
    π = softmax((gain·A + G) / τ)         over the P patterns
    W̃ = (π · Pat) ⊙ V                     Pat the [P, group] 0/1 pattern matrix

The composition of torch ops reads and writes [..., G, P] fp32 tensors several times per step and reduces
over an axis of 6, which torch.compile maps poorly (~0.2 TB/s on an H200:
benchmarks/results/refine_h200_2026-12-01_75a3a44_profile_compile.txt). Here one program handles BLOCK
groups with all P logits and `group` weights in registers: the forward reads A, U, V and writes W̃ once; the
backward recomputes π from A and U (nothing [G, P]-sized is saved) and writes dA and dV.
Two forms compute this (KERNELS): the tile form holds π as a [BLOCK, P] tile and reduces [BLOCK, P, group]
products; the column form reads each pattern's logits as a column and builds the weights' tile elementwise.
"""
from __future__ import annotations

import torch

from moesq_core.triton_support import HAS_TRITON, INTERPRET, tl, triton


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run for tensors on `device` (CUDA with Triton, or the interpreter)."""
    return HAS_TRITON and (device.type == "cuda" or INTERPRET)


if HAS_TRITON:
    # groups per program x warps: tuned once per problem size (the kernels only write their outputs, so
    # the tuning runs need no state restored)
    _CONFIGS = [triton.Config({"BLOCK_G": b}, num_warps=w) for b, w in ((64, 4), (128, 4), (128, 8), (256, 8))]
    if INTERPRET:
        _CONFIGS = _CONFIGS[:1]

    @triton.jit
    def _probs(a_ptr, u_ptr, rows, rmask, gain, inv_tau, tiny, one_minus_eps,
               P: tl.constexpr, PP: tl.constexpr, HAS_NOISE: tl.constexpr):
        """π [BLOCK, PP] (zero on the padding patterns p >= P)."""
        p = tl.arange(0, PP)
        pm = p < P
        m2 = rmask[:, None] & pm[None, :]
        off = rows[:, None] * P + p[None, :]
        logit = tl.load(a_ptr + off, mask=m2, other=0.0).to(tl.float32) * gain
        if HAS_NOISE:
            u = tl.load(u_ptr + off, mask=m2, other=0.5).to(tl.float32)
            u = tl.minimum(tl.maximum(u, tiny), one_minus_eps)
            logit += -tl.log(-tl.log(u))
        x = tl.where(pm[None, :], logit * inv_tau, float("-inf"))
        mx = tl.max(x, axis=1)
        e = tl.exp(x - mx[:, None])
        return e / tl.sum(e, axis=1)[:, None]

    @triton.jit
    def _group_tile(a_ptr, u_ptr, pat_ptr, n_groups, gain, inv_tau, tiny, one_minus_eps, P: tl.constexpr,
                    PP: tl.constexpr, GROUP: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK_G: tl.constexpr):
        """This program's BLOCK_G groups: (rows, row mask, π [BLOCK, PP], the [PP, GROUP] pattern matrix
        (padding rows 0), offsets and mask of their [BLOCK, GROUP] weights)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        rmask = rows < n_groups
        pi = _probs(a_ptr, u_ptr, rows, rmask, gain, inv_tau, tiny, one_minus_eps, P, PP, HAS_NOISE)
        j = tl.arange(0, GROUP)
        pat = tl.load(pat_ptr + tl.arange(0, PP)[:, None] * GROUP + j[None, :])
        return rows, rmask, pi, pat, rows[:, None] * GROUP + j[None, :], rmask[:, None]

    @triton.autotune(configs=_CONFIGS, key=["n_groups", "P", "GROUP", "HAS_NOISE"])
    @triton.jit
    def _relax_fwd_kernel(a_ptr, u_ptr, v_ptr, pat_ptr, out_ptr, n_groups, gain, inv_tau, tiny, one_minus_eps,
                          P: tl.constexpr, PP: tl.constexpr, GROUP: tl.constexpr, HAS_NOISE: tl.constexpr,
                          BLOCK_G: tl.constexpr):
        rows, rmask, pi, pat, voff, vm = _group_tile(a_ptr, u_ptr, pat_ptr, n_groups, gain, inv_tau, tiny,
                                                     one_minus_eps, P, PP, GROUP, HAS_NOISE, BLOCK_G)
        z = tl.sum(pi[:, :, None] * pat[None, :, :], axis=1)  # [BLOCK, GROUP] expected keep mask
        v = tl.load(v_ptr + voff, mask=vm, other=0.0).to(tl.float32)
        tl.store(out_ptr + voff, (z * v).to(out_ptr.dtype.element_ty), mask=vm)

    @triton.autotune(configs=_CONFIGS, key=["n_groups", "P", "GROUP", "HAS_NOISE", "NEED_DA", "NEED_DV"])
    @triton.jit
    def _relax_bwd_kernel(a_ptr, u_ptr, v_ptr, pat_ptr, dout_ptr, da_ptr, dv_ptr, n_groups, gain, inv_tau, tiny,
                          one_minus_eps, P: tl.constexpr, PP: tl.constexpr, GROUP: tl.constexpr,
                          HAS_NOISE: tl.constexpr, NEED_DA: tl.constexpr, NEED_DV: tl.constexpr,
                          BLOCK_G: tl.constexpr):
        rows, rmask, pi, pat, voff, vm = _group_tile(a_ptr, u_ptr, pat_ptr, n_groups, gain, inv_tau, tiny,
                                                     one_minus_eps, P, PP, GROUP, HAS_NOISE, BLOCK_G)
        dout = tl.load(dout_ptr + voff, mask=vm, other=0.0).to(tl.float32)
        if NEED_DV:
            z = tl.sum(pi[:, :, None] * pat[None, :, :], axis=1)
            tl.store(dv_ptr + voff, (dout * z).to(dv_ptr.dtype.element_ty), mask=vm)
        if NEED_DA:
            v = tl.load(v_ptr + voff, mask=vm, other=0.0).to(tl.float32)
            dz = dout * v  # [BLOCK, GROUP]
            dpi = tl.sum(dz[:, None, :] * pat[None, :, :], axis=2)  # [BLOCK, PP]
            dx = pi * (dpi - tl.sum(pi * dpi, axis=1)[:, None])  # softmax Jacobian
            p = tl.arange(0, PP)
            m2 = rmask[:, None] & (p < P)[None, :]
            tl.store(da_ptr + rows[:, None] * P + p[None, :], (dx * (gain * inv_tau)).to(da_ptr.dtype.element_ty),
                     mask=m2)


    # The same computation with no [BLOCK, P]- or [BLOCK, P, group]-shaped tensors: the P logits of a group are
    # read as P columns (one scalar per group each), the softmax runs over them unrolled, and the weights are
    # [BLOCK, group] tiles built as Σ_p π_p·Pat[p] — plain elementwise work in one register layout, where the
    # tile kernels above reduce over small middle axes (layout conversions through shared memory). π is
    # recomputed per pass from A and U (still in L1) rather than kept.

    @triton.jit
    def _logit_col(a_ptr, u_ptr, rows, rmask, p, gain, inv_tau, tiny, one_minus_eps, P: tl.constexpr,
                   HAS_NOISE: tl.constexpr):
        """(gain·A[:, p] + G[:, p]) / τ for the groups `rows`: [BLOCK] fp32."""
        logit = tl.load(a_ptr + rows * P + p, mask=rmask, other=0.0).to(tl.float32) * gain
        if HAS_NOISE:
            u = tl.load(u_ptr + rows * P + p, mask=rmask, other=0.5).to(tl.float32)
            u = tl.minimum(tl.maximum(u, tiny), one_minus_eps)
            logit += -tl.log(-tl.log(u))
        return logit * inv_tau

    @triton.jit
    def _col_softmax(a_ptr, u_ptr, pat_ptr, rows, rmask, j, gain, inv_tau, tiny, one_minus_eps, P: tl.constexpr,
                     GROUP: tl.constexpr, HAS_NOISE: tl.constexpr):
        """(max logit [BLOCK], Σ_p exp(x_p − max) [BLOCK], z = Σ_p π_p·Pat[p] [BLOCK, GROUP])."""
        mx = _logit_col(a_ptr, u_ptr, rows, rmask, 0, gain, inv_tau, tiny, one_minus_eps, P, HAS_NOISE)
        for p in tl.static_range(1, P):
            mx = tl.maximum(mx, _logit_col(a_ptr, u_ptr, rows, rmask, p, gain, inv_tau, tiny, one_minus_eps, P,
                                           HAS_NOISE))
        den = tl.zeros_like(mx)
        z = tl.zeros((rows.shape[0], GROUP), dtype=tl.float32)
        for p in tl.static_range(P):
            e = tl.exp(_logit_col(a_ptr, u_ptr, rows, rmask, p, gain, inv_tau, tiny, one_minus_eps, P, HAS_NOISE) - mx)
            den += e
            z += e[:, None] * tl.load(pat_ptr + p * GROUP + j)[None, :]
        return mx, den, z / den[:, None]

    _COLS_CONFIGS = [triton.Config({"BLOCK_G": b}, num_warps=w) for b, w in ((128, 4), (256, 4), (256, 8), (512, 8))]
    if INTERPRET:
        _COLS_CONFIGS = _COLS_CONFIGS[:1]

    @triton.autotune(configs=_COLS_CONFIGS, key=["n_groups", "P", "GROUP", "HAS_NOISE"])
    @triton.jit
    def _relax_fwd_cols_kernel(a_ptr, u_ptr, v_ptr, pat_ptr, out_ptr, n_groups, gain, inv_tau, tiny, one_minus_eps,
                               P: tl.constexpr, GROUP: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK_G: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        rmask = rows < n_groups
        j = tl.arange(0, GROUP)
        _, _, z = _col_softmax(a_ptr, u_ptr, pat_ptr, rows, rmask, j, gain, inv_tau, tiny, one_minus_eps, P, GROUP,
                               HAS_NOISE)
        voff, vm = rows[:, None] * GROUP + j[None, :], rmask[:, None]
        v = tl.load(v_ptr + voff, mask=vm, other=0.0).to(tl.float32)
        tl.store(out_ptr + voff, (z * v).to(out_ptr.dtype.element_ty), mask=vm)

    @triton.autotune(configs=_COLS_CONFIGS, key=["n_groups", "P", "GROUP", "HAS_NOISE", "NEED_DA", "NEED_DV"])
    @triton.jit
    def _relax_bwd_cols_kernel(a_ptr, u_ptr, v_ptr, pat_ptr, dout_ptr, da_ptr, dv_ptr, n_groups, gain, inv_tau,
                               tiny, one_minus_eps, P: tl.constexpr, GROUP: tl.constexpr, HAS_NOISE: tl.constexpr,
                               NEED_DA: tl.constexpr, NEED_DV: tl.constexpr, BLOCK_G: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        rmask = rows < n_groups
        j = tl.arange(0, GROUP)
        mx, den, z = _col_softmax(a_ptr, u_ptr, pat_ptr, rows, rmask, j, gain, inv_tau, tiny, one_minus_eps, P,
                                  GROUP, HAS_NOISE)
        voff, vm = rows[:, None] * GROUP + j[None, :], rmask[:, None]
        dout = tl.load(dout_ptr + voff, mask=vm, other=0.0).to(tl.float32)
        if NEED_DV:
            tl.store(dv_ptr + voff, (dout * z).to(dv_ptr.dtype.element_ty), mask=vm)
        if NEED_DA:
            dz = dout * tl.load(v_ptr + voff, mask=vm, other=0.0).to(tl.float32)
            # softmax Jacobian: dx_p = π_p·(dπ_p − Σ_q π_q dπ_q), dπ_p = Σ_j dz_j Pat[p, j], Σ_q π_q dπ_q = Σ_j dz_j z_j
            dot = tl.sum(dz * z, axis=1)
            for p in tl.static_range(P):
                pi = tl.exp(_logit_col(a_ptr, u_ptr, rows, rmask, p, gain, inv_tau, tiny, one_minus_eps, P,
                                       HAS_NOISE) - mx) / den
                dpi = tl.sum(dz * tl.load(pat_ptr + p * GROUP + j)[None, :], axis=1)
                tl.store(da_ptr + rows * P + p, (pi * (dpi - dot) * (gain * inv_tau)).to(da_ptr.dtype.element_ty),
                         mask=rmask)


# the relaxation's kernels: "cols" (the column form, the default: several times faster forward and backward) or
# "tile", a variant of benchmarks/bench_refine.py (_relax_*_kernel vs _relax_*_cols_kernel in
# benchmarks/results/refine_h200_2026-12-01_202e777_profile_static-width.txt and _profile_grad-fwd.txt).
KERNELS = "cols"


def _grid(n_groups: int):
    return lambda meta: (triton.cdiv(n_groups, meta["BLOCK_G"]),)


_TABLES: dict = {}  # (pattern rows, device) -> its table on that device


def _pattern_table(pattern_matrix: torch.Tensor, device) -> tuple[torch.Tensor, int]:
    """[P, group] 0/1 -> fp32 [PP, group] on `device`, PP = P rounded up to a power of two (rows of zeros).
    Built once per pattern set and device: a fresh copy per call would be a host-to-device transfer (and a
    wait for the queue) in every refinement step."""
    key = (tuple(map(tuple, pattern_matrix.cpu().tolist())), str(device))
    if key not in _TABLES:
        P, group = pattern_matrix.shape
        PP = triton.next_power_of_2(P)
        pat = torch.zeros(PP, group, dtype=torch.float32, device=device)
        pat[:P] = pattern_matrix.to(device, torch.float32)
        _TABLES[key] = pat, PP
    return _TABLES[key]


class _RelaxedWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, V, U, pattern_matrix, tau: float, gain: float):
        P, group = pattern_matrix.shape
        n_groups = A.numel() // P
        A_, V_ = A.contiguous(), V.contiguous()
        U_ = None if U is None else U.contiguous()
        pat, PP = _pattern_table(pattern_matrix, A.device)
        out = torch.empty_like(V_)
        fi = torch.finfo(torch.float32)
        consts = (float(gain), 1.0 / float(tau), fi.tiny, 1.0 - fi.eps)
        if KERNELS == "cols":
            _relax_fwd_cols_kernel[_grid(n_groups)](A_, A_ if U_ is None else U_, V_, pat, out, n_groups, *consts,
                                                    P=P, GROUP=group, HAS_NOISE=U_ is not None)
        else:
            _relax_fwd_kernel[_grid(n_groups)](A_, A_ if U_ is None else U_, V_, pat, out, n_groups, *consts,
                                               P=P, PP=PP, GROUP=group, HAS_NOISE=U_ is not None)
        ctx.save_for_backward(A_, V_, U_, pat)
        ctx.meta = (P, PP, group, n_groups, consts)
        return out

    @staticmethod
    def backward(ctx, dout):
        A, V, U, pat = ctx.saved_tensors
        P, PP, group, n_groups, consts = ctx.meta
        need_da, need_dv = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_da or need_dv):
            return None, None, None, None, None, None
        dout = dout.contiguous()
        dA = torch.empty_like(A) if need_da else None
        dV = torch.empty_like(V) if need_dv else None
        args = (A, A if U is None else U, V, pat, dout, A if dA is None else dA, V if dV is None else dV, n_groups,
                *consts)
        if KERNELS == "cols":
            _relax_bwd_cols_kernel[_grid(n_groups)](*args, P=P, GROUP=group, HAS_NOISE=U is not None,
                                                    NEED_DA=need_da, NEED_DV=need_dv)
        else:
            _relax_bwd_kernel[_grid(n_groups)](*args, P=P, PP=PP, GROUP=group, HAS_NOISE=U is not None,
                                               NEED_DA=need_da, NEED_DV=need_dv)
        return dA, dV, None, None, None, None


def relaxed_weight(A: torch.Tensor, V: torch.Tensor, U: torch.Tensor | None, pattern_matrix: torch.Tensor,
                   tau: float, gain: float) -> torch.Tensor:
    """(π(A, U) · Pat) ⊙ V with π = softmax((gain·A − log(−log U))/τ); A [..., G, P], U like A or None (no
    noise), V [..., G·group]; differentiable in A and V. Needs `available(A.device)`."""
    if not available(A.device):
        raise RuntimeError("the fused relaxation kernel runs on CUDA with Triton (or under TRITON_INTERPRET=1), "
                           f"got {A.device}")
    if tau <= 0:
        raise ValueError(f"temperature must be positive, got {tau}")
    P, group = pattern_matrix.shape
    if A.shape[-1] != P or V.numel() != A.numel() // P * group:
        raise ValueError(f"logits {tuple(A.shape)} and weights {tuple(V.shape)} "
                         f"do not match a [{P}, {group}] pattern set")
    if U is not None and U.shape != A.shape:
        raise ValueError(f"noise {tuple(U.shape)} does not match logits {tuple(A.shape)}")
    return _RelaxedWeight.apply(A, V, U, pattern_matrix, float(tau), float(gain))
