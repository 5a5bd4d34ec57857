"""The interface every compression method implements, and the data the engine hands it.

The engine (moesq_core/compression/engine.py) gathers, per MoE block, each expert's dense weights and the calibration
tokens routed to it, calls `Method.compress_block` once per block (or per rank's shard of experts), and
writes the returned `CompressedExpert`s as the block's artifact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from moesq_core.formats import Format, QuantizedWeight
from moesq_core.naming import PROJECTIONS  # noqa: F401  (the methods import it from here)


@dataclass(frozen=True)
class BlockRows:
    """The routed calibration rows of every expert of one block (by expert index), as every rank sees them.
    Methods that batch a block's experts size their batches from these rather than from the experts they
    were handed, so an expert's result does not depend on which others a process holds (expert parallel)."""

    layer_index: int
    rows: tuple[int, ...]  # len(x) per expert
    val_rows: tuple[int, ...] | None = None  # len(x_val) per expert, when the engine gives held-out rows


@dataclass(frozen=True)
class TokenRows:
    """Rows of a token matrix shared by the experts of a block: `tokens` [T, H] holds every calibration
    token's MoE-block input once (in the states' dtype), `idx` [n] (int64, token order) the tokens routed to
    one expert. Top-8 routing would otherwise hold every token 8 times (275 GB in fp32 for 4M tokens of a
    2048-wide model)."""

    tokens: torch.Tensor
    idx: torch.Tensor

    def __post_init__(self):
        if self.tokens.dim() != 2:
            raise ValueError(f"token matrix must be [tokens, hidden], got shape {tuple(self.tokens.shape)}")
        if self.idx.dim() != 1 or self.idx.dtype != torch.int64:
            raise ValueError(f"token indices must be a 1-d int64 tensor, got {self.idx.dtype} {tuple(self.idx.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.idx.numel(), self.tokens.shape[1])

    def __len__(self) -> int:
        return self.idx.numel()

    def materialize(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The rows as their own fp32 tensor [n, H] on `device` (default: where the tokens are)."""
        device = self.tokens.device if device is None else torch.device(device)
        rows = self.tokens.index_select(0, self.idx.to(self.tokens.device))
        return rows.to(device, torch.float32)


Rows = torch.Tensor | TokenRows  # an expert's calibration rows: its own tensor [n, H], or rows of a shared token matrix


def row_count(x: Rows | None) -> int:
    return 0 if x is None else (len(x) if isinstance(x, TokenRows) else x.shape[0])


def as_tensor(x: Rows, device: torch.device | None = None) -> torch.Tensor:
    """x as an fp32 tensor [n, H] (shared token rows are gathered into a copy)."""
    if isinstance(x, TokenRows):
        return x.materialize(device)
    return x.float() if device is None else x.to(device, torch.float32)


ROW_PIECE = 1 << 16  # rows per piece of a pass over one expert's rows (a multiple of hessian's fp64 chunk)


def all_finite(tokens: torch.Tensor) -> bool:
    """Whether every value of a token matrix [T, H] is finite (ROW_PIECE rows at a time: bounded memory)."""
    return all(bool(torch.isfinite(tokens[s:s + ROW_PIECE]).all()) for s in range(0, tokens.shape[0], ROW_PIECE))


def row_amax(tokens: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude [T] (fp32) of a token matrix [T, H], ROW_PIECE rows at a time."""
    out = torch.empty(tokens.shape[0], dtype=torch.float32, device=tokens.device)
    for s in range(0, tokens.shape[0], ROW_PIECE):
        out[s:s + ROW_PIECE] = tokens[s:s + ROW_PIECE].abs().amax(-1).float()
    return out


def rows_slice(x: Rows, a: int, b: int) -> Rows:
    """Rows a..b of x (shared token rows stay shared: only their indices are sliced)."""
    return TokenRows(x.tokens, x.idx[a:b]) if isinstance(x, TokenRows) else x[a:b]


@dataclass(frozen=True)
class RowPieces:
    """`n` rows of `width` values, made piece by piece (`piece(a, b)`: fp32 [b - a, width]) so that a pass over a
    hot expert's rows (a million of them at the paper's calibration: 8 GB in fp32, more for the SwiGLU
    intermediate) holds ROW_PIECE of them at a time. Iterating gives (first row, piece) pairs."""

    n: int
    width: int
    piece: Callable[[int, int], torch.Tensor]
    device: torch.device | None = None  # where the pieces are made

    def __iter__(self):
        for a in range(0, self.n, ROW_PIECE):
            yield a, self.piece(a, min(a + ROW_PIECE, self.n))


@dataclass
class ExpertData:
    """One expert of one block. Weights are fp32 [out, in] (gate/up: [I, H], down: [H, I]).

    x: the (compressed-prefix) hidden states routed to this expert, [n, H]: a tensor of its own, or
    `TokenRows` of a token matrix the block's experts share (the engine's form: read them with `inputs()`,
    which gathers an fp32 copy, and count them with `n_rows`); w: [n] the router weights the model multiplies
    this expert's output by. n may be 0 for an expert no calibration token reached.
    """

    index: int
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    x: Rows
    w: torch.Tensor
    # Held-out tokens routed to this expert (the calibration set's validation split), when the engine has
    # them; methods that validate (refine) use these instead of splitting x.
    x_val: Rows | None = None
    w_val: torch.Tensor | None = None
    block: BlockRows | None = None  # the whole block's row counts (None: the experts handed over are the block)

    @property
    def n_rows(self) -> int:
        return row_count(self.x)

    def inputs(self) -> torch.Tensor:
        """x as an fp32 tensor [n, H] on the weights' device (a gathered copy for shared token rows)."""
        return as_tensor(self.x, self.gate.device)

    def input_pieces(self) -> RowPieces:
        """`inputs()` piece by piece (RowPieces)."""
        return RowPieces(self.n_rows, self.gate.shape[1],
                         lambda a, b: as_tensor(rows_slice(self.x, a, b), self.gate.device), self.gate.device)

    def intermediate_pieces(self) -> RowPieces:
        """`dense_intermediate()` piece by piece (RowPieces)."""
        return RowPieces(self.n_rows, self.gate.shape[0],
                         lambda a, b: self.dense_intermediate(as_tensor(rows_slice(self.x, a, b), self.gate.device)),
                         self.gate.device)

    def dense_intermediate(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU intermediate of the uncompressed expert: the input of down_proj."""
        x = self.inputs() if x is None else x.float()
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

    def compress_block(self, experts: list[ExpertData], fmt: Format,
                       progress: ProgressFn | None = None) -> list[CompressedExpert]:
        ...


def compress_each(experts: list[ExpertData], fmt: Format,
                  compress_expert: Callable[[ExpertData, Format], CompressedExpert],
                  progress: ProgressFn | None = None) -> list[CompressedExpert]:
    """`compress_block` of a method that treats experts one at a time: its per-expert solve, with progress."""
    out = []
    for ex in experts:
        out.append(compress_expert(ex, fmt))
        if progress is not None:
            progress(1)
    return out
