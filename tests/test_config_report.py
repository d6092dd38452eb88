"""The "loongforge" config block and loongforge_report."""

import os
import re
import subprocess
import sys

import pytest
import torch

from ds_loongforge import report
from ds_loongforge.config import LoongForgeConfigError, parse_config
from ds_loongforge.ops.numerics import CheckResult


def test_absent_block_is_disabled():
    cfg = parse_config({"train_batch_size": 8})
    assert cfg.enabled is False and cfg.strict_ops is False and cfg.fused_kernels.rmsnorm is True


def test_unknown_key_names_key_and_value():
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.fused_kernel = \{'rmsnorm': True\}: unknown key; "
                       r"did you mean 'fused_kernels'\? loongforge allows enabled, .*, profiler"):
        parse_config({"loongforge": {"fused_kernel": {"rmsnorm": True}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.fused_kernels\.rmsnrom = False: unknown key; did you "
                       r"mean 'rmsnorm'\? loongforge\.fused_kernels allows rmsnorm, swiglu, qkv, "):
        parse_config({"loongforge": {"enabled": True, "fused_kernels": {"rmsnrom": False}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.moe\.zzz = 1: unknown key; loongforge\.moe allows "):
        parse_config({"loongforge": {"moe": {"zzz": 1}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.fused_kernels\.swiglu = 'maybe'"):
        parse_config({"loongforge": {"fused_kernels": {"swiglu": "maybe"}}})
    with pytest.raises(LoongForgeConfigError, match="must be a JSON object"):
        parse_config({"loongforge": True})


@pytest.mark.parametrize("block, key", [
    ({"enabled": "yes"}, "loongforge.enabled = 'yes'"),           # lax pydantic would take it as true
    ({"fused_kernels": {"rmsnorm": "no"}}, "loongforge.fused_kernels.rmsnorm = 'no'"),
    ({"fused_kernels": {"swiglu": 0}}, "loongforge.fused_kernels.swiglu = 0"),
    ({"moe": {"ep_size": "2"}}, "loongforge.moe.ep_size = '2'"),
    ({"moe": {"ep_size": 2.0}}, "loongforge.moe.ep_size = 2.0"),
    ({"moe": {"aux_loss_coef": float("inf")}}, "loongforge.moe.aux_loss_coef = inf"),
    ({"moe": {"all_to_all_buffer_factor": float("nan")}}, "loongforge.moe.all_to_all_buffer_factor = nan"),
    ({"sampler": {"seed": -1}}, "loongforge.sampler.seed = -1"),             # k-means' random_state range, checked
    ({"sampler": {"seed": 2**32}}, "loongforge.sampler.seed = 4294967296"),  # here, not after the model is built
])
def test_values_of_another_type_or_not_finite_are_errors(block, key):
    """Every field takes its own JSON type only (a string "no" is not false) and no inf/nan."""
    with pytest.raises(LoongForgeConfigError, match=re.escape(key)):
        parse_config({"loongforge": block})


def test_floats_take_integers():
    cfg = parse_config({"loongforge": {"moe": {"all_to_all_buffer_factor": 2, "aux_loss_coef": 0}}})
    assert cfg.moe.all_to_all_buffer_factor == 2.0 and cfg.moe.aux_loss_coef == 0.0


def test_report_lists_every_op_and_versions():
    out = subprocess.run([sys.executable, "-m", "ds_loongforge.report"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name in ("lf_fused_rmsnorm", "lf_fused_rmsnorm_cpu", "lf_fused_swiglu", "lf_fused_swiglu_cpu"):
        assert name in out.stdout
    for key in ("torch:", "torch CUDA:", "nvcc:", "NCCL:", "DeepSpeed:", "transformers:", "liger-kernel:", "GPU:"):
        assert key in out.stdout
    # a CUDA op is compatible where it compiles; whether it can run here is its own column (a user read "compatible
    # yes" on a machine without a GPU as "works here")
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith("lf_")}
    import torch

    assert rows["lf_fused_rmsnorm_cpu"][1:4] == ["cpu", "yes", "yes"]
    if not torch.cuda.is_available():
        assert rows["lf_fused_rmsnorm"][1] == "cuda" and rows["lf_fused_rmsnorm"][3] == "no"
        assert "runs here: no CUDA device is visible, so the compatible CUDA ops compile here" in out.stdout


def test_report_shows_the_extensions_dir_the_builders_use(tmp_path):
    """TORCH_EXTENSIONS_DIR is where JIT builds go and where the report's "JIT cached" column looks; the report
    showed torch's default root instead."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    out = subprocess.run([sys.executable, "-m", "ds_loongforge.report"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert f"torch extensions dir:   {tmp_path / 'ext'}\n" in out.stdout


def test_report_verify_passes_here():
    out = subprocess.run([sys.executable, "-m", "ds_loongforge.report", "--verify"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "verify: PASSED" in out.stdout
    assert "lf_fused_rmsnorm_cpu     ok" in out.stdout and "lf_fused_swiglu_cpu      ok" in out.stdout
    assert out.stdout.count("fused_kernels.qkv        ok") == 2  # fp32, bf16
    assert "fused_kernels.rope       not run:" in out.stdout  # a Triton kernel: no GPU here


def test_integration_checks_fail_on_wrong_math():
    """The --verify checks of the pieces inject adds can fail: a RoPE that does not rotate, and a q/k/v product
    whose k slice is off by one column."""
    from ds_loongforge.modules import qkv
    from ds_loongforge.ops.numerics import qkv_checks, row_strided_rope_checks

    results = row_strided_rope_checks(2, 5, 4, 2, 16, torch.float32, lambda q, k, cos, sin: (q * 1, k * 1),
                                      device="cpu")
    assert {r.name.rsplit(" ", 1)[1] for r in results if not r.passed} == {"q", "k", "dproduct"}
    results = row_strided_rope_checks(2, 5, 4, 2, 16, torch.float32, _hf_rope_for_check, device="cpu")
    assert all(r.passed for r in results), [r.describe() for r in results]

    original = qkv.QKVProjection.project

    def shifted(self, linear, x):
        out = original(self, linear, x)
        return out.roll(1, dims=-1) if linear is self.linears[1] else out

    qkv.QKVProjection.project = shifted
    try:
        failed = [r for r in qkv_checks(33, 64, 64, 16, torch.float32, "cpu") if not r.passed]
    finally:
        qkv.QKVProjection.project = original
    assert failed and all(r.name.rsplit(" ", 1)[1] in ("k", "dx", "dWk", "dbk") for r in failed)
    assert all(r.passed for r in qkv_checks(33, 64, 64, 16, torch.float32, "cpu"))


def _hf_rope_for_check(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def test_report_verify_exits_nonzero_on_a_failed_check(monkeypatch, capsys):
    monkeypatch.setattr(report.numerics, "checks_for",
                        lambda name, device: [lambda: CheckResult(f"{name} planted failure", 1.0, 0.5)])
    assert report.main(["--verify"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_report_verify_seed_draws_the_same_data_again(monkeypatch, capsys):
    """verify prints the seed it drew its data from; --seed N draws that data again (a failure by chance can be
    looked at), and each op's checks draw the same data whatever else was built."""
    monkeypatch.setattr(report.numerics, "checks_for",
                        lambda name, device: [lambda: CheckResult(f"{name} draw={torch.rand(1).item()!r}", 0.0, 1.0)])
    monkeypatch.setattr(report.numerics, "integration_checks", lambda device: [])

    def draws(argv):
        assert report.main(argv) == 0
        out = capsys.readouterr().out
        found = dict(re.findall(r"^\s+(\S+)\s+ok\s+\S+ draw=(\S+)", out, flags=re.M))
        assert found, out
        return out, found

    fresh, fresh_draws = draws(["--verify"])
    seed = int(re.search(r"; seed (\d+) ", fresh).group(1))
    assert draws(["--verify", "--seed", str(seed)])[1] == fresh_draws
    assert draws(["--verify", "--seed", str(seed + 1)])[1] != fresh_draws
    assert len(set(fresh_draws.values())) == 1, fresh_draws  # each op starts at the seed's first draw
    with pytest.raises(SystemExit):
        report.main(["--seed", "3"])
    assert "--seed 3 only applies to --verify" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main(["--verify", "--seed", str(2**64)])
    assert "--seed must be in [0, 2**63)" in capsys.readouterr().err


def test_example_configs_parse():
    import json
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json"))
    assert configs
    for path in configs:
        cfg = parse_config(json.loads(path.read_text()))
        assert cfg.enabled, path.name


def test_moe_section_defaults_validation_and_layer_kwargs():
    from ds_loongforge.modules.moe import ExpertMaskedMoE

    moe = parse_config({"loongforge": {"enabled": True}}).moe
    assert moe.all_to_all_buffer_factor == 1.2 and moe.buffer_warmup_steps == 500 and moe.buffer_growth == 0.2
    layer = ExpertMaskedMoE(8, 8, 4, 2, **moe.layer_kwargs())
    assert layer.receive_buffer.factor == 1.2 and layer.gate.mode == "topk" and layer.aux_loss_coef == 0.01
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.moe\.all_to_all_buffer_factor = 0.*greater than 0"):
        parse_config({"loongforge": {"moe": {"all_to_all_buffer_factor": 0}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.moe\.router = 'random'"):
        parse_config({"loongforge": {"moe": {"router": "random"}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.moe\.ep_size = 0"):
        parse_config({"loongforge": {"moe": {"ep_size": 0}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.moe\.overlap_chunks = 0"):
        parse_config({"loongforge": {"moe": {"overlap_chunks": 0}}})
    layer = ExpertMaskedMoE(8, 8, 4, 2, **parse_config({"loongforge": {"moe": {"overlap_chunks": 3}}}).moe.layer_kwargs())
    assert layer.chunk_bounds == [(0, 1), (1, 3), (3, 4)]


def test_sampler_section_defaults_and_validation():
    sampler = parse_config({"loongforge": {"enabled": True}}).sampler
    assert (sampler.expert_aware, sampler.n_clusters, sampler.refresh_every, sampler.signature,
            sampler.pad_to_multiple_of) == (True, 16, 1000, "router", 128)
    cfg = parse_config({"loongforge": {"sampler": {"expert_aware": True, "n_clusters": 4, "refresh_every": 0,
                                                   "signature": "probe"}}}).sampler
    assert cfg.n_clusters == 4 and cfg.refresh_every == 0 and cfg.signature == "probe"
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.sampler\.n_clusters = 0.*greater than or equal to 1"):
        parse_config({"loongforge": {"sampler": {"n_clusters": 0}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.sampler\.refresh_every = -1"):
        parse_config({"loongforge": {"sampler": {"refresh_every": -1}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.sampler\.signature = 'tokens'"):
        parse_config({"loongforge": {"sampler": {"signature": "tokens"}}})
    with pytest.raises(LoongForgeConfigError,
                       match=r"loongforge\.sampler\.n_cluster = 4: unknown key; did you mean 'n_clusters'"):
        parse_config({"loongforge": {"sampler": {"n_cluster": 4}}})


def test_optimizer_section_defaults_and_validation():
    assert parse_config({"loongforge": {"enabled": True}}).optimizer.fused_adamw_clip is False
    assert parse_config({"loongforge": {"optimizer": {"fused_adamw_clip": True}}}).optimizer.fused_adamw_clip
    with pytest.raises(LoongForgeConfigError,
                       match=r"loongforge\.optimizer\.fused_adam = True: unknown key; did you mean 'fused_adamw_clip'"):
        parse_config({"loongforge": {"optimizer": {"fused_adam": True}}})
