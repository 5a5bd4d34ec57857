"""moesq's version (moesq_core.__version__): recorded in work dirs, packs and model cards, so those modules
import it from here rather than from the package's __init__, which lazily imports them."""
__version__ = "0.1.0"
