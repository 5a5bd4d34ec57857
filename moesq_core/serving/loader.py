"""Load models back: a packed directory (experts replaced by a moesq experts module), a work dir stage
(the fake-quantized model that stage produced), or a reference model. The format builds the experts module
that serves it (`serving.experts.make_experts`: a fast GPU module where it has one, else the reference module)."""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from moesq_core.checkpoint.checksums import PACK_MANIFEST, ManifestCheck
from moesq_core.formats import get_format
from moesq_core.models import adapter_for
from moesq_core.naming import INDEX_FILE, PROJECTIONS, SINGLE_FILE, expert_linear, parse_expert_tensor, weight_files
from moesq_core.serving.experts import make_experts

log = logging.getLogger(__name__)


class _PackedTensors:
    """Reads a packed directory's tensors one at a time through memory-mapped safe_open handles (never a whole
    shard at once): the weight map comes from the index or the single file's header."""

    def __init__(self, path: Path, check: ManifestCheck | None):
        from safetensors import safe_open

        self.path, self.handles, self.check = path, {}, check
        try:
            files = weight_files(path) or [SINGLE_FILE]
        except ValueError as e:
            raise ValueError(f"{path / INDEX_FILE}: {e}; run `moesq verify {path}`") from None
        self.where: dict[str, str] = {}
        for f in files:
            try:
                h = safe_open(str(path / f), "pt")
            except Exception as e:
                raise ValueError(f"{path / f}: unreadable or truncated safetensors file ({e}); "
                                 f"run `moesq verify {path}`") from None
            self.handles[f] = h
            for k in h.keys():
                self.where[k] = f

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        try:
            t = self.handles[self.where[name]].get_tensor(name)
        except Exception as e:
            raise ValueError(f"{self.path / self.where[name]}: reading {name} failed ({e}); "
                             f"run `moesq verify {self.path}`") from None
        if self.check is not None:
            self.check.tensor(self.where[name], name, t)
        return t


@contextlib.contextmanager
def _parameters_on_meta():
    """Build a model with its parameters on the meta device (buffers stay real: rotary tables are computed in
    __init__); load_packed then gives every parameter its checkpoint tensor."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _progress_task(progress, description: str, total: int):
    """A rich-style task context from a moesq Progress, or a no-op."""
    if progress is None or not hasattr(progress, "task"):
        return contextlib.nullcontext(None)
    return progress.task(description, total)


def install_packed_experts(block, reader: _PackedTensors, fmt, act_quant: bool, device: torch.device,
                           fast: bool | None = None) -> list[str]:
    """Replace `block`'s routed experts with the module `fmt` serves the pack's tensors with (built for
    `device`, see serving.experts.make_experts); returns the names of the tensors it consumed. ValueError, naming the
    pack, for a tensor that belongs to no expert of the block or an expert linear without tensors."""
    path = reader.path
    mine = [k for k in reader.names() if k.startswith(block.prefix + ".")]
    per_expert = [{p: {} for p in PROJECTIONS} for _ in range(block.num_experts)]
    for k in mine:
        parsed = parse_expert_tensor(k)
        if parsed is None or parsed[0] != block.prefix or parsed[1] >= block.num_experts:
            raise ValueError(f"{path}: unexpected tensor {k}")
        _, e, p, suffix = parsed
        per_expert[e][p][suffix] = reader.get(k)
    for e, t in enumerate(per_expert):
        for p in PROJECTIONS:
            if not t[p]:
                raise ValueError(f"{path}: missing tensors for {expert_linear(block.prefix, e, p)}")
    # the dense placeholder is dropped
    block.mlp.experts = make_experts(fmt, per_expert, act_quant, device, fast, block.prefix)
    return mine


def load_packed(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                act_quant: bool | None = None, fast: bool | None = None, progress=None, verify: bool = True):
    """(model, tokenizer) from a packed directory written by `moesq pack`, in any moesq format.

    The one call that loads every moesq checkpoint: routed experts become the module the format serves them
    with (a fast GPU module where the format has one for `device`; `fast` forces it on/off), every other tensor
    is copied into the transformers model. Tensors are read one at a time (safe_open). progress: a moesq Progress
    (one bar over the MoE blocks) or None. verify (default): load only what `moesq pack` wrote: every file and
    tensor is checked against the checksum manifest as it is read (checksums.ManifestCheck; a missing manifest, a
    changed byte or an unlisted file that loaders read raises ValueError naming the file and tensor); verify=False
    skips that, and says so in the log.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; is this a directory written by `moesq pack`?")
    if verify:
        check = ManifestCheck(path)
    else:
        check = None
        log.warning("%s: loading without checking its files against %s (verify off)", path, PACK_MANIFEST)
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e}); run `moesq verify {path}`") from None
    qc = raw.get("quantization_config") or {}
    if "moesq" not in qc:
        raise ValueError(f"{path} is not a moesq packed model (config.json has no quantization_config.moesq)")
    fmt = get_format(qc["moesq"]["format"])  # unknown format: a clear error
    act_quant = qc["moesq"].get("act_quant", True) if act_quant is None else act_quant
    device = torch.device(device)
    raw.pop("quantization_config")
    config = AutoConfig.for_model(**raw)
    adapter = adapter_for(config)
    with _parameters_on_meta():  # no memory (nor random init) for weights that the checkpoint replaces
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = _PackedTensors(path, check)
    names = reader.names()
    blocks = adapter.blocks(model)
    expert_names = set()
    with _progress_task(progress, f"loading {path.name}", len(blocks)) as task:
        for block in blocks:
            expert_names.update(install_packed_experts(block, reader, fmt, act_quant, device, fast))
            if task is not None:
                task.advance(1)
    state = model.state_dict(keep_vars=True)
    unexpected = []
    for k in names:
        if k in expert_names:
            continue
        target = state.get(k)
        if target is None or ".mlp.experts." in k:
            unexpected.append(k)
            continue
        t = reader.get(k)
        if tuple(t.shape) != tuple(target.shape):
            raise ValueError(f"{path}: {k} has shape {tuple(t.shape)}, the config expects {tuple(target.shape)}")
        owner, _, leaf = k.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(t.to(target.dtype), requires_grad=False)
        else:
            module._buffers[leaf] = t.to(target.dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise ValueError(f"{path}: checkpoint does not match the config (missing {still_meta[:5]}, "
                         f"unexpected {unexpected[:5]})")
    if check is not None:
        log.info("%s: %d files checked against %s while loading", path, check.finish(), PACK_MANIFEST)
    model.to(device).eval()
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return model, tok
