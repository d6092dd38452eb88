"""Fused RMSNorm: the autograd op over the compiled kernels, and its plain-PyTorch reference.

    y = x * rsqrt(mean(x^2, -1) + eps) * weight                        (fp32 arithmetic)
    with residual: h = x + residual (in x's dtype); y = rmsnorm(h); returns (y, h)
    with keep_input: y = rmsnorm(x); returns (y, x), x's second use differentiable through the op

keep_input is for a decoder layer's input norm, whose input is also the layer's residual: the gradient that comes
back through the returned x is added to the norm's input gradient inside the backward kernel (the dresidual
path), where autograd would add the two with one more kernel.

Shapes: x [..., H], weight [H] (x's dtype or float32), residual like x. The output has x's dtype.

Rounding (``rounding=``, see ``ops._dispatch.ROUNDINGS``): "stock" (the default) rounds where transformers' eager
RMSNorm, ``weight * (x * rstd).to(dtype)``, and its autograd round: y = rnd(rnd(x * rstd) * w); in backward
w * dy is rounded to x's dtype (the gradient of the rounded x * rstd), and so is dy * rnd(x * rstd) when the weight
has that dtype, before dx's fp32 formula and dw's fp32 row sum. "once": fp32 to the end, one rounding per output.
fp32 inputs compute the same under both.
"""

from __future__ import annotations

import torch

from ds_loongforge.op_builder import FusedRMSNormBuilder, FusedRMSNormCPUBuilder
from ds_loongforge.ops._dispatch import (as_rows, check_rounding, check_rows_input, kernel_for, library_module,
                                         refuse_double_backward)

_BUILDERS = {"cuda": FusedRMSNormBuilder, "cpu": FusedRMSNormCPUBuilder}


# The kernels as torch.library custom ops, which torch.compile traces through their fake (shape-only) kernels where
# it cannot trace the module's pybind functions. Eager calls keep the pybind functions: a custom op's Python
# dispatch costs host time the eager step does not have to spare. Outputs the kernels leave undefined come back
# as empty tensors (a custom op returns tensors only); _Library maps them back to None.
@torch.library.custom_op("loongforge::rmsnorm_forward", mutates_args=())
def _forward_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                stock: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, rstd = library_module(_BUILDERS, x.device.type).forward(x, residual, weight, eps, stock)
    return y, (x.new_empty(0) if h is None else h), rstd


@_forward_op.register_fake
def _(x, residual, weight, eps, stock):
    rows, hidden = x.shape
    return (x.new_empty(rows, hidden), x.new_empty((rows, hidden) if residual is not None else (0,)),
            x.new_empty(rows, dtype=torch.float32))


@torch.library.custom_op("loongforge::rmsnorm_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, h: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                 dresidual: torch.Tensor | None, stock: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = library_module(_BUILDERS, h.device.type).backward(dy, h, rstd, weight, dresidual, stock)
    return dx, dw


@_backward_op.register_fake
def _(dy, h, rstd, weight, dresidual, stock):
    return h.new_empty(h.shape), torch.empty_like(weight, memory_format=torch.contiguous_format)


class _Library:
    """The kernel module's methods over the custom ops (what kernel_for returns under torch.compile)."""

    @staticmethod
    def forward(x, residual, weight, eps, stock):
        y, h, rstd = _forward_op(x, residual, weight, eps, stock)
        return y, (h if residual is not None else None), rstd

    backward = staticmethod(_backward_op)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      residual: torch.Tensor | None = None, rounding: str = "stock"):
    """Plain PyTorch with the kernel's semantics: fp32 math (fp64 for fp64 inputs), rounded as ``rounding`` says.

    "stock" is transformers' expression, ``weight * (h * rstd).to(dtype)``, so autograd's backward rounds where
    the stock module's does; "once" rounds the fp32 product once."""
    stock = check_rounding("rmsnorm_reference", rounding)
    h = x if residual is None else x + residual
    acc = _compute_dtype(h.dtype)
    hf = h.to(acc)
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if stock and acc != h.dtype:
        y = (weight * normed.to(h.dtype)).to(h.dtype)
    else:
        y = (normed * weight.to(acc)).to(h.dtype)
    return y if residual is None else (y, h)


class _FusedRMSNormFunction(torch.autograd.Function):
    """Over 2-D rows [N, H]; fused_rmsnorm gives its outputs their shape outside the Function, so they are not views
    made inside it, which autograd would not let a caller modify in place (OLMoE's attention clamps in place)."""

    @staticmethod
    def forward(ctx, x_rows, weight, residual_rows, eps, kernel, keep_input=False, stock=True):
        y, h, rstd = kernel.forward(x_rows, residual_rows, weight, eps, stock)
        has_residual = residual_rows is not None
        ctx.save_for_backward(h if has_residual else x_rows, rstd, weight)
        ctx.kernel = kernel
        ctx.stock = stock
        ctx.has_residual = has_residual
        if has_residual:
            return y, h
        if keep_input:
            # x itself: autograd returns it as a view of the input whose gradient comes back to this backward
            return y, x_rows
        return y

    @staticmethod
    def backward(ctx, dy, dh=None):
        refuse_double_backward("fused_rmsnorm")
        h, rstd, weight = ctx.saved_tensors
        dres = None if dh is None else dh.contiguous()
        dx, dw = ctx.kernel.backward(dy.contiguous(), h, rstd, weight, dres, ctx.stock)
        return dx, dw, (dx if ctx.has_residual else None), None, None, None, None


def fused_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  residual: torch.Tensor | None = None, impl: str = "auto", keep_input: bool = False,
                  rounding: str = "stock"):
    """RMSNorm of the last dimension; with ``residual`` it returns ``(y, x + residual)``, with ``keep_input``
    ``(y, x)`` (the gradient through that x joins the norm's input gradient in the backward kernel).

    ``impl``: "auto" (kernel for the tensor's device, reference if it cannot be built), "cuda", "cpu",
    or "reference". ``rounding``: "stock" (transformers' roundings) or "once" (see the module docstring).
    """
    stock = check_rounding("fused_rmsnorm", rounding)
    check_rows_input("fused_rmsnorm", x)
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"fused_rmsnorm: weight shape {tuple(weight.shape)} does not match the hidden size "
                         f"{x.shape[-1]} of x {tuple(x.shape)}; weight must be [hidden]")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"fused_rmsnorm: residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    if residual is not None and residual.device != x.device:  # the kernel would read it under x's device
        raise ValueError(f"fused_rmsnorm: residual is on {residual.device} but x on {x.device}; move it with "
                         f".to({str(x.device)!r})")
    if eps < 0:
        raise ValueError(f"fused_rmsnorm: eps must be >= 0, got {eps}")
    if keep_input and residual is not None:
        raise ValueError("fused_rmsnorm: keep_input=True returns (y, x) and takes no residual; with a residual "
                         "the op returns (y, x + residual) already")
    if residual is not None and residual.dtype != x.dtype:
        # as the unfused x + residual (and the reference) promote: under torch.autocast a decoder layer's attention
        # output is in the autocast dtype and its residual stream is not. The add then runs on its own
        h = x + residual
        return fused_rmsnorm(h, weight, eps, impl=impl, rounding=rounding), h
    kernel = None
    if impl != "auto" or x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        kernel = kernel_for("fused_rmsnorm", _BUILDERS, x.device.type, impl, _Library)
    if kernel is not None and weight.dtype != x.dtype and weight.dtype in (torch.float16, torch.bfloat16):
        # the kernels take a weight of x's dtype or fp32; a 16-bit weight of another dtype (a bf16 model's norm fed
        # fp32 activations) is exact in fp32, and the product is rounded to x's dtype as with an fp32 weight. Its
        # gradient, summed in fp32, is rounded to the weight's dtype by the cast's backward
        weight = weight.float()
    if kernel is not None and not weight.is_contiguous():  # the kernels read it as one vector (a strided view of
        weight = weight.contiguous()                      # a bigger tensor, say); its gradient flows back through
    if kernel is None:
        y = rmsnorm_reference(x, weight, eps, residual, rounding)
        return (y, x) if keep_input else y
    shape = x.shape
    out = _FusedRMSNormFunction.apply(as_rows(x), weight, None if residual is None else as_rows(residual),
                                      float(eps), kernel, bool(keep_input), stock)
    shaped = lambda t: t if t.shape == shape else t.reshape(shape)  # noqa: E731  (a view: rows of x's shape)
    if isinstance(out, tuple):
        return shaped(out[0]), shaped(out[1])
    return shaped(out)
