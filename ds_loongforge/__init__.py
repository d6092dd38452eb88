"""ds_loongforge: a DeepSpeed integration that makes Mixture-of-Experts training fast without changing
what the model learns."""

__version__ = "0.1.0"
