"""Eval loss of each bench_e2e variant against stock in the same call, over many calls: mean, sd and count per
(shape, variant), from the bench_e2e JSON files (text data, the given number of steps).

One call measures a variant's difference from stock to a few percent: two 100-step runs of the same math on the
same batches (stock and AutoEP) already differ by ~2%, and stock's own eval loss moves between calls with the same
seed (kernel order). Whether a variant trains like stock is a question about the mean over calls, which this
prints, with the number of calls a bound of ``--resolve`` percent on that mean would need (two standard errors).

    python -m benchmarks.loss_summary benchmarks/results/bench_e2e_*.json [--since b45c590] [--resolve 0.3]

``--since REV`` keeps the calls whose commit (from the file's metadata) has REV as an ancestor in this checkout
(b45c590 gave injected models their family's balancing objective; earlier LoongForge runs trained on another).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
from pathlib import Path


def call_commit(meta: dict, path: Path) -> str | None:
    """The commit a bench_e2e JSON was measured at: its environment's commit, else the name's hex field."""
    commit = (meta.get("env") or {}).get("commit")
    if commit:
        return str(commit)
    parts = path.stem.split("_")
    return next((p for p in reversed(parts) if len(p) >= 7 and all(c in "0123456789abcdef" for c in p)), None)


def is_after(base: str, commit: str, repo: Path) -> bool:
    done = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", base, commit], capture_output=True)
    return done.returncode == 0


def collect(paths: list[Path], steps: int = 100, keep=lambda meta, path: True) -> dict[tuple[str, str], list[float]]:
    """{(shape, variant): [eval-loss difference from stock in %, one per call]}, plus (shape, "stock") with stock's
    own eval losses. Calls without a stock eval loss, on random data or of another length are left out."""
    out: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        meta = json.loads(path.read_text())
        if meta.get("data") != "text" or meta.get("steps") != steps or not keep(meta, path):
            continue
        losses = {r["variant"]: r.get("eval_loss") for r in meta.get("results", [])}
        stock = losses.pop("stock", None)
        if not stock:
            continue
        shape = meta.get("shape_name", "?")
        out.setdefault((shape, "stock"), []).append(stock)
        for variant, loss in losses.items():
            if loss is not None:
                out.setdefault((shape, variant), []).append(100.0 * (loss / stock - 1.0))
    return out


def summary_rows(diffs: dict[tuple[str, str], list[float]], resolve: float) -> list[dict]:
    rows = []
    for (shape, variant), values in sorted(diffs.items()):
        sd = statistics.stdev(values) if len(values) > 1 else float("nan")
        row = {"shape": shape, "variant": variant, "calls": len(values), "mean": statistics.fmean(values), "sd": sd}
        if variant != "stock" and len(values) > 1:
            # two standard errors of the mean within `resolve`: n >= (2 sd / resolve)^2
            row["calls_to_resolve"] = math.ceil((2.0 * sd / resolve) ** 2) if sd > 0 else 1
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--since", default=None, help="only calls at commits that have this one as an ancestor")
    parser.add_argument("--resolve", type=float, default=0.3, help="percent the mean should be known to")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    keep = (lambda meta, path: True) if args.since is None else (
        lambda meta, path: (c := call_commit(meta, path)) is not None and is_after(args.since, c, args.repo))
    rows = summary_rows(collect(args.json, args.steps, keep), args.resolve)
    print(f"| shape | variant | calls | eval loss vs stock, mean ± sd | calls for ±{args.resolve}% (2 SE) |")
    print("|---|---|---:|---|---:|")
    for r in rows:
        if r["variant"] == "stock":
            print(f"| {r['shape']} | stock (its own eval loss) | {r['calls']} | {r['mean']:.4f} ± {r['sd']:.4f} | – |")
        else:
            print(f"| {r['shape']} | {r['variant']} | {r['calls']} | {r['mean']:+.2f}% ± {r['sd']:.2f} | "
                  f"{r.get('calls_to_resolve', '–')} |")


if __name__ == "__main__":
    main()
