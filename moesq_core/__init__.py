"""moesq: compress the routed experts of MoE LLMs into hardware-native sparse low-precision formats.

    from moesq_core import compress, CompressConfig, load_packed
    compress("path/or/hub-id", CompressConfig.from_file("recipe.yaml"), workdir="work").save_pretrained("out")
    model, tok = load_packed("out")

Importing moesq_core also lets transformers load packs: `AutoModelForCausalLM.from_pretrained("out")` gives
load_packed's model (checkpoint/transformers_route.py).
"""
from moesq_core.version import __version__

__all__ = ["compress", "CompressConfig", "CompressedModel", "load_packed", "__version__"]


def __getattr__(name):  # lazy: `import moesq_core` stays light (no torch until the API is used)
    if name in ("compress", "CompressedModel"):
        from moesq_core.compression import pipeline

        return getattr(pipeline, name)
    if name == "CompressConfig":
        from moesq_core.compression.config import CompressConfig

        return CompressConfig
    if name == "load_packed":
        from moesq_core.serving.loader import load_packed

        return load_packed
    raise AttributeError(f"module 'moesq_core' has no attribute {name!r}")


# -- `AutoModelForCausalLM.from_pretrained(pack)` (checkpoint/transformers_route.py) ---------------------------
_QUANTIZER_TABLE = "transformers.quantizers.auto"  # where transformers maps quant_method to its loader classes


def _route_packs_through_moesq(auto_module) -> None:
    import warnings

    try:
        from moesq_core.serving.transformers_route import install

        install(auto_module)
    except Exception as e:  # never break transformers itself; say that moesq packs will not load through it
        warnings.warn(f"moesq: AutoModelForCausalLM.from_pretrained will not load moesq packs ({type(e).__name__}: "
                      f"{e}); use moesq_core.load_packed", stacklevel=2)


class _ThenRoute:
    """The quantizer table's loader, routing moesq packs once the module has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _route_packs_through_moesq(module)

    def __getattr__(self, name):  # get_source, is_package, ...: the wrapped loader's
        return getattr(self.loader, name)


class _QuantizerTableFinder:
    """A sys.meta_path finder that only hands transformers' quantizer table a _ThenRoute loader (then leaves)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _QUANTIZER_TABLE:
            return None
        import sys

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRoute(spec.loader)
        return spec


def _install_transformers_route() -> None:
    """Route moesq packs through transformers' loader as soon as transformers has its quantizer table, without
    importing transformers (nor torch) here."""
    import sys

    if _QUANTIZER_TABLE in sys.modules:
        _route_packs_through_moesq(sys.modules[_QUANTIZER_TABLE])
    elif not any(isinstance(f, _QuantizerTableFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuantizerTableFinder())


_install_transformers_route()
