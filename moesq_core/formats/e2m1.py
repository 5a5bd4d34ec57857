"""FP4 E2M1 values: the grid, round-to-nearest with ties to the even code, codes.

A code is a nibble: sign << 3 | magnitude index, magnitude index into E2M1_GRID.
"""
from __future__ import annotations

import torch

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def e2m1_magnitude_index(a: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid magnitude for |x| >= 0; ties go to the even index; saturates at 6.

    Midpoints 0.25, 1.25, 2.5, 5 round down (to even indices 0, 2, 4, 6) and 0.75, 1.75, 3.5 round up
    (to even indices 2, 4, 6), hence the alternating strict/non-strict comparisons.
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


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float tensor (already divided by its scale) -> uint8 nibble codes. Zero is always code 0 (no -0)."""
    mag = e2m1_magnitude_index(x.abs())
    sign = ((x < 0) & (mag > 0)).to(torch.uint8)
    return (sign << 3) | mag


_GRIDS: dict[torch.device, torch.Tensor] = {}


def _grid(device: torch.device) -> torch.Tensor:
    """E2M1_GRID on `device`, made once per device: building it from the Python tuple is a copy from pageable
    host memory, which waits for the device's queue (a sync per quantizer call in the experts' loops)."""
    if torch.compiler.is_compiling():  # a constant of the compiled graph
        return torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)
    g = _GRIDS.get(device)
    if g is None:
        g = _GRIDS[device] = torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)
    return g


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 nibble codes -> float32 values on the E2M1 grid."""
    grid = _grid(codes.device)
    codes = codes.long()
    mag = grid[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even code, saturating at +-6), as float32."""
    return e2m1_decode(e2m1_encode(x)).to(x.dtype)
