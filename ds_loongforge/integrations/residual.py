"""A decoder layer's residual adds fused into its RMSNorms and its MoE block (``fused_kernels.residual_add``).

Every supported family's decoder layer forward reads (transformers 5.x)::

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(...)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states

With both norms FusedRMSNorm, the layer is re-classed as ``LoongForge<Layer>``, whose forward is the family's own
source with three of its steps rewritten (each replacing two or three statements):

    hidden_states, residual = self.input_layernorm(hidden_states, keep_input=True)
    hidden_states, _ = self.self_attn(...)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    hidden_states = (self.mlp(hidden_states, residual=residual) if getattr(self.mlp, "loongforge_adds_residual", False)
                     else residual + self.mlp(hidden_states))

The add after the attention happens inside the post-attention norm's kernel (``h = x + residual`` in x's dtype,
the same rounding as stock's ``residual + hidden_states``), and in backward both places where the residual stream
forks (the layer input, read by the input norm and the residual add; the post-attention sum, read by the norm and
the MLP's residual add) get their two gradients added by the norm's backward kernel instead of by autograd with a
separate bf16 add; the backward adds the two gradients in fp32 before one rounding where stock rounds each and
their sum. The MLP's add happens inside ExpertMaskedMoE's combine kernel (``residual + sum_j w_j y_j`` in fp32,
one rounding where stock rounds the MoE output and then the sum); any other MLP (a dense one, a MoE block with
shared experts) keeps stock's add. Per MoE layer that is two add kernels fewer forward and two fewer backward.

The rewrite is of the installed transformers' own source (``inspect.getsource``), checked statement by statement
against the pattern above and compiled in its module's globals with its decorators, so whatever arguments a
transformers release passes to the attention are passed the same way. A forward that does not match (another
release, a custom layer) is left alone and reported with the reason; no layer is changed unless its two norms are
FusedRMSNorm.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Callable

from torch import nn

from ds_loongforge.modules.norm_mlp import FusedRMSNorm

KIND_RESIDUAL = "residual adds fused into RMSNorm"
FUSED_ATTR = "_loongforge_fused_norms"  # on a re-classed layer class: (input norm, post-attention norm) names
ADDS_RESIDUAL = "loongforge_adds_residual"  # on an MLP/MoE block whose forward takes the residual to add

_NORM_CALL = re.compile(r"hidden_states = self\.(\w+)\(hidden_states\)")
_KEEP = "residual = hidden_states"
_ADD = "hidden_states = residual + hidden_states"


@functools.lru_cache(maxsize=None)
def fused_forward(layer_cls: type) -> tuple[Callable | None, tuple[str, str] | None, str | None]:
    """(forward, (input norm, post-attention norm), None) for a decoder layer class whose forward matches the
    pattern of the module docstring; (None, None, why not) otherwise."""
    raw = inspect.unwrap(layer_cls.forward)
    if raw.__code__.co_freevars:
        return None, None, f"its forward uses closure variables ({', '.join(raw.__code__.co_freevars)})"
    try:
        source = textwrap.dedent(inspect.getsource(raw))
        first_line = inspect.getsourcelines(raw)[1]
        filename = inspect.getsourcefile(raw) or "<unknown>"
    except (OSError, TypeError) as err:
        return None, None, f"the source of its forward is not available ({err})"
    try:
        tree = ast.parse(source)
    except SyntaxError as err:  # e.g. a forward assigned from a lambda: getsource returns the whole statement
        return None, None, f"the source of its forward does not parse on its own ({err})"
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        return None, None, "its forward is not a plain function definition"
    body = function.body
    text = [ast.unparse(statement) for statement in body]

    start = next((i for i in range(len(text) - 1) if text[i] == _KEEP and _NORM_CALL.fullmatch(text[i + 1])), None)
    if start is None:
        return None, None, f"no `{_KEEP}` followed by `hidden_states = self.<norm>(hidden_states)` in its forward"
    input_norm = _NORM_CALL.fullmatch(text[start + 1]).group(1)
    add = next((j for j in range(start + 2, len(text) - 2) if text[j] == _ADD), None)
    if add is None or text[add + 1] != _KEEP or not _NORM_CALL.fullmatch(text[add + 2]):
        return None, None, (f"after the input norm, no `{_ADD}` / `{_KEEP}` / `hidden_states = "
                            "self.<norm>(hidden_states)` in its forward")
    post_norm = _NORM_CALL.fullmatch(text[add + 2]).group(1)
    between = body[start + 2:add]
    if any(isinstance(node, ast.Name) and node.id == "residual" for statement in between for node in ast.walk(statement)):
        return None, None, "its forward reads `residual` between the input norm and the residual add"
    if input_norm == post_norm:
        return None, None, f"both norm calls use `self.{input_norm}`"

    def statement(src: str, at: ast.stmt) -> ast.stmt:
        new = ast.parse(src).body[0]
        for node in ast.walk(new):
            ast.copy_location(node, at)
        return new

    keep_input = statement(f"hidden_states, residual = self.{input_norm}(hidden_states, keep_input=True)",
                           body[start + 1])
    add_norm = statement(f"hidden_states, residual = self.{post_norm}(hidden_states, residual)", body[add + 2])
    rest = body[add + 3:]
    mlp = _NORM_CALL.fullmatch(text[add + 3]) if add + 4 < len(text) and text[add + 4] == _ADD else None
    if mlp is not None:  # the MLP's add: inside the block when it takes the residual (ExpertMaskedMoE), else stock's
        name = mlp.group(1)
        rest = [statement(f"hidden_states = self.{name}(hidden_states, residual=residual) if getattr(self.{name}, "
                          f"'{ADDS_RESIDUAL}', False) else residual + self.{name}(hidden_states)", body[add + 3]),
                *body[add + 5:]]
    function.body = [*body[:start], keep_input, *between, add_norm, *rest]
    ast.increment_lineno(tree, first_line - 1)
    namespace: dict = {}
    try:  # the decorators are evaluated again, in the module's globals: one defined elsewhere is a NameError
        exec(compile(tree, filename, "exec"), raw.__globals__, namespace)  # noqa: S102 - transformers' own source
    except (NameError, AttributeError, TypeError) as err:
        return None, None, f"its rewritten forward does not build in its module ({type(err).__name__}: {err})"
    return namespace[function.name], (input_norm, post_norm), None


def residual_problem(layer: nn.Module) -> str | None:
    """Why ``layer``'s residual adds cannot be fused into its norms, or None."""
    forward, norms, why = fused_forward(type(layer))
    if forward is None:
        return f"{why} (transformers' forward is kept)"
    for name in norms:
        norm = getattr(layer, name, None)
        if not isinstance(norm, FusedRMSNorm):
            return (f"`{name}` is {type(norm).__name__}, not FusedRMSNorm (the fused add is a FusedRMSNorm kernel; "
                    "fused_kernels.rmsnorm must be on)")
    return None


def fuse_residual_adds(layer: nn.Module, make_class: Callable[[str, tuple[type, ...], str, dict], type]) -> bool:
    """Re-class ``layer`` so that its forward runs its residual adds inside its norms (and inside its MLP when that
    takes the residual); False when it already does. ``make_class(name, bases, doc, namespace)`` builds (once per name) the re-classed type."""
    cls = type(layer)
    if FUSED_ATTR in cls.__dict__:
        return False
    problem = residual_problem(layer)
    if problem:
        raise ValueError(f"fuse_residual_adds: {cls.__name__}: {problem}")
    forward, norms, _ = fused_forward(cls)
    layer.__class__ = make_class(
        f"LoongForge{cls.__name__}", (cls,),
        f"{cls.__name__} whose attention residual add runs inside `{norms[1]}` and whose residual gradients are "
        f"added by the backward kernels of `{norms[0]}` and `{norms[1]}` "
        "(ds_loongforge.integrations.residual).",
        {"forward": forward, FUSED_ATTR: norms})
    return True
