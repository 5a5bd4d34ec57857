"""FP4 E2M1 values: the grid, round-to-nearest with ties to the even code, codes.

A code is a nibble: sign << 3 | magnitude index, magnitude index into E2M1_GRID.
"""
from __future__ import annotations

import torch

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

_EXPONENT_BITS = 0x7F800000
_SIGN_BIT = -0x80000000  # 0x80000000 as an int32
# magnitude index of 2·|value| for each grid value (0, 1, 2, 3, 4, 6, 8, 12 -> 0..7)
_INDEX_OF_TWICE = (0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7)


def e2m1_magnitude_index(a: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid magnitude for |x| >= 0; ties go to the even index; saturates at 6.

    Midpoints 0.25, 1.25, 2.5, 5 round down (to even indices 0, 2, 4, 6) and 0.75, 1.75, 3.5 round up
    (to even indices 2, 4, 6), hence the alternating strict/non-strict comparisons. The definition;
    `round_e2m1` computes the same rounding faster (tested equal bit for bit).
    """
    return (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even code, saturating at +-6, +0 for a zero code), as float32.

    One float addition does the rounding: E2M1's step is half the power of two at or below |x| (0.5 below 1),
    and (x + C) - C with C = ±2^22 times that power of two rounds x to a multiple of the step, ties to the even
    multiple (IEEE round-to-nearest-even) — exactly the even code. ~10 passes over x instead of ~30.
    NaN gives +0 (code 0)."""
    x = x.float()
    power = x.abs().clamp_(1.0, 8.0).view(torch.int32).bitwise_and_(_EXPONENT_BITS)  # 2^floor(log2|x|), in [1, 8]
    c = power.add_(22 << 23).bitwise_or_(x.view(torch.int32).bitwise_and(_SIGN_BIT)).view(torch.float32)
    # NaN: code 0, as e2m1_encode stores it (the format has no NaN), so fake quantization computes what is packed
    return torch.add(x, c).sub_(c).clamp_(-E2M1_MAX, E2M1_MAX).nan_to_num_(0.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float tensor (already divided by its scale) -> uint8 nibble codes. Zero is always code 0 (no -0)."""
    r = round_e2m1(x)
    table = _constant(_INDEX_OF_TWICE, torch.uint8, r.device)
    mag = table[r.abs().mul_(2.0).nan_to_num_(0.0).to(torch.uint8).long()]  # NaN: code 0
    return mag | (r < 0).to(torch.uint8) << 3


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small lookup table on `device`, made once per device: building it from a Python tuple is a copy from
    pageable host memory, which waits for the device's queue (a sync per quantizer call in the experts' loops)."""
    if torch.compiler.is_compiling():  # a constant of the compiled graph
        return torch.tensor(values, dtype=dtype, device=device)
    key = (values, dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 nibble codes -> float32 values on the E2M1 grid."""
    grid = _constant(E2M1_GRID, torch.float32, codes.device)
    codes = codes.long()
    mag = grid[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)
