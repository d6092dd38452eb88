"""The q/k/v projections of one attention, fwd + bwd, bf16: transformers' three Linears (three GEMMs each way, the
input gradients summed by autograd) against fused_kernels.qkv (ds_loongforge.modules.qkv: one GEMM forward, one
input-gradient and one weight-gradient GEMM backward), side by side in one run, with the dense GEMM rate of one
[T, H] x [H, N] product measured in the same run as the roofline.

FLOPs per fwd + bwd: 3 x 2 T H N (N = Q + 2 KV). Shapes: the e2e mixtral/finegrained attention (launch/train.py)
and a Llama-3-8B-like one.

    python -m benchmarks.bench_qkv [--repeats 100]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from benchmarks.harness import Row, Timer, environment, measure_copy_bandwidth, write_results, require_cuda
from ds_loongforge.modules.qkv import fuse_qkv

# (name, tokens, hidden, q_out, kv_out)
SHAPES = (("e2e_mixtral", 8192, 2048, 2048, 512), ("llama3_8b_like", 8192, 4096, 4096, 1024))


class Projections(nn.Module):
    def __init__(self, hidden: int, q_out: int, kv_out: int):
        super().__init__()
        kw = dict(bias=False, device="cuda", dtype=torch.bfloat16)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, q_out, **kw), nn.Linear(hidden, kv_out, **kw),
                                                 nn.Linear(hidden, kv_out, **kw))

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    require_cuda("benchmarks/bench_qkv.py")
    timer = Timer(repeats=args.repeats)
    copy_gbps = measure_copy_bandwidth(timer)
    rows, notes = [], []
    for name, tokens, hidden, q_out, kv_out in SHAPES:
        n_out = q_out + 2 * kv_out
        flops = 3 * 2 * tokens * hidden * n_out
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        stock = Projections(hidden, q_out, kv_out)
        fused = copy.deepcopy(stock)
        fuse_qkv(fused)
        grads = [torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) for n in (q_out, kv_out, kv_out)]
        w_dense = torch.randn(n_out, hidden, device="cuda", dtype=torch.bfloat16)
        dense_ms, p10, p90 = timer(lambda: x.detach() @ w_dense.t())
        dense_tflops = 2 * tokens * hidden * n_out / (dense_ms * 1e-3) / 1e12
        rows.append(Row(f"{name} T={tokens} H={hidden} N={n_out}", "one dense [T,H]x[H,N] product", dense_ms, p10,
                        p90, 0, note=f"{dense_tflops:.0f} TFLOP/s (roofline for the rows below)",
                        extra={"tflops": dense_tflops}))
        outs = {}
        for variant, module in (("transformers: three Linears", stock), ("fused_kernels.qkv", fused)):
            params = list(module.parameters())

            def fwd_bwd(module=module, params=params):
                return torch.autograd.grad(module(x), [x, *params], grads)

            outs[variant] = fwd_bwd()
            ms, p10, p90 = timer(fwd_bwd)
            tflops = flops / (ms * 1e-3) / 1e12
            rows.append(Row(f"{name} T={tokens} H={hidden} N={n_out}", variant, ms, p10, p90, 0,
                            note=f"{tflops:.0f} TFLOP/s, {3 * dense_ms / ms:.0%} of 3 dense products",
                            extra={"tflops": tflops}))
        ref, ours = outs.values()
        worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(ours, ref))
        notes.append(f"{name}: largest gradient difference, fused vs stock, relative to the gradient's max: "
                     f"{worst:.2e} (bf16 rounding of different GEMM reductions)")
        del x, stock, fused, grads, outs
    env = environment()
    json_path, md_path = write_results(f"bench_qkv_{env['commit'][:7]}", env, {"copy GB/s": copy_gbps}, rows,
                                       notes)
    print(md_path.read_text())


if __name__ == "__main__":
    main()
