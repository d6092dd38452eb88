"""``initialize``: ``deepspeed.initialize`` that applies the config's ``"loongforge"`` block.

    engine, optimizer, loader, scheduler = ds_loongforge.initialize(model=model, model_parameters=params, config=cfg)

Same arguments and return values as ``deepspeed.initialize``. With ``"loongforge": {"enabled": true}`` in the
config (a dict, a JSON path, or ``args.deepspeed_config``), before DeepSpeed builds its engine:

1. the op settings (``strict_ops``) are applied, and with ``moe.ep_size`` > 1 torch.distributed is initialised
   as ``deepspeed.initialize`` would (its first step, taken early: inject needs the ranks);
2. ``inject(model, config)`` replaces RMSNorm, SwiGLU MLP and MoE modules (one log line per family and the
   modules left as they were, with the reason);
3. parameters the caller collected before (``model_parameters``, a client optimizer's groups) are remapped to
   the replacements' Parameters by name, and an MLP's gate_proj and up_proj to the one gate_up_proj they were
   fused into (its place is the gate's, Adam state held for both is joined row-wise): injection copies MLP and
   expert weights into new Parameters, and an optimizer holding the old ones would train tensors the model no
   longer uses (the HF Trainer builds its optimizer before calling ``deepspeed.initialize``); an old Parameter
   with no replacement is an error;
4. the optimizer is FusedAdamWClip when the config selects it (``ds_loongforge.optim.initialize``);
5. ``training_data`` is served by ``ds_loongforge.data.build_dataloader`` (ExpertAwareSampler) when
   ``sampler.expert_aware`` is true, else by DeepSpeed's own loader;
6. once the engine is built, ``ds_loongforge.profiler`` starts on it when ``profiler.enabled`` is true.

Without the block, with ``"enabled": false``, or with ``LOONGFORGE_DISABLE=1`` this is exactly
``deepspeed.initialize``; in the first two cases the engine's ``load_checkpoint`` still recognises a checkpoint
saved with LoongForge's fused MLP and rebuilds its optimizer state for the stock layout (``_install_checkpoint_load``).
``install(deepspeed)`` makes ``deepspeed.initialize`` itself this function; the
``.pth`` autoloader (``ds_loongforge._autoload``) calls it when ``deepspeed`` is imported, so unmodified scripts
(direct calls, HF Trainer, accelerate: all look ``deepspeed.initialize`` up at call time) get it from the
config alone.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import sys
import threading
from typing import Any

from ds_loongforge.integrations._patching import ORIGINAL_ATTR as _ORIGINAL_ATTR, patch_once

logger = logging.getLogger("ds_loongforge")

ENV_DISABLE = "LOONGFORGE_DISABLE"
_reentry = threading.local()  # optim.initialize calls deepspeed.initialize: that inner call must be the stock one


def disabled_by_env() -> bool:
    """True when ``LOONGFORGE_DISABLE`` is set to anything but "", "0", "false" or "no" (the autoloader's test)."""
    from ds_loongforge._autoload import _disabled

    return _disabled()


def stock_initialize():
    """The unwrapped ``deepspeed.initialize``."""
    import deepspeed

    return getattr(deepspeed.initialize, _ORIGINAL_ATTR, deepspeed.initialize)


def install(deepspeed_module) -> None:
    """Make ``deepspeed_module.initialize`` apply the loongforge block (idempotent)."""
    patch_once(deepspeed_module, "initialize", lambda original, *args, **kwargs: _initialize(original, args, kwargs))


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the ``"loongforge"`` block applied (see the module doc)."""
    return _initialize(stock_initialize(), args, kwargs)


def _initialize(original, args: tuple, kwargs: dict):
    if getattr(_reentry, "active", False):
        return original(*args, **kwargs)
    if disabled_by_env():  # stock, with one warning when the config asks for LoongForge
        from ds_loongforge._autoload import warn_opt_out

        warn_opt_out(args, kwargs)
        return original(*args, **kwargs)
    bound = inspect.signature(original).bind(*args, **kwargs)
    call = dict(bound.arguments)
    if _two_config_sources(call):  # DeepSpeed refuses to choose ("Not sure how to proceed"): so do we
        return original(*args, **kwargs)
    ds_config = _resolve_config(call)
    if not isinstance(ds_config, dict) or "loongforge" not in ds_config:
        _install_checkpoint_load()
        return original(*args, **kwargs)
    from ds_loongforge.config import parse_config

    config = parse_config(ds_config)  # a disabled block is validated too: a typo must not pass silently
    if not config.enabled:
        _install_checkpoint_load()
        return original(*args, **kwargs)
    _reentry.active = True
    try:
        return _initialize_enabled(original, call, ds_config, config)
    finally:
        _reentry.active = False


def _install_checkpoint_load() -> None:
    """Every engine, LoongForge's or stock (the block off or absent), loads checkpoints through
    ``ds_loongforge.checkpoint``: a run saved with LoongForge's fused MLP (one ``gate_up_proj`` for an MLP's gate
    and up projections) and resumed without it, or the other way, has its ZeRO optimizer state in the other
    parameter layout, which DeepSpeed refuses at ZeRO-1/2 ("parameter-alignment layout does not match") and, at
    ZeRO-3 on several ranks, loads as it is: every MLP's masters and moments would be other rows'. Checkpoints in
    the engine's own layout go to DeepSpeed's load unchanged (the check reads the saved parameter names, not the
    weights)."""
    from ds_loongforge import checkpoint

    checkpoint.install()


def _two_config_sources(call: dict) -> bool:
    """A config in ``args`` (--deepspeed_config) and one in the call: stock DeepSpeed raises; the enabled hook used
    to take the call's and blank the args', so the run's config depended on whether LoongForge was on."""
    cli_args = call.get("args")
    in_args = cli_args is not None and any(getattr(cli_args, name, None) is not None
                                           for name in ("deepspeed_config", "deepscale_config"))
    return in_args and (call.get("config") is not None or call.get("config_params") is not None)


def _resolve_config(call: dict) -> Any:
    """The DeepSpeed config as ``deepspeed.initialize`` finds it (``config``, ``config_params`` or
    ``args.deepspeed_config``/``args.deepscale_config``), loaded into a dict; ``None`` when there is none."""
    from ds_loongforge._autoload import config_source

    config = config_source(call)
    if config is None or isinstance(config, dict):
        return config
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


def _refuse_expert_parallelism_under_zero3(config):
    # DeepSpeed's own assertion names its native MoE and AutoEP, not the setting to change
    raise ValueError(f"[LoongForge] moe.ep_size={config.moe.ep_size} shards the experts over DeepSpeed's "
                     "expert-parallel groups, which DeepSpeed does not support under ZeRO stage 3; set "
                     "\"loongforge\": {\"moe\": {\"ep_size\": 1}} (every rank holds the experts, ZeRO-3 "
                     "partitions them) or use ZeRO stage 1 or 2")


def _initialize_enabled(original, call: dict, ds_config: dict, config):
    import torch

    from ds_loongforge.config import apply_op_settings, throughput_timer_setting
    from ds_loongforge.integrations.fused_loss import register_for_zero3
    from ds_loongforge.integrations.inject import inject, moe_blocks
    from ds_loongforge.optim import FusedAdamWClip, uses_fused_adamw_clip
    from ds_loongforge.optim import initialize as optim_initialize
    from ds_loongforge.optim.ds_integration import check_zero_setup, split_client_optimizer, zero_section

    _ensure_log_handler()
    model = call.get("model")
    if model is None:
        raise ValueError("ds_loongforge.initialize: no model given (deepspeed.initialize requires a model)")
    fused_adamw_clip = uses_fused_adamw_clip(ds_config)
    if fused_adamw_clip:
        check_zero_setup(ds_config)  # before inject: nothing changed when the setup cannot run
    stage = int(zero_section(ds_config).get("stage", 0))
    if stage == 3 and config.moe.ep_size > 1 and config.moe.expert_masked and moe_blocks(model):
        _refuse_expert_parallelism_under_zero3(config)  # before inject: the model is left as it was given
    apply_op_settings(config)
    if config.moe.ep_size > 1:
        _init_distributed(call, config.moe.ep_size)
        _expert_groups_in_config_layout(ds_config, config.moe.ep_size)

    params_before = dict(model.named_parameters())
    inject(model, config)
    if stage == 3 and any(getattr(p, "allreduce", True) is False for p in model.parameters()):
        _refuse_expert_parallelism_under_zero3(config)  # a model the script injected itself
    if stage == 3:
        register_for_zero3(model)  # the fused loss's head weight, gathered for the model's forward and backward
    remap = _parameter_remap(params_before, dict(model.named_parameters()))
    if call.get("model_parameters") is not None:
        call["model_parameters"] = _remap_model_parameters(call["model_parameters"], remap)
    client_optimizer = call.get("optimizer")
    if hasattr(client_optimizer, "param_groups"):
        moved = _remap_optimizer(client_optimizer, remap)
        if moved:
            logger.info("[LoongForge] client optimizer: %d parameters remapped to the injected modules", moved)

    # DeepSpeed reads the config from one place only; pass it as a dict and hide it from args
    call.pop("config_params", None)
    call["config"] = throughput_timer_setting(ds_config, config)
    cli_args = call.get("args")
    if cli_args is not None and (getattr(cli_args, "deepspeed_config", None) is not None
                                 or getattr(cli_args, "deepscale_config", None) is not None):
        cli_args = copy.copy(cli_args)
        for name in ("deepspeed_config", "deepscale_config"):
            if hasattr(cli_args, name):
                setattr(cli_args, name, None)
        call["args"] = cli_args

    training_data = call.get("training_data")
    own_loader = training_data is not None and config.sampler.expert_aware
    if own_loader:
        from ds_loongforge.data.signatures import has_moe_router

        own_loader = has_moe_router(model)
        if not own_loader:
            logger.info("[LoongForge] training data: DeepSpeed's loader (%s has no MoE router, so the expert-aware "
                        "sampler has no expert load to balance)", type(model).__name__)
    if own_loader:
        call["training_data"] = None

    if isinstance(client_optimizer, FusedAdamWClip):
        # ds_loongforge.optim.initialize built it and calls deepspeed.initialize (this hook) with it; it attaches
        # the optimizer to the engine once this returns
        logger.info("[LoongForge] optimizer: FusedAdamWClip (built by ds_loongforge.optim.initialize)")
        engine, optimizer, loader, scheduler = original(**call)
    elif fused_adamw_clip:
        logger.info("[LoongForge] optimizer: FusedAdamWClip (AdamW + global-norm clip + non-finite skip)")
        engine, optimizer, loader, scheduler = optim_initialize(**call)
    else:
        logger.info("[LoongForge] optimizer: not replaced (%s)", _optimizer_reason(client_optimizer))
        if config.moe.ep_size > 1 and isinstance(client_optimizer, torch.optim.Optimizer):
            split = split_client_optimizer(client_optimizer)
            if split is not None:
                call["optimizer"] = split
                logger.info("[LoongForge] client optimizer: %s with its expert parameters in 'moe' groups of their "
                            "own for ZeRO (%d added; each follows its source group's lr and other hyper-parameters)",
                            type(split).__name__, len(split.param_groups) - len(client_optimizer.param_groups))
        elif client_optimizer is None and _unsplit_expert_groups(call.get("model_parameters"), model):
            # DeepSpeed splits the groups for its config's optimizer by their "name" (KeyError on a group without
            # one, as HF-style decay / no-decay groups come): split here, names given where missing
            from ds_loongforge.modules.moe_deepspeed import moe_param_groups

            call["model_parameters"] = moe_param_groups(call["model_parameters"])
        engine, optimizer, loader, scheduler = original(**call)

    if own_loader:
        from ds_loongforge.data import build_dataloader

        world_size, rank = engine.dp_world_size, engine.global_rank
        if engine.mpu is not None:
            world_size, rank = engine.mpu.get_data_parallel_world_size(), engine.mpu.get_data_parallel_rank()
        # drop_last as DeepSpeed's own loader takes it ("dataloader_drop_last"): a sampler left at false topped the
        # epoch up with repeated samples where stock DeepSpeed drops the incomplete micro-batches
        loader = build_dataloader(training_data, config, engine.module, engine.train_micro_batch_size_per_gpu(),
                                  rank=rank, world_size=world_size, collate_fn=call.get("collate_fn"),
                                  drop_last=engine.dataloader_drop_last())
        engine.training_dataloader = loader
        logger.info("[LoongForge] training data: ExpertAwareSampler (%d batches per epoch on this rank)", len(loader))
    elif training_data is not None and not config.sampler.expert_aware:
        logger.info("[LoongForge] training data: DeepSpeed's loader (sampler.expert_aware is false)")
    elif training_data is None and config.sampler.expert_aware:
        logger.info("[LoongForge] sampler: not applied (no training_data was passed to deepspeed.initialize: the "
                    "script loads its own batches, as the HF Trainer and accelerate do); "
                    "ds_loongforge.data.build_dataloader(dataset, config, model, batch_size) builds a loader with "
                    "the ExpertAwareSampler")
    if config.profiler.enabled:
        _start_profiler(engine, config.profiler.report_every)
    _release_cpu_allreduce_buffers()
    # an expert-parallel checkpoint keeps the experts in per-expert files, which DeepSpeed reads only into MoE
    # layers: ds_loongforge.checkpoint loads them, and the optimizer state, into unsharded experts; a checkpoint saved
    # with the MLPs' gate_proj and up_proj (stock) into their fused gate_up_proj, or the other way; and ZeRO-3's
    # consolidated 16-bit state dict (the Trainer's save_model) gets transformers' keys for the fused MLPs
    _install_checkpoint_load()
    return engine, optimizer, loader, scheduler


SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def _release_cpu_allreduce_buffers() -> None:
    """DeepSpeed's CPU all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp, 0.19.8) creates one POSIX shared-memory
    buffer per rank, ``SHM_BUFFER``, maps every rank's when the process group starts, and never unlinks them:
    each CPU run under the launcher left world x 69 MB in /dev/shm, and a machine running the tests for days filled
    its memory. Once every rank has mapped them (a barrier, after the engine's own collectives), each rank
    unlinks its own name: the mappings stay valid, and the memory is freed when the processes end. One process
    started by the launcher has one too (LOCAL_SIZE 1). A no-op on other accelerators."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or not dist.is_initialized():
        return
    dist.barrier()
    path = SHM_BUFFER.format(uid=os.getuid(), addr=os.environ.get("MASTER_ADDR"), port=os.environ.get("MASTER_PORT"),
                             rank=dist.get_rank())
    try:
        os.unlink(path)
    except FileNotFoundError:  # shared memory not used (ranks on several hosts) or already released
        pass


def _init_distributed(call: dict, ep_size: int) -> None:
    """torch.distributed as ``deepspeed.initialize`` sets it up (its own first step, with the call's
    ``distributed_port`` and ``dist_init_required``), done before inject: expert parallelism needs the ranks to
    know which experts each holds. An unmodified script leaves that to deepspeed.initialize, which would come too
    late for inject."""
    import torch.distributed

    if torch.distributed.is_initialized():
        return
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=call.get("distributed_port", TORCH_DISTRIBUTED_DEFAULT_PORT),
                               dist_init_required=call.get("dist_init_required"))
    logger.info("[LoongForge] torch.distributed initialised before inject (moe.ep_size=%d), as "
                "deepspeed.initialize would have", ep_size)


def _expert_groups_in_config_layout(ds_config: dict, ep_size: int) -> None:
    """DeepSpeed's expert groups for ep_size in the layout the config asks for
    (``use_data_before_expert_parallelism``), created before inject: inject's layers look their group up by name
    (``ep_size_<n>``) and copy the experts of their rank in it, and whichever call creates a name fixes its layout
    for the process, the engine's included. Created by the layers, they would take DeepSpeed's default layout
    whatever the config says."""
    from deepspeed.runtime.config import get_expert_data_topo_config

    from ds_loongforge.modules.moe_deepspeed import expert_parallel_group

    expert_parallel_group(ep_size, bool(get_expert_data_topo_config(ds_config)))


def _start_profiler(engine, report_every: int) -> None:
    from ds_loongforge import profiler

    if profiler.is_active():
        logger.warning("[LoongForge] profiler: already profiling another engine, this one is not profiled; call "
                       "ds_loongforge.profiler.stop() before building it")
        return
    profiler.start(engine, report_every=report_every)
    logger.info("[LoongForge] profiler: on (%s); ds_loongforge.profiler.stop() returns the report",
                f"a report every {report_every} steps" if report_every else "report on demand")


def _optimizer_reason(client_optimizer) -> str:
    if client_optimizer is not None:
        return "the script passes its own optimizer"
    return 'neither "optimizer": {"type": "LoongForgeAdamW"} nor loongforge.optimizer.fused_adamw_clip is set'


class _FusedPart:
    """Where an old Parameter went when inject fused it with others into one (FusedSwiGLUMLP: gate_proj and
    up_proj -> gate_up_proj, rows [gate; up]): the new Parameter and the old ones in its row order."""

    def __init__(self, new, parts: list):
        self.new, self.parts = new, parts


def _parameter_remap(before: dict, after: dict) -> dict[int, Any]:
    """id(old Parameter) -> its replacement: matched by name (inject keeps parameter names), except an MLP's
    gate_proj / up_proj weight and bias, which FusedSwiGLUMLP holds as one gate_up_proj (a :class:`_FusedPart`).
    An old Parameter that left the model and has no replacement here is an error: an optimizer holding it would
    train a tensor the model no longer reads, without a word."""
    remap: dict[int, Any] = {id(old): after[name] for name, old in before.items()
                             if name in after and after[name] is not old}
    live = {id(p) for p in after.values()}
    for name, old in before.items():
        if name in after or id(old) in live or id(old) in remap:
            continue
        owner, _, leaf = name.rpartition(".")
        module, _, proj = owner.rpartition(".")
        fused = f"{module}.gate_up_proj.{leaf}" if module else f"gate_up_proj.{leaf}"
        gate = f"{module}.gate_proj.{leaf}" if module else f"gate_proj.{leaf}"
        up = f"{module}.up_proj.{leaf}" if module else f"up_proj.{leaf}"
        if proj in ("gate_proj", "up_proj") and fused in after and gate in before and up in before:
            part = _FusedPart(after[fused], [before[gate], before[up]])
            remap[id(before[gate])] = remap[id(before[up])] = part
            continue
        raise RuntimeError(f"[LoongForge] inject replaced the parameter {name!r} and no parameter of the injected "
                           "model takes its place, so an optimizer built before deepspeed.initialize would train "
                           "a tensor the model no longer reads. Please report this with the model's class; "
                           'meanwhile leave that module family out ("loongforge": {"fused_kernels": ...}) or build '
                           "the optimizer after ds_loongforge.inject")
    return remap


def _remapped_params(params, remap: dict[int, Any], placed: set[int]) -> list:
    """One param list with replacements swapped in; a fused Parameter goes where its first part was, once."""
    out = []
    for p in params:
        target = remap.get(id(p), p)
        if isinstance(target, _FusedPart):
            if id(target.new) in placed:
                continue
            placed.add(id(target.new))
            target = target.new
        out.append(target)
    return out


def _remap_model_parameters(model_parameters, remap: dict[int, Any]):
    """``model_parameters`` (tensors, or param-group dicts) with replaced Parameters swapped in."""
    items = list(model_parameters)
    if not remap:
        return items
    placed: set[int] = set()
    out = []
    for item in items:
        if isinstance(item, dict):
            group = dict(item)
            group["params"] = _remapped_params(_as_list(group["params"]), remap, placed)
            out.append(group)
        else:
            out.extend(_remapped_params([item], remap, placed))
    return out


def _fused_state(optimizer, part: _FusedPart) -> dict | None:
    """The optimizer state of a fused Parameter from its parts' states: tensors shaped like a part are joined
    in the fused row order, the rest (the step count) taken from the first part. None when no part has state;
    an error when only some have (their moments would not fit the fused rows)."""
    import torch

    states = [optimizer.state.get(p) for p in part.parts]
    if not any(states):
        return None
    if not all(states):
        raise RuntimeError("[LoongForge] client optimizer: of the MLP projections fused into one gate_up_proj, "
                           "only some have optimizer state; build the optimizer (or load its state) after "
                           "deepspeed.initialize")
    merged = {}
    for key, value in states[0].items():
        if isinstance(value, torch.Tensor) and value.shape == part.parts[0].shape:
            merged[key] = torch.cat([s[key] for s in states], dim=0)
        else:
            merged[key] = value
    return merged


def _remap_optimizer(optimizer, remap: dict[int, Any]) -> int:
    """Swap replaced Parameters into ``optimizer.param_groups`` (and move their state); returns how many."""
    moved = 0
    placed: set[int] = set()
    parts: dict[int, _FusedPart] = {}
    for group in optimizer.param_groups:
        params = group["params"]
        for param in params:
            target = remap.get(id(param))
            if target is None:
                continue
            moved += 1
            if isinstance(target, _FusedPart):
                parts[id(target.new)] = target
            elif param in optimizer.state:
                optimizer.state[target] = optimizer.state.pop(param)
        params[:] = _remapped_params(params, remap, placed)
    for part in parts.values():
        state = _fused_state(optimizer, part)
        for old in part.parts:
            optimizer.state.pop(old, None)
        if state is not None:
            optimizer.state[part.new] = state
    return moved


def _unsplit_expert_groups(model_parameters, model) -> bool:
    """``model_parameters`` are param-group dicts with no 'moe' group while ``model`` has expert-parallel
    parameters (DeepSpeed's optimizer then splits them, and needs every group named)."""
    groups = model_parameters if isinstance(model_parameters, list) else []
    return (bool(groups) and all(isinstance(g, dict) for g in groups) and not any(g.get("moe") for g in groups)
            and any(getattr(p, "allreduce", True) is False for p in model.parameters()))


def _as_list(params) -> list:
    return [params] if hasattr(params, "data") and not isinstance(params, (list, tuple)) else list(params)


def _ensure_log_handler() -> None:
    """``[LoongForge]`` lines go to stderr when the script configured no logging of its own (rank 0 only,
    as DeepSpeed's own info lines: torch.distributed is not initialised yet, so the launcher's RANK decides)."""
    if logger.hasHandlers():
        if logger.getEffectiveLevel() > logging.INFO and logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    if os.environ.get("RANK", "0") != "0":
        handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
