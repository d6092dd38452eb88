"""``FusedAdamWClip``: torch.optim.AdamW + clip_grad_norm_ + an inf/nan step skip, in two device passes.

    opt = FusedAdamWClip(model.parameters(), lr=1e-4, weight_decay=0.01, max_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()
    opt.last_grad_norm        # device tensor: the global norm of this step's gradients (no sync)
    opt.skipped_steps         # int: steps skipped for a non-finite gradient (syncs when read)

One step = pass 1 over every gradient (squared global norm + non-finite flag), an optional ``stats_hook`` on
the device stats (the all-reduce under data/expert parallelism), pass 2 per parameter group (clip
coefficient and skip decided on the device, AdamW per tensor). No ``.item()`` and no host branch on a device
value. The update equals ``clip_grad_norm_(params, max_norm)`` followed by ``torch.optim.AdamW.step()``,
except that a step whose gradients hold an inf or nan changes nothing (params, moments, step counts).

bf16/fp16 params get fp32 master weights (``state["master"]``) unless ``master_weights=False``; moments are
fp32. Params whose grad is None are skipped, like torch. ``lr`` and the other hyper-parameters must be Python
numbers (a tensor lr would need a host read). ``state_dict()`` has torch AdamW's layout (plus ``master``);
``load_state_dict`` restores every state tensor bit for bit in its saved dtype.
"""

from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from typing import Callable

import torch

from ds_loongforge.ops._dispatch import check_impl
from ds_loongforge.ops.adamw import (DEFAULT_CLIP_EPS, AdamWBucket, _check_hyper, adamw_clip_apply, grad_norm,
                                     grad_stats, new_stats)

StatsHook = Callable[[torch.Tensor], None]


# torch.optim.AdamW options that change the update this optimizer computes: refused when set, not ignored
_UNSUPPORTED_OPTIONS = {"amsgrad": "AMSGrad's running max of exp_avg_sq",
                        "maximize": "a maximizing step (negate the loss instead)",
                        "differentiable": "autograd through the step"}


def _check_group(group: dict, where: str) -> None:
    """A param group's hyper-parameters in range, and none of torch's AdamW options this update does not do."""
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if group.get(key):
            raise ValueError(f"{where}: {key}={group[key]!r} asks for {what}, which FusedAdamWClip does not do; "
                             f"drop {key!r} (or set it False), or use torch.optim.AdamW")
    _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["max_norm"], where=where)


class FusedAdamWClip(torch.optim.Optimizer):
    """AdamW with global-norm clipping and a non-finite step skip (see the module docstring).

    Args:
        params: parameters or parameter groups (each group may set lr, betas, eps, weight_decay, max_norm).
        max_norm: clip the global gradient norm to this (None: no clipping; the norm is still computed).
        clip_eps: the clip coefficient is max_norm / (norm + clip_eps), as in clip_grad_norm_.
        master_weights: keep fp32 master copies of bf16/fp16 params.
        impl: "auto" | "cuda" | "cpu" | "reference", as for the other ops.
        stats_hook: called with the float32 [2] device tensor [sum of squared grads, non-finite count] between
            the passes; it may reduce it in place (e.g. ``dist.all_reduce(stats)`` when each rank holds a
            disjoint shard of the parameters).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, max_norm: float | None = None, *, clip_eps: float = DEFAULT_CLIP_EPS,
                 master_weights: bool = True, impl: str = "auto", stats_hook: StatsHook | None = None):
        _check_hyper(lr, betas, eps, weight_decay, max_norm, where="FusedAdamWClip")
        if not clip_eps >= 0.0:
            raise ValueError(f"FusedAdamWClip: clip_eps must be >= 0, got {clip_eps!r}")
        check_impl(impl)
        self.impl = impl
        self.master_weights = master_weights
        self.clip_eps = clip_eps
        self.stats_hook = stats_hook
        self.last_grad_norm: torch.Tensor | None = None
        self.last_stats: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self.last_skipped: torch.Tensor | None = None  # device int64: 1 if the last step was skipped, else 0
        self._buckets: dict[tuple, AdamWBucket] = {}
        self._followed: list[tuple[dict, dict]] = []
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_norm=max_norm)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with the group's hyper-parameters (its own or the defaults) checked before it joins: a
        rejected group leaves the optimizer as it was."""
        where = f"FusedAdamWClip param group {len(self.param_groups)}"
        _check_group({**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}, where)
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a generator is read once: as a list, in the same dict
            param_group["params"] = params = list(params)  # (torch does so too; a client's scheduler holds it)
        if isinstance(params, list) and len({id(p) for p in params}) != len(params):
            # torch only warns (an error in its future); the fused step would update it twice with one step count
            raise ValueError(f"{where}: a parameter appears more than once in the group; list each once")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        g["betas"] = tuple(g["betas"])

    def follow_hyperparameters(self, group: dict, source: dict) -> None:
        """``group`` (one of this optimizer's) takes ``source``'s lr, betas, eps and weight decay at every step:
        for a group split off another optimizer's group (a client optimizer's expert parameters, split into their
        own group for ZeRO), whose LR scheduler drives the original dict only."""
        if not any(g is group for g in self.param_groups):
            raise ValueError("follow_hyperparameters: group is not one of this optimizer's param_groups")
        self._followed.append((group, source))

    def _follow(self) -> None:
        for group, source in self._followed:
            group.update(lr=source["lr"], betas=tuple(source["betas"]), eps=source["eps"],
                         weight_decay=source["weight_decay"])

    def state_dict(self) -> dict:
        """torch's, with every following group first given its source's hyper-parameters (as the next step will):
        saved, a split group has its source's lr, not the one of the step before (a scheduler sets the source's
        after the step)."""
        self._follow()
        return super().state_dict()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was non-finite (reads a device counter: syncs)."""
        return 0 if self._skipped is None else int(self._skipped.item())

    @property
    def _global_grad_norm(self) -> torch.Tensor | None:
        """What DeepSpeed's engine reports as get_global_grad_norm() when this is its optimizer (ZeRO-0)."""
        return self.last_grad_norm

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            if self.master_weights and p.dtype in (torch.bfloat16, torch.float16):
                state["master"] = p.detach().float().contiguous()
        elif state["step"].dim():  # DeepSpeed's elastic checkpoint load writes it as a [1] tensor
            state["step"] = state["step"].reshape(())
        return state

    def _group_buckets(self, group_index: int, group: dict) -> list[AdamWBucket]:
        """This step's buckets of one group: params with a grad, split by (device, dtypes, master)."""
        members: dict[tuple, list] = defaultdict(list)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("FusedAdamWClip does not support sparse gradients")
            if not p.is_contiguous():
                raise RuntimeError(f"FusedAdamWClip needs contiguous params, got strides {p.stride()}")
            state = self._state_for(p)
            layout = (p.device, p.dtype, p.grad.dtype, "master" in state)
            members[layout].append((p, state))
        buckets = []
        for layout, items in members.items():
            bucket = self._buckets.get((group_index,) + layout)
            if bucket is None:
                bucket = AdamWBucket([], [], [], [], [])
                self._buckets[(group_index,) + layout] = bucket
            bucket.params = [p.detach() for p, _ in items]
            bucket.grads = [p.grad.contiguous() for p, _ in items]
            bucket.exp_avgs = [s["exp_avg"] for _, s in items]
            bucket.exp_avg_sqs = [s["exp_avg_sq"] for _, s in items]
            bucket.steps = [s["step"] for _, s in items]
            bucket.masters = [s["master"] for _, s in items] if layout[3] else None
            buckets.append(bucket)
        return buckets

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale: float | torch.Tensor = 1.0):
        """One step. ``inv_scale``: 1 / loss scale of fp16 training (grads are unscaled on the fly); a number,
        or a float32 one-element device tensor (a dynamic loss scale that never leaves the device)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        per_group = [(group, self._group_buckets(i, group)) for i, group in enumerate(self.param_groups)]
        self.step_buckets(per_group, inv_scale)
        return loss

    @torch.no_grad()
    def step_buckets(self, per_group: list[tuple[dict, list[AdamWBucket]]],
                     inv_scale: float | torch.Tensor = 1.0) -> None:
        """The two passes over prepared buckets, each with its group's hyper-parameters: what ``step`` does
        after gathering the grads. DeepSpeed's ZeRO glue calls it with buckets over its flat partitions."""
        # what torch's wrapped step() records for an LR scheduler on this optimizer: under ZeRO step() never runs,
        # and the scheduler's first step warned that optimizer.step() had not been called before it
        self._opt_called = True
        self._follow()
        for i, (group, _) in enumerate(per_group):  # every group before any update: no step half applied
            _check_group(group, f"FusedAdamWClip param group {i}")
        all_buckets = [b for _, buckets in per_group for b in buckets]
        self.last_skipped = None
        if not all_buckets:
            return
        stats = grad_stats(all_buckets, new_stats(all_buckets[0].device), impl=self.impl)
        if self.stats_hook is not None:
            self.stats_hook(stats)
        for group, buckets in per_group:
            for bucket in buckets:
                max_norm = group["max_norm"]
                adamw_clip_apply(bucket, stats, float(group["lr"]), tuple(map(float, group["betas"])),
                                 float(group["eps"]), float(group["weight_decay"]),
                                 None if max_norm is None else float(max_norm), self.clip_eps, inv_scale,
                                 impl=self.impl)
        self.last_stats = stats
        self.last_grad_norm = grad_norm(stats, inv_scale)
        skipped = (stats[1] != 0).to(torch.int64)
        self._skipped = skipped if self._skipped is None else self._skipped + skipped
        self.last_skipped = skipped
        for bucket in all_buckets:  # the cached buckets must not keep this step's gradients alive: under ZeRO
            bucket.grads = []       # that was a whole flat gradient partition held until the next step
            shared = bucket.shared_step
            if shared is not None:  # a partition bucket over gradient pieces: its scratch counters advanced
                shared.copy_(bucket.steps[0])  # together (or not at all, on a skipped step)

    def partition_bucket(self, group_index: int, master: torch.Tensor, grad: torch.Tensor | list[torch.Tensor],
                         low_precision: torch.Tensor | None = None, key=None) -> AdamWBucket:
        """One bucket over a flat fp32 partition ``master`` (this optimizer's param of group ``group_index``)
        and its gradient ``grad``. With ``low_precision`` (the bf16/fp16 partition the model reads), the kernel
        reads the gradient in that dtype and writes both the fp32 partition and the low-precision one: no fp32
        copy of the gradients and no separate copy-back pass.

        ``grad`` may also be the partition's gradient as a list of pieces that tile it from its start, in order
        (ZeRO's per-parameter gradient views): the bucket then has one entry per piece over the matching slices
        of the partition and its moments, so no flat copy of the gradients is made. Every entry needs its own
        step counter in the kernel; they are scratch copies of the partition's one step, written back by
        ``step_buckets``. The slices are cut once and reused while the pieces' sizes and the partition's storage
        stay the same (every step, in training).

        ``key``: which cached bucket this is, where one group has several partitions (ZeRO-3's sub-groups); the
        group's index by default."""
        state = self._state_for(master)
        key = ("partition", group_index) if key is None else ("partition", key)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = AdamWBucket([], [], [], [], [])
        bucket.shared_step = None
        if isinstance(grad, torch.Tensor):
            bucket.pieces_layout = None
            if low_precision is None:
                bucket.params, bucket.masters = [master], None
            else:
                bucket.params, bucket.masters = [low_precision], [master]
            bucket.grads = [grad]
            bucket.exp_avgs, bucket.exp_avg_sqs = [state["exp_avg"]], [state["exp_avg_sq"]]
            bucket.steps = [state["step"]]
            return bucket
        sizes = tuple(g.numel() for g in grad)
        if sum(sizes) > master.numel() or not grad:
            raise ValueError(f"partition_bucket: gradient pieces of {sum(sizes)} elements in {len(grad)} tensors "
                             f"do not fit the partition of {master.numel()}")
        owners = (master, state["exp_avg"], state["exp_avg_sq"], state["step"], low_precision)
        layout = (sizes,) + tuple(t.data_ptr() if t is not None else None for t in owners)
        if bucket.pieces_layout != layout:  # the first step, or a new partition / loaded state: cut again
            cut = lambda t: list(torch.split(t[:sum(sizes)], sizes))  # noqa: E731
            masters = cut(master)
            if low_precision is None:
                bucket.params, bucket.masters = masters, None
            else:
                bucket.params, bucket.masters = cut(low_precision), masters
            bucket.exp_avgs, bucket.exp_avg_sqs = cut(state["exp_avg"]), cut(state["exp_avg_sq"])
            bucket.step_scratch = torch.empty(len(sizes), dtype=torch.float32, device=master.device)
            bucket.steps = list(bucket.step_scratch.unbind())
            bucket.pieces_layout = layout
        bucket.grads = [g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1) for g in grad]
        bucket.step_scratch.copy_(state["step"].expand(len(sizes)))  # stream-ordered, no sync
        bucket.shared_step = state["step"]
        return bucket

    def load_state_dict(self, state_dict: dict) -> None:
        """Like torch's, except that every state tensor keeps its saved dtype (torch would cast the fp32
        moments and masters of bf16 params to bf16) and lands on its param's device, and that the saved
        hyper-parameters are loaded into the param group dicts already here (which others may hold)."""
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
                             f"{len(groups)}")
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"parameter group {i}: the loaded state dict has {len(sg['params'])} params, "
                                 f"the optimizer {len(g['params'])}")
        id_map = {old: p for g, sg in zip(groups, saved_groups) for old, p in zip(sg["params"], g["params"])}
        state: defaultdict = defaultdict(dict)
        for key, value in state_dict["state"].items():
            if key not in id_map:
                continue
            p = id_map[key]
            state[p] = {name: (v.to(device=p.device, copy=True) if isinstance(v, torch.Tensor) else deepcopy(v))
                        for name, v in value.items()}
            if "step" in state[p]:  # a number in torch < 1.12's and some other optimizers' state dicts
                state[p]["step"] = torch.as_tensor(state[p]["step"], dtype=torch.float32,
                                                   device=p.device).reshape(())
        for i, sg in enumerate(saved_groups):
            for key, value in self.defaults.items():  # torch.optim.AdamW's groups have no max_norm
                sg.setdefault(key, value)
            _check_group(sg, f"load_state_dict: the loaded param group {i}")
        for g, sg in zip(groups, saved_groups):  # into the same dicts: torch would put new ones in their place,
            sg["params"] = g["params"]           # and an LR scheduler built on a client optimizer whose groups
            sg["betas"] = tuple(sg["betas"])     # these are (ds_integration._client_adamw_groups) would go on
            g.clear()                            # setting an lr nobody reads
            g.update(sg)
        self.__setstate__({"state": state, "param_groups": groups})
        self._buckets.clear()
