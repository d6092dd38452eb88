"""Loading a ZeRO-1/2 checkpoint of a model with stacked experts (DeepSpeedExpertMaskedMoE) at another ep_size,
expert-parallel group layout or data-parallel world size, with the optimizer state.

Why DeepSpeed 0.19.8 alone does not:

- Its ZeRO load gives each rank the optimizer partition the same rank saved. Under expert parallelism an expert
  group is partitioned over the expert-data-parallel group, and which experts a rank holds follows the ep_size and
  the layout (``use_data_before_expert_parallelism``). At the same world size the partitions keep their size
  (E x P / world elements whatever the ep_size), so a checkpoint saved at ep_size 2 loads at ep_size 4 without a
  word, and every rank's expert masters and moments are those of other experts: the next step writes them into
  the weights. (Measured here on 4 gloo processes, ZeRO-1 and ZeRO-2, fp32 and bf16.)
- At another world size it refuses ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world
  size is not currently supported"); its universal checkpoints (``ds_to_universal``) know AutoEP's expert layers
  only.

What this does: ``DeepSpeedEngine.load_checkpoint`` of an engine that holds stacked experts (patched when the first
DeepSpeedExpertMaskedMoE is built, like the gradient norm in ``modules.moe_deepspeed``) compares the saved layout
with its own: data-parallel world size, each optimizer group's partition count, and each expert group's
expert-parallel rank of this rank. When they agree, DeepSpeed's own load runs unchanged. When they do not, DeepSpeed
loads everything but the optimizer (weights, per-expert files by global expert id, LR scheduler, step counters,
client state), and then every parameter's fp32 master and Adam moments are rebuilt from the saved partitions
(``param_slice_mappings``: each rank's fragment of each parameter, in partition order; the experts of an expert
group from the ranks of each saved expert-data-parallel group, concatenated by expert-parallel rank) and cut to this
rank's partition, as DeepSpeed's universal-checkpoint loader cuts its files. The base optimizer takes the moments,
the step count and the saved groups' hyper-parameters (the lr an LR scheduler last set, as DeepSpeed's own load
restores it) through its own ``load_state_dict``. Without ZeRO (one optimizer file per expert-parallel rank) another
ep_size is an error before anything loads.

An engine whose experts are unsharded (plain ExpertMaskedMoE layers: a model injected with ``moe.ep_size`` 1,
which DeepSpeed does not see as MoE) reads no per-expert files, so DeepSpeed alone fails on the missing expert
weights of an expert-parallel checkpoint. Here the module state is the model file plus each layer's per-expert files
stacked in expert order, and the ZeRO-1/2 optimizer state is rebuilt as above, every expert on every rank (pairing
the saved groups by the parameters they held). The other way, a checkpoint of unsharded experts (no per-expert
files) into expert-parallel layers, DeepSpeed would look for per-expert files; its load runs as for a model without
MoE layers, the stacked experts cut to each rank's, and the optimizer state is rebuilt the same way. Without ZeRO
only the weights load, either way (an error says so). Across expert sharding the optimizer's groups change too
(DeepSpeed splits off expert groups only with expert-parallel layers), so an LR scheduler's per-group state is
fitted to them (``fit_scheduler_state``): the engine's scheduler during DeepSpeed's load, the HF Trainer's own
``scheduler.pt`` during the Trainer's load and accelerate's ``scheduler.bin`` during its ``load_state``.
integrations.deepspeed_hook installs this for engines of unsharded experts; an expert-parallel layer installs it
when built.

Either way the load ends with a check that cannot be fooled by sizes: every fp32 master this rank holds, rounded to
the training dtype, must be the weight the checkpoint's module files hold for it (bit for bit, NaN matching NaN),
as it is after every step. A mismatch is an error on every rank, naming the parameters.

The MLP layout: LoongForge's FusedSwiGLUMLP trains one ``gate_up_proj`` where transformers has ``gate_proj`` and
``up_proj`` (its state dict keeps transformers' keys, but DeepSpeed names optimizer state by parameter). A
checkpoint of one layout loaded into an engine of the other (the block turned on for a stock run, or off, or
removed, for a LoongForge one: ``integrations.deepspeed_hook`` installs this for every engine) has its optimizer
state rebuilt per parameter, the rows joined or cut in halves: ZeRO-1/2 as above (DeepSpeed refused it), ZeRO-3 from
each parameter's partitions (``SavedZero3``; DeepSpeed loaded it silently wrong on several ranks; also at another
world size, which DeepSpeed's ZeRO-3 load refuses), and without ZeRO a torch optimizer's state by place
(``_unpartitioned_state_across_mlp_layout``; torch refused it) and FP16_Optimizer's flat groups by the order of
their elements (``_flat_state_across_mlp_layout``; with MLP biases DeepSpeed loaded them silently wrong). Which
parameters are compared is the optimizer's (frozen ones are saved apart); frozen parameters saved in the other
layout are joined or cut under this engine's names (``_frozen_in_engine_layout``; DeepSpeed looked them up by
name), and so are the per-parameter folders of a universal checkpoint (``_universal_across_mlp_layout``). ZeRO-3's
consolidated 16-bit state dict (the HF Trainer's ``save_model``) gets transformers' keys (``stock_mlp_keys``).

Saving: without ZeRO in bf16/fp16, DeepSpeed's FP16_Optimizer and FP16_UnfusedOptimizer save their fp32 masters with
no parameter names; ``save_checkpoint`` adds which parameter each is to the model file
(``sixteen_bit_optimizer_params``), by which ``loongforge_export`` reads them. A load drops that entry from the
client state it returns.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from ds_loongforge.integrations._patching import patch_once

logger = logging.getLogger("ds_loongforge")

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _note(message: str, *args) -> None:
    """An INFO line on what a load did across the MLP layout, shown also to a run with the block off or absent
    (whose ``ds_loongforge`` logger has no handler otherwise): the checkpoint was converted."""
    from ds_loongforge.integrations.deepspeed_hook import _ensure_log_handler

    _ensure_log_handler()
    logger.info(message, *args)


class CheckpointLayoutError(RuntimeError):
    """A checkpoint's optimizer state cannot be loaded into this engine as asked; the message says why and what
    to do."""


def _lp_groups(optimizer):
    """The 16-bit parameter groups of a ZeRO-1/2 optimizer (DeepSpeedZeroOptimizer: bit16_groups) or
    BF16_Optimizer (bf16_groups), whose parameters carry DeepSpeed's fp32 fragment mappings; None for others."""
    return getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None)


def _expert_rank(param) -> tuple[int, int]:
    """(expert-parallel rank, ep_size) of an expert parameter, from DeepSpeed's groups."""
    from deepspeed.utils import groups

    return (groups._get_expert_parallel_rank(param.group_name),
            groups._get_expert_parallel_world_size(param.group_name))


class _SavedRankFiles:
    """The optimizer files of one saved step, one a rank (``_files``, ``world``, ``folder``), read when first used."""

    def optim(self, rank: int) -> dict:
        """Rank ``rank``'s saved optimizer state dict, read (memory-mapped) on first use: comparing layouts reads
        rank 0's alone, rebuilding the state every rank's."""
        if rank not in self._optim:
            from ds_loongforge.export import _load

            self._optim[rank] = _load(self._files[rank])["optimizer_state_dict"]
        return self._optim[rank]

    def _step(self, key: str):
        """The base optimizer's step count (None before the first step; its state dict is each file's ``key``), the
        same in every saved group and rank, else an error."""
        states = [state for rank in range(self.world) for state in self.optim(rank)[key]["state"].values()]
        steps = {None if "step" not in state else float(state["step"]) for state in states}
        if len(steps) > 1:
            raise CheckpointLayoutError(f"{self.folder}: the saved optimizer groups have taken different numbers of "
                                        f"steps ({sorted(steps, key=str)}); one step count is needed to load them at "
                                        "another layout")
        return next((state["step"] for state in states if "step" in state), None)


class SavedOptimizer(_SavedRankFiles):
    """The ZeRO-1/2 optimizer files of one saved step: its layout, and each parameter's fp32 master and moments
    rebuilt from the ranks' partitions (memory-mapped; one parameter is materialised at a time)."""

    def __init__(self, folder: str):
        from deepspeed.runtime.config import get_expert_data_topo_config

        from ds_loongforge.export import _model_states, _zero_files, expert_data_parallel_ranks

        self.folder = folder
        states = _model_states(folder)
        self.world = int(states["dp_world_size"])
        files = _zero_files(folder, self.world)
        if not files:
            raise CheckpointLayoutError(f"{folder} holds no ZeRO optimizer files (*_optim_states.pt): it was saved "
                                        "without the optimizer, or without ZeRO")
        self._files, self._optim = files, {}
        counts = self.optim(0)["partition_count"]
        self.partition_count = list(counts) if isinstance(counts, list) else [counts] * len(states["param_shapes"])
        self.before = bool(get_expert_data_topo_config(states.get("ds_config") or {}))
        self.param_shapes = states["param_shapes"]
        self.shapes: dict[str, tuple[int, torch.Size]] = {}
        for g, shapes in enumerate(self.param_shapes):
            for name, shape in shapes.items():
                self.shapes[name] = (g, torch.Size(shape))
        # per expert group: ep_size, and each expert-parallel rank's expert-data-parallel ranks (partition order)
        self.expert_layout: dict[int, tuple[int, list[list[int]], dict[int, int]]] = {}
        for g, count in enumerate(self.partition_count):
            if count == self.world:
                continue
            if self.world % count:
                raise CheckpointLayoutError(f"{folder}: optimizer group {g} is partitioned {count} ways over "
                                            f"{self.world} ranks, which no expert-parallel size gives")
            ep_size = self.world // count
            self.expert_layout[g] = (ep_size, *expert_data_parallel_ranks(self.world, ep_size, self.before))

    def step(self):
        """The base optimizer's step count, the same in every saved group and rank (an error otherwise, or when the
        files cannot be cut per parameter)."""
        first = self.optim(0)
        if not isinstance(first.get("base_optimizer_state"), dict) or "param_slice_mappings" not in first:
            raise CheckpointLayoutError(
                f"{self.folder} was saved with \"elastic_checkpoint\": true (or by a DeepSpeed that does not record "
                "each parameter's place in the partitions): its optimizer state loads only at the world size, "
                "ep_size and expert-parallel layout it was saved with")
        return self._step("base_optimizer_state")

    def ep_of(self, group: int, rank: int) -> tuple[int, int] | None:
        """(expert-parallel rank, ep_size) a rank had in a saved expert group; None for a dense group."""
        if group not in self.expert_layout:
            return None
        ep_size, _, ep_rank = self.expert_layout[group]
        return ep_rank[rank], ep_size

    def _fragments(self, group: int, ranks: list[int], name: str, key: str) -> torch.Tensor:
        pieces = []
        for rank in ranks:
            optim = self.optim(rank)
            address = optim["param_slice_mappings"][group].get(name)
            if address is None:
                continue
            flat = (optim["single_partition_of_fp32_groups"][group] if key == "fp32"
                    else optim["base_optimizer_state"]["state"][group][key])
            pieces.append(flat.narrow(0, address.start, address.numel))
        return torch.cat(pieces) if pieces else torch.empty(0)

    def tensor(self, name: str, key: str, experts: range | None = None) -> torch.Tensor:
        """A parameter's saved ``key`` ('fp32', 'exp_avg', 'exp_avg_sq'), whole (a dense parameter) or the given
        global experts of an expert parameter, in fp32. An MLP's ``gate_up_proj`` saved as ``gate_proj`` and
        ``up_proj`` (a run without LoongForge's fused MLP) is their rows joined; the other way, each is its half."""
        if name not in self.shapes:
            return _other_mlp_layout(self, name, key)
        group, shape = self.shapes[name]
        if group not in self.expert_layout:  # a dense parameter, or experts saved unsharded (every one everywhere)
            whole = self._fragments(group, list(range(self.world)), name, key)
            if whole.numel() != shape.numel():
                raise CheckpointLayoutError(f"{self.folder}: {name}'s saved {key} fragments hold {whole.numel()} "
                                            f"elements, the parameter {shape.numel()}")
            whole = whole.view(shape)
            return whole if experts is None else whole[experts.start:experts.stop]
        ep_size, holders, _ = self.expert_layout[group]
        local = shape[0]
        if experts is None:
            experts = range(local * ep_size)
        parts = []
        for e in range(experts.start // local, (experts.stop - 1) // local + 1):
            held = self._fragments(group, holders[e], name, key)
            if held.numel() != shape.numel():
                raise CheckpointLayoutError(
                    f"{self.folder}: {name}'s saved {key} on expert-parallel rank {e} (ranks {holders[e]}) holds "
                    f"{held.numel()} elements, the local experts {shape.numel()}")
            held = held.view(shape)
            lo, hi = max(experts.start, e * local) - e * local, min(experts.stop, (e + 1) * local) - e * local
            parts.append(held[lo:hi])
        return torch.cat(parts)


def _other_mlp_layout(saved, name: str, key: str) -> torch.Tensor:
    """``saved.tensor(name, key)`` for a parameter the checkpoint holds in the other MLP layout: an MLP's
    ``gate_up_proj`` saved as ``gate_proj`` and ``up_proj`` (a run without LoongForge's fused MLP) is their rows
    joined; the other way, each is its half."""
    value = in_either_mlp_layout(name, saved.shapes, lambda n: saved.tensor(n, key))
    if value is None:
        raise CheckpointLayoutError(f"{saved.folder}: the checkpoint's optimizer holds no parameter named {name} "
                                    "(saved from another model?)")
    return value


def _join_rows(gate, up):
    return torch.cat([gate, up])


def _cut_rows(whole, half: int):
    return whole.chunk(2)[half]


def in_either_mlp_layout(name: str, held, fetch, join=_join_rows, cut=_cut_rows):
    """``name``'s value from a checkpoint holding the names ``held``, in either MLP layout: ``fetch(name)``; or an
    MLP's ``gate_up_proj`` saved as ``gate_proj`` and ``up_proj`` (a run without LoongForge's fused MLP),
    ``join(gate's, up's)``; or a ``gate_proj`` / ``up_proj`` saved as one ``gate_up_proj``, ``cut(its, 0 or 1)``
    (rows [gate; up] joined and halved by default). None where the checkpoint holds neither, or ``fetch`` gives
    None for a name it needs (a parameter without optimizer state)."""
    if name in held:
        return fetch(name)
    parts = fused_mlp_parts(name, held)
    if parts is not None:
        values = [fetch(part) for part in parts]
        return None if any(value is None for value in values) else join(*values)
    half = split_mlp_part(name, held)
    if half is not None:
        whole = fetch(half[0])
        return None if whole is None else cut(whole, half[1])
    return None


def _mlp_parts(name: str) -> list[str] | None:
    """``[<mlp>.gate_proj.<leaf>, <mlp>.up_proj.<leaf>]`` for a name ``<mlp>.gate_up_proj.<leaf>`` (FusedSwiGLUMLP,
    rows [gate; up]); else None (the stacked experts' own ``gate_up_proj`` has no leaf)."""
    module, _, rest = name.rpartition("gate_up_proj.")
    if not rest or "." in rest:
        return None
    return [f"{module}gate_proj.{rest}", f"{module}up_proj.{rest}"]


def _mlp_half(name: str) -> tuple[str, int] | None:
    """``(<mlp>.gate_up_proj.<leaf>, 0 or 1)`` for a name ``<mlp>.gate_proj.<leaf>`` / ``<mlp>.up_proj.<leaf>``."""
    for half, proj in enumerate(("gate_proj.", "up_proj.")):
        module, _, rest = name.rpartition(proj)
        if rest and "." not in rest and (not module or module.endswith(".")):
            return f"{module}gate_up_proj.{rest}", half
    return None


def fused_mlp_parts(name: str, saved: dict) -> list[str] | None:
    """``_mlp_parts(name)`` when both are in ``saved``; else None."""
    parts = _mlp_parts(name)
    return parts if parts is not None and all(part in saved for part in parts) else None


def split_mlp_part(name: str, saved: dict) -> tuple[str, int] | None:
    """``_mlp_half(name)`` when the fused one is in ``saved``; else None."""
    half = _mlp_half(name)
    return half if half is not None and half[0] in saved else None


def _has_mlp_projections(names) -> bool:
    """Whether any of these parameter names is an MLP's gate_up_proj or gate_proj / up_proj (a model without them,
    Mixtral's stacked experts for one, has no MLP layout to differ in)."""
    return any(_mlp_parts(name) is not None or _mlp_half(name) is not None for name in names)


def _optimized_names(engine) -> list[str]:
    """The names of the parameters ``engine``'s ZeRO optimizer holds, as its checkpoints' ``param_shapes`` name
    them: frozen parameters are not among them (DeepSpeed saves those apart, ``_frozen_in_engine_layout``)."""
    optimizer = engine.optimizer
    names = getattr(optimizer, "param_names", None) or {}
    groups = _lp_groups(optimizer) or getattr(optimizer, "fp16_groups", None) or []
    return [names[p] for params in groups for p in params if p in names]


def _saved_with_other_mlp_params(engine, folder: str, model_file: str | None = None) -> bool:
    """Whether the checkpoint holds an MLP's gate and up projections as this engine does not: one gate_up_proj
    where the engine has gate_proj and up_proj, or the other way (saved with LoongForge's fused MLP on and loaded
    with it off, or saved by stock DeepSpeed and loaded with LoongForge). DeepSpeed's flat ZeRO partitions then
    hold the same parameters under other names and boundaries: at ZeRO-1/2 its own load refuses them, at ZeRO-3 it
    copies each rank's partition as it is, so the MLPs' masters and moments become other rows' (``model_file``:
    the ZeRO-3 model file, whose ``param_shapes`` name the parameters)."""
    from ds_loongforge.export import MODEL_FILE, CheckpointExportError, _model_states

    names = _optimized_names(engine)
    if not _has_mlp_projections(names):  # no layout to differ in: the model file is not read
        return False
    try:
        states = _model_states(folder, model_file or MODEL_FILE)
    except CheckpointExportError:  # tensor or pipeline parallelism: DeepSpeed's own load says what it says
        return False
    saved = {name for shapes in states.get("param_shapes") or [] for name in shapes}
    if not saved or set(names) == saved:
        return False
    missing = [name for name in names if name not in saved]
    return all(fused_mlp_parts(name, saved) is not None or split_mlp_part(name, saved) is not None
               for name in missing)


def _this_layout_matches(engine, saved: SavedOptimizer, lp_groups) -> bool:
    """Whether every rank's saved partition is its partition now: the same world, partition counts, and (each
    expert group) the same expert-parallel rank. Agreed on by all ranks (a layout change can leave some ranks'
    expert-parallel rank as it was)."""
    import deepspeed.comm as dist
    from deepspeed.moe.utils import is_moe_param

    optimizer = engine.optimizer
    rank = dist.get_rank()
    same = saved.world == dist.get_world_size() and saved.partition_count == list(optimizer.partition_count)
    if same:
        for g, params in enumerate(lp_groups):
            expert = next((p for p in params if is_moe_param(p)), None)
            if (expert is None) != (g not in saved.expert_layout):
                same = False
            elif expert is not None and _expert_rank(expert) != saved.ep_of(g, rank):
                same = False
    flag = torch.tensor([0 if same else 1], dtype=torch.int32, device=_device(lp_groups))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag.item())


def _device(lp_groups) -> torch.device:
    return next(p.device for params in lp_groups for p in params)


@torch.no_grad()
def load_saved_optimizer_state(engine, saved: SavedOptimizer) -> None:
    """Every fp32 master and Adam moment of ``engine``'s ZeRO-1/2 (or BF16_Optimizer) partition from a saved step
    of any world size, ep_size and expert-parallel layout, and the base optimizer's step count; the 16-bit weights
    are left as they are (loaded from the module files)."""
    from deepspeed.moe.utils import is_moe_param

    step = saved.step()
    keys = MOMENT_KEYS if step is not None else ()  # saved before the first step: no moments yet
    optimizer = engine.optimizer
    lp_groups = _lp_groups(optimizer)
    base = optimizer.optimizer
    names = optimizer.param_names
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for g, (group, params) in enumerate(zip(base.param_groups, lp_groups)):
        hp = group["params"][0]
        flat = {key: torch.zeros_like(hp, device="cpu") for key in keys}
        for lp in params:
            mapping = lp._hp_mapping
            if mapping is None:
                continue
            experts = None
            if is_moe_param(lp):
                ep_rank, _ = _expert_rank(lp)
                experts = range(ep_rank * lp.shape[0], (ep_rank + 1) * lp.shape[0])
            lp_at, hp_at = mapping.lp_fragment_address, mapping.hp_fragment_address
            for key in ("fp32", *keys):
                whole = saved.tensor(names[lp], key, experts)
                if whole.shape != lp.shape:
                    raise CheckpointLayoutError(f"{saved.folder}: {names[lp]} was saved as {tuple(whole.shape)}, "
                                                f"this model's is {tuple(lp.shape)}")
                piece = whole.reshape(-1).narrow(0, lp_at.start, lp_at.numel)
                target = mapping.hp_fragment if key == "fp32" else flat[key].narrow(0, hp_at.start, hp_at.numel)
                target.copy_(piece)
        moments[g] = flat
    state = base.state_dict()
    hyper = _saved_hyperparameters(saved, lp_groups, names)
    for g, group in enumerate(state["param_groups"]):
        group.update(hyper[g])
        if step is not None:
            state["state"][group["params"][0]] = {**moments[g],
                                                  "step": step.clone() if torch.is_tensor(step) else step}
    base.load_state_dict(state)
    optimizer._load_global_state(saved.optim(0))
    optimizer._hp_optimizer_states_linked = False  # the fragments of the new moments, as after a step
    optimizer._lazy_init_hp_params_optimizer_state()


def _zero3_whole(pieces, shape) -> torch.Tensor:
    """One parameter whole from its ZeRO-3 partitions in rank order (``ceil(numel / world)`` elements a rank, the
    last rank's padded), as DeepSpeed's ``zero_to_fp32`` joins them."""
    shape = torch.Size(shape)
    return torch.cat([piece.reshape(-1) for piece in pieces])[:shape.numel()].view(shape)


def _zero3_partition(whole: torch.Tensor, param, group) -> torch.Tensor:
    """This rank's ZeRO-3 partition of ``param`` cut from its ``whole`` value (padded to ``partition_numel`` x the
    partition group's size), as DeepSpeed's universal-checkpoint loader for ZeRO-3 cuts its per-parameter files."""
    import deepspeed.comm as dist

    per_rank, flat = param.partition_numel(), whole.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(per_rank * dist.get_world_size(group=group) - flat.numel())])
    return flat.narrow(0, dist.get_rank(group=group) * per_rank, per_rank)


class SavedZero3(_SavedRankFiles):
    """The ZeRO-3 files of one saved step: each trainable parameter's fp32 master and Adam moments, whole, cut out
    of the ranks' partitions as DeepSpeed's ``zero_to_fp32`` cuts the masters. ZeRO-3 partitions every parameter on
    its own, ``ceil(numel / world)`` elements a rank (the last rank's padded), one after another in the model
    file's ``param_shapes`` order within each optimizer sub-group (``fp32_flat_groups[i]``, whose moments are the
    base optimizer's state ``i``). Memory-mapped: one parameter is materialised at a time."""

    def __init__(self, folder: str):
        from ds_loongforge.export import ZERO3_MODEL_FILE, _load, _zero_files

        self.folder = folder
        states = _load(os.path.join(folder, ZERO3_MODEL_FILE))
        self.world = int(states["dp_world_size"])
        self.buffers = {name: states["module"][name] for name in states.get("buffer_names") or []
                        if name in states["module"]}
        self._files, self._optim = _zero_files(folder, self.world), {}
        if not self._files:
            raise CheckpointLayoutError(f"{folder} holds no ZeRO optimizer files (*_optim_states.pt)")
        sizes = [flat.numel() for flat in self.optim(0)["fp32_flat_groups"]]
        param_shapes = states["param_shapes"]
        if len(param_shapes) != len(sizes):
            raise CheckpointLayoutError(f"{folder}: {len(param_shapes)} saved parameter groups for {len(sizes)} "
                                        "optimizer partitions; DeepSpeed's ZeRO-3 saves one for each")
        self.shapes: dict[str, tuple[int, int, int, torch.Size]] = {}  # name -> (sub-group, offset, per rank, shape)
        for g, (shapes, size) in enumerate(zip(param_shapes, sizes)):
            at = 0
            for name, shape in shapes.items():
                shape = torch.Size(shape)
                per_rank = -(-shape.numel() // self.world)
                self.shapes[name] = (g, at, per_rank, shape)
                at += per_rank
            if at != size:
                raise CheckpointLayoutError(f"{folder}: optimizer partition {g} holds {size} elements a rank, its "
                                            f"parameters {at}: it cannot be cut per parameter")

    def step(self):
        return self._step("optimizer_state_dict")

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """A parameter's saved ``key`` ('fp32', 'exp_avg', 'exp_avg_sq'), whole, in fp32 (an MLP saved in the other
        layout: ``_other_mlp_layout``)."""
        if name not in self.shapes:
            return _other_mlp_layout(self, name, key)
        g, at, per_rank, shape = self.shapes[name]
        pieces = []
        for rank in range(self.world):
            optim = self.optim(rank)
            flat = optim["fp32_flat_groups"][g] if key == "fp32" else optim["optimizer_state_dict"]["state"][g][key]
            pieces.append(flat.narrow(0, at, per_rank))
        return _zero3_whole(pieces, shape).float()


@torch.no_grad()
def load_zero3_state(engine, saved: SavedZero3, moments: bool) -> None:
    """Every fp32 master of ``engine``'s ZeRO-3 partitions (and, with ``moments``, the Adam moments, step count and
    saved hyper-parameters) from a saved step of any world size and MLP layout, cut to this rank's partition as
    DeepSpeed's universal-checkpoint loader for ZeRO-3 cuts its per-parameter files; the 16-bit partitions are then
    the masters rounded, and persistent parameters are gathered again, as after DeepSpeed's own load."""
    optimizer = engine.optimizer
    if getattr(optimizer, "swap_optimizer", False) or any(flat is None
                                                          for flat in optimizer.fp16_partitioned_groups_flat):
        raise CheckpointLayoutError(f"[LoongForge] {saved.folder}: its MLPs' gate and up projections are saved in the "
                                    "other layout, which is rebuilt per parameter, and this engine swaps its ZeRO-3 "
                                    "state to NVMe: load it without NVMe offload, save, and load that")
    step = saved.step() if moments else None
    keys = ("fp32", *MOMENT_KEYS) if step is not None else ("fp32",)
    names = optimizer.param_names
    optimizer.checkpoint_event_prologue()
    for g, params in enumerate(optimizer.fp16_groups):
        master = optimizer.fp32_partitioned_groups_flat[g]
        for key in keys:
            flat, at = torch.zeros_like(master), 0
            for param in params:
                whole = saved.tensor(names[param], key)
                if whole.shape != param.ds_shape:
                    raise CheckpointLayoutError(f"{saved.folder}: {names[param]} was saved as {tuple(whole.shape)}, "
                                                f"this model's is {tuple(param.ds_shape)}")
                part = _zero3_partition(whole, param, optimizer._get_param_partition_group(param))
                flat.narrow(0, at, part.numel()).copy_(part)
                at += part.numel()
            if key == "fp32":
                master.copy_(flat)
            else:
                optimizer.optimizer.state[master][key] = flat
        if step is not None:
            optimizer.optimizer.state[master]["step"] = step.clone() if torch.is_tensor(step) else step
    if moments:
        saved_groups = saved.optim(0)["optimizer_state_dict"]["param_groups"]
        if len(saved_groups) != len(optimizer.optimizer.param_groups):
            raise CheckpointLayoutError(f"{saved.folder}: {len(saved_groups)} saved optimizer groups, this engine has "
                                        f"{len(optimizer.optimizer.param_groups)}: group the parameters as the saving "
                                        "run did")
        for group, saved_group in zip(optimizer.optimizer.param_groups, saved_groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        optimizer._load_global_state_stage3(saved.optim(0))  # loss scaler, overflow
    for g, master in enumerate(optimizer.fp32_partitioned_groups_flat):
        if master.numel():
            optimizer.fp16_partitioned_groups_flat[g].copy_(master)
        weights = optimizer.unflatten(optimizer.fp16_partitioned_groups_flat[g], optimizer.fp16_partitioned_groups[g])
        for partitioned, weight in zip(optimizer.fp16_partitioned_groups[g], weights):
            partitioned.data = weight.data
    if optimizer.persistent_parameters:
        optimizer.persistent_parameters[0].partition(optimizer.persistent_parameters)
    optimizer.checkpoint_event_epilogue()


def _load_zero3_across_mlp_layout(original, engine, load_dir, tag, folder, load_optimizer_states, load_module_only,
                                  kwargs):
    """A ZeRO-3 checkpoint whose MLPs hold gate and up in the other layout (``_saved_with_other_mlp_params``):
    DeepSpeed's load runs for what it keeps (LR scheduler, step counters, client state, buffers, frozen
    parameters) without its optimizer state, and with the module's weights left to ``load_zero3_state``, which
    rebuilds the masters (and moments) per parameter. DeepSpeed's own rebuild of the module's fp32 state dict for
    that load (``get_fp32_state_dict_from_zero_checkpoint``, which reads the 'latest' tag whatever tag is loaded) is
    skipped: the buffers come from the loaded tag's model file. At more ranks than saved, a rank without a model
    file of its own reads rank 0's (what DeepSpeed keeps from it is the same on every rank; the frozen parameters'
    partitions are cut again, ``_frozen_in_engine_layout``)."""
    import glob

    import deepspeed.runtime.engine as ds_engine

    saved = SavedZero3(folder)
    user_fn = kwargs["custom_load_fn"]

    own_files = engine._get_all_ckpt_names

    def model_files(checkpoints_path, tag):  # DeepSpeedEngine._get_all_ckpt_names, rank 0's where this rank has none
        return (own_files(checkpoints_path, tag) or sorted(glob.glob(engine._get_ckpt_name(
            checkpoints_path, tag, mp_placeholder="*", pp_placeholder="0"))))

    def load_buffers(src, dst):  # DeepSpeed's custom_load_fn(src=the module state, dst=the module)
        if user_fn is not None:
            user_fn(src=src, dst=dst)
            return
        for name, buffer in dst.named_buffers():
            if name in src:
                buffer.copy_(src[name])

    rebuild = ds_engine.get_fp32_state_dict_from_zero_checkpoint
    ds_engine.get_fp32_state_dict_from_zero_checkpoint = lambda *args, **kw: dict(saved.buffers)
    engine._get_all_ckpt_names = model_files
    try:
        result = original(engine, load_dir, tag, load_optimizer_states=False, load_module_only=load_module_only,
                          **{**kwargs, "custom_load_fn": load_buffers})
    finally:
        ds_engine.get_fp32_state_dict_from_zero_checkpoint = rebuild
        del engine._get_all_ckpt_names
    if result[0] is None:
        return result
    moments = load_optimizer_states and not load_module_only
    load_zero3_state(engine, saved, moments)
    fused = any(split_mlp_part(name, saved.shapes) for name in _optimized_names(engine))
    _note("[LoongForge] %s: saved with the MLPs' gate and up projections as %s, loaded as %s: ZeRO-3 fp32 "
          "masters%s rebuilt per parameter", folder,
          *(("one gate_up_proj", "two") if fused else ("two", "one gate_up_proj")),
          " and Adam moments" if moments else "")
    return result


def _saved_groups_of(param_shapes: list[dict], lp_groups, names: dict) -> list[list[int]]:
    """For each current parameter group, the saved groups its parameters were in: ``param_shapes`` is the model
    file's record of each saved group's parameters (ZeRO checkpoints)."""
    saved_group = {name: g for g, shapes in enumerate(param_shapes) for name in shapes}
    return [sorted({saved_group[names[p]] for p in params if names[p] in saved_group}) for params in lp_groups]


def _saved_hyperparameters(saved: SavedOptimizer, lp_groups, names: dict) -> list[dict]:
    """Each current parameter group's saved hyper-parameters (lr, betas, weight decay, ...), as DeepSpeed's own load
    restores them: an LR scheduler sets the lr only at its next step. A group takes those of the saved groups its
    parameters were in (the checkpoint records each parameter's group), which holds whatever the ep_size and
    whether the experts were sharded: DeepSpeed splits every group of the model into a dense and an expert part
    when there are expert-parallel layers, and not otherwise. Those saved groups must agree (the expert flag apart,
    which stays this engine's; where dense and expert groups meet, the dense ones, which the expert ones follow)."""
    def hyper(group: dict) -> dict:
        return {k: v for k, v in group.items() if k not in ("params", "name", "moe")}

    saved_groups = saved.optim(0)["base_optimizer_state"]["param_groups"]
    out = []
    for g, sources in enumerate(_saved_groups_of(saved.param_shapes, lp_groups, names)):
        # an expert group split off a dense one takes that group's hyper-parameters at each step, so the dense
        # groups' are the ones to agree (checkpoints saved before the optimizers synced split groups at saving hold
        # them one schedule step behind)
        dense = [i for i in sources if not saved_groups[i].get("moe")]
        options = [hyper(saved_groups[i]) for i in dense or sources]
        if not options or any(o != options[0] for o in options):
            raise CheckpointLayoutError(
                f"{saved.folder}: this engine's optimizer group {g} holds parameters of the saved groups {sources}, "
                f"whose hyper-parameters ({options or 'none'}) do not agree: group the parameters as the saving run "
                "did (lr, weight decay, ...)")
        out.append(options[0])
    return out


# the per-group entries of torch's LR schedulers' state: LRScheduler's base_lrs and _last_lr, LambdaLR's and
# MultiplicativeLR's lr_lambdas, ReduceLROnPlateau's min_lrs, CyclicLR's and OneCycleLR's max_lrs and momenta
SCHEDULER_GROUP_KEYS = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "base_momentums",
                        "max_momentums")


def fit_scheduler_state(state, groups: list[int], saved_count: int, template: dict | None = None):
    """An LR scheduler's state saved for a checkpoint's ``saved_count`` optimizer groups, fitted to this
    optimizer's groups: group g takes the entries of saved group ``groups[g]`` (one its parameters were in; those
    agree in lr). DeepSpeed splits each group into a dense and an expert part only when it sees expert-parallel
    layers, so the count changes across expert sharding (3 groups and 2 for the HF Trainer's AdamW). Nested
    schedulers' states (SequentialLR, ChainedScheduler) are fitted alike; entries not kept per group are as saved.
    ``template``, the loading scheduler's own state, limits the fit to the entries it keeps per optimizer group (a
    scheduler built on a script's optimizer before ``deepspeed.initialize`` keeps one per script group)."""
    if not isinstance(state, dict):
        return state
    fitted = dict(state)
    for key in SCHEDULER_GROUP_KEYS:
        value = fitted.get(key)
        if template is None:
            mine = len(groups)
        else:
            mine = len(template[key]) if isinstance(template.get(key), list) else None
        if isinstance(value, list) and len(value) == saved_count and mine == len(groups):
            fitted[key] = [value[g] for g in groups]
    inner = fitted.get("_schedulers")
    if isinstance(inner, list):
        templates = ([None] * len(inner) if template is None
                     else list(template.get("_schedulers") or []) + [{}] * len(inner))
        fitted["_schedulers"] = [fit_scheduler_state(state, groups, saved_count, own)
                                 for state, own in zip(inner, templates)]
    return fitted


@contextlib.contextmanager
def fitting_scheduler_loads(scheduler, regroup: tuple[list[int], int] | None):
    """Within the block, ``scheduler.load_state_dict`` fits the state it is given (``fit_scheduler_state``) when
    ``regroup`` is (groups, saved group count); as it was afterwards."""
    if scheduler is None or regroup is None or not callable(getattr(scheduler, "load_state_dict", None)):
        yield
        return
    own = vars(scheduler).get("load_state_dict")
    load = scheduler.load_state_dict

    def load_fitted(state_dict, *args, **kwargs):
        return load(fit_scheduler_state(state_dict, *regroup, template=scheduler.state_dict()), *args, **kwargs)

    scheduler.load_state_dict = load_fitted
    try:
        yield
    finally:
        if own is None:
            del scheduler.load_state_dict
        else:
            scheduler.load_state_dict = own


def _scheduler_regroup(engine, states: dict) -> tuple[list[int], int] | None:
    """(for each optimizer group of this ZeRO-1/2 engine, a saved group its parameters were in; the saved group
    count) when a scheduler's per-group state needs fitting (the groups are not the saved ones, in order); else
    None, also where the checkpoint does not record each parameter's group (saved without ZeRO)."""
    lp_groups = _lp_groups(engine.optimizer)
    param_shapes = states.get("param_shapes")
    if lp_groups is None or not param_shapes:
        return None
    sources = _saved_groups_of(param_shapes, lp_groups, engine.optimizer.param_names)
    if not all(sources):
        return None  # parameters the checkpoint lacks: the optimizer's own load says which
    groups = [found[0] for found in sources]  # DeepSpeed puts expert groups after the dense ones they follow
    return None if groups == list(range(len(param_shapes))) else (groups, len(param_shapes))


REGROUP_ATTRIBUTE = "loongforge_scheduler_regroup"


def scheduler_regroup(scheduler) -> tuple[list[int], int] | None:
    """The regrouping a load across expert sharding recorded on the optimizer ``scheduler`` was built on (through
    wrappers: accelerate's AcceleratedScheduler and AcceleratedOptimizer, DeepSpeed's ZeRO optimizer); None when
    there is none."""
    seen, todo = set(), [scheduler]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen or len(seen) > 16:
            continue
        seen.add(id(obj))
        regroup = vars(obj).get(REGROUP_ATTRIBUTE) if hasattr(obj, "__dict__") else None
        if regroup is not None:
            return regroup
        todo += [getattr(obj, "scheduler", None), getattr(obj, "optimizer", None)]
    return None


def _fit_client_scheduler_loads() -> None:
    """Scripts load the LR schedulers DeepSpeed's checkpoint does not hold after DeepSpeed's load: the HF Trainer
    its ``scheduler.pt`` in ``Trainer._load_optimizer_and_scheduler``, accelerate's ``load_state`` each prepared
    scheduler's ``scheduler.bin`` in ``load_accelerator_state``. Those loads are routed through
    ``fitting_scheduler_loads`` for schedulers built on an optimizer a load across expert sharding regrouped.
    Patched (once each) when such a load runs and transformers' Trainer or accelerate is imported: both look the
    patched names up after DeepSpeed's load, within the same call."""
    import sys

    def load_trainer_scheduler(original, self, checkpoint, *args, **kwargs):
        scheduler = getattr(self, "lr_scheduler", None)
        with fitting_scheduler_loads(scheduler, scheduler_regroup(scheduler)):
            return original(self, checkpoint, *args, **kwargs)

    def load_accelerator_state(original, input_dir, models, optimizers, schedulers, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            for scheduler in schedulers:
                stack.enter_context(fitting_scheduler_loads(scheduler, scheduler_regroup(scheduler)))
            return original(input_dir, models, optimizers, schedulers, *args, **kwargs)

    patch_once(getattr(sys.modules.get("transformers.trainer"), "Trainer", None), "_load_optimizer_and_scheduler",
                load_trainer_scheduler)
    patch_once(sys.modules.get("accelerate.accelerator"), "load_accelerator_state", load_accelerator_state)


def _masters_and_weights(engine):
    """(name, fp32 master, 16-bit weight) of each parameter this rank holds a master of: ZeRO-1/2's and
    BF16_Optimizer's fragments (``_hp_mapping``), or the bf16/fp16 wrapper's masters without ZeRO."""
    optimizer = engine.optimizer
    if _sixteen_bit_wrapper(optimizer):
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for g, group in enumerate(optimizer.fp16_groups):
            if type(optimizer).__name__ == "FP16_Optimizer":
                masters = optimizer.fp32_groups_flat[g].split([p.numel() for p in group])
            else:
                masters = optimizer.fp32_groups[g]
            for p, master in zip(group, masters):
                yield names.get(id(p), f"group {g} parameter"), master.view(p.shape), p.detach()
        return
    names = optimizer.param_names
    for params in _lp_groups(optimizer):
        for lp in params:
            mapping = lp._hp_mapping
            if mapping is not None:
                yield names[lp], mapping.hp_fragment, mapping.lp_fragment


def check_masters_match_weights(engine, folder: str) -> None:
    """Every fp32 master of this rank, rounded to its weight's dtype, is that weight (as after every step): the
    optimizer state belongs to these parameters. Collective: every rank raises, naming the first mismatches."""
    import deepspeed.comm as dist

    from ds_loongforge.export import _rounds_to

    wrong = [name for name, master, weight in _masters_and_weights(engine)
             if not _rounds_to(master.to(weight.device), weight)]  # the masters may live on the host (offload)
    count = torch.tensor([len(wrong)], dtype=torch.int64, device=_device(_lp_groups(engine.optimizer)
                                                                       or engine.optimizer.fp16_groups))
    dist.all_reduce(count)
    if count.item():
        raise CheckpointLayoutError(
            f"[LoongForge] {folder}: after loading, {int(count.item())} fp32 masters (this rank: {wrong[:4]}) are not "
            "the weights the checkpoint holds for them, so the optimizer state belongs to other parameters; do not "
            "train from this engine. Load with the ep_size, expert-parallel layout and world size the checkpoint was "
            "saved with, or report the layout this happened at")


def _wants_optimizer_state(engine, load_optimizer_states: bool, load_module_only: bool) -> bool:
    return (load_optimizer_states and not load_module_only and bool(engine.zero_optimization())
            and not engine.load_universal_checkpoint() and _lp_groups(engine.optimizer) is not None)


def _holds_stacked_experts(module) -> bool:
    from ds_loongforge.modules.moe_deepspeed import DeepSpeedStackedExperts

    return any(isinstance(m, DeepSpeedStackedExperts) for m in module.modules())


def _check_unpartitioned_ep_size(engine, folder: str) -> None:
    """Without ZeRO, DeepSpeed saves the whole optimizer state of each expert-parallel rank (its experts' moments
    stacked [E/ep, ...]) in ``expp_rank_<e>_mp_rank_00_optim_states.pt`` and loads the file of this rank's
    expert-parallel rank: at another ep_size a rank finds no file or one of other experts' shapes. Said here, the
    same on every rank, before anything loads."""
    import glob

    from ds_loongforge.modules.moe_deepspeed import DeepSpeedStackedExperts

    from ds_loongforge.export import EXPERT_OPTIM_FILES_GLOB

    saved = len(glob.glob(os.path.join(folder, EXPERT_OPTIM_FILES_GLOB)))
    sizes = {m.ep_size for m in engine.module.modules() if isinstance(m, DeepSpeedStackedExperts)}
    if saved and sizes and sizes != {saved}:
        raise CheckpointLayoutError(
            f"[LoongForge] {folder} was saved without ZeRO at ep_size {saved} (one optimizer file per "
            f"expert-parallel rank) and this engine runs ep_size {sorted(sizes)[0]}: without ZeRO the optimizer state "
            f"loads only at the ep_size it was saved with. Load it at ep_size {saved}, or with "
            "load_optimizer_states=False (the weights load at any ep_size; the Adam moments start afresh); ZeRO-1/2 "
            "checkpoints load at any ep_size with their optimizer state")


def holds_unsharded_experts(engine) -> bool:
    """Stacked experts that DeepSpeed does not see as MoE (ExpertMaskedMoE without expert parallelism: a model
    injected with moe.ep_size 1): every expert is an ordinary data-parallel parameter here."""
    from ds_loongforge.modules.moe import StackedExperts
    from ds_loongforge.modules.moe_deepspeed import DeepSpeedStackedExperts

    return not getattr(engine, "has_moe_layers", False) and any(
        isinstance(m, StackedExperts) and not isinstance(m, DeepSpeedStackedExperts) for m in engine.module.modules())


def _expert_files(folder: str) -> list[str]:
    import glob

    from ds_loongforge.export import EXPERT_FILES_GLOB

    return glob.glob(os.path.join(folder, EXPERT_FILES_GLOB))


def _load_across_sharding(original, engine, load_dir, tag, folder, load_optimizer_states, load_module_only, kwargs,
                          into_sharded: bool):
    """An expert-parallel checkpoint into an engine whose experts are unsharded (``holds_unsharded_experts``), or,
    ``into_sharded``, a checkpoint of unsharded experts (every expert stacked in the model file, no per-expert files)
    into expert-parallel layers. DeepSpeed reads per-expert files exactly when the engine has MoE layers, so on its
    own it misses every expert weight of the first and looks for files the second does not have. Here its load runs
    as for a model without MoE layers (``has_moe_layers``, the one attribute it reads there, off for this call), with
    the module state made to fit: the per-expert files stacked in global expert order (``export.saved_weights``:
    the 16-bit weights the run trained with) added, or the stacked experts cut to this rank's. The ZeRO-1/2
    optimizer state is then rebuilt per parameter as for another ep_size."""
    from ds_loongforge.export import _model_states, saved_weights
    from ds_loongforge.modules.moe_deepspeed import DeepSpeedStackedExperts

    saved_how, loaded_how = (("with every expert unsharded", "with expert parallelism") if into_sharded
                             else ("with expert parallelism", "with every expert unsharded"))
    wants_optimizer = load_optimizer_states and not load_module_only
    states = _model_states(folder)
    if wants_optimizer and not (engine.zero_optimization() and _lp_groups(engine.optimizer) is not None):
        raise CheckpointLayoutError(
            f"[LoongForge] {folder} was saved {saved_how} and this engine runs {loaded_how}, without ZeRO-1/2, where "
            "DeepSpeed keeps the optimizer state in one file per expert-parallel rank of the saving layout. Load it "
            "with load_optimizer_states=False (the weights load; the Adam moments start afresh), or with ZeRO stage 1 "
            "or 2, where the optimizer state is rebuilt for this engine")
    if into_sharded:
        sharded = [(f"{prefix}.{name}", param) for prefix, module in engine.module.named_modules()
                   if isinstance(module, DeepSpeedStackedExperts)
                   for name, param in module.named_parameters(recurse=False)]

        def fit(src):  # this rank's experts of the stacked ones
            for key, param in sharded:
                if key in src and src[key].shape[0] != param.shape[0]:
                    ep_rank, _ = _expert_rank(param)
                    src[key] = src[key][ep_rank * param.shape[0]:(ep_rank + 1) * param.shape[0]]
    else:
        experts = {key: value for key, value in saved_weights(folder, states).items() if key not in states["module"]}

        def fit(src):
            src.update(experts)
    strict, user_fn = kwargs["load_module_strict"], kwargs["custom_load_fn"]

    def load_module(src, dst):  # DeepSpeed's custom_load_fn(src=the module file's state dict, dst=the module)
        fit(src)
        if user_fn is not None:
            user_fn(src=src, dst=dst)
        else:
            dst.load_state_dict(src, strict=strict)

    # the optimizer groups differ from the saved ones (DeepSpeed splits off expert groups only with expert-parallel
    # layers): an LR scheduler's per-group state is fitted to them, the engine's in DeepSpeed's load, the HF
    # Trainer's and accelerate's (files of their own) in their loads, which follow
    regroup = _scheduler_regroup(engine, states)
    has_moe_layers, engine.has_moe_layers = engine.has_moe_layers, False
    try:
        with fitting_scheduler_loads(engine.lr_scheduler, regroup):
            result = original(engine, load_dir, tag, load_optimizer_states=False, load_module_only=load_module_only,
                              **{**kwargs, "custom_load_fn": load_module})
    finally:
        engine.has_moe_layers = has_moe_layers
    if result[0] is None:
        return result
    if regroup is not None:
        setattr(engine.optimizer, REGROUP_ATTRIBUTE, regroup)
        _fit_client_scheduler_loads()
    if wants_optimizer:
        saved = SavedOptimizer(folder)
        load_saved_optimizer_state(engine, saved)
        saved_as = (f"(expert groups at ep_size {sorted({ep for ep, _, _ in saved.expert_layout.values()})})"
                    if saved.expert_layout else saved_how)
        logger.info("[LoongForge] %s: saved by %d ranks %s, loaded at %d ranks %s: fp32 masters and Adam moments "
                    "rebuilt from the saved partitions", folder, saved.world, saved_as,
                    torch.distributed.get_world_size(), loaded_how)
    elif not load_module_only and _sixteen_bit_wrapper(engine.optimizer):
        # without ZeRO DeepSpeed's load keeps the wrapper's own fp32 masters, which the next step would write over
        # the weights just loaded (load_module_only refreshes them from the weights); set from the checkpoint's,
        # each checked to round to its loaded weight, or from the weights
        _masters_from_checkpoint(engine, folder)
    if _lp_groups(engine.optimizer) is not None:
        check_masters_match_weights(engine, folder)
    return result


def _unfused_mlp_half(name: str, params: dict) -> tuple[str, int] | None:
    """``_mlp_half(name)`` of a module that has both gate_proj and up_proj in ``params`` (the unfused form of a
    FusedSwiGLUMLP's parameter); else None."""
    half = _mlp_half(name)
    return half if half is not None and fused_mlp_parts(half[0], params) is not None else None


def _per_element(value) -> bool:
    return torch.is_tensor(value) and value.dim() > 0


def _own(value):
    return value.clone() if torch.is_tensor(value) else value


def _copy_of(value):
    """A tensor, or a parameter's optimizer state, with tensors of its own."""
    return {key: _own(v) for key, v in value.items()} if isinstance(value, dict) else _own(value)


def _rank_optimizer_file(engine, folder: str) -> str:
    """The file of this rank's optimizer state without ZeRO, as DeepSpeed loads it: the model file, or with expert
    parallelism this expert-parallel rank's ``expp_rank_<e>_mp_rank_00_optim_states.pt`` (whose experts are its own;
    the model file holds rank 0's state)."""
    from ds_loongforge.export import MODEL_FILE, expert_optimizer_file

    if not getattr(engine, "has_moe_layers", False):
        return os.path.join(folder, MODEL_FILE)
    from deepspeed.utils import groups

    rank = groups._get_expert_parallel_rank(groups._get_max_expert_size_name())
    return os.path.join(folder, expert_optimizer_file(rank))


def _rank_optimizer_state(engine, folder: str, states: dict):
    """This rank's saved optimizer state without ZeRO (``_rank_optimizer_file``); ``states``: the model file's."""
    from ds_loongforge.export import MODEL_FILE, _load

    path = _rank_optimizer_file(engine, folder)
    if os.path.basename(path) == MODEL_FILE:
        return states.get("optimizer")
    return _load(path).get("optimizer") if os.path.isfile(path) else None


def _unpartitioned_state_across_mlp_layout(engine, folder: str) -> dict | None:
    """Without ZeRO, DeepSpeed saves a torch optimizer's own state dict (fp32), or FP16_UnfusedOptimizer's (bf16 or
    fp16 with a client optimizer: that state dict plus a per-parameter fp32 master list), which know parameters by
    their place in their groups only: saved with LoongForge's fused MLP (one gate_up_proj at the gate's place) and
    loaded without it, or the other way, torch refused it ("a parameter group that doesn't match the size of
    optimizer's group"). This engine's groups in the other layout (each gate_up_proj as gate_proj then up_proj, or
    those two as one gate_up_proj where gate_proj was) must match the saved groups' sizes and every saved moment
    and master its parameter's shape; then the state dict for this engine's parameters (the rows joined, or cut in
    halves), else None (not this case: DeepSpeed's own load follows). FP16_Optimizer (DeepSpeed's own fused
    optimizers in bf16/fp16) keeps one flat fp32 group per parameter group: ``_flat_state_across_mlp_layout``."""
    optimizer = engine.optimizer
    wrapped = type(optimizer).__name__ == "FP16_UnfusedOptimizer"
    flat = type(optimizer).__name__ == "FP16_Optimizer" and hasattr(optimizer, "fp32_groups_flat")
    if wrapped or flat:
        groups_of_params = optimizer.fp16_groups
    elif (isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "fp32_groups")
          and not engine.fp16_enabled() and not engine.bfloat16_enabled()):
        groups_of_params = [group["params"] for group in optimizer.param_groups]
    else:
        return None
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if not _has_mlp_projections(names.values()):  # no layout to differ in: the model file is not read
        return None
    from ds_loongforge.export import CheckpointExportError, _model_states

    try:
        states = _model_states(folder)
    except CheckpointExportError:  # tensor or pipeline parallelism: DeepSpeed's own load says what it says
        return None
    saved = _rank_optimizer_state(engine, folder, states)
    params = {n: p for n, p in engine.module.named_parameters()}
    groups = [[names.get(id(p)) for p in group] for group in groups_of_params]
    if any(None in group for group in groups):
        return None
    other, shapes = _groups_in_other_mlp_layout(groups, params)
    if flat:
        return _flat_state_across_mlp_layout(saved, states["module"], groups, other, shapes, params, folder)
    inner = saved.get("optimizer_state_dict") if wrapped and isinstance(saved, dict) else saved
    if (not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list) or "state" not in inner
            or (wrapped and not isinstance(saved.get("fp32_groups"), list))):
        return None
    if (len(groups) != len(inner["param_groups"])
            or all(len(g) == len(s["params"]) for g, s in zip(groups, inner["param_groups"]))):
        return None
    if [len(g) for g in other] != [len(s["params"]) for s in inner["param_groups"]]:
        return None
    saved_index, saved_master = {}, {}  # other-layout name -> the saved state's index / fp32 master
    for g, (names_other, saved_group) in enumerate(zip(other, inner["param_groups"])):
        saved_index.update(zip(names_other, saved_group["params"]))
        if wrapped:
            saved_master.update(zip(names_other, saved["fp32_groups"][g]))
    for name, index in saved_index.items():
        moment = inner["state"].get(index, {}).get("exp_avg")
        master = saved_master.get(name)
        if any(t is not None and t.shape != shapes[name] for t in (moment, master)):
            return None

    def join(a, b):  # a parameter's state dict, or a tensor; a step counter is the gate's, as a tensor of its own
        pair = lambda x, y: torch.cat([x, y]) if _per_element(x) else _own(x)  # noqa: E731
        return {key: pair(value, b[key]) for key, value in a.items()} if isinstance(a, dict) else pair(a, b)

    def cut(whole, half: int):
        part = lambda v: v.chunk(2)[half].clone() if _per_element(v) else _own(v)  # noqa: E731
        return {key: part(v) for key, v in whole.items()} if isinstance(whole, dict) else part(whole)

    def mapped(name: str, held: dict, fetch):
        """This engine's parameter ``name`` from ``fetch(saved name)`` over the saved names ``held``: a tensor or
        a parameter's state dict, the two saved halves joined, the saved whole cut, or the same; tensors of its own
        (torch's AdamW counts a parameter's step in place); None where the saved run had nothing."""
        value = in_either_mlp_layout(name, held, fetch, join, cut)
        return _copy_of(value) if name in held and value is not None else value

    state, param_groups, masters, index = {}, [], [], 0
    for group, saved_group in zip(groups, inner["param_groups"]):
        indices, group_masters = [], []
        for name in group:
            held = mapped(name, saved_index, lambda n: inner["state"].get(saved_index[n]))
            if held is not None:
                state[index] = held
            if wrapped:
                group_masters.append(mapped(name, saved_master, saved_master.get))
            indices.append(index)
            index += 1
        param_groups.append({**saved_group, "params": indices})
        masters.append(group_masters)
    converted = {"state": state, "param_groups": param_groups}
    return {**saved, "optimizer_state_dict": converted, "fp32_groups": masters} if wrapped else converted


SIXTEEN_BIT_PARAMS_KEY = "loongforge_16bit_optimizer_params"


def sixteen_bit_optimizer_params(engine) -> dict | None:
    """What DeepSpeed's bf16/fp16 wrappers without ZeRO (FP16_Optimizer, FP16_UnfusedOptimizer) save their fp32
    masters without: which parameter each is. FP16_Optimizer saves one flat master a parameter group, and
    FP16_UnfusedOptimizer a list, with no names or shapes (ZeRO's files record ``param_shapes``), so nothing but
    the engine that saved them could tell them apart. This record travels in the checkpoint's model file (as client
    state, which every DeepSpeed loads past): per optimizer group, each parameter's name under
    ``engine.module.named_parameters()``, its shape (an expert-parallel rank's local experts) and whether it is an
    expert parameter; the tied parameters (DeepSpeed's ``_get_shared_params``). None for other optimizers."""
    optimizer = engine.optimizer
    if engine.zero_optimization() or not _sixteen_bit_wrapper(optimizer):
        return None
    from deepspeed.moe.utils import is_moe_param

    names = {id(p): n for n, p in engine.module.named_parameters()}
    if any(id(p) not in names for group in optimizer.fp16_groups for p in group):
        return None  # a parameter the module does not hold: nothing to name it by
    return {"optimizer": type(optimizer).__name__,
            "groups": [[[names[id(p)], list(p.shape), bool(is_moe_param(p))] for p in group]
                       for group in optimizer.fp16_groups],
            "shared_params": engine._get_shared_params()}


def save_checkpoint(original, engine, save_dir, tag=None, client_state=None, *args, **kwargs):
    """``DeepSpeedEngine.save_checkpoint``, with ``sixteen_bit_optimizer_params`` in the model file where the
    engine's optimizer saves unnamed masters (``loongforge_export`` reads them by it)."""
    record = sixteen_bit_optimizer_params(engine)
    if record is not None:
        client_state = {**(client_state or {}), SIXTEEN_BIT_PARAMS_KEY: record}
    return original(engine, save_dir, tag, {} if client_state is None else client_state, *args, **kwargs)


def _sixteen_bit_wrapper(optimizer) -> bool:
    """Whether ``optimizer`` is DeepSpeed's bf16/fp16 wrapper without ZeRO (FP16_Optimizer, FP16_UnfusedOptimizer):
    fp32 masters of its own beside the 16-bit parameters."""
    return (type(optimizer).__name__ in ("FP16_Optimizer", "FP16_UnfusedOptimizer")
            and hasattr(optimizer, "fp16_groups") and hasattr(optimizer, "refresh_fp32_params"))


def _masters_from_checkpoint(engine, folder: str) -> None:
    """``load_checkpoint(load_optimizer_states=False)`` without ZeRO in bf16/fp16: DeepSpeed loads the 16-bit weights
    and leaves the optimizer's fp32 masters as they were (the fresh model's; only ``load_module_only`` refreshes
    them), so the next step wrote those masters over the loaded weights, and the run went on from its
    initialisation without a word (ZeRO-1/2 take the checkpoint's fp32 masters). The masters become the
    checkpoint's fp32 ones, in this engine's order (across the MLP layout: rearranged), where each rounds to the
    weight just loaded; else the loaded weights themselves."""
    optimizer = engine.optimizer
    flat = type(optimizer).__name__ == "FP16_Optimizer"
    targets = optimizer.fp32_groups_flat if flat else optimizer.fp32_groups
    masters = _saved_masters(engine, folder, flat)
    if masters is None:
        optimizer.refresh_fp32_params()
        source = "the loaded 16-bit weights (the checkpoint holds no fp32 masters for these parameters)"
    else:
        for target, master in zip(targets, masters):
            if flat:
                target.data.copy_(master)
            else:
                for t, m in zip(target, master):
                    t.data.copy_(m)
        source = "the checkpoint's"
    _note("[LoongForge] %s: loaded without its optimizer states (no ZeRO, %s): fp32 masters set from %s; DeepSpeed "
          "kept the engine's own, which the next step would have written over the loaded weights", folder,
          type(optimizer).__name__, source)


def _saved_masters(engine, folder: str, flat: bool) -> list | None:
    """The checkpoint's fp32 masters for this engine's bf16/fp16 wrapper (FP16_Optimizer's flat groups when
    ``flat``, else FP16_UnfusedOptimizer's per-parameter lists) in this engine's order, each rounding to the weight
    now loaded; else None. Saved in this engine's order, they are taken as saved; else by the names recorded at
    save time (``_recorded_masters``: the other MLP layout, the other wrapper, another expert layout); else, for a
    checkpoint without that record, by the other MLP layout's order (not with expert parallelism)."""
    from ds_loongforge.export import CheckpointExportError, _model_states, _rounds_to

    optimizer = engine.optimizer
    # FP16_Optimizer's parameters are views of one flat 16-bit tensor a group
    weights = optimizer.fp16_groups_flat if flat else [[p.detach() for p in g] for g in optimizer.fp16_groups]

    def rounds_to(master: torch.Tensor, weight: torch.Tensor, chunk: int = 1 << 26) -> bool:
        """On the weight's device, a piece at a time (a large model's group is many GiB)."""
        master, weight = master.reshape(-1), weight.detach().reshape(-1)
        return all(_rounds_to(master[i:i + chunk].to(weight.device), weight[i:i + chunk])
                   for i in range(0, weight.numel(), chunk))

    def fits(masters) -> bool:
        if not isinstance(masters, list) or len(masters) != len(weights):
            return False
        for master, group in zip(masters, weights):
            if flat:
                if not torch.is_tensor(master) or master.shape != group.shape or not rounds_to(master, group):
                    return False
            elif (not isinstance(master, (list, tuple)) or len(master) != len(group)
                  or any(not torch.is_tensor(m) or m.shape != w.shape or not rounds_to(m, w)
                         for m, w in zip(master, group))):
                return False
        return True

    key = "fp32_groups_flat" if flat else "fp32_groups"
    try:
        states = _model_states(folder)
    except CheckpointExportError:
        return None
    saved = _rank_optimizer_state(engine, folder, states)
    if isinstance(saved, dict) and fits(saved.get(key)):
        return saved[key]
    # the other MLP layout, the other wrapper's save, another expert layout
    recorded = _recorded_masters(engine, folder, states, flat)
    if recorded is not None and fits(recorded):
        return recorded
    if states.get("num_experts") or getattr(engine, "has_moe_layers", False):
        return None  # the record-less map below reads the model file's state, which is expert-parallel rank 0's
    try:
        converted = _unpartitioned_state_across_mlp_layout(engine, folder)  # saved in the other MLP layout
    except CheckpointLayoutError:  # the masters are in neither layout's order: the loaded weights give them
        return None
    return converted[key] if converted is not None and fits(converted.get(key)) else None


def _masters_in_engine_groups(engine, held, fetch, flat: bool) -> list | None:
    """Masters ``fetch(saved name)`` over the saved names ``held`` in this engine's wrapper's groups (``flat``:
    FP16_Optimizer's, else FP16_UnfusedOptimizer's lists): each parameter's by its name, a fused gate_up_proj's
    joined from the saved gate_proj's and up_proj's, or a gate_proj's and up_proj's cut from a saved gate_up_proj's.
    None where a parameter has no master of its size."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for group in engine.optimizer.fp16_groups:
        masters = [None if (name := names.get(id(p))) is None else in_either_mlp_layout(name, held, fetch)
                   for p in group]
        if any(m is None or m.numel() != p.numel() for m, p in zip(masters, group)):
            return None
        masters = [m.reshape(p.shape) for m, p in zip(masters, group)]
        out.append(torch.cat([m.reshape(-1) for m in masters]) if flat else masters)
    return out


def _recorded_masters(engine, folder: str, states: dict, flat: bool) -> list | None:
    """A checkpoint's fp32 masters of DeepSpeed's bf16/fp16 wrapper without ZeRO by the names recorded at save time
    (``sixteen_bit_optimizer_params``, ``export.RecordedMasters``), for this engine's wrapper (``flat``:
    FP16_Optimizer's flat groups, else FP16_UnfusedOptimizer's lists) and parameter groups: in either MLP layout,
    from either wrapper's save, at any expert layout (another ep_size, or the experts sharded on one side only:
    moe.ep_size 1 against > 1). Each of this rank's stacked expert parameters takes its experts in global order
    (expert-parallel rank r of ep_size n holds [r E/n, (r+1) E/n)); dense ones are the first file's, whose weights
    the model file holds. None without a record, or where a file or a parameter's master is missing."""
    from deepspeed.moe.utils import is_moe_param

    from ds_loongforge.export import CheckpointExportError, RecordedMasters
    from ds_loongforge.modules.moe import StackedExperts

    record = states.get(SIXTEEN_BIT_PARAMS_KEY)
    if not isinstance(record, dict) or not isinstance(record.get("groups"), list):
        return None
    try:
        recorded = RecordedMasters(folder, states, record)
    except CheckpointExportError:
        return None
    params = dict(engine.module.named_parameters())
    stacked = {f"{prefix}.{leaf}" for prefix, module in engine.module.named_modules()
               if isinstance(module, StackedExperts) for leaf, _ in module.named_parameters(recurse=False)}

    def fetch(name: str) -> torch.Tensor | None:
        param = params.get(name)
        if name in stacked and is_moe_param(param):  # this rank's experts
            ep_rank, _ = _expert_rank(param)
            local = param.shape[0]
            return recorded.experts(name, ep_rank * local, (ep_rank + 1) * local)
        if name in stacked:  # every expert here (moe.ep_size 1)
            return recorded.experts(name, 0, param.shape[0])
        if recorded.expert[name] or (param is not None and is_moe_param(param)):
            return None  # experts of another kind (DeepSpeed's own MoE: one parameter an expert, named locally)
        return recorded.master(name)

    return _masters_in_engine_groups(engine, recorded.expert, fetch, flat)


def _groups_in_other_mlp_layout(groups: list[list[str]], params: dict
                                ) -> tuple[list[list[str]], dict[str, torch.Size]]:
    """This engine's parameter groups (names) in the other MLP layout, and those parameters' shapes. A fused MLP's
    gate_up_proj leaves of a group become, at the first one's place, transformers' order of the module's
    parameters: gate_proj's (weight, bias), then up_proj's. A gate_proj + up_proj pair becomes one gate_up_proj at
    each gate leaf's place."""
    shapes: dict[str, torch.Size] = {}
    other = []
    for group in groups:
        names_other, done = [], set()
        for name in group:
            parts = _mlp_parts(name)
            if parts is not None:  # this engine fused: the other layout has gate's leaves, then up's
                mlp = name.rpartition("gate_up_proj.")[0]
                if mlp in done:
                    continue
                done.add(mlp)
                leaves = [n for n in group if _mlp_parts(n) is not None and n.rpartition("gate_up_proj.")[0] == mlp]
                for half in range(2):
                    for leaf in leaves:
                        part = _mlp_parts(leaf)[half]
                        names_other.append(part)
                        shapes[part] = params[leaf].chunk(2)[half].shape
                continue
            half = _unfused_mlp_half(name, params)
            if half is not None:  # this engine unfused: the other layout has gate_up_proj at the gate's place
                whole, which = half
                if which == 0:
                    names_other.append(whole)
                    shapes[whole] = torch.Size([2 * params[name].shape[0], *params[name].shape[1:]])
                continue
            names_other.append(name)
            shapes[name] = params[name].shape
        other.append(names_other)
    return other, shapes


def _flat_state_across_mlp_layout(saved, module: dict, groups: list[list[str]], other: list[list[str]],
                                  shapes: dict[str, torch.Size], params: dict, folder: str) -> dict | None:
    """FP16_Optimizer (bf16/fp16 without ZeRO around DeepSpeed's own fused optimizers, FusedAdam for one) saves one
    flat fp32 master per parameter group, and its moments flat alike, with no parameter boundaries; DeepSpeed loads
    them by size. Across the MLP layout the sizes agree, and so does the order of the elements where an MLP has no
    bias (gate_up_proj's rows are gate's then up's). With biases they do not: [gate.weight, gate.bias, up.weight,
    up.bias] against [gate_up.weight, gate_up.bias], and DeepSpeed's load gave up_proj the gate's bias and rows
    shifted by it, without a word. Which layout the saved flats are in is read from the saved weights: every fp32
    master rounds to its weight (the module file's, under transformers' keys in either layout) after every step.
    Where this engine's layout reads the masters right, None: DeepSpeed's own load follows. Where neither layout
    does (parameter groups built in another order, say), an error: DeepSpeed's load by size would be wrong. Else
    the saved state with each flat master and flat moment rearranged into this engine's order."""
    from ds_loongforge.export import _rounds_to

    inner = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
    flats = saved.get("fp32_groups_flat") if isinstance(saved, dict) else None
    if (not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list) or "state" not in inner
            or not isinstance(flats, list) or not len(flats) == len(groups) == len(inner["param_groups"])
            or any(len(group["params"]) != 1 for group in inner["param_groups"])
            or any(flat.numel() != sum(params[n].numel() for n in group) for flat, group in zip(flats, groups))):
        return None

    def runs_of(group: list[str], group_other: list[str]) -> list[tuple[int, int]] | None:
        """(start, length) runs of the saved flat, in the other layout's order, that make this engine's flat; None
        where a group holds one of an MLP's gate and up projections without the other (no other layout)."""
        start, offset = {}, 0
        for name in group_other:
            start[name] = offset
            offset += shapes[name].numel()
        runs = []
        for name in group:
            size = params[name].numel()
            if (parts := _mlp_parts(name)) is not None:
                runs += [(start[part], size // 2) for part in parts]
            elif name in start:
                runs.append((start[name], size))
            elif (whole := _unfused_mlp_half(name, params)) is not None and whole[0] in start:
                runs.append((start[whole[0]] + whole[1] * size, size))
            else:
                return None
        return runs

    def weight(name: str) -> torch.Tensor | None:
        """The saved weight of this engine's parameter ``name`` (the module file has transformers' keys)."""
        if name in module:
            return module[name]
        parts = _mlp_parts(name)
        return torch.cat([module[part] for part in parts]) if parts and all(p in module for p in parts) else None

    def reads_right(flat: torch.Tensor, group: list[str]) -> bool:
        """Whether the flat, read in this engine's order, holds a master for each parameter that rounds to its
        saved weight."""
        offset = 0
        for name in group:
            size = params[name].numel()
            saved_weight = weight(name)
            if (saved_weight is None or saved_weight.numel() != size
                    or not _rounds_to(flat[offset:offset + size].view(saved_weight.shape), saved_weight)):
                return False
            offset += size
        return True

    def rearranged(flat: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
        return torch.cat([flat[start:start + length] for start, length in runs])

    runs = [runs_of(group, group_other) for group, group_other in zip(groups, other)]
    if None in runs or all(_in_order(r) for r in runs):  # the same order in both layouts: DeepSpeed's load is right
        return None
    if all(reads_right(flat, group) for flat, group in zip(flats, groups)):  # saved in this engine's layout
        return None
    masters = [rearranged(flat, r) for flat, r in zip(flats, runs)]
    if not all(reads_right(flat, group) for flat, group in zip(masters, groups)):
        # the layouts order the elements differently and neither reads the saved weights: DeepSpeed's load by size
        # would hand these parameters other parameters' masters and moments
        raise CheckpointLayoutError(
            f"[LoongForge] {folder}: the checkpoint's flat fp32 masters (FP16_Optimizer, no ZeRO) are not "
            "its weights in this engine's parameter order nor in the other MLP layout's, so its optimizer state "
            "would load into other parameters. Build the optimizer's parameter groups as the saving run did, or "
            "load with load_optimizer_states=False (the weights load, their masters are set from them, and the "
            "moments start afresh)")
    state = dict(inner["state"])
    for group, r, flat in zip(inner["param_groups"], runs, flats):
        key = group["params"][0]
        if key in state:
            state[key] = {name: rearranged(value, r) if _per_element(value) and value.numel() == flat.numel()
                          else _own(value) for name, value in state[key].items()}
    return {**saved, "optimizer_state_dict": {**inner, "state": state}, "fp32_groups_flat": masters}


def _in_order(runs: list[tuple[int, int]]) -> bool:
    """Whether the runs, one after another, are the flat from its start in order (nothing rearranged)."""
    offset = 0
    for start, length in runs:
        if start != offset:
            return False
        offset += length
    return True


def _frozen_in_engine_layout(engine, folder: str, fragments: dict) -> dict:
    """A checkpoint's ``frozen_param_fragments`` (ZeRO-2/3 save the parameters their optimizer does not hold by
    name, whole at ZeRO-2, each rank's partition at ZeRO-3) under this engine's names: DeepSpeed's load looks each
    frozen parameter up by its name, so a frozen MLP saved in the other layout (a frozen fused gate_up_proj where
    this engine has gate_proj and up_proj, or the other way) was a KeyError. Those are joined or cut from the saved
    ones; at ZeRO-3, from every saved rank's partition, and every frozen parameter is then cut to this rank's
    partition at this world size (also when only the world size changed: a ZeRO-3 load across the MLP layout at
    another world size). Unchanged when every name is there with this rank's partition size, or a missing one is no
    MLP's other half (DeepSpeed's own error follows)."""
    from deepspeed.runtime.utils import is_optimized_parameter

    frozen = {name: p for name, p in engine.module.named_parameters() if not is_optimized_parameter(p)}
    missing = [name for name in frozen if name not in fragments]
    partitioned = any(hasattr(p, "ds_id") for p in frozen.values())
    # ZeRO-3 at another world size (a load across the MLP layout, DeepSpeed's own refuses): other partitions
    resized = partitioned and any(fragments[name].numel() != p.partition_numel()
                                  for name, p in frozen.items() if name in fragments)
    if not (missing or resized) or not all(fused_mlp_parts(name, fragments) or split_mlp_part(name, fragments)
                                           for name in missing):
        return fragments
    if partitioned:  # ZeRO-3: a saved parameter whole from every saved rank's partition, when it is needed
        from ds_loongforge.export import ZERO3_MODEL_FILE, _load, zero3_model_file

        states = _load(os.path.join(folder, ZERO3_MODEL_FILE))
        shapes = states["frozen_param_shapes"]
        ranks = [_load(os.path.join(folder, zero3_model_file(r)))["frozen_param_fragments"]
                 for r in range(int(states["dp_world_size"]))]  # memory-mapped

        def saved(name):
            return _zero3_whole([rank[name] for rank in ranks], shapes[name])
    else:
        shapes, saved = fragments, fragments.__getitem__
    out, partition_group = {}, getattr(engine.optimizer, "_get_param_partition_group", None)
    for name, param in frozen.items():
        whole = in_either_mlp_layout(name, shapes, saved)  # every missing name was checked to be in one above
        shape = param.ds_shape if partitioned else param.shape
        if whole.shape != shape:
            raise CheckpointLayoutError(f"{folder}: the frozen parameter {name} was saved as {tuple(whole.shape)}, "
                                        f"this model's is {tuple(shape)}")
        out[name] = (_zero3_partition(whole, param, partition_group(param) if partition_group else None).clone()
                     if partitioned else whole)
    if missing:
        _note("[LoongForge] %s: frozen MLP projections saved in the other layout (%s) loaded by this engine's "
              "names", folder, ", ".join(missing[:2]) + (", ..." if len(missing) > 2 else ""))
    return out


@contextlib.contextmanager
def _frozen_by_engine_names(engine, folder: str):
    """DeepSpeed's module load, during this ``load_checkpoint``, with the checkpoint's frozen parameters under this
    engine's names (``_frozen_in_engine_layout``)."""
    own = vars(engine).get("load_module_state_dict")
    load_module_state_dict = engine.load_module_state_dict

    def load_module(*args, **kwargs):
        checkpoint = kwargs["checkpoint"] if "checkpoint" in kwargs else args[0]
        if checkpoint.get("frozen_param_fragments") is not None:
            checkpoint = {**checkpoint, "frozen_param_fragments": _frozen_in_engine_layout(
                engine, folder, checkpoint["frozen_param_fragments"])}
            if "checkpoint" in kwargs:
                kwargs["checkpoint"] = checkpoint
            else:
                args = (checkpoint, *args[1:])
        return load_module_state_dict(*args, **kwargs)

    engine.load_module_state_dict = load_module
    try:
        yield
    finally:
        if own is None:
            del engine.load_module_state_dict
        else:
            engine.load_module_state_dict = own


def _universal_other_mlp_layout(engine, folder: str) -> dict:
    """The parameters of ``engine``'s optimizer that a universal checkpoint (``ds_to_universal``: one folder of
    fp32 / moment / step files per parameter under ``zero/``) holds in the other MLP layout: name -> the folders to
    join (gate_proj's and up_proj's, for a gate_up_proj) or (gate_up_proj's folder, the half) to cut. A folder with
    fp32.pt alone does not count: ds_to_universal writes one for every module state key the optimizer did not
    hold, and FusedSwiGLUMLP's state dict has transformers' keys. Empty when every parameter has its own state."""
    zero = os.path.join(folder, "zero")

    def with_state(name):
        return os.path.isdir(os.path.join(zero, name)) and bool(set(os.listdir(os.path.join(zero, name))) -
                                                                {"fp32.pt"})

    names = _optimized_names(engine)
    if not _has_mlp_projections(names) or not os.path.isdir(zero):
        return {}
    other = {}
    for name in names:
        if with_state(name):
            continue
        parts, half = _mlp_parts(name), _mlp_half(name)
        if parts is not None and all(with_state(part) for part in parts):
            other[name] = parts
        elif half is not None and with_state(half[0]):
            other[name] = half
        else:
            return {}  # not a layout change: DeepSpeed's own load says what is missing
    return other


def _universal_state(zero: str, source, key: str):
    """One ``key`` file's content of a parameter held in the other layout (``{"param": tensor, ...}`` from
    ZeRO-1/2, the tensor itself from ZeRO-3, or the step): the two halves' tensors joined, or the whole one's cut."""
    def load(name):
        return torch.load(os.path.join(zero, name, f"{key}.pt"), weights_only=False)

    def tensor(value):
        return value["param"] if isinstance(value, dict) else value

    if isinstance(source, list):
        parts = [load(part) for part in source]
        template = parts[0]
        joined = None if key == "step" else torch.cat([tensor(part) for part in parts])
    else:
        template = load(source[0])
        joined = None if key == "step" else tensor(template).chunk(2)[source[1]].clone()
    if key == "step":
        return template
    return {**template, "param": joined} if isinstance(template, dict) else joined


@contextlib.contextmanager
def _universal_across_mlp_layout(engine, folder: str):
    """DeepSpeed's universal-checkpoint load, during this ``load_checkpoint``, with the parameters the checkpoint
    holds in the other MLP layout (``_universal_other_mlp_layout``) read from their other-layout folders: DeepSpeed
    reads each parameter's folder by its name (a FileNotFoundError for a gate_up_proj converted from a stock run;
    "Steps [...] are not equal" the other way, from the fp32-only folders). Each such parameter's files are written,
    joined or cut, into a temporary folder of their own for the one call of DeepSpeed's per-parameter loader that
    reads them (ZeRO-1/2 and BF16_Optimizer: the parameter's ``load_hp_checkpoint_state``; ZeRO-3: the optimizer's,
    one key a call), so the rest of its loader (fragments, TP slices, padding) is DeepSpeed's own."""
    import tempfile

    other = _universal_other_mlp_layout(engine, folder)
    if not other:
        yield
        return
    zero = os.path.join(folder, "zero")

    def redirected(load, all_keys: bool):
        def load_from(param_folder, *args, **kwargs):
            source = other.get(os.path.basename(param_folder))
            if source is None:
                return load(param_folder, *args, **kwargs)
            probe = os.path.join(zero, source[0])  # gate_proj's folder, or gate_up_proj's
            keys = ([f[:-3] for f in os.listdir(probe) if f.endswith(".pt")] if all_keys
                    else [kwargs.get("key", args[0] if args else None)])
            with tempfile.TemporaryDirectory(prefix="loongforge_universal_") as tmp:
                for key in keys:
                    torch.save(_universal_state(zero, source, key), os.path.join(tmp, f"{key}.pt"))
                return load(tmp, *args, **kwargs)
        return load_from

    optimizer, restore = engine.optimizer, []
    lp_groups = _lp_groups(optimizer)
    if lp_groups is not None:  # ZeRO-1/2, BF16_Optimizer: each parameter's own loader
        names = optimizer.param_names
        for params in lp_groups:
            for param in params:
                if names.get(param) in other and hasattr(param, "load_hp_checkpoint_state"):
                    restore.append((param, param.load_hp_checkpoint_state))
                    param.load_hp_checkpoint_state = redirected(param.load_hp_checkpoint_state, True)
    elif hasattr(optimizer, "load_hp_checkpoint_state"):  # ZeRO-3: the optimizer's, (folder, key, param=)
        restore.append((optimizer, vars(optimizer).get("load_hp_checkpoint_state")))
        optimizer.load_hp_checkpoint_state = redirected(optimizer.load_hp_checkpoint_state, False)
    fused = any(isinstance(source, list) for source in other.values())
    _note("[LoongForge] %s: a universal checkpoint with the MLPs' gate and up projections as %s, loaded as "
          "%s: their states joined or cut per parameter", folder,
          *(("two", "one gate_up_proj") if fused else ("one gate_up_proj", "two")))
    try:
        yield
    finally:
        for owner, load in restore:
            if load is None:
                del owner.load_hp_checkpoint_state
            else:
                owner.load_hp_checkpoint_state = load


def load_checkpoint(original, engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """``DeepSpeedEngine.load_checkpoint`` for an engine with stacked experts (module docstring)."""
    from ds_loongforge.export import tag_folder

    args = (original, engine, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
            load_module_only, custom_load_fn)
    if engine.load_universal_checkpoint():  # DeepSpeed's universal load reads the tag in 'latest_universal'
        with _universal_across_mlp_layout(engine, tag_folder(load_dir, tag, latest="latest_universal")):
            return _load_checkpoint(*args)
    with _frozen_by_engine_names(engine, tag_folder(load_dir, tag)):
        return _load_checkpoint(*args)


def _load_checkpoint(original, engine, load_dir, tag, load_module_strict, load_optimizer_states,
                     load_lr_scheduler_states, load_module_only, custom_load_fn):
    from ds_loongforge.export import MODEL_FILE, ZERO3_MODEL_FILE, tag_folder

    kwargs = dict(load_module_strict=load_module_strict, load_lr_scheduler_states=load_lr_scheduler_states,
                  custom_load_fn=custom_load_fn)
    folder = tag_folder(load_dir, tag)
    if engine.optimizer is not None and hasattr(engine.optimizer, "__dict__"):
        vars(engine.optimizer).pop(REGROUP_ATTRIBUTE, None)  # set again by a load across sharding that regroups
    saved_here = os.path.isfile(os.path.join(folder, MODEL_FILE))  # not, e.g., without 'latest': DeepSpeed's answer
    sharded = getattr(engine, "has_moe_layers", False) and _holds_stacked_experts(engine.module)
    unsharded = holds_unsharded_experts(engine)
    if (saved_here and (sharded or unsharded) and not engine.load_universal_checkpoint()
            and unsharded == bool(_expert_files(folder))):
        return _load_across_sharding(original, engine, load_dir, tag, folder, load_optimizer_states,
                                     load_module_only, kwargs, into_sharded=sharded)
    if (engine.zero_optimization_partition_weights() and not engine.load_universal_checkpoint()
            and os.path.isfile(os.path.join(folder, ZERO3_MODEL_FILE))
            and _saved_with_other_mlp_params(engine, folder, ZERO3_MODEL_FILE)):
        return _load_zero3_across_mlp_layout(original, engine, load_dir, tag, folder, load_optimizer_states,
                                             load_module_only, kwargs)
    wants_optimizer = _wants_optimizer_state(engine, load_optimizer_states, load_module_only)
    # saved with the MLPs' gate_proj and up_proj where this engine has one gate_up_proj, or the other way: DeepSpeed's
    # load would refuse the partitions ("parameter-alignment layout does not match"); the weights load by name (the
    # fused MLP's state dict has the stock keys), the optimizer state is rebuilt per parameter below
    mlp_renamed = saved_here and wants_optimizer and _saved_with_other_mlp_params(engine, folder)
    if (load_optimizer_states and not load_module_only and not engine.zero_optimization()
            and getattr(engine, "has_moe_layers", False)):
        _check_unpartitioned_ep_size(engine, folder)
    if (saved_here and not load_optimizer_states and not load_module_only and not engine.zero_optimization()
            and not engine.load_universal_checkpoint() and _sixteen_bit_wrapper(engine.optimizer)):
        result = original(engine, load_dir, tag, load_optimizer_states=False, load_module_only=False, **kwargs)
        if result[0] is not None:
            _masters_from_checkpoint(engine, folder)
        return result
    if (saved_here and load_optimizer_states and not load_module_only and not engine.zero_optimization()
            and not engine.load_universal_checkpoint()):
        converted = _unpartitioned_state_across_mlp_layout(engine, folder)
        if converted is not None:
            result = original(engine, load_dir, tag, load_optimizer_states=False, load_module_only=False, **kwargs)
            if result[0] is not None:
                engine.optimizer.load_state_dict(converted)
                _note("[LoongForge] %s: saved with the MLPs' gate and up projections in the other layout "
                      "(no ZeRO): the optimizer state mapped per parameter", folder)
                if _sixteen_bit_wrapper(engine.optimizer):
                    check_masters_match_weights(engine, folder)
            return result
    if not (mlp_renamed or (saved_here and sharded and wants_optimizer)):
        return original(engine, load_dir, tag, load_optimizer_states=load_optimizer_states,
                        load_module_only=load_module_only, **kwargs)
    saved = SavedOptimizer(folder)
    lp_groups = _lp_groups(engine.optimizer)
    if not mlp_renamed and _this_layout_matches(engine, saved, lp_groups):
        result = original(engine, load_dir, tag, load_optimizer_states=True, load_module_only=False, **kwargs)
    else:
        result = original(engine, load_dir, tag, load_optimizer_states=False, load_module_only=False, **kwargs)
        if result[0] is not None:
            load_saved_optimizer_state(engine, saved)
            if mlp_renamed:
                fused = any(split_mlp_part(name, saved.shapes) for name in _optimized_names(engine))
                _note("[LoongForge] %s: saved with the MLPs' gate and up projections as %s, loaded as %s: "
                      "fp32 masters and Adam moments rebuilt from the saved partitions", folder,
                      *(("one gate_up_proj", "two") if fused else ("two", "one gate_up_proj")))
            else:
                expert_groups = sorted({ep for ep, _, _ in saved.expert_layout.values()})
                logger.info("[LoongForge] %s: saved by %d ranks (expert groups at ep_size %s%s), loaded at %d ranks: "
                            "fp32 masters and Adam moments rebuilt from the saved partitions", folder, saved.world,
                            expert_groups or "-", ", data before expert parallelism" if saved.before else "",
                            torch.distributed.get_world_size())
    if result[0] is not None:
        check_masters_match_weights(engine, folder)
    return result


def stock_mlp_keys(module, state):
    """A state dict DeepSpeed gathered parameter by parameter under ``named_parameters`` names (ZeRO-3's
    consolidated 16-bit state dict: ``save_16bit_model``, the HF Trainer's ``save_model`` and accelerate's
    ``get_state_dict``) under the keys ``module.state_dict()`` gives: each FusedSwiGLUMLP's ``gate_up_proj`` as
    transformers' ``gate_proj`` and ``up_proj`` rows, in its place. Without this a model saved that way had
    ``gate_up_proj`` keys, and stock transformers initialised its MLPs at random (with a warning only)."""
    from ds_loongforge.modules.norm_mlp import FusedSwiGLUMLP, _split_gate_up_state

    fused = {f"{name}{'.' if name else ''}gate_up_proj.{kind}": name + "." if name else ""
             for name, m in module.named_modules() if isinstance(m, FusedSwiGLUMLP) for kind in ("weight", "bias")}
    if not state or not any(key in fused for key in state):
        return state
    out = type(state)()
    for key, value in state.items():
        piece = {key: value}
        if key in fused:  # the module's own state_dict hook, on this entry
            _split_gate_up_state(None, piece, fused[key], None)
            piece = {k: v.clone() for k, v in piece.items()}  # copies: safetensors refuses shared storage
        out.update(piece)
    return out


def install() -> None:
    """Route ``DeepSpeedEngine.load_checkpoint`` through ``load_checkpoint``, its ZeRO-3 consolidated 16-bit state
    dict through ``stock_mlp_keys``, and ``save_checkpoint`` through ``save_checkpoint`` (once per process)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    def load(original, self, load_dir, tag=None, *args, **kwargs):
        result = load_checkpoint(original, self, load_dir, tag, *args, **kwargs)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            result[1].pop(SIXTEEN_BIT_PARAMS_KEY, None)  # ours, not the client's
        return result

    def consolidated(original, self, *args, **kwargs):
        return stock_mlp_keys(self.module, original(self, *args, **kwargs))

    if patch_once(DeepSpeedEngine, "load_checkpoint", load):
        logger.info("[LoongForge] DeepSpeedEngine.load_checkpoint -> optimizer state across ep_size, expert layout and "
                    "world size for stacked experts (ds_loongforge.checkpoint)")
    patch_once(DeepSpeedEngine, "_zero3_consolidated_16bit_state_dict", consolidated)
    patch_once(DeepSpeedEngine, "save_checkpoint", save_checkpoint)
