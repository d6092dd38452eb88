"""Expert-masked, dropless Mixture-of-Experts layer (single process).

Legend (shape suffixes): T tokens, H hidden, I expert intermediate size, E experts, K experts per token,
P = T*K token-expert pairs in expert-major order.

    x_TH -> router: logits_TE -> softmax (fp32) -> top-k (or sampled k) -> ids_TK, weights_TK
         -> permute: stable sort of the P pairs by expert, gather x rows            x_PH
         -> grouped GEMM gate_up [E, 2I, H] over the per-expert row groups          h_P(2I)
         -> fused SwiGLU (+dropout)                                                 a_PI
         -> grouped GEMM down [E, H, I]                                             y_PH
         -> unpermute: each token gathers its K rows, weighted sum in fp32          out_TH

Dropless: every token reaches its K experts. Experts that got no tokens form empty groups: they do no
work and their weight gradients are zeros (never None). The combine gathers instead of scattering with
atomics, so results are deterministic. Parameter names equal transformers' MixtralSparseMoeBlock
(gate.weight, experts.gate_up_proj, experts.down_proj), so checkpoints load both ways.

Expert parallelism (``ep_group``): each rank of the group holds E / ep_size consecutive experts and the
whole router. After routing, every rank sends each token-expert pair to the rank owning the expert with
one variable-size all-to-all (no padding to a capacity), the owners run their experts on what arrived,
and a second all-to-all returns the results, which are combined as above. The split sizes are exchanged
first and read on the host (one sync per layer). Rows arrive in a pre-allocated receive buffer
(ReceiveBuffer): ceil(factor * T * K / ep_size) rows at first, calibrated to the observed peak at the
end of a warm-up window, grown by ``growth`` with one warning when a step needs more; never a crash or a
dropped token. Chunked overlap of communication with expert compute, the fused permute/unpermute
kernels and DeepSpeed's MoE parameter groups are the remaining parts of this layer's issue.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ds_loongforge.ops.swiglu import swiglu_dropout

ROUTER_MODES = ("topk", "sampled")
logger = logging.getLogger("ds_loongforge")


class ReceiveBuffer:
    """The receive buffer of one layer's expert-parallel dispatch, reused across steps.

    Capacity starts at ceil(factor * pairs / ep_size) rows. During the first ``warmup_steps`` forwards it
    grows silently to what a step needs and records the peak; at the end of warm-up it is resized once
    to that peak plus ``growth`` headroom. After warm-up a step that needs more grows it by ``growth``
    (at least to the need) with one warning. Rows beyond a step's need are never read.
    """

    def __init__(self, factor: float = 1.2, warmup_steps: int = 500, growth: float = 0.2):
        if factor <= 0:
            raise ValueError(f"all_to_all_buffer_factor must be > 0, got {factor}")
        if warmup_steps < 0:
            raise ValueError(f"buffer_warmup_steps must be >= 0, got {warmup_steps}")
        if growth <= 0:
            raise ValueError(f"buffer_growth must be > 0, got {growth}")
        self.factor, self.warmup_steps, self.growth = factor, warmup_steps, growth
        self.buffer: torch.Tensor | None = None
        self.steps = 0
        self.peak_rows = 0
        self.reallocations = 0
        self.reallocations_after_warmup = 0
        self._warned = False

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[0]

    def _allocate(self, rows: int, like: torch.Tensor, calibration: bool = False) -> None:
        self.buffer = like.new_empty(rows, *like.shape[1:])
        self.reallocations += 1
        if self.steps > self.warmup_steps and not calibration:
            self.reallocations_after_warmup += 1

    def take(self, rows: int, pairs: int, ep_size: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, ...] view to receive into (like: a tensor of the row shape, dtype and device)."""
        self.steps += 1
        self.peak_rows = max(self.peak_rows, rows)
        if (self.buffer is None or self.buffer.shape[1:] != like.shape[1:] or self.buffer.dtype != like.dtype
                or self.buffer.device != like.device):
            self._allocate(max(1, math.ceil(self.factor * pairs / ep_size)), like)
        elif self.steps == self.warmup_steps + 1 and self.warmup_steps > 0:
            calibrated = math.ceil(self.peak_rows * (1 + self.growth))
            if calibrated != self.capacity:
                self._allocate(calibrated, like, calibration=True)
        if rows > self.capacity:
            grown = max(rows, math.ceil(self.capacity * (1 + self.growth)))
            if self.steps > self.warmup_steps and not self._warned:
                message = (f"[LoongForge] expert-parallel receive buffer grew from {self.capacity} to {grown} rows "
                           f"(a step needed {rows}); raise all_to_all_buffer_factor or buffer_warmup_steps to "
                           "size it up front")
                warnings.warn(message, RuntimeWarning, stacklevel=4)
                logger.warning(message)
                self._warned = True
            self._allocate(grown, like)
        return self.buffer[:rows]


@dataclass
class RoutingStats:
    """Routing of one forward. Tensors stay on the device; summary() reads them back (one sync)."""

    tokens_per_expert_E: torch.Tensor
    num_tokens: int
    top_k: int

    def summary(self) -> dict[str, float]:
        counts = self.tokens_per_expert_E.float()
        num_experts = counts.numel()
        used = int((counts > 0).sum())
        mean = float(counts.mean())
        return {
            "experts_used": used,
            "idle_expert_fraction": 1.0 - used / num_experts,
            "pair_sparsity": 1.0 - self.top_k / num_experts,  # token-expert pairs not activated
            "max_load": float(counts.max()),
            "mean_load": mean,
            "max_over_mean_load": float(counts.max()) / mean if mean > 0 else 0.0,
            "tokens_dropped": self.num_tokens * self.top_k - int(counts.sum()),
        }


class TopKRouter(nn.Module):
    """Linear router: softmax in fp32, then the K best experts ("topk") or, in training, K experts drawn
    without replacement from the softmax ("sampled"; eval uses top-k)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, mode: str = "topk",
                 renormalize: bool = True, device=None, dtype=None):
        super().__init__()
        if mode not in ROUTER_MODES:
            raise ValueError(f"router mode {mode!r} is not one of {ROUTER_MODES}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.mode = mode
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x_TH: torch.Tensor):
        logits_TE = F.linear(x_TH, self.weight)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        if self.mode == "sampled" and self.training:
            ids_TK = torch.multinomial(probs_TE.detach(), self.top_k, replacement=False)
            weights_TK = probs_TE.gather(1, ids_TK)
        else:
            weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return logits_TE, probs_TE, weights_TK, ids_TK


class StackedExperts(nn.Module):
    """E SwiGLU experts stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *, device=None, dtype=None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                     device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size,
                                                  device=device, dtype=dtype))
        for w in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[-1]))


def _grouped_mm_supported(x: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False  # torch's CUDA grouped GEMM is bf16-only; fp32/fp16 take the per-expert loop
    elem = x.element_size()
    return (x.shape[-1] * elem) % 16 == 0 and (w_EOI.shape[1] * elem) % 16 == 0


def expert_matmul(x_PI: torch.Tensor, w_EOI: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Rows of x_PI grouped by expert (expert-major, group sizes tokens_per_expert_E) times each group's
    w_EOI[e].T: a grouped GEMM where torch has one, else a loop over the experts that got tokens."""
    if _grouped_mm_supported(x_PI, w_EOI):
        offs_E = torch.cumsum(tokens_per_expert_E, 0).to(torch.int32)
        return F.grouped_mm(x_PI, w_EOI.transpose(1, 2), offs=offs_E)
    out = x_PI.new_empty(x_PI.shape[0], w_EOI.shape[1])
    start = 0
    for e, n in enumerate(tokens_per_expert_E.tolist()):  # host sync: fallback path only
        if n:
            out[start:start + n] = x_PI[start:start + n] @ w_EOI[e].t()
            start += n
    return out


class _AllToAll(torch.autograd.Function):
    """Variable-size all-to-all whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, allocate=None):
        """``allocate(rows)`` supplies the receive tensor (a pre-allocated buffer); default: a new one."""
        ctx.splits, ctx.group = (out_splits, in_splits), group
        rows = sum(out_splits)
        out = allocate(rows) if allocate is not None else x.new_empty(rows, *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty(sum(in_splits), *grad_out.shape[1:])
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None, None


class ExpertMaskedMoE(nn.Module):
    """Dropless top-k MoE block; ``forward(x [..., H]) -> [..., H]``.

    In training, ``aux_loss`` holds ``aux_loss_coef * load_balancing + z_loss_coef * z_loss`` of the last
    forward (Switch/GShard load balancing; router z-loss) for the training loop to add; ``last_routing``
    holds its RoutingStats.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 router_mode: str = "topk", renormalize: bool = True, jitter_noise: float = 0.0,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, dropout: float = 0.0,
                 impl: str = "auto", ep_group=None, all_to_all_buffer_factor: float = 1.2,
                 buffer_warmup_steps: int = 500, buffer_growth: float = 0.2, device=None, dtype=None):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"ExpertMaskedMoE: num_experts must be >= 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"ExpertMaskedMoE: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if jitter_noise < 0 or aux_loss_coef < 0 or z_loss_coef < 0:
            raise ValueError(f"ExpertMaskedMoE: jitter_noise, aux_loss_coef and z_loss_coef must be >= 0, got "
                             f"{jitter_noise}, {aux_loss_coef}, {z_loss_coef}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"ExpertMaskedMoE: dropout must be in [0, 1), got {dropout}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.jitter_noise, self.aux_loss_coef, self.z_loss_coef = jitter_noise, aux_loss_coef, z_loss_coef
        self.dropout, self.impl = dropout, impl
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if num_experts % self.ep_size:
            raise ValueError(f"ExpertMaskedMoE: num_experts={num_experts} is not divisible by the expert-parallel "
                             f"size {self.ep_size}; choose an ep_size that divides the number of experts")
        self.num_local_experts = num_experts // self.ep_size
        self.receive_buffer = ReceiveBuffer(all_to_all_buffer_factor, buffer_warmup_steps, buffer_growth)
        self.gate = TopKRouter(hidden_size, num_experts, top_k, mode=router_mode, renormalize=renormalize,
                               device=device, dtype=dtype)
        self.experts = StackedExperts(hidden_size, intermediate_size, self.num_local_experts, device=device,
                                      dtype=dtype)
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: RoutingStats | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"ExpertMaskedMoE: input hidden size {shape[-1]} != {self.hidden_size}")
        x_TH = hidden_states.reshape(-1, self.hidden_size)
        if self.training and self.jitter_noise > 0:
            x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        num_tokens, k = x_TH.shape[0], self.top_k

        logits_TE, probs_TE, weights_TK, ids_TK = self.gate(x_TH)
        ids_P = ids_TK.reshape(-1)
        order_P = torch.argsort(ids_P, stable=True)             # expert-major, token order within an expert
        tokens_per_expert_E = torch.bincount(ids_P, minlength=self.num_experts)
        x_PH = x_TH[order_P // k]

        if self.ep_size == 1:
            y_PH = self._experts(x_PH, tokens_per_expert_E)
        else:
            y_PH = self._experts_parallel(x_PH, tokens_per_expert_E)

        slot_P = torch.empty_like(order_P)
        slot_P[order_P] = torch.arange(order_P.numel(), device=order_P.device)
        y_TKH = y_PH[slot_P].view(num_tokens, k, self.hidden_size)
        out_TH = (y_TKH.float() * weights_TK.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)

        self.last_routing = RoutingStats(tokens_per_expert_E.detach(), num_tokens, k)
        if self.training:
            self.aux_loss = self._aux_loss(logits_TE, probs_TE, tokens_per_expert_E, num_tokens)
        return out_TH.view(shape)

    def _experts(self, x_PH: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """The local experts on expert-major rows."""
        gate_up_P2I = expert_matmul(x_PH, self.experts.gate_up_proj, tokens_per_expert_E)
        act_PI = swiglu_dropout(gate_up_P2I, self.dropout if self.training else 0.0, impl=self.impl)
        return expert_matmul(act_PI, self.experts.down_proj, tokens_per_expert_E)

    def _experts_parallel(self, x_PH: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Send each pair to the rank owning its expert, run the local experts, send the results back.

        R = ep_size ranks, L = local experts per rank; rows arrive source-rank-major, expert-major within
        a source, and are regrouped expert-major (source order within an expert) for the grouped GEMM.
        """
        ep, local = self.ep_size, self.num_local_experts
        send_RL = tokens_per_expert_E.view(ep, local)
        recv_RL = torch.empty_like(send_RL)
        dist.all_to_all_single(recv_RL, send_RL.contiguous(), group=self.ep_group)
        in_splits = send_RL.sum(1).tolist()   # host sync: the split sizes of the variable all-to-all
        out_splits = recv_RL.sum(1).tolist()
        # the gather below is the only reader of x_recv (it saves indices, not x_recv), so the buffer is
        # free for the next layer call as soon as it returns
        pairs = x_PH.shape[0]
        x_recv = _AllToAll.apply(x_PH, out_splits, in_splits, self.ep_group,
                                 lambda rows: self.receive_buffer.take(rows, pairs, ep, x_PH))

        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=x_PH.device).repeat(ep), recv_RL.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        y_local = self._experts(x_recv[order], recv_RL.sum(0))
        y_recv = torch.empty_like(y_local).index_copy(0, order, y_local)
        return _AllToAll.apply(y_recv, in_splits, out_splits, self.ep_group)

    def _aux_loss(self, logits_TE, probs_TE, tokens_per_expert_E, num_tokens) -> torch.Tensor:
        loss = logits_TE.new_zeros((), dtype=torch.float32)
        if self.aux_loss_coef > 0 and num_tokens > 0:
            fraction_E = tokens_per_expert_E.float() / (num_tokens * self.top_k)
            loss = loss + self.aux_loss_coef * self.num_experts * (fraction_E * probs_TE.mean(0)).sum()
        if self.z_loss_coef > 0 and num_tokens > 0:
            loss = loss + self.z_loss_coef * torch.logsumexp(logits_TE.float(), dim=-1).pow(2).mean()
        return loss

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
                f"top_k={self.top_k}, router={self.gate.mode}, impl={self.impl!r}")
