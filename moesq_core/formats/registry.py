"""The formats moesq knows: one module per format in this package, each defining `FORMAT` (a `Format`).

Adding a format is adding its module and one line here. This module imports nothing heavy, so the CLI can list
the names without loading torch; the modules are imported on first use.
"""
from __future__ import annotations

import importlib

# format name -> module (moesq_core.formats.<module>)
FORMAT_MODULES = {
    "p48-nvfp4": "p48_nvfp4",
    "dense-nvfp4": "dense_nvfp4",
    "s24-fp8": "s24_fp8",
    "dense-fp8": "dense_fp8",
}
FORMAT_NAMES = tuple(FORMAT_MODULES)
_LOADED: dict = {}


def formats() -> dict:
    """{name: Format} of every registered format, in registration order."""
    if not _LOADED:
        loaded = {}
        for name, module in FORMAT_MODULES.items():
            fmt = importlib.import_module(f"{__package__}.{module}").FORMAT
            if fmt.name != name:
                raise RuntimeError(f"format module {module} defines {fmt.name!r}, registered as {name!r}")
            loaded[name] = fmt
        _LOADED.update(loaded)
    return _LOADED


def get_format(name: str):
    try:
        return formats()[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose one of: {', '.join(FORMAT_NAMES)}") from None
