"""`MoesqMoEMethod`: a moesq pack's routed experts in a vLLM MoE layer.

Weights: for every tensor a packed expert linear stores (the pack's layout, e.g. p48's weight_sparse_packed,
weight_sparse_mask, weight_scale, weight_global_scale, plus the activation's input_global_scale), the layer gets
`w13_<suffix>` (gate then up, stacked along the rows as vLLM's fused gate_up) and `w2_<suffix>` (down), with the
expert dimension first, in the checkpoint's own dtype, so vLLM's expert-parameter mapping and weight loader
(RoutedExperts.weight_loader) load each checkpoint tensor into exactly one parameter, tensor-parallel shards
included: per-row tensors are split along the rows of gate/up and the columns of down like the weights, per-row
scales of down are replicated, per-tensor scalars are kept per expert ([E, 2] for gate/up, [E] for down).

After loading, the parameters are turned back into per-expert packed tensors and given to the format's experts
module (serving.experts.make_experts: moesq's Hopper kernels where they serve the device, else the reference
MoesqExperts); the packed parameters are then released. `apply` runs the layer's experts as one custom op
(op.routed_experts). Not served: expert parallelism, router weights applied on the input, biases, activations
other than SiLU-gated (the formats' experts modules compute SwiGLU).
"""
from __future__ import annotations

import functools

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoeWeightScaleSupported, MoEActivation
from vllm.model_executor.utils import set_weight_attrs

from moesq_core.formats import Format
from moesq_core.naming import PROJECTIONS
from moesq_core.serving.experts import make_experts
from moesq_core.serving.vllm_plugin.op import register_experts


@functools.lru_cache(maxsize=32)
def stored_tensors(fmt: Format, layout: str, out: int, inn: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{suffix: (shape, dtype)} of what a pack stores for one expert linear [out, in] in `layout` (the format's
    packer run on a stand-in weight); ValueError where the format cannot store that shape."""
    w = torch.ones(out, inn, device="cpu")  # on the CPU whatever device vLLM builds on
    fmt.check_weight(w, f"an expert linear [{out}, {inn}]")
    qw = fmt.quantize(w)
    tensors = {**fmt.pack(qw, layout), **fmt.act.packed_tensors(None)}
    return {s: (tuple(t.shape), t.dtype) for s, t in tensors.items()}


def _scale_kind(suffix: str, shape: tuple[int, ...]) -> str | None:
    """How vLLM's weight loader treats a stored tensor: it reads a name holding 'scale' as a scale of the kind
    the parameter's `quant_method` says (TENSOR: one value; CHANNEL: one per row; GROUP: sharded like the
    weight), any other as weight data (sharded)."""
    if shape == (1,):
        return FusedMoeWeightScaleSupported.TENSOR.value
    if "scale" not in suffix:
        return None
    return FusedMoeWeightScaleSupported.CHANNEL.value if shape[-1] == 1 else FusedMoeWeightScaleSupported.GROUP.value


class MoesqMoEMethod(FusedMoEMethodBase):
    def __init__(self, quant_config, moe):
        super().__init__(moe)
        self.quant_config = quant_config
        self.format: Format = quant_config.format
        self.layout: str = quant_config.layout.name
        self.act_quant: bool = quant_config.act_quant

    def _refuse_unsupported(self, layer) -> None:
        what = None
        if self.moe.moe_parallel_config.use_ep:
            what = "expert parallelism (serve with tensor parallelism instead)"
        elif self.moe.has_bias:
            what = "expert biases"
        elif self.moe.activation != MoEActivation.SILU:
            what = f"the {self.moe.activation.value} activation (moesq experts compute SwiGLU)"
        elif getattr(layer, "apply_router_weight_on_input", False):
            what = "router weights applied on the input"
        if what is not None:
            raise NotImplementedError(f"moesq: {layer.layer_name}: {what} is not supported for moesq packs")

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        self._refuse_unsupported(layer)
        inter = intermediate_size_per_partition
        try:
            gate = stored_tensors(self.format, self.layout, inter, hidden_size)
            down = stored_tensors(self.format, self.layout, hidden_size, inter)
        except ValueError as e:
            raise ValueError(f"moesq: {layer.layer_name}: {self.format.name} cannot hold this layer's experts split "
                             f"for tensor parallelism (intermediate size {inter} per partition): {e}") from None
        self.suffixes = tuple(gate)
        for suffix, (shape, dtype) in gate.items():
            kind = _scale_kind(suffix, shape)
            w13 = (num_experts, 2) if kind == FusedMoeWeightScaleSupported.TENSOR.value else \
                (num_experts, 2 * shape[0], *shape[1:])
            self._add(layer, f"w13_{suffix}", w13, dtype, kind, extra_weight_attrs)
            shape2, dtype2 = down[suffix]
            w2 = (num_experts,) if kind == FusedMoeWeightScaleSupported.TENSOR.value else (num_experts, *shape2)
            self._add(layer, f"w2_{suffix}", w2, dtype2, kind, extra_weight_attrs)

    @staticmethod
    def _add(layer, name: str, shape, dtype, kind, attrs) -> None:
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        layer.register_parameter(name, param)
        set_weight_attrs(param, attrs if kind is None else {**attrs, "quant_method": kind})

    def packed_experts(self, layer) -> list[dict[str, dict[str, torch.Tensor]]]:
        """packed[e] = {"gate"|"up"|"down": {suffix: tensor}}, each tensor as the pack stores it for this
        partition (gate/up rows and down columns of this tensor-parallel rank)."""
        experts = []
        for e in range(getattr(layer, f"w2_{self.suffixes[0]}").shape[0]):
            tensors = {p: {} for p in PROJECTIONS}
            for suffix in self.suffixes:
                w13, w2 = getattr(layer, f"w13_{suffix}").data[e], getattr(layer, f"w2_{suffix}").data[e]
                if w2.dim() == 0:  # per-tensor: [2] for gate/up, a scalar for down
                    tensors["gate"][suffix], tensors["up"][suffix] = w13[0:1], w13[1:2]
                    tensors["down"][suffix] = w2.reshape(1)
                else:
                    tensors["gate"][suffix], tensors["up"][suffix] = w13.chunk(2, dim=0)
                    tensors["down"][suffix] = w2
            experts.append(tensors)
        return experts

    def process_weights_after_loading(self, layer) -> None:
        """Build the format's experts module from the loaded tensors (unpacked and checked by the format) and
        release the packed parameters."""
        device = getattr(layer, f"w2_{self.suffixes[0]}").device
        module = make_experts(self.format, self.packed_experts(layer), self.act_quant, device,
                              prefix=layer.layer_name)
        for suffix in self.suffixes:
            for prefix in ("w13_", "w2_"):
                delattr(layer, prefix + suffix)
        layer.moesq_experts = module
        register_experts(layer.layer_name, module)

    def get_fused_moe_quant_config(self, layer):
        return None  # moesq's experts modules quantize their own activations

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return torch.ops.moesq.routed_experts(x, topk_ids, topk_weights, layer.layer_name)
