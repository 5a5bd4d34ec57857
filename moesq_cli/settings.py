"""Config fields on the command line: `--set KEY=VALUE` over the key paths of a recipe (`calib.seq_len`,
`init.options.percdamp`, `refine.epochs`), the options that set one field (a command's --help shows the few
typed most; the others are accepted hidden, so earlier command lines run as they did), and the list of a
command's settings in its --help.

Everything here reads moesq_core's source (the config dataclasses' fields, defaults and trailing comments,
which are each field's one help text) instead of importing it: --help must not load torch. Values are checked
by moesq_core.compression.config when a command runs (`check_setting`), so an option, `--set` and a recipe are validated
alike and give the same config.
"""
from __future__ import annotations

import ast
import difflib
import functools
import inspect
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer


# -- reading moesq_core's source ------------------------------------------------------------------------------
@functools.cache
def _module(module: str) -> tuple[ast.Module, list[str]]:
    import importlib.util

    package = Path(importlib.util.find_spec("moesq_core").origin).parent  # found, not imported
    path = package.joinpath(*module.split(".")[1:]).with_suffix(".py")
    text = path.read_text()
    return ast.parse(text), text.splitlines()


@functools.cache
def _module_constants(module: str) -> dict:
    """The module's top-level `NAME = <constant expression>`s."""
    out: dict = {}
    for n in _module(module)[0].body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            try:
                out[n.targets[0].id] = _constant(n.value, out)
            except ValueError:
                pass
    return out


def _constant(node, names: dict | None = None):
    """The value of a constant expression: literals, tuples/lists/dicts of them, unary minus, + - * / // ** on
    numbers, and `names` (a module's constants). Anything else raises ValueError (nothing is evaluated)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow}
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and names and node.id in names:
        return names[node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_constant(e, names) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_constant(k, names): _constant(v, names) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_constant(node.operand, names)
    if isinstance(node, ast.BinOp) and type(node.op) in ops:
        return ops[type(node.op)](_constant(node.left, names), _constant(node.right, names))
    raise ValueError(ast.dump(node))


def _scope(module: str, name: str):
    return next(n for n in _module(module)[0].body if getattr(n, "name", None) == name)


@functools.cache
def source_defaults(module: str, scope: str) -> dict:
    """The defaults written in moesq_core's source: the fields of dataclass `scope`, or the parameters of
    function `scope`, in `module`, where each is a constant expression. A test checks them against the
    imported objects."""
    node = _scope(module, scope)
    if isinstance(node, ast.ClassDef):
        return {f.name: f.default for f in source_fields(module, scope) if f.default is not _NO_DEFAULT}
    a = node.args
    pairs = [(arg.arg, d) for arg, d in [*zip(a.args[len(a.args) - len(a.defaults):], a.defaults),
                                         *zip(a.kwonlyargs, a.kw_defaults)] if d is not None]
    out = {}
    for name, value in pairs:
        try:
            out[name] = _constant(value, _module_constants(module))
        except ValueError:  # not a constant expression (a call): no default shown from the source
            pass
    return out


_NO_DEFAULT = object()  # a default that is not a constant expression (a call), or none


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # the annotation as written
    default: Any  # _NO_DEFAULT when not a constant expression
    help: str  # the field's trailing comment (and comment lines right below it)


@functools.cache
def source_fields(module: str, cls: str) -> tuple[Field, ...]:
    """The fields of dataclass `cls` (with those of its base classes in the module), as its source writes them."""
    _, lines = _module(module)
    node = _scope(module, cls)
    fields: dict[str, Field] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and any(getattr(n, "name", None) == base.id for n in _module(module)[0].body):
            fields.update((f.name, f) for f in source_fields(module, base.id))
    for s in node.body:
        if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)) or s.target.id.startswith("_"):
            continue
        try:
            default = _constant(s.value, _module_constants(module)) if s.value is not None else _NO_DEFAULT
        except ValueError:
            default = _NO_DEFAULT
        line = lines[s.end_lineno - 1]
        comment = [line[line.index("  # ") + 4:]] if "  # " in line else []
        j = s.end_lineno
        while comment and j < len(lines) and lines[j].strip().startswith("#"):
            comment.append(lines[j].strip().lstrip("# "))
            j += 1
        fields[s.target.id] = Field(s.target.id, ast.unparse(s.annotation), default, " ".join(comment))
    return tuple(fields.values())


@functools.cache
def _methods() -> dict[str, tuple[str, str, frozenset]]:
    """method name → (module, class, fixed options), from the method registry's source."""
    reg = "moesq_core.compression.methods.registry"
    tree, _ = _module(reg)
    where = {a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
             and n.module.startswith("moesq_core.compression.methods.") for a in n.names}
    table = next(n.value for n in tree.body if isinstance(n, ast.AnnAssign) and n.target.id == "_FACTORIES")
    return {k.value: (where[v.elts[0].id], v.elts[0].id, frozenset(_constant(v.elts[1]) or ()))
            for k, v in zip(table.keys, table.values)}


def method_names() -> tuple[str, ...]:
    return tuple(_methods())


@functools.cache
def _method_defaults() -> dict:
    tree, _ = _module("moesq_core.compression.methods.registry")
    return _constant(next(n.value for n in tree.body if isinstance(n, ast.AnnAssign) and n.target.id == "_DEFAULTS"))


# -- settings: the config's fields by key path ------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    key: str
    type: str
    default: str
    help: str


_SECTIONS = (("", "moesq_core.compression.config", "CompressConfig"),
             ("calib.", "moesq_core.compression.calibration", "CalibConfig"),
             ("refine.", "moesq_core.compression.methods.refine.trainer", "RefineConfig"))
_NOT_SETTINGS = {"calib", "init", "model"}  # sections of their own, and what --model gives


def _shown(value) -> str:
    return "-" if value is _NO_DEFAULT else "null" if value is None else str(value).lower() if isinstance(value, bool) \
        else str(value)


@functools.cache
def all_settings() -> dict[str, Setting]:
    """Every config field by key path, with its type, default and help, as the source writes them."""
    from moesq_core.formats import FORMAT_NAMES

    out = {}
    for prefix, module, cls in _SECTIONS:
        for f in source_fields(module, cls):
            if prefix or f.name not in _NOT_SETTINGS:
                typ = " | ".join(FORMAT_NAMES) if f.name == "format" and not prefix else \
                    "true | false" if f.name == "refine" and not prefix else f.type
                out[prefix + f.name] = Setting(prefix + f.name, typ, _shown(f.default), f.help)
    name = next(f for f in source_fields("moesq_core.compression.config", "MethodConfig") if f.name == "name")
    out["init.method"] = Setting("init.method", " | ".join(method_names()), _shown(name.default), name.help)
    options: dict[str, list] = {}
    for method, (module, cls, fixed) in _methods().items():
        for f in source_fields(module, cls):
            if f.name != "name" and f.name not in fixed:
                default = _method_defaults().get(method, {}).get(f.name, f.default)
                options.setdefault(f.name, []).append((method, f, _shown(default)))
    for opt, uses in options.items():
        defaults = {d for _, _, d in uses}
        default = defaults.pop() if len(defaults) == 1 else ", ".join(f"{d} ({m})" for m, _, d in uses)
        f = uses[0][1]
        out[f"init.options.{opt}"] = Setting(f"init.options.{opt}", f.type, default,
                                             f"{f.help} ({', '.join(m for m, _, _ in uses)})".strip())
    return out


_RUN_KEYS = ("format", "act_quant", "calib_source", "calib.")
COMMAND_KEYS = {  # the key paths a command takes: a key itself, or a section (ending in ".", or a name: both)
    "calibrate": _RUN_KEYS,
    "init-sgptq": (*_RUN_KEYS, "init"),
    "refine": (*_RUN_KEYS, "init.method", "refine."),  # its in-loop init takes the options of the init stage
    "run": (*_RUN_KEYS, "init", "refine", "baselines"),
}


def _takes(command: str, key: str) -> bool:
    return any(key == p or key.startswith(p if p.endswith(".") else p + ".") for p in COMMAND_KEYS[command])


def settings_of(command: str) -> list[Setting]:
    return [s for k, s in all_settings().items() if _takes(command, k)]


def key_paths(mapping: Any, prefix: str = "") -> set[str]:
    """The key paths a recipe's mapping writes, sections and their keys alike (`calib`, `calib.seq_len`, `init`,
    `init.options.percdamp`): what a recipe gives. Anything not a mapping writes none."""
    if not isinstance(mapping, dict):
        return set()
    out = set()
    for k, v in mapping.items():
        out |= {prefix + str(k), *key_paths(v, f"{prefix}{k}.")}
    return out


def parse_setting(command: str, text: str) -> tuple[str, Any]:
    """`KEY=VALUE` as (key path, value): VALUE a YAML scalar (or flow list). Raises ValueError naming what
    is wrong: no `=`, a key unknown (with the closest one) or not this command's."""
    import yaml

    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ValueError(f"{text!r}: expected KEY=VALUE, e.g. refine.epochs=4")
    if key not in all_settings():
        near = difflib.get_close_matches(key, list(all_settings()), n=1)
        raise ValueError(f"{key}: unknown key" + (f" (did you mean {near[0]}?)" if near else ""))
    if not _takes(command, key):
        raise ValueError(f"{key}: not a setting of `moesq {command}` (its keys: "
                         f"{', '.join(p + ('*' if p.endswith('.') else '') for p in COMMAND_KEYS[command])})")
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"{key}: {raw!r} is not a YAML value ({e.problem})") from None


# -- options that set one field ---------------------------------------------------------------------------------
_C, _I, _R, _U = "calibrate", "init-sgptq", "refine", "run"
_STAGES = (_C, _I, _R, _U)
# option → (key path, the commands that take it, value for a switch); --help shows an option only where SHOWN says
FLAGS: dict[str, tuple] = {
    "--format/-f": ("format", _STAGES), "--act-quant/--weights-only": ("act_quant", _STAGES),
    "--calib": ("calib_source", _STAGES), "--seq-len": ("calib.seq_len", _STAGES),
    "--n-train": ("calib.n_train", _STAGES), "--n-val": ("calib.n_val", _STAGES),
    "--n-init": ("calib.n_init", _STAGES), "--seed": ("calib.seed", _STAGES),
    "--text-column": ("calib.text_column", _STAGES),
    "--method": ("init.method", (_I, _U)), "--init": ("init.method", (_R,)),
    "--percdamp": ("init.options.percdamp", (_I,)), "--hessian-weighting": ("init.options.hessian_weighting", (_I,)),
    "--exact-scales/--fp32-scales": ("init.options.exact_scales", (_I,)),
    "--refit/--no-refit": ("init.options.refit", (_I,)),
    "--solve": ("init.options.solve", (_I,)),
    "--epochs": ("refine.epochs", (_R, _U)), "--steps-per-epoch": ("refine.steps_per_epoch", (_R, _U)),
    **{f"--{k.replace('_', '-')}": (f"refine.{k}", (_R,)) for k in (
        "batch_rows", "micro_batch_rows", "chunk_gb", "lr_logits", "lr_values", "loss_power", "e2e_steps", "e2e_lr",
        "e2e_batch_size", "e2e_memory_gb", "e2e_loss", "e2e_window", "e2e_optimizer")},
    "--values-only": ("refine.train_support", (_R,), False), "--support-only": ("refine.train_values", (_R,), False),
    "--refine-seed": ("refine.seed", (_R,)),
    "--init-split-rows/--no-init-split-rows": ("refine.init_split_rows", (_R,)),
    "--baselines": ("baselines", (_U,)), "--refine/--no-refine": ("refine", (_U,)),
}
SHOWN = {_C: ("--format/-f", "--calib", "--seq-len"), _I: ("--method", "--format/-f"), _R: ("--epochs",),
         _U: ("--format/-f", "--calib")}


def _param_name(flag: str) -> str:
    return flag.split("/")[0].lstrip("-").replace("-", "_")


def config_params(command: str) -> set[str]:
    """The names of a command's parameters that set a config field (FLAGS): the Settings panel lists them."""
    return {_param_name(flag) for flag, (_, commands, *_) in FLAGS.items() if command in commands}


def options_of(command: str) -> dict[str, list[str]]:
    """key path → the options of `command` that set it, one a line as its Settings panel shows them under the
    key (`--format, -f`; each of a pair of switches; a switch with the value it sets: `--values-only: false`)."""
    out: dict[str, list[str]] = {}
    for flag, (key, commands, *const) in FLAGS.items():
        if command in commands:
            names = flag.split("/")
            lines = [", ".join(names)] if "/-" in flag and "/--" not in flag else names
            out.setdefault(key, []).extend(f"{n}: {_shown(const[0])}" if const else n for n in lines)
    return out


def _kind(key: str) -> tuple[type, str | None, Any]:
    """An option's click type, metavar and conversion of its value to the setting's, from the field's type."""
    typ = all_settings()[key].type
    if key == "baselines":
        return str, "M1,M2", lambda v: [b.strip() for b in v.split(",") if b.strip()]
    if typ == "int | str":  # a number or a word (e2e_steps, e2e_window: N or auto)
        return str, "N|auto", lambda v: int(v) if re.fullmatch(r"-?\d+", v) else v
    for t in (bool, int, float):
        if re.fullmatch(rf"{t.__name__}( \| None)?", typ):
            return t, None, None
    return str, None, None


def _check(command: str, key: str, const=None, convert=None):
    """The callback of an option that sets `key`: its value checked as a config's (usage error, exit 2)."""
    def check(value):
        if value is None or (const is not None and value is False):
            return value
        v = const if const is not None else convert(value) if convert else value
        from moesq_core.compression.config import check_setting

        try:
            if key == "calib_source":
                check_calib_source(v)
            check_setting(key, v)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        return value
    return check


def check_calib_source(value: str) -> None:
    from moesq_core.compression.calibration import is_hub_dataset_name

    if not Path(value).expanduser().exists() and not is_hub_dataset_name(value):
        raise ValueError(f"{value}: no such file or directory (or a Hub dataset '[org/]name[:config][@split]')")


def with_config_options(command: str):
    """Adds to a command the options that set config fields (FLAGS) and `--set`, and calls it with
    `settings`: [(key path, value, what gave it: the option, or --set)], options first, --set last (it wins)."""
    def set_check(values):
        out = []
        for text in values or ():
            try:
                key, value = parse_setting(command, text)
                from moesq_core.compression.config import check_setting

                check_setting(key, value)
            except ValueError as e:
                raise typer.BadParameter(str(e)) from None
            out.append((key, value))
        return out

    def deco(fn):
        from rich.markup import escape

        sig = inspect.signature(fn, eval_str=True)
        specs, params = [], [p for p in sig.parameters.values() if p.name != "settings"]
        for flag, (key, commands, *const) in FLAGS.items():
            if command not in commands:
                continue
            const = const[0] if const else None
            decls = flag.split("/") if "/-" in flag and "/--" not in flag else [flag]
            hidden = flag not in SHOWN.get(command, ())
            s = all_settings()[key]
            help = None if hidden else escape(f"{s.help[:1].upper()}{s.help[1:]} ({key})")
            if const is not None or "/--" in flag:
                typ, metavar, convert = bool, None, None
            else:
                typ, metavar, convert = _kind(key)
            opt = typer.Option(*decls, hidden=hidden, help=help, metavar=metavar,
                               callback=_check(command, key, const, convert))
            annotation = Annotated[bool, opt] if const is not None else Annotated[Optional[typ], opt]
            params.append(inspect.Parameter(_param_name(flag), inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                            default=False if const is not None else None))
            specs.append((_param_name(flag), key, flag if "/--" in flag else flag.split("/")[0], const, convert))
        params.append(inspect.Parameter("set_", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", callback=set_check, help=(
                "A config field, by a recipe's key path (repeatable; below; over --recipe and the options): "
                "e.g. refine.epochs=4, calib.seq_len=256."))]))

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            settings = []
            for name, key, flag, const, convert in specs:
                value = kw.pop(name)
                if const is not None and value:  # a switch
                    settings.append((key, const, flag))
                elif const is None and value is not None:
                    settings.append((key, convert(value) if convert else value, flag))
            settings += [(k, v, "--set") for k, v in kw.pop("set_") or ()]
            return fn(*a, settings=settings, **kw)

        params.sort(key=lambda p: p.kind)
        wrapper.__signature__ = sig.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper
    return deco


def as_given(msg: str, settings: list[tuple[str, Any, str]]) -> str:
    """A config error with each key that an option gave named as that option (`--epochs`), as the user typed it."""
    for key, _, given in settings:
        if given != "--set":
            field = key.rsplit(".", 1)[-1]
            msg = re.sub(rf"(?<![\w.-]){re.escape(key)}\b|(?<![\w.-]){re.escape(field)}\b", given, msg)
    return msg


def settings_panel(command: str):
    """The --help panel listing a command's settings: key path (with the options that set it below it), type,
    default, help."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    table = Table(box=None, show_header=True, header_style="bold", padding=(0, 1), expand=True)
    for c, kw in (("key", {"style": "bold cyan", "no_wrap": True}), ("type", {"style": "yellow", "max_width": 16}),
                  ("default", {"max_width": 14}), ("", {"ratio": 1})):
        table.add_column(c, **kw)
    options = options_of(command)
    for s in settings_of(command):
        key = "\n".join([escape(s.key), *(f"  [not bold]{escape(o)}[/]" for o in options.get(s.key, ()))])
        table.add_row(key, *map(escape, (s.type, s.default, s.help)))
    return Panel(table, border_style="dim",
                 title="Settings: --set KEY=VALUE, a --recipe's keys, or the options below a key",
                 title_align="left")
