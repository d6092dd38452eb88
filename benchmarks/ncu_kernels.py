"""Our memory-bound kernels that stay below the copy rate in the e2e mixtral step, each launched once inside an
NVTX range "lf" for Nsight Compute to read their hardware counters (stall reasons, issue slots, occupancy, DRAM
throughput) instead of guessing from times.

At the e2e mixtral shape (8192 tokens, hidden 2048, 8 experts top-2, bf16) in the f456232 trace: the MoE gathers and
scatters at 58-75% of copy (1.35 ms a step), the RMSNorm backward with the residual's gradient at ~70% (0.71 ms),
and the cross-entropy chunk (2048 x 32000 bf16 logits), which was issue-bound before bfcb015.

    ncu --clock-control none --nvtx --nvtx-include "lf/" --section SpeedOfLight ... python -m benchmarks.ncu_kernels

(benchmarks/run_gpu.sh, step ncu_kernels, runs it so.) Without ncu it just runs each kernel, which checks the script.
"""

from __future__ import annotations

import torch

from ds_loongforge.op_builder import FusedCrossEntropyBuilder, FusedRMSNormBuilder, MoEDispatchBuilder

TOKENS, HIDDEN, EXPERTS, TOP_K = 8192, 2048, 8, 2  # launch/train.py --model mixtral, 4 x 2048 tokens
CE_ROWS, VOCAB = 2048, 32000


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dispatch, norm, ce = (b().load() for b in (MoEDispatchBuilder, FusedRMSNormBuilder, FusedCrossEntropyBuilder))

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    ids = torch.rand(TOKENS, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
    _, slot, _, _ = dispatch.routing_indices(ids, EXPERTS)
    weights = torch.rand(TOKENS, TOP_K, device="cuda", generator=gen)
    x, dout = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN)
    y = randn(TOKENS * TOP_K, HIDDEN)
    w = 1 + 0.1 * randn(HIDDEN)
    r, dy, dres = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN)
    _, h, rstd = norm.forward(x, r, w, 1e-6, True)
    logits = 2 * randn(CE_ROWS, VOCAB)
    target = torch.randint(0, VOCAB, (CE_ROWS,), device="cuda", generator=gen)
    valid = torch.ones(CE_ROWS, dtype=torch.bool, device="cuda")
    scale = torch.full((CE_ROWS,), 1.0 / CE_ROWS, device="cuda")
    grad = torch.empty_like(logits)

    calls = {
        "permute_forward": lambda: dispatch.permute_forward(x, slot),
        "permute_backward": lambda: dispatch.permute_backward(y, slot),
        "unpermute_forward": lambda: dispatch.unpermute_forward(y, slot, weights, None),
        "unpermute_forward_residual": lambda: dispatch.unpermute_forward(y, slot, weights, x),
        "unpermute_backward": lambda: dispatch.unpermute_backward(dout, y, slot, weights),
        "rmsnorm_forward_residual": lambda: norm.forward(x, r, w, 1e-6, True),
        "rmsnorm_backward_residual": lambda: norm.backward(dy, h, rstd, w, dres, True),
        "cross_entropy_chunk": lambda: ce.forward(logits, target, valid, scale, grad),
    }
    for fn in calls.values():  # warm: allocator, lazy module loading
        fn()
    torch.cuda.synchronize()
    for name, fn in calls.items():
        torch.cuda.nvtx.range_push("lf")
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    main()
