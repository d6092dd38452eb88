"""Where a GPU step's time and memory go: summaries of a ``torch.profiler`` run and of a CUDA memory history.

Used by ``launch/train.py --kernel-profile / --memory-snapshot`` and ``benchmarks/diagnose_moe.py``; the
summaries are plain dicts (JSON), small enough to keep next to a benchmark's numbers.

- :func:`kernel_timeline`: GPU busy time, span and the gaps between kernels (with the host ops running during
  each gap), time per kernel category (GEMM, attention, our fused ops, optimizer, copies, elementwise,
  reductions, communication), time per annotated range (``torch.profiler.record_function`` names, e.g. the
  training loop's ``forward`` / ``loss`` / ``backward`` / ``step``) split by category, and the top kernels.
- :func:`trace_gaps`: the longest GPU idle gaps of an exported chrome trace, each with when the host launched the
  work after it and what the host threads were doing meanwhile (host-bound issue vs a wait on the device).
- :func:`memory_at_peak`: replays a ``torch.cuda.memory._snapshot()`` trace to the moment the allocated bytes
  peaked and groups the blocks alive then by the first source line outside torch that allocated them.
- :class:`HostSyncRecorder`: every operation inside its block that makes the host wait for the device (a CUDA
  tensor's ``item()`` / ``tolist()`` / ``bool()``, ``nonzero``, a copy to pageable host memory, a synchronize),
  counted by the source lines outside torch that called it. One such wait per step empties the GPU's queue, and
  the host must then launch the rest of the step ahead of the GPU again: the GPU idles wherever the host is the
  slower of the two (a forward of many small kernels).
"""

from __future__ import annotations

import functools
import os
import re
import traceback
import warnings
from collections import Counter, defaultdict
from typing import Any, Iterable

# first match wins; names are lower-cased kernel names as the CUDA profiler reports them
KERNEL_CATEGORIES: tuple[tuple[str, re.Pattern], ...] = (
    ("communication", re.compile(r"nccl|all_?to_?all|allreduce|gloo")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*mha")),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|wgmma|sm90_|sm80_|cublas|grouped_mm|matmul")),
    ("loongforge", re.compile(r"rmsnorm|swiglu|permute|unpermute|sumsq|adamw|bump_steps|lf_|moe_")),
    ("optimizer", re.compile(r"multi_tensor|adam|lamb_|fused_optim")),  # not "lamb": lambda functors
    ("copy", re.compile(r"memcpy|memset|copy|cat_|catarray|index_put|scatter|gather|fill")),
    ("reduction", re.compile(r"reduce|softmax|norm|argmax|topk|sort|cumsum|scan|sum_")),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton")),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, pattern in KERNEL_CATEGORIES:
        if pattern.search(lowered):
            return category
    return "other"


def _intervals_overlap(start: float, end: float, ranges: list[tuple[float, float, str]]) -> str | None:
    """The innermost annotation holding the kernel's midpoint (ranges sorted by start; nested ranges are
    shorter, so the last containing one wins)."""
    mid, found = (start + end) / 2, None
    for a, b, name in ranges:
        if a > mid:
            break
        if a <= mid <= b:
            found = name
    return found


def kernel_timeline(prof, iters: int = 1, top: int = 30, gap_threshold_us: float = 5.0,
                    annotations: Iterable[str] | None = None) -> dict[str, Any]:
    """Summarise the CUDA kernels of a finished ``torch.profiler.profile`` that ran ``iters`` iterations:
    per-iteration milliseconds throughout. ``annotations``: the ``record_function`` names whose GPU ranges
    (the profiler's ``gpu_user_annotation`` events) split the time; by default every such name seen. A range's GPU
    span covers the kernels its own thread launched: the backward's, which autograd's device thread launches while
    the main thread waits in its "backward" range, fall outside every range and are counted under "(none)".
    Kernels whose launch call the profile did not record (work queued before it began) are left out of the
    counts, busy time and span (``kernels_launched_before_window``), but not of the gap scan: they kept the GPU
    busy."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    wanted = set(annotations) if annotations is not None else None
    # kineto reports record_function ranges on the GPU timeline as user-annotation events of the range's name
    annotated = [e for e in device if getattr(e, "is_user_annotation", False)]
    ranges = [(e.time_range.start, e.time_range.end, e.name) for e in annotated
              if wanted is None or e.name in wanted]
    recorded = sorted((e for e in device if not getattr(e, "is_user_annotation", False)),
                      key=lambda e: e.time_range.start)
    kernels, before = _launched_in_window(recorded, events)
    dropped = None if before is None else len(before)
    ranges.sort()
    if not kernels:
        return {"iters": iters, "kernels_per_iter": 0}
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    busy = _union_length([(k.time_range.start, k.time_range.end) for k in kernels])
    # the window's GPU time starts where the work launched before it ends (a side stream's copy may start
    # earlier, beside that tail); the gaps are looked for among all recorded kernels, the tail included
    start = max([kernels[0].time_range.start] + [k.time_range.end for k in before or []])
    span = max(k.time_range.end for k in kernels) - start
    gaps = []
    frontier = recorded[0].time_range.end
    previous = recorded[0]
    for k in recorded[1:]:
        gap = k.time_range.start - frontier
        if gap > gap_threshold_us:
            during = sorted({c.name for c in cpu_ops
                             if c.time_range.start < k.time_range.start and c.time_range.end > frontier})
            gaps.append((gap, previous.name[:70], k.name[:70], during[:6]))
        if k.time_range.end > frontier:
            frontier, previous = k.time_range.end, k
    gaps.sort(key=lambda g: -g[0])
    host = _host_ranges(events, annotated, wanted, iters)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_category: dict[str, float] = defaultdict(float)
    by_range: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for k in kernels:
        duration = (k.time_range.end - k.time_range.start) / iters / 1e3
        category = kernel_category(k.name)
        entry = by_name[k.name[:100]]
        entry[0] += duration
        entry[1] += 1 / iters
        by_category[category] += duration
        where = _intervals_overlap(k.time_range.start, k.time_range.end, ranges) or "(none)"
        by_range[where][category] += duration
    ms = lambda value: round(value, 3)  # noqa: E731
    return {
        "iters": iters,
        "kernels_per_iter": len(kernels) / iters,
        "kernels_launched_before_window": dropped,
        "busy_ms_per_iter": ms(busy / iters / 1e3),
        "span_ms_per_iter": ms(span / iters / 1e3),
        "gap_ms_per_iter_over_threshold": ms(sum(g[0] for g in gaps) / iters / 1e3),
        "gap_threshold_us": gap_threshold_us,
        "category_ms_per_iter": {c: ms(t) for c, t in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "range_category_ms_per_iter": {r: {"total": ms(sum(cats.values())),
                                           **{c: ms(t) for c, t in sorted(cats.items(), key=lambda kv: -kv[1])}}
                                       for r, cats in by_range.items()},
        "top_kernels": [{"name": n, "ms_per_iter": ms(t), "calls_per_iter": round(c, 2), "category":
                         kernel_category(n)}
                        for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        "top_gaps_us": [{"gap_us": round(g[0], 1), "after": g[1], "before": g[2], "cpu_ops_during": g[3]}
                        for g in gaps[:top]],
        "host_ranges": host,
    }


_CUDA_API = re.compile(r"cu(da)?[A-Z]")  # runtime / driver calls: cudaLaunchKernel, cuLaunchKernelEx, cudaMemsetAsync


def _launched_in_window(kernels: list, events: list) -> tuple[list, list | None]:
    """The device activities whose launch (the CUDA API call of the same correlation id) was recorded, and those
    whose launch was not. With the host ahead of the GPU, a profile that starts mid-run (after a dropped warm-up step,
    say) also records the GPU finishing work launched before it began: counted, that tail of the step before
    would add to the first step's time (the optimizer's kernel counted 4 times in 3 steps on the H200 at
    3c36a9d). None, all kept: no launch was recorded (no CUDA API events in this profile), or none pairs with
    a kernel."""
    from torch.autograd import DeviceType

    launched = {e.id for e in events if e.device_type == DeviceType.CPU and _CUDA_API.match(e.name)}
    if not launched:
        return kernels, None
    kept = [k for k in kernels if getattr(k, "id", None) in launched]
    if not kept:  # ids that do not pair kernels with launches (another profiler version): keep them all
        return kernels, None
    return kept, [k for k in kernels if getattr(k, "id", None) not in launched]


def _host_ranges(events, annotated, wanted, iters: int) -> dict[str, dict[str, float]]:
    """Per annotated range: the host's time inside it (``host_ms_per_iter``: how long the Python thread took to
    issue that part of the step) and how far the host ran ahead of the GPU when the range began
    (``host_lead_ms``: the GPU range's start minus the host range's, averaged). A lead near 0 at the forward
    means the GPU's queue was empty when the host got there: the step is bound by the host, not the kernels."""
    from torch.autograd import DeviceType

    names = {e.name for e in annotated if wanted is None or e.name in wanted}
    host: dict[str, list] = defaultdict(list)
    for e in events:
        if e.device_type == DeviceType.CPU and e.name in names:
            host[e.name].append(e.time_range)
    gpu: dict[str, list] = defaultdict(list)
    for e in annotated:
        if e.name in names:
            gpu[e.name].append(e.time_range)
    out = {}
    for name, spans in sorted(host.items()):
        spans.sort(key=lambda r: r.start)
        on_gpu = sorted(gpu.get(name, []), key=lambda r: r.start)
        entry = {"host_ms_per_iter": round(sum(r.end - r.start for r in spans) / iters / 1e3, 3)}
        if len(on_gpu) == len(spans):
            entry["host_lead_ms"] = round(sum(g.start - h.start for g, h in zip(on_gpu, spans)) / len(spans) / 1e3, 3)
        out[name] = entry
    return out


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def trace_gaps(trace: dict[str, Any], top: int = 5, threshold_us: float = 50.0,
               host_min_us: float = 20.0) -> list[dict[str, Any]]:
    """Why the GPU idled: the ``top`` longest gaps between device activities of a chrome trace exported by
    ``torch.profiler`` (``prof.export_chrome_trace``), each with the host side of it.

    Per gap: its length and the activities either side; ``launch_after_gap_start_us``: when the host called the
    launch of the activity after the gap, from the gap's start (its kineto correlation id). Positive and close
    to the gap's length: the host issued it late, the GPU waited for the host. Negative (launched before the GPU
    went idle): the GPU waited on something else, a stream or event wait. ``launch_stack``: the host ops open on
    the launching thread at that call, outermost first. ``host``: the host ops and CUDA API calls of at least
    ``host_min_us`` that overlap the gap on any thread (thread id, start from the gap's start, duration), which
    show what the host was doing instead: a slow op, a ``cudaFree`` / ``cudaMalloc`` (the caching allocator
    going to the driver, which waits for the device), a synchronize."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = sorted((e for e in events if e.get("cat") in _DEVICE_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    # work launched before the recording began (no launch here) still occupied the GPU: it stays in the scan
    if len(device) < 2:
        return []
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", *_LAUNCH_CATS)]
    gaps = []
    frontier, previous = device[0]["ts"] + device[0]["dur"], device[0]
    for e in device[1:]:
        if e["ts"] - frontier > threshold_us:
            gaps.append((e["ts"] - frontier, frontier, previous, e))
        if e["ts"] + e["dur"] > frontier:
            frontier, previous = e["ts"] + e["dur"], e
    gaps.sort(key=lambda g: -g[0])
    out = []
    for length, start, before, after in gaps[:top]:
        entry: dict[str, Any] = {"gap_us": round(length, 1), "after": before["name"][:80],
                                 "before": after["name"][:80]}
        launch = launches.get(after.get("args", {}).get("correlation"))
        if launch is not None:
            entry["launch_after_gap_start_us"] = round(launch["ts"] - start, 1)
            entry["launch_stack"] = [o["name"][:80] for o in sorted(
                (o for o in host if o.get("cat") in ("cpu_op", "user_annotation")
                 and o.get("tid") == launch.get("tid") and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]),
                key=lambda o: (o["ts"], -o["dur"]))]
        entry["host"] = [{"tid": o.get("tid"), "name": o["name"][:80], "start_us": round(o["ts"] - start, 1),
                          "dur_us": round(o["dur"], 1)}
                         for o in sorted(host, key=lambda o: o["ts"])
                         if o["dur"] >= host_min_us and o["ts"] < start + length and o["ts"] + o["dur"] > start][:60]
        out.append(entry)
    return out


def format_trace_gaps(gaps: list[dict[str, Any]]) -> str:
    lines = []
    for g in gaps:
        lag = g.get("launch_after_gap_start_us")
        lines.append(f"{g['gap_us']:9.1f} us idle after {g['after']} before {g['before']}"
                     + (f"; its launch {lag:+.1f} us from the gap's start in {' > '.join(g['launch_stack'][-4:])}"
                        if lag is not None else ""))
        lines += [f"    tid {h['tid']}: {h['start_us']:+9.1f} us {h['dur_us']:9.1f} us  {h['name']}" for h in g["host"]]
    return "\n".join(lines)


def format_host_ranges(host: dict[str, dict[str, float]], digits: int = 2) -> str:
    """``kernel_timeline``'s host_ranges as one line: 'forward 35.68 (lead 5.43), step 4.84 (lead 0.76)'."""
    return ", ".join(f"{name} {v['host_ms_per_iter']:.{digits}f}"
                     + (f" (lead {v['host_lead_ms']:.{digits}f})" if "host_lead_ms" in v else "")
                     for name, v in host.items())


def annotate_modules(groups: dict[str, Iterable[Any]]) -> list[Any]:
    """Profiler ranges around the forward of modules: ``groups`` maps a range name to the modules whose every
    forward runs inside ``record_function(name)``, so that ``kernel_timeline`` splits the forward's kernels
    (innermost range wins) and the host's time by part of the model (e.g. "attention", "moe"). Returns the hook
    handles; ``handle.remove()`` each to take the ranges off again."""
    import torch

    handles = []
    for name, modules in groups.items():
        def enter(module, args, name=name):
            ranges = module.__dict__.setdefault("_loongforge_ranges", [])
            ranges.append(torch.profiler.record_function(name).__enter__())

        def leave(module, args, output):
            module.__dict__["_loongforge_ranges"].pop().__exit__(None, None, None)

        for module in modules:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    return handles


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def format_kernel_timeline(t: dict[str, Any], top: int = 25) -> str:
    if not t.get("kernels_per_iter"):
        return "no CUDA kernels recorded"
    lines = [f"{t['kernels_per_iter']:.0f} kernels/iter, busy {t['busy_ms_per_iter']:.2f} ms, span "
             f"{t['span_ms_per_iter']:.2f} ms, gaps over {t['gap_threshold_us']:g} us "
             f"{t['gap_ms_per_iter_over_threshold']:.2f} ms"
             + (f" ({t['kernels_launched_before_window']} launched before the window left out)"
                if t.get("kernels_launched_before_window") else ""),
             "by category (ms/iter): " + ", ".join(f"{c} {v:.2f}" for c, v in t["category_ms_per_iter"].items())]
    for r, cats in t["range_category_ms_per_iter"].items():
        lines.append(f"  {r}: " + ", ".join(f"{c} {v:.2f}" for c, v in cats.items()))
    if t.get("host_ranges"):
        lines.append("host (ms/iter issuing each range; how far it ran ahead of the GPU at the range's start): " +
                     format_host_ranges(t["host_ranges"]))
    lines.append("top kernels (ms/iter, calls/iter):")
    lines += [f"  {k['ms_per_iter']:8.3f} {k['calls_per_iter']:7.1f}  [{k['category']}] {k['name']}"
              for k in t["top_kernels"][:top]]
    lines.append("largest gaps:")
    lines += [f"  {g['gap_us']:8.1f} us after {g['after']} before {g['before']} cpu: {g['cpu_ops_during']}"
              for g in t["top_gaps_us"][:10]]
    return "\n".join(lines)


_TORCH_PACKAGE = re.compile(r"[/\\](site|dist)-packages[/\\]torch[/\\]")


@functools.lru_cache(maxsize=4096)  # a memory replay asks once per frame of every allocation, of few files
def _is_torch_frame(filename: str) -> bool:
    """torch's own code: a Python file of the torch package (installed anywhere: by its site-packages path, not
    by a bare "torch" directory, which an environment's own path may hold, e.g. /opt/torch/.venv/...), or a
    C++ frame (a memory snapshot's frames include them)."""
    import torch

    return (filename.startswith(os.path.dirname(torch.__file__) + os.sep) or bool(_TORCH_PACKAGE.search(filename))
            or not filename.endswith(".py"))


def _frame_key(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch (and outside this module), with the innermost torch function that
    allocated: 'transformers/models/mixtral/modeling_mixtral.py:123 forward <- linear'."""
    inner = None
    for frame in frames:
        filename = frame.get("filename", "")
        name = frame.get("name", "")
        if _is_torch_frame(filename):
            if inner is None and name and not name.startswith("_") and filename.endswith(".py"):
                inner = name  # the innermost torch Python function (C++ frames' names are too deep to help)
            continue
        if filename == __file__:
            continue
        short = "/".join(filename.split("/")[-3:])
        return f"{short}:{frame.get('line', '?')} {name}" + (f" <- {inner}" if inner else "")
    return f"(torch internal{': ' + inner if inner else ''})"


def memory_at_peak(snapshot: dict[str, Any], device: int = 0, baseline_bytes: int = 0,
                   top: int = 25) -> dict[str, Any]:
    """Replay the allocation trace of ``torch.cuda.memory._snapshot()`` (recorded with
    ``_record_memory_history``) to its peak. ``baseline_bytes``: what was allocated when recording started
    (those blocks are not in the trace; freeing one lowers the running total). Frees count when requested, as
    ``memory_allocated`` does."""
    traces = snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    untracked_frees = 0
    for event in trace:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            live[addr] = (size, _frame_key(event.get("frames", [])))
            current += size
            if current > peak:
                peak, peak_live = current, dict(live)
        elif action == "free_requested":
            if addr in live:
                current -= live.pop(addr)[0]
            else:  # allocated before the recording started: the baseline shrinks
                untracked_frees += size
                current -= size
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, key in peak_live.values():
        groups[key][0] += size
        groups[key][1] += 1
    gib = lambda b: round(b / 2**30, 4)  # noqa: E731
    return {
        "baseline_gib": gib(baseline_bytes),
        "peak_above_baseline_gib": gib(peak),
        "peak_gib": gib(baseline_bytes + peak),
        "baseline_freed_before_end_gib": gib(untracked_frees),
        "events": len(trace),
        "live_at_peak": [{"where": key, "gib": gib(b), "blocks": n}
                         for key, (b, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def format_memory_at_peak(m: dict[str, Any]) -> str:
    lines = [f"peak {m['peak_gib']:.2f} GiB = baseline {m['baseline_gib']:.2f} + {m['peak_above_baseline_gib']:.2f} "
             f"allocated in the recorded window ({m['events']} events)"]
    lines += [f"  {e['gib']:8.3f} GiB {e['blocks']:5d} blocks  {e['where']}" for e in m["live_at_peak"]]
    return "\n".join(lines)


_SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda's text in sync debug mode "warn"


def _sync_site(stack: list[traceback.FrameSummary], depth: int = 3) -> str:
    """The innermost frame (in brackets when it is torch's own code) and the ``depth`` innermost frames outside
    torch's package and this module, innermost first."""
    ours = (__file__, warnings.__file__)
    frames = [f for f in reversed(stack) if f.filename not in ours]
    short = lambda f: f"{'/'.join(f.filename.split('/')[-3:])}:{f.lineno} {f.name}"  # noqa: E731
    outside = [f for f in frames if not _is_torch_frame(f.filename)]
    inner = f"[{short(frames[0])}] " if frames and _is_torch_frame(frames[0].filename) else ""
    if not outside:
        return inner + "(torch internal)"
    return inner + " <- ".join(short(f) for f in outside[:depth])


class HostSyncRecorder:
    """Record the host-device synchronizations inside a ``with`` block (module doc): torch's CUDA sync debug
    mode warns at each one, and the warning's Python stack names the caller. Other warnings pass through.

        with HostSyncRecorder() as syncs:
            train_step()
        syncs.summary()  # {"count": 2, "sites": [{"where": "modeling_x.py:12 forward <- ...", "count": 2}]}

    Explicit waits (``torch.cuda.synchronize()``, ``Stream.synchronize()``, ``Event.synchronize()``, e.g.
    DeepSpeed's synchronized throughput timer) are counted too, through wrappers installed for the block: torch's
    mode does not report all of them. Off CUDA the mode does nothing and only the wrappers count."""

    _EXPLICIT = (None, "Stream", "Event")  # torch.cuda.synchronize, torch.cuda.<owner>.synchronize

    def __init__(self, depth: int = 3):
        self.depth = depth
        self.sites: Counter[str] = Counter()
        self._inside_explicit = False

    def __enter__(self) -> "HostSyncRecorder":
        import torch

        self._torch = torch
        self.active = torch.cuda.is_available()  # the mode needs CUDA initialised; elsewhere nothing syncs
        self._previous_mode = torch.cuda.get_sync_debug_mode() if self.active else None
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=_SYNC_WARNING)
        self._show = warnings.showwarning
        warnings.showwarning = self._on_warning
        self._patched = []
        for owner in self._EXPLICIT:
            target = torch.cuda if owner is None else getattr(torch.cuda, owner)
            self._patched.append((target, target.synchronize))
            target.synchronize = self._explicit(target.synchronize)
        if self.active:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            self._torch.cuda.set_sync_debug_mode(self._previous_mode)
        for target, original in reversed(self._patched):
            target.synchronize = original
        self._catch.__exit__(*exc)

    def _explicit(self, original):
        def synchronize(*args, **kwargs):
            self.sites[_sync_site(traceback.extract_stack()[:-1], self.depth)] += 1
            self._inside_explicit = True  # torch's own warning for this wait (if any) is not counted twice
            try:
                return original(*args, **kwargs)
            finally:
                self._inside_explicit = False
        return synchronize

    def _on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if _SYNC_WARNING in str(message):
            if not self._inside_explicit:
                self.sites[_sync_site(traceback.extract_stack()[:-1], self.depth)] += 1
        else:
            self._show(message, category, filename, lineno, file, line)

    def summary(self) -> dict[str, Any]:
        return {"cuda": self.active, "count": sum(self.sites.values()),
                "sites": [{"where": where, "count": n} for where, n in self.sites.most_common()]}


__all__ = ["KERNEL_CATEGORIES", "kernel_category", "kernel_timeline", "format_kernel_timeline", "memory_at_peak",
           "format_memory_at_peak", "HostSyncRecorder", "format_host_ranges", "annotate_modules"]
