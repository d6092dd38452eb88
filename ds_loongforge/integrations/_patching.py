"""Process-wide replacement of a module-level function, for functions transformers' models look up in their own
modeling module at call time (``modeling_mixtral.apply_rotary_pos_emb``, ``load_balancing_loss_func``): one
bookkeeping for ``ds_loongforge.integrations.rope`` and ``ds_loongforge.integrations.balancing_loss``; and
``patch_once`` for the wrappers that stay for the process (``deepspeed.initialize``, the checkpoint loads).

A replacement carries the function it replaced in ``__loongforge_original__``; patching a module attribute that
already holds one is a no-op (never a wrapper of a wrapper), and ``restore`` puts the originals back.
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Callable

ORIGINAL_ATTR = "__loongforge_original__"  # on a replacement: the function it replaced


class ModulePatches:
    """The replacements of one kind (``what`` names the function they stand for, in messages)."""

    def __init__(self, what: str):
        self.what = what
        self.lock = threading.RLock()
        self._installed: dict[tuple[str, str], Callable] = {}  # (module, function name) -> replacement there

    def patch(self, module_name: str, function_name: str, problem: Callable[[Callable], str | None],
              make: Callable[[Callable], Callable]) -> str | None:
        """Set ``module_name.function_name`` to ``make(current)`` when ``problem(current)`` is None; None when
        done (or already done), else why the function was left alone."""
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            return f"{module_name} does not import ({err})"
        with self.lock:
            current = getattr(module, function_name, None)
            if current is None:
                return f"{module_name} has no {function_name}"
            if getattr(current, ORIGINAL_ATTR, None) is not None:
                self._installed[(module_name, function_name)] = current
                return None
            why = problem(current)
            if why is not None:
                return f"not the standard {self.what}: {why}"
            replacement = make(current)
            setattr(replacement, ORIGINAL_ATTR, current)
            setattr(module, function_name, replacement)
            self._installed[(module_name, function_name)] = replacement
        return None

    def patched(self) -> list[str]:
        """``module.function`` of every replacement installed and still in place."""
        with self.lock:
            return [f"{m}.{f}" for (m, f), r in self._installed.items()
                    if getattr(importlib.import_module(m), f, None) is r]

    def restore(self) -> list[str]:
        """Put every replaced function back; returns ``module.function`` of each."""
        restored = []
        with self.lock:
            for (module_name, function_name), replacement in list(self._installed.items()):
                module = importlib.import_module(module_name)
                if getattr(module, function_name, None) is replacement:
                    setattr(module, function_name, getattr(replacement, ORIGINAL_ATTR))
                    restored.append(f"{module_name}.{function_name}")
                del self._installed[(module_name, function_name)]
        return restored


def patch_once(owner, name: str, replacement: Callable) -> bool:
    """``owner.name`` (a module's function or a class's method) becomes ``replacement(original, *args, **kwargs)``,
    carrying the original in ``ORIGINAL_ATTR``; False when it already is one, or is missing (no wrapper of a
    wrapper: the checkpoint load, the client schedulers' loads and ``deepspeed.initialize``)."""
    current = getattr(owner, name, None)
    if current is None or getattr(current, ORIGINAL_ATTR, None) is not None:
        return False

    @functools.wraps(current)
    def patched(*args, **kwargs):  # a function, so that a method binds its instance
        return replacement(current, *args, **kwargs)

    setattr(patched, ORIGINAL_ATTR, current)
    setattr(owner, name, patched)
    return True


def original(function: Callable) -> Callable:
    """The function a replacement replaced (a function that is none: itself)."""
    return getattr(function, ORIGINAL_ATTR, function)
