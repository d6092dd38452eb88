"""The fused AdamW update of csrc/adamw/adamw.cu built once per launch shape (preprocessor flags), each timed on
the e2e mixtral optimizer's workload in one run: at the GPU's idle clocks, and right after a chain of bf16 GEMMs
long enough to bring the H200 to its power cap, as the backward leaves it in a training step.

Why: the default update (512 threads a block, 8 elements a thread) compiles to 70 registers, so one block of 512
threads fits an SM (25% occupancy in the e2e trace at f456232). Each thread loads, computes and stores one step
after the other; with fewer warps to switch between, less is in flight while threads compute, and the compute
takes longer at the capped clock. The variants (--variants):

- base (the default build): 512 threads, 8 elements a thread, 70 registers, one block an SM (84 from
  030a37f to 9358590, when the default bound named a block count of 1);
- lb2: the same with __launch_bounds__(512, 2): 64 registers, two blocks (1024 threads) an SM;
- t256x4: 256 threads, __launch_bounds__(256, 4): 64 registers, four blocks an SM;
- v4: 512 threads, 4 elements a thread (8-byte bf16 accesses): 50 registers (64 when measured at 030a37f),
  two blocks an SM.

Workload: bf16 params and grads, fp32 masters and moments, in 32 tensors that add up to the e2e mixtral model's
1.844e9 parameters (one bucket, one launch, as ZeRO-2's one partition on one GPU). The floor is 28 bytes a
parameter (reads grad 2, master, m, v 12; writes master, m, v 12, the bf16 param 2) at the copy rate measured in
the same run. Every variant must give the same bits (checked on a small state of odd sizes first).

    python -m benchmarks.diagnose_adamw [--variants base lb2 t256x4 v4] [--rounds 20] [--out results/x.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.harness import Timer, build_variants, environment, flag_variant_builders, measure_copy_bandwidth
from benchmarks.harness import require_cuda
from ds_loongforge.op_builder import FusedAdamWClipBuilder

PARAMS = 1_844_000_000  # the e2e mixtral model (28137 chunks of 65536 in its trace)
TENSORS = 32
BYTES_PER_PARAM = 28
LR, BETA1, BETA2, EPS, WD, MAX_NORM, CLIP_EPS = 1e-4, 0.9, 0.95, 1e-8, 0.01, 1.0, 1e-6


VARIANTS = {"base": {}, "lb2": {"LF_ADAMW_MIN_BLOCKS": 2},
            "t256x4": {"LF_ADAMW_THREADS": 256, "LF_ADAMW_MIN_BLOCKS": 4}, "v4": {"LF_ADAMW_VEC": 4}}
# one importable class per variant: build_ops compiles each in a spawned process that imports it by name
BUILDERS = flag_variant_builders(FusedAdamWClipBuilder, VARIANTS, __name__, "AdamW")
globals().update({cls.__name__: cls for cls in BUILDERS.values()})


def build_all(variants: list[str]) -> dict:
    """One build per variant, compiled in parallel (build_ops), then loaded from torch's cache."""
    return build_variants(BUILDERS, variants, "diagnose_adamw")


def make_state(sizes: list[int], seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    masters = [torch.randn(n, device="cuda", generator=gen) * 0.02 for n in sizes]
    return {"params": [m.to(torch.bfloat16) for m in masters], "masters": masters,
            "grads": [(torch.randn(n, device="cuda", generator=gen) * 1e-4).to(torch.bfloat16) for n in sizes],
            "m": [torch.randn(n, device="cuda", generator=gen) * 1e-5 for n in sizes],
            "v": [torch.rand(n, device="cuda", generator=gen) * 1e-9 for n in sizes],
            "steps": [torch.full((1,), 7.0, device="cuda") for _ in sizes]}


def clone_state(state: dict) -> dict:
    return {k: [t.clone() for t in ts] for k, ts in state.items()}


def stepper(module, state: dict):
    """A callable that runs pass 1 and pass 2 on the state (pass 2 alone is what the variants change)."""
    cpu = module.make_table(state["params"], state["masters"], state["grads"], state["m"], state["v"],
                            state["steps"])
    dev = cpu.to("cuda")
    stats = torch.zeros(2, device="cuda")

    def stats_pass():
        stats.zero_()
        module.grad_stats([cpu], [dev], stats)

    def update():
        module.adamw_apply(cpu, dev, stats, LR, BETA1, BETA2, EPS, WD, MAX_NORM, CLIP_EPS, 1.0)

    stats_pass()
    return stats_pass, update


def check_bits(modules: dict) -> dict:
    """Every variant from the same small state of odd sizes (tails, unaligned ends): the same bits as base."""
    sizes = [1, 7, 4095, 65536, 65537, 200_003, 1_000_001]
    start = make_state(sizes, seed=1)
    results = {}
    for name, module in modules.items():
        state = clone_state(start)
        stats_pass, update = stepper(module, state)
        for _ in range(3):
            stats_pass()
            update()
        results[name] = state
    torch.cuda.synchronize()
    ref_name = next(iter(results))
    ref = results[ref_name]
    same = {}
    for name, state in results.items():
        same[name] = all(torch.equal(a, b) for k in ("params", "masters", "m", "v", "steps")
                         for a, b in zip(state[k], ref[k]))
    return same


def gemm_burst(ms_target: float):
    """A chain of bf16 GEMMs that takes about ms_target at the idle clock (calibrated once)."""
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8192, 14336, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b, out=out)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        torch.mm(a, b, out=out)
    e.record()
    torch.cuda.synchronize()
    per = s.elapsed_time(e) / 10
    n = max(1, round(ms_target / per))

    def burst():
        for _ in range(n):
            torch.mm(a, b, out=out)

    return burst, n, per


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--burst-ms", type=float, default=40.0, help="GEMM time before each 'after GEMMs' call")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_cuda("benchmarks/diagnose_adamw.py")

    modules = build_all(args.variants)
    same = check_bits(modules)
    print("same bits as", args.variants[0], same, flush=True)

    timer = Timer(warmup=2, repeats=args.rounds)
    copy_gbps = measure_copy_bandwidth(timer)
    base = PARAMS // TENSORS
    sizes = [base] * (TENSORS - 1) + [PARAMS - base * (TENSORS - 1)]
    state = make_state(sizes, seed=0)
    steppers = {name: stepper(m, state) for name, m in modules.items()}
    burst, n_gemms, gemm_ms = gemm_burst(args.burst_ms)
    floor_ms = PARAMS * BYTES_PER_PARAM / (copy_gbps * 1e9) * 1e3

    idle = timer.interleaved_times({name: upd for name, (_, upd) in steppers.items()})

    def after_gemms(fn):
        def run():
            burst()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            return s, e
        return run

    hot: dict[str, list[float]] = {name: [] for name in steppers}
    for name, (_, upd) in steppers.items():  # warm-up
        after_gemms(upd)()
    torch.cuda.synchronize()
    for _ in range(args.rounds):
        events = [(name, after_gemms(upd)()) for name, (_, upd) in steppers.items()]
        torch.cuda.synchronize()
        for name, (s, e) in events:
            hot[name].append(s.elapsed_time(e))
    stats_ms = timer(steppers[args.variants[0]][0])[0]

    rows = []
    for name in steppers:
        row = {"variant": name, "flags": VARIANTS[name], "same_bits": same[name]}
        for cond, times in (("idle", idle[name]), ("after_gemms", hot[name])):
            med = statistics.median(times)
            row[cond] = {"median_ms": round(med, 4), "p10_ms": round(sorted(times)[len(times) // 10], 4),
                         "p90_ms": round(sorted(times)[(9 * len(times)) // 10], 4),
                         "pct_of_copy": round(100 * floor_ms / med, 1)}
        rows.append(row)
    result = {"env": environment(), "copy_gbps": round(copy_gbps, 1), "params": PARAMS, "tensors": TENSORS,
              "floor_ms": round(floor_ms, 4), "gemm_burst": {"gemms": n_gemms, "ms_each_idle": round(gemm_ms, 4)},
              "pass1_ms_idle": round(stats_ms, 4), "rows": rows}
    print(f"copy {copy_gbps:.0f} GB/s, floor {floor_ms:.3f} ms for {PARAMS:.3e} params x {BYTES_PER_PARAM} B; "
          f"burst {n_gemms} GEMMs of {gemm_ms:.2f} ms; pass 1 {stats_ms:.3f} ms")
    print(f"{'variant':<8} {'idle ms':>9} {'% copy':>7} {'after GEMMs ms':>15} {'% copy':>7}  same bits")
    for r in rows:
        print(f"{r['variant']:<8} {r['idle']['median_ms']:>9.3f} {r['idle']['pct_of_copy']:>7.1f} "
              f"{r['after_gemms']['median_ms']:>15.3f} {r['after_gemms']['pct_of_copy']:>7.1f}  {r['same_bits']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
