"""FP8 E4M3 (float8_e4m3fn) rounding, used for NVFP4 block scales and for fp8 values."""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the nearest e4m3 value (ties to even), saturating at +-448; returns float32.

    torch's cast does not saturate (it produces NaN above the range), so clamp first.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def round_ue4m3_scale(x: torch.Tensor) -> torch.Tensor:
    """Project a positive scale onto unsigned e4m3, clamped to [2^-9, 448] so it is never zero."""
    return round_e4m3(x.float().clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
