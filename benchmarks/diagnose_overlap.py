"""Would running the optimizer's update alongside the next forward's GEMMs shorten a step that runs at the power cap?

The mixtral e2e step (issue 5) spends ~14 ms of its ~70 ms in FusedAdamWClip's update, a memory-bound stream
(28 bytes a parameter), and ~41 ms in GEMMs at the 700 W cap. Overlapping the update with the next forward (each
layer's forward waiting for its own parameters' update) hides the stream only if the GPU has power to spare for
it while the GEMMs run. This measures that before anything is built, with no model: one process, one GPU.

Workloads, sized as the mixtral e2e step (1.84e9 bf16 parameters with fp32 masters; GEMMs of a forward-sized
chain: ``--gemms`` products [8192 x 2048] @ [2048 x 8192] and back):
  gemm        the GEMM chain alone
  update      the fused step's two passes (grad_stats, then adamw_clip_apply per chunk) alone
  sequential  update, then the GEMM chain, on one stream (today's step order)
  overlapped  pass 1 on the main stream, then the update on a side stream while the GEMM chain runs on the
              main stream; the main stream waits for the side one at the end
  layered     as overlapped, with the dependencies a real overlap has: the update in ``--layers`` chunks in
              forward order, and the GEMMs of layer i waiting for chunk i (its parameters)
Each mode runs ``--repeats`` times back to back after ``--warmup-s`` seconds of the same load (default 3 s: the
power and clocks settle at the cap in about a second; a warm-up of a few repeats left the first mode's power window
starting from idle),
timed with CUDA events per repeat (median), with nvidia-smi's SM clock and power sampled meanwhile (mean W,
and energy = mean W x median time).

    python benchmarks/diagnose_overlap.py [--params 1.84e9] [--gemms 24] [--repeats 30] [--warmup-s 3] [--out DIR]

A "win" is overlapped < sequential by more than the spread of repeats; the saving against sequential says how
much of the update a real overlap could hide at most (the real one also has per-layer waits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.harness import smi_samples

LR, BETAS, EPS, WD, MAX_NORM = 1e-4, (0.9, 0.95), 1e-8, 0.01, 1.0


def build_update(n_params: float, n_tensors: int, chunks: int):
    """(pass 1 fn -> stats, pass 2 fn(stats, chunk slice)) over n_params bf16 params with fp32 masters: FusedAdamWClip's
    own bucket, cut into ``chunks`` buckets of consecutive tensors (the update of one layer's parameters each)."""
    from ds_loongforge.ops.adamw import AdamWBucket, adamw_clip_apply, grad_stats
    from ds_loongforge.optim import FusedAdamWClip

    numel = int(n_params // n_tensors)
    params = [torch.nn.Parameter(torch.randn(numel, device="cuda", dtype=torch.bfloat16)) for _ in range(n_tensors)]
    for p in params:
        p.grad = 1e-4 * torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    opt = FusedAdamWClip(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_norm=MAX_NORM, impl="cuda")
    opt.step()  # creates the masters and moments
    (whole,) = [b for i, g in enumerate(opt.param_groups) for b in opt._group_buckets(i, g)]
    cuts = [(i * n_tensors // chunks, (i + 1) * n_tensors // chunks) for i in range(chunks)]
    buckets = [AdamWBucket(whole.params[a:b], whole.grads[a:b], whole.exp_avgs[a:b], whole.exp_avg_sqs[a:b],
                           whole.steps[a:b], whole.masters[a:b]) for a, b in cuts]

    def pass1():
        return grad_stats(buckets, impl="cuda")

    def pass2(stats, part=slice(None)):
        for b in buckets[part]:
            adamw_clip_apply(b, stats, LR, BETAS, EPS, WD, MAX_NORM, impl="cuda")

    return pass1, pass2, numel * n_tensors


def build_gemms(n: int):
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16) * 0.02

    def chain(part=range(n), y=None):
        y = x if y is None else y
        for i in part:
            y = (y @ w1) if i % 2 == 0 else (y @ w2)
        return y

    return chain, n * 2 * 8192 * 2048 * 8192


def warm_up(fn, seconds: float) -> int:
    """Run ``fn`` until ``seconds`` of wall time have passed with the GPU busy, so that the timed repeats start at
    the power and clocks of a sustained load. Returns the number of calls."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        torch.cuda.synchronize()
        if time.perf_counter() - start >= seconds:
            return calls


def timed(fn, repeats: int, warmup_s: float) -> tuple[list[float], list[str]]:
    warm_up(fn, warmup_s)
    with smi_samples() as samples:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events], samples


def summarize(name: str, times: list[float], samples: list[str]) -> dict:
    mhz, watts = [], []
    for line in samples:
        try:
            c, w = (float(v) for v in line.split(","))
        except ValueError:
            continue
        mhz.append(c)
        watts.append(w)
    ms = statistics.median(times)
    q = statistics.quantiles(times, n=10) if len(times) > 2 else [ms] * 9
    w = statistics.mean(watts) if watts else float("nan")
    row = {"mode": name, "ms": ms, "ms_p10": q[0], "ms_p90": q[-1], "sm_mhz_median": statistics.median(mhz) if mhz
           else None, "watts_mean": w, "joules": w * ms / 1e3, "smi_samples": len(watts)}
    print(f"{name:<12} {ms:8.3f} ms  p10 {q[0]:7.3f}  p90 {q[-1]:7.3f}  {row['sm_mhz_median']} MHz  {w:6.1f} W  "
          f"{row['joules']:6.2f} J", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1.84e9)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--gemms", type=int, default=24)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup-s", type=float, default=3.0,
                        help="seconds of the same load before each mode's timed repeats")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diagnose_overlap needs a CUDA device")
    pass1, pass2, n = build_update(args.params, args.tensors, args.layers)
    chain, flops = build_gemms(args.gemms)
    side = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()

    def update():
        pass2(pass1())

    def sequential():
        update()
        chain()

    def overlapped():
        stats = pass1()
        stats.record_stream(side)  # freed on the main stream while the side one may still read it
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            pass2(stats)
        chain()
        main_stream.wait_stream(side)

    L = args.layers
    update_parts = [slice(i, i + 1) for i in range(L)]
    gemm_parts = [range(i * args.gemms // L, (i + 1) * args.gemms // L) for i in range(L)]
    done = [torch.cuda.Event() for _ in range(L)]

    def layered():
        stats = pass1()
        stats.record_stream(side)
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            for part, event in zip(update_parts, done):
                pass2(stats, part)
                event.record()
        y = None
        for part, event in zip(gemm_parts, done):
            main_stream.wait_event(event)
            y = chain(part, y)
        main_stream.wait_stream(side)

    rows = []
    for name, fn in (("gemm", chain), ("update", update), ("sequential", sequential), ("overlapped", overlapped),
                     ("layered", layered), ("gemm", chain), ("sequential", sequential), ("overlapped", overlapped),
                     ("layered", layered)):
        rows.append(summarize(name, *timed(fn, args.repeats, args.warmup_s)))
    result = {"params": n, "gemm_tflop": flops / 1e12, "gemms": args.gemms, "repeats": args.repeats,
              "warmup_s": args.warmup_s,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    gemm_ms = statistics.median(r["ms"] for r in rows if r["mode"] == "gemm")
    result["gemm_tflops"] = flops / gemm_ms / 1e9
    seq = min(r["ms"] for r in rows if r["mode"] == "sequential")
    ovl = min(r["ms"] for r in rows if r["mode"] == "overlapped")
    lay = min(r["ms"] for r in rows if r["mode"] == "layered")
    result["saving_ms"] = {"overlapped": seq - ovl, "layered": seq - lay}
    print(f"GEMM chain {result['gemm_tflops']:.0f} TFLOP/s; against sequential's {seq:.2f} ms, overlapped saves "
          f"{seq - ovl:.2f} ms, layered {seq - lay:.2f}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "diagnose_overlap.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
