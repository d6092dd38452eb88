"""install_fused_loss on tiny random transformers causal LMs, fp32 on CPU: a training forward with labels gives the
stock loss (with the MoE aux loss where the family adds it) and the stock gradients, with logits=None; every other
call is the stock forward, bitwise; checkpoints are unchanged; num_items_in_batch, return_dict=False, the HF
Trainer's call; and the models and calls it refuses, with the reason."""

import copy
import inspect
import logging
import pickle

import pytest
import torch
import transformers
from torch import nn

from ds_loongforge.integrations import fused_loss
from ds_loongforge.integrations.fused_loss import _DeferredLMHead, install_fused_loss, uses_fused_loss
from ds_loongforge.integrations.inject import inject
from tests.integrations.test_inject import FAMILIES, VOCAB, build, token_ids

RTOL, ATOL = 1e-5, 1e-7
# A gradient's element takes the rounding noise of the whole tensor's scale, not of its own value: the fused loss
# sums the LM head's gradient in another order, and that difference (~1 ulp of the hidden gradient) reaches every
# element through the layers' backward. At seed 3777697053 (qwen3_moe) an embedding gradient element of 3.3e-3 was
# off by 1.5e-7, 7e-7 of its tensor's largest element (0.21), past ATOL + RTOL * 3.3e-3 = 1.3e-7; the other
# tensors' worst errors were 5e-7 of their largest. So each gradient's atol is also 4e-6 of its largest element
# (~34 fp32 ulps of it, 5x that seed's worst).
GRAD_SCALE_ATOL = 4e-6


def pair(family: str):
    stock = build(family).train()
    fused = copy.deepcopy(stock)
    assert install_fused_loss(fused) is None
    return stock, fused


def batch(rows=2, seq=12, routed_like=None):
    """Token ids and labels; with ``routed_like`` (a stock MoE model) ids on which its routers have no top-k near-tie
    (test_inject.token_ids)."""
    ids = torch.randint(0, VOCAB, (rows, seq)) if routed_like is None else token_ids(routed_like, (rows, seq))
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    return ids, labels


def loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def assert_same_training_step(stock, fused, **kwargs):
    ref, ref_grads = loss_and_grads(stock, **kwargs)
    out, grads = loss_and_grads(fused, **kwargs)
    assert out.logits is None and ref.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=ATOL)
    assert ref_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert grad is not None, name
        atol = max(ATOL, GRAD_SCALE_ATOL * ref_grads[name].abs().max().item())
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    return out, ref


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_loss_and_grads_equal_stock(family):
    stock, fused = pair(family)
    assert uses_fused_loss(fused) and not uses_fused_loss(stock)
    assert type(fused.lm_head) is _DeferredLMHead and isinstance(fused.lm_head, nn.Linear)
    ids, labels = batch()
    out, ref = assert_same_training_step(stock, fused, input_ids=ids, labels=labels,
                                         attention_mask=torch.ones_like(ids))
    if getattr(ref, "aux_loss", None) is not None:  # Mixtral & co. with output_router_logits=True
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=RTOL, atol=ATOL)
    assert type(out) is type(ref) and list(out.keys())[0] == "loss"


def test_mixtral_aux_loss_is_added_as_transformers_adds_it():
    stock, fused = pair("mixtral")
    ids, labels = batch()
    with_aux = fused(input_ids=ids, labels=labels, output_router_logits=True)
    without = fused(input_ids=ids, labels=labels, output_router_logits=False)
    assert with_aux.aux_loss is not None and without.aux_loss is None
    torch.testing.assert_close(with_aux.loss, without.loss + fused.router_aux_loss_coef * with_aux.aux_loss,
                               rtol=RTOL, atol=ATOL)
    assert_same_training_step(stock, fused, input_ids=ids, labels=labels, output_router_logits=False)


@pytest.mark.parametrize("family", ["mixtral", "llama", "qwen3_moe"])
def test_other_calls_are_the_stock_forward_bitwise(family, caplog):
    stock, fused = pair(family)
    ids, labels = batch()
    eval_mode = "is in eval() mode in a call with labels and gradients on"
    with caplog.at_level(logging.WARNING, logger="ds_loongforge"):
        with torch.no_grad():  # training mode, labels, no grad: the original forward
            a, b = stock(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
        a, b = stock(input_ids=ids), fused(input_ids=ids)  # no labels
        assert torch.equal(a.logits, b.logits) and b.loss is None
        stock.eval(), fused.eval()
        with torch.no_grad():  # an evaluation loop: eval, labels, no grad
            a, b = stock(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
        assert eval_mode not in caplog.text  # none of these is a training call
        fused_loss._warned.clear()  # said once per process: another test may have said it already
        for _ in range(2):
            a, b = stock(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels)  # eval, with grad
            assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    # a training call in all but the mode (a script that never called train() after from_pretrained): said, once
    assert caplog.text.count(eval_mode) == 1
    assert torch.equal(stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False),
                       fused.generate(ids[:1, :4], max_new_tokens=3, do_sample=False))


class _CatCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.cats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cats += func is torch.ops.aten.cat.default
        return func(*args, **(kwargs or {}))


def _cats(model, **kwargs) -> tuple[int, object]:
    with _CatCounter() as counter:
        out = model(**kwargs)
    return counter.cats, out


@pytest.mark.parametrize("family", ["mixtral", "llama", "deepseek_v3"])
def test_training_call_fills_no_kv_cache(family):
    """Where transformers would build a DynamicCache, the fused call's cache keeps nothing (no key/value copies)
    and the output holds no cache; a cache the caller passes, or use_cache=False, is left as the caller chose."""
    stock, fused = pair(family)
    ids, labels = batch()
    layers = fused.config.num_hidden_layers
    stock_cats, ref = _cats(stock, input_ids=ids, labels=labels)
    fused_cats, out = _cats(fused, input_ids=ids, labels=labels)
    assert ref.past_key_values is not None and ref.past_key_values.get_seq_length() == ids.shape[1]
    assert out.past_key_values is None
    assert stock_cats - fused_cats == 2 * layers, (stock_cats, fused_cats)  # one key and one value copy per layer
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=ATOL)
    mine = transformers.DynamicCache(config=fused.config)
    out = fused(input_ids=ids, labels=labels, **{fused_loss._forward_spec(type(fused)).cache_arg: mine})
    assert out.past_key_values is mine and mine.get_seq_length() == ids.shape[1]
    assert out.past_key_values.layers[0].keys.shape[-2] == ids.shape[1]
    off_cats, out = _cats(fused, input_ids=ids, labels=labels, use_cache=False)
    assert out.past_key_values is None and off_cats >= fused_cats  # (+1: the no-cache mask's packing check)
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=ATOL)


def test_num_items_in_batch_return_dict_and_positional_labels():
    stock, fused = pair("qwen3_moe")
    ids, labels = batch()
    for num_items in (torch.tensor(17), 17):  # the Trainer passes a tensor; custom loops may pass an int
        assert_same_training_step(stock, fused, input_ids=ids, labels=labels, num_items_in_batch=num_items)
    # a tuple runs the original forward: without logits every later field would move up a position
    out = fused(input_ids=ids, labels=labels, return_dict=False)
    ref = stock(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and [type(x) for x in out] == [type(x) for x in ref], (out, ref)
    for mine, theirs in zip(out, ref):
        if torch.is_tensor(theirs):
            torch.testing.assert_close(mine, theirs, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(fused(ids, None, None, None, None, labels).loss, ref[0], rtol=RTOL, atol=ATOL)


def test_shift_labels_and_custom_ignore_index_kwargs():
    stock, fused = pair("llama")
    ids, labels = batch()
    shifted = torch.randint(0, VOCAB, ids.shape)
    shifted[1, 5:] = -100
    assert_same_training_step(stock, fused, input_ids=ids, labels=labels, shift_labels=shifted)
    labels[labels == -100] = 3  # a token id as ignore_index: -100 is then an ordinary (out of range) label
    assert_same_training_step(stock, fused, input_ids=ids, labels=labels, ignore_index=3)


def test_logits_to_keep_in_training_falls_back(caplog):
    stock, fused = pair("llama")
    ids, labels = batch()
    with caplog.at_level(logging.WARNING, logger="ds_loongforge"):
        out = fused(input_ids=ids, labels=labels, logits_to_keep=ids.shape[1])  # all positions: a valid stock call
    ref = stock(input_ids=ids, labels=labels, logits_to_keep=ids.shape[1])
    assert out.logits is not None and torch.equal(out.loss, ref.loss) and torch.equal(out.logits, ref.logits)
    assert "logits_to_keep is not 0" in caplog.text
    assert fused(input_ids=ids, labels=labels, logits_to_keep=0).logits is None


def test_state_dict_unchanged_and_checkpoint_loads_in_stock(tmp_path):
    stock, fused = pair("mixtral")
    assert {k: v.shape for k, v in fused.state_dict().items()} == {k: v.shape for k, v in stock.state_dict().items()}
    fused.save_pretrained(tmp_path)
    loaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded.lm_head) is nn.Linear and not uses_fused_loss(loaded)
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, stock.eval()(input_ids=ids).logits)
    assert loaded.config.architectures == ["MixtralForCausalLM"]


def test_idempotent_deepcopy_and_resized_head():
    stock, fused = pair("llama")
    forward = fused.forward
    assert install_fused_loss(fused) is None and fused.forward == forward
    assert fused_loss._INNER not in fused.__dict__
    clone = copy.deepcopy(fused)
    assert uses_fused_loss(clone) and clone.forward.__self__ is clone
    ids, labels = batch()
    assert_same_training_step(stock, clone, input_ids=ids, labels=labels)
    # resize_token_embeddings builds a new nn.Linear head: the next training call defers it again
    stock.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    fused.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    fused.load_state_dict(stock.state_dict())
    assert type(fused.lm_head) is nn.Linear
    assert_same_training_step(stock, fused, input_ids=ids, labels=labels)
    assert type(fused.lm_head) is _DeferredLMHead


def test_trainer_call_path(tmp_path):
    """The HF Trainer keeps the dataset columns named in inspect.signature(model.forward), passes
    num_items_in_batch when the forward takes **kwargs, and reads outputs["loss"]."""
    stock, fused = pair("mixtral")
    assert list(inspect.signature(fused.forward).parameters) == list(inspect.signature(stock.forward).parameters)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    ids, labels = batch()
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    losses = []
    for model in (stock, fused):
        trainer = transformers.Trainer(model=model, args=args)
        assert trainer.model_accepts_loss_kwargs
        trainer._set_signature_columns_if_needed()
        assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)
        model.train()
        losses.append(trainer.compute_loss(model, dict(inputs), num_items_in_batch=torch.tensor(19)))
    torch.testing.assert_close(losses[1], losses[0], rtol=RTOL, atol=ATOL)


def test_unsupported_models_and_calls_give_the_reason(monkeypatch, caplog):
    model = build("llama")
    model.lm_head = nn.Linear(32, VOCAB, bias=True)
    assert "lm_head has a bias" in install_fused_loss(model)
    assert type(model.lm_head) is nn.Linear and not uses_fused_loss(model)

    model = build("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    assert "not transformers' ForCausalLMLoss" in install_fused_loss(model)

    config = transformers.PhiConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=48)
    assert "no preset family" in install_fused_loss(transformers.PhiForCausalLM(config))
    assert "soft-caps the logits" in fused_loss._forward_spec(transformers.Gemma2ForCausalLM)
    assert "exactly once" in fused_loss._forward_spec(transformers.CohereForCausalLM)  # logits * logit_scale

    import deepspeed  # noqa: F401  (imported, as it is wherever ZeRO-3 partitions parameters)

    stock, fused = pair("llama")  # a head replaced after install, then partitioned by ZeRO-3: that call runs the
    fused.lm_head = nn.Linear(32, VOCAB, bias=False)  # original (its weight is gathered for the head alone) and
    fused.lm_head.weight.ds_id = 0  # registers the weight with the model, so the next call is fused
    ids, labels = batch()
    with caplog.at_level(logging.WARNING, logger="ds_loongforge"):
        out = fused(input_ids=ids, labels=labels)
    assert out.logits is not None and "was not registered with the model" in caplog.text
    assert list(fused._external_params.values()) == [fused.lm_head.weight]  # the replaced head's let go
    assert fused(input_ids=ids, labels=labels).logits is None


def test_zero3_gathers_the_head_weight_for_the_whole_forward():
    """Installed on a model whose parameters are (or will be) partitioned by ZeRO-3, the LM head's weight is
    registered as an external parameter of the model (DeepSpeed's API for a parameter used outside its module's
    forward): ZeRO-3 then gathers it for the model's forward and backward, where the fused loss reads it after the
    head's own forward. The trained runs: tests/integrations/test_config_only.py (zero_init)."""
    import deepspeed  # noqa: F401  (imported, as it is wherever ZeRO-3 partitions parameters)

    model = build("llama")
    for p in model.parameters():
        p.ds_id = 3  # what ZeRO-3 puts on partitioned parameters (a model built under zero.Init)
    assert install_fused_loss(model) is None and uses_fused_loss(model)
    assert list(model._external_params.values()) == [model.lm_head.weight]
    assert [p for _, p in model.ds_external_parameters()] == [model.lm_head.weight]
    assert install_fused_loss(model) is None and len(model._external_params) == 1  # idempotent

    # a whole model: registered only for ZeRO-3 (deepspeed.initialize at stage 3), since the registration's bound
    # method on the model cannot be pickled
    model = build("llama")
    assert install_fused_loss(model) is None and not hasattr(model, "_external_params")
    pickle.loads(pickle.dumps(model))
    fused_loss.register_for_zero3(model)
    assert list(model._external_params.values()) == [model.lm_head.weight]


def test_inject_installs_and_reports(caplog):
    model = build("mixtral")
    with caplog.at_level(logging.INFO, logger="ds_loongforge"):
        report = inject(model, {"enabled": True})
    assert report.fused_loss == "lm_head of MixtralForCausalLM" and uses_fused_loss(model)
    assert "[LoongForge] fused linear cross-entropy: lm_head of MixtralForCausalLM" in caplog.text
    assert "fused linear cross-entropy: lm_head" in inject(model, {"enabled": True}).summary()  # idempotent

    off = build("mixtral")
    report = inject(off, {"enabled": True, "fused_kernels": {"linear_cross_entropy": False}})
    assert report.fused_loss is None and not uses_fused_loss(off)
    assert ("[LoongForge] not replaced: fused linear cross-entropy: fused_kernels.linear_cross_entropy is false"
            in report.summary())
    bias = build("llama")
    bias.lm_head = nn.Linear(32, VOCAB, bias=True)
    assert "lm_head has a bias" in inject(bias, {"enabled": True}).fused_loss_not_installed
    assert inject(nn.Sequential(nn.Linear(4, 4)), {"enabled": True}).fused_loss_not_installed is None


def test_injected_model_with_fused_loss_matches_stock():
    """All of inject (fused RMSNorm, SwiGLU, ExpertMaskedMoE and the fused loss) against the stock model."""
    stock = build("qwen2_moe").train()
    injected = copy.deepcopy(stock)
    assert inject(injected, {"enabled": True}).fused_loss
    # ExpertMaskedMoE's router against stock's: tokens without a top-k near-tie (tests/_params.MIN_ROUTER_GAP; a flip,
    # in about 1.4e-5 of the runs at 24 tokens, moves the loss and the head's gradient past the tolerances)
    ids, labels = batch(routed_like=stock)
    ref, _ = loss_and_grads(stock, input_ids=ids, labels=labels)
    out, _ = loss_and_grads(injected, input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(injected.lm_head.weight.grad, stock.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def test_config_switch_validation():
    from ds_loongforge.config import LoongForgeConfigError, parse_config

    assert parse_config({"loongforge": {"enabled": True}}).fused_kernels.linear_cross_entropy is True
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.fused_kernels\.linear_cross_entropy = 'no'"):
        parse_config({"loongforge": {"fused_kernels": {"linear_cross_entropy": "no"}}})
