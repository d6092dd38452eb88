"""Gradient accumulation (``"gradient_accumulation_steps": 4``) with the ``"loongforge"`` block against stock
DeepSpeed (the same config without the block), as a DeepSpeed user runs it: ``engine(...)``, ``engine.backward``
and ``engine.step`` once per micro-batch, the engine deciding when the optimizer steps.

A tiny Mixtral with ``output_router_logits`` on, so transformers' load-balancing loss (x router_aux_loss_coef) is
part of the trained loss; AdamW with weight decay, ``gradient_clipping`` 1.0 (active at every step: every norm above
it), DeepSpeed's WarmupLR (the lr moves during the run). On CPU gloo ranks:

- fp32, ZeRO-1 and ZeRO-2, 1 and 2 ranks: the block with DeepSpeed's own AdamW and clipping (the block's default:
  ``optimizer.fused_adamw_clip`` is false, config.py) and the block with FusedAdamWClip, against stock: the loss of
  every micro-step, the gradient every optimizer step takes, the grad norms, the lr of every micro-step, every
  weight and fp32 master after 3 optimizer steps; ``is_gradient_accumulation_boundary()``, ``global_steps``,
  ``global_samples``, ``was_step_applied()`` and ``get_global_grad_norm()`` after every micro-step are stock's and
  DeepSpeed's documented ones; the optimizer stepped exactly micro-steps / 4 times (every Adam step count, the
  optimizer's update calls). On one rank every step's gradient is, bit for bit, the one plain PyTorch accumulates
  over the same 4 micro-batches from the same weights (stock's too).
- expert parallelism (``moe.ep_size`` 2 on 2 ranks, ZeRO-1 and ZeRO-2, with DeepSpeed's AdamW and with
  FusedAdamWClip): the same losses, gradients and weights (each rank's experts joined) as the block at ep_size 1 and
  as stock. (With DeepSpeed's AdamW and the script's HF-style parameter groups, which have no "name", DeepSpeed's
  own MoE group split raised KeyError: 'name'; the hook now splits them.)
- bf16 at ZeRO-2 on 1 rank: every step's gradient bit for bit plain PyTorch's bf16 accumulation (ours and stock's),
  and the run within measured bf16 tolerances of stock's (``test_bf16_...``'s docstring: routing flips, as in
  test_moe_families_zero3.py).
- the HF Trainer (``TrainingArguments(deepspeed=..., gradient_accumulation_steps=4)``), an unmodified script in a
  subprocess with config-only enablement, as in test_config_only.py: the logged losses and grad norms with the
  block are stock's, 3 optimizer steps of 4 micro-steps, and the block's log lines name the replaced family and
  modules.
- the expert-aware sampler that ``ds_loongforge.initialize(training_data=...)`` returns, trained through two
  epochs on 2 ranks with 4 micro-batches per optimizer step and an epoch of 3.5 optimizer steps: every epoch draws
  every sample exactly once over the ranks (none lost, none repeated; so does stock DeepSpeed's loader), each rank
  the same number of micro-batches, the batches of the sampler built on its own (accumulation changes nothing in
  it), balanced better than random batches of the same samples, and the engine at 3 then 7 optimizer steps; with
  ``"dataloader_drop_last": true`` the incomplete micro-batches left out as stock's loader leaves them (the sampler
  used to top the epoch up with repeated samples).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

import deepspeed  # noqa: F401  (an install requirement: a missing one must fail, not skip)

from tests._dist import init_cpu_rank, spawn_with_deadline
from tests.integrations._block_vs_stock import (check_bf16_updates, check_fp32_weights, check_start_and_curves,
                                                ds_config, gathered, hf_groups, masters,
                                                token_batches, under_stock_names)
# accelerate_installed is a fixture (it needs autoload_installed, a fixture of that module too)
from tests.integrations.test_config_only import (HF_BASE, MODEL_SNIPPET, OUR_TYPES, STOCK_TYPES,  # noqa: F401
                                                 _result, _run_script, _tagged, accelerate_installed,
                                                 autoload_installed)

VOCAB, HIDDEN, SEQ, MICRO = 128, 32, 16, 2
EXPERTS = 4
GAS = 4
STEPS = 3  # optimizer steps: STEPS * GAS micro-steps
LR, WD = 1e-2, 0.1
# every step's norm is above it here (initializer_range in _model), so every step clips, in every run
CLIP = 1.0
# Adam's eps, 10x tests/integrations/test_tied_embeddings.py's 1e-4 (see there): Adam steps an entry whose gradient
# is below eps by about lr * g / eps, so an fp32 summation-order difference dg of such a gradient moves the weight by
# ~lr * dg / eps. This model's gradients (initializer_range 0.2) are ~10x those of the family tests' models (0.02),
# and so are their summation-order differences: with 1e-4 an embedding entry whose gradient was 1.8e-5 (a token seen
# once), 1.6e-7 apart between the block's kernels and stock's, ended 3.6e-6 apart (1 entry of 4096, in one run of
# ~30), above check_fp32_weights' tolerance; eps scaled with the gradients keeps that below it. A wrong gradient is
# still off by O(lr) = 1e-2.
EPS = 1e-3
# WarmupLR over more steps than run, from LR / 2: the lr moves during the run (DeepSpeed's WarmupLR gives its first
# lr twice, at construction and at its first step), so a schedule stepped per micro-step, or not at all, shows
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": LR / 2, "warmup_max_lr": LR,
                                            "warmup_num_steps": 2 * STEPS, "warmup_type": "linear"}}
SPAWN_TIMEOUT_S = 240

# variant -> the "loongforge" block (None: stock DeepSpeed). The sampler is off: these runs feed their own batches
BLOCKS = {
    "stock": None,
    "block": {"enabled": True, "sampler": {"expert_aware": False}},
    "fused": {"enabled": True, "sampler": {"expert_aware": False}, "optimizer": {"fused_adamw_clip": True}},
    "ep2": {"enabled": True, "sampler": {"expert_aware": False}, "moe": {"ep_size": 2}},
    "ep2_fused": {"enabled": True, "sampler": {"expert_aware": False}, "moe": {"ep_size": 2},
                  "optimizer": {"fused_adamw_clip": True}},
}


# ----------------------------------------------------------------------------------------------- in the workers

def _model(seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    # initializer_range 0.2: transformers' default 0.02 gave grad norms of 0.5-0.8 here, 0.2 gives 1.7-2.0 at the start
    # (2 ranks; more on 1): every step's norm above CLIP
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                           num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
                           output_router_logits=True, router_aux_loss_coef=0.02, initializer_range=0.2)
    return MixtralForCausalLM(config).float()


def _ds_config(stage: int, dtype: str, variant: str) -> dict:
    config = ds_config({"stage": stage}, dtype, BLOCKS[variant], micro=MICRO, clip=CLIP, lr=LR, weight_decay=WD,
                       eps=EPS)
    config.update(gradient_accumulation_steps=GAS, scheduler=SCHEDULER)
    return config


def _balancing_loss_patched() -> bool:
    from transformers.models.mixtral import modeling_mixtral

    from ds_loongforge.integrations._patching import ORIGINAL_ATTR

    return hasattr(modeling_mixtral.load_balancing_loss_func, ORIGINAL_ATTR)


def _adam_step_counts(optimizer) -> list[float]:
    """Every parameter's (or ZeRO partition's) Adam step count held by the optimizer."""
    return sorted({float(state["step"]) for state in optimizer.state.values() if "step" in state})


def _count_updates(engine) -> list:
    """A list that gets one entry per optimizer update: FusedAdamWClip's one step over every group
    (``step_buckets``, under ZeRO and without), or, for DeepSpeed's optimizer, one per ``step`` call of its torch
    AdamW (ZeRO-1/2 call it once per parameter group: counted per group by the test)."""
    from ds_loongforge.optim import FusedAdamWClip

    calls, optimizer = [], engine.basic_optimizer
    name = "step_buckets" if isinstance(optimizer, FusedAdamWClip) else "step"
    original = getattr(optimizer, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(optimizer, name, counting)
    return calls


def _accumulated_gradients(engine) -> dict:
    """Every parameter's gradient as the optimizer step takes it (after the last micro-step's backward: the GAS
    micro-steps' sum, averaged over the ranks), fp32, under stock names; DeepSpeed's safe_get_full_grad, a
    collective at ZeRO-1/2 on several ranks."""
    from deepspeed.utils import safe_get_full_grad

    return under_stock_names({n: safe_get_full_grad(p).float().clone() for n, p in engine.module.named_parameters()})


def _plain_twin(variant: str, dtype: str, seed: int):
    """The run's model outside DeepSpeed: the same modules (injected by the variant's block) and DeepSpeed's cast
    for bf16 (the parameters, not the buffers: the rotary inv_freq stays fp32)."""
    from ds_loongforge import inject

    model = _model(seed)
    if BLOCKS[variant] is not None:
        inject(model, {"loongforge": BLOCKS[variant]})
    if dtype == "bf16":
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    return model.train()


def _train(engine, batches: torch.Tensor, rank: int, twin=None) -> dict:
    """One micro-batch per engine call, as a DeepSpeed script does; what the engine says after each. ``twin`` (one
    rank): a plain PyTorch copy of the model that takes the engine's weights at the start of every optimizer step
    and accumulates the same micro-batches' gradients of loss / GAS with autograd (``.grad +=``, in the model's
    dtype); the largest difference from the gradient the engine's step takes is recorded per step."""
    out = {k: [] for k in ("losses", "boundary", "global_steps", "global_samples", "applied", "lrs", "micro_norms",
                           "grads", "twin_diffs")}
    updates = _count_updates(engine)
    for i, ids in enumerate(batches):
        ids = ids[rank].to(engine.device)
        if twin is not None and i % GAS == 0:
            with torch.no_grad():
                weights = dict(engine.module.named_parameters())
                for name, param in twin.named_parameters():
                    param.copy_(weights[name])
                    param.grad = None
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if twin is not None:
            (twin(input_ids=ids, labels=ids).loss / GAS).backward()
        out["boundary"].append(engine.is_gradient_accumulation_boundary())
        if out["boundary"][-1]:
            out["grads"].append(_accumulated_gradients(engine))
            if twin is not None:
                plain = under_stock_names({n: p.grad.float() for n, p in twin.named_parameters()})
                out["twin_diffs"].append(max(float((g - plain[n]).abs().max()) for n, g in out["grads"][-1].items()))
        out["lrs"].append(engine.get_lr()[0])  # the lr the step below takes (DeepSpeed's scheduler, stepped after)
        engine.step()
        out["losses"].append(loss.detach().float().item())
        out["global_steps"].append(engine.global_steps)
        out["global_samples"].append(engine.global_samples)
        out["applied"].append(engine.was_step_applied())
        norm = engine.get_global_grad_norm()
        out["micro_norms"].append(None if norm is None else float(norm))
    out["norms"] = [n for n, b in zip(out["micro_norms"], out["boundary"]) if b]
    out["updates"] = len(updates)
    out["groups"] = len(engine.basic_optimizer.param_groups)
    out["adam_steps"] = _adam_step_counts(engine.basic_optimizer)
    out["skipped"] = int(engine.skipped_steps)
    return out


def _run(stage: int, dtype: str, variant: str, seed: int, batches: torch.Tensor, rank: int) -> dict:
    import ds_loongforge
    from ds_loongforge.modules import ExpertMaskedMoE
    from ds_loongforge.optim import FusedAdamWClip

    # on one rank the plain twin (built first: a stock run's twin must not see inject's process-wide patches either)
    twin = _plain_twin(variant, dtype, seed) if torch.distributed.get_world_size() == 1 else None
    model = _model(seed)
    patched_before = _balancing_loss_patched()
    initialize = deepspeed.initialize if variant == "stock" else ds_loongforge.initialize
    engine, *_ = initialize(model=model, model_parameters=hf_groups(model, WD),
                            config=_ds_config(stage, dtype, variant))
    moe = [m for m in engine.module.modules() if isinstance(m, ExpertMaskedMoE)]
    facts = {"stage": engine.zero_optimization_stage(), "gas": engine.gradient_accumulation_steps(),
             "expert_masked": len(moe), "ep_size": sorted({m.ep_size for m in moe}),
             "fused_adamw_clip": isinstance(engine.basic_optimizer, FusedAdamWClip),
             "ds_clip": engine.gradient_clipping(), "balancing_loss_patched": patched_before,
             "types": sorted({type(m).__name__ for m in engine.module.modules()})}
    initial = gathered(engine.module)
    result = _train(engine, batches, rank, twin)
    result.update(facts=facts, initial=initial, weights=gathered(engine.module), masters=masters(engine),
                  ep_rank=moe[0].ep_rank if moe else 0)
    return result


def _worker(rank, world, port, seed, runs, out_dir):
    init_cpu_rank(rank, world, port)
    batches = token_batches(STEPS * GAS, world, MICRO, SEQ, VOCAB, seed)
    # stock first: inject patches transformers' load_balancing_loss_func process-wide (the same value), and the stock
    # runs must run transformers' own
    runs = sorted(runs, key=lambda run: run[2] != "stock")
    results = {run: _run(*run, seed, batches, rank) for run in runs}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


# the expert-aware sampler: micro-batches of SAMPLER_MICRO sequences (the balancing has more room than with 2), an
# epoch of SAMPLES / (SAMPLER_MICRO * 2 ranks) = 14 micro-batches a rank, 3.5 optimizer steps: the second epoch
# starts inside an accumulation window
SAMPLER_MICRO = 4
SAMPLES = 14 * SAMPLER_MICRO * 2
EPOCHS = 2
# and with DeepSpeed's "dataloader_drop_last": true, SAMPLES + EXTRA samples (one epoch): the EXTRA do not fill a
# micro-batch on each rank and are left out (stock DeepSpeed's loader drops them), never topped up with repeats
EXTRA = 6
SAMPLER = {"expert_aware": True, "n_clusters": 4, "refresh_every": 0, "pad_to_multiple_of": SEQ}


def _epoch_sampler(loader):
    """What a training script calls set_epoch on: ExpertAwareSampler is the loader's batch sampler; DeepSpeed's own
    loader holds a DistributedSampler."""
    return loader.batch_sampler if hasattr(loader, "batch_sampler") else loader.data_sampler


def _sampler_worker(rank, world, port, seed, out_dir):
    init_cpu_rank(rank, world, port)
    import ds_loongforge
    from ds_loongforge.data import ExpertAwareSampler, build_dataloader

    rows = torch.randint(0, VOCAB, (SAMPLES + EXTRA, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    index = {tuple(row.tolist()): i for i, row in enumerate(rows)}
    results = {"distinct": len(index)}
    # stock first (inject's process-wide patches)
    for variant, drop_last in (("stock", False), ("stock", True), ("block", False), ("block", True)):
        data = [{"input_ids": row} for row in rows[:SAMPLES + (EXTRA if drop_last else 0)]]
        block = None if variant == "stock" else {"enabled": True, "sampler": {**SAMPLER, "cache_dir": out_dir}}
        config = ds_config({"stage": 2}, "fp32", block, micro=SAMPLER_MICRO, clip=CLIP, lr=LR, weight_decay=WD,
                           eps=EPS)
        config.update(gradient_accumulation_steps=GAS, dataloader_drop_last=drop_last)
        model = _model(seed)
        initialize = deepspeed.initialize if variant == "stock" else ds_loongforge.initialize
        engine, _, loader, _ = initialize(model=model, model_parameters=hf_groups(model, WD), config=config,
                                          training_data=data)
        sampler = _epoch_sampler(loader)
        run = {"sampler": type(sampler).__name__, "epochs": [], "global_steps": []}
        if variant == "block" and not drop_last:
            # the same sampler built on its own, from the same (untrained) weights, with no engine around it
            alone = build_dataloader(data, config, engine.module, SAMPLER_MICRO, rank=rank,
                                     world_size=world).batch_sampler
            run["alone"] = []
            for epoch in range(EPOCHS):
                alone.set_epoch(epoch)
                run["alone"].append([list(map(int, batch)) for batch in alone])
            run["loads"] = sampler.plan.loads_NS
        for epoch in range(1 if drop_last else EPOCHS):
            sampler.set_epoch(epoch)
            batches = []
            for batch in loader:
                ids = batch["input_ids"]
                batches.append([index.get(tuple(row.tolist()), -1) for row in ids])
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
            run["epochs"].append(batches)
            run["global_steps"].append(engine.global_steps)
        run["is_expert_aware"] = isinstance(sampler, ExpertAwareSampler)
        results[variant, drop_last] = run
    torch.save(results, f"{out_dir}/sampler_rank{rank}.pt")


# ----------------------------------------------------------------------------------------------- in pytest

def _spawn(tmp_path, world: int, runs: list) -> tuple[int, list[dict]]:
    seed = int(torch.randint(0, 2**31, ()))
    spawn_with_deadline(_worker, world, seed, runs, str(tmp_path), timeout_s=SPAWN_TIMEOUT_S)
    return seed, [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check_engine_accounting(case, run: dict, world: int, problems: list) -> None:
    """DeepSpeed's gradient accumulation, micro-step by micro-step: the boundary on every GAS-th, one optimizer
    step there (global_steps, was_step_applied, the Adam step counts and update calls), the global batch's samples
    counted there, the norm of the last optimizer step (None before the first), the lr moved by the schedule there
    only; on one rank, every step's gradient bit for bit the plain PyTorch twin's."""
    micro_steps = STEPS * GAS
    boundary = [(i + 1) % GAS == 0 for i in range(micro_steps)]
    expected = {"boundary": boundary,
                "global_steps": [(i + 1) // GAS for i in range(micro_steps)],
                "global_samples": [(i + 1) // GAS * GAS * MICRO * world for i in range(micro_steps)],
                "applied": boundary}
    for key, want in expected.items():
        if run[key] != want:
            problems.append(f"{case}: {key} {run[key]}, expected {want}")
    if run["micro_norms"][:GAS - 1] != [None] * (GAS - 1) or len(run["norms"]) != STEPS:
        problems.append(f"{case}: norms after each micro-step {run['micro_norms']}")
    for i in range(GAS, micro_steps):  # between boundaries: the last optimizer step's norm
        if not boundary[i] and run["micro_norms"][i] != run["micro_norms"][i - 1]:
            problems.append(f"{case}: micro-step {i} changed the reported norm: {run['micro_norms']}")
    if run["adam_steps"] != [float(STEPS)]:
        problems.append(f"{case}: Adam step counts {run['adam_steps']}, expected [{float(STEPS)}] (one per {GAS} "
                        "micro-steps)")
    # FusedAdamWClip: one update over every group per optimizer step; torch's AdamW under ZeRO-1/2: one per group
    per_step = 1 if run["facts"]["fused_adamw_clip"] else run["groups"]
    if run["updates"] != STEPS * per_step:
        problems.append(f"{case}: {run['updates']} optimizer update calls, expected {STEPS * per_step}")
    if run["skipped"] != 0:
        problems.append(f"{case}: {run['skipped']} skipped steps")
    if len(set(run["lrs"])) < 2 or run["lrs"] != [lr for lr in run["lrs"][::GAS] for _ in range(GAS)]:
        problems.append(f"{case}: the lr moved otherwise than once per optimizer step: {run['lrs']}")
    if len(run["grads"]) != STEPS:
        problems.append(f"{case}: {len(run['grads'])} accumulated gradients recorded, expected {STEPS}")
    if world == 1 and run["twin_diffs"] != [0.0] * STEPS:
        problems.append(f"{case}: the accumulated gradients differ from plain PyTorch's accumulation over the same "
                        f"micro-batches by {run['twin_diffs']} (largest per step)")


def _check_facts(case, variant: str, run: dict, stage: int, problems: list) -> None:
    facts = run["facts"]
    fused = variant in ("fused", "ep2_fused")
    want = {"stage": stage, "gas": GAS, "expert_masked": 0 if variant == "stock" else 2,
            "ep_size": [] if variant == "stock" else [2 if variant.startswith("ep2") else 1],
            "fused_adamw_clip": fused, "ds_clip": 0.0 if fused else CLIP,
            # stock runs first in each process and runs transformers' own balancing loss
            "balancing_loss_patched": facts["balancing_loss_patched"] if variant != "stock" else False}
    got = {k: facts[k] for k in want}
    if got != want:
        problems.append(f"{case}: engine set-up {got}, expected {want}")
    if (variant == "stock") != ("MixtralSparseMoeBlock" in facts["types"]):
        problems.append(f"{case}: module types {facts['types']}")


def _same_bookkeeping(case, ours: dict, stock: dict, problems: list) -> None:
    for key in ("boundary", "global_steps", "global_samples", "applied", "lrs"):
        if ours[key] != stock[key]:
            problems.append(f"{case}: {key} ours {ours[key]} stock {stock[key]}")


def _gradient_errors(ours: dict, stock: dict) -> list[dict]:
    """Per optimizer step, per weight: ||ours - stock|| / ||stock|| of the accumulated gradient the step took."""
    return [{n: float((mine[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in theirs.items()}
            for mine, theirs in zip(ours["grads"], stock["grads"])]


def _check_fp32_pair(case, ours: dict, stock: dict, world: int, problems: list) -> None:
    """fp32: the fused kernels sum in another order than transformers' modules, so everything is stock's to fp32
    rounding, with the family tests' tolerances: losses 1e-5 and norms 1e-4 relative, weights and masters
    check_fp32_weights'; every step's accumulated gradient 1e-4 relative per weight (measured: 2.3e-6)."""
    _check_engine_accounting(case, ours, world, problems)
    _same_bookkeeping(case, ours, stock, problems)
    for step, errors in enumerate(_gradient_errors(ours, stock)):
        worst = max(errors, key=errors.get)
        if errors[worst] > 1e-4:
            problems.append(f"{case}: step {step + 1}'s accumulated gradient of {worst} differs from stock's by "
                            f"{errors[worst]:.3g} (relative)")
    if check_start_and_curves(case, ours, stock, problems, CLIP, 1e-5, 1e-4):
        check_fp32_weights(case, ours, stock, problems)


@pytest.mark.parametrize("world", [1, 2])
def test_fp32_gradient_accumulation_equals_stock(tmp_path, world):
    """ZeRO-1 and ZeRO-2, fp32: the block (DeepSpeed's AdamW, and FusedAdamWClip) with 4 micro-steps per optimizer
    step trains as stock DeepSpeed, micro-step by micro-step, and the engine's accumulation bookkeeping is stock's."""
    runs = [(stage, "fp32", variant) for stage in (1, 2) for variant in ("stock", "block", "fused")]
    seed, ranks = _spawn(tmp_path, world, runs)
    problems = []
    for rank, results in enumerate(ranks):
        for stage in (1, 2):
            stock = results[stage, "fp32", "stock"]
            _check_facts((f"ZeRO-{stage}", "stock", rank), "stock", stock, stage, problems)
            _check_engine_accounting((f"ZeRO-{stage}", "stock", rank), stock, world, problems)
            for variant in ("block", "fused"):
                case = (f"ZeRO-{stage}", variant, f"rank{rank}/{world}")
                ours = results[stage, "fp32", variant]
                _check_facts(case, variant, ours, stage, problems)
                _check_fp32_pair(case, ours, stock, world, problems)
    assert not problems, f"seed {seed}:\n" + "\n".join(problems)


def _whole_experts(ranks: list[dict], run: tuple) -> list[dict]:
    """Each rank's result of an expert-parallel run with its experts made whole: every expert tensor (weights,
    masters, gradients: this rank's experts) joined with the other expert-parallel ranks' in expert order."""
    by_ep_rank = sorted(ranks, key=lambda results: results[run]["ep_rank"])

    def joined(parts: list[dict]) -> dict:
        return {name: torch.cat([part[name] for part in parts]) if ".experts." in name else value
                for name, value in parts[0].items()}

    whole = []
    for results in ranks:
        mine = dict(results[run])
        for what in ("initial", "weights", "masters"):
            mine[what] = joined([r[run][what] for r in by_ep_rank])
        mine["grads"] = [joined([r[run]["grads"][step] for r in by_ep_rank]) for step in range(len(mine["grads"]))]
        whole.append(mine)
    return whole


def test_expert_parallel_gradient_accumulation_equals_ep1_and_stock(tmp_path):
    """moe.ep_size 2 on 2 ranks, 4 micro-steps per optimizer step, ZeRO-1 and ZeRO-2, with DeepSpeed's AdamW (the
    script's HF-style parameter groups, which have no "name") and with FusedAdamWClip: each rank holds half the
    experts and trains them on both ranks' tokens; the losses, accumulated gradients, norms and every weight and
    fp32 master (both ranks' experts together) are those of the block at ep_size 1 and of stock DeepSpeed, and the
    accumulation bookkeeping is stock's."""
    runs = [(stage, "fp32", variant) for stage in (1, 2) for variant in ("stock", "fused", "ep2", "ep2_fused")]
    seed, ranks = _spawn(tmp_path, 2, runs)
    problems = []
    for stage in (1, 2):
        for variant in ("ep2", "ep2_fused"):
            ep_ranks = sorted(results[stage, "fp32", variant]["ep_rank"] for results in ranks)
            sharded = {n: tuple(v.shape) for n, v in ranks[0][stage, "fp32", variant]["masters"].items()
                       if ".experts." in n}
            if ep_ranks != [0, 1] or not sharded or any(shape[0] != EXPERTS // 2 for shape in sharded.values()):
                problems.append(f"ZeRO-{stage} {variant}: experts not sharded over 2 ranks: ep ranks {ep_ranks}, "
                                f"rank 0's expert masters {sharded}")
            whole = _whole_experts(ranks, (stage, "fp32", variant))
            for rank, results in enumerate(ranks):
                ours = whole[rank]
                _check_facts((f"ZeRO-{stage}", variant, rank), variant, ours, stage, problems)
                for baseline in ("stock", "fused"):
                    case = (f"ZeRO-{stage}", variant, f"rank{rank}/2", "vs stock" if baseline == "stock" else
                            "vs ep_size 1")
                    _check_fp32_pair(case, ours, results[stage, "fp32", baseline], 2, problems)
    assert not problems, f"seed {seed}:\n" + "\n".join(problems)


# bf16 tolerances of the block against stock (see the test's docstring)
BF16_LOSS_RTOL, BF16_NORM_RTOL = 3e-2, 5e-2
BF16_UPDATE_BOUND = {"MoE path": 0.6, "rest": 0.4}


def test_bf16_zero2_gradient_accumulation_within_bf16_tolerance_of_stock(tmp_path):
    """bf16, ZeRO-2, 1 rank, 4 micro-steps per optimizer step, the block (DeepSpeed's AdamW, and FusedAdamWClip)
    against stock.

    The accumulation itself is exact, in both: every optimizer step's gradient is bit for bit the one plain PyTorch
    accumulates (autograd adding each micro-step's bf16 gradient of loss / 4 into the bf16 ``.grad``) over the same
    micro-batches from the step's weights, with the run's own modules. The bookkeeping is stock's.

    Against stock, the differences are those of the block's bf16 modules, as test_moe_families_zero3.py explains
    them: the fused kernels round where transformers' modules do, but from the first step bf16 router logits within
    an ulp of a tie go to another expert above the first MoE layer (and exact ties below it), and from the second
    step the weights differ by bf16 roundings and more ties flip; Adam's early updates carry small gradient
    differences into the weights. At this model's scale (initializer_range 0.2, 128 tokens a step) the spread is
    wider than in the family test: measured over 30 runs, the micro-steps' losses within 1.6e-2 (relative) of
    stock's, the grad norms within 1.5e-2, the fp32 masters' trained updates within 0.30 (MoE path: routers,
    experts, the norm feeding the router) and 0.20 (the rest); the first step's gradients up to 0.28 / 0.14 off
    where tokens flipped. With transformers' initializer_range (0.02) the same comparison gave losses within 6e-5
    and updates within 0.17 / 0.010 (6 runs), but no step clips there. It is not the accumulation: the block against
    stock with one micro-batch of 8 per step (the same tokens, gradient_accumulation_steps 1) spreads as far (10
    runs: updates within 0.20 / 0.15, against 0.15 / 0.17 with 4 micro-steps in the same runs). The bounds are 2x
    what was measured (the norms': the family test's 5e-2), below what a wrong gradient gives (an uncorrelated
    update is sqrt(2) off), and a missing micro-step or a gradient not divided by 4 fails the exact accumulation
    check (and the norms)."""
    runs = [(2, "bf16", variant) for variant in ("stock", "block", "fused")]
    seed, (results,) = _spawn(tmp_path, 1, runs)
    problems = []
    stock = results[2, "bf16", "stock"]
    _check_facts(("ZeRO-2 bf16", "stock"), "stock", stock, 2, problems)
    _check_engine_accounting(("ZeRO-2 bf16", "stock"), stock, 1, problems)
    for variant in ("block", "fused"):
        case = ("ZeRO-2 bf16", variant)
        ours = results[2, "bf16", variant]
        _check_facts(case, variant, ours, 2, problems)
        _check_engine_accounting(case, ours, 1, problems)
        _same_bookkeeping(case, ours, stock, problems)
        if not check_start_and_curves(case, ours, stock, problems, CLIP, BF16_LOSS_RTOL, BF16_NORM_RTOL):
            continue
        check_bf16_updates(case, ours, stock, BF16_UPDATE_BOUND, problems)
    assert not problems, f"seed {seed}:\n" + "\n".join(problems)


# the HF Trainer with --deepspeed and 4 micro-steps per optimizer step: MODEL_SNIPPET's Mixtral with transformers'
# load-balancing loss on, 3 optimizer steps logged one by one
TRAINER_GAS_SCRIPT = MODEL_SNIPPET + """
from transformers import Trainer, TrainingArguments

model.config.output_router_logits = True  # read at each forward
model.router_aux_loss_coef = 0.02         # the model took the config's at construction
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (24, 16))]
args = TrainingArguments(output_dir=sys.argv[2], deepspeed=sys.argv[1], max_steps=3, per_device_train_batch_size=2,
                         gradient_accumulation_steps=4, learning_rate=1e-2, report_to=[], use_cpu=True,
                         save_strategy="no", logging_steps=1)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
engine = trainer.model_wrapped
logs = [h for h in trainer.state.log_history if "loss" in h]
print("TRAINED " + json.dumps({"losses": [h["loss"] for h in logs], "grad_norms": [h.get("grad_norm") for h in logs],
                               "global_step": trainer.state.global_step, "engine_steps": engine.global_steps,
                               "micro_steps": engine.micro_steps, "gas": engine.gradient_accumulation_steps(),
                               "adam_steps": sorted({float(s["step"]) for s in engine.basic_optimizer.state.values()
                                                     if "step" in s}),
                               "optimizer": type(engine.basic_optimizer).__name__}))
report(engine.module, trainer.optimizer, engine)
leave()
"""

TRAINER_BLOCKS = {"stock": None, "block": {"enabled": True},
                  "fused": {"enabled": True, "optimizer": {"fused_adamw_clip": True}}}


def test_hf_trainer_gradient_accumulation_logs_stock_losses(tmp_path, accelerate_installed):
    """The HF Trainer, gradient_accumulation_steps 4 ("auto" in the DeepSpeed config, ZeRO-2, gradient_clipping
    1.0, not reached by this model's norms of 0.8-0.9), the block from the config alone (with the Trainer's AdamW,
    and with FusedAdamWClip standing in for it) against the same config without the block: the 3 logged losses and
    grad norms are stock's (fp32 rounding of the fused kernels: 1e-5 / 1e-4, as test_config_only's Trainer tests),
    3 optimizer steps in the Trainer, in DeepSpeed and in Adam's step counts, and the block's log lines name the
    family and modules it replaced (stock's none)."""
    config = {**HF_BASE, "zero_optimization": {"stage": 2}, "gradient_clipping": CLIP}

    def run(variant: str) -> str:
        folder = tmp_path / variant
        folder.mkdir()
        block = TRAINER_BLOCKS[variant]
        return _run_script(folder, TRAINER_GAS_SCRIPT, {**config, **({"loongforge": block} if block else {})},
                           str(folder / "out"))

    with concurrent.futures.ThreadPoolExecutor(len(TRAINER_BLOCKS)) as pool:
        outputs = dict(zip(TRAINER_BLOCKS, pool.map(run, TRAINER_BLOCKS)))
    trained = {variant: _tagged(output, "TRAINED") for variant, output in outputs.items()}
    for variant, output in outputs.items():
        got = trained[variant]
        # (the Trainer, through accelerate, calls engine.step() once per optimizer step: DeepSpeed's micro_steps
        # counts those calls, 3, in stock's run and ours alike)
        assert (got["global_step"], got["engine_steps"], got["micro_steps"], got["gas"], got["adam_steps"]) == (
            3, 3, trained["stock"]["micro_steps"], GAS, [3.0]), (variant, got, trained["stock"])
        assert len(got["losses"]) == 3 and len(set(got["losses"])) == 3, (variant, got)
        types = set(_result(output)["types"])
        lines = [line for line in output.splitlines() if line.startswith("[LoongForge]")]
        if variant == "stock":
            assert STOCK_TYPES <= types and not OUR_TYPES & types and not lines, (sorted(types), lines)
            assert got["optimizer"] == "AdamW", got
            continue
        assert OUR_TYPES <= types and not STOCK_TYPES & types, (variant, sorted(types))
        for line in ("[LoongForge] families: mixtral", "[LoongForge] ExpertMaskedMoE: 2 modules",
                     "[LoongForge] fused RMSNorm: 5 modules"):
            assert line in lines, (variant, line, lines)
        assert got["optimizer"] == ("FusedAdamWClip" if variant == "fused" else "AdamW"), (variant, got)
        stock = trained["stock"]
        assert np.allclose(got["losses"], stock["losses"], rtol=1e-5, atol=0), (variant, got, stock)
        assert np.allclose(got["grad_norms"], stock["grad_norms"], rtol=1e-4, atol=0), (variant, got, stock)


def test_expert_aware_sampler_with_gradient_accumulation(tmp_path):
    """ds_loongforge.initialize(training_data=...) with the expert-aware sampler on, 2 ranks, 4 micro-batches per
    optimizer step, two epochs of 14 micro-batches a rank (3.5 optimizer steps: the second epoch begins inside an
    accumulation window), each batch trained on as it comes: every epoch draws every sample exactly once over the
    ranks (none lost, none repeated; stock DeepSpeed's loader too), each rank as many micro-batches as the others,
    the batches of the same sampler built on its own from the same weights (the accumulation changes nothing in
    it), balanced in expected expert load better than random batches of the same samples (the per-batch peak
    load's coefficient of variation at most 3/4 of random's mean; measured 0.29-0.40), and the engine at 3, then 7
    optimizer steps. With DeepSpeed's "dataloader_drop_last": true and 6 samples more than whole micro-batches
    take, the loader leaves them out, as stock DeepSpeed's does: each rank the same 14 micro-batches, no sample
    twice (the sampler was built with drop_last false whatever the config said, and topped the epoch up with
    repeats: 15 micro-batches a rank, 2 samples drawn twice)."""
    from ds_loongforge.data import batch_loads, max_load_cv

    world = 2
    seed = int(torch.randint(0, 2**31, ()))
    spawn_with_deadline(_sampler_worker, world, seed, str(tmp_path), timeout_s=SPAWN_TIMEOUT_S)
    ranks = [torch.load(tmp_path / f"sampler_rank{r}.pt", weights_only=False) for r in range(world)]
    assert ranks[0]["distinct"] == SAMPLES + EXTRA, "the random samples must be distinct to be told apart"
    per_rank = SAMPLES // (SAMPLER_MICRO * world)
    for variant in ("stock", "block"):
        for drop_last in (False, True):
            runs = [results[variant, drop_last] for results in ranks]
            case = f"{variant}, dataloader_drop_last {drop_last}"
            assert all(run["is_expert_aware"] == (variant == "block") for run in runs), (case, runs[0]["sampler"])
            for epoch, _ in enumerate(runs[0]["epochs"]):
                epochs = [run["epochs"][epoch] for run in runs]
                drawn = sorted(i for batches in epochs for batch in batches for i in batch)
                repeated = sorted({i for i in drawn if drawn.count(i) > 1})
                if drop_last:  # SAMPLES of the SAMPLES + EXTRA, each once
                    assert len(drawn) == SAMPLES and not repeated and 0 <= drawn[0] and drawn[-1] < SAMPLES + EXTRA, (
                        f"{case}: {len(drawn)} samples drawn (expected {SAMPLES}), repeated {repeated}")
                else:
                    assert drawn == list(range(SAMPLES)), (f"{case}, epoch {epoch}: lost "
                                                           f"{sorted(set(range(SAMPLES)) - set(drawn))}, repeated "
                                                           f"{repeated}")
                assert [len(batches) for batches in epochs] == [per_rank] * world, (case, epoch, epochs)
                assert all(len(batch) == SAMPLER_MICRO for batches in epochs for batch in batches), (case, epoch)
            steps = [(e + 1) * per_rank // GAS for e in range(len(runs[0]["epochs"]))]
            assert all(run["global_steps"] == steps for run in runs), (case, [run["global_steps"] for run in runs])
    block = [results["block", False] for results in ranks]
    for rank, run in enumerate(block):
        assert run["epochs"] == run["alone"], f"rank {rank}: the loader's batches are not the sampler's own"
    assert block[0]["epochs"][0] != block[0]["epochs"][1], "set_epoch drew the same epoch again"
    loads = block[0]["loads"]
    rng = np.random.default_rng(seed)
    for epoch in range(EPOCHS):
        batches = [batch for run in block for batch in run["epochs"][epoch]]
        aware = max_load_cv(batch_loads(batches, loads))
        random = np.mean([max_load_cv(batch_loads(rng.permutation(SAMPLES).reshape(-1, SAMPLER_MICRO), loads))
                          for _ in range(50)])
        assert aware <= 0.75 * random, (epoch, aware, random)
