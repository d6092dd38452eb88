"""benchmarks/smi_summary.py on a synthetic nvidia-smi CSV and bench_e2e log: each variant's training window is
the longest high-power run inside its time span, start-up samples and other variants' samples left out; the energy
of a step from the window's power and the bench's median step time; benchmarks/loss_summary.py's per-call eval-loss
differences from stock, their mean and sd, and the calls a bound on the mean would need."""

import json
import math

import pytest

from benchmarks.loss_summary import call_commit, collect, summary_rows
from benchmarks.smi_summary import add_energy, summarize


def _csv(rows):
    head = "timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu\n"
    return head + "".join(f"2026/12/01 {t}, {mhz} MHz, {w:.2f} W, {c}\n" for t, mhz, w, c in rows)


def test_each_variant_gets_its_own_busy_window():
    rows = [("10:00:01.000", 1980, 125.0, 44), ("10:00:01.500", 1980, 610.0, 58), ("10:00:02.000", 1965, 620.0, 59),
            ("10:00:02.500", 1980, 130.0, 46),                                   # stock ends
            ("10:00:03.000", 1980, 126.0, 44), ("10:00:03.500", 1980, 450.0, 50),  # a short blip at start-up
            ("10:00:04.000", 1980, 126.0, 44), ("10:00:04.500", 1600, 694.0, 60), ("10:00:05.000", 1500, 690.0, 61),
            ("10:00:05.500", 1650, 695.0, 62), ("10:00:06.000", 1980, 135.0, 47),
            ("10:00:07.000", 1980, 125.0, 43)]                                   # after every variant
    log = ("[stock] DeepSpeed ... (from 10:00:01)\n[stock] ok in 1.5 s: 1 tokens/s (to 10:00:02)\n"
           "[loongforge] LoongForge ... (from 10:00:03)\n[loongforge] ok in 3 s: 2 tokens/s (to 10:00:06)\n"
           "[broken] x ... (from 10:00:07)\n[broken] failed: exit 1: boom (to 10:00:07)\n")
    by = {r["variant"]: r for r in summarize(_csv(rows), log)}
    assert by["stock"]["samples"] == 2 and by["stock"]["sm_mhz_median"] == 1972.5
    assert by["loongforge"]["samples"] == 3 and by["loongforge"]["sm_mhz_median"] == 1600
    assert by["loongforge"]["sm_mhz_min"] == 1500 and by["loongforge"]["power_w_median"] == 694.0
    assert by["loongforge"]["temp_c_max"] == 62
    assert by["broken"] == {"variant": "broken", "samples": 0}


def test_energy_per_step_is_median_power_times_median_step():
    rows = [{"variant": "stock", "samples": 3, "power_w_median": 600.0},
            {"variant": "loongforge", "samples": 2, "power_w_median": 700.0},
            {"variant": "broken", "samples": 0}]
    bench = {"results": [{"variant": "stock", "median_step_ms": 150.0, "tokens_per_s": 50000.0},
                         {"variant": "loongforge", "median_step_ms": 70.0, "tokens_per_s": None},
                         {"variant": "broken", "median_step_ms": None}]}
    by = {r["variant"]: r for r in add_energy(rows, bench)}
    assert by["stock"]["joules_per_step"] == 90.0 and by["stock"]["joules_per_ktoken"] == 12.0
    assert by["loongforge"]["joules_per_step"] == 49.0 and "joules_per_ktoken" not in by["loongforge"]
    assert "joules_per_step" not in by["broken"]


def _bench(path, shape, losses, data="text", steps=100, commit="abcdef1"):
    meta = {"shape_name": shape, "data": data, "steps": steps, "env": {"commit": commit},
            "results": [{"variant": v, "eval_loss": loss} for v, loss in losses.items()]}
    path.write_text(json.dumps(meta))
    return path


def test_loss_summary_differences_from_stock_per_call(tmp_path):
    paths = [_bench(tmp_path / "a.json", "mixtral", {"stock": 2.0, "autoep": 2.02, "loongforge": 1.9}),
             _bench(tmp_path / "b.json", "mixtral", {"stock": 2.5, "autoep": 2.45, "loongforge": None}),
             _bench(tmp_path / "c.json", "mixtral", {"stock": 2.0, "autoep": 3.0}, data="random"),  # left out
             _bench(tmp_path / "d.json", "mixtral", {"stock": 2.0, "autoep": 3.0}, steps=12),       # left out
             _bench(tmp_path / "e.json", "mixtral", {"autoep": 3.0})]                                # no stock
    diffs = collect(paths)
    assert diffs[("mixtral", "autoep")] == pytest.approx([1.0, -2.0])
    assert diffs[("mixtral", "loongforge")] == pytest.approx([-5.0])
    assert diffs[("mixtral", "stock")] == [2.0, 2.5]
    rows = {r["variant"]: r for r in summary_rows(diffs, resolve=0.3)}
    assert rows["autoep"]["mean"] == pytest.approx(-0.5) and rows["autoep"]["calls"] == 2
    sd = rows["autoep"]["sd"]
    assert sd == pytest.approx(2.1213, abs=1e-4)
    assert rows["autoep"]["calls_to_resolve"] == math.ceil((2 * sd / 0.3) ** 2)  # ~200: 2 SE of the mean <= 0.3
    assert "calls_to_resolve" not in rows["loongforge"]  # one call: no spread to go on
    assert call_commit({"env": {"commit": "1234abc"}}, tmp_path / "x.json") == "1234abc"
    assert call_commit({}, tmp_path / "bench_e2e_mixtral_5b2680a_stock_order.json") == "5b2680a"


def test_loss_floor_table_compares_each_seed_with_its_own_stock_run():
    from benchmarks.loss_floor_cpu import VARIANTS, table

    rows = []
    for seed, stock in ((1, 2.0), (2, 4.0)):
        for i, variant in enumerate(VARIANTS):
            factor = 1 + 0.01 * i * (1 if seed == 1 else -1)  # variant i: +i% at seed 1, -i% at seed 2
            rows.append({"variant": variant, "seed": seed, "eval_loss": stock * factor, "last10_loss": stock * factor})
    lines = table(rows, [1, 2], list(VARIANTS))
    assert len(lines) == 2 + len(VARIANTS) - 1  # header, rule, one row per variant but stock
    assert len(table(rows, [1, 2], ["stock", "loongforge"])) == 3  # --variants: only the ones that ran
    eager = next(line for line in lines if line.startswith("| stock-eager |"))
    assert "+1.00, -1.00" in eager and "| +0.00 ± 1.41 | 1.00 |" in eager


def test_flag_variant_builders_compile_each_variant_under_its_own_name_with_its_macros():
    """benchmarks.harness.flag_variant_builders: what diagnose_adamw/diagnose_dispatch build side by side."""
    from benchmarks.harness import flag_variant_builders
    from ds_loongforge.op_builder import FusedAdamWClipBuilder

    builders = flag_variant_builders(FusedAdamWClipBuilder, {"base": {}, "lb2": {"LF_ADAMW_MIN_BLOCKS": 2}},
                                     __name__, "T")
    base, lb2 = builders["base"](), builders["lb2"]()
    assert (base.NAME, lb2.NAME) == ("lf_fused_adamw_clip_base", "lf_fused_adamw_clip_lb2")
    stock_args = FusedAdamWClipBuilder().nvcc_args()
    assert base.nvcc_args() == stock_args
    assert lb2.nvcc_args() == stock_args + ["-DLF_ADAMW_MIN_BLOCKS=2"]
    assert "--use_fast_math" not in lb2.nvcc_args()  # the op's own choices are kept
    assert type(lb2).__module__ == __name__ and type(lb2).__name__ == "T_lb2_Builder"


def test_other_tree_builder_compiles_the_other_trees_sources(tmp_path, monkeypatch):
    """benchmarks.harness.other_tree_builder / use_other_tree: an op built from another csrc/ beside this one's
    (ab_rmsnorm_bits, diagnose_cross_entropy --old-csrc); a directory without the op's sources is refused."""
    from benchmarks.harness import OTHER_CSRC_ENV, other_tree_builder, use_other_tree
    from ds_loongforge.op_builder import FusedCrossEntropyBuilder

    cls = other_tree_builder(FusedCrossEntropyBuilder, __name__, "OldCE")
    assert cls.__name__ == "OldCE" and cls.__module__ == __name__ and cls.NAME == "lf_cross_entropy_old"
    with pytest.raises(SystemExit, match="holds no cross_entropy/cross_entropy.cu"):
        use_other_tree(tmp_path, "cross_entropy/cross_entropy.cu", "who")
    (tmp_path / "cross_entropy").mkdir()
    (tmp_path / "cross_entropy" / "cross_entropy.cu").write_text("")
    monkeypatch.setenv(OTHER_CSRC_ENV, "unset")  # so that the test leaves the environment as it found it
    use_other_tree(tmp_path, "cross_entropy/cross_entropy.cu", "who")
    builder = cls()
    assert builder.sources() == [str(tmp_path.resolve() / s) for s in FusedCrossEntropyBuilder.SOURCES]
    assert builder.include_paths() == [str(tmp_path.resolve() / "includes")]
    assert builder.nvcc_args() == FusedCrossEntropyBuilder().nvcc_args()


def test_new_and_old_builds_adds_the_other_tree_only_when_given(tmp_path, monkeypatch):
    """benchmarks.harness.new_and_old_builds / ab_parser, the before/after scripts' common start (diagnose_routing,
    diagnose_cross_entropy, ab_rmsnorm_bits): "old" is built only with --old-csrc, from that tree."""
    import os
    from pathlib import Path

    import benchmarks.harness as harness

    calls = []

    def fake_build_variants(builders, names, who):
        calls.append((builders, names, who))
        return {name: f"module {name}" for name in names}

    monkeypatch.setattr(harness, "build_variants", fake_build_variants)
    monkeypatch.setenv(harness.OTHER_CSRC_ENV, "unset")
    new, old = type("New", (), {}), type("Old", (), {})
    assert harness.new_and_old_builds(new, old, None, "op/op.cu", "who") == {"new": "module new"}
    assert calls[-1] == ({"new": new, "old": old}, ["new"], "who")
    assert os.environ[harness.OTHER_CSRC_ENV] == "unset"
    with pytest.raises(SystemExit, match="holds no op/op.cu"):
        harness.new_and_old_builds(new, old, tmp_path, "op/op.cu", "who")
    (tmp_path / "op").mkdir()
    (tmp_path / "op" / "op.cu").write_text("")
    assert set(harness.new_and_old_builds(new, old, tmp_path, "op/op.cu", "who")) == {"new", "old"}
    assert calls[-1][1] == ["new", "old"] and os.environ[harness.OTHER_CSRC_ENV] == str(tmp_path.resolve())

    args = harness.ab_parser("First line.\nMore.").parse_args(["--old-csrc", "t/csrc", "--out", "r.json"])
    assert (args.old_csrc, args.out, args.repeats) == (Path("t/csrc"), Path("r.json"), 50)
    assert harness.ab_parser("x", repeats=7).parse_args([]).repeats == 7


def test_smi_samples_collects_what_nvidia_smi_prints_while_the_block_runs(tmp_path, monkeypatch):
    """benchmarks.harness.smi_samples (diagnose_moe, diagnose_overlap): nvidia-smi is asked for the fields, at the
    period, in the format given, and its lines reach the yielded list when the block ends (a stand-in nvidia-smi
    on PATH echoes its arguments, then a reading every 20 ms until terminated)."""
    import os
    import time

    from benchmarks.harness import smi_samples

    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/usr/bin/env bash\necho "args: $*"\nwhile true; do echo "1980, 612.5"; sleep 0.02; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with smi_samples(period_ms=20) as samples:
        time.sleep(0.5)
        assert samples == []  # filled only when the block ends
    assert samples[0] == "args: --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 20"
    assert len(samples) > 3 and set(samples[1:]) == {"1980, 612.5"}
    with smi_samples("clocks.sm,power.draw,temperature.gpu", units=True) as samples:
        time.sleep(0.2)
    assert samples[0] == "args: --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 50"


def test_overlap_warm_up_runs_the_load_for_the_time_asked(monkeypatch):
    """benchmarks.diagnose_overlap.warm_up keeps calling the workload, waiting for the GPU after each call, until
    the time asked has passed, so each mode's timed repeats start at the sustained load's power and clocks whatever
    one call costs (a warm-up counted in repeats lasted ~0.3 s and left the first mode's power window starting
    from idle). A fake clock that each call moves on by 0.25 s, and a counter for the GPU wait."""
    import torch

    from benchmarks import diagnose_overlap

    now, waits = [100.0], []

    def work():
        now[0] += 0.25

    monkeypatch.setattr(diagnose_overlap.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: waits.append(now[0]))
    assert diagnose_overlap.warm_up(work, 1.0) == 4  # stops at the first call that ends past the second
    assert waits == [100.25, 100.5, 100.75, 101.0]  # one GPU wait after each call, before the clock decides
    assert diagnose_overlap.warm_up(work, 0.0) == 1  # always at least one call
    assert diagnose_overlap.warm_up(work, 0.3) == 2


GPU_ONLY = ["ab_rmsnorm_bits", "bench_norm_swiglu", "bench_qkv", "diagnose_adamw", "diagnose_cross_entropy",
            "diagnose_dispatch", "diagnose_e2e_levers", "diagnose_grouped_gemm", "diagnose_moe", "diagnose_residual",
            "diagnose_routing", "profile_moe", "profile_ops", "ncu_kernels"]


@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_only_scripts_answer_help_and_say_they_need_a_gpu(name, monkeypatch, capsys):
    """On a machine without a GPU these died in a CUDA-initialisation traceback, or in "builds failed ... set
    TORCH_CUDA_ARCH_LIST" (with it set: after minutes of CUDA builds); profile_ops and ncu_kernels took --help as a
    run. Each now answers --help and exits with a line naming the GPU it needs."""
    import importlib

    import torch

    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr("sys.argv", [name, "--help"])
    with pytest.raises(SystemExit) as info:
        module.main()
    assert info.value.code == 0 and "usage:" in capsys.readouterr().out
    if torch.cuda.is_available():
        return
    monkeypatch.setattr("sys.argv", [name] + (["--old-csrc", "csrc"] if name == "ab_rmsnorm_bits" else []))
    with pytest.raises(SystemExit) as info:
        module.main()
    assert "needs a CUDA GPU" in str(info.value.code)


def test_skip_swiglu_replays_every_moe_layers_swiglu_and_restores_the_op(monkeypatch):
    """diagnose_e2e_levers' skip_swiglu times the model with its MoE layers' SwiGLU replayed from a real call: in
    the replayed step every layer's call is replayed (the op never runs), the gradients still reach every trained
    parameter, the real step runs the op in every layer, and the module's swiglu_dropout is put back afterwards,
    also when a step raises."""
    from pathlib import Path

    import torch

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "launch"))
    import bench_e2e
    import train

    import ds_loongforge.modules.moe as moe
    from benchmarks import diagnose_e2e_levers as levers
    from ds_loongforge.integrations.inject import inject

    torch.manual_seed(0)
    model = train.build_model("tiny", 32000, 32)
    inject(model, bench_e2e.make_ds_config(False, 2, "text"))
    layers = sum(isinstance(m, moe.ExpertMaskedMoE) for m in model.modules())
    assert layers >= 2
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    calls = []
    original = moe.swiglu_dropout

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(moe, "swiglu_dropout", counted)
    monkeypatch.setattr(levers, "_kernel_ms", lambda run, iters: ({"swiglu_fwd_kernel": 0.25, "gemm": 1.0}, 2))
    ran = {}

    class Timer:
        repeats = 7

        def interleaved_times(self, fns):
            out = {}
            assert self.repeats == 3  # the lever's rounds
            for name, fn in fns.items():
                model.zero_grad(set_to_none=True)
                calls.clear()
                fn()
                ran[name] = len(calls)
                assert moe.swiglu_dropout is counted
                assert all(p.grad is not None for p in model.parameters() if p.requires_grad), name
                out[name] = [1.0 + (name == "real")] * self.repeats
            return out

    timer = Timer()
    result = levers.skip_swiglu(model, ids, timer, rounds=3)
    assert ran == {"real": layers, "skipped": 0}
    assert result["swiglu_calls_replayed_per_step"] == layers
    assert result["rounds"] == 3 and result["saved_ms_median_of_paired"] == 1.0
    assert result["swiglu_kernels_ms_per_step_real"] == {"swiglu_fwd_kernel": 0.25}
    assert timer.repeats == 7 and moe.swiglu_dropout is counted  # the timer's own repeats put back

    def failing(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(model, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        levers.skip_swiglu(model, ids, timer, rounds=3)
    assert moe.swiglu_dropout is counted
