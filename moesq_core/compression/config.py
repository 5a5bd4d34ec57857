"""Normalised configs: every default filled in, validated, with a JSON-ready `to_dict()`.

A stage's identity in the work dir's manifest is the normalised dict of its config, so options typed on the
command line or left at their defaults give the same stage (`init-sgptq` then `refine` on one work dir, or
`--redo-from` on a stage another command started).

Recipes and configs built in Python (`CompressConfig(refine={...})`) are validated alike, by pydantic over these
dataclasses (unknown keys refused, numbers finite), and every error names its key path: `refine.epochs: expected an
integer, got 'two'`, `refine.epoch: unknown key (did you mean epochs?)`. A setting `KEY=VALUE` (the command line's
`--set`) uses a recipe's key paths: `apply_settings`.
"""
from __future__ import annotations

import contextvars
import copy
import dataclasses
import difflib
import functools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

from moesq_core.compression.calibration import CalibConfig

if TYPE_CHECKING:  # imported where the config-file validator is built (_config_adapter): refinement is heavy
    from moesq_core.compression.methods.refine import RefineConfig
    from moesq_core.compression.workdir import RunIdentity

ASSETS = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_MODEL = ASSETS / "micro-qwen3-moe"
DEFAULT_CALIB = ASSETS / "calib-sample.txt.xz"
DEFAULT_EVAL = ASSETS / "eval-sample.txt.xz"

RUN_OPTIONS = ("format", "act_quant", "calib_source", "seq_len", "n_train", "n_val", "n_init", "seed", "text_column")
_CALIB_KEYS = ("seq_len", "n_train", "n_val", "n_init", "seed", "text_column")


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
        from moesq_core.formats import get_format

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

    @classmethod
    def from_identity(cls, identity: RunIdentity) -> "RunConfig":
        """The run config a work dir was made with, from its identity (WorkDir.identity)."""
        return cls.from_options({"format": identity.format_name, "act_quant": identity.act_quant,
                                 "calib_source": identity.calib_source, **identity.calib.to_dict()})


@dataclass(frozen=True)
class MethodConfig:
    """A one-shot method and its options, normalised to every option of the method (defaults filled in).
    In a config file: `{method: NAME, options: {...}}` (to_dict's form) or just the name."""

    __pydantic_config__ = {"extra": "forbid"}

    name: Annotated[str, Field(alias="method")] = "sgptq"  # the one-shot method
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        from moesq_core.compression.methods.registry import get_method, method_options, option_types

        types = option_types(self.name)  # each option's type, checked as pydantic checks a config's fields
        for k, v in self.options.items():
            try:
                TypeAdapter(types.get(k, Any), config={"allow_inf_nan": False}).validate_python(v)
            except ValidationError as e:
                err = e.errors()[0]
                what = _EXPECTED.get(err["type"].split("_")[0])
                raise ValueError(f"options.{k}: " + (f"expected {what}, got {v!r}" if what else err["msg"])) from None
        method = get_method(self.name, **self.options)  # refuses unknown methods and options
        full = {k: getattr(method, k) for k in method_options(self.name)} if dataclasses.is_dataclass(method) else {}
        object.__setattr__(self, "options", jsonable(full))

    def build(self):
        from moesq_core.compression.methods.registry import get_method

        return get_method(self.name, **self.options)

    def check_format(self, fmt) -> None:
        """Refuse a method that cannot compress this format before any work (GPTQ needs a dense format)."""
        if getattr(self.build(), "dense_only", False) and not fmt.patterns.is_dense:
            raise ValueError(f"method {self.name!r} is GPTQ on a dense format; format {fmt.name!r} is sparse: "
                             "use method 'sgptq' for sparse formats")

    def to_dict(self) -> dict:
        return {"method": self.name, "options": dict(self.options)}


def _named(key: str, check, value) -> None:
    """check(value), its ValueError prefixed with the config key it is about."""
    try:
        check(value)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def refine_identity(rcfg, init: MethodConfig) -> dict:
    """The manifest identity of a refinement stage: its (in-loop) init method's normalised config and the full
    RefineConfig — without the end-to-end options when there is no end-to-end step (they change nothing then,
    and stages recorded before they existed keep their identity; `e2e_loss` too when it is the KL, `e2e_optimizer`
    when it is Adam), and without `init_split_rows` when it is off (stages recorded before it existed routed the
    training split alone)."""
    refine = jsonable(asdict(rcfg))
    if not rcfg.e2e_steps:
        refine = {k: v for k, v in refine.items() if not k.startswith("e2e_")}
    else:
        if rcfg.e2e_loss == "kl":  # stages recorded before e2e_loss existed trained on the KL
            del refine["e2e_loss"]
        if rcfg.e2e_memory_gb is None:  # likewise e2e_memory_gb: none meant the device's memory
            del refine["e2e_memory_gb"]
        if rcfg.e2e_window == "auto":  # likewise e2e_window: the whole model where it fits
            del refine["e2e_window"]
        if rcfg.e2e_optimizer == "adam":  # likewise e2e_optimizer: Adam
            del refine["e2e_optimizer"]
    if not rcfg.init_split_rows:
        del refine["init_split_rows"]
    return {"method": "refine", "init": init.to_dict(), "refine": refine}


@dataclass
class CompressConfig:
    """Everything `compress()` / `moesq run` does to one model: the work dir's run config (format, activation
    quantization, calibration), the one-shot init method (with refinement: computed inside refinement's block
    loop), refinement (None: the init stage only) and one-shot baselines (init-only stages, for comparison).
    `to_dict()` is normalised (every default filled in); recipes are its YAML form."""

    __pydantic_config__ = {"extra": "forbid"}

    format: str = "p48-nvfp4"  # the experts' compressed format
    act_quant: bool = True  # quantize activations too (W4A4 / W8A8), or weights only
    calib: CalibConfig = field(default_factory=CalibConfig)
    calib_source: str = str(DEFAULT_CALIB)  # calibration text: a .txt/.txt.xz/.jsonl file, a dir of them, a
    # Hugging Face dataset dir (save_to_disk's, or parquet files) or a Hub dataset [org/]name[:config][@split]
    # (default: the embedded sample)
    init: Annotated[MethodConfig, BeforeValidator(lambda v: {"method": v} if isinstance(v, str) else v)] = \
        field(default_factory=MethodConfig)
    refine: RefineConfig | None = None  # None: the init stage only
    baselines: tuple[str, ...] = ()  # one-shot methods also run alone, for comparison
    model: str | None = None  # a recipe may name its model; compress()'s model argument wins

    def __post_init__(self):
        from moesq_core.compression.methods.refine import RefineConfig
        from moesq_core.formats import get_format

        if not _validating.get():  # built in Python: validated as a recipe is (from_dict), errors naming keys
            given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            if given["calib_source"] is None:
                del given["calib_source"]
            elif isinstance(given["calib_source"], Path):
                given["calib_source"] = str(given["calib_source"])
            valid = _validate(given)
            for f in dataclasses.fields(self):
                setattr(self, f.name, getattr(valid, f.name))
            return
        if isinstance(self.calib, dict):
            self.calib = CalibConfig(**self.calib)
        if isinstance(self.init, dict):
            self.init = MethodConfig(self.init.get("method", "sgptq"), self.init.get("options") or {})
        elif isinstance(self.init, str):
            self.init = MethodConfig(self.init)
        if isinstance(self.refine, dict):
            self.refine = RefineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.refine.items()})
        elif self.refine is not None and not isinstance(self.refine, RefineConfig):
            raise ValueError("refine must be a RefineConfig, a dict of its fields or None, "
                             f"got {type(self.refine).__name__}")
        self.baselines = tuple(self.baselines or ())
        for b in self.baselines:
            _named("baselines", MethodConfig, b)  # an unknown baseline is refused here
        _named("format", get_format, self.format)
        run = self.run_config()  # validates calibration; normalises the source
        self.calib_source, self.act_quant = run.calib_source, run.act_quant

    def run_config(self) -> RunConfig:
        return RunConfig(self.format, self.act_quant, self.calib, self.calib_source)

    def to_dict(self) -> dict:
        return jsonable({"model": self.model, **self.run_config().to_dict(), "init": self.init.to_dict(),
                         "refine": asdict(self.refine) if self.refine is not None else None,
                         "baselines": list(self.baselines)})

    @classmethod
    def from_dict(cls, d: dict) -> "CompressConfig":
        """From to_dict()'s form (a recipe's mapping); omitted keys take their defaults. A ValueError names
        the key path of every wrong or unknown key."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a mapping of config keys, got {type(d).__name__}")
        d = dict(d)
        if d.get("calib_source") is None:
            d.pop("calib_source", None)
        return _validate(d)

    @classmethod
    def from_file(cls, path: str | Path) -> "CompressConfig":
        """A recipe: YAML (or JSON) with the keys of to_dict(); omitted keys take their defaults."""
        path = Path(path)
        d = read_recipe(path)
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


def read_recipe(path: str | Path) -> Any:
    """A recipe file's YAML (or JSON) as written, not validated (CompressConfig.from_file validates it); a file
    that cannot be read or parsed raises ValueError naming it."""
    import yaml

    path = Path(path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"recipe {path}: cannot be read ({type(e).__name__}: {e})") from None


def apply_settings(config: dict, settings: list[tuple[str, Any]]) -> dict:
    """A copy of a config mapping (to_dict()'s or a recipe's form) with settings (key path, value) applied, the
    key paths a recipe's: `format`, `calib.seq_len`, `init.method`, `init.options.percdamp`, `refine.epochs`.
    Sections before their keys, later settings of a key win. Setting init.method to another method drops the
    init's options (they were the other method's); one of refine.steps_per_epoch / refine.batch_rows clears the
    other unless both are set; `refine` true keeps refinement (its defaults where there was none), false or null
    drops it. Validation is from_dict's."""
    d = copy.deepcopy(config)
    keys = {k for k, _ in settings}
    for key, value in sorted(settings, key=lambda kv: kv[0].count(".")):
        parts = key.split(".")
        if parts == ["refine"] and isinstance(value, bool):
            value = (d.get("refine") or {}) if value else None
        if parts[0] == "init" and isinstance(d.get("init"), str):
            d["init"] = {"method": d["init"]}
        if parts == ["init", "method"] and (d.get("init") or {}).get("method", "sgptq") != value:
            d["init"] = {"method": value}
            continue
        node = d
        for i, p in enumerate(parts[:-1]):
            if p in node and node[p] is None and p == "refine":
                raise ValueError(f"{key}: this config has no refinement")
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key}: {'.'.join(parts[:i + 1])} is not a section")
        node[parts[-1]] = value
    for a, b in (("steps_per_epoch", "batch_rows"), ("batch_rows", "steps_per_epoch")):
        if f"refine.{a}" in keys and f"refine.{b}" not in keys and isinstance(d.get("refine"), dict):
            d["refine"][b] = None
    return d


def check_setting(key: str, value: Any) -> None:
    """Validate one setting alone, over the defaults (an init option with a method that has it): a ValueError
    naming its key path."""
    base: dict = {}
    if key.startswith("init.options."):
        from .methods.registry import METHODS, method_options

        name = key.split(".", 2)[2]
        base = {"init": {"method": next((m for m in METHODS if name in method_options(m)), "sgptq")}}
    CompressConfig.from_dict(apply_settings(base, [(key, value)]))


# -- config file validation ---------------------------------------------------------------------------------
@functools.cache
def _config_adapter() -> TypeAdapter:
    from moesq_core.compression.methods.refine import RefineConfig  # noqa: F401  (resolves CompressConfig.refine's annotation here)

    return TypeAdapter(CompressConfig)


# set while pydantic builds a CompressConfig: its __post_init__ then only normalises (the fields are validated)
_validating: contextvars.ContextVar[bool] = contextvars.ContextVar("moesq_config_validating", default=False)


def _validate(d: dict) -> CompressConfig:
    """A CompressConfig from a mapping of its fields, validated by pydantic: a ValueError naming the key path of
    every wrong or unknown key."""
    token = _validating.set(True)
    try:
        return _config_adapter().validate_python(d)
    except ValidationError as e:
        raise ValueError(_error_lines(e.errors(include_url=False))) from None
    finally:
        _validating.reset(token)


def _section_keys(loc: tuple) -> list[str]:
    """The keys the mapping at `loc` (a key path) accepts, as a config file spells them."""
    from moesq_core.compression.methods.refine import RefineConfig

    cls = {(): CompressConfig, ("calib",): CalibConfig, ("refine",): RefineConfig}.get(tuple(loc))
    if tuple(loc) == ("init",):
        return ["method", "options"]
    return [f.name for f in dataclasses.fields(cls)] if cls else []


def _method_option_names() -> set[str]:
    from .methods.registry import METHODS, method_options

    return {o for m in METHODS for o in method_options(m)}


_EXPECTED = {"int": "an integer", "float": "a number", "finite": "a finite number", "bool": "true or false",
             "string": "a string", "tuple": "a list", "list": "a list", "dict": "a mapping",
             "dataclass": "a mapping of keys", "none": "null"}


def _error_lines(errors: list[dict]) -> str:
    """pydantic's errors as `key.path: what is wrong`, joined by "; ". The alternatives of a union-typed key
    (e2e_steps: an integer or "auto") make one line."""
    lines: dict[str, str | tuple] = {}  # path -> its line, or (what is expected, the input) while a union's gather
    for err in errors:
        loc = tuple(str(p) for p in err["loc"])
        if len(loc) > 1 and isinstance(err["loc"][-1], str) and not _section_keys(loc[:-1]):
            loc = loc[:-1]  # a union's member tag, not a key
        path, kind = ".".join(loc), err["type"]
        expected = _EXPECTED.get(kind.split("_")[0])
        if kind in ("unexpected_keyword_argument", "extra_forbidden"):
            valid = _section_keys(loc[:-1])
            near = difflib.get_close_matches(loc[-1], valid, n=1)
            lines[path] = (f"{path}: unknown key "
                           f"({f'did you mean {near[0]}?' if near else 'valid: ' + ', '.join(valid)})")
        elif expected and kind != "value_error":
            prev = lines.get(path)
            wanted = (prev[0] + " or " if isinstance(prev, tuple) else "") + expected
            lines[path] = (wanted, err["input"])
        else:
            msg = err["msg"].removeprefix("Value error, ")
            # a section's check that names its key first (`epochs must be >= 0`, `options.refit: ...`) names its path
            named = re.match(r"([\w.]+)(?:: | (?=must ))(.*)", msg, flags=re.S)
            if path and named:
                if named[1].split(".")[0] in _section_keys(loc):
                    path, msg = f"{path}.{named[1]}", named[2]
                elif loc == ("init",) and named[1] in _method_option_names():
                    path, msg = f"{path}.options.{named[1]}", named[2]
            lines[path] = f"{path}: {msg}" if path else msg
    return "; ".join(v if isinstance(v, str) else f"{k}: expected {v[0]}, got {v[1]!r}" for k, v in lines.items())
