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
instance only, by :func:`_fused_zero_step`: every group's gradient partition read where ZeRO left it (its per-
parameter views, no flat copy), one
FusedAdamWClip step over all groups, copy back into the bf16 partitions and all-gather (DeepSpeed's code).

The norm: ZeRO-1/2 partitions of one rank are disjoint from every other rank's, for dense groups over the
data-parallel group and for expert groups over the expert-data-parallel group inside each expert-parallel
rank, so the sum of squares over the whole world is the global one: one all-reduce of the [2] stats
tensor (sum of squares, non-finite count), no host sync. ``engine.get_global_grad_norm()`` returns it as a
device tensor. Steps with an inf/nan gradient change nothing; ``optimizer.skipped_steps`` counts them on the
device and ``engine.skipped_steps`` reads that count (a sync only when it is read: DeepSpeed's progress line
every ``steps_per_print`` steps, checkpoints).

fp16: DeepSpeed's dynamic loss scaler decides on the host (overflow -> halve, ``loss_scale_window`` clean
steps -> double, with hysteresis), which needs the overflow flag on the host every step. Under this optimizer
the ZeRO optimizer's scaler is replaced by :class:`DeviceLossScaler`, the same rules on device tensors: the
loss is multiplied by the device scale, the kernel reads its inverse, and the non-finite count of pass 1
updates it. A static ``"loss_scale"`` stays DeepSpeed's own (a host constant).

ZeRO-0 with bf16 or fp16 params (DeepSpeed wraps the optimizer in BF16_Optimizer / FP16_Optimizer, each with
its own norm, overflow and clip passes) or with expert-parallel parameter groups (whose gradients differ
between expert-parallel ranks, so the norm needs ZeRO's partition-disjoint layout) runs as ZeRO-1:
DeepSpeed's BF16_Optimizer is itself a ZeRO-1-style partitioned fp32 optimizer, and ZeRO-1 gives the same
updates with the fp32 state partitioned. This is logged once. ZeRO-0 with fp32 params and no expert
parallelism uses FusedAdamWClip directly on the gradients DeepSpeed already all-reduced.

A client optimizer passed with such a config (the HF Trainer builds its AdamW when the DeepSpeed config has no
"optimizer") is replaced by FusedAdamWClip on the client's own param groups, so its hyperparameters and an LR
scheduler built on it carry over; one FusedAdamWClip cannot stand in for (not AdamW, AMSGrad, state already
held) is an error.

ZeRO-3 (``stage3.py``): the ZeRO optimizer's ``step`` is replaced by :func:`_fused_zero3_step`. Its gradient
partitions (per-parameter views into one flat buffer, ``averaged_gradients``) are read in place, one
FusedAdamWClip step runs over every sub-group (``sub_group_size`` splits a param group into several; each has its
own fp32 partition and moments, with its group's hyper-parameters), and the kernel writes the fp32 partition
and the bf16/fp16 one the model's partitioned parameters view. DeepSpeed would copy each sub-group's gradients
into an fp32 flat first, compute the norm with its own pass and an all-reduce per group, read the fp16 overflow
flag on the host, scale the gradients, step, and copy the fp32 partition back. Partitions of one rank are
disjoint from every other rank's over the data-parallel group, so the norm is again one all-reduce of the
[2] stats over the world. No all-gather follows: ZeRO-3 gathers parameters when the forward needs them.

Not covered (raise at initialize): optimizer or parameter offload, MiCS, ZeRO-3 sub-groups partitioned over
another group than the data-parallel one (AutoEP experts), tensor/pipeline parallelism (mpu).
"""

from __future__ import annotations

import copy
import logging

import torch

from ds_loongforge.optim.fused_adamw_clip import FusedAdamWClip

logger = logging.getLogger("ds_loongforge")

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


def zero_section(ds_config: dict) -> dict:
    """The config's "zero_optimization" as a dict; DeepSpeed also reads the deprecated form ``true`` / ``false``
    (ZeRO stage 1 / 0)."""
    zero = ds_config.get("zero_optimization")
    if isinstance(zero, bool):
        return {"stage": int(zero)}
    return dict(zero or {})


def check_zero_setup(ds_config: dict) -> None:
    """FusedAdamWClip runs under ZeRO 0-3 without offload and without MiCS: a config that selects it with
    offload or MiCS is refused from the config alone, before a model is changed or an engine built (``attach``
    would find it only once DeepSpeed had built the whole engine)."""
    zero = zero_section(ds_config)
    stage = zero.get("stage", 0)
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    offload_param = (zero.get("offload_param") or {}).get("device", "none")
    mics = zero.get("mics_shard_size", -1)
    problem = (f'"offload_optimizer": {{"device": "{offload}"}}' if str(offload).lower() not in ("none", "") else
               '"cpu_offload": true (DeepSpeed\'s deprecated offload_optimizer)' if zero.get("cpu_offload") else
               f'"offload_param": {{"device": "{offload_param}"}}' if int(stage) == 3 and
               str(offload_param).lower() not in ("none", "") else
               f'"mics_shard_size": {mics} (MiCS)' if int(stage) == 3 and mics is not None and int(mics) > 0 else None)
    if problem is not None:
        raise ValueError(f"FusedAdamWClip (selected by the config) runs under ZeRO stages 0-3 without offload or "
                         f"MiCS; the config has {problem}. Set \"loongforge\": {{\"optimizer\": "
                         "{\"fused_adamw_clip\": false}} (and an \"optimizer\" type other than LoongForgeAdamW) "
                         "to keep DeepSpeed's optimizer, or drop the offload / MiCS setting")
    accum = str((ds_config.get("data_types") or {}).get("grad_accum_dtype") or "").lower()
    if (_enabled(ds_config, "bf16") or _enabled(ds_config, "bfloat16")) and int(stage) in (0, 1) and \
            accum in ("fp32", "float32", "float", "torch.float32"):
        # DeepSpeed then wraps the optimizer in its BF16_Optimizer (its own norm, clip and step), not ZeRO's
        raise ValueError(f"FusedAdamWClip (selected by the config) with bf16 and \"data_types\": "
                         f"{{\"grad_accum_dtype\": \"fp32\"}} runs under ZeRO stage 2 only; the config has "
                         f"\"zero_optimization\": {{\"stage\": {stage}}}, where DeepSpeed does not step through "
                         "ZeRO's optimizer (at stage 1 it uses its BF16_Optimizer). Use ZeRO stage 2 (the same "
                         "updates, fp32 gradient accumulation), drop grad_accum_dtype, or set \"loongforge\": "
                         "{\"optimizer\": {\"fused_adamw_clip\": false}} to keep DeepSpeed's optimizer")


def deepspeed_optimizer(model_params, ds_config: dict, impl: str = "auto") -> FusedAdamWClip:
    """FusedAdamWClip from a DeepSpeed config's ``"optimizer"`` params and ``"gradient_clipping"``."""
    optimizer = ds_config.get("optimizer") or {}
    kind = str(optimizer.get("type", OPTIMIZER_TYPE)).lower()
    if kind not in _ADAMW_TYPES:
        raise ValueError(f'FusedAdamWClip replaces AdamW; the config\'s "optimizer" type is {optimizer.get("type")!r} '
                         f"(expected {OPTIMIZER_TYPE!r} or AdamW)")
    params = dict(optimizer.get("params") or {})
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (its adam_w_mode defaults to true)
    if params.get("adam_w_mode") is False:
        raise ValueError('FusedAdamWClip is AdamW (decoupled weight decay); the config asks for Adam with L2 weight '
                         'decay (adam_w_mode false)')
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


def _enabled(config: dict, key: str) -> bool:
    return bool((config.get(key) or {}).get("enabled", False))


def deepspeed_config_for(ds_config: dict, expert_parallel: bool = False) -> dict:
    """The config DeepSpeed gets beside our optimizer: no "optimizer" entry, no clipping of its own, and
    ZeRO-0 raised to ZeRO-1 for bf16/fp16 params or expert-parallel groups (see the module doc)."""
    config = copy.deepcopy(ds_config)
    config.pop("optimizer", None)
    config["gradient_clipping"] = 0.0
    config["zero_allow_untested_optimizer"] = True
    zero = zero_section(config)
    low_precision = _enabled(config, "bf16") or _enabled(config, "bfloat16") or _enabled(config, "fp16")
    if int(zero.get("stage", 0)) == 0 and (low_precision or expert_parallel):
        why = "bf16/fp16 params" if low_precision else "expert-parallel parameter groups"
        logger.info("[LoongForge] FusedAdamWClip: ZeRO-0 with %s runs as ZeRO-1 (partitioned fp32 state, the "
                    "same updates; DeepSpeed's ZeRO-0 %s wrapper would add its own norm and clip passes)", why,
                    "BF16_Optimizer/FP16_Optimizer" if low_precision else "norm")
        zero["stage"] = 1
        config["zero_optimization"] = zero
    return config


def _has_expert_groups(params) -> bool:
    groups = params if isinstance(params, (list, tuple)) else []
    return any(isinstance(g, dict) and g.get("moe", False) for g in groups)


def initialize(model, config: dict, model_parameters=None, impl: str = "auto", **kwargs):
    """``deepspeed.initialize`` that builds FusedAdamWClip when the config selects it (see the module doc)."""
    import deepspeed

    from ds_loongforge.config import throughput_timer_setting

    config = throughput_timer_setting(config)  # an enabled loongforge block: no per-step timer syncs
    if not uses_fused_adamw_clip(config):
        return deepspeed.initialize(model=model, model_parameters=model_parameters, config=config, **kwargs)
    check_zero_setup(config)
    client = kwargs.pop("optimizer", None)
    params = model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    if client is None:
        params = list(params)
        for group in params:  # as torch's add_param_group makes them (a generator would be spent by the check)
            if isinstance(group, dict) and not isinstance(group.get("params"), (list, torch.Tensor)):
                group["params"] = list(group["params"])
        if not any(not isinstance(group, dict) or isinstance(group["params"], torch.Tensor) or group["params"]
                   for group in params):
            # a frozen model (a reference or teacher model built from the training config): nothing to optimize,
            # and FusedAdamWClip refused the empty list; DeepSpeed builds what it builds for it
            logger.info("[LoongForge] optimizer: no FusedAdamWClip (no parameter of %s requires grad)",
                        type(model).__name__)
            if str((config.get("optimizer") or {}).get("type", "")).lower() == OPTIMIZER_TYPE.lower():
                config = {k: v for k, v in config.items() if k != "optimizer"}  # a name DeepSpeed does not know
            return deepspeed.initialize(model=model, model_parameters=None if model_parameters is None else params,
                                        config=config, **kwargs)
    if client is not None:
        params = _client_adamw_groups(client, config)
        logger.info("[LoongForge] FusedAdamWClip takes the script's %s: its %d parameter groups with their lr, betas, "
                    "eps and weight decay (an LR scheduler built on it keeps setting the lr)", type(client).__name__,
                    len(params))
    expert_parallel = _has_expert_groups(params) or any(getattr(p, "allreduce", True) is False
                                                        for p in model.parameters())
    sources = {}
    if expert_parallel and not _has_expert_groups(params):
        # ZeRO reduces expert parameters over their expert-data-parallel group only from groups marked 'moe' (and
        # asserts without one); DeepSpeed splits them itself only for an optimizer of its own config, so an
        # unmodified script's parameters are split here
        if client is None:
            from ds_loongforge.modules.moe_deepspeed import moe_param_groups

            params = moe_param_groups(params)
        else:
            params, sources = _split_client_groups(params)
    optimizer = deepspeed_optimizer(params, config, impl=impl)
    _list_with_zero()
    for group in optimizer.param_groups:
        if id(group) in sources:
            optimizer.follow_hyperparameters(group, sources[id(group)])
    result = deepspeed.initialize(model=model, optimizer=optimizer,
                                  config=deepspeed_config_for(config, expert_parallel), **kwargs)
    attach(result[0], optimizer)
    return result


def _list_with_zero() -> None:
    """List FusedAdamWClip among the optimizers DeepSpeed's ZeRO knows (``ZERO_SUPPORTED_OPTIMIZERS``, process-wide,
    once). Unlisted, every engine built with it logs "You are using ZeRO with an untested optimizer, proceed with
    caution" (``_do_optimizer_sanity_check``), a warning about the very step ``attach`` replaces with one tested
    here at every ZeRO stage. ``deepspeed_config_for`` still sets ``zero_allow_untested_optimizer`` for a subclass,
    which DeepSpeed's exact type check would not find in the list."""
    from deepspeed.runtime.zero import utils

    if FusedAdamWClip not in utils.ZERO_SUPPORTED_OPTIMIZERS:
        utils.ZERO_SUPPORTED_OPTIMIZERS.append(FusedAdamWClip)


def _split_client_groups(groups: list[dict]) -> tuple[list[dict], dict[int, dict]]:
    """A client optimizer's groups with the expert parameters split out ('moe' groups, DeepSpeed's
    split_params_into_different_moe_groups_for_optimizer), the client's dicts kept as they are (their "params"
    lose the expert weights) so that its LR scheduler still drives them; and, per new group (by id), the client
    dict it came from, whose hyper-parameters it follows at every step."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    for i, group in enumerate(groups):
        group.setdefault("name", f"client-group-{i}")
    origin = {id(p): group for group in groups for p in group["params"]}
    split = split_params_into_different_moe_groups_for_optimizer(list(groups))
    client = {id(group) for group in groups}
    return split, {id(group): origin[id(group["params"][0])] for group in split
                   if id(group) not in client and group["params"]}


_STRUCTURAL_GROUP_KEYS = ("params", "name", "moe")


def split_client_optimizer(client: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """A script's own torch optimizer on an expert-parallel model, as ZeRO needs it: the same optimizer over the
    client's groups with the expert parameters split out into 'moe' groups (``_split_client_groups``); ZeRO-1/2
    asserts without them ("None of the param groups are marked as MoE"), and DeepSpeed splits only an optimizer of
    its own config. The result is a shallow copy of ``client`` (its class, defaults, state and hooks) whose group
    list holds the client's own dicts and the new ones, so the client's group list is left as it was: an LR
    scheduler built on the client before ``deepspeed.initialize`` (accelerate's prepare, a plain script) keeps its
    entries per client group (torch zips them strictly) and keeps setting the lr in those dicts, and each new group
    takes the hyper-parameters of the group it came from before every step and before its state is saved (hooks),
    as FusedAdamWClip's split groups do; a load keeps those dicts (torch's would put new ones in their place). None
    when there is nothing to split (expert groups already, or no expert parameters)."""
    if _has_expert_groups(client.param_groups):
        return None
    split, sources = _split_client_groups(client.param_groups)
    followed = [(group, sources[id(group)]) for group in split if id(group) in sources]
    if not followed:
        return None
    optimizer = copy.copy(client)
    vars(optimizer).pop("step", None)  # an LR scheduler's wrapper of the client's bound step, if any
    for name, hooks in vars(client).items():  # its own hook tables, for the hooks added below
        if name.endswith("_hooks") and isinstance(hooks, dict):
            setattr(optimizer, name, type(hooks)(hooks))
    optimizer.param_groups = split
    own = list(split)  # the group dicts the client, its LR scheduler and the followed pairs hold

    def follow(*args):
        for group, source in followed:
            group.update({k: v for k, v in source.items() if k not in _STRUCTURAL_GROUP_KEYS})

    def into_own_dicts(opt):  # torch's load_state_dict puts new group dicts in place of those others hold
        for i, group in enumerate(own):
            loaded = opt.param_groups[i]
            if loaded is not group:
                group.clear()
                group.update(loaded)
                opt.param_groups[i] = group

    optimizer.register_step_pre_hook(follow)
    optimizer.register_state_dict_pre_hook(follow)  # saved as the next step will take them
    optimizer.register_load_state_dict_post_hook(into_own_dicts)
    # the client's step never runs now: tell an LR scheduler built on it (torch's order check) that it did not miss
    # it, else its first step warns that optimizer.step() was not called before it
    client._opt_called = True
    return optimizer


_CLIENT_FLAGS_OFF = ("amsgrad", "maximize")


def _client_adamw_groups(client, ds_config: dict) -> list[dict]:
    """The parameter groups FusedAdamWClip is built on in place of a client optimizer: the HF Trainer builds its
    AdamW before calling deepspeed.initialize when the DeepSpeed config has no "optimizer" block, and the
    loongforge block asks for FusedAdamWClip. The groups are the client's own dicts, so that its hyperparameters
    (per group: lr, betas, eps, weight_decay) are FusedAdamWClip's and an LR scheduler built on the client keeps
    setting the lr that FusedAdamWClip reads. Only an AdamW (torch's AdamW, or Adam without weight decay, which
    is the same update) with no AMSGrad or maximize and no state yet is taken; anything else is an error naming
    the fix."""
    def refuse(why: str):
        raise ValueError(f"initialize: the config selects FusedAdamWClip (loongforge.optimizer.fused_adamw_clip or "
                         f"\"optimizer\": {{\"type\": \"{OPTIMIZER_TYPE}\"}}) and the script passes its own "
                         f"{type(client).__name__} optimizer, which FusedAdamWClip cannot stand in for: {why}. Set "
                         "fused_adamw_clip to false to keep the script's optimizer")

    if (ds_config.get("optimizer") or {}).get("type") is not None:
        refuse('the DeepSpeed config also names an "optimizer"; DeepSpeed takes one or the other')
    if not isinstance(client, torch.optim.Optimizer):
        refuse("it is not a torch.optim.Optimizer")
    decoupled = isinstance(client, torch.optim.AdamW)
    if not (decoupled or type(client) is torch.optim.Adam):
        refuse("it is not AdamW")
    for i, group in enumerate(client.param_groups):
        for flag in _CLIENT_FLAGS_OFF:
            if group.get(flag):
                refuse(f"param group {i} has {flag}=True")
        if not (decoupled or group.get("decoupled_weight_decay")) and group.get("weight_decay", 0.0) != 0.0:
            refuse(f"param group {i} is Adam with weight_decay={group['weight_decay']} (L2 in the gradient, "
                   "not AdamW's decoupled decay)")
    if any(client.state.values()):
        refuse("it already holds optimizer state (moments); build the engine before the first step")
    # the client's step never runs now: tell an LR scheduler built on it (torch's order check) that it did not
    # miss it, else its first step warns that optimizer.step() was not called before it
    client._opt_called = True
    return client.param_groups


def attach(engine, optimizer: FusedAdamWClip) -> None:
    """Make ``engine`` step through ``optimizer`` without DeepSpeed's own norm/clip passes (see module doc)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if engine.basic_optimizer is not optimizer:
        raise ValueError("attach: the engine was not built with this optimizer")
    if engine.gradient_clipping() != 0.0:
        raise ValueError(f"attach: the engine clips gradients itself (gradient_clipping="
                         f"{engine.gradient_clipping()}); build it with deepspeed_config_for(config)")
    if engine.mpu is not None:
        raise NotImplementedError("FusedAdamWClip under tensor/pipeline parallelism (mpu) is not supported")
    stage = engine.zero_optimization_stage()
    if stage == 0:
        if not isinstance(engine.optimizer, FusedAdamWClip):
            raise NotImplementedError(f"FusedAdamWClip at ZeRO-0 needs fp32 params; DeepSpeed wrapped it in "
                                      f"{type(engine.optimizer).__name__}. Build the engine with "
                                      "deepspeed_config_for(config), which runs bf16/fp16 as ZeRO-1.")
        _follow_device_skips(engine, optimizer)
        return
    zero = engine.optimizer
    if stage == 3:
        _attach_zero3(engine, zero, optimizer)
        return
    if stage not in (1, 2) or not isinstance(zero, DeepSpeedZeroOptimizer):
        raise NotImplementedError(f"FusedAdamWClip supports ZeRO stages 0-3, not {stage} "
                                  f"({type(zero).__name__})")
    for flag in ("cpu_offload", "torch_autocast_gradscaler", "zenflow"):
        if getattr(zero, flag, None):
            raise NotImplementedError(f"FusedAdamWClip under ZeRO with {flag} is not supported")
    _device_loss_scaler(zero)
    # ZeRO's own clip pass stays off (its step is replaced below), but its clip_grad is what DeepSpeed saves in
    # every optimizer file and restores over the config on load: 0 there would resume a run with DeepSpeed's
    # optimizer and clipping silently off (not with "compute_grad_norm": false, whose load refuses a clip_grad > 0)
    if getattr(zero, "compute_grad_norm", True):
        zero.clip_grad = float(optimizer.defaults.get("max_norm") or 0.0)
    optimizer.stats_hook = _world_all_reduce
    _single_process_shortcuts(zero, optimizer)
    zero.step = _fused_zero_step.__get__(zero)
    zero.loongforge_optimizer = optimizer
    if getattr(zero, "elastic_checkpoint", False):
        zero.state_dict = _elastic_state_dict.__get__(zero)
    _follow_device_skips(engine, optimizer)


def _attach_zero3(engine, zero, optimizer: FusedAdamWClip) -> None:
    """``attach`` at ZeRO-3: what the fused step cannot take is refused by name, then ZeRO's step is replaced."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    keep = 'set "loongforge": {"optimizer": {"fused_adamw_clip": false}} to keep DeepSpeed\'s optimizer'
    if not isinstance(zero, DeepSpeedZeroOptimizer_Stage3) or type(zero).__name__.startswith("MiCS"):
        raise NotImplementedError(f"FusedAdamWClip at ZeRO-3 runs on DeepSpeed's DeepSpeedZeroOptimizer_Stage3, "
                                  f"not {type(zero).__name__}; {keep}")
    for flag in ("offload_optimizer", "offload_param", "swap_optimizer", "torch_autocast_gradscaler", "zenflow",
                 "use_muon"):
        if getattr(zero, flag, None):
            raise NotImplementedError(f"FusedAdamWClip under ZeRO-3 with {flag} is not supported; {keep}")

    def ranks(group) -> list[int]:  # the global ranks of a group (DeepSpeed's _get_sub_group_partition_ranks, any group)
        if group is None or group == dist.get_world_group():
            return list(range(dist.get_world_size()))
        return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group=group))]

    data_parallel = ranks(zero.dp_process_group)
    for i, group in enumerate(zero.sub_group_process_groups):
        if ranks(group) != data_parallel:
            # the norm's all-reduce over the world counts each element once only if every partition is over the
            # data-parallel group (AutoEP's expert sub-groups are partitioned over their expert-data-parallel one)
            raise NotImplementedError(f"FusedAdamWClip under ZeRO-3: sub-group {i} is partitioned over another "
                                      f"process group than the data-parallel one (AutoEP expert parameters); {keep}")
    _device_loss_scaler(zero)
    for fp32 in zero.fp32_partitioned_groups_flat:
        # DeepSpeed's initialize_optimizer_states leaves a zero gradient buffer of the largest sub-group on the fp32
        # partitions until its first step frees it; the fused step reads the bf16/fp16 gradients, never this one
        fp32.grad = None
    optimizer.stats_hook = None if dist.get_world_size() == 1 else _world_all_reduce
    zero.step = _fused_zero3_step.__get__(zero)
    zero.loongforge_optimizer = optimizer
    _follow_device_skips(engine, optimizer)


@torch.no_grad()
def _fused_zero3_step(zero, closure=None):
    """DeepSpeedZeroOptimizer_Stage3.step (no offload) with its overflow check, norm, unscale/clip and fp32
    gradient copies replaced by one FusedAdamWClip step over every sub-group (module doc). The bookkeeping
    around it is DeepSpeed 0.19.8's own: ``_pre_step``, the parameters partitioned, the model's gradients
    cleared, the partitioned parameters re-pointed at the flat bf16/fp16 partition, ``_post_step`` (persistent
    parameters gathered)."""
    zero._pre_step()
    zero._partition_all_parameters()
    zero.overflow = False  # a non-finite step is skipped on the device, never reported to the host
    zero.zero_grad(set_to_none=True)  # the epilogue copied the gradients into the partition buffer already
    optimizer = zero.loongforge_optimizer
    per_group = []
    for i in range(len(zero.fp16_groups)):
        fp32, low = zero.fp32_partitioned_groups_flat[i], zero.fp16_partitioned_groups_flat[i]
        fp32_model = low.dtype == fp32.dtype  # fp32 params: the fp32 partition is stepped, then copied below
        pieces = zero.averaged_gradients[i]
        grad_dtype = fp32.dtype if fp32_model or pieces[0].dtype == torch.float32 else low.dtype
        # the per-parameter gradient views into ZeRO's flat partition buffer, read where they are
        grad = pieces if all(g.dtype == grad_dtype for g in pieces) else zero.flatten(pieces).to(grad_dtype)
        group_index = zero.sub_group_to_group_id[i]
        per_group.append((optimizer.param_groups[group_index],
                          [optimizer.partition_bucket(group_index, fp32, grad, None if fp32_model else low,
                                                      key=("zero3", i))]))
    _step_and_record_norm(zero, optimizer, per_group)
    del per_group
    for i, (fp32, low) in enumerate(zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat)):
        zero.averaged_gradients[i] = None
        if low.dtype == fp32.dtype:  # fp32 params: the kernel stepped the fp32 partition alone
            low.data.copy_(fp32.data)
        zero._unflatten_partitioned_parameters(i)
    zero._post_step(set())


def _elastic_state_dict(zero) -> dict:
    """DeepSpeedZeroOptimizer.state_dict under ``"elastic_checkpoint": true``, which records the base optimizer's
    step only from ``param_groups[0]["step"]`` (DeepSpeed's FusedAdam keeps it there) and cannot load a
    checkpoint without it. FusedAdamWClip counts steps on the device, per partition (``state["step"]``, equal in
    every group: a skipped step skips all); each group's count is put into its param group here, read once per
    save (a host sync), and loading restores the state's own tensor besides."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = zero.loongforge_optimizer
    for group in optimizer.param_groups:
        state = optimizer.state.get(group["params"][0]) or {}
        group["step"] = int(state["step"]) if "step" in state else 0
    return DeepSpeedZeroOptimizer.state_dict(zero)


def _single_process_shortcuts(zero, optimizer: FusedAdamWClip) -> None:
    """In a world of one process every data-parallel and expert-data-parallel group has one rank: DeepSpeed's
    gradient averaging divides every gradient bucket by 1.0 (a read and a write of all gradients per step,
    1.7 ms of a 94 ms e2e Mixtral step on an H200) and the norm's all-reduce sums one tensor. Both are exact
    no-ops, so both are skipped; the updates stay bitwise the same (tested)."""
    from deepspeed import comm as dist

    if dist.get_world_size() != 1 or getattr(zero, "sequence_parallel_size", 1) != 1:
        return
    optimizer.stats_hook = None
    if zero.gradient_average:
        zero.gradient_average = False
        logger.info("ZeRO in one process: DeepSpeed's gradient averaging (a division by 1) is skipped")
    _gradients_stay_in_place(zero)


# What _gradients_stay_in_place replaces on the ZeRO optimizer instance (restore_gradient_copies undoes it).
_IN_PLACE_METHODS = ("setup_buckets", "reduce_ready_partitions_and_remove_grads", "reduce_ipg_grads")


def _gradients_stay_in_place(zero) -> None:
    """In one process ZeRO-1/2 copies every gradient twice per step: into its reduce bucket (to all-reduce
    over a group of one) and from there into the flat partition buffer (a 3.6 GiB pair of DtoD copies, 3.7 ms
    of a 79 ms e2e Mixtral step on an H200). With one rank there is nothing to reduce and the whole model is
    this rank's partition, so here the gradients stay where autograd put them: the bucket buffers are not
    allocated, nothing is copied, and the epilogue (DeepSpeed's own) collects ``param.grad`` into the
    per-parameter lists the fused step reads in place (and accumulates later micro-steps into them, as it
    does for ZeRO-1). The updates are bitwise the same (tested, with gradient accumulation too).

    Left to DeepSpeed: a config that accumulates gradients in another dtype than the model's (its compact fp32
    partition buffer) and ZeRO-1's separate accumulation attribute."""
    if getattr(zero, "use_grad_accum_attribute", False) or any(
            zero._use_compact_grad_partition_buffer(i) for i in range(len(zero.bit16_groups))):
        return

    def setup_buckets(self):
        if not self.ready_for_gradients:  # DeepSpeed's bookkeeping, without the bucket buffers
            self.micro_step_id += 1
            self.ready_for_gradients = True

    def reduce_ready_partitions_and_remove_grads(self, param, i):
        pass  # the gradient stays in param.grad: the epilogue takes it from there

    def reduce_ipg_grads(self, comm_dtype=None):
        pass  # nothing was put in a bucket

    for name, fn in zip(_IN_PLACE_METHODS, (setup_buckets, reduce_ready_partitions_and_remove_grads,
                                            reduce_ipg_grads)):
        setattr(zero, name, fn.__get__(zero))
    zero._loongforge_gradients_in_place = True
    logger.info("ZeRO in one process: gradients are read where autograd wrote them (no copies into "
                "DeepSpeed's reduce bucket and partition buffer)")


def restore_gradient_copies(zero) -> None:
    """Undoes :func:`_gradients_stay_in_place` on ``zero`` (DeepSpeed's own copying path again); for tests
    that compare the two."""
    for name in _IN_PLACE_METHODS:
        zero.__dict__.pop(name, None)
    zero._loongforge_gradients_in_place = False


class DeviceLossScaler:
    """DeepSpeed's DynamicLossScaler (fp16) with its state on the device, so that no step reads the overflow
    flag on the host. Same rules as DeepSpeed 0.19.8's ``update_scale``: on a step with a non-finite
    gradient the scale is divided by ``scale_factor`` (not below ``min_scale``) once the hysteresis is used
    up, else the hysteresis counts down; after ``scale_window`` clean steps since the last overflow it is
    multiplied by ``scale_factor`` (and the hysteresis refilled). DeepSpeed raises when an overflow hits the
    minimum scale; here that would need a host read, so the step is skipped like any other (the skip count,
    ``engine.skipped_steps``, shows it).

    It stands in for ZeRO's ``loss_scaler``: ``loss_scale`` / ``cur_scale`` are a float32 device scalar,
    ``scale_loss``/``backward`` multiply by it, ``inverse()`` is what the fused step reads, and
    ``update(stats)`` follows each step. It pickles (into DeepSpeed checkpoints, through deepcopy) as DeepSpeed's own
    DynamicLossScaler in its current state, so a checkpoint resumes with DeepSpeed's optimizer too (whose step calls
    ``update_scale``, which this class has not) and loads where ds_loongforge is not installed; the fused step turns
    it back into a device twin (``_device_loss_scaler``)."""

    dynamic = True

    def __init__(self, init_scale: float, scale_window: int = 1000, min_scale: float = 1.0, delayed_shift: int = 1,
                 consecutive_hysteresis: bool = False, scale_factor: float = 2.0, device=None):
        if not init_scale > 0 or not min_scale > 0 or scale_window < 1 or delayed_shift < 1 or scale_factor <= 1:
            raise ValueError(f"DeviceLossScaler: needs init_scale > 0, min_scale > 0, scale_window >= 1, "
                             f"delayed_shift >= 1, scale_factor > 1; got {init_scale}, {min_scale}, {scale_window}, "
                             f"{delayed_shift}, {scale_factor}")
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.scale_window, self.min_scale, self.delayed_shift = int(scale_window), float(min_scale), int(delayed_shift)
        self.consecutive_hysteresis, self.scale_factor = bool(consecutive_hysteresis), float(scale_factor)
        self._scale = torch.tensor(float(init_scale), **f32)
        self._hysteresis = torch.tensor(self.delayed_shift, **i64)
        self._iter = torch.tensor(0, **i64)
        self._last_overflow = torch.tensor(-1, **i64)

    def __reduce__(self):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

        # four host reads, once per save
        state = {"cur_scale": float(self._scale), "cur_hysteresis": int(self._hysteresis),
                 "cur_iter": int(self._iter), "last_overflow_iter": int(self._last_overflow),
                 "scale_factor": self.scale_factor}
        return (DynamicLossScaler, (float(self._scale), self.scale_window, self.min_scale, self.delayed_shift,
                                    self.consecutive_hysteresis), state)

    @classmethod
    def like(cls, scaler, device=None) -> "DeviceLossScaler":
        """The device twin of a DeepSpeed DynamicLossScaler, in its current state."""
        new = cls(scaler.cur_scale, scaler.scale_window, scaler.min_scale, scaler.delayed_shift,
                  scaler.consecutive_hysteresis, scaler.scale_factor, device=device)
        new._hysteresis.fill_(int(scaler.cur_hysteresis))
        new._iter.fill_(int(scaler.cur_iter))
        new._last_overflow.fill_(int(scaler.last_overflow_iter))
        return new

    def to(self, device) -> "DeviceLossScaler":
        """Moves the state to ``device`` (a checkpoint may load it onto the CPU); a no-op when it is there."""
        if self._scale.device != torch.device(device):
            for name in ("_scale", "_hysteresis", "_iter", "_last_overflow"):
                setattr(self, name, getattr(self, name).to(device))
        return self

    @property
    def cur_scale(self) -> torch.Tensor:
        return self._scale

    @cur_scale.setter
    def cur_scale(self, value) -> None:
        self._scale.fill_(value)

    loss_scale = cur_scale

    @property
    def cur_hysteresis(self) -> int:  # host reads: for logs and tests
        return int(self._hysteresis)

    @property
    def cur_iter(self) -> int:
        return int(self._iter)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def inverse(self) -> torch.Tensor:
        return torch.reciprocal(self._scale)

    @torch.no_grad()
    def update(self, stats: torch.Tensor) -> None:
        """After a step whose (all-reduced) pass-1 stats are ``stats``: DeepSpeed's update_scale, on device."""
        overflow = stats[1] != 0
        shrink = overflow & ((self.delayed_shift == 1) | (self._hysteresis == 1))
        scale_on_overflow = torch.where(shrink, torch.clamp(self._scale / self.scale_factor, min=self.min_scale),
                                        self._scale)
        hysteresis_on_overflow = torch.where(shrink, self._hysteresis, self._hysteresis - 1)
        stable = self._iter - self._last_overflow - 1
        grow = (stable > 0) & (stable % self.scale_window == 0)
        hysteresis_ok = torch.full_like(self._hysteresis, self.delayed_shift) if self.consecutive_hysteresis \
            else torch.where(grow, torch.full_like(self._hysteresis, self.delayed_shift), self._hysteresis)
        scale_ok = torch.where(grow, self._scale * self.scale_factor, self._scale)
        self._scale.copy_(torch.where(overflow, scale_on_overflow, scale_ok))
        self._hysteresis.copy_(torch.where(overflow, hysteresis_on_overflow, hysteresis_ok))
        self._last_overflow.copy_(torch.where(overflow, self._iter, self._last_overflow))
        self._iter += 1


def _device_loss_scaler(zero):
    """ZeRO's loss scaler, a dynamic one turned into (or kept as) a DeviceLossScaler on the partitions' device:
    at attach, and at every step, since a loaded checkpoint brings back its pickled scaler (DeepSpeed's host
    one from a stock checkpoint, or ours mapped onto the CPU)."""
    scaler = zero.loss_scaler
    if getattr(scaler, "dynamic", False) and not isinstance(scaler, DeviceLossScaler):
        scaler = zero.loss_scaler = DeviceLossScaler.like(scaler)
    if isinstance(scaler, DeviceLossScaler):
        partitions = getattr(zero, "single_partition_of_fp32_groups", None)  # ZeRO-1/2; ZeRO-3's are below
        scaler.to((partitions or zero.fp32_partitioned_groups_flat)[0].device)
    return scaler


def _follow_device_skips(engine, optimizer: FusedAdamWClip) -> None:
    """``engine.skipped_steps`` = the optimizer's device count of skipped steps (plus what a loaded
    checkpoint recorded): DeepSpeed counts only host-reported overflows, which this optimizer never reports.

    And the LR schedule of a skipped step. DeepSpeed steps its ``lr_scheduler`` only after a step that was not
    skipped; the skip is decided on the device here, so the engine steps the schedule every time and the
    decision is read one step later, before the next update takes its lr (by then the device is long past
    it: no wait in practice): when the previous step was skipped, the schedule and the param groups'
    hyper-parameters go back to where they were before it (:class:`_ScheduleRollback`). Every update thus uses
    DeepSpeed's lr, and a checkpoint saved after a skipped step holds DeepSpeed's schedule. Between a skipped
    step and the next one, ``get_lr()`` shows the lr one schedule step ahead."""
    base = type(engine)
    if getattr(base, "_loongforge_skips", False):
        return

    def get(self) -> int:
        return self.__dict__.get("_lf_skip_offset", 0) + self.basic_optimizer.skipped_steps

    def set_(self, value: int) -> None:  # DeepSpeed's __init__ (0) and load_checkpoint
        self.__dict__["_lf_skip_offset"] = int(value) - self.basic_optimizer.skipped_steps

    def _take_model_step(self, lr_kwargs):
        rollback = _ScheduleRollback.of(self)
        rollback.settle()
        rollback.before_step()
        base._take_model_step(self, lr_kwargs)
        rollback.after_step()

    def save_checkpoint(self, *args, **kwargs):
        _ScheduleRollback.of(self).settle()
        return base.save_checkpoint(self, *args, **kwargs)

    def was_step_applied(self) -> bool:  # DeepSpeed's, with the device's skip decision (a host read when asked)
        skipped = self.basic_optimizer.last_skipped
        return base.was_step_applied(self) and (skipped is None or not int(skipped))

    offset = engine.__dict__.pop("skipped_steps", 0)
    engine.__class__ = type(base.__name__, (base,), {"skipped_steps": property(get, set_), "_loongforge_skips": True,
                                                     "_take_model_step": _take_model_step,
                                                     "save_checkpoint": save_checkpoint,
                                                     "was_step_applied": was_step_applied,
                                                     "__module__": base.__module__})
    engine.__dict__["_lf_skip_offset"] = int(offset)


class _ScheduleRollback:
    """The engine's LR schedule before its last step, kept until that step's skip flag is known (see
    :func:`_follow_device_skips`). The flag is copied to pinned host memory behind the step and read at the
    next step through an event: no host sync unless the host is a whole step ahead of the device."""

    def __init__(self, engine):
        self.engine = engine
        self.saved: tuple[dict, list[dict]] | None = None
        self.flag: torch.Tensor | None = None
        self.event = None

    @classmethod
    def of(cls, engine) -> "_ScheduleRollback":
        rollback = engine.__dict__.get("_lf_schedule_rollback")
        if rollback is None:
            rollback = engine.__dict__["_lf_schedule_rollback"] = cls(engine)
        return rollback

    def _groups(self) -> list[dict]:
        scheduler = self.engine.lr_scheduler
        return getattr(scheduler, "optimizer", self.engine.basic_optimizer).param_groups

    def before_step(self) -> None:
        scheduler = self.engine.lr_scheduler
        if scheduler is None or not callable(getattr(scheduler, "state_dict", None)):
            self.saved = None  # nothing to roll back (a scheduler without state_dict cannot be checkpointed)
            return
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self._groups()]
        self.saved = (copy.deepcopy(scheduler.state_dict()), groups)

    def after_step(self) -> None:
        skipped = self.engine.basic_optimizer.last_skipped
        if self.saved is None or skipped is None:  # no schedule, or no gradient at all: nothing was skipped
            self.saved = None
            return
        if skipped.device.type == "cpu":
            self.flag, self.event = skipped, None
            return
        if self.flag is None or not self.flag.is_pinned():  # one pinned flag, reused: settle() read it already
            self.flag = torch.empty((), dtype=skipped.dtype, pin_memory=True)
        self.flag.copy_(skipped, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def settle(self) -> None:
        """Roll the schedule back if the last step was skipped; then nothing is pending."""
        saved, self.saved = self.saved, None
        if saved is None or self.flag is None:
            return
        if self.event is not None and not self.event.query():
            self.event.synchronize()
        if not int(self.flag):
            return
        state, groups = saved
        self.engine.lr_scheduler.load_state_dict(state)
        for group, hyper in zip(self._groups(), groups):
            group.update(hyper)
        logger.info("optimizer step %d was skipped (a non-finite gradient): its LR schedule step is undone",
                    self.engine.global_steps)


def _world_all_reduce(stats: torch.Tensor) -> None:
    from deepspeed import comm as dist

    dist.all_reduce(stats)


def _step_and_record_norm(zero, optimizer: FusedAdamWClip, per_group: list) -> None:
    """The fused step over ZeRO's prepared buckets, unscaled by ZeRO's loss scale (the device scaler's inverse,
    updated from the step's stats after it; or a host constant), and the norm ZeRO reports."""
    scaler = _device_loss_scaler(zero)
    device_scaler = isinstance(scaler, DeviceLossScaler) and not zero.custom_loss_scaler
    optimizer.step_buckets(per_group, inv_scale=scaler.inverse() if device_scaler else 1.0 / float(zero.loss_scale))
    if device_scaler:
        scaler.update(optimizer.last_stats)
    # a skipped step's norm is inf, as DeepSpeed's ZeRO reports an overflow step's (ours would be nan with any nan)
    norm, stats = optimizer.last_grad_norm, optimizer.last_stats
    zero._global_grad_norm = norm if norm is None else norm.masked_fill(stats[1] != 0, float("inf"))


@torch.no_grad()
def _fused_zero_step(zero, closure=None):
    """DeepSpeedZeroOptimizer.step (ZeRO-1/2, no offload) with the overflow check, norm and clip passes
    replaced by one FusedAdamWClip step over every group. Follows DeepSpeed 0.19.8's step, except that the
    kernel reads each group's flat bf16/fp16 gradient partition as it is and writes the fp32 partition and the
    bf16/fp16 partition itself (DeepSpeed converts the gradients to an fp32 copy per group and copies the
    fp32 partition back afterwards: two more passes, and fp32 gradients for every group at once here)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import all_gather_dp_groups
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    zero.micro_step_id = INITIAL_MICRO_STEP_ID
    zero._wait_for_offload_copies()
    zero.overflow = False  # a non-finite step is skipped on the device, never reported to the host
    optimizer = zero.loongforge_optimizer
    fp32_groups = zero.single_partition_of_fp32_groups
    per_group, lows = [], []  # lows[i]: group i's fp32 model partition to copy the stepped fp32 one into
    for i in range(len(zero.bit16_groups)):
        zero.free_grad_in_param_list(zero.params_not_in_partition[i])
        partition_id = dist.get_rank(group=zero.real_dp_process_group[i])
        low = zero.parallel_partitioned_bit16_groups[i][partition_id]
        fp32_model = low.dtype == fp32_groups[i].dtype  # the fp32 partition is stepped, then copied below
        lows.append(low if fp32_model else None)
        grad_dtype = fp32_groups[i].dtype if fp32_model else low.dtype
        flat = zero._get_preflattened_grad_partition(i)
        pieces = zero.averaged_gradients[i] if flat is None else None
        accumulated = flat.dtype if flat is not None else pieces[0].dtype if pieces else grad_dtype
        if accumulated == torch.float32:  # "data_types": {"grad_accum_dtype": "fp32"}: the kernel reads fp32
            grad_dtype = accumulated      # gradients of a bf16/fp16 partition as they are (not rounded first)
        if pieces is not None and all(g.dtype == grad_dtype for g in pieces):
            # the per-parameter gradient views, read where they are: DeepSpeed would flatten them into a new
            # partition-sized tensor first (a copy of every gradient; 1.8 ms and 3.4 GiB in the e2e mixtral step)
            grad = pieces
        else:
            if flat is None:
                group = zero.real_dp_process_group[i]
                if dist.get_rank(group=group) == dist.get_world_size(group=group) - 1:
                    flat = zero.flatten_dense_tensors_aligned(pieces, int(zero.partition_size[i]))
                else:
                    flat = zero.flatten(pieces)
            assert flat.numel() == zero.partition_size[i], (flat.numel(), zero.partition_size[i])
            grad = flat.to(grad_dtype)  # a no-op unless grads differ
        per_group.append((optimizer.param_groups[i],
                          [optimizer.partition_bucket(i, fp32_groups[i], grad, None if fp32_model else low)]))
    _step_and_record_norm(zero, optimizer, per_group)
    for i in range(len(zero.bit16_groups)):  # the gradients were read in place: release them only now
        zero.free_grad_in_param_list(zero.params_in_partition[i])
        zero._release_preflattened_grad_buffers(i)
        zero.averaged_gradients[i] = None
        zero.all_grad_tensors[i] = None
    del per_group
    zero._lazy_init_hp_params_optimizer_state()
    for low, fp32 in zip(lows, fp32_groups):
        if low is not None:
            low.data.copy_(fp32.data)
    all_gather_dp_groups(groups_flat=zero.bit16_groups_flat,
                         partitioned_param_groups=zero.parallel_partitioned_bit16_groups,
                         dp_process_group=zero.real_dp_process_group,
                         start_alignment_factor=zero.nccl_start_alignment_factor,
                         allgather_bucket_size=zero.allgather_bucket_size)
    for i in range(len(zero.bit16_groups)):
        zero._update_model_bit16_weights(i)
