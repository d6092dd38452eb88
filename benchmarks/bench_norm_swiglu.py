"""RMSNorm and SwiGLU(+dropout) fwd+bwd on one GPU: ours side by side with eager PyTorch, torch.compile
and Liger-Kernel, in one run.

Byte counts (the minimum each op must move, bf16 = 2 B):
  RMSNorm [T, H]:           fwd reads x, writes y (4 B/elem); bwd reads x, dy, writes dx (6 B/elem) -> 10 B/elem
  RMSNorm + residual:       fwd reads x, r, writes y, h (8); bwd reads h, dy, dh, writes dx (8)    -> 16 B/elem
  SwiGLU gate_up [T, 2I]:   per output element: fwd reads gate, up, writes out (6); bwd reads gate,
                            up, dout, writes dgate, dup (10) -> 16 B/elem (dropout adds none: the mask
                            is regenerated, not stored)
(weight, rstd and dweight traffic is < 0.1% at these sizes and not counted).

    python benchmarks/bench_norm_swiglu.py [--repeats 100]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.harness import Row, Timer, environment, finish_rows, measure_copy_bandwidth, write_results, require_cuda
from ds_loongforge.ops import fused_rmsnorm, swiglu_dropout
from ds_loongforge.ops.numerics import hf_rmsnorm_eager

EPS = 1e-6


def _row(timer, workload, variant, fn, bytes_moved, note=""):
    ms, p10, p90 = timer(fn)
    return Row(workload, variant, ms, p10, p90, bytes_moved, note=note)


def rmsnorm_rows(timer: Timer, tokens: int, hidden: int, with_anchors: bool = True) -> list[Row]:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    n = tokens * hidden
    label = f"RMSNorm {tokens}x{hidden} bf16"
    variants = {"ours (fused CUDA)": lambda a, b: fused_rmsnorm(a, b, EPS, impl="cuda"),
                "ours, rounding once": lambda a, b: fused_rmsnorm(a, b, EPS, impl="cuda", rounding="once")}
    if with_anchors:
        compiled = torch.compile(hf_rmsnorm_eager)
        variants = {"eager (HF LlamaRMSNorm)": lambda a, b: hf_rmsnorm_eager(a, b, EPS),
                    "torch.compile": lambda a, b: compiled(a, b, EPS), **variants}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        variants["Liger-Kernel"] = lambda a, b: LigerRMSNormFunction.apply(a, b, EPS, 0.0, "llama", False)
    except ImportError as err:
        print(f"Liger-Kernel not available: {err}")
    rows = []
    for name, f in variants.items():
        rows.append(_row(timer, label + " fwd+bwd", name, lambda f=f: torch.autograd.grad(f(x, w), (x, w), dy),
                         10 * n))
        with torch.no_grad():
            rows.append(_row(timer, label + " fwd", name, lambda f=f: f(x, w), 4 * n))
    return rows


def rmsnorm_residual_rows(timer: Timer, tokens: int, hidden: int) -> list[Row]:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy, dh = torch.randn_like(x), torch.randn_like(x)
    compiled = torch.compile(hf_rmsnorm_eager)
    label = f"RMSNorm+residual {tokens}x{hidden} bf16 fwd+bwd"
    rows = []
    for name, f in {"torch.compile": lambda: compiled(x, w, EPS, r),
                    "ours (fused CUDA)": lambda: fused_rmsnorm(x, w, EPS, residual=r, impl="cuda")}.items():
        rows.append(_row(timer, label, name, lambda f=f: torch.autograd.grad(f(), (x, w, r), (dy, dh)),
                         16 * tokens * hidden))
    return rows


def _swiglu_eager(gate_up, p):
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return F.dropout(out, p) if p > 0 else out


def swiglu_rows(timer: Timer, tokens: int, inter: int) -> list[Row]:
    gate_up = (2 * torch.randn(tokens, 2 * inter, device="cuda")).to(torch.bfloat16).requires_grad_()
    dout = torch.randn(tokens, inter, device="cuda", dtype=torch.bfloat16)
    n = tokens * inter
    compiled = torch.compile(_swiglu_eager)
    rows = []
    for p in (0.0, 0.1):
        label = f"SwiGLU{'+dropout' if p else ''} gate_up {tokens}x(2x{inter}) bf16 p={p}"
        variants = {"eager": lambda g, p=p: _swiglu_eager(g, p),
                    "torch.compile": lambda g, p=p: compiled(g, p),
                    "ours (fused CUDA)": lambda g, p=p: swiglu_dropout(g, p, seed=1234, impl="cuda"),
                    "ours, rounding once": lambda g, p=p: swiglu_dropout(g, p, seed=1234, impl="cuda",
                                                                         rounding="once")}
        if p == 0:
            try:
                from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

                variants["Liger-Kernel (fused gate_up)"] = lambda g: LigerFusedGateUpSiLUMulFunction.apply(g)
            except ImportError as err:
                print(f"Liger-Kernel not available: {err}")
        for name, f in variants.items():
            note = "stores a mask / keeps random state" if (p and not name.startswith("ours")) else ""
            rows.append(_row(timer, label + " fwd+bwd", name,
                             lambda f=f: torch.autograd.grad(f(gate_up), (gate_up,), dout), 16 * n, note))
            with torch.no_grad():
                rows.append(_row(timer, label + " fwd", name, lambda f=f: f(gate_up), 6 * n))
    try:  # Liger's unfused-GEMM layout: gate and up as two separate tensors
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        gate = gate_up.detach()[:, :inter].contiguous().requires_grad_()
        up = gate_up.detach()[:, inter:].contiguous().requires_grad_()
        rows.append(_row(timer, f"SwiGLU gate_up {tokens}x(2x{inter}) bf16 p=0.0 fwd+bwd",
                         "Liger-Kernel (separate gate, up)",
                         lambda: torch.autograd.grad(LigerSiLUMulFunction.apply(gate, up), (gate, up), dout), 16 * n))
    except ImportError as err:
        print(f"Liger-Kernel not available: {err}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--name", default="bench_norm_swiglu")
    args = parser.parse_args()
    require_cuda("benchmarks/bench_norm_swiglu.py")
    torch.manual_seed(0)
    timer = Timer(warmup=10, repeats=args.repeats)
    copy_gbps = measure_copy_bandwidth(timer)
    rows = rmsnorm_rows(timer, 8192, 4096)
    rows += rmsnorm_residual_rows(timer, 8192, 4096)
    rows += swiglu_rows(timer, 8192, 14336)
    # no shape cliffs: the same bytes at other hidden sizes and token counts (ours and Liger)
    for hidden in (2048, 2880, 5120, 7168, 16384, 32768):  # 2048: the e2e shapes
        rows += [r for r in rmsnorm_rows(timer, (8192 * 4096) // hidden, hidden, with_anchors=False)
                 if r.workload.endswith("fwd+bwd")]
    for tokens in (1000, 4097, 8191, 12345):
        rows += [r for r in rmsnorm_rows(timer, tokens, 4096, with_anchors=False) if r.workload.endswith("fwd+bwd")]
    finish_rows(rows, copy_gbps)
    env = environment()
    notes = [
        "Timing: median of {} repeats after 10 warm-ups, CUDA events around each call, L2 flushed (512 MB write) "
        "before each repeat; fwd+bwd with torch.autograd.grad.".format(args.repeats),
        "Targets (shared/BENCHMARKS.md): RMSNorm fwd+bwd >= 70% of copy bandwidth; SwiGLU(+dropout) fwd+bwd >= 80%.",
        "Liger RMSNorm runs with in_place=False so repeated backward calls do not overwrite dy.",
    ]
    json_path, md_path = write_results(args.name, env, {"copy GB/s": copy_gbps}, rows, notes)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
