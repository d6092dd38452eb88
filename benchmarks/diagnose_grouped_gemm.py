"""Is torch's grouped GEMM (``F.grouped_mm``, CUTLASS ptr-array, one fixed 128x256x64 tile for large groups) as
fast per clock as cuBLAS on the MoE layer's six GEMMs? In the e2e mixtral kernel profile (87181e1) the 48 grouped
GEMMs of a step ran at ~696 TFLOP/s and the dense cuBLAS GEMMs of the same step at ~763: if that gap is the
kernel's and not the power cap's, an expert GEMM of our own is worth ~2.5 ms of the 69 ms step.

For each shape, the six GEMMs of one layer's fwd+bwd, as autograd runs them for
``F.grouped_mm(x, w.transpose(1, 2), offs)`` (forward; the input gradient; the weight gradient over ragged K),
each three ways, interleaved round by round so that clocks and power are the same for all three:

- ``grouped``: F.grouped_mm as the layer calls it;
- ``loop``: one cuBLAS GEMM per expert with the group sizes on the host (what a host sync would allow);
- ``dense``: one cuBLAS GEMM of the same FLOPs ([P, K] x [K, N], or K = P for the weight gradient).

Then the six back to back (the layer's GEMM chain) each way, and the SM clock read through NVML after each row's rounds.

``--host-cost``: the host side of the same choice. A per-expert loop issued from Python cost far more host time
than its GEMMs saved on the device (6323049: +28 ms of backward host time for 256 GEMMs a step, ~110 us each).
Python's own overhead is ~10 us a call, so the question is whether cuBLAS pays for a heuristic query whenever a
GEMM's M or K is new, which with fresh routing is every step. The layer's four backward products per-expert
with fresh group sizes every round (a skewed Dirichlet draw, max/mean ~2-4 as in the e2e logs), with the same
sizes every round, and grouped; host time to issue a round (perf_counter) and device time (CUDA events).

``--policies``: the device side of the same choice, paired. --host-cost timed its plans one after another, each
on its own draws of group sizes (the "same sizes" plan on the first draw only, the most skewed of them), so its
device times mixed three things: the plan, the draws, and the clock a sustained load had run down to by then. Here
every variant runs the same draws, round by round (Timer.interleaved_times: round r of each at the same clocks),
after one untimed pass over all draws that fills every algorithm cache (cuBLAS's for torch.mm with exact sizes,
ours per bucket): torch's grouped GEMM, a torch.mm loop (cuBLAS's exact-size heuristic), and
expert_linear_backward with each row-count grouping (8 buckets an octave, multiples of 64 rows, exact, blocks of 8).

``--algo-map``: cuBLASLt's exact choice for every row count in [mean / 2, 3 x mean] of the four backward products,
as runs of equal configuration (what the "blocks" grouping rests on).

    python -m benchmarks.diagnose_grouped_gemm [--rounds 30] [--out DIR] [--host-cost | --policies] [--algo-map]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import Timer, environment, require_cuda
from ds_loongforge.ops.moe_dispatch import expert_gemm_stats, expert_linear_backward
from ds_loongforge.ops.numerics import skewed_counts
from ds_loongforge.profiler import nvml_errors

# (name, tokens, hidden, intermediate, experts, top_k)
SHAPES = (("e2e_mixtral", 8192, 2048, 4096, 8, 2), ("e2e_finegrained", 8192, 2048, 1024, 64, 8),
          ("mixtral_like", 8192, 4096, 14336, 8, 2))
_clock_note: str | None = None  # why the SM clock cannot be read here, once known


def sm_clock_mhz() -> float | None:
    """The SM clock now (torch's NVML query), or None where NVML is missing (printed once)."""
    global _clock_note
    if _clock_note is not None:
        return None
    try:
        return float(torch.cuda.clock_rate())
    except nvml_errors() as err:
        _clock_note = f"SM clock not read: NVML unavailable ({type(err).__name__}: {err}); install nvidia-ml-py"
        print(_clock_note, flush=True)
        return None


def gemms(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0):
    """The layer's six GEMMs as {name: (flops, {variant: fn})}, on one random routing's group sizes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pairs = tokens * top_k
    ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, dim=1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    sizes = counts.tolist()
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(pairs, hidden, **kw)
    act = torch.randn(pairs, inter, **kw)
    d_out = torch.randn(pairs, hidden, **kw)
    d_gu = torch.randn(pairs, 2 * inter, **kw)
    w_gu = torch.randn(experts, 2 * inter, hidden, **kw) / hidden ** 0.5
    w_dn = torch.randn(experts, hidden, inter, **kw) / inter ** 0.5

    def loop_rows(a, w_of, n_out):  # rows grouped by expert times a per-expert matrix
        out = a.new_empty(a.shape[0], n_out)
        for e in range(experts):
            s, t = starts[e], starts[e + 1]
            if t > s:
                torch.mm(a[s:t], w_of(e), out=out[s:t])
        return out

    def loop_wgrad(a, b):  # per-expert a[rows].T @ b[rows] into [E, a_cols, b_cols]
        out = a.new_empty(experts, a.shape[1], b.shape[1])
        for e in range(experts):
            s, t = starts[e], starts[e + 1]
            torch.mm(a[s:t].t(), b[s:t], out=out[e])
        return out

    w_gu_t, w_dn_t = w_gu.transpose(1, 2), w_dn.transpose(1, 2)
    table = {
        "gate_up fwd": (2 * pairs * hidden * 2 * inter, {
            "grouped": lambda: F.grouped_mm(x, w_gu_t, offs=offs),
            "loop": lambda: loop_rows(x, lambda e: w_gu[e].t(), 2 * inter),
            "dense": lambda: torch.mm(x, w_gu[0].t())}),
        "down fwd": (2 * pairs * inter * hidden, {
            "grouped": lambda: F.grouped_mm(act, w_dn_t, offs=offs),
            "loop": lambda: loop_rows(act, lambda e: w_dn[e].t(), hidden),
            "dense": lambda: torch.mm(act, w_dn[0].t())}),
        "down dgrad": (2 * pairs * hidden * inter, {
            "grouped": lambda: F.grouped_mm(d_out, w_dn, offs=offs),
            "loop": lambda: loop_rows(d_out, lambda e: w_dn[e], inter),
            "dense": lambda: torch.mm(d_out, w_dn[0])}),
        "down wgrad": (2 * pairs * inter * hidden, {
            "grouped": lambda: F.grouped_mm(act.t(), d_out, offs=offs),
            "loop": lambda: loop_wgrad(act, d_out),
            "dense": lambda: torch.mm(act.t(), d_out)}),
        "gate_up dgrad": (2 * pairs * 2 * inter * hidden, {
            "grouped": lambda: F.grouped_mm(d_gu, w_gu, offs=offs),
            "loop": lambda: loop_rows(d_gu, lambda e: w_gu[e], hidden),
            "dense": lambda: torch.mm(d_gu, w_gu[0])}),
        "gate_up wgrad": (2 * pairs * hidden * 2 * inter, {
            "grouped": lambda: F.grouped_mm(x.t(), d_gu, offs=offs),
            "loop": lambda: loop_wgrad(x, d_gu),
            "dense": lambda: torch.mm(x.t(), d_gu)}),
    }
    # the loop's results equal the grouped ones (same math, cuBLAS vs CUTLASS summation order)
    for name, (_, fns) in table.items():
        ref, got = fns["grouped"]().float(), fns["loop"]().float()
        err = (ref - got).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        if err > 2e-2:
            raise AssertionError(f"{name}: per-expert loop differs from grouped_mm by {err:.3g} (relative)")
    return table, sizes


def time_interleaved(fns: dict, rounds: int) -> dict:
    """Median ms per variant, interleaved round by round (harness Timer), and the SM clock after the rounds."""
    out = Timer(warmup=3, repeats=rounds, head_start_cycles=1_000_000).interleaved(fns)
    out["sm_clock_mhz_median"] = sm_clock_mhz()
    return out


class BackwardProducts:
    """The MoE layer's four backward products (the gate_up and down weights' input and weight gradients) on random
    bf16 operands of one shape, each way: a torch.mm loop, torch's grouped GEMM and expert_linear_backward."""

    def __init__(self, tokens: int, hidden: int, inter: int, experts: int, top_k: int):
        self.pairs, self.experts = tokens * top_k, experts
        kw = dict(device="cuda", dtype=torch.bfloat16)
        self.x, self.act = torch.randn(self.pairs, hidden, **kw), torch.randn(self.pairs, inter, **kw)
        self.d_out, self.d_gu = torch.randn(self.pairs, hidden, **kw), torch.randn(self.pairs, 2 * inter, **kw)
        self.w_gu = torch.randn(experts, 2 * inter, hidden, **kw) / hidden ** 0.5
        self.w_dn = torch.randn(experts, hidden, inter, **kw) / inter ** 0.5
        self.dx_gu, self.dx_dn = torch.empty_like(self.x), torch.empty_like(self.act)
        self.dw_gu = self.x.new_empty(experts, hidden, 2 * inter)
        self.dw_dn = self.x.new_empty(experts, inter, hidden)

    @staticmethod
    def offsets(sizes: list[int]) -> torch.Tensor:
        return torch.tensor(sizes).cumsum(0).to(device="cuda", dtype=torch.int32)

    def loop(self, sizes: list[int]) -> None:
        s = 0
        for e, n in enumerate(sizes):
            r = slice(s, s + n)
            torch.mm(self.d_gu[r], self.w_gu[e], out=self.dx_gu[r])
            torch.mm(self.x[r].t(), self.d_gu[r], out=self.dw_gu[e])
            torch.mm(self.d_out[r], self.w_dn[e], out=self.dx_dn[r])
            torch.mm(self.act[r].t(), self.d_out[r], out=self.dw_dn[e])
            s += n

    def grouped(self, offs: torch.Tensor) -> None:
        F.grouped_mm(self.d_gu, self.w_gu, offs=offs)
        F.grouped_mm(self.x.t(), self.d_gu, offs=offs)
        F.grouped_mm(self.d_out, self.w_dn, offs=offs)
        F.grouped_mm(self.act.t(), self.d_out, offs=offs)

    def ours(self, sizes: list[int], row_bucket) -> None:  # the same per-expert GEMMs, one host call per weight
        expert_linear_backward(self.d_gu, self.x, self.w_gu, sizes, row_bucket=row_bucket)
        expert_linear_backward(self.d_out, self.act, self.w_dn, sizes, row_bucket=row_bucket)


def host_cost(tokens: int, hidden: int, inter: int, experts: int, top_k: int, rounds: int) -> dict:
    """Host us per round and device ms per round of the layer's four backward products, three ways."""
    from ds_loongforge.modules.moe import expert_gemm_row_bucket
    from ds_loongforge.ops.moe_dispatch import expert_gemm_backend

    prod = BackwardProducts(tokens, hidden, inter, experts, top_k)
    pairs = prod.pairs
    gen = torch.Generator().manual_seed(0)
    fresh = [skewed_counts(pairs, experts, gen) for _ in range(rounds + 3)]
    fixed = [fresh[0]] * (rounds + 3)
    row_bucket = expert_gemm_row_bucket()  # the layer's grouping

    def ours(sizes):
        prod.ours(sizes, row_bucket)

    def grouped(sizes):
        prod.grouped(prod.offsets(sizes))

    out = {"rounds": rounds, "max_over_mean": [max(s) * experts / pairs for s in fresh[:5]],
           "expert_gemm_backend": expert_gemm_backend("cuda"), "row_bucket": row_bucket}
    plans = [("loop_fresh_sizes", prod.loop, fresh), ("loop_same_sizes", prod.loop, fixed), ("grouped", grouped, fresh),
             ("expert_linear_backward_fresh_sizes", ours, fresh)]
    # a second pass of fresh sizes for ours: its first pass asks the heuristic for each new row-count bucket
    plans.append(("expert_linear_backward_fresh_sizes_warm", ours,
                  [skewed_counts(pairs, experts, gen) for _ in range(rounds + 3)]))
    for name, fn, plan in plans:
        for sizes in plan[:3]:
            fn(sizes)
        torch.cuda.synchronize()
        host, dev = [], []
        for sizes in plan[3:]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)  # the device busy, so that issue time is host time alone
            start.record()
            t = time.perf_counter()
            fn(sizes)
            host.append((time.perf_counter() - t) * 1e6)
            end.record()
            torch.cuda.synchronize()
            dev.append(start.elapsed_time(end))
        host.sort(), dev.sort()
        out[name] = {"host_us_per_round": host[len(host) // 2], "host_us_per_gemm": host[len(host) // 2] /
                     (4 if fn is grouped else 4 * experts), "device_ms_per_round": dev[len(dev) // 2]}
    return out


POLICIES = (("octave", "octave"), ("rows 64", 64), ("exact", "exact"), ("blocks", "blocks"))
FRESH_PRE_DRAWS = 100  # draws the blocks grouping sees before its host cost on fresh draws is measured


def uniform_counts(rows: int, experts: int, generator: torch.Generator) -> list[int]:
    """Group sizes of ``rows`` pairs routed uniformly at random (bench_moe's routing: sizes within a few % of
    rows / experts)."""
    ids = torch.randint(experts, (rows,), generator=generator)
    return torch.bincount(ids, minlength=experts).tolist()


def policies(tokens: int, hidden: int, inter: int, experts: int, top_k: int, rounds: int,
             routing: str = "skewed") -> dict:
    """Device ms of the layer's four backward products on the same fresh draws of group sizes (``routing``:
    "skewed" as the e2e logs, "uniform" as bench_moe), every variant round by round: grouped, a torch.mm loop,
    and expert_linear_backward per row-count grouping (POLICIES)."""
    prod = BackwardProducts(tokens, hidden, inter, experts, top_k)
    pairs = prod.pairs
    gen = torch.Generator().manual_seed(1)
    draw = skewed_counts if routing == "skewed" else uniform_counts
    draws = [draw(pairs, experts, gen) for _ in range(rounds)]
    offs = [prod.offsets(d) for d in draws]

    def cycling(body):  # the variant's call on the next draw, round robin over the draws
        state = {"i": 0}

        def call():
            i = state["i"] % rounds
            state["i"] += 1
            body(i)
        return call

    def ours(bucket, sizes=draws):
        return lambda i: prod.ours(sizes[i], bucket)

    fns = {"grouped": cycling(lambda i: prod.grouped(offs[i])), "torch.mm loop": cycling(lambda i: prod.loop(draws[i])),
           **{f"ours {name}": cycling(ours(bucket)) for name, bucket in POLICIES}}
    # warm-up: one pass over every draw (each variant's algorithm caches hold all of its sizes before timing)
    times = Timer(warmup=rounds, repeats=rounds, head_start_cycles=2_000_000).interleaved_times(fns)
    clock = sm_clock_mhz()
    # the blocks grouping's host cost in a run's steady state: heuristic queries and host time to issue a round on
    # fresh draws, after FRESH_PRE_DRAWS others
    pre = [draw(pairs, experts, gen) for _ in range(FRESH_PRE_DRAWS + rounds)]
    for i in range(FRESH_PRE_DRAWS):
        ours("blocks", pre)(i)
    before, host_us = expert_gemm_stats(), []
    for i in range(FRESH_PRE_DRAWS, FRESH_PRE_DRAWS + rounds):
        torch.cuda._sleep(2_000_000)
        t = time.perf_counter()
        ours("blocks", pre)(i)
        host_us.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    after = expert_gemm_stats()
    blocks_host = {k: after[k] - before[k] for k in after}
    blocks_host["host_us_per_round_median"] = sorted(host_us)[rounds // 2]
    blocks_host["host_us_per_round_max"] = max(host_us)
    base = times["grouped"]
    out = {"rounds": rounds, "routing": routing, "max_over_mean": [max(d) * experts / pairs for d in draws],
           "sm_clock_mhz": clock, "blocks_on_fresh_draws": blocks_host, "variants": {}}
    for name, t in times.items():
        ratios = sorted(a / b for a, b in zip(t, base))
        out["variants"][name] = {"sum_ms": sum(t), "median_ms": sorted(t)[rounds // 2],
                                 "median_ratio_to_grouped": ratios[rounds // 2], "ms_per_round": t}
    return out


def algo_map(tokens: int, hidden: int, inter: int, experts: int, top_k: int, lo: int, hi: int) -> dict:
    """cuBLASLt's exact heuristic choice for every row count in [lo, hi] of the layer's four backward product
    classes, as runs of equal configuration, and the host time of a query."""
    from ds_loongforge.op_builder import MoEDispatchBuilder

    module = MoEDispatchBuilder().load()
    like = torch.empty(1, device="cuda", dtype=torch.bfloat16)
    # (name, wgrad, m, fixed): y = x @ w^T with x [rows, I], w [O, I]; rows GEMM m=I k=O, wgrad m=I n=O
    classes = (("gate_up dx", False, hidden, 2 * inter), ("gate_up dw", True, hidden, 2 * inter),
               ("down dx", False, inter, hidden), ("down dw", True, inter, hidden))
    out = {"rows": [lo, hi], "classes": {}}
    for name, wgrad, m, fixed in classes:
        runs, t = [], time.perf_counter()
        for rows in range(lo, hi + 1):
            config = module.expert_gemm_heuristic(like, wgrad, m, fixed, rows)
            if runs and runs[-1][2] == config:
                runs[-1][1] = rows
            else:
                runs.append([rows, rows, config])
        query_us = (time.perf_counter() - t) * 1e6 / (hi - lo + 1)
        out["classes"][name] = {"query_us": query_us, "runs": len(runs),
                                "configs": len({tuple(c) for _, _, c in runs}), "by_rows": runs}
        print(f"{name}: {len(runs)} runs of {out['classes'][name]['configs']} configurations over rows {lo}..{hi}, "
              f"{query_us:.0f} us a query", flush=True)
    return out


def algo_rows(text: str) -> tuple[int, int]:
    """--algo-rows LO:HI, checked: 1 <= LO <= HI."""
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise SystemExit(f"--algo-rows {text!r}: expected LO:HI, two integers (e.g. 1:12288)") from None
    if not 1 <= lo <= hi:
        raise SystemExit(f"--algo-rows {text!r}: need 1 <= LO <= HI")
    return lo, hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--host-cost", action="store_true", help="host time of the per-expert loop (see above)")
    parser.add_argument("--policies", action="store_true",
                        help="device time of the row-count groupings, paired on the same draws (see above)")
    parser.add_argument("--algo-map", action="store_true",
                        help="cuBLASLt's exact choice over row counts around each shape's mean (see algo_map)")
    parser.add_argument("--algo-rows", default=None, metavar="LO:HI",
                        help="--algo-map's row counts (default: half to three times each shape's mean)")
    args = parser.parse_args()
    require_cuda("benchmarks/diagnose_grouped_gemm.py")
    rows_range = algo_rows(args.algo_rows) if args.algo_rows else None
    wanted = args.shapes.split(",")
    if args.algo_map:
        report = {"env": environment(), "shapes": {}}
        for name, *shape in SHAPES:
            if name in wanted:
                mean = shape[0] * shape[4] // shape[3]
                lo, hi = mean // 2, mean * 3
                if rows_range:
                    lo, hi = rows_range
                report["shapes"][name] = algo_map(*shape, lo=lo, hi=hi)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "diagnose_expert_gemm_algo_map.json").write_text(json.dumps(report))
        if not args.policies:
            return
    if args.policies:
        report = {"env": environment(), "shapes": {}}
        lines = []
        for (name, *shape), routing in ((s, r) for s in SHAPES for r in ("skewed", "uniform")):
            if name not in wanted:
                continue
            res = policies(*shape, rounds=args.rounds, routing=routing)
            report["shapes"][f"{name} {routing}"] = res
            lines.append(f"\n{name}, {routing} routing: {args.rounds} draws, max/mean load "
                         f"{min(res['max_over_mean']):.2f}.."
                         f"{max(res['max_over_mean']):.2f}, SM clock after {res['sm_clock_mhz']} MHz")
            lines.append(f"{'variant':16s} {'sum ms':>9s} {'median ms':>10s} {'x grouped':>10s}")
            for variant, r in res["variants"].items():
                lines.append(f"{variant:16s} {r['sum_ms']:9.2f} {r['median_ms']:10.3f} "
                             f"{r['median_ratio_to_grouped']:10.4f}")
            lines.append(f"blocks on {args.rounds} fresh draws after {FRESH_PRE_DRAWS} others: "
                         f"{res['blocks_on_fresh_draws']}")
            print("\n".join(lines[-3 - len(res["variants"]):]), flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "diagnose_expert_gemm_policies.json").write_text(json.dumps(report, indent=1))
        (out / "diagnose_expert_gemm_policies.txt").write_text("\n".join(lines) + "\n")
        return
    if args.host_cost:
        report = {"env": environment(), "shapes": {}}
        for name, *shape in SHAPES:
            if name in wanted:
                report["shapes"][name] = host_cost(*shape, rounds=args.rounds)
                print(name, json.dumps(report["shapes"][name], indent=1), flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "diagnose_expert_gemm_host.json").write_text(json.dumps(report, indent=1))
        return
    report = {"env": environment(), "rounds": args.rounds, "shapes": {}}
    lines = []
    for name, tokens, hidden, inter, experts, top_k in SHAPES:
        if name not in wanted:
            continue
        table, sizes = gemms(tokens, hidden, inter, experts, top_k)
        rows = {}
        lines.append(f"\n{name}: T={tokens} H={hidden} I={inter} E={experts} k={top_k}, group sizes "
                     f"{min(sizes)}..{max(sizes)}")
        lines.append(f"{'GEMM':15s} {'grouped':>16s} {'loop':>16s} {'dense':>16s}  MHz")
        total_flops = 0
        for gemm, (flops, fns) in table.items():
            t = time_interleaved(fns, args.rounds)
            total_flops += flops
            rows[gemm] = {"flops": flops, **{f"{v}_ms": t[v] for v in fns},
                          **{f"{v}_tflops": flops / t[v] / 1e9 for v in fns}, "sm_clock_mhz": t["sm_clock_mhz_median"]}
            lines.append(f"{gemm:15s} " + " ".join(f"{t[v]:7.3f} ms {flops / t[v] / 1e9:4.0f}T" for v in fns)
                         + f"  {t['sm_clock_mhz_median']}")
        chains = {v: (lambda v=v: [fns[v]() for _, fns in table.values()]) for v in ("grouped", "loop", "dense")}
        t = time_interleaved(chains, max(10, args.rounds // 2))
        rows["chain of six"] = {"flops": total_flops, **{f"{v}_ms": t[v] for v in chains},
                                **{f"{v}_tflops": total_flops / t[v] / 1e9 for v in chains},
                                "sm_clock_mhz": t["sm_clock_mhz_median"]}
        lines.append(f"{'chain of six':15s} " + " ".join(f"{t[v]:7.3f} ms {total_flops / t[v] / 1e9:4.0f}T"
                                                          for v in chains) + f"  {t['sm_clock_mhz_median']}")
        report["shapes"][name] = {"group_sizes": sizes, "gemms": rows}
        print("\n".join(lines[-9:]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnose_grouped_gemm.json").write_text(json.dumps(report, indent=1))
    (out / "diagnose_grouped_gemm.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
