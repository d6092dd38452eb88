"""Config-only enablement: ``loongforge_autoload.pth`` (installed into site-packages by setup.py) imports
this module at interpreter start.

It only adds a finder to ``sys.meta_path``, which costs one string comparison per first import of a module:
no torch, no DeepSpeed, nothing else of ds_loongforge is imported here. When a script imports ``deepspeed``,
the finder lets the real loader run and then makes ``deepspeed.initialize`` apply the config's
``"loongforge"`` block (``ds_loongforge.integrations.deepspeed_hook``); a config without the block, or with
``"enabled": false``, gets stock ``deepspeed.initialize``. ``LOONGFORGE_DISABLE=1`` leaves DeepSpeed untouched.

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
        if fullname != _TARGET or _disabled():
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
    try:
        from ds_loongforge.integrations.deepspeed_hook import install
    except ImportError as err:
        import warnings

        warnings.warn(f"ds_loongforge: deepspeed.initialize left stock, the LoongForge hook failed to import "
                      f"({err}); set LOONGFORGE_DISABLE=1 to silence this", RuntimeWarning, stacklevel=2)
        return
    install(deepspeed_module)


def install_hook() -> None:
    """Add the finder (once); wrap ``deepspeed.initialize`` at once when DeepSpeed is already imported."""
    if _disabled():
        return
    if _TARGET in sys.modules:
        _wrap(sys.modules[_TARGET])
        return
    if not any(isinstance(finder, DeepSpeedImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook())


install_hook()
