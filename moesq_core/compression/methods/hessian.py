"""Layer-wise Hessians H = 2/n Σ c_t x_t x_tᵀ of one expert's projections, and the factorisations the
Hessian-based solvers (SGPTQ, OBR) share.

gate and up see the same input (the tokens routed to the expert), so they share one Hessian; down sees the
SwiGLU intermediate of the *uncompressed* gate/up (the dense target of each projection).
c_t is 1, the router weight w_t or w_t² (`weighting`), which turns ‖(W−Ŵ)X‖² into the router-weighted
objective of the paper's eq. 4.

Everything here keeps the tensor's device; accumulation is fp64, factorisations fp64, results fp32: the
Cholesky chain H → H⁻¹ → chol(H⁻¹) loses digits in fp32 on ill-conditioned calibration sets, and bf16 is
never used. The iterative kept-set solves (`kept_set_solve`, solve="cg") run in fp32: they stop on the
objective's own decrease, which fp32 round-off does not fool at the tolerance used.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from moesq_core.compression.methods import spd
from moesq_core.compression.methods.base import ExpertData, RowPieces

log = logging.getLogger(__name__)

WEIGHTINGS = ("none", "w", "w2")


def check_weighting(weighting: str) -> None:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"hessian_weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")


def check_damping(percdamp: float) -> None:
    if not percdamp >= 0:
        raise ValueError(f"percdamp must be >= 0 (a fraction of mean(diag H)), got {percdamp}")


def token_coefficients(n: int, w: torch.Tensor | None, weighting: str, device) -> torch.Tensor | None:
    """Per-token c_t for the weighting mode; None means uniform."""
    check_weighting(weighting)
    if weighting == "none":
        return None
    if w is None or w.numel() != n:
        raise ValueError(f"hessian weighting {weighting!r} needs one router weight per token ({n} tokens)")
    w = w.detach().to(device=device, dtype=torch.float64).reshape(-1)
    return w if weighting == "w" else w * w


def _pieces(x) -> tuple[int, int, object]:
    """(rows, width, (first row, piece) pairs) of a tensor [n, d] or RowPieces."""
    if isinstance(x, RowPieces):
        return x.n, x.width, iter(x)
    if x.dim() != 2:
        raise ValueError(f"calibration inputs must be [tokens, features], got shape {tuple(x.shape)}")
    return x.shape[0], x.shape[1], iter([(0, x)])


def hessian(x: torch.Tensor | RowPieces, w: torch.Tensor | None = None, weighting: str = "none",
            chunk: int = 8192) -> torch.Tensor:
    """H = 2/Σc Σ_t c_t x_t x_tᵀ (c_t = 1 gives GPTQ's 2/n XᵀX). x: [n, d], or RowPieces (made piece by piece, the
    same sums in the same order). fp64 accumulation, fp32 result.

    n = 0 (or all-zero weights) gives the zero matrix: every column is then dead.
    """
    n, d, pieces = _pieces(x)
    device = x.device
    c = H = None
    for start, xp in pieces:
        if H is None:
            device = xp.device
            c = token_coefficients(n, w, weighting, device)
            H = torch.zeros(d, d, dtype=torch.float64, device=device)
        for s in range(0, xp.shape[0], chunk):  # chunked so the fp64 copy of x never exceeds `chunk` rows
            xs = xp[s:s + chunk].to(torch.float64)
            o = start + s
            xw = xs if c is None else xs * c[o:o + xs.shape[0], None]
            H += xw.T @ xs
    if H is None:  # no rows
        token_coefficients(n, w, weighting, device)
        return torch.zeros(d, d, device=device)
    total = float(n) if c is None else float(c.sum())
    if total > 0:
        H *= 2.0 / total
    return H.float()


def input_sq_norms(x: torch.Tensor | RowPieces, w: torch.Tensor | None = None, weighting: str = "none") -> torch.Tensor:
    """Σ_t c_t x_tj² per input column j (fp32): Wanda's ‖X_j‖₂², optionally router-weighted. x: [n, d] or
    RowPieces."""
    n, d, pieces = _pieces(x)
    out = None
    for start, xp in pieces:
        c = token_coefficients(n, w, weighting, xp.device)
        x64 = xp.to(torch.float64)
        sq = x64 * x64
        part = sq.sum(0) if c is None else (sq * c[start:start + xp.shape[0], None]).sum(0)
        out = part if out is None else out + part
    if out is None:
        return torch.zeros(d, device=x.device)
    return out.float()


def expert_hessians(ex: ExpertData, weighting: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """(H_in, H_mid): the Hessian shared by gate and up, and down's Hessian over the dense SwiGLU output."""
    x = ex.inputs()
    h_in = hessian(x, ex.w, weighting)
    h_mid = hessian(ex.dense_intermediate(x), ex.w, weighting)
    return h_in, h_mid


def dead_columns(H: torch.Tensor) -> torch.Tensor:
    """Input columns no calibration token ever excites (diag H = 0)."""
    return torch.diagonal(H) == 0


def fix_dead(H: torch.Tensor, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's handling of dead columns: diag set to 1 (keeps H invertible) and the weight column zeroed
    (its value cannot be observed, so any value is as good as zero and zero costs nothing to store)."""
    dead = dead_columns(H)
    if not bool(dead.any()):
        return H, W
    H = H.clone()
    idx = dead.nonzero().squeeze(1)
    H[idx, idx] = 1.0
    W = W.clone()
    W[:, dead] = 0.0
    return H, W


@dataclass
class Damped:
    """A damped Hessian and its factorisation (all fp32, on H's device)."""

    H: torch.Tensor  # H + λI, dead columns fixed
    hinv_chol: torch.Tensor  # upper U with (H + λI)⁻¹ = UᵀU: the row-by-row OBS/GPTQ quantities
    percdamp: float  # the fraction of mean(diag H) actually used (grows on retries)
    damp: float  # λ


def damped_factor(H: torch.Tensor, percdamp: float = 0.01, max_tries: int = 6, what: str = "hessian") -> Damped:
    """λ = percdamp·mean(diag H); a Hessian that is not positive definite after damping is retried with
    10× more damping (logged) up to `max_tries` times. H must already have its dead columns fixed."""
    if percdamp < 0:
        raise ValueError(f"percdamp must be >= 0, got {percdamp}")
    if not bool(torch.isfinite(H).all()):
        raise ValueError(f"{what}: non-finite entries in the Hessian (NaN/Inf calibration inputs?)")
    H64 = H.to(torch.float64)
    d = H.shape[0]
    mean_diag = float(torch.diagonal(H64).mean()) if d else 0.0
    eye = torch.eye(d, dtype=torch.float64, device=H.device)
    pd = percdamp
    for attempt in range(max_tries):
        damp = pd * mean_diag
        Hd = H64 + damp * eye
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            # chol(H⁻¹) upper, as GPTQ: U = chol(cholesky_inverse(L))ᵀ. The inverse of a PD matrix is PD,
            # but fp rounding can still break the second factorisation: treat that as a failure too.
            U, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if int(info2) == 0 and bool(torch.isfinite(U).all()):
                return Damped(Hd.float(), U.float(), pd, damp)
        nxt = pd * 10 if pd > 0 else 1e-6
        log.warning("%s: not positive definite with percdamp=%g; retrying with percdamp=%g", what, pd, nxt)
        pd = nxt
    raise ValueError(f"{what}: not positive definite even with percdamp={pd / 10:g}; calibration data degenerate?")


def relative_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """‖(W−Ŵ)X‖²/‖WX‖² computed through H ∝ XᵀX (the constant cancels). 0 when WX = 0 and Ŵ = W."""
    E = (W.float() - W_hat.float()).to(torch.float64)
    H64 = H.to(torch.float64)
    num = float(((E @ H64) * E).sum())
    W64 = W.to(torch.float64)
    den = float(((W64 @ H64) * W64).sum())
    if den <= 0:
        return 0.0 if num <= 0 else float("inf")
    return num / den


def row_sets(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, pruned) column indices per row, ascending: [R, k], [R, C−k]. Every row keeps the same count
    (each group keeps kept_per_group entries)."""
    R, C = mask.shape
    k = int(mask[0].sum())
    if not bool((mask.sum(1) == k).all()):
        raise ValueError("a masked reconstruction needs the same number of kept entries in every row")
    kept = mask.nonzero()[:, 1].reshape(R, k)
    pruned = (~mask).nonzero()[:, 1].reshape(R, C - k)
    return kept, pruned


def batched_masked_solve(H: torch.Tensor, rows_a: torch.Tensor, rows_b: torch.Tensor, rhs: torch.Tensor,
                         budget: int = 1 << 26, solve: str = "exact") -> torch.Tensor:
    """Per row r: solve H[a_r, a_r] δ = H[a_r, b_r] rhs_r. rows_a [R, ka], rows_b [R, kb], rhs [R, kb].
    solve="cg": `kept_set_solve` for this one matrix."""
    check_solve(solve)
    if solve != "exact":
        return kept_set_solve(H[None], rows_a[None], rows_b[None], rhs[None], solve)[0]
    R, ka = rows_a.shape
    kb = rows_b.shape[1]
    out = torch.zeros(R, ka, dtype=torch.float32, device=H.device)
    if ka == 0 or kb == 0:
        return out
    step = max(1, budget // (ka * (ka + kb)))
    H64 = H.to(torch.float64)  # the gathered systems are small; fp64 keeps ill-conditioned ones honest
    for s in range(0, R, step):
        a, b = rows_a[s:s + step], rows_b[s:s + step]
        Haa = H64[a[:, :, None], a[:, None, :]]
        Hab = H64[a[:, :, None], b[:, None, :]]
        L, info = torch.linalg.cholesky_ex(Haa)
        if bool((info != 0).any()):
            raise ValueError("a kept-set block of the damped Hessian is not positive definite")
        rhs_s = (Hab @ rhs[s:s + step, :, None].to(torch.float64))
        out[s:s + step] = torch.cholesky_solve(rhs_s, L)[..., 0].float()
    return out


def masked_optimum(W: torch.Tensor, H: torch.Tensor, mask: torch.Tensor, solve: str = "exact",
                   start: torch.Tensor | None = None) -> torch.Tensor:
    """argmin over W' supported on mask of tr((W−W')H(W−W')ᵀ): per row, with kept set K and pruned set Z,
    W'_K = W_K + H_KK⁻¹ H_KZ W_Z (the closed-form OBS update of OBR). H damped. solve="cg" (from `start`, a guess
    of W'): `masked_optimum_batched` for this one matrix."""
    check_solve(solve)
    if solve != "exact":
        return masked_optimum_batched(W[None], H[None], mask[None], solve=solve,
                                      start=None if start is None else start[None])[0]
    kept, pruned = row_sets(mask)
    delta = batched_masked_solve(H, kept, pruned, W.gather(1, pruned))
    return (W * mask).scatter_add(1, kept, delta)


# ---------------------------------------------------------------- batched over the experts of a block
#
# The same quantities for E experts at once: Hessians [E, C, C], weights [E, R, C]. Per-expert numbers (damping,
# retries, dead columns) stay per expert; factorisations and solves are batched (`spd`).


@dataclass
class BlockStatistics:
    """What the batched solvers need from the calibration inputs of one projection kind, for E experts."""

    H: torch.Tensor  # [E, d, d] Hessians with the method's weighting
    H_plain: torch.Tensor  # [E, d, d] unweighted (the reported errors); H itself when the weighting is "none"
    sq_norms: torch.Tensor | None  # [E, d] Σ c_t x_tj² (Wanda's scores), when asked for


def block_statistics(experts: list[ExpertData], inputs: Callable[[ExpertData], torch.Tensor | RowPieces],
                     weighting: str = "none", sq_norms: bool = False) -> BlockStatistics:
    """`hessian` (and `input_sq_norms`) of each expert's inputs(ex), one expert at a time: token counts differ,
    and an input such as the SwiGLU intermediate is made for one expert only, never for the chunk, and piece by
    piece where inputs(ex) gives RowPieces (ExpertData.input_pieces, intermediate_pieces)."""
    hs, plain, norms = [], [], []
    for ex in experts:
        x = inputs(ex)
        hs.append(hessian(x, ex.w, weighting))
        if weighting != "none":
            plain.append(hessian(x))
        if sq_norms:
            norms.append(input_sq_norms(x, ex.w, weighting))
        del x
    H = torch.stack(hs)
    del hs
    return BlockStatistics(H, torch.stack(plain) if plain else H, torch.stack(norms) if sq_norms else None)


def fix_dead_batched(H: torch.Tensor, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fix_dead` per expert: H [E, C, C], W [E, R, C] (new tensors; the inputs are not modified)."""
    dead = torch.diagonal(H, dim1=-2, dim2=-1) == 0  # [E, C]
    H = H + torch.diag_embed(dead.to(H.dtype))  # the diagonal is exactly 0 there: this sets it to 1
    W = torch.where(dead[:, None, :], torch.zeros((), dtype=W.dtype, device=W.device), W)
    return H, W


@dataclass
class DampedBatch:
    """`Damped` for E experts: H [E, C, C] (H + λ_e I, dead columns fixed), hinv_chol [E, C, C] (fp32)."""

    H: torch.Tensor
    hinv_chol: torch.Tensor
    percdamp: list[float]
    damp: list[float]


def damped_factors(H: torch.Tensor, percdamp: float = 0.01, max_tries: int = 6, what: list[str] | None = None,
                   blocked: bool | None = None) -> DampedBatch:
    """`damped_factor` for E experts at once: λ_e = percdamp·mean(diag H_e); an expert whose damped Hessian is not
    positive definite is retried alone with 10× more damping (logged), up to `max_tries` times. what[e] names
    expert e in messages. H [E, C, C] with dead columns fixed."""
    if percdamp < 0:
        raise ValueError(f"percdamp must be >= 0, got {percdamp}")
    E, d = H.shape[0], H.shape[-1]
    what = what or [f"hessian {e}" for e in range(E)]
    finite = torch.isfinite(H).flatten(1).all(1).tolist()
    if not all(finite):
        raise ValueError(f"{what[finite.index(False)]}: non-finite entries in the Hessian "
                         f"(NaN/Inf calibration inputs?)")
    H64 = H.to(torch.float64)
    mean_diag = (torch.diagonal(H64, dim1=-2, dim2=-1).mean(-1) if d
                 else torch.zeros(E, dtype=torch.float64, device=H.device))
    eye = torch.eye(d, dtype=torch.float64, device=H.device)
    Hd_out = torch.empty(H.shape, dtype=torch.float32, device=H.device)
    U_out = torch.empty(H.shape, dtype=torch.float32, device=H.device)
    pd = [float(percdamp)] * E
    damp = [0.0] * E
    todo = list(range(E))
    for _ in range(max_tries):
        sel = torch.tensor(todo, device=H.device)
        all_of_them = len(todo) == E
        dmp = (torch.tensor([pd[e] for e in todo], dtype=torch.float64, device=H.device)
               * (mean_diag if all_of_them else mean_diag[sel]))
        Hd = (H64 if all_of_them else H64[sel]) + dmp[:, None, None] * eye
        U, ok = spd.inverse_cholesky_upper(Hd, blocked)
        ok = ok.tolist()
        good = [i for i, o in enumerate(ok) if o]
        if good:
            gi = torch.tensor(good, device=H.device)
            dst = sel[gi]
            Hd_out[dst] = Hd[gi].float()
            U_out[dst] = U[gi].float()
        dmp = dmp.tolist()
        failed = []
        for i, e in enumerate(todo):
            if ok[i]:
                damp[e] = dmp[i]
                continue
            nxt = pd[e] * 10 if pd[e] > 0 else 1e-6
            log.warning("%s: not positive definite with percdamp=%g; retrying with percdamp=%g", what[e], pd[e], nxt)
            pd[e] = nxt
            failed.append(e)
        todo = failed
        del Hd, U
        if not todo:
            return DampedBatch(Hd_out, U_out, pd, damp)
    e = todo[0]
    raise ValueError(f"{what[e]}: not positive definite even with percdamp={pd[e] / 10:g}; "
                     f"calibration data degenerate?")


def row_sets_batched(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_sets` for masks [..., R, C]: (kept, pruned) column indices per row, ascending."""
    C = mask.shape[-1]
    counts = mask.sum(-1)
    k = int(counts.flatten()[0]) if counts.numel() else 0
    if not bool((counts == k).all()):
        raise ValueError("a masked reconstruction needs the same number of kept entries in every row")
    # A stable sort of (pruned?) puts each row's kept columns first, both parts in ascending column order.
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices
    return order[..., :k], order[..., k:C]


SOLVES = ("cg", "exact")  # how the kept-set least squares are solved (see `kept_set_solve`)
# A row stops once its last CG_WINDOW steps lowered its objective by <= CG_TOL of its value. 1e-6 because at 1e-5
# the micro model's SGPTQ perplexity sat ~0.3 % above the exact solve's (more than round-off moves it).
CG_TOL = 1e-6
CG_WINDOW = 4
CG_MAX_ITER = 300  # rows still above the tolerance then are solved exactly
CG_RANK = 32  # top eigenpairs of the Jacobi-scaled Hessian in the preconditioner (0: Jacobi alone)


def check_solve(solve: str) -> None:
    if solve not in SOLVES:
        raise ValueError(f"solve must be one of {', '.join(SOLVES)}, got {solve!r}")


def _exact_rows(H64: torch.Tensor, e_of_row: torch.Tensor, a: torch.Tensor, rhs_a: torch.Tensor, budget: int,
                blocked: bool | None) -> torch.Tensor:
    """Per listed row n: solve H64[e_of_row[n]][a_n, a_n] x = rhs_a[n] by Cholesky, in batches of gathered systems
    that fit `budget` bytes. e_of_row [N], a [N, ka], rhs_a [N, ka, 1] fp64 -> x [N, ka] fp32."""
    N, ka = a.shape
    out = torch.zeros(N, ka, dtype=torch.float32, device=H64.device)
    step = max(1, budget // (ka * ka * 8 * 4))  # the gathered systems, their factor and the solve's temporaries
    ok_all = torch.ones(N, dtype=torch.bool, device=H64.device)
    for s in range(0, N, step):
        e, aa = e_of_row[s:s + step], a[s:s + step]
        Haa = H64[e[:, None, None], aa[:, :, None], aa[:, None, :]]
        x, ok = spd.spd_solve(Haa, rhs_a[s:s + step], blocked)
        out[s:s + step] = x[..., 0].float()
        ok_all[s:s + step] = ok
        del Haa, x
    if not bool(ok_all.all()):
        raise ValueError("a kept-set block of the damped Hessian is not positive definite")
    return out


def top_eigenpairs(H: torch.Tensor, k: int, iters: int = 4, oversample: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest eigenpairs of symmetric PSD H [E, C, C] by subspace iteration from a fixed start (the same
    for every expert, so an expert's pairs do not depend on the batch): (λ [E, k] descending, V [E, C, k])."""
    E, C = H.shape[0], H.shape[-1]
    m = min(C, k + oversample)
    g = torch.Generator().manual_seed(0)
    Q = torch.randn(C, m, generator=g, dtype=torch.float32).to(device=H.device, dtype=H.dtype).expand(E, C, m)
    for _ in range(iters):
        Y = (H @ Q).to(torch.float64)
        # Cholesky-QR (products and an m × m factor; batched QR is a loop over matrices on some devices)
        L = torch.linalg.cholesky(Y.mT @ Y)
        Q = torch.linalg.solve_triangular(L, Y.mT, upper=False).mT.to(H.dtype)
    lam, S = torch.linalg.eigh((Q.mT @ H @ Q).to(torch.float64))
    lam, S = lam.to(H.dtype), S.to(H.dtype)
    top = torch.arange(m - 1, m - 1 - min(k, m), -1, device=H.device)
    return lam[:, top], Q @ S[..., top]


class _Preconditioner:
    """An approximate inverse of each row's kept-set block A = H[K, K], for `cg_rows`.

    Jacobi alone (rank 0) is z = r / diag(H). With rank k > 0, the Jacobi-scaled Hessian Ĥ = D^-½ H D^-½ is
    approximated as Ĥ ≈ Dres + V Λ Vᵀ (its top k eigenpairs plus the diagonal they leave), which restricted to a
    row's kept set is inverted per row with Woodbury: M_K⁻¹ = Dres⁻¹ − Dres⁻¹ V_K G⁻¹ V_Kᵀ Dres⁻¹ with the k × k
    G = Λ⁻¹ + V_Kᵀ Dres⁻¹ V_K. A few dominant directions (what correlated activations produce) are what make
    the kept-set systems ill-conditioned; this removes them at the cost of two thin products per iteration."""

    def __init__(self, H: torch.Tensor, keep: torch.Tensor, rank: int):
        zero = torch.zeros((), dtype=H.dtype, device=H.device)
        d = torch.diagonal(H, dim1=-2, dim2=-1)  # > 0: damped, dead columns fixed
        self.keep = keep
        self.rank = min(rank, H.shape[-1])
        if self.rank == 0:
            self.dinv = torch.where(keep, 1.0 / d[:, None, :], zero)
            return
        s = d.rsqrt()
        lam, V = top_eigenpairs(H * s[:, :, None] * s[:, None, :], self.rank)
        lam = lam.clamp_min(torch.finfo(H.dtype).tiny)
        dres = (1.0 - (V * V * lam[:, None, :]).sum(-1)).clamp_min(1e-3)  # what the top pairs leave of diag Ĥ = 1
        w = torch.where(keep, 1.0 / dres[:, None, :], zero)  # Dres⁻¹ on the kept set
        k = self.rank
        outer = (V[..., :, None] * V[..., None, :]).reshape(*V.shape[:-1], k * k)  # [E, C, k²]
        G = (w @ outer).reshape(*keep.shape[:-1], k, k) + torch.diag_embed(1.0 / lam)[:, None]
        del outer
        # z = D^-½ M⁻¹ D^-½ r = (D^-1 Dres⁻¹) r − (D^-½ Dres⁻¹) (y Vᵀ) with y = G⁻¹ Vᵀ (D^-½ Dres⁻¹) r
        self.sw = w * s[:, None, :]
        self.ssw = self.sw * s[:, None, :]
        self.V = V
        del w
        L, info = torch.linalg.cholesky_ex(G)
        eye = torch.eye(k, dtype=H.dtype, device=H.device)
        self.Li = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False)  # G⁻¹ = Liᵀ Li
        bad = info != 0  # (cannot happen for SPD G; such a row falls back to Jacobi)
        self.Li = torch.where(bad[..., None, None], zero, self.Li)

    def __call__(self, r: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            return self.dinv * r
        t = self.Li @ ((self.sw * r) @ self.V)[..., None]
        y = (self.Li.mT @ t)[..., 0]
        return torch.addcmul(self.ssw * r, self.sw, y @ self.V.mT, value=-1)


def cg_rows(H: torch.Tensor, keep: torch.Tensor, b: torch.Tensor, x: torch.Tensor, c: torch.Tensor,
            tol: float | None = None, window: int | None = None, max_iter: int | None = None,
            rank: int | None = None) -> tuple[torch.Tensor, int]:
    """Preconditioned conjugate gradients for every row of every expert at once: per row, minimise
    f(x) = c − 2xᵀb + xᵀAx, A = H[keep, keep] (H [E, C, C]; keep, b, x [E, R, C], b and x zero off `keep`;
    c [E, R] = f(0)). Each row has its own step sizes and is frozen once converged, so its numbers do not depend
    on the rows solved with it. x is updated in place. Returns (converged [E, R], iterations run).

    A CG step lowers f by exactly αρ, and the decreases of the next few steps estimate the A-norm error left
    (Hestenes–Stiefel; Strakoš & Tichý), so a row stops once its last `window` steps lowered f by ≤ tol·f.
    Preconditioner: `_Preconditioner` of `rank`. None: the module's CG_TOL, CG_WINDOW, CG_MAX_ITER, CG_RANK
    (read at call time)."""
    tol = CG_TOL if tol is None else tol
    window = CG_WINDOW if window is None else window
    max_iter = CG_MAX_ITER if max_iter is None else max_iter
    precondition = _Preconditioner(H, keep, CG_RANK if rank is None else rank)
    zero = torch.zeros((), dtype=H.dtype, device=H.device)
    tiny = torch.finfo(H.dtype).tiny
    # r = b − Ax on the kept set; off it r is never read (the preconditioner is zero there), so no product is
    # masked
    r = b - x @ H
    f = c - (x * (b + r)).sum(-1)  # f(x) for any x (x is zero off the kept set)
    z = precondition(r)
    p = z
    rho = (r * z).sum(-1)
    done = rho <= 0  # nothing to do: a zero right-hand side, or x already exact
    recent = torch.zeros(window, *rho.shape, dtype=rho.dtype, device=rho.device)
    it = 0
    while it < max_iter:
        Ap = p @ H  # (p is zero off the kept set, and Ap off it only reaches r where it is never read)
        pAp = (p * Ap).sum(-1)
        alpha = torch.where(done | (pAp <= 0), zero, rho / pAp.clamp_min(tiny))
        x.addcmul_(alpha[..., None], p)
        r.addcmul_(alpha[..., None], Ap, value=-1)
        dec = alpha * rho
        f = f - dec
        recent[it % window] = dec
        it += 1
        if it >= window:
            done = done | (recent.sum(0) <= tol * f.clamp_min(0))
        if it % 8 == 0 and bool(done.all()):  # (a host sync: not every iteration)
            break
        z = precondition(r)
        rho_new = (r * z).sum(-1)
        beta = torch.where(done, zero, rho_new / rho.clamp_min(tiny))
        p = z + beta[..., None] * p
        rho = torch.where(done, rho, rho_new)
    return done, it


def kept_set_solve(H: torch.Tensor, rows_a: torch.Tensor, rows_b: torch.Tensor, rhs: torch.Tensor,
                   solve: str = "exact", start: torch.Tensor | None = None, budget: int = 1 << 30,
                   blocked: bool | None = None, stats: dict | None = None) -> torch.Tensor:
    """Per expert e and row r: δ = H_e[a, a]⁻¹ H_e[a, b] rhs with a = rows_a[e, r], b = rows_b[e, r] (disjoint),
    i.e. the values on a that best absorb rhs on b: argmin_δ ‖[δ on a, −rhs on b]‖²_H. H [E, C, C] damped;
    rows_a [E, R, ka]; rows_b, rhs [E, R, kb]. Returns δ [E, R, ka] fp32.

    solve="exact": one Cholesky per row of the gathered H[a, a] (fp64). solve="cg": conjugate gradients on all rows
    at once (`cg_rows`, fp32), one batched product with H per iteration, started from `start` (a guess of δ, e.g.
    what a sweep computed; zeros when None); rows not converged after CG_MAX_ITER iterations are solved exactly.
    `budget`: bytes for one batch of work. `stats` (optional) receives the iterations and the exact fallbacks."""
    check_solve(solve)
    E, R, ka = rows_a.shape
    kb = rows_b.shape[-1]
    C = H.shape[-1]
    out = torch.zeros(E, R, ka, dtype=torch.float32, device=H.device)
    if ka == 0 or kb == 0 or R == 0:
        return out
    if solve == "exact":
        H64 = H.to(torch.float64)
        # H[a, b]·rhs without gathering H[a, b]: scatter rhs onto its columns (zeros elsewhere), one product per
        # expert for all rows, then read the kept entries (a and b are disjoint).
        z = torch.zeros(E, R, C, dtype=torch.float64, device=H.device).scatter_(-1, rows_b, rhs.to(torch.float64))
        rhs_a = (z @ H64).gather(-1, rows_a).reshape(E * R, ka, 1)
        del z
        e_of_row = torch.arange(E, device=H.device).repeat_interleave(R)
        return _exact_rows(H64, e_of_row, rows_a.reshape(E * R, ka), rhs_a, budget, blocked).reshape(E, R, ka)
    # CG works on full rows (zero off a) and only on the columns a reaches: OBR's second solve lives right of its
    # partition point, a quarter of the products.
    lo, hi = int(rows_a.min()), int(rows_a.max()) + 1
    Cw = hi - lo
    k2 = CG_RANK * CG_RANK
    # fp32: the recurrence's and the preconditioner's vectors, the scattered rhs, H's window, the per-row k × k factors
    step = max(1, budget // (4 * (10 * R * Cw + 2 * R * C + 2 * Cw * Cw + 2 * R * k2 + Cw * k2)))
    iters, fallback = 0, 0
    for s in range(0, E, step):
        sl = slice(s, s + step)
        Hs = H[sl].float()
        n = Hs.shape[0]
        z = torch.zeros(n, R, C, dtype=torch.float32, device=H.device).scatter_(-1, rows_b[sl], rhs[sl].float())
        zH = z @ Hs
        c = (zH * z).sum(-1)  # ‖rhs on b‖²_H: the objective at δ = 0
        del z
        a = rows_a[sl] - lo
        keep = torch.zeros(n, R, Cw, dtype=torch.bool, device=H.device).scatter_(-1, a, True)
        b = zH[..., lo:hi] * keep
        del zH
        x = torch.zeros(n, R, Cw, dtype=torch.float32, device=H.device)
        if start is not None:
            x.scatter_(-1, a, start[sl].float())
        done, it = cg_rows(Hs[:, lo:hi, lo:hi].contiguous(), keep, b, x, c)
        iters = max(iters, it)
        out[sl] = x.gather(-1, a)
        del x, b, keep
        if not bool(done.all()):  # the stragglers, exactly (rare: a very ill-conditioned kept set)
            e_r = (~done).nonzero()
            fallback += e_r.shape[0]
            H64 = Hs.to(torch.float64)
            zr = torch.zeros(e_r.shape[0], C, dtype=torch.float64, device=H.device).scatter_(
                -1, rows_b[sl][e_r[:, 0], e_r[:, 1]], rhs[sl][e_r[:, 0], e_r[:, 1]].to(torch.float64))
            ar = rows_a[sl][e_r[:, 0], e_r[:, 1]]
            rhs_a = (zr[:, None, :] @ H64[e_r[:, 0]])[:, 0].gather(-1, ar)[..., None]
            out[sl][e_r[:, 0], e_r[:, 1]] = _exact_rows(H64, e_r[:, 0], ar, rhs_a, budget, blocked)
            del H64
        del Hs
    log.debug("kept-set CG: %d rows, %d iterations at most, %d rows solved exactly after it", E * R, iters, fallback)
    if stats is not None:
        stats["cg_iterations"] = max(stats.get("cg_iterations", 0), iters)
        stats["exact_fallback_rows"] = stats.get("exact_fallback_rows", 0) + fallback
    return out


def masked_optimum_batched(W: torch.Tensor, H: torch.Tensor, mask: torch.Tensor, budget: int = 1 << 30,
                           blocked: bool | None = None, solve: str = "exact", start: torch.Tensor | None = None,
                           stats: dict | None = None) -> torch.Tensor:
    """`masked_optimum` for E experts: W, mask [E, R, C], H [E, C, C] (damped). `start`: a guess of the optimum
    (e.g. SparseGPT's compensated values on the same support) where solve="cg" starts."""
    kept, pruned = row_sets_batched(mask)
    guess = None if start is None else (start - W).gather(-1, kept)
    delta = kept_set_solve(H, kept, pruned, W.gather(-1, pruned), solve, guess, budget, blocked, stats)
    return (W * mask).scatter_add(-1, kept, delta)
