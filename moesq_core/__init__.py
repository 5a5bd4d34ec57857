"""moesq: compress the routed experts of MoE LLMs into hardware-native sparse low-precision formats."""
__version__ = "0.1.0"
