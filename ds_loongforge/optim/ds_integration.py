"""FusedAdamWClip inside DeepSpeed 0.19.8: selected by the config, one norm all-reduce, no DeepSpeed clip pass.

    engine, optimizer, _, _ = ds_loongforge.optim.initialize(model=model, model_parameters=groups, config=cfg)

with either ``"optimizer": {"type": "LoongForgeAdamW", "params": {...}}`` or ``"loongforge": {"optimizer":
{"fused_adamw_clip": true}}`` (then ``"optimizer"`` names AdamW and its params are taken) in ``cfg``;
``"gradient_clipping"`` becomes the optimizer's ``max_norm``. Without either, this is ``deepspeed.initialize``.

Why a wrapper: DeepSpeed 0.19.8 builds a config-named optimizer only from its own list or ``torch.optim``
(``_configure_basic_optimizer``), and ZeRO-1/2 (``stage_1_and_2.py``) computes the norm, checks overflow and
scales the flat fp32 gradients in its own passes before calling the optimizer once per parameter group. So
here the optimizer is built from the config and passed as a client optimizer, DeepSpeed is configured with
``gradient_clipping = 0`` (its norm and clip passes then do not run; with bf16/fp32 the loss scale is 1 and
its unscale pass returns at once), and under ZeRO-1/2 the ZeRO optimizer's ``step`` is replaced, on that
instance only, by :func:`_fused_zero_step`: flatten every group's gradient partition (DeepSpeed's code), one
FusedAdamWClip step over all groups, copy back into the bf16 partitions and all-gather (DeepSpeed's code).

The norm: ZeRO-1/2 partitions of one rank are disjoint from every other rank's, for dense groups over the
data-parallel group and for expert groups over the expert-data-parallel group inside each expert-parallel
rank, so the sum of squares over the whole world is the global one: one all-reduce of the [2] stats
tensor (sum of squares, non-finite count), no host sync. ``engine.get_global_grad_norm()`` returns it as a
device tensor. Steps with an inf/nan gradient change nothing; ``optimizer.skipped_steps`` counts them.

Not covered (raise at initialize): fp16 (its dynamic loss scale needs the overflow on the host), ZeRO-3,
CPU offload, tensor/pipeline parallelism (mpu). ZeRO-0 with fp32 params uses FusedAdamWClip directly with the
gradients DeepSpeed already all-reduced (exact without expert parallelism; with it the norm is this rank's).
"""

from __future__ import annotations

import copy
import torch

from ds_loongforge.optim.fused_adamw_clip import FusedAdamWClip

OPTIMIZER_TYPE = "LoongForgeAdamW"
_ADAMW_TYPES = ("adamw", "adam", OPTIMIZER_TYPE.lower())
_IGNORED_DS_PARAMS = ("torch_adam", "adam_w_mode", "fp32_optimizer_states")


def uses_fused_adamw_clip(ds_config: dict) -> bool:
    """True when the config selects FusedAdamWClip (by type name or by the loongforge block)."""
    from ds_loongforge.config import parse_config

    optimizer = ds_config.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() == OPTIMIZER_TYPE.lower():
        return True
    block = parse_config(ds_config)
    return block.enabled and block.optimizer.fused_adamw_clip


def deepspeed_optimizer(model_params, ds_config: dict, impl: str = "auto") -> FusedAdamWClip:
    """FusedAdamWClip from a DeepSpeed config's ``"optimizer"`` params and ``"gradient_clipping"``."""
    optimizer = ds_config.get("optimizer") or {}
    kind = str(optimizer.get("type", OPTIMIZER_TYPE)).lower()
    if kind not in _ADAMW_TYPES:
        raise ValueError(f'FusedAdamWClip replaces AdamW; the config\'s "optimizer" type is {optimizer.get("type")!r} '
                         f"(expected {OPTIMIZER_TYPE!r} or AdamW)")
    params = dict(optimizer.get("params") or {})
    if params.get("adam_w_mode") is False or (kind == "adam" and "adam_w_mode" not in params):
        raise ValueError('FusedAdamWClip is AdamW (decoupled weight decay); the config asks for Adam '
                         '(type "Adam" without adam_w_mode, or adam_w_mode false)')
    for key in _IGNORED_DS_PARAMS:
        params.pop(key, None)
    kwargs = {k: params.pop(k) for k in ("lr", "betas", "eps", "weight_decay", "impl") if k in params}
    if params:
        raise ValueError(f'FusedAdamWClip: unknown "optimizer" params {sorted(params)} '
                         "(accepted: lr, betas, eps, weight_decay, impl)")
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    clip = float(ds_config.get("gradient_clipping", 0.0) or 0.0)
    if clip < 0:
        raise ValueError(f'"gradient_clipping" must be >= 0, got {clip}')
    kwargs.setdefault("impl", impl)
    return FusedAdamWClip(model_params, max_norm=clip if clip > 0 else None, **kwargs)


def deepspeed_config_for(ds_config: dict) -> dict:
    """The config DeepSpeed gets beside our optimizer: no "optimizer" entry, no clipping of its own."""
    config = copy.deepcopy(ds_config)
    config.pop("optimizer", None)
    config["gradient_clipping"] = 0.0
    config["zero_allow_untested_optimizer"] = True
    return config


def initialize(model, config: dict, model_parameters=None, impl: str = "auto", **kwargs):
    """``deepspeed.initialize`` that builds FusedAdamWClip when the config selects it (see the module doc)."""
    import deepspeed

    if not uses_fused_adamw_clip(config):
        return deepspeed.initialize(model=model, model_parameters=model_parameters, config=config, **kwargs)
    if kwargs.get("optimizer") is not None:
        raise ValueError("initialize: the config selects FusedAdamWClip; do not pass an optimizer as well")
    params = model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    optimizer = deepspeed_optimizer(params, config, impl=impl)
    result = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config_for(config), **kwargs)
    attach(result[0], optimizer)
    return result


def attach(engine, optimizer: FusedAdamWClip) -> None:
    """Make ``engine`` step through ``optimizer`` without DeepSpeed's own norm/clip passes (see module doc)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if engine.basic_optimizer is not optimizer:
        raise ValueError("attach: the engine was not built with this optimizer")
    if engine.gradient_clipping() != 0.0:
        raise ValueError(f"attach: the engine clips gradients itself (gradient_clipping="
                         f"{engine.gradient_clipping()}); build it with deepspeed_config_for(config)")
    if engine.fp16_enabled():
        raise NotImplementedError("FusedAdamWClip under DeepSpeed fp16 is not supported: the dynamic loss scale "
                                  "needs the overflow on the host. Use bf16 or fp32.")
    if engine.mpu is not None:
        raise NotImplementedError("FusedAdamWClip under tensor/pipeline parallelism (mpu) is not supported")
    stage = engine.zero_optimization_stage()
    if stage == 0:
        if not isinstance(engine.optimizer, FusedAdamWClip):
            raise NotImplementedError(f"FusedAdamWClip at ZeRO-0 needs fp32 params; DeepSpeed wrapped it in "
                                      f"{type(engine.optimizer).__name__}. Use ZeRO-1/2 for bf16.")
        return
    zero = engine.optimizer
    if stage not in (1, 2) or not isinstance(zero, DeepSpeedZeroOptimizer):
        raise NotImplementedError(f"FusedAdamWClip supports ZeRO stages 0, 1 and 2, not {stage}")
    for flag in ("cpu_offload", "torch_autocast_gradscaler", "zenflow"):
        if getattr(zero, flag, None):
            raise NotImplementedError(f"FusedAdamWClip under ZeRO with {flag} is not supported")
    optimizer.stats_hook = _world_all_reduce
    zero.step = _fused_zero_step.__get__(zero)
    zero.loongforge_optimizer = optimizer


def _world_all_reduce(stats: torch.Tensor) -> None:
    from deepspeed import comm as dist

    dist.all_reduce(stats)


@torch.no_grad()
def _fused_zero_step(zero, closure=None):
    """DeepSpeedZeroOptimizer.step (ZeRO-1/2, no offload) with the overflow check, norm and clip passes
    replaced by one FusedAdamWClip step over every group. Follows DeepSpeed 0.19.8's step line by line."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import all_gather_dp_groups
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    zero.micro_step_id = INITIAL_MICRO_STEP_ID
    zero._wait_for_offload_copies()
    zero.overflow = False  # a non-finite step is skipped on the device, never reported to the host
    fp32_groups = zero.single_partition_of_fp32_groups
    for i in range(len(zero.bit16_groups)):
        zero.free_grad_in_param_list(zero.params_not_in_partition[i])
        flat = zero._get_preflattened_grad_partition(i)
        if flat is None:
            group = zero.real_dp_process_group[i]
            if dist.get_rank(group=group) == dist.get_world_size(group=group) - 1:
                flat = zero.flatten_dense_tensors_aligned(zero.averaged_gradients[i], int(zero.partition_size[i]))
            else:
                flat = zero.flatten(zero.averaged_gradients[i])
        assert flat.numel() == zero.partition_size[i], (flat.numel(), zero.partition_size[i])
        fp32_groups[i].grad = flat.to(fp32_groups[i].dtype)
        zero.free_grad_in_param_list(zero.params_in_partition[i])
        zero._release_preflattened_grad_buffers(i)
        zero.averaged_gradients[i] = None
        zero.all_grad_tensors[i] = None
    optimizer = zero.loongforge_optimizer
    optimizer.step(inv_scale=1.0 / zero.loss_scale)
    zero._global_grad_norm = optimizer.last_grad_norm
    zero._lazy_init_hp_params_optimizer_state()
    for i in range(len(zero.bit16_groups)):
        fp32_groups[i].grad = None
        partition_id = dist.get_rank(group=zero.real_dp_process_group[i])
        zero.parallel_partitioned_bit16_groups[i][partition_id].data.copy_(fp32_groups[i].data)
    all_gather_dp_groups(groups_flat=zero.bit16_groups_flat,
                         partitioned_param_groups=zero.parallel_partitioned_bit16_groups,
                         dp_process_group=zero.real_dp_process_group,
                         start_alignment_factor=zero.nccl_start_alignment_factor,
                         allgather_bucket_size=zero.allgather_bucket_size)
    for i in range(len(zero.bit16_groups)):
        zero._update_model_bit16_weights(i)

