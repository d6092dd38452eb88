"""Drop-in modules over the fused ops: FusedRMSNorm and FusedSwiGLUMLP.

Both keep transformers' parameter names and checkpoint keys, so a model that uses them saves and loads
like the stock model:

* FusedRMSNorm has ``weight [H]`` and both ``variance_epsilon`` (Llama/Mixtral/Qwen) and ``eps``.
* FusedSwiGLUMLP computes gate and up with one GEMM (``gate_up_proj.weight [2I, H]``) but its
  ``state_dict()`` holds HF's ``gate_proj.weight`` / ``up_proj.weight``; ``load_state_dict()``
  accepts those keys or the fused ``gate_up_proj.weight``. Its ``gate_proj`` and ``up_proj`` are
  parameterless :class:`FusedIntoGateUp` markers: a tool that looks those Linears up by name (PEFT's
  ``target_modules`` applied after inject) finds a module it cannot wrap and says so, instead of silently
  adapting only the other Linears.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ds_loongforge.ops._dispatch import check_rounding
from ds_loongforge.ops.rmsnorm import fused_rmsnorm
from ds_loongforge.ops.swiglu import swiglu_dropout

logger = logging.getLogger("ds_loongforge")
_WRAPPED_GATE_UP_WARNED: set[str] = set()


class FusedRMSNorm(nn.Module):
    """RMSNorm over the last dimension; ``forward(x, residual=None, keep_input=False)``.

    With ``residual`` it returns ``(norm(x + residual), x + residual)`` from one fused kernel; with ``keep_input``
    ``(norm(x), x)``, the gradient through the returned x added to the input gradient by the backward kernel.
    ``rounding``: "stock" (transformers' roundings, the default) or "once" (ds_loongforge.ops.rmsnorm).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, impl: str = "auto", rounding: str = "stock",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"FusedRMSNorm: hidden_size must be >= 1, got {hidden_size}")
        check_rounding("FusedRMSNorm", rounding)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = float(eps)
        self.impl, self.rounding = impl, rounding

    @property
    def eps(self) -> float:
        return self.variance_epsilon

    @eps.setter
    def eps(self, value: float) -> None:
        self.variance_epsilon = float(value)

    @classmethod
    def from_hf(cls, module: nn.Module, impl: str = "auto", rounding: str = "stock") -> "FusedRMSNorm":
        """Wrap an HF ``*RMSNorm`` (``weight`` times the normalized input), sharing its weight Parameter."""
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise ValueError(f"FusedRMSNorm.from_hf: {type(module).__name__} has no 1-D `weight` Parameter")
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise ValueError(f"FusedRMSNorm.from_hf: {type(module).__name__} has neither `variance_epsilon` nor `eps`")
        check_rounding("FusedRMSNorm.from_hf", rounding)
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.weight = weight
        fused.variance_epsilon = float(eps)
        fused.impl, fused.rounding = impl, rounding
        return fused

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None, keep_input: bool = False):
        return fused_rmsnorm(hidden_states, self.weight, self.variance_epsilon, residual=residual, impl=self.impl,
                             keep_input=keep_input, rounding=self.rounding)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, impl={self.impl!r}, rounding={self.rounding!r}"


class FusedIntoGateUp(nn.Module):
    """Where an MLP's ``gate_proj`` or ``up_proj`` Linear was: its weight is now rows of the parent
    FusedSwiGLUMLP's ``gate_up_proj``. It holds no Parameters and cannot be called; its repr says why (PEFT puts
    the repr of a module it cannot adapt in its error)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} was fused into gate_up_proj by ds_loongforge (FusedSwiGLUMLP); call the MLP")

    def extra_repr(self) -> str:
        return (f"{self.name}: fused with the other into FusedSwiGLUMLP.gate_up_proj by ds_loongforge.inject; to "
                "adapt it with PEFT apply PEFT before inject (the MLP then stays the family's own), or set "
                "loongforge.fused_kernels.swiglu to false")


class FusedSwiGLUMLP(nn.Module):
    """``down_proj(dropout_p(silu(gate_proj(x)) * up_proj(x)))`` with gate and up fused in one GEMM; ``rounding``:
    "stock" (transformers' roundings, the default) or "once" (ds_loongforge.ops.swiglu)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, dropout: float = 0.0,
                 impl: str = "auto", rounding: str = "stock", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if hidden_size < 1 or intermediate_size < 1:
            raise ValueError(f"FusedSwiGLUMLP: sizes must be >= 1, got hidden_size={hidden_size}, "
                             f"intermediate_size={intermediate_size}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"FusedSwiGLUMLP: dropout must be in [0, 1), got {dropout}")
        check_rounding("FusedSwiGLUMLP", rounding)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.dropout = dropout
        self.impl, self.rounding = impl, rounding
        kw = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **kw)
        self.gate_proj, self.up_proj = FusedIntoGateUp("gate_proj"), FusedIntoGateUp("up_proj")
        self.register_state_dict_post_hook(_split_gate_up_state)
        self.register_load_state_dict_pre_hook(_fuse_gate_up_state)

    @classmethod
    def from_hf(cls, mlp: nn.Module, dropout: float = 0.0, impl: str = "auto",
                rounding: str = "stock") -> "FusedSwiGLUMLP":
        """Build from an HF MLP with ``gate_proj``, ``up_proj``, ``down_proj`` (Linear) and a SiLU act."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                raise ValueError(f"FusedSwiGLUMLP.from_hf: {type(mlp).__name__} has no nn.Linear `{name}`")
        problem = gate_up_trainability_problem(mlp)
        if problem:
            raise ValueError(f"FusedSwiGLUMLP.from_hf: {type(mlp).__name__}: {problem}")
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        bias = gate.bias is not None
        fused = cls(gate.in_features, gate.out_features, bias=bias, dropout=dropout, impl=impl, rounding=rounding,
                    device=gate.weight.device, dtype=gate.weight.dtype)
        with torch.no_grad():
            fused.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight], dim=0))
            if bias:
                fused.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias], dim=0))
        # a frozen MLP stays frozen: the fused Parameters are new ones, trainable by default
        fused.gate_up_proj.weight.requires_grad_(gate.weight.requires_grad)
        if bias:
            fused.gate_up_proj.bias.requires_grad_(gate.bias.requires_grad)
        fused.down_proj = down
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.gate_up_proj) is not nn.Linear and is_peft_wrapper(self.gate_up_proj):
            _say_gate_up_is_wrapped(self.gate_up_proj)
        gate_up = self.gate_up_proj(x)
        act = swiglu_dropout(gate_up, self.dropout if self.training else 0.0, impl=self.impl, rounding=self.rounding)
        return self.down_proj(act)

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, impl={self.impl!r}, rounding={self.rounding!r}"


def is_peft_wrapper(module) -> bool:
    """Whether ``module`` is a PEFT tuner layer (LoRA's Linear, ParamWrapper, ...): each holds the module it
    adapts as ``base_layer``."""
    return hasattr(module, "base_layer")


def _say_gate_up_is_wrapped(wrapper: nn.Module) -> None:
    """A wrapper around the fused gate_up_proj (PEFT's target_modules="all-linear" applied after inject finds it
    as a Linear) works, but adapts gate and up as one [2I, H] matrix, where the stock model would get one adapter
    each: a different model. Said once per wrapper type."""
    name = f"{type(wrapper).__module__}.{type(wrapper).__qualname__}"  # PEFT's LoRA layer is a class named Linear
    if name not in _WRAPPED_GATE_UP_WARNED:
        _WRAPPED_GATE_UP_WARNED.add(name)
        logger.warning("[LoongForge] FusedSwiGLUMLP.gate_up_proj is wrapped by %s: one adapter over gate and up "
                       "together, where the stock model's gate_proj and up_proj would get one each. Apply PEFT "
                       "before ds_loongforge.inject to adapt them as stock does, or set "
                       "loongforge.fused_kernels.swiglu to false", name)


def gate_up_trainability_problem(mlp: nn.Module) -> str | None:
    """Why ``mlp``'s gate_proj and up_proj cannot become one gate_up Parameter: one of them is frozen (its
    ``requires_grad`` is False) and the other is not, and one Parameter cannot be partly trainable."""
    for kind in ("weight", "bias"):
        gate, up = getattr(mlp.gate_proj, kind, None), getattr(mlp.up_proj, kind, None)
        if gate is not None and up is not None and gate.requires_grad != up.requires_grad:
            return (f"gate_proj.{kind}.requires_grad={gate.requires_grad} but up_proj.{kind}.requires_grad="
                    f"{up.requires_grad}: one fused gate_up {kind} cannot be partly frozen")
    return None


def _split_gate_up_state(module: FusedSwiGLUMLP, state_dict: dict, prefix: str, local_metadata) -> None:
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}gate_up_proj.{kind}", None)
        if fused is None:
            continue
        gate, up = fused.chunk(2, dim=0)
        state_dict[f"{prefix}gate_proj.{kind}"] = gate
        state_dict[f"{prefix}up_proj.{kind}"] = up


def _fuse_gate_up_state(module: FusedSwiGLUMLP, state_dict: dict, prefix: str, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    for kind in ("weight", "bias"):
        gate_key, up_key = f"{prefix}gate_proj.{kind}", f"{prefix}up_proj.{kind}"
        if gate_key in state_dict and up_key in state_dict:
            state_dict[f"{prefix}gate_up_proj.{kind}"] = torch.cat(
                [state_dict.pop(gate_key), state_dict.pop(up_key)], dim=0)
        elif gate_key in state_dict or up_key in state_dict:
            present = gate_key if gate_key in state_dict else up_key
            error_msgs.append(f"FusedSwiGLUMLP: found {present} without its partner; a checkpoint needs both "
                              f"{gate_key} and {up_key}, or the fused {prefix}gate_up_proj.{kind}")
