"""Hardware-native formats: pattern sets, value quantizers and the named formats built from them."""
from .e2m1 import E2M1_GRID, e2m1_decode, e2m1_encode, round_e2m1
from .e4m3 import round_e4m3, round_ue4m3_scale
from .patterns import DENSE, P48, PATTERN_SETS, S24, PatternSet
from .quantizers import FP8ChannelQuantizer, NVFP4Quantizer, nvfp4_global_scale
from .registry import FORMATS, Format, QuantizedWeight, get_format

__all__ = [
    "E2M1_GRID", "e2m1_decode", "e2m1_encode", "round_e2m1", "round_e4m3", "round_ue4m3_scale",
    "DENSE", "P48", "S24", "PATTERN_SETS", "PatternSet", "FP8ChannelQuantizer", "NVFP4Quantizer",
    "nvfp4_global_scale", "FORMATS", "Format", "QuantizedWeight", "get_format",
]
