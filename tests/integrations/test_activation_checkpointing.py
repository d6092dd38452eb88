"""Activation (gradient) checkpointing on a transformers MoE model with the ``"loongforge"`` block: what a user gets
with ``activation_checkpointing_enable`` (transformers >= 5.24; ``gradient_checkpointing_enable`` before) against
the same injected model without it, tiny fp32 Mixtral and Qwen2-MoE (shared expert with its gate, one dense layer)
on the CPU.

Checked, each from one torch seed (the conftest's; ``LF_TEST_SEED`` repeats a run):

1. Deterministic model, ``use_reentrant=False`` and ``True`` (reentrant with ``output_router_logits`` off; see 3):
   the loss, the family's aux loss, every router logit and every parameter gradient are bit for bit those without
   checkpointing, and the layers really are recomputed
   (each MoE block runs twice per step). Also at 2048 tokens, where the experts' backward takes the per-expert
   GEMMs from host counts recorded in the forward (``HostCounts``): the recompute records its own.
2. Stochastic parts on: router jitter (Mixtral's ``router_jitter_noise``, which inject carries into
   ``ExpertMaskedMoE.jitter_noise``; Qwen2-MoE has none, so the attribute is set), the ``"sampled"`` router
   (``moe.router``: experts drawn with ``torch.multinomial``) and dropout in every fused SwiGLU (experts, shared
   expert, dense MLP). The block has no dropout key: inject builds ``ExpertMaskedMoE`` and ``FusedSwiGLUMLP`` with
   ``dropout=0`` and their ``dropout`` attribute is the only switch, set here. Dropout seeds are drawn from torch's
   CPU generator and jitter / sampling use torch's generator, all of which ``torch.utils.checkpoint`` restores for
   the recompute (``preserve_rng_state``), so the recomputed routing and masks are the forward's: gradients equal
   bit for bit, and the generator is left where the run without checkpointing leaves it.
3. Side effects. ``ExpertMaskedMoE`` records, per forward, ``last_routing`` (tokens per expert) and ``aux_loss``
   (assigned, never accumulated), and only with expert parallelism a receive-buffer warm-up counter
   (``ReceiveBuffer.steps``) and a call counter (``_ep_calls``). A recompute therefore cannot double anything
   here: after a step with checkpointing the stats are the forward's (the tokens per expert sum to T * k, not 2 T k),
   equal to the run without checkpointing, and the two counters stay 0 at ``ep_size`` 1. The HF outputs
   (``router_logits``: one tensor per MoE layer, not two; ``aux_loss``) come from hooks that record only inside the
   model's outer forward, so the recompute adds nothing to them either. With expert parallelism the recompute IS a
   forward of the layer: ``ReceiveBuffer.steps`` (warm-up, ``moe.buffer_warmup_steps``) counts it, which
   ``ReceiveBuffer``'s docstring in moe.py, the config field's description and the README say: under
   checkpointing warm-up ends after about half as many training steps. Asserted in the DeepSpeed test below (2
   ranks, ``ep_size`` 2): 2 counts per layer and step with checkpointing, 1 without; the trained weights equal.
   With ``use_reentrant=True`` the checkpointed forward runs under ``no_grad``: every side output computed inside
   it has no gradient. That is PyTorch's reentrant checkpoint, and the stock model behaves the same (asserted):
   transformers' ``aux_loss`` (from the recorded router logits) and ``ExpertMaskedMoE.aux_loss`` (with
   ``moe.aux_loss_coef`` set) come back without ``grad_fn``, the loss value includes them, and the gradients are
   those of the loss without them, silently (no warning from transformers or the block). Use ``use_reentrant=False``
   (transformers' default) to train the balancing loss under checkpointing.
4. Through ``ds_loongforge.initialize`` (checkpointing enabled before it, as the HF Trainer does, so inject re-classes
   layers that already checkpoint), FusedAdamWClip, 2 steps with jitter and dropout, gloo: the losses, weights and
   fp32 masters with checkpointing equal those without, bit for bit, at ZeRO-2 on 1 rank, ZeRO-2 with ``moe.ep_size``
   2 on 2 ranks (the recompute runs the all-to-all exchanges again; non-reentrant, and reentrant with
   ``output_router_logits`` off), and ZeRO-3 on 2 ranks (the recompute gathers the partitioned stacked experts
   again); plus the counters above.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from ds_loongforge.integrations.inject import KIND_MOE, inject
from ds_loongforge.modules import ExpertMaskedMoE, FusedSwiGLUMLP
from tests._dist import init_cpu_rank, spawn_with_deadline
from tests.integrations.test_inject import COMMON, FAMILIES, VOCAB

MOE_FAMILIES = ("mixtral", "qwen2_moe")
JITTER, DROPOUT = 0.1, 0.2
REENTRANT = [pytest.param(False, id="nonreentrant"), pytest.param(True, id="reentrant")]


# ------------------------------------------------------------------------------------------------------- helpers

def _seed() -> int:
    """A seed drawn from the conftest-seeded generator (so LF_TEST_SEED repeats it)."""
    return int(torch.randint(0, 2**31 - 1, (1,)))


def _model(family: str, seed: int, max_positions: int = 64, **config_extra):
    config_cls, model_cls, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs, "max_position_embeddings": max_positions,
                                                  **config_extra})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).float().train()


def _injected(family: str, seed: int, block: dict | None = None, jitter: float = 0.0, dropout: float = 0.0,
              **model_kwargs):
    extra = {"router_jitter_noise": jitter} if family == "mixtral" else {}
    model = _model(family, seed, **model_kwargs, **extra)
    report = inject(model, {"enabled": True, **(block or {})})
    assert report.replaced.get(KIND_MOE), report.summary()
    _set_stochastic(model, family, jitter, dropout)
    return model


def _set_stochastic(model, family: str, jitter: float, dropout: float) -> None:
    for module in model.modules():
        if isinstance(module, ExpertMaskedMoE):
            if family == "mixtral":  # inject carries the family's jitter over
                assert module.jitter_noise == jitter, module.jitter_noise
            module.jitter_noise = jitter
            module.dropout = dropout
        elif isinstance(module, FusedSwiGLUMLP):
            module.dropout = dropout


def _enable_checkpointing(model, reentrant: bool) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.model.gradient_checkpointing


def _moe_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, ExpertMaskedMoE)]


def _step(model, ids: torch.Tensor, seed: int, *, add_own_aux: bool = False, **forward_kwargs) -> dict:
    """One training forward + backward from ``torch.manual_seed(seed)``; what it returned and left behind."""
    layers = _moe_layers(model)
    calls = [0]
    handles = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in layers]
    model.zero_grad(set_to_none=True)
    try:
        torch.manual_seed(seed)
        out = model(input_ids=ids, labels=ids, **forward_kwargs)
        forward_calls = calls[0]
        seen = {"tokens": [m.last_routing.tokens_per_expert_E.clone() for m in layers],
                "own_aux": [m.aux_loss for m in layers]}
        loss = out.loss
        if add_own_aux:
            loss = loss + sum(a for a in seen["own_aux"] if a is not None)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return {"loss": out.loss.detach(), "aux_loss": getattr(out, "aux_loss", None),
            "router_logits": getattr(out, "router_logits", None), "seen": seen,
            "after": {"tokens": [m.last_routing.tokens_per_expert_E.clone() for m in layers],
                      "num_tokens": [m.last_routing.num_tokens for m in layers],
                      "own_aux": [m.aux_loss for m in layers],
                      "buffer_steps": [m.receive_buffer.steps for m in layers],
                      "ep_calls": [m._ep_calls for m in layers]},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "forward_calls": forward_calls, "all_calls": calls[0], "rng": torch.get_rng_state()}


def _assert_same_grads(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    differ = {}
    for name, g in got.items():
        e = expected[name]
        assert (g is None) == (e is None), name
        if g is not None and not torch.equal(g, e):
            differ[name] = float((g - e).abs().max())
    assert not differ, f"gradients differ (max |diff|): {differ}"


def _assert_recomputed(ckpt: dict, plain: dict, layers: int) -> None:
    """Checkpointing is really on: every MoE block ran once in the forward and once more in the backward."""
    assert plain["forward_calls"] == plain["all_calls"] == layers
    assert ckpt["forward_calls"] == layers and ckpt["all_calls"] == 2 * layers, ckpt["all_calls"]


def _pair(family: str, reentrant: bool, **kwargs):
    seed = _seed()
    plain = _injected(family, seed, **kwargs)
    ckpt = copy.deepcopy(plain)
    _enable_checkpointing(ckpt, reentrant)
    return plain, ckpt


# ----------------------------------------------------------------------------------------------- 1: deterministic

@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_checkpointing_gives_the_same_loss_and_gradients(family, reentrant):
    plain, ckpt = _pair(family, reentrant)
    ids, seed = torch.randint(0, VOCAB, (2, 12)), _seed()
    # reentrant: the family's aux loss would lose its gradient under checkpointing (test below); off here
    kwargs = {"output_router_logits": False} if reentrant else {}
    a, b = _step(plain, ids, seed, **kwargs), _step(ckpt, ids, seed, **kwargs)
    _assert_recomputed(b, a, len(_moe_layers(plain)))
    assert torch.equal(b["loss"], a["loss"])
    if not reentrant:
        assert a["aux_loss"] is not None and b["aux_loss"].requires_grad
        assert torch.equal(b["aux_loss"], a["aux_loss"])
        assert len(b["router_logits"]) == len(a["router_logits"]) == len(_moe_layers(plain))
        for x, y in zip(b["router_logits"], a["router_logits"]):
            assert torch.equal(x, y)
    _assert_same_grads(b["grads"], a["grads"])


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_checkpointing_with_per_expert_backward(reentrant, monkeypatch):
    """2 x 1024 tokens, 4 experts, top-2: 1024 rows per expert, where the experts' backward runs per-expert GEMMs on
    host counts that the forward recorded; the recompute must record (and the backward read) its own."""
    from ds_loongforge.modules import moe as moe_module

    used = [0]
    real = moe_module.HostCounts

    class CountingHostCounts(real):
        def __init__(self, *args, **kwargs):
            used[0] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(moe_module, "HostCounts", CountingHostCounts)
    plain, ckpt = _pair("mixtral", reentrant, max_positions=1024)
    ids, seed = torch.randint(0, VOCAB, (2, 1024)), _seed()
    a = _step(plain, ids, seed, output_router_logits=False)
    assert used[0] == 2, "the per-expert backward was not taken"  # one per MoE layer
    b = _step(ckpt, ids, seed, output_router_logits=False)
    # non-reentrant: the forward and the recompute each record theirs; reentrant: only the recompute (the checkpointed
    # forward runs without grad, and builds no backward)
    assert used[0] == 2 + (2 if reentrant else 4)
    _assert_recomputed(b, a, 2)
    assert torch.equal(b["loss"], a["loss"])
    _assert_same_grads(b["grads"], a["grads"])


# ------------------------------------------------------------------------------------------------- 2: stochastic

@pytest.mark.parametrize("router", ["topk", "sampled"])
@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_recompute_reproduces_jitter_sampling_and_dropout(family, reentrant, router):
    plain, ckpt = _pair(family, reentrant, block={"moe": {"router": router}}, jitter=JITTER, dropout=DROPOUT)
    assert all(m.gate.mode == router for m in _moe_layers(plain))
    other_model = copy.deepcopy(plain)
    ids, seed = torch.randint(0, VOCAB, (2, 12)), _seed()
    a, b = _step(plain, ids, seed, output_router_logits=False), _step(ckpt, ids, seed, output_router_logits=False)
    _assert_recomputed(b, a, len(_moe_layers(plain)))
    # the stochastic parts are on: another seed gives another loss
    other = _step(other_model, ids, seed + 1, output_router_logits=False)
    assert not torch.equal(other["loss"], a["loss"])
    assert torch.equal(b["loss"], a["loss"])
    for x, y, z in zip(b["seen"]["tokens"], a["seen"]["tokens"], b["after"]["tokens"]):
        assert torch.equal(x, y) and torch.equal(z, y)  # the recompute routed as the forward did
    _assert_same_grads(b["grads"], a["grads"])
    # the checkpoint restored the generator after its recompute: later draws are the plain run's
    assert torch.equal(b["rng"], a["rng"])


# ----------------------------------------------------------------------------------------------- 3: side effects

OWN_AUX = {"moe": {"router": "sampled", "aux_loss_coef": 0.01, "z_loss_coef": 0.001}}


def test_routing_stats_and_aux_losses_are_not_double_counted():
    """Non-reentrant (transformers' default): after a training step with checkpointing, the routing statistics, the
    HF router logits and aux loss, ExpertMaskedMoE's own aux loss, the gradients (both aux losses included) and the
    weights after an optimizer step are those of the run without checkpointing, and nothing counted the recompute."""
    plain, ckpt = _pair("mixtral", False, block=OWN_AUX, jitter=JITTER, dropout=DROPOUT)
    layers = len(_moe_layers(plain))
    ids, seed = torch.randint(0, VOCAB, (2, 12)), _seed()
    tokens, k = ids.numel(), plain.config.num_experts_per_tok
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, ckpt)]
    a = _step(plain, ids, seed, add_own_aux=True)
    b = _step(ckpt, ids, seed, add_own_aux=True)
    for opt in opts:
        opt.step()
    _assert_recomputed(b, a, layers)
    assert torch.equal(b["loss"], a["loss"])
    # HF outputs: one router logit tensor per MoE layer, the same aux loss, differentiable
    assert len(b["router_logits"]) == len(a["router_logits"]) == layers
    for x, y in zip(b["router_logits"], a["router_logits"]):
        assert torch.equal(x, y)
    assert b["aux_loss"].requires_grad and torch.equal(b["aux_loss"], a["aux_loss"])
    # ExpertMaskedMoE's state: the forward's routing, T * k pairs, no counter moved
    for run in (a, b):
        after = run["after"]
        assert after["num_tokens"] == [tokens] * layers
        assert [int(t.sum()) for t in after["tokens"]] == [tokens * k] * layers
        assert after["buffer_steps"] == [0] * layers and after["ep_calls"] == [0] * layers
        assert all(x.requires_grad for x in run["seen"]["own_aux"])
    for x, y in zip(b["after"]["tokens"], a["after"]["tokens"]):
        assert torch.equal(x, y)
    for x, y in zip(b["after"]["own_aux"], a["after"]["own_aux"]):
        assert torch.equal(x.detach(), y.detach())
    _assert_same_grads(b["grads"], a["grads"])
    trained = dict(plain.named_parameters())
    for name, p in ckpt.named_parameters():
        assert torch.equal(p, trained[name]), name


@pytest.mark.parametrize("injected", [pytest.param(True, id="injected"), pytest.param(False, id="stock")])
def test_reentrant_checkpointing_drops_aux_gradients_as_stock_does(injected):
    """use_reentrant=True runs the checkpointed forward under no_grad: the aux losses come back without grad_fn and
    the gradients are those of the language-model loss alone, for the stock model too (PyTorch's reentrant
    checkpoint, not the block). ExpertMaskedMoE's own aux loss (injected only) likewise."""
    seed = _seed()
    if injected:
        plain = _injected("mixtral", seed, block=OWN_AUX, jitter=JITTER, dropout=DROPOUT)
    else:
        plain = _model("mixtral", seed, router_jitter_noise=JITTER)
    ckpt, lm_only_model = copy.deepcopy(plain), copy.deepcopy(plain)
    _enable_checkpointing(ckpt, True)
    ids, step_seed = torch.randint(0, VOCAB, (2, 12)), _seed()
    with_aux = _step(plain, ids, step_seed, add_own_aux=injected)
    lm_only = _step(lm_only_model, ids, step_seed, output_router_logits=False)
    b = _step(ckpt, ids, step_seed, add_own_aux=injected)
    assert torch.equal(b["loss"], with_aux["loss"]) and torch.equal(b["aux_loss"], with_aux["aux_loss"])
    assert with_aux["aux_loss"].requires_grad and not b["aux_loss"].requires_grad
    if injected:
        assert all(x.requires_grad for x in with_aux["seen"]["own_aux"])
        assert not any(x.requires_grad for x in b["seen"]["own_aux"])
    _assert_same_grads(b["grads"], lm_only["grads"])
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(with_aux["grads"][gate], lm_only["grads"][gate])  # the aux terms do reach the router


# ------------------------------------------------------------------------------------------------- 4: DeepSpeed

DS_STEPS, DS_MICRO, DS_SEQ = 2, 2, 16
DS_LR, DS_WD, DS_CLIP, DS_EPS = 1e-2, 0.1, 0.5, 1e-4


def _ds_worker(rank, world, port, seed, ep_size, out_dir, stage=2, reentrant=False):
    init_cpu_rank(rank, world, port)
    import ds_loongforge
    from tests.integrations._block_vs_stock import ds_config, gathered, hf_groups, masters, token_batches

    block = {"enabled": True, "optimizer": {"fused_adamw_clip": True}, "sampler": {"expert_aware": False},
             "moe": {"ep_size": ep_size}}
    config = ds_config({"stage": stage}, "fp32", block, micro=DS_MICRO, clip=DS_CLIP, lr=DS_LR, weight_decay=DS_WD,
                       eps=DS_EPS)
    batches = token_batches(DS_STEPS, world, DS_MICRO, DS_SEQ, VOCAB, seed)
    results = {}
    for checkpointing in (False, True):
        # reentrant: no family aux loss (its gradient would be dropped, as for the stock model: test above)
        model = _model("mixtral", seed, router_jitter_noise=JITTER, output_router_logits=not reentrant)
        if checkpointing:  # before initialize, as the HF Trainer does: inject then re-classes checkpointing layers
            _enable_checkpointing(model, reentrant)
        engine, *_ = ds_loongforge.initialize(model=model, model_parameters=hf_groups(model, DS_WD), config=config)
        module = engine.module
        _set_stochastic(module, "mixtral", JITTER, DROPOUT)
        layers = _moe_layers(module)
        calls = [0]
        for m in layers:
            m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        losses = []
        for step, ids in enumerate(batches):
            torch.manual_seed(seed + 7 * step + rank)
            ids = ids[rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        from ds_loongforge.optim import FusedAdamWClip

        results[checkpointing] = {
            "fused_adamw_clip": isinstance(engine.basic_optimizer, FusedAdamWClip), "losses": losses, "weights": gathered(module), "masters": masters(engine), "calls": calls[0],
            "layers": len(layers), "checkpointing": bool(module.model.gradient_checkpointing),
            "residual_fused": all(type(layer).__name__.startswith("LoongForge") for layer in module.model.layers),
            "buffer_steps": [m.receive_buffer.steps for m in layers], "ep_calls": [m._ep_calls for m in layers],
            "ep_size": [m.ep_size for m in layers]}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("world,ep_size,stage,reentrant", [
    pytest.param(1, 1, 2, False, id="zero2-1rank"),
    pytest.param(2, 2, 2, False, id="zero2-ep2-2ranks"),
    pytest.param(2, 2, 2, True, id="zero2-ep2-2ranks-reentrant"),
    pytest.param(2, 1, 3, False, id="zero3-2ranks")])
def test_deepspeed_with_checkpointing_trains_as_without(tmp_path, world, ep_size, stage, reentrant):
    seed = _seed()
    spawn_with_deadline(_ds_worker, world, seed, ep_size, str(tmp_path), stage, reentrant, timeout_s=240)
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        plain, ckpt = results[False], results[True]
        layers = plain["layers"]
        assert layers == 2 and plain["ep_size"] == ckpt["ep_size"] == [ep_size] * layers
        assert plain["fused_adamw_clip"] and ckpt["fused_adamw_clip"]
        assert ckpt["checkpointing"] and not plain["checkpointing"] and ckpt["residual_fused"]
        assert plain["calls"] == DS_STEPS * layers and ckpt["calls"] == 2 * DS_STEPS * layers  # recomputed
        if ep_size > 1:  # the recompute is a forward of the layer: counted by the warm-up and the exchanges
            assert plain["buffer_steps"] == plain["ep_calls"] == [DS_STEPS] * layers
            assert ckpt["buffer_steps"] == ckpt["ep_calls"] == [2 * DS_STEPS] * layers
        else:
            assert plain["buffer_steps"] == ckpt["buffer_steps"] == [0] * layers
        for x, y in zip(ckpt["losses"], plain["losses"]):
            assert torch.equal(x, y), (rank, ckpt["losses"], plain["losses"])
        for what in ("weights", "masters"):
            assert ckpt[what].keys() == plain[what].keys()
            differ = [n for n, v in plain[what].items() if not torch.equal(ckpt[what][n], v)]
            assert not differ, (rank, what, differ)
