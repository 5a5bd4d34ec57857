"""One adapter per transformers 5.x MoE family, over a shared protocol.

transformers 5.x stores every supported family's routed experts fused (`experts.gate_up_proj` [E, 2I, H],
gate rows first; `experts.down_proj` [E, H, I]) behind one call signature,
`experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`, and every router returns
`(logits, top_k_weights, top_k_index)` exactly as the block combines them (softmax/sigmoid, renormalisation,
group-limited top-k, routed_scaling_factor). So routing is reproduced exactly by calling the model's own
router, and an expert swap is replacing `block.experts`. What differs per family is recorded here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moesq_core.models.errors import CheckpointError, UnsupportedModelError
from moesq_core.naming import experts_prefix
from moesq_core.paths import model_dir_or_hub_id

# bytes per element of the safetensors dtypes; others (sub-byte formats) are only checked to lie in the file
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def check_safetensors(file: Path) -> None:
    """Read a safetensors file's header (not its tensors) and raise CheckpointError naming the file unless
    every tensor's dtype, shape and byte range fit inside it."""
    file = Path(file)

    def damaged(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: damaged weight file ({what}); restore or re-download the model")

    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise damaged(f"{size} bytes, shorter than a safetensors header")
        n = int.from_bytes(prefix, "little")
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise damaged(f"its header claims {n:,} bytes of the file's {size:,}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError):
            raise damaged("its header is not JSON") from None
    data_bytes = size - 8 - n
    if not isinstance(header, dict):
        raise damaged("its header is not a table of tensors")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            raise damaged(f"tensor {name!r} has no valid dtype, shape and data offsets") from None
        numel = 1
        for d in shape:
            numel *= d
        if dtype in _DTYPE_BYTES and numel * _DTYPE_BYTES[dtype] != end - begin:
            raise damaged(f"tensor {name!r} of shape {shape} {dtype} needs {numel * _DTYPE_BYTES[dtype]:,} bytes, "
                          f"its header gives it {end - begin:,}")
        if not begin <= end <= data_bytes:
            raise damaged(f"tensor {name!r} lies at bytes {begin:,}..{end:,} of {data_bytes:,}: the file is truncated")


@dataclass(frozen=True)
class MoEAdapter:
    family: str
    model_types: tuple[str, ...]
    router: str  # how the router weights tokens (for docs and model cards)
    extras: str = ""  # what else the MoE block holds that moesq leaves untouched

    def blocks(self, model: nn.Module) -> list["MoEBlock"]:
        layers = _decoder_layers(model)
        out = []
        for i, layer in enumerate(layers):
            mlp = getattr(layer, "mlp", None)
            experts = getattr(mlp, "experts", None)
            if experts is not None and hasattr(mlp, "gate"):
                out.append(MoEBlock(self, i, layer, mlp))
        if not out:
            raise UnsupportedModelError(f"no routed-expert blocks found in this {self.family} model")
        return out


SUPPORTED: dict[str, MoEAdapter] = {
    a.family: a
    for a in (
        MoEAdapter("qwen3-moe", ("qwen3_moe",), "softmax top-k, renormalised when norm_topk_prob"),
        MoEAdapter("qwen2-moe", ("qwen2_moe",), "softmax top-k, renormalised when norm_topk_prob",
                   "a shared expert scaled by sigmoid(shared_expert_gate) (kept at source precision)"),
        MoEAdapter("mixtral", ("mixtral",), "softmax top-k, always renormalised"),
        MoEAdapter("deepseek-v3", ("deepseek_v3", "kimi_k2"),
                   "sigmoid scores + correction bias, group-limited top-k, renormalised, x routed_scaling_factor",
                   "shared experts and the first dense layers (kept at source precision)"),
        MoEAdapter("olmoe", ("olmoe",), "softmax top-k, renormalised when norm_topk_prob"),
    )
}
_BY_MODEL_TYPE = {t: a for a in SUPPORTED.values() for t in a.model_types}


def supported_list() -> str:
    return ", ".join(f"{a.family} ({'/'.join(a.model_types)})" for a in SUPPORTED.values())


def adapter_for(config_or_model) -> MoEAdapter:
    config = getattr(config_or_model, "config", config_or_model)
    model_type = getattr(config, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    n_experts = (
        getattr(config, "num_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "n_routed_experts", None)
    )
    what = "a dense (non-MoE) model" if not n_experts else "an MoE architecture moesq has no adapter for"
    raise UnsupportedModelError(
        f"model_type {model_type!r} is {what}. moesq compresses routed experts of: {supported_list()}."
    )


def check_unquantized(config_or_model, source: str | Path) -> None:
    """Refuse a checkpoint that is already quantized (its config has a `quantization_config`): moesq would read
    its stored codes as if they were weights (an fp8 pack's codes without their scales, a packed NVFP4 pack not
    at all). Raises UnsupportedModelError naming the quantization."""
    config = getattr(config_or_model, "config", config_or_model)
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return
    qc = qc if isinstance(qc, dict) else qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    what = f"quant_method {qc.get('quant_method', '?')!r}"
    if qc.get("format"):
        what += f", format {qc['format']!r}"
    moesq = qc.get("moesq")
    if isinstance(moesq, dict):
        what = f"a moesq {moesq.get('format', '?')} pack; {what}"
    raise UnsupportedModelError(
        f"model {source} is already quantized (quantization_config: {what}); moesq compresses an unquantized "
        "(bf16/fp16/fp32) checkpoint: pass the model it was made from")


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"cannot find decoder layers in {type(model).__name__}")
    return layers


@dataclass
class MoEBlock:
    """One MoE block (the `mlp` of decoder layer `layer_index`)."""

    adapter: MoEAdapter
    layer_index: int
    layer: nn.Module
    mlp: nn.Module

    @property
    def experts(self) -> nn.Module:
        return self.mlp.experts

    @property
    def num_experts(self) -> int:
        return self.dense_experts.num_experts

    @property
    def prefix(self) -> str:
        """Checkpoint name prefix of this block's experts (per-expert tensors on disk)."""
        return experts_prefix(self.layer_index)

    @torch.no_grad()
    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top_k_index [T, k], top_k_weights [T, k]) exactly as the block computes them for hidden [T, H]."""
        _, weights, index = self.mlp.gate(hidden.reshape(-1, hidden.shape[-1]))
        return index, weights

    @property
    def dense_experts(self) -> nn.Module:
        """The model's original experts module, even after a swap (kept aside by set_experts)."""
        return getattr(self.mlp, "_moesq_dense_experts", None) or self.mlp.experts

    def expert_weights(self, e: int) -> dict[str, torch.Tensor]:
        """Dense fp32 (gate [I, H], up [I, H], down [H, I]) of the original expert e."""
        ex = self.dense_experts
        if hasattr(ex, "expert_weights"):  # a lazily opened model reads the one expert from the checkpoint
            return ex.expert_weights(e)
        gu = ex.gate_up_proj[e].detach().float()
        inter = gu.shape[0] // 2
        return {"gate": gu[:inter].clone(), "up": gu[inter:].clone(), "down": ex.down_proj[e].detach().float().clone()}

    def set_experts(self, module: nn.Module) -> None:
        """Swap in a module with the fused-experts call signature. The original is kept aside (not as a
        submodule, so it is neither saved nor moved) for later stages that need the dense weights.

        On a lazily opened model this frees the block's materialised dense weights and releases the modules
        installed earlier in other blocks, so one block's worth of experts is held at a time."""
        from moesq_core.models.lazy import LazyExperts, release_installed

        if not hasattr(self.mlp, "_moesq_dense_experts"):
            object.__setattr__(self.mlp, "_moesq_dense_experts", self.mlp.experts)
        self.mlp.experts = module
        dense = self.dense_experts
        if isinstance(dense, LazyExperts) and module is not dense:
            dense.release()
            release_installed(dense.model_mlps, keep=self.mlp)

    def release_installed(self) -> None:
        """On a lazily opened model, free this block's installed experts (a later forward through the block
        raises, naming the release); an eagerly loaded model keeps them. The engine calls it once the block
        has propagated the calibration states, so the next block's install does not find it still held."""
        from moesq_core.models.lazy import LazyExperts, ReleasedExperts

        dense = self.dense_experts
        if isinstance(dense, LazyExperts) and self.mlp.experts is not dense:
            dense.release()
            self.mlp.experts = ReleasedExperts(self.layer_index, self.num_experts)

    def restore_dense(self) -> None:
        self.mlp.experts = self.dense_experts


@torch.no_grad()
def checkpoint_difference(model: nn.Module, path: Path) -> str | None:
    """The name of the first parameter or buffer of a loaded transformers MoE model whose value differs from the
    checkpoint at `path` as transformers loads it (in the model's dtype), or that the checkpoint lacks; None when
    the model holds exactly the checkpoint's weights. Reads the checkpoint once, one block's experts at a time.
    Tensors the model keeps on the meta device (offloaded by a device_map) are not compared."""
    from transformers import AutoConfig

    from moesq_core.models.lazy import load_lazy

    config = AutoConfig.from_pretrained(path)
    adapter = adapter_for(config)
    reference = load_lazy(Path(path), config, adapter, model.dtype, "cpu")
    mine = model.state_dict()

    def differs(have: torch.Tensor | None, want: torch.Tensor) -> bool:
        if have is None:
            return True
        if have.device.type == "meta":
            return False
        return tuple(have.shape) != tuple(want.shape) or not torch.equal(have.detach().cpu(), want.to(have.dtype))

    wanted = reference.state_dict()
    for name, want in wanted.items():
        if differs(mine.get(name), want):
            return name
    blocks = adapter.blocks(model)
    for block, ref_block in zip(blocks, adapter.blocks(reference), strict=True):
        gate_up, down = ref_block.dense_experts.load_dense()
        for proj, want in (("gate_up_proj", gate_up), ("down_proj", down)):
            if differs(getattr(block.dense_experts, proj, None), want):
                return f"{block.prefix}.{proj}"
    experts = tuple(block.prefix + "." for block in blocks)
    return next((name for name in mine if name not in wanted and not name.startswith(experts)), None)


def read_config(source: str | Path) -> dict:
    p = Path(source)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{source}: no config.json (expected a model directory)")
    return json.loads((p / "config.json").read_text())


def resolve_model_path(source: str) -> Path:
    """A local directory as is; otherwise a Hub id, downloaded (or taken from the local HF cache).

    Errors say what to do: a wrong id or no network gives a message naming the id.
    """
    p = model_dir_or_hub_id(source)
    if p is not None:
        for f in sorted(p.glob("*.safetensors")):
            check_safetensors(f)
        return p
    try:
        from huggingface_hub import snapshot_download

        # *.jinja / *.py: chat templates and remote code that `moesq pack` carries over; README.md: its license
        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja", "*.py", "README.md"]
        path = Path(snapshot_download(source, allow_patterns=patterns))
    except Exception as e:  # network, auth, missing repo: one clear message
        raise FileNotFoundError(
            f"model {source!r}: could not be found locally nor downloaded from the Hugging Face Hub "
            f"({type(e).__name__}: {e}). "
            "Check the id, your network and HF_TOKEN, or pass a local directory."
        ) from None
    for f in sorted(path.glob("*.safetensors")):
        check_safetensors(f)
    return path


def load_model(source: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               lazy: bool = False):
    """(model, tokenizer, adapter, path) for a supported MoE model; refuses others before loading weights.

    lazy: load only the non-expert weights; each MoE block's experts are read from the safetensors shards when
    used and dropped afterwards (moesq_core.models.lazy), so a model larger than host memory can be compressed."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(str(source))
    config = AutoConfig.from_pretrained(path)
    adapter = adapter_for(config)
    if lazy:
        from moesq_core.models.lazy import load_lazy

        model = load_lazy(path, config, adapter, dtype, device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(path) if any(path.glob("tokenizer*")) else None
    return model, tok, adapter, path
