"""Fused rotary position embedding: a family's ``apply_rotary_pos_emb`` -> Liger-Kernel's Triton RoPE on CUDA.

transformers' attention calls the function of its own modeling module by name
(``modeling_mixtral.apply_rotary_pos_emb(q, k, cos, sin)``), so the replacement is a process-wide patch of that
module attribute, not a module swap: every model of that family in the process uses it. The patch is a wrapper
that sends a call to Liger (its Triton ``LigerRopeFunction``; ``liger_rotary_pos_emb`` where that class is missing)
only when Liger computes what the original returns, and calls the original otherwise:

* q, k, cos, sin plain tensors on one CUDA device (a model injected on the CPU and moved to the GPU later runs the
  original while its tensors are on the CPU); q [B, Hq, S, D], k [B, Hk, S, D], cos = sin shape [1 or B, S, D]
  (HF's layout, ``unsqueeze_dim=1``); D even; nothing empty; cos/sin not requiring grad (Liger gives them none).
* q and k of one dtype, and the dtype HF's broadcasting gives the result, promote(q, cos, sin), is fp16, bf16 or
  fp32 (fp64: the original). Where cos/sin and q differ (autocast: q bf16, cos fp32, HF returns fp32) the inputs
  are cast to that dtype first, so Liger computes in the dtype HF computes in and returns the dtype HF returns.

The checks read shapes, dtypes and devices only: no host-device sync. A Liger call that raises (a Triton build
failure, say) warns once and the original runs from then on; with strict ops (``"strict_ops": true`` or
``LOONGFORGE_STRICT_OPS=1``) it is raised.

In place: Liger's kernel rotates q and k in their own storage when their rows are where it can index them
(``rows_in_place``: B x S rows of one stride, each row's heads D apart), which is the layout HF's attention hands it
(``q_proj(x).view(B, S, H, D).transpose(1, 2)``; also any [B, H, 1, D] tensor) and that of the column slices of the
fused q/k/v product (``fused_kernels.qkv``); its backward rotates the incoming gradients in place the same way.
Liger's own LigerRopeFunction copies any input that is not contiguous, so with Liger 0.8.5's kernel arguments the
kernel is launched by ``RowStridedRope`` here, on q/k where they are (other Liger versions: LigerRopeFunction). The
Triton stores bypass autograd's version counters, so a clobbered saved tensor would not raise. That is safe in the
families covered: nothing reads the pre-rotation q/k after the call and no autograd node saved them (a Linear
saves its input, HF's RMSNorm and FusedRMSNorm theirs, not their outputs; the q/k/v product is saved by nothing),
and the gradients reaching it are fresh tensors of SDPA's / eager
attention's backward used nowhere else. Not safe: a caller that keeps using the q/k it passed in (it sees them
rotated), or a gradient that is also used elsewhere (``grad_outputs`` passed straight to ``torch.autograd.grad``,
a ``retain_grad()`` on the rotated q, an output that also feeds an addition). tests/integrations/
test_rope_injection.py checks the families' models with a PyTorch function of the same in-place contract whose
writes do bump the version counters.

torch.compile: each patched call is a Triton kernel behind an autograd.Function; for a compiled model (where
Inductor fuses HF's RoPE itself) ``"rope": false`` is likely the better choice.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import warnings
from typing import Callable

import torch

from ds_loongforge.integrations import _patching
from ds_loongforge.ops._dispatch import refuse_double_backward

logger = logging.getLogger("ds_loongforge")

LIGER_DIST = "liger-kernel"
LIGER_MODULE = "liger_kernel.transformers.rope"
LIGER_OPS_MODULE = "liger_kernel.ops.rope"
ORIGINAL_ATTR = _patching.ORIGINAL_ATTR  # on a wrapper: the function it replaced
FUSED_ATTR = "__loongforge_fused__"        # on a wrapper: the fused function it calls
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the parameters after (q, k, cos, sin) of the standard function: transformers 5.x, and 4.x with position_ids
_STANDARD_TAILS = (("unsqueeze_dim",), ("position_ids", "unsqueeze_dim"))

_patches = _patching.ModulePatches("rotary function")
_lock = _patches.lock
_failed: dict[str, str] = {}  # fused function's label -> why it is no longer called


# Liger 0.8.5's kernel arguments, which RowStridedRope passes positionally: any other list and LigerRopeFunction runs
_KERNEL_ARGS = ("q_ptr", "q_row_stride", "k_ptr", "k_row_stride", "cos", "cos_row_stride", "sin", "sin_row_stride",
                "sl", "bs", "cos_bs", "n_qh", "n_kh", "hd", "pad_n_qh", "pad_n_kh", "pad_hd", "pad_rd", "rd",
                "BLOCK_SIZE", "BACKWARD_PASS")


def _kernel_args(kernel) -> tuple[str, ...]:
    """The parameter names of a Triton kernel (its Python function's signature), () for anything else."""
    function = getattr(kernel, "fn", None)
    try:
        return tuple(inspect.signature(function).parameters) if callable(function) else ()
    except (TypeError, ValueError):
        return ()


def rows_in_place(x: torch.Tensor) -> bool:
    """Whether Liger's kernel can rotate ``x`` [B, H, S, D] in its own storage: the kernel walks B x S rows of one
    stride with each row's heads D apart. True for HF's projection layout (``q_proj(x).view(B, S, H, D)
    .transpose(1, 2)``) and for a column slice of the fused q/k/v product (rows N apart)."""
    rows = x.transpose(1, 2)
    batch, seq, heads, dim = rows.shape
    return (rows.stride(3) == 1 and (heads == 1 or rows.stride(2) == dim) and rows.stride(1) >= heads * dim
            and (batch == 1 or rows.stride(0) == seq * rows.stride(1)))


def _liger_kernel_rope(q, k, cos, sin, backward: bool):
    """q [B, Hq, S, D], k [B, Hk, S, D] rotated (backward: by the inverse rotation) by Liger's kernel, in their own
    storage where ``rows_in_place`` holds, else in a contiguous copy, as Liger's own functions do; returns the
    [B, H, S, D] views of what was rotated."""
    import triton
    from liger_kernel.ops.rope import _triton_rope

    q_rows, k_rows = (t.transpose(1, 2) for t in (q, k))
    q_rows = q_rows if rows_in_place(q) else q_rows.contiguous()
    k_rows = k_rows if rows_in_place(k) else k_rows.contiguous()
    batch, seq, heads_q, dim = q_rows.shape
    heads_k = k_rows.shape[2]
    cos, sin = cos.contiguous(), sin.contiguous()
    pad_q, pad_k = triton.next_power_of_2(heads_q), triton.next_power_of_2(heads_k)
    _triton_rope[(batch * seq,)](
        q_rows, q_rows.stride(1), k_rows, k_rows.stride(1), cos, cos.stride(-2), sin, sin.stride(-2), seq, batch,
        cos.shape[0], heads_q, heads_k, dim, pad_q, pad_k, triton.next_power_of_2(dim), triton.next_power_of_2(dim),
        dim, BLOCK_SIZE=max(pad_q, pad_k), BACKWARD_PASS=backward)
    return q_rows.transpose(1, 2), k_rows.transpose(1, 2)


class RowStridedRope(torch.autograd.Function):
    """Liger's RoPE (its Triton kernel, ``LigerRopeFunction``'s math) that also rotates row-strided q/k in place:
    LigerRopeFunction makes every input contiguous first, which for the column slices of the fused q/k/v product
    (``fused_kernels.qkv``) is a copy of q and k per layer (0.53 ms per e2e mixtral step on the H200 at 0d28803).
    Same in-place contract as Liger's (see the module docstring); full rotary dim, cos/sin [1 or B, S, D]."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _liger_kernel_rope(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        refuse_double_backward("fused RoPE (Liger-Kernel's Triton kernel)")
        cos, sin = ctx.saved_tensors
        dq, dk = _liger_kernel_rope(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


def load_liger() -> tuple[Callable | None, str]:
    """(Liger's Triton RoPE as ``fused(q, k, cos, sin)``, ``"liger-kernel X.Y.Z"``), or (None, why it cannot be
    used). Where ``liger_kernel.ops.rope.LigerRopeFunction`` exists it is applied directly: from 0.8 Liger's
    public ``liger_rotary_pos_emb`` goes through its multi-backend dispatcher, whose Python (backend resolution,
    registry lookups, ``torch.compiler.disable``) cost the H200's host more than the Triton launch itself (py-spy
    of the e2e mixtral step: about 1.3 of 1.8 ms per step), and on CUDA that dispatcher runs this same function.
    Where its kernel ``_triton_rope`` takes 0.8.5's arguments, ``RowStridedRope`` launches that kernel itself, so
    that row-strided q/k are rotated in place instead of copied."""
    try:
        fused = importlib.import_module(LIGER_MODULE).liger_rotary_pos_emb
        ops = importlib.import_module(LIGER_OPS_MODULE)
        function = getattr(ops, "LigerRopeFunction", None)
        if function is not None:
            fused = function.apply  # (q, k, cos, sin): its position_ids, unsqueeze_dim and rotary_dim keep defaults
        if _kernel_args(getattr(ops, "_triton_rope", None)) == _KERNEL_ARGS:
            fused = RowStridedRope.apply  # the same kernel, launched on q/k where they are
    except ImportError as err:
        if (err.name or "").split(".")[0] == "liger_kernel":
            return None, f"{LIGER_DIST} is not installed (pip install {LIGER_DIST})"
        return None, f"{LIGER_DIST} does not import ({type(err).__name__}: {err})"
    except Exception as err:  # noqa: BLE001 - e.g. triton failing at import: report, never break inject
        return None, f"{LIGER_DIST} does not import ({type(err).__name__}: {err})"
    try:
        version = importlib.metadata.version(LIGER_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    return fused, f"{LIGER_DIST} {version}"


def cuda_visible() -> bool:
    """Whether a CUDA device is visible, so that CUDA tensors may reach the wrapper (one place for tests)."""
    return torch.cuda.is_available()


def fused_dtype(q, k, cos, sin, unsqueeze_dim, device_type: str = "cuda") -> torch.dtype | None:
    """The dtype Liger is to compute in for these arguments, or None when the original must run.

    Reads metadata only (no host-device sync)."""
    if unsqueeze_dim != 1 or not all(type(t) is torch.Tensor for t in (q, k, cos, sin)):
        return None  # subclasses (DTensor, ...) and HF's [B, S, H, D] layout (unsqueeze_dim=2) run the original
    device = q.device
    if device.type != device_type or k.device != device or cos.device != device or sin.device != device:
        return None
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return None
    batch, _, seq, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != head_dim or head_dim % 2:
        return None
    if cos.shape[0] not in (1, batch) or cos.shape[1] != seq or cos.shape[2] != head_dim:
        return None
    if q.numel() == 0 or k.numel() == 0 or cos.requires_grad or sin.requires_grad or q.dtype != k.dtype:
        return None
    dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
    return dtype if dtype in _FUSED_DTYPES else None


def call_signature(function: Callable) -> inspect.Signature:
    """The signature a call of ``function`` takes: a plain function's own, or the forward's of a module standing for
    one. transformers 5.25 with the ``kernels`` package (one of its requirements from 5.25 on) turns each family's
    ``apply_rotary_pos_emb`` into such a module (kernels' ``Func``, an nn.Module whose forward calls the function
    and carries its signature); ``inspect.signature`` of the module itself would read nn.Module's (*args,
    **kwargs)."""
    if isinstance(function, torch.nn.Module):
        return inspect.signature(function.forward)
    return inspect.signature(function)


def _wraps(original: Callable) -> Callable:
    """functools.wraps for a plain function; for a module standing for one (call_signature), its docstring and the
    call signature only (wraps would copy the module's state into the wrapper and point __wrapped__ at it)."""
    if not isinstance(original, torch.nn.Module):
        return functools.wraps(original)

    def decorate(wrapper: Callable) -> Callable:
        wrapper.__signature__ = call_signature(original)
        wrapper.__doc__ = type(original).forward.__doc__ or original.__doc__
        return wrapper

    return decorate


def make_wrapper(original: Callable, fused: Callable, label: str, tail: tuple[str, ...] = ("unsqueeze_dim",),
                 device_type: str = "cuda") -> Callable:
    """``original`` with calls that ``fused`` can take (``fused_dtype``) sent to ``fused(q, k, cos, sin)``.

    ``tail``: the original's parameters after (q, k, cos, sin); ``label`` names ``fused`` in messages."""

    @_wraps(original)
    def wrapper(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = 1
        if args or kwargs:
            if len(args) > len(tail) or not set(kwargs) <= set(tail[len(args):]):
                return original(q, k, cos, sin, *args, **kwargs)  # not a call it accepts: let it say so
            unsqueeze_dim = {**dict(zip(tail, args)), **kwargs}.get("unsqueeze_dim", 1)
        if torch.compiler.is_compiling():
            # Liger's Triton launch (its kernel subscripted with a grid, in place on q/k) breaks the graph; the
            # compiler fuses the standard expression into one kernel of its own
            return original(q, k, cos, sin, *args, **kwargs)
        dtype = fused_dtype(q, k, cos, sin, unsqueeze_dim, device_type)
        if dtype is None or label in _failed:
            return original(q, k, cos, sin, *args, **kwargs)
        try:
            return fused(*(t if t.dtype == dtype else t.to(dtype) for t in (q, k, cos, sin)))
        except Exception as err:  # noqa: BLE001 - raised before its kernel ran: q/k are untouched
            _give_up(label, err)
            return original(q, k, cos, sin, *args, **kwargs)

    setattr(wrapper, ORIGINAL_ATTR, original)
    setattr(wrapper, FUSED_ATTR, fused)
    return wrapper


def _give_up(label: str, err: Exception) -> None:
    from ds_loongforge.ops._dispatch import strict_ops

    if strict_ops():
        raise err
    with _lock:
        first = label not in _failed
        _failed[label] = f"{type(err).__name__}: {err}"
    if first:
        message = (f"[LoongForge] fused RoPE ({label}) failed, running transformers' apply_rotary_pos_emb from "
                   f"now on: {type(err).__name__}: {err}. Set LOONGFORGE_STRICT_OPS=1 or \"strict_ops\": true to "
                   "make this an error.")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.warning(message)


def reference_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF's standard rotary embedding written out: x * cos + rotate_half(x) * sin over the whole head, for q/k
    [B, H, S, D] and cos/sin [1 or B, S, D] (unsqueezed at dim 1). What a fused function must compute."""
    def rotated(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]

    return rotated(q), rotated(k)


def standard_rope_problem(function: Callable) -> str | None:
    """None when ``function(q, k, cos, sin)`` is HF's standard RoPE (rotate_half over the whole head, cos/sin
    [B, S, D] unsqueezed at dim 1), else what differs. Checks the signature, then the values on a tiny fp64
    CPU input against the formula."""
    try:
        params = list(call_signature(function).parameters.values())
    except (TypeError, ValueError):
        return "its signature cannot be read"
    names = tuple(p.name for p in params)
    if names[:4] != ("q", "k", "cos", "sin") or names[4:] not in _STANDARD_TAILS:
        return f"signature ({', '.join(names)}) is not (q, k, cos, sin, [position_ids,] unsqueeze_dim=1)"
    if params[-1].default != 1:
        return "unsqueeze_dim does not default to 1"
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(2, 1, 5, 8, dtype=torch.float64, generator=gen)
    angle = torch.rand(2, 5, 4, dtype=torch.float64, generator=gen) * 6.0
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()

    try:
        q_out, k_out = function(q, k, cos, sin)
    except Exception as err:  # noqa: BLE001
        return f"it raises on a standard input ({type(err).__name__}: {err})"
    q_want, k_want = reference_rope(q, k, cos, sin)
    if not (torch.allclose(q_out, q_want, rtol=1e-12, atol=1e-12)
            and torch.allclose(k_out, k_want, rtol=1e-12, atol=1e-12)):
        return "it does not compute q * cos + rotate_half(q) * sin over the whole head"
    return None


def patch(module_name: str, function_name: str, fused: Callable, label: str,
          device_type: str = "cuda") -> str | None:
    """Make ``module_name.function_name`` the wrapper around its current value; None when done (or already
    done: the wrapper is never wrapped again), else why it was left alone."""
    return _patches.patch(
        module_name, function_name, standard_rope_problem,
        lambda current: make_wrapper(current, fused, label, tuple(call_signature(current).parameters)[4:],
                                     device_type))


def original(function: Callable) -> Callable:
    """The function a wrapper replaced (a function that is no wrapper: itself)."""
    return _patching.original(function)


def patched() -> list[str]:
    """``module.function`` of every wrapper installed and still in place."""
    return _patches.patched()


def restore() -> list[str]:
    """Put every patched function back (the patch is process-wide) and forget fused functions that failed;
    returns ``module.function`` of each function restored."""
    with _lock:
        restored = _patches.restore()
        _failed.clear()
    return restored
