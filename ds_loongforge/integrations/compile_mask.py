"""The causal-mask skip of transformers' SDPA attention, kept under torch.compile.

A causal LM's forward builds its attention mask in ``transformers.masking_utils``. When nothing needs a mask (no
padding mask, as many queries as keys, no sliding window reached), ``_ignore_causal_mask_sdpa`` says so. SDPA then
runs with ``is_causal=True``: the flash / cuDNN causal kernels, and ``enable_gqa`` instead of K and V repeated per
query head. Under torch.compile transformers refuses that skip, because it cannot tell compile from export:
* transformers <= 5.17 refuses whenever dynamo traces (``is_tracing``);
* 5.25 asks ``torch.compiler.is_exporting()``, which dynamo traced as the constant True before pytorch#176499
  (torch 2.14).

So a compiled forward built the [B, 1, S, S] mask, repeated K and V, and ran SDPA with the mask over the full
S x S product. On an H100 (torch 2.11, transformers 5.17), the attention of the compiled mixtral e2e step took
13.2 ms of device time, against eager's 4.7 ms (e433161). Stock transformers pays the same under compile.

The replacement answers True in exactly that case: compiling but not exporting (``torch.compiler._is_exporting_flag``,
the flag torch.export sets, still False), no padding mask, more than one query, as many keys as queries, a plain
int offset, no sliding window reached. That is eager's answer there, and it is reached without reading a tensor's
values. Every other call, and every eager call, goes to transformers' function. The compiled graph then computes
the causal attention that eager computes.

The patch is process-wide, as the other function patches are (``ds_loongforge.integrations._patching``): every
model in the process gets it. ``restore()`` takes it back.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ds_loongforge.integrations import _patching

MODULE = "transformers.masking_utils"
FUNCTION = "_ignore_causal_mask_sdpa"
KIND = "causal-mask skip under torch.compile"
_PARAMETERS = ["padding_mask", "q_length", "kv_length", "q_offset", "kv_offset", "local_attention_size"]

_patches = _patching.ModulePatches("transformers _ignore_causal_mask_sdpa")


def standard_problem(current: Callable) -> str | None:
    """Why ``current`` is not transformers' ``_ignore_causal_mask_sdpa`` as this replacement knows it (None when
    it is): its parameters, and eager's answer for a plain causal mask."""
    if not hasattr(torch.compiler, "_is_exporting_flag"):
        return "torch.compiler has no _is_exporting_flag (the flag torch.export sets)"
    try:
        names = list(inspect.signature(current).parameters)
    except (TypeError, ValueError):
        names = None
    if names != _PARAMETERS:
        return f"its parameters are {names}, not {_PARAMETERS}"
    if current(None, 8, 8, 0, 0, None) is not True:
        return "it does not skip a plain causal mask in eager (no padding, 8 queries and 8 keys)"
    return None


def plain_causal(padding_mask, q_length, kv_length, q_offset, local_attention_size) -> bool:
    """No padding mask, more than one query, as many keys as queries (no cache before them), no sliding window
    reached: ``is_causal=True`` is the whole mask."""
    return (padding_mask is None and not isinstance(q_offset, torch.Tensor) and q_length > 1
            and kv_length == q_length and (local_attention_size is None or kv_length < local_attention_size))


def patch() -> str | None:
    """Install the replacement as ``transformers.masking_utils._ignore_causal_mask_sdpa``; None when done (or
    already done), else why it was left alone."""
    return _patches.patch(MODULE, FUNCTION, standard_problem, _installed)


def _installed(original: Callable) -> Callable:
    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if (torch.compiler.is_compiling() and not torch.compiler._is_exporting_flag
                and plain_causal(padding_mask, q_length, kv_length, q_offset, local_attention_size)):
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    _ignore_causal_mask_sdpa.__doc__ = original.__doc__
    return _ignore_causal_mask_sdpa


def patched() -> list[str]:
    """``transformers.masking_utils._ignore_causal_mask_sdpa`` when the replacement is installed and in place."""
    return _patches.patched()


def restore() -> list[str]:
    """Put transformers' function back (the patch is process-wide); returns ``module.function`` when it did."""
    return _patches.restore()
