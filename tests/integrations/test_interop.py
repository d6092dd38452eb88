"""inject() beside what else touches a transformers model, in fp32 on CPU: frozen Parameters (a PEFT base, a
``requires_grad_(False)`` model) stay frozen; a q/k/v projection wrapped or hooked after inject runs on its own;
PEFT adapters applied after inject take effect or are refused by name, never silently dropped; a wrapper around
ExpertMaskedMoE's experts is an error; torch.compile of an fp32 MoE layer on the CPU."""

import copy
import logging

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from ds_loongforge.integrations.inject import KIND_MLP, inject
from ds_loongforge.modules import ExpertMaskedMoE, FusedSwiGLUMLP
from ds_loongforge.modules import norm_mlp
from ds_loongforge.modules.norm_mlp import FusedIntoGateUp
from ds_loongforge.modules.qkv import FusedQKVLinear
from tests.integrations.test_inject import ENABLED, FAMILIES, build, run, token_ids

RTOL, ATOL = 1e-5, 1e-6


def _trainable_keys(model: nn.Module) -> set[str]:
    """Names of the trainable Parameters, with a fused gate_up_proj named as the two stock Linears."""
    names = set()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if ".gate_up_proj." in name and "experts" not in name:
            names |= {name.replace("gate_up_proj", "gate_proj"), name.replace("gate_up_proj", "up_proj")}
        else:
            names.add(name)
    return names


@pytest.mark.parametrize("family", list(FAMILIES))
def test_frozen_parameters_stay_frozen(family):
    """The MoE and MLP replacements are new Parameters (trainable by default): each takes its original's
    requires_grad, so a frozen base (PEFT, a requires_grad_(False) model) is not trained through them."""
    model = build(family).requires_grad_(False)
    report = inject(model, ENABLED)
    assert report.total_replaced > 0
    assert _trainable_keys(model) == set()

    model = build(family)
    for name, param in model.named_parameters():  # freeze the MLPs, experts and routers; keep the rest trainable
        if ".mlp." in name:
            param.requires_grad_(False)
    expected = _trainable_keys(model)
    inject(model, ENABLED)
    assert _trainable_keys(model) == expected
    ids = token_ids(model, (2, 8))
    run(model.train(), ids)
    for name, param in model.named_parameters():
        assert (param.grad is not None) == param.requires_grad, name


def test_mlp_with_only_one_of_gate_and_up_frozen_stays_stock():
    model = build("llama")
    model.model.layers[0].mlp.gate_proj.weight.requires_grad_(False)
    report = inject(model, ENABLED)
    assert report.replaced[KIND_MLP] == 1
    reasons = dict(report.not_replaced)
    assert "gate_proj.weight.requires_grad=False but up_proj.weight.requires_grad=True" in reasons[
        "model.layers.0.mlp"]
    assert not isinstance(model.model.layers[0].mlp, FusedSwiGLUMLP)
    with pytest.raises(ValueError, match="cannot be partly frozen"):
        FusedSwiGLUMLP.from_hf(model.model.layers[0].mlp)


class _WeightDelta(nn.Module):
    """Adds ``delta`` to the wrapped Linear's weight during its own call only, as PEFT's ParamWrapper
    (target_parameters) does through a parametrization."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer = base
        self.delta = nn.Parameter(0.05 * torch.randn_like(base.weight))

    def forward(self, x):
        delta = self.delta

        class Add(nn.Module):
            def forward(self, weight):
                return weight + delta

        parametrize.register_parametrization(self.base_layer, "weight", Add())
        try:
            return self.base_layer(x)
        finally:
            parametrize.remove_parametrizations(self.base_layer, "weight", leave_parametrized=False)


@pytest.mark.parametrize("change", ["wrapped", "pre_hook"])
def test_qkv_projection_wrapped_or_hooked_after_inject_runs_on_its_own(change):
    """One product for q, k and v is taken at q_proj's call: a v_proj whose weight changes only at its own call
    (a wrapper standing in its place, a forward pre-hook) must not get the slice of that product."""
    stock = build("llama").train()
    injected = copy.deepcopy(stock)
    inject(injected, ENABLED)
    for model in (stock, injected):
        torch.manual_seed(3)
        for layer in model.model.layers:
            attention = layer.self_attn
            if change == "wrapped":
                attention.v_proj = _WeightDelta(attention.v_proj)
            else:  # sets the weight at its call (idempotent: the test's run calls the models unequally often)
                def set_weight(module, args, target=1.5 * attention.v_proj.weight.detach().clone()):
                    with torch.no_grad():
                        module.weight.copy_(target)
                attention.v_proj.register_forward_pre_hook(set_weight)
    ids = token_ids(stock, (2, 8))
    ref, out = run(stock, ids), run(injected, ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=ATOL)
    stock_params = dict(stock.named_parameters())
    for name, param in injected.named_parameters():
        if "self_attn" in name:
            torch.testing.assert_close(param.grad, stock_params[name].grad, rtol=1e-4, atol=1e-6)
    groups = {id(m.__dict__["_lf_qkv"]): m.__dict__["_lf_qkv"] for m in injected.modules()
              if isinstance(m, FusedQKVLinear)}
    assert groups and all(g.fused_calls == 0 for g in groups.values())


def test_mlp_gate_and_up_names_are_markers_that_cannot_run():
    model = build("llama")
    inject(model, ENABLED)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, FusedSwiGLUMLP)
    assert isinstance(mlp.gate_proj, FusedIntoGateUp) and isinstance(mlp.up_proj, FusedIntoGateUp)
    assert "apply PEFT before inject" in repr(mlp.gate_proj)
    assert not list(mlp.gate_proj.parameters())
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_proj.bias",
                                     "up_proj.bias", "down_proj.bias"}  # llama's test config has mlp_bias
    with pytest.raises(RuntimeError, match="fused into gate_up_proj"):
        mlp.gate_proj(torch.zeros(1, 32))


def test_wrapped_experts_are_an_error_not_bypassed():
    model = build("mixtral")
    inject(model, ENABLED)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, ExpertMaskedMoE)

    class Wrapper(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

    moe.experts = Wrapper(moe.experts)
    with pytest.raises(TypeError, match=r"`experts` is Wrapper, not StackedExperts.*Apply PEFT before"):
        moe(torch.randn(1, 4, 32))

    stock = build("mixtral")
    for layer in stock.model.layers:
        layer.mlp.experts = Wrapper(layer.mlp.experts)
    report = inject(stock, ENABLED)
    reasons = dict(report.not_replaced)
    assert "experts are wrapped by Wrapper" in reasons["model.layers.0.mlp"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21.2 on 5.25
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_peft_lora_after_inject(family, caplog):
    """LoRA applied after inject: on q/k/v/o it takes effect and gives stock+LoRA's logits, loss and adapter
    gradients; naming gate_proj/up_proj, which the fused MLP replaced, is refused by PEFT with our message."""
    peft = pytest.importorskip("peft", reason="needs peft (installed by .ci/run through the test extras)")
    stock = build(family).train()
    injected = copy.deepcopy(stock)
    inject(injected, ENABLED)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    models = []
    for model in (stock, injected):
        torch.manual_seed(7)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
        models.append(lora)
    ids = token_ids(stock, (2, 8))
    ref, out = run(models[0], ids), run(models[1], ids)
    # fp32 summation order (the fused q/k/v GEMM, norms and experts) moves the logits by a few ulp of the largest
    # one, which LoRA's random adapters make larger than test_inject's: seed 1292209061 gave 1.16e-6 at a largest
    # logit of 0.47, 1.07x a fixed 1e-6 + 1e-5 |ref| (40 other seeds: at most 0.26x); a missing adapter is O(1e-2)
    torch.testing.assert_close(out.logits, ref.logits, rtol=RTOL,
                               atol=max(ATOL, 1e-5 * float(ref.logits.detach().abs().max())))
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=ATOL)
    ref_lora = {n: p.grad for n, p in models[0].named_parameters() if "lora_" in n}
    out_lora = {n: p.grad for n, p in models[1].named_parameters() if "lora_" in n}
    assert ref_lora.keys() == out_lora.keys() and len(ref_lora) == 4 * 2 * 2  # 4 targets, A and B, 2 layers
    for name, grad in out_lora.items():
        torch.testing.assert_close(grad, ref_lora[name], rtol=1e-4, atol=1e-6)

    if family == "llama":
        model = build(family)
        inject(model, ENABLED)
        with pytest.raises(ValueError, match="apply PEFT before inject"):
            peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
        # "all-linear" finds the fused gate_up_proj (a Linear): it works, as one adapter over both, and says so
        model = build(family)
        inject(model, ENABLED)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
        norm_mlp._WRAPPED_GATE_UP_WARNED.clear()  # said once per process
        with caplog.at_level(logging.WARNING, logger="ds_loongforge"):
            run(lora.train(), ids)
        assert "gate_up_proj is wrapped by peft.tuners.lora.layer.Linear: one adapter over gate and up together" in caplog.text


@pytest.mark.filterwarnings("ignore:Dynamo:UserWarning")  # graph breaks at the ops' pybind calls, the lru_cache
def test_torch_compile_fp32_moe_layer_on_cpu():
    """torch.compile traces grouped_mm with a meta kernel that takes bf16 only: an fp32 layer takes the per-expert
    loop under compile (eager on the CPU keeps the grouped GEMM) and equals eager."""
    torch.manual_seed(0)
    layer = ExpertMaskedMoE(16, 24, 4, 2)
    x = torch.randn(2, 6, 16, requires_grad=True)
    ref = layer(x)
    ref.square().sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    out = torch.compile(layer, backend="aot_eager")(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    for got, want in zip([x.grad] + [p.grad for p in layer.parameters()], ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _expert_files_worker(rank, world, port, ckpt_dir, out_path):
    """One process: a LoongForge engine (tiny Mixtral, moe.ep_size 1: plain layers, which DeepSpeed does not see as
    MoE) saves; the same checkpoint with the experts moved into per-expert files, as moe.ep_size > 1 writes them,
    is then loaded into fresh ones (ds_loongforge.initialize installs ds_loongforge.checkpoint for them), and so is
    one with a per-expert file of another layout."""
    import json
    import os

    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import ds_loongforge
    from ds_loongforge.modules.moe import StackedExperts

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "loongforge": {"enabled": True}}

    def engine():
        model = build("mixtral")
        return ds_loongforge.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                        config=config)[0]

    saving = engine()
    saving.save_checkpoint(ckpt_dir, tag="t")
    result = {"round_trip": engine().load_checkpoint(ckpt_dir, tag="t")[0] is not None}
    states = f"{ckpt_dir}/t/mp_rank_00_model_states.pt"
    checkpoint = torch.load(states, weights_only=False)
    layers = [name for name, m in saving.module.named_modules() if isinstance(m, StackedExperts)]
    experts = {k: checkpoint["module"].pop(k) for k in list(checkpoint["module"]) if ".experts." in k}
    checkpoint["num_experts"] = [experts[f"{prefix}.gate_up_proj"].shape[0] for prefix in layers]
    torch.save(checkpoint, states)
    for layer, prefix in enumerate(layers):  # DeepSpeed's layout: one file per global expert
        for g in range(checkpoint["num_experts"][layer]):
            torch.save({f"{prefix}.deepspeed_moe.experts.deepspeed_experts.{g}.{name}": experts[f"{prefix}.{name}"][g]
                        for name in ("gate_up_proj", "down_proj")},
                       f"{ckpt_dir}/t/layer_{layer}_expert_{g}_mp_rank_00_model_states.pt")
    try:  # the tag from "latest"; without ZeRO the optimizer state is one file per saving rank
        engine().load_checkpoint(ckpt_dir)
        result["error"] = None
    except RuntimeError as error:
        result["error"] = str(error)
    loading = engine()
    result["weights_only"] = loading.load_checkpoint(ckpt_dir, load_optimizer_states=False)[0] is not None
    saved = saving.module.state_dict()
    result["equal"] = {k: torch.equal(v, saved[k]) for k, v in loading.module.state_dict().items()}
    # a per-expert file that is not DeepSpeed's layout of stacked experts: an error naming it
    torch.save({"w": torch.zeros(2)}, f"{ckpt_dir}/t/layer_0_expert_0_mp_rank_00_model_states.pt")
    try:
        engine().load_checkpoint(ckpt_dir, load_optimizer_states=False)
        result["foreign"] = None
    except ValueError as error:
        result["foreign"] = str(error)
    with open(out_path, "w") as f:
        json.dump(result, f)


def test_an_ep_size_1_model_reads_per_expert_files(tmp_path):
    import json

    from tests._dist import spawn_with_deadline

    spawn_with_deadline(_expert_files_worker, 1, str(tmp_path / "ckpt"), str(tmp_path / "out.json"), timeout_s=240)
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["round_trip"] and result["weights_only"]
    assert "without ZeRO-1/2" in result["error"] and "load_optimizer_states=False" in result["error"], result["error"]
    assert result["equal"] and all(result["equal"].values()), result["equal"]
    assert any(".experts." in k for k in result["equal"])
    assert "layer_0_expert_0_mp_rank_00_model_states.pt holds w" in result["foreign"], result["foreign"]
