"""End-to-end tuning after block-wise refinement (RefineConfig.e2e_steps): every expert's sparsity pattern
stays fixed and the latent values of all experts of all blocks are tuned at once so that the compressed
model's next-token distribution matches the reference model's, KL(p_ref ‖ p_compressed) on the final logits
over the calibration sequences, like EfficientQAT's end-to-end phase.

Why: block-wise refinement fits each block's output to the dense block's on the compressed prefix; the
errors of the blocks still add up, and on a small calibration set the per-block objective overfits (its
validation loss stops falling after the first epoch). The end-to-end loss sees the model's output instead.

Mechanics, as in block-wise refinement: a latent fp32 copy V of every expert weight, initialised from the
block-wise result (dequantized), straight-through quantization in the forward pass (block scales from the
masked values, per expert the input's global scales, gate and up sharing one), activations quantized with
the stage's static calibrated scales (as served) and straight-through. The reference distribution comes from
the dense model's final hidden states, computed once (logits = lm_head of them, recomputed per step: the
vocabulary-sized logits are never stored). Validation: the KL on the calibration's validation sequences,
before tuning and after every pass over the training sequences; the best ships (the input unchanged when
nothing validates better).

`e2e_loss="fisher"` trains on the KL's second-order form instead: with d = h − h_ref the final hidden states'
error and z = W h the logits, KL(p_ref ‖ p) ≈ ½ dᵀ Wᵀ F W d, F = diag(p_ref) − p_ref p_refᵀ the softmax's Fisher.
Averaging F over the reference's calibration tokens gives one hidden × hidden matrix M = Wᵀ diag(p̄) W − mean(u uᵀ),
u = Wᵀ p_ref, computed once; a step's loss is then ½ mean dᵀ M d, with no vocabulary-sized logits (most of a
step where the vocabulary outweighs the experts: half the step's time on the embedded model; at Qwen3-30B-A3B's
scale the head is ~10 % of a step). Validation stays the exact KL.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moesq_core.compression.methods.base import PROJECTIONS, CompressedExpert
from moesq_core.formats import Format, QuantizedWeight
from moesq_core.formats.quantizers import input_global_scales
from moesq_core.progress import NullProgress
from moesq_core.serving.experts import MoesqExperts

log = logging.getLogger(__name__)


class TunableExperts(MoesqExperts):
    """MoesqExperts (what serving computes for the same QuantizedWeights, activation quantizers with the
    stage's static scales) whose weights are fake-quantized latent values V under fixed masks, differentiable
    in V (straight-through, weights and activations)."""

    ste = True

    def __init__(self, fmt: Format, weights: list[dict[str, QuantizedWeight]], act_quant: bool,
                 act_amax_in: torch.Tensor, act_amax_mid: torch.Tensor, device=None):
        E = len(weights)
        # no dequantized copies: the weights come from V at every forward (expert_linears)
        super().__init__(fmt, torch.empty(E, 0, 0), torch.empty(E, 0, 0), act_quant,
                         input_global_scales(act_amax_in)[0], input_global_scales(act_amax_mid)[0])
        self.V = nn.ParameterDict()
        for p in PROJECTIONS:
            qws = [w[p] for w in weights]
            self.V[p] = nn.Parameter(torch.stack([q.dequantize().float() for q in qws]))
            self.register_buffer(f"mask_{p}", torch.stack([q.mask.bool() for q in qws]))
            # per expert the input's global scale (gate and up share one): fixed, so the tuned weights keep it
            self.register_buffer(f"g_{p}",
                                 torch.stack([q.global_scale.float().reshape(()) for q in qws]).reshape(-1, 1, 1))
        self._w: tuple[torch.Tensor, torch.Tensor] | None = None
        self.to(device)

    def mask(self, p: str) -> torch.Tensor:
        return getattr(self, f"mask_{p}")

    def global_scale(self, p: str) -> torch.Tensor:
        return getattr(self, f"g_{p}")

    def weights(self) -> dict[str, torch.Tensor]:
        """The quantize-dequantized weights [E, O, K] of the current values (straight-through in V)."""
        return {p: self.fmt.fake_quant_weight(self.V[p], self.mask(p), self.global_scale(p), ste=True)
                for p in PROJECTIONS}

    def stacked_linears(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._w

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        W = self.weights()  # once per forward, for all experts
        self._w = (torch.cat([W["gate"], W["up"]], dim=1), W["down"])
        try:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        finally:
            self._w = None

    @torch.no_grad()
    def export(self, infos: list[dict]) -> list[CompressedExpert]:
        """fmt.quantize of the current values under the fixed masks and global scales: exactly the weights
        the forward pass used."""
        out = []
        for e, info in enumerate(infos):
            q = {p: self.fmt.quantize(self.V[p][e].detach().cpu(), self.mask(p)[e].cpu(),
                                      self.global_scale(p)[e].cpu()) for p in PROJECTIONS}
            out.append(CompressedExpert(q["gate"], q["up"], q["down"], info=info))
        return out


# Bytes the step holds per expert weight beyond the dense weights: latent V, its gradient and Adam's two
# moments (fp32 each), the fake-quantized weights its forward keeps for the backward (fp32), the mask.
STATE_BYTES_PER_WEIGHT = 4 * 4 + 4 + 1
# Activations kept for the backward per token and decoder layer, in units of the hidden width (attention and
# MoE inputs/outputs, norms, routed rows at top-k; measured order of magnitude, not a bound).
ACTIVATION_WIDTHS_PER_LAYER = 24


def memory_need_bytes(model: nn.Module, adapter, batch_size: int, seq_len: int) -> int:
    """Estimated peak memory of the end-to-end step on `model`: every block's dense expert weights (restored
    for the reference pass), the tuning state of every expert weight, one batch's activations through all
    layers and its vocabulary-sized logits (the model's other weights are resident already)."""
    expert_weights = itemsize = 0
    layers = 0
    for b in adapter.blocks(model):
        ex = b.dense_experts
        expert_weights += ex.gate_up_proj.numel() + ex.down_proj.numel()
        itemsize = ex.gate_up_proj.element_size()
        layers += 1
    cfg = model.config
    tokens = batch_size * seq_len
    acts = tokens * 4 * (cfg.hidden_size * ACTIVATION_WIDTHS_PER_LAYER * max(layers, cfg.num_hidden_layers)
                         + 3 * cfg.vocab_size)
    return expert_weights * (itemsize + STATE_BYTES_PER_WEIGHT) + acts


@dataclass
class E2EResult:
    blocks: dict[int, list[CompressedExpert]]  # layer index -> the experts to ship (the input where unchanged)
    summary: dict  # JSON-ready: steps, validation KL per pass, the shipped pass


def _batches(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


class EndToEndTuner:
    """Tunes the installed TunableExperts of every MoE block of `model` against reference final hidden
    states. `blocks`: layer index -> (MoEBlock, CompressedExperts, amax_in, amax_mid) of the stage."""

    def __init__(self, model: nn.Module, blocks: dict, fmt: Format, act_quant: bool, cfg, device):
        self.model, self.blocks, self.fmt, self.cfg, self.device = model, blocks, fmt, cfg, device
        self.act_quant = act_quant
        self.modules: dict[int, TunableExperts] = {}

    @torch.no_grad()
    def _reference_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The dense model's final (normed) hidden states of `tokens`, on the CPU in fp32."""
        out = []
        for a, b in _batches(len(tokens), self.cfg.e2e_batch_size):
            h = self.model.model(input_ids=tokens[a:b].to(self.device), use_cache=False).last_hidden_state
            out.append(h.float().cpu())
        return torch.cat(out)

    @torch.no_grad()
    def _fisher(self, ref_h: torch.Tensor, tokens: int = 8192, chunk: int = 1024) -> torch.Tensor:
        """M = mean over reference tokens of Wᵀ (diag(p) − p pᵀ) W (every k-th of the calibration tokens, about
        `tokens` of them), W the output head, p the reference's next-token distribution: [hidden, hidden], fp32."""
        W = self.model.lm_head.weight.float()
        flat = ref_h.reshape(-1, ref_h.shape[-1])
        flat = flat[:: max(1, len(flat) // tokens)]
        M = torch.zeros(W.shape[1], W.shape[1], device=W.device)
        p_sum = torch.zeros(W.shape[0], device=W.device)
        for a in range(0, len(flat), chunk):
            p = torch.softmax(flat[a : a + chunk].to(W.device) @ W.T, dim=-1)
            u = p @ W
            M -= u.T @ u
            p_sum += p.sum(0)
        M += (W.T * p_sum) @ W
        return M / len(flat)

    def _fisher_loss(self, tokens: torch.Tensor, ref_h: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """½ mean over tokens of dᵀ M d, d the final hidden states' error: the KL to second order."""
        h = self.model.model(input_ids=tokens.to(self.device), use_cache=False).last_hidden_state
        d = (h.float() - ref_h.to(self.device)).reshape(-1, h.shape[-1])
        return 0.5 * ((d @ M) * d).sum(-1).mean()

    def _kl(self, tokens: torch.Tensor, ref_h: torch.Tensor) -> torch.Tensor:
        """Mean over tokens of KL(p_ref ‖ p_model), p = softmax of the final logits (fp32)."""
        head = self.model.lm_head
        h = self.model.model(input_ids=tokens.to(self.device), use_cache=False).last_hidden_state
        logp = F.log_softmax(head(h).float(), dim=-1)
        with torch.no_grad():
            ref = F.log_softmax(head(ref_h.to(self.device, h.dtype)).float(), dim=-1)
        return F.kl_div(logp.reshape(-1, logp.shape[-1]), ref.reshape(-1, ref.shape[-1]), log_target=True,
                        reduction="batchmean")

    @torch.no_grad()
    def _validate(self, tokens: torch.Tensor, ref_h: torch.Tensor) -> float:
        total, n = 0.0, 0
        for a, b in _batches(len(tokens), self.cfg.e2e_batch_size):
            k = b - a
            total += float(self._kl(tokens[a:b], ref_h[a:b])) * k
            n += k
        return total / max(n, 1)

    def _snapshot(self) -> dict[int, dict[str, torch.Tensor]]:
        return {li: {p: m.V[p].detach().clone() for p in PROJECTIONS} for li, m in self.modules.items()}

    def run(self, train: torch.Tensor, val: torch.Tensor, progress=None) -> E2EResult:
        """Tune on the sequences `train` [n, seq], validate on `val`; the model's experts end up dense."""
        for b, *_ in self.blocks.values():
            b.restore_dense()
        # a task for the whole step: its reference states, its Fisher matrix and its validations are long too
        with (progress or NullProgress()).task("refine: end-to-end step (references, validation)", None):
            ref_train, ref_val = self._reference_states(train), self._reference_states(val)
            for p in self.model.parameters():
                p.requires_grad_(False)
            for li, (b, results, amax_in, amax_mid) in self.blocks.items():
                m = TunableExperts(self.fmt, [r.weights() for r in results], self.act_quant, amax_in, amax_mid,
                                   self.device)
                self.modules[li] = m
                b.mlp.experts = m  # every block at once (not set_experts: a lazily opened model would release them)
            try:
                return self._train(train, val, ref_train, ref_val, progress)
            finally:
                for b, *_ in self.blocks.values():
                    b.restore_dense()

    def _train(self, train, val, ref_train, ref_val, progress) -> E2EResult:
        cfg = self.cfg
        params = [m.V[p] for m in self.modules.values() for p in PROJECTIONS]
        opt = torch.optim.Adam(params, lr=cfg.e2e_lr)
        batches = _batches(len(train), cfg.e2e_batch_size)
        if cfg.e2e_loss == "fisher":
            M = self._fisher(ref_train)
            loss_of = lambda tokens, ref_h: self._fisher_loss(tokens, ref_h, M)  # noqa: E731
        else:
            loss_of = self._kl
        val_kl = [self._validate(val, ref_val)]  # "pass 0": the block-wise result
        best, best_pass, best_state = val_kl[0], 0, None
        gen = torch.Generator().manual_seed(cfg.seed)
        step, pass_no, train_kl = 0, 0, []
        with (progress or NullProgress()).task("refine: end-to-end tuning", cfg.e2e_steps) as t:
            while step < cfg.e2e_steps:
                perm = torch.randperm(len(train), generator=gen)
                pass_no += 1
                acc, k = 0.0, 0
                for a, b in batches:
                    if step >= cfg.e2e_steps:
                        break
                    lr = cfg.e2e_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.e2e_steps))  # cosine to 0
                    for g in opt.param_groups:
                        g["lr"] = lr
                    idx = perm[a:b]
                    loss = loss_of(train[idx], ref_train[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    acc, k, step = acc + float(loss.detach()), k + 1, step + 1
                    t.advance()
                train_kl.append(acc / max(k, 1))
                v = self._validate(val, ref_val)
                val_kl.append(v)
                log.info("refine end-to-end: pass %d, %d steps, train loss %.4g, val KL %.4g", pass_no, step,
                         train_kl[-1], v)
                if v < best:
                    best, best_pass, best_state = v, pass_no, self._snapshot()
        summary = {"steps": step, "passes": pass_no, "val_kl": val_kl, "train_kl": train_kl, "best_pass": best_pass}
        out = {}
        for li, (b, results, amax_in, amax_mid) in self.blocks.items():
            if best_state is None:
                out[li] = results
                continue
            m = self.modules[li]
            with torch.no_grad():
                for p in PROJECTIONS:
                    m.V[p].copy_(best_state[li][p])
            infos = [{**(r.info or {}), "e2e": {"best_pass": best_pass}} for r in results]
            out[li] = m.export(infos)
        return E2EResult(out, summary)

