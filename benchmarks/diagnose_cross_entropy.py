"""The fused softmax cross-entropy kernel (csrc/cross_entropy) timed on the LM heads' chunk shapes against the copy
rate, and, with --old-csrc, beside the same op built from another source tree, interleaved round by round (the
same clocks for both), with each build's error against fp64 and its tolerance (2x PyTorch's own fp32 error).

Why: with libm's expf the H200 ran the e2e chunk (2048 x 32000 bf16 logits, bf16 gradient) at 115 us, 2274 GB/s,
where moving its bytes takes ~61 us: the kernel was issue-bound (40 SASS instructions an element, 8 of them an
expf's range reduction and rescale). Each exp is now one MUFU.EX2 of (x - max) * log2(e).

    git archive <rev> csrc | tar -x -C /tmp/old        # here; the tree must travel with the device call
    python -m benchmarks.diagnose_cross_entropy [--old-csrc /tmp/old/csrc] [--out results/x.json]

Shapes: the e2e chunk (bf16 and fp32 logits, and without a gradient, as in eval), Llama-3's and Qwen2/3's
vocabularies (the streaming kernel), and an odd vocabulary (the scalar path). Bytes counted: one read of the logits
and one write of the gradient; the floor is those at the copy rate measured in the same run.
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.harness import (Timer, ab_parser, environment, measure_copy_bandwidth, new_and_old_builds,
                                other_tree_builder, require_cuda)
from ds_loongforge.op_builder import FusedCrossEntropyBuilder
from ds_loongforge.ops.numerics import cross_entropy_checks

OldCrossEntropyBuilder = other_tree_builder(FusedCrossEntropyBuilder, __name__, "OldCrossEntropyBuilder")

# (name, rows, vocab, logits dtype, gradient dtype or None)
SHAPES = [
    ("e2e_chunk_bf16", 2048, 32000, torch.bfloat16, torch.bfloat16),
    ("e2e_chunk_fp32_logits", 2048, 32000, torch.float32, torch.bfloat16),
    ("e2e_chunk_nll_only", 2048, 32000, torch.bfloat16, None),
    ("llama3_vocab", 2048, 128256, torch.bfloat16, torch.bfloat16),
    ("qwen_vocab", 1024, 151936, torch.bfloat16, torch.bfloat16),
    ("odd_vocab_scalar", 2048, 32003, torch.bfloat16, torch.bfloat16),
]


def make_inputs(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (2.0 * torch.randn(rows, vocab, device="cuda", generator=gen)).to(dtype)
    valid = torch.rand(rows, device="cuda", generator=gen) >= 0.1
    target = torch.where(valid, torch.randint(0, vocab, (rows,), device="cuda", generator=gen), 0)
    scale = torch.where(valid, 1.0 / rows, 0.0)
    return logits, target, valid, scale


def errors(module, logits: torch.Tensor, grad_dtype) -> dict:
    """Max |error| against fp64 of the nll and the gradient of this build (module), and its tolerance: 2x
    PyTorch's fp32 error on the same logits, floored at 8 fp32 ulp (numerics.cross_entropy_checks)."""
    checks = cross_entropy_checks(logits.shape[0], logits.shape[1], grad_dtype, "cuda", "cuda", logits_CV=logits,
                                  op=module.forward)
    return {c.name.rsplit(" ", 1)[1]: {"error": c.error, "tolerance": c.tol} for c in checks}


def main() -> int:
    args = ab_parser(__doc__).parse_args()
    require_cuda("benchmarks/diagnose_cross_entropy.py")
    builds = new_and_old_builds(FusedCrossEntropyBuilder, OldCrossEntropyBuilder, args.old_csrc,
                                "cross_entropy/cross_entropy.cu", "diagnose_cross_entropy")

    timer = Timer(repeats=args.repeats)
    copy_gbps = measure_copy_bandwidth(timer)
    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, commit {env['commit'][:12]}; copy {copy_gbps:.0f} GB/s")
    rows_out = []
    header = (f"{'shape':24s} {'C x V':>14s} {'build':5s} {'us':>8s} {'GB/s':>6s} {'% copy':>6s}  max |error| vs fp64: "
              "nll / dlogits (tolerance: 2x torch's fp32)")
    print(header)
    for i, (name, rows, vocab, dtype, grad_dtype) in enumerate(SHAPES):
        inputs = make_inputs(rows, vocab, dtype, seed=i)
        grads = {b: (torch.empty(rows, vocab, dtype=grad_dtype, device="cuda") if grad_dtype else None)
                 for b in builds}
        fns = {b: (lambda m=m, g=grads[b], a=inputs: m.forward(*a, g)) for b, m in builds.items()}
        times = timer.interleaved(fns)
        moved = rows * vocab * (inputs[0].element_size() + (torch.finfo(grad_dtype).bits // 8 if grad_dtype else 0))
        same = None
        if "old" in builds:
            nll_new, nll_old = builds["new"].forward(*inputs, grads["new"]), builds["old"].forward(*inputs, grads["old"])
            same = bool(torch.equal(nll_new, nll_old) and (grad_dtype is None or torch.equal(grads["new"], grads["old"])))
        del grads
        errs = {b: errors(m, inputs[0], grad_dtype) for b, m in builds.items()}
        for b in builds:
            gbps = moved / (times[b] * 1e-3) / 1e9
            shown = " / ".join(f"{e['error']:.2e} (tol {e['tolerance']:.2e})" for e in errs[b].values())
            print(f"{name:24s} {f'{rows}x{vocab}':>14s} {b:5s} {times[b] * 1e3:8.1f} {gbps:6.0f} "
                  f"{100 * gbps / copy_gbps:6.1f}  {shown}")
        if same is not None:
            print(f"{'':24s} new == old bitwise: {same}")
        rows_out.append({"shape": name, "rows": rows, "vocab": vocab, "logits": str(dtype)[6:],
                         "grad": str(grad_dtype)[6:] if grad_dtype else None, "bytes": moved,
                         "floor_us": moved / (copy_gbps * 1e9) * 1e6,
                         "us": {b: times[b] * 1e3 for b in builds}, "errors": errs, "bitwise_equal": same})
        del inputs
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"env": env, "copy_gbps": copy_gbps, "rows": rows_out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
