"""Fused LM head + cross-entropy: ``F.cross_entropy((hidden @ weight.T).float(), labels)`` without the full logits.

Legend (shape suffixes): N rows (tokens), H hidden, V vocabulary, C rows of one chunk.

The unfused loss path of a causal LM in bf16 writes the logits [N, V] in bf16, copies them to fp32, keeps the
fp32 log-softmax for backward and, in backward, builds the fp32 gradient of the logits and converts it back:
several [N, V] fp32 tensors of memory traffic and up to ~3 [N, V] fp32 buffers alive at the peak.

Here the forward runs chunk by chunk over rows: logits_CV = h_CH @ W_VH^T in the logits dtype, then one call of the
fused softmax cross-entropy op (``ops/cross_entropy.py``: one read of the chunk's logits, fp32 math) gives the loss
terms lse - x[target] of the valid rows, summed into an fp32 device scalar, and writes the gradient of the logits
g_CV = (softmax - onehot(target)) * scale (scale = 1/n_valid for valid rows, 0 for ignored ones), cast to the input
dtype, into a preallocated [N, V] buffer. fp64 inputs, and the others when the op's kernel could not be built, run
the op's PyTorch reference (log_softmax, gather, exp_, scatter_add_, mul). Backward is two GEMMs of exactly the
unfused backward's shapes: grad_hidden = g @ W and grad_weight = g^T @ hidden, scaled by the incoming gradient.

The logits dtype is by default the inputs' (``logits_dtype=None``): the logits GEMM rounds to bf16 as the unfused
path's ``lm_head`` does, and the op upcasts on load as its ``logits.float()`` does, so the loss and gradients are
the ones transformers computes (only the order of the fp32 sums differs). A bf16 chunk is half the bytes of an
fp32 one (1 GB less traffic per step at Mixtral's 8192 x 32000). ``logits_dtype=torch.float32`` keeps the logits in
fp32 instead (on CUDA the bf16/fp16 GEMM writes fp32 directly: ``torch.mm(..., out_dtype=torch.float32)``): a loss
nearer the exact one than the unfused path's, at twice the logits' bytes.

Nothing synchronises with the host: the number of valid labels stays a device tensor, rows are never selected by
a boolean mask, and no Python branch looks at tensor values.

Semantics are those of ``F.cross_entropy(logits.float(), labels, ignore_index=..., reduction=...)``: ``"mean"``
divides by the number of non-ignored labels and is nan when all are ignored (gradients are then 0, as torch's
are); ``"sum"`` is the plain sum (0 when all are ignored). A label outside [0, V) that is not ``ignore_index``
cannot be checked without a host sync: like torch's own CUDA loss it trips a device-side assert (in the kernel,
or ``gather`` of the reference) on CUDA and raises "out of bounds" (RuntimeError) on CPU.

Under ``torch.autocast`` the GEMMs run in the autocast dtype, as ``nn.Linear`` would (the gradient buffer is kept
in that dtype); gradients come back in the dtypes of ``hidden`` and ``weight``. fp16 keeps the [N, V] gradient
buffer in fp32 (twice its bytes) until backward multiplies it by the incoming gradient (a loss scale): stored in
fp16 before that, (softmax - onehot) / n_valid flushed small probabilities to 0 that the unfused path keeps.
"""

from __future__ import annotations

import logging

import torch

from ds_loongforge.ops._dispatch import refuse_double_backward
from ds_loongforge.ops.cross_entropy import accumulation_dtype, scale_by, softmax_cross_entropy_

logger = logging.getLogger("ds_loongforge")

# target size of one chunk's logits: 256 MiB, 4096 rows of bf16 (2048 of fp32) at V = 32000
CHUNK_BYTES = 256 << 20
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# whether torch.mm(a, b, out_dtype=torch.float32) works for CUDA bf16/fp16 inputs: decided by the first CUDA call
_mm_out_dtype_ok: bool | None = None


def default_chunk_rows(vocab: int, logits_dtype: torch.dtype = torch.float32) -> int:
    """Rows whose logits in ``logits_dtype`` take about CHUNK_BYTES (a multiple of 256 rows when that is possible)."""
    rows = max(1, CHUNK_BYTES // (max(1, vocab) * torch.finfo(logits_dtype).bits // 8))
    return rows - rows % 256 if rows >= 256 else rows


def _logits(h_CH: torch.Tensor, w_VH: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
    """h @ w^T as ``logits_dtype`` (the inputs' dtype, or fp32)."""
    global _mm_out_dtype_ok
    if logits_dtype == h_CH.dtype:
        return torch.mm(h_CH, w_VH.t())
    if h_CH.is_cuda and h_CH.dtype in (torch.bfloat16, torch.float16) and torch.compiler.is_compiling():
        # no probe of out_dtype inside a traced graph: the 16-bit inputs widen exactly, the products and sums fp32
        return torch.mm(h_CH.to(logits_dtype), w_VH.t().to(logits_dtype))
    if h_CH.is_cuda and h_CH.dtype in (torch.bfloat16, torch.float16) and _mm_out_dtype_ok is not False:
        if _mm_out_dtype_ok:
            return torch.mm(h_CH, w_VH.t(), out_dtype=torch.float32)
        try:
            out = torch.mm(h_CH, w_VH.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as err:
            _mm_out_dtype_ok = False
            logger.info("[LoongForge] linear_cross_entropy: torch.mm(..., out_dtype=torch.float32) is not available "
                        "(%s); the logits GEMM writes %s and is converted to fp32 per chunk", err, h_CH.dtype)
        else:
            _mm_out_dtype_ok = True
            return out
    return torch.mm(h_CH, w_VH.t()).to(logits_dtype)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd op behind ``linear_cross_entropy`` (inputs already validated and flattened)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, ignore_index: int, chunk_rows: int, reduction: str,
                compute_dtype: torch.dtype, logits_dtype: torch.dtype, grad_enabled: bool):
        device_type = hidden_NH.device.type
        with torch.autocast(device_type, enabled=False):
            h_NH = hidden_NH.to(compute_dtype)
            w_VH = weight_VH.to(compute_dtype)
            n_rows, vocab = h_NH.shape[0], w_VH.shape[0]
            acc = accumulation_dtype(compute_dtype)

            valid_N = labels_N != ignore_index
            target_N = torch.where(valid_N, labels_N, 0)  # ignored rows point at class 0
            n_valid = valid_N.sum()  # a device tensor: never read on the host
            if reduction == "mean":
                scale_N = torch.where(valid_N, n_valid.to(acc).reciprocal(), 0.0)  # 0 on ignored rows, even if 0 valid
            else:
                scale_N = valid_N.to(acc)

            # (needs_input_grad is set under torch.no_grad too: the caller passes the grad mode)
            need_grad = grad_enabled and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
            # fp16 keeps the gradient in fp32 until the backward has its incoming scale (a loss scale of 2^16, say):
            # (softmax - onehot) / n_valid in fp16 would flush every probability below ~2^-24 * n_valid to 0, where
            # the unfused path scales in fp32 first and rounds once (bf16 has fp32's range: its own dtype)
            grad_dtype = torch.float32 if compute_dtype == torch.float16 else compute_dtype
            grad_NV = torch.empty(n_rows, vocab, dtype=grad_dtype, device=h_NH.device) if need_grad else None
            loss = torch.zeros((), dtype=acc, device=h_NH.device)
            for start in range(0, n_rows, chunk_rows):
                rows = slice(start, min(n_rows, start + chunk_rows))
                nll_C = softmax_cross_entropy_(_logits(h_NH[rows], w_VH, logits_dtype), target_N[rows], valid_N[rows],
                                               scale_N[rows], grad_NV[rows] if grad_NV is not None else None)
                loss += nll_C.sum()
            if reduction == "mean":
                loss = loss / n_valid  # nan when every label is ignored, as torch's

        if need_grad:
            ctx.save_for_backward(grad_NV, h_NH, w_VH)
        ctx.dtypes = (hidden_NH.dtype, weight_VH.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("fused_linear_cross_entropy")
        grad_NV, h_NH, w_VH = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_hidden = grad_weight = None
        with torch.autocast(h_NH.device.type, enabled=False):
            if grad_NV.dtype != h_NH.dtype:  # fp16: scaled in fp32, rounded once, then the GEMMs as unfused
                scaled_NV = torch.empty_like(grad_NV, dtype=h_NH.dtype)
                torch.mul(grad_NV, grad_loss.to(grad_NV.dtype), out=scaled_NV)
                if ctx.needs_input_grad[0]:
                    grad_hidden = torch.mm(scaled_NV, w_VH).to(hidden_dtype)
                if ctx.needs_input_grad[1]:
                    grad_weight = torch.mm(scaled_NV.t(), h_NH).to(weight_dtype)
                return grad_hidden, grad_weight, None, None, None, None, None, None, None
            if ctx.needs_input_grad[0]:
                grad_hidden = scale_by(torch.mm(grad_NV, w_VH), grad_loss, in_place=True).to(hidden_dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = _weight_gradient(grad_NV, h_NH, grad_loss).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _weight_gradient(grad_NV: torch.Tensor, h_NH: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """grad_NV^T @ h_NH times the incoming gradient, scaling whichever of h [N, H] and the product [V, H] is smaller
    (h at Mixtral's N = 8192 < V = 32000: the H200 spent 0.33 ms per e2e step on the [V, H] product and grad_hidden
    multiplied by a device scalar). For a power-of-two scale (1, 1/GAS, a loss scale) both orders give the same bits.
    fp16 scales the product: h times a loss scale of 2^16 would overflow where the scaled gradient does not."""
    if h_NH.dtype != torch.float16 and h_NH.shape[0] < grad_NV.shape[1]:
        return torch.mm(grad_NV.t(), scale_by(h_NH, grad_loss))
    return scale_by(torch.mm(grad_NV.t(), h_NH), grad_loss, in_place=True)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if (device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)
            and hidden.dtype != torch.float64 and weight.dtype != torch.float64):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; they must "
                         f"match outside torch.autocast (cast one, e.g. hidden.to(weight.dtype))")
    return hidden.dtype


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         chunk_rows: int | None = None, reduction: str = "mean",
                         logits_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=ignore_index, reduction=reduction)``
    computed chunk by chunk, without materialising the full logits or their fp32 gradient.

    hidden: [..., H] (leading dims are flattened), fp32/bf16/fp16 (fp64 for references).
    weight: [V, H], the LM head's weight (no bias), same dtype as hidden (or anything under torch.autocast).
    labels: int64 with hidden.shape[:-1] elements (any shape); ``ignore_index`` marks rows without a loss.
    chunk_rows: rows per chunk; default: about 256 MiB of logits (4096 rows of bf16 at V = 32000).
    reduction: "mean" (over non-ignored labels; nan when there are none) or "sum".
    logits_dtype: None (the GEMM's dtype, as the unfused path: bf16 logits for bf16 inputs) or torch.float32 (fp32
    logits: a loss nearer the exact one than transformers', twice the bytes). fp64 inputs keep fp64 logits.

    Returns a 0-dim fp32 tensor (fp64 for fp64 inputs). A label outside [0, V) other than ``ignore_index`` is not
    checked (that would sync with the host): it trips a device-side assert on CUDA, a RuntimeError on CPU.
    """
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor) \
            or not isinstance(labels, torch.Tensor):
        raise TypeError("linear_cross_entropy: hidden, weight and labels must be tensors, got "
                        f"{type(hidden).__name__}, {type(weight).__name__}, {type(labels).__name__}")
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"linear_cross_entropy: hidden must be [..., H] with H > 0, got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got shape {tuple(weight.shape)}; pass the LM head's weight as stored by nn.Linear "
                         f"(out_features x in_features), not its transpose")
    if weight.shape[0] == 0:
        raise ValueError("linear_cross_entropy: weight has V = 0 classes")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"linear_cross_entropy: {name} is {t.dtype}; use float32, bfloat16, float16 or float64")
    if labels.dtype != torch.int64:
        raise ValueError(f"linear_cross_entropy: labels must be int64 (torch.long), got {labels.dtype}; "
                         f"pass labels.long()")
    n_rows = hidden.numel() // hidden.shape[-1]
    if labels.numel() != n_rows:
        raise ValueError(f"linear_cross_entropy: labels has {labels.numel()} elements (shape {tuple(labels.shape)}) "
                         f"but hidden has {n_rows} rows (shape {tuple(hidden.shape)}); give one label per row "
                         f"(for a causal LM, shift the labels first)")
    if n_rows == 0:
        raise ValueError(f"linear_cross_entropy: hidden has no rows (shape {tuple(hidden.shape)})")
    if hidden.device != weight.device or hidden.device != labels.device:
        raise ValueError(f"linear_cross_entropy: hidden ({hidden.device}), weight ({weight.device}) and labels "
                         f"({labels.device}) must be on one device; move them with .to(hidden.device)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; use 'mean' or 'sum'")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"linear_cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    compute_dtype = _compute_dtype(hidden, weight)
    if logits_dtype not in (None, torch.float32):
        raise ValueError(f"linear_cross_entropy: logits_dtype={logits_dtype!r}; use None (the inputs' dtype, as the "
                         f"unfused loss) or torch.float32")
    if compute_dtype == torch.float64 or logits_dtype is None:
        logits_dtype = compute_dtype
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0], logits_dtype)
    elif isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be a positive int or None, got {chunk_rows!r}")

    hidden_NH = hidden.reshape(n_rows, hidden.shape[-1])
    return LinearCrossEntropyFunction.apply(hidden_NH, weight, labels.reshape(n_rows), ignore_index, chunk_rows,
                                            reduction, compute_dtype, logits_dtype, torch.is_grad_enabled())


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """The unfused computation, as transformers' ForCausalLMLoss does it: logits in the inputs' dtype, then fp32
    (fp64 inputs stay fp64)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    if logits.dtype != torch.float64:
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index,
                                             reduction=reduction)
