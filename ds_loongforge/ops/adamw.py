"""Fused AdamW + global-norm gradient clipping + non-finite skip over many tensors, and its PyTorch reference.

Two passes over the gradients and no host sync:

    pass 1   grad_stats(buckets) -> stats = [sum of squared grads, non-finite count]   float32 [2], on device
    (hook)   e.g. all_reduce(stats, SUM) over the data- and expert-parallel groups: one collective
    pass 2   adamw_clip_apply(bucket, stats, ...)   once per parameter group (bucket), on device:
                 norm  = sqrt(stats[0]) * inv_scale
                 scale = inv_scale * min(1, max_norm / (norm + clip_eps))        (1 when max_norm is None)
                 if stats[1] == 0:  AdamW(param, grad * scale) with step + 1, then step += 1
                 else:              params, moments and step counts stay bit-identical

AdamW is torch.optim.AdamW's (decoupled weight decay, bias correction from each tensor's own step count) in
fp32, operation for operation. A bucket holds same-layout tensors of one group: fp32 params + fp32 grads, or
bf16/fp16 params with fp32 master weights (``masters``) and grads of the param dtype or fp32 (the low-precision
param is rewritten from its master); moments are always fp32 (bf16 moments are not offered). Step counts are
one-element fp32 tensors on the device, like torch's ``state["step"]``.

A bucket's tensor table (addresses, sizes, chunk list) is built on the host once per layout and copied to the
device asynchronously; it is rebuilt only when a tensor's storage changes (e.g. grads set to None and
reallocated). The kernels are deterministic: pass 1 reduces fixed per-block partials in a fixed order.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Sequence

import torch

from ds_loongforge.op_builder import FusedAdamWClipBuilder, FusedAdamWClipCPUBuilder
from ds_loongforge.ops._dispatch import kernel_for

_BUILDERS = {"cuda": FusedAdamWClipBuilder, "cpu": FusedAdamWClipCPUBuilder}
DEFAULT_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


@dataclass(eq=False)
class AdamWBucket:
    """Same-layout tensors of one parameter group; every list has one entry per param."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    masters: list[torch.Tensor] | None = None
    # a ZeRO partition bucket over per-parameter gradient pieces: the partition's one step counter, which
    # the entries' scratch counters (steps) are copied from before the step and into after it
    shared_step: torch.Tensor | None = field(default=None, repr=False)
    step_scratch: torch.Tensor | None = field(default=None, repr=False)
    pieces_layout: tuple | None = field(default=None, repr=False)  # what the cached slices were cut for
    _key: tuple = field(default=(), repr=False)
    _tables: tuple | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def _layout_key(self, module) -> tuple:
        # runs twice per optimizer step over every tensor: addresses of all, sizes of the params (the table
        # builder checks that the others match them), and the dtypes that pick the kernel
        tensors = chain(self.params, self.masters or (), self.grads, self.exp_avgs, self.exp_avg_sqs, self.steps)
        return ((id(module), self.params[0].dtype, self.grads[0].dtype) + tuple(map(torch.Tensor.data_ptr, tensors))
                + tuple(map(torch.Tensor.numel, self.params)))

    def tables(self, module) -> tuple[torch.Tensor, torch.Tensor]:
        """(CPU table, device table), rebuilt only when a tensor's storage, size or dtype changed."""
        key = self._layout_key(module)
        if self._tables is None or key != self._key:
            cpu = module.make_table(self.params, self.masters or [], self.grads, self.exp_avgs, self.exp_avg_sqs,
                                    self.steps)
            if self.device.type == "cuda":
                # pinned + non_blocking: no host sync; the caching host allocator keeps the staging buffer
                # alive until the copy has run
                dev = cpu.pin_memory().to(self.device, non_blocking=True)
            else:
                dev = cpu
            self._tables, self._key = (cpu, dev), key
        return self._tables


def _check_hyper(lr: float, betas: Sequence[float], eps: float, weight_decay: float,
                 max_norm: float | None = None, where: str = "fused_adamw_clip") -> None:
    """Hyper-parameters must be real numbers (Python's or NumPy's; a tensor would need a host read) in range."""
    real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # noqa: E731
    if not (real(lr) and lr >= 0.0):
        raise ValueError(f"{where}: lr must be a float >= 0, got {lr!r}")
    if len(betas) != 2 or not all(real(b) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be two floats in [0, 1), got {tuple(betas)!r}")
    if not (real(eps) and eps > 0.0):
        raise ValueError(f"{where}: eps must be a float > 0, got {eps!r}")
    if not (real(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"{where}: weight_decay must be a float >= 0, got {weight_decay!r}")
    if max_norm is not None and not (real(max_norm) and max_norm > 0.0 and math.isfinite(max_norm)):
        raise ValueError(f"{where}: max_norm must be None (no clipping) or a finite float > 0, got {max_norm!r}")


def _kernel(buckets: Sequence[AdamWBucket], impl: str):
    devices = {b.device for b in buckets}
    if len(devices) != 1:
        raise ValueError(f"fused_adamw_clip: all buckets must be on one device, got {sorted(map(str, devices))}")
    return kernel_for("fused_adamw_clip", _BUILDERS, next(iter(devices)).type, impl)


def new_stats(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------- reference

def grad_stats_reference(buckets: Sequence[AdamWBucket], stats: torch.Tensor) -> torch.Tensor:
    """Pass 1 in PyTorch: stats[0] = sum of squared grads (fp32), stats[1] = number of non-finite grads."""
    total = torch.zeros((), dtype=torch.float32, device=stats.device)
    bad = torch.zeros((), dtype=torch.float32, device=stats.device)
    for g in chain.from_iterable(b.grads for b in buckets):
        gf = g.float()
        total = total + gf.square().sum()
        bad = bad + (~torch.isfinite(gf)).any().float()
    stats[0] = total
    stats[1] = bad
    return stats


def _grad_scale_reference(stats: torch.Tensor, max_norm: float | None, clip_eps: float,
                          inv_scale: float | torch.Tensor):
    inv = torch.as_tensor(inv_scale, dtype=torch.float32, device=stats.device).reshape(())
    if max_norm is None:
        return inv
    return (max_norm / (stats[0].sqrt() * inv + clip_eps)).clamp(max=1.0) * inv


@torch.no_grad()
def adamw_clip_apply_reference(bucket: AdamWBucket, stats: torch.Tensor, lr: float, betas: tuple[float, float],
                               eps: float, weight_decay: float, max_norm: float | None = None,
                               clip_eps: float = DEFAULT_CLIP_EPS, inv_scale: float | torch.Tensor = 1.0) -> None:
    """Pass 2 in PyTorch with the kernels' arithmetic; nothing changes when stats[1] != 0."""
    beta1, beta2 = betas
    skip = stats[1] != 0
    scale = _grad_scale_reference(stats, max_norm, clip_eps, inv_scale)
    decay = 1.0 - lr * weight_decay
    masters = bucket.masters or [None] * len(bucket.params)
    for p, master, g, m, v, step in zip(bucket.params, masters, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs,
                                        bucket.steps):
        new_step = step + 1
        t = new_step.double()
        neg_step_size = (-(lr / (1.0 - beta1 ** t))).float()
        bc2_sqrt = (1.0 - beta2 ** t).sqrt().float()
        gf = g.float() * scale
        pf = (master if master is not None else p.float()) * decay
        m_new = m.lerp(gf, 1.0 - beta1)
        v_new = v * beta2 + (1.0 - beta2) * (gf * gf)
        pf = pf + neg_step_size * (m_new / (v_new.sqrt() / bc2_sqrt + eps))
        m.copy_(torch.where(skip, m, m_new))
        v.copy_(torch.where(skip, v, v_new))
        if master is not None:
            master.copy_(torch.where(skip, master, pf))
        p.copy_(torch.where(skip, p, pf.to(p.dtype)))
        step.copy_(torch.where(skip, step, new_step))


# ------------------------------------------------------------------------------------------------ the op

def grad_stats(buckets: Sequence[AdamWBucket], stats: torch.Tensor | None = None,
               impl: str = "auto") -> torch.Tensor:
    """Pass 1 over every bucket: ``stats = [sum of squared grads, non-finite count]`` (float32 [2], device).

    The sum is of the gradients as stored (times any loss scale); all-reduce ``stats`` with SUM to make it
    global before pass 2.
    """
    if not buckets:
        raise ValueError("grad_stats: needs at least one bucket")
    if stats is None:
        stats = new_stats(buckets[0].device)
    kernel = _kernel(buckets, impl)
    if kernel is None:
        return grad_stats_reference(buckets, stats)
    tables = [b.tables(kernel) for b in buckets]
    kernel.grad_stats([t[0] for t in tables], [t[1] for t in tables], stats)
    return stats


def adamw_clip_apply(bucket: AdamWBucket, stats: torch.Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                     eps: float = 1e-8, weight_decay: float = 1e-2, max_norm: float | None = None,
                     clip_eps: float = DEFAULT_CLIP_EPS, inv_scale: float | torch.Tensor = 1.0,
                     impl: str = "auto") -> None:
    """Pass 2 over one bucket with its group's hyper-parameters (see the module docstring). ``inv_scale``:
    a Python number, or a float32 one-element tensor on the stats' device (a dynamic fp16 loss scale kept on
    the device: read by the kernel, never by the host)."""
    _check_hyper(lr, betas, eps, weight_decay, max_norm)
    inv_scale_t = None
    if isinstance(inv_scale, torch.Tensor):
        if inv_scale.numel() != 1 or inv_scale.dtype != torch.float32 or inv_scale.device != stats.device:
            raise ValueError(f"fused_adamw_clip: a tensor inv_scale must be one float32 element on {stats.device}, "
                             f"got {inv_scale.dtype} of shape {tuple(inv_scale.shape)} on {inv_scale.device}")
        inv_scale_t, inv_scale = inv_scale.reshape(1), 1.0
    elif not inv_scale > 0.0:
        raise ValueError(f"fused_adamw_clip: inv_scale must be > 0, got {inv_scale!r}")
    kernel = _kernel([bucket], impl)
    if kernel is None:
        adamw_clip_apply_reference(bucket, stats, lr, betas, eps, weight_decay, max_norm, clip_eps,
                                   inv_scale if inv_scale_t is None else inv_scale_t)
        return
    cpu, dev = bucket.tables(kernel)
    kernel.adamw_apply(cpu, dev, stats, float(lr), float(betas[0]), float(betas[1]), float(eps),
                       float(weight_decay), float(max_norm) if max_norm is not None else 0.0, float(clip_eps),
                       float(inv_scale), inv_scale_t)


def fused_adamw_clip_step(buckets: Sequence[AdamWBucket], hypers: Sequence[dict], max_norm: float | None = None,
                          inv_scale: float = 1.0, clip_eps: float = DEFAULT_CLIP_EPS, impl: str = "auto",
                          stats_hook: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Pass 1, ``stats_hook(stats)`` (e.g. an all-reduce), pass 2 per bucket; returns stats.

    ``hypers[i]`` holds bucket i's ``lr``, ``betas``, ``eps`` and ``weight_decay``.
    """
    if len(hypers) != len(buckets):
        raise ValueError(f"fused_adamw_clip_step: one hyper-parameter dict per bucket, got {len(hypers)} for "
                         f"{len(buckets)} buckets")
    stats = grad_stats(buckets, impl=impl)
    if stats_hook is not None:
        stats_hook(stats)
    for bucket, h in zip(buckets, hypers):
        adamw_clip_apply(bucket, stats, h["lr"], tuple(h.get("betas", (0.9, 0.999))), h.get("eps", 1e-8),
                         h.get("weight_decay", 1e-2), max_norm, clip_eps, inv_scale, impl)
    return stats


def grad_norm(stats: torch.Tensor, inv_scale: float = 1.0) -> torch.Tensor:
    """The global L2 norm of the unscaled gradients, as a device tensor (no sync)."""
    return stats[0].sqrt() * inv_scale


def verify_checks(builder_name: str, device: str) -> list[Callable[[], object]]:
    """``loongforge_report --verify``'s checks of the compiled op: 3 clipped steps of the kernel against
    torch.optim.AdamW + clip_grad_norm_ (fp32 params; bf16 params with fp32 masters, masters compared),
    max error within 1e-6 of the largest param."""
    if not builder_name.startswith("lf_fused_adamw_clip"):
        return []

    def check(low_precision: bool):
        from ds_loongforge.ops.numerics import CheckResult, max_error

        shapes = [(300, 230), (33, 65), (7,)]
        dtype = torch.bfloat16 if low_precision else torch.float32
        params = [torch.randn(s, device=device).to(dtype) for s in shapes]
        masters = [p.float() for p in params] if low_precision else None
        bucket = AdamWBucket(params, [], [torch.zeros(s, device=device) for s in shapes],
                             [torch.zeros(s, device=device) for s in shapes],
                             [torch.zeros((), device=device) for _ in shapes], masters)
        ref = [torch.nn.Parameter(p.float()) for p in params]
        ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            grads = [0.05 * torch.randn(s, device=device) for s in shapes]
            bucket.grads = [g.to(dtype) for g in grads]
            for q, g in zip(ref, bucket.grads):
                q.grad = g.float()
            fused_adamw_clip_step([bucket], [dict(lr=1e-2, weight_decay=0.1)], max_norm=1.0,
                                  impl=device)
            torch.nn.utils.clip_grad_norm_(ref, 1.0)
            ref_opt.step()
        ours = masters if low_precision else params
        error = max(max_error(a, q) for a, q in zip(ours, ref))
        scale = max(float(q.detach().abs().max()) for q in ref)
        name = "adamw+clip 3 steps vs torch " + ("bf16+fp32 master" if low_precision else "fp32")
        return CheckResult(name, error, 1e-6 * scale)

    return [lambda: check(False), lambda: check(True)]
