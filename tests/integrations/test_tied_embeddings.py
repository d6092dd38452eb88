"""Tied input/output embeddings (``tie_word_embeddings=True``, as Llama 3.2 1B/3B and Qwen2 0.5B/1.5B ship) with the
config's ``"loongforge"`` block (fused kernels, the fused LM head + cross-entropy, FusedAdamWClip) against stock
DeepSpeed (the same config without the block: torch's AdamW, DeepSpeed's own clipping), on CPU gloo ranks:

- ZeRO-2 on 1 and 2 ranks and ZeRO-3 on 2 ranks (the model built whole, and loaded under ``deepspeed.zero.Init``),
  fp32 and bf16, a tiny Llama and a tiny Qwen2: the losses, grad norms (clipping active: every norm above
  ``gradient_clipping``) and every weight after a few AdamW steps with weight decay are stock's (fp32 to ~1e-5,
  bf16 within a bf16 tolerance); the LM head and the embedding are still one Parameter after training, and that
  Parameter is held once by the optimizer.
- save_checkpoint / load_checkpoint with the block at ZeRO-2: the next step after loading is the next step of the
  run that saved (bit for bit), and the loaded model's head and embedding are still one Parameter.
"""

from __future__ import annotations

import pytest
import torch

import deepspeed  # noqa: F401  (an install requirement: a missing one must fail, not skip)

from tests._dist import init_cpu_rank, spawn_with_deadline
from tests.integrations._block_vs_stock import (check_fp32_weights, check_start_and_curves, ds_config, fallbacks,
                                                gathered, hf_groups, masters, relative_update_error,
                                                token_batches)

VOCAB, HIDDEN, INTER, SEQ, MICRO = 128, 32, 48, 16, 2
STEPS = 4
LR, WD = 1e-2, 0.1
# below every step's gradient norm here (~1.2-3 at these sizes): every step clips, in both runs
CLIP = 0.5
# Adam's eps, 1e-4 as in tests/optim/test_fused_adamw_clip_deepspeed.py: an entry steps by about
# lr * g / (|g| + eps), so a gradient that differs by fp32 summation order (~1e-9 absolute in the tied embedding's
# rows, whose head and embedding parts nearly cancel) moves it by ~lr * dg / (4 eps) where |g| ~ eps: with eps 1e-6
# that is ~3e-6 after 4 steps (measured: Qwen2 fp32, 1.1e-5, as much with stock AdamW under the block's fused
# kernels), with 1e-4 below 1e-6. A wrong gradient (a missing half of the tied one) is off by O(lr) = 1e-2.
EPS = 1e-4
SPAWN_TIMEOUT_S = 240
FAMILIES = ("llama", "qwen2")
DTYPES = ("fp32", "bf16")
BLOCK = {"enabled": True, "strict_ops": False, "optimizer": {"fused_adamw_clip": True},
         "sampler": {"expert_aware": False}}


# ----------------------------------------------------------------------------------------------- in the workers

def _hf_config(family: str):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    return cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def _model_class(family: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[family]


def _model(family: str, seed: int):
    torch.manual_seed(seed)
    model = _model_class(family)(_hf_config(family))
    assert model.lm_head.weight is model.model.embed_tokens.weight, "transformers did not tie the weights"
    return model


def _ds_config(stage: int, dtype: str, block: bool) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned, the tied one included
    return ds_config(zero, dtype, BLOCK if block else None, micro=MICRO, clip=CLIP, lr=LR, weight_decay=WD, eps=EPS)


def _batches(world: int, seed: int) -> torch.Tensor:
    return token_batches(STEPS, world, MICRO, SEQ, VOCAB, seed)


def _optimizer_holdings(engine) -> dict:
    """How often the tied Parameter (and any Parameter) is held by the ZeRO optimizer's groups."""
    zero = engine.optimizer
    groups = getattr(zero, "bit16_groups", None) or getattr(zero, "fp16_groups", None)
    held = [p for g in groups for p in g]
    module = engine.module
    tied = module.model.embed_tokens.weight
    trainable = [p for p in module.parameters() if p.requires_grad]
    return {"tied": sum(p is tied for p in held), "held": len(held), "distinct": len({id(p) for p in held}),
            "trainable": len(trainable), "all_trainable_held": {id(p) for p in held} == {id(p) for p in trainable}}


def _engine_facts(engine) -> dict:
    from ds_loongforge.integrations.fused_loss import uses_fused_loss
    from ds_loongforge.optim import FusedAdamWClip

    module = engine.module
    return {"fused_loss": uses_fused_loss(module),
            "fused_adamw_clip": isinstance(engine.basic_optimizer, FusedAdamWClip),
            "fused_mlp": any("gate_up_proj" in n for n, _ in module.named_parameters()),
            "ds_clip": engine.gradient_clipping()}


def _tied(module) -> dict:
    head, embed = module.lm_head.weight, module.model.embed_tokens.weight
    with deepspeed.zero.GatheredParameters([head, embed]):
        data_equal = torch.equal(head.detach(), embed.detach())
    state = module.state_dict()
    return {"is": head is embed, "data_equal": data_equal,
            "state_dict_keys": sorted(k for k in ("lm_head.weight", "model.embed_tokens.weight") if k in state)}


def _train(engine, batches, rank: int) -> dict:
    losses, norms, fused = [], [], []
    for ids in batches:
        ids = ids[rank].to(engine.device)
        result = engine(input_ids=ids, labels=ids)
        fused.append(result.logits is None)  # the fused loss's output: no [tokens, vocab] logits
        loss = result.loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float().item())
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
    return {"losses": losses, "norms": norms, "fused_calls": fused}


def _run(family, stage, dtype, block, seed, batches, rank, zero_init_folder=None) -> dict:
    import deepspeed as ds

    config = _ds_config(stage, dtype, block)
    if zero_init_folder is None:
        model = _model(family, seed)
    else:  # as the HF Trainer does under a ZeRO-3 config: from_pretrained builds it partitioned
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds = HfDeepSpeedConfig({**config, "train_batch_size": MICRO * torch.distributed.get_world_size()})
        # from_pretrained returns eval(), where the fused loss leaves the call to transformers; the Trainer trains in
        # train() mode
        model = _model_class(family).from_pretrained(zero_init_folder).train()
        del hf_ds
        assert all(hasattr(p, "ds_id") for p in model.parameters()), "not built under zero.Init"
        assert model.lm_head.weight is model.model.embed_tokens.weight, "from_pretrained did not tie under zero.Init"
    engine, *_ = ds.initialize(model=model, model_parameters=hf_groups(model, WD), config=config)
    facts = _engine_facts(engine)
    initial = gathered(engine.module, head_data=True)
    result = _train(engine, batches, rank)
    facts["fallbacks"] = fallbacks()
    result.update(facts=facts, initial=initial, weights=gathered(engine.module, head_data=True),
                  masters=masters(engine), tied=_tied(engine.module), holdings=_optimizer_holdings(engine))
    return result


def _compare_worker(rank, world, port, seed, stage, zero_init, out_dir):
    init_cpu_rank(rank, world, port)
    batches = _batches(world, seed)
    results = {}
    for family in FAMILIES:
        folder = None
        if zero_init:
            folder = f"{out_dir}/{family}"
            if rank == 0:
                _model(family, seed).save_pretrained(folder)
            torch.distributed.barrier()
        for dtype in DTYPES:
            for block in (False, True):
                results[family, dtype, block] = _run(family, stage, dtype, block, seed, batches, rank, folder)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _checkpoint_worker(rank, world, port, seed, out_dir):
    """Per dtype, with the block at ZeRO-2: STEPS steps straight through (saving after STEPS - 1), then a fresh
    engine on another model loads that checkpoint and takes the last step on the same batch."""
    init_cpu_rank(rank, world, port)
    import deepspeed as ds

    batches = _batches(world, seed)
    results = {}
    for family in FAMILIES:
        for dtype in DTYPES:
            config = _ds_config(2, dtype, block=True)
            model = _model(family, seed)
            engine, *_ = ds.initialize(model=model, model_parameters=hf_groups(model, WD), config=config)
            first = _train(engine, batches[:-1], rank)
            saved = {"weights": gathered(engine.module, head_data=True), "masters": masters(engine)}
            engine.save_checkpoint(f"{out_dir}/{family}_{dtype}", tag="t")
            last = _train(engine, batches[-1:], rank)
            straight = {"weights": gathered(engine.module, head_data=True), "masters": masters(engine), **last}

            fresh = _model(family, seed + 1000)
            engine2, *_ = ds.initialize(model=fresh, model_parameters=hf_groups(fresh, WD), config=config)
            engine2.load_checkpoint(f"{out_dir}/{family}_{dtype}", tag="t")
            loaded = {"weights": gathered(engine2.module, head_data=True), "masters": masters(engine2),
                      "tied": _tied(engine2.module), "holdings": _optimizer_holdings(engine2),
                      "facts": _engine_facts(engine2)}
            last2 = _train(engine2, batches[-1:], rank)
            loaded["facts"]["fallbacks"] = fallbacks()
            resumed = {"weights": gathered(engine2.module, head_data=True), "masters": masters(engine2), **last2,
                       "tied": _tied(engine2.module)}
            results[family, dtype] = {"first": first, "saved": saved, "straight": straight, "loaded": loaded,
                                      "resumed": resumed}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


# ----------------------------------------------------------------------------------------------- in pytest

def _check_pair(case, ours: dict, stock: dict, problems: list) -> None:
    """Our run against stock's: the engine set-up, the tied Parameter, losses, norms and weights."""
    facts = ours["facts"]
    if not (facts["fused_loss"] and facts["fused_adamw_clip"] and facts["fused_mlp"] and facts["ds_clip"] == 0.0
            and facts["fallbacks"] == []):
        problems.append(f"{case}: the block is not in effect: {facts}")
    if ours["fused_calls"] != [True] * STEPS or stock["fused_calls"] != [False] * STEPS:
        problems.append(f"{case}: the fused loss ran in {ours['fused_calls']} (ours), {stock['fused_calls']} (stock)")
    sfacts = stock["facts"]
    if sfacts["fused_loss"] or sfacts["fused_adamw_clip"] or sfacts["fused_mlp"] or sfacts["ds_clip"] != CLIP:
        problems.append(f"{case}: the stock run is not stock: {sfacts}")
    for name, run in (("ours", ours), ("stock", stock)):
        if run["tied"] != {"is": True, "data_equal": True,
                           "state_dict_keys": ["lm_head.weight", "model.embed_tokens.weight"]}:
            problems.append(f"{case} {name}: head and embedding no longer tied after training: {run['tied']}")
        h = run["holdings"]
        if h["tied"] != 1 or h["held"] != h["distinct"] or not h["all_trainable_held"]:
            problems.append(f"{case} {name}: optimizer holdings {h}")
    bf16 = case[1] == "bf16"
    if not check_start_and_curves(case, ours, stock, problems, CLIP, *((2e-2, 5e-2) if bf16 else (1e-5, 1e-4))):
        return
    # every weight (and the fp32 masters) after training
    if bf16:
        # bf16 forward/backward: gradients agree to bf16 rounding and Adam normalises them, so the fp32 masters
        # are compared by the trained update as a whole (measured: 1-2% apart, the worst weight); a wrong gradient
        # (e.g. a missing half of the tied one) is an O(1) error there
        errors = relative_update_error(ours["masters"], stock["masters"], stock["initial"])
        worst = max(errors, key=errors.get)
        if errors[worst] > 0.1:
            problems.append(f"{case} masters: update differs from stock's by {errors[worst]:.3g} (relative) in "
                            f"{worst}; all above 0.05: {[(n, round(e, 3)) for n, e in errors.items() if e > 0.05]}")
        for name, run in (("ours", ours), ("stock", stock)):  # each run's bf16 weights are its masters rounded
            off = [n for n, m in run["masters"].items() if not torch.equal(run["weights"][n], m.bfloat16().float())]
            if off:
                problems.append(f"{case} {name}: bf16 weights are not the masters rounded: {off}")
    else:
        check_fp32_weights(case, ours, stock, problems)
    tied_w = ours["weights"]
    if not torch.equal(tied_w["<lm_head.weight data>"], tied_w["model.embed_tokens.weight"]):
        problems.append(f"{case}: our head's data is not the embedding's")


def _compare(tmp_path, world: int, stage: int, zero_init: bool = False) -> list:
    seed = int(torch.randint(0, 2**31, ()))
    spawn_with_deadline(_compare_worker, world, seed, stage, zero_init, str(tmp_path), timeout_s=SPAWN_TIMEOUT_S)
    problems = []
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for family in FAMILIES:
        for dtype in DTYPES:
            for r, result in enumerate(ranks):
                case = (family, dtype, f"zero{stage}", f"world{world}", f"rank{r}") + (("zero.Init",) if zero_init
                                                                                       else ())
                _check_pair(case, result[family, dtype, True], result[family, dtype, False], problems)
    return problems


@pytest.mark.parametrize("world", [1, 2])
def test_zero2_tied_embeddings_train_as_stock(tmp_path, world):
    """ZeRO-2, 1 and 2 ranks, fp32 and bf16, Llama and Qwen2 with tied embeddings: the block (fused kernels, fused
    LM head + cross-entropy, FusedAdamWClip) trains as stock DeepSpeed does, and keeps the head tied."""
    problems = _compare(tmp_path, world, stage=2)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("zero_init", [False, True], ids=["whole", "zero_init"])
def test_zero3_tied_embeddings_train_as_stock(tmp_path, zero_init):
    """ZeRO-3 on 2 ranks (every parameter partitioned), built whole or loaded under deepspeed.zero.Init: the same."""
    problems = _compare(tmp_path, 2, stage=3, zero_init=zero_init)
    assert not problems, "\n".join(problems)


def test_zero2_checkpoint_round_trip_with_tied_embeddings(tmp_path):
    """With the block at ZeRO-2 on 2 ranks: a checkpoint saved one step before the end and loaded into a fresh
    engine (another initialisation) gives the loaded weights and masters of the saving run, the head still tied,
    and the same last step, bit for bit."""
    seed = int(torch.randint(0, 2**31, ()))
    spawn_with_deadline(_checkpoint_worker, 2, seed, str(tmp_path), timeout_s=SPAWN_TIMEOUT_S)
    problems = []
    for r in range(2):
        results = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        for (family, dtype), run in results.items():
            case = (family, dtype, f"rank{r}")
            facts = run["loaded"]["facts"]
            if not (facts["fused_loss"] and facts["fused_adamw_clip"] and facts["fused_mlp"]
                    and not facts["fallbacks"]):
                problems.append(f"{case}: the block is not in effect: {facts}")
            for stage in ("loaded", "resumed"):
                if run[stage]["tied"] != {"is": True, "data_equal": True,
                                          "state_dict_keys": ["lm_head.weight", "model.embed_tokens.weight"]}:
                    problems.append(f"{case} {stage}: head and embedding not tied: {run[stage]['tied']}")
            h = run["loaded"]["holdings"]
            if h["tied"] != 1 or h["held"] != h["distinct"] or not h["all_trainable_held"]:
                problems.append(f"{case}: optimizer holdings after load {h}")
            for what in ("weights", "masters"):
                for name, value in run["saved"][what].items():
                    if not torch.equal(run["loaded"][what][name], value):
                        problems.append(f"{case} loaded {what} {name} differ from the saved ones by "
                                        f"{float((run['loaded'][what][name] - value).abs().max()):.3g}")
                for name, value in run["straight"][what].items():
                    if not torch.equal(run["resumed"][what][name], value):
                        problems.append(f"{case} resumed step {what} {name} differs by "
                                        f"{float((run['resumed'][what][name] - value).abs().max()):.3g}")
            if run["resumed"]["losses"] != run["straight"]["losses"] or \
                    run["resumed"]["norms"] != run["straight"]["norms"]:
                problems.append(f"{case}: resumed loss/norm {run['resumed']['losses']} {run['resumed']['norms']} "
                                f"vs {run['straight']['losses']} {run['straight']['norms']}")
    assert not problems, "\n".join(problems)
