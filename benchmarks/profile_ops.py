"""Per-kernel CUDA time of one fwd+bwd of each RMSNorm / SwiGLU variant (torch.profiler), to see where a
variant's time goes when its benchmark row disappoints.

    python -m benchmarks.profile_ops
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_norm_swiglu import _swiglu_eager
from benchmarks.harness import require_cuda
from ds_loongforge.ops import fused_rmsnorm, swiglu_dropout


def kernels_of(fn, label, iters=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    print(f"== {label}: per-iteration CUDA time by kernel (us)")
    total = 0.0
    for evt in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        us = evt.device_time_total / iters
        if us < 0.5:
            continue
        total += us
        print(f"   {us:9.1f}  x{evt.count // iters}  {evt.key[:110]}")
    print(f"   {total:9.1f}  total")


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    require_cuda("benchmarks/profile_ops.py")
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    kernels_of(lambda: torch.autograd.grad(fused_rmsnorm(x, w, impl="cuda"), (x, w), dy), "ours RMSNorm 8192x4096")
    gate_up = torch.randn(8192, 2 * 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(8192, 14336, device="cuda", dtype=torch.bfloat16)
    for p in (0.0, 0.1):
        kernels_of(lambda: torch.autograd.grad(swiglu_dropout(gate_up, p, seed=1, impl="cuda"), (gate_up,), dout),
                   f"ours SwiGLU p={p}")
    compiled = torch.compile(_swiglu_eager)
    kernels_of(lambda: torch.autograd.grad(compiled(gate_up, 0.0), (gate_up,), dout), "compile SwiGLU p=0")
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    kernels_of(lambda: torch.autograd.grad(LigerFusedGateUpSiLUMulFunction.apply(gate_up), (gate_up,), dout),
               "Liger SwiGLU fused gate_up")


if __name__ == "__main__":
    main()
