"""The RMSNorm CUDA op built from another source tree and from this one, run on the same inputs, every output
compared bit for bit: for a kernel change that should not move a bit (e.g. 71cee29's packed roundings).

    git archive <rev> csrc | tar -x -C /tmp/old        # here; the tree must travel with the device call
    python -m benchmarks.ab_rmsnorm_bits --old-csrc /tmp/old/csrc

With --time, both builds' backward is then timed, interleaved round by round (the same clocks for both), at the
e2e shapes (8192 rows of 2048 and 4096, bf16, stock rounding, with and without the residual's gradient), against
the copy rate of its bytes (reads dy, h, w and the residual's gradient, writes dx; dw's partials not counted).

Cases: bf16, fp16 and fp32 activations, weights of their dtype or fp32, 11 shapes that hit every kernel path,
with and without the residual, both roundings (264 in all). For a case that differs it prints the share of each
output's elements that differ, and for dw (an fp32 sum over rows) both builds' distance from an fp64 sum of the
same rounded terms.
"""
import argparse
import sys
from pathlib import Path

import torch

from benchmarks.harness import Timer, measure_copy_bandwidth, new_and_old_builds, other_tree_builder, require_cuda
from ds_loongforge.op_builder import FusedRMSNormBuilder


OldRMSNormBuilder = other_tree_builder(FusedRMSNormBuilder, __name__, "OldRMSNormBuilder")


SHAPES = ((257, 4096), (8192, 2048), (64, 5120), (33, 7168), (17, 16384), (513, 64), (129, 8), (300, 2880),
          (9, 4097), (3, 40960), (4096, 4096))


def run_both(new, old, dtype, wdt, rows, hidden, res, stock):
    """(inputs, [new outputs], [old outputs]); outputs: y, h (with the residual), rstd, dx, dw."""
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + hidden)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    r = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype) if res else None
    w = (1 + 0.5 * torch.randn(hidden, device="cuda", generator=g)).to(wdt)
    dy = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    dres = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype) if res else None
    outs = []
    for m in (new, old):
        y, h, rstd = m.forward(x, r, w, 1e-6, stock)
        dx, dw = m.backward(dy, h if h is not None else x, rstd, w, dres, stock)
        outs.append({"y": y, "h": h, "rstd": rstd, "dx": dx, "dw": dw})
    return {"x": x, "r": r, "dy": dy}, outs[0], outs[1]


def report_dw(inputs, new, old, dtype, wdt):
    """Both builds' dw against an fp64 sum of the same rounded terms, where they differ."""
    x, r, dy = inputs["x"], inputs["r"], inputs["dy"]
    h = (x.float() + r.float()).to(dtype) if r is not None else x
    n16 = (h.float() * new["rstd"][:, None]).to(dtype)
    p = dy.float() * n16.float()
    if wdt == dtype:
        p = p.to(dtype)
    ref = p.double().sum(0)
    dw_new, dw_old = new["dw"].double(), old["dw"].double()
    idx = (dw_new != dw_old).nonzero().flatten()
    sub = float(torch.finfo(dtype).smallest_normal)
    tiny_n = int(((n16 != 0) & (n16.float().abs() < sub)).sum())
    tiny_p = int(((p != 0) & (p.float().abs() < sub)).sum())
    print(f"   differing dw: {idx.numel()}; mean |new - fp64| {float((dw_new[idx] - ref[idx]).abs().mean()):.3e}, "
          f"|old - fp64| {float((dw_old[idx] - ref[idx]).abs().mean()):.3e}; subnormal terms: {tiny_n} xhat, "
          f"{tiny_p} products")
    for i in idx[:4].tolist():
        print(f"    dw[{i}]: new {float(dw_new[i])!r}, old {float(dw_old[i])!r}, fp64 {float(ref[i])!r}")


TIMED_SHAPES = ((8192, 2048), (8192, 4096))


def time_backward(new, old, repeats: int) -> None:
    timer = Timer(repeats=repeats)
    copy_gbps = measure_copy_bandwidth(timer)
    print(f"backward, bf16, stock rounding; copy {copy_gbps:.0f} GB/s")
    for rows, hidden in TIMED_SHAPES:
        for res in (True, False):
            g = torch.Generator(device="cuda").manual_seed(rows + hidden)
            x, r, dy, dres = (torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
            w = (1 + 0.5 * torch.randn(hidden, device="cuda", generator=g)).to(torch.bfloat16)
            _, h, rstd = new.forward(x, r, w, 1e-6, True)
            dres = dres if res else None
            times = timer.interleaved({name: (lambda m=m: m.backward(dy, h, rstd, w, dres, True))
                                       for name, m in (("new", new), ("old", old))})
            moved = rows * hidden * 2 * (4 if res else 3)
            print(f"  {rows}x{hidden} {'with' if res else 'without'} the residual's gradient: " + ", ".join(
                f"{name} {ms * 1e3:.1f} us ({100 * moved / (ms * 1e-3) / 1e9 / copy_gbps:.1f}% of copy)"
                for name, ms in times.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-csrc", type=Path, required=True, help="the other tree's csrc/ directory")
    parser.add_argument("--time", action="store_true", help="also time both builds' backward at the e2e shapes")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    require_cuda("benchmarks/ab_rmsnorm_bits.py")
    mods = new_and_old_builds(FusedRMSNormBuilder, OldRMSNormBuilder, args.old_csrc, "rmsnorm/rmsnorm.cu",
                              "ab_rmsnorm_bits")
    new, old = mods["new"], mods["old"]
    n = bad = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for wdt in (dtype, torch.float32):
            for rows, hidden in SHAPES:
                for res in (False, True):
                    for stock in (True, False):
                        inputs, a, b = run_both(new, old, dtype, wdt, rows, hidden, res, stock)
                        n += 1
                        diffs = {k: float((a[k] != b[k]).float().mean()) for k in a if a[k] is not None}
                        if any(diffs.values()):
                            bad += 1
                            print("DIFF", dtype, "weight", wdt, f"{rows}x{hidden}", "residual" if res else "",
                                  "stock" if stock else "once", "share differing:", diffs)
                            if diffs["dw"]:
                                report_dw(inputs, a, b, dtype, wdt)
    print(f"ab_rmsnorm_bits: {n} cases, {bad} differ")
    if args.time:
        time_backward(new, old, args.repeats)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
