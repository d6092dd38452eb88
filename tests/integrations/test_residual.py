"""Residual adds fused into the decoder layers' RMSNorms (ds_loongforge.integrations.residual): the rewritten
forward of every family's decoder layer against the stock layer, the add kernels it removes, the layers it must
leave alone, and what survives the re-classing (gradient checkpointing, deepcopy, pickling)."""

import copy
import io
from collections import Counter

import pytest
import torch
import transformers
from torch.profiler import profile

from ds_loongforge.integrations.inject import KIND_RESIDUAL, inject
from ds_loongforge.integrations.residual import FUSED_ATTR, fused_forward, fuse_residual_adds, residual_problem
from tests.integrations.test_inject import FAMILIES, VOCAB, build, run

ON = {"enabled": True}
OFF = {"enabled": True, "fused_kernels": {"residual_add": False}}


def _layers(model):
    return list(model.model.layers)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_layers_equal_unfused_injection(family):
    """Forward values are stock's; gradients differ only by where two fp32 sums are rounded (fp32 here: ~ulp)."""
    stock = build(family).train()
    fused, unfused = copy.deepcopy(stock), copy.deepcopy(stock)
    report = inject(fused, ON)
    assert report.replaced[KIND_RESIDUAL] == 2
    assert KIND_RESIDUAL not in inject(unfused, OFF).replaced
    for layer, plain in zip(_layers(fused), _layers(unfused)):
        assert type(layer).__name__ == f"LoongForge{type(plain).__name__}" and isinstance(layer, type(plain))
        assert FUSED_ATTR in type(layer).__dict__
    ids = torch.randint(0, VOCAB, (2, 12))
    a, b = run(fused, ids), run(unfused, ids)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-6)
    grads = dict(unfused.named_parameters())
    for name, param in fused.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _hidden_adds(model, ids, hidden):
    """aten add ops on hidden-size activations in one forward + backward (the residual stream's adds)."""
    with profile(record_shapes=True) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    counts = Counter()
    for event in prof.events():
        shapes = event.input_shapes
        if event.name in ("aten::add", "aten::add_") and shapes and shapes[0] and shapes[0][-1] == hidden \
                and len(shapes[0]) >= 2 and shapes[0][0] > 1:
            counts[event.name] += 1
    return sum(counts.values())


@pytest.mark.parametrize("family,per_layer", [("llama", 3), ("mixtral", 4), ("qwen2_moe", 3)])
def test_each_layer_loses_its_residual_adds(family, per_layer):
    """Dense MLP (llama) or MoE with shared experts (qwen2_moe, whose layer 1 is dense too): one add fewer forward
    and two backward per layer; ExpertMaskedMoE (mixtral) takes the MLP's add into its combine as well."""
    stock = build(family).train()
    fused, unfused = copy.deepcopy(stock), copy.deepcopy(stock)
    inject(fused, ON)
    inject(unfused, OFF)
    ids = torch.randint(0, VOCAB, (2, 12))
    hidden = stock.config.hidden_size
    layers = stock.config.num_hidden_layers
    assert _hidden_adds(unfused, ids, hidden) - _hidden_adds(fused, ids, hidden) == per_layer * layers


def test_gradient_checkpointing_runs_the_fused_forward():
    stock = build("mixtral").train()
    fused = copy.deepcopy(stock)
    inject(fused, ON)
    ref = copy.deepcopy(fused)
    # transformers 5.25 renamed it (the old name warns: deprecated, removed in v6); the device's 5.17 has the old one
    enable = getattr(fused, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert fused.model.gradient_checkpointing  # on, whichever name turned it on
    ids = torch.randint(0, VOCAB, (2, 12))
    a, b = run(fused, ids), run(ref, ids)
    torch.testing.assert_close(a.loss, b.loss)
    grads = dict(ref.named_parameters())
    for name, param in fused.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, msg=lambda m: f"{name}: {m}")


def test_deepcopy_pickle_and_state_dict_survive_the_reclass():
    model = build("qwen3").eval()
    stock_keys = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    inject(model, ON)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == stock_keys
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
            assert type(other.model.layers[0]) is type(model.model.layers[0])
            torch.testing.assert_close(other(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_a_forward_that_differs_is_left_alone_with_the_reason():
    base = transformers.models.llama.modeling_llama.LlamaDecoderLayer

    class ScaledResidualLayer(base):
        def forward(self, hidden_states, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
            hidden_states = residual + 0.5 * hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            return residual + self.mlp(hidden_states)

    forward, norms, why = fused_forward(ScaledResidualLayer)
    assert forward is None and norms is None and "hidden_states = residual + hidden_states" in why

    model = build("llama")
    for layer in model.model.layers:
        layer.__class__ = ScaledResidualLayer
    report = inject(model, ON)  # the preset names LlamaDecoderLayer: the subclass is not one of its layers
    assert KIND_RESIDUAL not in report.replaced
    assert all(type(layer) is ScaledResidualLayer for layer in model.model.layers)
    with pytest.raises(ValueError, match="ScaledResidualLayer: .*hidden_states = residual \\+ hidden_states"):
        fuse_residual_adds(model.model.layers[0], lambda *a: type)


def test_layers_keep_their_forward_without_fused_norms():
    model = build("mixtral")
    report = inject(model, {"enabled": True, "fused_kernels": {"rmsnorm": False}})
    assert KIND_RESIDUAL not in report.replaced
    reasons = [reason for path, reason in report.not_replaced if path.endswith(("layers.0", "layers.1"))]
    assert len(reasons) == 2 and all("not FusedRMSNorm" in r and "fused_kernels.rmsnorm" in r for r in reasons)
    assert residual_problem(model.model.layers[0]) is not None
    assert all(FUSED_ATTR not in type(layer).__dict__ for layer in model.model.layers)


def test_switch_off_is_reported_and_a_second_inject_changes_nothing():
    model = build("olmoe")
    report = inject(model, OFF)
    assert any(reason.endswith("residual adds not fused: fused_kernels.residual_add is false")
               for _, reason in report.not_replaced)
    fused = build("olmoe")
    inject(fused, ON)
    classes = [type(layer) for layer in fused.model.layers]
    again = inject(fused, ON)
    assert KIND_RESIDUAL not in again.replaced and [type(layer) for layer in fused.model.layers] == classes


def _passthrough(function):  # a decorator that is not a global of the module the layer's class comes from
    return function


def test_a_forward_whose_decorator_the_module_lacks_is_left_alone():
    base = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    passthrough = _passthrough

    class DecoratedLayer(base):
        @passthrough
        def forward(self, hidden_states, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    forward, norms, why = fused_forward(DecoratedLayer)
    assert forward is None and "does not build in its module (NameError" in why and "passthrough" in why
