"""cpu_opt: make PyTorch models run fast on CPUs without rewriting them."""
__version__ = "0.1.0"
