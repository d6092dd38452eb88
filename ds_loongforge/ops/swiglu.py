"""Fused SwiGLU + dropout on the concatenated gate/up projection, and its plain-PyTorch reference.

    gate_up [..., 2I] = [gate | up]  ->  out [..., I] = dropout_p(silu(gate) * up)

The dropout mask of flat output element e is bit (e % 4) of Philox4x32-10(counter=(e // 4, offset),
key=seed), kept when the 32-bit word is below floor((1 - p) * 2^32). The CUDA kernel, the CPU kernel
and :func:`philox_keep_mask` below compute the same mask, so every implementation agrees exactly for a
given seed; backward regenerates it instead of storing it. ``p == 0`` draws no random numbers.

Rounding (``rounding=``, see ``ops._dispatch.ROUNDINGS``), for float16/bfloat16 tensors; rnd(v) rounds the fp32 value
v to the tensor's dtype, s = sigmoid(gate), scale = 1 / (1 - p):

* "stock" (the default) rounds where transformers' eager MLP, ``act_fn(gate) * up``, then dropout, and its
  autograd round: a = rnd(silu(gate)), h = rnd(a * up), out = rnd(h * scale) where kept (else 0); backward
  dh = rnd(dout * scale) where kept (else 0), dup = rnd(dh * a), dgate = rnd(rnd(dh * up) * s * (1 + gate * (1 - s))).
  The kernels then match eager PyTorch up to the last fp32 bit of exp, which moves an element by one unit of the
  dtype at rare times.
* "once": fp32 from the inputs to each output, rounded once (closer to the exact value than stock, and different).

float32 tensors (and the reference's float64) compute the same under both.
"""

from __future__ import annotations

import torch

from ds_loongforge.op_builder import FusedSwiGLUBuilder, FusedSwiGLUCPUBuilder
from ds_loongforge.ops._dispatch import (CUDAGRAPH_UNSAFE, as_rows, check_rounding, check_rows_input, kernel_for,
                                         library_module, refuse_double_backward)

_BUILDERS = {"cuda": FusedSwiGLUBuilder, "cpu": FusedSwiGLUCPUBuilder}
_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_SEED_MAX = 2**63 - 1


def keep_threshold(p: float) -> int:
    t = (1.0 - p) * 4294967296.0
    return _MASK32 if t >= 4294967295.0 else int(t)


def _mulhilo(m: int, c: torch.Tensor):
    """(hi, lo) 32-bit halves of m * c for uint32 values held in int64, without int64 overflow."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    c_hi, c_lo = c >> 16, c & 0xFFFF
    low = c_lo * m_lo
    mid = c_hi * m_lo + c_lo * m_hi
    lo_sum = low + ((mid & 0xFFFF) << 16)
    lo = lo_sum & _MASK32
    hi = (c_hi * m_hi + (mid >> 16) + (lo_sum >> 32)) & _MASK32
    return hi, lo


def philox_words(counter: torch.Tensor, offset: int, seed: int) -> torch.Tensor:
    """Philox4x32-10 words [n, 4] for 64-bit block counters (int64), as the kernels compute them:
    counter = (block lo, block hi, offset lo, offset hi), key = (seed lo, seed hi)."""
    c = [counter & _MASK32, (counter >> 32) & _MASK32, torch.full_like(counter, offset & _MASK32),
         torch.full_like(counter, (offset >> 32) & _MASK32)]
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c[0])
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + _PHILOX_W[0]) & _MASK32
        k1 = (k1 + _PHILOX_W[1]) & _MASK32
    return torch.stack(c, dim=-1)


def philox_keep_mask(numel: int, p: float, seed: int, offset: int = 0,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool keep-mask of ``numel`` flat elements, bit-identical to the kernels' mask."""
    blocks = torch.arange((numel + 3) // 4, dtype=torch.int64, device=device)
    words = philox_words(blocks, offset, seed).reshape(-1)[:numel]
    return words < keep_threshold(p)


def _check_p(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"swiglu_dropout: p must be in [0, 1), got {p}")


def swiglu_reference(gate_up: torch.Tensor, p: float = 0.0, seed: int = 0, offset: int = 0,
                     rounding: str = "stock") -> torch.Tensor:
    """Plain PyTorch with the kernel's semantics (same Philox mask), rounded as ``rounding`` says.

    "stock" on a 16-bit tensor is the eager expression in its dtype, ``where(keep, silu(gate) * up * scale, 0)``,
    so autograd's backward rounds where the kernels' stock backward does; otherwise fp32 math (fp64 for fp64
    inputs) with one rounding."""
    stock = check_rounding("swiglu_reference", rounding)
    _check_p(p)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension holds [gate | up] and must be even, got {gate_up.shape[-1]}")
    acc = torch.float64 if gate_up.dtype == torch.float64 else torch.float32
    if stock and gate_up.dtype not in (torch.float32, torch.float64):
        acc = gate_up.dtype  # every op below computes in fp32 and stores its result in this dtype
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    if p > 0:
        keep = philox_keep_mask(out.numel(), p, seed, offset, gate_up.device).view(out.shape)
        out = torch.where(keep, out * (1.0 / (1.0 - p)), torch.zeros((), dtype=acc, device=out.device))
    return out.to(gate_up.dtype)


# The kernels as torch.library custom ops for torch.compile (see ops/rmsnorm.py). A given seed (or p = 0) is a plain
# int. A seed drawn inside a compiled graph is an int64 tensor of one element on the CPU, read by the kernel when it
# runs (a read at trace time would break the graph); those ops are marked unsafe for CUDA graphs, whose replay would
# repeat the recorded seed.
@torch.library.custom_op("loongforge::swiglu_forward", mutates_args=())
def _forward_op(gate_up: torch.Tensor, p: float, seed: int, offset: int, stock: bool) -> torch.Tensor:
    return library_module(_BUILDERS, gate_up.device.type).forward(gate_up, p, seed, offset, stock)


@torch.library.custom_op("loongforge::swiglu_forward_drawn_seed", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _forward_drawn_op(gate_up: torch.Tensor, p: float, seed: torch.Tensor, offset: int, stock: bool) -> torch.Tensor:
    return _forward_op(gate_up, p, int(seed), offset, stock)


@torch.library.custom_op("loongforge::swiglu_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, gate_up: torch.Tensor, p: float, seed: int, offset: int,
                 stock: bool) -> torch.Tensor:
    return library_module(_BUILDERS, gate_up.device.type).backward(dout, gate_up, p, seed, offset, stock)


@torch.library.custom_op("loongforge::swiglu_backward_drawn_seed", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _backward_drawn_op(dout: torch.Tensor, gate_up: torch.Tensor, p: float, seed: torch.Tensor, offset: int,
                       stock: bool) -> torch.Tensor:
    return _backward_op(dout, gate_up, p, int(seed), offset, stock)


for _op in (_forward_op, _forward_drawn_op):
    _op.register_fake(lambda gate_up, *_: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))
for _op in (_backward_op, _backward_drawn_op):
    _op.register_fake(lambda dout, gate_up, *_: gate_up.new_empty(gate_up.shape))


class _Library:
    """The kernel module's methods over the custom ops (what kernel_for returns under torch.compile)."""

    @staticmethod
    def forward(gate_up, p, seed, offset, stock):
        op = _forward_drawn_op if isinstance(seed, torch.Tensor) else _forward_op
        return op(gate_up, p, seed, offset, stock)

    @staticmethod
    def backward(dout, gate_up, p, seed, offset, stock):
        op = _backward_drawn_op if isinstance(seed, torch.Tensor) else _backward_op
        return op(dout, gate_up, p, seed, offset, stock)


class _FusedSwiGLUFunction(torch.autograd.Function):
    """Over 2-D rows; swiglu_dropout shapes the output outside the Function (a view made inside one could not be
    modified in place by the caller)."""

    @staticmethod
    def forward(ctx, rows, p, seed, offset, kernel, stock):
        out = kernel.forward(rows, p, seed, offset, stock)
        ctx.save_for_backward(rows)
        ctx.args = (p, seed, offset, kernel, stock)
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_double_backward("swiglu_dropout")
        (rows,) = ctx.saved_tensors
        p, seed, offset, kernel, stock = ctx.args
        return kernel.backward(dout.contiguous(), rows, p, seed, offset, stock), None, None, None, None, None


def draw_seed() -> int:
    """A dropout seed from torch's default CPU generator (follows torch.manual_seed; no device sync)."""
    return int(torch.randint(0, _SEED_MAX, (1,), dtype=torch.int64).item())


def swiglu_dropout(gate_up: torch.Tensor, p: float = 0.0, seed: int | None = None, offset: int = 0,
                   impl: str = "auto", rounding: str = "stock") -> torch.Tensor:
    """``dropout_p(silu(gate) * up)`` for ``gate_up = [gate | up]`` along the last dimension.

    ``seed=None`` draws one from torch's generator when ``p > 0``; a given seed reproduces the mask.
    ``rounding``: "stock" (eager PyTorch's roundings) or "once" (fp32 to each output; see the module docstring).
    """
    stock = check_rounding("swiglu_dropout", rounding)
    _check_p(p)
    check_rows_input("swiglu_dropout", gate_up, "gate_up")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_dropout: the last dimension holds [gate | up] and must be even, "
                         f"got shape {tuple(gate_up.shape)}")
    compiling = torch.compiler.is_compiling()
    if seed is None and p > 0 and compiling:
        # drawn inside the graph (torch.compile's generator) and read by the kernel at run time: reading it here
        # (draw_seed's .item()) would break the graph
        seed = torch.randint(0, _SEED_MAX, (1,), dtype=torch.int64)
    elif seed is None:
        seed = draw_seed() if p > 0 else 0
    if not 0 <= offset <= _SEED_MAX or (not isinstance(seed, torch.Tensor) and not 0 <= seed <= _SEED_MAX):
        raise ValueError(f"swiglu_dropout: seed and offset must be in [0, 2^63), got seed={seed} offset={offset}")
    kernel = None
    if impl != "auto" or gate_up.dtype in (torch.float32, torch.float16, torch.bfloat16):
        kernel = kernel_for("swiglu_dropout", _BUILDERS, gate_up.device.type, impl, _Library)
    if kernel is None:
        return swiglu_reference(gate_up, p, int(seed), offset, rounding)
    if not isinstance(seed, torch.Tensor):
        seed = int(seed)
    out = _FusedSwiGLUFunction.apply(as_rows(gate_up), float(p), seed, int(offset), kernel, stock)
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
