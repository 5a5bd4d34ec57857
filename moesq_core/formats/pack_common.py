"""Helpers shared by the packers: a structured error, tensor checks, nibble/byte shuffles, kept-slot logic.

Everything is vectorised torch over arbitrary leading dimensions ([out, in] or stacked [E, out, in]).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:  # annotations only: base.py (the Format's checks) builds on these helpers, not the reverse
    from moesq_core.formats.base import QuantizedWeight

# Per-linear tensors that belong to the activation side; packers ignore them when present.
ACTIVATION_SUFFIXES = ("input_global_scale",)


class PackingError(ValueError):
    """A packed tensor (or a QuantizedWeight field) that cannot be packed/unpacked.

    `tensor` names the tensor (suffix, or full name when a prefix was given), `position` is the index of the
    first offending element in that tensor (None for whole-tensor problems such as a wrong shape) and
    `problem` says what is wrong.
    """

    def __init__(self, tensor: str, problem: str, position: tuple[int, ...] | None = None):
        self.tensor = tensor
        self.problem = problem
        self.position = position
        where = f"{tensor}[{', '.join(map(str, position))}]" if position is not None else tensor
        super().__init__(f"{where}: {problem}")


def full_name(name: str, suffix: str) -> str:
    return f"{name}.{suffix}" if name else suffix


def first_index(bad: torch.Tensor) -> tuple[int, ...]:
    """Row-major index of the first True in `bad` (caller ensures there is one)."""
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def select(
    tensors: dict[str, torch.Tensor], required: Iterable[str], layout: str, name: str
) -> dict[str, torch.Tensor]:
    """The required tensors of a layout; missing or unexpected suffixes raise (activation scales are ignored)."""
    required = tuple(required)
    missing = [s for s in required if s not in tensors]
    if missing:
        raise PackingError(
            full_name(name, missing[0]),
            f"missing; layout {layout!r} needs {', '.join(required)} (got {', '.join(sorted(tensors)) or 'nothing'})",
        )
    extra = sorted(set(tensors) - set(required) - set(ACTIVATION_SUFFIXES))
    if extra:
        raise PackingError(
            full_name(name, extra[0]), f"unexpected tensor for layout {layout!r}, which stores {', '.join(required)}"
        )
    return {s: tensors[s] for s in required}


def primary_dims(
    t: torch.Tensor, tname: str, columns_per_element: int, expected: str
) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, out, logical in) of a layout's primary tensor, which must be at least 2-D."""
    if t.dim() < 2:
        raise PackingError(tname, f"expected {expected}, got shape {tuple(t.shape)}")
    *lead, out, cols = t.shape
    return tuple(lead), out, cols * columns_per_element


def check_tensor(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], tname: str) -> None:
    if t.dtype != dtype:
        raise PackingError(tname, f"dtype is {t.dtype}, expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise PackingError(tname, f"shape is {tuple(t.shape)}, expected {tuple(shape)}")


def check_divisible(in_features: int, need: int, tname: str, why: str) -> None:
    if in_features <= 0 or in_features % need:
        raise PackingError(tname, f"input dimension {in_features} is not a positive multiple of {need} ({why})")


def nibbles_to_bytes(n: torch.Tensor) -> torch.Tensor:
    """[..., 2k] uint8 nibbles -> [..., k] bytes, element 2j in the low nibble (lower K first)."""
    return n[..., 0::2] | (n[..., 1::2] << 4)


def bytes_to_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Inverse of nibbles_to_bytes."""
    n = torch.empty(*b.shape[:-1], b.shape[-1] * 2, dtype=torch.uint8, device=b.device)
    n[..., 0::2] = b & 0xF
    n[..., 1::2] = b >> 4
    return n


# Lookup tables over the 16 values of a 4-slot nibble (bit i = slot i kept); valid nibbles have 2 bits set.
def _slots(v: int) -> list[int]:
    return [i for i in range(4) if v >> i & 1]


_NIB_KEPT = torch.tensor([[i in _slots(v) for i in range(4)] for v in range(16)])  # [16, 4] bool
_NIB_POPCOUNT = torch.tensor([len(_slots(v)) for v in range(16)], dtype=torch.uint8)
# The 2 kept slots in ascending order (meaningless for invalid nibbles, which callers reject first).
_NIB_POS = torch.tensor([(_slots(v) + [0, 0])[:2] for v in range(16)])  # [16, 2] int64
# Per slot, which of (first kept value, second kept value, zero) lands there.
_NIB_SRC = torch.tensor([[_slots(v)[:2].index(i) if i in _slots(v)[:2] else 2 for i in range(4)] for v in range(16)])


def _lut(table: torch.Tensor, nib: torch.Tensor) -> torch.Tensor:
    return table.to(nib.device)[nib.long()]


def kept_to_nibble(kept: torch.Tensor) -> torch.Tensor:
    """bool [..., 4] -> uint8 [...], bit i = slot i kept."""
    k = kept.to(torch.uint8)
    return k[..., 0] | (k[..., 1] << 1) | (k[..., 2] << 2) | (k[..., 3] << 3)


def nibble_popcount(nib: torch.Tensor) -> torch.Tensor:
    return _lut(_NIB_POPCOUNT, nib)


def nibble_to_kept(nib: torch.Tensor) -> torch.Tensor:
    """uint8 [...] -> bool [..., 4]."""
    return _lut(_NIB_KEPT, nib)


def nibble_positions(nib: torch.Tensor) -> torch.Tensor:
    """int64 [..., 2]: the 2 kept slots of each (valid) nibble, ascending."""
    return _lut(_NIB_POS, nib)


def spread_pairs(values: torch.Tensor, nib: torch.Tensor) -> torch.Tensor:
    """Kept values [..., C, 2] (K order) + nibbles [..., C] -> [..., C, 4] with zeros in the unkept slots."""
    padded = torch.cat((values, torch.zeros_like(values[..., :1])), dim=-1)
    return torch.gather(padded, -1, _lut(_NIB_SRC, nib))


def complete_kept(kept: torch.Tensor, k: int = 2) -> torch.Tensor:
    """Top up slot groups with fewer than k kept slots using their lowest-index free slots."""
    free = ~kept
    rank = free.to(torch.int16).cumsum(-1)  # 1-based rank of each free slot within its group
    need = (k - kept.sum(-1, keepdim=True)).clamp_min(0)
    return kept | (free & (rank <= need))


def to_e4m3(scales: torch.Tensor, tname: str) -> torch.Tensor:
    """float32 scales that are exactly e4m3 values -> float8_e4m3fn; anything else would not round trip."""
    s = scales.float()
    if not bool(torch.isfinite(s).all()):
        raise PackingError(
            tname, f"non-finite scale {s[~torch.isfinite(s)][0].item()}", first_index(~torch.isfinite(s))
        )
    s8 = s.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    bad = s8.float() != s
    if bool(bad.any()):
        pos = first_index(bad)
        raise PackingError(
            tname, f"scale {s[pos].item()!r} is not an e4m3 value (round it with round_ue4m3_scale first)", pos
        )
    return s8


def check_qw(qw: QuantizedWeight, fmt: str, codes_dtype: torch.dtype = torch.uint8) -> tuple[tuple[int, ...], int, int]:
    """Common QuantizedWeight checks; returns (leading dims, out, in)."""
    if qw.format != fmt:
        raise PackingError("QuantizedWeight", f"format is {qw.format!r}, this layout stores {fmt!r}")
    c = qw.codes
    if c.dim() < 2:
        raise PackingError("codes", f"expected [out, in] or [E, out, in], got shape {tuple(c.shape)}")
    if c.dtype != codes_dtype:
        raise PackingError("codes", f"dtype is {c.dtype}, expected {codes_dtype}")
    if tuple(qw.mask.shape) != tuple(c.shape):
        raise PackingError("mask", f"shape {tuple(qw.mask.shape)} differs from codes shape {tuple(c.shape)}")
    *lead, out, inn = c.shape
    n_global = math.prod(lead)
    if qw.global_scale.numel() != n_global:
        raise PackingError(
            "global_scale", f"has {qw.global_scale.numel()} elements, expected {n_global} (one per weight matrix)"
        )
    return tuple(lead), out, inn


def check_scale_shape(qw: QuantizedWeight, shape: tuple[int, ...]) -> None:
    if tuple(qw.scales.shape) != tuple(shape):
        raise PackingError("scales", f"shape is {tuple(qw.scales.shape)}, expected {tuple(shape)}")


def check_nibble_codes(codes: torch.Tensor) -> None:
    bad = codes > 0xF
    if bool(bad.any()):
        pos = first_index(bad)
        raise PackingError("codes", f"value {int(codes[pos])} is not a 4-bit E2M1 code", pos)


def check_pruned_zero(codes: torch.Tensor, kept: torch.Tensor) -> None:
    """A nonzero code outside the mask would be silently dropped by a sparse layout: refuse instead."""
    bad = (codes != 0) & ~kept
    if bool(bad.any()):
        pos = first_index(bad)
        raise PackingError("codes", f"nonzero code {int(codes[pos])} at a position the mask prunes", pos)


def global_to_packed(g: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    # A copy: gate and up share one global-scale tensor, and safetensors refuses to save aliased tensors.
    return g.float().reshape(*lead, 1).clone()


def global_from_packed(t: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """[*lead, 1] -> scalar for one matrix, [*lead, 1, 1] for stacked ones (broadcasts over [out, in])."""
    return (t.float().reshape(()) if not lead else t.float().reshape(*lead, 1, 1)).clone()


def packed_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the given tensors (everything in the dict is counted)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
