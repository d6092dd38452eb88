"""ExpertMaskedMoE under DeepSpeed: expert-parallel groups, ZeRO parameter groups, gradient clipping, checkpoints.

What DeepSpeed 0.19.8's engine needs from an MoE layer, and how this file provides it:

- Groups. ``deepspeed.utils.groups._create_expert_and_data_parallel(ep_size)`` builds, under the name
  ``ep_size_<ep>``, the expert-parallel group of each rank (consecutive ranks) and its expert-data-parallel
  group (the ranks holding the same experts). DeepSpeedExpertMaskedMoE takes ``ep_size`` and its all-to-all
  runs over that expert-parallel group; the engine calls ``set_deepspeed_parallelism()`` on every module that
  has it (``DeepSpeedEngine._configure_distributed_model``), so a layer built before ``deepspeed.initialize``
  gets its group there, and one built after ``torch.distributed`` is up gets it at once.
- Gradient reduction. ``deepspeed.moe.utils.is_moe_param`` is ``param.allreduce is False``; such parameters
  are reduced over the expert-data-parallel group named by ``param.group_name`` (ZeRO-1/2:
  ``DeepSpeedZeroOptimizer._configure_moe_settings`` / ``average_tensor``; no ZeRO:
  ``DeepSpeedEngine._reduce_expert_gradients``), averaged over the whole data-parallel size. The stacked
  expert weights are marked that way (as ``deepspeed.moe.experts.Experts`` marks its experts); the router is
  an ordinary data-parallel parameter.
- The engine's MoE switch. ``has_moe_layers`` (which turns on the two points above, the ZeRO MoE parameter
  groups and the per-expert checkpoint files) is set only by ``isinstance(module, deepspeed.moe.layer.MoE)``
  (or DeepSpeed's AutoEP layer, whose checkpoint code hard-codes expert weights named w1/w2/w3). So the
  layer's ``experts`` submodule becomes a DeepSpeedStackedExperts, a subclass of both StackedExperts and
  MoE: it carries the attributes the engine reads (num_experts, num_local_experts, ep_size,
  expert_group_name) and keeps the parameter names ``experts.gate_up_proj`` / ``experts.down_proj``.
  Making the experts (not the whole layer) the MoE is what keeps the router in the dense checkpoint file:
  the engine drops every key under an MoE module's prefix that contains "expert".
- Checkpoints. ``DeepSpeedEngine._save_moe_checkpoint`` calls ``module.state_dict()`` on each MoE module
  and writes one file per global expert id, ``layer_<L>_expert_<g>_mp_rank_<mp>_model_states.pt``, with keys
  ``<module>.deepspeed_moe.experts.deepspeed_experts.<g>.<param>``; ``DeepSpeedEngine.load_moe_state_dict``
  reads back the files of this rank's experts, renames ``<g>`` to the local index and loads the model
  state dict. DeepSpeedStackedExperts answers a call of ``state_dict()`` on itself with those per-expert
  keys (one [2I, H] / [H, I] slice per expert) and, when loading, stacks them back. Calls through a parent
  (``model.state_dict()``) keep the stacked transformers names, so a model's state dict still loads into
  MixtralSparseMoeBlock. Files are per global expert, so a checkpoint reloads into DeepSpeedExpertMaskedMoE
  layers of another ep_size, 1 included (module states; ``ds_loongforge.checkpoint`` rebuilds the ZeRO optimizer
  state for the new partitions, which DeepSpeed would take rank by rank from the old ones). A
  model injected with ``moe.ep_size`` 1 holds plain ExpertMaskedMoE layers, which DeepSpeed does not see as
  MoE: its engine reads no per-expert files, so ``ds_loongforge.checkpoint`` stacks them into the module state
  and rebuilds the ZeRO-1/2 optimizer state (installed for such engines by integrations.deepspeed_hook), and
  loads such a model's checkpoint (no per-expert files) into these layers;
  ``ds_loongforge.export`` writes the checkpoint's weights, every expert's fp32 master, under the transformers
  keys such a model loads.
- Gradient norm and clipping. ZeRO-1/2 get it right under expert parallelism
  (``DeepSpeedZeroOptimizer.get_grad_norm_direct`` sums every partition's squares over the whole
  data-parallel group, and each expert partition lives on exactly one rank of it). Without ZeRO two paths
  are wrong, fp32 (``DeepSpeedEngine.clip_fp32_gradients``) and 16-bit with an unfused optimizer
  (``FP16_UnfusedOptimizer``); the first DeepSpeedExpertMaskedMoE built replaces the two methods involved
  (see "gradient norm without ZeRO" below), for models holding these layers only.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

import deepspeed
import deepspeed.comm as ds_comm
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.utils import groups

from ds_loongforge import checkpoint
from ds_loongforge.modules.moe import ExpertMaskedMoE, StackedExperts

logger = logging.getLogger("ds_loongforge")

# the infix of DeepSpeed's per-expert checkpoint keys (deepspeed.moe.layer.MoE -> MOELayer -> Experts)
DEEPSPEED_EXPERT_KEY = "deepspeed_moe.experts.deepspeed_experts"
EXPERT_PARAM_NAMES = ("gate_up_proj", "down_proj")


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert-parallel and expert-data-parallel groups of size ep_size."""
    return f"ep_size_{ep_size}"


def expert_parallel_group(ep_size: int, use_data_before_expert_parallel: bool = False, *,
                          adopt_existing: bool = False):
    """This rank's expert-parallel group of size ep_size from deepspeed.utils.groups, created (with its
    expert-data-parallel group) on first use in the layout asked for. DeepSpeed keeps one group per name for the
    life of the process, so a group that exists in the other layout is an error (ZeRO partitions, the
    checkpoint's files and their export all follow it), unless ``adopt_existing`` (a layer built before the
    engine takes what the config-only hook made). torch.distributed must be initialized; deepspeed.comm is
    attached to it if deepspeed.init_distributed has not run yet."""
    if not dist.is_initialized():
        raise RuntimeError("expert_parallel_group: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() (or deepspeed.initialize) first")
    if not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the world size {world}")
    name = expert_group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size,
                                                use_data_before_expert_parallel_=use_data_before_expert_parallel)
    elif not adopt_existing:
        wanted, _ = groups._get_expert_parallel_ranks(world, 1, ep_size, 1, use_data_before_expert_parallel)
        mine = next(list(ranks) for ranks in wanted if dist.get_rank() in ranks)
        held = list(groups._get_expert_parallel_group_ranks(name))
        if held != mine:
            raise ValueError(
                f"DeepSpeed's expert groups {name} exist in the other layout: this rank's expert-parallel group is "
                f"{held}, and use_data_before_expert_parallelism={use_data_before_expert_parallel} (the DeepSpeed "
                f"config) puts it in {mine}. A DeepSpeedExpertMaskedMoE built after torch.distributed was up made "
                "them: build it with use_data_before_expert_parallel equal to the config's "
                "use_data_before_expert_parallelism")
    return groups._get_expert_parallel_group(name)


class DeepSpeedStackedExperts(StackedExperts, MoE):
    """StackedExperts that DeepSpeed's engine treats as an MoE layer (see the module docstring).

    Never built directly: DeepSpeedExpertMaskedMoE re-classes its StackedExperts in place (as
    torch.nn.utils.parametrize does), so MoE.__init__, which would build DeepSpeed's own gate and experts,
    never runs. ``state_dict()`` called on this module itself returns DeepSpeed's per-expert layout, local
    expert index j: ``deepspeed_moe.experts.deepspeed_experts.<j>.gate_up_proj`` [2I, H] and ``.down_proj``
    [H, I]; as part of a parent's state dict it stays ``gate_up_proj`` [E_local, 2I, H] / ``down_proj``.
    Loading accepts both.
    """

    num_experts: int
    num_local_experts: int
    ep_size: int
    expert_group_name: str

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Nothing to bind here: the owning DeepSpeedExpertMaskedMoE, which the engine visits first
        (named_modules is pre-order), creates the groups and holds the all-to-all group."""

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        if args or destination is not None or prefix:  # part of a parent's state dict: stacked names
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        # called on this module alone, as DeepSpeedEngine._save_moe_checkpoint does
        params = {name: getattr(self, name) for name in EXPERT_PARAM_NAMES}
        return {f"{DEEPSPEED_EXPERT_KEY}.{j}.{name}": (p[j] if keep_vars else p[j].detach())
                for j in range(self.num_local_experts) for name, p in params.items()}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        per_expert = f"{prefix}{DEEPSPEED_EXPERT_KEY}."
        keys = [k for k in state_dict if k.startswith(per_expert)]
        if keys:
            for name in EXPERT_PARAM_NAMES:
                wanted = [f"{per_expert}{j}.{name}" for j in range(self.num_local_experts)]
                absent = [k for k in wanted if k not in state_dict]
                if absent:
                    error_msgs.append(f"DeepSpeed per-expert checkpoint keys missing: {absent}")
                    return
                state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in wanted])
            unexpected_keys.extend(k for k in keys if k in state_dict)
            for k in keys:
                state_dict.pop(k, None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class DeepSpeedExpertMaskedMoE(ExpertMaskedMoE):
    """ExpertMaskedMoE whose expert parallelism, ZeRO reduction and checkpoints go through DeepSpeed.

    Same arguments as ExpertMaskedMoE, with ``ep_size`` instead of ``ep_group``: the group is DeepSpeed's
    ``ep_size_<ep>`` expert-parallel group (consecutive ranks; this rank holds experts
    [ep_rank * E/ep, (ep_rank + 1) * E/ep)). Built before torch.distributed is up, it gets the group when
    ``deepspeed.initialize`` runs. ZeRO-3 is not supported (DeepSpeed refuses MoE layers under stage 3).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 ep_size: int = 1, use_data_before_expert_parallel: bool = False, **kwargs: Any):
        if "ep_group" in kwargs:
            raise TypeError("DeepSpeedExpertMaskedMoE takes ep_size; its group comes from deepspeed.utils.groups")
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, ep_size=ep_size, **kwargs)
        self.use_data_before_expert_parallel = use_data_before_expert_parallel
        experts = self.experts
        experts.__class__ = DeepSpeedStackedExperts
        experts.num_experts, experts.num_local_experts = num_experts, self.num_local_experts
        experts.ep_size, experts.expert_group_name = ep_size, expert_group_name(ep_size)
        for param in experts.parameters():
            param.allreduce = False
            param.group_name = experts.expert_group_name
            param.loongforge_stacked_experts = True
        _install_expert_parallel_grad_norm()
        _install_gathered_16bit_save()
        checkpoint.install()  # the optimizer state across ep_size, expert layout and world size
        if dist.is_initialized():
            self._bind(expert_parallel_group(ep_size, use_data_before_expert_parallel, adopt_existing=True))

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create or look up DeepSpeed's groups for this ep_size, in the layout of the engine's config, and bind
        the expert-parallel one (DeepSpeedEngine._configure_distributed_model calls this on every module that has
        it). The config decides: ZeRO's expert-data-parallel partitions and the checkpoint follow it."""
        if self.use_data_before_expert_parallel and not use_data_before_expert_parallel_:
            raise ValueError("DeepSpeedExpertMaskedMoE(use_data_before_expert_parallel=True) in an engine whose "
                             "config does not set \"use_data_before_expert_parallelism\": true; DeepSpeed's groups "
                             "and checkpoints follow the config: set it there")
        self._bind(expert_parallel_group(self.ep_size, use_data_before_expert_parallel_))

    def _bind(self, group) -> None:
        self.ep_group = group if self.ep_size > 1 else None
        self.ep_rank = dist.get_rank(group)


def moe_param_groups(model_or_params: nn.Module | Iterable, max_group_size: int | None = 178956971,
                     **group_options: Any) -> list[dict]:
    """Optimizer parameter groups with the expert parameters split out per expert group ('moe': True),
    which ZeRO-1/2 require when the optimizer is built outside DeepSpeed (DeepSpeed splits the groups
    itself only for an optimizer named in its config).

    ``model_or_params``: a module (its trainable parameters form one group), parameters, or parameter
    groups (dicts; a group without a "name" gets one). ``group_options`` (lr, weight_decay, ...) go into
    every group that does not set them. ``max_group_size`` as in DeepSpeed's
    split_params_into_different_moe_groups_for_optimizer, which this wraps.
    """
    if isinstance(model_or_params, nn.Module):
        param_groups = [{"params": [p for p in model_or_params.parameters() if p.requires_grad]}]
    else:
        items = list(model_or_params)
        param_groups = [dict(g) for g in items] if items and isinstance(items[0], dict) else [{"params": items}]
    for i, group in enumerate(param_groups):
        group["params"] = list(group["params"])
        group.setdefault("name", "dense-params" if len(param_groups) == 1 else f"params-{i}")
        for key, value in group_options.items():
            group.setdefault(key, value)
    names = [g["name"] for g in param_groups]
    if len(set(names)) != len(names):
        raise ValueError(f"moe_param_groups: parameter group names must be unique, got {names}")
    return split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=max_group_size)


# --- gradient norm without ZeRO ---------------------------------------------------------------------------------
# Two DeepSpeed 0.19.8 paths get the global norm wrong once expert weights are MoE parameters, and the first
# DeepSpeedExpertMaskedMoE built replaces them (for models holding these layers; others keep DeepSpeed's):
# - fp32: DeepSpeedEngine.clip_fp32_gradients -> deepspeed/runtime/utils.py: clip_grad_norm_ averages each
#   rank's local norm over the data-parallel group ("Need to average total_norm across different GPUs due to
#   the presence of moe params"): mean_r sqrt(d^2 + e_r^2) instead of sqrt(d^2 + sum_r e_r^2); it is also never
#   recorded, so get_global_grad_norm() is None.
# - fp16/bf16 with an optimizer other than DeepSpeed's FusedAdam (torch's AdamW, a client optimizer, any CPU
#   run): deepspeed/runtime/fp16/unfused_optimizer.py: FP16_UnfusedOptimizer.step builds the norm from
#   split_params_grads_into_shared_and_expert_params(group)[0], the dense gradients only, so expert gradients
#   are neither in the reported norm nor in the clip coefficient (wrong even at ep_size 1).
# The true norm: dense squares (equal on every rank after the data-parallel all-reduce) plus, per expert
# group, the squares summed over its expert-parallel group (expert-data-parallel replicas hold equal
# gradients, so each expert counts once). ZeRO-1/2, BF16_Optimizer and FP16_Optimizer get it right.

_deepspeed_clip_fp32_gradients = DeepSpeedEngine.clip_fp32_gradients
_deepspeed_unfused_unscale_and_clip_grads = FP16_UnfusedOptimizer.unscale_and_clip_grads


def _holds_stacked_experts(params: Iterable[torch.Tensor]) -> bool:
    return any(getattr(p, "loongforge_stacked_experts", False) for p in params)


def _sum_of_squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()


def _expert_sum_of_squares(params: list[torch.Tensor]) -> torch.Tensor:
    """Squared norm of the expert gradients among params (all ranks call it: collectives), each expert once."""
    by_group = defaultdict(list)
    for p in params:
        if is_moe_param(p):
            by_group[p.group_name].append(p)
    total = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for name in sorted(by_group):  # the same order on every rank
        squares = _sum_of_squares([p.grad for p in by_group[name] if p.grad is not None], total.device)
        ds_comm.all_reduce(squares, group=groups._get_expert_parallel_group(name))
        total = total + squares
    return total


def _clip_fp32_gradients(engine: DeepSpeedEngine):
    """DeepSpeedEngine.clip_fp32_gradients with the expert-parallel global norm, recorded for
    get_global_grad_norm()."""
    params = list(engine.module.parameters())
    if not _holds_stacked_experts(params):
        return _deepspeed_clip_fp32_gradients(engine)
    if engine.mpu is not None:
        raise NotImplementedError("ExpertMaskedMoE: gradient clipping without ZeRO under model parallelism is not "
                                  "supported; use ZeRO stage 1 or 2")
    dense = [p.grad for p in params if p.grad is not None and not is_moe_param(p)]
    total_norm = (_sum_of_squares(dense, params[0].device) + _expert_sum_of_squares(params)).sqrt()
    clip_coef = (engine.gradient_clipping() / (total_norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(clip_coef)
    engine._global_grad_norm = total_norm
    return total_norm


def _unfused_unscale_and_clip_grads(optimizer: FP16_UnfusedOptimizer, total_norm, apply_scale=True):
    """FP16_UnfusedOptimizer.unscale_and_clip_grads given the norm with the expert gradients added.
    ``total_norm`` is the dense norm that step() computed (loss-scaled, like the gradients read here)."""
    params = [p for group in optimizer.fp16_groups for p in group]
    if not _holds_stacked_experts(params):
        return _deepspeed_unfused_unscale_and_clip_grads(optimizer, total_norm, apply_scale)
    if optimizer.mpu is not None:
        raise NotImplementedError("ExpertMaskedMoE: 16-bit training without ZeRO under model parallelism is not "
                                  "supported; use ZeRO stage 1 or 2")
    total_norm = float((total_norm**2 + _expert_sum_of_squares(params)).sqrt())
    optimizer._global_grad_norm = total_norm
    return _deepspeed_unfused_unscale_and_clip_grads(optimizer, total_norm, apply_scale)


def gathered_module_state_dict(engine, exclude_frozen_parameters: bool = False) -> dict:
    """``engine.module_state_dict`` with each expert-parallel layer's stacked experts all-gathered over its
    expert-parallel group, in expert order (rank r of the group holds experts [r * E/ep, (r + 1) * E/ep)): the whole
    model under transformers' keys, every rank the same. A collective: every rank calls it."""
    state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    for name, layer in engine.module.named_modules():
        if not (isinstance(layer, DeepSpeedExpertMaskedMoE) and layer.ep_size > 1 and layer.ep_group is not None):
            continue
        for param_name in EXPERT_PARAM_NAMES:
            key = f"{name}.experts.{param_name}" if name else f"experts.{param_name}"
            if key not in state:  # excluded as frozen
                continue
            local = state[key].detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(layer.ep_size)]
            dist.all_gather(parts, local, group=layer.ep_group)
            state[key] = torch.cat(parts)
    return state


def _save_16bit_model(original, engine, save_dir, save_filename="pytorch_model.bin",
                      exclude_frozen_parameters=False):
    """DeepSpeedEngine.save_16bit_model, whose ZeRO-1/2 path saves rank 0's ``module_state_dict``: under expert
    parallelism that held rank 0's experts only ([E/ep, ...] where the model has [E, ...]), which a stock model
    refuses on its size, returned True and said nothing. The experts are gathered first (every rank calls
    save_16bit_model, as DeepSpeed requires)."""
    sharded = any(isinstance(m, DeepSpeedExpertMaskedMoE) and m.ep_size > 1 for m in engine.module.modules())
    if not sharded or engine.zero_optimization_partition_weights():
        return original(engine, save_dir, save_filename, exclude_frozen_parameters)
    state = gathered_module_state_dict(engine, exclude_frozen_parameters)
    had = "module_state_dict" in engine.__dict__
    previous = engine.__dict__.get("module_state_dict")
    engine.module_state_dict = lambda *args, **kwargs: state
    try:
        return original(engine, save_dir, save_filename, exclude_frozen_parameters)
    finally:
        if had:
            engine.module_state_dict = previous
        else:
            del engine.module_state_dict


def _install_gathered_16bit_save() -> None:
    from ds_loongforge.integrations._patching import patch_once

    if patch_once(DeepSpeedEngine, "save_16bit_model", _save_16bit_model):
        logger.info("[LoongForge] DeepSpeedEngine.save_16bit_model -> expert-parallel experts gathered into the saved "
                    "model (ds_loongforge.modules.moe_deepspeed)")


def _install_expert_parallel_grad_norm() -> None:
    if DeepSpeedEngine.clip_fp32_gradients is not _clip_fp32_gradients:
        DeepSpeedEngine.clip_fp32_gradients = _clip_fp32_gradients
        FP16_UnfusedOptimizer.unscale_and_clip_grads = _unfused_unscale_and_clip_grads
        logger.info("[LoongForge] DeepSpeedEngine.clip_fp32_gradients, FP16_UnfusedOptimizer.unscale_and_clip_grads"
                    " -> expert-parallel global gradient norm (ds_loongforge.modules.moe_deepspeed)")
