"""Fused MoE router top-k: ``softmax(logits.float())`` -> the k best experts -> optional renormalisation, forward
and backward in one kernel each, and the plain-PyTorch reference.

Legend (shape suffixes): T tokens, E experts, K experts per token.

    router_topk(logits_TE, k, renormalize) -> probs_TE (fp32), weights_TK (fp32), ids_TK (int64)
        probs_TE   = softmax(float(logits_TE))
        ids_TK     the k largest probabilities, descending; the lowest expert first among equal values, NaN
                   above every number (torch.topk's order of NaN)
        weights_TK = probs_TE[ids_TK], divided by their sum when ``renormalize``
    backward: dlogits_TE from the gradients of weights_TK and probs_TE (either may be absent), in logits' dtype

The unfused router is a softmax, a top-k (two kernels), a sum and a division forward, and in backward the
division's gradient, the top-k's scatter, the softmax backward and the cast: about a dozen kernels per MoE layer on
[T, E] tensors of a few hundred KiB, whose cost is their launches and the gaps between them. The kernels
(csrc/moe_dispatch/moe_router.cu, moe_router_cpu.cpp, built into the dispatch op) take a warp per token with up
to 1024 experts and k <= 32; larger shapes, fp64 logits and a build that failed take the reference. Sums are fp32
in a fixed order (deterministic); the values agree with the reference to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from ds_loongforge.ops._dispatch import kernel_for, refuse_double_backward
from ds_loongforge.ops.moe_dispatch import _BUILDERS, _KERNEL_DTYPES, _Library  # the same compiled op family

MAX_KERNEL_EXPERTS = 1024  # csrc/moe_dispatch/moe_dispatch_checks.h: kMaxRouterExperts
MAX_KERNEL_TOP_K = 32  # kMaxRouterTopK


def router_topk_reference(logits_TE: torch.Tensor, k: int, renormalize: bool = True,
                          ids_TK: torch.Tensor | None = None):
    """Plain PyTorch: the fp32 softmax (fp64 for fp64 logits), torch.topk, the division by the chosen sum.
    ``ids_TK`` given: those choices instead of torch.topk's (the checks follow a kernel's choices through ties)."""
    probs_TE = torch.softmax(logits_TE.double() if logits_TE.dtype == torch.float64 else logits_TE.float(), dim=-1)
    if ids_TK is None:
        weights_TK, ids_TK = torch.topk(probs_TE, k, dim=-1)
    else:
        weights_TK = probs_TE.gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return probs_TE, weights_TK, ids_TK


class _RouterTopKFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits_TE, k: int, renormalize: bool, kernel):
        probs_TE, weights_TK, ids_TK = kernel.router_topk_forward(logits_TE, k, renormalize)
        ctx.save_for_backward(probs_TE, ids_TK)
        ctx.mark_non_differentiable(ids_TK)
        ctx.set_materialize_grads(False)  # an unused probs_TE sends no gradient: no [T, E] of zeros is read
        ctx.renormalize = renormalize
        ctx.kernel = kernel
        ctx.logits_dtype = logits_TE.dtype
        return probs_TE, weights_TK, ids_TK

    @staticmethod
    def backward(ctx, dprobs_TE, dweights_TK, _dids):
        refuse_double_backward("router_topk")
        probs_TE, ids_TK = ctx.saved_tensors
        if dprobs_TE is None and dweights_TK is None:
            return None, None, None, None
        dweights_TK = (torch.zeros_like(ids_TK, dtype=torch.float32) if dweights_TK is None
                       else dweights_TK.float().contiguous())
        dprobs_TE = None if dprobs_TE is None else dprobs_TE.float().contiguous()
        dlogits_TE = ctx.kernel.router_topk_backward(dweights_TK, dprobs_TE, probs_TE, ids_TK, ctx.renormalize,
                                                    ctx.logits_dtype)
        return dlogits_TE, None, None, None


def _check_args(logits_TE: torch.Tensor, k: int) -> None:
    if logits_TE.dim() != 2:
        raise ValueError(f"router_topk: logits_TE must be [tokens, experts], got shape {tuple(logits_TE.shape)}")
    experts = logits_TE.shape[1]
    if not 1 <= k <= experts:
        raise ValueError(f"router_topk: k = {k} must be between 1 and the number of experts ({experts})")


def kernel_fits(logits_TE: torch.Tensor, k: int) -> bool:
    """Whether the kernels take these logits (dtype, at most MAX_KERNEL_EXPERTS experts and MAX_KERNEL_TOP_K)."""
    return logits_TE.dtype in _KERNEL_DTYPES and logits_TE.shape[-1] <= MAX_KERNEL_EXPERTS and k <= MAX_KERNEL_TOP_K


def router_topk(logits_TE: torch.Tensor, k: int, renormalize: bool = True, impl: str = "auto"):
    """(probs_TE, weights_TK, ids_TK) of the module legend. ``impl``: "auto" (the kernel where the shape and
    dtype allow it and it builds, else the reference), "cuda", "cpu" or "reference"."""
    _check_args(logits_TE, k)
    if impl == "reference":
        return router_topk_reference(logits_TE, k, renormalize)
    if impl == "auto" and not kernel_fits(logits_TE, k):
        return router_topk_reference(logits_TE, k, renormalize)
    kernel = kernel_for("moe_router_topk", _BUILDERS, logits_TE.device.type, impl, _Library)
    if kernel is None:
        return router_topk_reference(logits_TE, k, renormalize)
    return _RouterTopKFunction.apply(logits_TE.contiguous(), int(k), bool(renormalize), kernel)
