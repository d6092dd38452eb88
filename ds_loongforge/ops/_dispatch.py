"""Choosing an op's implementation: the compiled kernel for the tensor's device, or the reference.

``impl="auto"`` loads the kernel for the tensor's device (building it on first use). When the build
fails it warns once, naming the op and the fix, and the PyTorch reference runs instead; with strict
ops (``LOONGFORGE_STRICT_OPS=1`` or ``"strict_ops": true`` in the config block) the failure is raised.
``impl="cuda"`` / ``"cpu"`` demand that kernel and raise on failure; ``"reference"`` never compiles.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

import torch

from ds_loongforge.op_builder import OpBuildError

logger = logging.getLogger("ds_loongforge")

IMPLS = ("auto", "cuda", "cpu", "reference")
_STRICT_ENV = "LOONGFORGE_STRICT_OPS"

_state_lock = threading.Lock()
_strict_override: bool | None = None
_unavailable: dict[str, OpBuildError] = {}


def set_strict_ops(strict: bool | None) -> None:
    """Make a failed op build an error (True), a warning with fallback (False), or follow the env (None)."""
    global _strict_override
    _strict_override = strict


def strict_ops() -> bool:
    if _strict_override is not None:
        return _strict_override
    return os.environ.get(_STRICT_ENV, "0").lower() in ("1", "true", "yes")


# Where a fused elementwise op rounds to a 16-bit activation dtype. "stock": where transformers' eager modules
# round (each op of the unfused expression stores its result in the activation dtype: RMSNorm rounds h * rstd
# before the weight multiplies it, SwiGLU rounds silu(gate) before up multiplies it, and the backward rounds the
# same intermediate products), so a fused model keeps the stock model's numerics up to fp32 summation order and
# the last bits of exp/rsqrt; as Liger-Kernel's casting modes do. "once": fp32 throughout, one rounding per
# output (more accurate than stock, and different from it). fp32/fp64 tensors are the same under both.
ROUNDINGS = ("stock", "once")


def check_rounding(op: str, rounding: str) -> bool:
    """Validates ``rounding`` and returns whether it is "stock" (the kernels' flag)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"{op}: rounding={rounding!r} is not one of {ROUNDINGS}; \"stock\" rounds where "
                         f"transformers' eager modules do, \"once\" keeps fp32 to the end")
    return rounding == "stock"


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")


def kernel_for(op: str, builders: dict, device_type: str, impl: str, library=None):
    """The compiled module for ``device_type`` ('cpu'/'cuda'), or None to run the reference.

    ``builders`` maps a device type to the builder class of that op's kernel. Under ``torch.compile``, where the
    module's pybind functions cannot be traced (each call would break the graph), ``library`` is returned instead
    when the kernel loads: the op's class of the same methods over its ``torch.library`` custom ops (see
    ``library_module``), whose fake kernels let the compiler trace through. Loading (or building) is done once, at
    trace time, outside the graph.
    """
    check_impl(impl)
    if impl == "reference":
        return None
    if impl != "auto" and impl != device_type:
        raise ValueError(f"{op}: impl={impl!r} was requested but the tensors are on {device_type!r}; "
                         f"move them to {impl!r} or use impl='auto'")
    if library is not None and torch.compiler.is_compiling():
        return library if _loads(op, builders, device_type, impl) else None
    return _load(op, builders, device_type, impl)


@torch.compiler.assume_constant_result  # run at trace time, its answer a constant of the graph
def _loads(op: str, builders: dict, device_type: str, impl: str) -> bool:
    return _load(op, builders, device_type, impl) is not None


# for custom ops that read a host value when they run (a CUDA graph's replay would repeat the recorded one or skip
# the read); torch versions without the tag get none
CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def library_module(builders: dict, device_type: str):
    """The loaded module a custom op's implementation calls at run time (loaded at trace time by kernel_for)."""
    return builders[device_type]().load()


def _load(op: str, builders: dict, device_type: str, impl: str):
    builder_cls = builders.get(device_type)
    if builder_cls is None:
        if impl == "auto":
            return None
        raise ValueError(f"{op}: no kernel for device type {device_type!r}")
    key = builder_cls.NAME
    failed = _unavailable.get(key)
    if failed is None:
        try:
            return builder_cls().load()
        except OpBuildError as err:
            with _state_lock:
                first = key not in _unavailable
                _unavailable[key] = err
            failed = err
            if impl == "auto" and not strict_ops() and first:
                message = (f"[LoongForge] {op} kernel '{key}' is unavailable, using the PyTorch reference "
                           f"(slower, same results): {err.reason}. Fix: {err.fix}. "
                           f"Set {_STRICT_ENV}=1 or \"strict_ops\": true to make this an error.")
                warnings.warn(message, RuntimeWarning, stacklevel=4)
                logger.warning(message)
    if impl == "auto" and not strict_ops():
        return None
    raise failed


def check_rows_input(op: str, t, what: str = "x") -> None:
    """A row op's input: a floating tensor [..., H] with H >= 1 (what torch's own kernels would reject with a
    message that names neither the op nor the fix)."""
    if t.dim() == 0 or t.shape[-1] == 0:
        raise ValueError(f"{op}: {what} must be [..., hidden] with hidden >= 1, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{op}: {what} must be a floating tensor (float32, float16, bfloat16 or float64), got "
                         f"{t.dtype}")


def as_rows(t):
    """[..., H] as a 2-D [rows, H] view the kernels take (row stride allowed); copies only when the last
    dimension is not unit-stride or the leading dimensions cannot be merged."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def forget_failures() -> None:
    """Retry builds that failed before (after the user fixed the environment)."""
    with _state_lock:
        _unavailable.clear()


def refuse_double_backward(op: str) -> None:
    """Called first in the backward of an autograd Function whose backward is a compiled kernel (or a collective):
    what it returns carries no autograd graph. Under ``create_graph=True`` (grad mode is on inside the backward
    exactly then) a higher-order gradient would silently lack this op's terms, or fail later with "does not
    require grad"; ``once_differentiable`` catches only incoming gradients that require grad, not the
    dependence of this backward on the forward's inputs. So raise here, naming the op and the way out."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op}: double backward (create_graph=True, e.g. a gradient penalty) through this op's "
                           "compiled kernel is not supported: its backward builds no autograd graph, so the "
                           "higher-order gradient would miss this op's terms. Pass impl='reference' to the op or "
                           "module (the PyTorch reference is twice differentiable), or compute the gradient "
                           "without create_graph")
