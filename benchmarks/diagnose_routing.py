"""The routing kernel (csrc/moe_dispatch/moe_routing.cu: the stable counting sort of the token-expert pairs by
expert) timed from the e2e shapes up to millions of pairs, beside torch's stable sort (the reference path it
replaced) and, with --old-csrc, beside the same op built from another source tree, interleaved round by round.
Every build's result is checked against the reference (integers: equal or not).

Why: the kernel's scan used to be one 1024-thread block. At 42005ae each expert's bucket had one thread, which
walked that bucket's counter in every 1024-pair block, one after the other and twice: 16 to 64 counters at the
e2e shapes, thousands at millions of pairs. ea99d7e spread the counters over all 1024 threads, which helped at 8
experts (4M pairs: 632 -> 128 us) but read them uncoalesced and lost at 256 experts (879 -> 2297 us). The
counters are now bucket-major and scanned by torch's device-wide CUB scan.

    git archive <rev> csrc | tar -x -C /tmp/old        # here; the tree must travel with the device call
    python -m benchmarks.diagnose_routing [--old-csrc /tmp/old/csrc] [--out results/x.json]
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.harness import Timer, ab_parser, environment, new_and_old_builds, other_tree_builder, require_cuda
from ds_loongforge.op_builder import MoEDispatchBuilder
from ds_loongforge.ops.moe_dispatch import routing_indices_reference

OldMoEDispatchBuilder = other_tree_builder(MoEDispatchBuilder, __name__, "OldMoEDispatchBuilder")

# (name, tokens, k, experts)
SHAPES = [
    ("e2e_mixtral", 8192, 2, 8),
    ("e2e_finegrained", 8192, 8, 64),
    ("1M_pairs_e8", 524288, 2, 8),
    ("1M_pairs_e64", 131072, 8, 64),
    ("4M_pairs_e8", 2097152, 2, 8),
    ("4M_pairs_e256", 524288, 8, 256),
    ("16M_pairs_e64", 2097152, 8, 64),
]


def main() -> int:
    args = ab_parser(__doc__).parse_args()
    require_cuda("benchmarks/diagnose_routing.py")
    builds = new_and_old_builds(MoEDispatchBuilder, OldMoEDispatchBuilder, args.old_csrc,
                                "moe_dispatch/moe_routing.cu", "diagnose_routing")

    timer = Timer(repeats=args.repeats)
    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, commit {env['commit'][:12]}")
    print(f"{'shape':16s} {'T x K, E':>18s} {'pairs':>9s} " + " ".join(f"{b + ' us':>10s}" for b in builds)
          + f" {'sort us':>10s}  equal to the stable sort")
    rows = []
    for i, (name, tokens, k, experts) in enumerate(SHAPES):
        gen = torch.Generator(device="cuda").manual_seed(i)
        ids = torch.randint(0, experts, (tokens, k), device="cuda", generator=gen)
        fns = {b: (lambda m=m, ids=ids: m.routing_indices(ids, experts)) for b, m in builds.items()}
        fns["sort"] = lambda ids=ids: routing_indices_reference(ids, experts)
        times = timer.interleaved(fns)
        ref = routing_indices_reference(ids, experts)
        equal = {b: all(torch.equal(a, r) for a, r in zip(m.routing_indices(ids, experts), ref))
                 for b, m in builds.items()}
        print(f"{name:16s} {f'{tokens}x{k}, {experts}':>18s} {tokens * k:9d} "
              + " ".join(f"{times[b] * 1e3:10.1f}" for b in builds) + f" {times['sort'] * 1e3:10.1f}  "
              + ", ".join(f"{b} {'yes' if ok else 'NO'}" for b, ok in equal.items()))
        rows.append({"shape": name, "tokens": tokens, "k": k, "experts": experts,
                     "us": {b: t * 1e3 for b, t in times.items()}, "equal_to_sort": equal})
        del ids, ref
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    return 0 if all(all(r["equal_to_sort"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
