"""ds_loongforge: a DeepSpeed integration that makes Mixture-of-Experts training fast without changing
what the model learns.

``ds_loongforge.initialize`` (``deepspeed.initialize`` applying the config's ``"loongforge"`` block) and
``ds_loongforge.inject`` (replace a transformers model's modules) are imported on first use: the package is
imported at interpreter start by the config-only autoloader and must not pull in torch there.
"""

__version__ = "0.1.0"

_LAZY = {
    "initialize": ("ds_loongforge.integrations.deepspeed_hook", "initialize"),
    "inject": ("ds_loongforge.integrations.inject", "inject"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'ds_loongforge' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
