"""``inject(model, config)``: swap a transformers model's RMSNorm, SwiGLU MLP and MoE modules for ours, fuse its
attentions' q/k/v projections into one GEMM, and replace its family's rotary embedding function with
Liger-Kernel's fused RoPE.

Legend (shape suffixes): T tokens, H hidden, I expert intermediate size, E experts, K experts per token.

What each replacement keeps, so that training learns what the stock model would:

* Parameter names, shapes and state-dict keys (a model saved after injection loads in stock transformers
  and the reverse). FusedRMSNorm shares the norm's weight Parameter; FusedSwiGLUMLP and the MoE blocks
  copy the weights into their own Parameters, so inject before building the optimizer.
* The forward: MoE blocks whose router is a softmax top-k (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) use
  ExpertMaskedMoE's router, which computes the same thing; any other router (DeepSeek-V3) is kept as is
  and its (ids, weights) feed the expert path. Shared experts are added as the family adds them.
* ``output_router_logits``: transformers records router logits with a forward hook on every module that
  is an instance of the family's router class (``_can_record_outputs``). Our router is re-classed as a
  subclass of both TopKRouter and that class, its forward returns the logits first, as the family's does,
  and hooks already on the replaced modules move to their replacements.

With ``fused_kernels.qkv`` an attention's q_proj, k_proj and v_proj (nn.Linear modules on one input) are
re-classed in place as FusedQKVLinear: one GEMM computes the three (``ds_loongforge.modules.qkv``); the modules
and Parameters are the model's own.

The rotary embedding is a function, not a module: with ``fused_kernels.rope`` (and liger-kernel installed, a
CUDA device visible), ``modeling_<family>.apply_rotary_pos_emb`` of each family in the model becomes a wrapper
that runs Liger's kernel on CUDA tensors and the original elsewhere (see ``ds_loongforge.integrations.rope``).
That patch is process-wide: it applies to every model of the family, injected or not.

With ``fused_kernels.residual_add`` (and the norms replaced) a decoder layer whose forward is the families' standard
one is re-classed so that its attention's residual add runs inside the post-attention norm's kernel and the
residual stream's gradients are added inside the norms' backward kernels (``ds_loongforge.integrations.residual``).

With ``fused_kernels.linear_cross_entropy`` the causal LM's training loss is computed by the fused LM head +
cross-entropy (``ds_loongforge.integrations.fused_loss``): a training forward with labels returns the same loss
with ``logits=None``; the LM head keeps its Parameter and state-dict key.

transformers refuses its SDPA causal-mask skip under torch.compile (it cannot tell compile from export there). For a
transformers model, the skip is kept where eager takes it without reading a tensor (``ds_loongforge.integrations.
compile_mask``; process-wide, like the RoPE patch). A compiled forward then runs SDPA's causal kernels with no
mask, as eager does.

Nothing is replaced unless the config's ``enabled`` is true. Modules that look like these kinds but that no
preset covers, or that a preset cannot convert, are listed in the report with the reason.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_loongforge.config import LoongForgeConfig, apply_op_settings, parse_config
from ds_loongforge.integrations.fused_loss import KIND_FUSED_LOSS, install_fused_loss, uses_fused_loss  # noqa: F401
from ds_loongforge.integrations.residual import KIND_RESIDUAL, fuse_residual_adds, residual_problem
from ds_loongforge.integrations.zero3 import gathered, partition_new
from ds_loongforge.modules.moe import ExpertMaskedMoE, TopKRouter
from ds_loongforge.modules.norm_mlp import (FusedRMSNorm, FusedSwiGLUMLP, gate_up_trainability_problem,
                                            is_peft_wrapper)
from ds_loongforge.modules.qkv import FusedQKVLinear, fuse_qkv, qkv_problem

logger = logging.getLogger("ds_loongforge")

KIND_RMSNORM = "fused RMSNorm"
KIND_MLP = "fused SwiGLU MLP"
KIND_MOE = "ExpertMaskedMoE"
KIND_MOE_EP = "DeepSpeedExpertMaskedMoE"
KIND_ROPE = "fused RoPE"
KIND_QKV = "fused QKV projection"
KIND_BALANCING = "load-balancing loss without host sync"
OP_IMPL = "auto"
# class-name endings of modules that look replaceable: listed as not replaced when no preset covers them
_LOOKALIKE_SUFFIXES = ("RMSNorm", "MLP", "SparseMoeBlock", "MoeBlock", "MoE")


@dataclass
class InjectionReport:
    """What ``inject`` did: modules replaced per kind, modules left as they were (path, reason), the
    families whose presets matched, and notes on behaviour that differs from the config. Functions (the rotary
    embedding) are listed apart: ``patched_functions`` maps a kind with its library (``"fused RoPE
    (liger-kernel 0.8.5)"``) to the ``modeling_<family>.<function>`` it replaced, ``not_patched`` holds
    (function, reason) for those left alone."""

    enabled: bool
    replaced: dict[str, int] = field(default_factory=dict)
    not_replaced: list[tuple[str, str]] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    already_injected: int = 0  # LoongForge modules found in the model before this call
    patched_functions: dict[str, list[str]] = field(default_factory=dict)
    not_patched: list[tuple[str, str]] = field(default_factory=list)
    fused_loss: str | None = None                # "lm_head of <ModelClass>": the fused linear cross-entropy is on
    fused_loss_not_installed: str | None = None  # why it is not (causal LMs only)

    @property
    def total_replaced(self) -> int:
        return sum(self.replaced.values())

    def summary(self) -> str:
        if not self.enabled:
            return "[LoongForge] inject: \"enabled\" is false; nothing replaced"
        lines = [f"[LoongForge] {kind}: {count} modules" for kind, count in self.replaced.items() if count]
        if not lines and self.already_injected:
            # a repeat call (train.py's inject, then deepspeed.initialize's): one line, what is on in brief; the
            # first call reported the rest
            on = [f"{kind}: {', '.join(names)}" for kind, names in self.patched_functions.items() if names]
            on += [f"{KIND_FUSED_LOSS}: {self.fused_loss}"] if self.fused_loss else []
            return (f"[LoongForge] inject: nothing left to replace; the model already holds "
                    f"{self.already_injected} LoongForge modules" + (f" ({'; '.join(on)})" if on else ""))
        if not lines:
            lines.append("[LoongForge] inject: no module replaced (no known RMSNorm, SwiGLU MLP or MoE block "
                         "of a supported family, or every kind switched off)")
        lines += [f"[LoongForge] {kind}: {', '.join(names)}" for kind, names in self.patched_functions.items()
                  if names]
        if self.fused_loss:
            lines.append(f"[LoongForge] {KIND_FUSED_LOSS}: {self.fused_loss}")
        if self.families:
            lines.append(f"[LoongForge] families: {', '.join(self.families)}")
        lines += [f"[LoongForge] note: {note}" for note in self.notes]
        if self.not_replaced:
            lines.append(f"[LoongForge] not replaced: {len(self.not_replaced)} modules")
            by_reason: dict[str, list[str]] = {}
            for path, reason in self.not_replaced:
                by_reason.setdefault(reason, []).append(path)
            for reason, paths in by_reason.items():
                shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4 else "")
                lines.append(f"[LoongForge]   {shown}: {reason}")
        lines += [f"[LoongForge] not replaced: {name}: {reason}" for name, reason in self.not_patched]
        if self.fused_loss_not_installed:
            lines.append(f"[LoongForge] not replaced: {KIND_FUSED_LOSS}: {self.fused_loss_not_installed}")
        return "\n".join(lines)


def inject(model: nn.Module, config: LoongForgeConfig | dict[str, Any] | None) -> InjectionReport:
    """Replace, in place, the modules of ``model`` that the config switches on; returns what was done.

    ``config``: a LoongForgeConfig, a DeepSpeed config dict holding a ``"loongforge"`` block, or the block.

    torch's random generators are left where they were: the replacements are built with random initial weights
    and then take the model's, and those draws must not shift a script's later ones (its data order, dropout)
    away from the stock run's.

    A model built under ``deepspeed.zero.Init`` (ZeRO-3) is injected one module at a time: the module's shards are
    gathered to build its replacement, whose new Parameters DeepSpeed then partitions. Gathering is a collective:
    call inject on every rank (``deepspeed.initialize`` with the block does).
    """
    cuda = sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        return _inject(model, config)


def _active_presets() -> list:
    """(preset, its resolved classes) of every preset whose transformers classes exist here."""
    from ds_loongforge.integrations.presets import PRESETS

    return [(preset, classes) for preset in PRESETS if (classes := preset.resolve()) is not None]


def _moe_types(active) -> dict:
    """MoE block class -> its preset."""
    return {classes[p.moe.block]: p for p, classes in active if p.moe}


def moe_blocks(model: nn.Module) -> list[str]:
    """The paths of ``model``'s MoE blocks that a preset covers (what inject replaces when ``moe.expert_masked``)."""
    types = _moe_types(_active_presets())
    return [path for path, module in model.named_modules() if type(module) in types]


def _inject(model: nn.Module, config) -> InjectionReport:
    config = _as_config(config)
    report = InjectionReport(enabled=config.enabled)
    if not config.enabled:
        logger.info(report.summary())
        return report
    apply_op_settings(config)
    ours = (FusedRMSNorm, FusedSwiGLUMLP, ExpertMaskedMoE, FusedQKVLinear)
    report.already_injected = sum(isinstance(m, ours) for m in model.modules())

    active = _active_presets()
    moe_types = _moe_types(active)
    mlp_types = {classes[name]: p for p, classes in active for name in p.mlp}
    norm_types = {classes[name]: p for p, classes in active for name in p.rmsnorm}
    families: Counter = Counter()
    handled: set[str] = set()

    # MoE blocks first: the MLP pass then also fuses their shared experts, at their final paths
    for path, module in _snapshot(model):
        preset = moe_types.get(type(module))
        if preset is None:
            continue
        handled.add(path)
        if not config.moe.expert_masked:
            report.not_replaced.append((path, f"{type(module).__name__}: moe.expert_masked is false"))
            continue
        with gathered(module.parameters()):  # ZeRO-3 (a model built under zero.Init): this block whole, read-only
            new, reason = _build_moe(module, preset, config, report, getattr(model, "config", None))
        if new is None:
            report.not_replaced.append((path, f"{type(module).__name__}: {reason}"))
            continue
        _swap(model, path, module, new)
        partition_new(module, new)  # ZeRO-3: the new experts and router partitioned before the next block
        families[preset.name] += 1
        kind = KIND_MOE_EP if config.moe.ep_size > 1 else KIND_MOE
        report.replaced[kind] = report.replaced.get(kind, 0) + 1

    def swap_in(ours_cls):
        def replace(path: str, module: nn.Module) -> bool:
            with gathered(module.parameters()):
                fused = ours_cls.from_hf(module, impl=OP_IMPL, rounding=config.fused_kernels.rounding)
            _swap(model, path, module, fused.train(module.training))
            partition_new(module, fused)
            return True
        return replace

    def fuse_projections(path: str, module: nn.Module) -> bool:
        if isinstance(module.q_proj, FusedQKVLinear):
            return False  # a repeat inject: already fused
        fuse_qkv(module)
        return True

    # then the dense pieces, and last the decoder layers around the norms replaced before them: (classes, switch
    # name, switch, why a module cannot be replaced, replace -> done, kind, what a reason is prefixed with, whether
    # the modules inside a matched one are settled: not for a decoder layer, whose children keep being reported)
    attention_types = {classes[name]: p for p, classes in active for name in p.attention}
    decoder_types = {cls: p for p, _ in active if (cls := p.decoder_class()) is not None}
    for types, switch, on, problem, replace, kind, prefix, settles in (
            (mlp_types, "fused_kernels.swiglu", config.fused_kernels.swiglu, _swiglu_problem,
             swap_in(FusedSwiGLUMLP), KIND_MLP, "", True),
            (norm_types, "fused_kernels.rmsnorm", config.fused_kernels.rmsnorm, lambda m: None,
             swap_in(FusedRMSNorm), KIND_RMSNORM, "", True),
            (attention_types, "fused_kernels.qkv", config.fused_kernels.qkv, qkv_problem, fuse_projections,
             KIND_QKV, "", True),
            (decoder_types, "fused_kernels.residual_add", config.fused_kernels.residual_add, residual_problem,
             lambda path, module: fuse_residual_adds(module, _dynamic_class), KIND_RESIDUAL,
             "residual adds not fused: ", False)):
        for path, module in _snapshot(model):
            preset = types.get(type(module))
            if preset is None:
                continue
            if settles:
                handled.add(path)
            reason = f"{switch} is false" if not on else problem(module)
            if reason:
                report.not_replaced.append((path, f"{type(module).__name__}: {prefix}{reason}"))
                continue
            if replace(path, module):
                families[preset.name] += 1
                report.replaced[kind] = report.replaced.get(kind, 0) + 1

    _patch_rope(model, config, report, families)
    _patch_balancing(model, config, report)
    _patch_compile_mask(model, report)
    _install_fused_loss(model, config, report)

    known = ", ".join(p.name for p, _ in active)
    for path, module in _snapshot(model):
        if path in handled or isinstance(module, ours) or _inside(path, handled):
            continue
        name = type(module).__name__
        if name.endswith(_LOOKALIKE_SUFFIXES):
            report.not_replaced.append((path, f"{name}: no preset covers this class (presets: {known})"))
    report.families = sorted(families)
    if config.moe.ep_size > 1 and not any(isinstance(m, ExpertMaskedMoE) for m in model.modules()):
        note = (f"moe.ep_size={config.moe.ep_size} has no effect: {type(model).__name__} has no MoE block replaced "
                "here (every rank holds the whole model, as with ep_size 1)")
        report.notes.append(note)

    for line in report.summary().splitlines():
        logger.info(line)
    return report


def _patch_balancing(model: nn.Module, config: LoongForgeConfig, report: InjectionReport) -> None:
    """Replace ``load_balancing_loss_func`` of each transformers modeling module that defines a class of the model
    with LoongForge's host-sync-free implementation (``ds_loongforge.integrations.balancing_loss``: the same value;
    installed only where the family's function passes its check)."""
    from ds_loongforge.integrations import balancing_loss

    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if not module_name.startswith("transformers.models.") or not hasattr(module, balancing_loss.FUNCTION):
            continue
        name = f"{module_name.rpartition('.')[2]}.{balancing_loss.FUNCTION}"
        if not config.moe.sync_free_balancing_loss:
            reason = "moe.sync_free_balancing_loss is false"
        else:
            reason = balancing_loss.patch(module_name)
        if reason:
            report.not_patched.append((name, reason))
        else:
            report.patched_functions.setdefault(KIND_BALANCING, []).append(name)


def _patch_compile_mask(model: nn.Module, report: InjectionReport) -> None:
    """For transformers models: the SDPA causal-mask skip kept under torch.compile, where transformers refuses it
    (``ds_loongforge.integrations.compile_mask``)."""
    from ds_loongforge.integrations import compile_mask

    if not type(model).__module__.startswith("transformers."):
        return
    name = f"masking_utils.{compile_mask.FUNCTION}"
    reason = compile_mask.patch()
    if reason:
        report.not_patched.append((name, reason))
    else:
        report.patched_functions.setdefault(compile_mask.KIND, []).append(name)


def _install_fused_loss(model: nn.Module, config: LoongForgeConfig, report: InjectionReport) -> None:
    """The fused linear cross-entropy on a causal LM (see ``ds_loongforge.integrations.fused_loss``): the report's
    ``fused_loss`` (``"lm_head of <ModelClass>"``) or ``fused_loss_not_installed`` (why not). Models without an
    ``lm_head`` that are not ``...ForCausalLM`` classes are not mentioned."""
    name = type(model).__name__
    if not (hasattr(model, "lm_head") or name.endswith("ForCausalLM")):
        return
    if config.fused_kernels.linear_cross_entropy:
        reason = install_fused_loss(model)
    else:
        reason = "fused_kernels.linear_cross_entropy is false"
        if uses_fused_loss(model):
            reason += " (an earlier inject installed it on this model, and it stays on)"
    if reason:
        report.fused_loss_not_installed = reason
    else:
        report.fused_loss = f"lm_head of {name}"


def _patch_rope(model: nn.Module, config: LoongForgeConfig, report: InjectionReport, families: Counter) -> None:
    """Patch the rotary function of each family whose modeling module defines a class of the model.

    The device rule is the op layer's ``impl="auto"``: decided per call from the tensors' device, since inject may
    run on a CPU model that DeepSpeed moves to the GPU later. So the patch goes in whenever a CUDA device is
    visible, and the wrapper runs the original for CPU tensors."""
    from ds_loongforge.integrations import rope
    from ds_loongforge.integrations.presets import PRESETS

    in_model = {type(m).__module__ for m in model.modules()}
    present = [p for p in PRESETS if p.modeling_module in in_model]
    if not present:
        return
    if not config.fused_kernels.rope:
        fused, label = None, "fused_kernels.rope is false"
    elif not rope.cuda_visible():  # liger (and triton) are not even imported then
        fused, label = None, "no CUDA device visible (Liger's fused RoPE is a Triton kernel for CUDA tensors)"
    else:
        fused, label = rope.load_liger()
    for preset in present:
        short = preset.modeling_module.rpartition(".")[2]
        name = f"{short}.{preset.rope or 'apply_rotary_pos_emb'}"
        if preset.rope is None:
            reason = f"{preset.name}: {preset.rope_why_not or 'no standard rotary function in this preset'}"
        elif fused is None:
            reason = label
        else:
            reason = rope.patch(preset.modeling_module, preset.rope, fused, label)
        if reason:
            report.not_patched.append((name, reason))
            continue
        report.patched_functions.setdefault(f"{KIND_ROPE} ({label})", []).append(name)
        families[preset.name] += 1


def _family_balancing(kwargs: dict, config: LoongForgeConfig, preset, model_config, report: InjectionReport) -> None:
    """The load-balancing objective of an injected block: the family's own unless the block sets coefficients.

    transformers computes the family's balancing loss from the router logits it records (our router is of the
    family's router class, so it still records them) when the model config's ``output_router_logits`` is on:
    one loss over the router logits of all layers together, ``router_aux_loss_coef`` x E x sum_e f_e P_e with f_e
    counting each token's k choices. ExpertMaskedMoE's own loss is per layer with f_e summing to 1, summed over
    the layers: for Mixtral's 8 layers top-2 its router gradient is 4x the family's, and the H200 e2e run at
    644b933 (with a 0.001 z-loss the family does not have) trained 7% worse than stock on the same batches. So
    an unset ``moe.aux_loss_coef`` / ``z_loss_coef`` turns ExpertMaskedMoE's terms off and the model trains on
    exactly the objective it had; a set one adds ExpertMaskedMoE's term as asked."""
    moe = config.moe
    kwargs["aux_loss_coef"] = 0.0 if moe.aux_loss_coef is None else moe.aux_loss_coef
    kwargs["z_loss_coef"] = 0.0 if moe.z_loss_coef is None else moe.z_loss_coef
    if moe.aux_loss_coef is not None and moe.z_loss_coef is not None:
        return
    on = bool(getattr(model_config, "output_router_logits", False))
    coef = getattr(model_config, "router_aux_loss_coef", None)
    family = (f"transformers' load-balancing loss on the router logits (output_router_logits on, "
              f"router_aux_loss_coef={coef})" if on else
              "none: output_router_logits is off in the model config, as in the stock model")
    note = (f"{preset.name}: load balancing is the family's own ({family}); ExpertMaskedMoE adds "
            + ("no loss of its own" if not (kwargs["aux_loss_coef"] or kwargs["z_loss_coef"]) else
               f"aux_loss_coef={kwargs['aux_loss_coef']}, z_loss_coef={kwargs['z_loss_coef']}")
            + " (set moe.aux_loss_coef / moe.z_loss_coef to add its per-layer terms)")
    if note not in report.notes:
        report.notes.append(note)


def _as_config(config) -> LoongForgeConfig:
    if isinstance(config, LoongForgeConfig):
        return config
    if config is None:
        return LoongForgeConfig()
    if not isinstance(config, dict):
        raise ValueError(f"inject: config must be a LoongForgeConfig, a DeepSpeed config dict or its \"loongforge\" "
                         f"block, got {type(config).__name__}")
    fields = set(LoongForgeConfig.model_fields)
    # the block itself when it holds a key only the block has ("optimizer" is a DeepSpeed key too), so that a
    # misspelt key beside it is an error naming it rather than a DeepSpeed config without the block (disabled)
    if "loongforge" not in config and (set(config) & (fields - {"optimizer"}) or set(config) <= fields):
        return parse_config({"loongforge": config})
    return parse_config(config)  # a DeepSpeed config (without the block: disabled)


def _snapshot(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(path, module) for path, module in model.named_modules() if path]


def _inside(path: str, parents: set[str]) -> bool:
    return any(path.startswith(parent + ".") for parent in parents)


def _swap(model: nn.Module, path: str, old: nn.Module, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    _move_hooks(old, new)
    setattr(parent, name, new)


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Forward hooks on ``old`` (e.g. transformers' output recorders, installed on first forward) now fire
    on ``new``."""
    for name in _HOOK_DICTS:
        getattr(new, name).update(getattr(old, name))


def _is_silu(act: nn.Module | None) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _swiglu_problem(mlp: nn.Module) -> str | None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not isinstance(getattr(mlp, name, None), nn.Linear):
            return f"no nn.Linear `{name}`"
    act = getattr(mlp, "act_fn", None)
    if not _is_silu(act):
        return f"activation {type(act).__name__} is not SiLU (the fused kernel computes silu(gate) * up)"
    return gate_up_trainability_problem(mlp)


_DYNAMIC_CLASSES: dict[str, type] = {}


def _dynamic_class(name: str, bases: tuple[type, ...], doc: str, namespace: dict | None = None) -> type:
    """One class per name, importable from this module (pickle finds it once it has been built here)."""
    cls = _DYNAMIC_CLASSES.get(name)
    if cls is None:
        cls = type(name, bases, {**(namespace or {}), "__module__": __name__, "__qualname__": name, "__doc__": doc})
        _DYNAMIC_CLASSES[name] = cls
        globals()[name] = cls
    return cls


class TransformersRouterAdapter(nn.Module):
    """Mixin over a family's router class: returns (logits_TE, None, weights_TK, ids_TK), the tuple
    ExpertMaskedMoE expects (no probabilities: the load-balancing and z losses are off for such routers)."""

    mode = "transformers"

    def forward(self, x_TH: torch.Tensor):
        logits_TE, weights_TK, ids_TK = super().forward(x_TH)
        return logits_TE, None, weights_TK, ids_TK


class SharedExpertsMixin(nn.Module):
    """Mixin over ExpertMaskedMoE (or its DeepSpeed subclass): routed output + shared expert(s), the shared
    output scaled by sigmoid(gate(x)) where the family has a gate (Qwen2-MoE)."""

    shared_expert_name: str
    shared_expert_gate_name: str | None
    loongforge_adds_residual = False  # forward(hidden_states): the decoder adds its residual to routed + shared

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routed = super().forward(hidden_states)
        shared = getattr(self, self.shared_expert_name)(hidden_states)
        if self.shared_expert_gate_name is not None:
            shared = torch.sigmoid(getattr(self, self.shared_expert_gate_name)(hidden_states)) * shared
        return routed + shared


def _build_moe(block: nn.Module, preset, config: LoongForgeConfig, report: InjectionReport, model_config=None):
    """(replacement, None) or (None, reason)."""
    spec = preset.moe
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if is_peft_wrapper(experts):  # LoRA's ParamWrapper via target_parameters
        return None, (f"experts are wrapped by {type(experts).__name__} (PEFT adapters on the expert weights); "
                      "the block stays the family's own so that the adapters take effect")
    gate_up_EIH, down_EHI = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up_EIH, torch.Tensor) and isinstance(down_EHI, torch.Tensor) and gate_up_EIH.dim() == 3):
        return None, "experts are not stacked gate_up_proj [E, 2I, H] / down_proj [E, H, I] tensors"
    if not _is_silu(getattr(experts, "act_fn", None)):
        return None, f"expert activation {type(getattr(experts, 'act_fn', None)).__name__} is not SiLU"
    if getattr(experts, "has_bias", False) or hasattr(experts, "gate_up_proj_bias"):
        return None, "experts with biases are not supported by ExpertMaskedMoE"
    num_experts, two_i, hidden = gate_up_EIH.shape
    intermediate = two_i // 2
    top_k = int(gate.top_k)
    ep_size = config.moe.ep_size
    # expert parallelism was asked for: a block it cannot apply to is an error, not a block left stock (the run
    # would hold every expert on every rank, which is not what the config says)
    if num_experts % ep_size:
        raise ValueError(f"inject: moe.ep_size={ep_size} does not divide the {num_experts} experts of "
                         f"{type(block).__name__}; choose an ep_size that divides both the number of experts and "
                         "the world size")
    if ep_size > 1 and not dist.is_initialized():
        raise ValueError(f"inject: moe.ep_size={ep_size} needs torch.distributed initialised before inject, to know "
                         "which experts this rank holds: call deepspeed.init_distributed() first (deepspeed."
                         "initialize with the loongforge block does it itself)")
    if ep_size > 1 and dist.get_world_size() % ep_size:
        raise ValueError(f"inject: moe.ep_size={ep_size} does not divide the world size {dist.get_world_size()}; "
                         "set loongforge.moe.ep_size to a divisor of both the world size and the number of experts "
                         "(1: no expert parallelism)")

    kwargs = dict(config.moe.layer_kwargs())
    if spec.router == "transformers":
        kwargs.update(aux_loss_coef=0.0, z_loss_coef=0.0)
        note = (f"{preset.name}: the family's own router is kept (moe.router={config.moe.router!r} does not "
                "apply) and ExpertMaskedMoE's aux/z losses are off (the family balances with its own scheme)")
        if note not in report.notes:
            report.notes.append(note)
    else:
        _family_balancing(kwargs, config, preset, model_config, report)
    renormalize = True if spec.renormalize_attr is None else bool(getattr(gate, spec.renormalize_attr))
    factory = {"device": gate_up_EIH.device, "dtype": gate_up_EIH.dtype}
    if ep_size > 1:
        from ds_loongforge.modules.moe_deepspeed import DeepSpeedExpertMaskedMoE
        moe = DeepSpeedExpertMaskedMoE(hidden, intermediate, num_experts, top_k, ep_size=ep_size,
                                       renormalize=renormalize, jitter_noise=float(getattr(block, "jitter_noise", 0.0)),
                                       impl=OP_IMPL, rounding=config.fused_kernels.rounding,
                                       weights_in_input_dtype=spec.weights_in_input_dtype, **kwargs, **factory)
    else:
        moe = ExpertMaskedMoE(hidden, intermediate, num_experts, top_k, renormalize=renormalize,
                              jitter_noise=float(getattr(block, "jitter_noise", 0.0)), impl=OP_IMPL,
                              rounding=config.fused_kernels.rounding,
                              weights_in_input_dtype=spec.weights_in_input_dtype, **kwargs, **factory)

    local = slice(moe.ep_rank * moe.num_local_experts, (moe.ep_rank + 1) * moe.num_local_experts)
    with torch.no_grad():
        moe.experts.gate_up_proj.copy_(gate_up_EIH[local])
        moe.experts.down_proj.copy_(down_EHI[local])
    # the replacements are new Parameters, trainable by default: frozen experts (a PEFT model's base, a
    # requires_grad_(False) model) stay frozen
    moe.experts.gate_up_proj.requires_grad_(gate_up_EIH.requires_grad)
    moe.experts.down_proj.requires_grad_(down_EHI.requires_grad)
    if spec.router == "softmax_topk":
        moe.gate.to(gate.weight.dtype)  # a router kept in fp32 in a bf16 model stays fp32
        with torch.no_grad():
            moe.gate.weight.copy_(gate.weight)
        moe.gate.weight.requires_grad_(gate.weight.requires_grad)
        moe.gate.__class__ = _dynamic_class(f"LoongForge{type(gate).__name__}", (TopKRouter, type(gate)),
                                            f"TopKRouter recorded as {type(gate).__name__} by transformers.")
        _move_hooks(gate, moe.gate)
    else:
        gate.__class__ = _dynamic_class(f"LoongForge{type(gate).__name__}",
                                        (TransformersRouterAdapter, type(gate)),
                                        f"{type(gate).__name__} returning ExpertMaskedMoE's routing tuple.")
        moe.gate = gate
    if spec.shared_expert is not None:
        moe.__class__ = _dynamic_class(f"LoongForgeShared{type(moe).__name__}", (SharedExpertsMixin, type(moe)),
                                       f"{type(moe).__name__} plus the model's shared experts.")
        moe.shared_expert_name, moe.shared_expert_gate_name = spec.shared_expert, spec.shared_expert_gate
        setattr(moe, spec.shared_expert, getattr(block, spec.shared_expert))
        if spec.shared_expert_gate is not None:
            setattr(moe, spec.shared_expert_gate, getattr(block, spec.shared_expert_gate))
    return moe.train(block.training), None
