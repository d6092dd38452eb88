"""Fused softmax cross-entropy over a chunk of logits: the loss terms and the logits' gradient in one pass.

Legend (shape suffixes): C rows of the chunk, V classes.

Per row r of logits x_CV (fp32, bf16 or fp16: the dtype the logits GEMM wrote), with lse = max(x) +
log(sum(exp(x - max(x)))) in fp32:

    nll_C[r]     = valid_C[r] ? lse - x[r, target_C[r]] : 0
    grad_CV[r]   = (exp(x[r] - lse) - onehot(target_C[r])) * scale_C[r]      (when grad_CV is given)

The gradient is written, cast once, into ``grad_CV`` (fp32/bf16/fp16; typically a row slice of a bigger [N, V]
buffer). 16-bit logits are upcast on load, as the unfused ``logits.float()`` does, so the loss is the one transformers
computes from the same bf16 logits. The CUDA kernel reads each row from HBM once and writes the gradient once, where
the eager sequence (log_softmax, gather, exp_, scatter_add_, mul) reads and writes [C, V] fp32 several times.
Ignored rows carry target 0, valid False and scale 0 (the caller maps them; nothing here selects rows by a boolean
mask, so nothing synchronises with the host). fp64 logits run :func:`cross_entropy_reference` (no kernel).
"""

from __future__ import annotations

import torch

from ds_loongforge.op_builder import FusedCrossEntropyBuilder, FusedCrossEntropyCPUBuilder
from ds_loongforge.ops._dispatch import check_impl, kernel_for, library_module

_BUILDERS = {"cuda": FusedCrossEntropyBuilder, "cpu": FusedCrossEntropyCPUBuilder}
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOGITS_DTYPES = _GRAD_DTYPES + (torch.float64,)  # fp64 runs the reference


# The kernels as torch.library custom ops for torch.compile (see ops/rmsnorm.py). These return the gradient and
# the scaled tensor as new tensors, which _Library copies into the caller's buffer: a custom op that wrote into an
# argument (possibly the logits it reads) would have to be functionalized around anyway.
@torch.library.custom_op("loongforge::cross_entropy_forward", mutates_args=())
def _forward_op(logits_CV: torch.Tensor, target_C: torch.Tensor, valid_C: torch.Tensor, scale_C: torch.Tensor,
                want_grad: bool, grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    grad_CV = torch.empty(logits_CV.shape, dtype=grad_dtype, device=logits_CV.device) if want_grad else None
    nll_C = library_module(_BUILDERS, logits_CV.device.type).forward(logits_CV, target_C, valid_C, scale_C, grad_CV)
    return nll_C, (logits_CV.new_empty(0, dtype=grad_dtype) if grad_CV is None else grad_CV)


@_forward_op.register_fake
def _(logits_CV, target_C, valid_C, scale_C, want_grad, grad_dtype):
    return (logits_CV.new_empty(logits_CV.shape[0], dtype=torch.float32),
            logits_CV.new_empty(logits_CV.shape if want_grad else (0,), dtype=grad_dtype))


@torch.library.custom_op("loongforge::scale_by", mutates_args=())
def _scale_by_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return library_module(_BUILDERS, x.device.type).scale_by(x, scale, None)


@_scale_by_op.register_fake
def _(x, scale):
    return torch.empty_like(x)


class _Library:
    """The kernel module's methods over the custom ops (what kernel_for returns under torch.compile)."""

    @staticmethod
    def forward(logits_CV, target_C, valid_C, scale_C, grad_CV):
        nll_C, grad = _forward_op(logits_CV, target_C, valid_C, scale_C, grad_CV is not None,
                                  logits_CV.dtype if grad_CV is None else grad_CV.dtype)
        if grad_CV is not None:
            grad_CV.copy_(grad)
        return nll_C

    @staticmethod
    def scale_by(x, scale, out):
        scaled = _scale_by_op(x, scale)
        return scaled if out is None else out.copy_(scaled)


def cross_entropy_reference(logits_CV: torch.Tensor, target_C: torch.Tensor, valid_C: torch.Tensor,
                            scale_C: torch.Tensor, grad_CV: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch with the op's semantics: fp32 math (fp64 for fp64 logits), one [C, V] temporary.

    This is also the unfused path that ``linear_cross_entropy`` runs for fp64 and when the kernel is unavailable.
    """
    acc = accumulation_dtype(logits_CV.dtype)
    logp_CV = torch.log_softmax(logits_CV.to(acc), dim=1)
    target_C1 = target_C.unsqueeze(1)
    nll_C = torch.where(valid_C, logp_CV.gather(1, target_C1).squeeze(1).neg(), 0.0)
    if grad_CV is not None:
        p_CV = logp_CV.exp_()
        p_CV.scatter_add_(1, target_C1, p_CV.new_full(target_C1.shape, -1.0))
        torch.mul(p_CV, scale_C.to(acc).unsqueeze(1), out=grad_CV)  # the cast is part of the multiply
    return nll_C


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the loss is computed in for logits (or inputs) of ``dtype``: fp64 for fp64, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_args(logits_CV, target_C, valid_C, scale_C, grad_CV) -> None:
    name = "softmax_cross_entropy_"
    if not isinstance(logits_CV, torch.Tensor) or logits_CV.dim() != 2 or logits_CV.shape[1] < 1:
        shape = tuple(logits_CV.shape) if isinstance(logits_CV, torch.Tensor) else type(logits_CV).__name__
        raise ValueError(f"{name}: logits_CV must be a [C, V] tensor with V >= 1, got {shape}")
    if logits_CV.dtype not in _LOGITS_DTYPES:
        raise ValueError(f"{name}: logits_CV is {logits_CV.dtype}; the op takes float32, bfloat16 or float16 logits "
                         f"(float64 runs the reference): pass logits_CV.float()")
    if logits_CV.shape[1] > 1 and logits_CV.stride(1) != 1:
        raise ValueError(f"{name}: logits_CV must have unit stride along V, got strides {logits_CV.stride()}; "
                         f"pass logits_CV.contiguous()")
    rows = logits_CV.shape[0]
    for arg, t, dtype in (("target_C", target_C, torch.int64), ("valid_C", valid_C, torch.bool),
                          ("scale_C", scale_C, accumulation_dtype(logits_CV.dtype))):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (rows,):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {arg} must be a {dtype} tensor of shape ({rows},) (one per logits row), "
                             f"got {got}")
        if t.device != logits_CV.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but logits_CV on {logits_CV.device}; move it with "
                             f".to(logits_CV.device)")
    if grad_CV is None:
        return
    allowed = _GRAD_DTYPES + ((torch.float64,) if logits_CV.dtype == torch.float64 else ())
    if not isinstance(grad_CV, torch.Tensor) or grad_CV.dtype not in allowed \
            or grad_CV.shape != logits_CV.shape:
        got = f"{grad_CV.dtype} {tuple(grad_CV.shape)}" if isinstance(grad_CV, torch.Tensor) \
            else type(grad_CV).__name__
        raise ValueError(f"{name}: grad_CV must be None or a tensor of the logits' shape {tuple(logits_CV.shape)} "
                         f"with dtype in {[str(d) for d in allowed]}, got {got}")
    if grad_CV.device != logits_CV.device:
        raise ValueError(f"{name}: grad_CV is on {grad_CV.device} but logits_CV on {logits_CV.device}")
    if grad_CV.shape[1] > 1 and grad_CV.stride(1) != 1:
        raise ValueError(f"{name}: grad_CV must have unit stride along V (rows may be strided, e.g. a row slice "
                         f"of a bigger buffer), got strides {grad_CV.stride()}")


def softmax_cross_entropy_(logits_CV: torch.Tensor, target_C: torch.Tensor, valid_C: torch.Tensor,
                           scale_C: torch.Tensor, grad_CV: torch.Tensor | None = None,
                           impl: str = "auto") -> torch.Tensor:
    """Per-row softmax cross-entropy of ``logits_CV`` [C, V] (fp32/bf16/fp16, fp32 math): returns ``nll_C`` (fp32,
    0 on rows where ``valid_C`` is False) and, when ``grad_CV`` [C, V] is given, writes ``(softmax -
    onehot(target)) * scale_C`` into it (in place, cast to its dtype; it may be ``logits_CV`` itself, whose values
    the gradient then replaces). No autograd: the caller owns the gradient.

    target_C: int64 [C] in [0, V) (map ignored rows to 0). valid_C: bool [C]. scale_C: fp32 [C] (fp64 for fp64
    logits), the gradient's row scale (0 on ignored rows). Rows of logits_CV and grad_CV may be strided (unit stride
    along V). A target outside [0, V) raises "out of bounds" on CPU and trips a device-side assert on CUDA.
    impl: "auto" (the kernel for the tensors' device; the reference when its build fails), "cuda", "cpu",
    "reference". float64 logits always run the reference.
    """
    _check_args(logits_CV, target_C, valid_C, scale_C, grad_CV)
    if logits_CV.dtype == torch.float64:
        check_impl(impl)
        return cross_entropy_reference(logits_CV, target_C, valid_C, scale_C, grad_CV)
    kernel = kernel_for("softmax_cross_entropy_", _BUILDERS, logits_CV.device.type, impl, _Library)
    if kernel is None:
        return cross_entropy_reference(logits_CV, target_C, valid_C, scale_C, grad_CV)
    # the per-row vectors are C elements: a copy of a strided one costs nothing next to the [C, V] logits
    return kernel.forward(logits_CV, target_C.contiguous(), valid_C.contiguous(), scale_C.contiguous(), grad_CV)


def scale_by_reference(x: torch.Tensor, scale: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``x * scale`` in the scale's dtype (float32 for a float32 scale), rounded once to x's dtype. The scale goes
    in as a [1, ..., 1] tensor: a 0-dim one takes x's dtype in type promotion, and on CUDA ``x.mul_(scale)`` then
    rounds it to x's dtype first (an fp16 loss scale of 2^16 became inf; 1/3 is 0.3340 in bf16)."""
    s = scale.reshape((1,) * x.dim())
    return x.mul_(s) if in_place else torch.mul(x, s, out=torch.empty_like(x))


def scale_by(x: torch.Tensor, scale: torch.Tensor, in_place: bool = False, impl: str = "auto") -> torch.Tensor:
    """:func:`scale_by_reference` (``x`` times a one-element device ``scale``, one rounding; ``in_place``
    overwrites x) in one vectorized pass where x is a contiguous fp32/bf16/fp16 tensor and the scale a float32 on
    its device. The LM head's backward scales [N, H] tensors by the loss's incoming gradient: on the H200 torch ran
    each as a generic broadcast kernel of mixed dtypes (71 us for 32 MiB of bf16, ~1 TB/s). The same bits either
    way. ``impl`` as in :func:`softmax_cross_entropy_`; other inputs take the reference."""
    check_impl(impl)
    fits = (x.dtype in _GRAD_DTYPES and x.is_contiguous() and scale.dtype == torch.float32 and scale.numel() == 1
            and scale.device == x.device)
    kernel = kernel_for("scale_by", _BUILDERS, x.device.type, impl, _Library) if fits or impl != "auto" else None
    if kernel is None:
        return scale_by_reference(x, scale, in_place)
    return kernel.scale_by(x, scale.reshape(1), x if in_place else None)
