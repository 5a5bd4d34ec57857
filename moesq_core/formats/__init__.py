"""Hardware-native formats: shared building blocks (E2M1, E4M3, pattern sets, quantizers, packing helpers),
one module per format (p48_nvfp4, dense_nvfp4, s24_fp8, …) and the registry listing them.

Importing this package is light (the CLI lists FORMAT_NAMES without torch); everything else loads on first use.
"""
from moesq_core.formats.registry import FORMAT_NAMES, get_format

_LAZY = {
    "E2M1_GRID": "e2m1", "e2m1_decode": "e2m1", "e2m1_encode": "e2m1", "round_e2m1": "e2m1",
    "round_e4m3": "e4m3", "round_ue4m3_scale": "e4m3",
    "DENSE": "patterns", "P48": "patterns", "S24": "patterns", "PATTERN_SETS": "patterns", "PatternSet": "patterns",
    "FP8ChannelQuantizer": "quantizers", "NVFP4Quantizer": "quantizers", "nvfp4_global_scale": "quantizers",
    "Format": "base", "Layout": "base", "QuantizedWeight": "base",
}

__all__ = ["FORMATS", "FORMAT_NAMES", "get_format", *_LAZY]


def __getattr__(name):
    if name == "FORMATS":
        from moesq_core.formats.registry import formats

        return formats()
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
