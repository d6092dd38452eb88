"""Where the host's Python spends a training step: a summary of a py-spy raw recording (collapsed stacks).

    py-spy record --nonblocking -r 500 --threads --idle -f raw -o spy.txt -- python launch/train.py ...
    python benchmarks/pyspy_summary.py spy.txt --anchor "_Session._wrap_forward" --host-ms 27.5

(benchmarks/run_gpu.sh's ``pyspy_e2e`` step records the LoongForge e2e run this way.) Samples are kept when their
thread's name contains ``--thread`` and one of their frames contains ``--anchor`` (e.g. the profiler's forward
wrapper: every sample inside a steady-state forward); the frames below the anchor are counted inclusively (a
function once per sample however deep it recurs) and by the line a sample stopped in (its leaf). ``--host-ms``
(the profiler's host ms per step of that phase) turns shares into ms per step. A leaf inside a kernel call that
holds a large share is the host waiting there: a launch blocked by a full queue (the device is the bottleneck)
or a host-device sync.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
import sys

_PREFIXES = re.compile(r"\S*/site-packages/|\S*/lib/python3\.\d+/")


def short(frame: str) -> str:
    return _PREFIXES.sub("", frame)


def summarize(lines, anchor: str, thread: str, top: int) -> dict:
    inclusive, leaves, total = collections.Counter(), collections.Counter(), 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if thread not in frames[0]:
            continue
        start = next((i for i, frame in enumerate(frames) if anchor in frame), None)
        if start is None:
            continue
        n = int(count)
        total += n
        below = [short(frame) for frame in frames[start + 1:]]
        for function in {re.sub(r":\d+\)", ")", frame) for frame in below}:
            inclusive[function] += n
        leaves[below[-1] if below else "(the anchor itself)"] += n
    return {"samples": total, "inclusive": inclusive.most_common(top), "leaves": leaves.most_common(top)}


def markdown(summary: dict, anchor: str, host_ms: float | None) -> str:
    total = summary["samples"]
    unit = "ms/step" if host_ms else "share"

    def cell(n: int) -> str:
        return f"{n / total * host_ms:.2f}" if host_ms else f"{n / total:.1%}"

    out = [f"{total} samples under `{anchor}`" + (f" ({host_ms:.2f} host ms per step)" if host_ms else ""), "",
           f"| inclusive {unit} | function |", "|---:|---|"]
    out += [f"| {cell(n)} | `{name}` |" for name, n in summary["inclusive"]]
    out += ["", f"| self {unit} | line a sample stopped in |", "|---:|---|"]
    out += [f"| {cell(n)} | `{name}` |" for name, n in summary["leaves"]]
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy record -f raw output (.gz: gzipped, as run_gpu.sh keeps it)")
    p.add_argument("--anchor", default="_Session._wrap_forward", help="frame substring the samples must pass")
    p.add_argument("--thread", default="MainThread", help="thread name substring (py-spy --threads)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--host-ms", type=float, default=None, help="host ms per step of the anchored phase")
    args = p.parse_args(argv)
    opener = gzip.open if args.raw.endswith(".gz") else open
    with opener(args.raw, "rt") as f:
        summary = summarize(f, args.anchor, args.thread, args.top)
    if not summary["samples"]:
        sys.exit(f"no sample of a thread named like {args.thread!r} passes a frame like {args.anchor!r}")
    print(markdown(summary, args.anchor, args.host_ms))


if __name__ == "__main__":
    main()
