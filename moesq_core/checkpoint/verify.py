"""Verify a packed Hugging Face–style model directory without loading it whole.

The directory holds config.json, whose `quantization_config` has `quant_method: "compressed-tensors"`, `format`,
`group_size`, `ignore`, a `moesq: {"format": <a registered format>, "version": 1}` sub-dict and the format's
own entries (e.g. sparse p48's `paired48_sparse` marker, read from quantization_config or the top level of
config.json). Weights live in model.safetensors or in the shards listed by model.safetensors.index.json. Every
routed-expert linear `<prefix>.mlp.experts.<e>.<gate_proj|up_proj|down_proj>` has one of its format's layouts'
tensors (moesq_core.formats) plus what the format's activation quantizer stores (`input_global_scale` float32
[1]: required where activations take a global scale, e.g. NVFP4; checked when present otherwise).

Checks, in order: the checksum manifest `moesq_pack.json` written by `moesq pack` (every file's sha256; for a
changed safetensors file the tensor(s) whose bytes changed are named, the header giving each tensor's byte range;
a missing or damaged manifest is an error, and so is an unlisted file that loaders read, e.g. a tokenizer file;
other unlisted files are a warning); then the structure, which also catches files
re-encoded by other tools: each file opens (safetensors rejects truncated files and bad headers) and the index
matches the files; the config has `quantization_status: "compressed"` and passes the format's checks
(`Format.check_config`: group size, format name, markers), and no other format's marker; per linear: dtypes
and shapes, sparsity metadata (exactly 2 kept pairs per 8-group / 2 of 4 for s24, through the format's unpack),
then `Format.check_tensors`: e4m3 values not NaN, block/row scales, weight global scales and input global scales
finite and > 0 (serving engines divide by the input scale); the format's rules over all stored layouts
(`Format.check_layouts`, e.g. p48's marker matches its layout); per expert:
all three projections present, gate/up/down shapes consistent (and equal across a layer's experts), gate and
up sharing one bit-identical weight_global_scale (NVFP4 formats; the tensor the checksums show changed is
blamed). E2M1 codes need no check: all 16 nibbles are grid values.

Files are visited one at a time with safe_open (memory-mapped); tensors are read one linear at a time.
Rendering the report is the CLI's job.
"""
from __future__ import annotations

import json
import math
import re
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moesq_core.checkpoint.checksums import PACK_MANIFEST, check_manifest
from moesq_core.compression.pack_swap import restore_interrupted_swap
from moesq_core.formats import FORMATS, get_format
from moesq_core.formats.packing import ACTIVATION_SUFFIXES, PackingError, bits_per_weight
from moesq_core.naming import EXPERT_RE, INDEX_FILE, PROJ_NAMES, PROJECTIONS, SINGLE_FILE, read_index

PROJ_ORDER = tuple(PROJ_NAMES[p] for p in PROJECTIONS)
MOESQ_VERSION = 1


@dataclass
class VerifyError:
    """What is wrong, where: a tensor (or file) name, the index of the first bad element when there is one."""

    tensor: str
    position: tuple[int, ...] | None
    problem: str

    def __str__(self) -> str:
        where = f"{self.tensor}[{', '.join(map(str, self.position))}]" if self.position is not None else self.tensor
        return f"{where}: {self.problem}"


@dataclass
class TensorRow:
    """One expert linear. shape is the logical [out, in] (() when unknown); format is the storage layout
    (e.g. p48-nvfp4, dense-p48); bits_per_weight counts the weight's stored tensors
    (input_global_scale excluded); status is "ok" or the first problem found."""

    name: str
    shape: tuple[int, ...]
    format: str
    bits_per_weight: float | None
    status: str = "ok"
    file: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class VerifyReport:
    path: str
    format: str | None = None  # moesq format from the config
    files: list[str] = field(default_factory=list)
    rows: list[TensorRow] = field(default_factory=list)
    errors: list[VerifyError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checksums: str = "absent"  # "ok" | "failed" | "absent" (no moesq_pack.json)
    checksum_files: int = 0
    changed_tensors: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        """The `moesq verify --json` document (schema "moesq.verify/1")."""
        return {
            "schema": "moesq.verify/1", "path": self.path, "ok": self.ok, "format": self.format,
            "checksums": self.checksums, "checksum_files": self.checksum_files, "files": self.files,
            "expert_linears": self.num_linears, "bits_per_weight": self.bits_per_weight,
            "errors": [{"tensor": e.tensor, "position": list(e.position) if e.position is not None else None,
                        "problem": e.problem} for e in self.errors],
            "warnings": self.warnings,
            "rows": [{"name": r.name, "shape": list(r.shape), "layout": r.format, "bits_per_weight": r.bits_per_weight,
                      "file": r.file, "status": r.status} for r in self.rows],
        }

    @property
    def first_error(self) -> VerifyError | None:
        return self.errors[0] if self.errors else None

    @property
    def bits_per_weight(self) -> float | None:
        """Weighted over the expert linears whose size is known."""
        rows = [r for r in self.rows if r.bits_per_weight is not None and r.shape]
        n = sum(math.prod(r.shape) for r in rows)
        return sum(r.bits_per_weight * math.prod(r.shape) for r in rows) / n if n else None

    @property
    def num_linears(self) -> int:
        return len(self.rows)

    def _error(self, tensor: str, problem: str, position: tuple[int, ...] | None = None,
               row: TensorRow | None = None) -> None:
        err = VerifyError(tensor, position, problem)
        self.errors.append(err)
        if row is not None and row.ok:
            row.status = str(err)


# ---- config ---------------------------------------------------------------------------------------------------


def _read_config(root: Path, report: VerifyReport) -> tuple[str | None, dict, dict]:
    """(moesq format, quantization_config, config); format None when the config is unusable."""
    path = root / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        report._error("config.json", f"missing in {root}")
        return None, {}, {}
    except (OSError, ValueError) as e:
        report._error("config.json", f"unreadable: {e}")
        return None, {}, {}
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        report._error("config.json", "no quantization_config: not a packed checkpoint")
        return None, {}, config
    if qc.get("quant_method") != "compressed-tensors":
        report._error("config.json", f"quantization_config.quant_method is {qc.get('quant_method')!r}, "
                      "expected 'compressed-tensors'")
    if qc.get("quantization_status") != "compressed":
        report._error("config.json", f"quantization_config.quantization_status is {qc.get('quantization_status')!r}, "
                      "expected 'compressed' (stock loaders treat anything else as not yet compressed)")
    moesq = qc.get("moesq")
    if not isinstance(moesq, dict):
        report._error("config.json", "quantization_config has no 'moesq' entry {format, version}")
        return None, qc, config
    fmt = moesq.get("format")
    if fmt not in FORMATS:
        report._error("config.json", f"quantization_config.moesq.format is {fmt!r}; known: {', '.join(FORMATS)}")
        return None, qc, config
    if moesq.get("version") != MOESQ_VERSION:
        report._error("config.json", f"quantization_config.moesq.version is {moesq.get('version')!r}; "
                      f"this moesq reads version {MOESQ_VERSION}")
    report.format = fmt
    for key in ("format", "ignore"):
        if key not in qc:
            report.warnings.append(f"quantization_config has no {key!r}")
    if "ignore" in qc and not isinstance(qc["ignore"], list):
        report._error("config.json", f"quantization_config.ignore is {type(qc['ignore']).__name__}, expected a list")
    for level, message in FORMATS[fmt].check_config(qc, config):
        if level == "warning":
            report.warnings.append(message)
        else:
            report._error("config.json", message)
    for other in FORMATS.values():  # another format's marker would make loaders decode the experts wrongly
        for key in other.markers:
            if other.name != fmt and qc.get(key, config.get(key)) is not None:
                report._error("config.json", f"{key} marker present but the format is {fmt}")
    return fmt, qc, config


# ---- files ----------------------------------------------------------------------------------------------------


def _weight_map(root: Path, report: VerifyReport) -> tuple[dict[str, str] | None, set[str]]:
    """(tensor name -> file from the index or the single file's header, the files that opened)."""
    try:
        wm = read_index(root)
    except ValueError as e:
        report._error(INDEX_FILE, str(e))
        return None, set()
    if wm is not None:
        files = sorted(set(wm.values()))
    elif (root / SINGLE_FILE).exists():
        wm, files = None, [SINGLE_FILE]
    else:
        report._error(SINGLE_FILE, f"no weights in {root}: neither {SINGLE_FILE} nor {INDEX_FILE}")
        return None, set()
    report.files = files
    from_headers: dict[str, str] = {}
    readable: set[str] = set()
    for f in files:
        if not (root / f).is_file():
            report._error(f, "file listed in the index does not exist")
            continue
        try:
            # Opening parses and validates the header, including that the data covers the file exactly.
            with safe_open(str(root / f), framework="pt") as h:
                keys = list(h.keys())
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            report._error(f, f"file unreadable or truncated: {e}")
            continue
        readable.add(f)
        for k in keys:
            from_headers[k] = f
    if wm is None:
        return from_headers, readable
    for k, f in wm.items():
        if from_headers.get(k, f) != f:
            report._error(k, f"the index puts it in {f} but it is in {from_headers[k]}")
    missing = [k for k, f in wm.items() if f in readable and k not in from_headers]
    if missing:
        report._error(missing[0], f"listed in the index under {wm[missing[0]]} but absent from that file "
                      f"({len(missing)} such)")
    extra = sorted(set(from_headers) - set(wm))
    if extra:
        report.warnings.append(f"{len(extra)} tensor(s) in the shards are not in the index, e.g. {extra[0]}")
    return dict(wm), readable


class _Reader:
    """Reads tensors through at most two open safetensors files (the current one and a neighbour)."""

    def __init__(self, root: Path):
        self.root = root
        self.open: OrderedDict[str, Any] = OrderedDict()

    def get(self, file: str, name: str) -> torch.Tensor:
        h = self.open.get(file)
        if h is None:
            while len(self.open) >= 2:
                _, old = self.open.popitem(last=False)
                old.__exit__(None, None, None)
            h = safe_open(str(self.root / file), framework="pt")
            h.__enter__()
            self.open[file] = h
        self.open.move_to_end(file)
        return h.get_tensor(name)

    def close(self) -> None:
        while self.open:
            _, h = self.open.popitem()
            h.__exit__(None, None, None)


# ---- values ---------------------------------------------------------------------------------------------------


# ---- main -----------------------------------------------------------------------------------------------------


def _natural(s: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s))


def _progress_hooks(progress, total: int):
    """Accepts None, an object with .task(description, total) (moesq_core.progress) or a callable(done, total)."""
    if progress is None:
        return None, lambda done: None
    if hasattr(progress, "task"):
        ctx = progress.task("verifying packed experts", total)
        task = ctx.__enter__()
        return ctx, lambda done: task.advance(1)
    return None, lambda done: progress(done, total)


def verify_packed_dir(path, progress=None, checksums_only: bool = False) -> VerifyReport:
    """Check a packed model directory; never raises for problems in the checkpoint, reports them instead.

    progress: None, a moesq_core.progress.Progress-like object, or a callable(done, total) called after each
    expert linear. checksums_only: stop after the checksum manifest (a fast integrity check; a directory
    without a manifest is then an error).
    """
    root = Path(path)
    restore_interrupted_swap(root)
    report = VerifyReport(str(root))
    if not root.is_dir():
        report._error(str(root), "not a directory")
        return report
    sums = check_manifest(root)
    if not sums.present:
        report._error(PACK_MANIFEST, "missing: a moesq pack lists every file's checksum there (deleted, or written by "
                      "another tool?); the structure is still checked below")
    else:
        report.checksums = "failed" if sums.problems else "ok"
        report.checksum_files = sums.files_checked
        report.changed_tensors = sums.changed_tensors
        for p in sums.problems:
            report._error(p.tensor or p.file, f"{p.problem}" + (f" (in {p.file})" if p.tensor else ""))
        if sums.extra_files:
            report.warnings.append(f"{len(sums.extra_files)} file(s) not written by moesq pack, "
                                   f"e.g. {sums.extra_files[0]}")
    if checksums_only:
        return report
    fmt, qc, config = _read_config(root, report)
    if fmt is None:
        return report
    wm, readable = _weight_map(root, report)
    if wm is None:
        return report

    # module -> {suffix: file}; (prefix, expert) -> {proj: module}
    linears: dict[str, dict[str, str]] = defaultdict(dict)
    experts: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
    for name, f in wm.items():
        m = EXPERT_RE.match(name)
        if m is None:
            continue
        module = name[: -len(m["suffix"]) - 1]
        linears[module][m["suffix"]] = f
        experts[(m["prefix"], int(m["expert"]))][m["proj"]] = module
    if not linears:
        report._error(report.files[0] if report.files else str(root),
                      "no routed-expert tensors (<prefix>.mlp.experts.<e>.<proj>.*) found")
        return report

    file_order = {f: i for i, f in enumerate(report.files)}

    def sort_key(module: str):
        m = EXPERT_RE.match(module + ".x")
        first_file = min(file_order.get(f, len(file_order)) for f in linears[module].values())
        return (first_file, _natural(m["prefix"]), int(m["expert"]), PROJ_ORDER.index(m["proj"]))

    order = sorted(linears, key=sort_key)
    rows: dict[str, TensorRow] = {}
    global_scales: dict[str, torch.Tensor] = {}
    reader = _Reader(root)
    ctx, tick = _progress_hooks(progress, len(order))
    try:
        for i, module in enumerate(order):
            rows[module] = _check_linear(module, linears[module], fmt, readable, reader, report, global_scales)
            report.rows.append(rows[module])
            tick(i + 1)
    finally:
        reader.close()
        if ctx is not None:
            ctx.__exit__(None, None, None)

    for tensor, problem in get_format(fmt).check_layouts([(r.name, r.format) for r in report.rows], qc, config):
        report._error(tensor, problem)
    _check_experts(experts, rows, global_scales, report, report.changed_tensors)
    return report


def _check_linear(module, files, fmt, readable, reader, report, global_scales) -> TensorRow:
    row = TensorRow(module, (), "?", None, file=min(files.values()))
    unreadable = sorted({f for f in files.values() if f not in readable})
    if unreadable:
        report._error(unreadable[0], f"cannot read {module}: its file is unreadable", row=row)
        return row
    tensors: dict[str, torch.Tensor] = {}
    for suffix, f in files.items():
        try:
            tensors[suffix] = reader.get(f, f"{module}.{suffix}")
        except Exception as e:
            report._error(f, f"reading {module}.{suffix} failed: {e}", row=row)
            return row
    fmt = get_format(fmt)
    layout = fmt.detect_layout(tensors.keys())
    row.format = layout.name
    try:
        row.shape = tuple(int(d) for d in layout.logical_shape(tensors))
    except Exception:
        pass  # a missing primary tensor: unpack below names it
    try:
        qw = layout.unpack(tensors, module)
    except PackingError as e:
        report._error(e.tensor, e.problem, e.position, row=row)
        return row
    row.shape = tuple(qw.shape)
    if len(row.shape) != 2:
        report._error(module, f"expected one [out, in] matrix per expert, got {row.shape}", row=row)
        return row
    weight = {k: v for k, v in tensors.items() if k not in ACTIVATION_SUFFIXES}
    row.bits_per_weight = bits_per_weight(weight, row.shape)
    err = fmt.check_tensors(module, layout, tensors)
    if err is not None:
        report._error(err.tensor, err.problem, err.position, row=row)
    if "weight_global_scale" in tensors:
        global_scales[module] = tensors["weight_global_scale"].clone()
    return row


def _check_experts(experts, rows, global_scales, report, changed: set[str] = frozenset()) -> None:
    layer_shapes: dict[str, tuple] = {}
    for (prefix, e), projs in sorted(experts.items(), key=lambda kv: (_natural(kv[0][0]), kv[0][1])):
        name = f"{prefix}.mlp.experts.{e}"
        missing = [p for p in PROJ_ORDER if p not in projs]
        if missing:
            report._error(name, f"expert has no {', '.join(missing)}", row=rows[next(iter(projs.values()))])
            continue
        gate, up, down = (rows[projs[p]] for p in PROJ_ORDER)
        if not (gate.ok and up.ok and down.ok):
            continue
        if up.shape != gate.shape:
            report._error(up.name, f"shape {up.shape} differs from gate_proj's {gate.shape}", row=up)
        elif down.shape != gate.shape[::-1]:
            report._error(down.name, f"shape {down.shape} does not match gate_proj {gate.shape} "
                          f"(expected {gate.shape[::-1]})", row=down)
        else:
            shapes = (gate.shape, down.shape)
            first = layer_shapes.setdefault(prefix, shapes)
            if first != shapes:
                report._error(gate.name, f"expert shapes {shapes} differ from the layer's first expert {first}",
                              row=gate)
        g_gate, g_up = global_scales.get(gate.name), global_scales.get(up.name)
        if (g_gate is not None and g_up is not None
                and not torch.equal(g_gate.view(torch.int32), g_up.view(torch.int32))):
            # blame the tensor the checksums show changed; without a manifest, name both
            gate_changed = f"{gate.name}.weight_global_scale" in changed
            up_changed = f"{up.name}.weight_global_scale" in changed
            if gate_changed and not up_changed:
                report._error(f"{gate.name}.weight_global_scale", f"{g_gate.item()!r} was changed after packing and "
                              f"now differs from up_proj's {g_up.item()!r}; gate and up of one expert must share one "
                              "weight global scale (serving fuses them)", row=gate)
            else:
                what = "was changed after packing and now differs" if up_changed else "differs"
                report._error(
                    f"{up.name}.weight_global_scale", f"{g_up.item()!r} {what} from gate_proj's {g_gate.item()!r} "
                    f"({gate.name}.weight_global_scale); gate and up of one expert must share one weight global "
                    "scale (serving fuses them)", row=up,
                )
