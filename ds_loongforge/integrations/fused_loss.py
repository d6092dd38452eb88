"""The fused linear cross-entropy in a transformers causal LM: ``install_fused_loss(model)``.

A training forward of ``<Family>ForCausalLM`` with ``labels`` computes ``logits = lm_head(hidden)`` [B, S, V] and
``ForCausalLMLoss(logits, labels)`` (fp32 copy, log-softmax, nll; their gradients in backward). After
``install_fused_loss`` the same call computes the loss with ``ds_loongforge.ops.linear_cross_entropy`` straight
from the LM head's input, chunk by chunk, and never builds the logits:

* ``model.lm_head`` (an ``nn.Linear`` without bias) is re-classed as ``_DeferredLMHead``, a subclass of
  ``nn.Linear``: same Parameter, same state-dict key and shape, and outside a fused call the same forward.
* ``model.forward`` (on the instance) is wrapped. When ``labels`` is given, grad mode is on and the model is
  training, the wrapper (a) tells the head to keep its input and return an empty placeholder instead of logits,
  (b) runs the model's own forward with ``labels=None`` (so transformers computes no loss on the placeholder; the
  MoE load-balancing loss is still computed when ``output_router_logits`` is on), (c) computes the loss as
  transformers' ``ForCausalLMLoss`` would: labels shifted left by one with ``ignore_index`` padding (or the
  ``shift_labels`` kwarg as given), mean over non-ignored labels, or sum / ``num_items_in_batch`` when that kwarg
  is passed (the HF Trainer passes it), (d) adds ``router_aux_loss_coef * aux_loss`` where the family's forward
  does, and (e) returns the family's output with ``loss`` set and ``logits=None``.
* Any other call (no labels, eval mode, no grad: evaluation and generation; ``return_dict=False``, whose tuple
  would lose the logits' position) runs the original forward unchanged.
  A training call that passes ``logits_to_keep`` other than 0, a model whose ``loss_function`` is not
  transformers' ``ForCausalLMLoss``, or an LM head replaced since install whose weight ZeRO-3 partitioned (the
  new weight is then registered for the next call) also runs the original (logged once per reason).
* ZeRO-3: the head's weight is registered as an external parameter of the model (DeepSpeed's
  ``register_external_parameter``), so ZeRO-3 gathers it for the model's whole forward and backward, where the
  fused loss reads it, and not for the head's own forward alone.

Which models: the ``<Family>ForCausalLM`` classes of the preset families whose ``forward`` has transformers'
shape, checked on its source (ast): ``hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)``,
``logits = self.lm_head(hidden_states)``, then ``loss = self.loss_function(logits, labels, vocab_size, **kwargs)``
with nothing else assigned to ``logits`` (no soft-capping or scaling) and, for the MoE families, exactly
``loss += self.router_aux_loss_coef * aux_loss.to(loss.device)``. A class that differs is not patched, and
``install_fused_loss`` returns the reason.

A training call that would have built transformers' DynamicCache (use_cache on, no cache passed) gets one whose
layers keep nothing (``_training_cache``): the same mask and attention, without copying every layer's keys and
values into a cache the loss never reads; the output's cache is then None.

The effect a caller sees: a training forward with labels returns ``logits=None`` (and no cache, as above). Code
that needs the logits of a training step must call the model without ``labels`` (and compute its own loss), or
switch ``fused_kernels.linear_cross_entropy`` off.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import logging
import textwrap
import types

import torch
import torch.nn.functional as F
from torch import nn

from ds_loongforge.ops.linear_cross_entropy import linear_cross_entropy

logger = logging.getLogger("ds_loongforge")

KIND_FUSED_LOSS = "fused linear cross-entropy"
_MARK = "__loongforge_fused_loss__"        # on the wrapper function
_INNER = "_loongforge_inner_forward"       # instance attribute: a forward that was on the instance before ours
_DEFAULT_IGNORE_INDEX = -100
_warned: set[str] = set()


class _DeferredLMHead(nn.Linear):
    """``nn.Linear`` that, while ``_loongforge_defer`` is set, keeps its input in ``_loongforge_hidden`` and returns
    an empty [..., 0] placeholder instead of computing the logits. Otherwise exactly ``nn.Linear``."""

    _loongforge_defer = False
    _loongforge_hidden = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._loongforge_defer:
            return super().forward(input)
        self._loongforge_hidden = input
        return input.new_empty((*input.shape[:-1], 0))


@dataclasses.dataclass(frozen=True)
class _ForwardSpec:
    positional: tuple[str, ...]  # parameter names after self that can be passed positionally
    adds_aux: bool               # the forward adds router_aux_loss_coef * aux_loss to the loss
    cache_arg: str | None = None  # its KV-cache parameter: "cache" (transformers >= 5.24), "past_key_values"


def uses_fused_loss(model: nn.Module) -> bool:
    """Whether ``install_fused_loss`` is in effect on ``model`` (its forward wrapper and deferred LM head)."""
    if not isinstance(getattr(model, "lm_head", None), _DeferredLMHead):
        return False
    forward = model.__dict__.get("forward")
    for _ in range(16):  # through wrappers added after ours (accelerate's autocast / fp32 conversion)
        if forward is None:
            return False
        forward = getattr(forward, "__func__", forward)
        if getattr(forward, _MARK, False):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def install_fused_loss(model: nn.Module) -> str | None:
    """Route the training loss of a transformers causal LM through ``linear_cross_entropy``.

    Returns None when installed (or already installed), else the reason it was not (the model is unchanged)."""
    if not uses_fused_loss(model):
        cls = type(model)
        name = cls.__name__
        problem = _model_problem(model)
        if problem:
            return f"{name}: {problem}"
        spec = _forward_spec(cls)
        if isinstance(spec, str):
            return f"{name}: {spec}"
        if spec.adds_aux and not isinstance(getattr(model, "router_aux_loss_coef", None), (int, float)):
            return (f"{name}: its forward adds router_aux_loss_coef * aux_loss but the model has no "
                    "router_aux_loss_coef")

        model.lm_head.__class__ = _DeferredLMHead
        previous = model.__dict__.get("forward")
        if previous is not None:
            setattr(model, _INNER, previous)
        model.forward = types.MethodType(_make_forward(cls, spec), model)
    if hasattr(model.lm_head.weight, "ds_id"):  # built under zero.Init; else deepspeed.initialize's ZeRO-3 registers
        _register_head_weight(model)
    return None


_REGISTERED_HEAD = "_loongforge_registered_head"  # id of the head weight _register_head_weight registered


def register_for_zero3(model: nn.Module) -> None:
    """Before ZeRO-3 partitions ``model`` (``deepspeed.initialize`` at stage 3 with the block calls this): have it
    gather the fused loss's head weight for the whole forward and backward. Only then, and for a model built under
    zero.Init: the registration puts a bound method on the model that pickle cannot save."""
    if uses_fused_loss(model):
        _register_head_weight(model)


def _head_registered(model: nn.Module) -> bool:
    return id(model.lm_head.weight) in getattr(model, "_external_params", {})


def _register_head_weight(model: nn.Module) -> None:
    """Have ZeRO-3 gather ``lm_head.weight`` for ``model``'s whole forward and backward: the fused loss reads it
    in the model's forward, after the head's own forward (where ZeRO-3 would gather it for the head alone) has
    returned. DeepSpeed's ``register_external_parameter`` is its API for a parameter used outside its module; the
    Parameter object is registered, so one registered before ZeRO-3 partitions it in place (deepspeed.initialize)
    stays registered. Idempotent. Called only where ZeRO-3 runs, so DeepSpeed is imported; a model whose head
    weight ZeRO-3 partitioned unregistered (inject outside deepspeed.initialize, then ZeRO-3) registers at its
    first call (``_call_problem``, which runs that call unfused)."""
    if _head_registered(model):
        return
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    registered = getattr(model, "_external_params", {})
    stale = registered.get(model.__dict__.get(_REGISTERED_HEAD))  # a replaced head's: ZeRO-3 would keep gathering it
    if stale is not None:
        del registered[id(stale)]
    register_external_parameter(model, model.lm_head.weight)
    model.__dict__[_REGISTERED_HEAD] = id(model.lm_head.weight)


def _model_problem(model: nn.Module) -> str | None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    from ds_loongforge.integrations.presets import PRESETS

    cls = type(model)
    families = {p.modeling_module: p.name for p in PRESETS}
    if cls.__module__ not in families:
        return (f"no preset family defines this class (fused linear cross-entropy covers the CausalLM classes of "
                f"{', '.join(sorted(families.values()))})")
    if not cls.__name__.endswith("ForCausalLM"):
        return "not a ...ForCausalLM class (the fused loss replaces the causal-LM loss only)"
    head = getattr(model, "lm_head", None)
    if type(head) not in (nn.Linear, _DeferredLMHead):
        return f"lm_head is {type(head).__name__}, not a plain nn.Linear (e.g. wrapped by PEFT or quantized)"
    if head.bias is not None:
        return "lm_head has a bias (linear_cross_entropy takes a bias-free weight)"
    if _is_dtensor(head.weight):
        return "lm_head.weight is a DTensor (tensor parallel): the fused loss needs the whole vocabulary locally"
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab != head.out_features:
        return (f"lm_head has {head.out_features} outputs but config.vocab_size is {vocab}; ForCausalLMLoss views "
                f"the logits as [-1, vocab_size]")
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return (f"its loss_function is {getattr(model.loss_function, '__name__', model.loss_function)!r}, not "
                f"transformers' ForCausalLMLoss")
    return None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)


@functools.lru_cache(maxsize=None)
def _forward_spec(cls: type) -> _ForwardSpec | str:
    """The ``_ForwardSpec`` of ``cls.forward`` when its source has transformers' causal-LM shape, else why not."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as err:
        return f"the source of {cls.__name__}.forward cannot be read to check its loss ({err})"
    func = tree.body[0] if tree.body else None
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{cls.__name__}.forward is not a plain function"
    where = f"{cls.__qualname__}.forward ({inspect.getmodule(cls).__name__})"
    decorators = {ast.unparse(d).split("(")[0].rpartition(".")[2] for d in func.decorator_list}
    if "can_return_tuple" not in decorators:
        return f"{where} is not decorated with can_return_tuple (return_dict handling differs)"

    logits_assigns, loss_calls, head_calls, loss_other, aux_adds = [], [], [], [], []
    for node in ast.walk(func):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if "logits" in names:
                logits_assigns.append(node)
            if "loss" in names:
                text = ast.unparse(node)
                if text == "loss = None":
                    pass
                elif isinstance(node, ast.Assign) and _is_loss_call(node.value):
                    loss_calls.append(node)
                elif text == "loss += self.router_aux_loss_coef * aux_loss.to(loss.device)":
                    aux_adds.append(node)
                else:
                    loss_other.append(text)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.lm_head":
            head_calls.append(node)
        if isinstance(node, (ast.Name, ast.Attribute)) and "softcap" in ast.unparse(node).lower():
            return f"{where} soft-caps the logits"
    if len(head_calls) != 1 or len(logits_assigns) != 1 or logits_assigns[0].value is not head_calls[0]:
        return f"{where} does not compute `logits = self.lm_head(...)` exactly once (the logits are transformed)"
    head_arg = ast.unparse(head_calls[0].args[0]) if len(head_calls[0].args) == 1 else ""
    if head_arg not in ("hidden_states", "hidden_states[:, slice_indices, :]"):
        return f"{where} calls lm_head on {head_arg or 'several arguments'}, not on the sliced hidden states"
    if head_arg == "hidden_states" and "slice_logits_to_keep(hidden_states, logits_to_keep)" not in source:
        return f"{where} does not slice the hidden states by logits_to_keep before lm_head"
    if len(loss_calls) != 1 or loss_other:
        return (f"{where} does not compute the loss as `self.loss_function(logits, labels, vocab_size, **kwargs)` "
                f"alone ({'; '.join(loss_other) or 'no such call'})")
    if len(aux_adds) > 1:
        return f"{where} adds the router aux loss more than once"

    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    positional = tuple(p.name for p in params
                       if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    if "labels" not in positional:
        return f"{where} has no labels parameter"
    names = {p.name for p in params}
    cache_arg = next((n for n in ("cache", "past_key_values") if n in names), None)
    return _ForwardSpec(positional=positional, adds_aux=bool(aux_adds), cache_arg=cache_arg)


@functools.cache
def _unstored_layer_class() -> tuple[type, type]:
    from transformers.cache_utils import DynamicLayer

    class UnstoredKVLayer(DynamicLayer):
        """A layer of the KV cache a training call gets: it returns this call's keys and values and keeps none,
        so its length stays 0 (what an empty DynamicLayer reports before and during the one forward)."""

        def update(self, key_states, value_states, *args, **kwargs):
            return key_states, value_states

    return DynamicLayer, UnstoredKVLayer


def _training_cache(model: nn.Module, spec: _ForwardSpec, kwargs: dict):
    """The cache to pass to a fused training call in place of the DynamicCache transformers would build, or None
    to leave the call as it is.

    transformers (5.17-5.24) builds a DynamicCache in a training forward whenever use_cache is on (the config's
    default), and its mask code needs one: without a cache it reads a device value in every forward
    (find_packed_sequence_indices' ``.all()`` when no attention mask is given, the SDPA mask's
    ``padding_mask.all()`` when one is; on the H200 that made the e2e mixtral forward wait 29 ms per step). But
    filling it costs a copy of every layer's keys and values (``torch.cat`` onto an empty tensor: 16 copies,
    ~0.9 ms per e2e step) that the loss never reads. So where transformers would build one, the call gets the
    same DynamicCache with its layers re-classed to keep nothing: the mask, positions and attention are the ones
    an empty cache gives. Only where every layer is a plain DynamicLayer (no sliding window or other kinds), the
    caller passed no cache of its own, and gradient checkpointing does not turn the cache off."""
    if spec.cache_arg is None or kwargs.get(spec.cache_arg) is not None:
        return None
    if torch.compiler.is_compiling():  # re-classing the cache's layers breaks the graph; a compiled graph keeps
        return None                    # the copies or drops them, and reads no device value
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(model, "config", None), "use_cache", False)
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.24's name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if not use_cache or checkpointing:
        return None
    from transformers.cache_utils import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except (TypeError, ValueError, AttributeError):  # a config DynamicCache cannot lay out: as transformers does
        return None
    plain, unstored = _unstored_layer_class()
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not plain for layer in layers):
        return None
    for layer in layers:
        layer.__class__ = unstored
    return cache


def _is_loss_call(value: ast.expr) -> bool:
    """``self.loss_function(logits, labels, <vocab>, **kwargs)`` (positional or keyword), nothing else."""
    if not (isinstance(value, ast.Call) and ast.unparse(value.func) == "self.loss_function"):
        return False
    args = dict(zip(("logits", "labels", "vocab_size"), (ast.unparse(a) for a in value.args)))
    if len(value.args) > 3:
        return False
    double_star = False
    for kw in value.keywords:
        if kw.arg is None:
            double_star = ast.unparse(kw.value) == "kwargs"
        elif kw.arg in args or kw.arg not in ("logits", "labels", "vocab_size"):
            return False
        else:
            args[kw.arg] = ast.unparse(kw.value)
    return (double_star and args.get("logits") == "logits" and args.get("labels") == "labels"
            and args.get("vocab_size") in ("self.vocab_size", "self.config.vocab_size"))


def _make_forward(cls: type, spec: _ForwardSpec):
    def forward(self, *args, **kwargs):
        return _fused_loss_forward(self, spec, args, kwargs)

    # what inspect.signature (the HF Trainer's column filter and loss-kwargs check) sees: the class's forward
    forward.__signature__ = inspect.signature(cls.forward)
    forward.__doc__ = cls.forward.__doc__
    forward.__qualname__ = f"{cls.__qualname__}.forward"
    setattr(forward, _MARK, True)
    return forward


def _warn_once(model: nn.Module, reason: str) -> None:
    key = f"{type(model).__name__}: {reason}"
    if key not in _warned:
        _warned.add(key)
        logger.warning("[LoongForge] fused linear cross-entropy: %s; this call runs the original forward", key)


def _call_problem(model: nn.Module, kwargs: dict) -> str | None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor) or isinstance(keep, bool) or keep != 0:
        return "logits_to_keep is not 0 in a training call with labels"
    head = getattr(model, "lm_head", None)
    if type(head) is nn.Linear and head.bias is None:  # replaced since install (resize_token_embeddings)
        head.__class__ = _DeferredLMHead
    elif not isinstance(head, _DeferredLMHead):
        return f"lm_head is now {type(head).__name__}"
    if hasattr(head.weight, "ds_id") and not _head_registered(model):
        # a head replaced since install (resize_token_embeddings): its weight was gathered for the head's forward
        # alone; registered from the next call on
        _register_head_weight(model)
        return "lm_head.weight is partitioned by ZeRO-3 and was not registered with the model before this call"
    if model.loss_function is not ForCausalLMLoss:
        return "loss_function is no longer ForCausalLMLoss"
    return None


def _fused_loss_forward(model: nn.Module, spec: _ForwardSpec, args: tuple, kwargs: dict):
    inner = model.__dict__.get(_INNER)
    original = inner if inner is not None else functools.partial(type(model).forward, model)  # (traceable)
    if len(args) > len(spec.positional):
        return original(*args, **kwargs)
    kwargs = {**dict(zip(spec.positional, args)), **kwargs}
    labels = kwargs.get("labels")
    if labels is None or not torch.is_grad_enabled():
        return original(**kwargs)
    if not model.training:
        # a training call in all but the mode: from_pretrained returns eval(), and a script that never calls
        # train() trains on full logits (and without its dropout or router jitter)
        _warn_once(model, "the model is in eval() mode in a call with labels and gradients on (from_pretrained "
                          "returns eval(); call model.train() to train through the fused loss)")
        return original(**kwargs)
    problem = _call_problem(model, kwargs)
    if problem:
        _warn_once(model, problem)
        return original(**kwargs)

    return_dict = kwargs.get("return_dict")
    if return_dict is None:  # as can_return_tuple decides
        return_dict = getattr(getattr(model, "config", None), "return_dict", True)
        return_dict = True if return_dict is None else return_dict
    if not return_dict:
        # a tuple drops the fields that are None: without logits (and the cache) every later field would move
        # up a position, and out[1] would no longer be what it is in stock's tuple
        return original(**kwargs)
    head = model.lm_head
    call = {**kwargs, "labels": None, "return_dict": True}
    cache = _training_cache(model, spec, kwargs)
    if cache is not None:
        call[spec.cache_arg] = cache
    head._loongforge_defer = True
    try:
        out = original(**call)
    finally:
        # (read and cleared as attributes: torch 2.11's compiler cannot trace a pop from the module's __dict__)
        hidden, head._loongforge_hidden = head._loongforge_hidden, None
        head._loongforge_defer = False
    if hidden is None:
        raise RuntimeError(f"[LoongForge] fused linear cross-entropy: {type(model).__name__}.forward did not call "
                           f"lm_head; switch fused_kernels.linear_cross_entropy off for this model")

    ignore_index = kwargs.get("ignore_index", _DEFAULT_IGNORE_INDEX)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:  # ForCausalLMLoss: tokens < n predict n; the last position has no label
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    num_items = kwargs.get("num_items_in_batch")
    loss = linear_cross_entropy(hidden, head.weight, shift_labels.reshape(-1).to(hidden.device),
                                ignore_index=ignore_index, reduction="mean" if num_items is None else "sum")
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    aux_loss = getattr(out, "aux_loss", None)
    if spec.adds_aux and aux_loss is not None:
        loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
    replace = {"loss": loss, "logits": None}
    if cache is not None:  # it holds nothing: no cache rather than an empty one that looks filled
        field = next((f.name for f in dataclasses.fields(out) if f.name in ("cache", "past_key_values")
                      and getattr(out, f.name) is cache), None)
        if field is not None:
            replace[field] = None
    return dataclasses.replace(out, **replace)
