"""The MoE layer's expert GEMMs as one grouped GEMM of our own (csrc/grouped_gemm, CUTLASS 3 on Hopper), with
autograd, and its plain-PyTorch reference.

Legend: P rows (token-expert pairs, expert-major), E groups (experts), I in features, O out features.

    y_PO = grouped_linear(x_PI, w_EOI, offs_E)     y[rows of e] = x[rows of e] @ w[e].T

``offs_E`` holds the int32 inclusive group ends (``cumsum`` of the rows per expert; ``offs_E[-1] == P``), read on
the device: no host sync. Backward: dx = grouped(dy, w[e]) (B row-major) and dw[e] = dy[rows e].T @ x[rows e]
(the K-ragged weight gradient, written in w's own [E, O, I] layout; an expert with no rows gets zeros, never a
missing gradient).

Why not torch's ``F.grouped_mm``: it is the same CUTLASS kernel family with one tile for every large problem.
benchmarks/diagnose_grouped_gemm.py (ab44d7f) measured it 4-17% slower than cuBLAS on the layer's per-expert
products at the e2e shapes (the down forward and the gate_up input gradient, whose 2048 output columns leave the
last wave of 128x256 tiles a quarter full, the most); this op picks one of three tile configurations per product
(:func:`choose_config`).

Where the kernel cannot run (not CUDA, not bf16, not an sm_90 device, rows not a multiple of 8 elements, the op
not built: CUTLASS headers missing) :func:`grouped_linear_kernel` returns None and the caller keeps torch's
``F.grouped_mm``. ``LOONGFORGE_GROUPED_GEMM=torch`` makes that choice for every call (A/B benchmarks);
``LOONGFORGE_GROUPED_GEMM_CONFIGS=f,d,w`` pins the forward, input-gradient and weight-gradient configurations.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ds_loongforge.op_builder.grouped_gemm import GroupedGemmBuilder
from ds_loongforge.ops._dispatch import kernel_for

_BUILDERS = {"cuda": GroupedGemmBuilder}
_BACKEND_ENV = "LOONGFORGE_GROUPED_GEMM"
_CONFIGS_ENV = "LOONGFORGE_GROUPED_GEMM_CONFIGS"
# (tile M, tile N, relative rate of a full tile): 0 cooperative 128x256, 1 cooperative 256x128, 2 pingpong 128x128
CONFIG_TILES = ((128, 256, 1.0), (256, 128, 1.0), (128, 128, 0.95))


def grouped_linear_reference(x_PI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e].T, one torch GEMM per group, in x's dtype (fp64 in the tests)."""
    ends = offs_E.tolist()
    y = x_PI.new_empty(x_PI.shape[0], w_EOI.shape[1])
    start = 0
    for e, end in enumerate(ends):
        torch.mm(x_PI[start:end], w_EOI[e].t(), out=y[start:end])
        start = end
    return y


def _waves(tiles: int, sm_count: int) -> int:
    return math.ceil(tiles / sm_count)


@functools.lru_cache(maxsize=256)
def choose_config(rows: int, groups: int, n: int, wgrad: bool, sm_count: int) -> int:
    """The tile configuration with the fewest estimated full-tile waves (divided by its relative rate).

    Rows mode (``rows`` = P): each group's rows make ceil(m_e / TM) tiles along M, about P / TM + groups / 2 over
    all groups. Weight gradient (``rows`` = the output's M): every group is one [rows, n] tile grid."""
    best, best_cost = 0, float("inf")
    for config, (tm, tn, rate) in enumerate(CONFIG_TILES):
        if wgrad:
            tiles = groups * math.ceil(rows / tm) * math.ceil(n / tn)
        else:
            tiles = (math.ceil(rows / tm) + groups // 2) * math.ceil(n / tn)
        cost = _waves(tiles, sm_count) * tm * tn / rate
        if cost < best_cost:
            best, best_cost = config, cost
    return best


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pinned(slot: int) -> int | None:
    pinned = os.environ.get(_CONFIGS_ENV)
    if not pinned:
        return None
    values = [int(v) for v in pinned.split(",")]
    if len(values) != 3:
        raise ValueError(f"{_CONFIGS_ENV}={pinned!r}: give three configurations (forward,dgrad,wgrad), each 0..2")
    return values[slot]


def _rows_config(x: torch.Tensor, groups: int, n: int, slot: int) -> int:
    pinned = _pinned(slot)
    if pinned is not None:
        return pinned
    return choose_config(x.shape[0], groups, n, False, _sm_count(x.device))


def _wgrad_config(m: int, n: int, groups: int, device: torch.device) -> int:
    pinned = _pinned(2)
    if pinned is not None:
        return pinned
    return choose_config(m, groups, n, True, _sm_count(device))


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_PI, w_EOI, offs_E, kernel):
        ctx.save_for_backward(x_PI, w_EOI, offs_E)
        ctx.kernel = kernel
        config = _rows_config(x_PI, w_EOI.shape[0], w_EOI.shape[1], 0)
        return kernel.rows(x_PI, w_EOI, offs_E, True, config)

    @staticmethod
    def backward(ctx, dy_PO):
        x_PI, w_EOI, offs_E = ctx.saved_tensors
        kernel = ctx.kernel
        dy_PO = dy_PO.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = kernel.rows(dy_PO, w_EOI, offs_E, False, _rows_config(dy_PO, w_EOI.shape[0], w_EOI.shape[2], 1))
        if ctx.needs_input_grad[1]:
            config = _wgrad_config(w_EOI.shape[1], w_EOI.shape[2], w_EOI.shape[0], x_PI.device)
            dw = kernel.wgrad(dy_PO, x_PI, offs_E, config)
        return dx, dw, None, None


def _supported(x_PI: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    if x_PI.device.type != "cuda" or x_PI.dtype != torch.bfloat16 or w_EOI.dtype != torch.bfloat16:
        return False
    if x_PI.dim() != 2 or w_EOI.dim() != 3 or x_PI.shape[1] % 8 or w_EOI.shape[1] % 8:
        return False
    return torch.cuda.get_device_capability(x_PI.device) == (9, 0)


def grouped_linear_kernel(x_PI: torch.Tensor, w_EOI: torch.Tensor, impl: str = "auto"):
    """The compiled grouped GEMM for these operands, or None where it cannot run (module doc)."""
    if os.environ.get(_BACKEND_ENV, "").lower() == "torch" or impl == "reference":
        return None
    if not _supported(x_PI, w_EOI):
        if impl == "cuda":
            raise ValueError(f"grouped_linear: impl='cuda' needs bf16 CUDA tensors on an sm_90 device with rows of a "
                             f"multiple of 8 elements, got x {x_PI.dtype} {tuple(x_PI.shape)} and w {w_EOI.dtype} "
                             f"{tuple(w_EOI.shape)} on {x_PI.device}")
        return None
    return kernel_for("grouped GEMM", _BUILDERS, "cuda", impl)


def grouped_linear(x_PI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor, kernel=None) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e].T on the compiled kernel (``kernel``: from :func:`grouped_linear_kernel`)."""
    if kernel is None:
        kernel = grouped_linear_kernel(x_PI, w_EOI, "cuda")
    if offs_E.dtype != torch.int32:
        raise ValueError(f"grouped_linear: offs_E must be int32 group ends, got {offs_E.dtype}")
    return _GroupedLinearFunction.apply(x_PI.contiguous(), w_EOI.contiguous(), offs_E.contiguous(), kernel)
