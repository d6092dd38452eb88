"""SM clock, power and temperature of each bench_e2e variant while it trained, from the nvidia-smi samples that
benchmarks/run_gpu.sh takes beside every e2e shape (smi_<shape>.csv, every 0.5 s) and the variant time stamps in
bench_e2e's log ("[variant] ... (from HH:MM:SS)" / "... (to HH:MM:SS)").

A variant's training window is the longest run of samples above --busy-watts inside its time span (start-up,
data loading and the pre-scan draw ~125 W; training 550-700 W on the H200). Prints one markdown row per variant.

With ``--json`` (the bench_e2e JSON of the same call) each row also gives the energy of a step: the window's median
power times the variant's median step time, in J, and per 1000 tokens. At the H200's 700 W cap a step's time is
its energy over the cap, so this is what a change must lower there.

    python -m benchmarks.smi_summary results/smi_mixtral.csv results/bench_e2e_mixtral.log \
        [--json results/bench_e2e_mixtral.json]
"""

from __future__ import annotations

import argparse
import csv
import json
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


def add_energy(rows: list[dict], bench: dict) -> list[dict]:
    """Each row with a median power gets ``joules_per_step`` (median W x the variant's median step s) and
    ``joules_per_ktoken``, from the bench_e2e JSON of the same call."""
    by_variant = {r["variant"]: r for r in bench.get("results", [])}
    for row in rows:
        res = by_variant.get(row["variant"], {})
        step_ms, tok_s = res.get("median_step_ms"), res.get("tokens_per_s")
        if row.get("samples") and step_ms:
            row["joules_per_step"] = round(row["power_w_median"] * step_ms / 1e3, 1)
            if tok_s:
                row["joules_per_ktoken"] = round(row["power_w_median"] / tok_s * 1e3, 3)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("log", type=Path)
    parser.add_argument("--json", type=Path, default=None, help="bench_e2e JSON of the same call: adds J per step")
    parser.add_argument("--busy-watts", type=float, default=300.0)
    args = parser.parse_args()
    rows = summarize(args.csv.read_text(), args.log.read_text(), args.busy_watts)
    energy = args.json is not None
    if energy:
        rows = add_energy(rows, json.loads(args.json.read_text()))
    extra_head, extra_rule = (" J per step | J per 1k tokens |", "---:|---:|") if energy else ("", "")
    print(f"| variant | training samples | SM clock MHz (median / min) | power W (median) | max temp C |{extra_head}")
    print(f"|---|---:|---|---:|---:|{extra_rule}")
    for r in rows:
        extra = ""
        if energy:
            extra = (f" {r['joules_per_step']:.1f} | {r.get('joules_per_ktoken', float('nan')):.3f} |"
                     if "joules_per_step" in r else " – | – |")
        if not r["samples"]:
            print(f"| {r['variant']} | 0 | – | – | – |{extra}")
        else:
            print(f"| {r['variant']} | {r['samples']} | {r['sm_mhz_median']:.0f} / {r['sm_mhz_min']:.0f} | "
                  f"{r['power_w_median']:.0f} | {r['temp_c_max']:.0f} |{extra}")


if __name__ == "__main__":
    main()
