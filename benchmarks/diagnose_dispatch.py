"""The MoE dispatch kernels of csrc/moe_dispatch/moe_dispatch.cu built once per variant (preprocessor flags), each
timed on the e2e shapes' four dispatch ops next to a device copy of the same bytes, in one run.

Variants (--variants):
- pipelined (the default build): at 401c695 the gathers (permute backward, unpermute forward) ran on a persistent
  grid whose threads read the next token's slots while a token's rows arrive, every row of a token at once; since
  the H200 run of that (diagnose_dispatch_401c695) only the unpermute forward with the residual at K <= 2 does;
- one_token (LF_GATHER_PIPELINED=0): the gathers one token a thread everywhere, as before 401c695 (~59% of copy
  at the mixtral shape's K = 2 on the H200, diagnose_dispatch_d149122);
- loads1 / loads2 / loads8 (LF_DISPATCH_LOADS_IN_FLIGHT): how many y rows the unpermute backward reads before it
  uses the first (4 in the default build; one at a time ran at ~65% of copy in the 5325e3c e2e profile).

Bytes moved (the least each op must move): permute forward x [T, H] once, x_PH [P, H] once; permute backward the
same; unpermute forward y [P, H], out [T, H] (and the residual [T, H]); unpermute backward dout [T, H], y [P, H],
dy [P, H] once and dweights [T, K] fp32. Every variant must give the same bits (the same sums in the same order).

    python -m benchmarks.diagnose_dispatch [--variants pipelined one_token] [--out results/diagnose_dispatch.json]
"""


from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.harness import Timer, build_variants, environment, flag_variant_builders, measure_copy_bandwidth
from benchmarks.harness import require_cuda
from ds_loongforge.op_builder import MoEDispatchBuilder

# (name, tokens, hidden, experts, top_k): launch/train.py's e2e presets, 4 x 2048 tokens
SHAPES = (("mixtral_e2e", 8192, 2048, 8, 2), ("finegrained_e2e", 8192, 2048, 64, 8))


VARIANTS = {"pipelined": {}, "one_token": {"LF_GATHER_PIPELINED": 0}, "loads1": {"LF_DISPATCH_LOADS_IN_FLIGHT": 1},
            "loads2": {"LF_DISPATCH_LOADS_IN_FLIGHT": 2}, "loads8": {"LF_DISPATCH_LOADS_IN_FLIGHT": 8}}
# one importable class per variant: build_ops compiles each in a spawned process that imports it by name
BUILDERS = flag_variant_builders(MoEDispatchBuilder, VARIANTS, __name__, "Dispatch")
globals().update({cls.__name__: cls for cls in BUILDERS.values()})


def build_all(variants: list[str]) -> dict:
    """One build per variant, compiled in parallel (build_ops), then loaded from torch's cache."""
    return build_variants(BUILDERS, variants, "diagnose_dispatch")


def inputs(tokens: int, hidden: int, experts: int, top_k: int, module):
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices
    _, slot, _, _ = module.routing_indices(ids, experts)
    weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
    dout = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    return dout, y, slot, weights


def ops(dout, y, slot, weights, x):
    """(name, call, bytes moved) of the four dispatch ops on one shape's tensors."""
    tokens, hidden = dout.shape
    pairs = y.shape[0]
    return (
        ("permute_forward", lambda m: m.permute_forward(x, slot), 2 * (tokens + pairs) * hidden),
        ("permute_backward", lambda m: m.permute_backward(y, slot), 2 * (pairs + tokens) * hidden),
        ("unpermute_forward", lambda m: m.unpermute_forward(y, slot, weights, None), 2 * (pairs + tokens) * hidden),
        ("unpermute_forward_residual", lambda m: m.unpermute_forward(y, slot, weights, x),
         2 * (pairs + 2 * tokens) * hidden),
        ("unpermute_backward", lambda m: m.unpermute_backward(dout, y, slot, weights),
         2 * (tokens * hidden + 2 * pairs * hidden) + 4 * pairs),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["pipelined", "one_token"], choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_cuda("benchmarks/diagnose_dispatch.py")
    modules = build_all(args.variants)
    timer = Timer(warmup=5, repeats=args.repeats)
    copy_gbps = measure_copy_bandwidth(timer)
    result = {"environment": environment(), "copy_gbps": copy_gbps, "variants": {v: VARIANTS[v] for v in args.variants},
              "rows": []}
    print(f"device copy: {copy_gbps:.0f} GB/s")
    for name, tokens, hidden, experts, top_k in SHAPES:
        dout, y, slot, weights = inputs(tokens, hidden, experts, top_k, modules[args.variants[0]])
        x = torch.randn_like(dout)
        for op, call, moved in ops(dout, y, slot, weights, x):
            reference = None
            for variant, module in modules.items():
                out = call(module)
                out = out if isinstance(out, (list, tuple)) else (out,)
                if reference is None:
                    reference = out
                same = all(torch.equal(a, b) for a, b in zip(out, reference))
                ms, p10, p90 = timer(lambda m=module: call(m))
                row = {"shape": name, "op": op, "variant": variant, "ms": ms, "p10_ms": p10, "p90_ms": p90,
                       "gbps": moved / ms / 1e6, "pct_of_copy": 100 * moved / ms / 1e6 / copy_gbps,
                       "bitwise_equal_to_first": same}
                result["rows"].append(row)
                print(f"{name:16s} {op:27s} {variant:10s} {ms * 1e3:7.1f} us  {row['gbps']:6.0f} GB/s  "
                      f"{row['pct_of_copy']:5.1f}% of copy  same bits: {same}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
