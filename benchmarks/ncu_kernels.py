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

import argparse

import torch

from benchmarks.diagnose_dispatch import SHAPES, inputs, ops
from benchmarks.harness import require_cuda
from ds_loongforge.op_builder import FusedCrossEntropyBuilder, FusedRMSNormBuilder, MoEDispatchBuilder

CE_ROWS, VOCAB = 2048, 32000  # one chunk of the e2e LM head's loss


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    require_cuda("benchmarks/ncu_kernels.py")
    dispatch, norm, ce = (b().load() for b in (MoEDispatchBuilder, FusedRMSNormBuilder, FusedCrossEntropyBuilder))
    _, tokens, hidden, experts, top_k = SHAPES[0]  # the e2e mixtral shape
    dout, y, slot, weights = inputs(tokens, hidden, experts, top_k, dispatch)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    x, r, dy, dres = (randn(tokens, hidden) for _ in range(4))
    w = 1 + 0.1 * randn(hidden)
    _, h, rstd = norm.forward(x, r, w, 1e-6, True)
    logits = 2 * randn(CE_ROWS, VOCAB)
    target = torch.randint(0, VOCAB, (CE_ROWS,), device="cuda", generator=gen)
    valid = torch.ones(CE_ROWS, dtype=torch.bool, device="cuda")
    scale = torch.full((CE_ROWS,), 1.0 / CE_ROWS, device="cuda")
    grad = torch.empty_like(logits)

    calls = {name: (lambda call=call: call(dispatch)) for name, call, _ in ops(dout, y, slot, weights, x)}
    calls.update({
        "rmsnorm_forward_residual": lambda: norm.forward(x, r, w, 1e-6, True),
        "rmsnorm_backward_residual": lambda: norm.backward(dy, h, rstd, w, dres, True),
        "cross_entropy_chunk": lambda: ce.forward(logits, target, valid, scale, grad),
    })
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
