"""How many y rows the unpermute backward should read at once: csrc/moe_dispatch/moe_dispatch.cu built once per
value of LF_DISPATCH_LOADS_IN_FLIGHT, each timed on the e2e shapes' unpermute backward with weight gradients, next
to a device copy of the same bytes, in one run.

The kernel walks tokens (a warp per row at H >= 256): per 16-byte vector it reads the token's dout once, writes
w * dout to each of its K pair rows and adds the pair row's y vector into that pair's dot product. Read one y
vector at a time, a load is followed by its use before the next is issued, so each warp has one 512-byte read in
flight (about 65% of copy bandwidth in the 5325e3c e2e profile). Reading n of them first keeps n in flight and
holds more registers (fewer warps per SM): which n wins is measured here, not guessed.

Bytes moved (the least the op must move): dout [T, H] once, y [P, H] once, dy [P, H] once, dweights [T, K] fp32.

    python -m benchmarks.diagnose_dispatch [--values 1 2 4 8] [--out results/diagnose_dispatch.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.harness import Timer, environment, measure_copy_bandwidth
from ds_loongforge.op_builder import MoEDispatchBuilder, build_ops

# (name, tokens, hidden, experts, top_k): launch/train.py's e2e presets, 4 x 2048 tokens
SHAPES = (("mixtral_e2e", 8192, 2048, 8, 2), ("finegrained_e2e", 8192, 2048, 64, 8))


class _LoadsBuilder(MoEDispatchBuilder):
    """The dispatch op compiled with LF_DISPATCH_LOADS_IN_FLIGHT = LOADS, under a name of its own."""

    LOADS = 4

    def nvcc_args(self):
        return super().nvcc_args() + [f"-DLF_DISPATCH_LOADS_IN_FLIGHT={self.LOADS}"]


# one importable class per value: build_ops compiles each in a spawned process that imports it by name
VALUES = (1, 2, 4, 8)
BUILDERS = {n: type(f"Loads{n}Builder", (_LoadsBuilder,), {"NAME": f"lf_moe_dispatch_loads{n}", "LOADS": n,
                                                            "__module__": __name__}) for n in VALUES}
globals().update({cls.__name__: cls for cls in BUILDERS.values()})


def build_all(values: list[int]) -> dict:
    """One build per value, compiled in parallel (build_ops), then loaded from torch's cache."""
    modules = build_ops([BUILDERS[n]() for n in values])
    failed = {name: err for name, err in modules.items() if isinstance(err, Exception)}
    if failed:
        raise RuntimeError(f"diagnose_dispatch: builds failed: {failed}")
    return {n: modules[BUILDERS[n].NAME] for n in values}


def inputs(tokens: int, hidden: int, experts: int, top_k: int, module):
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices
    _, slot, _, _ = module.routing_indices(ids, experts)
    weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
    dout = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    return dout, y, slot, weights


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, nargs="+", default=list(VALUES), choices=VALUES)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    modules = build_all(args.values)
    timer = Timer(warmup=5, repeats=args.repeats)
    copy_gbps = measure_copy_bandwidth(timer)
    result = {"environment": environment(), "copy_gbps": copy_gbps, "rows": []}
    print(f"device copy: {copy_gbps:.0f} GB/s")
    for name, tokens, hidden, experts, top_k in SHAPES:
        dout, y, slot, weights = inputs(tokens, hidden, experts, top_k, modules[args.values[0]])
        moved = 2 * (tokens * hidden + 2 * tokens * top_k * hidden) + 4 * tokens * top_k
        reference = None
        for n, module in modules.items():
            dy, dw = module.unpermute_backward(dout, y, slot, weights)
            if reference is None:
                reference = (dy, dw)
            # the same sums in the same order whatever n: the same bits
            same = torch.equal(dy, reference[0]) and torch.equal(dw, reference[1])
            ms, p10, p90 = timer(lambda m=module: m.unpermute_backward(dout, y, slot, weights))
            row = {"shape": name, "loads_in_flight": n, "ms": ms, "p10_ms": p10, "p90_ms": p90,
                   "gbps": moved / ms / 1e6, "pct_of_copy": 100 * moved / ms / 1e6 / copy_gbps,
                   "bitwise_equal_to_first": same}
            result["rows"].append(row)
            print(f"{name:16s} loads {n}: {ms * 1e3:7.1f} us  {row['gbps']:6.0f} GB/s  {row['pct_of_copy']:5.1f}% "
                  f"of copy  same bits: {same}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
