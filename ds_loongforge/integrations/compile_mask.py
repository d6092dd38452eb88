"""The causal-mask skip of transformers' SDPA attention under torch.compile on torch < 2.14.

A causal LM's forward builds its attention mask in ``transformers.masking_utils``. With no padding and no cache
offset it skips the mask (``_ignore_causal_mask_sdpa``): SDPA then runs with ``is_causal=True`` on the flash / cuDNN
causal kernels, and with ``enable_gqa`` instead of K/V repeated per query head. transformers refuses the skip while
exporting, asking ``is_torchdynamo_exporting()``, that is ``torch.compiler.is_exporting()``. Until pytorch#176499
(torch 2.14), dynamo traced that call as the constant True under torch.compile too. So every compiled forward built
the [B, 1, S, S] mask, repeated K and V, and ran SDPA with a mask over the full S x S product. On an H100 (torch 2.11)
the attention of the compiled mixtral e2e step took 13.2 ms of device time, against eager's 4.7 ms (e433161).
Stock transformers pays the same under compile with those torch versions.

The replacement returns ``torch.compiler._is_exporting_flag``: the flag that torch.export sets, that
``is_exporting()`` returns in eager, and that torch 2.14's dynamo reads. So eager gets the same answer as before,
and under dynamo the answer is True only while exporting. The mask's values are unchanged wherever transformers
still builds one; where it skips, ``is_causal=True`` is the same causal attention that eager runs.

The patch is process-wide: every model in the process gets it, as with the other function patches
(``ds_loongforge.integrations._patching``). ``restore()`` takes it back. It is installed only where the bug is
(``TORCH_MISREPORTS_EXPORTING``).
"""

from __future__ import annotations

from typing import Callable

import torch
from packaging.version import Version

from ds_loongforge.integrations import _patching

MODULE = "transformers.masking_utils"
FUNCTION = "is_torchdynamo_exporting"
KIND = "causal-mask skip under torch.compile"
# torch.compiler.is_exporting() is the constant True inside torch.compile before pytorch#176499
TORCH_MISREPORTS_EXPORTING = Version(Version(torch.__version__).base_version) < Version("2.14")

_patches = _patching.ModulePatches("transformers is_torchdynamo_exporting")


def standard_problem(current: Callable) -> str | None:
    """Why ``current`` is not transformers' ``is_torchdynamo_exporting`` over ``torch.compiler.is_exporting``
    (None when it is)."""
    if not hasattr(torch.compiler, "_is_exporting_flag"):
        return "torch.compiler has no _is_exporting_flag (the flag torch.export sets)"
    if getattr(current, "__module__", None) != "transformers.utils.import_utils":
        return f"it is {getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', current)!s}"
    if current() is not bool(torch.compiler._is_exporting_flag):
        return "it does not return torch.compiler.is_exporting()"
    return None


def is_torchdynamo_exporting() -> bool:
    """True while torch.export traces (the flag it sets), under torch.compile too; transformers' own function
    answers True in every torch.compile graph before torch 2.14."""
    return bool(torch.compiler._is_exporting_flag)


def patch() -> str | None:
    """Install :func:`is_torchdynamo_exporting` as ``transformers.masking_utils.is_torchdynamo_exporting``; None
    when done (or already done), else why it was left alone."""
    return _patches.patch(MODULE, FUNCTION, standard_problem, lambda current: _installed())


def _installed() -> Callable:
    def replacement() -> bool:
        return is_torchdynamo_exporting()

    replacement.__name__ = replacement.__qualname__ = FUNCTION
    replacement.__doc__ = is_torchdynamo_exporting.__doc__
    return replacement


def patched() -> list[str]:
    """``masking_utils.is_torchdynamo_exporting`` when the replacement is installed and still in place."""
    return _patches.patched()


def restore() -> list[str]:
    """Put transformers' function back (the patch is process-wide); returns ``module.function`` when it did."""
    return _patches.restore()
