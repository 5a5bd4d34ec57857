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

Windows (RefineConfig.e2e_window), for models whose every expert cannot be tuned at once: the MoE blocks are cut
into windows of consecutive blocks, tuned one window after the other, first to last. While a window tunes, its
blocks hold the tuning state and every other block serves its current compressed weights, frozen (the windows
before it tuned, those after it block-wise); the loss is the same KL on the model's final logits, through the rest
of the model. Why this design rather than fitting each window's output to the reference model's states there: the
objective stays the true one (the next-token distribution, which is what the step is for; a window's output error
is what the block loop already fits), and nothing new is needed: the reference's final states are computed once
for all windows (the states at each window's end would cost one stored set per window), the prefix before the
window runs without autograd (no parameter there needs a gradient, so it keeps no activations), and a window of
the whole model is exactly the whole-model step (the same code, the same bytes). The frozen blocks hold their
compressed weights (FrozenExperts: ~2.25 bytes per expert weight against the window's ~25), dequantized one block at
a time, and their forward runs again in the backward (a checkpoint: the backward does not keep their dequantized
weights); their activation quantizers are straight-through like the window's, so the gradient reaches the window
through them. The cost is time: each window runs the step's passes, so k windows cost about k whole-model steps
(plus one more forward of the blocks after the window, for the checkpoint). Windows are planned before the block
loop (`e2e_window_plan`, from the device's memory: `auto` takes the whole model where it fits, else the largest
window that fits), and each finished window is saved before the next starts (a killed run resumes at the window
it was in; pipeline.tune_end_to_end).
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


class _ExpertsWithoutDenseCopy(MoesqExperts):
    """MoesqExperts with the stage's static activation scales and straight-through quantizers, holding no
    dequantized weight copy: a subclass makes the weights at every forward (expert_linears)."""

    ste = True

    def __init__(self, fmt: Format, experts: int, act_quant: bool, act_amax_in: torch.Tensor,
                 act_amax_mid: torch.Tensor):
        super().__init__(fmt, torch.empty(experts, 0, 0), torch.empty(experts, 0, 0), act_quant,
                         input_global_scales(act_amax_in)[0], input_global_scales(act_amax_mid)[0])


class TunableExperts(_ExpertsWithoutDenseCopy):
    """MoesqExperts (what serving computes for the same QuantizedWeights, activation quantizers with the
    stage's static scales) whose weights are fake-quantized latent values V under fixed masks, differentiable
    in V (straight-through, weights and activations)."""

    def __init__(self, fmt: Format, weights: list[dict[str, QuantizedWeight]], act_quant: bool,
                 act_amax_in: torch.Tensor, act_amax_mid: torch.Tensor, device=None):
        super().__init__(fmt, len(weights), act_quant, act_amax_in, act_amax_mid)
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


class FrozenExperts(_ExpertsWithoutDenseCopy):
    """A block outside the window being tuned: MoesqExperts' arithmetic on the block's compressed weights, which it
    holds as they are (codes, block scales, global scales, masks: ~2.25 bytes per weight instead of the 4 of the
    dequantized fp32 copy). A forward dequantizes the block once; under autograd the forward is checkpointed (run
    again in the backward), so the dequantized copy is not kept for the backward either: only the block being
    computed holds one. Its activation quantizers are straight-through, as the tuned blocks' are (TunableExperts):
    the gradient reaches the window through the blocks after it."""

    def __init__(self, fmt: Format, weights: list[dict[str, QuantizedWeight]], act_quant: bool,
                 act_amax_in: torch.Tensor, act_amax_mid: torch.Tensor, device=None):
        super().__init__(fmt, len(weights), act_quant, act_amax_in, act_amax_mid)
        for p in PROJECTIONS:
            qws = [w[p] for w in weights]
            self.register_buffer(f"codes_{p}", torch.stack([q.codes for q in qws]))
            self.register_buffer(f"scales_{p}", torch.stack([q.scales.float() for q in qws]))
            self.register_buffer(f"global_{p}", torch.stack([q.global_scale.float().reshape(1, 1) for q in qws]))
            self.register_buffer(f"kept_{p}", torch.stack([q.mask.bool() for q in qws]))
        self._w: tuple[torch.Tensor, torch.Tensor] | None = None
        self.to(device)

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) fp32: QuantizedWeight.dequantize of the stacked experts (the same
        elementwise arithmetic as from_quantized's per expert)."""
        w = {p: QuantizedWeight(self.fmt.name, getattr(self, f"codes_{p}"), getattr(self, f"scales_{p}"),
                                getattr(self, f"global_{p}"), getattr(self, f"kept_{p}")).dequantize().float()
             for p in PROJECTIONS}
        return torch.cat([w["gate"], w["up"]], dim=1), w["down"]

    def stacked_linears(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._w if self._w is not None else self._dequantized()

    def _forward(self, hidden_states, top_k_index, top_k_weights):
        self._w = self._dequantized()  # once per forward, for all experts
        try:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        finally:
            self._w = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, hidden_states, top_k_index, top_k_weights, use_reentrant=False)
        return self._forward(hidden_states, top_k_index, top_k_weights)


# Bytes the step holds per expert weight beyond the dense weights, per optimizer (RefineConfig.e2e_optimizer): latent
# V and its gradient (fp32 each), the optimizer's moments (Adam two fp32, Lion one), the fake-quantized weights its
# forward keeps for the backward (fp32), the mask.
STATE_BYTES_PER_WEIGHT = {"adam": 2 * 4 + 2 * 4 + 4 + 1, "lion": 2 * 4 + 4 + 4 + 1}
# Activations kept for the backward per token and decoder layer, in units of the hidden width (attention and
# MoE inputs/outputs, norms, routed rows at top-k; measured order of magnitude, not a bound).
ACTIVATION_WIDTHS_PER_LAYER = 24


# Bytes a frozen block holds per expert weight while another window tunes (FrozenExperts: uint8 codes, a bool mask,
# fp32 block scales of 16 weights), and those of the one frozen block being computed (its dequantized fp32 weights
# and gate_up's concatenated copy)
FROZEN_BYTES_PER_WEIGHT = 2.25
FROZEN_TRANSIENT_BYTES_PER_WEIGHT = 8


def _expert_weights(adapter, model) -> tuple[dict[int, int], int]:
    """(layer index -> the MoE block's expert weights, their dense itemsize)."""
    counts, itemsize = {}, 0
    for b in adapter.blocks(model):
        ex = b.dense_experts
        counts[b.layer_index] = ex.gate_up_proj.numel() + ex.down_proj.numel()
        itemsize = ex.gate_up_proj.element_size()
    return counts, itemsize


def window_need_bytes(model: nn.Module, adapter, batch_size: int, seq_len: int, layers: list[int],
                      optimizer: str = "adam") -> int:
    """Estimated peak memory of tuning the experts of the MoE layers `layers` (a window) end to end with
    `optimizer`: their dense weights (restored for the reference pass) and tuning state (STATE_BYTES_PER_WEIGHT),
    the other blocks' served weights, one batch's activations from the window's first layer to the last (the
    prefix runs without autograd) and its vocabulary-sized logits (the model's other weights are resident
    already)."""
    counts, itemsize = _expert_weights(adapter, model)
    tuned = sum(counts[li] for li in layers)
    frozen = sum(counts.values()) - tuned
    cfg = model.config
    after = max(len(counts), cfg.num_hidden_layers) - (min(layers) if frozen else 0)  # layers the backward runs
    tokens = batch_size * seq_len
    acts = tokens * 4 * (cfg.hidden_size * ACTIVATION_WIDTHS_PER_LAYER * after + 3 * cfg.vocab_size)
    transient = FROZEN_TRANSIENT_BYTES_PER_WEIGHT * max((c for li, c in counts.items() if li not in layers), default=0)
    state = STATE_BYTES_PER_WEIGHT[optimizer]
    return tuned * (itemsize + state) + int(frozen * FROZEN_BYTES_PER_WEIGHT) + transient + acts


def memory_need_bytes(model: nn.Module, adapter, batch_size: int, seq_len: int, optimizer: str = "adam") -> int:
    """Estimated peak memory of the end-to-end step on `model` in one window: every block's dense expert weights,
    the tuning state of every expert weight, one batch's activations through all layers and its logits."""
    return window_need_bytes(model, adapter, batch_size, seq_len, [b.layer_index for b in adapter.blocks(model)],
                             optimizer)


@dataclass
class WindowPlan:
    """The end-to-end step's windows (lists of consecutive MoE layer indices, first to last), the largest
    window's memory estimate and whether it fits the memory given."""

    windows: list[list[int]]
    need_bytes: int
    fits: bool
    auto: bool

    @property
    def whole(self) -> bool:
        return len(self.windows) == 1

    def describe(self) -> str:
        """The windows in words: "the whole model at once", "2 windows of 2 blocks: layers 0-1, 2-3" (more than
        six: "48 windows of 1 block: layers 0, 1, …, 47")."""
        if self.whole:
            return "the whole model at once"
        size = len(self.windows[0])
        spans = [f"{w[0]}-{w[-1]}" if len(w) > 1 else f"{w[0]}" for w in self.windows]
        spans = ", ".join(spans if len(spans) <= 6 else [*spans[:2], "…", spans[-1]])
        return f"{len(self.windows)} windows of {size} block{'s' if size > 1 else ''}: layers {spans}"


def e2e_window_plan(model: nn.Module, adapter, batch_size: int, seq_len: int, window: int | str,
                    available: int | None, optimizer: str = "adam") -> WindowPlan:
    """The windows of the end-to-end step with `optimizer` (RefineConfig.e2e_window, e2e_optimizer): `window`
    blocks each (the last may hold fewer; more than the model has is the whole model), or "auto": the whole
    model where its estimate fits `available` bytes (None: unknown, taken to fit), else the largest window that
    fits, else one block a window (then `fits` is False and the caller decides)."""
    layers = [b.layer_index for b in adapter.blocks(model)]

    def plan(w: int) -> WindowPlan:
        ws = [layers[i : i + w] for i in range(0, len(layers), w)]
        need = max(window_need_bytes(model, adapter, batch_size, seq_len, x, optimizer) for x in ws) if ws else 0
        return WindowPlan(ws, need, available is None or need <= available, window == "auto")

    if window != "auto":
        return plan(max(1, min(int(window), len(layers))))
    for w in range(len(layers), 0, -1):
        p = plan(w)
        if p.fits:
            return p
    return plan(1)


@dataclass
class E2EResult:
    blocks: dict[int, list[CompressedExpert]]  # layer index -> the experts to ship (the input where unchanged)
    summary: dict  # JSON-ready: steps, validation KL per pass, the shipped pass (per window: "windows")


def make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The end-to-end step's optimizer (RefineConfig.e2e_optimizer) at `lr`: "adam" (torch's Adam, two fp32
    moments per weight) or "lion" (lion-pytorch's Lion, one fp32 moment per weight; betas (0.9, 0.99), no weight
    decay, as Adam here has none). Their state per weight is STATE_BYTES_PER_WEIGHT's."""
    if name == "lion":
        from lion_pytorch import Lion  # imported here so formats/methods load without it

        return Lion(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    return torch.optim.Adam(params, lr=lr)


def _batches(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


class EndToEndTuner:
    """Tunes the installed TunableExperts of every MoE block of `model` against reference final hidden
    states. `blocks`: layer index -> (MoEBlock, CompressedExperts, amax_in, amax_mid) of the stage."""

    def __init__(self, model: nn.Module, blocks: dict, fmt: Format, act_quant: bool, cfg, device):
        self.model, self.blocks, self.fmt, self.cfg, self.device = model, blocks, fmt, cfg, device
        self.act_quant = act_quant
        self.modules: dict[int, TunableExperts] = {}
        self._M: torch.Tensor | None = None

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

    def run(self, train: torch.Tensor, val: torch.Tensor, progress=None, windows: list[list[int]] | None = None,
            finished: list[dict] | None = None, on_window=None) -> E2EResult:
        """Tune on the sequences `train` [n, seq], validate on `val`; the model's experts end up dense.

        `windows` (default: one, every block) are tuned in order, each with the others frozen at their current
        results. `finished`: the summaries of the first windows, already tuned (a resumed run; their results
        are in `blocks` already). `on_window(layers, result)`, called after each window tuned now, returns the
        experts its blocks ship from then on (the caller saves them; None: result.blocks)."""
        windows = windows or [sorted(self.blocks)]
        finished = list(finished or [])
        for b, *_ in self.blocks.values():
            b.restore_dense()
        # a task for the whole step: its reference states, its Fisher matrix and its validations are long too
        with (progress or NullProgress()).task("refine: end-to-end step (references, validation)", None):
            ref_train, ref_val = self._reference_states(train), self._reference_states(val)
            for p in self.model.parameters():
                p.requires_grad_(False)
            summaries = finished
            try:
                for layers in windows[len(finished):]:
                    self._install(layers)
                    name = "" if len(windows) == 1 else f", layers {layers[0]}-{layers[-1]}"
                    result = self._train(train, val, ref_train, ref_val, progress, name)
                    if len(windows) == 1:
                        return result
                    kept = on_window(layers, result) if on_window is not None else None
                    for li, results in (kept or result.blocks).items():
                        b, _, amax_in, amax_mid = self.blocks[li]
                        self.blocks[li] = (b, results, amax_in, amax_mid)
                    summaries.append({"layers": layers, **result.summary})
                    self.modules = {}
                    for b, *_ in self.blocks.values():
                        b.restore_dense()
            finally:
                for b, *_ in self.blocks.values():
                    b.restore_dense()
        # steps: each window's (they all run the step's length); best_pass: > 0 where some window shipped tuned values
        summary = {"windows": summaries, "steps": max((w["steps"] for w in summaries), default=0),
                   "best_pass": max((w["best_pass"] for w in summaries), default=0)}
        return E2EResult({li: results for li, (_, results, *_) in self.blocks.items()}, summary)

    def _install(self, layers: list[int]) -> None:
        """TunableExperts in the blocks of `layers`, every other block's current results frozen (as served)."""
        self.modules = {}
        for li, (b, results, amax_in, amax_mid) in self.blocks.items():
            if li in layers:
                m = TunableExperts(self.fmt, [r.weights() for r in results], self.act_quant, amax_in, amax_mid,
                                   self.device)
                self.modules[li] = m
            else:
                m = FrozenExperts(self.fmt, [r.weights() for r in results], self.act_quant, amax_in, amax_mid,
                                  self.device)
            b.mlp.experts = m  # every block at once (not set_experts: a lazily opened model would release them)

    def _train(self, train, val, ref_train, ref_val, progress, name: str = "") -> E2EResult:
        """Tune the installed TunableExperts (self.modules); the blocks of the others come back unchanged."""
        cfg = self.cfg
        params = [m.V[p] for m in self.modules.values() for p in PROJECTIONS]
        opt = make_optimizer(cfg.e2e_optimizer, params, cfg.e2e_lr)
        batches = _batches(len(train), cfg.e2e_batch_size)
        if cfg.e2e_loss == "fisher":
            if self._M is None:  # the reference's: once for every window
                self._M = self._fisher(ref_train)
            M = self._M
            loss_of = lambda tokens, ref_h: self._fisher_loss(tokens, ref_h, M)  # noqa: E731
        else:
            loss_of = self._kl
        val_kl = [self._validate(val, ref_val)]  # "pass 0": the block-wise result
        best, best_pass, best_state = val_kl[0], 0, None
        gen = torch.Generator().manual_seed(cfg.seed)
        step, pass_no, train_kl = 0, 0, []
        with (progress or NullProgress()).task(f"refine: end-to-end tuning{name}", cfg.e2e_steps) as t:
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
                log.info("refine end-to-end%s: pass %d, %d steps, train loss %.4g, val KL %.4g", name, pass_no, step,
                         train_kl[-1], v)
                if v < best:
                    best, best_pass, best_state = v, pass_no, self._snapshot()
        summary = {"steps": step, "passes": pass_no, "val_kl": val_kl, "train_kl": train_kl, "best_pass": best_pass}
        out = {}
        for li, (b, results, amax_in, amax_mid) in self.blocks.items():
            if best_state is None or li not in self.modules:
                out[li] = results
                continue
            m = self.modules[li]
            with torch.no_grad():
                for p in PROJECTIONS:
                    m.V[p].copy_(best_state[li][p])
            infos = [{**(r.info or {}), "e2e": {"best_pass": best_pass}} for r in results]
            out[li] = m.export(infos)
        return E2EResult(out, summary)

