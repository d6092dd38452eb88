"""FusedAdamWClip inside DeepSpeed (CPU accelerator, gloo): ZeRO-0, 1, 2 and 3 (fp32) and ZeRO-2 and 3 bf16 with 2
processes give the parameters and global norms of plain PyTorch (torch.optim.AdamW + clip_grad_norm_) on the
whole global batch, with two parameter groups, one step whose gradients are nan (skipped everywhere), and a
checkpoint whose resumed next step is bitwise identical. Also the config plumbing and its errors (single
process, no dist)."""


import pytest
import torch
from torch import nn

import deepspeed  # noqa: E402  (an install requirement: a missing one must fail, not skip)
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer  # noqa: E402

from ds_loongforge.optim import (FusedAdamWClip, deepspeed_config_for, deepspeed_optimizer,  # noqa: E402
                                 uses_fused_adamw_clip)
from tests._dist import init_cpu_rank, spawn_with_deadline  # noqa: E402

IN, HID, OUT = 8, 16, 4
ROWS = 6           # per rank and step
CLIP = 0.05        # below the gradient norms here: every finite step clips
STEPS = 5
NAN_STEP = 2       # rank 0's input is nan on this step: every rank must skip it
LR, WD = 0.02, 0.1
# Adam's eps, 1e-4 instead of the default 1e-8. Adam steps an entry by about lr * g / (|g| + eps), and ranks summing
# their gradients round otherwise than one backward over the global batch (~1e-10 here, clipped gradients ~3e-3):
# with eps 1e-8 an entry whose gradient lies within ~2e-7 of 0 takes a different first step by more than atol 1e-6,
# up to 2 lr where the sign flips. An emulation of the world-2 fp32 comparison (per-rank mean gradients averaged,
# FusedAdamWClip against torch AdamW + clip_grad_norm_ on the global batch) failed 7 of 2000 seeds (3.5e-3, the worst
# 110x the tolerance). With eps 1e-4 the step moves at most lr / eps = 200 per unit of gradient, 6e-8 for an error of
# 3e-10: 1000 seeds' worst was 0.09 of the tolerance. A wrong eps (or one put inside the root) is off by
# ~lr * eps / |g| ~ 6e-4, a wrong moment or decay by O(lr).
EPS = 1e-4
SPAWN_TIMEOUT_S = 240
RESUMED_RUNS = [(2, False), (2, True), (3, False), (3, True)]  # checkpointed one step before the end and resumed
# (ZeRO stage, bf16); ZeRO-0 bf16 runs as ZeRO-1
RUNS = [(0, False), (1, False), (2, False), (2, True), (0, True), (3, False), (3, True)]
# ZeRO-3: a sub-group closes once its partitions reach 30 elements, which splits the weights' group (128 + 64, per
# rank 64 + 32 in a world of 2) in two and leaves the biases' (16 + 4) whole, so one param group has two fp32
# partitions; fp32 keeps DeepSpeed's persistence threshold (every parameter here stays gathered and is
# re-gathered after the step), bf16 sets it to 0 (every parameter partitioned, gathered by the forward)
SUB_GROUP_SIZE = 30


def _spawn(fn, world: int, *args) -> None:
    spawn_with_deadline(fn, world, *args, timeout_s=SPAWN_TIMEOUT_S)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def _groups(model: nn.Module, **extra):
    """weights decay, biases do not (and step faster): two groups with different hyper-parameters"""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [dict(params=weights, weight_decay=WD, **extra), dict(params=biases, weight_decay=0.0, lr=2 * LR, **extra)]


def _batches(world: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(world, ROWS, IN, generator=g), torch.randn(world, ROWS, OUT, generator=g))
               for _ in range(STEPS)]
    batches[NAN_STEP][0][0, 0, 0] = float("nan")
    return batches


def _loss(model, x, target):
    return (model(x) - target).pow(2).mean()


def _config(stage: int, by_block: bool = False, bf16: bool = False) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["sub_group_size"] = SUB_GROUP_SIZE
        if bf16:
            zero["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "zero_optimization": zero, "steps_per_print": 10**9, "bf16": {"enabled": bf16},
              "optimizer": {"type": "LoongForgeAdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.95],
                                                                  "eps": EPS, "impl": "cpu"}}}
    if by_block:
        config["optimizer"]["type"] = "AdamW"
        config["loongforge"] = {"enabled": True, "optimizer": {"fused_adamw_clip": True}}
    return config


def _gathered(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters as fp32 copies, gathered first under ZeRO-3 (a no-op for other stages)."""
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return [p.detach().float().clone() for p in model.parameters()]


def _worker(rank, world, port, seed, out_dir):
    init_cpu_rank(rank, world, port)
    from ds_loongforge.optim import initialize

    batches = _batches(world, seed)
    results = {}
    # in one process, also each ZeRO-2 run with DeepSpeed's division by 1 and the one-tensor norm all-reduce
    # restored ("full"): skipping them must change no bit
    runs = RUNS + ([("full", 2, False), ("full", 2, True)] if world == 1 else [])
    for run in runs:
        full = run[0] == "full"
        stage, bf16 = run[-2:]
        model = _model(seed)
        engine, _, _, _ = initialize(model=model, model_parameters=_groups(model),
                                     config=_config(stage, by_block=stage == 2, bf16=bf16))
        assert isinstance(engine.basic_optimizer, FusedAdamWClip) and engine.gradient_clipping() == 0.0
        assert engine.zero_optimization_stage() == (1 if run == (0, True) else stage)
        # listed with ZeRO: DeepSpeed's "ZeRO with an untested optimizer, proceed with caution" is not logged
        assert is_zero_supported_optimizer(engine.basic_optimizer)
        if engine.zero_optimization_stage() == 3:
            zero = engine.optimizer
            assert len(zero.fp16_groups) == 3 and list(zero.sub_group_to_group_id.values()) == [0, 0, 1], \
                "the weights' group is two ZeRO-3 sub-groups"
            assert all(fp32.grad is None for fp32 in zero.fp32_partitioned_groups_flat)
            assert (engine.basic_optimizer.stats_hook is None) == (world == 1)
        if engine.zero_optimization_stage() in (1, 2):
            # what ZeRO saves in every optimizer file and restores over the config on load: the optimizer's
            # max_norm, not the 0 DeepSpeed runs with (a resume with DeepSpeed's optimizer lost clipping)
            assert engine.optimizer.state_dict()["clip_grad"] == CLIP
        if engine.zero_optimization_stage() in (1, 2):
            zero = engine.optimizer
            assert zero.gradient_average == (world > 1), "the division by 1 is skipped only in one process"
            assert (engine.basic_optimizer.stats_hook is None) == (world == 1)
            assert getattr(zero, "_loongforge_gradients_in_place", False) == (world == 1)
            if full:
                from ds_loongforge.optim.ds_integration import _world_all_reduce, restore_gradient_copies

                zero.gradient_average, engine.basic_optimizer.stats_hook = True, _world_all_reduce
                restore_gradient_copies(zero)
        cast = torch.bfloat16 if bf16 else torch.float32
        norms, params = [], []
        for step, (x, target) in enumerate(batches):
            engine.backward(_loss(engine, x[rank].to(cast), target[rank].to(cast)))
            engine.step()
            if stage == 3:
                assert all(fp32.grad is None for fp32 in engine.optimizer.fp32_partitioned_groups_flat)
            norms.append(engine.get_global_grad_norm().clone())
            params.append(_gathered(model))
            if run in RESUMED_RUNS and step == STEPS - 2:
                engine.save_checkpoint(f"{out_dir}/ckpt{int(bf16)}", tag="t")
        results[run] = {"norms": norms, "params": params, "skipped": engine.basic_optimizer.skipped_steps,
                        "engine_skipped": engine.skipped_steps}
        if run in RESUMED_RUNS:  # resume from the checkpoint taken one step before the end, redo the last step
            fresh = _model(seed + 99)
            engine2, *_ = initialize(model=fresh, model_parameters=_groups(fresh), config=_config(stage, bf16=bf16))
            engine2.load_checkpoint(f"{out_dir}/ckpt{int(bf16)}", tag="t")
            results["resumed_skipped", run] = engine2.skipped_steps  # the checkpoint's count (1), before a step
            x, target = batches[-1]
            engine2.backward(_loss(engine2, x[rank].to(cast), target[rank].to(cast)))
            engine2.step()
            results["resumed", run] = _gathered(fresh)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _torch_reference(seed: int, world: int):
    model = _model(seed)
    ref_opt = torch.optim.AdamW(_groups(model), lr=LR, betas=(0.9, 0.95), eps=EPS)
    norms, params = [], []
    for x, target in _batches(world, seed):
        ref_opt.zero_grad()
        # the mean over the global batch: the average of the ranks' means (equal micro-batches)
        _loss(model, x.reshape(-1, IN), target.reshape(-1, OUT)).backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if finite:
            ref_opt.step()
        norms.append(norm)
        params.append([p.detach().clone() for p in model.parameters()])
    return norms, params


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1])
def test_zero0_1_2_equal_torch_on_the_global_batch(tmp_path, world):
    seed = int(torch.randint(0, 2**31, ()))
    _spawn(_worker, world, seed, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    ref_norms, ref_params = _torch_reference(seed, world)
    for run in RUNS:
        # fp32: summation order only. bf16: the model runs in bf16 (fp32 masters), so grads carry bf16 error, and
        # Adam's normalised update (~lr) of a near-zero grad can flip sign: most elements must agree to 1e-2
        norm_rtol = 5e-2 if run[1] else 1e-5
        for r in range(world):
            got = ranks[r][run]
            assert got["skipped"] == 1 and got["engine_skipped"] == 1
            for step in range(STEPS):
                if step == NAN_STEP:
                    assert not torch.isfinite(got["norms"][step])
                else:
                    torch.testing.assert_close(got["norms"][step], ref_norms[step], rtol=norm_rtol, atol=0)
                if run[1]:
                    diff = torch.cat([(a - b).flatten() for a, b in zip(got["params"][step], ref_params[step])])
                    assert (diff.abs() <= 1e-2).float().mean() >= 0.9, (run, step, diff.abs().max())
                else:
                    for a, b in zip(got["params"][step], ref_params[step]):
                        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            # the nan step changed nothing
            for a, b in zip(got["params"][NAN_STEP], got["params"][NAN_STEP - 1]):
                assert torch.equal(a, b)
    if world == 1:  # DeepSpeed's division by 1, the norm's one-process all-reduce and its gradient copies
        # (into the reduce bucket, then the partition buffer) skipped: bitwise the same
        for stage_bf16 in [(2, False), (2, True)]:
            full, fast = ranks[0][("full", *stage_bf16)], ranks[0][stage_bf16]
            for step in range(STEPS):
                assert torch.equal(full["norms"][step], fast["norms"][step]) or step == NAN_STEP
                for a, b in zip(full["params"][step], fast["params"][step]):
                    assert torch.equal(a, b), (stage_bf16, step)
    for r in range(world):
        for run in RESUMED_RUNS:  # fp32, bf16 (the kernel writes the fp32 and bf16 partitions in place); ZeRO-2, 3
            assert ranks[r]["resumed_skipped", run] == 1
            for a, b in zip(ranks[r]["resumed", run], ranks[r][run]["params"][-1]):
                assert torch.equal(a, b), run


def test_config_selects_and_builds_the_optimizer():
    model = _model(0)
    assert uses_fused_adamw_clip(_config(1)) and uses_fused_adamw_clip(_config(1, by_block=True))
    plain = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert not uses_fused_adamw_clip(plain)
    disabled = {"enabled": False, "optimizer": {"fused_adamw_clip": True}}
    assert not uses_fused_adamw_clip(dict(plain, loongforge=disabled))
    opt = deepspeed_optimizer(_groups(model), _config(2))
    assert opt.param_groups[0]["max_norm"] == CLIP and opt.param_groups[0]["betas"] == (0.9, 0.95)
    assert opt.param_groups[0]["eps"] == EPS
    assert opt.param_groups[1]["lr"] == 2 * LR and opt.param_groups[1]["weight_decay"] == 0.0
    ds = deepspeed_config_for(_config(2))
    assert "optimizer" not in ds and ds["gradient_clipping"] == 0.0 and ds["zero_allow_untested_optimizer"]
    no_clip = dict(_config(2), gradient_clipping=0.0)
    assert deepspeed_optimizer(model.parameters(), no_clip).param_groups[0]["max_norm"] is None


def test_config_errors_name_the_value():
    model = _model(0)
    with pytest.raises(ValueError, match=r"unknown \"optimizer\" params \['amsgrad'\]"):
        deepspeed_optimizer(model.parameters(), {"optimizer": {"type": "LoongForgeAdamW",
                                                               "params": {"amsgrad": True}}})
    with pytest.raises(ValueError, match="type is 'Lamb'"):
        deepspeed_optimizer(model.parameters(), {"optimizer": {"type": "Lamb"}})
    with pytest.raises(ValueError, match="asks for Adam"):
        deepspeed_optimizer(model.parameters(), {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    with pytest.raises(ValueError, match="asks for Adam"):
        deepspeed_optimizer(model.parameters(), {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    with pytest.raises(ValueError, match=r"lr must be a float >= 0, got -1"):
        deepspeed_optimizer(model.parameters(), {"optimizer": {"type": "LoongForgeAdamW", "params": {"lr": -1}}})


def test_deepspeed_adam_without_adam_w_mode_is_adamw():
    """DeepSpeed's "Adam" runs AdamW unless adam_w_mode is false (ADAM_W_MODE_DEFAULT = True: "Optimizer name of
    Adam forces AdamW logic unless adam_w_mode is explicitly set", DeepSpeed 0.19.8), as in DeepSpeed's own example
    configs; with fused_adamw_clip it was refused as Adam with L2 weight decay."""
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT

    assert ADAM_W_MODE_DEFAULT is True
    opt = deepspeed_optimizer(_model(0).parameters(), {"gradient_clipping": CLIP, "optimizer": {
        "type": "Adam", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.95], "eps": EPS}}})
    assert isinstance(opt, FusedAdamWClip) and opt.param_groups[0]["weight_decay"] == WD


@pytest.mark.parametrize("zero, problem", [
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, r'"offload_optimizer": \{"device": "cpu"\}'),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, r'"offload_param": \{"device": "cpu"\}'),
    ({"stage": 3, "mics_shard_size": 2}, r'"mics_shard_size": 2 \(MiCS\)'),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, r'"offload_optimizer": \{"device": "cpu"\}')])
def test_a_zero_setup_it_cannot_run_is_refused_before_anything_is_built(zero, problem):
    """Offload and MiCS with fused_adamw_clip: an error naming the setting and the fix, before inject or DeepSpeed
    touch the model (a user found it raised only after DeepSpeed had built the whole engine)."""
    import ds_loongforge

    model = _model(0)
    before = [p.detach().clone() for p in model.parameters()]
    config = {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": zero,
              "loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": True}}}
    with pytest.raises(ValueError, match=r"FusedAdamWClip \(selected by the config\) runs under ZeRO stages 0-3 "
                                         r"without offload or MiCS; the config has " + problem +
                                         r'.*"fused_adamw_clip": false'):
        ds_loongforge.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # the same check where the optimizer is built: ds_loongforge.optim.initialize, the type named in "optimizer"
    from ds_loongforge.optim import initialize

    by_type = {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": zero,
               "optimizer": {"type": "LoongForgeAdamW", "params": {"lr": LR}}}
    with pytest.raises(ValueError, match=r"runs under ZeRO stages 0-3 without offload or MiCS; the config has "
                                         + problem):
        initialize(model=model, model_parameters=model.parameters(), config=by_type)


def test_client_adamw_stands_in_on_its_own_groups():
    """A script's (the HF Trainer's) AdamW under a config that selects FusedAdamWClip without an "optimizer"
    block: FusedAdamWClip is built on the client's own group dicts (hyperparameters per group; an LR scheduler
    built on the client keeps setting the lr FusedAdamWClip reads), with the config's clip."""
    from ds_loongforge.optim.ds_integration import _client_adamw_groups

    model = _model(0)
    config = {"gradient_clipping": CLIP, "loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": True}}}
    client = torch.optim.AdamW(_groups(model), lr=LR, betas=(0.8, 0.9), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 0.5 ** step)
    opt = deepspeed_optimizer(_client_adamw_groups(client, config), config)
    assert opt.param_groups[0] is client.param_groups[0] and opt.param_groups[1] is client.param_groups[1]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["max_norm"] == CLIP
    assert opt.param_groups[1]["lr"] == 2 * LR and opt.param_groups[1]["weight_decay"] == 0.0
    scheduler.step()
    assert opt.param_groups[0]["lr"] == LR / 2 and opt.param_groups[1]["lr"] == LR  # the scheduler sets our lr
    # Adam without weight decay is the same update
    assert _client_adamw_groups(torch.optim.Adam(model.parameters(), lr=LR), config)


@pytest.mark.parametrize("make, why", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "it is not AdamW"),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1), r"param group 0 is Adam with weight_decay=0\.1"),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True), "param group 0 has amsgrad=True"),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1, maximize=True), "param group 0 has maximize=True"),
])
def test_client_optimizer_fused_adamw_clip_cannot_stand_in_for(make, why):
    from ds_loongforge.optim.ds_integration import _client_adamw_groups

    config = {"loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": True}}}
    with pytest.raises(ValueError, match=f"cannot stand in for: {why}.*Set fused_adamw_clip to false"):
        _client_adamw_groups(make(_model(0).parameters()), config)


def test_client_optimizer_with_state_or_beside_a_config_optimizer_is_refused():
    from ds_loongforge.optim.ds_integration import _client_adamw_groups

    model = _model(0)
    client = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r'the DeepSpeed config also names an "optimizer"'):
        _client_adamw_groups(client, _config(1))
    model(torch.randn(3, model[0].in_features)).sum().backward()
    client.step()
    with pytest.raises(ValueError, match="already holds optimizer state"):
        _client_adamw_groups(client, {"loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": True}}})


def test_device_loss_scaler_follows_deepspeeds_dynamic_loss_scaler(monkeypatch):
    """The same overflow sequence through DeepSpeed's host DynamicLossScaler and our device one gives the
    same scale after every step, for hysteresis 1 and 2, with and without consecutive hysteresis."""
    from deepspeed.runtime.fp16 import loss_scaler as ds_scaler

    from ds_loongforge.optim.ds_integration import DeviceLossScaler

    monkeypatch.setattr(ds_scaler.dist, "get_rank", lambda *a, **k: 0)  # its log lines ask for the rank
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for hysteresis, consecutive in [(1, False), (2, False), (2, True), (3, True)]:
        ref = ds_scaler.DynamicLossScaler(init_scale=2.0**10, scale_window=4, min_scale=2.0, delayed_shift=hysteresis,
                                          consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
        ours = DeviceLossScaler.like(ref)
        for step in range(200):
            overflow = bool(torch.rand((), generator=g) < 0.3)
            ref.update_scale(overflow)
            ours.update(torch.tensor([1.0, 1.0 if overflow else 0.0]))
            assert float(ours.cur_scale) == ref.cur_scale, (hysteresis, consecutive, step)
            assert ours.cur_hysteresis == ref.cur_hysteresis and ours.cur_iter == ref.cur_iter
        assert torch.equal(ours.inverse(), 1.0 / ours.cur_scale)
        assert torch.equal(ours.scale_loss(torch.tensor(3.0)), 3.0 * ours.cur_scale)
    with pytest.raises(ValueError, match="scale_window"):
        DeviceLossScaler(init_scale=8.0, scale_window=0)


def test_device_loss_scaler_survives_a_checkpoint_round_trip(tmp_path):
    """DeepSpeed pickles the scaler into the ZeRO checkpoint: it is saved as DeepSpeed's own DynamicLossScaler in
    the same state, so the checkpoint resumes with DeepSpeed's optimizer too (whose step calls update_scale; the
    pickled device scaler had none: AttributeError at the first step) and loads without ds_loongforge; the fused
    step's device twin of it (``like``) has the state back exactly, on the step's device."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from ds_loongforge.optim.ds_integration import DeviceLossScaler

    scaler = DeviceLossScaler(init_scale=2.0**12, scale_window=2, delayed_shift=2, consecutive_hysteresis=True)
    for overflow in (0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0):
        scaler.update(torch.tensor([1.0, overflow]))
    torch.save({"loss_scaler": scaler}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=False)["loss_scaler"]
    assert type(loaded) is DynamicLossScaler and loaded.dynamic
    assert loaded.cur_scale == float(scaler.cur_scale) and loaded.cur_iter == scaler.cur_iter == 7
    assert loaded.cur_hysteresis == scaler.cur_hysteresis and loaded.last_overflow_iter == 6
    assert (loaded.scale_window, loaded.min_scale, loaded.delayed_shift, loaded.consecutive_hysteresis) == (
        2, 1.0, 2, True)
    assert callable(loaded.update_scale)  # what DeepSpeed's own step calls
    again = DeviceLossScaler.like(loaded)
    assert (float(again.cur_scale), again.cur_iter, again.cur_hysteresis) == (
        float(scaler.cur_scale), scaler.cur_iter, scaler.cur_hysteresis)
    if torch.cuda.is_available():
        assert DeviceLossScaler.like(loaded, device="cuda").cur_scale.device.type == "cuda"


IN_PLACE_RUNS = [(1, False, False), (1, True, False), (2, False, False), (2, True, False), (2, True, True)]
ACCUMULATION = 2  # micro-steps per optimizer step


def _in_place_worker(rank, world, port, seed, out_dir):
    """One process, gradient accumulation over 2 micro-steps: each (stage, bf16, overlap_comm) run with the
    gradients read where autograd wrote them, and again with DeepSpeed's copies restored."""
    init_cpu_rank(rank, world, port)
    from ds_loongforge.optim import initialize
    from ds_loongforge.optim.ds_integration import restore_gradient_copies

    g = torch.Generator().manual_seed(seed + 1)
    micro = [(torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g))
             for _ in range(STEPS * ACCUMULATION)]
    results = {}
    for stage, bf16, overlap in IN_PLACE_RUNS:
        for in_place in (True, False):
            model = _model(seed)
            config = _config(stage, by_block=True, bf16=bf16)
            config["gradient_accumulation_steps"] = ACCUMULATION
            config["zero_optimization"]["overlap_comm"] = overlap
            engine, *_ = initialize(model=model, model_parameters=_groups(model), config=config)
            zero = engine.optimizer
            assert zero._loongforge_gradients_in_place
            if not in_place:
                restore_gradient_copies(zero)
            copies = []  # DeepSpeed's per-gradient copy into its reduce bucket, counted
            bucketed = zero.reduce_independent_p_g_buckets_and_remove_grads
            zero.reduce_independent_p_g_buckets_and_remove_grads = lambda *a: (copies.append(1), bucketed(*a))
            cast = torch.bfloat16 if bf16 else torch.float32
            norms, params = [], []
            for n, (x, target) in enumerate(micro):
                engine.backward(_loss(engine, x.to(cast), target.to(cast)))
                engine.step()
                if (n + 1) % ACCUMULATION == 0:
                    norms.append(engine.get_global_grad_norm().clone())
                    params.append([p.detach().float().clone() for p in model.parameters()])
            results[stage, bf16, overlap, in_place] = {"norms": norms, "params": params,
                                                      "bucket_copies": len(copies)}
    torch.save(results, f"{out_dir}/in_place.pt")


@pytest.mark.slow
def test_gradients_in_place_in_one_process_are_bitwise_deepspeeds_copies(tmp_path):
    """In one process ZeRO-1/2 would copy every gradient into its reduce bucket and then into the partition
    buffer; the fused step reads them where autograd wrote them instead. Over 5 optimizer steps of 2
    accumulated micro-steps each, for ZeRO-1 and ZeRO-2, fp32 and bf16, with and without overlap_comm, the
    norms and parameters are bitwise those of DeepSpeed's copying path, and no gradient goes into a bucket."""
    _spawn(_in_place_worker, 1, int(torch.randint(0, 2**31, ())), str(tmp_path))
    results = torch.load(tmp_path / "in_place.pt", weights_only=True)
    for run in IN_PLACE_RUNS:
        fast, copied = results[(*run, True)], results[(*run, False)]
        assert fast["bucket_copies"] == 0, run
        assert copied["bucket_copies"] >= STEPS * 4, "the comparison must run DeepSpeed's copying path"
        for step in range(STEPS):
            assert torch.equal(fast["norms"][step], copied["norms"][step]), (run, step)
            assert torch.isfinite(fast["norms"][step]) and fast["norms"][step] > 0
            for a, b in zip(fast["params"][step], copied["params"][step]):
                assert torch.equal(a, b), (run, step)
        first, last = fast["params"][0], fast["params"][-1]
        assert any(not torch.equal(a, b) for a, b in zip(first, last)), "the parameters must move"


# (ZeRO stage, bf16, where the schedule comes from): DeepSpeed's WarmupLR from the config, or a torch LambdaLR on
# a client AdamW that FusedAdamWClip stands in for (the HF Trainer's way)
SCHEDULE_RUNS = [(2, False, "config"), (1, True, "client"), (0, False, "config")]
SCHEDULE_SAVE_AFTER = NAN_STEP  # a checkpoint right after the skipped step


def _scheduled_engine(stage: int, bf16: bool, source: str, seed: int):
    from ds_loongforge.optim import initialize

    model = _model(seed)
    config = _config(stage, by_block=True, bf16=bf16)
    if source == "config":
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                              "warmup_num_steps": 2 * STEPS, "warmup_type": "linear"}}
        engine, *_ = initialize(model=model, model_parameters=_groups(model), config=config)
    else:
        del config["optimizer"]
        client = torch.optim.AdamW(_groups(model), lr=LR, betas=(0.9, 0.95), eps=EPS)
        schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda step: (step + 1) / (2 * STEPS))
        engine, *_ = initialize(model=model, optimizer=client, lr_scheduler=schedule, config=config)
    assert isinstance(engine.basic_optimizer, FusedAdamWClip) and engine.lr_scheduler is not None
    return model, engine


def record_update_lrs(optimizer: FusedAdamWClip) -> list[list[float]]:
    """The lr of every group as each update takes it (FusedAdamWClip.step_buckets, the one place both its own step
    and the ZeRO glue go through): after a skipped step that is the schedule rolled back, which the param groups
    show only from that next update on."""
    lrs, step_buckets = [], optimizer.step_buckets

    def recording(per_group, *args, **kwargs):
        lrs.append([group["lr"] for group, _ in per_group])
        return step_buckets(per_group, *args, **kwargs)

    optimizer.step_buckets = recording
    return lrs


def _schedule_worker(rank, world, port, seed, out_dir):
    """Each run twice: on every batch, with the nan step in the middle, and on the batches without that step;
    the lr of every update, the parameters after each step and the schedule's state at the end."""
    init_cpu_rank(rank, world, port)
    batches = [(x[0], target[0]) for x, target in _batches(1, seed)]
    clean = batches[:NAN_STEP] + batches[NAN_STEP + 1:]
    results = {}
    for run in SCHEDULE_RUNS:
        cast = torch.bfloat16 if run[1] else torch.float32
        # "saved": the nan run again, with a checkpoint right after the skipped step (which settles the schedule
        # at once, so the plain nan run is the one that checks the rollback at the next update)
        for name, data in (("with_nan", batches), ("clean", clean), ("saved", batches)):
            model, engine = _scheduled_engine(*run, seed)
            lrs, params = record_update_lrs(engine.basic_optimizer), []
            for step, (x, target) in enumerate(data):
                engine.backward(_loss(engine, x.to(cast), target.to(cast)))
                engine.step()
                params.append([p.detach().float().clone() for p in model.parameters()])
                if name == "saved" and step == SCHEDULE_SAVE_AFTER:
                    engine.save_checkpoint(f"{out_dir}/sched_{run[0]}", tag="t")
            results[run, name] = {"lrs": lrs, "params": params, "skipped": engine.skipped_steps,
                                  "schedule": engine.lr_scheduler.state_dict()}
        # resumed from the checkpoint taken right after the skipped step: the rest of the run, as uninterrupted
        model, engine = _scheduled_engine(*run, seed + 99)
        engine.load_checkpoint(f"{out_dir}/sched_{run[0]}", tag="t")
        results[run, "resumed_schedule"] = engine.lr_scheduler.state_dict()
        for x, target in batches[SCHEDULE_SAVE_AFTER + 1:]:
            engine.backward(_loss(engine, x.to(cast), target.to(cast)))
            engine.step()
        results[run, "resumed"] = [p.detach().float().clone() for p in model.parameters()]
    torch.save(results, f"{out_dir}/schedule.pt")


@pytest.mark.slow
def test_a_skipped_step_does_not_advance_the_lr_schedule(tmp_path):
    """DeepSpeed steps the LR schedule only after a step it did not skip. FusedAdamWClip decides the skip on the
    device, so the schedule step of a skipped step is undone before the next update: a run with a nan step in
    the middle takes every later update with the lr, and ends with the parameters and the schedule, of the run
    without that step, bit for bit; a checkpoint saved right after the skipped step holds that schedule too."""
    _spawn(_schedule_worker, 1, int(torch.randint(0, 2**31, ())), str(tmp_path))
    results = torch.load(tmp_path / "schedule.pt", weights_only=False)
    for run in SCHEDULE_RUNS:
        clean = results[run, "clean"]
        assert clean["skipped"] == 0 and len(clean["lrs"]) == STEPS - 1, run
        # (WarmupLR gives its first lr twice: at construction and at its first step, iteration 0)
        assert len({lr[0] for lr in clean["lrs"][1:]}) == STEPS - 2, "the schedule must move at every later step"
        kept = [step for step in range(STEPS) if step != NAN_STEP]
        for name in ("with_nan", "saved"):
            nan = results[run, name]
            assert nan["skipped"] == 1 and len(nan["lrs"]) == STEPS, (run, name)
            assert [nan["lrs"][step] for step in kept] == clean["lrs"], (run, name)
            for a, b in zip(nan["params"][NAN_STEP - 1], nan["params"][NAN_STEP]):
                assert torch.equal(a, b), f"{run}: the nan step changed a parameter"
            for step, clean_step in zip(kept, range(STEPS - 1)):
                for a, b in zip(nan["params"][step], clean["params"][clean_step]):
                    assert torch.equal(a, b), (run, name, step)
            assert nan["schedule"] == clean["schedule"], (run, name)
        assert results[run, "resumed"] is not None
        for a, b in zip(results[run, "resumed"], clean["params"][-1]):
            assert torch.equal(a, b), f"{run}: resumed after the skipped step"


def _elastic_worker(rank, world, port, seed, out_dir, mode):
    """ZeRO-2 bf16 with ``"elastic_checkpoint": true``: "save" trains (the nan step included), saves one step before
    the end and takes the last step; "load" loads that checkpoint and takes the last step.
    Each records its optimizer partitions (fp32 masters, moments, step) without the padding, right after the save or
    the load."""
    init_cpu_rank(rank, world, port)
    from ds_loongforge.optim import initialize

    config = _config(2, bf16=True)
    config["zero_optimization"]["elastic_checkpoint"] = True
    model = _model(seed if mode == "save" else seed + 99)
    engine, *_ = initialize(model=model, model_parameters=_groups(model), config=config)
    zero, optimizer = engine.optimizer, engine.basic_optimizer

    def partitions():
        out = {}
        for i, fp32 in enumerate(zero.single_partition_of_fp32_groups):
            lean = fp32.numel() - zero.groups_padding[i]
            state = optimizer.state[fp32]
            out[i] = {"fp32": fp32[:lean].clone(), "exp_avg": state["exp_avg"][:lean].clone(),
                      "exp_avg_sq": state["exp_avg_sq"][:lean].clone(),
                      "step": state["step"].reshape(()).clone()}  # the elastic load writes it as [1]
        return out

    batches = _batches(world, seed)
    if mode == "save":
        for x, target in batches[:-1]:
            engine.backward(_loss(engine, x[rank].to(torch.bfloat16), target[rank].to(torch.bfloat16)))
            engine.step()
        engine.save_checkpoint(f"{out_dir}/ckpt", tag="t")
    else:
        engine.load_checkpoint(f"{out_dir}/ckpt", tag="t")
    state = partitions()
    x, target = batches[-1]
    engine.backward(_loss(engine, x[rank].to(torch.bfloat16), target[rank].to(torch.bfloat16)))
    engine.step()
    assert all(optimizer.state[fp32]["step"].dim() == 0 for fp32 in zero.single_partition_of_fp32_groups)
    torch.save({"state": state, "params": [p.detach().float().clone() for p in model.parameters()],
                "skipped": engine.skipped_steps}, f"{out_dir}/{mode}{world}_rank{rank}.pt")


def test_elastic_checkpoint_round_trip(tmp_path):
    """DeepSpeed's elastic ZeRO checkpoints record the base optimizer's step from its param groups, where
    FusedAdamWClip keeps none (it counts on the device): such a checkpoint saved but never loaded (a bare assertion
    in DeepSpeed's load). Now it loads with every partition's masters, moments and step count where the saving run
    left them, and the next step is bitwise the uninterrupted run's. (DeepSpeed 0.19.8 loads a ZeRO checkpoint at
    another data-parallel size only as a universal checkpoint, elastic or not.)"""
    seed = int(torch.randint(0, 2**31, ()))
    _spawn(_elastic_worker, 2, seed, str(tmp_path), "save")
    _spawn(_elastic_worker, 2, seed, str(tmp_path), "load")
    saved = [torch.load(tmp_path / f"save2_rank{r}.pt", weights_only=True) for r in range(2)]
    loaded = [torch.load(tmp_path / f"load2_rank{r}.pt", weights_only=True) for r in range(2)]
    for r in range(2):
        for group, want in saved[r]["state"].items():
            assert float(want["step"]) == STEPS - 2  # 4 steps, the nan one skipped
            for key, value in want.items():
                assert torch.equal(loaded[r]["state"][group][key], value), (r, group, key)
        for got, want in zip(loaded[r]["params"], saved[r]["params"]):
            assert torch.equal(got, want)
        assert loaded[r]["skipped"] == saved[r]["skipped"] == 1


@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_with_fp32_gradient_accumulation_below_zero_2_is_refused_before_anything_is_built(stage):
    """bf16 with "data_types": {"grad_accum_dtype": "fp32"} at ZeRO-1 (or ZeRO-0, run as ZeRO-1): DeepSpeed wraps
    the optimizer in its BF16_Optimizer, not ZeRO's, and the user got "FusedAdamWClip supports ZeRO stages 0, 1
    and 2, not 1" once the model was injected and the whole engine built. Now an error naming the fix, up front."""
    import ds_loongforge

    model = _model(0)
    before = [p.detach().clone() for p in model.parameters()]
    config = {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": True}}}
    with pytest.raises(ValueError, match=r'grad_accum_dtype": "fp32"\} runs under ZeRO stage 2 only; the config has '
                                         r'"zero_optimization": \{"stage": ' + str(stage) + r"\}.*fused_adamw_clip"):
        ds_loongforge.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _fp32_accumulation_worker(rank, world, port, seed, out_dir):
    init_cpu_rank(rank, world, port)
    from ds_loongforge.optim import initialize

    g = torch.Generator().manual_seed(seed + 1)
    micro = [(torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)) for _ in range(3 * 3)]
    results = {}
    for fused in (False, True):
        config = _config(2, by_block=fused, bf16=True)
        config.update(gradient_accumulation_steps=3, data_types={"grad_accum_dtype": "fp32"})
        if not fused:  # stock DeepSpeed: torch's AdamW inside ZeRO-2, its own clip
            config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.95],
                                                               "eps": EPS, "torch_adam": True}}
        model = _model(seed)
        engine, *_ = initialize(model=model, model_parameters=_groups(model), config=config)
        assert isinstance(engine.basic_optimizer, FusedAdamWClip) == fused
        norms, masters = [], []
        for n, (x, target) in enumerate(micro):
            engine.backward(_loss(engine, x.to(torch.bfloat16), target.to(torch.bfloat16)))
            engine.step()
            if (n + 1) % 3 == 0:
                norms.append(torch.as_tensor(engine.get_global_grad_norm()).float().clone())
                masters.append([t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups])
        results[fused] = {"norms": norms, "masters": masters}
    torch.save(results, f"{out_dir}/fp32_accumulation.pt")


@pytest.mark.slow
def test_bf16_zero_2_with_fp32_gradient_accumulation_steps_on_the_fp32_gradients(tmp_path):
    """bf16 ZeRO-2 with "data_types": {"grad_accum_dtype": "fp32"}: DeepSpeed accumulates the micro-steps'
    gradients in an fp32 partition and steps on them. The fused step rounded that fp32 sum to bf16 before the
    update (the run was bitwise one without fp32 accumulation; its norms 1e-4 off stock's). Now the kernel reads the
    fp32 gradients: stock DeepSpeed's norms and fp32 masters, 3 micro-steps per step."""
    _spawn(_fp32_accumulation_worker, 1, int(torch.randint(0, 2**31, ())), str(tmp_path))
    results = torch.load(tmp_path / "fp32_accumulation.pt", weights_only=True)
    stock, fused = results[False], results[True]
    for step in range(3):
        torch.testing.assert_close(fused["norms"][step], stock["norms"][step], rtol=1e-6, atol=0)
        for a, b in zip(fused["masters"][step], stock["masters"][step]):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-7)


def _step_applied_worker(rank, world, port, out_dir):
    init_cpu_rank(rank, world, port)
    from ds_loongforge.optim import initialize

    g = torch.Generator().manual_seed(5)
    micro = [(torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)) for _ in range(6)]
    micro[3][0][0, 0] = float("nan")  # the second optimizer step's last micro-step
    results = {}
    for fused, stage in [(False, 2), (True, 2), (True, 0)]:
        config = _config(stage, by_block=fused)
        config["gradient_accumulation_steps"] = 2
        if not fused:
            config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}
        model = _model(0)
        engine, *_ = initialize(model=model, model_parameters=_groups(model), config=config)
        applied, norms = [], []
        for x, target in micro:
            engine.backward(_loss(engine, x, target))
            engine.step()
            applied.append(engine.was_step_applied())
            norms.append(float(engine.get_global_grad_norm() or 0.0))
        results[fused, stage] = applied
        results["norms", fused, stage] = norms
    torch.save(results, f"{out_dir}/applied.pt")


@pytest.mark.slow
def test_was_step_applied_is_false_after_a_skipped_step(tmp_path):
    """engine.was_step_applied() after a step FusedAdamWClip skipped on the device (a nan gradient): DeepSpeed's
    flag (set from the host overflow this optimizer never reports) said True, so a script that steps its own
    schedule or logs only applied steps took the skipped one for an update. Now False, as stock DeepSpeed says.
    Under ZeRO get_global_grad_norm() of that step is inf, as stock's (it was nan)."""
    _spawn(_step_applied_worker, 1, str(tmp_path))
    results = torch.load(tmp_path / "applied.pt", weights_only=True)
    want = [False, True, False, False, False, True]
    assert results[False, 2] == want  # stock DeepSpeed
    assert results[True, 2] == want and results[True, 0] == want, results
    # and the skipped step's norm under ZeRO is inf, as stock DeepSpeed reports it (it was nan: a nan gradient)
    assert results["norms", False, 2][3] == results["norms", True, 2][3] == float("inf"), results


def test_deprecated_zero_optimization_forms():
    """DeepSpeed still reads "zero_optimization": true / false (ZeRO-1 / 0) and "cpu_offload": true (its old name
    of offload_optimizer cpu). With fused_adamw_clip the bool form raised AttributeError ('bool' object has no
    attribute 'get') before anything was built, and "cpu_offload" passed the up-front check to fail only once the
    engine was built ("FusedAdamWClip under ZeRO with cpu_offload is not supported")."""
    from ds_loongforge.optim.ds_integration import check_zero_setup

    for zero, stage in [(True, 1), (False, 0)]:
        config = {"zero_optimization": zero, "bf16": {"enabled": True}}
        check_zero_setup(config)
        assert deepspeed_config_for(config)["zero_optimization"] in (True, {"stage": 1})  # bf16 ZeRO-0 runs as 1
        assert deepspeed_config_for({"zero_optimization": zero})["zero_optimization"] == zero
    with pytest.raises(ValueError, match=r'"cpu_offload": true .*"fused_adamw_clip": false'):
        check_zero_setup({"zero_optimization": {"stage": 2, "cpu_offload": True}})


def _zero3_accumulation_worker(rank, world, port, seed, out_dir):
    """ZeRO-3, 2 ranks, 3 micro-steps per step, two sub-groups per weight group: FusedAdamWClip and stock DeepSpeed
    (torch's AdamW inside ZeRO-3, its own norm and clip) from the same model and data."""
    init_cpu_rank(rank, world, port)
    from ds_loongforge.optim import initialize

    g = torch.Generator().manual_seed(seed)
    micro = [(torch.randn(world, ROWS, IN, generator=g), torch.randn(world, ROWS, OUT, generator=g))
             for _ in range(9)]
    results = {}
    for precision in ("fp32", "bf16"):
        bf16 = precision == "bf16"
        for fused in (True, False):
            config = _config(3, by_block=fused, bf16=bf16)
            config["gradient_accumulation_steps"] = 3
            config["train_batch_size"] = ROWS * 3 * world
            if bf16:
                config["data_types"] = {"grad_accum_dtype": "fp32"}
            if not fused:
                config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.95],
                                                                   "eps": EPS, "torch_adam": True}}
            model = _model(seed)
            engine, *_ = initialize(model=model, model_parameters=_groups(model), config=config)
            assert isinstance(engine.basic_optimizer, FusedAdamWClip) == fused
            assert engine.zero_optimization_stage() == 3
            cast = torch.bfloat16 if bf16 else torch.float32
            norms, masters, params = [], [], []
            for n, (x, target) in enumerate(micro):
                engine.backward(_loss(engine, x[rank].to(cast), target[rank].to(cast)))
                engine.step()
                if (n + 1) % 3 == 0:
                    norms.append(torch.as_tensor(engine.get_global_grad_norm()).float().clone())
                    masters.append([t.detach().clone() for t in engine.optimizer.fp32_partitioned_groups_flat])
                    params.append(_gathered(model))
            results[precision, fused] = {"norms": norms, "masters": masters, "params": params,
                                         "grad_dtype": str(engine.optimizer.grad_partitions_flat_buffer.dtype)}
    torch.save(results, f"{out_dir}/zero3_rank{rank}.pt")


@pytest.mark.slow
def test_zero3_gradient_accumulation_equals_stock_deepspeed(tmp_path):
    """ZeRO-3 on 2 ranks, 3 micro-steps per optimizer step, the weights' group in two sub-groups: FusedAdamWClip's
    norms, fp32 partitions and gathered weights after each step are stock DeepSpeed's (torch AdamW and its clip
    inside ZeRO-3), fp32, and bf16 accumulating its gradients in fp32 (the kernel reads the fp32 gradient
    partition as it is)."""
    _spawn(_zero3_accumulation_worker, 2, int(torch.randint(0, 2**31, ())), str(tmp_path))
    for rank in range(2):
        results = torch.load(tmp_path / f"zero3_rank{rank}.pt", weights_only=True)
        for precision in ("fp32", "bf16"):
            fused, stock = results[precision, True], results[precision, False]
            assert fused["grad_dtype"] == stock["grad_dtype"] == "torch.float32", precision
            for step in range(3):
                torch.testing.assert_close(fused["norms"][step], stock["norms"][step], rtol=1e-6, atol=0)
                for a, b in zip(fused["masters"][step], stock["masters"][step]):
                    torch.testing.assert_close(a, b, rtol=0, atol=2e-7)
                for a, b in zip(fused["params"][step], stock["params"][step]):
                    # bf16: the weights are the masters rounded; one ulp where the masters differ in the last bits
                    torch.testing.assert_close(a, b, rtol=0, atol=2e-7 if precision == "fp32" else 4e-3)
