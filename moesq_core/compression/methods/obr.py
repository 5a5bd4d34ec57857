"""OBR without rotation (Guo, Li, Benini 2025/26, "Optimal Brain Restoration for joint quantization and
sparsification of LLMs"), in the target format.

Per projection, with H the damped Hessian:
1. Support: Wanda scores |W_ij|·‖X_j‖₂ (what OBR's code prunes with), best pattern of the format per group.
2. Pruning compensation, row-wise closed-form OBS restricted to the kept set K (pruned set Z):
       δ_K = H_KK⁻¹ H_KZ W_Z,  W' = (W + δ) ⊙ mask
   the exact minimiser of ‖(W − W')X‖² over weights supported on K.
3. Quantization compensation on a second partition: the kept columns are split by column order at
   `alpha`·in (0.5); the first partition is rounded to nearest in the format (error e₁ = W'₁ − Q₁) and the
   second absorbs it,   δ₂ = H₂₂⁻¹ H₂₁ e₁.
4. The second partition is quantized: by GPTQ with the support fixed (OBR's default; `second_stage="gptq"`,
   export-exact scales as in SGPTQ) or by RTN (`"rtn"`, OBR's --obr_rtn, which re-rounds the whole row).

Each row has its own kept set, so steps 2-3 are least-squares problems per row, solved for all rows at once
(`hessian.kept_set_solve`): by preconditioned conjugate gradients (`solve="cg"`, the default) or one Cholesky per
row of the gathered H[K, K] (`solve="exact"`): no Python loop over rows. `compress_block` runs all experts of a
block at once (gate and up stacked along their rows, then down; chunked to a memory budget); `batched=False` runs
the per-expert reference (`compress_expert`) instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moesq_core.compression.methods.base import PROJECTIONS, CompressedExpert, ExpertData, ProgressFn, compress_each
from moesq_core.compression.methods.batching import assemble_results, compress_batched
from moesq_core.compression.methods.hessian import (
    Damped,
    DampedBatch,
    batched_masked_solve,
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
    kept_set_solve,
    masked_optimum,
    masked_optimum_batched,
    relative_error,
    row_sets,
    row_sets_batched,
)
from moesq_core.compression.methods.rtn import check_expert, fallback_no_tokens
from moesq_core.compression.methods.sparsegpt_gptq import SGPTQSolver
from moesq_core.compression.methods.wanda import wanda_scores
from moesq_core.formats import Format, QuantizedWeight


def partition_point(C: int, fmt: Format, alpha: float) -> int:
    """alpha·C rounded to whole groups and scale blocks, so no group or scale block straddles the split."""
    unit = math.lcm(fmt.patterns.group, fmt.scale_block or 1)
    return int(round(alpha * C / unit)) * unit


@dataclass
class OBR:
    name: str = "obr"
    percdamp: float = 0.01  # Hessian damping as a fraction of mean(diag H)
    alpha: float = 0.5  # the first partition's share of the kept columns, rounded to nearest (in [0, 1])
    second_stage: str = "gptq"  # gptq | rtn
    exact_scales: bool = True  # GPTQ with the final E4M3 block scales; false: fp32 scales projected afterwards
    blocksize: int = 128  # columns per lazy GPTQ block
    hessian_weighting: str = "none"  # router weighting of the Hessian: none | w | w2
    solve: str = "cg"  # the kept-set least squares of steps 2-3: "cg" (iterative) | "exact" (Cholesky per row)
    batched: bool = True  # all experts of a block at once (False: the per-expert reference, one at a time)
    chunk_gb: float | None = None  # memory for one chunk of experts (None: half the free GPU memory; 4 GiB on CPU)
    cuda_graphs: bool = True  # the batched GPTQ sweep on CUDA replays each lazy block as a CUDA graph (same numbers)

    def __post_init__(self):
        if self.second_stage not in ("gptq", "rtn"):
            raise ValueError(f"second_stage must be 'gptq' or 'rtn', got {self.second_stage!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        check_solve(self.solve)
        check_damping(self.percdamp)
        check_weighting(self.hessian_weighting)

    def quantize(self, Wc: torch.Tensor, fac: Damped, mask: torch.Tensor, fmt: Format,
                 g: torch.Tensor) -> tuple[QuantizedWeight, torch.Tensor]:
        """Steps 3-4 on the pruning-compensated Wc (`obr_compensate`). Returns (weight, latent)."""
        C = Wc.shape[1]
        Hd = fac.H
        s = partition_point(C, fmt, self.alpha)
        q0 = fmt.quantize(Wc, mask, g)  # RTN; its first partition is final
        if 0 < s < C:
            kept, _ = row_sets(mask)
            k1 = int((kept[0] < s).sum())
            k_first, k_second = kept[:, :k1], kept[:, k1:]
            e1 = (Wc - q0.dequantize()).gather(1, k_first)
            Wc = Wc.scatter_add(1, k_second, batched_masked_solve(Hd, k_second, k_first, e1, solve=self.solve))
        if self.second_stage == "rtn" or s >= C:
            q = fmt.quantize(Wc, mask, g)
            return q, Wc
        # GPTQ on the second partition: the trailing block of chol(H⁻¹) is chol(H₂₂⁻¹), the problem left once
        # the first partition is fixed.
        per_row = fmt.scale_block == 0
        solver = SGPTQSolver(fmt, self.blocksize, exact_scales=self.exact_scales)
        res = solver.solve(Wc[:, s:], fac.hinv_chol[s:, s:], g, mask=mask[:, s:],
                           scales=q0.scales if per_row else None)
        sb = fmt.scale_block
        scales = q0.scales if per_row else torch.cat([q0.scales[:, : s // sb], res.scales], 1)
        codes = torch.cat([q0.codes[:, :s], res.codes], 1)
        latent = torch.cat([Wc[:, :s], res.latent], 1)
        return QuantizedWeight(fmt.name, codes, scales, g.reshape(()), mask), latent

    def compress_expert(self, ex: ExpertData, fmt: Format) -> CompressedExpert:
        check_expert(ex, fmt)
        if ex.n_rows == 0:
            return fallback_no_tokens(ex, fmt, self.name)
        h_in, h_mid = expert_hessians(ex, self.hessian_weighting)
        hs = {"gate": h_in, "up": h_in, "down": h_mid}
        x = ex.inputs()
        inputs = {"gate": x, "up": x, "down": ex.dense_intermediate(x)}
        fixed = {p: fix_dead(hs[p], getattr(ex, p).detach().float()) for p in PROJECTIONS}
        fac_in = damped_factor(fixed["gate"][0], self.percdamp, what=f"expert {ex.index} gate/up Hessian")
        fac_mid = damped_factor(fixed["down"][0], self.percdamp, what=f"expert {ex.index} down Hessian")
        fac = {"gate": fac_in, "up": fac_in, "down": fac_mid}
        W, masks, Wc = {}, {}, {}
        for p in PROJECTIONS:
            W[p] = fixed[p][1]
            masks[p] = fmt.patterns.best_mask(wanda_scores(W[p], inputs[p], ex.w, self.hessian_weighting))
            Wc[p] = masked_optimum(W[p], fac[p].H, masks[p], self.solve)
        g_gu = fmt.global_scale(Wc["gate"], Wc["up"])  # Wc is already masked
        g_d = fmt.global_scale(Wc["down"])
        q, latent = {}, {}
        for p in PROJECTIONS:
            q[p], latent[p] = self.quantize(Wc[p], fac[p], masks[p], fmt, g_d if p == "down" else g_gu)
        if self.hessian_weighting != "none":  # report the plain, unweighted error like every method
            hs = {"gate": hessian(x), "down": hessian(inputs["down"])}
            hs["up"] = hs["gate"]
        info = {
            "method": self.name,
            "tokens": ex.n_rows,
            "percdamp": {"gate_up": fac_in.percdamp, "down": fac_mid.percdamp},
            "damp": {"gate_up": fac_in.damp, "down": fac_mid.damp},
            "second_stage": self.second_stage,
            "rel_err": {p: relative_error(getattr(ex, p), q[p].dequantize(), hs[p]) for p in PROJECTIONS},
        }
        return CompressedExpert(q["gate"], q["up"], q["down"], latent=latent, info=info)

    def compress_block(self, experts: list[ExpertData], fmt: Format,
                       progress: ProgressFn | None = None) -> list[CompressedExpert]:
        if not self.batched:
            return compress_each(experts, fmt, self.compress_expert, progress)
        return compress_batched(experts, fmt, self.name, lambda chunk, budget: self._compress_chunk(chunk, fmt, budget),
                                progress, self.chunk_gb)

    def quantize_batched(self, Wc: torch.Tensor, fac: DampedBatch, mask: torch.Tensor, fmt: Format, g: torch.Tensor,
                         row_groups: int = 1, budget: int = 1 << 30) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`quantize` for E experts: Wc, mask [E, R, C], g [E]. Returns (codes, scales, latent), batched."""
        C = Wc.shape[-1]
        gb = g[:, None, None]
        s = partition_point(C, fmt, self.alpha)
        q = fmt.weight

        def rtn(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # = fmt.quantize(W, mask, g), batched
            wm = W * mask
            sc = q.block_scales(wm, gb)
            return (q.encode(wm, sc, gb) * mask).to(torch.uint8), sc

        codes0, scales0 = rtn(Wc)  # its first partition is final
        if 0 < s < C:
            kept, _ = row_sets_batched(mask)
            k1 = s // fmt.patterns.group * fmt.patterns.kept_per_group  # every row keeps this many left of s
            k_first, k_second = kept[..., :k1], kept[..., k1:]
            e1 = (Wc - q.decode(codes0, scales0, gb) * mask).gather(-1, k_first)
            Wc = Wc.scatter_add(-1, k_second, kept_set_solve(fac.H, k_second, k_first, e1, self.solve, budget=budget))
        if self.second_stage == "rtn" or s >= C:
            codes, scales = rtn(Wc)
            return codes, scales, Wc
        per_row = fmt.scale_block == 0
        solver = SGPTQSolver(fmt, self.blocksize, exact_scales=self.exact_scales, cuda_graphs=self.cuda_graphs)
        res = solver.solve_batched(Wc[..., s:], fac.hinv_chol[:, s:, s:], g, mask=mask[..., s:],
                                   scales=scales0 if per_row else None, row_groups=row_groups)
        sb = fmt.scale_block
        scales = scales0 if per_row else torch.cat([scales0[..., : s // sb], res.scales], -1)
        codes = torch.cat([codes0[..., :s], res.codes], -1)
        latent = torch.cat([Wc[..., :s], res.latent], -1)
        return codes, scales, latent

    def _compress_chunk(self, experts: list[ExpertData], fmt: Format, budget: int) -> list[CompressedExpert]:
        """`compress_expert` for a chunk of experts (all with tokens) at once: gate and up stacked along their
        rows (they share the Hessian and the global scale), then down."""
        inter = experts[0].gate.shape[0]
        results: list[dict] = [dict(q={}, latent={}, rel_err={}, percdamp={}, damp={}) for _ in experts]
        phases = (("gate_up", ("gate", "up"), lambda ex: ex.input_pieces(), lambda ex: torch.cat([ex.gate, ex.up])),
                  ("down", ("down",), lambda ex: ex.intermediate_pieces(), lambda ex: ex.down))
        for phase, projs, inputs, weight in phases:
            stats = block_statistics(experts, inputs, self.hessian_weighting, sq_norms=True)
            H = stats.H
            W = torch.stack([weight(ex).detach().float() for ex in experts])
            Hf, W = fix_dead_batched(H, W)
            fac = damped_factors(Hf, self.percdamp,
                                 what=[f"expert {ex.index} {phase.replace('_', '/')} Hessian" for ex in experts])
            del Hf
            mask = fmt.patterns.best_mask(W.abs() * stats.sq_norms.sqrt()[:, None, :])  # Wanda's scores
            Wc = masked_optimum_batched(W, fac.H, mask, budget // 2, solve=self.solve)
            del W
            g = fmt.weight.global_scales(Wc)  # Wc is already masked; gate and up share one
            codes, scales, latent = self.quantize_batched(Wc, fac, mask, fmt, g, len(projs), budget // 2)
            pds, dmps = fac.percdamp, fac.damp
            del Wc, fac
            H = stats.H_plain  # report the plain, unweighted error like every method
            del stats
            for e, ex in enumerate(experts):
                r = results[e]
                r["percdamp"][phase], r["damp"][phase] = pds[e], dmps[e]
                for k, p in enumerate(projs):
                    rows = slice(k * inter, (k + 1) * inter) if len(projs) > 1 else slice(None)
                    r["q"][p] = QuantizedWeight(fmt.name, codes[e, rows].clone(), scales[e, rows].clone(),
                                                g[e].reshape(()).clone(), mask[e, rows].clone())
                    r["latent"][p] = latent[e, rows].clone()
                    r["rel_err"][p] = relative_error(getattr(ex, p), r["q"][p].dequantize(), H[e])
            del codes, scales, latent, mask, H
        return assemble_results(experts, results, self.name, lambda r: {"second_stage": self.second_stage})
