"""launch/train.py end to end on CPU, in subprocesses (as users run it).

- LoongForge on (ds_configs/cpu.json): finite losses, MoE layers replaced, checkpoints written; a run resumed
  from the step-4 checkpoint reaches step 6 with the same loss, bit for bit, as the run that never stopped
  (weights, optimizer, step counter and expert-aware sampler position all restored).
- --no-loongforge: the stock transformers model and DeepSpeed optimizer.
- The deepspeed launcher with 2 CPU processes on ds_configs/multi_gpu_ep.json: ZeRO-2 bf16, experts sharded over
  ep_size 2, FusedAdamWClip.
- The corpus helpers and the config flags, in process.
Sizes are cut (sequences of 64 tokens, a few steps) so the file runs in about 2 minutes on 2 cores.
"""

import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "launch" / "train.py"
FAST = ["--seq-len", "64", "--eval-every", "0", "--eval-batches", "2", "--log-every", "2", "--no-progress"]
TIMEOUT_S = 240

sys.path.insert(0, str(TRAIN.parent))
import _corpus  # noqa: E402
import train  # noqa: E402
from tests._dist import free_port  # noqa: E402


def _env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _summary(cmd: list[str], cwd: Path = ROOT, env: dict | None = None) -> dict:
    proc = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-4000:]}")
    # train.py's last line (rank 0's); the deepspeed launcher prints its own lines after it, and another rank's
    # output may land on the same line, before or after it, so the object is decoded where it starts
    start = proc.stdout.rfind('{"steps"')
    assert start >= 0, f"no JSON summary line in the output:\n{proc.stdout[-4000:]}"
    summary, _ = json.JSONDecoder().raw_decode(proc.stdout, start)
    summary["_log"] = proc.stdout + proc.stderr
    return summary


def _train(*args: str) -> dict:
    return _summary([sys.executable, str(TRAIN), *FAST, *args])


def _train_gpu(*args: str) -> dict:
    """train.py on the GPU (DeepSpeed's accelerator detected, not forced to the CPU like _train)."""
    env = _env()
    env.pop("DS_ACCELERATOR")
    return _summary([sys.executable, str(TRAIN), *FAST, *args], env=env)


@pytest.fixture
def launcher() -> Path:
    """DeepSpeed's ``deepspeed`` launcher script, installed beside this Python."""
    path = Path(sys.executable).parent / "deepspeed"
    if not path.exists():
        pytest.skip(f"no deepspeed launcher next to {sys.executable}")
    return path


def _assert_finite(summary: dict) -> None:
    for _, loss in summary["loss_history"]:
        assert math.isfinite(loss) and 0 < loss < 10, summary["loss_history"]
    assert math.isfinite(summary["eval_loss"]), summary["eval_loss"]
    assert summary["tokens_per_s"] > 0


def test_loongforge_run_checkpoint_and_exact_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = _train("--deepspeed_config", "ds_configs/cpu.json", "--steps", "6", "--save-dir", str(ckpt),
                  "--save-every", "2")
    _assert_finite(full)
    assert full["loongforge"] and full["expert_masked_layers"] == 2 and full["expert_aware_sampler"], full
    assert full["steps"] == 6 and [s for s, _ in full["loss_history"]] == [2, 4, 6]
    assert full["loss_history"][-1][1] < full["loss_history"][0][1], full["loss_history"]  # it learns
    assert "[LoongForge]" in full["_log"] and "ExpertMaskedMoE" in full["_log"]
    assert full["routing"]["sparsity"] == pytest.approx(0.75)  # 8 experts, top-2
    assert full["fused_loss"] and "fused linear cross-entropy: lm_head of MixtralForCausalLM" in full["_log"]
    assert {p.name for p in ckpt.iterdir()} >= {"step2", "step4", "step6", "latest"}

    (ckpt / "latest").write_text("step4")  # resume from the middle: the last window must repeat exactly
    resumed = _train("--deepspeed_config", "ds_configs/cpu.json", "--steps", "6", "--save-dir", str(ckpt),
                     "--resume")
    assert resumed["start_step"] == 4 and resumed["steps"] == 6, resumed
    assert "resumed from" in resumed["_log"]
    assert resumed["loss_history"] == [full["loss_history"][-1]], (resumed["loss_history"], full["loss_history"])
    assert resumed["eval_loss"] == full["eval_loss"]


def test_resume_with_fused_adamw_clip_repeats_every_step_bit_for_bit(tmp_path):
    """With FusedAdamWClip a resumed run repeats every later step of the uninterrupted one exactly (the README says
    so). DeepSpeed's CPU FusedAdam, cpu.json's optimizer, drifts by an ulp from the second resumed step on (stock
    DeepSpeed alike), so this checks the block's optimizer, three steps past the checkpoint."""
    config = json.loads((ROOT / "ds_configs" / "cpu.json").read_text())
    config["loongforge"]["optimizer"] = {"fused_adamw_clip": True}
    path = tmp_path / "fused_adamw_clip.json"
    path.write_text(json.dumps(config))
    ckpt = tmp_path / "ckpt"
    args = ("--deepspeed_config", str(path), "--steps", "8", "--save-dir", str(ckpt), "--log-every", "1")
    full = _train(*args, "--save-every", "5")
    assert full["optimizer"] == "FusedAdamWClip" and [s for s, _ in full["loss_history"]] == list(range(1, 9))
    (ckpt / "latest").write_text("step5")
    resumed = _train(*args, "--resume")
    assert resumed["start_step"] == 5
    assert resumed["loss_history"] == full["loss_history"][5:], (resumed["loss_history"], full["loss_history"])
    assert resumed["eval_loss"] == full["eval_loss"]


def test_fused_loss_trains_like_the_unfused_loss(tmp_path):
    """The same LoongForge run with fused_kernels.linear_cross_entropy off: the same losses (fp32 on CPU: only
    the summation order differs), so the fused LM head + cross-entropy changes nothing the model learns."""
    config = json.loads((ROOT / "ds_configs" / "cpu.json").read_text())
    config["loongforge"]["fused_kernels"]["linear_cross_entropy"] = False
    unfused_cfg = tmp_path / "unfused.json"
    unfused_cfg.write_text(json.dumps(config))
    fused = _train("--deepspeed_config", "ds_configs/cpu.json", "--steps", "4")
    unfused = _train("--deepspeed_config", str(unfused_cfg), "--steps", "4")
    assert fused["fused_loss"] and not unfused["fused_loss"]
    assert "fused_kernels.linear_cross_entropy is false" in unfused["_log"]
    assert [s for s, _ in fused["loss_history"]] == [s for s, _ in unfused["loss_history"]] == [2, 4]
    for (_, a), (_, b) in zip(fused["loss_history"], unfused["loss_history"]):
        assert a == pytest.approx(b, rel=1e-4), (fused["loss_history"], unfused["loss_history"])
    assert fused["eval_loss"] == pytest.approx(unfused["eval_loss"], rel=1e-4)
    # bench_e2e's loongforge-stock-order: LoongForge on the stock data order
    plain_order = _train("--deepspeed_config", "ds_configs/cpu.json", "--steps", "2", "--no-expert-aware-sampler")
    assert plain_order["loongforge"] and plain_order["fused_loss"] and not plain_order["expert_aware_sampler"]
    assert fused["expert_aware_sampler"]
    assert plain_order["loss_history"][0][1] != fused["loss_history"][0][1]  # other batches


def test_compiled_run_trains_like_the_eager_run():
    """--compile (DeepSpeed's engine.compile, inductor) on the default CPU job: the fp32 MoE layers' per-expert loop
    and every kernel are custom ops in the compiled graph. The losses are the eager run's to fp32 summation order
    (under compile the q/k/v projections run as three GEMMs)."""
    eager = _train("--deepspeed_config", "ds_configs/cpu.json", "--steps", "4")
    compiled = _train("--deepspeed_config", "ds_configs/cpu.json", "--steps", "4", "--compile")
    assert compiled["loongforge"] and compiled["expert_masked_layers"] == eager["expert_masked_layers"] > 0
    assert [s for s, _ in compiled["loss_history"]] == [s for s, _ in eager["loss_history"]] == [2, 4]
    for (_, a), (_, b) in zip(compiled["loss_history"], eager["loss_history"]):
        assert a == pytest.approx(b, rel=1e-4), (compiled["loss_history"], eager["loss_history"])
    assert compiled["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-4)


def test_no_loongforge_runs_stock(tmp_path):
    summary = _train("--deepspeed_config", "ds_configs/cpu.json", "--steps", "2", "--no-loongforge")
    _assert_finite(summary)
    assert not summary["loongforge"] and summary["expert_masked_layers"] == 0 and not summary["expert_aware_sampler"]
    assert not summary["fused_loss"]
    assert "ExpertMaskedMoE:" not in summary["_log"]
    assert summary["variant"] == "stock" and summary["data"] == "text"
    # no --timing: no per-step synchronize, so no step times (tokens/s still comes from the loop's wall time)
    assert summary["step_times"] == [] and summary["median_step_s_last_half"] is None and summary["mfu"] is None


def test_deepspeed_launcher_two_cpu_processes_expert_parallel(tmp_path, launcher):
    # 57 held-out sequences and up to 8 eval batches a rank: split by rank alone, rank 0 got one batch more than
    # rank 1 and waited in its expert-parallel exchange while rank 1 was in the eval loss's all-reduce (a hang)
    ckpt = tmp_path / "ckpt"
    summary = _summary([str(launcher), "--num_gpus", "2", "--master_port", str(free_port()), str(TRAIN), *FAST,
                        "--deepspeed_config", "ds_configs/multi_gpu_ep.json", "--steps", "2", "--max-documents", "30",
                        "--eval-fraction", "0.1", "--eval-batches", "8", "--save-dir", str(ckpt)])
    assert "57 eval sequences" in summary["_log"]
    _assert_finite(summary)
    assert summary["world_size"] == 2 and summary["zero_stage"] == 2 and summary["bf16"], summary
    assert summary["optimizer"] == "FusedAdamWClip", summary["optimizer"]
    assert "DeepSpeedExpertMaskedMoE: 2 modules" in summary["_log"]

    # the expert-parallel checkpoint out as a transformers model: every expert, fp32 masters (tests/test_export.py
    # checks them bit for bit against DeepSpeed's own assembly)
    proc = subprocess.run([sys.executable, "-m", "ds_loongforge.export", str(ckpt), str(tmp_path / "hf")], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["model"] == "MixtralForCausalLM"
    from transformers import MixtralForCausalLM

    model, info = MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == model.config.num_local_experts

    # and on from there in one process (ep_size 1): the exported folder is the starting point
    resumed = _train("--deepspeed_config", "ds_configs/cpu.json", "--model", str(tmp_path / "hf"), "--steps", "1",
                     "--max-documents", "30")
    assert f"model: weights from {tmp_path / 'hf'} (model.safetensors)" in resumed["_log"]
    assert math.isfinite(resumed["loss_history"][0][1])


def test_deepspeed_launcher_two_cpu_processes_zero3(tmp_path, launcher):
    """ZeRO-3 through the launcher: the model is built partitioned under deepspeed.zero.Init (its weights loaded from
    a model folder into the shards), the expert-aware sampler's routing signatures read the partitioned embedding
    and routers (gathered for the snapshot; before, an IndexError on their empty data), and the fused LM head's
    weight is gathered for the whole forward (no call falls back to the logits). From the same weights, the model
    built whole (--no-zero-init, partitioned by deepspeed.initialize) trains to the same losses bit for bit."""
    config = json.loads((ROOT / "ds_configs" / "cpu.json").read_text())
    config["zero_optimization"] = {"stage": 3}
    config["loongforge"]["sampler"] = {"refresh_every": 2, "cache_dir": str(tmp_path / "signatures")}
    (tmp_path / "zero3.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    train.build_model("tiny", _corpus.build_tokenizer(None).vocab_size, 64).save_pretrained(tmp_path / "tiny")

    def run(*extra: str) -> dict:
        return _summary([str(launcher), "--num_gpus", "2", "--master_port", str(free_port()), str(TRAIN), *FAST,
                         "--deepspeed_config", str(tmp_path / "zero3.json"), "--model", str(tmp_path / "tiny"),
                         "--steps", "4", "--max-documents", "30", *extra])

    summary = run("--save-dir", str(tmp_path / "ckpt"))
    _assert_finite(summary)
    assert summary["world_size"] == 2 and summary["zero_stage"] == 3 and summary["zero_init"], summary
    assert "built partitioned under deepspeed.zero.Init" in summary["_log"]
    assert "expert-aware sampler: step 2" in summary["_log"] and "ExpertMaskedMoE: 2 modules" in summary["_log"]
    assert "fused linear cross-entropy: lm_head of" in summary["_log"]
    assert "runs the original forward" not in summary["_log"]
    # the parameter count is the whole model's, not a shard's (the FLOPs per token likewise)
    whole = run("--no-zero-init")
    assert not whole["zero_init"] and "built partitioned" not in whole["_log"]
    assert summary["params"] == whole["params"] > 0
    assert summary["model_flops_per_token"] == whole["model_flops_per_token"] > 0
    assert summary["loss_history"] == whole["loss_history"] and summary["eval_loss"] == whole["eval_loss"]


def test_resume_at_another_world_size_and_ep_size(tmp_path, launcher):
    """Saved by 2 processes at ep_size 2, resumed by 4 at ep_size 4: DeepSpeed loads the module, and
    ds_loongforge.checkpoint rebuilds the optimizer state for the new partitions (tests/test_checkpoint.py checks
    it bit for bit); the data position carries over: the expert-aware sampler (multi_gpu_ep.json's) deals the
    epoch's unused samples over the 4 ranks (tests/data/test_sampler.py checks every sample is drawn once), and
    without it the position is the same prefix of the epoch's permutation. Then one process at ep_size 1 (every
    expert unsharded, as on one GPU) resumes the 4-rank checkpoint, and 2 processes at ep_size 2 resume its."""
    config = json.loads((ROOT / "ds_configs" / "multi_gpu_ep.json").read_text())
    config["loongforge"]["moe"]["ep_size"] = 4
    (tmp_path / "ep4.json").write_text(json.dumps(config))
    ckpt = tmp_path / "ckpt"

    def run(world: int, cfg: str, steps: int, *extra: str) -> dict:
        return _summary([str(launcher), "--num_gpus", str(world), "--master_port", str(free_port()), str(TRAIN),
                         *FAST, "--deepspeed_config", cfg, "--steps", str(steps), "--max-documents", "30",
                         "--save-dir", str(ckpt), *extra])

    saved = run(2, "ds_configs/multi_gpu_ep.json", 3)
    resumed = run(4, str(tmp_path / "ep4.json"), 4, "--resume")
    assert saved["world_size"] == 2 and resumed["world_size"] == 4 and resumed["start_step"] == 3, resumed
    assert saved["expert_aware_sampler"] and resumed["expert_aware_sampler"]
    assert f"{ckpt / 'step3'}: saved by 2 ranks (expert groups at ep_size [2]), loaded at 4 ranks" in resumed["_log"]
    assert "epoch 0 resumed at step 3 on 4 ranks (saved on 2)" in resumed["_log"]
    assert "(epoch 0, batch 3)" in resumed["_log"]
    _assert_finite(resumed)
    # and on one process at ep_size 1 (plain ExpertMaskedMoE layers, every expert unsharded), as on one GPU:
    # the experts come from the per-expert files, the optimizer state is rebuilt, the sampler deals the rest
    config["loongforge"]["moe"]["ep_size"] = 1
    (tmp_path / "ep1.json").write_text(json.dumps(config))
    single = run(1, str(tmp_path / "ep1.json"), 5, "--resume")
    assert single["world_size"] == 1 and single["start_step"] == 4 and single["expert_masked_layers"] > 0, single
    assert (f"{ckpt / 'step4'}: saved by 4 ranks (expert groups at ep_size [4]), loaded at 1 ranks with every expert "
            "unsharded") in single["_log"]
    assert "epoch 0 resumed at step 4 on 1 ranks (saved on 4)" in single["_log"]
    _assert_finite(single)
    # and back: that unsharded checkpoint (every expert in the model file) resumed by 2 processes at ep_size 2
    back = run(2, "ds_configs/multi_gpu_ep.json", 6, "--resume")
    assert back["start_step"] == 5, back
    assert (f"{ckpt / 'step5'}: saved by 1 ranks with every expert unsharded, loaded at 2 ranks with expert "
            "parallelism") in back["_log"]
    _assert_finite(back)
    # without the sampler: 3 steps x 2 ranks = 6 micro-batches of the epoch used, 1 a rank at 4 ranks and the
    # last 2 read again
    shutil.rmtree(ckpt)
    run(2, "ds_configs/multi_gpu_ep.json", 3, "--no-expert-aware-sampler")
    resumed = run(4, str(tmp_path / "ep4.json"), 4, "--resume", "--no-expert-aware-sampler")
    assert "the 6 micro-batches used of epoch 0 do not split over 4 ranks; the last 2 are read again" in \
        resumed["_log"]
    assert "(epoch 0, batch 1)" in resumed["_log"]
    _assert_finite(resumed)


def test_random_data_resumed_with_more_steps_continues_the_same_run(tmp_path):
    """--data random used to size its corpus by --steps, so a run resumed with a larger --steps (how a run is
    continued) read another dataset: the expert-aware sampler refused the state, DeepSpeed's sampler went on with
    other batches. 2 steps, then resumed to 4, repeats the run that took 4 at once, bit for bit."""
    config = json.loads((ROOT / "ds_configs" / "cpu.json").read_text())
    config["loongforge"]["optimizer"] = {"fused_adamw_clip": True}  # exact resume (see the test above)
    path = tmp_path / "fused_adamw_clip.json"
    path.write_text(json.dumps(config))
    args = ("--deepspeed_config", str(path), "--data", "random", "--log-every", "1")
    full = _train(*args, "--steps", "4")
    _train(*args, "--steps", "2", "--save-dir", str(tmp_path / "ckpt"))
    resumed = _train(*args, "--steps", "4", "--save-dir", str(tmp_path / "ckpt"), "--resume")
    assert resumed["start_step"] == 2
    assert resumed["loss_history"] == full["loss_history"][2:], (resumed["loss_history"], full["loss_history"])


def test_a_checkpoint_of_another_training_set_is_refused(tmp_path):
    """The data position of a checkpoint is an epoch's order over its training set: read over another set (other
    --max-documents, --seq-len ...) it would silently pick other samples, so it is an error naming the options."""
    from torch.utils.data import DataLoader

    stream = train.BatchStream(DataLoader(list(range(10)), batch_size=2), expert_aware=False)
    state = stream.state_dict()
    assert state["num_samples"] == 10
    other = train.BatchStream(DataLoader(list(range(12)), batch_size=2), expert_aware=False)
    with pytest.raises(ValueError, match="training set of 10 sequences, this run's has 12"):
        other.load_state_dict(state)
    other.load_state_dict({"epoch": 1, "consumed": 2})  # a state saved before the count was kept
    assert (other.epoch, other.consumed) == (1, 2)


@pytest.mark.parametrize("flag, value", [("--log-every", "0"), ("--save-every", "-1"), ("--eval-every", "-2"),
                                         ("--threads", "0")])
def test_bad_counts_are_errors_before_anything_runs(flag, value, capsys):
    """--log-every 0 used to fail with a ZeroDivisionError after the model was built and a step taken."""
    with pytest.raises(SystemExit):
        train.parse_args(["--deepspeed_config", "ds_configs/cpu.json", flag, value])
    assert f"{flag} must be >=" in capsys.readouterr().err


def test_data_position_at_another_world_size_is_the_same_prefix():
    """Without the expert-aware sampler the ranks have used a prefix of the epoch's permutation; at another world
    size the position is the same prefix (rounded down when it does not split)."""
    from torch.utils.data import DistributedSampler

    samples, micro = list(range(97)), 3

    def used(world: int, consumed: int) -> set:
        return {i for rank in range(world)
                for i in list(DistributedSampler(samples, world, rank, seed=5, drop_last=True))[:consumed * micro]}

    state = {"epoch": 2, "consumed": 4}
    for saved_world, world in ((2, 4), (4, 2), (3, 2), (2, 3), (4, 4)):
        moved = train.data_state_for_world(state, saved_world, world, warn=False)
        assert moved["epoch"] == 2
        if (4 * saved_world) % world == 0:
            assert used(world, moved["consumed"]) == used(saved_world, 4), (saved_world, world)
        else:  # rounded down: a prefix of what was used, short of it by less than a step of the new world
            assert used(world, moved["consumed"]) < used(saved_world, 4)
            assert len(used(saved_world, 4)) - len(used(world, moved["consumed"])) < world * micro
    # the expert-aware sampler's state moves itself (its load_state_dict): the position stays
    for saved_world, world in ((2, 4), (2, 2)):
        assert train.data_state_for_world({**state, "sampler": {}}, saved_world, world) == {**state, "sampler": {}}


def test_model_folder_with_weights_is_the_starting_point(tmp_path):
    model = train.build_model("tiny", 259, 64)
    model.save_pretrained(tmp_path / "weights")
    loaded = train.build_model(str(tmp_path / "weights"), 259, 64)
    # in train() mode, as built from a config (from_pretrained returns eval(): the fused loss, router jitter and
    # dropout were off until the first evaluation switched the model back)
    assert all(m.training for m in loaded.modules())
    state = loaded.state_dict()
    assert state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    model.config.save_pretrained(tmp_path / "config")  # a config alone: a fresh initialisation
    fresh = train.build_model(str(tmp_path / "config"), 259, 64)
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)


# --- in process ------------------------------------------------------------------------------------------------

def test_pack_holds_out_whole_documents():
    tok = _corpus.ByteTokenizer()
    docs = ["alpha " * 40, "beta " * 40, "gamma " * 40, "delta " * 40]
    corpus = _corpus.pack(docs, tok, seq_len=16, eval_fraction=0.25, source="test")
    assert all(len(row["input_ids"]) == 16 for row in corpus.train + corpus.eval)
    assert all(max(row["input_ids"]) < tok.vocab_size for row in corpus.train)
    assert "delta" in tok.decode(corpus.eval[0]["input_ids"])
    assert not any("delta" in tok.decode(row["input_ids"]) for row in corpus.train)
    with pytest.raises(ValueError, match="seq-len"):
        _corpus.pack(docs, tok, seq_len=1000, eval_fraction=0.25, source="test")


def test_tensor_rows_collate_to_the_same_batches():
    from ds_loongforge.data import PadCollator

    tok = _corpus.ByteTokenizer()
    corpus = _corpus.pack(["alpha " * 40, "beta " * 40, "gamma " * 40], tok, seq_len=16, eval_fraction=0.3,
                          source="test")
    tensors = _corpus.with_tensor_rows(corpus)
    assert (len(tensors.train), len(tensors.eval), tensors.tokens) == (len(corpus.train), len(corpus.eval),
                                                                        corpus.tokens)
    for row, lists in zip(tensors.train + tensors.eval, corpus.train + corpus.eval):
        assert row["input_ids"].dtype == torch.long and row["input_ids"].tolist() == lists["input_ids"]
    collate = PadCollator(tok.pad_token_id, pad_to_multiple_of=8)
    a, b = collate(tensors.train[:3]), collate(corpus.train[:3])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pydoc_corpus_is_offline_english():
    docs = _corpus.pydoc_documents()
    assert len(docs) > 50 and sum(map(len, docs)) > 100_000
    assert "the" in docs[0].lower()


def test_home_relative_paths_are_expanded(tmp_path, monkeypatch):
    """--dataset=~/corpus.txt (no shell expansion after '=', or quoted) was "no such file or folder" for a file that
    exists; --model/--save-dir/... got a literal "~" folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus.txt").write_text("one\ntwo\n")
    assert _corpus.dataset_documents("~/corpus.txt") == ["one", "two"]
    args = train.parse_args(["--deepspeed_config=~/ds.json", "--model=~/model", "--dataset=~/corpus.txt",
                             "--tokenizer=~/tok", "--save-dir=~/ckpt", "--kernel-trace=~/trace.json"])
    for name in ("deepspeed_config", "model", "dataset", "tokenizer", "save_dir", "kernel_trace"):
        assert getattr(args, name).startswith(str(tmp_path) + os.sep), (name, getattr(args, name))
    assert train.parse_args(["--deepspeed_config", "c.json"]).model == "tiny"


def test_local_text_dataset(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line of text\nsecond line\n\nthird\n")
    assert _corpus.dataset_documents(str(path)) == ["first line of text", "second line", "third"]
    with pytest.raises(ValueError, match="text column"):
        _corpus.dataset_documents(str(path), column="body")
    # errors name the option they came from (datasets' own messages do not)
    with pytest.raises(FileNotFoundError, match=r"--dataset '.*missing\.txt': no such file or folder"):
        _corpus.dataset_documents(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match=r"--dataset '.*empty': the datasets library could not load it"):
        _corpus.dataset_documents(str(tmp_path / "empty"))


@pytest.mark.parametrize("flag, expected", [(None, True), (True, True), (False, False)])
def test_loongforge_flags(tmp_path, flag, expected):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"optimizer": {"type": "LoongForgeAdamW", "params": {"lr": 1e-3}},
                                  "loongforge": {"enabled": True}}))
    ds_config, enabled = train.load_ds_config(str(config), flag)
    assert enabled is expected and ds_config["loongforge"]["enabled"] is expected
    assert ds_config["optimizer"]["type"] == ("LoongForgeAdamW" if expected else "AdamW")  # stock = stock optimizer


@pytest.mark.parametrize("flag", [None, True])
def test_env_opt_out_runs_the_stock_variant(tmp_path, monkeypatch, caplog, flag):
    """LOONGFORGE_DISABLE opts out here as in any DeepSpeed script (a user found train.py injecting anyway and
    reporting the run as the loongforge variant)."""
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"optimizer": {"type": "LoongForgeAdamW", "params": {"lr": 1e-3}},
                                  "loongforge": {"enabled": True}}))
    monkeypatch.setenv("LOONGFORGE_DISABLE", "1")
    with caplog.at_level(logging.WARNING, logger="ds_loongforge.train"):
        ds_config, enabled = train.load_ds_config(str(config), flag)
    assert enabled is False and ds_config["loongforge"]["enabled"] is False
    assert ds_config["optimizer"]["type"] == "AdamW" and train.variant_name(ds_config, enabled) != "loongforge"
    assert "LOONGFORGE_DISABLE=1: LoongForge is off for this run" in caplog.text


def test_zero_init_outside_zero3_is_an_error(monkeypatch):
    for key, value in (("RANK", "0"), ("DS_ACCELERATOR", "cpu")):  # main() sets these when they are unset
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r'--zero-init builds the model partitioned for ZeRO stage 3; '
                       r'ds_configs/cpu.json has "zero_optimization": \{"stage": 0\}'):
        train.main(["--deepspeed_config", "ds_configs/cpu.json", "--zero-init"])


def test_bad_config_block_names_the_key(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"loongforge": {"enabled": True, "moe": {"ep_sise": 2}}}))
    with pytest.raises(ValueError, match="ep_sise"):
        train.load_ds_config(str(config), None)


@pytest.mark.gpu
def test_memory_phases_on_cuda(tmp_path):
    """--memory-phases records allocated and peak memory around forward, backward and the optimizer step of
    step 2 (GPU only: the counters are CUDA's); the overall peak still covers them."""
    got = _train_gpu("--deepspeed_config", "ds_configs/1gpu_zero2_bf16.json", "--steps", "3", "--memory-phases",
                     "--timing")
    phases = [m["phase"] for m in got["memory_phases"]]
    assert phases == ["until forward 0", "forward 0", "backward 0", "step 0"], phases
    assert all(m["peak_gib"] >= m["allocated_gib"] > 0 for m in got["memory_phases"])
    # the forward keeps activations for backward: allocated memory grows across it
    assert got["memory_phases"][1]["allocated_gib"] > got["memory_phases"][0]["allocated_gib"]
    assert got["peak_memory_gib"] >= max(m["peak_gib"] for m in got["memory_phases"])


@pytest.mark.gpu
def test_kernel_profile_and_memory_snapshot_on_cuda(tmp_path):
    """--kernel-profile splits the GPU kernel time of the profiled steps by phase and category (GEMMs inside the
    forward, and in the backward, which autograd's thread launches outside the main thread's ranges; the optimizer
    step's own kernels inside "step"); --memory-snapshot replays step 2's
    allocations to their peak, which matches the peak the CUDA counters saw within the allocator's rounding."""
    got = _train_gpu("--deepspeed_config", "ds_configs/1gpu_zero2_bf16.json", "--steps", "4", "--kernel-profile",
                     "2", "--memory-snapshot", "--memory-phases")
    k = got["kernels"]
    assert k["steps"] == [3, 4], k["steps"]
    # step 2 is the profiler's warm-up: the kernels it launched that the GPU ran inside the window are left out
    assert k["kernels_launched_before_window"] is not None, "no kernel paired with its launch"
    assert k["kernels_per_iter"] > 10 and 0 < k["busy_ms_per_iter"] <= k["span_ms_per_iter"]
    ranges = k["range_category_ms_per_iter"]
    # with the fused linear cross-entropy (on in this config) the loss is computed inside the forward: what is
    # left in "loss" is the scaling of the family's balancing term (a few scalar kernels), no GEMM or reduction
    assert got["fused_loss"] and not {"gemm", "reduction"} & set(ranges.get("loss", {})), ranges.get("loss")
    assert {"forward", "backward", "step"} <= set(ranges), sorted(ranges)
    # the backward's kernels are launched by autograd's device thread, outside the main thread's "backward" range:
    # kernel_timeline files them under "(none)" (on the H200 at df0b48c the range held only the loss gradient's fill)
    backward_gemm = ranges["backward"].get("gemm", 0) + ranges.get("(none)", {}).get("gemm", 0)
    assert ranges["forward"].get("gemm", 0) > 0 and backward_gemm > 0, ranges
    assert abs(sum(v["total"] for v in ranges.values()) - sum(k["category_ms_per_iter"].values())) < 1e-2
    m = got["memory_at_peak"]
    assert m["events"] > 0 and m["peak_above_baseline_gib"] > 0 and m["live_at_peak"]
    phase_peak = max(p["peak_gib"] for p in got["memory_phases"])
    assert abs(m["peak_gib"] - phase_peak) <= 0.05 * phase_peak + 0.01, (m["peak_gib"], phase_peak)


@pytest.mark.gpu
def test_kernel_trace_reports_the_idle_gaps_on_cuda(tmp_path):
    """--kernel-trace writes the profiled steps' chrome trace and reports its longest idle gaps with the launch of
    the work after each; --kernel-profile-device-only records no host ops (so no phase ranges), but still the CUDA
    API calls that tie each kernel to its launch."""
    for device_only in (False, True):
        trace = tmp_path / f"trace_{device_only}.json.gz"
        got = _train_gpu("--deepspeed_config", "ds_configs/1gpu_zero2_bf16.json", "--steps", "4",
                         "--kernel-profile", "2", "--kernel-trace", str(trace),
                         *(["--kernel-profile-device-only"] if device_only else []))
        k = got["kernels"]
        assert trace.stat().st_size > 0 and k["kernels_per_iter"] > 10
        gaps = k["trace_gaps"]
        assert gaps and all(g["gap_us"] > 50 for g in gaps), gaps
        assert all("launch_after_gap_start_us" in g for g in gaps), gaps  # every kernel's launch was recorded
        host_ops = {h["name"] for g in gaps for h in g["host"]} - {"cudaLaunchKernel", "cudaLaunchKernelExC"}
        if device_only:
            assert "forward" not in k["range_category_ms_per_iter"], k["range_category_ms_per_iter"]
            assert not any(g["launch_stack"] for g in gaps), gaps  # no host op recorded around a launch
        else:
            assert {"forward", "backward"} <= set(k["range_category_ms_per_iter"]) and host_ops, gaps


@pytest.mark.gpu
def test_training_step_makes_no_host_sync_on_cuda():
    """--sync-debug on a LoongForge step of unpadded batches (random tokens fill every row) finds no place where
    the host waits for the device: the all-ones attention mask is dropped on the host (transformers would read it
    back in every forward), and the MoE layer, the fused loss, FusedAdamWClip and the ZeRO-2 step need no host
    value. Step 3 is not a --log-every step (the loss read-back is the loop's one sync by design). Sequences of
    128 tokens: the training collator pads to a multiple of 128, so shorter ones would carry padding and a mask."""
    got = _train_gpu("--deepspeed_config", "ds_configs/1gpu_zero2_bf16.json", "--steps", "4", "--data", "random",
                     "--seq-len", "128", "--log-every", "4", "--sync-debug", "--use-loongforge")
    assert got["optimizer"] == "FusedAdamWClip" and got["fused_loss"], (got["optimizer"], got["fused_loss"])
    syncs = got["host_syncs"]
    assert syncs["step"] == 3 and syncs["cuda"], syncs
    assert syncs["count"] == 0, syncs["sites"]


def test_device_batches_drop_a_mask_without_padding():
    """A batch without padding reaches the model without its attention mask (the same math for a causal LM, and
    no host sync in transformers' mask path); a padded batch keeps its mask. The token count is the host's."""
    ids = torch.randint(0, 100, (2, 8))
    full = {"input_ids": ids, "attention_mask": torch.ones(2, 8, dtype=torch.long), "labels": ids}
    padded = dict(full, attention_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))
    batches = train.device_batches(iter([full, padded, full]), torch.device("cpu"))
    (first, n_first), (second, n_second) = next(batches), next(batches)
    assert "attention_mask" not in first and n_first == 16 and first["input_ids"] is ids
    assert torch.equal(second["attention_mask"], padded["attention_mask"]) and n_second == 13


def test_no_mask_is_an_all_ones_mask_to_a_causal_lm():
    """What the mask drop relies on: a causal LM's logits and family balancing loss are the same without a mask
    as with an all-ones one (transformers drops the latter itself, after reading it back)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=4, num_experts_per_tok=2,
                                             output_router_logits=True)).eval()
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        masked = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        unmasked = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(unmasked.logits, masked.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(unmasked.aux_loss, masked.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(unmasked.loss, masked.loss, rtol=1e-6, atol=1e-7)


def test_kernel_profile_window():
    assert train.kernel_profile_window(0, 0, 100) is None
    assert train.kernel_profile_window(3, 0, 100) == (6, 8)
    assert train.kernel_profile_window(3, 0, 5) == (3, 5)  # a short run: its last steps, never the first
    assert train.kernel_profile_window(5, 0, 4) == (2, 4)
    assert train.kernel_profile_window(2, 10, 20) == (16, 17)  # a resumed run counts from its start
    assert train.kernel_profile_window(3, 0, 1) is None


@pytest.mark.parametrize("use_lf", [False, True])
def test_kernel_profile_ranges_cover_attention_mlp_and_router(use_lf):
    """--kernel-profile's model ranges: every decoder layer's attention and MLP/MoE block, and the MoE router
    nested in the block, for stock transformers modules and for LoongForge's injected ones."""
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=4, num_experts_per_tok=2))
    if use_lf:
        from ds_loongforge.integrations.inject import inject

        inject(model, {"loongforge": {"enabled": True, "fused_kernels": {"rmsnorm": True, "swiglu": True}}})
    handles = train.annotate_model_parts(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=torch.randint(0, 64, (1, 8)))
    names = [e.name for e in prof.events()]
    assert (names.count("attention"), names.count("mlp"), names.count("router")) == (2, 2, 2), use_lf
    for handle in handles:
        handle.remove()
