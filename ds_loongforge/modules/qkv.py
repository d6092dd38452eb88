"""The q, k and v projections of an attention computed with one GEMM, keeping its three nn.Linear modules.

Legend (shape suffixes): T tokens (any leading dims), H hidden, Q = q_proj.out_features, KV = k/v out_features,
N = Q + 2 KV.

transformers' attention calls ``self.q_proj(x)``, ``self.k_proj(x)`` and ``self.v_proj(x)`` on one input: three
GEMMs, two of them narrow (KV = H / 4 at the e2e mixtral shape, where the H200 ran them at ~400 TFLOP/s against
~700 for the wide one), each reading x again; backward adds the three input gradients with two bf16 adds.
``fuse_qkv(attention)`` re-classes the three Linears as FusedQKVLinear, which share one QKVProjection:

* The first of them called on an input x computes ``x @ cat(Wq, Wk, Wv)^T`` (one GEMM, the weights concatenated
  per call: 2 N H bytes) and returns its slice; the other two, called on the same tensor object at the same
  version, return theirs without computing. Backward is autograd's: one input-gradient GEMM (K = N, one rounding
  where stock rounds three products and two sums), one weight-gradient GEMM, whose [N, H] result the
  concatenation splits into each weight's gradient (views, no copy).
* The math is the stock Linears': every output element is the same dot product. Any other call (another
  input, x modified in place in between, a second call of the same projection, mixed dtypes or devices,
  ZeRO-3 parameters, which DeepSpeed gathers per module, a call under torch.compile) runs that Linear on its own,
  as stock does. So does every call while one of the three is no longer the attention's own attribute (a wrapper
  such as PEFT's ``ParamWrapper`` stands in its place and changes its weight only during its own call) or has
  forward pre-hooks (which may change a weight before that Linear's call, after the fused product was taken).
* Modules, Parameters, names and state-dict keys stay as they were; nothing is copied at inject.

The outputs are column slices of the [T, N] product (views, row stride N): the attention's ``view`` +
``transpose`` take them as they take a contiguous tensor; the fused RoPE (integrations.rope.RowStridedRope) rotates
them in place, and a kernel that needs contiguous q or k copies them, as it would any strided input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class QKVProjection:
    """The shared state of one attention's three FusedQKVLinear: who they are, and the slices of the last fused
    product not yet returned. Not a Module (it would register the Linears twice); held in each Linear's
    ``__dict__``."""

    def __init__(self, linears: tuple[nn.Linear, nn.Linear, nn.Linear], attention: nn.Module | None = None):
        self.linears = linears
        # the attention whose attributes the three must still be (a reference cycle through the Linears'
        # __dict__, which deepcopy and pickle keep consistent)
        self.attention = attention
        self._pending: tuple[torch.Tensor, int, list[torch.Tensor | None]] | None = None  # (x, x._version, slices)
        self.fused_calls = 0  # products computed for all three at once (what tests count)

    def project(self, linear: nn.Linear, x_TH: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # the check that x was not modified in place between the three calls reads its version counter, which
            # torch.compile cannot trace (a data-dependent graph break at each call): each Linear on its own
            return F.linear(x_TH, linear.weight, linear.bias)
        role = self.linears.index(linear)
        pending = self._pending
        if pending is not None:
            x_pending, version, slices = pending
            if x_pending is x_TH and x_TH._version == version and slices[role] is not None:
                out, slices[role] = slices[role], None
                if all(s is None for s in slices):
                    self._pending = None
                return out
        self._pending = None
        weights = [lin.weight for lin in self.linears]
        if not self._fusable(x_TH, weights):
            return F.linear(x_TH, linear.weight, linear.bias)
        biases = [lin.bias for lin in self.linears]
        bias_N = None if biases[0] is None else torch.cat(biases)
        y_TN = F.linear(x_TH, torch.cat(weights), bias_N)
        slices: list[torch.Tensor | None] = list(y_TN.split([w.shape[0] for w in weights], dim=-1))
        out, slices[role] = slices[role], None
        self._pending = (x_TH, x_TH._version, slices)
        self.fused_calls += 1
        return out

    def _fusable(self, x_TH: torch.Tensor, weights: list[torch.Tensor]) -> bool:
        first = weights[0]
        if any(hasattr(w, "ds_id") for w in weights):  # ZeRO-3: each weight is gathered by its own module's hook
            return False
        attention = self.attention
        if attention is not None and any(getattr(attention, name, None) is not linear
                                         for name, linear in zip(PROJECTIONS, self.linears)):
            return False  # wrapped (e.g. PEFT's ParamWrapper): the wrapper's weight holds only during its call
        if any(linear._forward_pre_hooks for linear in self.linears):
            return False  # a pre-hook may change a weight at its own Linear's call, after the fused product
        if any(w.dtype != first.dtype or w.device != first.device for w in weights[1:]):
            return False
        return x_TH.device == first.device  # (biases all or none: checked by fuse_qkv)


class FusedQKVLinear(nn.Linear):
    """An attention's q_proj, k_proj or v_proj whose forward goes through its QKVProjection (see the module
    docstring). Its Parameters and state-dict keys are the nn.Linear's."""

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.__dict__["_lf_qkv"].project(self, x_TH)


def qkv_problem(attention: nn.Module) -> str | None:
    """Why ``attention``'s projections cannot be fused, or None."""
    linears = [getattr(attention, name, None) for name in PROJECTIONS]
    for name, linear in zip(PROJECTIONS, linears):
        if type(linear) not in (nn.Linear, FusedQKVLinear):
            return (f"`{name}` is {type(linear).__name__}, not an nn.Linear (q_proj, k_proj and v_proj must be "
                    "plain Linears on one input)")
    if len({linear.in_features for linear in linears}) != 1:
        return ("q_proj, k_proj and v_proj have different in_features "
                f"({', '.join(str(linear.in_features) for linear in linears)}): not one input")
    if len({linear.bias is None for linear in linears}) != 1:
        return "some of q_proj, k_proj and v_proj have a bias and some do not"
    clip = getattr(getattr(attention, "config", None), "clip_qkv", None)
    if clip is not None:  # OLMo/OLMoE: value_states.clamp_(...) on the projections' outputs
        return (f"the attention clamps its q/k/v projections' outputs in place (clip_qkv={clip}), which autograd "
                "refuses on the slices of one fused product")
    return None


def fuse_qkv(attention: nn.Module) -> QKVProjection:
    """Re-class ``attention.q_proj/k_proj/v_proj`` as FusedQKVLinear sharing one QKVProjection (idempotent)."""
    problem = qkv_problem(attention)
    if problem:
        raise ValueError(f"fuse_qkv: {type(attention).__name__}: {problem}")
    linears = tuple(getattr(attention, name) for name in PROJECTIONS)
    group = linears[0].__dict__.get("_lf_qkv")
    if group is not None and group.linears == linears:
        return group
    group = QKVProjection(linears, attention)
    for linear in linears:
        linear.__class__ = FusedQKVLinear
        linear.__dict__["_lf_qkv"] = group
    return group
