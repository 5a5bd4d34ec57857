"""Normalised configs: every default filled in, validated, with a JSON-ready `to_dict()`.

A stage's identity in the work dir's manifest is the normalised dict of its config, so options typed on the
command line or left at their defaults give the same stage (`init-sgptq` then `refine` on one work dir, or
`--redo-from` on a stage another command started).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .calibration import CalibConfig

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = ASSETS / "micro-qwen3-moe"
DEFAULT_CALIB = ASSETS / "calib-sample.txt.xz"
DEFAULT_EVAL = ASSETS / "eval-sample.txt.xz"

RUN_OPTIONS = ("format", "act_quant", "calib_source", "seq_len", "n_train", "n_val", "n_init", "seed")
_CALIB_KEYS = ("seq_len", "n_train", "n_val", "n_init", "seed")


def jsonable(obj: Any) -> Any:
    """The JSON form of a config value (tuples become lists), as it is stored and compared in the manifest."""
    return json.loads(json.dumps(obj))


def normalise_calib_source(source: str | Path) -> str:
    """A local calibration file or dir as its absolute path; anything else (a Hub dataset name) as given."""
    p = Path(source).expanduser()
    return str(p.resolve()) if p.exists() else str(source)


@dataclass
class RunConfig:
    """Work-dir–level settings: a work dir holds one model, one format, one calibration set."""

    format: str = "p48-nvfp4"
    act_quant: bool = True  # W4A4 / W8A8 (the format's activation quantizer) vs weights only
    calib: CalibConfig = field(default_factory=CalibConfig)
    calib_source: str = str(DEFAULT_CALIB)

    def __post_init__(self):
        from .formats import get_format

        get_format(self.format)  # an unknown format is refused here, naming the known ones
        self.act_quant = bool(self.act_quant)
        self.calib_source = normalise_calib_source(self.calib_source)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["calib"] = self.calib.to_dict()
        return d

    def flat(self) -> dict:
        """The options a command line gives (format, act_quant, calib_source, seq_len, …)."""
        return {"format": self.format, "act_quant": self.act_quant, "calib_source": self.calib_source,
                **self.calib.to_dict()}

    @classmethod
    def from_options(cls, options: dict, defaults: dict | None = None) -> "RunConfig":
        """From flat options (RUN_OPTIONS; None = not given) over `defaults` over the built-in defaults."""
        opts = {k: v for k, v in {**(defaults or {}), **options}.items() if v is not None}
        unknown = sorted(set(opts) - set(RUN_OPTIONS))
        if unknown:
            raise ValueError(f"unknown run option(s) {', '.join(unknown)}; valid: {', '.join(RUN_OPTIONS)}")
        kw = {k: opts[k] for k in ("format", "act_quant", "calib_source") if k in opts}
        return cls(**kw, calib=CalibConfig(**{k: opts[k] for k in _CALIB_KEYS if k in opts}))

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        return cls.from_options({**{k: v for k, v in d.items() if k != "calib"}, **d.get("calib", {})})


@dataclass(frozen=True)
class MethodConfig:
    """A one-shot method and its options, normalised to every option of the method (defaults filled in)."""

    name: str = "sgptq"
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        from .methods.registry import get_method, method_options

        method = get_method(self.name, **self.options)  # refuses unknown methods and options
        full = {k: getattr(method, k) for k in method_options(self.name)} if dataclasses.is_dataclass(method) else {}
        object.__setattr__(self, "options", jsonable(full))

    def build(self):
        from .methods.registry import get_method

        return get_method(self.name, **self.options)

    def check_format(self, fmt) -> None:
        """Refuse a method that cannot compress this format before any work (GPTQ needs a dense format)."""
        if getattr(self.build(), "dense_only", False) and not fmt.patterns.is_dense:
            raise ValueError(f"method {self.name!r} is GPTQ on a dense format; format {fmt.name!r} is sparse: "
                             "use method 'sgptq' for sparse formats")

    def to_dict(self) -> dict:
        return {"method": self.name, "options": dict(self.options)}


def refine_identity(rcfg, init_stage: str) -> dict:
    """The manifest identity of a refinement stage: its init stage and the full RefineConfig."""
    return {"method": "refine", "init": init_stage, "refine": jsonable(asdict(rcfg))}
