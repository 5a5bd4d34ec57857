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


def refine_identity(rcfg, init: MethodConfig) -> dict:
    """The manifest identity of a refinement stage: its (in-loop) init method's normalised config and the full
    RefineConfig — without the end-to-end options when there is no end-to-end step (they change nothing then,
    and stages recorded before they existed keep their identity; `e2e_loss` too when it is the KL), and without `init_split_rows` when it is
    off (stages recorded before it existed routed the training split alone)."""
    refine = jsonable(asdict(rcfg))
    if not rcfg.e2e_steps:
        refine = {k: v for k, v in refine.items() if not k.startswith("e2e_")}
    else:
        if rcfg.e2e_loss == "kl":  # stages recorded before e2e_loss existed trained on the KL
            del refine["e2e_loss"]
        if rcfg.e2e_memory_gb is None:  # likewise e2e_memory_gb: none meant the device's memory
            del refine["e2e_memory_gb"]
    if not rcfg.init_split_rows:
        del refine["init_split_rows"]
    return {"method": "refine", "init": init.to_dict(), "refine": refine}


@dataclass
class CompressConfig:
    """Everything `compress()` / `moesq run` does to one model: the work dir's run config (format, activation
    quantization, calibration), the one-shot init method (with refinement: computed inside refinement's block
    loop), refinement (None: the init stage only) and one-shot baselines (init-only stages, for comparison).
    `to_dict()` is normalised (every default filled in); recipes are its YAML form."""

    format: str = "p48-nvfp4"
    act_quant: bool = True
    calib: CalibConfig = field(default_factory=CalibConfig)
    calib_source: str = str(DEFAULT_CALIB)
    init: MethodConfig = field(default_factory=MethodConfig)
    refine: Any = None  # a RefineConfig, or None for the init stage only
    baselines: tuple[str, ...] = ()
    model: str | None = None  # a recipe may name its model; compress()'s model argument wins

    def __post_init__(self):
        from .methods.refine import RefineConfig

        if isinstance(self.calib, dict):
            self.calib = CalibConfig(**self.calib)
        if isinstance(self.init, dict):
            self.init = MethodConfig(self.init.get("method", "sgptq"), self.init.get("options") or {})
        elif isinstance(self.init, str):
            self.init = MethodConfig(self.init)
        if isinstance(self.refine, dict):
            self.refine = RefineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.refine.items()})
        elif self.refine is not None and not isinstance(self.refine, RefineConfig):
            raise ValueError(f"refine must be a RefineConfig, a dict of its fields or None, got {type(self.refine).__name__}")
        self.baselines = tuple(self.baselines or ())
        for b in self.baselines:
            MethodConfig(b)  # an unknown baseline is refused here
        run = self.run_config()  # validates format and calibration; normalises the source
        self.calib_source, self.act_quant = run.calib_source, run.act_quant

    def run_config(self) -> RunConfig:
        return RunConfig(self.format, self.act_quant, self.calib, self.calib_source)

    def to_dict(self) -> dict:
        return jsonable({"model": self.model, **self.run_config().to_dict(), "init": self.init.to_dict(),
                         "refine": asdict(self.refine) if self.refine is not None else None,
                         "baselines": list(self.baselines)})

    @classmethod
    def from_dict(cls, d: dict) -> "CompressConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        d = dict(d)
        if d.get("calib_source") is None:
            d.pop("calib_source", None)
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | Path) -> "CompressConfig":
        """A recipe: YAML (or JSON) with the keys of to_dict(); omitted keys take their defaults."""
        import yaml

        path = Path(path)
        try:
            d = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ValueError(f"recipe {path}: cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"recipe {path}: expected a mapping of config keys, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"recipe {path}: {e}") from None

    def with_overrides(self, **flat) -> "CompressConfig":
        """A copy with command-line–style overrides (None = not given): RUN_OPTIONS, and `epochs`,
        `steps_per_epoch` of refinement."""
        given = {k: v for k, v in flat.items() if v is not None}
        d = self.to_dict()
        for k in ("format", "act_quant", "calib_source"):
            if k in given:
                d[k] = given.pop(k)
        for k in _CALIB_KEYS:
            if k in given:
                d["calib"][k] = given.pop(k)
        for k in ("epochs", "steps_per_epoch"):
            if k in given:
                if d["refine"] is None:
                    raise ValueError(f"{k} is a refinement option, and this config has no refinement")
                d["refine"][k] = given.pop(k)
                if k == "steps_per_epoch":
                    d["refine"]["batch_rows"] = None
        if given:
            raise ValueError(f"unknown override(s) {', '.join(sorted(given))}")
        return CompressConfig.from_dict(d)
