"""Batched refinement of one MoE block: the joint support–value optimisation of every expert at once.

Layout. The block's calibration tokens are held once, in one token matrix [T, H] (the states' dtype; top-8
routing would hold each 8 times). Every routed row of the block (expert by expert, train rows then validation
rows, plus one "sentinel" row) is the index of its token, with its router weight w. A step gathers each
expert's rows into a capacity-padded [k, c, H] buffer (padding points at the sentinel, whose rows are zeroed
and whose token weight is 0), quantizes them, computes their dense targets Y and runs gate/up/down for all k
experts with torch.bmm. Nothing is cached per routed row and hidden unit, so a full-width block at the paper's
calibration (33.5 M routed rows) is refined in one piece. Experts are independent problems: the loss is the sum
of per-expert normalised losses, Lion is elementwise, and the per-expert best epoch is chosen per expert, so
batching changes no expert's result.

Per optimizer step the relaxed, fake-quantized weights are built once; micro-batches over the token axis
accumulate their gradients (fp32) and one backward pass carries them to the logits A and latent values V.
Only the experts that still have rows at a micro-batch's offset take part in it, so load imbalance costs
little padding.

Activation quantizers use static per-expert global scales, as served: the input's from the amax of the
expert's calibration rows, the SwiGLU output's from the range seen in the previous step (validation: from
its own rows, in a first pass). Matmul operands are in the compute dtype (bf16 on CUDA, fp32 on the CPU),
training and validation alike; losses, gradients and parameters are fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moesq_core.compression.kernels import gather_quant_triton, relax_triton, rows_add_triton, swiglu_quant_triton
from moesq_core.compression.kernels.gather_quant_triton import gather_quant, zero_padding
from moesq_core.compression.kernels.swiglu_quant_triton import swiglu_quant
from moesq_core.compression.methods.base import (
    PROJECTIONS,
    BlockRows,
    CompressedExpert,
    ExpertData,
    TokenRows,
    all_finite,
    row_amax,
    row_count,
)
from moesq_core.compression.methods.refine import objective, relaxation
from moesq_core.formats import P48, Format, PatternSet
from moesq_core.memory import HOST_CHUNK_BYTES, consecutive_chunks, device_available_bytes, size

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_WARNED: set[str] = set()
_COMPILED: dict = {}  # (function, format, compute dtype, ...) -> its torch.compile'd form, shared by all refiners
# Compiled functions specialise the model's widths and keep only the expert and row counts symbolic: a symbolic
# width costs a runtime division per element in every broadcast over it. False (all sizes symbolic) is a variant
# of benchmarks/bench_refine.py (static-width vs compile-swiglu, benchmarks/results/refine_h200_2026-12-01_202e777.md).
STATIC_WIDTHS = True
# The micro-batch forward writes the loss's gradient with respect to the expert outputs while it reads them, and
# the backward starts from it, so the loss is one kernel per micro-batch. False (the loss's own backward reads the
# outputs again) is a variant of benchmarks/bench_refine.py (grad-fwd vs static-width, the same results file).
LOSS_GRAD_IN_FORWARD = True


def _with_dynamic_dims(fn, dims: tuple[tuple[int, ...], ...]):
    """fn(*args) with the dimensions dims[i] of tensor argument i marked dynamic for torch.compile (sizes of
    0 or 1 may still be specialised)."""
    def call(*args):
        for a, ds in zip(args, dims):
            if isinstance(a, torch.Tensor):
                for d in ds:
                    torch._dynamo.maybe_mark_dynamic(a, d)
        return fn(*args)
    return call


PAPER_STEPS = 1280  # the paper's budget per block: 10 epochs × 128 Lion steps (its learning rates are set for it)
RMS_CAP = 0.025  # RefineConfig.lr_budget_values_rms's default (see its docstring)
SHIP = ("best", "last")
E2E_LOSSES = ("kl", "fisher")  # RefineConfig.e2e_loss
E2E_OPTIMIZERS = ("adam", "lion")  # RefineConfig.e2e_optimizer (e2e.py make_optimizer, STATE_BYTES_PER_WEIGHT)
# e2e_steps="auto": passes over the calibration sequences, at most this many steps (2 passes of moesq run's 128
# sequences are 64 steps); on tiny 256 steps did better than 64 (benchmarks/results/accuracy_gpu512_reading.md).
E2E_AUTO_PASSES = 2
E2E_AUTO_MAX_STEPS = 256


@dataclass(frozen=True)
class RefineConfig:
    """Hyperparameters of refinement. Defaults are the paper's Qwen3-30B-A3B settings, except the learning-rate
    budget rule, per-expert best-epoch selection, fp32 logits, the one-shot split's rows and the end-to-end step
    (below); docs/accuracy.md gives the measurements behind each of them.

    Steps. Each optimizer step gives every expert an equal share (1/steps_per_epoch) of its own training rows.
    steps_per_epoch defaults to the paper's 128 whatever the calibration set's size; `batch_rows` (routed rows per
    step over the block; the paper's batch is 64 × 4,096 × top-8 = 2,097,152) derives the count from the data
    instead (at least min_steps_per_epoch). Either way the count is capped so the experts average at least
    `min_rows_per_step` rows per step. Micro-batches (`micro_batch_rows`, routed rows over the block) bound memory
    and change no result.

    Learning-rate budget rule (`lr_budget_steps` = N, default the paper's 1,280 steps per block). Lion moves every
    parameter by exactly lr per step, so a run's reach is its travel Σ_t lr_t. Each parameter group's base rate is
    multiplied by s = min(cap, N / T), T = the optimizer steps that group trains (the logits: only the joint phase
    under `values_first`), cap = `lr_budget_cap_logits` / `lr_budget_cap_values`; since the cosine factor's mean
    depends only on the fraction of the run, the travel — and the decay Σ_t lr_t·wd it carries — equals the paper's
    whenever s is below its cap. s = 1 at T = N: the paper's run is unchanged; budgets beyond it get proportionally
    smaller rates. `lr_budget_steps = None` uses lr_logits / lr_values as given. The logits' cap is lower because a
    pattern flip needs the gradient's sign to agree over many steps, and few large steps follow noisy signs.

    Values' step and the weights' scale (`lr_budget_values_rms` = ρ): a Lion step moves every value by lr whatever
    its size, so where the rule raises lr_values each expert projection's step is at most ρ × the RMS of its dense
    weights (never below lr_values, so the paper's budget and longer ones are unchanged); the decoupled weight decay
    keeps the rule's rate. A step is then the same fraction of any model's weights. `None`: no such cap.

    Can a pattern change at all? The exported pattern is argmax A. init_logits starts the init's pattern
    init_noise·init_match·(c_match − c_next) ahead of its nearest rivals (paired 4:8: 0.01·4·(2 − 0) = 0.08).
    Per step two logits can close that gap by at most 2·lr, while the weight decay shrinks it by (1 − lr·wd): the
    gap after the run is g_T with g_{t+1} = g_t·(1 − lr_t·wd) − 2·lr_t. If g_T > 0 no pattern can change (the run
    is values-only with extra cost); `schedule()` says so and the trainer logs a warning.

    `values_first = f` trains only the values for the first ⌊f·T⌋ steps (hard init mask, no Gumbel noise), then
    logits and values jointly; τ, the gain and the logits' cosine run over the joint phase only.

    Weight decay is lion-pytorch's (non-"decoupled") form, p ← p·(1 − lr·wd), i.e. the AdamW-style decoupled decay
    the paper means; lion-pytorch's `decoupled_weight_decay=True` would divide wd by the initial lr (with wd = 1.0
    that zeroes the parameters), so it is not used.

    Release-faithful options (the public release's behaviour next to moesq's): logits_dtype "bfloat16" (where
    Lion's small steps round away), ship "last" (the last epoch ships even when an earlier one, or the init,
    validated better), shared_gate_up_global False (gate and up train with their own global scales; export then
    re-quantizes both under one shared scale, as the release's serving merge does).

    Calibration rows (`init_split_rows`): True routes the training split's and the one-shot methods' split's
    sequences through the block loop together, so the in-loop init (its Hessians) and block-wise training see both;
    the validation split stays held out. False routes the training split alone.

    End-to-end tuning (e2e.py): after the last block, the patterns stay fixed and the values of every expert of
    every block are tuned together (Adam at `e2e_lr`, cosine to 0, batches of `e2e_batch_size` calibration
    sequences) to match the reference model's next-token distribution, KL on the final logits, over every
    calibration sequence but the validation ones. It validates before and after each pass and ships the best (the
    block-wise result unchanged when nothing validates better). It holds the whole model's expert latents and
    Adam moments at once (~24 bytes per expert weight with the weights its forward keeps). `e2e_steps`: a number
    of steps (0: none), or "auto": E2E_AUTO_PASSES passes over those sequences, at most E2E_AUTO_MAX_STEPS steps,
    when the step's memory fits what the device has available (`e2e_memory_gb` when given), else none, said
    before the block loop starts. `e2e_loss="fisher"` trains on the KL's second-order form on the final hidden
    states instead (validation stays the exact KL): no vocabulary-sized logits per step. `e2e_window`: where the
    whole model does not fit, windows of that many consecutive blocks are tuned one after the other, the other
    blocks frozen, against the same KL on the final logits ("auto": the whole model where it fits, else the largest
    window that fits; each window runs the step's passes). `e2e_optimizer`: "adam" (two fp32 moments per expert
    weight) or "lion" (one: ~4 bytes less per expert weight, so larger windows in the same memory); `e2e_lr` is the
    chosen optimizer's own rate.
    """

    # config files and --set: an unknown key is an error, and so is a nan or infinite number
    # (moesq_core.compression.config)
    __pydantic_config__ = {"extra": "forbid", "allow_inf_nan": False}

    epochs: int = 10  # passes over the training tokens per block
    steps_per_epoch: int | None = None  # None: from batch_rows when given, else the paper's 128
    batch_rows: int | None = None  # when set: steps_per_epoch = ceil(training rows of the block / batch_rows)
    min_steps_per_epoch: int = 16  # floor for steps derived from batch_rows (a 1-step epoch learns nothing)
    min_rows_per_step: int = 8  # steps per epoch are capped so each expert averages at least this many routed rows
    micro_batch_rows: int = 8 * 4096 * 8  # routed rows per forward/backward (bounds memory, changes no result)
    lr_logits: float = 2.5e-4  # Lion learning rate of the pattern logits A at the paper's budget
    # (scaled: lr_budget_steps)
    lr_values: float = 5e-5  # Lion learning rate of the latent weights V at the paper's budget (scaled likewise)
    lr_budget_steps: int | None = PAPER_STEPS  # the budget rule (above); None: lrs as given at any budget
    lr_budget_cap_logits: float = 10.0  # largest multiplier of lr_logits the rule applies (see below)
    lr_budget_cap_values: float = 100.0  # largest multiplier of lr_values the rule applies
    lr_budget_values_rms: float | None = RMS_CAP  # the rule never raises an expert's lr_values above this × its
    # weights' RMS
    values_first: float = 0.0  # fraction of the block's steps that train the values only, before joint training
    betas: tuple[float, float] = (0.9, 0.95)  # Lion's betas
    weight_decay: float = 1.0  # Lion's weight decay, p ← p·(1 − lr·wd)
    lr_final_ratio: float = 0.1  # cosine decay to this fraction of the base lr at the last step
    tau: tuple[float, float] = (2.0, 0.05)  # Gumbel-softmax temperature, linear per optimizer step
    gain: tuple[float, float] = (100.0, 500.0)  # multiplier of A before the noise, linear per step
    loss_power: int = 2  # token weight w^p: 2 is the paper's eq. 4 (‖diag(w)(Y − f)‖² = Σ w²‖·‖²), 0 uniform
    train_support: bool = True  # False: the init's mask stays (values-only ablation)
    train_values: bool = True  # False: V stays at the init's latent (support-only ablation)
    val_fraction: float = 0.05  # held out from each expert's rows when the engine gives no x_val
    min_val_rows: int = 16  # ... but at least this many (never more than half the expert's rows)
    init_noise: float = 0.01  # A = init_noise · (N(0,1) + init_match · c)
    init_match: float = 4.0  # weight of the init's pattern in A's init (see init_noise)
    seed: int = 0  # seed of the Gumbel noise and the init of A (each expert draws its own stream from it)
    compute_dtype: str = "auto"  # matmul operands in training: "float32", "bfloat16", auto = bf16 on CUDA
    logits_dtype: str = "float32"  # dtype of the logits A ("bfloat16": the release's, where small steps vanish)
    ship: str = "best"  # "best": per expert the best-validating epoch (the init included); "last": the last epoch
    validations: int | None = 10  # validations per block at most, evenly spaced over the epochs (the last always
    # one of them): each costs a pass over the held-out rows; None: after every epoch
    shared_gate_up_global: bool = True  # False: gate and up train with separate global scales (the release)
    compile: bool | str = "auto"  # torch.compile the weight quantizer and the micro-batch forward+loss, and use
    # the fused Triton relaxation and Lion kernels (where Triton is installed); auto = on CUDA
    keep_latent: bool = False  # return the refined V as CompressedExpert.latent
    chunk_gb: float | None = None  # memory for the state of one chunk of a block's experts (None: 85 % of the free
    # GPU memory less the block's tokens, rows and micro-batch; on the CPU memory.HOST_CHUNK_BYTES)
    init_split_rows: bool = True  # the block loop also routes the one-shot split's sequences (see above)
    e2e_steps: int | str = "auto"  # end-to-end tuning after the last block (0: none; "auto": see above); e2e.py
    e2e_lr: float = 1e-3  # its learning rate (cosine to 0), e2e_optimizer's
    e2e_batch_size: int = 4  # calibration sequences per end-to-end step
    e2e_memory_gb: float | None = None  # memory the end-to-end step may use (None: what the device has available)
    e2e_loss: str = "kl"  # its training loss: "kl" on the final logits, or "fisher", its second-order form (e2e.py)
    e2e_window: int | str = "auto"  # MoE blocks tuned together per window ("auto": the whole model where it fits,
    # else the largest window that fits); e2e.py
    e2e_optimizer: str = "adam"  # its optimizer: "adam", or "lion" (one moment instead of two); e2e.py

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1 (torch's seeds), got {self.seed!r}")
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        for name in ("micro_batch_rows", "steps_per_epoch", "min_steps_per_epoch", "min_rows_per_step",
                     "lr_budget_steps"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.batch_rows is not None and self.batch_rows < 1:
            raise ValueError(f"batch_rows must be a positive number of routed rows (or None), got {self.batch_rows}")
        if self.lr_logits <= 0 or self.lr_values <= 0:
            raise ValueError("learning rates must be positive")
        for name in ("lr_budget_cap_logits", "lr_budget_cap_values"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1 (1 = never raise the lr), got {getattr(self, name)}")
        if self.lr_budget_values_rms is not None and not self.lr_budget_values_rms > 0:
            raise ValueError(f"lr_budget_values_rms must be > 0 (a fraction of each expert's weight RMS) or None (no "
                             f"such cap), got {self.lr_budget_values_rms}")
        if not 0 <= self.values_first < 1:
            raise ValueError(f"values_first must be in [0, 1) (a fraction of the block's steps), "
                             f"got {self.values_first}")
        if self.values_first > 0 and not (self.train_support and self.train_values):
            raise ValueError("values_first needs both train_support and train_values")
        if not 0 < self.lr_final_ratio <= 1:
            raise ValueError(f"lr_final_ratio must be in (0, 1], got {self.lr_final_ratio}")
        if min(self.tau) <= 0:
            raise ValueError(f"temperatures must be positive, got {self.tau}")
        objective.check_power(self.loss_power)
        if self.steps_per_epoch is not None and self.batch_rows is not None:
            raise ValueError("steps_per_epoch and batch_rows exclude each other: give one")
        if not (self.train_support or self.train_values):
            raise ValueError("train_support and train_values are both off: nothing to refine")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        for name in ("compute_dtype", "logits_dtype"):
            v = getattr(self, name)
            if v not in _DTYPES and not (name == "compute_dtype" and v == "auto"):
                raise ValueError(f"{name} must be one of {sorted(_DTYPES)}"
                                 f"{' or auto' if name == 'compute_dtype' else ''}, got {v!r}")
        if self.compile not in (True, False, "auto"):
            raise ValueError(f"compile must be true, false or auto (on CUDA only), got {self.compile!r}")
        if not (self.e2e_steps == "auto"
                or (isinstance(self.e2e_steps, int) and not isinstance(self.e2e_steps, bool) and self.e2e_steps >= 0)):
            raise ValueError(f"e2e_steps must be a number of steps >= 0 or 'auto', got {self.e2e_steps!r}")
        if self.e2e_batch_size < 1:
            raise ValueError(f"e2e_batch_size must be >= 1, got {self.e2e_batch_size}")
        if self.e2e_memory_gb is not None and not self.e2e_memory_gb > 0:
            raise ValueError(f"e2e_memory_gb must be > 0 GiB (or None: what the device has), got {self.e2e_memory_gb}")
        if not self.e2e_lr > 0:
            raise ValueError(f"e2e_lr must be positive, got {self.e2e_lr}")
        if not (self.e2e_window == "auto" or (isinstance(self.e2e_window, int) and not isinstance(self.e2e_window, bool)
                                               and self.e2e_window >= 1)):
            raise ValueError(f"e2e_window must be a number of blocks >= 1 or 'auto', got {self.e2e_window!r}")
        if self.e2e_loss not in E2E_LOSSES:
            raise ValueError(f"e2e_loss must be one of {', '.join(E2E_LOSSES)}, got {self.e2e_loss!r}")
        if self.e2e_optimizer not in E2E_OPTIMIZERS:
            raise ValueError(f"e2e_optimizer must be one of {', '.join(E2E_OPTIMIZERS)}, got {self.e2e_optimizer!r}")
        if self.validations is not None and (isinstance(self.validations, bool) or self.validations < 1):
            raise ValueError(f"validations must be >= 1 (or None: after every epoch), got {self.validations!r}")
        if self.ship not in SHIP:
            raise ValueError(f"ship must be one of {SHIP}, got {self.ship!r}")
        if self.chunk_gb is not None and not self.chunk_gb > 0:
            raise ValueError(f"chunk_gb must be > 0 GiB (or None: from the free GPU memory), got {self.chunk_gb}")

    def compute_dtype_on(self, device: torch.device | str) -> torch.dtype:
        """The matmul operands' dtype on `device` ("auto": bf16 on CUDA, else fp32)."""
        if self.compute_dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return _DTYPES[self.compute_dtype]

    def e2e_steps_for(self, sequences: int) -> int:
        """The end-to-end step's length over `sequences` calibration sequences, before any memory check:
        e2e_steps when a number, else E2E_AUTO_PASSES passes of e2e_batch_size sequences, at most E2E_AUTO_MAX_STEPS."""
        if self.e2e_steps != "auto":
            return int(self.e2e_steps)
        return min(E2E_AUTO_MAX_STEPS, E2E_AUTO_PASSES * math.ceil(max(sequences, 0) / self.e2e_batch_size))

    def lr_scale(self, steps: int, cap: float) -> float:
        """The budget rule's multiplier for a group that trains `steps` optimizer steps."""
        if self.lr_budget_steps is None or steps <= 0:
            return 1.0
        return min(cap, self.lr_budget_steps / steps)

    def values_rate(self, plan: "RefineSchedule", rms: torch.Tensor) -> torch.Tensor:
        """Each expert projection's multiplier of the values' scheduled rate plan.lr_values (the budget rule's),
        from the RMS of its dense weights `rms` (any shape): the rule may raise lr_values up to
        lr_budget_values_rms × rms, never above plan.lr_values and never below the configured lr_values."""
        if self.lr_budget_values_rms is None or plan.lr_values <= self.lr_values:
            return torch.ones_like(rms)
        cap = torch.clamp(rms * self.lr_budget_values_rms, min=self.lr_values)
        return torch.clamp(cap / plan.lr_values, max=1.0)

    def schedule(self, train_rows: int, experts_with_rows: int, patterns: PatternSet | None = None) -> "RefineSchedule":
        """The optimizer schedule of one block holding `train_rows` routed training rows spread over
        `experts_with_rows` experts: steps per epoch from steps_per_epoch, or from batch_rows (at least
        min_steps_per_epoch), or the paper's 128; never so many that an expert averages fewer than
        min_rows_per_step rows per step (a step of ~0 rows would be Lion momentum alone). Then the learning
        rates of the budget rule and whether any pattern can change (`patterns`: the format's pattern set,
        default paired 4:8)."""
        if self.steps_per_epoch is not None:
            S = self.steps_per_epoch
        elif self.batch_rows is not None:
            S = max(self.min_steps_per_epoch, math.ceil(train_rows / self.batch_rows))
        else:
            S = 128
        if experts_with_rows > 0:
            S = min(S, (train_rows // experts_with_rows) // self.min_rows_per_step)
        S = max(1, S)
        T = self.epochs * S
        T1 = values_first_steps(self.values_first, T)
        ps = P48 if patterns is None else patterns
        learn = self.train_support and ps.num_patterns > 1
        s_a = self.lr_scale(T - T1, self.lr_budget_cap_logits) if learn else 1.0
        s_v = self.lr_scale(T, self.lr_budget_cap_values) if self.train_values else 1.0
        gap = closure = None
        if learn:
            gap = relaxation.init_gap(ps, self.init_noise, self.init_match)
            lrs = [self.lr_logits * s_a * _cosine_factor(self.lr_final_ratio, _frac(t, T - T1)) for t in range(T - T1)]
            closure = gap - remaining_gap(gap, lrs, self.weight_decay)
        return RefineSchedule(epochs=self.epochs, steps_per_epoch=S, rows_per_step=math.ceil(train_rows / S),
                              lr_logits=self.lr_logits * s_a, lr_values=self.lr_values * s_v,
                              lr_scale_logits=s_a, lr_scale_values=s_v, values_first_steps=T1 if learn else 0,
                              lr_values_rms=self.lr_budget_values_rms if s_v > 1 else None,
                              learns_support=learn, init_gap=gap, logit_closure=closure)


def validated_epochs(epochs: int, validations: int | None) -> set[int]:
    """The epochs after which refinement validates (and may keep the weights as the best so far): every epoch, or
    `validations` of them evenly spaced, the last always among them."""
    if validations is None or epochs <= validations:
        return set(range(1, epochs + 1))
    return {round(epochs * k / validations) for k in range(1, validations + 1)}


def values_first_steps(fraction: float, total: int) -> int:
    """Steps of the values-only phase: ⌊fraction·total⌋, leaving the joint phase at least one step."""
    if fraction <= 0 or total <= 1:
        return 0
    return min(int(fraction * total), total - 1)


def remaining_gap(gap: float, lrs, weight_decay: float) -> float:
    """The smallest gap between two logits after Lion steps at rates `lrs` that push them together as hard
    as they can: each moves by lr towards the other (closing 2·lr) after the weight decay shrank both by
    (1 − lr·wd). ≤ 0 means the order can flip."""
    g = gap
    for lr in lrs:
        g = g * (1.0 - lr * weight_decay) - 2.0 * lr
        if g <= 0:
            return g
    return g


REFINE_GPU_FRACTION = 0.85  # of the free device memory: the estimates below already are the peak
ROW_BYTES = 48  # per routed row: its token index, router weight, epoch order and step indices (int64/fp32)


def micro_batch_bytes(H: int, inter: int, rows: int, compute_bytes: int = 4) -> int:
    """Peak activations of one micro-batch of `rows` routed rows in a compute dtype of `compute_bytes`: the
    gathered tokens, quantized inputs, dense targets, expert outputs, residual and gradient (~6 values per row and
    hidden unit), the gate/up outputs, SwiGLU output and what autograd keeps of them (~8 per row and
    intermediate unit)."""
    return rows * compute_bytes * (6 * H + 8 * inter)


def refine_bytes_per_expert(fmt: Format, inter: int, H: int) -> int:
    """Estimated peak bytes of one expert's state in the batched trainer: per weight the fp32 latent, its
    gradient, Lion state and best copy, the copy of the values taken before each step where the budget rule's
    weight-scale cap rescales it (lr_budget_values_rms), the dense weights the targets are computed from, the
    logits (patterns per group, with gradient and Lion state), masks and the relaxed/quantized transients
    (~38 B + 12 B per logit)."""
    ps = fmt.patterns
    logits_per_weight = ps.num_patterns / ps.group if ps.num_patterns > 1 else 0.0
    return int(3 * inter * H * (38 + 12 * logits_per_weight))


def refine_shared_bytes(H: int, inter: int, tokens: int, token_bytes: int, routed_rows: int,
                        micro_batch_rows: int, compute_bytes: int = 4) -> int:
    """Estimated peak bytes a block's refinement holds whatever its experts: the token matrix (`tokens` rows of
    H values of `token_bytes`), ROW_BYTES per routed row (`routed_rows`: training and validation) and one
    micro-batch's activations (never more rows than the block has) in a compute dtype of `compute_bytes`."""
    return (tokens * H * token_bytes + routed_rows * ROW_BYTES
            + micro_batch_bytes(H, inter, min(micro_batch_rows, routed_rows), compute_bytes))


class RefineMemoryError(ValueError):
    """A block's refinement cannot fit the device: raised before the block loop starts."""


def refine_memory_plan(fmt: Format, cfg: "RefineConfig", *, experts: int, H: int, inter: int, tokens: int,
                       token_bytes: int, routed_rows: int, available: int | None, device: str, sequences: int) -> str:
    """One line saying what refining a block holds on `device` and whether all of its `experts` fit at once,
    from the calibration (`tokens` held once per block, `sequences` of them trained on or validated,
    `routed_rows` = their tokens × top-k) before any work. `available`: the device's free bytes (None: unknown,
    nothing is checked). Raises RefineMemoryError, naming the bytes needed and the options that lower them, when
    not even one expert fits beside the block's shared part (`refine_shared_bytes`); with fewer than all experts
    fitting, refinement goes in chunks (slower, the same bytes) and the line says so."""
    cb = cfg.compute_dtype_on(device).itemsize
    shared = refine_shared_bytes(H, inter, tokens, token_bytes, routed_rows, cfg.micro_batch_rows, cb)
    micro = micro_batch_bytes(H, inter, min(cfg.micro_batch_rows, routed_rows), cb)
    per = refine_bytes_per_expert(fmt, inter, H)
    whole = shared + experts * per
    parts = (f"{size(tokens * H * token_bytes)} of calibration tokens ({tokens:,} × {H} × {token_bytes} B), "
             f"{size(micro)} of micro-batch activations "
             f"(--micro-batch-rows {cfg.micro_batch_rows:,}), "
             f"{size(routed_rows * ROW_BYTES)} for {routed_rows:,} routed rows, "
             f"{size(experts * per)} of expert state")
    if available is None:
        if cfg.chunk_gb is None and device == "cpu" and experts * per > HOST_CHUNK_BYTES:
            chunks = math.ceil(experts / max(1, HOST_CHUNK_BYTES // per))
            return (f"~{size(shared + min(experts, max(1, HOST_CHUNK_BYTES // per)) * per)} per block on cpu "
                    f"({parts}), "
                    f"refined in {chunks} chunks of experts to bound host memory")
        return f"~{size(whole)} per block on {device} ({parts}); the device's free memory is unknown"
    budget = available * REFINE_GPU_FRACTION
    if shared + per > budget:
        fit = max(0, int((budget - per - micro)
                         / (tokens * H * token_bytes + routed_rows * ROW_BYTES) * sequences)) if tokens else 0
        raise RefineMemoryError(
            f"refine: a block at this calibration needs ~{size(shared + per)} on {device} for one expert beside what "
            f"every block holds ({parts}), and {size(budget)} of the {size(available)} available may be used: lower "
            f"--n-train/--n-init/--n-val ({fit} of the {sequences} sequences would fit) or --seq-len, "
            f"or --micro-batch-rows")
    if cfg.chunk_gb is None and whole > budget:
        chunks = math.ceil(experts * per / max(budget - shared, per))
        return (f"~{size(whole)} per block on {device} ({parts}); {size(budget)} may be used, so each block is refined "
                f"in ~{chunks} chunks of experts (each runs every step: slower; fewer calibration tokens fit in one)")
    return f"~{size(whole)} per block on {device} of {size(available)} available ({parts}): one chunk"


def refine_chunks(experts: list[ExpertData], fmt: Format, cfg: "RefineConfig") -> list[list[ExpertData]]:
    """The block's experts cut into consecutive chunks whose state fits cfg.chunk_gb (default: 85 % of the
    free CUDA memory less what the block holds whatever its experts, `refine_shared_bytes`; on the CPU
    memory.HOST_CHUNK_BYTES, which bounds the host memory per process). Refining chunk by chunk gives the same
    bytes as all at once: every expert draws from its own generator and batches are sized from the whole block's
    row counts (ExpertData.block), exactly as for expert parallel."""
    if not experts:
        return []
    dev = experts[0].gate.device
    inter, H = experts[0].gate.shape
    if cfg.chunk_gb is not None:
        budget = cfg.chunk_gb * (1 << 30)
    elif dev.type == "cuda":
        rows = sum(ex.n_rows + row_count(ex.x_val) for ex in experts)
        sources = [x for ex in experts for x in (ex.x, ex.x_val) if x is not None]
        matrices = {id(x.tokens): x.tokens for x in sources if isinstance(x, TokenRows)}
        # a token matrix already on the device is in use, not free; one elsewhere, and rows given as tensors
        # of their own, are copied in (block_token_matrix)
        copied = sum(t.numel() * t.element_size() for t in matrices.values() if t.device != dev)
        copied += sum(row_count(x) for x in sources if not isinstance(x, TokenRows)) * H * 4
        shared = refine_shared_bytes(H, inter, 0, 0, rows, cfg.micro_batch_rows, cfg.compute_dtype_on(dev).itemsize)
        shared += copied
        budget = device_available_bytes(dev) * REFINE_GPU_FRACTION - shared
    else:
        budget = HOST_CHUNK_BYTES
    need = [refine_bytes_per_expert(fmt, inter, H)] * len(experts)
    if sum(need) <= budget:
        return [experts]
    return consecutive_chunks(with_block_rows(experts), need, max(budget, 0))


def with_block_rows(experts: list[ExpertData]) -> list[ExpertData]:
    """The experts with ExpertData.block set: without the block's row counts a chunk of them would size its batches
    from itself, so experts given without one get the block they form (by expert index), which is what
    BlockRefiner assumes when none is given; refining them in any chunks then gives the same bytes."""
    if not experts or experts[0].block is not None:
        return experts
    idx = sorted(ex.index for ex in experts)
    if idx != list(range(len(experts))):
        raise ValueError("refining a block in chunks needs ExpertData.block (or expert indices 0..E-1)")
    rows = {ex.index: ex.n_rows for ex in experts}
    has_val = experts[0].x_val is not None
    val = {ex.index: row_count(ex.x_val) for ex in experts}
    blk = BlockRows(0, tuple(rows[i] for i in idx), tuple(val[i] for i in idx) if has_val else None)
    return [dataclasses.replace(ex, block=blk) for ex in experts]


def expert_seed(seed: int, layer: int, expert: int, stream: str = "") -> int:
    """The seed of one expert's random numbers: a hash of (seed, layer, expert index, stream), the same
    whichever process refines the expert."""
    digest = hashlib.sha256(f"moesq-refine:{seed}:{layer}:{expert}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class RefineSchedule:
    """What one block's refinement will do (printed before training)."""

    epochs: int
    steps_per_epoch: int
    rows_per_step: int  # routed rows per optimizer step over the whole block
    lr_logits: float  # base rates after the budget rule (the cosine decays them to lr_final_ratio×)
    lr_values: float
    lr_scale_logits: float = 1.0  # the budget rule's multipliers (1.0: the rates as configured)
    lr_scale_values: float = 1.0
    lr_values_rms: float | None = None  # when set: each expert projection's lr(V) is at most this × its weights' RMS
    values_first_steps: int = 0  # steps training the values only, before the joint phase
    learns_support: bool = True  # False: the support stays the init's (values only, or a dense format)
    init_gap: float | None = None  # the init pattern's logit lead over its nearest rivals
    logit_closure: float | None = None  # how much of it the logits' schedule can close at most

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def can_change_patterns(self) -> bool:
        """False when the logits cannot close the init pattern's nominal lead: then only the rare groups whose
        init noise (std init_noise per logit) narrowed their lead can change pattern."""
        return self.learns_support and self.init_gap is not None and self.logit_closure is not None \
            and self.logit_closure >= self.init_gap

    @property
    def warning(self) -> str | None:
        if not self.learns_support or self.can_change_patterns or self.total_steps == 0:
            return None
        return (f"refinement cannot change the sparsity patterns: in {self.total_steps - self.values_first_steps} "
                f"steps at lr(A) {self.lr_logits:.3g} the logits close at most {self.logit_closure:.3g} of the init "
                f"pattern's lead of {self.init_gap:.3g} (only the rare groups whose init noise narrowed it can flip), "
                f"so this trains the values only; give more steps or a larger lr_logits (or lr_budget_cap_logits)")

    def __str__(self) -> str:
        rates = f"lr(A) {self.lr_logits:.3g}, lr(V) {self.lr_values:.3g}"
        if self.lr_scale_logits != 1.0 or self.lr_scale_values != 1.0:
            rates += f" (budget rule: ×{self.lr_scale_logits:.3g} / ×{self.lr_scale_values:.3g}"
            rates += f", lr(V) ≤ {self.lr_values_rms:.3g} × each expert's weight RMS)" if self.lr_values_rms else ")"
        s = (f"{self.epochs} epochs × {self.steps_per_epoch} steps = {self.total_steps} Lion steps per block, "
             f"~{self.rows_per_step:,} routed rows per step; {rates}")
        if self.values_first_steps:
            s += f"; values only for the first {self.values_first_steps} steps"
        if self.learns_support:
            s += "; patterns can change" if self.can_change_patterns else "; patterns CANNOT change"
        return s

# ---------------------------------------------------------------------------------------------------------
# Format-generic helpers, batched over experts (leading axis): the format's quantizers take the expert axis.


def batched_weight_global(fmt: Format, *ws: torch.Tensor) -> torch.Tensor:
    """Per-expert weight global scale [E, 1, 1] shared by the given [E, O, K] tensors (detached)."""
    return fmt.weight.global_scales(*ws).reshape(-1, 1, 1)


def act_global(fmt: Format, amax: torch.Tensor) -> torch.Tensor | None:
    """Static activation global scale per expert [E, 1, 1] from an amax [E] (None: the format has none)."""
    g = fmt.act.global_from_amax(amax)
    return None if g is None else g.reshape(-1, 1, 1)


def batched_act_quant(fmt: Format, x: torch.Tensor, ste: bool, g: torch.Tensor | None = None) -> torch.Tensor:
    """The format's activation quantizer, batched over experts: x [E, C, D], g [E, 1, 1] per-expert global
    scales (default: each expert's own amax, i.e. dynamic; ignored where the format has none)."""
    return fmt.act.batched(x, g, ste=ste)


def _linear_schedule(a: float, b: float, frac: float) -> float:
    return a + (b - a) * frac


def _frac(t: int, n: int) -> float:
    """Position of step t in a phase of n steps, 0 at its first step and 1 at its last."""
    return min(max(t / (n - 1), 0.0), 1.0) if n > 1 else 0.0


def _cosine_factor(final: float, frac: float) -> float:
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * frac))


class Active(NamedTuple):
    """The experts of a micro-batch that is not all of them: their positions in the refiner's expert order (on
    the device) and, when they are the first `first` experts, that count (selecting them is a slice)."""

    idx: torch.Tensor
    first: int | None


class StepSchedule(NamedTuple):
    tau: float  # Gumbel-softmax temperature
    gain: float  # multiplier of A before the noise
    lr_logits: float  # cosine factors of the base learning rates
    lr_values: float
    joint: bool  # False in the values-only phase (values_first)


def block_token_matrix(experts: list[ExpertData], device: torch.device
                       ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """The token matrix [T, H] the experts' rows index, on `device`, and per expert (training row tokens [n],
    validation row tokens [n_val] or None), int64 on `device`. Experts whose rows (ExpertData.x, x_val) are
    `TokenRows` of one shared matrix use it as it is (moved to `device` once if it lives elsewhere); rows given
    as tensors of their own are stacked into a new matrix, one token per row."""
    parts: list[torch.Tensor] = []  # the matrices, each once
    where: dict[int, int] = {}  # id(matrix) -> its first row in the concatenation
    start = 0

    def place(x) -> torch.Tensor:
        nonlocal start
        m = x.tokens if isinstance(x, TokenRows) else x.reshape(-1, experts[0].gate.shape[1])
        if id(m) not in where:
            where[id(m)] = start
            parts.append(m)
            start += m.shape[0]
        base = where[id(m)]
        idx = x.idx.to(device) if isinstance(x, TokenRows) else torch.arange(m.shape[0], device=device)
        return idx + base if base else idx

    sources = [(place(ex.x), None if ex.x_val is None else place(ex.x_val)) for ex in experts]
    if len(parts) == 1:
        tokens = parts[0].to(device)
    else:
        dtype = parts[0].dtype if all(p.dtype == parts[0].dtype for p in parts) else torch.float32
        tokens = torch.cat([p.to(device, dtype) for p in parts])
    return tokens, sources


def rows_and_targets(fmt: Format, cd: torch.dtype, tokens: torch.Tensor, tok: torch.Tensor, valid: torch.Tensor,
                     g_in: torch.Tensor | None, Dg: torch.Tensor, Du: torch.Tensor, Dd: torch.Tensor,
                     fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, y) of a batch of routed rows tok [k, c] (indices into the token matrix tokens [T, H]; `valid` [k, c]
    false on padding, whose rows become exact zeros): the input-quantized rows under the experts' static global
    scales g_in [k, 1, 1] (as served) and the dense experts' outputs (Dg, Du, Dd: [k, out, in] in the compute
    dtype), both in the compute dtype cd. The quantized values are exact there; the targets are the matmuls' own
    output. fused: the gather and the input quantizer in one kernel where it runs (gather_quant_triton)."""
    x, xq = gather_quant(fmt.act, tokens, tok, valid, g_in, cd, with_x=True, fused=fused)
    h = BlockRefiner.intermediate(x, Dg, Du, cd)
    return xq, torch.bmm(h.to(cd), Dd.transpose(1, 2).to(cd))


def quantized_rows(fmt: Format, cd: torch.dtype, tokens: torch.Tensor, tok: torch.Tensor, valid: torch.Tensor,
                   g_in: torch.Tensor | None, fused: bool = False) -> torch.Tensor:
    """The input-quantized rows of `rows_and_targets` alone."""
    return gather_quant(fmt.act, tokens, tok, valid, g_in, cd, with_x=False, fused=fused)[1]


@dataclass
class _Proj:
    name: str
    V: torch.Tensor  # fp32 [E, O, K] latent values (leaf)
    A: torch.Tensor | None  # fp32 [E, O, K/group, P] logits (leaf), None when the support is fixed
    fixed_mask: torch.Tensor | None  # bool [E, O, K] when the support is fixed (None for dense formats)
    best_V: torch.Tensor | None = None
    best_mask: torch.Tensor | None = None
    init_mask: torch.Tensor | None = None  # bool [E, O, K]: the init's support (to count changed groups)


class BlockRefiner:
    """Refines all experts of one block together. `run()` = validate the init, train + validate per epoch,
    export the best epoch per expert. The pieces are public so benchmarks can time single steps."""

    def __init__(self, experts: list[ExpertData], inits: list[CompressedExpert], fmt: Format, config: RefineConfig):
        if len(inits) != len(experts):
            raise ValueError(f"init returned {len(inits)} experts for a block of {len(experts)}")
        if not experts:
            raise ValueError("empty block")
        self.fmt, self.cfg = fmt, config
        self.ps = fmt.patterns
        self.experts, self.inits = experts, inits
        self.E = len(experts)
        self.device = dev = experts[0].gate.device
        inter, H = experts[0].gate.shape
        self.H, self.I = H, inter
        for ex in experts:
            for p, shape in (("gate", (inter, H)), ("up", (inter, H)), ("down", (H, inter))):
                t = getattr(ex, p)
                if tuple(t.shape) != shape:
                    raise ValueError(f"expert {ex.index}: {p} has shape {tuple(t.shape)}, expected {shape} "
                                     f"like the block's first expert")
                if t.device != dev:
                    raise ValueError(f"expert {ex.index}: {p} is on {t.device}, the block's first expert on {dev}")
                fmt.check_weight(t, f"expert {ex.index} {p}")
        for ex, ce in zip(experts, inits):
            for p, qw in ce.weights().items():
                if qw.format != fmt.name:
                    raise ValueError(f"init for expert {ex.index} {p} is in format {qw.format!r}, "
                                     f"refining {fmt.name!r}")
        self.cd = config.compute_dtype_on(dev)
        # auto: compiled on CUDA, where compiling takes a third off the step
        # (benchmarks/results/refine_h200_2026-12-01_75a3a44.md, eager vs compile); eager on the CPU, the
        # reference path, where compiling costs more than it saves
        self.compiled = dev.type == "cuda" if config.compile == "auto" else bool(config.compile)
        self.fused_relax = self.compiled and relax_triton.available(dev)
        # the SwiGLU output and its quantizer in one Triton pass where the activation quantizer has one
        self.fused_swiglu = self.compiled and swiglu_quant_triton.USE and swiglu_quant_triton.available(dev)
        self.fused_gather = self.compiled and gather_quant_triton.USE and gather_quant_triton.available(dev)
        self.learn_support = config.train_support and self.ps.num_patterns > 1
        if not (self.learn_support or config.train_values):
            raise ValueError(f"format {fmt.name} has no sparsity pattern to learn and train_values is False: "
                             f"nothing to refine")
        # Shard invariance (expert parallel gives each process some of a block's experts): every random draw
        # of an expert (split, A init, shuffles, Gumbel noise) comes from its own generator, seeded by (seed,
        # layer, expert index), and batches are sized from the whole block's row counts, so an expert's
        # result does not depend on which other experts are refined with it.
        self._block_layout()
        self.gens = [torch.Generator(device=dev).manual_seed(expert_seed(config.seed, self.layer, ex.index))
                     for ex in experts]
        self.all_experts = torch.arange(self.E, device=dev)
        self.mc = max(1, -(-config.micro_batch_rows // len(self.blk_ntr)))  # rows per expert per micro-batch
        self.timings: dict[str, float] = {}  # setup phases, seconds (synchronised; setup only)
        self._t = time.perf_counter()
        self._setup_data()
        self._setup_params()
        self.step_count = 0
        self.rows_done = 0  # routed training rows the steps so far have trained on
        self.validated = validated_epochs(config.epochs, config.validations)  # the epochs `run` validates after

    # --- setup -------------------------------------------------------------------------------------------

    def _tick(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.timings[name] = now - self._t
        self._t = now

    def _n_val(self, n: int) -> int:
        if n < 2 or self.cfg.val_fraction <= 0:
            return 0
        return min(max(round(self.cfg.val_fraction * n), self.cfg.min_val_rows), n // 2)

    def _split_counts(self, rows: int, val_rows: int | None) -> tuple[int, int]:
        """(train, validation) rows of an expert with `rows` routed rows and `val_rows` given held-out ones
        (None: held out from its own rows)."""
        if val_rows is not None:
            return rows, val_rows
        nv = self._n_val(rows)
        return rows - nv, nv

    def _block_layout(self):
        """The whole block's train / validation row counts (blk_ntr, blk_nva: [experts of the block]), the
        block position of each expert refined here (pos) and the layer index, from ExpertData.block; without
        it the experts handed over are the block."""
        blk = self.experts[0].block
        n = lambda x: len(x) if isinstance(x, TokenRows) else x.numel() // self.H  # noqa: E731
        mine = [self._split_counts(n(ex.x), None if ex.x_val is None else n(ex.x_val)) for ex in self.experts]
        if blk is None:
            self.layer, self.pos, counts = 0, list(range(self.E)), mine
        else:
            if any(ex.block != blk for ex in self.experts):
                raise ValueError("the experts handed over belong to different blocks (ExpertData.block)")
            self.layer, self.pos = blk.layer_index, [ex.index for ex in self.experts]
            val = blk.val_rows or (None,) * len(blk.rows)
            counts = [self._split_counts(n, v) for n, v in zip(blk.rows, val)]
            for ex, p, c in zip(self.experts, self.pos, mine):
                if not 0 <= p < len(counts) or counts[p] != c:
                    raise ValueError(f"expert {ex.index}: its rows do not match ExpertData.block's counts")
        self.blk_ntr = torch.tensor([c[0] for c in counts], dtype=torch.int64)
        self.blk_nva = torch.tensor([c[1] for c in counts], dtype=torch.int64)

    def _setup_data(self):
        cfg, dev = self.cfg, self.device
        self.tokens, sources = block_token_matrix(self.experts, dev)
        if not all_finite(self.tokens):
            raise ValueError("calibration inputs contain NaN/Inf")
        token_amax = row_amax(self.tokens)  # [T] fp32: each token's largest |x|
        rows, ws, ntr, nva, amax_in, amax_all = [], [], [], [], [], []
        for ex, (idx, idx_val) in zip(self.experts, sources):
            w = ex.w.to(dev, torch.float32).reshape(-1)
            if w.numel() != idx.numel():
                raise ValueError(f"expert {ex.index}: {idx.numel()} routed rows but {w.numel()} router weights")
            zero = torch.zeros((), device=dev)
            amax_in.append(token_amax[idx].amax() if idx.numel() else zero)
            if idx_val is not None:
                wv = (ex.w_val if ex.w_val is not None
                      else torch.ones(idx_val.numel())).to(dev, torch.float32).reshape(-1)
                if wv.numel() != idx_val.numel():
                    raise ValueError(f"expert {ex.index}: {idx_val.numel()} validation rows but "
                                     f"{wv.numel()} router weights")
                it, wt, iv = idx, w, idx_val
            else:
                nv = self._n_val(idx.numel())
                # CPU: the split does not depend on the device
                split_gen = torch.Generator().manual_seed(expert_seed(cfg.seed, self.layer, ex.index, "split"))
                perm = torch.randperm(idx.numel(), generator=split_gen).to(dev)
                iv, wv, it, wt = idx[perm[:nv]], w[perm[:nv]], idx[perm[nv:]], w[perm[nv:]]
            amax_all.append(torch.cat([token_amax[it], token_amax[iv], zero[None]]).amax())
            rows += [it, iv]
            ws += [wt, wv]
            ntr.append(it.numel())
            nva.append(iv.numel())
        # Each routed row (expert by expert: training rows, then validation rows) is the index of its token;
        # the last row is the padding "sentinel": token 0, zeroed wherever rows are read (its weight is 0).
        self.row_token = torch.cat(rows + [torch.zeros(1, dtype=torch.int64, device=dev)])
        self.W = torch.cat(ws + [torch.zeros(1, device=dev)])
        self.sentinel = self.row_token.numel() - 1
        del rows, ws
        self._tick("gather_rows")
        # Static input range per expert: amax of its calibration rows x (as the engine calibrates the served
        # input_global_scale); validation rows from the engine (x_val) are not part of it, except for an expert
        # whose only rows they are.
        self.amax_in = torch.stack(amax_in)
        amax = torch.where(self.amax_in > 0, self.amax_in, torch.stack(amax_all))
        self.g_in = act_global(self.fmt, amax)  # [E, 1, 1] or None (the format's activations have no global scale)
        self.n_train = torch.tensor(ntr, dtype=torch.int64)
        self.n_val = torch.tensor(nva, dtype=torch.int64)
        n_all = self.n_train + self.n_val
        off = torch.cumsum(n_all, 0) - n_all
        self.offsets = off
        # Flat row index of each expert's train / validation / all rows, sentinel-padded: [E, max count].
        self.train_base = off.to(dev)
        blk_all = self.blk_ntr + self.blk_nva
        self.val_idx = self._ranges(off + self.n_train, self.n_val, int(self.blk_nva.max()))
        all_idx = self._ranges(off, n_all, int(blk_all.max()))
        # The dense experts in the compute dtype: the targets Y are computed per micro-batch from the rows'
        # tokens (caching them would take 2-4 bytes per routed row and hidden unit: 137 GB for a Qwen3-30B-A3B
        # block at the paper's calibration).
        self.dense = {p: torch.stack([getattr(ex, p).to(dev, torch.float32) for ex in self.experts]).to(self.cd)
                      for p in PROJECTIONS}
        self.h_amax = self._dense_h_amax(all_idx)  # the SwiGLU-output range the first step's quantizer uses
        self._tick("dense_targets")
        ntr_t = self.blk_ntr[self.blk_ntr > 0]  # the block's, whichever of its experts are refined here
        self.plan = self.cfg.schedule(int(ntr_t.sum()), int(ntr_t.numel()), self.ps)
        if self.plan.warning and self.plan.warning not in _WARNED:
            _WARNED.add(self.plan.warning)  # once per process, not once per block
            log.info(self.plan.warning)  # the schedule printed before training says it too (patterns CANNOT change)
        self.steps_per_epoch = S = self.plan.steps_per_epoch
        s = torch.arange(S + 1, dtype=torch.int64)[:, None]
        bounds = (s * self.blk_ntr[None, :]) // S  # [S+1, block] each expert's rows split into S near-equal chunks
        self.blk_step_cnt = bounds[1:] - bounds[:-1]
        self.step_start, self.step_cnt = bounds[:-1, self.pos], self.blk_step_cnt[:, self.pos]
        self.total_steps = S * self.cfg.epochs
        self.values_steps = self.plan.values_first_steps  # values-only phase before the joint one

    def _ranges(self, start: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
        C = max(width, 1)
        j = torch.arange(C, device=self.device)[None, :]
        idx = start.to(self.device)[:, None] + j
        return torch.where(j < count.to(self.device)[:, None], idx, torch.full_like(idx, self.sentinel))

    def _plan(self, block_counts: torch.Tensor, width: int) -> list[tuple[torch.Tensor | None, int, int]]:
        """Token-axis micro-batches over column offsets of a [E, width] index matrix: (act, start, stop),
        act = the experts refined here (CPU indices; None = all) with rows at `start`. When few experts
        remain, each takes more columns, so a micro-batch holds about micro_batch_rows rows however unequal
        the loads. Offsets come from the whole block's counts [block experts] (shard invariance)."""
        plan, off = [], 0
        mine = block_counts[self.pos]
        while off < width:
            k = int((block_counts > off).sum())
            if k == 0:
                break
            c = max(self.mc, self.cfg.micro_batch_rows // k)
            act = (mine > off).nonzero().reshape(-1)
            if act.numel():
                plan.append((None if act.numel() == self.E else act, off, off + c))
            off += c
        return plan

    def _to_device(self, *host: torch.Tensor) -> list[torch.Tensor]:
        """Small CPU int64 tensors -> device in one asynchronous copy (a pageable copy would make the host
        wait for the GPU queue to drain at every micro-batch)."""
        if not host:
            return []
        flat = torch.cat([h.reshape(-1).to(torch.int64) for h in host])
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        return list(torch.split(flat, [h.numel() for h in host]))

    def _micro_batches(self, block_counts: torch.Tensor, width: int, *extra: torch.Tensor):
        """(act: Active or None = all, start, stop) per micro-batch; `extra` CPU tensors travel along and are
        yielded first (as device tensors)."""
        plan = self._plan(block_counts, width)
        moved = self._to_device(*extra, *(a for a, _, _ in plan if a is not None))
        yield moved[:len(extra)]
        it = iter(moved[len(extra):])
        for act, a, b in plan:
            # RefineMethod orders a refiner's experts by falling row count, so the experts that still have rows
            # at an offset are mostly the first k: selecting them is then a view, not a copy of their weights
            first = act.numel() if act is not None and int(act[-1]) == act.numel() - 1 else None
            yield (None if act is None else Active(next(it), first)), a, b

    @staticmethod
    def _sel(t: torch.Tensor, act: "Active | None"):
        if act is None:
            return t
        return t[:act.first] if act.first is not None else t.index_select(0, act.idx)

    def _token_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The tokens of the rows idx [k, c] (padding: token 0, to be zeroed): [k, c, H] in the tokens' dtype."""
        return self.tokens.index_select(0, self.row_token[idx].reshape(-1)).view(*idx.shape, self.H)

    def _gather(self, idx: torch.Tensor, act=None, targets: bool = True):
        """(xq, y, valid, w) of the rows idx [k, c] of the experts act: the input-quantized rows and (targets)
        their dense targets in the compute dtype (else y is None), which rows are real (not padding) and their
        router weights. The training step computes the same inside its compiled micro-batch function."""
        valid = idx != self.sentinel
        tok = self.row_token[idx]
        g_in = None if self.g_in is None else self._sel(self.g_in, act)
        fmt, cd, fused = self.fmt, self.cd, self.fused_gather
        # compiled on CUDA: eager, the input quantizer's ~20 elementwise passes over fp32 rows made a validation
        # of a Qwen3-30B-A3B block at the paper's calibration (4.2 M rows) take ~1.5 s
        if targets:
            fn = self._maybe_compile(f"rows-targets{'-fused' if fused else ''}",
                                     lambda: functools.partial(rows_and_targets, fmt, cd, fused=fused),
                                     ((0,), (0, 1), (0, 1), (0,), (0,), (0,), (0,)))
            xq, y = fn(self.tokens, tok, valid, g_in, *(self._sel(self.dense[p], act) for p in PROJECTIONS))
        else:
            fn = self._maybe_compile(f"rows{'-fused' if fused else ''}",
                                     lambda: functools.partial(quantized_rows, fmt, cd, fused=fused),
                                     ((0,), (0, 1), (0, 1), (0,)))
            xq, y = fn(self.tokens, tok, valid, g_in), None
        return xq, y, valid, self.W[idx]

    @torch.no_grad()
    def _dense_h_amax(self, all_idx: torch.Tensor) -> torch.Tensor:
        """Per expert, the range of the dense SwiGLU output over all its rows (the release computed the dense
        targets every step; here they are computed per micro-batch, and this first pass gives the range the
        first training step's SwiGLU-output quantizer starts from)."""
        h_amax = torch.zeros(self.E, device=self.device)
        mb = self._micro_batches(self.blk_ntr + self.blk_nva, all_idx.shape[1])
        next(mb)
        for act, a, b in mb:
            idx = self._sel(all_idx, act)[:, a:b]
            x = zero_padding(self._token_rows(idx), idx != self.sentinel)
            h = self.intermediate(x, self._sel(self.dense["gate"], act), self._sel(self.dense["up"], act), self.cd)
            self._note_amax(h_amax, act, h)
        return h_amax

    @staticmethod
    def _note_amax(store: torch.Tensor, act, h: torch.Tensor) -> None:
        """store[e] = max(store[e], amax of h's rows of expert e), in place."""
        BlockRefiner._note_range(store, act, h.detach().abs().amax(dim=(1, 2)))

    @staticmethod
    def _note_range(store: torch.Tensor, act, a: torch.Tensor) -> None:
        """store[e] = max(store[e], a[i]) for the experts act[i] (all when act is None), in place."""
        a = a.float()
        if act is None:
            torch.maximum(store, a, out=store)
        else:
            store.scatter_reduce_(0, act.idx, a, reduce="amax")

    def _setup_params(self):
        cfg, E = self.cfg, self.E
        self.proj: dict[str, _Proj] = {}
        init_weights = {}
        for p in PROJECTIONS:
            qws = [ce.weights()[p] for ce in self.inits]
            deq = torch.stack([qw.dequantize().to(self.device, torch.float32) for qw in qws])
            mask = torch.stack([qw.mask.to(self.device).bool() for qw in qws])
            lat = []
            for ce, d in zip(self.inits, deq):
                if ce.latent is not None and ce.latent.get(p) is not None:
                    lat.append(ce.latent[p].to(self.device, torch.float32))
                else:
                    lat.append(d)
            V = torch.stack(lat)
            if V.shape != deq.shape:
                raise ValueError(f"init latent for {p} has shape {tuple(V.shape[1:])}, weights {tuple(deq.shape[1:])}")
            V.requires_grad_(cfg.train_values)
            if self.learn_support:
                A = relaxation.init_logits(mask, self.ps, self.gens, cfg.init_noise, cfg.init_match)
                A = A.to(_DTYPES[cfg.logits_dtype]).requires_grad_()
                fixed = None
            else:
                A, fixed = None, (None if self.ps.num_patterns == 1 else mask)
            pr = _Proj(p, V, A, fixed, init_mask=mask)
            if cfg.train_values:
                pr.best_V = V.detach().clone()
            if A is not None:
                pr.best_mask = relaxation.hard_mask(A.detach(), self.ps)
            self.proj[p] = pr
            init_weights[p] = deq
        # Per expert projection, the multiplier [E, 1, 1] of the values' rate (lr_budget_values_rms; None: 1 for all)
        self.values_rate: dict[str, torch.Tensor | None] = {p: None for p in PROJECTIONS}
        if cfg.train_values:
            for p in PROJECTIONS:
                rms = torch.stack([getattr(ex, p).to(self.device, torch.float32).pow(2).mean().sqrt()
                                   for ex in self.experts])
                m = cfg.values_rate(self.plan, rms)
                self.values_rate[p] = None if bool((m == 1).all()) else m.reshape(-1, 1, 1)
        groups = []  # base rates after the budget rule (self.plan)
        if self.learn_support:
            groups.append({"params": [pr.A for pr in self.proj.values()], "lr": self.plan.lr_logits,
                           "base_lr": self.plan.lr_logits, "name": "logits"})
        if cfg.train_values:
            groups.append({"params": [pr.V for pr in self.proj.values()], "lr": self.plan.lr_values,
                           "base_lr": self.plan.lr_values, "name": "values"})
        from lion_pytorch import Lion  # imported here so formats/methods load without it

        # Lion's Triton kernel: one pass over parameter, gradient and momentum instead of ~8 (same update rule)
        self.opt = Lion(groups, lr=groups[0]["lr"], betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                        use_triton=self.fused_relax and self.device.type == "cuda")
        self._tick("init_params")
        # "Epoch 0" is the init itself: refinement ships an epoch only where it validates better than this.
        v0 = self.validate(init_weights)
        self._tick("validate_init")
        self.best_loss = torch.where(torch.isnan(v0), torch.full_like(v0, math.inf), v0)
        self.best_epoch = torch.zeros(E, dtype=torch.int64, device=self.device)
        self.history_val = [v0]
        self.history_train: list[torch.Tensor] = []

    # --- the relaxed forward -------------------------------------------------------------------------------

    def schedule(self, t: int) -> StepSchedule:
        """τ, gain and the cosine lr factors at optimizer step t of the block. The values' cosine spans all
        steps; the logits', τ's and the gain's span the joint phase (all steps unless values_first)."""
        c = self.cfg
        fv = _frac(t, self.total_steps)
        fa = _frac(t - self.values_steps, self.total_steps - self.values_steps)
        return StepSchedule(_linear_schedule(*c.tau, fa), _linear_schedule(*c.gain, fa),
                            _cosine_factor(c.lr_final_ratio, fa), _cosine_factor(c.lr_final_ratio, fv),
                            joint=t >= self.values_steps)

    def soft_weights(self, tau: float, gain: float, joint: bool = True) -> dict[str, torch.Tensor]:
        """Fake-quantized relaxed weights W̃ = Q(Z ⊙ V) per projection (STE), with fresh Gumbel noise;
        joint=False (the values-only phase): the current hard mask instead, A gets no gradient."""
        soft = {}
        for p, pr in self.proj.items():
            if pr.A is not None and not joint:
                soft[p] = pr.V * relaxation.hard_mask(pr.A.detach(), self.ps)
            elif pr.A is not None and self.fused_relax:
                # the same uniforms gumbel_noise draws; the kernel takes −log(−log U) itself
                U = relaxation.draw(torch.rand, pr.A.shape, self.gens, self.device)
                soft[p] = relax_triton.relaxed_weight(pr.A, pr.V, U, self.ps.pattern_matrix(), tau, gain)
            elif pr.A is not None:
                G = relaxation.gumbel_noise(pr.A.shape, self.gens, self.device)
                soft[p] = self._relax(pr.A, pr.V, G, tau, gain)
            elif pr.fixed_mask is not None:
                soft[p] = pr.V * pr.fixed_mask
            else:
                soft[p] = pr.V
        return self._quant_soft(soft)

    def _relax(self, A, V, G, tau, gain):
        ps = self.ps
        fn = self._maybe_compile("relax", lambda: lambda A, V, G, tau, gain: relaxation.soft_mask(
            relaxation.pattern_probs(A, tau, gain, G), ps) * V, ((0,), (0,), (0,)))
        return fn(A, V, G, tau, gain)

    def _quant_soft(self, soft: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Scales from the soft weights, detached; gate and up share one global scale from the start (unless
        # shared_gate_up_global is off, as in the release).
        g = self._weight_globals(soft)
        fmt = self.fmt
        fq = self._maybe_compile("wq", lambda: lambda w, g: fmt.fake_quant_weight(w, None, g, ste=True), ((0,), (0,)))
        return {p: fq(soft[p], g[p]) for p in PROJECTIONS}

    def _weight_globals(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.cfg.shared_gate_up_global:
            g_gu = batched_weight_global(self.fmt, w["gate"], w["up"])
            return {"gate": g_gu, "up": g_gu, "down": batched_weight_global(self.fmt, w["down"])}
        return {p: batched_weight_global(self.fmt, w[p]) for p in PROJECTIONS}

    def _maybe_compile(self, key: str, make, dims: tuple[tuple[int, ...], ...]):
        """make() -> the function named `key`, compiled when `compile` says so. Compiled functions are kept per
        process and close over the format and compute dtype only (never the refiner), so later blocks reuse
        them instead of recompiling (and never hit dynamo's recompilation limit). dims: per positional
        argument, the dimensions whose size changes from call to call (experts, rows), compiled symbolic; the
        others, the model's widths, stay static, so the fused kernels' index arithmetic is constants rather
        than runtime 64-bit divisions per element (a new width compiles its own static version)."""
        if not self.compiled:
            return make()
        k = (key, self.fmt.name, self.cd, STATIC_WIDTHS)
        if k not in _COMPILED:
            _COMPILED[k] = _with_dynamic_dims(torch.compile(make(), dynamic=False), dims) if STATIC_WIDTHS \
                else torch.compile(make(), dynamic=True)
        return _COMPILED[k]

    @staticmethod
    def gate_up(x, Wg, Wu, cd: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up matmuls x Wgᵀ, x Wuᵀ in the compute dtype, batched: x [k, c, H] (input-quantized)."""
        xc = x.to(cd)
        return torch.bmm(xc, Wg.transpose(1, 2).to(cd)), torch.bmm(xc, Wu.transpose(1, 2).to(cd))

    @staticmethod
    def intermediate(x, Wg, Wu, cd: torch.dtype) -> torch.Tensor:
        """SwiGLU output h = silu(x Wgᵀ) ⊙ (x Wuᵀ), batched: x [k, c, H] (already input-quantized), fp32."""
        g, u = BlockRefiner.gate_up(x, Wg, Wu, cd)
        return F.silu(g.float()) * u.float()

    def forward(self, x, Wg, Wu, Wd, cd: torch.dtype, ste: bool = True, h_global: torch.Tensor | None = None,
                h_amax: tuple | None = None) -> torch.Tensor:
        """Quantized-activation SwiGLU expert, batched. h_global: static per-expert global scales of the
        SwiGLU-output quantizer ([k, 1, 1]; None = dynamic); h_amax = (store, act) records h's range."""
        hq, amax = swiglu_quant(self.fmt.act, *self.gate_up(x, Wg, Wu, cd), h_global, ste=ste, out_dtype=cd,
                                fused=self.fused_swiglu)
        if h_amax is not None:
            self._note_range(h_amax[0], h_amax[1], amax)
        return torch.bmm(hq, Wd.transpose(1, 2).to(cd)).float()

    @staticmethod
    def micro_loss_fn(fmt: Format, cd: torch.dtype, fused: bool = False, grad_in_forward: bool = True,
                      fused_gather: bool = False):
        """One micro-batch of the training forward, (tokens, tok, valid, g_in, Dg, Du, Dd, Wg, Wu, Wd, tw, scale,
        g_h) -> (out, grad_out, num [k], amax of h [k]): the unit torch.compile fuses (the rows' gather, input
        quantizer and dense targets (`rows_and_targets`), casts, SwiGLU, activation quantizer, loss). tok [k, c]:
        the rows' token indices into tokens [T, H], `valid` false on padding; D*: the dense experts, W*: the
        relaxed quantized weights (leaves). The weights' gradients of the loss Σ_e scale_e·num_e are
        autograd.grad(out, weights, grad_out): out = the expert outputs ŷ and grad_out = the loss's gradient in ŷ,
        written in the forward (grad_in_forward), else out = the loss itself and grad_out None. fused: the SwiGLU
        and its quantizer in the activation quantizer's fused kernel where it has one; fused_gather: the gather
        and the input quantizer in one kernel where it runs."""
        def micro_loss(tokens, tok, valid, g_in, Dg, Du, Dd, Wg, Wu, Wd, tw, scale, g_h):
            with torch.no_grad():
                xq, y = rows_and_targets(fmt, cd, tokens, tok, valid, g_in, Dg, Du, Dd, fused=fused_gather)
            gate, up = BlockRefiner.gate_up(xq, Wg, Wu, cd)
            hq, hamax = swiglu_quant(fmt.act, gate, up, g_h, ste=True, out_dtype=cd, fused=fused)
            yhat = torch.bmm(hq, Wd.transpose(1, 2).to(cd))
            if grad_in_forward:
                num, gy = objective.weighted_sq_error_and_grad(yhat, y, tw, scale)
                return yhat, gy, num, hamax
            num = objective.weighted_sq_error(yhat, y, tw)
            return (num * scale).sum(), None, num.detach(), hamax
        return micro_loss

    # --- training -----------------------------------------------------------------------------------------

    def epoch_order(self) -> torch.Tensor:
        """A fresh random order of each expert's training rows: [E, max n_train] positions (padding last)."""
        C = max(int(self.n_train.max()), 1)
        order = torch.arange(C, device=self.device).repeat(self.E, 1)
        for e, (n, g) in enumerate(zip(self.n_train.tolist(), self.gens)):
            if n:
                order[e, :n] = torch.rand(n, generator=g, device=self.device).argsort(stable=True)
        return order

    def train_step(self, order: torch.Tensor, s: int) -> torch.Tensor:
        """One optimizer step (step s of the epoch with row order `order`). Returns the per-expert loss [E]."""
        sch = self.schedule(self.step_count)
        for grp in self.opt.param_groups:
            grp["lr"] = grp["base_lr"] * (sch.lr_logits if grp["name"] == "logits" else sch.lr_values)
        cnt = self.step_cnt[s]
        C = int(self.blk_step_cnt[s].max())  # the block's widest: shapes that do not depend on the shard
        mb = self._micro_batches(self.blk_step_cnt[s], C, self.step_start[s], cnt)
        start, cnt_d = next(mb)
        j = torch.arange(max(C, 1), device=self.device)[None, :]
        pos = order.gather(1, (start[:, None] + j).clamp(max=order.shape[1] - 1))
        idx = torch.where(j < cnt_d[:, None], self.train_base[:, None] + pos,
                          torch.full_like(pos, self.sentinel))
        valid_all = idx != self.sentinel
        tw_all = objective.token_weights(self.W[idx], valid_all, self.cfg.loss_power)
        den = tw_all.sum(1) * self.H
        inv_den = torch.where(den > 0, 1.0 / den.clamp_min(1e-30), torch.zeros_like(den))

        Wq = self.soft_weights(sch.tau, sch.gain, sch.joint)
        Wc = {p: w.detach().to(self.cd) for p, w in Wq.items()}
        gacc = {p: torch.zeros_like(w) for p, w in Wq.items()}
        num = torch.zeros(self.E, device=self.device)
        # The SwiGLU-output quantizer uses one static global scale per expert for the whole step (the range
        # seen in the previous step), so micro-batching changes nothing and training sees what serving's
        # calibrated scale does, rather than a per-micro-batch dynamic one.
        g_h = act_global(self.fmt, self.h_amax)
        step_amax = torch.zeros_like(self.h_amax)
        grad_in_forward = LOSS_GRAD_IN_FORWARD
        micro = self._maybe_compile(
            f"micro{'-fused' if self.fused_swiglu else ''}{'-grad' if grad_in_forward else ''}"
            f"{'-gather' if self.fused_gather else ''}",
            lambda: self.micro_loss_fn(self.fmt, self.cd, self.fused_swiglu, grad_in_forward, self.fused_gather),
            ((0,), (0, 1), (0, 1), (0,), (0,), (0,), (0,), (0,), (0,), (0,), (0, 1), (0,), (0,)))
        for act, a, b in mb:
            sl = self._sel(idx, act)[:, a:b]
            tw = self._sel(tw_all, act)[:, a:b]
            leaves = {p: self._sel(w, act).detach().requires_grad_() for p, w in Wc.items()}
            out, grad_out, n, hamax = micro(self.tokens, self.row_token[sl], sl != self.sentinel,
                                            self._sel(self.g_in, act) if self.g_in is not None else None,
                                            *(self._sel(self.dense[p], act) for p in PROJECTIONS),
                                            leaves["gate"], leaves["up"], leaves["down"], tw,
                                            self._sel(inv_den, act), None if g_h is None else self._sel(g_h, act))
            # autograd.grad, not backward: the micro-batch's gradients come back as they are, without the
            # AccumulateGrad copy into .grad of every leaf
            grads = torch.autograd.grad(out, [leaves[p] for p in PROJECTIONS], grad_out)
            if act is None:
                torch.maximum(step_amax, hamax, out=step_amax)
            else:
                step_amax.scatter_reduce_(0, act.idx, hamax, reduce="amax")
            for p, gr in zip(PROJECTIONS, grads):
                if act is None and not rows_add_triton.ALL_ROWS:
                    gacc[p].add_(gr)  # fp32 += the compute-dtype gradient, promoted inside the one kernel
                else:
                    rows_add_triton.add_rows_(gacc[p], self.all_experts if act is None else act.idx, gr)
            num = num.index_add(0, act.idx, n) if act is not None else num + n
        self.h_amax = torch.where(step_amax > 0, step_amax, self.h_amax)
        torch.autograd.backward([Wq[p] for p in PROJECTIONS], [gacc[p] for p in PROJECTIONS])
        before = {p: self.proj[p].V.detach().clone() for p, m in self.values_rate.items() if m is not None}
        self.opt.step()
        self._rescale_value_steps(before)
        self.opt.zero_grad(set_to_none=True)
        self.step_count += 1
        return num * inv_den

    @torch.no_grad()
    def _rescale_value_steps(self, before: dict[str, torch.Tensor]) -> None:
        """Lion at a rate of its own per expert projection (values_rate × the group's): lion-pytorch takes one
        rate per parameter group, so its step V' = d·V − lr·sign(c) (d = 1 − lr·wd, the decay at the group's
        rate) is scaled afterwards to d·V − m·lr·sign(c) = m·V' + (1 − m)·d·V. Lion's momentum does not
        depend on the rate, so this is exactly Lion with rate m·lr (decay as the group's)."""
        if not before:
            return
        grp = next(g for g in self.opt.param_groups if g["name"] == "values")
        d = 1.0 - grp["lr"] * grp["weight_decay"]
        for p, old in before.items():
            m = self.values_rate[p]
            self.proj[p].V.mul_(m).add_(old.mul_((1.0 - m) * d))

    def train_epoch(self, max_steps: int | None = None, on_step=None) -> torch.Tensor:
        """One epoch's steps; on_step(steps done in the block, routed rows trained on so far) after each."""
        order = self.epoch_order()
        S = self.steps_per_epoch if max_steps is None else min(max_steps, self.steps_per_epoch)
        acc = torch.zeros(self.E, device=self.device)
        for s in range(S):
            acc += self.train_step(order, s)
            self.rows_done += int(self.step_cnt[s].sum())
            if on_step is not None:
                on_step(self.step_count, self.rows_done)
        return acc / max(S, 1)

    # --- validation and export ----------------------------------------------------------------------------

    @torch.no_grad()
    def hard_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
        """The exported weights (dequantized, batched) and masks of the current parameters: argmax pattern,
        scales recomputed from the masked values, one global scale for gate and up (= fmt.quantize)."""
        masks, masked = {}, {}
        for p, pr in self.proj.items():
            if pr.A is not None:
                masks[p] = relaxation.hard_mask(pr.A, self.ps)
            else:
                masks[p] = pr.fixed_mask
            masked[p] = pr.V.detach() if masks[p] is None else pr.V.detach() * masks[p]
        g = self._weight_globals(masked)
        W = {p: self.fmt.fake_quant_weight(masked[p], None, g[p]) for p in PROJECTIONS}
        if not self.cfg.shared_gate_up_global:  # what serving sees: re-quantized under one shared scale
            g_gu = batched_weight_global(self.fmt, W["gate"], W["up"])
            W["gate"], W["up"] = (self.fmt.fake_quant_weight(W[p], None, g_gu) for p in ("gate", "up"))
        return W, masks

    @torch.no_grad()
    def validate(self, W: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-expert loss [E] of given (hard) weights on the held-out rows; NaN without rows. The matmuls run
        in the compute dtype as in training (bf16 on CUDA: at the paper's calibration an fp32 validation of a
        Qwen3-30B-A3B block costs ~1 s, 80 of them a third of the block's time), the loss in fp32.

        The SwiGLU-output quantizer gets a static global scale per expert from the range of h over the
        validation rows (a first pass), so the result does not depend on the micro-batch size."""
        g_h = None
        if self.fmt.act.uses_global_scale:
            amax = torch.zeros(self.E, device=self.device)
            for act, sl in self._val_batches():
                x = self._gather(sl, act, targets=False)[0]
                self._note_amax(amax, act,
                                self.intermediate(x, self._sel(W["gate"], act), self._sel(W["up"], act), self.cd))
            g_h = act_global(self.fmt, amax)
        num = torch.zeros(self.E, device=self.device)
        den = torch.zeros(self.E, device=self.device)
        for act, sl in self._val_batches():
            x, y, valid, w = self._gather(sl, act)
            tw = objective.token_weights(w, valid, self.cfg.loss_power)
            yhat = self.forward(x, *(self._sel(W[p], act) for p in PROJECTIONS), self.cd, ste=False,
                                h_global=None if g_h is None else self._sel(g_h, act))
            n = objective.weighted_sq_error(yhat, y, tw)
            d = tw.sum(-1)
            if act is None:
                num, den = num + n, den + d
            else:
                num, den = num.index_add(0, act.idx, n), den.index_add(0, act.idx, d)
        return torch.where(den > 0, num / (den.clamp_min(1e-30) * self.H), torch.full_like(num, math.nan))

    def _val_batches(self):
        mb = self._micro_batches(self.blk_nva, self.val_idx.shape[1])
        next(mb)
        for act, a, b in mb:
            yield act, self._sel(self.val_idx, act)[:, a:b]

    @torch.no_grad()
    def end_epoch(self, epoch: int, train_loss: torch.Tensor | None = None) -> torch.Tensor:
        """Validate the current parameters and keep, per expert, whichever epoch validates best so far."""
        W, masks = self.hard_state()
        v = self.validate(W)
        if self.cfg.ship == "last":  # the release: the last epoch ships wherever the expert trained
            better = ((self.n_train > 0).to(self.device) if epoch == self.cfg.epochs
                      else torch.zeros_like(v, dtype=torch.bool))
        else:
            better = v < self.best_loss  # NaN (no validation rows) never wins: those experts keep their init
        self.best_loss = torch.where(better, v, self.best_loss)
        self.best_epoch = torch.where(better, torch.full_like(self.best_epoch, epoch), self.best_epoch)
        b3 = better[:, None, None]
        for p, pr in self.proj.items():
            if pr.best_V is not None:
                pr.best_V = torch.where(b3, pr.V.detach(), pr.best_V)
            if pr.best_mask is not None:
                pr.best_mask = torch.where(b3, masks[p], pr.best_mask)
        self.history_val.append(v)
        if train_loss is not None:
            self.history_train.append(train_loss)
        return v

    def run(self, on_step=None) -> list[CompressedExpert]:
        """Validate the init, train and validate each epoch, export the best epoch per expert (see the class);
        on_step(steps done, routed rows trained on so far) after every optimizer step."""
        t0 = time.perf_counter()
        for epoch in range(1, self.cfg.epochs + 1):
            te = time.perf_counter()
            tl = self.train_epoch(on_step=on_step)
            if epoch not in self.validated:
                self.history_train.append(tl)
                continue
            v = self.end_epoch(epoch, tl)
            if log.isEnabledFor(logging.INFO):
                fin = torch.isfinite(v)
                log.info("refine epoch %d/%d: train %.4g, val %.4g (mean over %d experts), "
                         "%d/%d experts improved on init, %.1fs",
                         epoch, self.cfg.epochs, float(tl.mean()), float(v[fin].mean()) if fin.any() else math.nan,
                         int(fin.sum()), int((self.best_epoch > 0).sum()), self.E, time.perf_counter() - te)
        self.seconds = time.perf_counter() - t0
        return self.export()

    def _groups_changed(self, e: int) -> dict:
        """How many sparsity groups of expert e ship a pattern other than the init's (sparse formats)."""
        if self.ps.is_dense:
            return {}
        changed = total = 0
        for pr in self.proj.values():
            if pr.best_mask is None or self.best_epoch[e] == 0:
                total += pr.init_mask[e].numel() // self.ps.group
                continue
            diff = (pr.best_mask[e] != pr.init_mask[e]).reshape(-1, self.ps.group).any(-1)
            changed, total = changed + int(diff.sum()), total + diff.numel()
        return {"groups_changed": changed, "groups": total}

    @torch.no_grad()
    def export(self) -> list[CompressedExpert]:
        """Per expert: the init itself where no epoch validated better, else fmt.quantize of the best epoch's
        (V, argmax mask) with gate/up sharing one global scale — exactly what pack writes."""
        fmt = self.fmt
        best_epoch = self.best_epoch.cpu().tolist()
        val = torch.stack(self.history_val).cpu()  # [epochs+1, E]
        train = torch.stack(self.history_train).cpu() if self.history_train else None
        out = []
        for e, (ex, ce) in enumerate(zip(self.experts, self.inits)):
            info = {
                "init": ce.info,
                "refine": {
                    "best_epoch": best_epoch[e],
                    "val_loss": [None if math.isnan(x) else x for x in val[:, e].tolist()],
                    **({"val_epochs": [0, *sorted(self.validated)]} if len(self.validated) < self.cfg.epochs else {}),
                    "train_loss": train[:, e].tolist() if train is not None else [],
                    "n_train": int(self.n_train[e]), "n_val": int(self.n_val[e]),
                    "steps": self.step_count,
                    **self._groups_changed(e),
                },
            }
            if best_epoch[e] == 0:
                out.append(CompressedExpert(ce.gate, ce.up, ce.down, latent=ce.latent if self.cfg.keep_latent else None,
                                            info=info))
                continue
            vals, masks = {}, {}
            for p, pr in self.proj.items():
                vals[p] = (pr.best_V if pr.best_V is not None else pr.V.detach())[e]
                if pr.best_mask is not None:
                    masks[p] = pr.best_mask[e]
                elif pr.fixed_mask is not None:
                    masks[p] = pr.fixed_mask[e]
                else:
                    masks[p] = torch.ones_like(vals[p], dtype=torch.bool)
            if self.cfg.shared_gate_up_global:
                g = fmt.global_scale(vals["gate"] * masks["gate"], vals["up"] * masks["up"])
                q = {p: fmt.quantize(vals[p], masks[p], g if p != "down" else None) for p in PROJECTIONS}
            else:  # the release: each with its own global scale, then re-quantized under the merged one
                q = {p: fmt.quantize(vals[p], masks[p]) for p in PROJECTIONS}
                deq = {p: q[p].dequantize() for p in ("gate", "up")}
                g = fmt.global_scale(deq["gate"], deq["up"])
                q.update({p: fmt.quantize(deq[p], masks[p], g) for p in ("gate", "up")})
            latent = {p: vals[p].clone() for p in PROJECTIONS} if self.cfg.keep_latent else None
            out.append(CompressedExpert(q["gate"], q["up"], q["down"], latent=latent, info=info))
        return out
