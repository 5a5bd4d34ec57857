"""Method names → Method objects: `get_method("sgptq", percdamp=0.1)`.

Options are the fields of each method's dataclass; unknown options are refused with the list of valid
ones, so a typo on the command line does not silently fall back to a default.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable

from moesq_core.compression.methods.base import Method
from moesq_core.compression.methods.jsq import JSQ
from moesq_core.compression.methods.obr import OBR
from moesq_core.compression.methods.rtn import RTN, Magnitude
from moesq_core.compression.methods.sparsegpt_gptq import SGPTQ
from moesq_core.compression.methods.wanda import Wanda

_FACTORIES: dict[str, tuple[Callable[..., Method], dict[str, Any]]] = {
    "rtn": (RTN, {}),
    "magnitude": (Magnitude, {}),
    "wanda": (Wanda, {}),
    "jsq": (JSQ, {}),
    "obr": (OBR, {}),
    "sgptq": (SGPTQ, {}),
    # GPTQ is SGPTQ on a dense format; asking it for a sparse format is an error (see SGPTQ.dense_only).
    "gptq": (SGPTQ, {"name": "gptq", "dense_only": True}),
}
# Defaults that differ from the class's own (the caller may override them). sgptq refits its values on
# SparseGPT's support: lower perplexity than plain SGPTQ on both shared models, alone and as refinement's init
# (benchmarks/results/accuracy_embedded_run-budget.md, accuracy_tiny_budget.md); --no-refit is the paper's SGPTQ.
_DEFAULTS: dict[str, dict[str, Any]] = {"sgptq": {"refit": True}}

METHODS: tuple[str, ...] = tuple(_FACTORIES)


def method_options(name: str) -> list[str]:
    """The options `get_method(name, ...)` accepts."""
    factory, fixed = _lookup(name)
    if dataclasses.is_dataclass(factory):
        return [f.name for f in dataclasses.fields(factory) if f.init and f.name not in fixed and f.name != "name"]
    return []


def option_types(name: str) -> dict[str, Any]:
    """The type of each option of `get_method(name, ...)`, from its dataclass."""
    factory, _ = _lookup(name)
    hints = typing.get_type_hints(factory) if dataclasses.is_dataclass(factory) else {}
    return {k: hints[k] for k in method_options(name)}


def _lookup(name: str):
    try:
        return _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(_FACTORIES)}") from None


def get_method(name: str, **options: Any) -> Method:
    factory, fixed = _lookup(name)
    valid = method_options(name)
    bad = sorted(set(options) - set(valid)) if dataclasses.is_dataclass(factory) else []
    if bad:
        raise ValueError(f"method {name!r} has no option(s) {', '.join(bad)}; "
                         f"valid options: {', '.join(valid) or '(none)'}")
    return factory(**{**_DEFAULTS.get(name, {}), **options, **fixed})
