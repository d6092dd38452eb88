"""Two device-side levers for the e2e step (issue 5), each measured before either is built. The step is the
GPU's now (NOTES: "a step that is now the GPU's"), so only device time counts:

1. overlap: the fused optimizer step (memory-bound, 13.8 ms of the mixtral step) on a side stream while the next
   forward's GEMMs run. Does the H200 run the two concurrently (both take about the longer one) or one after the
   other (about the sum)? Measured whole (one step beside one forward) and layered (one optimizer per decoder
   layer, in forward order on the side stream, each layer's forward waiting on its own update's event).
2. graph: the injected model's forward + backward captured in one CUDA graph and replayed, next to eager with
   the host far ahead: what the ~1200 launches and the gaps between them cost.
3. graph_kernels: why the replay of 2. is slower than eager (8.8 ms at 5325e3c): one eager fwd+bwd and one replay
   under torch.profiler, their kernels' device time summed per name, and the names whose time differs most (a
   kernel only one of them runs shows as all of its time), and how SDPA was called in each (mask, GQA, causal).
4. sdpa_graph: the attention alone, as eager calls it, eager against a graph of it, with its kernels.
5. skip_swiglu: fwd+bwd with the MoE layers' SwiGLU kernels gone (outputs replayed from a real call), against the
   real fwd+bwd round by round: the most a SwiGLU fused into the expert GEMMs' epilogues could save at the power
   cap.

The model is launch/train.py's preset with LoongForge injected (bf16, fused loss), without DeepSpeed; the timings
are device times (benchmarks/harness.Timer with a head start long enough for the host to queue a whole step).

    python -m benchmarks.diagnose_e2e_levers [--model mixtral] [--levers overlap,graph,graph_kernels] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.diagnose_moe import captured as captured_fn
from benchmarks.diagnose_moe import graph_vs_eager
from benchmarks.harness import Timer, require_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))


def build(model_name: str, seq_len: int, micro_batch: int, fused_kernels: dict | None = None):
    """The injected bf16 model (the same weights on every call: seeded) and a batch of token ids; ``fused_kernels``
    overrides switches of the bench's LoongForge block."""
    import bench_e2e
    import train

    from ds_loongforge.integrations.inject import inject

    torch.manual_seed(0)
    model = train.build_model(model_name, 32000, seq_len)
    config = bench_e2e.make_ds_config(True, micro_batch, "text")
    config["loongforge"].setdefault("fused_kernels", {}).update(fused_kernels or {})
    inject(model, config)
    model = model.to(device="cuda", dtype=torch.bfloat16).train()
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), device="cuda")
    return model, ids


def model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The e2e model and timing options the diagnoses of this model share."""
    parser.add_argument("--model", default="mixtral")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def overlap(model, ids, timer) -> dict:
    from ds_loongforge.optim import FusedAdamWClip

    params = [p for p in model.parameters() if p.requires_grad]
    model(input_ids=ids, labels=ids).loss.backward()
    whole = FusedAdamWClip(params, lr=1e-4, weight_decay=0.01, max_norm=1.0)
    whole.step()
    decoder = model.model.layers
    groups = [list(model.model.embed_tokens.parameters())] + [list(layer.parameters()) for layer in decoder]
    seen = {id(p) for g in groups for p in g}
    groups.append([p for p in params if id(p) not in seen])  # final norm, lm_head
    layered = [FusedAdamWClip(g, lr=1e-4, weight_decay=0.01, max_norm=1.0) for g in groups]
    for opt in layered:
        opt.step()

    def forward():
        return model(input_ids=ids, labels=ids).loss

    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def both_whole():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            whole.step()
        forward()
        main.wait_stream(side)

    modules = [model.model.embed_tokens, *decoder, model.lm_head]
    events = [torch.cuda.Event() for _ in modules]
    handles = [m.register_forward_pre_hook(lambda _m, _a, e=e: main.wait_event(e)) for m, e in zip(modules, events)]

    def both_layered():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for opt, event in zip(layered, events):
                opt.step()
                event.record(side)
        forward()
        main.wait_stream(side)

    # the hooks wait on recorded events only inside both_layered; outside it they wait on events already passed
    result = {"forward_ms": timer(forward)[0], "step_ms": timer(whole.step)[0],
              "layered_steps_ms": timer(lambda: [opt.step() for opt in layered])[0]}
    result["concurrent_whole_ms"] = timer(both_whole)[0]
    result["concurrent_layered_ms"] = timer(both_layered)[0]
    for h in handles:
        h.remove()
    result["sum_ms"] = result["forward_ms"] + result["step_ms"]
    result["saved_whole_ms"] = result["sum_ms"] - result["concurrent_whole_ms"]
    result["saved_layered_ms"] = result["sum_ms"] - result["concurrent_layered_ms"]
    del whole, layered
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return result


def graph(model, ids, timer) -> dict:
    def fwd_bwd():
        model(input_ids=ids, labels=ids).loss.backward()

    # eager minus graph: what the launches and the gaps between kernels cost (called between_kernels_ms in the
    # 5325e3c results)
    return graph_vs_eager(fwd_bwd, timer)


def sdpa_graph(model, ids, timer) -> dict:
    """The model's attention alone (its SDPA call as eager hands it over: causal, GQA, no mask), fwd+bwd, eager
    against a CUDA graph of it, with the kernels of each: whether the slower attention in a captured step is
    torch's SDPA under capture or what transformers hands it there."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    batch, seq = ids.shape
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
        out.backward(grad)

    (eager, _), (replay, _), graph = _eager_and_replay_kernels(fwd_bwd, 3)
    result = {"eager_ms": timer(fwd_bwd)[0], "graph_ms": timer(graph.replay)[0]}
    result["eager_kernels_ms"] = {n[:120]: round(t, 4) for n, t in sorted(eager.items(), key=lambda x: -x[1])[:8]}
    result["replay_kernels_ms"] = {n[:120]: round(t, 4) for n, t in sorted(replay.items(), key=lambda x: -x[1])[:8]}
    return result


def _eager_and_replay_kernels(fn, iters: int):
    """(_kernel_ms of ``fn`` eager, _kernel_ms of its CUDA graph's replay, the graph), each after warm-up."""
    for _ in range(3):
        fn()
    eager = _kernel_ms(fn, iters)
    graph = captured_fn(fn)
    graph.replay()
    return eager, _kernel_ms(graph.replay, iters), graph


def _kernel_ms(run, iters: int) -> tuple[dict[str, float], int]:
    """({kernel, copy or fill name: device ms per call}, device events per call) of ``iters`` calls of ``run``."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    count = 0
    for event in prof.events():
        if (event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0
                and not getattr(event, "is_user_annotation", False)):
            per_name[event.name] = per_name.get(event.name, 0.0) + event.device_time_total / 1e3 / iters
            count += 1
    return per_name, count // iters


class _SdpaCalls:
    """Records how F.scaled_dot_product_attention is called (mask or none, is_causal, enable_gqa, q/k heads), and
    whether a stream was capturing then: what transformers' attention hands SDPA eager and under capture."""

    def __init__(self):
        self.seen: dict[str, int] = {}
        self._original = torch.nn.functional.scaled_dot_product_attention

    def __enter__(self):
        def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
            mask = "none" if attn_mask is None else f"{attn_mask.dtype} {tuple(attn_mask.shape)}"
            key_ = (f"capturing={torch.cuda.is_current_stream_capturing()} mask={mask} "
                    f"is_causal={kwargs.get('is_causal')} enable_gqa={kwargs.get('enable_gqa')} "
                    f"q_heads={query.shape[1]} k_heads={key.shape[1]}")
            self.seen[key_] = self.seen.get(key_, 0) + 1
            return self._original(query, key, value, attn_mask, *args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._original


def graph_kernels(model, ids, timer, iters: int = 3, top: int = 25) -> dict:
    def fwd_bwd():
        model(input_ids=ids, labels=ids).loss.backward()

    with _SdpaCalls() as calls:  # how attention is called eager and while the graph is captured
        (eager, eager_count), (replay, replay_count), graph = _eager_and_replay_kernels(fwd_bwd, iters)
    names = set(eager) | set(replay)
    diff = sorted(((replay.get(n, 0.0) - eager.get(n, 0.0), n) for n in names), key=lambda d: -abs(d[0]))
    return {"sdpa_calls": calls.seen, "eager_ms": timer(fwd_bwd)[0], "replay_ms": timer(graph.replay)[0],
            "eager_kernel_sum_ms": sum(eager.values()), "replay_kernel_sum_ms": sum(replay.values()),
            "eager_kernels": eager_count, "replay_kernels": replay_count,
            "largest_differences": [{"kernel": n[:160], "eager_ms": round(eager.get(n, 0.0), 4),
                                     "replay_ms": round(replay.get(n, 0.0), 4), "replay_minus_eager_ms": round(d, 4)}
                                    for d, n in diff[:top]]}


def skip_swiglu(model, ids, timer, rounds: int = 30) -> dict:
    """The upper bound of the lever left inside the expert GEMMs: SwiGLU in the gate_up GEMM's epilogue (and its
    backward in the down GEMM's input-gradient epilogue) would save at most the SwiGLU kernels' own device time
    and energy. The same fwd+bwd with every MoE layer's SwiGLU kernels gone, their outputs and input gradients
    replayed from a real call (real values of the same shape, so the GEMMs downstream see real data and draw real
    power), timed round by round against the real step at the same clocks. Timings only: the replayed step's
    numbers are not the model's."""
    import statistics

    import ds_loongforge.modules.moe as moe

    real = moe.swiglu_dropout
    recorded: dict[str, torch.Tensor] = {}

    def recording(gate_up, *args, **kwargs):
        out = real(gate_up, *args, **kwargs)
        if "out" not in recorded and gate_up.requires_grad:
            recorded["out"] = out.detach().clone()
            gate_up.register_hook(lambda g: recorded.setdefault("grad", g.detach().clone()))
        return out

    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate_up):
            return recorded["out"].detach()  # an alias: no kernel

        @staticmethod
        def backward(ctx, dout):
            return recorded["grad"].detach()

    replays = [0]

    def replayed(gate_up, *args, **kwargs):
        if gate_up.shape != recorded["grad"].shape:  # another row count (expert parallelism): the real kernel
            return real(gate_up, *args, **kwargs)
        replays[0] += 1
        return Replayed.apply(gate_up)

    def step(fn):
        def run():
            moe.swiglu_dropout = fn
            try:
                model(input_ids=ids, labels=ids).loss.backward()
            finally:
                moe.swiglu_dropout = real
        return run

    step(recording)()
    if "out" not in recorded or "grad" not in recorded:
        raise RuntimeError("skip_swiglu: no MoE layer called swiglu_dropout with a gradient (is this an MoE model "
                           "injected with ExpertMaskedMoE?)")
    step(replayed)()
    per_step = replays[0]
    saved = timer.repeats
    timer.repeats = rounds
    try:
        times = timer.interleaved_times({"real": step(real), "skipped": step(replayed)})
    finally:
        timer.repeats = saved
    diffs = sorted(r - s for r, s in zip(times["real"], times["skipped"]))
    real_ms, skipped_ms = statistics.median(times["real"]), statistics.median(times["skipped"])
    kernels, _ = _kernel_ms(step(real), 3)
    swiglu = {n[:120]: round(t, 4) for n, t in kernels.items() if "swiglu" in n}
    return {"swiglu_calls_replayed_per_step": per_step, "rounds": rounds,
            "real_fwd_bwd_ms": real_ms, "skipped_fwd_bwd_ms": skipped_ms,
            "saved_ms_median_of_paired": statistics.median(diffs), "saved_ms_p10_p90": [diffs[len(diffs) // 10],
                                                                                      diffs[(9 * len(diffs)) // 10]],
            "saved_share": (real_ms - skipped_ms) / real_ms,
            "swiglu_kernels_ms_per_step_real": swiglu, "swiglu_kernels_sum_ms": round(sum(swiglu.values()), 4)}


LEVERS = {"overlap": overlap, "graph": graph, "graph_kernels": graph_kernels, "sdpa_graph": sdpa_graph,
          "skip_swiglu": skip_swiglu}


def main():
    parser = model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--levers", default="overlap,graph", help=f"comma-separated, of {sorted(LEVERS)}")
    args = parser.parse_args()
    require_cuda("benchmarks/diagnose_e2e_levers.py")
    levers = args.levers.split(",")
    unknown = sorted(set(levers) - set(LEVERS))
    if unknown:
        parser.error(f"--levers: unknown {unknown}; choose from {sorted(LEVERS)}")
    model, ids = build(args.model, args.seq_len, args.micro_batch)
    # ~100 ms of head start (at ~2 GHz): the host queues a whole step before the GPU reaches the start event
    timer = Timer(warmup=3, repeats=args.repeats, head_start_cycles=200_000_000)
    result = {"model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch}
    for name in levers:
        fn = LEVERS[name]
        try:
            result[name] = fn(model, ids, timer)
        except Exception as err:  # one lever's failure still reports the other
            result[name] = f"failed: {type(err).__name__}: {str(err)[:400]}"
        print(name, json.dumps(result[name], indent=1), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"diagnose_e2e_levers_{args.model}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
