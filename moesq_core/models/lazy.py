"""Open a supported MoE model without loading it whole (`load_model(..., lazy=True)`).

The transformers model is built on the meta device; every non-expert weight is read from the safetensors
shards once, and each MoE block's routed experts become a `LazyExperts` placeholder that holds no weights. It
reads its dense weights from the shards when used (a whole block for a forward, one expert for
`expert_weights`) and drops them afterwards, so host memory holds one block of expert weights at a time.

The compressed experts a stage installs would add up to a whole model too: on a lazily opened model,
installing one block's compressed experts releases those installed earlier in other blocks (the engine uses a
block's compressed experts only to propagate the calibration states through that block, right after
installing it). A released block refuses to run, with a message, instead of silently falling back to dense.

Checkpoints store experts per expert (`...experts.{e}.gate_proj.weight`; mixtral's `w1`/`w3`/`w2`) or fused
as transformers 5 saves them (`...experts.gate_up_proj` [E, 2I, H], `...experts.down_proj` [E, H, I]); names
are mapped to the model with transformers' own checkpoint conversion rules.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moesq_core.models.errors import UnsupportedModelError
from moesq_core.naming import PROJ_NAMES

if TYPE_CHECKING:  # adapter.py imports this module (load_model, MoEBlock); the adapter is only an annotation here
    from moesq_core.models.adapter import MoEAdapter

_PER_EXPERT = re.compile(r"^(?P<mlp>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(?P<mlp>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_PROJ = {**{n: p for p, n in PROJ_NAMES.items()}, "w1": "gate", "w3": "up", "w2": "down"}  # + Mixtral's names


class ShardReader:
    """Reads single tensors (or one expert's rows of a fused tensor) from a model's safetensors shards.

    Files are opened per read with positioned reads where safetensors supports them: a long-lived memory map
    would keep every page it ever touched in the process's resident set."""

    def __init__(self, path: Path):

        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        shards = sorted(Path(path).glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"{path}: no .safetensors weights (lazy loading reads safetensors shards only)")
        for f in shards:
            with self._open(f) as sf:
                for k in sf.keys():
                    self.files[k] = f
                    self.shapes[k] = tuple(sf.get_slice(k).get_shape())

    @staticmethod
    @contextmanager
    def _open(file: Path):
        from safetensors import safe_open

        try:
            sf = safe_open(str(file), "pt", backend="pread")
        except TypeError:  # safetensors < 0.8: memory-mapped, closed right after the read
            sf = safe_open(str(file), "pt")
        with sf:
            yield sf

    def iter(self, names: list[str], index: int | None = None):
        """(name, tensor) for each of `names` (or row `index` of each), shard by shard, one tensor at a time."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        for f, ns in by_file.items():
            with self._open(f) as sf:
                for n in ns:
                    yield n, sf.get_tensor(n) if index is None else sf.get_slice(n)[index].clone()

    def read(self, names: list[str], index: int | None = None) -> list[torch.Tensor]:
        """The tensors `names` (all from the checkpoint), or row `index` of each."""
        out = dict(self.iter(names, index))
        return [out[n] for n in names]


class _ExpertSource:
    """Where one block's expert weights live in the checkpoint: per-expert names or two fused tensors."""

    def __init__(self, mlp_name: str):
        self.mlp_name = mlp_name
        self.per_expert: dict[int, dict[str, str]] = {}
        self.fused: dict[str, str] = {}

    def check(self, num_experts: int, inter: int, hidden: int, shapes: dict) -> None:
        where = f"{self.mlp_name}.experts"
        if self.fused and self.per_expert:
            raise UnsupportedModelError(f"{where}: the checkpoint stores these experts both fused and per expert")
        if self.fused:
            want = {"gate_up_proj": (num_experts, 2 * inter, hidden), "down_proj": (num_experts, hidden, inter)}
            for proj, shape in want.items():
                if proj not in self.fused or tuple(shapes[self.fused[proj]]) != shape:
                    got = shapes.get(self.fused.get(proj, ""), "missing")
                    raise UnsupportedModelError(
                        f"{where}.{proj}: expected shape {list(shape)} in the checkpoint, found {got}"
                    )
            return
        want = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        for e in range(num_experts):
            names = self.per_expert.get(e, {})
            for proj, shape in want.items():
                if proj not in names or tuple(shapes[names[proj]]) != shape:
                    got = shapes.get(names.get(proj, ""), "missing")
                    raise UnsupportedModelError(
                        f"{where}.{e} {proj}: expected shape {list(shape)} in the checkpoint, found {got}"
                    )


class LazyExperts(nn.Module):
    """A routed-experts module whose dense weights stay in the checkpoint until used.

    Same call signature as the model's experts; `forward` materialises the block's weights into the model's
    own (meta) experts module, runs it, and drops them unless `materialize()` pinned them. `gate_up_proj` and
    `down_proj` are the pinned tensors, or meta tensors of the right shape and dtype when not pinned.
    """

    def __init__(self, template: nn.Module, source: _ExpertSource, reader: ShardReader, layer_index: int, dtype,
                 model_mlps: list[nn.Module]):
        super().__init__()
        object.__setattr__(self, "_template", template)  # not a submodule: its parameters are on meta
        object.__setattr__(self, "model_mlps", model_mlps)  # every MoE block of the model (for releases)
        self._source, self._reader, self.layer_index = source, reader, layer_index
        self.num_experts = template.gate_up_proj.shape[0]
        self._inter, self._hidden = template.down_proj.shape[2], template.down_proj.shape[1]
        # Follows model.to(device/dtype): where and in what dtype the weights are materialised.
        self.register_buffer("_anchor", torch.empty(0, dtype=dtype), persistent=False)
        self._pinned: tuple[torch.Tensor, torch.Tensor] | None = None

    def extra_repr(self) -> str:
        state = "materialised" if self._pinned is not None else "in the checkpoint"
        return f"layer={self.layer_index}, num_experts={self.num_experts}, weights {state}"

    def _meta(self, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self._anchor.dtype, device="meta")

    @property
    def gate_up_proj(self) -> torch.Tensor:
        if self._pinned is not None:
            return self._pinned[0]
        return self._meta((self.num_experts, 2 * self._inter, self._hidden))

    @property
    def down_proj(self) -> torch.Tensor:
        if self._pinned is not None:
            return self._pinned[1]
        return self._meta((self.num_experts, self._hidden, self._inter))

    @property
    def is_materialized(self) -> bool:
        return self._pinned is not None

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self._anchor.device, dtype=self._anchor.dtype)

    @torch.no_grad()
    def load_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) read from the checkpoint, in the model's dtype and device."""
        src = self._source
        if src.fused:
            gu, down = self._reader.read([src.fused["gate_up_proj"], src.fused["down_proj"]])
            return self._cast(gu), self._cast(down)
        E, inter, H = self.num_experts, self._inter, self._hidden
        gu = torch.empty(E, 2 * inter, H, dtype=self._anchor.dtype, device=self._anchor.device)
        down = torch.empty(E, H, inter, dtype=self._anchor.dtype, device=self._anchor.device)
        for e in range(E):
            n = src.per_expert[e]
            g, u, d = self._reader.read([n["gate"], n["up"], n["down"]])
            gu[e, :inter], gu[e, inter:], down[e] = self._cast(g), self._cast(u), self._cast(d)
        return gu, down

    def materialize(self) -> "LazyExperts":
        """Read and keep the block's dense weights (until `release`)."""
        if self._pinned is None:
            self._pinned = self.load_dense()
        return self

    def release(self) -> None:
        """Drop materialised dense weights (they stay readable from the checkpoint)."""
        self._pinned = None

    @torch.no_grad()
    def expert_weights(self, e: int) -> dict[str, torch.Tensor]:
        """Dense fp32 (gate [I, H], up [I, H], down [H, I]) of expert e, read alone; the same values as the
        eagerly loaded model's (checkpoint dtype -> model dtype -> fp32)."""
        if not 0 <= e < self.num_experts:
            raise IndexError(f"layer {self.layer_index}: expert {e} out of range (0..{self.num_experts - 1})")
        if self._pinned is not None:
            gu, down = self._pinned[0][e], self._pinned[1][e]
        else:
            src = self._source
            if src.fused:
                fused = [src.fused["gate_up_proj"], src.fused["down_proj"]]
                gu, down = (self._cast(t) for t in self._reader.read(fused, e))
            else:
                n = src.per_expert[e]
                g, u, down = (self._cast(t) for t in self._reader.read([n["gate"], n["up"], n["down"]]))
                gu = torch.cat([g, u])
        inter = self._inter
        return {"gate": gu[:inter].float().clone(), "up": gu[inter:].float().clone(), "down": down.float().clone()}

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        gu, down = self._pinned if self._pinned is not None else self.load_dense()
        t = self._template
        saved = t.gate_up_proj, t.down_proj
        try:
            # The model's own experts module runs the block, so the result is exactly the eager model's.
            t.gate_up_proj, t.down_proj = nn.Parameter(gu, requires_grad=False), nn.Parameter(down, requires_grad=False)
            return t(hidden_states, top_k_index, top_k_weights)
        finally:
            t.gate_up_proj, t.down_proj = saved


class ReleasedExperts(nn.Module):
    """Stands in for compressed experts released to keep host memory bounded; refuses to run."""

    def __init__(self, layer_index: int, num_experts: int):
        super().__init__()
        self.layer_index, self.num_experts = layer_index, num_experts

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"layer {self.layer_index}: its compressed experts were released when a later block's were installed "
            "(the model was opened lazily, which keeps one block in memory); install them again from the stage's "
            "block artifacts, or open the model without lazy loading to keep every block installed")


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        # Frozen: a lazily opened model is for inference and compression, and a forward pass must not keep an
        # autograd graph (with every layer's activations) alive.
        value = mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[attr] = value
    value._is_hf_initialized = True  # transformers' initialize_weights leaves it alone


def _target_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    # transformers keeps some modules (e.g. deepseek-v3's router) in fp32 when loading in half precision
    keep = []
    if dtype in (torch.float16, torch.bfloat16):
        keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return torch.float32 if any(k in name for k in keep) else dtype


def load_lazy(path: Path, config, adapter: MoEAdapter, dtype: torch.dtype, device) -> nn.Module:
    """The model at `path` with non-expert weights loaded and every MoE block's experts a LazyExperts."""
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = ShardReader(path)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = model.state_dict()
    blocks = {f"model.layers.{b.layer_index}.mlp": b for b in adapter.blocks(model)}
    sources = {name: _ExpertSource(name) for name in blocks}

    dense: dict[str, str] = {}  # model name -> checkpoint name
    for key in reader.files:
        renamed, _ = rename_source_key(key, renamings, [], model.base_model_prefix, expected)
        m = _PER_EXPERT.match(renamed) or _FUSED.match(renamed)
        if m and m.group("mlp") in sources:
            src = sources[m.group("mlp")]
            if "e" in m.groupdict():
                src.per_expert.setdefault(int(m.group("e")), {})[_PROJ[m.group("proj")]] = key
            else:
                src.fused[m.group("proj")] = key
            continue
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if pattern is not None:
            raise UnsupportedModelError(f"{key}: this checkpoint tensor needs a conversion lazy loading does not "
                                        "do; load the model without lazy loading")
        if target in expected:
            dense[target] = key
        # anything else is a tensor the model does not use (transformers ignores those too)

    mlps = [b.mlp for b in blocks.values()]
    for name, block in blocks.items():
        template = block.mlp.experts
        E, H, inter = template.down_proj.shape
        sources[name].check(E, inter, H, reader.shapes)
        block.mlp.experts = LazyExperts(template, sources[name], reader, block.layer_index, dtype, mlps)

    target_of = {key: target for target, key in dense.items()}
    for key, t in reader.iter(sorted(target_of)):
        target = target_of[key]
        _set_tensor(model, target, t.to(_target_dtype(model, target, dtype)))
    model.tie_weights()
    missing = [n for n, t in model.state_dict(keep_vars=True).items() if t.device.type == "meta"]
    if missing:
        raise UnsupportedModelError(f"{path}: the checkpoint has no tensor for {', '.join(missing[:5])}"
                                    f"{' …' if len(missing) > 5 else ''}")
    # What remains on meta are non-persistent buffers (rotary frequencies, the experts' anchors): give them
    # storage, and let transformers compute the rotary ones as it does after loading a checkpoint.
    for mod in model.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.device.type == "meta":
                mod._buffers[bname] = torch.zeros_like(buf, device="cpu")
    model.initialize_weights()  # only touches tensors not flagged as loaded
    model.to(device).eval()
    return model


def release_installed(mlps: list[nn.Module], keep: nn.Module) -> None:
    """Release the experts installed in place of the lazy placeholders of every block but `keep`."""
    for mlp in mlps:
        if mlp is keep or isinstance(mlp.experts, (LazyExperts, ReleasedExperts)):
            continue
        mlp.experts = ReleasedExperts(mlp._moesq_dense_experts.layer_index, mlp._moesq_dense_experts.num_experts)
