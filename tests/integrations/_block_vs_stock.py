"""Helpers of the tests that train a model with the ``"loongforge"`` block and without it (stock DeepSpeed) on CPU
gloo ranks and compare the two runs weight by weight (test_tied_embeddings.py, test_moe_families_zero3.py)."""

from __future__ import annotations

import deepspeed
import torch


def hf_groups(model, weight_decay: float) -> list[dict]:
    """The HF Trainer's two groups: matrices (and stacked experts) decay, norms and other 1-d weights do not. By the
    whole shape: a Parameter built under zero.Init holds an empty 1-d placeholder (its ``ds_shape`` is its shape).
    A tied Parameter comes once (``named_parameters`` lists it under its first name)."""
    named = list(model.named_parameters())
    decay = [p for _, p in named if len(getattr(p, "ds_shape", p.shape)) >= 2]
    rest = [p for _, p in named if len(getattr(p, "ds_shape", p.shape)) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def under_stock_names(named: dict) -> dict:
    """Weights of an injected model under stock transformers' names: the fused MLP's gate_up_proj as gate_proj and
    up_proj (stacked experts keep their names, ExpertMaskedMoE's are transformers')."""
    out = {}
    for name, value in named.items():
        if ".gate_up_proj." in name:
            gate, up = value.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = value
    return out


def gathered(module, head_data: bool = False, buffers: tuple[str, ...] = ()) -> dict:
    """Every parameter as an fp32 copy (gathered under ZeRO-3), under stock names; ``head_data``: also
    ``lm_head.weight``'s data as "<lm_head.weight data>" (a tied head is not listed on its own); ``buffers``: the
    buffers whose names contain one of these, as "<buffer NAME>"."""
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        weights = {n: p.detach().float().clone() for n, p in module.named_parameters()}
        if head_data:
            weights["<lm_head.weight data>"] = module.lm_head.weight.detach().float().clone()
    weights.update({f"<buffer {n}>": b.detach().float().clone() for n, b in module.named_buffers()
                    if any(part in n for part in buffers)})
    return under_stock_names(weights)


def masters(engine) -> dict:
    """Every parameter's fp32 master (DeepSpeed's full copy of it), under stock names."""
    from deepspeed.utils import safe_get_full_fp32_param

    return under_stock_names({n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()})


def relative_update_error(ours: dict, stock: dict, initial: dict) -> dict:
    """Per weight: ||ours - stock|| / ||stock - initial||, the trained update's relative error ("<...>" entries
    skipped)."""
    out = {}
    for name, value in stock.items():
        if name.startswith("<"):
            continue
        update = value - initial[name]
        out[name] = float((ours[name] - value).norm() / update.norm().clamp_min(1e-30))
    return out


def in_moe_path(name: str) -> bool:
    """The weights a changed expert choice moves first: the MoE layers' routers, experts and shared experts (and
    DeepSeek-V3's dense MLPs, named alike), and the norm whose output the router reads."""
    return ".mlp." in name or "post_attention_layernorm" in name


def check_bf16_updates(case, ours: dict, stock: dict, bounds: dict, problems: list) -> None:
    """bf16: each fp32 master's trained update against stock's (``relative_update_error``), the worst of the MoE
    path (``in_moe_path``) and of the rest each within its bound (``bounds``: {"MoE path": b, "rest": b})."""
    errors = relative_update_error(ours["masters"], stock["masters"], stock["initial"])
    for part, bound in bounds.items():
        mine = {n: e for n, e in errors.items() if in_moe_path(n) == (part == "MoE path")}
        worst = max(mine, key=mine.get)
        if mine[worst] > bound:
            problems.append(f"{case} masters ({part}): update differs from stock's by {mine[worst]:.3g} "
                            f"(relative) in {worst}; all above {bound / 2}: "
                            f"{[(n, round(e, 3)) for n, e in mine.items() if e > bound / 2]}")


def fallbacks() -> list:
    """The reasons a training call ran the original forward instead of the fused loss (logged once each)."""
    from ds_loongforge.integrations import fused_loss

    return sorted(fused_loss._warned)


def check_start_and_curves(case, ours: dict, stock: dict, problems: list, clip: float, loss_rtol: float,
                           norm_rtol: float) -> bool:
    """The two runs' shared checks, each failure appended to ``problems``: clipping active at every step of both,
    the same weight names and initial weights (through the fused MLP's names), and the per-step losses and grad
    norms within ``loss_rtol`` / ``norm_rtol``. False when the names differ (the weights cannot be compared)."""
    for name, run in (("ours", ours), ("stock", stock)):
        if not all(n > clip for n in run["norms"]):
            problems.append(f"{case} {name}: clipping not active on every step, norms {run['norms']}")
    if sorted(ours["initial"]) != sorted(stock["initial"]):
        problems.append(f"{case}: weight names differ: {sorted(set(ours['initial']) ^ set(stock['initial']))}")
        return False
    bad_init = [n for n in stock["initial"] if not torch.equal(ours["initial"][n], stock["initial"][n])]
    if bad_init:
        problems.append(f"{case}: the initial weights differ: {bad_init}")
    for key, rtol in (("losses", loss_rtol), ("norms", norm_rtol)):
        if not torch.allclose(torch.tensor(ours[key]), torch.tensor(stock[key]), rtol=rtol, atol=0):
            problems.append(f"{case}: {key} ours {ours[key]} stock {stock[key]}")
    return True


def ds_config(zero: dict, dtype: str, block: dict | None, *, micro: int, clip: float, lr: float, weight_decay: float,
              eps: float) -> dict:
    """A DeepSpeed config for the comparison: AdamW with weight decay (torch's, with DeepSpeed's own clipping, for
    the stock run; FusedAdamWClip where ``block`` selects it), ``block`` as the "loongforge" block (None: stock)."""
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
              "zero_optimization": zero, "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay, "betas": [0.9, 0.95],
                                                        "eps": eps, "torch_adam": True}}}
    if block is not None:
        config["loongforge"] = block
    return config


def token_batches(steps: int, world: int, micro: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """[steps, world, micro, seq] token ids, the same on every rank (each takes its own [step, rank])."""
    return torch.randint(0, vocab, (steps, world, micro, seq), generator=torch.Generator().manual_seed(seed + 1))


def check_fp32_weights(case, ours: dict, stock: dict, problems: list) -> None:
    """fp32 runs: every weight and fp32 master of ours within rtol 1e-5 / atol 3e-6 of stock's."""
    for what in ("weights", "masters"):
        for name, value in stock[what].items():
            got = ours[what][name]
            if not torch.allclose(got, value, rtol=1e-5, atol=3e-6):
                problems.append(f"{case} {what} {name}: max |diff| {float((got - value).abs().max()):.3g}")
