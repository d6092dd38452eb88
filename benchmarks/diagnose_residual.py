"""What fusing the decoder layers' residual adds (fused_kernels.residual_add) saves in the e2e model's forward +
backward, measured side by side on one GPU: device time and energy, with the fusion on and off.

The e2e step runs at the H200's 700 W cap (benchmarks/NOTES.md, "a step that runs at the power cap"), where a
kernel that goes away helps only as far as it saves energy. So both are measured:

1. time: Timer.interleaved, one fwd+bwd of each model per round (the same clocks for both), with a ~100 ms GPU
   head start so the host has queued the whole call;
2. energy: blocks of back-to-back fwd+bwd calls of one model, alternating between the two models, each block's
   energy from NVML's total-energy counter and its time from CUDA events (the GPU kept busy: the host queues
   ahead); J per call and the mean power of each;
3. kernels: one profiled call of each, the add kernels and the kernels whose time differs most.

The two models are launch/train.py's preset with the same weights, LoongForge injected with residual_add on and off
(bf16, fused loss), without DeepSpeed.

    python -m benchmarks.diagnose_residual [--model mixtral] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from benchmarks import diagnose_e2e_levers as levers
from benchmarks.harness import Timer, require_cuda
from ds_loongforge.profiler import nvml_errors


def build(model_name: str, seq_len: int, micro_batch: int):
    """The two models, the same weights (diagnose_e2e_levers.build seeds), and one batch."""
    models = {}
    for name, on in (("fused", True), ("unfused", False)):
        models[name], ids = levers.build(model_name, seq_len, micro_batch, {"residual_add": on})
    return models, ids


def step_fn(model, ids):
    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    return fwd_bwd


def energy(fns: dict, blocks: int, calls: int) -> dict:
    """J and ms per call of each fn: alternating blocks of ``calls`` back-to-back calls, NVML's energy counter
    read around each block (after a synchronize) and CUDA events inside it."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        read_mj = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # noqa: E731
        read_mj()
    except nvml_errors() as err:
        return {"skipped": f"no NVML energy counter here ({type(err).__name__}: {err})"}
    joules: dict[str, list[float]] = defaultdict(list)
    millis: dict[str, list[float]] = defaultdict(list)
    for _ in range(blocks):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            e0 = read_mj()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            joules[name].append((read_mj() - e0) / 1e3 / calls)
            millis[name].append(start.elapsed_time(end) / calls)
    return {name: {"j_per_call": statistics.median(joules[name]), "ms_per_call": statistics.median(millis[name]),
                   "watts": statistics.median(j / (m / 1e3) for j, m in zip(joules[name], millis[name])),
                   "j_per_call_all": [round(j, 3) for j in joules[name]]}
            for name in fns}


def kernels(fn) -> dict:
    """One profiled call: diagnostics.kernel_timeline's summary, with every kernel in its list."""
    from torch.profiler import ProfilerActivity, profile

    from ds_loongforge.diagnostics import kernel_timeline

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return kernel_timeline(prof, iters=1, top=100_000)


def main():
    parser = levers.model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--energy-blocks", type=int, default=6)
    parser.add_argument("--energy-calls", type=int, default=10)
    args = parser.parse_args()
    require_cuda("benchmarks/diagnose_residual.py")
    models, ids = build(args.model, args.seq_len, args.micro_batch)
    fns = {name: step_fn(model, ids) for name, model in models.items()}
    result: dict = {"model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                    "device": torch.cuda.get_device_name(), "torch": torch.__version__}

    timer = Timer(warmup=3, repeats=args.repeats, head_start_cycles=200_000_000)
    result["fwd_bwd_ms"] = timer.interleaved(fns)
    print("fwd+bwd ms (interleaved medians):", json.dumps(result["fwd_bwd_ms"]), flush=True)
    result["energy"] = energy(fns, args.energy_blocks, args.energy_calls)
    print("energy:", json.dumps(result["energy"]), flush=True)

    timelines = {name: kernels(fn) for name, fn in fns.items()}
    profiles = {name: {k["name"]: {"calls": k["calls_per_iter"], "ms": k["ms_per_iter"]} for k in t["top_kernels"]}
                for name, t in timelines.items()}
    fused, unfused = profiles["fused"], profiles["unfused"]
    names = set(fused) | set(unfused)
    diff = sorted(((unfused.get(n, {"ms": 0})["ms"] - fused.get(n, {"ms": 0})["ms"], n) for n in names), reverse=True)
    result["kernels"] = {
        name: {"calls": timelines[name]["kernels_per_iter"], "busy_ms": timelines[name]["busy_ms_per_iter"],
               "add_calls": sum(k["calls"] for n, k in prof.items() if "CUDAFunctor_add" in n)}
        for name, prof in profiles.items()}
    result["kernel_ms_saved_by_fusion"] = [
        {"kernel": n, "unfused": unfused.get(n), "fused": fused.get(n), "saved_ms": round(d, 4)}
        for d, n in diff[:12] + diff[-8:]]
    print("kernels:", json.dumps(result["kernels"]), flush=True)
    for row in result["kernel_ms_saved_by_fusion"]:
        print(f"  {row['saved_ms']:+.4f} ms  {row['kernel']}: unfused {row['unfused']} fused {row['fused']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"diagnose_residual_{args.model}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
