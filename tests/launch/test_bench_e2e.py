"""launch/bench_e2e.py (the end-to-end A/B benchmark) and train.py's benchmark mode, on CPU.

- One bench_e2e run on the tiny shape (4 steps of 4 x 64 tokens): stock and LoongForge both produce numbers,
  a variant forced to fail (a bad --model) is recorded with its error while the others still run, and the
  JSON, markdown table (with the speedup column) and PNG are written.
- train.py --timing --data random: the per-step timing fields and the random-token corpus.
- The comparison logic (best stock baseline, targets) and config helpers, in process.
About 40 s on 2 cores.
"""

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from tests.launch.test_train import _assert_finite, _train

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))
import _corpus  # noqa: E402
import bench_e2e  # noqa: E402
import train  # noqa: E402


def test_bench_e2e_tiny_writes_results_and_survives_a_failing_variant(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench_e2e.VARIANTS, "broken", ["--model", "no_such_model"])  # train.py raises ValueError
    monkeypatch.setitem(bench_e2e.DESCRIPTIONS, "broken", "forced to fail")
    monkeypatch.setenv("LF_COMMIT", "abcdef0123456789")
    out = tmp_path / "results"
    run = bench_e2e.main(["--shape", "tiny", "--steps", "4", "--seq-len", "64", "--eval-batches", "2",
                          "--variants", "stock,broken,loongforge", "--out", str(out),
                          "--log-dir", str(tmp_path / "logs")])
    name = "bench_e2e_tiny_abcdef0"
    assert {p.name for p in out.iterdir()} == {f"{name}.json", f"{name}.md", f"{name}.png"}
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / f"{name}.png").stat().st_size > 10_000  # three drawn panels, not an empty canvas

    data = json.loads((out / f"{name}.json").read_text())
    assert data["env"]["commit"] == "abcdef0123456789" and data["env"]["torch"] == torch.__version__
    assert data["ds_config"]["zero_optimization"]["stage"] == 0 and "bf16" not in data["ds_config"]
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["stock", "broken", "loongforge"]
    stock, broken, ours = rows["stock"], rows["broken"], rows["loongforge"]

    assert broken["status"] == "failed: exit 1", broken["status"]
    assert "no_such_model" in broken["error"] and "no_such_model" in broken["stderr_tail"]
    assert broken["tokens_per_s"] is None and broken["speedup_vs_best_stock"] is None

    for row, variant in ((stock, "stock"), (ours, "loongforge")):
        summary = row["train_summary"]
        assert row["status"] == "ok" and summary["variant"] == variant, row["status"]
        assert len(row["step_times"]) == 4 and all(t > 0 for t in row["step_times"])
        assert [s for s, _ in row["loss_history"]] == [1, 2, 3, 4]  # one loss per step
        assert row["median_step_ms"] == pytest.approx(1e3 * statistics.median(row["step_times"][2:]), rel=1e-3)
        assert row["tokens_per_s"] == pytest.approx(4 * 64 / (row["median_step_ms"] / 1e3), rel=1e-3)
        assert math.isfinite(row["eval_loss"]) and 0 < row["final_loss"] < 10
        assert row["mfu"] is None and row["peak_gib"] is None  # CPU: no peak rate, no CUDA allocator
    assert stock["train_summary"]["expert_masked_layers"] == 0
    assert ours["train_summary"]["expert_masked_layers"] == 2
    assert ours["train_summary"]["expert_aware_sampler"]  # text data: the sampler is on
    assert stock["speedup_vs_best_stock"] == pytest.approx(1.0)
    assert ours["speedup_vs_best_stock"] == pytest.approx(ours["tokens_per_s"] / stock["tokens_per_s"])
    assert stock["loss_diff_vs_stock_pct"] == 0.0
    assert ours["loss_diff_vs_stock_pct"] == pytest.approx(
        100 * (ours["eval_loss"] - stock["eval_loss"]) / stock["eval_loss"])
    assert set(ours["targets"]) == {"loss within 0.3%"}  # tiny: no speed target; CPU: no memory target
    assert data["baselines"] == {"best_stock": "stock", "loss_reference": "stock", "lowest_stock_peak_gib": None,
                                 "stock_eval_loss_spread_pct": None}  # one stock variant: no spread

    md = (out / f"{name}.md").read_text()
    assert "| variant | median step ms | tokens/s | speedup vs best stock |" in md
    assert f"| {ours['speedup_vs_best_stock']:.2f}x |" in md and "| 1.00x |" in md
    assert "| broken |" in md and "failed: exit 1" in md
    printed = capsys.readouterr().out
    assert "| loongforge |" in printed and "[broken] failed: exit 1" in printed
    assert run["paths"][0] == out / f"{name}.json"


@pytest.mark.parametrize("mode", [[], ["sync"]], ids=["events", "sync"])
def test_train_timing_and_random_data(mode):
    summary = _train("--deepspeed_config", "ds_configs/cpu.json", "--steps", "4", "--no-loongforge", "--timing",
                     *mode, "--data", "random", "--log-every", "1")
    _assert_finite(summary)
    assert summary["variant"] == "stock" and summary["data"] == "random"
    assert summary["timing"] == (mode[0] if mode else "events")
    # every step's loss, kept on the device and read after the loop, equals the per-step log (--log-every 1)
    assert summary["step_losses"] == pytest.approx([v for _, v in summary["loss_history"]], rel=1e-5)
    assert "random tokens (uniform over 259 ids, seed 1234)" in summary["_log"]
    times = summary["step_times"]
    assert len(times) == 4 and all(t > 0 for t in times)
    assert summary["median_step_s_last_half"] == pytest.approx(statistics.median(times[2:]), rel=1e-4)
    assert summary["tokens_per_s_median"] == pytest.approx(4 * 64 / summary["median_step_s_last_half"])
    assert summary["mfu"] is None and summary["peak_memory_gib"] is None and summary["peak_flops"] is None
    assert summary["model_flops_per_token"] == 6 * summary["active_params_per_token"] + 12 * 2 * 128 * 64
    # uniform random ids: nothing to learn, the loss stays at ln(vocab) (text drops below it within steps)
    for _, loss in summary["loss_history"]:
        assert loss == pytest.approx(math.log(259), abs=0.15)


# --- in process ------------------------------------------------------------------------------------------------

def test_random_tokens_are_seeded_and_span_the_vocabulary():
    a = _corpus.random_tokens(32000, 16, num_train=40, num_eval=8, seed=7)
    b = _corpus.random_tokens(32000, 16, num_train=40, num_eval=8, seed=7)
    c = _corpus.random_tokens(32000, 16, num_train=40, num_eval=8, seed=8)
    assert a.train == b.train and a.eval == b.eval and a.train != c.train
    assert len(a.train) == 40 and len(a.eval) == 8 and all(len(r["input_ids"]) == 16 for r in a.train + a.eval)
    ids = [i for r in a.train for i in r["input_ids"]]
    assert min(ids) >= 0 and max(ids) < 32000 and max(ids) > 256  # the whole vocabulary, not only byte ids
    with pytest.raises(ValueError, match="num_eval >= 1.*0"):
        _corpus.random_tokens(32000, 16, num_train=4, num_eval=0, seed=0)


def test_model_flops_count_experts_at_k_over_e():
    model = train.build_model("tiny", 259, 64)
    # one model definition for every variant: transformers' balancing loss on, as the stock model trains
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == train.PRESET_AUX_LOSS_COEF
    flops, active = train.model_flops_per_token(model, seq_len=64)
    H, I, L, kv_dim, E, K, V = 128, 256, 2, 64, 8, 2, 259
    per_layer = (2 * H * H + 2 * H * kv_dim) + E * H + E * 3 * H * I * K / E + 2 * H  # attn, router, experts, norms
    assert active == L * per_layer + H + V * H  # + final norm + LM head; the input embedding is not counted
    assert flops == 6 * active + 12 * L * H * 64


def test_step_timing_median_over_last_half():
    timing = train.step_timing([9.0, 5.0, 0.5, 0.2, 0.3, 0.4], [100] * 6, flops_per_token=1e9,
                               total_peak_flops=1e12)
    assert timing["median_step_s_last_half"] == pytest.approx(0.3)  # of [0.2, 0.3, 0.4]
    assert timing["tokens_per_s_median"] == pytest.approx(100 / 0.3)
    assert timing["mfu"] == pytest.approx(100 / 0.3 * 1e9 / 1e12)
    empty = train.step_timing([], [100, 100], 1e9, 1e12)
    assert empty["step_times"] == [] and empty["median_step_s_last_half"] is None and empty["mfu"] is None


def test_autoep_flag_adds_the_block_and_excludes_loongforge(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "loongforge": {"enabled": True}}))
    args = train.parse_args(["--deepspeed_config", str(config), "--autoep"])
    assert args.loongforge is False
    ds_config, enabled = train.load_ds_config(str(config), args.loongforge, autoep=True)
    assert not enabled and ds_config["expert_parallel"] == train.AUTOEP_BLOCK
    assert train.variant_name(ds_config, enabled) == "autoep"
    with pytest.raises(SystemExit):
        train.parse_args(["--deepspeed_config", str(config), "--autoep", "--use-loongforge"])
    config.write_text(json.dumps({"loongforge": {"enabled": True}, "expert_parallel": {"enabled": True}}))
    with pytest.raises(ValueError, match="AutoEP"):
        train.load_ds_config(str(config), None)


def _row(variant, tokens_per_s, peak, eval_loss):
    return bench_e2e.VariantResult(variant, status="ok", tokens_per_s=tokens_per_s, peak_gib=peak,
                                   eval_loss=eval_loss)


@pytest.mark.parametrize("data", ["text", "random"])
def test_compare_uses_the_faster_stock_variant(data):
    rows = [_row("stock", 50.0, 30.0, 2.000), _row("autoep", 55.0, 34.0, 2.010),
            bench_e2e.VariantResult("broken", status="failed: exit 1"), _row("loongforge", 130.0, 29.0, 2.004)]
    baselines = bench_e2e.compare(rows, bench_e2e.SHAPES["mixtral"], data)
    assert baselines == {"best_stock": "autoep", "loss_reference": "stock", "lowest_stock_peak_gib": 30.0,
                         "stock_eval_loss_spread_pct": pytest.approx(0.5)}
    ours = rows[-1]
    assert ours.speedup_vs_best_stock == pytest.approx(130 / 55)
    assert rows[0].speedup_vs_best_stock == pytest.approx(50 / 55)
    assert ours.loss_diff_vs_stock_pct == pytest.approx(0.2)
    expected = {"speed >= 2.3x": True, "memory <= best stock": True}
    if data == "text":
        expected["loss within 0.3%"] = True
    assert ours.targets == expected and rows[0].targets == {}
    assert rows[2].speedup_vs_best_stock is None
    rows[-1] = _row("loongforge", 120.0, 31.0, 2.008)
    bench_e2e.compare(rows, bench_e2e.SHAPES["mixtral"], "text")
    assert rows[-1].targets == {"speed >= 2.3x": False, "memory <= best stock": False, "loss within 0.3%": False}
    assert bench_e2e._targets_cell(rows[-1]).startswith("no (")
    # LoongForge on stock's batches is judged like the LoongForge row
    rows.append(_row("loongforge-stock-order", 131.0, 29.5, 1.999))
    bench_e2e.compare(rows, bench_e2e.SHAPES["mixtral"], "text")
    assert rows[-1].targets == {"speed >= 2.3x": True, "memory <= best stock": True, "loss within 0.3%": True}


def test_bench_e2e_config_and_arguments():
    gpu = bench_e2e.make_ds_config(gpu=True, micro_batch=4, data="text")
    assert gpu["bf16"] == {"enabled": True} and gpu["zero_optimization"]["stage"] == 2
    assert gpu["gradient_clipping"] == 1.0 and gpu["optimizer"]["params"] == {"lr": 1e-4, "weight_decay": 0.01}
    assert gpu["loongforge"]["optimizer"]["fused_adamw_clip"] and gpu["loongforge"]["sampler"]["expert_aware"]
    assert gpu["loongforge"]["strict_ops"]
    cpu = bench_e2e.make_ds_config(gpu=False, micro_batch=4, data="random")
    assert "bf16" not in cpu and cpu["zero_optimization"]["stage"] == 0
    assert not cpu["loongforge"]["sampler"]["expert_aware"]
    from ds_loongforge.config import parse_config

    parse_config(gpu)  # the generated block is valid
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--shape", "mixtral", "--variants", "stock,deepspeed_moe"])
    args = bench_e2e.parse_args(["--shape", "finegrained"])
    assert args.variant_names == ["stock", "autoep", "loongforge", "loongforge-stock-order"] and args.steps == 100
    args = bench_e2e.parse_args(["--shape", "finegrained", "--data", "random"])
    assert args.variant_names == ["stock", "autoep", "loongforge"]
    # the compiled variants run only when named, and compiled stock is a baseline like the other stock variants
    args = bench_e2e.parse_args(["--shape", "mixtral", "--variants", "stock-compiled,loongforge-compiled"])
    assert args.variant_names == ["stock-compiled", "loongforge-compiled"]
    assert bench_e2e.VARIANTS["loongforge-compiled"][-1] == "--compile"
    assert "stock-compiled" in bench_e2e.STOCK_VARIANTS and "loongforge-compiled" not in bench_e2e.STOCK_VARIANTS
