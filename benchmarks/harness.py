"""One benchmark harness: timing with CUDA events, the measured copy-bandwidth ceiling, and results
(JSON + markdown) under benchmarks/results/ with the GPU name, versions and git commit.

Method (shared/BENCHMARKS.md): every variant runs in the same process and run; each repeat flushes
the L2 cache first, gives the GPU a ~1 ms head start (so host-side dispatch is not timed), then times
one call between two CUDA events; the median of >= 50 repeats after
warm-up is reported. Fwd+bwd is timed with torch.autograd.grad (no leaf .grad accumulation).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from ds_loongforge.report import package_version

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_FLUSH_BYTES = 512 * 1024 * 1024  # well above the H200's L2 (~60 MB)


@dataclass
class Row:
    workload: str
    variant: str
    ms: float                      # median ms per call
    ms_p10: float
    ms_p90: float
    bytes_moved: int               # minimum bytes the work must move (stated per workload)
    gbps: float = 0.0
    pct_of_copy: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)


def git_commit() -> str:
    if os.environ.get("LF_COMMIT"):
        return os.environ["LF_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       cwd=Path(__file__).resolve().parent, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "sm": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "deepspeed": package_version("deepspeed"),
        "liger_kernel": package_version("liger-kernel"),
        "transformers": package_version("transformers"),
        "commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def parse_names(value: str, choices, flag: str) -> list[str]:
    """A comma-separated CLI list of names, each one of ``choices`` (an error names the bad ones)."""
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in names if s not in choices]
    if unknown or not names:
        raise ValueError(f"{flag}: unknown {unknown or names}; choose from {', '.join(choices)}")
    return names


@functools.lru_cache(maxsize=1)
def _flush_buffer() -> torch.Tensor:
    """One L2-flush buffer per process, shared by every Timer."""
    return torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


class Timer:
    def __init__(self, warmup: int = 10, repeats: int = 100, head_start_cycles: int = 2_000_000):
        self.warmup = warmup
        self.repeats = repeats
        self.head_start_cycles = head_start_cycles  # ~1 ms at the H200's ~2 GHz
        self._flush = _flush_buffer()

    def _timed(self, fn: Callable[[], object]) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue one timed call: L2 flushed, then a GPU-side head start, so the host has queued all of fn's
        launches before the GPU reaches the start event (the events bracket GPU work, not dispatch)."""
        self._flush.zero_()
        torch.cuda._sleep(self.head_start_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return start, end

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float, float]:
        """(median, p10, p90) milliseconds of fn() on the GPU, L2 flushed before each repeat."""
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        events = [self._timed(fn) for _ in range(self.repeats)]
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in events)
        return statistics.median(times), times[len(times) // 10], times[(9 * len(times)) // 10]

    def interleaved(self, fns: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Median milliseconds of each fn, timed round by round (every fn once per round, in order), so that
        clocks and power, which drift under a sustained load, are the same for all of them."""
        return {name: statistics.median(t) for name, t in self.interleaved_times(fns).items()}

    def interleaved_times(self, fns: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
        """Every round's milliseconds of each fn, as :meth:`interleaved` times them (round r of every fn at the
        same clocks: for paired comparisons)."""
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(self.repeats):
            events = [(name, self._timed(fn)) for name, fn in fns.items()]
            torch.cuda.synchronize()
            for name, (s, e) in events:
                times[name].append(s.elapsed_time(e))
        return times


def flag_variant_builders(base: type, variants: dict[str, dict], module: str, tag: str) -> dict[str, type]:
    """One op-builder class per variant: ``base`` compiled with the variant's ``-D`` macros, under the name
    ``<base.NAME>_<variant>``, to build and time kernel variants side by side in one run. The caller binds the
    classes in its module (``globals().update``) named ``module``: build_ops compiles each in a spawned process,
    which imports the class by its module and name."""

    def nvcc_args(self):
        return base.nvcc_args(self) + [f"-D{name}={value}" for name, value in self.FLAGS.items()]

    return {v: type(f"{tag}_{v}_Builder", (base,), {"NAME": f"{base.NAME}_{v}", "FLAGS": flags,
                                                    "nvcc_args": nvcc_args, "__module__": module})
            for v, flags in variants.items()}


OTHER_CSRC_ENV = "LF_AB_OLD_CSRC"


def other_tree_builder(base: type, module: str, class_name: str) -> type:
    """``base`` compiled from another source tree's csrc/ (the directory in $LF_AB_OLD_CSRC, read when building, in
    this process and in build_ops' spawned ones, which inherit the environment), under ``<base.NAME>_old``: to run
    a kernel before and after a change side by side in one process. Bind it in ``module`` as ``class_name``:
    build_ops' spawned processes import it by those. Such a tree comes from
    ``git archive <rev> csrc | tar -x -C /tmp/old``."""

    def tree(_self) -> Path:
        return Path(os.environ[OTHER_CSRC_ENV])

    return type(class_name, (base,), {
        "NAME": f"{base.NAME}_old", "__module__": module,
        "sources": lambda self: [str(tree(self) / s) for s in self.SOURCES],
        "include_paths": lambda self: [str(tree(self) / "includes")]})


def use_other_tree(csrc: Path, probe: str, who: str) -> None:
    """Point :func:`other_tree_builder`'s classes at ``csrc``, after checking it holds ``probe`` (a source path
    relative to csrc/); a wrong directory is an error naming it."""
    csrc = csrc.resolve()
    if not (csrc / probe).is_file():
        raise SystemExit(f"{who}: {csrc} holds no {probe}; pass a csrc/ directory")
    os.environ[OTHER_CSRC_ENV] = str(csrc)


def build_variants(builders: dict[str, type], variants: list[str], who: str) -> dict:
    """{variant: loaded module}: one build per variant, compiled in parallel (build_ops), then loaded from the
    cache; any failed build is an error naming them."""
    from ds_loongforge.op_builder import build_ops

    modules = build_ops([builders[v]() for v in variants])
    failed = {name: err for name, err in modules.items() if isinstance(err, Exception)}
    if failed:
        raise RuntimeError(f"{who}: builds failed: {failed}")
    return {v: modules[builders[v].NAME] for v in variants}


def require_cuda(script: str) -> None:
    """A GPU-only script's first step after its options: on a machine without a CUDA device, exit with a line that
    says so (not a CUDA-initialisation traceback, or minutes of CUDA builds that end in one)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} measures CUDA kernels and needs a CUDA GPU; none is visible here")


def ab_parser(doc: str, repeats: int = 50) -> argparse.ArgumentParser:
    """The before/after scripts' options (described by the first line of ``doc``): --old-csrc (another tree's
    csrc/, built and run beside this one), --repeats and --out (a JSON path)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--old-csrc", type=Path, help="another tree's csrc/ directory to run beside this one")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", type=Path)
    return parser


def new_and_old_builds(new: type, old: type, old_csrc: Path | None, probe: str, who: str) -> dict:
    """{"new": module}, and "old" (``old``, an :func:`other_tree_builder` class, built from ``old_csrc``) when
    ``old_csrc`` is given; ``probe`` is a source the other tree must hold (:func:`use_other_tree`)."""
    names = ["new"]
    if old_csrc is not None:
        use_other_tree(old_csrc, probe, who)
        names.append("old")
    return build_variants({"new": new, "old": old}, names, who)


@contextlib.contextmanager
def smi_samples(fields: str = "clocks.sm,power.draw", period_ms: int = 50, units: bool = False):
    """nvidia-smi's readings of ``fields`` every ``period_ms`` while the block runs: the list it yields gets one CSV
    line per reading (without units unless ``units``) when the block ends."""
    samples: list[str] = []
    fmt = "csv,noheader" if units else "csv,noheader,nounits"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", f"--format={fmt}", "-lms", str(period_ms)],
                           stdout=subprocess.PIPE, text=True)
    try:
        yield samples
    finally:
        smi.terminate()
        samples.extend(smi.communicate(timeout=10)[0].strip().splitlines())


def measure_copy_bandwidth(timer: Timer, n_bytes: int = 2 * 1024**3) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms, _, _ = timer(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def finish_rows(rows: list[Row], copy_gbps: float) -> None:
    for r in rows:
        r.gbps = r.bytes_moved / (r.ms * 1e-3) / 1e9
        r.pct_of_copy = 100.0 * r.gbps / copy_gbps


def write_results(name: str, env: dict, ceilings: dict, rows: list[Row], notes: list[str]) -> tuple[Path, Path]:
    out_dir = Path(os.environ.get("LF_RESULTS_DIR", RESULTS_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    md_path = out_dir / f"{name}.md"
    json_path.write_text(json.dumps({"env": env, "ceilings": ceilings, "rows": [asdict(r) for r in rows],
                                     "notes": notes}, indent=2))
    lines = [f"# {name}", "",
             f"{env['gpu']} (sm_{env['sm'].replace('.', '')}, {env['sms']} SMs), torch {env['torch']}, CUDA {env['cuda']}, "
             f"triton {env['triton']}, liger-kernel {env['liger_kernel']}, DeepSpeed {env['deepspeed']}, "
             f"commit {env['commit'][:12]}, {env['date']}", "",
             "Ceilings measured in this run: " + ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items()), "",
             "| workload | variant | median ms | p10–p90 ms | GB/s | % of copy BW | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.workload} | {r.variant} | {r.ms:.4f} | {r.ms_p10:.4f}–{r.ms_p90:.4f} | {r.gbps:.0f} | "
                     f"{r.pct_of_copy:.1f} | {r.note} |")
    lines += [""] + [f"- {n}" for n in notes]
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path
