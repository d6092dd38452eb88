"""Expert-masked, dropless Mixture-of-Experts layer (single process).

Legend (shape suffixes): T tokens, H hidden, I expert intermediate size, E experts, K experts per token,
P = T*K token-expert pairs in expert-major order.

    x_TH -> router: logits_TE -> softmax (fp32) -> top-k (or sampled k) -> ids_TK, weights_TK
         -> expert_routing: stable counting sort of the P pairs by expert (order_P, slot_TK, counts, group ends)
         -> fused permute kernel: gather x rows into expert-major order              x_PH
         -> grouped GEMM gate_up [E, 2I, H] over the per-expert row groups          h_P(2I)
         -> fused SwiGLU (+dropout)                                                 a_PI
         -> grouped GEMM down [E, H, I]                                             y_PH
         -> fused unpermute kernel: each token gathers its K rows, weighted sum in fp32  out_TH

The backward of both GEMMs runs one cuBLAS GEMM per expert where experts are few and large (at most 16,
at least 1024 rows each): the group sizes are copied to the host behind the routing in the forward and
are there long before the backward (_GroupedExpertLinear, ops.moe_dispatch.expert_linear_backward).

Dropless: every token reaches its K experts. Experts that got no tokens form empty groups: they do no
work and their weight gradients are zeros (never None). The combine gathers instead of scattering with
atomics, so results are deterministic. Parameter names equal transformers' MixtralSparseMoeBlock
(gate.weight, experts.gate_up_proj, experts.down_proj), so checkpoints load both ways.

Expert parallelism (``ep_group``): each rank of the group holds E / ep_size consecutive experts and the
whole router. After routing, every rank sends each token-expert pair to the rank owning the expert with
one variable-size all-to-all (no padding to a capacity), the owners run their experts on what arrived,
and a second all-to-all returns the results, which are combined as above. The local experts are split
into ``overlap_chunks`` groups, each exchanged by its own async all-to-all: all dispatches start at
once, experts run on chunk 0 while chunk 1 is in flight, and each chunk's results start back before
the next chunk computes (backward mirrors it). The split sizes are exchanged first and read on the host:
one sync per layer forward, none in backward. It stays because all_to_all_single (NCCL, gloo) takes
host split sizes; removing it needs a device-side-split all-to-all (NVSHMEM symmetric memory), which
the design leaves for later. Rows arrive in a pre-allocated receive buffer (ReceiveBuffer):
ceil(factor * T * K / ep_size) rows at first, calibrated to the observed peak at the end of a warm-up
window, grown by ``growth`` with one warning when a step needs more; never a crash or a dropped token.
Each launch and wait of an exchange is a ``profiler.region("all_to_all")`` (one shared no-op while the
profiler is off).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ds_loongforge import profiler
from ds_loongforge.ops._dispatch import CUDAGRAPH_UNSAFE, check_rounding, refuse_double_backward
from ds_loongforge.ops.moe_dispatch import (ROW_BUCKETS, expert_gemm_backend, expert_linear_backward, expert_routing,
                                            moe_permute, moe_unpermute, sort_routing_keys)
from ds_loongforge.ops.moe_router import kernel_fits, router_topk
from ds_loongforge.ops.swiglu import swiglu_dropout

ROUTER_MODES = ("topk", "sampled")
logger = logging.getLogger("ds_loongforge")


class ReceiveBuffer:
    """The receive buffer of one layer's expert-parallel dispatch, reused across steps.

    Capacity starts at ceil(factor * pairs / ep_size) rows. During the first ``warmup_steps`` forwards it
    grows silently to what a step needs and records the peak; at the end of warm-up it is resized once
    to that peak plus ``growth`` headroom (whatever ``factor`` gave: the factor sizes warm-up only). After
    warm-up a step that needs more grows it by ``growth`` (at least to the need) with one warning. Rows
    beyond a step's need are never read. Warm-up counts forwards (eval and recomputed ones too).
    """

    def __init__(self, factor: float = 1.2, warmup_steps: int = 500, growth: float = 0.2):
        if factor <= 0:
            raise ValueError(f"all_to_all_buffer_factor must be > 0, got {factor}")
        if warmup_steps < 0:
            raise ValueError(f"buffer_warmup_steps must be >= 0, got {warmup_steps}")
        if growth <= 0:
            raise ValueError(f"buffer_growth must be > 0, got {growth}")
        self.factor, self.warmup_steps, self.growth = factor, warmup_steps, growth
        self.buffer: torch.Tensor | None = None
        self.steps = 0
        self.peak_rows = 0
        self.reallocations = 0
        self.reallocations_after_warmup = 0
        self._warned = False

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[0]

    def _allocate(self, rows: int, like: torch.Tensor, calibration: bool = False) -> None:
        first = self.buffer is None  # the first allocation is no reallocation (buffer_warmup_steps=0 included)
        self.buffer = like.new_empty(rows, *like.shape[1:])
        self.reallocations += 1
        if self.steps > self.warmup_steps and not calibration and not first:
            self.reallocations_after_warmup += 1

    def take(self, rows: int, pairs: int, ep_size: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, ...] view to receive into (like: a tensor of the row shape, dtype and device)."""
        self.steps += 1
        self.peak_rows = max(self.peak_rows, rows)
        if (self.buffer is None or self.buffer.shape[1:] != like.shape[1:] or self.buffer.dtype != like.dtype
                or self.buffer.device != like.device):
            self._allocate(max(1, math.ceil(self.factor * pairs / ep_size)), like)
        elif self.steps == self.warmup_steps + 1 and self.warmup_steps > 0:
            calibrated = math.ceil(self.peak_rows * (1 + self.growth))
            if calibrated != self.capacity:
                self._allocate(calibrated, like, calibration=True)
        if rows > self.capacity:
            grown = max(rows, math.ceil(self.capacity * (1 + self.growth)))
            if self.steps > self.warmup_steps and not self._warned:
                message = (f"[LoongForge] expert-parallel receive buffer grew from {self.capacity} to {grown} rows "
                           f"(a step needed {rows}) after warm-up sized it to its peak of {self.peak_rows} rows plus "
                           f"{self.growth:.0%}: raise moe.buffer_growth, or let warm-up (moe.buffer_warmup_steps, "
                           "counted in forwards) see the largest batches, eval included")
                warnings.warn(message, RuntimeWarning, stacklevel=4)
                logger.warning(message)
                self._warned = True
            self._allocate(grown, like)
        return self.buffer[:rows]


@dataclass
class RoutingStats:
    """Routing of one forward. Tensors stay on the device; summary() reads them back (one sync)."""

    tokens_per_expert_E: torch.Tensor
    num_tokens: int
    top_k: int
    buffer_fill: float | None = None  # expert parallel: received rows / receive-buffer capacity

    def summary(self) -> dict[str, float]:
        counts = self.tokens_per_expert_E.float()
        num_experts = counts.numel()
        used = int((counts > 0).sum())
        mean = float(counts.mean())
        return {
            "buffer_fill": self.buffer_fill,
            "experts_used": used,
            "idle_expert_fraction": 1.0 - used / num_experts,
            "pair_sparsity": 1.0 - self.top_k / num_experts,  # token-expert pairs not activated
            "max_load": float(counts.max()),
            "mean_load": mean,
            "max_over_mean_load": float(counts.max()) / mean if mean > 0 else 0.0,
            "tokens_dropped": self.num_tokens * self.top_k - int(counts.sum()),
        }


SPARSITY_PAYOFF, EXPERTS_PAYOFF = 0.6, 8
_HEALTH_WARNED: set = set()


def routing_health(num_experts: int, top_k: int) -> list[str]:
    """Why the expert-masked path may not pay off for this shape (empty when it should): it skips idle
    experts and gathers only routed rows, which wins with sparse routing over many experts."""
    problems = []
    sparsity = 1.0 - top_k / num_experts
    if sparsity < SPARSITY_PAYOFF:
        problems.append(f"pair sparsity 1 - k/E = {sparsity:.2f} is below {SPARSITY_PAYOFF}: most token-expert "
                        "pairs are active, so a dense MLP over all experts may be as fast")
    if num_experts < EXPERTS_PAYOFF:
        problems.append(f"{num_experts} experts is fewer than {EXPERTS_PAYOFF}: few experts to skip, little for "
                        "the masked path to save")
    return problems


class TopKRouter(nn.Module):
    """Linear router: softmax in fp32, then the K best experts ("topk") or, in training, K experts drawn
    without replacement from the softmax ("sampled"; eval uses top-k)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, mode: str = "topk",
                 renormalize: bool = True, impl: str = "auto", device=None, dtype=None):
        super().__init__()
        if mode not in ROUTER_MODES:
            raise ValueError(f"router mode {mode!r} is not one of {ROUTER_MODES}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.mode = mode
        self.renormalize = renormalize
        self.impl = impl  # of the fused top-k op (ops/moe_router.py), as the layer's other ops
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x_TH: torch.Tensor):
        logits_TE = F.linear(x_TH, self.weight)
        if self.mode == "sampled" and self.training:
            probs_TE = torch.softmax(logits_TE.float(), dim=-1)
            ids_TK = torch.multinomial(probs_TE.detach(), self.top_k, replacement=False)
            weights_TK = probs_TE.gather(1, ids_TK)
            if self.renormalize:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
            return logits_TE, probs_TE, weights_TK, ids_TK
        # softmax, top-k and renormalisation in one kernel each way (ops/moe_router.py)
        # a layer on "cuda" / "cpu" keeps its other kernels where the router's shape is beyond this op's
        impl = self.impl if kernel_fits(logits_TE, self.top_k) else "reference"
        probs_TE, weights_TK, ids_TK = router_topk(logits_TE, self.top_k, self.renormalize, impl=impl)
        return logits_TE, probs_TE, weights_TK, ids_TK


class StackedExperts(nn.Module):
    """E SwiGLU experts stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *, device=None, dtype=None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                     device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size,
                                                  device=device, dtype=dtype))
        for w in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[-1]))


def _grouped_mm_supported(x: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    return _grouped_mm_supported_for(x.device.type, x.dtype, x.shape[-1], w_EOI.shape[1],
                                     torch.compiler.is_compiling())


@functools.lru_cache(maxsize=64)  # asked twice per MoE layer and forward, of a few shapes
def _grouped_mm_supported_for(device_type: str, dtype: torch.dtype, in_features: int, out_features: int,
                              compiling: bool = False) -> bool:
    if not hasattr(F, "grouped_mm") or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False  # torch's grouped GEMM takes these three (fp64 takes the per-expert loop)
    if (device_type == "cuda" or compiling) and dtype != torch.bfloat16:
        # torch's CUDA grouped GEMM is bf16-only, and so is the meta kernel torch.compile traces any device's
        # with (the CPU's eager kernel takes fp32): those take the per-expert loop
        return False
    elem = dtype.itemsize
    return (in_features * elem) % 16 == 0 and (out_features * elem) % 16 == 0


EXPERT_COMPUTE = ("auto", "grouped_mm", "loop")

# The backward of the grouped GEMMs takes one cuBLAS GEMM per expert (expert_linear_backward) where experts are
# few and large. The layer's four backward products with skewed group sizes (max/mean 1.8-3.6), H200, a811de5's
# diagnose_grouped_gemm --host-cost: 2.21 vs 2.26 ms grouped at the e2e mixtral shape (8 experts, 16384 rows),
# 16.5 vs 18.2 ms at bench_moe's mixtral_like; with 64 experts of ~1024 rows the per-expert GEMMs ran at half
# the grouped rate (ab44d7f). The forward keeps the grouped GEMM: its group sizes are not on the host without a
# wait that would empty the device's queue. Measured at 08bca89 (H100): the down GEMM per expert in the forward,
# behind that wait, took bench_moe's mixtral_like layer from 26.43 to 26.17 ms but the e2e mixtral step from 74.8
# to 80.6 ms, the forward's device time from 18.9 to 29.3 ms: the host's lead went into the wait.
PER_EXPERT_BACKWARD_MAX_EXPERTS = 16
PER_EXPERT_BACKWARD_MIN_ROWS_PER_EXPERT = 1024


class HostCounts:
    """Rows per expert, copied to pinned host memory right behind the routing (no wait in the forward). The
    backward reads them after waiting on the copy's event: by then it has landed long ago (the copy sits before
    the rest of the layer's forward, and the backward's host thread runs far behind that point), and where it
    has not, the wait ends at the copy, so the device's queue beyond it stays full. On the CPU the counts are
    read directly."""

    def __init__(self, tokens_per_expert_E: torch.Tensor):
        self._event, self._list = None, None
        counts = tokens_per_expert_E.detach()
        if counts.device.type == "cpu":
            self._host = counts.clone()
        else:
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def get(self) -> list[int]:
        """The counts as a list, read once (the layer's two expert GEMMs share them)."""
        if self._list is None:
            if self._event is not None:
                self._event.synchronize()
            self._list = self._host.tolist()
        return self._list


class _GroupedExpertLinear(torch.autograd.Function):
    """``F.grouped_mm(x_PI, w_EOI.transpose(1, 2), offs=offs_E)``, whose backward runs one GEMM per expert and
    product from the host group sizes (expert_linear_backward, one host call), the weight gradient in the weight's
    layout as torch's grouped GEMM gives it."""

    @staticmethod
    def forward(ctx, x_PI, w_EOI, offs_E, host_counts, impl):
        ctx.save_for_backward(x_PI, w_EOI)
        ctx.host_counts, ctx.impl = host_counts, impl
        return F.grouped_mm(x_PI, w_EOI.transpose(1, 2), offs=offs_E)

    @staticmethod
    def backward(ctx, dy_PO):
        refuse_double_backward("ExpertMaskedMoE's per-expert GEMM backward")
        x_PI, w_EOI = ctx.saved_tensors
        dx_PI, dw_EOI = expert_linear_backward(dy_PO, x_PI, w_EOI, ctx.host_counts.get(),
                                               need_dx=ctx.needs_input_grad[0], need_dw=ctx.needs_input_grad[1],
                                               impl=ctx.impl, row_bucket=expert_gemm_row_bucket())
        return dx_PI, dw_EOI, None, None, None


def expert_gemm_row_bucket() -> int | str:
    """How the per-expert backward groups row counts for cuBLASLt's algorithm choice (expert_linear_backward's
    row_bucket): LOONGFORGE_EXPERT_GEMM_ROWS ("blocks", "octave", "exact" or a positive row step) for A/Bs, else
    the op's default ("blocks", the exact heuristic's choice: csrc/moe_dispatch/moe_expert_gemm.cpp's bucket())."""
    value = os.environ.get("LOONGFORGE_EXPERT_GEMM_ROWS", "blocks")
    if value in ROW_BUCKETS:
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"LOONGFORGE_EXPERT_GEMM_ROWS must be one of {sorted(ROW_BUCKETS)} or a positive number of "
                     f"rows, got {value!r}; unset it for the default (blocks)")


@functools.lru_cache(maxsize=16)
def _per_expert_gemms_run_well(device_type: str, impl: str) -> bool:
    """Whether expert_linear_backward's kernel on this device issues per-expert GEMMs cheaply: cuBLASLt on CUDA
    (torch's cuBLAS path would query a heuristic per new row count), ATen on the CPU (what torch's CPU grouped
    GEMM runs per group too). The reference (a Python loop) never."""
    if impl == "reference":
        return False
    backend = expert_gemm_backend(device_type, impl)
    return backend == "cublaslt" or (device_type == "cpu" and backend == "aten")


def per_expert_backward_pays(x_PI: torch.Tensor, w_EOI: torch.Tensor, impl: str = "auto") -> bool:
    """Where the experts' backward takes per-expert GEMMs (see PER_EXPERT_BACKWARD_*): few and large experts, a
    kernel that issues them cheaply, and neither CUDA graph capture nor torch.compile (the host counts need a host
    read).
    LOONGFORGE_PER_EXPERT_BACKWARD=0 turns it off (torch's grouped GEMMs both ways), for A/B measurements."""
    if torch.compiler.is_compiling():  # the host counts would break the graph: torch's grouped GEMM both ways
        return False
    if os.environ.get("LOONGFORGE_PER_EXPERT_BACKWARD", "1") == "0":
        return False
    experts = w_EOI.shape[0]
    if experts > PER_EXPERT_BACKWARD_MAX_EXPERTS or x_PI.shape[0] < PER_EXPERT_BACKWARD_MIN_ROWS_PER_EXPERT * experts:
        return False
    if x_PI.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return _per_expert_gemms_run_well(x_PI.device.type, impl)


def expert_matmul(x_PI: torch.Tensor, w_EOI: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                  mode: str = "auto", counts: list[int] | None = None,
                  offs_E: torch.Tensor | None = None, host_counts: HostCounts | None = None,
                  impl: str = "auto") -> torch.Tensor:
    """Rows of x_PI grouped by expert (expert-major, group sizes tokens_per_expert_E) times each group's
    w_EOI[e].T. ``grouped_mm``: one grouped GEMM (torch's; "auto" takes it where supported), over the group
    ends ``offs_E`` (int32 cumsum of the sizes; computed here if not given); with ``host_counts`` (mode "auto")
    its backward runs per-expert GEMMs (_GroupedExpertLinear). ``loop``: one GEMM per expert that got tokens,
    from ``counts`` (host copy of the sizes; read here if not given: a host sync)."""
    if mode not in EXPERT_COMPUTE:
        raise ValueError(f"expert_compute must be one of {EXPERT_COMPUTE}, got {mode!r}")
    if mode == "grouped_mm" and not _grouped_mm_supported(x_PI, w_EOI):
        raise ValueError(f"expert_compute='grouped_mm' is not supported for {x_PI.dtype} on {x_PI.device} with "
                         f"rows of {x_PI.shape[-1]} and {w_EOI.shape[1]} elements (torch {torch.__version__} "
                         "needs F.grouped_mm, bf16 on CUDA, 16-byte aligned rows); use 'auto' or 'loop'")
    if mode != "loop" and _grouped_mm_supported(x_PI, w_EOI):
        if offs_E is None:
            offs_E = torch.cumsum(tokens_per_expert_E, 0).to(torch.int32)
        if host_counts is not None and mode == "auto":
            return _GroupedExpertLinear.apply(x_PI, w_EOI, offs_E, host_counts, impl)
        return F.grouped_mm(x_PI, w_EOI.transpose(1, 2), offs=offs_E)
    if torch.compiler.is_compiling():
        return _compiled_expert_loop(x_PI, w_EOI, tokens_per_expert_E)
    if counts is None:
        counts = tokens_per_expert_E.tolist()  # host sync
    pieces, start = [], 0
    for e, n in enumerate(counts):
        if n:
            pieces.append(x_PI[start:start + n] @ w_EOI[e].t())
            start += n
    if not pieces:
        return x_PI[:0] @ w_EOI[0].t()  # no rows: an empty product keeps x and the weights in the graph
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


# The per-expert loop under torch.compile (fp32 and fp16, which torch's grouped GEMM does not trace): one custom op
# each way that reads the group sizes when it runs. Traced, that read would break the graph at each layer, and the
# sizes, specialised into the graph as constants, would recompile it at nearly every step. The read is a host sync:
# the ops are marked unsafe for CUDA graphs.

@torch.library.custom_op("loongforge::expert_loop_matmul", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _expert_loop_op(x_PI: torch.Tensor, w_EOI: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    y_PO = x_PI.new_zeros(x_PI.shape[0], w_EOI.shape[1])
    start = 0
    with torch.autocast(x_PI.device.type, enabled=False):  # the caller cast the inputs as autocast would
        for e, n in enumerate(tokens_per_expert_E.tolist()):
            if n:
                torch.mm(x_PI[start:start + n], w_EOI[e].t(), out=y_PO[start:start + n])
                start += n
    return y_PO


@_expert_loop_op.register_fake
def _(x_PI, w_EOI, tokens_per_expert_E):
    return x_PI.new_empty(x_PI.shape[0], w_EOI.shape[1])


@torch.library.custom_op("loongforge::expert_loop_matmul_backward", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _expert_loop_backward_op(dy_PO: torch.Tensor, x_PI: torch.Tensor, w_EOI: torch.Tensor,
                             tokens_per_expert_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(x_PI.device.type, enabled=False):
        return expert_linear_backward(dy_PO, x_PI, w_EOI, tokens_per_expert_E.tolist(), need_dx=True, need_dw=True)


@_expert_loop_backward_op.register_fake
def _(dy_PO, x_PI, w_EOI, tokens_per_expert_E):
    return x_PI.new_empty(x_PI.shape), w_EOI.new_empty(w_EOI.shape)


def _expert_loop_setup_context(ctx, inputs, output):
    x_PI, w_EOI, tokens_per_expert_E = inputs
    ctx.save_for_backward(x_PI, w_EOI, tokens_per_expert_E)


def _expert_loop_backward(ctx, dy_PO):
    x_PI, w_EOI, tokens_per_expert_E = ctx.saved_tensors
    dx_PI, dw_EOI = _expert_loop_backward_op(dy_PO.contiguous(), x_PI, w_EOI, tokens_per_expert_E)
    return dx_PI, dw_EOI, None


_expert_loop_op.register_autograd(_expert_loop_backward, setup_context=_expert_loop_setup_context)


def _compiled_expert_loop(x_PI: torch.Tensor, w_EOI: torch.Tensor, tokens_per_expert_E: torch.Tensor):
    device_type = x_PI.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)  # the eager loop's matmuls run in it
        x_PI, w_EOI = x_PI.to(dtype), w_EOI.to(dtype)
    elif w_EOI.dtype != x_PI.dtype:
        raise ValueError(f"expert_matmul: rows are {x_PI.dtype} but the expert weights {w_EOI.dtype}; outside "
                         "torch.autocast they must match")
    return _expert_loop_op(x_PI.contiguous(), w_EOI, tokens_per_expert_E)


class _Exchange:
    """One variable-size all-to-all in flight (forward) and its reverse (backward), shared by the two
    autograd nodes below so that a wait can sit apart from its launch and other work runs in between."""

    def __init__(self, out: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        self.out, self.out_splits, self.in_splits, self.group = out, out_splits, in_splits, group
        self.work = None       # forward exchange in flight
        self.grad_in = None    # backward: gradient rows arriving for the sender
        self.back_work = None  # backward exchange in flight


class _StartAllToAll(torch.autograd.Function):
    """Launch ``x`` -> ``xchg.out`` (rows ``sum(out_splits)``; may be a pre-allocated buffer view) with
    ``async_op=True``; ``_WaitAllToAll`` makes the stream wait for it. In backward the roles swap:
    _WaitAllToAll.backward launches the reverse exchange, this node's backward waits for it."""

    @staticmethod
    def forward(ctx, x, xchg):
        ctx.xchg = xchg
        with profiler.region("all_to_all"):
            xchg.work = dist.all_to_all_single(xchg.out, x.contiguous(), xchg.out_splits, xchg.in_splits,
                                               group=xchg.group, async_op=True)
        return xchg.out

    @staticmethod
    def backward(ctx, _grad_passthrough):
        refuse_double_backward("ExpertMaskedMoE's all-to-all")
        xchg = ctx.xchg
        with profiler.region("all_to_all"):
            xchg.back_work.wait()
        grad_in = xchg.grad_in
        xchg.back_work = xchg.grad_in = None
        return grad_in, None


class _WaitAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, xchg):
        ctx.xchg = xchg
        with profiler.region("all_to_all"):
            xchg.work.wait()  # NCCL: the current stream waits (no host block); gloo: the host waits
        xchg.work = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_double_backward("ExpertMaskedMoE's all-to-all")
        xchg = ctx.xchg
        grad_out = grad_out.contiguous()
        xchg.grad_in = grad_out.new_empty(sum(xchg.in_splits), *grad_out.shape[1:])
        with profiler.region("all_to_all"):
            xchg.back_work = dist.all_to_all_single(xchg.grad_in, grad_out, xchg.in_splits, xchg.out_splits,
                                                    group=xchg.group, async_op=True)
        return grad_out, None  # placeholder; _StartAllToAll.backward returns the exchanged gradient


def all_to_all_start(x: torch.Tensor, out: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     group) -> tuple[torch.Tensor, _Exchange]:
    """Start a differentiable variable-size all-to-all of the rows of ``x`` into ``out``; finish it with
    :func:`all_to_all_wait` before reading the result. Backward runs the reverse exchange, also async."""
    xchg = _Exchange(out, out_splits, in_splits, group)
    pending = _StartAllToAll.apply(x, xchg)
    xchg.out = None  # the autograd output owns the rows now
    return pending, xchg


def all_to_all_wait(pending: torch.Tensor, xchg: _Exchange) -> torch.Tensor:
    return _WaitAllToAll.apply(pending, xchg)


def chunk_bounds(num_local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """Split the local experts into at most ``chunks`` contiguous, near-equal groups [lo, hi)."""
    chunks = max(1, min(chunks, num_local_experts))
    edges = [round(c * num_local_experts / chunks) for c in range(chunks + 1)]
    return [(edges[c], edges[c + 1]) for c in range(chunks)]


class ExpertMaskedMoE(nn.Module):
    """Dropless top-k MoE block; ``forward(x [..., H], residual=None) -> [..., H]``.

    ``residual`` (x's shape and dtype): added to the output in the combine's kernel (a decoder layer's residual
    stream; ``loongforge_adds_residual`` says that a block takes it). ``rounding`` "stock" rounds the k-sum
    ``sum_j w_j y_j``, then ``residual + sum`` again, as transformers' block and decoder layer do; "once" rounds
    ``residual + sum_j w_j y_j`` once (ds_loongforge.ops.moe_dispatch). ``weights_in_input_dtype``: under "stock",
    the routing weights are cast to the input's dtype before they scale the expert outputs, as the routers of
    Qwen2-MoE, Qwen3-MoE and OLMoE cast theirs (Mixtral's stay fp32); "once" keeps them fp32.

    In training, ``aux_loss`` holds ``aux_loss_coef * load_balancing + z_loss_coef * z_loss`` of the last
    forward (Switch/GShard load balancing; router z-loss) for the training loop to add, or None when both
    coefficients are 0 (no loss of its own); ``last_routing`` holds its RoutingStats.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 router_mode: str = "topk", renormalize: bool = True, jitter_noise: float = 0.0,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, dropout: float = 0.0,
                 impl: str = "auto", ep_group=None, ep_size: int | None = None,
                 all_to_all_buffer_factor: float = 1.2,
                 buffer_warmup_steps: int = 500, buffer_growth: float = 0.2, overlap_chunks: int = 2,
                 expert_compute: str = "auto", rounding: str = "stock", weights_in_input_dtype: bool = False,
                 device=None, dtype=None):
        super().__init__()
        check_rounding("ExpertMaskedMoE", rounding)
        if num_experts < 1:
            raise ValueError(f"ExpertMaskedMoE: num_experts must be >= 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"ExpertMaskedMoE: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if jitter_noise < 0 or aux_loss_coef < 0 or z_loss_coef < 0:
            raise ValueError(f"ExpertMaskedMoE: jitter_noise, aux_loss_coef and z_loss_coef must be >= 0, got "
                             f"{jitter_noise}, {aux_loss_coef}, {z_loss_coef}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"ExpertMaskedMoE: dropout must be in [0, 1), got {dropout}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.jitter_noise, self.aux_loss_coef, self.z_loss_coef = jitter_noise, aux_loss_coef, z_loss_coef
        self.dropout, self.impl, self.rounding = dropout, impl, rounding
        self.weights_in_input_dtype = bool(weights_in_input_dtype)
        self.ep_group = ep_group
        if ep_group is not None:
            if ep_size is not None and ep_size != dist.get_world_size(ep_group):
                raise ValueError(f"ExpertMaskedMoE: ep_size={ep_size} but ep_group has "
                                 f"{dist.get_world_size(ep_group)} ranks; pass one of them")
            ep_size = dist.get_world_size(ep_group)
        elif ep_size is not None and ep_size < 1:
            raise ValueError(f"ExpertMaskedMoE: ep_size must be >= 1, got {ep_size}")
        self.ep_size = ep_size or 1  # ep_size without ep_group: the group is bound later (moe_deepspeed)
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if num_experts % self.ep_size:
            raise ValueError(f"ExpertMaskedMoE: num_experts={num_experts} is not divisible by the expert-parallel "
                             f"size {self.ep_size}; choose an ep_size that divides the number of experts")
        self.num_local_experts = num_experts // self.ep_size
        self.receive_buffer = ReceiveBuffer(all_to_all_buffer_factor, buffer_warmup_steps, buffer_growth)
        if overlap_chunks < 1:
            raise ValueError(f"ExpertMaskedMoE: overlap_chunks must be >= 1, got {overlap_chunks}")
        self.chunk_bounds = chunk_bounds(self.num_local_experts, overlap_chunks)
        chunk_of_local = [c for c, (lo, hi) in enumerate(self.chunk_bounds) for _ in range(lo, hi)]
        self.register_buffer("_chunk_of_local_L", torch.tensor(chunk_of_local, dtype=torch.long, device=device),
                             persistent=False)
        self.split_sync_seconds = 0.0  # host time spent waiting for the split sizes (expert-parallel only)
        self._ep_calls = 0  # exchanges this layer started: every rank of the group must be at the same one
        for message in routing_health(num_experts, top_k):
            if (num_experts, top_k, message) not in _HEALTH_WARNED:
                _HEALTH_WARNED.add((num_experts, top_k, message))
                logger.warning("[LoongForge] ExpertMaskedMoE(E=%d, k=%d): %s", num_experts, top_k, message)
        if expert_compute not in EXPERT_COMPUTE:
            raise ValueError(f"ExpertMaskedMoE: expert_compute must be one of {EXPERT_COMPUTE}, got {expert_compute!r}")
        self.expert_compute = expert_compute
        self.gate = TopKRouter(hidden_size, num_experts, top_k, mode=router_mode, renormalize=renormalize,
                               impl=impl, device=device, dtype=dtype)
        self.experts = StackedExperts(hidden_size, intermediate_size, self.num_local_experts, device=device,
                                      dtype=dtype)
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: RoutingStats | None = None

    loongforge_adds_residual = True  # forward takes ``residual`` (integrations.residual passes a decoder's)

    def __getstate__(self) -> dict:
        """``copy.deepcopy`` and pickling of a layer that has run a training forward: ``aux_loss`` is then a
        tensor of that forward's autograd graph, which deepcopy refuses ("Only Tensors created explicitly by the
        user ... support the deepcopy protocol"), so an injected model could not be copied after a step where
        stock's could. The copy gets its value, detached; the layer itself keeps the graph's tensor."""
        state = super().__getstate__()  # object's: the instance dict itself, so it is copied before the change
        aux = state.get("aux_loss")
        if isinstance(aux, torch.Tensor) and aux.grad_fn is not None:
            state = dict(state, aux_loss=aux.detach())
        return state

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape = hidden_states.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"ExpertMaskedMoE: input hidden size {shape[-1]} != {self.hidden_size}")
        if residual is not None and (residual.shape != shape or residual.dtype != hidden_states.dtype):
            raise ValueError(f"ExpertMaskedMoE: residual {tuple(residual.shape)} {residual.dtype} must have the "
                             f"input's shape {tuple(shape)} and dtype {hidden_states.dtype}")
        if not isinstance(self.experts, StackedExperts):
            # its Parameters are read here, never through experts.forward: a wrapper would be bypassed
            raise TypeError(f"ExpertMaskedMoE: `experts` is {type(self.experts).__name__}, not StackedExperts; a "
                            "wrapper around it (e.g. PEFT adapters via target_parameters) would not take effect. "
                            "Apply PEFT before ds_loongforge.inject (the block then stays the family's own, with "
                            "the adapters), or leave the expert weights out of target_parameters")
        x_TH = hidden_states.reshape(-1, self.hidden_size)
        if self.training and self.jitter_noise > 0:
            x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        num_tokens, k = x_TH.shape[0], self.top_k

        logits_TE, probs_TE, weights_TK, ids_TK = self.gate(x_TH)
        if self.weights_in_input_dtype and self.rounding == "stock":
            # the family's router casts them to its logits' dtype (its gradient flows back): the input's, or the
            # autocast dtype under torch.autocast
            weights_TK = weights_TK.to(logits_TE.dtype)
        order_P, slot_TK, tokens_per_expert_E, offsets_E = self._routing_indices(ids_TK)
        x_PH = moe_permute(x_TH, order_P, slot_TK, impl=self.impl)

        if self.ep_size == 1:
            y_PH = self._experts(x_PH, tokens_per_expert_E, offsets_E=offsets_E)
            self.last_routing = RoutingStats(tokens_per_expert_E.detach(), num_tokens, k)
        elif self.ep_group is None:
            raise RuntimeError(f"ExpertMaskedMoE: ep_size={self.ep_size} but no expert-parallel group is bound; "
                               "pass ep_group, or use moe_deepspeed.DeepSpeedExpertMaskedMoE")
        else:  # sets last_routing itself: the receive buffer's fill is host state that a compiled graph leaves out
            y_PH = self._experts_parallel(x_PH, tokens_per_expert_E)
        if weights_TK.dtype not in (torch.float32, y_PH.dtype):
            # 16-bit weights beside outputs of another dtype (a family's router under torch.autocast): fp32 holds
            # them exactly, and the combine's fp32 products are what the stock block's promoting multiply gives
            weights_TK = weights_TK.float()

        out_TH = moe_unpermute(y_PH, slot_TK, weights_TK, impl=self.impl,
                               residual_TH=None if residual is None else residual.reshape(-1, self.hidden_size),
                               rounding=self.rounding)

        if self.training:
            self.aux_loss = self._aux_loss(logits_TE, probs_TE, tokens_per_expert_E, num_tokens)
        return out_TH.view(shape)

    def _experts(self, x_PH: torch.Tensor, tokens_per_expert_E: torch.Tensor, gate_up: torch.Tensor | None = None,
                 down: torch.Tensor | None = None, offsets_E: torch.Tensor | None = None) -> torch.Tensor:
        """The local experts (or the chunk of them whose stacked weights are given) on expert-major rows,
        group sizes tokens_per_expert_E (group ends offsets_E, int32, when the routing gave them)."""
        loop = self._use_loop(x_PH)
        # loop: one host sync (under torch.compile, inside the loop's custom op)
        counts = tokens_per_expert_E.tolist() if loop and not torch.compiler.is_compiling() else None
        # grouped GEMMs: both take the same group ends, computed once
        offs_E = None if loop else (offsets_E if offsets_E is not None
                                    else torch.cumsum(tokens_per_expert_E, 0).to(torch.int32))
        gate_up = self.experts.gate_up_proj if gate_up is None else gate_up
        down = self.experts.down_proj if down is None else down
        host_counts = None
        if (not loop and self.expert_compute == "auto" and torch.is_grad_enabled()
                and per_expert_backward_pays(x_PH, gate_up, self.impl)):
            host_counts = HostCounts(tokens_per_expert_E)  # for the backward, copied behind the routing
        gate_up_P2I = expert_matmul(x_PH, gate_up, tokens_per_expert_E, self.expert_compute, counts, offs_E,
                                    host_counts, self.impl)
        act_PI = swiglu_dropout(gate_up_P2I, self.dropout if self.training else 0.0, impl=self.impl,
                                rounding=self.rounding)
        y_PH = expert_matmul(act_PI, down, tokens_per_expert_E, self.expert_compute, counts, offs_E, host_counts,
                             self.impl)
        # under torch.autocast the per-expert loop's matmuls come out in the autocast dtype (grouped_mm is not on
        # autocast's lists): back to the input's dtype, as the family's block returns its experts' sum (and as the
        # combine's residual and the all-to-all buffers have it), whichever path ran
        return y_PH if y_PH.dtype == x_PH.dtype else y_PH.to(x_PH.dtype)

    def _use_loop(self, x_PH: torch.Tensor) -> bool:
        if self.expert_compute != "auto":
            return self.expert_compute == "loop"
        compiling = torch.compiler.is_compiling()
        return not (_grouped_mm_supported_for(x_PH.device.type, x_PH.dtype, x_PH.shape[-1],
                                              self.experts.gate_up_proj.shape[1], compiling)
                    and _grouped_mm_supported_for(x_PH.device.type, x_PH.dtype, self.intermediate_size,
                                                  self.experts.down_proj.shape[1], compiling))

    def _routing_indices(self, ids_TK: torch.Tensor):
        """(order_P, slot_TK, tokens_per_expert_E, offsets_E or None) for the permute/unpermute ops, in
        _dispatch_key order. No host sync, no atomics: locally the counting-sort kernel (expert_routing); with
        chunked expert parallelism a stable sort by the dispatch key (sort_routing_keys)."""
        if self.ep_group is None or len(self.chunk_bounds) == 1:
            return expert_routing(ids_TK, self.num_experts, impl=self.impl)
        key_E = self._dispatch_key(torch.arange(self.num_experts, device=ids_TK.device))
        # rows in key order, not expert order: the cumsum of the counts is no group end here
        return (*sort_routing_keys(self._dispatch_key(ids_TK), key_E), None)

    def _dispatch_key(self, ids_P: torch.Tensor) -> torch.Tensor:
        """Sort key of the token-expert pairs. Local: the expert id (expert-major). Expert-parallel with C
        chunks: (chunk of the expert on its owner, owner rank, expert), so that each chunk's rows for
        every destination are one contiguous run and a chunk is sent with one all-to-all."""
        if self.ep_group is None or len(self.chunk_bounds) == 1:
            return ids_P
        return self._chunk_of_local_L[ids_P % self.num_local_experts] * self.num_experts + ids_P

    # Under torch.compile this runs eagerly, between two graphs: the split sizes are host integers the exchange
    # needs anyway (a graph break), and the host state it keeps (the call tag, the receive buffer's steps and
    # capacity) would otherwise be guarded on and recompile the layer at every call until dynamo gives up
    @torch.compiler.disable
    def _experts_parallel(self, x_PH: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Send each pair to the rank owning its expert, run the local experts, send the results back; sets
        last_routing (with the receive buffer's fill).

        R = ep_size ranks, L = local experts per rank, C = len(chunk_bounds) groups of local experts.
        Rows of x_PH are in _dispatch_key order (chunk-major). All C dispatch exchanges are launched at
        once (async); chunk c's experts run as soon as chunk c has arrived, while later chunks are still
        in flight, and chunk c's results start back (async) before chunk c+1 computes. Backward mirrors
        this: each reverse exchange is launched where its forward waited and awaited where it started.
        Arriving rows are source-rank-major, expert-major within a source; they are regrouped
        expert-major (source order within an expert) for the grouped GEMM.
        """
        ep, local, bounds = self.ep_size, self.num_local_experts, self.chunk_bounds
        send_RL = tokens_per_expert_E.view(ep, local)
        # each rank's counts go out with a tag, (this layer's call number, grad mode), read back with the split
        # sizes below: ranks out of step (a forward on one rank only, an extra eval batch) would otherwise pair
        # different calls' exchanges without a word and train on each other's tokens
        self._ep_calls += 1
        grad = int(torch.is_grad_enabled())
        send_tagged = torch.cat([send_RL, send_RL.new_full((ep, 1), self._ep_calls), send_RL.new_full((ep, 1), grad)],
                                dim=1)
        recv_tagged = torch.empty_like(send_tagged)
        with profiler.region("all_to_all"):
            dist.all_to_all_single(recv_tagged, send_tagged, group=self.ep_group)
        recv_RL = recv_tagged[:, :local]
        send_CR = torch.stack([send_RL[:, lo:hi].sum(1) for lo, hi in bounds])
        recv_CR = torch.stack([recv_RL[:, lo:hi].sum(1) for lo, hi in bounds])
        # The one host sync of the layer (forward only; backward reuses the splits): all_to_all_single
        # takes split sizes as host integers. Everything queued above overlaps the wait.
        t0 = time.perf_counter()
        split_list = torch.cat([send_CR.reshape(-1), recv_CR.reshape(-1), recv_tagged[:, local:].reshape(-1)]).tolist()
        self.split_sync_seconds += time.perf_counter() - t0
        n = len(bounds) * ep
        self._check_in_step(split_list[2 * n:], grad)
        send_splits = [split_list[c * ep:(c + 1) * ep] for c in range(len(bounds))]
        recv_splits = [split_list[n + c * ep:n + (c + 1) * ep] for c in range(len(bounds))]

        # the gathers below are the only readers of the received rows (they save indices, not the rows),
        # so the buffer is free for the next layer call as soon as this one returns
        pairs = x_PH.shape[0]
        received = sum(map(sum, recv_splits))
        buffer = self.receive_buffer.take(received, pairs, ep, x_PH)
        self.last_routing = RoutingStats(tokens_per_expert_E.detach(), pairs // self.top_k, self.top_k,
                                         received / max(1, self.receive_buffer.capacity))
        dispatched, s_off, r_off = [], 0, 0
        for c in range(len(bounds)):
            n_send, n_recv = sum(send_splits[c]), sum(recv_splits[c])
            dispatched.append(all_to_all_start(x_PH[s_off:s_off + n_send], buffer[r_off:r_off + n_recv],
                                               recv_splits[c], send_splits[c], self.ep_group))
            s_off, r_off = s_off + n_send, r_off + n_recv

        # one split of each stacked weight into the chunks' views: its backward concatenates the chunks'
        # gradients once, where a slice per chunk would zero-fill and copy a full-size gradient per chunk
        if len(bounds) == 1:
            gate_up_C, down_C = [self.experts.gate_up_proj], [self.experts.down_proj]
        else:
            sizes = [hi - lo for lo, hi in bounds]
            gate_up_C, down_C = self.experts.gate_up_proj.split(sizes), self.experts.down_proj.split(sizes)
        returned = []
        for c, (lo, hi) in enumerate(bounds):
            x_recv = all_to_all_wait(*dispatched[c])
            recv_rl = recv_RL[:, lo:hi]
            expert_of_row = torch.repeat_interleave(
                torch.arange(lo, hi, device=x_PH.device).repeat(ep), recv_rl.reshape(-1),
                output_size=x_recv.shape[0])  # output_size known on the host: no sync
            order = torch.argsort(expert_of_row, stable=True)
            y_local = self._experts(x_recv[order], recv_rl.sum(0), gate_up_C[c], down_C[c])
            y_recv = torch.empty_like(y_local).index_copy(0, order, y_local)
            returned.append(all_to_all_start(y_recv, y_recv.new_empty(sum(send_splits[c]), y_recv.shape[1]),
                                             send_splits[c], recv_splits[c], self.ep_group))
        y_chunks = [all_to_all_wait(*r) for r in returned]
        return y_chunks[0] if len(y_chunks) == 1 else torch.cat(y_chunks)

    def _check_in_step(self, tags: list[int], grad: int) -> None:
        """``tags``: (call number, grad mode) of every rank of the group, as each sent them with its counts."""
        mine = (self._ep_calls, grad)
        others = [(r, tuple(tags[2 * r:2 * r + 2])) for r in range(self.ep_size)]
        wrong = [(r, tag) for r, tag in others if tag != mine]
        if not wrong:
            return

        def say(call: int, grad_on: int) -> str:
            return f"call {call} ({'grad enabled' if grad_on else 'no grad'})"

        r, (call, grad_on) = wrong[0]
        raise RuntimeError(
            f"ExpertMaskedMoE: the ranks of the expert-parallel group are out of step: rank {self.ep_rank} is at this "
            f"layer's {say(*mine)}, rank {r} at its {say(call, grad_on)}. Every rank of an expert-parallel group "
            "must run the same forwards, since each is a collective of the group: give every rank the same number "
            "of eval batches, generate on every rank (generate(..., synced_gpus=True)), never run a forward on one "
            "rank only")

    def _aux_loss(self, logits_TE, probs_TE, tokens_per_expert_E, num_tokens) -> torch.Tensor | None:
        if self.aux_loss_coef == 0 and self.z_loss_coef == 0:
            return None  # no loss of its own (an injected model's default): no zero tensor to launch and add
        loss = logits_TE.new_zeros((), dtype=torch.float32)
        if self.aux_loss_coef > 0 and num_tokens > 0:
            fraction_E = tokens_per_expert_E.float() / (num_tokens * self.top_k)
            loss = loss + self.aux_loss_coef * self.num_experts * (fraction_E * probs_TE.mean(0)).sum()
        if self.z_loss_coef > 0 and num_tokens > 0:
            loss = loss + self.z_loss_coef * torch.logsumexp(logits_TE.float(), dim=-1).pow(2).mean()
        return loss

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
                f"top_k={self.top_k}, router={self.gate.mode}, impl={self.impl!r}, rounding={self.rounding!r}"
                + (", weights_in_input_dtype=True" if self.weights_in_input_dtype else ""))
