"""The errors that refuse a model: raised by the adapters and by lazy loading, which both import them from
here (lazy.py sits below adapter.py, whose load_model and MoEBlock use it)."""


class UnsupportedModelError(ValueError):
    pass


class CheckpointError(ValueError):
    """A model weight file that cannot be read: truncated, not safetensors, or a header describing tensors that
    cannot be in it. Raised before any weights are loaded, naming the file."""
