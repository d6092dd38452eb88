"""``loongforge_report [--verify]``: what ds_report is for DeepSpeed, for the ds_loongforge ops.

One row per op (compatible, runs here, prebuilt, JIT-cached) and the versions that decide whether ops build:
torch, its CUDA, nvcc, NCCL, DeepSpeed, transformers, liger-kernel (whose RoPE ``fused_kernels.rope`` uses),
and the GPU architecture. ``--verify`` builds every compatible op, checks forward and backward against the fp64
reference on random data, prints the max error against its tolerance, and exits 1 on any failure; then the same
for the pieces ``inject`` adds that are not ops (the fused q/k/v projection; the fused RoPE on its slices where
liger-kernel and a GPU are present). A CUDA op on a machine without a GPU is compiled (a build break fails) and
its numerical check reported as not run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from ds_loongforge.op_builder import FusedRMSNormBuilder, OpBuildError, all_builders, build_ops
from ds_loongforge.ops import numerics


def package_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nvcc_version() -> str:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "not found (CUDA_HOME unset)"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    try:
        out = subprocess.check_output([nvcc, "--version"], text=True, stderr=subprocess.STDOUT)
    except (OSError, subprocess.CalledProcessError) as err:
        return f"not runnable at {nvcc} ({err})"
    release = [line for line in out.splitlines() if "release" in line]
    return f"{release[-1].strip() if release else out.strip()} ({nvcc})"


def environment() -> dict[str, str]:
    nccl = "n/a"
    if torch.cuda.is_available() or torch.version.cuda:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError) as err:
            nccl = f"unavailable ({err})"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"{torch.cuda.get_device_name()} (sm_{major}{minor}) x{torch.cuda.device_count()}"
    else:
        gpu = "none visible"
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch CUDA": str(torch.version.cuda),
        "nvcc": _nvcc_version(),
        "NCCL": nccl,
        "DeepSpeed": package_version("deepspeed"),
        "transformers": package_version("transformers"),
        "liger-kernel": package_version("liger-kernel") + " (fused RoPE, fused_kernels.rope)",
        "ds_loongforge": package_version("ds_loongforge"),
        "GPU": gpu,
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "(unset)"),
        "torch extensions dir": extensions_dir(),
    }


def extensions_dir() -> str:
    """Where JIT builds of the ops are cached, as the builders look there (``jit_cached``, ``load``):
    TORCH_EXTENSIONS_DIR when set, else torch's default root with its per-Python/CUDA folder."""
    from torch.utils.cpp_extension import _get_build_directory, get_default_build_root

    try:
        return os.path.dirname(_get_build_directory(FusedRMSNormBuilder.NAME, verbose=False))
    except OSError as err:  # the report is where a user looks for why builds fail: say it, do not crash
        return (f"{get_default_build_root()} (cannot be written: {err}; JIT builds fail, set TORCH_EXTENSIONS_DIR "
                "to a writable directory)")


@dataclass
class OpRow:
    name: str
    device: str
    compatible: bool
    problem: str | None
    prebuilt: bool
    jit_cached: bool

    @property
    def runs_here(self) -> bool:
        """Compatible, and for a CUDA op a CUDA device visible: a CUDA op built here without one only compiles."""
        return self.compatible and (self.device != "cuda" or torch.cuda.is_available())


def op_rows() -> list[OpRow]:
    rows = []
    for builder in all_builders():
        problem = builder.compatibility_problem()
        try:
            prebuilt = builder.prebuilt_module() is not None
        except OpBuildError:
            prebuilt = False
        rows.append(OpRow(builder.NAME, "cuda" if builder.is_cuda_op else "cpu", problem is None, problem,
                          prebuilt, builder.jit_cached()))
    return rows


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def print_report(rows: list[OpRow], env: dict[str, str]) -> None:
    width = max(len(r.name) for r in rows) + 2
    print("-" * 78)
    print("ds_loongforge op report")
    print("-" * 78)
    print(f"{'op name':<{width}}{'device':<8}{'compatible':<12}{'runs here':<11}{'prebuilt':<10}{'JIT-cached':<10}")
    for r in rows:
        print(f"{r.name:<{width}}{r.device:<8}{_yes(r.compatible):<12}{_yes(r.runs_here):<11}{_yes(r.prebuilt):<10}"
              f"{_yes(r.jit_cached):<10}")
        if r.problem:
            print(f"{'':<{width}}  why not: {r.problem}")
    if any(r.compatible and not r.runs_here for r in rows):
        print("runs here: no CUDA device is visible, so the compatible CUDA ops compile here but run on a GPU machine")
    print("-" * 78)
    for key, value in env.items():
        print(f"{key + ':':<24}{value}")
    print("-" * 78)


def verify(rows: list[OpRow], seed: int | None = None) -> bool:
    """Build every compatible op (concurrently) and check it on data drawn from ``seed`` (a fresh one when None,
    printed so that a failure can be drawn again); True when nothing failed."""
    ok = True
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    print("verify: max error / tolerance (pass when error <= tolerance), fwd and every grad, fp64 reference; "
          f"seed {seed} (--verify --seed {seed} draws the same data)")
    to_build = []
    by_name = {r.name: r for r in rows}
    for builder in all_builders():
        row = by_name[builder.NAME]
        if not row.compatible:
            print(f"  {builder.NAME:<24} not built: {row.problem}")
        elif builder.is_cuda_op and not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            print(f"  {builder.NAME:<24} not built: no GPU visible; set TORCH_CUDA_ARCH_LIST (e.g. 9.0) "
                  "to compile-check it here")
        else:
            to_build.append(builder)
    cold = [b for b in to_build if not (by_name[b.NAME].prebuilt or by_name[b.NAME].jit_cached)]
    if cold:  # a cold build of the CUDA ops takes minutes on a small machine: say so before it starts
        print(f"  compiling {len(cold)} ops not built yet ({', '.join(b.NAME for b in cold)})"
              + (": a cold CUDA build takes minutes" if any(b.is_cuda_op for b in cold) else ""), flush=True)
    start = time.monotonic()
    built = build_ops(to_build)
    if cold:
        print(f"  built in {time.monotonic() - start:.0f} s", flush=True)
    for builder in to_build:
        module = built[builder.NAME]
        if isinstance(module, OpBuildError):
            ok = False
            print(f"  {builder.NAME:<24} BUILD FAILED\n{module}")
            continue
        device = "cuda" if builder.is_cuda_op else "cpu"
        if not by_name[builder.NAME].runs_here:
            print(f"  {builder.NAME:<24} built; numerical check not run: no CUDA device visible")
            continue
        torch.manual_seed(seed)  # per op: its data does not depend on which other ops were built
        checks = [(builder.NAME, check) for check in numerics.checks_for(builder.NAME, device)]
        ok = _run_checks(checks) and ok
    torch.manual_seed(seed)
    ok = _run_checks(numerics.integration_checks("cuda" if torch.cuda.is_available() else "cpu")) and ok
    print("verify:", "PASSED" if ok else "FAILED")
    return ok


def _run_checks(checks) -> bool:
    """Run and print (name, check) pairs, one line each (a str in place of a check: why it did not run); True when
    every check that ran passed."""
    ok = True
    for name, check in checks:
        if isinstance(check, str):
            print(f"  {name:<24} not run: {check}")
            continue
        result = check()
        ok = ok and result.passed
        print(f"  {name:<24} {result.describe()}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loongforge_report", description=__doc__.splitlines()[0])
    parser.add_argument("--verify", action="store_true",
                        help="build every compatible op and check it against its reference; exit 1 on failure")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="with --verify: draw the checks' data from seed N (default: a fresh seed, printed)")
    args = parser.parse_args(argv)
    if args.seed is not None and not args.verify:
        parser.error(f"--seed {args.seed} only applies to --verify: add --verify, or drop --seed")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        parser.error(f"--seed must be in [0, 2**63) (torch.manual_seed's range), got {args.seed}")
    rows = op_rows()
    print_report(rows, environment())
    if args.verify:
        return 0 if verify(rows, args.seed) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
