"""``loongforge_export CHECKPOINT OUTPUT``: a DeepSpeed checkpoint of a ds_loongforge model, expert-parallel or
not, to the model's weights under transformers' keys (the fp32 masters by default), in a folder that
``from_pretrained`` loads.

What DeepSpeed's own tools do with such a checkpoint, and what this adds:

- ``zero_to_fp32`` concatenates every rank's ZeRO partition of every optimizer group. Under expert parallelism an
  expert group is partitioned over one expert-data-parallel group, and the ranks of an expert-parallel group hold
  different experts, so it cannot rebuild them (it stops at the per-expert files); ``ds_to_universal`` knows
  AutoEP's layers only.
- It names tensors as the engine's parameters. An injected FusedSwiGLUMLP's parameter is ``gate_up_proj.weight``,
  a key stock transformers does not know. Here the keys are the model's ``state_dict()`` keys, as the
  checkpoint's module file holds them (``gate_proj`` / ``up_proj``), and the experts are stacked over all ranks
  as transformers stacks them (``experts.gate_up_proj`` [E, 2I, H]).

How (ZeRO-1/2, the stages DeepSpeed runs MoE layers under; DeepSpeedZeroOptimizer's files, or BF16_Optimizer's
for ZeRO-1 bf16 with fp32 gradient accumulation): each optimizer group's fp32 partitions come from the
``*_optim_states.pt`` files. A dense group is unflattened from all ranks' partitions in rank order (DeepSpeed's
``zero_to_fp32._zero2_merge_trainable_params``); an expert group from the ranks of each expert-data-parallel
group (the layout of ``deepspeed.utils.groups``, with the config's ``use_data_before_expert_parallelism``), once per
expert-parallel rank, and the ranks' local experts are concatenated in expert-parallel rank order (rank e holds
experts [e * E/ep, (e + 1) * E/ep), as DeepSpeed numbers its per-expert files).

A ZeRO-3 checkpoint (whose model files hold no weights) is assembled by ``zero_to_fp32`` itself, its fused MLPs
cut into transformers' keys (``_zero3_state_dict``).

Without ZeRO, an fp32 run's weights are its masters. A bf16/fp16 run's masters are DeepSpeed's FP16_Optimizer's flat
groups or FP16_UnfusedOptimizer's lists, in the model file (with expert parallelism: one optimizer file per
expert-parallel rank). They carry no names, and ``zero_to_fp32`` does not read them; ds_loongforge records which
parameter each is when the checkpoint is saved (``checkpoint.sixteen_bit_optimizer_params``), and
``sixteen_bit_masters`` reads them by that record. A checkpoint saved without it is an error naming
``--source module``.

Then every tensor is checked against the weights the model ran with: the module file and the per-expert files
hold each master rounded to the training dtype, bit for bit (a NaN matching a NaN). A layout read wrong, a file
from another run, a missing rank or MoE layer is an error naming it, never a silently wrong tensor. Frozen
parameters and buffers have no master and come from those files (upcast to fp32: exact). ``source="module"``
exports those files' weights alone, in the training dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import logging
import os
import pickle
import re
import sys
from types import SimpleNamespace

import torch

logger = logging.getLogger("ds_loongforge")

SOURCES = ("masters", "module")
MODEL_FILE = "mp_rank_00_model_states.pt"
# DeepSpeedEngine._get_expert_ckpt_name / _get_zero_ckpt_name (bf16_ / fp16 prefixes vary by optimizer)
EXPERT_FILES_GLOB = "layer_*_expert_*_mp_rank_00_model_states.pt"
EXPERT_FILE = re.compile(r"^layer_(?P<layer>\d+)_expert_(?P<expert>\d+)_mp_rank_00_model_states\.pt$")
# DeepSpeedEngine._get_optimizer_ckpt_name: without ZeRO, one optimizer file per expert-parallel rank
EXPERT_OPTIM_FILES_GLOB = "expp_rank_*_mp_rank_00_optim_states.pt"
EXPERT_OPTIM_FILE = re.compile(r"^expp_rank_(?P<rank>\d+)_mp_rank_00_optim_states\.pt$")


def expert_optimizer_file(rank: int) -> str:
    """Expert-parallel rank ``rank``'s optimizer file without ZeRO."""
    return f"expp_rank_{rank}_mp_rank_00_optim_states.pt"


ZERO_FILE = re.compile(r"^(?:\w+_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_00_optim_states\.pt$")
EXPERT_KEY = re.compile(r"^(?P<module>.+)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<expert>\d+)\."
                        r"(?P<param>[^.]+)$")


class CheckpointExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names the file or key and the fix."""


def tag_folder(checkpoint_dir: str, tag: str | None = None, latest: str = "latest") -> str:
    """The folder of one saved step: ``checkpoint_dir/tag``, the tag in ``checkpoint_dir/<latest>`` (as
    DeepSpeed's load_checkpoint reads it: 'latest', or 'latest_universal' for a universal load), or
    ``checkpoint_dir`` itself."""
    if tag is not None:
        return os.path.join(checkpoint_dir, str(tag))
    if os.path.isfile(os.path.join(checkpoint_dir, latest)):
        with open(os.path.join(checkpoint_dir, latest)) as f:
            return os.path.join(checkpoint_dir, f.read().strip())
    return checkpoint_dir


def zero3_model_file(rank: int) -> str:
    """Data-parallel rank ``rank``'s model file under ZeRO-3 (DeepSpeedEngine._get_ckpt_name)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


ZERO3_MODEL_FILE = zero3_model_file(0)


def checkpoint_folder(checkpoint_dir: str, tag: str | None = None) -> str:
    """``tag_folder``, which must hold the model file (ZeRO-3's first rank's, for a ZeRO-3 checkpoint)."""
    folder = tag_folder(checkpoint_dir, tag)
    if not any(os.path.isfile(os.path.join(folder, name)) for name in (MODEL_FILE, ZERO3_MODEL_FILE)):
        raise CheckpointExportError(
            f"no DeepSpeed checkpoint at {folder}: {MODEL_FILE} is missing (pass the folder that "
            "engine.save_checkpoint wrote, holding a 'latest' file, or the tag's own folder, or name the tag)")
    return folder


def _load(path: str) -> dict:
    # DeepSpeed's files hold its own objects (config enums, fragment addresses): not loadable with weights_only
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def _model_states(folder: str, model_file: str = MODEL_FILE) -> dict:
    states = _load(os.path.join(folder, model_file))
    dims = states.get("checkpoint_parallel_dimensions") or {}
    if states.get("mp_world_size", 1) != 1 or dims.get("tp_degree", 1) != 1 or dims.get("pp_degree", 1) != 1:
        raise CheckpointExportError(
            f"{folder} was saved with tensor or pipeline parallelism (mp_world_size {states.get('mp_world_size')}, "
            f"{dims}); only data and expert parallelism are supported")
    if states.get("module") is None:
        raise CheckpointExportError(f"{folder}: {MODEL_FILE} holds no module state (a pipeline checkpoint?)")
    return states


def saved_weights(folder: str, model_states: dict | None = None) -> dict[str, torch.Tensor]:
    """The weights the model ran with, as the checkpoint holds them (the training dtype), under the model's
    state-dict keys: the module file's dense tensors, and each MoE layer's per-expert files stacked in global
    expert order under the stacked name (``<experts>.gate_up_proj`` [E, 2I, H], ``<experts>.down_proj``)."""
    from ds_loongforge.modules.moe_deepspeed import EXPERT_PARAM_NAMES

    states = model_states if model_states is not None else _model_states(folder)
    weights = dict(states["module"])
    experts: dict[str, dict[int, torch.Tensor]] = {}
    layers: dict[int, str] = {}
    for path in sorted(glob.glob(os.path.join(folder, EXPERT_FILES_GLOB))):
        name = os.path.basename(path)
        match = EXPERT_FILE.match(name)
        if match is None:
            raise CheckpointExportError(f"{path}: not a per-expert file name DeepSpeed writes")
        expert = int(match["expert"])
        for key, tensor in _load(path).items():
            parsed = EXPERT_KEY.match(key)
            if parsed is None or parsed["param"] not in EXPERT_PARAM_NAMES:
                raise CheckpointExportError(
                    f"{path} holds {key}, not a ds_loongforge stacked expert weight "
                    f"(<experts>.{EXPERT_PARAM_NAMES[0]} or .{EXPERT_PARAM_NAMES[1]}); DeepSpeed's own MoE layers "
                    "are not supported here")
            if int(parsed["expert"]) != expert:
                raise CheckpointExportError(f"{path} holds expert {parsed['expert']}'s {key}")
            if layers.setdefault(int(match["layer"]), parsed["module"]) != parsed["module"]:
                raise CheckpointExportError(f"{path}: layer {match['layer']} holds experts of two modules")
            experts.setdefault(f"{parsed['module']}.{parsed['param']}", {})[expert] = tensor
    num_experts = states.get("num_experts") or []
    absent = [layer for layer in range(len(num_experts)) if layer not in layers]
    if absent:
        raise CheckpointExportError(
            f"{folder}: the model has {len(num_experts)} MoE layers and the per-expert files of layers {absent} are "
            "missing (layer_<L>_expert_<id>_mp_rank_00_model_states.pt); the checkpoint is incomplete")
    for key, by_expert in experts.items():
        ids = sorted(by_expert)
        layer = next(layer for layer, module in layers.items() if key.startswith(module + "."))
        want = num_experts[layer] if layer < len(num_experts) else len(ids)
        if ids != list(range(want)):
            missing = sorted(set(range(want)) - set(ids))
            raise CheckpointExportError(
                f"{folder}: {key} is missing the files of experts {missing} of {want} "
                f"(layer_{layer}_expert_<id>_mp_rank_00_model_states.pt); the checkpoint is incomplete")
        weights[key] = torch.stack([by_expert[e] for e in ids])
    return weights


def _zero_files(folder: str, world: int) -> list[str]:
    ranks = {}
    for path in glob.glob(os.path.join(folder, "*_optim_states.pt")):
        match = ZERO_FILE.match(os.path.basename(path))
        if match:
            ranks[int(match["rank"])] = path
    if ranks and sorted(ranks) != list(range(world)):
        raise CheckpointExportError(
            f"{folder} was saved by {world} data-parallel ranks but holds the ZeRO optimizer files of ranks "
            f"{sorted(ranks)}: those of {sorted(set(range(world)) - set(ranks))} are missing")
    return [ranks[r] for r in sorted(ranks)]


def _unflatten(partitions: list[torch.Tensor], shapes: dict, paddings: list | None) -> dict[str, torch.Tensor]:
    """One optimizer group's fp32 parameters from its ZeRO partitions in partition order, by DeepSpeed's own
    unflatten (which checks the consumed size against the partitions' padded size)."""
    from deepspeed.utils import zero_to_fp32

    out: dict[str, torch.Tensor] = {}
    with contextlib.redirect_stdout(io.StringIO()) as said:
        zero_to_fp32._zero2_merge_trainable_params(out, len(partitions), [[p] for p in partitions],
                                                   [SimpleNamespace(param_shapes=[shapes])],
                                                   None if paddings is None else [paddings])
    logger.debug("[LoongForge] export: %s", said.getvalue().strip())
    return out


def expert_data_parallel_ranks(world: int, ep_size: int, data_before_expert: bool
                               ) -> tuple[list[list[int]], dict[int, int]]:
    """DeepSpeed's expert groups of size ep_size over ``world`` ranks (``deepspeed.utils.groups``, in the layout
    ``use_data_before_expert_parallelism`` picks): the expert-data-parallel ranks holding each expert-parallel
    rank's experts, in partition order, by expert-parallel rank; and each rank's expert-parallel rank."""
    from deepspeed.utils import groups

    expert_parallel, expert_data_parallel = groups._get_expert_parallel_ranks(
        world, 1, ep_size, 1, use_data_before_expert_parallel_=data_before_expert)
    ep_rank = {rank: i for members in expert_parallel for i, rank in enumerate(members)}
    holders: list[list[int]] = [[] for _ in range(ep_size)]
    for members in expert_data_parallel:
        held = {ep_rank[rank] for rank in members}
        assert len(held) == 1, (members, held)
        holders[held.pop()] = list(members)
    return holders, ep_rank


def fp32_masters(folder: str, model_states: dict | None = None) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 master of every trainable parameter of a ZeRO-1/2 checkpoint, under the engine's
    parameter names, each expert parameter with all E experts. Empty when the checkpoint has no ZeRO optimizer
    files (ZeRO-0, or saved without the optimizer)."""
    from deepspeed.runtime.config import get_expert_data_topo_config

    states = model_states if model_states is not None else _model_states(folder)
    world = int(states["dp_world_size"])
    files = _zero_files(folder, world)
    if not files:
        return {}
    optim = [_load(path)["optimizer_state_dict"] for path in files]
    # DeepSpeedZeroOptimizer's files record their stage; BF16_Optimizer's (ZeRO-1 bf16 with fp32 gradient
    # accumulation) do not, and keep each rank's group padding at the end of its partition
    bf16_optimizer = "zero_stage" not in optim[0]
    stage = 1 if bf16_optimizer else int(optim[0]["zero_stage"])
    if stage not in (1, 2):
        raise CheckpointExportError(f"{folder}: ZeRO stage {stage} checkpoints are not supported (ZeRO-1/2 are; "
                                    "DeepSpeed runs MoE layers under those only)")
    if stage == 2 and states.get("frozen_param_shapes") is None:
        logger.warning("[LoongForge] export: %s was saved with exclude_frozen_parameters: frozen parameters, if "
                       "the model had any, are not in it, nor in the export", folder)
    shapes = states["param_shapes"]
    counts = optim[0]["partition_count"]
    counts = counts if isinstance(counts, list) else [counts] * len(shapes)
    paddings = optim[0].get("param_alignment_paddings")
    before = bool(get_expert_data_topo_config(states.get("ds_config") or {}))
    masters: dict[str, torch.Tensor] = {}
    for g, group_shapes in enumerate(shapes):
        partitions = [o["single_partition_of_fp32_groups"][g] for o in optim]
        if bf16_optimizer:
            partitions = [p[:p.numel() - o["group_paddings"][g]] for p, o in zip(partitions, optim)]
        group_paddings = None if paddings is None else paddings[g]

        def unflatten(ranks: list[int], what: str) -> dict[str, torch.Tensor]:
            try:
                return _unflatten([partitions[rank] for rank in ranks], group_shapes, group_paddings)
            except (ValueError, RuntimeError) as error:
                raise CheckpointExportError(
                    f"{folder}: optimizer group {g} ({what}, ranks {ranks}) does not unflatten into its parameters "
                    f"{list(group_shapes)[:3]}...: {error}. If the model built its expert groups itself, its "
                    "layout may differ from the config's use_data_before_expert_parallelism") from error

        if counts[g] == world:
            masters.update(unflatten(list(range(world)), "dense"))
            continue
        if world % counts[g]:
            raise CheckpointExportError(f"{folder}: optimizer group {g} is partitioned {counts[g]} ways over "
                                        f"{world} ranks, which no expert-parallel size gives")
        holders, _ = expert_data_parallel_ranks(world, world // counts[g], before)
        ep_size = len(holders)
        local = [unflatten(members, f"experts, ep_size {ep_size}") for members in holders]
        for name in group_shapes:
            masters[name] = torch.cat([local[e][name] for e in range(ep_size)])
    return masters


def sixteen_bit_masters(folder: str, states: dict, saved_weights: dict[str, torch.Tensor], dtypes: list[str]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The fp32 masters of a checkpoint saved without ZeRO in bf16/fp16 (DeepSpeed's FP16_Optimizer: one flat
    master a parameter group; FP16_UnfusedOptimizer: a list), under the engine's parameter names, each expert
    parameter with all E experts; and the tied parameters. Those files name no parameter: the names come from the
    record ds_loongforge saves beside them (``checkpoint.sixteen_bit_optimizer_params``). The optimizer state is
    in the model file, or with expert parallelism in one ``expp_rank_<e>_mp_rank_00_optim_states.pt`` per
    expert-parallel rank, whose local experts are concatenated in rank order (dense masters: rank 0's)."""
    from ds_loongforge.checkpoint import SIXTEEN_BIT_PARAMS_KEY

    record = states.get(SIXTEEN_BIT_PARAMS_KEY)
    if not isinstance(record, dict) or not isinstance(record.get("groups"), list):
        raise CheckpointExportError(
            f"{folder} holds no ZeRO optimizer files and its weights are {', '.join(dtypes)}, and it was saved "
            "without the record of which parameter each fp32 master is (DeepSpeed's bf16/fp16 optimizer without ZeRO "
            "saves them unnamed; ds_loongforge records the names when it is installed at save time). Export the "
            "weights the model ran with (source='module', --source module), or save with ds_loongforge installed")
    recorded = RecordedMasters(folder, states, record)
    experts = recorded.expert
    out = {name: recorded.master(name) for name in experts}
    for name in sorted(name for name, expert in experts.items() if expert):
        want = saved_weights.get(name)
        if want is not None and want.dim() and out[name].shape[0] != want.shape[0]:
            raise CheckpointExportError(
                f"{folder}: {name} has {want.shape[0]} experts and the {len(recorded.ranks)} expert-parallel optimizer "
                f"files hold {out[name].shape[0]} of them: the files of the other expert-parallel ranks are missing")
    return out, dict(record.get("shared_params") or {})


def sixteen_bit_optimizer_files(folder: str, states: dict) -> tuple[list[str], list]:
    """The optimizer files of a checkpoint saved without ZeRO and their optimizer states (memory-mapped): the model
    file's, or with expert parallelism one ``expp_rank_<e>_mp_rank_00_optim_states.pt`` per expert-parallel rank,
    in rank order (an error when a rank's is missing)."""
    if not states.get("num_experts"):
        return [os.path.join(folder, MODEL_FILE)], [states.get("optimizer")]
    paths = {}
    for path in glob.glob(os.path.join(folder, EXPERT_OPTIM_FILES_GLOB)):
        match = EXPERT_OPTIM_FILE.match(os.path.basename(path))
        if match:
            paths[int(match["rank"])] = path
    if not paths or sorted(paths) != list(range(len(paths))):
        raise CheckpointExportError(
            f"{folder}: the expert-parallel optimizer files (expp_rank_<e>_mp_rank_00_optim_states.pt) of ranks "
            f"{sorted(paths)} are there; those of ranks 0..{max(paths, default=0)} are needed")
    files = [paths[r] for r in sorted(paths)]
    return files, [_load(path).get("optimizer") for path in files]


class RecordedMasters:
    """The fp32 masters of a checkpoint saved without ZeRO in bf16/fp16 by the names recorded beside them
    (``checkpoint.sixteen_bit_optimizer_params``): ``ranks``, one dict of them a saved optimizer file (the model
    file's, or each expert-parallel rank's in rank order: its local experts); ``expert[name]``, whether the saving
    engine's parameter was an expert one. Memory-mapped: only what ``experts`` cuts is read."""

    def __init__(self, folder: str, states: dict, record: dict):
        files, optim = sixteen_bit_optimizer_files(folder, states)
        self.ranks = [masters_by_record(record, saved, path) for path, saved in zip(files, optim)]
        self.expert = {name: bool(expert) for group in record["groups"] for name, _, expert in group}

    def experts(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor | None:
        """Global experts [lo, hi) of ``name`` (all by default), cut from the files that hold them: expert-parallel
        rank r of R saved experts [r E/R, (r+1) E/R); a parameter saved unsharded holds every expert. None past the
        saved experts."""
        if not self.expert[name]:
            whole = self.ranks[0][name]
            hi = whole.shape[0] if hi is None else hi
            return whole[lo:hi] if hi <= whole.shape[0] else None
        local = self.ranks[0][name].shape[0]
        hi = local * len(self.ranks) if hi is None else hi
        if hi > local * len(self.ranks) or lo >= hi:
            return None
        return torch.cat([self.ranks[r][name][max(lo, r * local) - r * local:min(hi, (r + 1) * local) - r * local]
                          for r in range(lo // local, (hi - 1) // local + 1)])

    def master(self, name: str) -> torch.Tensor | None:
        """The whole saved master of ``name``: every expert of an expert parameter, in global order; a dense one's
        from the first file (every expert-parallel rank holds the same)."""
        return self.experts(name) if self.expert[name] else self.ranks[0][name]


def masters_by_record(record: dict, saved: dict | None, path: str) -> dict[str, torch.Tensor]:
    """One optimizer file's fp32 masters of DeepSpeed's bf16/fp16 wrapper without ZeRO (``saved``: its state dict)
    by the saving engine's parameter names, in the shapes the record gives (an expert-parallel rank's local
    experts): FP16_Optimizer's flat groups cut, FP16_UnfusedOptimizer's lists taken. An error names ``path`` when
    the state is not what the record says."""
    flat = record.get("optimizer") == "FP16_Optimizer"
    key = "fp32_groups_flat" if flat else "fp32_groups"
    groups = saved.get(key) if isinstance(saved, dict) else None
    if not isinstance(groups, list) or len(groups) != len(record["groups"]):
        raise CheckpointExportError(
            f"{path}: its optimizer state holds no {record.get('optimizer')} fp32 masters ('{key}') of "
            f"{len(record['groups'])} parameter groups as the record beside them says (the optimizer not saved, "
            "or files of two saves?); source='module' exports the saved weights alone")
    masters = {}
    for g, (group, params) in enumerate(zip(groups, record["groups"])):
        sizes = [int(torch.Size(shape).numel()) for _, shape, _ in params]
        pieces = (list(group.split(sizes)) if flat and torch.is_tensor(group) and group.numel() == sum(sizes)
                  else list(group) if not flat and isinstance(group, (list, tuple)) and len(group) == len(sizes)
                  else None)
        if pieces is None or any(not torch.is_tensor(p) or p.numel() != n for p, n in zip(pieces, sizes)):
            raise CheckpointExportError(
                f"{path}: optimizer group {g}'s fp32 masters are not the {len(sizes)} parameters "
                f"({sum(sizes)} elements) the record names, {[name for name, _, _ in params][:3]}...: files of "
                "two saves? source='module' exports the saved weights alone")
        masters.update({name: piece.reshape(shape) for piece, (name, shape, _) in zip(pieces, params)})
    return masters


def _name_in_saved(name: str, tensor: torch.Tensor, saved: dict) -> dict[str, torch.Tensor]:
    """An engine parameter under the saved state's keys: itself, or a FusedSwiGLUMLP's fused gate_up split back
    into gate_proj / up_proj by the module's own state-dict hook."""
    from ds_loongforge.modules.norm_mlp import _split_gate_up_state

    if name in saved:
        return {name: tensor}
    prefix, fused, kind = name.rpartition("gate_up_proj.")
    if fused and kind in ("weight", "bias") and f"{prefix}gate_proj.{kind}" in saved:
        state = {name: tensor}
        _split_gate_up_state(None, state, prefix, None)
        return state
    raise CheckpointExportError(f"the optimizer holds {name}, which the checkpoint's module state does not (nor "
                                "as a fused gate_up_proj's gate_proj / up_proj): the files are not of one model")


def _rounds_to(master: torch.Tensor, saved: torch.Tensor) -> bool:
    """The master rounded to the saved dtype is the saved tensor; a NaN matches a NaN (a diverged run's
    checkpoint is still one save; devices write different NaN bits)."""
    cast = master.to(saved.dtype)
    return bool(((cast == saved) | (cast.isnan() & saved.isnan())).all())


def load_state_dict(checkpoint_dir: str, tag: str | None = None, *, source: str = "masters"
                    ) -> dict[str, torch.Tensor]:
    """The model's state dict from a DeepSpeed checkpoint (see the module docstring): keys as the model's
    ``state_dict()`` gives them (transformers' keys for an injected transformers model), experts stacked over
    every expert-parallel rank. ``source="masters"``: trainable parameters are the optimizer's fp32 masters
    (ZeRO-1/2; without ZeRO: in fp32 the weights, in bf16/fp16 the 16-bit wrapper's masters by the names
    ``sixteen_bit_masters`` reads), checked bit for bit against the
    saved weights; frozen ones and buffers come from the saved weights in fp32. ``source="module"``: the saved
    weights, in the dtype the model ran in."""
    if source not in SOURCES:
        raise CheckpointExportError(f"source={source!r}: must be one of {SOURCES}")
    folder = checkpoint_folder(checkpoint_dir, tag)
    if not os.path.isfile(os.path.join(folder, MODEL_FILE)):
        return _zero3_state_dict(folder, source)
    states = _model_states(folder)
    saved = saved_weights(folder, states)
    if source == "module":
        return saved
    masters = fp32_masters(folder, states)
    shared = states.get("shared_params") or {}
    if not masters:
        low = sorted({str(t.dtype) for t in saved.values() if t.is_floating_point() and t.dtype != torch.float32})
        if low:  # bf16/fp16 without ZeRO: the masters are in the optimizer's own files
            masters, shared = sixteen_bit_masters(folder, states, saved, low)
        else:  # fp32 without ZeRO: the weights are the masters
            masters = {k: v for k, v in saved.items() if k not in states.get("buffer_names", ())}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in masters.items():  # fp32 (bf16_master_weights_and_grads keeps bf16 masters: exact in fp32)
        out.update(_name_in_saved(name, tensor.float(), saved))
    for alias, target in shared.items():
        if target in out:
            out[alias] = out[target]
    mismatched = []
    for key, tensor in out.items():
        want = saved[key]
        if tensor.shape != want.shape or not _rounds_to(tensor, want):
            diff = ("shape " + str(tuple(tensor.shape)) if tensor.shape != want.shape
                    else f"max |diff| {(tensor.double() - want.double()).abs().max().item():.3g}")
            mismatched.append(f"{key} ({diff})")
    if mismatched:
        raise CheckpointExportError(
            f"{folder}: {len(mismatched)} fp32 masters do not round to the weights saved beside them: "
            f"{', '.join(mismatched[:5])}{' ...' if len(mismatched) > 5 else ''}. The files are not of one "
            "save (an overwritten or mixed checkpoint?); source='module' exports the saved weights alone")
    for key, tensor in saved.items():
        if key not in out:  # frozen parameters and buffers: no master; fp32 holds them exactly
            out[key] = tensor.float() if tensor.is_floating_point() else tensor
    return {key: out[key] for key in saved}


def _zero3_state_dict(folder: str, source: str) -> dict[str, torch.Tensor]:
    """``load_state_dict`` of a ZeRO-3 checkpoint: DeepSpeed's ``zero_to_fp32`` assembles it (the masters from
    every rank's partitions, frozen parameters from their saved fragments, buffers, tied weights) under the
    engine's parameter names, and a fused MLP's gate_up_proj is cut into transformers' gate_proj and up_proj
    here. The model files hold no weights under ZeRO-3, so there is nothing to check the masters against, and
    nothing to export for ``source="module"``. DeepSpeed runs no MoE layer under ZeRO-3: no per-expert files."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if source == "module":
        raise CheckpointExportError(f"{folder} is a ZeRO-3 checkpoint, whose model files hold no weights (ZeRO-3 "
                                    "keeps them only as the optimizer's fp32 partitions): export the masters "
                                    "(source='masters', the default)")
    states = _model_states(folder, ZERO3_MODEL_FILE)
    keys = dict.fromkeys(states["module"])  # the model's state_dict() keys (empty tensors under ZeRO-3)
    parent, tag = os.path.split(os.path.normpath(folder))
    with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32 prints its progress; stdout is the CLI's summary
        assembled = get_fp32_state_dict_from_zero_checkpoint(parent, tag)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in assembled.items():
        out.update(_name_in_saved(name, tensor.float() if tensor.is_floating_point() else tensor, keys))
    missing = [key for key in keys if key not in out]
    if missing:
        raise CheckpointExportError(f"{folder}: DeepSpeed's zero_to_fp32 assembled no {missing[:5]} (saved with "
                                    "exclude_frozen_parameters, or files of another save?)")
    return {key: out[key] for key in keys}


def _hf_config_path(checkpoint_dir: str, folder: str, config: str | None) -> str | None:
    if config is not None:
        return config
    for where in (folder, checkpoint_dir):
        if os.path.isfile(os.path.join(where, "config.json")):
            return where
    return None


def _save_pretrained(state: dict, config_path: str, output_dir: str, max_shard_size: str) -> str:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(config_path)
    except (OSError, ValueError) as error:
        raise CheckpointExportError(f"--config {config_path}: not a transformers config ({error})") from error
    architecture = (getattr(config, "architectures", None) or [None])[0]
    with torch.device("meta"):
        if architecture and hasattr(transformers, architecture):
            model = getattr(transformers, architecture)._from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointExportError(
            f"the checkpoint's weights do not fit {type(model).__name__} built from {config_path}: missing "
            f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]} (pass the model's own config "
            "with --config, or none to write the bare state dict; a checkpoint saved with "
            "exclude_frozen_parameters holds no frozen parameters)")
    model.save_pretrained(output_dir, max_shard_size=max_shard_size)
    return type(model).__name__


def _save_safetensors(state: dict, output_dir: str, max_shard_size: str) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    seen, unique = set(), {}
    for key, tensor in state.items():  # tied weights share storage, which safetensors refuses
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        unique[key] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    split = split_torch_state_dict_into_shards(unique, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: unique[k] for k in keys}, os.path.join(output_dir, filename), metadata={"format": "pt"})
    if split.is_sharded:
        with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)


def export(checkpoint_dir: str, output_dir: str, tag: str | None = None, *, source: str = "masters",
           config: str | None = None, max_shard_size: str = "5GB") -> dict:
    """Write the checkpoint's state dict (``load_state_dict``) to ``output_dir``: with a transformers config
    (``config``, else a config.json in the step's folder or in ``checkpoint_dir``, which launch/train.py
    writes) through ``save_pretrained`` after a strict key check, so ``from_pretrained(output_dir)`` loads it;
    without one as ``model.safetensors`` (sharded above ``max_shard_size``). Returns a summary."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise CheckpointExportError(f"the output {output_dir!r} is a file; give a folder (it is created)")
    try:  # checked before the checkpoint is read: huggingface_hub parses it the way the save below will
        from huggingface_hub import split_torch_state_dict_into_shards

        split_torch_state_dict_into_shards({}, max_shard_size=max_shard_size)
    except ValueError as error:
        raise CheckpointExportError(f"max_shard_size={max_shard_size!r}: {error} (e.g. \"5GB\")") from None
    folder = checkpoint_folder(checkpoint_dir, tag)
    state = load_state_dict(folder, source=source)
    os.makedirs(output_dir, exist_ok=True)
    config_path = _hf_config_path(checkpoint_dir, folder, config)
    model = _save_pretrained(state, config_path, output_dir, max_shard_size) if config_path else None
    if model is None:
        _save_safetensors(state, output_dir, max_shard_size)
    return {"checkpoint": folder, "output": output_dir, "source": source, "tensors": len(state),
            "elements": sum(t.numel() for t in state.values()),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in state.values()}),
            "model": model, "config": config_path}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="loongforge_export", description="A DeepSpeed checkpoint of a ds_loongforge model (expert-parallel or "
        "not) as the model's fp32 masters under transformers' keys, in a folder from_pretrained loads.")
    parser.add_argument("checkpoint_dir", help="the folder engine.save_checkpoint wrote (with 'latest'), or a step's")
    parser.add_argument("output_dir", help="where the weights go (created)")
    parser.add_argument("--tag", help="the step's tag (default: the one in 'latest')")
    parser.add_argument("--source", choices=SOURCES, default="masters",
                        help="masters: the optimizer's fp32 masters (default); module: the weights the model ran "
                             "with, in the training dtype")
    parser.add_argument("--config", help="a transformers config.json or model folder (default: a config.json in "
                                         "the checkpoint folder); without one, a bare model.safetensors is written")
    parser.add_argument("--max-shard-size", default="5GB")
    args = parser.parse_args(argv)
    try:
        summary = export(args.checkpoint_dir, args.output_dir, args.tag, source=args.source, config=args.config,
                         max_shard_size=args.max_shard_size)
    except (CheckpointExportError, OSError) as error:
        print(f"loongforge_export: error: {error}", file=sys.stderr)
        return 1
    except (RuntimeError, pickle.UnpicklingError) as error:  # torch.load of a truncated or foreign file
        print(f"loongforge_export: error: could not read the checkpoint in {args.checkpoint_dir!r}: "
              f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
