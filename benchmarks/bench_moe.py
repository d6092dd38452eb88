"""One MoE layer fwd+bwd in bf16 on one GPU: ours (ExpertMaskedMoE) side by side with HF transformers'
MixtralSparseMoeBlock (grouped_mm and eager experts), DeepSpeed's MoE layer and DeepSpeed's AutoEP layer,
in one run, against the GEMM floor measured in the same run (issue 3).

Legend (shape suffixes): T tokens, H hidden, I expert intermediate size, E experts, K experts per token.

Shapes:  mixtral_like  T=8192 H=4096 I=14336 E=8  K=2
         fine_grained  T=8192 H=2048 I=1024  E=64 K=8

Floor: only the expert GEMMs are counted. Forward 2*T*K*H*2I (gate_up) + 2*T*K*I*H (down) = 6*T*K*H*I FLOPs;
backward does twice that (dX and dW of each GEMM), so fwd+bwd = 18*T*K*H*I. floor_ms = those FLOPs / the
dense bf16 matmul rate measured in this run on the [T*K, H] x [H, 2I] product of mixtral_like. The router,
permutation and combine are not counted.

Every variant gets the same weights (copied from one set; HF and ours share parameter names and layouts,
DeepSpeed's are copied expert by expert, AutoEP repacks HF's itself) and the same input and output
gradient. Before timing, each variant's output and gradients are compared with HF eager's (relative L2
error, in the JSON). Input tokens on a bf16/fp32 router near-tie, or on a tie of bf16 logits at the top-k
boundary, are redrawn first, so that DeepSpeed MoE's fp32 router picks the same experts as the others' bf16
routers, and every top-k breaks no tie (the CPU's torch.topk breaks them otherwise than CUDA's and ours).
Timing: benchmarks/harness.py's Timer (L2 flushed and a GPU head start before each repeat), fwd+bwd with
torch.autograd.grad over the input and every parameter, median of --repeats (fewer for the slow HF-eager and
DeepSpeed-MoE variants). Each variant is freed before the next is built.

Expected on one H200 (shared/BENCHMARKS.md anchors, one earlier run): floor ~22.1 / ~3.15 ms; HF grouped_mm
37.3 / 13.2 ms, HF eager 58.0 / 95.9, DeepSpeed MoE 39.5 / 39.8; target for ours <= 25.4 / <= 6.3 ms. About a
minute of GPU time after start-up.

    python benchmarks/bench_moe.py [--shapes mixtral_like,fine_grained] [--smoke] [--out DIR]

--smoke runs tiny shapes on the CPU (2 repeats, wall-clock timing) to exercise every code path.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import RESULTS_DIR, Timer, environment, git_commit, parse_names
from ds_loongforge.report import package_version

DTYPE = torch.bfloat16
AGREE_TOL = 3e-2           # relative L2 vs HF eager; two bf16 implementations differ by ~5e-3
SLOW_VARIANTS = ("HF eager", "DeepSpeed MoE")  # host-synchronising loops: fewer repeats keep the run short
SLOW_REPEATS = 20
GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int

    @property
    def gemm_flops_fwd_bwd(self) -> int:
        return 18 * self.tokens * self.top_k * self.hidden * self.inter

    def describe(self) -> str:
        return (f"T={self.tokens} H={self.hidden} I={self.inter} E={self.experts} K={self.top_k}")


SHAPES = {
    "mixtral_like": Shape("mixtral_like", 8192, 4096, 14336, 8, 2),
    "fine_grained": Shape("fine_grained", 8192, 2048, 1024, 64, 8),
}
# same E and K (so the same router paths run), sizes a CPU finishes in seconds; multiples of 8 for grouped_mm
SMOKE_SHAPES = {
    "mixtral_like": Shape("mixtral_like", 128, 64, 128, 8, 2),
    "fine_grained": Shape("fine_grained", 128, 64, 32, 64, 8),
}
# shared/BENCHMARKS.md, one H200 (torch 2.11+cu130, transformers 5.17, DeepSpeed 0.19.8)
ANCHORS_MS = {
    "mixtral_like": {"floor": 22.1, "target": 25.4, "HF grouped_mm": 37.3, "HF eager": 58.0, "DeepSpeed MoE": 39.5},
    "fine_grained": {"floor": 3.15, "target": 6.3, "HF grouped_mm": 13.2, "HF eager": 95.9, "DeepSpeed MoE": 39.8},
}


class Unavailable(Exception):
    """A variant that cannot run here (package missing, feature absent in this version)."""


@dataclass
class Weights:
    """The one set of weights every variant copies: HF/ours layout."""

    gate_EH: torch.Tensor
    gate_up_E2IH: torch.Tensor   # gate rows first, then up rows
    down_EHI: torch.Tensor


@dataclass
class Built:
    """A variant ready to run: forward(x_BTH) -> out_BTH, its parameters, and how its parameter gradients
    map onto the reference names (gate.weight, experts.gate_up_proj, experts.down_proj)."""

    module: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    params: list[nn.Parameter]
    to_reference: Callable[[dict[int, torch.Tensor]], dict[str, torch.Tensor]]  # id(param) -> grad
    implementation: str


@dataclass
class MoERow:
    shape: str
    variant: str
    status: str                        # "ok", "unavailable: <why>", "error: <what>"
    ms: float | None = None            # median ms per fwd+bwd
    ms_p10: float | None = None
    ms_p90: float | None = None
    repeats: int = 0
    x_floor: float | None = None       # ms / floor_ms
    gemm_tflops: float | None = None   # counted expert-GEMM FLOPs / time
    weights_gib: float | None = None
    peak_gib: float | None = None      # torch.cuda.max_memory_allocated over the timed fwd+bwd
    working_gib: float | None = None   # peak_gib minus what was allocated before it
    rel_err: dict = field(default_factory=dict)   # vs HF eager: out, x, gate.weight, experts.*
    agrees: bool | None = None
    anchor_ms: float | None = None
    implementation: str = ""
    note: str = ""


# ---------------------------------------------------------------------------------------------------------
# timing and memory
# ---------------------------------------------------------------------------------------------------------

class WallTimer:
    """--smoke on the CPU: the harness Timer's interface over perf_counter (no L2 flush, no events)."""

    def __init__(self, warmup: int, repeats: int):
        self.warmup, self.repeats = warmup, repeats

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float, float]:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        return statistics.median(times), times[len(times) // 10], times[(9 * len(times)) // 10]


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure_matmul_tflops(timer, m: int, k: int, n: int, device: torch.device) -> float:
    a = torch.randn(m, k, device=device, dtype=DTYPE)
    b = torch.randn(k, n, device=device, dtype=DTYPE)
    ms, _, _ = timer(lambda: a @ b)
    return 2 * m * k * n / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------------------
# weights and the variants
# ---------------------------------------------------------------------------------------------------------

def make_weights(shape: Shape, device: torch.device) -> Weights:
    """Random, never zeros: router like nn.Linear's default (uniform +-1/sqrt(H)), experts N(0, 1/fan_in)."""
    E, H, I = shape.experts, shape.hidden, shape.inter
    gate = (torch.rand(E, H, device=device, dtype=torch.float32) * 2 - 1).div_(math.sqrt(H)).to(DTYPE)
    gate_up = torch.randn(E, 2 * I, H, device=device, dtype=DTYPE).mul_(1 / math.sqrt(H))
    down = torch.randn(E, H, I, device=device, dtype=DTYPE).mul_(1 / math.sqrt(I))
    return Weights(gate, gate_up, down)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: expected shape {tuple(src.shape)}, the module has {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def _same_names(module: nn.Module) -> Callable[[dict[int, torch.Tensor]], dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in module.named_parameters()}
    return lambda grads: {names[i]: g for i, g in grads.items()}


def build_ours(shape: Shape, w: Weights, device: torch.device, expert_compute: str = "auto",
               rounding: str = "stock") -> Built:
    from ds_loongforge.modules import moe as ours

    moe = ours.ExpertMaskedMoE(shape.hidden, shape.inter, shape.experts, shape.top_k, dtype=DTYPE, device=device,
                               expert_compute=expert_compute, rounding=rounding)
    if expert_compute == "loop":
        _copy(moe.gate.weight, w.gate_EH, "ours gate.weight")
        _copy(moe.experts.gate_up_proj, w.gate_up_E2IH, "ours experts.gate_up_proj")
        _copy(moe.experts.down_proj, w.down_EHI, "ours experts.down_proj")
        return Built(moe, moe, list(moe.parameters()), _same_names(moe),
                     "ExpertMaskedMoE(expert_compute='loop'): one cuBLAS GEMM per expert, one host sync per layer")
    _copy(moe.gate.weight, w.gate_EH, "ours gate.weight")
    _copy(moe.experts.gate_up_proj, w.gate_up_E2IH, "ours experts.gate_up_proj")
    _copy(moe.experts.down_proj, w.down_EHI, "ours experts.down_proj")
    what = (f"ExpertMaskedMoE(impl={moe.impl!r}, rounding={moe.rounding!r}), strict ops (compiled kernels or an "
            "error)")
    supported = getattr(ours, "_grouped_mm_supported", None)
    if supported is not None:
        # the layer's pair rows [T*K, H] without their memory: the checks read the shape, dtype and device only
        pairs_x = torch.empty(1, shape.hidden, device=device, dtype=DTYPE).expand(shape.tokens * shape.top_k, -1)
        if not supported(pairs_x, moe.experts.gate_up_proj):
            path = "per-expert loop (host sync)"
        elif ours.per_expert_backward_pays(pairs_x, moe.experts.gate_up_proj, moe.impl):
            path = "torch grouped_mm forward, per-expert cuBLASLt backward (expert_linear_backward)"
        else:
            path = "torch grouped_mm"
        what += f", expert GEMMs: {path}"
    return Built(moe, moe, list(moe.parameters()), _same_names(moe), what)


def _hf_block(shape: Shape, impl: str, w: Weights, device: torch.device):
    """MixtralSparseMoeBlock whose experts run ``impl`` ('grouped_mm' or 'eager'), with the shared weights.

    transformers 5.x: ``@use_experts_implementation`` wraps MixtralExperts.forward, which looks up
    ``self.config._experts_implementation`` in ALL_EXPERTS_FUNCTIONS at every call ('eager' = the class's
    own loop over experts). The block is built on the meta device and materialised in bf16 on ``device``.
    """
    try:
        from transformers import MixtralConfig
        from transformers.integrations import moe as hf_moe
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError as err:
        raise Unavailable(f"transformers: {err}") from err
    if not hasattr(hf_moe, "ALL_EXPERTS_FUNCTIONS"):
        raise Unavailable(f"transformers {package_version('transformers')} has no experts_implementation dispatch")
    if impl != "eager" and impl not in hf_moe.ALL_EXPERTS_FUNCTIONS:
        raise Unavailable(f"experts implementation {impl!r} is not registered in transformers "
                          f"{package_version('transformers')}: {sorted(hf_moe.ALL_EXPERTS_FUNCTIONS)}")
    config = MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.inter,
                           num_local_experts=shape.experts, num_experts_per_tok=shape.top_k,
                           hidden_act="silu", router_jitter_noise=0.0)
    config._experts_implementation = impl
    with torch.device("meta"):
        block = MixtralSparseMoeBlock(config)
    block = block.to(DTYPE).to_empty(device=device)
    if getattr(block.experts, "config", None) is not config:
        raise Unavailable("MixtralExperts is not wrapped by use_experts_implementation in transformers "
                          f"{package_version('transformers')}")
    _copy(block.gate.weight, w.gate_EH, "HF gate.weight")
    _copy(block.experts.gate_up_proj, w.gate_up_E2IH, "HF experts.gate_up_proj")
    _copy(block.experts.down_proj, w.down_EHI, "HF experts.down_proj")

    selected = hf_moe.ALL_EXPERTS_FUNCTIONS.get_interface(config._experts_implementation, None)
    if impl == "eager":
        if selected is not None:
            raise RuntimeError(f"experts_implementation='eager' dispatched to {selected.__name__}")
        what = "MixtralExperts.forward (eager loop over experts)"
    else:
        what = selected.__name__
        can_use = getattr(hf_moe, "_can_use_grouped_mm", None)
        if impl == "grouped_mm" and can_use is not None:
            probe_x = torch.empty(8, shape.hidden, device=device, dtype=DTYPE)
            probe_offs = torch.zeros(shape.experts, device=device, dtype=torch.int32)
            kernel = ("torch grouped_mm" if can_use(probe_x, block.experts.gate_up_proj.transpose(-2, -1), probe_offs)
                      else "transformers' per-expert fallback loop")
            what += f" -> {kernel}"
    return config, block, f"transformers {package_version('transformers')}: {what}"


def build_hf(impl: str):
    def build(shape: Shape, w: Weights, device: torch.device) -> Built:
        _, block, what = _hf_block(shape, impl, w, device)
        return Built(block, block, list(block.parameters()), _same_names(block), what)

    return build


class SwiGLUExpert(nn.Module):
    """One expert of DeepSpeed's MoE layer: the same SwiGLU MLP, gate rows before up rows."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group(device: torch.device) -> None:
    """DeepSpeed's layers need torch.distributed and its groups: one process, world size 1."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               auto_mpi_discovery=False, verbose=False)


def build_deepspeed_moe(shape: Shape, w: Weights, device: torch.device) -> Built:
    """deepspeed.moe.layer.MoE, ep_size=1, dropless: drop_tokens=False sets the capacity to the busiest
    expert's count; no random token selection and no sampled second expert, so routing is plain top-k with
    renormalised weights, as in Mixtral (its router runs in fp32: near-ties may pick other experts)."""
    try:
        from deepspeed.moe.layer import MoE
    except ImportError as err:
        raise Unavailable(f"deepspeed: {err}") from err
    init_single_process_group(device)
    with torch.device("meta"):
        expert = SwiGLUExpert(shape.hidden, shape.inter)
    moe = MoE(shape.hidden, expert, num_experts=shape.experts, ep_size=1, k=shape.top_k, capacity_factor=1.0,
              eval_capacity_factor=1.0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    moe = moe.to(DTYPE).to_empty(device=device)
    moe.set_deepspeed_parallelism()
    wg = moe.deepspeed_moe.gate.wg.weight
    experts = list(moe.deepspeed_moe.experts.deepspeed_experts)
    _copy(wg, w.gate_EH, "DeepSpeed gate.wg.weight")
    for e, ex in enumerate(experts):
        _copy(ex.gate_up.weight, w.gate_up_E2IH[e], f"DeepSpeed expert {e} gate_up.weight")
        _copy(ex.down.weight, w.down_EHI[e], f"DeepSpeed expert {e} down.weight")

    def to_reference(grads):
        return {"gate.weight": grads[id(wg)],
                "experts.gate_up_proj": torch.stack([grads[id(ex.gate_up.weight)] for ex in experts]),
                "experts.down_proj": torch.stack([grads[id(ex.down.weight)] for ex in experts])}

    gate = moe.deepspeed_moe.gate
    what = (f"DeepSpeed {package_version('deepspeed')} MoE(k={gate.k}, drop_tokens={gate.drop_tokens}, "
            f"use_rts={gate.use_rts}, top2_2nd_expert_sampling={gate.top2_2nd_expert_sampling}), "
            f"{len(experts)} nn.Linear SwiGLU experts")
    return Built(moe, lambda x: moe(x)[0], list(moe.parameters()), to_reference, what)


class _OneMoELayerModel(nn.Module):
    """The module path AutoEP's mixtral preset matches (model.layers.<n>.mlp) around one HF block, with
    the HF config AutoEP reads num_local_experts / num_experts_per_tok from."""

    def __init__(self, config, block: nn.Module):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = block


def build_autoep(shape: Shape, w: Weights, device: torch.device) -> Built:
    """DeepSpeed AutoEP's layer, made the way deepspeed.initialize makes it with
    ``"expert_parallel": {"enabled": true, "autoep_size": 1, "preset_model": "mixtral"}``
    (runtime/engine.py _configure_expert_parallel): AutoEP(model, config).ep_parser() finds the HF block,
    AutoEPMoELayer(spec, block, ep_size=1, ep_rank=0, config) copies its weights, set_deepspeed_parallelism()
    binds the group. The engine's step after that (retargeting the model's router-logit output recorders)
    concerns a whole HF model, not one layer, and is skipped."""
    try:
        from deepspeed.module_inject.auto_ep import AutoEP
        from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_post_detection
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError as err:
        raise Unavailable(f"DeepSpeed {package_version('deepspeed')} has no AutoEP: {err}") from err
    init_single_process_group(device)
    config, block, _ = _hf_block(shape, "grouped_mm", w, device)
    ep_config = parse_autoep_config({"enabled": True, "autoep_size": 1, "preset_model": "mixtral"})
    auto_ep = AutoEP(_OneMoELayerModel(config, block), ep_config)
    specs = auto_ep.ep_parser()
    if len(specs) != 1:
        raise RuntimeError(f"AutoEP detected {len(specs)} MoE layers in a one-layer model: {specs}")
    validate_autoep_post_detection(ep_config, specs)
    with torch.device(device):  # its fresh parameters are replaced by copies of the block's
        layer = AutoEPMoELayer(spec=specs[0], source_module=block, ep_size=1, ep_rank=0, config=ep_config,
                               deepep_scope=auto_ep.deepep_scope)
    layer.set_deepspeed_parallelism()
    del auto_ep, block
    ex = layer.experts

    def to_reference(grads):
        return {"gate.weight": grads[id(layer.router.gate.weight)],
                "experts.gate_up_proj": torch.cat([grads[id(ex.w1)], grads[id(ex.w3)]], dim=1),
                "experts.down_proj": grads[id(ex.w2)]}

    def forward(x):
        out = layer(x)
        return out[0] if isinstance(out, tuple) else out

    path = ("triton grouped GEMM" if ex.use_triton_grouped_mm else
            f"torch._grouped_mm (gate_up_impl={ex.gate_up_impl!r})" if ex.use_grouped_mm else "loop over experts")
    what = (f"DeepSpeed {package_version('deepspeed')} AutoEPMoELayer (preset mixtral, ep_size=1): {path}, "
            f"combine={layer.combine_impl}, score_apply={layer.score_apply}")
    return Built(layer, forward, list(layer.parameters()), to_reference, what)


VARIANTS: dict[str, Callable[[Shape, Weights, torch.device], Built]] = {
    "HF eager": build_hf("eager"),   # first: the reference every other variant is compared with
    "ours": build_ours,
    # the combine rounded once in fp32 (fused_kernels.rounding "once") instead of where transformers rounds
    "ours, rounding once": lambda shape, w, device: build_ours(shape, w, device, rounding="once"),
    "ours (per-expert GEMM loop)": lambda shape, w, device: build_ours(shape, w, device, "loop"),
    "HF grouped_mm": build_hf("grouped_mm"),
    "DeepSpeed MoE": build_deepspeed_moe,
    "DeepSpeed AutoEP": build_autoep,
}


# ---------------------------------------------------------------------------------------------------------
# one shape
# ---------------------------------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"comparing shapes {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.float(), b.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def fwd_bwd(built: Built, x: torch.Tensor, dy: torch.Tensor):
    out = built.forward(x)
    grads = torch.autograd.grad(out, (x, *built.params), dy, allow_unused=True, materialize_grads=True)
    return out, grads


def router_near_ties_T(x_TH: torch.Tensor, gate_EH: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens whose top-k expert set differs between a bf16 router (ours, HF, AutoEP: bf16 logits) and an
    fp32 one (DeepSpeed's TopKGate upcasts input and weight before the logits), and tokens whose k-th and
    (k+1)-th bf16 logits are equal: which of those two a router takes is its top-k's tie-break (ours takes the
    lower expert, as torch.topk does on CUDA; the CPU's torch.topk may take the other)."""
    logits = F.linear(x_TH, gate_EH).float()
    ids_bf16 = torch.topk(torch.softmax(logits, -1), k, dim=-1).indices.sort(-1).values
    ids_fp32 = torch.topk(torch.softmax(F.linear(x_TH.float(), gate_EH.float()), -1), k, dim=-1).indices
    near = (ids_bf16 != ids_fp32.sort(-1).values).any(-1)
    if k < logits.shape[-1]:
        top = torch.topk(logits, k + 1, dim=-1).values
        near |= top[:, k - 1] == top[:, k]
    return near


def dense_gemm_chain_ms(shape: Shape, timer, device: torch.device) -> float:
    """The layer's expert-GEMM FLOPs as six dense bf16 products of the same sizes, one after the other (the
    forward's gate_up and down, and each one's dX and dW), with no routing, permutation or activation: what
    the GEMMs alone cost when run back to back for as long as the layer runs. The single-product rate that
    sets the floor is measured on a short burst; a chain this long runs at the power-limited clock."""
    P, H, I = shape.tokens * shape.top_k, shape.hidden, shape.inter
    x = torch.randn(P, H, device=device, dtype=DTYPE)
    w1 = torch.randn(2 * I, H, device=device, dtype=DTYPE)
    a = torch.randn(P, I, device=device, dtype=DTYPE)
    w2 = torch.randn(H, I, device=device, dtype=DTYPE)
    g2 = torch.randn(P, 2 * I, device=device, dtype=DTYPE)
    dy = torch.randn(P, H, device=device, dtype=DTYPE)

    def chain():
        x @ w1.t()        # gate_up forward   [P, 2I]
        a @ w2.t()        # down forward      [P, H]
        dy @ w2           # down dX           [P, I]
        dy.t() @ a        # down dW           [H, I]
        g2 @ w1           # gate_up dX        [P, H]
        g2.t() @ x        # gate_up dW        [2I, H]

    ms = timer(chain)[0]
    del x, w1, a, w2, g2, dy
    return ms


def make_input(shape: Shape, gate_EH: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, float]:
    """x [1, T, H] with every token routed alike by bf16 and fp32 routers, and the fraction of tokens that
    were redrawn to get there. A near-tie between the K-th and (K+1)-th expert can flip with the router's
    precision; such a token is redrawn, so that every variant routes every token to the same experts and the
    comparison with HF eager checks the computation, not the tie-break (the few redrawn tokens leave the
    load per expert statistically unchanged)."""
    x_TH = torch.randn(shape.tokens, shape.hidden, device=device, dtype=DTYPE)
    redrawn = torch.zeros(shape.tokens, dtype=torch.bool, device=device)
    for _ in range(50):
        ties_T = router_near_ties_T(x_TH, gate_EH, shape.top_k)
        if not bool(ties_T.any()):
            break
        redrawn |= ties_T
        x_TH[ties_T] = torch.randn(int(ties_T.sum()), shape.hidden, device=device, dtype=DTYPE)
    else:
        raise RuntimeError("could not draw an input whose routing is the same under bf16 and fp32 routers")
    return x_TH.unsqueeze(0).requires_grad_(), float(redrawn.float().mean())


def measure_variant(row: MoERow, build, shape: Shape, w: Weights, x: torch.Tensor, dy: torch.Tensor,
                    reference: dict[str, torch.Tensor], timer, repeats: int, floor_ms: float,
                    device: torch.device) -> None:
    """Build one variant, compare it with ``reference`` (HF eager's output and gradients; HF eager itself
    fills it), time it, and fill ``row``. Everything it built is freed when it returns or raises."""
    built = build(shape, w, device)
    row.implementation = built.implementation
    row.weights_gib = sum(p.numel() * p.element_size() for p in built.params) / GIB
    out, grads = fwd_bwd(built, x, dy)
    named = {"out": out.detach(), "x": grads[0],
             **built.to_reference({id(p): g for p, g in zip(built.params, grads[1:])})}
    del out, grads
    if row.variant == "HF eager":
        reference.update(named)
    elif not reference:
        row.note = "HF eager did not run: not checked"
    else:
        row.rel_err = {k: rel_err(v, reference[k]) for k, v in named.items() if k in reference}
        row.agrees = all(e <= AGREE_TOL for e in row.rel_err.values())
        if not row.agrees:
            row.note = f"DISAGREES with HF eager (tol {AGREE_TOL})"
    del named

    row.repeats = min(repeats, SLOW_REPEATS) if row.variant in SLOW_VARIANTS else repeats
    timer.repeats = row.repeats
    resident = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    inputs = (x, *built.params)
    row.ms, row.ms_p10, row.ms_p90 = timer(
        lambda: torch.autograd.grad(built.forward(x), inputs, dy, allow_unused=True, materialize_grads=True))
    if device.type == "cuda":
        row.peak_gib = torch.cuda.max_memory_allocated() / GIB
        row.working_gib = row.peak_gib - resident / GIB
    row.x_floor = row.ms / floor_ms
    row.gemm_tflops = shape.gemm_flops_fwd_bwd / (row.ms * 1e-3) / 1e12


def run_shape(shape: Shape, timer, repeats: int, tflops: float, device: torch.device) -> tuple[list[MoERow], dict]:
    floor_ms = shape.gemm_flops_fwd_bwd / (tflops * 1e12) * 1e3
    anchors = ANCHORS_MS[shape.name]
    w = make_weights(shape, device)
    x, redrawn = make_input(shape, w.gate_EH, device)
    dy = torch.randn(1, shape.tokens, shape.hidden, device=device, dtype=DTYPE)
    info = {**asdict(shape), "gemm_flops_fwd_bwd": shape.gemm_flops_fwd_bwd, "floor_ms": floor_ms,
            "floor_ms_issue": anchors["floor"], "target_ms": anchors["target"],
            "tokens_redrawn_for_router_ties": redrawn}
    print(f"\n== {shape.name} ({shape.describe()}): GEMM floor {floor_ms:.2f} ms at {tflops:.0f} TFLOP/s "
          f"(issue: {anchors['floor']}); {100 * redrawn:.2f}% of tokens redrawn (bf16/fp32 router near-ties)",
          flush=True)

    reference: dict[str, torch.Tensor] = {}
    rows = []
    if device.type == "cuda":
        info["dense_chain_ms"] = dense_gemm_chain_ms(shape, timer, device)
        info["dense_chain_tflops"] = shape.gemm_flops_fwd_bwd / (info["dense_chain_ms"] * 1e-3) / 1e12
        print(f"  dense GEMM chain (the layer's 6 GEMMs as dense products, no routing): {info['dense_chain_ms']:.3f} "
              f"ms = {info['dense_chain_tflops']:.0f} TFLOP/s sustained", flush=True)
    for name, build in VARIANTS.items():
        row = MoERow(shape.name, name, "ok", anchor_ms=anchors.get(name))
        try:
            measure_variant(row, build, shape, w, x, dy, reference, timer, repeats, floor_ms, device)
        except Unavailable as err:
            row.status = f"unavailable: {err}"
        except Exception as err:  # recorded in the results; the next variant still runs
            row.status = f"error: {type(err).__name__}: {str(err)[:400]}"
            traceback.print_exc()
        _free(device)
        errs = ", ".join(f"{k} {v:.1e}" for k, v in row.rel_err.items())
        timing = f"{row.ms:9.3f} ms ({row.x_floor:.2f}x floor)" if row.ms is not None else row.status
        print(f"  {name:17s} {timing}  {errs}", flush=True)
        if row.status == "ok" and row.implementation:
            print(f"  {'':17s} ran: {row.implementation}", flush=True)
        rows.append(row)
    del w, x, dy, reference
    _free(device)
    return rows, info


# ---------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------

def cpu_environment() -> dict:
    return {"gpu": "none (CPU smoke run)", "sm": "-", "sms": 0, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": package_version("triton"),
            "deepspeed": package_version("deepspeed"), "liger_kernel": package_version("liger-kernel"),
            "transformers": package_version("transformers"), "commit": git_commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def summary_lines(rows: list[MoERow], shapes: dict) -> list[str]:
    lines = []
    for name, info in shapes.items():
        by = {r.variant: r for r in rows if r.shape == name and r.ms is not None}
        ours = by.get("ours")
        if ours is None:
            lines.append(f"{name}: ours did not run")
            continue
        verdict = "met" if ours.ms <= info["target_ms"] else "missed"
        line = (f"{name}: ours {ours.ms:.2f} ms = {ours.x_floor:.2f}x the floor {info['floor_ms']:.2f} ms "
                f"(target <= {info['target_ms']} ms: {verdict})")
        if info.get("dense_chain_ms"):
            line += (f"; the same GEMMs as a dense chain take {info['dense_chain_ms']:.2f} ms "
                     f"({info['dense_chain_tflops']:.0f} TFLOP/s sustained): ours = "
                     f"{ours.ms / info['dense_chain_ms']:.3f}x the dense chain")
        ratios = [f"{v} {r.ms / ours.ms:.2f}" for v, r in by.items() if v != "ours"]
        lines.append(line + ("; time / ours' time: " + ", ".join(ratios) if ratios else ""))
    return lines


def write_results(name: str, out_dir: Path, env: dict, ceilings: dict, shapes: dict, rows: list[MoERow],
                  notes: list[str]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    summary = summary_lines(rows, shapes)
    json_path.write_text(json.dumps({"env": env, "ceilings": ceilings, "shapes": shapes,
                                     "rows": [asdict(r) for r in rows], "summary": summary, "notes": notes},
                                    indent=2))
    lines = [f"# {name}", "",
             f"{env['gpu']} (sm_{env['sm'].replace('.', '')}, {env['sms']} SMs), torch {env['torch']}, "
             f"CUDA {env['cuda']}, "
             f"triton {env['triton']}, transformers {env['transformers']}, DeepSpeed {env['deepspeed']}, "
             f"commit {env['commit'][:12]}, {env['date']}", "",
             "Ceilings measured in this run: " + ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items()), ""]
    for shape_name, info in shapes.items():
        lines += [f"## {shape_name}: T={info['tokens']} H={info['hidden']} I={info['inter']} E={info['experts']} "
                  f"K={info['top_k']}, fwd+bwd bf16", "",
                  f"GEMM floor {info['floor_ms']:.2f} ms ({info['gemm_flops_fwd_bwd'] / 1e12:.2f} TFLOP of expert "
                  f"GEMMs at the measured rate; issue: {info['floor_ms_issue']} ms); target for ours <= "
                  f"{info['target_ms']} ms. "
                  + (f"The same GEMMs as six dense products back to back: {info['dense_chain_ms']:.2f} ms "
                     f"({info['dense_chain_tflops']:.0f} TFLOP/s sustained). " if info.get("dense_chain_ms") else "")
                  + f"Input tokens redrawn so that bf16 and fp32 routers agree (near-ties): "
                  f"{100 * info['tokens_redrawn_for_router_ties']:.2f}%.", "",
                  "| variant | median ms | p10–p90 ms | x floor | expert-GEMM TFLOP/s | working GiB | "
                  "rel. err vs HF eager (out / dx / max param grad) | anchor ms | what ran / status |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---|"]
        for r in (r for r in rows if r.shape == shape_name):
            errs = "–"
            if r.rel_err:
                param_errs = [v for k, v in r.rel_err.items() if k not in ("out", "x")]
                errs = (f"{r.rel_err.get('out', float('nan')):.1e} / {r.rel_err.get('x', float('nan')):.1e} / "
                        f"{max(param_errs) if param_errs else float('nan'):.1e}")
            what = r.implementation if r.status == "ok" else r.status
            if r.note:
                what += f" — {r.note}"
            spread = f"{r.ms_p10:.3f}–{r.ms_p90:.3f}" if r.ms is not None else "–"
            lines.append(f"| {r.variant} | {_fmt(r.ms, '.3f')} | {spread} | {_fmt(r.x_floor, '.2f')} | "
                         f"{_fmt(r.gemm_tflops, '.0f')} | {_fmt(r.working_gib, '.2f')} | {errs} | "
                         f"{_fmt(r.anchor_ms, '.1f')} | {what.replace('|', '/')} |")
        lines.append("")
    lines += [f"- {s}" for s in summary] + [f"- {n}" for n in notes]
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral_like,fine_grained",
                        help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, 2 repeats, wall-clock timing")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("LF_RESULTS_DIR", RESULTS_DIR)),
                        help="results directory (default: $LF_RESULTS_DIR or benchmarks/results)")
    parser.add_argument("--repeats", type=int, default=50,
                        help=f"timed repeats per variant ({', '.join(SLOW_VARIANTS)}: at most {SLOW_REPEATS})")
    args = parser.parse_args()
    names = parse_names(args.shapes, SHAPES, "--shapes")

    from ds_loongforge.ops import set_strict_ops

    set_strict_ops(True)  # ours runs its compiled kernels or fails loudly, never the slower reference
    torch.manual_seed(0)
    if args.smoke:
        device, repeats = torch.device("cpu"), 2
        timer = WallTimer(warmup=1, repeats=repeats)
        shapes, env = SMOKE_SHAPES, cpu_environment()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_moe.py needs a CUDA GPU; use --smoke on a CPU machine")
        device, repeats = torch.device("cuda", 0), args.repeats
        timer = Timer(warmup=5, repeats=repeats)
        shapes, env = SHAPES, environment()
    start = time.time()

    ref = shapes["mixtral_like"]
    gemm = (ref.tokens * ref.top_k, ref.hidden, 2 * ref.inter)
    timer.repeats = repeats
    tflops = measure_matmul_tflops(timer, *gemm, device)
    _free(device)
    print(f"bf16 matmul [{gemm[0]}x{gemm[1]}] x [{gemm[1]}x{gemm[2]}]: {tflops:.1f} TFLOP/s", flush=True)

    rows, infos = [], {}
    for name in names:
        shape_rows, infos[name] = run_shape(shapes[name], timer, repeats, tflops, device)
        rows += shape_rows

    commit = env["commit"]
    result_name = f"bench_moe{'_smoke' if args.smoke else ''}_{commit[:7]}"
    notes = [
        f"Timing: median of {repeats} repeats ({', '.join(SLOW_VARIANTS)}: {min(repeats, SLOW_REPEATS)}) after "
        + ("1 warm-up, wall clock (CPU smoke run: the numbers mean nothing)." if args.smoke else
           "5 warm-ups, CUDA events around each call, L2 flushed (512 MB write) and a ~1 ms GPU head start "
           "before each repeat.")
        + " fwd+bwd = forward, then torch.autograd.grad over the input and every parameter with one fixed "
          "random output gradient; each layer's own router and auxiliary-loss work is included.",
        f"Floor: 18*T*K*H*I expert-GEMM FLOPs over the bf16 matmul rate measured here on "
        f"[{gemm[0]}x{gemm[1]}] x [{gemm[1]}x{gemm[2]}]; router, permutation and combine not counted.",
        "working GiB: peak allocated during the timed fwd+bwd minus what was allocated before it (weights, "
        "input, the shared reference copies and the timer's flush buffer).",
        f"Correctness: relative L2 error vs HF eager of the output, dx and each parameter gradient (in HF's "
        f"layout), from the same weights, input and output gradient; 'agrees' = all <= {AGREE_TOL}. Input "
        "tokens whose top-K experts differ between a bf16 router and DeepSpeed MoE's fp32 router, or whose K-th "
        "and (K+1)-th bf16 logits are equal (a top-k tie-break), are redrawn first, so every variant routes every "
        "token alike.",
        "Anchors: shared/BENCHMARKS.md, an earlier H200 run (torch 2.11+cu130, transformers 5.17, DeepSpeed 0.19.8).",
        f"Wall time of this run: {time.time() - start:.0f} s.",
    ]
    json_path, md_path = write_results(result_name, args.out, env, {"bf16 matmul TFLOP/s": tflops}, infos, rows,
                                       notes)
    print()
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
