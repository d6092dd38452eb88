"""The family's load-balancing loss without a host sync: ``modeling_<family>.load_balancing_loss_func`` ->
:func:`load_balancing_loss`.

transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) add ``router_aux_loss_coef x
load_balancing_loss_func(router_logits, E, k, attention_mask)`` to the training loss when the model config's
``output_router_logits`` is on. On CUDA that function makes the host wait for the device in every forward (the
H200 run at ec1e978 counted 16 waits per Mixtral forward, at its expert-count line, with ``train.py --sync-debug``):
each wait empties the GPU's queue, and the host must then launch the rest of the forward's small kernels ahead of
the GPU again, which it cannot, so the forward runs at the host's launch rate.

:func:`load_balancing_loss` computes the same value (Switch Transformer eqs. 4-6, as transformers: per layer the
softmax of the logits in their dtype, the top-k choices, counts of the choices per expert and summed fp32
probabilities, masked by ``attention_mask`` when one is given; both normalised by the rows counted over all
layers; ``E x sum_e f_e P_e``) with device-side counts only: a ``scatter_add_`` of ones (exact integers in fp32,
so the same bits in any order) instead of ``histc`` / ``one_hot`` / ``bincount``. Layers whose logits have one
shape and dtype (every family's) are stacked and each operation runs once for all of them, not once per layer:
~8 launches instead of ~50 (host time only: in the H200 e2e step the host runs 5-20 ms ahead of the GPU). On CUDA
the top-k and the count scatter of the stacked layers are one kernel (ops.moe_dispatch.topk_counts: torch.topk's
choices, ties included, counted with integer atomics), where torch.topk, its sort and a scatter of float ones
onto E addresses took ~0.3 ms of the H200 e2e mixtral step. The gradients are the same bits; the value differs
from the per-layer loop only in the order of its fp32 probability sums.

transformers' forward looks the function up in its modeling module at call time, so the replacement is a
process-wide patch of that module attribute (like the fused RoPE, ``ds_loongforge.integrations.rope``). It is
installed only where the family's function has the standard signature and gives the same values as
:func:`load_balancing_loss` on a small fp64 check (with and without a mask): a transformers version that
computes something else keeps its own function, and inject says why.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ds_loongforge.integrations import _patching
from ds_loongforge.ops.moe_dispatch import MAX_TOPK_COUNT_COLUMNS, topk_counts

FUNCTION = "load_balancing_loss_func"
ORIGINAL_ATTR = _patching.ORIGINAL_ATTR  # on the installed function: the one it replaced
_PARAMS = ("gate_logits", "num_experts", "top_k", "attention_mask")

_patches = _patching.ModulePatches("Switch load-balancing loss")


def load_balancing_loss(gate_logits, num_experts: int | None = None, top_k: int = 2,
                        attention_mask: torch.Tensor | None = None):
    """transformers' ``load_balancing_loss_func`` (same arguments, same value), with no host-device sync.

    gate_logits: a tuple of per-layer router logits [rows, E] (anything else: 0, as transformers returns);
    attention_mask: [batch, seq] with batch x seq = rows, 1 for tokens that count."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    device = gate_logits[0].device
    layers = [g.to(device) for g in gate_logits]
    if len({(g.shape, g.dtype) for g in layers}) == 1:
        return _stacked(torch.stack(layers), num_experts, top_k, attention_mask)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        weights = flat_mask.repeat_interleave(top_k)  # one per (row, choice), row-major as topk's indices
        counted = flat_mask.sum()  # rows that count, the same for every layer
    else:
        one = torch.ones((), dtype=torch.float32, device=device)
    rows = 0
    for layer_logits in layers:
        routing = torch.softmax(layer_logits, dim=-1)
        _, chosen = torch.topk(routing, top_k, dim=-1)
        chosen = chosen.reshape(-1)
        if flat_mask is None:
            counts.scatter_add_(0, chosen, one.expand_as(chosen))
            probs += routing.float().sum(dim=0)
            rows += routing.shape[0]
        else:
            counts.scatter_add_(0, chosen, weights)
            probs += (routing.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + counted  # summed layer by layer, as transformers does (exact: whole numbers)
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def _stacked(logits_LRE: torch.Tensor, num_experts: int, top_k: int, attention_mask: torch.Tensor | None):
    """:func:`load_balancing_loss` of layers of one shape, stacked [L, rows, E]: each operation once for all
    layers (softmax, top-k, one scatter of the counts, one reduction of the probabilities), where the loop issues
    them per layer (~50 launches for 8 layers). The same math: softmax and top-k act on each row alone and the
    counts are whole numbers; only the order of the fp32 sums of the probabilities differs (rounding, ~1e-7
    relative)."""
    layers, rows, experts = logits_LRE.shape
    device = logits_LRE.device
    routing = torch.softmax(logits_LRE, dim=-1)
    flat_mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device)
    if _counts_on_device(routing, num_experts, flat_mask):
        # torch.topk's choices (its CUDA kernel's, ties included) counted in one kernel: exact integers
        counts = topk_counts(routing.detach().reshape(-1, experts), top_k,
                             None if flat_mask is None else flat_mask.long()).float()
    else:
        _, chosen = torch.topk(routing, top_k, dim=-1)
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        if flat_mask is None:
            counts.scatter_add_(0, chosen.reshape(-1), torch.ones((), dtype=torch.float32, device=device).expand(
                chosen.numel()))
        else:
            # one weight per (layer, row, choice), in topk's row-major order
            counts.scatter_add_(0, chosen.reshape(-1), flat_mask.float().repeat_interleave(top_k).repeat(layers))
    if flat_mask is None:
        probs = routing.sum(dim=(0, 1), dtype=torch.float32)
        total = layers * rows
    else:
        flat_mask = flat_mask.float()
        probs = (routing.float() * flat_mask[:, None]).sum(dim=(0, 1))
        total = flat_mask.sum() * layers  # whole numbers: exact
    return torch.sum((counts / total) * (probs / total)) * num_experts


def _counts_on_device(routing_LRE: torch.Tensor, num_experts: int, flat_mask: torch.Tensor | None) -> bool:
    """Whether ops.moe_dispatch.topk_counts counts the choices: on CUDA, where it takes torch.topk's choices
    (the CPU's torch.topk may break ties otherwise, so the CPU keeps it), for the dtypes and widths its kernel
    takes, with one column per expert and an integer or boolean mask (its weights are int64: a float mask keeps
    the scatter of float weights)."""
    return (routing_LRE.is_cuda and routing_LRE.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and routing_LRE.shape[-1] == num_experts and num_experts <= MAX_TOPK_COUNT_COLUMNS
            and (flat_mask is None or not (flat_mask.dtype.is_floating_point or flat_mask.dtype.is_complex)))


def standard_problem(function: Callable) -> str | None:
    """None when ``function`` has the standard signature and gives :func:`load_balancing_loss`'s values (to fp32
    rounding) on a small fp64 CPU input, without a mask and with a mask that hides some rows; else what differs."""
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "its signature cannot be read"
    if names != _PARAMS:
        return f"signature ({', '.join(names)}) is not ({', '.join(_PARAMS)})"
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    batch, seq, experts, k = 2, 5, 6, 2
    logits = tuple(torch.randn(batch * seq, experts, dtype=torch.float64, generator=gen) for _ in range(3))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, 3:] = 0
    for m in (None, mask):
        try:
            theirs = function(logits, experts, k, m)
        except Exception as err:  # noqa: BLE001
            return f"it raises on a standard input ({type(err).__name__}: {err})"
        ours = load_balancing_loss(logits, experts, k, m)
        # fp32 accumulation here (as transformers 5.2x); other versions may sum in fp64: a formula that differs
        # (a factor k or E, another normalisation) is off by far more than fp32 rounding
        if not (isinstance(theirs, torch.Tensor) and torch.allclose(theirs.double(), ours.double(), rtol=1e-5,
                                                                    atol=1e-7)):
            return (f"it computes {theirs!r} where the Switch loss is {float(ours):.6f} "
                    f"({'with' if m is not None else 'without'} an attention mask)")
    return None


def patch(module_name: str) -> str | None:
    """Install :func:`load_balancing_loss` as ``module_name.load_balancing_loss_func``; None when done (or
    already done), else why the family's function was left alone."""
    return _patches.patch(module_name, FUNCTION, standard_problem, lambda current: _installed())


def _installed() -> Callable:
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return load_balancing_loss(gate_logits, num_experts, top_k, attention_mask)

    load_balancing_loss_func.__doc__ = load_balancing_loss.__doc__
    return load_balancing_loss_func


def patched() -> list[str]:
    """``module.load_balancing_loss_func`` of every replacement installed and still in place."""
    return _patches.patched()


def restore() -> list[str]:
    """Put every replaced function back (the patch is process-wide); returns ``module.function`` of each."""
    return _patches.restore()
