"""Load models back: a packed directory (experts replaced by a moesq experts module), a work dir stage
(the fake-quantized model that stage produced), or a reference model. On a Hopper GPU the packed p48-nvfp4
experts run through the fast kernel module when it is available; otherwise the CPU reference module."""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from ..engine import install_block, load_block
from ..formats import get_format
from ..models import adapter_for, load_model
from ..packing import unpack
from ..runtime.experts import MoesqExperts
from ..workdir import WorkDir, WorkDirError

log = logging.getLogger("moesq.loader")
PROJS = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))


class _PackedTensors:
    """Reads a packed directory's tensors one at a time through memory-mapped safe_open handles (never a whole
    shard at once): the weight map comes from the index or the single file's header."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path, self.handles = path, {}
        idx = path / "model.safetensors.index.json"
        try:
            files = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.is_file() else ["model.safetensors"]
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{idx}: unreadable index ({e}); run `moesq verify {path}`") from None
        self.where: dict[str, str] = {}
        for f in files:
            try:
                h = safe_open(str(path / f), "pt")
            except Exception as e:
                raise ValueError(f"{path / f}: unreadable or truncated safetensors file ({e}); run `moesq verify {path}`") from None
            self.handles[f] = h
            for k in h.keys():
                self.where[k] = f

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.handles[self.where[name]].get_tensor(name)
        except Exception as e:
            raise ValueError(f"{self.path / self.where[name]}: reading {name} failed ({e}); run `moesq verify {self.path}`") from None


def _fast_p48_available(device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        from ..runtime import p48_hopper  # noqa: F401
    except Exception as e:  # the fast module is optional; say why it is not used
        log.warning("fast p48 Hopper experts unavailable (%s); using the reference module", e)
        return False
    return True


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


def load_packed(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                act_quant: bool | None = None, fast: bool | None = None, progress=None):
    """(model, tokenizer) from a packed directory written by `moesq pack`, in any moesq format.

    The one call that loads every moesq checkpoint: routed experts become a moesq experts module (on an sm_90
    GPU the fast Hopper module when available, `fast` forces it on/off), every other tensor is copied into the
    transformers model. Tensors are read one at a time (safe_open). progress: a moesq Progress (one bar over
    the MoE blocks) or None.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; is this a directory written by `moesq pack`?")
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e}); run `moesq verify {path}`") from None
    qc = raw.get("quantization_config") or {}
    if "moesq" not in qc:
        raise ValueError(f"{path} is not a moesq packed model (config.json has no quantization_config.moesq)")
    fmt_name = qc["moesq"]["format"]
    get_format(fmt_name)  # unknown format: a clear error
    act_quant = qc["moesq"].get("act_quant", True) if act_quant is None else act_quant
    device = torch.device(device)
    raw.pop("quantization_config")
    config = AutoConfig.for_model(**raw)
    adapter = adapter_for(config)
    with _parameters_on_meta():  # no memory (nor random init) for weights that the checkpoint replaces
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = _PackedTensors(path)
    names = reader.names()
    blocks = adapter.blocks(model)
    use_fast = fmt_name == "p48-nvfp4" and (_fast_p48_available(device) if fast is None else fast)
    expert_names = set()
    with _progress_task(progress, f"loading {path.name}", len(blocks)) as task:
        for block in blocks:
            mine = [k for k in names if k.startswith(block.prefix + ".")]
            expert_names.update(mine)
            per_expert = []
            for e in range(block.num_experts):
                per_expert.append({p: {} for p, _ in PROJS})
            for k in mine:
                e, n, suffix = k[len(block.prefix) + 1:].split(".", 2)
                proj = next((p for p, pn in PROJS if pn == n), None)
                if proj is None or not e.isdigit() or int(e) >= block.num_experts:
                    raise ValueError(f"{path}: unexpected tensor {k}")
                per_expert[int(e)][proj][suffix] = reader.get(k)
            for e, t in enumerate(per_expert):
                for p, n in PROJS:
                    if not t[p]:
                        raise ValueError(f"{path}: missing tensors for {block.prefix}.{e}.{n}")
            if use_fast:
                from ..runtime.p48_hopper import P48HopperExperts

                module = P48HopperExperts.from_packed(per_expert, act_quant=act_quant, device=device)
            elif fmt_name == "s24-fp8" and act_quant and fast is not False and device.type == "cuda":
                from ..runtime.s24_hopper import S24HopperExperts, available  # CUTLASS 2:4 kernels on sm_90

                module = (S24HopperExperts.from_packed(per_expert, act_quant=act_quant, device=device) if available(device)
                          else _reference_module(fmt_name, per_expert, act_quant, block.prefix))
            else:
                module = _reference_module(fmt_name, per_expert, act_quant, block.prefix)
            block.mlp.experts = module  # the dense placeholder is dropped, not kept aside
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
        raise ValueError(f"{path}: checkpoint does not match the config (missing {still_meta[:5]}, unexpected {unexpected[:5]})")
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(path) if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file() else None
    return model, tok


def _reference_module(fmt_name: str, per_expert: list[dict], act_quant: bool, prefix: str) -> MoesqExperts:
    weights, g_in, g_mid = [], [], []
    for e, t in enumerate(per_expert):
        weights.append({p: unpack(fmt_name, t[p], f"{prefix}.{e}.{n}") for p, n in PROJS})
        for lst, p in ((g_in, "gate"), (g_mid, "down")):
            g = t[p].get("input_global_scale")
            lst.append(g.float().reshape(()) if g is not None else torch.zeros(()))  # s24: scaled per token
    ref = MoesqExperts.from_quantized(get_format(fmt_name), weights, act_quant)
    ref.act_global_in.copy_(torch.stack(g_in))
    ref.act_global_mid.copy_(torch.stack(g_mid))
    return ref


def load_workdir_model(workdir: str | Path, stage: str, device="cpu", dtype=torch.float32, act_quant: bool | None = None):
    """(model, tokenizer): the source model with each block's experts replaced by `stage`'s compressed ones."""
    wd = WorkDir(workdir)
    m = wd.load()
    st = m["stages"].get(stage)
    if st is None or not st.get("done"):
        raise WorkDirError(f"stage {stage!r} is not finished in {workdir}")
    model, tok, adapter, _ = load_model(m["model"]["path"], dtype=dtype, device=device)
    fmt = get_format(m["config"]["format"])
    act_quant = m["config"].get("act_quant", True) if act_quant is None else act_quant
    for block in adapter.blocks(model):
        results, amax_in, amax_mid = load_block(wd.verified_block(stage, block.layer_index))
        install_block(block, fmt, results, amax_in, amax_mid, act_quant, device)
    return model, tok
