"""Fused MoE dispatch: token rows into expert-major order (permute) and the weighted combine back
(unpermute), forward and backward, and their plain-PyTorch references.

Legend (shape suffixes): T tokens, K experts per token, P = T*K token-expert pairs (pair t*K + j is
token t's j-th expert), H hidden, E experts.

    expert_routing(ids_TK, E) -> order_P, slot_TK, tokens_per_expert_E, offsets_E   (counting-sort kernel)
        order_P[p]    the pair at expert-major position p (stable: token order within an expert)
        slot_TK[t, j] the expert-major position of pair (t, j): order_P's inverse
        offsets_E[e]  int32 group ends (cumsum of the counts), as torch's grouped GEMM takes them
    moe_permute(x_TH, order_P, slot_TK) -> x_PH[p] = x_TH[order_P[p] // K]
        backward: dx_TH[t] = sum_j dx_PH[slot_TK[t, j]]
    moe_unpermute(y_PH, slot_TK, weights_TK, residual_TH=None, rounding="stock")
        -> out_TH[t] = residual_TH[t] + sum_j weights_TK[t, j] * y_PH[slot_TK[t, j]]   (no residual: 0)
        backward: dy_PH[slot_TK[t, j]] = weights_TK[t, j] * dout_TH[t]
                  dweights_TK[t, j]    = dout_TH[t] . y_PH[slot_TK[t, j]]
                  dresidual_TH         = dout_TH (the same tensor)

Sums and products are fp32 (fp64 for fp64 inputs), rounded once to the rows' dtype; dweights is fp32
until it is cast to the weights' dtype. The unpermute forward rounds as ``rounding`` says: "stock" (the default)
rounds the k-sum, then adds the residual and rounds again, as transformers' combine (its grouped_mm experts:
products in the weights' promoted dtype, an fp32 sum, one cast) followed by the decoder layer's
``residual + hidden_states`` does, with each product and sum rounded on its own (no FMA) and, for weights in the
rows' 16-bit dtype, each product rounded to it: with k <= 2 the stock bits. "once" starts the sum from the
residual and rounds once. Every output row is produced by one thread group in a fixed order and each P row is
written exactly once, so the kernels use no atomics and are deterministic.

Index tensors are int64, as argsort returns them. The kernels walk tokens and take slot_TK for both
directions (permute forward reads each x row once and writes its K copies instead of reading it K
times); order_P defines the layout and drives the reference. Both must come from routing_indices(): the
CPU kernels check that slot_TK is a permutation of [0, P), the CUDA kernels do not (that would cost a
host sync) and an out-of-range slot there reads or writes out of bounds. weights_TK may be float32 (the
router's output) or y's dtype; the kernels take float32, so other dtypes are cast (a [T, K] tensor).
Rows may be row-strided views (unit stride along H) without a copy; other layouts are copied first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ds_loongforge.op_builder import MoEDispatchBuilder, MoEDispatchCPUBuilder
from ds_loongforge.ops._dispatch import check_rounding, kernel_for, library_module, refuse_double_backward

_BUILDERS = {"cuda": MoEDispatchBuilder, "cpu": MoEDispatchCPUBuilder}
MAX_KERNEL_EXPERTS = 8192  # csrc/moe_dispatch/moe_dispatch_checks.h: kMaxRoutingExperts (CUDA)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The kernels as torch.library custom ops for torch.compile (see ops/rmsnorm.py); the router's are here too, as
# they are built into this op. Outputs the kernels leave undefined come back as empty tensors.
def _module(t: torch.Tensor):
    return library_module(_BUILDERS, t.device.type)


@torch.library.custom_op("loongforge::moe_permute_forward", mutates_args=())
def _permute_forward_op(x_TH: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    return _module(x_TH).permute_forward(x_TH, slot_TK)


@_permute_forward_op.register_fake
def _(x_TH, slot_TK):
    return x_TH.new_empty(slot_TK.numel(), x_TH.shape[1])


@torch.library.custom_op("loongforge::moe_permute_backward", mutates_args=())
def _permute_backward_op(dx_PH: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    return _module(dx_PH).permute_backward(dx_PH, slot_TK)


@_permute_backward_op.register_fake
def _(dx_PH, slot_TK):
    return dx_PH.new_empty(slot_TK.shape[0], dx_PH.shape[1])


@torch.library.custom_op("loongforge::moe_unpermute_forward", mutates_args=())
def _unpermute_forward_op(y_PH: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor,
                          residual_TH: torch.Tensor | None, stock: bool, round_products: bool) -> torch.Tensor:
    return _module(y_PH).unpermute_forward(y_PH, slot_TK, weights_TK, residual_TH, stock, round_products)


@_unpermute_forward_op.register_fake
def _(y_PH, slot_TK, weights_TK, residual_TH, stock, round_products):
    return y_PH.new_empty(slot_TK.shape[0], y_PH.shape[1])


@torch.library.custom_op("loongforge::moe_unpermute_backward", mutates_args=())
def _unpermute_backward_op(dout_TH: torch.Tensor, y_PH: torch.Tensor | None, slot_TK: torch.Tensor,
                           weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy_PH, dweights_TK = _module(dout_TH).unpermute_backward(dout_TH, y_PH, slot_TK, weights_TK)
    return dy_PH, (weights_TK.new_empty(0) if dweights_TK is None else dweights_TK)


@_unpermute_backward_op.register_fake
def _(dout_TH, y_PH, slot_TK, weights_TK):
    return (dout_TH.new_empty(slot_TK.numel(), dout_TH.shape[1]),
            weights_TK.new_empty(slot_TK.shape if y_PH is not None else (0,)))


@torch.library.custom_op("loongforge::moe_routing_indices", mutates_args=())
def _routing_indices_op(ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                           torch.Tensor]:
    return tuple(_module(ids_TK).routing_indices(ids_TK, num_experts))  # (the module's: a list)


@_routing_indices_op.register_fake
def _(ids_TK, num_experts):
    return (ids_TK.new_empty(ids_TK.numel(), dtype=torch.int64), ids_TK.new_empty(ids_TK.shape, dtype=torch.int64),
            ids_TK.new_empty(num_experts, dtype=torch.int64), ids_TK.new_empty(num_experts, dtype=torch.int32))


@torch.library.custom_op("loongforge::moe_topk_counts", mutates_args=())
def _topk_counts_op(values_RE: torch.Tensor, k: int, weights_R: torch.Tensor | None) -> torch.Tensor:
    return _module(values_RE).topk_counts(values_RE, k, weights_R)


@_topk_counts_op.register_fake
def _(values_RE, k, weights_R):
    return values_RE.new_empty(values_RE.shape[1], dtype=torch.int64)


@torch.library.custom_op("loongforge::moe_router_topk_forward", mutates_args=())
def _router_forward_op(logits_TE: torch.Tensor, k: int,
                       renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_module(logits_TE).router_topk_forward(logits_TE, k, renormalize))


@_router_forward_op.register_fake
def _(logits_TE, k, renormalize):
    tokens = logits_TE.shape[0]
    return (logits_TE.new_empty(logits_TE.shape, dtype=torch.float32),
            logits_TE.new_empty(tokens, k, dtype=torch.float32), logits_TE.new_empty(tokens, k, dtype=torch.int64))


@torch.library.custom_op("loongforge::moe_router_topk_backward", mutates_args=())
def _router_backward_op(dweights_TK: torch.Tensor, dprobs_TE: torch.Tensor | None, probs_TE: torch.Tensor,
                        ids_TK: torch.Tensor, renormalize: bool, logits_dtype: torch.dtype) -> torch.Tensor:
    return _module(probs_TE).router_topk_backward(dweights_TK, dprobs_TE, probs_TE, ids_TK, renormalize, logits_dtype)


@_router_backward_op.register_fake
def _(dweights_TK, dprobs_TE, probs_TE, ids_TK, renormalize, logits_dtype):
    return probs_TE.new_empty(probs_TE.shape, dtype=logits_dtype)


class _Library:
    """The kernel module's methods over the custom ops (what kernel_for returns under torch.compile). Its
    expert_linear_backward is not here: under torch.compile the layer takes torch's grouped GEMM both ways
    (per_expert_backward_pays), as the per-expert GEMMs need the group sizes on the host."""

    permute_forward = staticmethod(_permute_forward_op)
    permute_backward = staticmethod(_permute_backward_op)
    unpermute_forward = staticmethod(_unpermute_forward_op)
    topk_counts = staticmethod(_topk_counts_op)
    router_topk_forward = staticmethod(_router_forward_op)
    router_topk_backward = staticmethod(_router_backward_op)
    routing_indices = staticmethod(_routing_indices_op)

    @staticmethod
    def unpermute_backward(dout_TH, y_PH, slot_TK, weights_TK):
        dy_PH, dweights_TK = _unpermute_backward_op(dout_TH, y_PH, slot_TK, weights_TK)
        return dy_PH, (dweights_TK if y_PH is not None else None)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """The 2-D rows as the kernels take them: a row stride is fine, elements within a row must be adjacent."""
    if t.numel() == 0:  # autograd's gradient of an empty output may be expanded (strides 0), which
        return t.new_empty(t.shape)  # .contiguous() leaves as it is: an empty tensor counts as contiguous
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


class Routing(NamedTuple):
    """The routing indices of one forward (see the module legend); offsets_E[e] = counts[0] + ... + counts[e] as
    int32, the group ends torch's grouped GEMM takes."""

    order_P: torch.Tensor
    slot_TK: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    offsets_E: torch.Tensor


def _check_routing_args(ids_TK: torch.Tensor, num_experts: int) -> None:
    if ids_TK.dim() != 2:
        raise ValueError(f"routing_indices: ids_TK must be [tokens, k], got shape {tuple(ids_TK.shape)}")
    if ids_TK.dtype.is_floating_point or ids_TK.dtype.is_complex or ids_TK.dtype == torch.bool:
        raise ValueError(f"routing_indices: ids_TK must hold integer expert ids, got dtype {ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"routing_indices: num_experts must be >= 1, got {num_experts}")
    if ids_TK.device.type == "cpu" and ids_TK.numel() and not torch.compiler.is_compiling():
        # (under torch.compile the CPU kernel's own check of each id says it at run time, without a graph break)
        low, high = int(ids_TK.min()), int(ids_TK.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"routing_indices: expert ids must be in [0, {num_experts}), got ids from {low} "
                             f"to {high}")


def routing_indices_reference(ids_TK: torch.Tensor, num_experts: int) -> Routing:
    """Plain PyTorch: a stable sort of the pairs by expert, its inverse and the counts (sort_routing_keys), their
    int32 cumsum."""
    _check_routing_args(ids_TK, num_experts)
    return _sorted_routing(ids_TK, num_experts)


def sort_routing_keys(key_TK: torch.Tensor, key_E: torch.Tensor):
    """``(order_P, slot_TK, tokens_per_expert_E)`` of a stable sort of the pairs by ``key_TK`` [T, K]: expert e's
    pairs are those whose key is ``key_E[e]`` (expert e's sort key; the expert id itself when the rows are
    expert-major). Counts from the run boundaries of the sorted keys: torch.bincount would read the largest key back
    to the host on CUDA."""
    sorted_P, order_P = torch.sort(key_TK.reshape(-1), stable=True)  # the sorted keys come with the order
    slot_P = torch.empty_like(order_P)
    slot_P[order_P] = torch.arange(order_P.numel(), device=order_P.device)
    key_E = key_E.to(sorted_P.dtype)
    counts_E = torch.searchsorted(sorted_P, key_E, right=True) - torch.searchsorted(sorted_P, key_E)
    return order_P, slot_P.view(key_TK.shape), counts_E


def _sorted_routing(ids_TK: torch.Tensor, num_experts: int) -> Routing:
    order_P, slot_TK, counts_E = sort_routing_keys(ids_TK, torch.arange(num_experts, device=ids_TK.device))
    return Routing(order_P, slot_TK, counts_E, torch.cumsum(counts_E, 0).to(torch.int32))


def expert_routing(ids_TK: torch.Tensor, num_experts: int, impl: str = "auto") -> Routing:
    """``Routing(order_P, slot_TK, tokens_per_expert_E, offsets_E)``, index tensors int64, from the experts
    ``ids_TK`` [T, K] of each token: order_P is the stable sort of the pairs by expert (token order within an
    expert), slot_TK its inverse.

    The kernel (``impl`` "auto", "cuda" or "cpu") is one counting sort from one host call (on CUDA its block
    counters are scanned by torch's CUB scan), where the reference takes about ten ops; "auto" falls back to the
    reference where the kernel cannot be built or takes no such input (more than 8192 experts on CUDA). On the CPU
    the ids are checked to lie in [0, num_experts). On CUDA they are not (it would cost a host sync): an
    out-of-range id then gets a position after every expert's rows and is counted nowhere (the reference's sort puts
    a negative one first). No step here syncs with the host or uses order-dependent atomics: for ids in range the
    result is deterministic and the same on every path.
    """
    _check_routing_args(ids_TK, num_experts)
    kernel = None
    if not (ids_TK.device.type == "cuda" and num_experts > MAX_KERNEL_EXPERTS and impl == "auto"):
        kernel = kernel_for("routing_indices", _BUILDERS, ids_TK.device.type, impl, _Library)
    if kernel is None or ids_TK.numel() >= 2**31 - 1:
        return _sorted_routing(ids_TK, num_experts)
    return Routing(*kernel.routing_indices(ids_TK.long().contiguous(), num_experts))


MAX_TOPK_COUNT_COLUMNS = 4096  # csrc/moe_dispatch/moe_dispatch_checks.h: kMaxTopKCountExperts


def topk_order_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in torch.topk's order of the values (its CUDA kernel's radix order of the IEEE bits): -0.0 below
    0.0, every NaN above +inf. fp16/bf16 values widen to fp32 exactly; fp64 keeps its own 64 bits."""
    if values.dtype == torch.float64:
        bits = values.contiguous().view(torch.int64)
        keys = torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)  # negatives: larger magnitude, smaller key
        return torch.where(torch.isnan(values), torch.full_like(keys, torch.iinfo(torch.int64).max), keys)
    bits = values.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    keys = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return torch.where(torch.isnan(values), torch.full_like(keys, 0xFFFFFFFF), keys)


def _check_topk_counts_args(values_RE: torch.Tensor, k: int, weights_R: torch.Tensor | None) -> None:
    if values_RE.dim() != 2:
        raise ValueError(f"topk_counts: values_RE must be [rows, columns], got shape {tuple(values_RE.shape)}")
    if not 1 <= k <= values_RE.shape[1]:
        raise ValueError(f"topk_counts: k = {k} must be between 1 and the number of columns ({values_RE.shape[1]})")
    if weights_R is not None:
        if weights_R.dim() != 1 or weights_R.dtype != torch.int64:
            raise ValueError(f"topk_counts: weights_R must be a 1-D int64 tensor, got {weights_R.dtype} of shape "
                             f"{tuple(weights_R.shape)}")
        if weights_R.numel() == 0 or values_RE.shape[0] % weights_R.numel():
            raise ValueError(f"topk_counts: weights_R has {weights_R.numel()} entries, which must divide the "
                             f"{values_RE.shape[0]} rows (row r takes weights_R[r % {weights_R.numel()}])")


def topk_counts_reference(values_RE: torch.Tensor, k: int, weights_R: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: a stable descending sort of each row's topk_order_keys (ties to the lower column, as
    torch.topk's CUDA kernel takes them), its first k columns, their weights scattered into int64 counts."""
    _check_topk_counts_args(values_RE, k, weights_R)
    rows, columns = values_RE.shape
    chosen_RK = torch.sort(topk_order_keys(values_RE), dim=1, descending=True, stable=True).indices[:, :k]
    weight_R = (torch.ones(rows, dtype=torch.int64, device=values_RE.device) if weights_R is None
                else weights_R.to(values_RE.device).repeat(rows // weights_R.numel()))
    counts_E = torch.zeros(columns, dtype=torch.int64, device=values_RE.device)
    return counts_E.scatter_add_(0, chosen_RK.reshape(-1), weight_R.repeat_interleave(k))


def topk_counts(values_RE: torch.Tensor, k: int, weights_R: torch.Tensor | None = None,
                impl: str = "auto") -> torch.Tensor:
    """int64 ``counts_E[e]``: the sum of ``weights_R[r % len(weights_R)]`` (1 without weights) over the rows r of
    ``values_RE`` [R, E] whose k largest values include column e. The choices are torch.topk's on CUDA: NaN above
    every number, -0.0 below 0.0, the lower column first among equal values.

    For the Switch load-balancing loss (integrations/balancing_loss.py), where torch.topk, a ones tensor and a
    ``scatter_add_`` of R x k floats into E counters took ~0.3 ms of an e2e mixtral step on the H200 (the
    scatter's float atomics all land on E addresses). One kernel here: a thread per row, k passes over its values,
    shared-memory counters, integer atomics (the counts do not depend on their order). Float32, float16 and
    bfloat16 values with up to 4096 columns; others take the reference. ``impl`` as in :func:`moe_permute`.
    """
    _check_topk_counts_args(values_RE, k, weights_R)
    kernel = None
    if impl != "auto" or (values_RE.dtype in _KERNEL_DTYPES and values_RE.shape[1] <= MAX_TOPK_COUNT_COLUMNS):
        kernel = kernel_for("topk_counts", _BUILDERS, values_RE.device.type, impl, _Library)
    if kernel is None:
        return topk_counts_reference(values_RE, k, weights_R)
    return kernel.topk_counts(values_RE.detach().contiguous(), int(k),
                              None if weights_R is None else weights_R.contiguous())


def _check_expert_linear_args(dy_PO: torch.Tensor, x_PI: torch.Tensor, w_EOI: torch.Tensor, counts) -> None:
    if dy_PO.dim() != 2 or x_PI.dim() != 2 or w_EOI.dim() != 3:
        raise ValueError(f"expert_linear_backward: dy_PO [P, O], x_PI [P, I] and w_EOI [E, O, I] expected, got shapes "
                         f"{tuple(dy_PO.shape)}, {tuple(x_PI.shape)} and {tuple(w_EOI.shape)}")
    if (dy_PO.shape[0] != x_PI.shape[0] or dy_PO.shape[1] != w_EOI.shape[1] or x_PI.shape[1] != w_EOI.shape[2]):
        raise ValueError(f"expert_linear_backward: shapes do not agree: dy_PO {tuple(dy_PO.shape)}, x_PI "
                         f"{tuple(x_PI.shape)}, w_EOI {tuple(w_EOI.shape)} (dy_PO [P, O], x_PI [P, I], w_EOI [E, O, I])")
    if not dy_PO.dtype == x_PI.dtype == w_EOI.dtype:
        raise ValueError(f"expert_linear_backward: one dtype for all three, got dy_PO {dy_PO.dtype}, x_PI "
                         f"{x_PI.dtype}, w_EOI {w_EOI.dtype}")
    if len(counts) != w_EOI.shape[0] or any(n < 0 for n in counts) or sum(counts) != x_PI.shape[0]:
        raise ValueError(f"expert_linear_backward: counts must be {w_EOI.shape[0]} group sizes >= 0 summing to the "
                         f"{x_PI.shape[0]} rows of x_PI, got {list(counts)}")


def expert_linear_backward_reference(dy_PO: torch.Tensor, x_PI: torch.Tensor, w_EOI: torch.Tensor, counts,
                                     need_dx: bool = True, need_dw: bool = True):
    """Plain PyTorch (one torch.mm per expert and product): see :func:`expert_linear_backward`."""
    _check_expert_linear_args(dy_PO, x_PI, w_EOI, counts)
    dx_PI = torch.empty_like(x_PI) if need_dx else None
    dw_EOI = torch.empty_like(w_EOI) if need_dw else None
    start = 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        if need_dx and n:
            torch.mm(dy_PO[rows], w_EOI[e], out=dx_PI[rows])
        if need_dw:
            torch.mm(dy_PO[rows].t(), x_PI[rows], out=dw_EOI[e])  # no rows: zeros
        start += n
    return dx_PI, dw_EOI


def expert_gemm_backend(device_type: str, impl: str = "auto") -> str | None:
    """How :func:`expert_linear_backward` runs its GEMMs on ``device_type``: "cublaslt" (CUDA, an algorithm per
    problem class chosen once), "aten" (torch's matmul per GEMM: on CUDA a cuBLAS heuristic query whenever a row
    count is new) or None (no kernel: the reference)."""
    kernel = kernel_for("expert_linear_backward", _BUILDERS, device_type, impl)
    return None if kernel is None else kernel.expert_gemm_backend


ROW_BUCKETS = {"octave": 0, "exact": -1, "blocks": -2}


def _row_bucket_code(row_bucket) -> int:
    """The kernel's code for a row-count grouping (moe_expert_gemm.cpp's bucket()): ROW_BUCKETS, or a positive row
    step itself."""
    if isinstance(row_bucket, str) and row_bucket in ROW_BUCKETS:
        return ROW_BUCKETS[row_bucket]
    if isinstance(row_bucket, int) and not isinstance(row_bucket, bool) and row_bucket > 0:
        return row_bucket
    raise ValueError(f"expert_linear_backward: row_bucket must be one of {sorted(ROW_BUCKETS)} or a positive number "
                     f"of rows, got {row_bucket!r}")


def expert_gemm_stats() -> dict | None:
    """The CUDA build's cuBLASLt heuristic queries since the process started and their host milliseconds (None
    without a CUDA kernel)."""
    kernel = kernel_for("expert_linear_backward", _BUILDERS, "cuda", "auto")
    if kernel is None or not hasattr(kernel, "expert_gemm_stats"):
        return None
    queries, query_ns = kernel.expert_gemm_stats()
    return {"queries": queries, "query_ms": query_ns / 1e6}


def expert_linear_backward(dy_PO: torch.Tensor, x_PI: torch.Tensor, w_EOI: torch.Tensor, counts,
                           need_dx: bool = True, need_dw: bool = True, impl: str = "auto",
                           row_bucket: int | str = "blocks"):
    """``(dx_PI, dw_EOI)``, the gradients of ``y_PO = x_PI @ w_EOI[e].T`` on each expert's rows (expert-major,
    ``counts[e]`` rows for expert e, a host list): ``dx_PI[rows] = dy_PO[rows] @ w_EOI[e]`` and ``dw_EOI[e] =
    dy_PO[rows].T @ x_PI[rows]`` (the weight's own layout, as torch's grouped GEMM writes it: a transposed one
    would cost the parameter a strided copy; zeros for an expert without rows). None for a gradient not asked for.

    One GEMM per expert and product, all issued by one host call: where experts are few and large, cuBLAS's GEMMs
    of each expert's size ran ~5-10% faster than torch's grouped GEMM, but issued as torch.mm from Python they cost
    far more host time than they saved (benchmarks/NOTES.md, 6323049; a811de5's --host-cost: a cuBLAS heuristic
    query for each new row count). On CUDA the op asks cuBLASLt's heuristic once per problem class and row-count
    bucket (csrc/moe_dispatch/moe_expert_gemm.cpp): ``row_bucket`` "blocks" (the default: the exact choice, asked
    once per block of 8 counts and per multiple of 8, see bucket() there), "octave" (8 buckets an octave), a
    positive row step (multiples of it) or "exact" (a ~0.1 ms heuristic query for every new row count); only
    CUDA's choice of algorithm depends on it, never the arithmetic's precision, and each is a function of the row
    count alone.
    fp32 accumulation; split-K sums only in fp32.
    ``impl`` as in :func:`moe_permute`.
    """
    counts = [int(n) for n in counts]
    _check_expert_linear_args(dy_PO, x_PI, w_EOI, counts)
    code = _row_bucket_code(row_bucket)
    kernel = _kernel("expert_linear_backward", x_PI, impl, library=None)  # host counts: no custom op
    if kernel is None:
        return expert_linear_backward_reference(dy_PO, x_PI, w_EOI, counts, need_dx, need_dw)
    return tuple(kernel.expert_linear_backward(dy_PO.contiguous(), x_PI.contiguous(), w_EOI.contiguous(), counts,
                                               bool(need_dx), bool(need_dw), code))


def routing_indices(ids_TK: torch.Tensor, num_experts: int, impl: str = "auto"):
    """``(order_P, slot_TK, tokens_per_expert_E)`` of :func:`expert_routing`."""
    return tuple(expert_routing(ids_TK, num_experts, impl)[:3])


def _check_indices(op: str, order_P: torch.Tensor | None, slot_TK: torch.Tensor) -> None:
    if slot_TK.dim() != 2 or slot_TK.dtype != torch.int64:
        raise ValueError(f"{op}: slot_TK must be an int64 [tokens, k] tensor (as routing_indices returns it), "
                         f"got {slot_TK.dtype} of shape {tuple(slot_TK.shape)}")
    if order_P is not None and (order_P.dtype != torch.int64 or tuple(order_P.shape) != (slot_TK.numel(),)):
        raise ValueError(f"{op}: order_P must be an int64 [T*K] = [{slot_TK.numel()}] tensor for slot_TK of "
                         f"shape {tuple(slot_TK.shape)}, got {order_P.dtype} of shape {tuple(order_P.shape)}")


def _check_permute_args(x_TH: torch.Tensor, order_P: torch.Tensor, slot_TK: torch.Tensor) -> None:
    _check_indices("moe_permute", order_P, slot_TK)
    if x_TH.dim() != 2 or x_TH.shape[0] != slot_TK.shape[0]:
        raise ValueError(f"moe_permute: x_TH must be [tokens, hidden] with tokens = slot_TK.shape[0] = "
                         f"{slot_TK.shape[0]}, got shape {tuple(x_TH.shape)}")


def _check_unpermute_args(y_PH: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor,
                          residual_TH: torch.Tensor | None = None) -> None:
    _check_indices("moe_unpermute", None, slot_TK)
    if residual_TH is not None and (residual_TH.shape != (slot_TK.shape[0], y_PH.shape[-1])
                                    or residual_TH.dtype != y_PH.dtype or residual_TH.device != y_PH.device):
        raise ValueError(f"moe_unpermute: residual_TH must be [tokens, hidden] = [{slot_TK.shape[0]}, "
                         f"{y_PH.shape[-1]}] in y's dtype {y_PH.dtype} on {y_PH.device}, got "
                         f"{tuple(residual_TH.shape)} {residual_TH.dtype} on {residual_TH.device}")
    if y_PH.dim() != 2 or y_PH.shape[0] != slot_TK.numel():
        raise ValueError(f"moe_unpermute: y_PH must be [T*K, hidden] with T*K = {slot_TK.numel()} for slot_TK "
                         f"of shape {tuple(slot_TK.shape)}, got shape {tuple(y_PH.shape)}")
    if weights_TK.shape != slot_TK.shape:
        raise ValueError(f"moe_unpermute: weights_TK shape {tuple(weights_TK.shape)} differs from slot_TK shape "
                         f"{tuple(slot_TK.shape)}")
    if weights_TK.dtype not in (torch.float32, y_PH.dtype):
        raise ValueError(f"moe_unpermute: weights_TK must be float32 or y's dtype {y_PH.dtype}, got "
                         f"{weights_TK.dtype}")


def moe_permute_reference(x_TH: torch.Tensor, order_P: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch with the kernels' semantics: the gather by order_P, gradients summed in fp32 (fp64 for
    fp64 inputs) and rounded once."""
    _check_permute_args(x_TH, order_P, slot_TK)
    k = slot_TK.shape[1]
    return x_TH.to(_compute_dtype(x_TH.dtype))[order_P // k].to(x_TH.dtype)


def _rounds_products(y_PH: torch.Tensor, weights_TK: torch.Tensor) -> bool:
    """Whether "stock" rounds each weighted product to y's dtype: weights in y's 16-bit dtype, whose product torch
    computes in that dtype (Qwen2-MoE, Qwen3-MoE and OLMoE cast their routing weights so; Mixtral keeps them fp32,
    and fp32 x 16-bit promotes to an fp32 product)."""
    return weights_TK.dtype == y_PH.dtype and y_PH.dtype in (torch.float16, torch.bfloat16)


def moe_unpermute_reference(y_PH: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor,
                            residual_TH: torch.Tensor | None = None, rounding: str = "stock") -> torch.Tensor:
    """Plain PyTorch with the kernels' semantics: fp32 products and sums (fp64 for fp64 inputs), rounded once;
    under "stock", 16-bit weights' products rounded to that dtype before the sum, and with a residual the sum
    rounded, the residual added and the result rounded again."""
    stock = check_rounding("moe_unpermute_reference", rounding)
    _check_unpermute_args(y_PH, slot_TK, weights_TK, residual_TH)
    acc = _compute_dtype(y_PH.dtype)
    y_TKH = y_PH.to(acc)[slot_TK]
    products = y_TKH * weights_TK.to(acc).unsqueeze(-1)
    if stock and _rounds_products(y_PH, weights_TK):
        products = products.to(y_PH.dtype).to(acc)
    out = products.sum(dim=1)
    if residual_TH is not None:
        out = residual_TH.to(acc) + (out.to(y_PH.dtype).to(acc) if stock else out)
    return out.to(y_PH.dtype)


class _MoEPermuteFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_TH, slot_TK, kernel):
        ctx.save_for_backward(slot_TK)
        ctx.kernel = kernel
        return kernel.permute_forward(_unit_stride_rows(x_TH), slot_TK)

    @staticmethod
    def backward(ctx, dx_PH):
        refuse_double_backward("moe_permute")
        (slot_TK,) = ctx.saved_tensors
        return ctx.kernel.permute_backward(_unit_stride_rows(dx_PH), slot_TK), None, None


class _MoEUnpermuteFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y_PH, slot_TK, weights_TK, residual_TH, kernel, stock, round_products):
        y_rows = _unit_stride_rows(y_PH)
        out_TH = kernel.unpermute_forward(y_rows, slot_TK, weights_TK,
                                          None if residual_TH is None else _unit_stride_rows(residual_TH), stock,
                                          round_products)
        # y is needed only for dweights: without a weight gradient the backward never reads it
        ctx.save_for_backward(y_rows if ctx.needs_input_grad[2] else None, slot_TK, weights_TK)
        ctx.kernel = kernel
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH):
        refuse_double_backward("moe_unpermute")
        y_rows, slot_TK, weights_TK = ctx.saved_tensors
        dy_PH, dweights_TK = ctx.kernel.unpermute_backward(_unit_stride_rows(dout_TH), y_rows, slot_TK, weights_TK)
        dresidual_TH = dout_TH if ctx.needs_input_grad[3] else None  # out = residual + ...: the gradient as is
        return (dy_PH if ctx.needs_input_grad[0] else None), None, dweights_TK, dresidual_TH, None, None, None


def _kernel(op: str, rows: torch.Tensor, impl: str, library=_Library):
    """The compiled module for ``rows``' device, or None for the reference (auto with a dtype the kernels
    do not take, e.g. fp64, or a build that failed)."""
    if impl == "auto" and rows.dtype not in _KERNEL_DTYPES:
        return None
    return kernel_for(op, _BUILDERS, rows.device.type, impl, library)


def moe_permute(x_TH: torch.Tensor, order_P: torch.Tensor, slot_TK: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``x_PH[p] = x_TH[order_P[p] // K]``: each token's row once per chosen expert, in expert-major order.

    ``order_P`` and ``slot_TK`` come from :func:`routing_indices`. ``impl``: "auto" (kernel for the
    tensor's device, reference if it cannot be built), "cuda", "cpu", or "reference".
    """
    _check_permute_args(x_TH, order_P, slot_TK)
    kernel = _kernel("moe_permute", x_TH, impl)
    if kernel is None:
        return moe_permute_reference(x_TH, order_P, slot_TK)
    return _MoEPermuteFunction.apply(x_TH, slot_TK, kernel)


def moe_unpermute(y_PH: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor,
                  impl: str = "auto", residual_TH: torch.Tensor | None = None, rounding: str = "stock") -> torch.Tensor:
    """``out_TH[t] = residual_TH[t] + sum_j weights_TK[t, j] * y_PH[slot_TK[t, j]]`` in fp32, returned in y's
    dtype (without ``residual_TH`` the sum alone, rounded once).

    ``weights_TK`` is float32 or y's dtype; its gradient comes back in its own dtype. ``residual_TH`` [T, H] in
    y's dtype: a decoder layer's residual stream, added in the same pass (its gradient is out's). ``rounding``
    "stock" (the default) rounds the sum before the residual is added, as transformers' MoE block and decoder layer
    do, and rounds each product and sum on its own (each product to y's dtype when the weights are in it, as
    torch's 16-bit multiply does); "once" rounds ``residual + sum`` once (see the module docstring). ``impl`` as in
    :func:`moe_permute`.
    """
    stock = check_rounding("moe_unpermute", rounding)
    _check_unpermute_args(y_PH, slot_TK, weights_TK, residual_TH)
    kernel = _kernel("moe_unpermute", y_PH, impl)
    if kernel is None:
        return moe_unpermute_reference(y_PH, slot_TK, weights_TK, residual_TH, rounding)
    round_products = stock and _rounds_products(y_PH, weights_TK)  # before the kernels' fp32 copy of the weights
    return _MoEUnpermuteFunction.apply(y_PH, slot_TK, weights_TK.float().contiguous(), residual_TH, kernel, stock,
                                       round_products)
