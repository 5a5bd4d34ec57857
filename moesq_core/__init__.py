"""moesq: compress the routed experts of MoE LLMs into hardware-native sparse low-precision formats.

    from moesq_core import compress, CompressConfig, load_packed
    compress("path/or/hub-id", CompressConfig.from_file("recipe.yaml"), workdir="work").save_pretrained("out")
    model, tok = load_packed("out")
"""
__version__ = "0.1.0"

__all__ = ["compress", "CompressConfig", "CompressedModel", "load_packed", "__version__"]


def __getattr__(name):  # lazy: `import moesq_core` stays light (no torch until the API is used)
    if name in ("compress", "CompressedModel"):
        from . import api

        return getattr(api, name)
    if name == "CompressConfig":
        from .config import CompressConfig

        return CompressConfig
    if name == "load_packed":
        from .checkpoint.loader import load_packed

        return load_packed
    raise AttributeError(f"module 'moesq_core' has no attribute {name!r}")
