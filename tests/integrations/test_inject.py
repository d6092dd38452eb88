"""inject() on tiny random transformers models of every supported family, in fp32 on CPU: logits, loss (with
the router aux loss where the family has one) and gradients equal to the stock model's; state-dict keys
and shapes unchanged, and checkpoints load both ways."""

import copy
import logging

import pytest
import torch
import transformers
from torch import nn

from ds_loongforge.config import LoongForgeConfig
from ds_loongforge.integrations.inject import (KIND_MLP, KIND_MOE, KIND_MOE_EP, KIND_QKV, KIND_RESIDUAL,
                                               KIND_RMSNORM, InjectionReport, SharedExpertsMixin, inject)
from ds_loongforge.modules import ExpertMaskedMoE, FusedRMSNorm, FusedSwiGLUMLP
from ds_loongforge.modules.qkv import FusedQKVLinear
from tests._params import draw_without_router_near_tie

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
MOE_RTOL, ATOL = 1e-5, 1e-6

# family -> (config class, model class, config kwargs, expected replacements per kind)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
                {KIND_MOE: 2, KIND_RMSNORM: 5, KIND_QKV: 2, KIND_RESIDUAL: 2}),
    # layer 1 dense (mlp_only_layers), shared expert with its sigmoid gate, no renormalisation
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                       output_router_logits=True),
                  {KIND_MOE: 1, KIND_MLP: 2, KIND_RMSNORM: 5, KIND_QKV: 2, KIND_RESIDUAL: 2}),
    # q/k norms over the head dimension are RMSNorms too
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True, head_dim=8, output_router_logits=True),
                  {KIND_MOE: 2, KIND_RMSNORM: 9, KIND_QKV: 2, KIND_RESIDUAL: 2}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, output_router_logits=True),
              {KIND_MOE: 2, KIND_RMSNORM: 9, KIND_QKV: 2, KIND_RESIDUAL: 2}),
    # layer 0 dense, layer 1 MoE: sigmoid router, 2 groups (1 kept), bias, scaling factor, one shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4),
                    {KIND_MOE: 1, KIND_MLP: 2, KIND_RMSNORM: 9, KIND_RESIDUAL: 2}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=48, mlp_bias=True),
              {KIND_MLP: 2, KIND_RMSNORM: 5, KIND_QKV: 2, KIND_RESIDUAL: 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=48),
              {KIND_MLP: 2, KIND_RMSNORM: 5, KIND_QKV: 2, KIND_RESIDUAL: 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=48, head_dim=8),
              {KIND_MLP: 2, KIND_RMSNORM: 9, KIND_QKV: 2, KIND_RESIDUAL: 2}),
}
ENABLED = {"loongforge": {"enabled": True}}


def build(family: str) -> nn.Module:
    config_cls, model_cls, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs})
    model = getattr(transformers, model_cls)(config).float()
    if family == "deepseek_v3":
        with torch.no_grad():  # a nonzero correction bias, so that it changes which experts are chosen
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.normal_(std=0.05)
    return model


# Router near-ties (tests/_params.MIN_ROUTER_GAP): these models' router logits (std 0.11) put a density of about 12
# per top-k decision at a zero gap, 500-600 per draw of 2 x 12 tokens over two MoE layers (300 draws per family
# measured): a changed expert in about 3e-5 of the runs per family, 1e-4 per CI run over the four, before tokens were
# redrawn where a stock gap is below MIN_ROUTER_GAP (about 0.5% of the draws); any other difference still fails.
def _stock_router_logits(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """The router logits of every MoE layer ([] for a model that records none: dense, or DeepSeek-V3, whose router
    inject keeps)."""
    if not getattr(model.config, "output_router_logits", False):
        return []
    with torch.no_grad():
        return list(model(input_ids=ids, output_router_logits=True).router_logits)


def token_ids(model: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    """Random token ids on which the stock model's routers decide every top-k choice by at least MIN_ROUTER_GAP."""
    top_k = getattr(model.config, "num_experts_per_tok", None) or 1
    return draw_without_router_near_tie(lambda: torch.randint(0, VOCAB, shape),
                                        lambda ids: _stock_router_logits(model, ids), top_k)


def run(model: nn.Module, ids: torch.Tensor):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    if out.logits is None:  # the fused linear cross-entropy: a training forward with labels returns no logits
        with torch.no_grad():
            out.logits = model(input_ids=ids).logits
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_injected_model_matches_stock(family):
    stock = build(family).train()
    injected = copy.deepcopy(stock)
    report = inject(injected, ENABLED)

    assert report.replaced == FAMILIES[family][3], report.summary()
    assert report.not_replaced == [] and report.families == [family]
    kinds = {FusedRMSNorm: KIND_RMSNORM, FusedSwiGLUMLP: KIND_MLP, ExpertMaskedMoE: KIND_MOE}
    for cls, kind in kinds.items():
        assert sum(isinstance(m, cls) for m in injected.modules()) == report.replaced.get(kind, 0)
    assert sum(isinstance(m, FusedQKVLinear) for m in injected.modules()) == 3 * report.replaced.get(KIND_QKV, 0)

    ids = token_ids(stock, (2, 12))  # no router near-tie: see MIN_ROUTER_GAP
    ref, out = run(stock, ids), run(injected, ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=MOE_RTOL, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=MOE_RTOL, atol=ATOL)
    groups = {id(m.__dict__["_lf_qkv"]): m.__dict__["_lf_qkv"] for m in injected.modules()
              if isinstance(m, FusedQKVLinear)}
    assert all(g.fused_calls >= 1 for g in groups.values())  # each attention's projections ran as one product
    if getattr(ref, "aux_loss", None) is not None:  # router logits recorded through our router
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=MOE_RTOL, atol=ATOL)

    stock_params = dict(stock.named_parameters())
    compared = 0
    for name, param in injected.named_parameters():
        if name in stock_params:
            ref_grad = stock_params[name].grad
        elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
            prefix, kind = name.rsplit(".gate_up_proj.", 1)
            ref_grad = torch.cat([stock_params[f"{prefix}.gate_proj.{kind}"].grad,
                                  stock_params[f"{prefix}.up_proj.{kind}"].grad])
        else:
            raise AssertionError(f"{name} has no counterpart in the stock model")
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref_grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        compared += 1
    assert compared >= len(stock_params) - 2 * FAMILIES[family][3].get(KIND_MLP, 0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp32_model_under_autocast_computes_the_stock_loss(family):
    """An fp32 model under torch.autocast (bf16), as a plain or HF Trainer bf16 run without DeepSpeed's bf16 has
    it: the attention output is bf16 and the residual stream fp32 (the fused add fell back to stock's promoting
    add; it raised), DeepSeek-V3's kept router returns bf16 weights beside fp32 expert outputs (the combine raised),
    and the Qwen/OLMoE routers round their weights to the logits' dtype, bf16 (inject rounded to fp32's). Training
    loss and eval logits equal stock's, the gradients within the tolerance of the bf16 autocast."""
    stock = build(family).train()
    injected = copy.deepcopy(stock)
    inject(injected, ENABLED)
    # bf16 router logits tie exactly far more often than fp32 ones, and the two routers break an exact tie
    # otherwise (torch.topk's order against the lowest expert): redraw where a top-k gap is below a few bf16 ulps
    # of these logits (std ~0.1: an ulp ~5e-4), which also covers the inputs' last-bit differences (CI drew a tie)
    top_k = getattr(stock.config, "num_experts_per_tok", None) or 1

    def autocast_router_logits(ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _stock_router_logits(stock, ids)

    ids = draw_without_router_near_tie(lambda: torch.randint(0, VOCAB, (2, 12)), autocast_router_logits, top_k,
                                       gap=2e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, out = run(stock, ids), run(injected, ids)
    assert out.loss.dtype == ref.loss.dtype
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-3, atol=1e-3)
    stock.eval()
    injected.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(injected(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-2, atol=1e-2)
    grads = dict(stock.named_parameters())
    for name, param in injected.named_parameters():
        if name in grads:
            scale = grads[name].grad.abs().max().item()
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=0.1, atol=0.1 * scale + 1e-6,
                                       msg=lambda m: f"{name}: {m}")


def test_olmoe_with_clip_qkv_trains_as_stock():
    """OLMoE clamps its q/k/v (after the q/k norms) in place when clip_qkv is set: the fused norm's outputs are no
    longer views made inside its autograd Function (which autograd refuses to modify in place), and q/k/v of one
    fused product (slices of one split) are not fused there, said in the report."""
    config_cls, model_cls, kwargs, _ = FAMILIES["olmoe"]
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs, "clip_qkv": 0.5})
    stock = getattr(transformers, model_cls)(config).float().train()
    injected = copy.deepcopy(stock)
    report = inject(injected, ENABLED)
    assert KIND_QKV not in report.replaced and report.replaced[KIND_RMSNORM] == 9
    assert any("clip_qkv=0.5" in why for _, why in report.not_replaced), report.not_replaced
    ids = token_ids(stock, (2, 12))
    ref, out = run(stock, ids), run(injected, ids)
    torch.testing.assert_close(out.loss, ref.loss, rtol=MOE_RTOL, atol=ATOL)
    layer = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(dict(injected.named_parameters())[layer].grad, dict(stock.named_parameters())[layer].grad,
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])  # the two with shared experts and extra keys
def test_state_dict_round_trip(family):
    stock = build(family).eval()
    injected = copy.deepcopy(stock)
    inject(injected, ENABLED)
    ours = injected.state_dict()
    theirs = stock.state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}

    fresh = build(family).eval()
    fresh.load_state_dict(ours, strict=True)  # saved after injection -> stock model
    ids = token_ids(stock, (1, 10))  # the injected model below routes as stock: no near-tie (MIN_ROUTER_GAP)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=0, atol=0)

    other = build(family).eval()  # stock checkpoint -> injected model
    inject(other, ENABLED)
    other.load_state_dict(theirs, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids).logits, stock(input_ids=ids).logits,
                                   rtol=MOE_RTOL, atol=ATOL)


def test_shared_expert_block_layout():
    model = build("qwen2_moe")
    inject(model, ENABLED)
    block = model.model.layers[0].mlp
    assert isinstance(block, SharedExpertsMixin) and isinstance(block, ExpertMaskedMoE)
    assert isinstance(block.shared_expert, FusedSwiGLUMLP)  # the shared expert is a dense MLP: fused too
    assert isinstance(block.shared_expert_gate, nn.Linear)
    assert isinstance(block.gate, transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter)


def test_router_logits_recorded_when_hooks_predate_injection():
    """transformers installs its output-recording hooks on the first forward; injecting after it must move
    them to the new routers, or output_router_logits would silently return nothing."""
    stock = build("mixtral").eval()
    # no router near-tie (MIN_ROUTER_GAP): layer 1's logits follow layer 0's routing (token_ids runs a stock forward
    # too: the hooks still predate the injection)
    ids = token_ids(stock, (1, 8))
    with torch.no_grad():
        ref = stock(input_ids=ids, output_router_logits=True)
        inject(stock, ENABLED)
        out = stock(input_ids=ids, output_router_logits=True)
    assert len(out.router_logits) == len(ref.router_logits) == 2
    for a, b in zip(out.router_logits, ref.router_logits):
        torch.testing.assert_close(a, b, rtol=MOE_RTOL, atol=ATOL)


def test_aux_loss_attribute_and_router_mode():
    model = build("mixtral").train()
    inject(model, {"enabled": True, "moe": {"router": "sampled", "aux_loss_coef": 0.02}})
    block = model.model.layers[0].mlp
    assert block.gate.mode == "sampled" and block.aux_loss_coef == 0.02
    model(input_ids=torch.randint(0, VOCAB, (1, 8)))
    assert block.aux_loss is not None and block.aux_loss.item() > 0


def test_by_default_the_model_keeps_its_family_balancing_objective():
    """Unset moe.aux_loss_coef / z_loss_coef: ExpertMaskedMoE adds no loss of its own (transformers' balancing
    loss on the recorded router logits is the objective, as in stock); each set coefficient is used as given."""
    model = build("mixtral").train()
    report = inject(model, ENABLED)
    blocks = [layer.mlp for layer in model.model.layers]
    assert all(b.aux_loss_coef == 0 and b.z_loss_coef == 0 for b in blocks)
    assert any("load balancing is the family's own" in note and "router_aux_loss_coef=" in note
               and "no loss of its own" in note for note in report.notes), report.notes
    out = model(input_ids=torch.randint(0, VOCAB, (2, 8)))
    assert out.aux_loss is not None and out.aux_loss.item() > 0  # the family's, from our router's logits
    assert all(b.aux_loss is None or b.aux_loss.item() == 0 for b in blocks)

    only_z = build("mixtral")
    report = inject(only_z, {"enabled": True, "moe": {"z_loss_coef": 0.002}})
    assert only_z.model.layers[0].mlp.aux_loss_coef == 0 and only_z.model.layers[0].mlp.z_loss_coef == 0.002
    assert any("z_loss_coef=0.002" in note for note in report.notes), report.notes

    config_cls, model_cls, kwargs, _ = FAMILIES["mixtral"]
    off = getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        **{**COMMON, **kwargs, "output_router_logits": False}))
    report = inject(off, ENABLED)
    assert any("output_router_logits is off" in note for note in report.notes), report.notes


def test_deepseek_keeps_its_router_and_reports_it():
    model = build("deepseek_v3")
    report = inject(model, {"enabled": True, "moe": {"router": "sampled"}})
    block = model.model.layers[1].mlp
    assert isinstance(block.gate, transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter)
    assert block.aux_loss_coef == 0 and block.z_loss_coef == 0
    assert any("deepseek_v3" in note and "router" in note for note in report.notes)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_bf16_model_with_stock_rounding_computes_stock_logits(family):
    """fused_kernels.rounding "stock" (the default) puts the fused RMSNorm, SwiGLU and MoE combine roundings where
    transformers' modules have them (the combine: fp32 or, where the family's router casts them, bf16 weights; the
    k-sum rounded before the decoder's residual add), so a bf16 model injected with it computes the stock logits
    bit for bit on the CPU (top-2 here: a sum of two has one order); "once" rounds fewer times and differs.

    An MoE model's routing is not always stock's: among equal bf16 router logits ExpertMaskedMoE picks the lower
    expert (torch.topk's order on CUDA; on the CPU torch.topk may pick the other), and its fp32 softmax uses another
    exp than torch's (an ulp apart at times). Either changes a draw's logits: in 150 draws per family, Qwen3-MoE 14
    (9%; 4 experts here, so a tie at the 2nd/3rd logit is common), OLMoE 8, Mixtral 7, Qwen2-MoE 2, DeepSeek-V3 0;
    in 1000 more (800 for the last two), Qwen3-MoE 87 (8.7%, 95% bound 10.6%), OLMoE 60, Mixtral 59, Qwen2-MoE 21,
    DeepSeek-V3 1. So MoE families need 6 of 16 draws bit for bit: 11 or more of 16 differ with probability 6e-9 at
    8.7% (5e-8 at 10.6%). 6 of 8 failed about once in 30 runs (a CI run failed so at abdb297), 6 of 12 about once in
    30000 (3e-5 at 8.7%). A rounding not stock's changes every draw; one that changed 90% of them would pass this
    with probability 0.003. tests/modules/test_moe.py compares the experts on one routing, bit for bit every time."""
    draws = 1 if KIND_MOE not in FAMILIES[family][3] else 16
    equal_draws, once_differing = 0, []
    for _ in range(draws):
        stock = build(family).to(torch.bfloat16).eval()
        ids = torch.randint(0, VOCAB, (2, 12))
        with torch.no_grad():
            ref = stock(input_ids=ids).logits
            differing = {}
            for rounding in ("stock", "once"):
                injected = copy.deepcopy(stock)
                report = inject(injected, {"enabled": True, "fused_kernels": {"rounding": rounding}})
                assert report.replaced.get(KIND_RMSNORM), report.summary()
                assert all(m.rounding == rounding for m in injected.modules()
                           if isinstance(m, (FusedRMSNorm, FusedSwiGLUMLP, ExpertMaskedMoE)))
                differing[rounding] = float((injected(input_ids=ids).logits != ref).float().mean())
        equal_draws += differing["stock"] == 0.0
        once_differing.append(differing["once"])
    assert equal_draws >= (draws if draws == 1 else 6), f"{equal_draws} of {draws} draws gave stock's logits"
    assert min(once_differing) > 0.0, once_differing


def test_rounding_setting_is_checked():
    with pytest.raises(ValueError, match="rounding"):
        LoongForgeConfig(enabled=True, fused_kernels={"rounding": "fp32"})


@pytest.mark.parametrize("config", [
    LoongForgeConfig(enabled=True),
    {"enabled": True},                                        # the block itself
    {"train_batch_size": 8, "loongforge": {"enabled": True}},  # a DeepSpeed config
])
def test_config_forms(config):
    model = build("llama")
    assert inject(model, config).replaced == FAMILIES["llama"][3]


@pytest.mark.parametrize("config", [
    None, {"train_batch_size": 8}, {"loongforge": {"enabled": False}}, LoongForgeConfig()])
def test_disabled_changes_nothing(config):
    model = build("mixtral")
    before = [type(m) for m in model.modules()]
    report = inject(model, config)
    assert not report.enabled and report.total_replaced == 0
    assert [type(m) for m in model.modules()] == before
    assert "nothing replaced" in report.summary()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inject_leaves_the_random_generators_where_they_were(family):
    """The replacements are built with random weights and then take the model's: a script's draws after inject
    (data order, dropout) must be the stock run's."""
    model = build(family)
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    state = torch.get_rng_state()
    report = inject(model, ENABLED)
    assert report.total_replaced > 0
    assert torch.equal(torch.get_rng_state(), state)


def test_switches_off_are_reported():
    model = build("qwen2_moe")
    report = inject(model, {"enabled": True, "fused_kernels": {"rmsnorm": False, "swiglu": False, "qkv": False},
                            "moe": {"expert_masked": False}})
    assert report.total_replaced == 0
    reasons = {reason for _, reason in report.not_replaced}
    assert any("fused_kernels.rmsnorm is false" in r for r in reasons)
    assert any("fused_kernels.swiglu is false" in r for r in reasons)
    assert any("moe.expert_masked is false" in r for r in reasons)
    assert any("fused_kernels.qkv is false" in r for r in reasons)
    assert any("residual adds not fused" in r and "not FusedRMSNorm" in r for r in reasons)
    # norms, MLPs (dense layer 1, shared expert of 0), MoE, attentions, decoder layers
    assert len(report.not_replaced) == 5 + 2 + 1 + 2 + 2


def test_expert_parallel_that_cannot_apply_is_an_error():
    """ep_size > 1 is a request for expert parallelism: without torch.distributed, or with an ep_size that does not
    divide the experts, inject raises instead of leaving the MoE blocks stock (every expert on every rank)."""
    with pytest.raises(ValueError, match=r"moe\.ep_size=2 needs torch\.distributed initialised before inject.*"
                       r"deepspeed\.init_distributed\(\)"):
        inject(build("mixtral"), {"enabled": True, "moe": {"ep_size": 2}})
    with pytest.raises(ValueError, match=r"moe\.ep_size=3 does not divide the 4 experts of MixtralSparseMoeBlock"):
        inject(build("mixtral"), {"enabled": True, "moe": {"ep_size": 3}})
    # an ep_size that divides the experts but not the world: said before any expert-parallel layer is built
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build("mixtral")
        with pytest.raises(ValueError, match=r"moe\.ep_size=2 does not divide the world size 1; set "
                                             r"loongforge\.moe\.ep_size to a divisor"):
            inject(model, {"enabled": True, "moe": {"ep_size": 2}})
        assert not any(isinstance(m, ExpertMaskedMoE) for m in model.modules())
    finally:
        dist.destroy_process_group()


def test_unsupported_model_is_reported_not_raised(caplog):
    class FooRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    class FooMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

    model = nn.Sequential(FooRMSNorm(), FooMLP(), nn.Linear(8, 8))
    with caplog.at_level(logging.INFO, logger="ds_loongforge"):
        report = inject(model, ENABLED)
    assert isinstance(report, InjectionReport) and report.total_replaced == 0
    assert [p for p, _ in report.not_replaced] == ["0", "1"]
    assert all("no preset covers" in reason for _, reason in report.not_replaced)
    assert "no module replaced" in caplog.text and "FooRMSNorm" in caplog.text


def test_second_inject_says_already_injected():
    model = build("llama")
    inject(model, ENABLED)
    report = inject(model, ENABLED)
    assert report.total_replaced == 0 and report.already_injected == 2 + 5 + 6  # MLPs, norms, q/k/v Linears
    assert "already holds 13 LoongForge modules" in report.summary()
    assert len(report.summary().splitlines()) == 1  # the first call's report is not repeated


def test_log_lines(caplog):
    model = build("mixtral")
    with caplog.at_level(logging.INFO, logger="ds_loongforge"):
        inject(model, ENABLED)
    assert "[LoongForge] ExpertMaskedMoE: 2 modules" in caplog.text
    assert "[LoongForge] fused RMSNorm: 5 modules" in caplog.text
    assert "[LoongForge] fused QKV projection: 2 modules" in caplog.text


def _expert_parallel_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same stock model on both ranks
        stock = build("qwen2_moe").train()
        injected = copy.deepcopy(stock)
        report = inject(injected, {"enabled": True, "moe": {"ep_size": 2}})
        torch.manual_seed(1 + rank)  # different tokens per rank: the all-to-all carries real traffic
        ids = torch.randint(0, VOCAB, (2, 12))
        ref, out = run(stock, ids), run(injected, ids)
        experts = injected.model.layers[0].mlp.experts
        torch.save({"replaced": report.replaced, "logits": (out.logits.detach(), ref.logits.detach()),
                    "aux": (out.aux_loss.detach(), ref.aux_loss.detach()),
                    "experts": (experts.gate_up_proj.detach(), experts.gate_up_proj.grad),
                    "stock_experts": stock.model.layers[0].mlp.experts.gate_up_proj.detach(),
                    "stock_grad": stock.model.layers[0].mlp.experts.gate_up_proj.grad},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes importing deepspeed: about 15 s of the file's run time
def test_expert_parallel_two_ranks(tmp_path):
    """ep_size=2 over gloo: each rank holds its half of the experts, copied from the model; logits and the
    router aux loss equal the stock model's on every rank, and a rank's expert gradients are the stock
    gradients of those experts summed over both ranks' tokens (the tokens that reached them)."""
    from tests._dist import spawn_with_deadline

    spawn_with_deadline(_expert_parallel_worker, 2, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for rank, result in enumerate(results):
        assert result["replaced"] == {KIND_MOE_EP: 1, KIND_MLP: 2, KIND_RMSNORM: 5, KIND_QKV: 2, KIND_RESIDUAL: 2}
        torch.testing.assert_close(*result["logits"], rtol=MOE_RTOL, atol=ATOL)
        torch.testing.assert_close(*result["aux"], rtol=MOE_RTOL, atol=ATOL)
        mine = slice(rank * 2, (rank + 1) * 2)
        weight, grad = result["experts"]
        torch.testing.assert_close(weight, result["stock_experts"][mine], rtol=0, atol=0)
        torch.testing.assert_close(grad, sum(r["stock_grad"][mine] for r in results), rtol=1e-4, atol=1e-6)
