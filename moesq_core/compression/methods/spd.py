"""Batched factorisations of symmetric positive definite matrices, built from matrix products.

The Hessian-based solvers factorise one Hessian per expert (hundreds of 2048² or 7168² matrices per block) and,
for masked least squares, one kept-set system per weight row (hundreds of thousands of 1024² systems). torch's
batched Cholesky on a GPU calls cuSOLVER's batched routines, which are built for small matrices and run large
ones at a small fraction of the GPU's fp64 rate. The recursive versions here split each matrix in halves
(Cholesky: factor the leading half, a triangular solve for the off-diagonal block, the Schur complement's
update as one batched product, recurse), so nearly all the work is batched matrix products; blocks of at most
`base` rows go to torch's own routines.

Two recursive strategies: "substitution" (L by recursion, triangular solves by recursion, torch's batched
triangular solve at the leaves) and "inverse" (the recursion carries L⁻¹ instead of L, so off-diagonal blocks and
solves are plain products and the leaves' triangular solves only ever have `base` right-hand sides).

`blocked=None` picks the recursive version on CUDA and torch's per-matrix LAPACK calls elsewhere (on a CPU
those are fast, and they give exactly the numbers the per-expert reference code computes).
"""
from __future__ import annotations

import torch

# The recursive factorisation's strategy and leaf size: the fastest of `benchmarks/bench_sgptq.py --factorisations`
# (H200, OBR's [256, 1024, 1024] fp64 kept-set solves: 15.5 ms, torch's batched cuSOLVER calls 23.5 ms).
BASE = 64
STRATEGY = "inverse"
STRATEGIES = ("substitution", "inverse")


def _use_blocked(A: torch.Tensor, blocked: bool | None) -> bool:
    return A.is_cuda if blocked is None else blocked


def _base(base: int | None) -> int:
    return BASE if base is None else base


def _split(n: int, base: int) -> int:
    """A split point near n/2 that is a multiple of min(base, 32), so products stay on aligned sizes."""
    unit = max(1, min(base, 32))
    h = (n // 2 + unit - 1) // unit * unit
    return min(max(h, unit), n - 1)


def cholesky(A: torch.Tensor, blocked: bool | None = None,
             base: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower L with A = L Lᵀ for A [..., n, n]; ok [...] is False where A is not numerically positive definite
    (L is then meaningless for that matrix)."""
    base = _base(base)
    if not _use_blocked(A, blocked) or A.shape[-1] <= base:
        L, info = torch.linalg.cholesky_ex(A)
        return L, (info == 0) & torch.isfinite(L).flatten(-2).all(-1)
    n = A.shape[-1]
    h = _split(n, base)
    L11, ok1 = cholesky(A[..., :h, :h], True, base)
    L21 = solve_lower(L11, A[..., h:, :h].mT, True, base).mT  # A21 L11⁻ᵀ
    L22, ok2 = cholesky(A[..., h:, h:] - L21 @ L21.mT, True, base)
    L = torch.zeros_like(A)
    L[..., :h, :h] = L11
    L[..., h:, :h] = L21
    L[..., h:, h:] = L22
    return L, ok1 & ok2


def solve_lower(L: torch.Tensor, B: torch.Tensor, blocked: bool | None = None, base: int | None = None) -> torch.Tensor:
    """X with L X = B, L lower triangular [..., n, n], B [..., n, r]."""
    base = _base(base)
    if not _use_blocked(L, blocked) or L.shape[-1] <= base:
        return torch.linalg.solve_triangular(L, B, upper=False)
    h = _split(L.shape[-1], base)
    X1 = solve_lower(L[..., :h, :h], B[..., :h, :], True, base)
    X2 = solve_lower(L[..., h:, h:], B[..., h:, :] - L[..., h:, :h] @ X1, True, base)
    return torch.cat([X1, X2], -2)


def solve_upper(U: torch.Tensor, B: torch.Tensor, blocked: bool | None = None, base: int | None = None) -> torch.Tensor:
    """X with U X = B, U upper triangular [..., n, n], B [..., n, r]."""
    base = _base(base)
    if not _use_blocked(U, blocked) or U.shape[-1] <= base:
        return torch.linalg.solve_triangular(U, B, upper=True)
    h = _split(U.shape[-1], base)
    X2 = solve_upper(U[..., h:, h:], B[..., h:, :], True, base)
    X1 = solve_upper(U[..., :h, :h], B[..., :h, :] - U[..., :h, h:] @ X2, True, base)
    return torch.cat([X1, X2], -2)


def inverse_cholesky_factor(A: torch.Tensor, base: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """L⁻¹ (lower triangular) where A = L Lᵀ, by the recursion of `cholesky` carrying the inverse: with
    L11⁻¹ from the leading half, L21 = A21 L11⁻ᵀ, S = A22 − L21 L21ᵀ = L22 L22ᵀ, and
    L⁻¹ = [[L11⁻¹, 0], [−L22⁻¹ L21 L11⁻¹, L22⁻¹]]. ok per matrix as in `cholesky`."""
    base = _base(base)
    n = A.shape[-1]
    if n <= base:
        L, info = torch.linalg.cholesky_ex(A)
        eye = torch.eye(n, dtype=A.dtype, device=A.device).expand_as(A)
        Li = torch.linalg.solve_triangular(L, eye, upper=False)
        return Li, (info == 0) & torch.isfinite(Li).flatten(-2).all(-1)
    h = _split(n, base)
    L11i, ok1 = inverse_cholesky_factor(A[..., :h, :h], base)
    L21 = A[..., h:, :h] @ L11i.mT
    L22i, ok2 = inverse_cholesky_factor(A[..., h:, h:] - L21 @ L21.mT, base)
    out = torch.zeros_like(A)
    out[..., :h, :h] = L11i
    out[..., h:, h:] = L22i
    out[..., h:, :h] = -(L22i @ (L21 @ L11i))
    return out, ok1 & ok2


def inverse_lower(L: torch.Tensor, blocked: bool | None = None, base: int | None = None) -> torch.Tensor:
    """L⁻¹ of a lower triangular L [..., n, n] (lower triangular too)."""
    base = _base(base)
    n = L.shape[-1]
    if not _use_blocked(L, blocked) or n <= base:
        eye = torch.eye(n, dtype=L.dtype, device=L.device).expand_as(L)
        return torch.linalg.solve_triangular(L, eye, upper=False)
    h = _split(n, base)
    A = inverse_lower(L[..., :h, :h], True, base)
    C = inverse_lower(L[..., h:, h:], True, base)
    out = torch.zeros_like(L)
    out[..., :h, :h] = A
    out[..., h:, h:] = C
    out[..., h:, :h] = -(C @ (L[..., h:, :h] @ A))
    return out


def inverse_cholesky_upper(H: torch.Tensor, blocked: bool | None = None,
                           base: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper U with H⁻¹ = UᵀU (GPTQ's chol(H⁻¹)), and ok per matrix.

    Unblocked: torch's chol → cholesky_inverse → chol (what the per-expert code does). Blocked: with J the
    index reversal and J H J = L̃ L̃ᵀ, U = J L̃⁻¹ J is upper with positive diagonal and UᵀU = H⁻¹, so by
    uniqueness it is the same factor, from one Cholesky and one triangular inverse.
    """
    base = _base(base)
    if not _use_blocked(H, blocked):
        L, ok = cholesky(H, False)
        U, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
        return U, ok & (info2 == 0) & torch.isfinite(U).flatten(-2).all(-1)
    if STRATEGY == "inverse":
        Lri, ok = inverse_cholesky_factor(H.flip(-1, -2), base)
    else:
        Lr, ok = cholesky(H.flip(-1, -2), True, base)
        Lri = inverse_lower(Lr, True, base)
        del Lr
    U = Lri.flip(-1, -2)
    return U, ok & torch.isfinite(U).flatten(-2).all(-1)


def spd_solve(A: torch.Tensor, B: torch.Tensor, blocked: bool | None = None,
              base: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """X = A⁻¹ B for SPD A [..., n, n], B [..., n, r], by Cholesky; ok per matrix."""
    base = _base(base)
    if _use_blocked(A, blocked) and STRATEGY == "inverse":
        Li, ok = inverse_cholesky_factor(A, base)
        return Li.mT @ (Li @ B), ok
    L, ok = cholesky(A, blocked, base)
    if not _use_blocked(A, blocked):
        return torch.cholesky_solve(B, L), ok
    return solve_upper(L.mT, solve_lower(L, B, True, base), True, base), ok
