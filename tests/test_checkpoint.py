"""ds_loongforge.checkpoint: a ZeRO-1/2 checkpoint of a model with stacked experts loads, with its optimizer state,
at another ep_size, expert-parallel layout or world size (CPU accelerator, gloo, several processes).

One checkpoint per optimizer (ZeRO-2 fp32 with torch's AdamW, ZeRO-2 bf16 with FusedAdamWClip, ZeRO-1 bf16 under
DeepSpeed's BF16_Optimizer), saved by 4 ranks at ep_size 2 in DeepSpeed's default layout after two steps, then
loaded by fresh engines:
- 4 ranks at ep_size 4, and at ep_size 2 in the other layout (use_data_before_expert_parallelism);
- 2 ranks at ep_size 2, and at ep_size 1 (every rank holds every expert);
- 2 ranks with plain ExpertMaskedMoE layers (unsharded experts, which DeepSpeed does not see as MoE: a model
  injected with moe.ep_size 1), which read the experts from the per-expert files; their checkpoint (no per-expert
  files) back into ep_size 2.
After each load every rank's fp32 masters and Adam moments equal, bit for bit, the saving engine's for the
parameters and experts the rank now holds, and the step counters are the saved ones; at ep_size 4 the next step's
parameters equal the saving engine's next step (the same data; only the reduction order differs). And the check
every load ends with catches DeepSpeed's own load of such a checkpoint (which takes each rank's partition as the
same rank saved it): forced down that path, the load raises instead of training on other experts' moments.
Without ZeRO (one optimizer file per expert-parallel rank) another ep_size, or unsharded experts, is an error on every
rank, and the weights alone load. A checkpoint saved before the first step (no moments) loads at ep_size 4 and
takes the same first step. Across expert sharding the optimizer's group count changes, and torch LR schedulers'
per-group state is fitted to the new groups (the HF Trainer's, end to end, in tests/integrations/test_config_only.py).
"""

import os

import pytest
import torch

import deepspeed  # noqa: E402  (an install requirement: a missing one must fail, not skip)

from tests._dist import spawn_with_deadline  # noqa: E402
from tests.modules.test_moe_deepspeed import (  # noqa: E402
    E, H, INTER, K, _batches, _deepspeed_net, _Net, _reference, _setup_env)

CASES = ("zero2_fp32", "zero2_bf16_fused", "zero1_bf16")
SAVED_WORLD, SAVED_EP = 4, 2
TIMEOUT_S = 240


def _setup(rank: int, world: int, port: int) -> None:
    _setup_env(rank, world, port)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _engine(case: str, ep_size: int | None, ep_rank: int, seed: int, before: bool = False):
    """``ep_size`` None: a plain ExpertMaskedMoE, every expert an ordinary data-parallel parameter (a model injected
    with moe.ep_size 1)."""
    from ds_loongforge.modules.moe import ExpertMaskedMoE
    from ds_loongforge.modules.moe_deepspeed import DeepSpeedExpertMaskedMoE, moe_param_groups
    from ds_loongforge.optim import initialize

    if ep_size is None:
        torch.manual_seed(seed)
        net = _Net(ExpertMaskedMoE(H, INTER, E, K, impl="cpu"))
    elif before:  # built after torch.distributed is up: the layer makes its groups, in the config's layout
        net = _Net(DeepSpeedExpertMaskedMoE(H, INTER, E, K, impl="cpu", ep_size=ep_size,
                                            use_data_before_expert_parallel=True))
    else:
        net = _deepspeed_net(_reference(seed), ep_size, ep_rank)
    stage = {"zero1_bf16": 1, "zero0_fp32": 0}.get(case, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.05,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": "bf16" in case}, "steps_per_print": 10**9,
              "use_data_before_expert_parallelism": before,
              # an lr that changes every step: a load must restore the saved one, as DeepSpeed's does
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 8, "warmup_type": "linear"}}}
    if case == "zero2_bf16_fused":
        config["optimizer"] = {"type": "LoongForgeAdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "impl": "cpu"}}
        engine, *_ = initialize(model=net, model_parameters=moe_param_groups(net), config=config)
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}}
        if case == "zero1_bf16":  # fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return net, engine


def _train(engine, rank: int, batches) -> None:
    dtype = engine.module.proj.weight.dtype
    for x, target in batches:
        engine.backward(engine(x[rank].to(dtype), target[rank].to(dtype)))
        engine.step()


def _states(net, engine) -> dict:
    """Every parameter's fp32 master and Adam moments as this rank's engine holds them (its experts only), read
    from the partitions through DeepSpeed's fragment addresses."""
    from deepspeed.utils import safe_get_full_fp32_param

    optimizer = engine.optimizer
    groups = getattr(optimizer, "bit16_groups", None) or optimizer.bf16_groups
    flat_of = {id(lp): optimizer.optimizer.param_groups[i]["params"][0] for i, g in enumerate(groups) for lp in g}
    out = {}
    for name, param in net.named_parameters():
        out[name] = {"fp32": safe_get_full_fp32_param(param).clone()}
        mapping = param._hp_mapping
        for key in ("exp_avg", "exp_avg_sq"):
            whole = torch.zeros(param.numel())
            if mapping is not None:
                flat = optimizer.optimizer.state[flat_of[id(param)]][key]
                whole.narrow(0, mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel).copy_(
                    flat.narrow(0, mapping.hp_fragment_address.start, mapping.hp_fragment_address.numel))
            torch.distributed.all_reduce(whole, group=param._dp_group)
            out[name][key] = whole.view(param.shape)
    steps = {float(s["step"]) for s in optimizer.optimizer.state.values()}
    lrs = {bool(g.get("moe")): g["lr"] for g in optimizer.param_groups}
    return {"states": out, "steps": steps, "global_steps": engine.global_steps, "lrs": lrs}


def _masters(net) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(param).clone() for name, param in net.named_parameters()}


def _ep_rank(net) -> int:
    return net.moe.ep_rank


def _save_and_reload_worker(rank, world, port, ckpt_dir, out_dir, seed):
    _setup(rank, world, port)
    from ds_loongforge.checkpoint import CheckpointLayoutError

    batches = _batches(world, seed, steps=3)
    results = {}
    # without ZeRO each expert-parallel rank's whole optimizer state is one file: another ep_size is an error on
    # every rank before anything loads (DeepSpeed: a missing file on some ranks, the others hang), and the weights
    # alone still load. First, while ep_size 2 is this process's largest expert group: DeepSpeed names those files
    # by the rank in the largest group any engine of the process has made
    net, engine = _engine("zero0_fp32", SAVED_EP, rank % SAVED_EP, seed)
    _train(engine, rank, batches[:1])
    engine.save_checkpoint(f"{ckpt_dir}/zero0_fp32", tag="step1")
    saved_weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    net, engine = _engine("zero0_fp32", 4, rank, seed + 4)
    with pytest.raises(CheckpointLayoutError) as error:
        engine.load_checkpoint(f"{ckpt_dir}/zero0_fp32", tag="step1")
    results["zero0_error"] = str(error.value)
    engine.load_checkpoint(f"{ckpt_dir}/zero0_fp32", tag="step1", load_optimizer_states=False)
    results["zero0_weights"] = {"saved": saved_weights, "loaded": {n: p.detach().clone()
                                                                   for n, p in net.named_parameters()}}

    for case in CASES:
        net, engine = _engine(case, SAVED_EP, rank % SAVED_EP, seed)
        _train(engine, rank, batches[:2])
        engine.save_checkpoint(f"{ckpt_dir}/{case}", tag="step2")
        results[case] = {"saved": _states(net, engine), "saved_ep_rank": _ep_rank(net)}
        _train(engine, rank, batches[2:])
        results[case]["continued"] = _masters(net)

        net, engine = _engine(case, 4, rank, seed + 1)
        path, _ = engine.load_checkpoint(f"{ckpt_dir}/{case}", tag="step2")
        assert path is not None
        results[case]["ep4"] = {**_states(net, engine), "ep_rank": _ep_rank(net)}
        _train(engine, rank, batches[2:])
        results[case]["ep4_next"] = _masters(net)

    # saved before the first step (no moments yet): the masters load, and the next step starts Adam afresh
    net, engine = _engine("zero2_fp32", SAVED_EP, rank % SAVED_EP, seed + 5)
    engine.save_checkpoint(f"{ckpt_dir}/step0", tag="step0")
    net4, engine4 = _engine("zero2_fp32", 4, rank, seed + 6)
    engine4.load_checkpoint(f"{ckpt_dir}/step0", tag="step0")
    _train(engine4, rank, batches[:1])
    _train(engine, rank, batches[:1])
    results["step0"] = {"loaded_next": _masters(net4), "saved_next": _masters(net)}

    # a folder without a checkpoint (no 'latest'): DeepSpeed's answer, a warning and (None, None)
    os.makedirs(f"{ckpt_dir}/empty", exist_ok=True)
    assert engine.load_checkpoint(f"{ckpt_dir}/empty") == (None, None)

    # DeepSpeed's own load of the ep_size-2 checkpoint at ep_size 4 (the load this module replaces) is caught
    import ds_loongforge.checkpoint as checkpoint

    matches = checkpoint._this_layout_matches
    checkpoint._this_layout_matches = lambda *args: True
    try:
        net, engine = _engine("zero2_fp32", 4, rank, seed + 2)
        with pytest.raises(CheckpointLayoutError) as error:
            engine.load_checkpoint(f"{ckpt_dir}/zero2_fp32", tag="step2")
        results["forced_error"] = str(error.value)
    finally:
        checkpoint._this_layout_matches = matches

    torch.save(results, f"{out_dir}/saved{rank}.pt")


def _reload_worker(rank, world, port, ckpt_dir, out_dir, seed, loads):
    _setup(rank, world, port)
    from ds_loongforge import checkpoint
    from ds_loongforge.checkpoint import scheduler_regroup

    # what ds_loongforge.initialize does for an engine of unsharded experts (tests/integrations: the HF Trainer)
    checkpoint.install()
    results = {}
    if any(ep_size is None for _, ep_size, _ in loads):
        # without ZeRO the optimizer state is one file per saving rank: an error that says so; the weights load
        net, engine = _engine("zero0_fp32", None, 0, seed + 7)
        with pytest.raises(checkpoint.CheckpointLayoutError) as error:
            engine.load_checkpoint(f"{ckpt_dir}/zero0_fp32", tag="step1")
        results["zero0_error"] = str(error.value)
        engine.load_checkpoint(f"{ckpt_dir}/zero0_fp32", tag="step1", load_optimizer_states=False)
        results["zero0_weights"] = {n: p.detach().clone() for n, p in net.named_parameters()}
        # ... and the other way: that unsharded checkpoint (every expert in the model file) into ep_size 2
        engine.save_checkpoint(f"{ckpt_dir}/zero0_plain", tag="step1")
        net, engine = _engine("zero0_fp32", 2, 0, seed + 8)
        with pytest.raises(checkpoint.CheckpointLayoutError) as error:
            engine.load_checkpoint(f"{ckpt_dir}/zero0_plain", tag="step1")
        results["zero0_plain_error"] = str(error.value)
        engine.load_checkpoint(f"{ckpt_dir}/zero0_plain", tag="step1", load_optimizer_states=False)
        results["zero0_plain_weights"] = {"ep_rank": _ep_rank(net),
                                          **{n: p.detach().clone() for n, p in net.named_parameters()}}
    for case in CASES:
        for label, ep_size, before in loads:
            net, engine = _engine(case, ep_size, 0, seed + 3, before=before)
            path, _ = engine.load_checkpoint(f"{ckpt_dir}/{case}", tag="step2")
            assert path is not None
            results[(case, label)] = {**_states(net, engine), "ep_rank": _ep_rank(net), "ep_size": ep_size,
                                      "has_moe_layers": engine.has_moe_layers,
                                      "regroup": scheduler_regroup(engine.optimizer)}
            if ep_size is None:
                # saved again with every expert unsharded, and loaded back at ep_size 2: the same state, each rank's
                # experts cut from the stacked ones
                engine.save_checkpoint(f"{ckpt_dir}/{case}_plain", tag="step2")
                net, engine = _engine(case, 2, 0, seed + 9)
                path, _ = engine.load_checkpoint(f"{ckpt_dir}/{case}_plain", tag="step2")
                assert path is not None and engine.has_moe_layers
                results[(case, f"{label}_to_ep2")] = {**_states(net, engine), "ep_rank": _ep_rank(net),
                                                      "regroup": scheduler_regroup(engine.optimizer)}
    torch.save(results, f"{out_dir}/{loads[0][0]}{rank}.pt")


def _global(saved: list[dict], name: str, key: str) -> torch.Tensor:
    """The saving engine's tensor with every expert: the ep ranks' local experts, in ep-rank order."""
    if ".experts." not in name:
        return saved[0]["saved"]["states"][name][key]
    by_ep = {r["saved_ep_rank"]: r["saved"]["states"][name][key] for r in saved}
    return torch.cat([by_ep[e] for e in range(SAVED_EP)])


def _assert_loaded(saved_case: list[dict], loaded: dict, ep_size: int, what: str) -> None:
    local = E // ep_size
    experts = slice(loaded["ep_rank"] * local, (loaded["ep_rank"] + 1) * local)
    for name, keys in loaded["states"].items():
        for key, value in keys.items():
            want = _global(saved_case, name, key)
            want = want[experts] if ".experts." in name else want
            assert torch.equal(value, want), f"{what}: {name} {key} differs from the saved one"
    assert loaded["steps"] == saved_case[0]["saved"]["steps"] == {2.0}, what
    assert loaded["global_steps"] == 2, what
    saved_lrs = saved_case[0]["saved"]["lrs"]  # dense and expert groups; unsharded experts have dense groups only
    assert loaded["lrs"] == {kind: saved_lrs[kind] for kind in loaded["lrs"]}, what
    assert len(set(saved_lrs.values())) == 1 and 0.001 < saved_lrs[True] < 0.01, what  # in the warm-up, past its
    # first value


def test_optimizer_state_loads_at_another_ep_size_layout_and_world_size(tmp_path):
    seed = int(torch.randint(0, 2**31, ()))
    ckpt = str(tmp_path / "ckpt")
    spawn_with_deadline(_save_and_reload_worker, SAVED_WORLD, ckpt, str(tmp_path), seed, timeout_s=TIMEOUT_S)
    spawn_with_deadline(_reload_worker, 2, ckpt, str(tmp_path), seed,
                        [("world2_ep2", 2, False), ("world2_ep1", 1, False), ("world2_plain", None, False)],
                        timeout_s=TIMEOUT_S)
    spawn_with_deadline(_reload_worker, 4, ckpt, str(tmp_path), seed, [("before_ep2", 2, True)], timeout_s=TIMEOUT_S)
    saved = [torch.load(tmp_path / f"saved{rank}.pt", weights_only=False) for rank in range(SAVED_WORLD)]
    world2 = [torch.load(tmp_path / f"world2_ep2{rank}.pt", weights_only=False) for rank in range(2)]
    before = [torch.load(tmp_path / f"before_ep2{rank}.pt", weights_only=False) for rank in range(4)]

    for case in CASES:
        saved_case = [s[case] for s in saved]
        for rank in range(SAVED_WORLD):
            _assert_loaded(saved_case, saved[rank][case]["ep4"], 4, f"{case}, 4 ranks at ep_size 4, rank {rank}")
            _assert_loaded(saved_case, before[rank][(case, "before_ep2")], 2,
                           f"{case}, 4 ranks at ep_size 2 with data before expert parallelism, rank {rank}")
        for rank in range(2):
            for label, ep_size in (("world2_ep2", 2), ("world2_ep1", 1), ("world2_plain", 1)):
                _assert_loaded(saved_case, world2[rank][(case, label)], ep_size, f"{case}, {label}, rank {rank}")
            # no MoE layer DeepSpeed knows, so no expert files read by DeepSpeed
            assert not world2[rank][(case, "world2_plain")]["has_moe_layers"]
            # the optimizer groups an LR scheduler's per-group state is fitted to (fit_scheduler_state): the saved
            # dense and expert groups into one, and one into a dense and an expert group; none at the same sharding
            regroups = [world2[rank][(case, label)]["regroup"]
                        for label in ("world2_ep2", "world2_ep1", "world2_plain", "world2_plain_to_ep2")]
            assert regroups == [None, None, ([0], 2), ([0, 0], 1)], regroups
            _assert_loaded(saved_case, world2[rank][(case, "world2_plain_to_ep2")], 2,
                           f"{case}, unsharded checkpoint into ep_size 2, rank {rank}")
        # the other layout puts rank 1 at ep rank 0 (it held ep rank 1's experts when saving): a real change
        assert before[1][(case, "before_ep2")]["ep_rank"] == 0 and saved_case[1]["saved_ep_rank"] == 1

        # the step after loading at ep_size 4 is the saving engine's next step on the same data: the fp32 masters
        # agree up to the gradients' reduction order (bf16: up to 2.4e-4 seen, from the expert GEMMs' rounding over
        # other token groupings, which Adam's normalised update carries), well below the ~lr (0.01) by which experts'
        # moments of other experts or another step count's bias correction move them
        first = saved_case[0]["continued"]
        continued = {name: torch.cat([saved_case[r]["continued"][name] for r in range(SAVED_EP)])
                     if ".experts." in name else first[name] for name in first}
        tol = {"rtol": 0, "atol": 1e-6} if case == "zero2_fp32" else {"rtol": 0, "atol": 1e-3}
        for rank in range(SAVED_WORLD):
            for name, value in saved[rank][case]["ep4_next"].items():
                experts = slice(rank * (E // 4), (rank + 1) * (E // 4))
                want = continued[name][experts] if ".experts." in name else continued[name]
                torch.testing.assert_close(value, want, **tol, msg=f"{case}, ep_size 4, rank {rank}, {name}")
        moved = saved_case[0]["continued"]["moe.experts.down_proj"]
        assert not torch.equal(moved, _global(saved_case, "moe.experts.down_proj", "fp32")[:E // SAVED_EP])

    # the first step after loading a step-0 checkpoint at ep_size 4. Adam's first update is lr * g / (|g| + eps): a
    # gradient element near eps (terms that cancel) turns the other reduction order's rounding of it into up to
    # ~lr * dg / eps (1.2e-6 seen, seed 3947023985, at 1e-6 before); masters of other parameters would differ by
    # ~0.1-1, and moments or a step count not started afresh by ~lr (0.01)
    for rank in range(SAVED_WORLD):
        experts = slice(rank * (E // 4), (rank + 1) * (E // 4))
        for name, value in saved[rank]["step0"]["loaded_next"].items():
            if ".experts." in name:
                want = torch.cat([saved[r]["step0"]["saved_next"][name] for r in range(SAVED_EP)])[experts]
            else:
                want = saved[0]["step0"]["saved_next"][name]
            torch.testing.assert_close(value, want, rtol=0, atol=1e-4, msg=f"step-0 checkpoint, rank {rank}, {name}")

    for rank in range(SAVED_WORLD):
        message = saved[rank]["forced_error"]
        assert "are not the weights the checkpoint holds for them" in message and "moe.experts" in message, message
        message = saved[rank]["zero0_error"]
        assert "saved without ZeRO at ep_size 2" in message and "runs ep_size 4" in message, message
        assert "load_optimizer_states=False" in message, message
    # the weights without ZeRO at ep_size 4: rank r's experts, from the saving rank of the same expert-parallel
    # rank (rank e held ep rank e's experts at ep_size 2)
    for rank in range(SAVED_WORLD):
        for name, value in saved[rank]["zero0_weights"]["loaded"].items():
            if ".experts." in name:
                first = rank * (E // 4)
                ep_rank, start = divmod(first, E // SAVED_EP)
                want = saved[ep_rank]["zero0_weights"]["saved"][name][start:start + E // 4]
            else:
                want = saved[0]["zero0_weights"]["saved"][name]
            assert torch.equal(value, want), f"ZeRO-0 weights at ep_size 4, rank {rank}, {name}"
    # ... and into unsharded experts on 2 ranks: every expert, from both saving expert-parallel ranks; the optimizer
    # state without ZeRO is an error that names the way on
    for rank in range(2):
        assert "load_optimizer_states=False" in world2[rank]["zero0_error"], world2[rank]["zero0_error"]
        for name, value in world2[rank]["zero0_weights"].items():
            want = (torch.cat([saved[e]["zero0_weights"]["saved"][name] for e in range(SAVED_EP)])
                    if ".experts." in name else saved[0]["zero0_weights"]["saved"][name])
            assert torch.equal(value, want), f"ZeRO-0 weights into unsharded experts, rank {rank}, {name}"
        # that unsharded checkpoint back at ep_size 2: the weights, the optimizer state an error
        message = world2[rank]["zero0_plain_error"]
        assert "saved with every expert unsharded" in message, message
        loaded = world2[rank]["zero0_plain_weights"]
        for name, value in world2[0]["zero0_weights"].items():
            want = value[loaded["ep_rank"] * (E // 2):(loaded["ep_rank"] + 1) * (E // 2)] if ".experts." in name \
                else value
            assert torch.equal(loaded[name], want), f"ZeRO-0 unsharded weights at ep_size 2, rank {rank}, {name}"


# LR schedulers as a training script builds them on its optimizer; each keeps some state per parameter group
SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)),
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
        torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)], milestones=[2]),
    "cyclic": lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=[0.1 * g["lr"] for g in
                                                                                       opt.param_groups],
                                                            step_size_up=2, cycle_momentum=False),
    "plateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0,
                                                                      min_lr=[g["lr"] / 8 for g in opt.param_groups]),
}


def _optimizer(lrs: list[float]) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs])


def _stepped(make, lrs: list[float], steps: int = 3):
    optimizer = _optimizer(lrs)
    scheduler = make(optimizer)
    for step in range(steps):
        optimizer.step()
        scheduler.step(*((1.0,) if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) else ()))
    return optimizer, scheduler


def _comparable(state):
    """A scheduler's state without its functions' attributes (LambdaLR keeps those of non-function lambdas)."""
    if isinstance(state, dict):
        return {k: _comparable(v) for k, v in state.items() if k != "lr_lambdas"}
    return [_comparable(v) for v in state] if isinstance(state, list) else state


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("saved_lrs, lrs, groups", [
    ([0.1, 0.2, 0.1], [0.1, 0.2], [0, 1]),      # expert-parallel (dense, dense without decay, experts) -> unsharded
    ([0.1, 0.2], [0.1, 0.2, 0.1], [0, 1, 0]),   # and back
    ([0.1], [0.1, 0.1], [0, 0])])               # one group, and a dense and an expert part of it
def test_scheduler_state_fits_other_optimizer_groups(name, saved_lrs, lrs, groups):
    """A scheduler's state saved for one set of optimizer groups, fitted (``fit_scheduler_state``) and loaded into
    the same scheduler on other groups, is the state that scheduler reaches on those groups itself; loading it as
    saved raises (torch) or leaves the wrong number of entries."""
    from ds_loongforge.checkpoint import fit_scheduler_state, fitting_scheduler_loads

    make = SCHEDULERS[name]
    _, saved = _stepped(make, saved_lrs)
    state = saved.state_dict()
    want_optimizer, want = _stepped(make, lrs)
    optimizer = _optimizer(lrs)
    scheduler = make(optimizer)
    with fitting_scheduler_loads(scheduler, (groups, len(saved_lrs))):
        scheduler.load_state_dict(state)
    assert "load_state_dict" not in vars(scheduler)  # the class's own again
    assert _comparable(scheduler.state_dict()) == _comparable(want.state_dict())
    assert _comparable(fit_scheduler_state(state, groups, len(saved_lrs))) == _comparable(want.state_dict())
    if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        assert scheduler.get_last_lr() == want.get_last_lr()
    # as saved: the per-group entries are the other groups'
    unfitted = make(_optimizer(lrs))
    try:
        unfitted.load_state_dict(state)
    except (IndexError, ValueError):
        return
    assert _comparable(unfitted.state_dict()) != _comparable(want.state_dict())


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_with_entries_per_script_group_is_left_as_saved(name):
    """A scheduler built on a script's optimizer before deepspeed.initialize keeps one entry per script group
    whatever groups the engine's optimizer has: a regrouped load (2 saved groups into 3) leaves its state as saved,
    where fitting it would give it entries for groups it does not have."""
    from ds_loongforge.checkpoint import fitting_scheduler_loads

    _, saved = _stepped(SCHEDULERS[name], [0.1, 0.2])
    scheduler = SCHEDULERS[name](_optimizer([0.1, 0.2]))
    with fitting_scheduler_loads(scheduler, ([0, 1, 0], 2)):
        scheduler.load_state_dict(saved.state_dict())
    assert _comparable(scheduler.state_dict()) == _comparable(saved.state_dict())


def test_unpartitioned_mlp_layout_check_leaves_other_checkpoints_to_deepspeed(tmp_path):
    """The load every engine now takes (the block on, off or absent) looks at a checkpoint saved without ZeRO for
    the other MLP layout: a tensor-parallel one (which the export's reader refuses) and one of the engine's own
    layout go to DeepSpeed's load as they were, and an unfused engine maps a fused one."""
    from types import SimpleNamespace

    from ds_loongforge.checkpoint import _unpartitioned_state_across_mlp_layout
    from ds_loongforge.export import MODEL_FILE

    mlp = torch.nn.Module()
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = (torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(4, 6, bias=False),
                                                 torch.nn.Linear(6, 4, bias=False))
    module = torch.nn.ModuleDict({"mlp": mlp})
    optimizer = torch.optim.AdamW(module.parameters())
    engine = SimpleNamespace(module=module, optimizer=optimizer, fp16_enabled=lambda: False,
                             bfloat16_enabled=lambda: False)
    gate_up = {"step": torch.tensor(3.0), "exp_avg": torch.randn(12, 4), "exp_avg_sq": torch.rand(12, 4)}
    down = {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 6), "exp_avg_sq": torch.rand(4, 6)}
    fused_state = {"state": {0: gate_up, 1: down}, "param_groups": [{**optimizer.param_groups[0], "params": [0, 1]}]}
    for name, states, expected in [("tp", {"mp_world_size": 2}, None),
                                   ("same", {"optimizer": optimizer.state_dict()}, None),
                                   ("fused", {"optimizer": fused_state}, "mapped")]:
        folder = tmp_path / name
        folder.mkdir()
        torch.save({"module": {}, **states}, folder / MODEL_FILE)
        got = _unpartitioned_state_across_mlp_layout(engine, str(folder))
        if expected is None:
            assert got is None, name
            continue
        assert got["param_groups"][0]["params"] == [0, 1, 2]
        assert torch.equal(got["state"][0]["exp_avg"], gate_up["exp_avg"][:6])  # gate: the first rows
        assert torch.equal(got["state"][1]["exp_avg_sq"], gate_up["exp_avg_sq"][6:])  # up: the rest
        assert torch.equal(got["state"][2]["exp_avg"], down["exp_avg"])
        assert got["state"][0]["step"] is not got["state"][1]["step"]  # AdamW counts each in place
        optimizer.load_state_dict(got)


def test_flat_masters_across_the_fused_mlp_with_biases():
    """FP16_Optimizer's flat fp32 masters and moments (no parameter boundaries saved) of a stock MLP with biases,
    [gate.weight, gate.bias, up.weight, up.bias, down...], rearranged for a fused engine's [gate_up.weight,
    gate_up.bias, down...]; the layout is read from the saved 16-bit weights. Flats already in the engine's order go
    to DeepSpeed; flats that neither order reads right are an error (DeepSpeed would load them by size)."""
    from ds_loongforge.checkpoint import (CheckpointLayoutError, _flat_state_across_mlp_layout,
                                          _groups_in_other_mlp_layout)

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    stock = {name: torch.randn(shape, generator=g) for name, shape in [
        ("mlp.gate_proj.weight", (6, 4)), ("mlp.gate_proj.bias", (6,)), ("mlp.up_proj.weight", (6, 4)),
        ("mlp.up_proj.bias", (6,)), ("mlp.down_proj.weight", (4, 6))]}
    params = {"mlp.gate_up_proj.weight": torch.empty(12, 4), "mlp.gate_up_proj.bias": torch.empty(12),
              "mlp.down_proj.weight": torch.empty(4, 6)}
    groups = [list(params)]
    other, shapes = _groups_in_other_mlp_layout(groups, params)
    assert other == [list(stock)]  # transformers' order: the gate's leaves, then the up's
    assert all(shapes[name] == value.shape for name, value in stock.items())
    module = {name: value.bfloat16() for name, value in stock.items()}  # the weights the masters round to
    flat = torch.cat([value.reshape(-1) for value in stock.values()])
    moment = torch.rand(flat.shape, generator=g)
    saved = {"fp32_groups_flat": [flat], "clip_grad": 1.0, "optimizer_state_dict": {
        "state": {0: {"exp_avg": moment, "exp_avg_sq": moment * 2, "step": 3}}, "param_groups": [{"params": [0]}]}}

    got = _flat_state_across_mlp_layout(saved, module, groups, other, shapes, params, "ckpt")
    fused_order = [stock["mlp.gate_proj.weight"], stock["mlp.up_proj.weight"], stock["mlp.gate_proj.bias"],
                   stock["mlp.up_proj.bias"], stock["mlp.down_proj.weight"]]
    assert torch.equal(got["fp32_groups_flat"][0], torch.cat([t.reshape(-1) for t in fused_order]))
    state = got["optimizer_state_dict"]["state"][0]
    index = torch.cat([torch.arange(24), torch.arange(30, 54), torch.arange(24, 30), torch.arange(54, 60),
                       torch.arange(60, 84)])  # gate.w, up.w, gate.b, up.b, down: where each sits in the stock flat
    assert torch.equal(state["exp_avg"], moment[index]) and torch.equal(state["exp_avg_sq"], 2 * moment[index])
    assert state["step"] == 3 and got["clip_grad"] == 1.0

    in_order = {**saved, "fp32_groups_flat": [got["fp32_groups_flat"][0]]}  # saved by a fused engine
    assert _flat_state_across_mlp_layout(in_order, module, groups, other, shapes, params, "ckpt") is None
    shuffled = {**saved, "fp32_groups_flat": [flat.flip(0)]}
    with pytest.raises(CheckpointLayoutError, match="load_optimizer_states=False"):
        _flat_state_across_mlp_layout(shuffled, module, groups, other, shapes, params, "ckpt")


def test_mlp_parameter_names_across_the_fused_mlp():
    """A checkpoint's gate_proj / up_proj for the fused MLP's gate_up_proj and the other way (the rows [gate; up]);
    the stacked experts' own gate_up_proj (no leaf) and other names are left alone."""
    from ds_loongforge.checkpoint import fused_mlp_parts, split_mlp_part

    mlp = "model.layers.0.mlp."
    stock = {mlp + "gate_proj.weight", mlp + "up_proj.weight", mlp + "down_proj.weight"}
    fused = {mlp + "gate_up_proj.weight", mlp + "down_proj.weight"}
    assert fused_mlp_parts(mlp + "gate_up_proj.weight", stock) == [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
    assert fused_mlp_parts(mlp + "gate_up_proj.bias", stock) is None  # no saved bias
    assert fused_mlp_parts("gate_up_proj.weight", {"gate_proj.weight", "up_proj.weight"}) == ["gate_proj.weight",
                                                                                              "up_proj.weight"]
    assert fused_mlp_parts(mlp + "experts.gate_up_proj", stock) is None
    assert split_mlp_part(mlp + "gate_proj.weight", fused) == (mlp + "gate_up_proj.weight", 0)
    assert split_mlp_part(mlp + "up_proj.weight", fused) == (mlp + "gate_up_proj.weight", 1)
    assert split_mlp_part(mlp + "down_proj.weight", fused) is None
    assert split_mlp_part(mlp + "gate_up_proj.weight", fused) is None
    assert split_mlp_part(mlp + "up_proj.weight", stock) is None  # saved as it is
