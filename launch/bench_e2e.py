"""End-to-end A/B benchmark (issue 5): stock DeepSpeed, DeepSpeed AutoEP and LoongForge training the same
model on the same data from the same seed, each variant in its own process of launch/train.py, in one run.

    python launch/bench_e2e.py --shape mixtral|finegrained|tiny [--steps 100] [--variants stock,autoep,loongforge,loongforge-stock-order]
        [--data text|random] [--out benchmarks/results] [--timeout 600] [--log-dir DIR]

Variants (train.py flags): stock = ``--no-loongforge`` (transformers' default experts implementation, grouped_mm
in transformers 5.x, with DeepSpeed's AdamW); autoep = ``--autoep`` (stock + ``"expert_parallel": {"enabled":
true, "autoep_size": 1, "preset_model": "mixtral"}``); loongforge = ``--use-loongforge`` (injected modules,
FusedAdamWClip, and with text data the expert-aware sampler). All share one generated DeepSpeed config: on a GPU
the anchors' ``bf16, ZeRO-2, AdamW lr 1e-4 wd 0.01, gradient_clipping 1.0``, micro-batch 4; on a CPU (smoke runs)
fp32 and ZeRO-0 as ds_configs/cpu.json. A variant that exits non-zero or runs past ``--timeout`` is recorded with
its error and the tail of its stderr; the others still run. Results are rewritten after every variant, so a run
cut short keeps what finished.

Measured per variant (train.py ``--timing``: CUDA events at step ends, no host sync in the loop; ``--train-args
"--timing sync"`` times as the anchors were, with a synchronize at each step's end): median step time over the last
half of the steps, tokens/s from it, MFU (train.py's FLOPs-per-token count over ``--peak-flops``), peak
allocated memory over the training loop, the training loss per step and the held-out eval loss after the last
step (the same eval sequences for every variant). Speedup = tokens/s over the best stock variant's (stock or
AutoEP, whichever ran faster). Targets (issue 5, LoongForge row): mixtral >= 2.3x and finegrained >= 2.5x the best
stock tokens/s; peak memory no higher than the lowest stock peak; with text data, eval loss within 0.3% of stock
DeepSpeed's. With text data a fourth variant, loongforge-stock-order, runs LoongForge without the expert-aware
sampler: on stock's batches in stock's order, so its loss differs from stock's only by the numerics (the sampler's
order alone moves the eval loss after 100 steps by more than 0.3%); the report also gives the two stock variants'
eval-loss spread (the same math on the same batches), the resolution of this check in that run. Two more variants
run only when named: stock-compiled and loongforge-compiled (train.py ``--compile``: ``engine.compile()`` with
inductor); stock-compiled counts as a stock baseline. Writes
``bench_e2e_<shape>[_<data>]_<commit>.{json,md,png}`` under ``--out`` and prints the table.

Shapes: mixtral = MixtralForCausalLM, 8 layers, hidden 2048, intermediate 4096, 8 experts top-2, 16 heads / 8 kv
heads, vocab 32000, seq 2048 x micro-batch 4; finegrained = the same with intermediate 1024, 64 experts top-8;
tiny = train.py's CPU model (seq 256), for smoke runs. Text data is pydoc_data through the byte tokenizer (the
presets keep their 32000-entry embedding); at seq 2048 it holds ~215 training sequences, so 100 steps are about
two epochs.

Expected on one H200 (shared/BENCHMARKS.md anchors, random tokens): mixtral stock (grouped_mm) ~52.9k tokens/s,
AutoEP ~55.3k (148 ms/step, 34.4 GiB); finegrained stock ~35.6k, AutoEP ~37.2k (61.9 GiB). A warm variant takes
about a minute (start-up, model build, 100 steps); cold JIT builds add ~45 s (DeepSpeed FusedAdam) and ~65 s
(LoongForge's ops) the first time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks.harness lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS_DIR, git_commit  # noqa: E402
from ds_loongforge.diagnostics import format_host_ranges  # noqa: E402
from ds_loongforge.report import package_version  # noqa: E402

TRAIN = ROOT / "launch" / "train.py"
LOSS_TOLERANCE_PCT = 0.3   # issue 5: loss after the run within 0.3% of stock DeepSpeed's
FINAL_LOSS_WINDOW = 10     # "final loss" = mean training loss over this many last steps (one batch is noisy)
STDERR_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Shape:
    model: str                      # train.py --model preset
    seq_len: int
    micro_batch: int
    speedup_target: float | None    # LoongForge tokens/s over the best stock variant's
    anchors: str


SHAPES = {
    "mixtral": Shape("mixtral", 2048, 4, 2.3, "H200 anchors (random tokens): AutoEP 55.3k tokens/s (148 ms/step, "
                     "34.4 GiB peak), HF grouped_mm 52.9k, HF eager 33.2k"),
    "finegrained": Shape("finegrained", 2048, 4, 2.5, "H200 anchors (random tokens): AutoEP 37.2k tokens/s "
                         "(61.9 GiB peak), HF grouped_mm 35.6k, HF eager 8.1k"),
    "tiny": Shape("tiny", 256, 4, None, "smoke shape: no anchors, no speed target"),
}
# variant -> train.py flags; the stock variants are the baselines LoongForge's speedup is measured against
VARIANTS = {
    "stock": ["--no-loongforge"],
    "autoep": ["--autoep"],
    "loongforge": ["--use-loongforge"],
    # the loss check on the same batches in the same order as stock: the expert-aware sampler reorders the data,
    # which moves the eval loss after 100 steps by more than the 0.3% target on its own
    "loongforge-stock-order": ["--use-loongforge", "--no-expert-aware-sampler"],
    # engine.compile() (inductor) on each side: run only when named, since the first compiled step and the eval's
    # recompile take a minute or more each
    "stock-compiled": ["--no-loongforge", "--compile"],
    "loongforge-compiled": ["--use-loongforge", "--compile"],
}
OPT_IN_VARIANTS = ("stock-compiled", "loongforge-compiled")
STOCK_VARIANTS = ("stock", "autoep", "stock-compiled")
DESCRIPTIONS = {
    "stock": "DeepSpeed + transformers' default experts",
    "autoep": "DeepSpeed AutoEP (preset mixtral, autoep_size 1)",
    "loongforge": "LoongForge (injected modules, FusedAdamWClip)",
    "loongforge-stock-order": "LoongForge without the expert-aware sampler (stock data order)",
    "stock-compiled": "stock, engine.compile() with inductor",
    "loongforge-compiled": "LoongForge, engine.compile() with inductor",
}


# the held-out share of the text: at seq 2048 the pydoc corpus packs ~240 sequences, so train.py's default 5%
# left 2 eval sequences, and the eval loss of two identical models differed by up to 4.5% between H200 runs
# (kernel nondeterminism over 100 steps); 10% gives ~24 (at most --eval-batches x micro-batch are used)
EVAL_FRACTION = 0.1


@dataclass
class VariantResult:
    variant: str
    status: str = "not run"                 # "ok", "failed: exit <n>", "timeout after <s> s"
    error: str = ""                          # the last line of stderr, for a failed variant
    stderr_tail: str = ""                    # for a failed variant
    seconds: float | None = None             # wall time of the whole process
    command: str = ""
    median_step_ms: float | None = None
    tokens_per_s: float | None = None
    speedup_vs_best_stock: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    final_loss: float | None = None          # mean training loss over the last FINAL_LOSS_WINDOW steps
    eval_loss: float | None = None
    loss_diff_vs_stock_pct: float | None = None   # eval loss vs the stock variant's, in percent
    targets: dict = field(default_factory=dict)   # name -> True/False (only the applicable ones)
    loss_history: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    train_summary: dict = field(default_factory=dict)


def make_ds_config(gpu: bool, micro_batch: int, data: str) -> dict:
    """The one DeepSpeed config every variant gets (train.py's flags switch the loongforge block on or off and
    add AutoEP's block). GPU: the anchors' settings and ds_configs/1gpu_zero2_bf16.json's loongforge block (with
    the fused optimizer); CPU: fp32, ZeRO-0 as ds_configs/cpu.json (LoongForge's CPU ops may fall back)."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2 if gpu else 0},
        "loongforge": {
            "enabled": True,
            "strict_ops": gpu,
            "fused_kernels": {"rmsnorm": True, "swiglu": True},
            "optimizer": {"fused_adamw_clip": True},
            "sampler": {"expert_aware": data == "text"},  # random tokens carry no routing structure to balance
        },
    }
    if gpu:
        config["bf16"] = {"enabled": True}
    return config


_WORLD_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _child_env(gpu: bool) -> dict:
    """Without the caller's distributed variables: train.py then sets up its own world of one process on a
    free port (as for `python launch/train.py`)."""
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if not gpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _last_error_line(stderr: str) -> str:
    lines = [line.removeprefix("[rank0]: ").strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else "(no stderr)"


def run_variant(name: str, base_cmd: list[str], gpu: bool, timeout_s: float, log_dir: Path) -> VariantResult:
    """Runs train.py for one variant and fills its row from the JSON summary (train.py's last stdout line)."""
    cmd = [*base_cmd, *VARIANTS[name]]
    result = VariantResult(name, command=" ".join(cmd))
    out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    started = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(gpu), stdout=out, stderr=err)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    result.seconds = round(time.perf_counter() - started, 1)
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    summary_line = next((line for line in reversed(stdout.splitlines()) if line.startswith('{"steps"')), None)
    if rc != 0 or summary_line is None:
        result.status = (f"timeout after {timeout_s:g} s" if rc is None else
                         f"failed: exit {rc}" if rc != 0 else "failed: no JSON summary on stdout")
        result.error = _last_error_line(stderr)
        result.stderr_tail = stderr[-STDERR_TAIL_CHARS:]
        return result
    summary = json.loads(summary_line)
    result.status = "ok"
    result.train_summary = {k: v for k, v in summary.items()
                            if k not in ("loss_history", "step_times", "step_losses")}
    # every step's loss (kept on the device by --timing, read after the loop), else the --log-every windows
    steps = summary.get("step_losses") or []
    result.loss_history = ([[summary["start_step"] + i + 1, v] for i, v in enumerate(steps)] if steps
                           else summary["loss_history"])
    result.step_times = summary["step_times"]
    if summary["median_step_s_last_half"] is not None:
        result.median_step_ms = 1e3 * summary["median_step_s_last_half"]
    result.tokens_per_s = summary["tokens_per_s_median"]
    result.mfu = summary["mfu"]
    result.peak_gib = summary["peak_memory_gib"]
    tail = [loss for _, loss in result.loss_history[-FINAL_LOSS_WINDOW:]]
    result.final_loss = statistics.fmean(tail) if tail else None
    result.eval_loss = summary["eval_loss"]
    return result


def compare(results: list[VariantResult], shape: Shape, data: str) -> dict:
    """Fills speedups, loss differences and the LoongForge row's targets; returns the baselines used."""
    ok = [r for r in results if r.status == "ok" and r.tokens_per_s]
    stock_rows = [r for r in ok if r.variant in STOCK_VARIANTS]
    best = max(stock_rows, key=lambda r: r.tokens_per_s, default=None)
    reference = next((r for r in ok if r.variant == "stock"), None)
    peaks = [r.peak_gib for r in stock_rows if r.peak_gib is not None]
    for r in ok:
        if best is not None:
            r.speedup_vs_best_stock = r.tokens_per_s / best.tokens_per_s
        if reference is not None and reference.eval_loss and r.eval_loss is not None:
            r.loss_diff_vs_stock_pct = 100.0 * (r.eval_loss - reference.eval_loss) / reference.eval_loss
        if r.variant in STOCK_VARIANTS:
            continue
        r.targets = {}
        if shape.speedup_target is not None and r.speedup_vs_best_stock is not None:
            r.targets[f"speed >= {shape.speedup_target}x"] = r.speedup_vs_best_stock >= shape.speedup_target
        if peaks and r.peak_gib is not None:
            r.targets["memory <= best stock"] = r.peak_gib <= min(peaks)
        if data == "text" and r.loss_diff_vs_stock_pct is not None:
            r.targets[f"loss within {LOSS_TOLERANCE_PCT}%"] = abs(r.loss_diff_vs_stock_pct) <= LOSS_TOLERANCE_PCT
    # the same math on the same batches (stock vs AutoEP): how far kernel nondeterminism alone moves the eval loss
    spreads = [abs(r.loss_diff_vs_stock_pct) for r in stock_rows
               if r is not reference and r.loss_diff_vs_stock_pct is not None]
    return {"best_stock": best.variant if best else None, "loss_reference": reference.variant if reference else None,
            "lowest_stock_peak_gib": min(peaks) if peaks else None,
            "stock_eval_loss_spread_pct": max(spreads) if spreads else None}


# ---------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------

def prebuild_cuda_ops() -> dict:
    """Compiles LoongForge's CUDA ops concurrently (one process per op) before the variants run, so the
    LoongForge variant's start-up does not build them one after the other (cold: ~30 s each). A failure is
    recorded, not raised: the variant then fails under strict_ops and its row says why."""
    from ds_loongforge.op_builder import build_ops, cuda_builders

    started = time.perf_counter()
    results = build_ops(cuda_builders())
    failures = {name: str(r) for name, r in results.items() if isinstance(r, Exception)}
    return {"seconds": round(time.perf_counter() - started, 1), "ops": sorted(results), "failures": failures}


def environment(gpu: bool, query_device: bool) -> dict:
    """Versions and the GPU name. The device is queried (``query_device``) only after the last variant ran,
    so this process holds no CUDA context while they run."""
    import torch

    env = {"gpu": "none (CPU smoke run)", "torch": torch.__version__, "cuda": torch.version.cuda,
           "deepspeed": package_version("deepspeed"), "transformers": package_version("transformers"),
           "triton": package_version("triton"), "commit": git_commit(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if gpu and not query_device:
        env["gpu"] = "CUDA device (its name is read after the last variant)"
    elif gpu:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), sm=f"{props.major}.{props.minor}",
                   sms=props.multi_processor_count)
    return env


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _targets_cell(r: VariantResult) -> str:
    if r.variant in STOCK_VARIANTS or r.status != "ok":
        return "–"
    if not r.targets:
        return "n/a"
    verdict = "yes" if all(r.targets.values()) else "no"
    detail = ", ".join(f"{k}: {'yes' if met else 'no'}" for k, met in r.targets.items())
    return f"{verdict} ({detail})"


def markdown_table(results: list[VariantResult]) -> list[str]:
    lines = ["| variant | median step ms | tokens/s | speedup vs best stock | MFU | peak GiB | final loss | "
             "eval loss | loss diff vs stock % | targets met | status |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        status = r.status if r.status == "ok" else f"{r.status}: {r.error}"
        lines.append(
            f"| {r.variant} | {_fmt(r.median_step_ms, '.1f')} | {_fmt(r.tokens_per_s, ',.0f')} | "
            f"{_fmt(r.speedup_vs_best_stock, '.2f')}{'x' if r.speedup_vs_best_stock is not None else ''} | "
            f"{_fmt(None if r.mfu is None else 100 * r.mfu, '.1f')}{'%' if r.mfu is not None else ''} | "
            f"{_fmt(r.peak_gib, '.2f')} | {_fmt(r.final_loss, '.4f')} | {_fmt(r.eval_loss, '.4f')} | "
            f"{_fmt(r.loss_diff_vs_stock_pct, '+.3f')} | {_targets_cell(r)} | {status.replace('|', '/')} |")
    return lines


def plot(path: Path, title: str, results: list[VariantResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, rate, losses) = plt.subplots(1, 3, figsize=(17, 4.8))
    names = [r.variant for r in results]
    values = [r.tokens_per_s or 0.0 for r in results]
    drawn = bars.bar(names, values, color=["tab:gray" if r.variant in STOCK_VARIANTS else "tab:orange"
                                           for r in results])
    for rect, r in zip(drawn, results):
        label = (f"{r.tokens_per_s:,.0f}\n{r.speedup_vs_best_stock:.2f}x" if r.speedup_vs_best_stock is not None
                 else f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else r.status.split(":")[0])
        bars.annotate(label, (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom",
                      fontsize=8)
    bars.set_ylim(0, 1.2 * max(values + [1.0]))  # room for the labels above the bars
    bars.set_ylabel("tokens/s (median step, last half)")
    bars.set_title("throughput")
    for r in results:
        if r.status != "ok" or not r.step_times:
            continue
        tokens_per_step = r.train_summary["tokens"] / max(1, len(r.step_times))
        rate.plot(range(1, len(r.step_times) + 1), [tokens_per_step / t for t in r.step_times], label=r.variant)
        losses.plot([s for s, _ in r.loss_history], [v for _, v in r.loss_history], label=r.variant)
    rate.set_xlabel("step")
    rate.set_ylabel("tokens/s")
    rate.set_yscale("log")
    rate.set_title("tokens/s per step")
    losses.set_xlabel("step")
    losses.set_ylabel("training LM loss")
    losses.set_title("loss")
    for ax in (rate, losses):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out_dir: Path, name: str, meta: dict, results: list[VariantResult]) -> tuple[Path, Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out_dir / f"{name}.{ext}" for ext in ("json", "md", "png"))
    json_path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2))
    env, shape = meta["env"], meta["shape"]
    lines = [f"# {name}", "",
             f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, DeepSpeed {env['deepspeed']}, "
             f"transformers {env['transformers']}, commit {env['commit'][:12]}, {env['date']}", "",
             f"Shape {meta['shape_name']}: train.py --model {shape['model']}, seq {shape['seq_len']} x micro-batch "
             f"{shape['micro_batch']}, {meta['steps']} steps, {meta['data']} data, seed {meta['seed']}; "
             f"{'bf16 ZeRO-2' if meta['gpu'] else 'fp32 ZeRO-0 (CPU smoke run: the numbers mean nothing)'}, "
             "AdamW lr 1e-4 wd 0.01, clip 1.0. One process per variant.", ""]
    lines += markdown_table(results)
    profiled = [r for r in results if r.status == "ok" and r.train_summary.get("profile")]
    if profiled:
        phases = list(profiled[0].train_summary["profile"]["shares"])
        lines += ["", "Where the step time goes (ds_loongforge.profiler, steps 2..N; share of the window, "
                  "ms per step):",
                  "", "| variant | " + " | ".join(phases) + " |", "|---|" + "---:|" * len(phases)]
        for r in profiled:
            prof = r.train_summary["profile"]
            cells = [f"{100 * prof['shares'][k]:.1f}% ({prof['ms_per_step'].get(k, float('nan')):.1f})"
                     for k in phases]
            lines.append(f"| {r.variant} | " + " | ".join(cells) + " |")
        hosted = [r for r in profiled if r.train_summary["profile"].get("host_ms_per_step")]
        if hosted:
            issued = [k for k in phases if k != "idle"]  # idle is the time in no phase: nothing issues it
            lines += ["", "Host time per step in each phase (the Python thread issuing it, ms; above the device's ms "
                      "the device waited for the host):", "",
                      "| variant | " + " | ".join(issued) + " |", "|---|" + "---:|" * len(issued)]
            for r in hosted:
                host = r.train_summary["profile"]["host_ms_per_step"]
                lines.append(f"| {r.variant} | " + " | ".join(f"{host.get(k, float('nan')):.1f}" for k in issued)
                             + " |")
    phased = [r for r in results if r.status == "ok" and r.train_summary.get("memory_phases")]
    if phased:
        lines += ["", "Memory by phase of step 2 (train.py --memory-phases; GiB peak within the phase / allocated at "
                  "its end):", ""]
        for r in phased:
            cells = [f"{m['phase']} {m['peak_gib']:.2f} / {m['allocated_gib']:.2f}"
                     for m in r.train_summary["memory_phases"]]
            lines.append(f"- {r.variant}: " + "; ".join(cells))
    traced = [r for r in results if r.status == "ok" and (r.train_summary.get("kernels") or {}).get("kernels_per_iter")]
    if traced:
        lines += ["", "GPU kernel time per step by phase and category (train.py --kernel-profile; ms per step):", ""]
        for r in traced:
            k = r.train_summary["kernels"]
            lines.append(f"- {r.variant} (steps {k['steps'][0]}..{k['steps'][1]}): busy {k['busy_ms_per_iter']:.1f}, "
                         f"span {k['span_ms_per_iter']:.1f}; " + ", ".join(
                             f"{c} {v:.1f}" for c, v in k["category_ms_per_iter"].items()))
            for phase, cats in k["range_category_ms_per_iter"].items():
                lines.append(f"  - {phase}: " + ", ".join(f"{c} {v:.1f}" for c, v in cats.items()))
            if k.get("host_ranges"):
                lines.append("  - host (ms issuing each phase, under the profiler; lead: how far the host was ahead "
                             "of the GPU when the phase began): " + format_host_ranges(k["host_ranges"], digits=1))
    synced = [r for r in results if r.status == "ok" and (r.train_summary.get("host_syncs") or {}).get("cuda")]
    if synced:
        lines += ["", "Host waits for the device in step 3 (train.py --sync-debug; the host stops at each until the "
                  "device gets there, and a synchronize empties the device's queue):", ""]
        for r in synced:
            h = r.train_summary["host_syncs"]
            lines.append(f"- {r.variant}: {h['count']}" + (": " if h["sites"] else "") + "; ".join(
                f"{e['count']}x {e['where']}" for e in h["sites"][:6]))
    peaks = [r for r in results if r.status == "ok" and r.train_summary.get("memory_at_peak")]
    if peaks:
        lines += ["", "Blocks alive at the peak of step 2 (train.py --memory-snapshot; GiB, by allocating line):", ""]
        for r in peaks:
            m = r.train_summary["memory_at_peak"]
            lines.append(f"- {r.variant}: peak {m['peak_gib']:.2f} = before the step {m['baseline_gib']:.2f} + "
                         + "; ".join(f"{e['gib']:.2f} {e['where']}" for e in m["live_at_peak"][:8]))
    lines += ["",
              f"- Timing: train.py --timing, CUDA events at step ends read after the loop (no host sync inside it: "
              f"the host queues the next step while one runs, idle time counted); median step time over the last "
              f"half of the steps; tokens/s = tokens per step / that median. MFU = tokens/s x "
              f"{_fmt(meta.get('model_flops_per_token'), '.4g')} FLOPs/token / {meta['peak_flops']:.4g} FLOP/s "
              "(6 x active params per token, experts counted k/E, + 12 x layers x hidden x seq).",
              "- Peak GiB: torch.cuda.max_memory_allocated over the training loop (reset when the loop starts).",
              f"- Speedup: tokens/s over the best stock variant's ({meta['baselines']['best_stock']}); final loss: "
              f"mean training loss of the last {FINAL_LOSS_WINDOW} steps; loss diff: held-out eval loss vs "
              f"{meta['baselines']['loss_reference']} (same eval sequences for every variant).",
              "- Targets (LoongForge): " + (f"speed >= {shape['speedup_target']}x the best stock, "
                                            if shape["speedup_target"] else "no speed target for this shape, ")
              + f"peak memory <= the lowest stock peak (CUDA only), loss within {LOSS_TOLERANCE_PCT}% of stock "
              "(text data only).",
              *([f"- Loss resolution: the stock variants (the same math on the same batches) differ by "
                 f"{meta['baselines']['stock_eval_loss_spread_pct']:.3f}% in eval loss in this run (kernel "
                 "nondeterminism over the steps); loongforge-stock-order is LoongForge on stock's batches in "
                 "stock's order, loongforge adds the expert-aware sampler's order."]
                if meta["baselines"].get("stock_eval_loss_spread_pct") is not None else []),
              f"- {shape['anchors']}.",
              f"- Wall time: {meta['wall_seconds']:.0f} s; per-variant logs: {meta['log_dir']}."]
    md_path.write_text("\n".join(lines) + "\n")
    plot(png_path, f"{name}: {meta['data']} data, {meta['steps']} steps, {env['gpu']}", results)
    return json_path, md_path, png_path


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--variants", default=None, help=f"comma-separated, from {', '.join(VARIANTS)} (default: all "
                   "with text data; without loongforge-stock-order with --data random, where no sampler runs)")
    p.add_argument("--data", choices=("text", "random"), default="text")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seq-len", type=int, default=None, help="override the shape's sequence length")
    p.add_argument("--micro-batch", type=int, default=None, help="override the shape's micro-batch")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--peak-flops", type=float, default=989e12, help="peak dense bf16 FLOP/s for MFU (H200: 989e12)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one variant may run (start-up included)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("LF_RESULTS_DIR", RESULTS_DIR)),
                   help="results directory (default: $LF_RESULTS_DIR or benchmarks/results)")
    p.add_argument("--log-dir", type=Path, default=None, help="per-variant stdout/stderr (default: a temp dir)")
    p.add_argument("--train-args", default="", help="extra launch/train.py flags for every variant, one string "
                   "(e.g. \"--kernel-profile 3 --memory-snapshot\" for a diagnosis run)")
    p.add_argument("--no-prebuild-ops", dest="prebuild_ops", action="store_false",
                   help="on a GPU, do not compile LoongForge's CUDA ops in parallel before the variants run")
    args = p.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join(v for v in VARIANTS if v not in OPT_IN_VARIANTS
                                 and (args.data == "text" or v != "loongforge-stock-order"))
    args.variant_names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_names if v not in VARIANTS]
    if unknown or not args.variant_names:
        p.error(f"--variants: unknown {unknown or args.variants!r}; choose from {', '.join(VARIANTS)}")
    if len(set(args.variant_names)) != len(args.variant_names):
        p.error(f"--variants: {args.variants!r} names a variant twice")
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the median is over the last half), got {args.steps}")
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()  # NVML only: no CUDA context in this process
    base = SHAPES[args.shape]
    shape = Shape(base.model, args.seq_len or base.seq_len, args.micro_batch or base.micro_batch,
                  base.speedup_target, base.anchors)
    started = time.perf_counter()
    commit = git_commit()
    name = f"bench_e2e_{args.shape}{'' if args.data == 'text' else '_' + args.data}_{commit[:7]}"
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ds_config = make_ds_config(gpu, shape.micro_batch, args.data)
    config_path = log_dir / "ds_config.json"
    config_path.write_text(json.dumps(ds_config, indent=2))
    base_cmd = [sys.executable, str(TRAIN), "--deepspeed_config", str(config_path), "--model", shape.model,
                "--seq-len", str(shape.seq_len), "--steps", str(args.steps), "--data", args.data,
                "--seed", str(args.seed), "--timing", "events", "--log-every", "10", "--eval-every", "0",
                "--eval-batches", str(args.eval_batches), "--eval-fraction", str(EVAL_FRACTION),
                "--peak-flops", repr(args.peak_flops), "--no-progress",
                "--profile", "--memory-phases", "--sync-debug", *shlex.split(args.train_args)]
    print(f"bench_e2e {args.shape}: variants {', '.join(args.variant_names)}; logs and config in {log_dir}",
          flush=True)

    prebuild = None
    if gpu and args.prebuild_ops and any(v.startswith("loongforge") for v in args.variant_names):
        prebuild = prebuild_cuda_ops()
        print(f"prebuilt LoongForge CUDA ops in {prebuild['seconds']} s"
              + (f"; failed: {prebuild['failures']}" if prebuild["failures"] else ""), flush=True)

    results = [VariantResult(v) for v in args.variant_names]
    meta, paths = {}, ()
    for i, variant in enumerate(args.variant_names):
        print(f"[{variant}] {DESCRIPTIONS[variant]} ... (from {time.strftime('%H:%M:%S')})", flush=True)
        results[i] = run_variant(variant, base_cmd, gpu, args.timeout, log_dir)
        r = results[i]
        print(f"[{variant}] {r.status} in {r.seconds} s"
              + (f": {_fmt(r.tokens_per_s, ',.0f')} tokens/s, eval loss {_fmt(r.eval_loss, '.4f')}"
                 if r.status == "ok" else f": {r.error}") + f" (to {time.strftime('%H:%M:%S')})", flush=True)
        baselines = compare(results, shape, args.data)
        flops = next((r.train_summary.get("model_flops_per_token") for r in results if r.train_summary), None)
        meta = {"name": name, "shape_name": args.shape, "shape": asdict(shape), "steps": args.steps,
                "data": args.data, "seed": args.seed, "gpu": gpu, "peak_flops": args.peak_flops,
                "model_flops_per_token": flops, "timeout_s": args.timeout, "ds_config": ds_config,
                "variants": {v: {"flags": VARIANTS[v], "description": DESCRIPTIONS[v]} for v in args.variant_names},
                "baselines": baselines, "prebuild_ops": prebuild, "wall_seconds": time.perf_counter() - started,
                "log_dir": str(log_dir),
                "env": environment(gpu, query_device=i == len(args.variant_names) - 1)}
        paths = write_results(args.out, name, meta, results)  # after every variant: a cut-short run keeps its rows
    print()
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return {"meta": meta, "results": results, "paths": paths}


if __name__ == "__main__":
    main()
