"""SM clock, power and temperature of each bench_e2e variant while it trained, from the nvidia-smi samples that
benchmarks/run_gpu.sh takes beside every e2e shape (smi_<shape>.csv, every 0.5 s) and the variant time stamps in
bench_e2e's log ("[variant] ... (from HH:MM:SS)" / "... (to HH:MM:SS)").

A variant's training window is the longest run of samples above --busy-watts inside its time span (start-up,
data loading and the pre-scan draw ~125 W; training 550-700 W on the H200). Prints one markdown row per variant.

    python -m benchmarks.smi_summary results/smi_mixtral.csv results/bench_e2e_mixtral.log
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from datetime import datetime
from pathlib import Path

_STAMP = re.compile(r"^\[(?P<variant>[^\]]+)\] .*\((?P<edge>from|to) (?P<time>\d\d:\d\d:\d\d)\)$")
_STAMP_C16C37E = re.compile(r"^\[(?P<variant>[^\]]+)\] (?P<time>\d\d:\d\d:\d\d) ")  # c16c37e: start, then end


def variant_spans(log_text: str) -> dict[str, tuple[str, str]]:
    spans: dict[str, list[str]] = {}
    for line in log_text.splitlines():
        m = _STAMP.match(line.strip())
        if m:
            spans.setdefault(m["variant"], [m["time"], m["time"]])[0 if m["edge"] == "from" else 1] = m["time"]
        elif m := _STAMP_C16C37E.match(line.strip()):
            span = spans.setdefault(m["variant"], [m["time"], "99:99:99"])  # cut off: open to the log's end
            if span[0] != m["time"]:
                span[1] = m["time"]
    return {v: (a, b) for v, (a, b) in spans.items()}


def read_samples(csv_text: str) -> list[tuple[str, float, float, float]]:
    """(HH:MM:SS.fff, SM MHz, W, deg C) per nvidia-smi row; rows with a non-numeric field are skipped."""
    rows = []
    for row in list(csv.reader(csv_text.splitlines()))[1:]:
        try:
            stamp = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").strftime("%H:%M:%S.%f")
            rows.append((stamp, float(row[1].split()[0]), float(row[2].split()[0]), float(row[3])))
        except (IndexError, ValueError):
            continue
    return rows


def busy_window(samples, start: str, end: str, busy_watts: float):
    inside = [s for s in samples if start <= s[0][:8] <= end]
    best, run = [], []
    for s in inside:
        run = run + [s] if s[2] >= busy_watts else []
        if len(run) > len(best):
            best = run
    return best


def summarize(csv_text: str, log_text: str, busy_watts: float = 300.0) -> list[dict]:
    samples = read_samples(csv_text)
    out = []
    for variant, (start, end) in variant_spans(log_text).items():
        w = busy_window(samples, start, end, busy_watts)
        if not w:
            out.append({"variant": variant, "samples": 0})
            continue
        out.append({"variant": variant, "samples": len(w), "seconds": round(len(w) * 0.5, 1),
                    "sm_mhz_median": statistics.median(s[1] for s in w), "sm_mhz_min": min(s[1] for s in w),
                    "power_w_median": round(statistics.median(s[2] for s in w), 1),
                    "temp_c_max": max(s[3] for s in w)})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("log", type=Path)
    parser.add_argument("--busy-watts", type=float, default=300.0)
    args = parser.parse_args()
    rows = summarize(args.csv.read_text(), args.log.read_text(), args.busy_watts)
    print("| variant | training samples | SM clock MHz (median / min) | power W (median) | max temp C |")
    print("|---|---:|---|---:|---:|")
    for r in rows:
        if not r["samples"]:
            print(f"| {r['variant']} | 0 | – | – | – |")
        else:
            print(f"| {r['variant']} | {r['samples']} | {r['sm_mhz_median']:.0f} / {r['sm_mhz_min']:.0f} | "
                  f"{r['power_w_median']:.0f} | {r['temp_c_max']:.0f} |")


if __name__ == "__main__":
    main()
