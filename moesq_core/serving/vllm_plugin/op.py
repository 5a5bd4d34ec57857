"""`torch.ops.moesq.routed_experts`: one call runs a MoE layer's routed experts, as one torch custom op (so
torch.compile and CUDA graphs see one opaque node per layer, with a fake implementation for tracing).

The op takes the layer's hidden states [T, H], its top-k expert ids and router weights [T, k] and the name the
layer's experts module was registered under (`register_experts`), and returns the weighted sum of the experts'
outputs [T, H] in the dtype of the hidden states. The module is the one the pack's format serves with
(serving.experts.make_experts: the format's fast module on a GPU it serves, e.g. moesq's Hopper kernels, else
the reference MoesqExperts), so the op computes exactly what that module computes. vLLM is not needed here: the
op runs and is tested outside vLLM too.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

_EXPERTS: "weakref.WeakValueDictionary[str, nn.Module]" = weakref.WeakValueDictionary()


def register_experts(name: str, module: nn.Module) -> None:
    """Serve the op's calls for layer `name` with `module` (held weakly: the layer owns it)."""
    _EXPERTS[name] = module


def registered_experts(name: str) -> nn.Module:
    try:
        return _EXPERTS[name]
    except KeyError:
        raise KeyError(f"moesq: no routed experts registered for layer {name!r}; its weights were not processed "
                       "after loading (MoesqMoEMethod.process_weights_after_loading)") from None


@torch.library.custom_op("moesq::routed_experts", mutates_args=())
def routed_experts(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   layer: str) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t]) of layer `layer`'s experts."""
    return registered_experts(layer)(hidden_states, topk_ids.long(), topk_weights)


@routed_experts.register_fake
def _routed_experts_fake(hidden_states, topk_ids, topk_weights, layer):
    return torch.empty_like(hidden_states)


class OpExperts(nn.Module):
    """An experts module (transformers' `forward(hidden, top_k_index, top_k_weights)`) whose forward is the op over
    `experts`: how a model outside vLLM runs its experts through the same op (the decode benchmark compares it with
    calling `experts` directly)."""

    def __init__(self, experts: nn.Module, name: str):
        super().__init__()
        self.experts, self.name = experts, name
        register_experts(name, experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.moesq.routed_experts(hidden_states, top_k_index, top_k_weights, self.name)
