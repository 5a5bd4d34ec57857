"""Formats own their code: outside moesq_core/formats (and the kernels and benchmarks that implement one
format each) nothing branches on a format's type or name — it calls the format interface instead."""
from __future__ import annotations

import ast
from pathlib import Path

from moesq_core.formats.registry import FORMAT_MODULES, FORMAT_NAMES

REPO = Path(__file__).resolve().parents[2]
EXEMPT = ("moesq_core/formats/", "moesq_core/serving/kernels/", "moesq_core/serving/bench/")
# Words that name a format or a number format; a comparison against a string holding one is format branching.
FORMAT_WORDS = (*FORMAT_NAMES, "dense-p48", "nvfp4", "fp8", "p48", "s24")


def _names_format(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and any(w in node.value.lower() for w in FORMAT_WORDS))


def violations(source: str, path: str) -> list[str]:
    """Lines of `source` that branch on a format's type or name, as 'path:line: what'."""
    out = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Compare) and any(_names_format(n) for n in (node.left, *node.comparators)):
            what = "compares with a format name"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and any(_names_format(a) for a in node.args)):
            what = f"{node.func.attr} of a format name"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
              and any(n.endswith(("Quantizer", "Format")) for n in _type_names(node.args[1]))):
            what = "tests a format/quantizer type"
        elif isinstance(node, ast.Dict) and any(k is not None and _names_format(k) for k in node.keys):
            what = "a table keyed by format names"
        elif isinstance(node, ast.ImportFrom) and node.module and any(
                node.module.endswith(f"formats.{m}") for m in (*FORMAT_MODULES.values(), "nvfp4", "fp8")):
            what = f"imports format module {node.module}"
        if what:
            out.append(f"{path}:{node.lineno}: {what}: {ast.get_source_segment(source, node)!r}")
    return out


def _type_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [n for e in node.elts for n in _type_names(e)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def test_no_format_branching_outside_the_formats_package():
    found = []
    for pkg in ("moesq_core", "moesq_cli"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if not rel.startswith(EXEMPT):
                found += violations(f.read_text(), rel)
    assert not found, "format-specific code outside moesq_core/formats:\n" + "\n".join(found)


def test_the_rule_catches_each_kind_of_branching():
    src = "\n".join([
        "nv = isinstance(q, NVFP4Quantizer)",
        "if fmt_name == 's24-fp8': pass",
        "x = 'W4A4' if 'nvfp4' in name else 'W8A8'",
        "ok = name.endswith('nvfp4')",
        "TAGS = {'p48-nvfp4': ['sparse']}",
        "from ..formats.s24_fp8 import MARKER",
        "if isinstance(fmt, str): pass",  # fine: not a format type
        "fmt = get_format('p48-nvfp4')",  # fine: naming a format is not branching on one
    ])
    found = violations(src, "x.py")
    assert sorted(int(v.split(":")[1]) for v in found) == [1, 2, 3, 4, 5, 6], found


def test_cli_format_choices_come_from_the_registry():
    from typer.testing import CliRunner

    from moesq_cli.app import app
    from moesq_cli.settings import all_settings

    assert all(name in all_settings()["format"].type for name in FORMAT_NAMES)  # the --help settings table
    r = CliRunner().invoke(app, ["calibrate", "--format", "int4"], env={"COLUMNS": "300"})
    assert r.exit_code == 2 and all(name in r.stderr for name in FORMAT_NAMES), r.stderr
