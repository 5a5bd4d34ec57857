"""Model adapters: find a transformers MoE model's routed-expert blocks, route like the model, swap experts."""
from moesq_core.models.adapter import SUPPORTED, MoEAdapter, MoEBlock, adapter_for, load_model
from moesq_core.models.errors import UnsupportedModelError

__all__ = ["SUPPORTED", "MoEAdapter", "MoEBlock", "adapter_for", "load_model", "UnsupportedModelError"]
