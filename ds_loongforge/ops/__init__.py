"""Functional ops: each an autograd op over compiled kernels, with its PyTorch reference beside it."""

from ds_loongforge.ops._dispatch import IMPLS, set_strict_ops, strict_ops
from ds_loongforge.ops.adamw import (AdamWBucket, adamw_clip_apply, adamw_clip_apply_reference,
                                     fused_adamw_clip_step, grad_stats, grad_stats_reference)
from ds_loongforge.ops.cross_entropy import cross_entropy_reference, softmax_cross_entropy_
from ds_loongforge.ops.moe_dispatch import (Routing, expert_routing, moe_permute, moe_permute_reference,
                                            moe_unpermute, moe_unpermute_reference, routing_indices,
                                            routing_indices_reference)
from ds_loongforge.ops.moe_router import router_topk, router_topk_reference
from ds_loongforge.ops.rmsnorm import fused_rmsnorm, rmsnorm_reference
from ds_loongforge.ops.swiglu import philox_keep_mask, swiglu_dropout, swiglu_reference

__all__ = [
    "IMPLS", "set_strict_ops", "strict_ops", "fused_rmsnorm", "rmsnorm_reference", "philox_keep_mask",
    "swiglu_dropout", "swiglu_reference", "moe_permute", "moe_permute_reference", "moe_unpermute",
    "moe_unpermute_reference", "routing_indices", "routing_indices_reference", "expert_routing", "Routing",
    "AdamWBucket", "grad_stats", "grad_stats_reference",
    "adamw_clip_apply", "adamw_clip_apply_reference", "fused_adamw_clip_step", "softmax_cross_entropy_",
    "cross_entropy_reference", "router_topk", "router_topk_reference",
]
