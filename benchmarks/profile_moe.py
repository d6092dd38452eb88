"""Per-kernel CUDA time of one fwd+bwd of our MoE layer (and HF's grouped_mm block) at the issue's shapes,
to see where the layer's time goes: expert GEMMs vs routing, permutation, SwiGLU and combine.

    python -m benchmarks.profile_moe [--shapes mixtral_like,fine_grained]
"""

import argparse

import torch

from benchmarks.bench_moe import SHAPES, VARIANTS, make_weights
from benchmarks.harness import require_cuda
from benchmarks.profile_ops import kernels_of


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral_like,fine_grained")
    parser.add_argument("--variants", default="ours,ours (per-expert GEMM loop),HF grouped_mm")
    args = parser.parse_args()
    require_cuda("benchmarks/profile_moe.py")
    device = torch.device("cuda")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        w = make_weights(shape, device)
        x = torch.randn(1, shape.tokens, shape.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        for variant in args.variants.split(","):
            built = VARIANTS[variant](shape, w, device)
            params = [x] + built.params
            kernels_of(lambda: torch.autograd.grad(built.forward(x), params, dy), f"{variant} {name}", iters=3)
            del built
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
