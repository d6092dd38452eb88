"""Config-only enablement: ``loongforge_autoload.pth`` (installed into site-packages by setup.py) imports
this module at interpreter start.

It only adds a finder to ``sys.meta_path``, which costs one string comparison per first import of a module:
no torch, no DeepSpeed, nothing else of ds_loongforge is imported here. When a script imports ``deepspeed``,
the finder lets the real loader run and then makes ``deepspeed.initialize`` apply the config's
``"loongforge"`` block (``ds_loongforge.integrations.deepspeed_hook``); a config without the block, or with
``"enabled": false``, gets stock ``deepspeed.initialize``. ``LOONGFORGE_DISABLE=1`` leaves DeepSpeed stock: its
``initialize`` then only warns, once, when a config asks for LoongForge (``"loongforge": {"enabled": true}``)
that the block is ignored, reading nothing of ds_loongforge.

Nothing here may raise: a broken hook must not stop Python from starting. A failure to install the wrapper
when ``deepspeed`` is imported is reported as a warning and DeepSpeed stays stock.
"""

import os
import sys

_TARGET = "deepspeed"


def _disabled() -> bool:
    return os.environ.get("LOONGFORGE_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


class DeepSpeedImportHook:
    """Meta-path finder: defers to the other finders for ``deepspeed`` and wraps its loader's
    ``exec_module`` so that ``deepspeed.initialize`` is wrapped once the package has executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_wrap(module):
            exec_module(module)
            _wrap(module)

        loader.exec_module = exec_then_wrap
        return spec


def _wrap(deepspeed_module) -> None:
    if _disabled():
        _note_opt_out(deepspeed_module)
        return
    try:
        from ds_loongforge.integrations.deepspeed_hook import install
    except ImportError as err:
        import warnings

        warnings.warn(f"ds_loongforge: deepspeed.initialize left stock, the LoongForge hook failed to import "
                      f"({err}); set LOONGFORGE_DISABLE=1 to silence this", RuntimeWarning, stacklevel=2)
        return
    install(deepspeed_module)


def _note_opt_out(deepspeed_module) -> None:
    """``deepspeed.initialize`` stays DeepSpeed's; a call whose config enables the loongforge block gets one warning
    saying that the block is ignored (nothing else: the opt-out must work even where ds_loongforge is broken)."""
    original = deepspeed_module.initialize
    if getattr(original, "__loongforge_opt_out__", False):
        return

    def initialize(*args, **kwargs):
        warn_opt_out(args, kwargs)
        return original(*args, **kwargs)

    initialize.__loongforge_opt_out__ = True
    initialize.__wrapped__ = original
    initialize.__doc__ = original.__doc__
    deepspeed_module.initialize = initialize


_opt_out_warned = False


def warn_opt_out(args: tuple, kwargs: dict) -> None:
    """Once per process: the warning that LOONGFORGE_DISABLE overrides a config that enables the block."""
    global _opt_out_warned
    if _opt_out_warned:
        return
    try:
        asks = _asks_for_loongforge(args, kwargs)
    except Exception:  # noqa: BLE001  (a note must never break the call)
        asks = False
    if asks:
        import logging

        _opt_out_warned = True
        logging.getLogger("ds_loongforge").warning(
            "[LoongForge] LOONGFORGE_DISABLE=%s: the config's \"loongforge\" block is ignored, deepspeed.initialize "
            "runs stock", os.environ.get("LOONGFORGE_DISABLE"))


def config_source(call: dict):
    """The DeepSpeed config as ``deepspeed.initialize`` finds it in its arguments (``config``, ``config_params``
    or ``args.deepspeed_config``/``args.deepscale_config``): a dict, a path, or None."""
    config = call.get("config")
    if config is None:
        config = call.get("config_params")
    cli_args = call.get("args")
    if config is None and cli_args is not None:
        config = getattr(cli_args, "deepspeed_config", None) or getattr(cli_args, "deepscale_config", None)
    return config


def _asks_for_loongforge(args: tuple, kwargs: dict) -> bool:
    """Whether the config that deepspeed.initialize will read (a dict or a JSON file) holds
    ``"loongforge": {"enabled": true}``."""
    config = config_source({"args": args[0] if args else None, **kwargs})
    if isinstance(config, (str, os.PathLike)):
        import json

        with open(config) as f:
            config = json.load(f)
    block = config.get("loongforge") if isinstance(config, dict) else None
    return isinstance(block, dict) and block.get("enabled") is True


def install_hook() -> None:
    """Add the finder (once); wrap ``deepspeed.initialize`` at once when DeepSpeed is already imported."""
    if _TARGET in sys.modules:
        _wrap(sys.modules[_TARGET])
        return
    if not any(isinstance(finder, DeepSpeedImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook())


install_hook()
