"""AdamW + global-norm clipping on one GPU: ours (FusedAdamWClip, two passes, no host sync) side by side with
torch AdamW(fused=True) + clip_grad_norm_(foreach=True) and DeepSpeed FusedAdam + the same clip, in one run,
against the copy-bandwidth floor measured in the same run (issue 4).

Workloads (1e9 parameters in 200 tensors of 5e6):
  fp32          fp32 params, grads, moments. Floor: 32 B/param (pass 1 reads the grad: 4; pass 2 reads grad,
                param, m, v and writes param, m, v: 28).
  bf16_master   bf16 params and grads, fp32 master weights and moments. Floor: 30 B/param (pass 1: 2; pass 2
                reads grad 2, master, m, v 12, writes master, m, v 12 and the bf16 param 2). The baselines
                step the fp32 masters: grads copied into the masters' .grad (foreach), clip, AdamW, masters
                copied back into the bf16 params (foreach) — the usual mixed-precision recipe.

Every variant steps from the same state with the same random gradients (never zeros); before timing, one
step of each is compared with torch's (max relative error, in the JSON). Timing: benchmarks/harness.py's
Timer (L2 flushed and a GPU head start before each repeat), one optimizer step per call, median of
--repeats. Rows: "ours" = FusedAdamWClip.step() (bucket bookkeeping in Python included), "ours (op)" = the
two passes on prebuilt buckets, "clip only" = clip_grad_norm_(foreach=True) alone. DeepSpeed FusedAdam
JIT-builds; a failed build is recorded in the notes and the run continues.

Expected on one H200 (shared/BENCHMARKS.md anchors): fp32 torch fused + clip 12.3 ms, DeepSpeed FusedAdam +
clip 12.8 ms, clip alone 4.0 ms, floor 7.6 ms; target for ours <= 8.4 ms. Needs ~3 x 16 GB of GPU memory at
the peak (one variant's state at a time plus the shared gradients); a minute or two of GPU time.

Engine rows: the optimizer part of a DeepSpeed ZeRO-2 bf16 engine (one process, Linear(4096, 4096) x 59
= 0.99e9 params): engine.step() between two synchronizes, after an untimed backward, ours
("optimizer": {"type": "LoongForgeAdamW"} through ds_loongforge.optim.initialize) vs stock ("type":
"AdamW": FusedAdam plus DeepSpeed's norm, overflow and clip passes), both with gradient_clipping 1.0. Target
(issue 4): ours >= 1.8x faster. Needs MASTER_ADDR/PORT etc. only if already set differently (defaults: one
local process).

    python benchmarks/bench_optimizer.py [--layouts fp32,bf16_master] [--repeats 50] [--no-engine] [--smoke] [--out DIR]

--smoke runs tiny sizes on the CPU (2 repeats, wall-clock timing) to exercise every code path.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_moe import WallTimer, cpu_environment
from benchmarks.harness import (RESULTS_DIR, Row, Timer, environment, finish_rows, measure_copy_bandwidth,
                                parse_names, write_results)

LR, BETAS, EPS, WD, MAX_NORM = 1e-4, (0.9, 0.95), 1e-8, 0.01, 1.0
GRAD_STD = 1e-4  # global norm ~3 over 1e9 params: every step clips, as in training
BYTES_PER_PARAM = {"fp32": 32, "bf16_master": 30}


class State:
    """One variant's params (and masters), sharing the workload's gradients."""

    def __init__(self, init: list[torch.Tensor], grads: list[torch.Tensor], layout: str):
        self.layout = layout
        if layout == "fp32":
            self.params = [torch.nn.Parameter(t.clone()) for t in init]
            self.masters = None
        else:
            self.params = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
            self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]  # as ours starts them
        for p, g in zip(self.params, grads):
            p.grad = g

    @property
    def stepped(self) -> list[torch.Tensor]:
        """What the baselines' optimizer steps: the params, or the fp32 masters."""
        return self.params if self.masters is None else self.masters


def _baseline_step(state: State, optimizer) -> None:
    if state.masters is not None:
        torch._foreach_copy_([m.grad for m in state.masters], [p.grad for p in state.params])
    torch.nn.utils.clip_grad_norm_(state.stepped, MAX_NORM, foreach=True)
    optimizer.step()
    if state.masters is not None:
        torch._foreach_copy_([p.data for p in state.params], [m.data for m in state.masters])


def _prepare_masters(state: State) -> None:
    if state.masters is not None:
        for m, p in zip(state.masters, state.params):
            m.grad = torch.empty_like(m)


def build_variants(init, grads, layout, device):
    """{name: build() -> (step fn, fp32 values the step updates, or None for the clip-only row)}; torch first,
    so the others are checked against it."""
    from ds_loongforge.ops.adamw import fused_adamw_clip_step
    from ds_loongforge.optim import FusedAdamWClip

    impl = "cuda" if device.type == "cuda" else "cpu"

    def baseline(make_optimizer):
        state = State(init, grads, layout)
        _prepare_masters(state)
        opt = make_optimizer(state.stepped)
        return (lambda: _baseline_step(state, opt)), (lambda: state.stepped)

    def ours():
        state = State(init, grads, layout)
        opt = FusedAdamWClip(state.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_norm=MAX_NORM, impl=impl)
        updated = (lambda: [opt.state[p]["master"] for p in state.params]) if layout != "fp32" else \
            (lambda: state.params)
        return opt.step, updated

    def ours_op():
        state = State(init, grads, layout)
        opt = FusedAdamWClip(state.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_norm=MAX_NORM, impl=impl)
        opt.step()  # creates the optimizer state and its buckets, which the op then steps directly
        # a step drops its buckets' gradients (ae3e54b): take this step's buckets, gradients attached, again
        buckets = [b for i, g in enumerate(opt.param_groups) for b in opt._group_buckets(i, g)]
        hypers = [dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)] * len(buckets)
        return (lambda: fused_adamw_clip_step(buckets, hypers, max_norm=MAX_NORM, impl=impl)), None

    def torch_fused():
        return baseline(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True))

    def deepspeed_fused():
        from deepspeed.ops.adam import FusedAdam

        return baseline(lambda ps: FusedAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=True))

    def clip_only():
        state = State(init, grads, layout)
        _prepare_masters(state)
        return (lambda: torch.nn.utils.clip_grad_norm_(state.stepped, MAX_NORM, foreach=True)), None

    return {"torch AdamW fused + clip": torch_fused, "ours": ours, "ours (op)": ours_op,
            "DeepSpeed FusedAdam + clip": deepspeed_fused, "clip only (torch foreach)": clip_only}


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _max_rel_error(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    scale = max(float(r.detach().float().abs().max()) for r in ref)
    return max(float((a.detach().float() - r.detach().float()).abs().max()) for a, r in zip(ours, ref)) / scale


def run_layout(layout: str, n_tensors: int, numel: int, timer, device, notes: list[str]) -> list[Row]:
    init = [torch.randn(numel, device=device) for _ in range(n_tensors)]
    grads = [GRAD_STD * torch.randn(numel, device=device) for _ in range(n_tensors)]
    if layout != "fp32":
        grads = [g.to(torch.bfloat16) for g in grads]
    params_total = n_tensors * numel
    workload = f"{layout}: {params_total:.3g} params in {n_tensors} tensors"
    rows, reference = [], None
    for name, build in build_variants(init, grads, layout, device).items():
        try:
            step, updated = build()
        except Exception as err:  # DeepSpeed's JIT build of FusedAdam can fail on a bare machine: record, go on
            notes.append(f"{layout} / {name}: not run: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
            traceback.print_exc()
            _free(device)
            continue
        note = ""
        if updated is not None:  # one step from the shared initial state, checked against torch's
            step()
            values = [t.detach().float().clone() for t in updated()]
            if reference is None:
                reference = values
            else:
                note = f"max rel err after 1 step vs torch: {_max_rel_error(values, reference):.1e}"
            del values
        ms, p10, p90 = timer(step)
        bytes_moved = (BYTES_PER_PARAM[layout] if updated is not None or name == "ours (op)"
                       else grads[0].element_size()) * params_total
        rows.append(Row(workload, name, ms, p10, p90, bytes_moved, note=note))
        print(f"{workload:<40} {name:<30} {ms:8.3f} ms  {note}", flush=True)
        del step, updated
        _free(device)
    return rows


def _engine_step_times(config: dict, layers: int, width: int, repeats: int, device) -> list[float]:
    """ms of engine.step() alone (backward done before each, untimed) for a ZeRO-2 engine over a stack of
    Linear layers; CUDA events on the GPU, wall clock on the CPU."""
    import deepspeed

    from ds_loongforge.optim import initialize

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(8, width, device=engine.device, dtype=torch.bfloat16)
    times = []
    for i in range(repeats + 3):
        engine.backward(engine(x).float().square().mean())
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            engine.step()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            engine.step()
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            times.append(elapsed)
    del engine, model
    deepspeed.comm.barrier()
    return sorted(times)


def run_engine(params_target: int, repeats: int, device, notes: list[str]) -> list[Row]:
    """The optimizer part of a DeepSpeed ZeRO-2 bf16 engine step, ours vs stock DeepSpeed (FusedAdam with its
    own norm, overflow check and clip passes). engine.step() is timed with a synchronize before and after,
    so the stock engine's host syncs are inside the time, as they are in training."""
    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    width = 4096 if device.type == "cuda" else 256
    layers = max(1, params_target // (width * width))
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": MAX_NORM,
            "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "steps_per_print": 10**9}
    adam = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}
    stock_params = dict(adam, torch_adam=True) if device.type != "cuda" else adam  # FusedAdam needs CUDA
    variants = {"ours (LoongForgeAdamW)": dict(base, optimizer={"type": "LoongForgeAdamW", "params": adam}),
                "stock DeepSpeed (AdamW)": dict(base, optimizer={"type": "AdamW", "params": stock_params})}
    workload = f"ZeRO-2 bf16 engine.step(), {layers * width * width:.3g} params in {layers} tensors"
    rows = []
    for name, config in variants.items():
        try:
            times = _engine_step_times(config, layers, width, repeats, device)
        except Exception as err:  # e.g. DeepSpeed's FusedAdam JIT build: record it and go on
            notes.append(f"engine / {name}: not run: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
            traceback.print_exc()
            _free(device)
            continue
        ms = times[len(times) // 2]
        rows.append(Row(workload, name, ms, times[len(times) // 10], times[(9 * len(times)) // 10],
                        BYTES_PER_PARAM["bf16_master"] * layers * width * width,
                        note="includes flattening the grad partition, the bf16 copy-back and all-gather"))
        print(f"{workload:<40} {name:<30} {ms:8.3f} ms", flush=True)
        _free(device)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="fp32,bf16_master", help="comma-separated, from fp32, bf16_master")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, 2 repeats, wall-clock timing")
    parser.add_argument("--no-engine", action="store_true", help="skip the DeepSpeed ZeRO-2 engine comparison")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("LF_RESULTS_DIR", RESULTS_DIR)),
                        help="results directory (default: $LF_RESULTS_DIR or benchmarks/results)")
    args = parser.parse_args()
    layouts = parse_names(args.layouts, BYTES_PER_PARAM, "--layouts")

    from ds_loongforge.ops import set_strict_ops

    set_strict_ops(True)  # ours runs its compiled kernels or fails loudly, never the slower reference
    torch.manual_seed(0)
    start = time.time()
    if args.smoke:
        device, n_tensors, numel = torch.device("cpu"), 3, 70_001
        timer, env, ceilings = WallTimer(warmup=1, repeats=2), cpu_environment(), {}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_optimizer.py needs a CUDA GPU; use --smoke on a CPU machine")
        device, n_tensors, numel = torch.device("cuda", 0), 200, 5_000_000
        timer, env = Timer(warmup=5, repeats=args.repeats), environment()
        ceilings = {"copy GB/s": measure_copy_bandwidth(timer)}
        print(f"copy bandwidth: {ceilings['copy GB/s']:.0f} GB/s", flush=True)
    notes: list[str] = []
    rows = []
    for layout in layouts:
        rows += run_layout(layout, n_tensors, numel, timer, device, notes)
    if not args.no_engine:
        rows += run_engine(n_tensors * numel, timer.repeats, device, notes)
    finish_rows(rows, ceilings.get("copy GB/s", float("inf")))
    notes += [
        f"Timing: median of {timer.repeats} repeats, "
        + ("wall clock (CPU smoke run: the numbers mean nothing)." if args.smoke else
           "5 warm-ups, CUDA events around each step, L2 flushed and a ~1 ms GPU head start before each repeat."),
        "Bytes: fp32 32 B/param, bf16_master 30 B/param for every optimizer row (the floor of ours; the baselines "
        "move more); clip only: the gradient bytes read once.",
        f"Hyper-parameters: lr {LR}, betas {BETAS}, eps {EPS}, weight_decay {WD}, max_norm {MAX_NORM}; gradients "
        f"N(0, {GRAD_STD}^2), so every step clips.",
        f"Wall time of this run: {time.time() - start:.0f} s.",
    ]
    os.environ["LF_RESULTS_DIR"] = str(args.out)
    name = f"bench_optimizer{'_smoke' if args.smoke else ''}_{env['commit'][:7]}"
    json_path, md_path = write_results(name, env, ceilings, rows, notes)
    print()
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
