"""SGPTQ: SparseGPT support selection + GPTQ quantization in the target format, with export-exact scales.

The sweep (`SGPTQSolver.solve`) walks the columns of W in natural order, in lazy blocks of 128 (Frantar &
Alistarh's SparseGPT/GPTQ). With U = chol(H⁻¹) (upper), column j is replaced by its pruned-or-quantized
value q_j and the error (w_j − q_j)/U_jj is pushed onto the columns right of j through row j of U (OBS).

- Support: when the sweep reaches a K-group (every `mask_block` columns; default the group itself, which is
  what SparseGPT's N:M mode does) its pattern is the one keeping the largest summed saliency w²/U_jj² of the
  *current*, already compensated weights (`PatternSet.best_index`; for paired 4:8 the per-pair sum, dropping
  the 2 lowest pairs). Choosing per group rather than once per lazy block of 128 lets each choice see the
  compensation of every column to its left (measured: output error of micro-qwen3-moe's layer-0 experts in
  p48-nvfp4 0.154 per group vs 0.184 per 128 columns).
- One combined sweep: each column is pruned and quantized at once and the joint error is compensated
  (SparseGPT's joint mode). This *is* GPTQ with the support fixed — the support of a column is final before
  the sweep reaches it — but every compensation step targets the original W rather than an intermediate
  pruned copy, so no error is frozen into the target, and the mask is chosen from weights that already absorb
  the quantization error of the columns to their left. It also costs one sweep instead of two.
- Export-exact scales: when the sweep reaches the first column of a scale block, its stored scale is
  computed from the current compensated, masked weights of that block with the format's own
  `block_scales` (UE4M3-projected for NVFP4) and the gate/up-shared global scale, and every value is encoded
  with the format's `encode`/`decode`. Groups of the block the sweep has not reached yet get a provisional
  pattern by the same saliency for this. The element that sets the block's amax is kept by the later
  pattern choices and pinned to the largest code (±6 for E2M1, ±448 for E4M3), so the block keeps its max
  code even when compensation shrinks that element: `fmt.quantize(dequantized, mask, g)` then reproduces the
  same scales and codes (a fixed point), i.e. what GPTQ optimised is exactly what any re-packing writes.
- `exact_scales=False` is what the public release effectively ships: fp32 scales during the sweep, projected
  onto E4M3 afterwards and the codes re-rounded with the projected scales.
- FP8 has one scale per row. It must be known at column 0 but has to cover the row's largest weight after
  compensation, so a plain SparseGPT pass (no quantization) runs first and its compensated, masked row sets
  the scale; that element is pinned as above.
- The global scale (gate and up share one) is taken before the sweep from the weights under the
  provisional support SparseGPT picks without compensation.

`SGPTQ.compress_block` runs the sweep for all experts of a block at once (`SGPTQSolver.solve_batched`): gate
and up stacked along their rows (same Hessian, same global scale), then down, each step one tensor op over
experts × rows, the experts chunked to a memory budget (`chunk_gb`). Rows never interact in the sweep, so this
computes each expert's numbers exactly; `batched=False` runs the per-expert reference (`compress_expert`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from moesq_core.compression.methods.base import PROJECTIONS, CompressedExpert, ExpertData, ProgressFn, compress_each
from moesq_core.compression.methods.batching import assemble_results, compress_batched
from moesq_core.compression.methods.hessian import (
    block_statistics,
    check_damping,
    check_solve,
    check_weighting,
    damped_factor,
    damped_factors,
    expert_hessians,
    fix_dead,
    fix_dead_batched,
    hessian,
    masked_optimum,
    masked_optimum_batched,
    relative_error,
)
from moesq_core.compression.methods.rtn import check_expert, fallback_no_tokens
from moesq_core.formats import Format, QuantizedWeight

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    """One projection after the sweep. values = what the errors were computed against (dequantized, masked)."""

    values: torch.Tensor
    mask: torch.Tensor
    latent: torch.Tensor  # V: each column's compensated value just before it was pruned/quantized
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    pinned: int = 0  # (row, scale block) pairs whose max element had drifted and was pinned to the max code

    def quantized_weight(self, fmt: Format) -> QuantizedWeight:
        if self.codes is None:
            raise ValueError("this sweep ran without quantization (quantize=False): no codes to export")
        return QuantizedWeight(fmt.name, self.codes, self.scales, self.global_scale.reshape(()), self.mask)


@dataclass
class BatchedSweepResult:
    """`SweepResult` for E experts: values, mask, latent, codes [E, R, C], scales [E, R, nb], global_scale [E],
    pinned [E, row_groups] (tensors; no host sync)."""

    values: torch.Tensor
    mask: torch.Tensor
    latent: torch.Tensor
    codes: torch.Tensor | None
    scales: torch.Tensor | None
    global_scale: torch.Tensor
    pinned: torch.Tensor

    def expert(self, e: int, rows: slice = slice(None), pinned_group: int = 0) -> SweepResult:
        """One expert's (and optionally one row range's) result as the per-expert sweep returns it."""
        pick = lambda t: None if t is None else t[e, rows].clone()  # noqa: E731 (copies: the batch can be freed)
        return SweepResult(pick(self.values), pick(self.mask), pick(self.latent), pick(self.codes), pick(self.scales),
                           self.global_scale[e].reshape(()).clone(), int(self.pinned[e, pinned_group]))


def provisional_mask(fmt: Format, W: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """The support SparseGPT picks before any compensation (saliency w²/U_jj² of the original W).
    W [..., R, C] with U [..., C, C] (leading expert dimensions allowed)."""
    if fmt.patterns.is_dense:
        return torch.ones_like(W, dtype=torch.bool)
    return fmt.patterns.best_mask(W.float() ** 2 / torch.diagonal(U, dim1=-2, dim2=-1).float().unsqueeze(-2) ** 2)


class _ColumnCodec:
    """The format's encode/decode applied to one column at a time (`weight.column()`: a column of a block shares
    the block's scale, so it computes exactly the same numbers). Columns may carry leading (expert) dimensions:
    w [..., R], scales [..., R, 1], g a scalar or [..., 1, 1]."""

    def __init__(self, fmt: Format, exact: bool):
        self.q = fmt.weight
        self.col = self.q.column()
        self.exact = exact
        # Codes of ±(largest value): what a pinned element is encoded to, whatever its block's scale.
        one = torch.ones(1, 1)
        top = self.col.encode(torch.tensor([[self.q.max_value]]), one, one)
        bottom = self.col.encode(-torch.tensor([[self.q.max_value]]), one, one)
        self.top_codes = (int(top), int(bottom))
        self._values: dict[torch.device, torch.Tensor] = {}

    def block_scale(self, blk: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """[..., R, 1] scale of a masked block. Not exact: the fp32 scale before its projection (the release)."""
        s = self.q.block_scales(blk, g) if self.exact else self.q.unrounded_block_scales(blk, g)
        return s.reshape(*blk.shape[:-1], -1)[..., :1]

    def encode(self, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return self.col.encode(w[..., None], s, g)[..., 0]

    def decode(self, c: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        # a table lookup kept on the device (the sweep decodes every column: no host copies)
        values = self._values.get(c.device)
        if values is None:
            values = self._values[c.device] = self.q.code_values().to(c.device)
        return (values[c.long()][..., None] * s / g)[..., 0]


class _BlockReplay:
    """Runs `sweep(n)` for one lazy block of the batched sweep. With `graphs` (CUDA), full blocks of n_full
    columns after the first are one CUDA graph replay: the first runs eagerly on a side stream (the warm-up a
    capture needs: lazily built tables, library workspaces), the second is captured, every later one replays it.
    Replays run the very kernels of the eager sweep, so the numbers are the same. A capture that fails (an op
    that cannot be captured) falls back to launching the ops, with one warning."""

    def __init__(self, sweep, n_full: int, graphs: bool, device: torch.device):
        self.sweep, self.n_full, self.graphs, self.device = sweep, n_full, graphs, device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warmed = False

    def __call__(self, n: int) -> None:
        if not self.graphs or n != self.n_full:
            self.sweep(n)
        elif not self.warmed:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.sweep(n)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.warmed = True
        else:
            if self.graph is None:
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.device(self.device), torch.cuda.graph(graph):
                        self.sweep(n)  # recorded, not run: the block's buffers are untouched if this fails
                except RuntimeError as exc:
                    log.warning("column sweep: CUDA graph capture failed (%s); launching the ops instead", exc)
                    self.graphs = False
                    self.sweep(n)
                    return
                self.graph = graph
            self.graph.replay()


@dataclass
class SGPTQSolver:
    """The column sweep for one projection. quantize=False turns it into plain SparseGPT (and, on a dense
    format, into the identity), which is what the tests compare against.

    mask_block: the support of the next `mask_block` columns is chosen when the sweep reaches them; None =
    the pattern group (what SparseGPT's N:M mode does: each M-group at its first column). A scale block
    whose support is not chosen yet when its scale is needed gets a provisional choice by the same saliency;
    the element that sets the scale is then kept by the final choice.
    """

    fmt: Format
    blocksize: int = 128
    mask_block: int | None = None
    exact_scales: bool = True
    quantize: bool = True
    pin_block_max: bool = True  # only meaningful with exact_scales
    cuda_graphs: bool = True  # solve_batched on CUDA: replay one lazy block's launches as a CUDA graph

    def __post_init__(self):
        grp, sb = self.fmt.patterns.group, self.fmt.scale_block
        if self.mask_block is None:
            self.mask_block = grp
        if self.blocksize <= 0 or self.mask_block <= 0 or self.blocksize % self.mask_block:
            raise ValueError(f"mask_block ({self.mask_block}) must divide blocksize ({self.blocksize})")
        if self.mask_block % grp:
            raise ValueError(f"mask_block ({self.mask_block}) must be a multiple of the pattern group ({grp})")
        if sb and self.blocksize % sb:
            raise ValueError(f"blocksize ({self.blocksize}) must be a multiple of the scale block ({sb}) "
                             f"of format {self.fmt.name}")

    def solve(self, W: torch.Tensor, U: torch.Tensor, g: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> SweepResult:
        """W [R, C] fp32 (dead columns already zeroed), U = chol((H+λI)⁻¹) upper [C, C], g the global scale.

        mask: a fixed support (GPTQ with the support given); scales: fixed stored scales (no scale search).
        """
        fmt, pat = self.fmt, self.fmt.patterns
        W = W.detach().float().clone()
        R, C = W.shape
        dev = W.device
        U = U.to(device=dev, dtype=torch.float32)
        if U.shape != (C, C):
            raise ValueError(f"Hessian factor {tuple(U.shape)} does not match weight {tuple(W.shape)}")
        fmt.check_weight(W)
        if g is None:
            g = fmt.global_scale(W * (mask if mask is not None else provisional_mask(fmt, W, U)))
        g = g.to(dev).float().reshape(())
        fixed = mask is not None
        M = mask.to(dev).bool().clone() if fixed else torch.ones(R, C, dtype=torch.bool, device=dev)
        select = not fixed and not pat.is_dense
        mb = self.mask_block
        dU = torch.diagonal(U)
        Q = torch.zeros_like(W)
        V = torch.zeros_like(W)
        codec = _ColumnCodec(fmt, self.exact_scales) if self.quantize else None
        sb = fmt.scale_block or C  # FP8: one scale for the whole row
        find_scales = self.quantize and scales is None
        pin = find_scales and self.exact_scales and self.pin_block_max
        codes = torch.zeros(R, C, dtype=torch.uint8, device=dev) if self.quantize else None
        S = None
        if self.quantize:
            S = scales.to(dev).float().clone() if scales is not None else torch.zeros(R, C // sb, device=dev)
        pin_col = torch.full((R,), -1, dtype=torch.long, device=dev)
        pinned = 0
        chosen = 0  # supports of columns < chosen are final

        def choose(vals: torch.Tensor, c0: torch.Tensor | int) -> torch.Tensor:
            """Patterns for columns [c0, c0 + vals.shape[1]) by saliency; pinned elements are always kept."""
            sal = vals ** 2 / dU[None, c0:c0 + vals.shape[1]] ** 2
            if pin:  # (no host sync: this runs every group on the GPU)
                at = torch.arange(vals.shape[1], device=dev)[None, :] == (pin_col - c0)[:, None]
                sal = torch.where(at, sal.sum(-1).max() * 2 + 1, sal)
            return pat.best_mask(sal)

        if find_scales and fmt.scale_block == 0:
            # One scale for the whole row: it must be known at column 0 but has to cover the row's largest
            # weight *after* compensation (growth past the original amax would saturate at ±448). A plain
            # SparseGPT pass gives the compensated, masked row; its largest element sets the scale and is
            # pinned (kept, and encoded at the max code).
            pre = replace(self, quantize=False, mask_block=mb).solve(W, U, g, mask=M if fixed else None)
            blk = pre.values
            S[:, 0] = codec.block_scale(blk, g)[:, 0]
            if pin:
                amax, arg = blk.abs().max(-1)
                pin_col = torch.where(amax > 0, arg, pin_col)
            find_scales = False

        for i1 in range(0, C, self.blocksize):
            i2 = min(i1 + self.blocksize, C)
            W1 = W[:, i1:i2].clone()
            U1 = U[i1:i2, i1:i2]
            d = dU[i1:i2]
            Err1 = torch.zeros_like(W1)
            for i in range(i2 - i1):
                col = i1 + i
                if select and col % mb == 0:
                    j = min(i + mb, i2 - i1)
                    M[:, col:i1 + j] = choose(W1[:, i:j], col)
                    chosen = i1 + j
                if find_scales and col % sb == 0:
                    cur = W1[:, i:i + sb]  # the current compensated values of the scale block
                    if select and chosen < col + sb:
                        M[:, chosen:col + sb] = choose(cur[:, chosen - col:], chosen)  # provisional
                    blk = cur * M[:, col:col + sb]
                    S[:, col // sb] = codec.block_scale(blk, g)[:, 0]
                    if pin:
                        amax, arg = blk.abs().max(-1)
                        pin_col = torch.where(amax > 0, arg + col, torch.full_like(arg, -1))
                w = W1[:, i]
                V[:, col] = w
                m = M[:, col]
                if self.quantize:
                    s = S[:, col // sb: col // sb + 1]
                    c = codec.encode(w, s, g)
                    if pin:
                        at = pin_col == col
                        top = torch.where(w >= 0, codec.top_codes[0], codec.top_codes[1]).to(torch.uint8)
                        pinned = pinned + (at & (c != top)).sum()
                        c = torch.where(at, top, c)
                    c = c * m
                    codes[:, col] = c
                    q = codec.decode(c, s, g) * m
                else:
                    q = w * m
                Q[:, col] = q
                err = (w - q) / d[i]
                W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
                Err1[:, i] = err
            W[:, i2:] -= Err1 @ U[i1:i2, i2:]

        if self.quantize and not self.exact_scales and codec.q.rounds_scales:
            # The release: GPTQ ran against fp32 scales; the stored ones are their E4M3 projection and the
            # codes are re-rounded to them, so the exported weights are not the ones GPTQ optimised.
            S = fmt.weight.round_scales(S)
            codes = fmt.weight.encode(Q, S, g) * M
            Q = fmt.weight.decode(codes, S, g) * M
        return SweepResult(Q, M, V, codes.to(torch.uint8) if codes is not None else None, S, g, int(pinned))

    def solve_batched(self, W: torch.Tensor, U: torch.Tensor, g: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                      row_groups: int = 1) -> BatchedSweepResult:
        """`solve` for E experts at once: W [E, R, C], U [E, C, C], g [E], mask [E, R, C], scales [E, R, nb].

        The same sweep as `solve`, every step a tensor op over experts × rows: per column the encode/decode and
        the OBS update of the lazy block, per group the pattern choice, per scale block its scale, per lazy
        block one batched product; no host syncs inside the loops. row_groups: the rows are that many stacked
        projections (gate and up share a Hessian and are solved as one [2I, H] matrix); the one quantity that
        is a reduction over rows in `solve` (the saliency forcing a pinned element to be kept) is taken per
        group, so each projection gets exactly the numbers it gets alone.
        """
        fmt, pat = self.fmt, self.fmt.patterns
        W = W.detach().float().clone()
        if W.dim() != 3:
            raise ValueError(f"batched weights must be [experts, out, in], got shape {tuple(W.shape)}")
        E, R, C = W.shape
        dev = W.device
        U = U.to(device=dev, dtype=torch.float32)
        if U.shape != (E, C, C):
            raise ValueError(f"Hessian factors {tuple(U.shape)} do not match weights {tuple(W.shape)}")
        if R % row_groups:
            raise ValueError(f"{R} rows do not split into {row_groups} equal row groups")
        pat.check_shape(C, fmt.scale_block, f"weight for format {fmt.name}")
        if not bool(torch.isfinite(W).all()):
            raise ValueError("weight: non-finite values; refusing to compress NaN/Inf weights")
        if g is None:
            g = fmt.weight.global_scales(W * (mask if mask is not None else provisional_mask(fmt, W, U)))
        g = g.to(dev).float().reshape(E)
        gb = g[:, None, None]
        fixed = mask is not None
        M = mask.to(dev).bool().clone() if fixed else torch.ones(E, R, C, dtype=torch.bool, device=dev)
        select = not fixed and not pat.is_dense
        mb = self.mask_block
        dU = torch.diagonal(U, dim1=-2, dim2=-1)  # [E, C]
        Q = torch.zeros_like(W)
        V = torch.zeros_like(W)
        codec = _ColumnCodec(fmt, self.exact_scales) if self.quantize else None
        sb = fmt.scale_block or C
        find_scales = self.quantize and scales is None
        pin = find_scales and self.exact_scales and self.pin_block_max
        codes = torch.zeros(E, R, C, dtype=torch.uint8, device=dev) if self.quantize else None
        S = None
        if self.quantize:
            S = scales.to(dev).float().clone() if scales is not None else torch.zeros(E, R, C // sb, device=dev)
        pin_col = torch.full((E, R), -1, dtype=torch.long, device=dev)
        pinned = torch.zeros(E, R, dtype=torch.long, device=dev)
        P = pat.pattern_matrix(dev)  # kept on the device once (best_index/mask_from_index would copy per call)
        Pb = pat.patterns.to(dev)
        row_scale = fmt.scale_block == 0  # one scale per row (FP8): every lazy block reads the same S column

        def best_mask(sal: torch.Tensor) -> torch.Tensor:  # = pat.best_mask
            idx = (sal.reshape(*sal.shape[:-1], -1, pat.group).float() @ P.T).argmax(-1)
            return Pb[idx].reshape(*idx.shape[:-1], idx.shape[-1] * pat.group)

        if find_scales and row_scale:
            pre = replace(self, quantize=False, mask_block=mb).solve_batched(W, U, g, mask=M if fixed else None,
                                                                             row_groups=row_groups)
            blk = pre.values
            S[..., 0] = codec.block_scale(blk, gb)[..., 0]
            if pin:
                amax, arg = blk.abs().max(-1)
                pin_col = torch.where(amax > 0, arg, pin_col)
            find_scales = False
            del pre, blk

        # One lazy block's state, in buffers of fixed address that the block's sweep alone reads and writes
        # (columns numbered from the block's first): on CUDA the ~40 small ops per column are recorded once as
        # a CUDA graph and replayed for every full block, because launching them, not the GPU, bounds the sweep.
        n0 = min(self.blocksize, C)
        W1, V1, Q1, Err1 = (torch.empty(E, R, n0, device=dev) for _ in range(4))
        U1 = torch.empty(E, n0, n0, device=dev)
        d1 = torch.empty(E, n0, device=dev)
        M1 = torch.empty(E, R, n0, dtype=torch.bool, device=dev)
        K1 = torch.empty(E, R, n0, dtype=torch.uint8, device=dev) if self.quantize else None
        S1 = (S if row_scale else torch.empty(E, R, n0 // sb, device=dev)) if self.quantize else None
        pin1 = torch.empty(E, R, dtype=torch.long, device=dev)

        def choose(vals: torch.Tensor, c0: int) -> torch.Tensor:
            sal = vals ** 2 / d1[:, None, c0:c0 + vals.shape[-1]] ** 2
            if pin:
                at = torch.arange(vals.shape[-1], device=dev) == (pin1 - c0)[..., None]
                big = sal.sum(-1).reshape(E, row_groups, -1).amax(-1) * 2 + 1  # per projection, as in `solve`
                sal = torch.where(at, big[..., None].expand(E, row_groups, R // row_groups).reshape(E, R, 1), sal)
            return best_mask(sal)

        def sweep_block(n: int) -> None:
            """Columns 0..n-1 of the loaded block. A block starts at a multiple of blocksize, itself a multiple of
            mask_block and of the scale block, so local column numbers take the same group and scale steps."""
            chosen = 0  # supports of columns < chosen are final
            for i in range(n):
                if select and i % mb == 0:
                    j = min(i + mb, n)
                    M1[..., i:j] = choose(W1[..., i:j], i)
                    chosen = j
                if find_scales and i % sb == 0:
                    cur = W1[..., i:i + sb]
                    if select and chosen < i + sb:
                        M1[..., chosen:i + sb] = choose(cur[..., chosen - i:], chosen)  # provisional
                    blk = cur * M1[..., i:i + sb]
                    S1[..., i // sb] = codec.block_scale(blk, gb)[..., 0]
                    if pin:
                        amax, arg = blk.abs().max(-1)
                        pin1.copy_(torch.where(amax > 0, arg + i, torch.full_like(arg, -1)))
                w = W1[..., i]
                V1[..., i] = w
                m = M1[..., i]
                if self.quantize:
                    k = 0 if row_scale else i // sb
                    s = S1[..., k:k + 1]
                    c = codec.encode(w, s, gb)
                    if pin:
                        at = pin1 == i
                        top = torch.where(w >= 0, codec.top_codes[0], codec.top_codes[1]).to(torch.uint8)
                        pinned.add_(at & (c != top))
                        c = torch.where(at, top, c)
                    c = c * m
                    K1[..., i] = c
                    q = codec.decode(c, s, gb) * m
                else:
                    q = w * m
                Q1[..., i] = q
                err = (w - q) / d1[:, i, None]
                W1[..., i:n] -= err[..., None] * U1[:, i, None, i:n]
                Err1[..., i] = err

        run = _BlockReplay(sweep_block, n0, self.cuda_graphs and dev.type == "cuda" and C // n0 >= 3, dev)
        for i1 in range(0, C, n0):
            i2 = min(i1 + n0, C)
            n = i2 - i1
            W1[..., :n] = W[..., i1:i2]
            U1[:, :n, :n] = U[:, i1:i2, i1:i2]
            d1[:, :n] = dU[:, i1:i2]
            M1[..., :n] = M[..., i1:i2]
            if self.quantize and not row_scale:
                S1[..., :n // sb] = S[..., i1 // sb:i2 // sb]
            pin1.copy_(pin_col - i1)  # FP8's pins from the pre-pass (NVFP4 sets its own per scale block)
            run(n)
            V[..., i1:i2], Q[..., i1:i2], M[..., i1:i2] = V1[..., :n], Q1[..., :n], M1[..., :n]
            if self.quantize:
                codes[..., i1:i2] = K1[..., :n]
                if not row_scale:
                    S[..., i1 // sb:i2 // sb] = S1[..., :n // sb]
            W[..., i2:] -= Err1[..., :n] @ U[:, i1:i2, i2:]

        if self.quantize and not self.exact_scales and codec.q.rounds_scales:
            S = fmt.weight.round_scales(S)
            codes = fmt.weight.encode(Q, S, gb) * M
            Q = fmt.weight.decode(codes, S, gb) * M
        return BatchedSweepResult(Q, M, V, codes.to(torch.uint8) if codes is not None else None, S, g,
                                  pinned.reshape(E, row_groups, -1).sum(-1))


@dataclass
class SGPTQ:
    """Method `sgptq` (and `gptq` = the same on a dense format): Hessians from the routed tokens, one
    shared global scale for gate and up, the sweep above per projection."""

    name: str = "sgptq"
    percdamp: float = 0.01  # Hessian damping as a fraction of mean(diag H)
    blocksize: int = 128  # columns per lazy GPTQ block
    mask_block: int | None = None  # None: the pattern group (SparseGPT's N:M mode)
    exact_scales: bool = True  # GPTQ with the final E4M3 block scales (export-exact); false: fp32 scales
    # projected afterwards
    pin_block_max: bool = True  # with exact_scales: a scale block's drifted max element is pinned to the max code
    hessian_weighting: str = "none"  # router weighting of the Hessian: none | w | w2
    refit: bool = False  # not SGPTQ proper: SparseGPT's support + closed-form reconstruction + GPTQ
    solve: str = "cg"  # the refit's kept-set least squares: "cg" (iterative, from SparseGPT's values) | "exact"
    dense_only: bool = False
    batched: bool = True  # all experts of a block at once (False: the per-expert reference, one at a time)
    chunk_gb: float | None = None  # memory for one chunk of experts (None: half the free GPU memory; 4 GiB on CPU)
    cuda_graphs: bool = True  # the batched sweep on CUDA replays each lazy block as a CUDA graph (same numbers)

    def __post_init__(self):
        check_solve(self.solve)
        check_damping(self.percdamp)
        check_weighting(self.hessian_weighting)

    def _solver(self, fmt: Format) -> SGPTQSolver:
        return SGPTQSolver(fmt, self.blocksize, self.mask_block, self.exact_scales, True, self.pin_block_max,
                           self.cuda_graphs)

    def compress_expert(self, ex: ExpertData, fmt: Format) -> CompressedExpert:
        check_expert(ex, fmt)
        if ex.n_rows == 0:
            return fallback_no_tokens(ex, fmt, self.name)
        h_in, h_mid = expert_hessians(ex, self.hessian_weighting)
        hs = {"gate": h_in, "up": h_in, "down": h_mid}
        h_in_f, wg = fix_dead(h_in, ex.gate.detach().float())
        _, wu = fix_dead(h_in, ex.up.detach().float())
        h_mid_f, wd = fix_dead(h_mid, ex.down.detach().float())
        W = {"gate": wg, "up": wu, "down": wd}
        fac_in = damped_factor(h_in_f, self.percdamp, what=f"expert {ex.index} gate/up Hessian")
        fac_mid = damped_factor(h_mid_f, self.percdamp, what=f"expert {ex.index} down Hessian")
        fac = {"gate": fac_in, "up": fac_in, "down": fac_mid}
        # The shared gate/up global scale from the weights before the sweep under the provisional support
        # (the sweep only moves the support where compensation makes another pattern more salient).
        g_gu = fmt.global_scale(*(W[p] * provisional_mask(fmt, W[p], fac[p].hinv_chol) for p in ("gate", "up")))
        g_d = fmt.global_scale(W["down"] * provisional_mask(fmt, W["down"], fac["down"].hinv_chol))
        solver = self._solver(fmt)
        if self.refit:
            # SparseGPT's support, then the least-squares weights on it (the sequential OBS updates of the
            # sweep only approximate them; CG starts from the sweep's values), then GPTQ with that support fixed.
            sparse = {p: replace(solver, quantize=False).solve(W[p], fac[p].hinv_chol) for p in PROJECTIONS}
            support = {p: sparse[p].mask for p in PROJECTIONS}
            W = {p: masked_optimum(W[p], fac[p].H, support[p], self.solve, start=sparse[p].values) for p in PROJECTIONS}
            g_gu = fmt.global_scale(W["gate"], W["up"])
            g_d = fmt.global_scale(W["down"])
            res = {p: solver.solve(W[p], fac[p].hinv_chol, g_d if p == "down" else g_gu, mask=support[p])
                   for p in PROJECTIONS}
        else:
            res = {p: solver.solve(W[p], fac[p].hinv_chol, g_d if p == "down" else g_gu) for p in PROJECTIONS}
        q = {p: res[p].quantized_weight(fmt) for p in PROJECTIONS}
        if self.hessian_weighting != "none":  # report the plain, unweighted error like every method
            x = ex.inputs()
            h_plain = hessian(x)
            hs = {"gate": h_plain, "up": h_plain, "down": hessian(ex.dense_intermediate(x))}
        info = {
            "method": self.name,
            "tokens": ex.n_rows,
            "percdamp": {"gate_up": fac_in.percdamp, "down": fac_mid.percdamp},
            "damp": {"gate_up": fac_in.damp, "down": fac_mid.damp},
            "exact_scales": self.exact_scales,
            "refit": self.refit,
            "pinned_block_max": {p: res[p].pinned for p in PROJECTIONS},
            "rel_err": {p: relative_error(getattr(ex, p), q[p].dequantize(), hs[p]) for p in PROJECTIONS},
        }
        latent = {p: res[p].latent for p in PROJECTIONS}
        return CompressedExpert(q["gate"], q["up"], q["down"], latent=latent, info=info)

    def compress_block(self, experts: list[ExpertData], fmt: Format,
                       progress: ProgressFn | None = None) -> list[CompressedExpert]:
        if self.dense_only and not fmt.patterns.is_dense:
            raise ValueError(f"method {self.name!r} is GPTQ on a dense format; format {fmt.name!r} is sparse "
                             f"({fmt.patterns.name}): use method 'sgptq' for sparse formats")
        if not self.batched:
            return compress_each(experts, fmt, self.compress_expert, progress)
        return compress_batched(experts, fmt, self.name, lambda chunk, budget: self._compress_chunk(chunk, fmt, budget),
                                progress, self.chunk_gb)

    def _compress_chunk(self, experts: list[ExpertData], fmt: Format, budget: int) -> list[CompressedExpert]:
        """`compress_expert` for a chunk of experts (all with tokens) at once: gate and up stacked along their
        rows (they share the Hessian and the global scale), then down."""
        solver = self._solver(fmt)
        inter = experts[0].gate.shape[0]
        results: list[dict] = [dict(q={}, latent={}, pinned={}, rel_err={}, percdamp={}, damp={}) for _ in experts]
        phases = (("gate_up", ("gate", "up"), lambda ex: ex.input_pieces(), lambda ex: torch.cat([ex.gate, ex.up])),
                  ("down", ("down",), lambda ex: ex.intermediate_pieces(), lambda ex: ex.down))
        for phase, projs, inputs, weight in phases:
            stats = block_statistics(experts, inputs, self.hessian_weighting)
            H = stats.H
            W = torch.stack([weight(ex).detach().float() for ex in experts])
            Hf, W = fix_dead_batched(H, W)
            fac = damped_factors(Hf, self.percdamp,
                                 what=[f"expert {ex.index} {phase.replace('_', '/')} Hessian" for ex in experts])
            del Hf
            U = fac.hinv_chol
            rg = len(projs)
            if self.refit:
                sparse = replace(solver, quantize=False).solve_batched(W, U, row_groups=rg)
                support = sparse.mask
                W = masked_optimum_batched(W, fac.H, support, budget // 2, solve=self.solve, start=sparse.values)
                del sparse
                res = solver.solve_batched(W, U, fmt.weight.global_scales(W), mask=support, row_groups=rg)
                del support
            else:
                g = fmt.weight.global_scales(W * provisional_mask(fmt, W, U))
                res = solver.solve_batched(W, U, g, row_groups=rg)
            pds, dmps = fac.percdamp, fac.damp
            del W, U, fac
            H = stats.H_plain  # report the plain, unweighted error like every method
            del stats
            for e, ex in enumerate(experts):
                r = results[e]
                r["percdamp"][phase], r["damp"][phase] = pds[e], dmps[e]
                for k, p in enumerate(projs):
                    part = res.expert(e, slice(k * inter, (k + 1) * inter) if rg > 1 else slice(None), k)
                    r["q"][p] = part.quantized_weight(fmt)
                    r["latent"][p] = part.latent
                    r["pinned"][p] = part.pinned
                    r["rel_err"][p] = relative_error(getattr(ex, p), r["q"][p].dequantize(), H[e])
            del res, H
        return assemble_results(experts, results, self.name, lambda r: {
            "exact_scales": self.exact_scales, "refit": self.refit,
            "pinned_block_max": {p: r["pinned"][p] for p in PROJECTIONS}})
