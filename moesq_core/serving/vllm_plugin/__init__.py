"""moesq's vLLM plugin: `vllm serve <pack>` for the packs stock vLLM cannot serve (p48-nvfp4 in either layout,
s24-fp8), without patching vLLM.

vLLM loads `register` from moesq's `vllm.general_plugins` entry point in every process it starts. Importing this
package imports neither vLLM nor torch; `register` imports vLLM and adds the `moesq` quantization method
(config.MoesqConfig), which claims those packs from their `compressed-tensors` quantization_config and serves
their routed experts through one torch custom op per MoE layer (op.py, which needs no vLLM). Packs of formats
that stock vLLM serves (Format.stock_serving) are left to it.
"""
from __future__ import annotations


def register() -> None:
    """Add the `moesq` quantization method to vLLM (idempotent: a second call changes nothing)."""
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
        register_quantization_config,
    )

    from moesq_core.serving.vllm_plugin.config import NAME, MoesqConfig

    if NAME in QUANTIZATION_METHODS and get_quantization_config(NAME) is MoesqConfig:
        return
    register_quantization_config(NAME)(MoesqConfig)
