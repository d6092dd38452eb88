"""Numerical checks of the ops against fp64, shared by the tests and ``loongforge_report --verify``.

The rule (as in flash-attention/apex): an op's error against the fp64 reference must be at most 2x the
error of the same computation done by PyTorch in the op's dtype, with a floor of one unit of rounding
at the reference's scale (so exact agreement of both never fails on a zero tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ds_loongforge.ops.cross_entropy import cross_entropy_reference, softmax_cross_entropy_
from ds_loongforge.ops.moe_dispatch import (expert_linear_backward, expert_linear_backward_reference, expert_routing,
                                            moe_permute, moe_permute_reference, moe_unpermute, moe_unpermute_reference,
                                            routing_indices, routing_indices_reference)
from ds_loongforge.ops.moe_router import router_topk, router_topk_reference
from ds_loongforge.ops.rmsnorm import fused_rmsnorm, rmsnorm_reference
from ds_loongforge.ops.swiglu import philox_keep_mask, swiglu_dropout, swiglu_reference


def max_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    diff = (value.detach().double() - reference.detach().double()).abs()
    if torch.isnan(diff).any():
        return float("inf")
    return float(diff.max()) if diff.numel() else 0.0


def relative_l2_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference||: for composite layers, where a shared upstream rounding
    dominates and the single worst element is chance."""
    ref = reference.detach().double()
    norm = float(ref.norm())
    diff = float((value.detach().double() - ref).norm())
    return diff / norm if norm > 0 else diff


def tolerance(torch_error: float, reference: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> float:
    """2x PyTorch's own error, floored at the rounding level of the dtype at the computation's scale.

    The floor is one ulp for 16-bit types (a result computed in fp32 and rounded once can land a hair
    past half an ulp) and 8 ulp for float32, where summation order alone moves results by a few ulp. ``scale`` defaults to the reference's largest
    magnitude; a result formed by cancelling larger terms passes the size of those terms instead.
    """
    if scale is None:
        scale = float(reference.detach().abs().max()) if reference.numel() else 0.0
    ulps = 8.0 if dtype == torch.float32 else 1.0
    return max(2.0 * torch_error, ulps * torch.finfo(dtype).eps * scale)


def hf_rmsnorm_eager(x, weight, eps, residual=None):
    """transformers' LlamaRMSNorm computed by PyTorch in x's dtype (the baseline for the 2x rule)."""
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * hf.to(h.dtype)
    return y if residual is None else (y, h)


def swiglu_eager(gate_up, p, seed, offset=0):
    """Unfused PyTorch in gate_up's dtype with the same mask (the baseline for the 2x rule)."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    if p > 0:
        keep = philox_keep_mask(out.numel(), p, seed, offset, out.device).view(out.shape)
        out = out * keep.to(out.dtype) / (1.0 - p)
    return out


@dataclass
class CheckResult:
    name: str
    error: float
    tol: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tol

    def describe(self) -> str:
        verdict, relation = ("ok  ", "<=") if self.passed else ("FAIL", "> ")
        return f"{verdict} {self.name:<52} max err {self.error:.3e} {relation} tol {self.tol:.3e}"


def _grads(outputs, inputs, grad_outputs):
    return torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=False)


def _rmsnorm_reference_stored_residual(x, weight, eps, residual, dtype):
    """fp64 reference of the op's specified semantics: the new residual h = x + r is stored in the
    activation dtype (as an unfused add would store it) and normalized from there. The rounding is
    straight-through for the gradients."""
    if residual is None:
        return rmsnorm_reference(x, weight, eps)
    h = x + residual
    h = h + (h.to(dtype).to(h.dtype) - h).detach()
    return rmsnorm_reference(h, weight, eps), h


def rmsnorm_checks(rows: int, hidden: int, dtype: torch.dtype, device: str, impl: str,
                   residual: bool = False, weight_dtype: torch.dtype | None = None, eps: float = 1e-6,
                   x: torch.Tensor | None = None, generator: torch.Generator | None = None,
                   keep_input: bool = False, rounding: str = "stock") -> list[CheckResult]:
    """Forward and all gradients of fused_rmsnorm(impl, rounding) vs fp64, each with its 2x-PyTorch tolerance.

    ``x`` may be given (e.g. a non-contiguous view); otherwise it is drawn at random. ``keep_input``: the op
    also returns x, and a second upstream gradient comes back through it (dx is the sum of both paths).
    """
    if keep_input and residual:
        raise ValueError("rmsnorm_checks: keep_input and residual are two different modes of the op")
    weight_dtype = weight_dtype or dtype
    kw = {"device": device, "generator": generator}
    if x is None:
        x = torch.randn(rows, hidden, dtype=dtype, **kw)
    w = (1.0 + 0.5 * torch.randn(hidden, dtype=torch.float32, **kw)).to(weight_dtype)
    r = torch.randn(x.shape, dtype=dtype, **kw) if residual else None
    dy = torch.randn(x.shape, dtype=dtype, **kw)
    dh = torch.randn(x.shape, dtype=dtype, **kw) if residual or keep_input else None
    label = (f"rmsnorm {impl} {str(dtype)[6:]} {tuple(x.shape)}{' +res' if residual else ''}"
             f"{' +keep_input' if keep_input else ''}{' rounding once' if rounding == 'once' else ''}")
    two_outputs = residual or keep_input

    def run(fn, cast):
        xs = x.detach().to(cast).requires_grad_()
        ws = w.detach().to(cast if cast == torch.float64 else weight_dtype).requires_grad_()
        rs = r.detach().to(cast).requires_grad_() if residual else None
        out = fn(xs, ws, rs)
        outs = out if two_outputs else (out,)
        grads_out = (dy.to(cast), dh.to(cast)) if two_outputs else (dy.to(cast),)
        inputs = (xs, ws, rs) if residual else (xs, ws)
        return [o.detach() for o in outs] + list(_grads(outs, inputs, grads_out))

    def keeping(norm):  # the plain-PyTorch forms return x through a view, whose gradient autograd adds
        return lambda a, b, c: (norm(a, b, c), a.view_as(a)) if keep_input else norm(a, b, c)

    ours = run(lambda a, b, c: fused_rmsnorm(a, b, eps, residual=c, impl=impl, keep_input=keep_input,
                                             rounding=rounding), dtype)
    ref = run(keeping(lambda a, b, c: _rmsnorm_reference_stored_residual(a, b, eps, c, dtype)), torch.float64)
    eager = run(keeping(lambda a, b, c: hf_rmsnorm_eager(a, b, eps, residual=c)), dtype)
    # dx = rstd * (w*dy - xhat * mean(xhat * w*dy)) cancels terms of size rstd*|w*dy| (all of it when
    # hidden == 1), and dw sums dy*xhat over rows: those magnitudes set the rounding scale of each.
    h64 = (x + r).double() if residual else x.double()
    rstd = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    dx_scale = float((rstd * (w.double() * dy.double()).abs()).max()) if x.numel() else 0.0
    dw_scale = float((dy.double() * h64 * rstd).abs().sum(0).max()) if x.numel() else 0.0
    names = ["y", "h", "dx", "dw", "dresidual"] if residual else ["y", "x", "dx", "dw"] if keep_input \
        else ["y", "dx", "dw"]
    if keep_input:  # dx also holds the gradient that came through the returned x
        dx_scale = max(dx_scale, float(dh.double().abs().max()) if x.numel() else 0.0)
    scales = {"dx": dx_scale, "dresidual": dx_scale, "dw": dw_scale}
    return [CheckResult(f"{label} {n}", max_error(o, f), tolerance(max_error(e, f), f, dtype, scales.get(n)))
            for n, o, f, e in zip(names, ours, ref, eager)]


def swiglu_checks(rows: int, inter: int, dtype: torch.dtype, device: str, impl: str, p: float = 0.0,
                  seed: int = 1234, gate_up: torch.Tensor | None = None,
                  generator: torch.Generator | None = None, rounding: str = "stock") -> list[CheckResult]:
    """Forward and the gradient of swiglu_dropout(impl, rounding) vs fp64, each with its 2x-PyTorch tolerance."""
    kw = {"device": device, "generator": generator}
    if gate_up is None:
        gate_up = 2.0 * torch.randn(rows, 2 * inter, dtype=dtype, **kw)
    dout = torch.randn(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=dtype, **kw)
    label = (f"swiglu {impl} {str(dtype)[6:]} {tuple(gate_up.shape)} p={p}"
             f"{' rounding once' if rounding == 'once' else ''}")

    def run(fn, cast):
        g = gate_up.detach().to(cast).requires_grad_()
        out = fn(g)
        (dg,) = _grads((out,), (g,), (dout.to(cast),))
        return [out.detach(), dg]

    ours = run(lambda g: swiglu_dropout(g, p, seed=seed, impl=impl, rounding=rounding), dtype)
    ref = run(lambda g: swiglu_reference(g, p, seed=seed), torch.float64)
    eager = run(lambda g: swiglu_eager(g, p, seed), dtype)
    return [CheckResult(f"{label} {n}", max_error(o, f), tolerance(max_error(e, f), f, dtype))
            for n, o, f, e in zip(["out", "dgate_up"], ours, ref, eager)]


def cross_entropy_checks(rows: int, vocab: int, grad_dtype: torch.dtype | None, device: str, impl: str,
                         logits_CV: torch.Tensor | None = None, ignore_frac: float = 0.3,
                         generator: torch.Generator | None = None,
                         logits_dtype: torch.dtype = torch.float32,
                         op: Callable | None = None) -> list[CheckResult]:
    """nll and the logits' gradient (in ``grad_dtype``; None: no gradient) of softmax_cross_entropy_(impl) vs
    fp64, each with its 2x-PyTorch tolerance (PyTorch: the reference's fp32 log_softmax path on the same logits).
    ``op`` (logits, target, valid, scale, grad) -> nll replaces softmax_cross_entropy_, e.g. a compiled module's
    ``forward`` built from another source tree (benchmarks/diagnose_cross_entropy.py).

    ``logits_CV`` [rows, vocab] (any float dtype) may be given (e.g. a strided view or huge values); otherwise
    2 * randn in ``logits_dtype``. The fp64 truth is computed from the logits as given (a bf16 chunk's values are
    exact in fp64): what is checked is the op's arithmetic, not the rounding of the logits before it.
    Ignored rows get valid False, target 0 and scale 0; valid rows a scale in [0.5, 1.5).
    """
    kw = {"device": device, "generator": generator}
    if logits_CV is None:
        logits_CV = (2.0 * torch.randn(rows, vocab, **kw)).to(logits_dtype)
    valid_C = torch.rand(rows, **kw) >= ignore_frac
    target_C = torch.where(valid_C, torch.randint(0, vocab, (rows,), **kw), 0)
    scale_C = torch.where(valid_C, 0.5 + torch.rand(rows, **kw), 0.0)
    label = (f"cross_entropy {impl} logits={str(logits_CV.dtype)[6:]} "
             f"grad={str(grad_dtype)[6:] if grad_dtype else None} C={rows} V={vocab}")

    def run(fn, logits, scale, dtype):
        grad = torch.empty(logits.shape, dtype=dtype, device=device) if grad_dtype is not None else None
        return [fn(logits, target_C, valid_C, scale, grad)] + ([grad] if grad is not None else [])

    ours = run(op or (lambda *a: softmax_cross_entropy_(*a, impl=impl)), logits_CV, scale_C, grad_dtype)
    ref = run(cross_entropy_reference, logits_CV.double(), scale_C.double(), torch.float64)
    eager = run(cross_entropy_reference, logits_CV, scale_C, grad_dtype)
    dtypes = [torch.float32, grad_dtype]
    return [CheckResult(f"{label} {n}", max_error(o, f), tolerance(max_error(e, f), f, d))
            for n, o, f, e, d in zip(["nll", "dlogits"], ours, ref, eager, dtypes)]


def random_routing(tokens: int, k: int, experts: int, device: str, generator: torch.Generator | None = None):
    """Expert ids [T, K] from the first ceil(3E/4) experts only, so the others get no tokens (a token may
    pick one expert twice, as when K exceeds them), and float32 softmax weights [T, K]."""
    used = max(1, (3 * experts + 3) // 4)
    ids_TK = torch.randint(0, used, (tokens, k), device=device, generator=generator)
    weights_TK = torch.softmax(torch.randn(tokens, k, device=device, generator=generator), dim=-1)
    return ids_TK, weights_TK


def moe_permute_eager(x_TH, order_P, k):
    """Unfused PyTorch in x's dtype (the baseline for the 2x rule): its gradient adds in x's dtype."""
    return x_TH[order_P // k]


def moe_unpermute_eager(y_PH, slot_TK, weights_TK, residual_TH=None):
    """Unfused PyTorch in y's dtype (the baseline for the 2x rule); the residual added after, as a decoder does."""
    out = (y_PH[slot_TK] * weights_TK.to(y_PH.dtype).unsqueeze(-1)).sum(dim=1)
    return out if residual_TH is None else residual_TH + out


def moe_permute_checks(tokens: int, hidden: int, k: int, experts: int, dtype: torch.dtype, device: str, impl: str,
                       x: torch.Tensor | None = None, generator: torch.Generator | None = None) -> list[CheckResult]:
    """Forward and the gradient of moe_permute(impl) vs fp64, each with its 2x-PyTorch tolerance.

    ``x`` [tokens, hidden] may be given (e.g. a row-strided view); otherwise it is drawn at random.
    """
    kw = {"device": device, "generator": generator}
    if x is None:
        x = torch.randn(tokens, hidden, dtype=dtype, **kw)
    ids_TK, _ = random_routing(tokens, k, experts, device, generator)
    order_P, slot_TK, _ = routing_indices(ids_TK, experts)
    dx_PH = torch.randn(tokens * k, hidden, dtype=dtype, **kw)
    label = f"moe_permute {impl} {str(dtype)[6:]} T={tokens} H={hidden} K={k} E={experts}"

    def run(fn, cast):
        xs = x.detach().to(cast).requires_grad_()
        out = fn(xs)
        (dx,) = _grads((out,), (xs,), (dx_PH.to(cast),))
        return [out.detach(), dx]

    ours = run(lambda a: moe_permute(a, order_P, slot_TK, impl=impl), dtype)
    ref = run(lambda a: moe_permute_reference(a, order_P, slot_TK), torch.float64)
    eager = run(lambda a: moe_permute_eager(a, order_P, k), dtype)
    # dx adds K gradient rows: their magnitudes, not the (possibly cancelled) sum, set its rounding scale
    dx_scale = float(dx_PH.double().abs()[slot_TK].sum(1).max()) if dx_PH.numel() else 0.0
    scales = {"dx": dx_scale}
    return [CheckResult(f"{label} {n}", max_error(o, f), tolerance(max_error(e, f), f, dtype, scales.get(n)))
            for n, o, f, e in zip(["x_PH", "dx"], ours, ref, eager)]


def moe_unpermute_checks(tokens: int, hidden: int, k: int, experts: int, dtype: torch.dtype, device: str,
                         impl: str, weights_dtype: torch.dtype = torch.float32, y: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, residual: bool = False,
                         rounding: str = "stock") -> list[CheckResult]:
    """Forward and the gradients (dy, dweights, and dresidual with ``residual``) of moe_unpermute(impl, rounding)
    vs fp64, each with its 2x-PyTorch tolerance. ``y`` [tokens * k, hidden] may be given; otherwise it is drawn at
    random."""
    kw = {"device": device, "generator": generator}
    ids_TK, weights_TK = random_routing(tokens, k, experts, device, generator)
    weights_TK = weights_TK.to(weights_dtype)
    _, slot_TK, _ = routing_indices(ids_TK, experts)
    if y is None:
        y = torch.randn(tokens * k, hidden, dtype=dtype, **kw)
    dout_TH = torch.randn(tokens, hidden, dtype=dtype, **kw)
    r_TH = 4.0 * torch.randn(tokens, hidden, dtype=dtype, **kw) if residual else None
    label = (f"moe_unpermute {impl} {rounding} {str(dtype)[6:]} T={tokens} H={hidden} K={k} E={experts}"
             f"{' +res' if residual else ''}")

    def run(fn, cast):
        ys = y.detach().to(cast).requires_grad_()
        ws = weights_TK.detach().to(cast if cast == torch.float64 else weights_dtype).requires_grad_()
        rs = r_TH.detach().to(cast).requires_grad_() if residual else None
        out = fn(ys, ws, rs)
        return [out.detach()] + list(_grads((out,), (ys, ws, rs) if residual else (ys, ws), (dout_TH.to(cast),)))

    ours = run(lambda a, w, r: moe_unpermute(a, slot_TK, w, impl=impl, residual_TH=r, rounding=rounding), dtype)
    ref = run(lambda a, w, r: moe_unpermute_reference(a, slot_TK, w, r), torch.float64)
    eager = run(lambda a, w, r: moe_unpermute_eager(a, slot_TK, w, r), dtype)
    # out and dweights are sums of products: the sums of their magnitudes set the rounding scale
    y_TKH = y.double()[slot_TK].abs()
    nonempty = y_TKH.numel() > 0
    out_TH = (y_TKH * weights_TK.double().abs().unsqueeze(-1)).sum(1)
    if residual:
        out_TH = out_TH + r_TH.double().abs()
    out_scale = float(out_TH.max()) if nonempty else 0.0
    dw_scale = float((y_TKH * dout_TH.double().abs().unsqueeze(1)).sum(-1).max()) if nonempty else 0.0
    scales = {"out": out_scale, "dweights": dw_scale}
    dtypes = {"dweights": weights_dtype}
    return [CheckResult(f"{label} {n}", max_error(o, f),
                        tolerance(max_error(e, f), f, dtypes.get(n, dtype), scales.get(n)))
            for n, o, f, e in zip(["out", "dy", "dweights", "dresidual"], ours, ref, eager)]


def routing_checks(tokens: int, k: int, experts: int, device: str, impl: str,
                   generator: torch.Generator | None = None) -> list[CheckResult]:
    """expert_routing(impl) against the reference's stable sort: integers, so the tolerance is 0 (error: the
    number of entries that differ)."""
    ids_TK, _ = random_routing(tokens, k, experts, device, generator)
    ours, ref = expert_routing(ids_TK, experts, impl=impl), routing_indices_reference(ids_TK, experts)
    label = f"routing_indices {impl} T={tokens} K={k} E={experts}"
    return [CheckResult(f"{label} {name}", float((a != b).sum()) if a.shape == b.shape else float(b.numel()), 0.0)
            for name, a, b in zip(ours._fields, ours, ref)]


def choice_errors(ids_TK: torch.Tensor, probs_TE: torch.Tensor, exact_TE: torch.Tensor) -> float:
    """Entries of a router's top-k choices that are wrong: those that differ from a stable descending sort of its
    own fp32 probabilities (the lowest expert first among equal values), plus those where the fp64
    probabilities' order differs between experts whose fp32 probabilities the router holds apart. Two logits
    an fp32 ulp apart round to one value in ``x - max`` when the max is over twice their size, and so to one
    probability: that tie is the router's to break (lowest expert first), as it is for torch.topk over the
    stock fp32 softmax. With N(0, 2) logits, E=64, K=8 the CPU kernel met 32 such ties among the top 9 in 8M
    tokens, 2 of which chose against the fp64 order: a verify run of 4099 tokens failed about once in 1000 when
    the fp64 order was the reference (once on an H100 host at 2c5e7de)."""
    k = ids_TK.shape[-1]
    own = torch.sort(probs_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    exact = torch.sort(exact_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen, exact_chosen = probs_TE.gather(-1, ids_TK), probs_TE.gather(-1, exact)
    tied = (chosen == exact_chosen) | (chosen.isnan() & exact_chosen.isnan())
    return float((ids_TK != own).sum() + ((ids_TK != exact) & ~tied).sum())


def router_checks(tokens: int, experts: int, k: int, dtype: torch.dtype, device: str, impl: str,
                  renormalize: bool = True, grads: str = "both",
                  generator: torch.Generator | None = None) -> list[CheckResult]:
    """router_topk(impl) vs fp64: the choices against a stable descending sort of the fp64 probabilities (the
    lowest expert first among equal values; tolerance 0, error: entries that differ), then probs, weights and
    the logits' gradient (from the weights', the probabilities' or both gradients) each with its 2x-PyTorch
    tolerance. fp64 and PyTorch (the fp32 softmax of the dtype's logits, autograd) go through the kernel's
    choices: 16-bit logits tie often, and torch.topk may break a tie the other way."""
    kw = {"device": device, "generator": generator}
    logits = (2.0 * torch.randn(tokens, experts, **kw)).to(dtype)
    dw = torch.randn(tokens, k, **kw)
    dp = torch.randn(tokens, experts, **kw)
    label = f"router_topk {impl} {str(dtype)[6:]} T={tokens} E={experts} K={k}{'' if renormalize else ' raw'} {grads}"

    def run(fn, cast, ids=None):
        xs = logits.detach().to(cast).requires_grad_()
        probs, weights, chosen = fn(xs, ids)
        loss = 0
        if grads in ("weights", "both"):
            loss = loss + (weights * dw.to(weights.dtype)).sum()
        if grads in ("probs", "both"):
            loss = loss + (probs * dp.to(probs.dtype)).sum()
        (dx,) = _grads((loss,), (xs,), (None,))
        return [probs.detach(), weights.detach(), dx], chosen

    def through(xs, ids):
        return router_topk_reference(xs, k, renormalize, ids_TK=ids)

    ours, ids = run(lambda xs, _: router_topk(xs, k, renormalize, impl=impl), dtype)
    ref, _ = run(through, torch.float64, ids)
    eager, _ = run(through, dtype, ids)
    results = [CheckResult(f"{label} ids", choice_errors(ids, ours[0], ref[0]), 0.0)]
    dtypes = [torch.float32, torch.float32, dtype]
    return results + [CheckResult(f"{label} {n}", max_error(o, f), tolerance(max_error(e, f), f, d))
                      for n, o, f, e, d in zip(["probs", "weights", "dlogits"], ours, ref, eager, dtypes)]


def skewed_counts(rows: int, experts: int, generator: torch.Generator | None = None, empty: int = 0) -> list[int]:
    """Group sizes summing to ``rows``: a Dirichlet draw (max/mean ~2-4 at 8 experts, as the e2e routing logs show),
    the last ``empty`` experts without rows."""
    used = experts - empty
    if used <= 0 or rows == 0:
        return [0] * experts
    g = torch._standard_gamma(torch.ones(used, dtype=torch.float64), generator=generator)
    sizes = (g / g.sum() * rows).floor().long()
    sizes[int(torch.argmax(sizes))] += rows - int(sizes.sum())
    return sizes.tolist() + [0] * empty


def expert_linear_checks(counts: list[int], in_features: int, out_features: int, dtype: torch.dtype, device: str,
                         impl: str, generator: torch.Generator | None = None,
                         row_bucket: int | str = "blocks") -> list[CheckResult]:
    """expert_linear_backward(impl, row_bucket) vs fp64: dx and dw, each within 2x the error of the same per-expert
    products by torch.mm in ``dtype`` (expert_linear_backward_reference). Experts without rows must get exact
    zeros."""
    experts, rows = len(counts), sum(counts)
    kw = {"device": device, "generator": generator}
    dy = torch.randn(rows, out_features, **kw).to(dtype)
    x = torch.randn(rows, in_features, **kw).to(dtype)
    w = (torch.randn(experts, out_features, in_features, **kw) / out_features ** 0.5).to(dtype)
    ours = expert_linear_backward(dy, x, w, counts, impl=impl, row_bucket=row_bucket)
    exact = expert_linear_backward_reference(dy.double(), x.double(), w.double(), counts)
    eager = expert_linear_backward_reference(dy, x, w, counts)
    label = (f"expert_linear_backward {impl} {str(dtype)[6:]} E={experts} P={rows} I={in_features} O={out_features} "
             f"row_bucket={row_bucket}")
    empty = [e for e, n in enumerate(counts) if n == 0]
    zeros = float(ours[1][empty].abs().sum()) if empty else 0.0
    return [CheckResult(f"{label} {n}", max_error(o, f), tolerance(max_error(e, f), f, dtype))
            for n, o, f, e in zip(["dx", "dw"], ours, exact, eager)] + [
        CheckResult(f"{label} dw_of_empty_experts", zeros, 0.0)]


def checks_for(builder_name: str, device: str) -> list[Callable[[], CheckResult]]:
    """The quick checks ``loongforge_report --verify`` runs for one compiled op, one line each."""
    impl = device
    checks: list[Callable[[], CheckResult]] = []
    if builder_name.startswith("lf_fused_rmsnorm"):
        for dtype in (torch.float32, torch.bfloat16):
            checks.append(lambda d=dtype: _merge(rmsnorm_checks(257, 4096, d, device, impl)))
            checks.append(lambda d=dtype: _merge(rmsnorm_checks(33, 2880, d, device, impl, residual=True)))
            checks.append(lambda d=dtype: _merge(rmsnorm_checks(33, 2048, d, device, impl, keep_input=True)))
    elif builder_name.startswith("lf_fused_swiglu"):
        for dtype in (torch.float32, torch.bfloat16):
            checks.append(lambda d=dtype: _merge(swiglu_checks(129, 1408, d, device, impl, p=0.0)))
            checks.append(lambda d=dtype: _merge(swiglu_checks(65, 1000, d, device, impl, p=0.1)))
    elif builder_name.startswith("lf_moe_dispatch"):
        for dtype in (torch.float32, torch.bfloat16):
            checks.append(lambda d=dtype: _merge(moe_permute_checks(129, 2880, 8, 64, d, device, impl)))
            checks.append(lambda d=dtype: _merge(moe_unpermute_checks(129, 2880, 8, 64, d, device, impl)))
            checks.append(lambda d=dtype: _merge(moe_unpermute_checks(65, 2048, 2, 8, d, device, impl, residual=True)))
        checks.append(lambda: _merge(routing_checks(3001, 8, 64, device, impl)))  # 3 rank blocks, idle experts
        for dtype in (torch.float32, torch.bfloat16):
            checks.append(lambda d=dtype: _merge(router_checks(4099, 64, 8, d, device, impl)))
        for dtype in (torch.float32, torch.bfloat16):  # skewed groups, one expert without rows
            checks.append(lambda d=dtype: _merge(expert_linear_checks(
                skewed_counts(4096, 8, torch.Generator().manual_seed(0), empty=1), 512, 1024, d, device, impl)))
    elif builder_name.startswith("lf_cross_entropy"):
        for dtype in (torch.float32, torch.bfloat16):
            checks.append(lambda d=dtype: _merge(cross_entropy_checks(257, 32000, d, device, impl)))
            checks.append(lambda d=dtype: _merge(cross_entropy_checks(33, 32003, d, device, impl)))
        # bf16 logits (the default of linear_cross_entropy in a bf16 model): the vector path and the scalar one
        for vocab in (32000, 32003):
            checks.append(lambda v=vocab: _merge(cross_entropy_checks(257, v, torch.bfloat16, device, impl,
                                                                      logits_dtype=torch.bfloat16)))
    elif builder_name.startswith("lf_fused_adamw_clip"):
        from ds_loongforge.ops.adamw import verify_checks  # the optimizer step's checks live beside it

        checks.extend(verify_checks(builder_name, device))
    return checks


def _merge(results: list[CheckResult]) -> CheckResult:
    """One line per check group: the result with the largest error/tolerance ratio."""
    worst = max(results, key=lambda r: r.error / r.tol if r.tol > 0 else (0.0 if r.error == 0 else float("inf")))
    base = worst.name.rsplit(" ", 1)[0]
    return CheckResult(f"{base} [worst: {worst.name.rsplit(' ', 1)[1]}]", worst.error, worst.tol)


def qkv_checks(tokens: int, hidden: int, q_out: int, kv_out: int, dtype: torch.dtype,
               device: str) -> list[CheckResult]:
    """fused_kernels.qkv (ds_loongforge.modules.qkv) against three nn.Linear in fp64: q, k, v, the input gradient
    and each weight's gradient within 2x PyTorch's own error in ``dtype``: the larger of the three Linears' and of
    one F.linear over the concatenated weights (the product the fused path computes, written out here). The one
    wide GEMM gets another cuBLAS kernel than the narrow ones, which sums in another order: in fp32 on the H200 its
    worst k element's error was 0.82-1.14x the tolerance the narrow GEMMs alone set (4 draws at c124be0; 1.00x in
    an earlier log), so that check failed by chance."""
    from torch import nn

    from ds_loongforge.modules.qkv import fuse_qkv

    class Projections(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(hidden, q_out, device=device, dtype=dtype)
            self.k_proj = nn.Linear(hidden, kv_out, device=device, dtype=dtype)
            self.v_proj = nn.Linear(hidden, kv_out, device=device, dtype=dtype)

        def forward(self, x):
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    stock = Projections()
    fused = Projections().to(dtype)
    fused.load_state_dict(stock.state_dict())
    fuse_qkv(fused)
    exact = Projections().double()
    exact.load_state_dict(stock.state_dict())
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    grads = [torch.randn(tokens, n, device=device, dtype=dtype) for n in (q_out, kv_out, kv_out)]

    def run(module, cast):
        x_in = x.to(cast).requires_grad_()
        outs = module(x_in)
        params = list(module.parameters())
        return [*outs, *_grads(outs, [x_in, *params], [g.to(cast) for g in grads])]

    class OneGemm(Projections):
        def forward(self, x):
            linears = (self.q_proj, self.k_proj, self.v_proj)
            y = nn.functional.linear(x, torch.cat([lin.weight for lin in linears]),
                                     torch.cat([lin.bias for lin in linears]))
            return y.split([q_out, kv_out, kv_out], dim=-1)

    one_gemm = OneGemm()
    one_gemm.load_state_dict(stock.state_dict())
    names = ["q", "k", "v", "dx", "dWq", "dbq", "dWk", "dbk", "dWv", "dbv"]
    ours, eager, wide, ref = run(fused, dtype), run(stock, dtype), run(one_gemm, dtype), run(exact, torch.float64)
    label = f"fused q/k/v {device} {str(dtype)[6:]} T={tokens} H={hidden} Q={q_out} KV={kv_out}"
    return [CheckResult(f"{label} {n}", max_error(o, r), tolerance(max(max_error(e, r), max_error(w, r)), r, dtype))
            for n, o, e, w, r in zip(names, ours, eager, wide, ref)]


def row_strided_rope_checks(batch: int, seq: int, heads_q: int, heads_k: int, head_dim: int, dtype: torch.dtype,
                            fused: Callable, device: str = "cuda") -> list[CheckResult]:
    """The fused RoPE of fused_kernels.rope (``fused``: what ds_loongforge.integrations.rope.load_liger chose) on
    column slices of one [B, S, N] q/k/v product, as the fused projection hands them over, against transformers'
    formula in fp64: rotated q and k, and the gradient of the product, within 2x that formula's error in ``dtype``.
    Liger's is a Triton kernel: CUDA, or the CPU under Triton's interpreter (TRITON_INTERPRET=1)."""
    q_cols, kv_cols = heads_q * head_dim, heads_k * head_dim
    angle = torch.rand(1, seq, head_dim // 2, device=device, dtype=torch.float64) * 6.0
    cos64, sin64 = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    leaf = torch.randn(batch, seq, q_cols + 2 * kv_cols, device=device, dtype=dtype)
    dq = torch.randn(batch, heads_q, seq, head_dim, device=device, dtype=dtype)
    dk = torch.randn(batch, heads_k, seq, head_dim, device=device, dtype=dtype)

    def slices(y):
        q, k, _ = y.split([q_cols, kv_cols, kv_cols], dim=-1)
        return (q.view(batch, seq, heads_q, head_dim).transpose(1, 2),
                k.view(batch, seq, heads_k, head_dim).transpose(1, 2))

    def run(function, cast):
        x = leaf.to(cast).requires_grad_()
        q_out, k_out = function(*slices(x * 1), cos64.to(cast), sin64.to(cast))
        (grad,) = _grads((q_out, k_out), [x], [dq.to(cast, copy=True), dk.to(cast, copy=True)])
        return q_out.detach(), k_out.detach(), grad

    from ds_loongforge.integrations.rope import reference_rope

    ours, eager, ref = run(fused, dtype), run(reference_rope, dtype), run(reference_rope, torch.float64)
    label = (f"fused RoPE on q/k/v slices {device} {str(dtype)[6:]} B={batch} S={seq} Hq={heads_q} Hk={heads_k} "
             f"D={head_dim}")
    return [CheckResult(f"{label} {n}", max_error(o, r), tolerance(max_error(e, r), r, dtype))
            for n, o, e, r in zip(("q", "k", "dproduct"), ours, eager, ref)]


def integration_checks(device: str) -> list[tuple[str, Callable[[], CheckResult] | str]]:
    """(name, check) of the pieces ``inject`` adds that are not ops of their own, for ``--verify``; a str in place
    of a check says why it does not run here."""
    checks: list[tuple[str, Callable[[], CheckResult] | str]] = []
    for dtype in (torch.float32, torch.bfloat16):
        checks.append(("fused_kernels.qkv", lambda d=dtype: _merge(qkv_checks(257, 512, 512, 128, d, device))))
    from ds_loongforge.integrations import rope

    fused, label = rope.load_liger()
    if fused is None:
        checks.append(("fused_kernels.rope", label))
    elif device != "cuda":
        checks.append(("fused_kernels.rope", f"{label}: not run, no CUDA device visible (a Triton kernel)"))
    else:
        for dtype in (torch.float32, torch.bfloat16):
            checks.append(("fused_kernels.rope",
                           lambda d=dtype: _merge(row_strided_rope_checks(2, 77, 8, 2, 128, d, fused))))
    return checks
