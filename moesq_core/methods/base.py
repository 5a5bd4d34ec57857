"""The interface every compression method implements, and the data the engine hands it.

The engine (moesq_core/engine.py) gathers, per MoE block, each expert's dense weights and the calibration
tokens routed to it, calls `Method.compress_block` once per block (or per rank's shard of experts), and
writes the returned `CompressedExpert`s as the block's artifact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from ..formats import Format, QuantizedWeight
from ..naming import PROJECTIONS  # noqa: F401  (the methods import it from here)


@dataclass(frozen=True)
class BlockRows:
    """The routed calibration rows of every expert of one block (by expert index), as every rank sees them.
    Methods that batch a block's experts size their batches from these rather than from the experts they
    were handed, so an expert's result does not depend on which others a process holds (expert parallel)."""

    layer_index: int
    rows: tuple[int, ...]  # len(x) per expert
    val_rows: tuple[int, ...] | None = None  # len(x_val) per expert, when the engine gives held-out rows


@dataclass
class ExpertData:
    """One expert of one block. Weights are fp32 [out, in] (gate/up: [I, H], down: [H, I]).

    x: [n, H] the (compressed-prefix) hidden states routed to this expert; w: [n] the router weights the
    model multiplies this expert's output by. n may be 0 for an expert no calibration token reached.
    """

    index: int
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    x: torch.Tensor
    w: torch.Tensor
    # Held-out tokens routed to this expert (the calibration set's validation split), when the engine has
    # them; methods that validate (refine) use these instead of splitting x.
    x_val: torch.Tensor | None = None
    w_val: torch.Tensor | None = None
    block: BlockRows | None = None  # the whole block's row counts (None: the experts handed over are the block)

    def dense_intermediate(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU intermediate of the uncompressed expert: the input of down_proj."""
        x = self.x if x is None else x
        x = x.float()
        return F.silu(x @ self.gate.T) * (x @ self.up.T)

    def dense_output(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Y, the uncompressed expert's output (the reconstruction target)."""
        return self.dense_intermediate(x) @ self.down.T


@dataclass
class CompressedExpert:
    """The result for one expert: one QuantizedWeight per projection (gate and up share a global scale),
    optional latent dense values (refinement's initial V), and free-form metrics for the log."""

    gate: QuantizedWeight
    up: QuantizedWeight
    down: QuantizedWeight
    latent: dict[str, torch.Tensor] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def weights(self) -> dict[str, QuantizedWeight]:
        return {"gate": self.gate, "up": self.up, "down": self.down}


ProgressFn = Callable[[int], None]  # called with the number of experts just finished


class Method(Protocol):
    """A compression method. `name` is what `--method` selects."""

    name: str

    def compress_block(self, experts: list[ExpertData], fmt: Format, progress: ProgressFn | None = None) -> list[CompressedExpert]:
        ...


def compress_each(experts: list[ExpertData], fmt: Format, compress_expert: Callable[[ExpertData, Format], CompressedExpert],
                  progress: ProgressFn | None = None) -> list[CompressedExpert]:
    """`compress_block` of a method that treats experts one at a time: its per-expert solve, with progress."""
    out = []
    for ex in experts:
        out.append(compress_expert(ex, fmt))
        if progress is not None:
            progress(1)
    return out
