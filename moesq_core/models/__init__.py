"""Model adapters: find a transformers MoE model's routed-expert blocks, route like the model, swap experts."""
from .adapter import SUPPORTED, MoEAdapter, MoEBlock, adapter_for, load_model
from .errors import UnsupportedModelError

__all__ = ["SUPPORTED", "MoEAdapter", "MoEBlock", "adapter_for", "load_model", "UnsupportedModelError"]
