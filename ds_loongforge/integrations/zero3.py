"""Reading and replacing parameters that DeepSpeed ZeRO-3 partitions.

A ZeRO-3 parameter (``deepspeed.zero.Init``, or ``deepspeed.initialize`` at stage 3) carries ``ds_id``; between
the forwards that gather it, its ``data`` is empty (or this rank's shard) and ``ds_shape`` is its real shape. Code
that reads weights outside a module's forward (inject building a replacement, the sampler's routing signatures)
gathers them here first, with DeepSpeed's own ``GatheredParameters``: a collective, so every rank must gather the
same parameters at the same point of its program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn


def partitioned(params: Iterable[torch.Tensor]) -> list[nn.Parameter]:
    """The parameters among ``params`` that ZeRO-3 partitions."""
    return [p for p in params if hasattr(p, "ds_id")]


def whole_shape(param: torch.Tensor) -> torch.Size:
    """``param``'s shape, a ZeRO-3 parameter's whole one (not its shard's)."""
    return getattr(param, "ds_shape", param.shape)


def gathered(params: Iterable[torch.Tensor]):
    """A context in which the ZeRO-3 parameters among ``params`` hold their whole data on every rank, read-only
    (partitioned again on exit, any change dropped); a no-op context when there are none."""
    params = partitioned(params)
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def partition_new(old: nn.Module, new: nn.Module) -> None:
    """Partition the Parameters of ``new`` (a replacement built from ZeRO-3-partitioned ``old``) that ZeRO-3 does
    not partition yet, as ``old``'s are: DeepSpeed's own conversion (the one ``deepspeed.initialize`` applies to a
    module's unpartitioned parameters), here right away, so that at most one module's new weights are whole at a
    time. The Parameters ``new`` took over from ``old`` stay as they are."""
    like = partitioned(old.parameters())
    fresh = [p for p in new.parameters() if not hasattr(p, "ds_id")]
    if like and fresh:
        like[0].convert_to_zero_parameters(param_list=fresh)
