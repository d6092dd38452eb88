"""Declarative presets: which transformers classes of a model family ``inject`` replaces, and how.

A preset names classes of one ``transformers.models.<family>.modeling_<family>`` module; nothing here
imports transformers until ``FamilyPreset.resolve`` runs, so a transformers release that drops a family
only makes that preset inactive (reported by ``inject``), never an import error.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MoESpec:
    """A sparse MoE block: router ``gate`` (weight [E, H], ``top_k``), stacked SwiGLU ``experts``
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and optional shared experts.

    router:
      ``softmax_topk``: softmax in fp32 over all experts, top-k, optional renormalisation; ExpertMaskedMoE's
      own router reproduces it (and honours ``moe.router``).
      ``transformers``: any other router; the model's router module is kept and its (ids, weights) feed
      ExpertMaskedMoE's expert path. Its load-balancing/z losses are off (the family defines its own).
    """

    block: str
    router: Literal["softmax_topk", "transformers"]
    renormalize_attr: str | None = "norm_topk_prob"  # router attribute; None: always renormalised
    shared_expert: str | None = None       # block attribute holding a dense SwiGLU MLP added to the output
    shared_expert_gate: str | None = None  # Linear(H, 1): the shared output is scaled by sigmoid(gate(x))
    # the router casts its top-k weights to the activations' dtype before they scale the expert outputs
    # (fused_kernels.rounding "stock" does the same; "once" keeps them fp32)
    weights_in_input_dtype: bool = False


@dataclass(frozen=True)
class FamilyPreset:
    name: str
    modeling_module: str
    rmsnorm: tuple[str, ...] = ()
    mlp: tuple[str, ...] = ()  # dense SwiGLU MLPs: gate_proj, up_proj, down_proj, SiLU act_fn
    attention: tuple[str, ...] = ()  # attentions calling q_proj, k_proj, v_proj (nn.Linear) on one input
    moe: MoESpec | None = None
    # the module-level rotary function the family's attention calls, when it is HF's standard one:
    # (q, k, cos, sin, unsqueeze_dim=1), q * cos + rotate_half(q) * sin over the whole head (fused_kernels.rope)
    rope: str | None = None
    rope_why_not: str | None = None  # with rope None: why the family's rotary embedding is not replaced
    # the decoder layer whose attention residual add fuses into its RMSNorms (integrations.residual); optional:
    # a transformers release without it leaves the rest of the preset active
    decoder_layer: str | None = None

    def _module(self):
        """The family's modeling module, or None if this transformers lacks it."""
        try:
            return importlib.import_module(self.modeling_module)
        except ImportError:
            return None

    def resolve(self) -> dict[str, type] | None:
        """Class name -> class from the family's modeling module, or None if this transformers lacks it."""
        module = self._module()
        if module is None:
            return None
        names = (*self.rmsnorm, *self.mlp, *self.attention, *((self.moe.block,) if self.moe else ()))
        classes = {name: getattr(module, name, None) for name in names}
        return None if any(c is None for c in classes.values()) else classes

    def decoder_class(self) -> type | None:
        """The family's decoder layer class, or None (no ``decoder_layer``, or this transformers lacks it)."""
        module = self._module() if self.decoder_layer is not None else None
        return getattr(module, self.decoder_layer, None) if module is not None else None


# imported after the dataclasses above, which the family files use
from ds_loongforge.integrations.presets import (  # noqa: E402
    deepseek_v3, llama, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe)

PRESETS: tuple[FamilyPreset, ...] = tuple(
    family.PRESET for family in (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, llama, qwen2, qwen3))

__all__ = ["FamilyPreset", "MoESpec", "PRESETS"]
