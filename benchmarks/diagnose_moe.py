"""Where does the MoE layer's time go between its kernels? (issue 3: mixtral_like is ~2.4 ms slower than the
sum of its kernels.) Four measurements on one fwd+bwd of our layer, each answering one question:

1. host syncs: ``torch.cuda.set_sync_debug_mode("warn")`` over one fwd+bwd; every synchronising call is
   listed with the Python line that made it (a sync lets the GPU drain while the host catches up).
2. timeline: torch.profiler (CPU + CUDA) over 3 iterations; the idle gaps between consecutive kernels on
   the stream, largest first, each with the kernels on either side and the CPU ops running during it.
3. launch-free time: the same fwd+bwd captured in a CUDA graph and replayed (no host work at all), next to
   the eager time, with the same timer. Eager minus graph = what the host costs.
4. clocks: the dense bf16 matmul rate for one product (what bench_moe's floor uses) vs sustained over a
   chain as long as the layer, with nvidia-smi's SM clock and power sampled around it.

    python -m benchmarks.diagnose_moe [--shape mixtral_like] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

from benchmarks.bench_moe import DTYPE, SHAPES, build_ours, make_input, make_weights
from benchmarks.harness import Timer, smi_samples, require_cuda
from ds_loongforge.diagnostics import format_kernel_timeline


def host_syncs(fn) -> list[str]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the mode's own "prototype feature" notice is not a sync
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:160]}" for w in caught
            if "called a synchronizing" in str(w.message)]


def timeline(fn, iters: int = 3, top: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from ds_loongforge.diagnostics import kernel_timeline

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return kernel_timeline(prof, iters=iters, top=top)


def captured(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warmup`` calls on a side stream (torch's recipe: lazy state and
    the caching allocator's blocks settle outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_vs_eager(fn, timer) -> dict:
    eager_ms = timer(fn)[0]
    try:
        graph = captured(fn)
    except Exception as err:  # a host sync or a host-dependent shape inside the layer makes capture fail
        return {"eager_ms": eager_ms, "graph": f"capture failed: {type(err).__name__}: {str(err)[:300]}"}
    graph_ms = timer(graph.replay)[0]
    return {"eager_ms": eager_ms, "graph_ms": graph_ms, "host_cost_ms": eager_ms - graph_ms}


def clocks(shape, timer) -> dict:
    T, H, I = shape.tokens * shape.top_k // shape.experts, shape.hidden, shape.inter
    a = torch.randn(T, H, device="cuda", dtype=DTYPE)
    b = torch.randn(H, 2 * I, device="cuda", dtype=DTYPE)
    flops = 2 * T * H * 2 * I
    one_ms = timer(lambda: a @ b)[0]
    chain = max(1, int(round(shape.gemm_flops_fwd_bwd / flops)))
    with smi_samples("clocks.sm,power.draw,temperature.gpu", units=True) as samples:
        chain_ms = timer(lambda: [a @ b for _ in range(chain)])[0]
    return {"gemm": f"[{T}x{H}] @ [{H}x{2 * I}] bf16", "single_tflops": flops / one_ms / 1e9,
            "chain_len": chain, "chain_tflops": chain * flops / chain_ms / 1e9, "smi_samples": samples[-12:]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral_like")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require_cuda("benchmarks/diagnose_moe.py")
    shape = SHAPES[args.shape]
    w = make_weights(shape, torch.device("cuda"))
    x, _ = make_input(shape, w.gate_EH, torch.device("cuda"))
    dy = torch.randn_like(x)
    built = build_ours(shape, w, torch.device("cuda"))
    inputs = (x, *built.params)

    def step():
        return torch.autograd.grad(built.forward(x), inputs, dy, allow_unused=True, materialize_grads=True)

    timer = Timer(warmup=5, repeats=args.repeats)
    result = {"shape": args.shape, "implementation": built.implementation}
    result["host_syncs"] = host_syncs(step)
    print("host syncs in one fwd+bwd:", len(result["host_syncs"]), *result["host_syncs"], sep="\n  ", flush=True)
    result["timeline"] = timeline(step)
    print("timeline:", format_kernel_timeline(result["timeline"]), sep="\n", flush=True)
    result["graph"] = graph_vs_eager(step, timer)
    print("graph vs eager:", result["graph"], flush=True)
    del built, inputs
    torch.cuda.empty_cache()
    result["clocks"] = clocks(shape, timer)
    print("clocks:", json.dumps(result["clocks"], indent=1), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"diagnose_moe_{args.shape}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
