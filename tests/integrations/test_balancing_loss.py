"""ds_loongforge.integrations.balancing_loss: the family's load-balancing loss without a host sync.

- :func:`load_balancing_loss` against each supported family's own ``load_balancing_loss_func`` (value and gradient
  with respect to the router logits), fp32 / bf16 / fp64 logits, with and without a mask, k from 1 to E, a batch
  row fully masked; its fp64 value against a direct evaluation of the Switch formula.
- inject installs it in the family's modeling module (and the report says so), the injected model's aux loss
  equals the stock model's, ``moe.sync_free_balancing_loss: false`` and a non-standard function leave it alone,
  ``restore`` puts transformers' function back.
- On CUDA (gpu marker): no host sync inside it, counted with diagnostics.HostSyncRecorder.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from ds_loongforge.integrations import balancing_loss as bl
from ds_loongforge.integrations.inject import KIND_BALANCING, inject

FAMILY_MODULES = ["transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen2_moe.modeling_qwen2_moe",
                  "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.olmoe.modeling_olmoe"]
ORIGINALS = {name: importlib.import_module(name).load_balancing_loss_func for name in FAMILY_MODULES}


@pytest.fixture(autouse=True)
def _restore():
    """The patch is process-wide: every test starts and ends with transformers' own functions."""
    bl.restore()
    for name, function in ORIGINALS.items():
        setattr(importlib.import_module(name), bl.FUNCTION, getattr(function, bl.ORIGINAL_ATTR, function))
    yield
    bl.restore()


def _inputs(rows_per_batch=(3, 7), layers=3, experts=8, dtype=torch.float32, masked=True):
    batch, seq = rows_per_batch
    logits = tuple((torch.randn(batch * seq, experts, dtype=torch.float64) * 2).to(dtype).requires_grad_()
                   for _ in range(layers))
    mask = None
    if masked:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, seq // 2:] = 0
        mask[-1] = 0 if batch > 1 else mask[-1]  # a row with no token that counts
    return logits, mask


def _switch_fp64(logits, experts, k, mask):
    """E x sum_e f_e P_e, written out: f_e = share of counted (token, choice) pairs on e, P_e = mean probability."""
    keep = torch.ones(logits[0].shape[0], dtype=torch.float64) if mask is None else mask.reshape(-1).double()
    counts, probs, rows = torch.zeros(experts, dtype=torch.float64), torch.zeros(experts, dtype=torch.float64), 0.0
    for layer in logits:
        p = torch.softmax(layer.detach().double(), -1)
        for row in range(p.shape[0]):
            for e in torch.topk(p[row], k).indices.tolist():
                counts[e] += keep[row]
        probs += (p * keep[:, None]).sum(0)
        rows += float(keep.sum())
    return experts * float(((counts / rows) * (probs / rows)).sum())


@pytest.mark.parametrize("module_name", FAMILY_MODULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("masked", [False, True])
def test_equals_the_family_function_value_and_gradient(module_name, dtype, k, masked):
    original = ORIGINALS[module_name]
    logits, mask = _inputs(dtype=dtype, masked=masked)
    theirs = original(logits, 8, k, mask)
    grads_theirs = torch.autograd.grad(theirs, logits)
    ours = bl.load_balancing_loss(logits, 8, k, mask)
    grads_ours = torch.autograd.grad(ours, logits)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    # the same operations on all layers at once: only the fp32 sums of the probabilities run in another order
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=0)
    # the gradient of those sums is the same for every element, so the gradients are the same bits
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("masked", [False, True])
def test_layers_of_other_shapes_take_the_loop(masked):
    """Router logits of different shapes (or dtypes) cannot be stacked: the per-layer loop, transformers' own
    order of operations, gives the same bits as the family's function."""
    logits, mask = _inputs(layers=3, masked=masked)
    mixed = (logits[0], logits[1].to(torch.bfloat16), logits[2])
    theirs = ORIGINALS[FAMILY_MODULES[0]](mixed, 8, 2, mask)
    assert torch.equal(bl.load_balancing_loss(mixed, 8, 2, mask), theirs)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_fp64_value_is_the_switch_formula(k, masked):
    logits, mask = _inputs(rows_per_batch=(2, 5), experts=6, dtype=torch.float64, masked=masked)
    # the sums are fp32 whatever the logits' dtype (as transformers keeps them): fp32 rounding
    got = float(bl.load_balancing_loss(logits, 6, k, mask).detach())
    assert got == pytest.approx(_switch_fp64(logits, 6, k, mask), rel=1e-6)


def test_no_router_logits_gives_zero_like_transformers():
    assert bl.load_balancing_loss(None, 8, 2) == 0
    assert bl.load_balancing_loss(torch.randn(4, 8), 8, 2) == 0  # not a tuple: transformers returns 0 too


def _tiny_mixtral(output_router_logits=True):
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64,
                                        output_router_logits=output_router_logits)
    return transformers.MixtralForCausalLM(config)


def test_inject_installs_it_and_the_aux_loss_is_the_stock_models():
    from transformers.models.mixtral import modeling_mixtral

    torch.manual_seed(0)
    stock = _tiny_mixtral()
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    expected = stock(input_ids=ids, attention_mask=mask, labels=ids)
    model = _tiny_mixtral()
    model.load_state_dict(stock.state_dict())
    report = inject(model, {"enabled": True, "moe": {"expert_masked": False},
                            "fused_kernels": {"linear_cross_entropy": False}})
    assert report.patched_functions[KIND_BALANCING] == ["modeling_mixtral.load_balancing_loss_func"]
    assert modeling_mixtral.load_balancing_loss_func is not ORIGINALS[modeling_mixtral.__name__]
    assert bl.patched() == [f"{modeling_mixtral.__name__}.{bl.FUNCTION}"]
    got = model(input_ids=ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    # a second inject finds it in place and keeps it
    again = inject(model, {"enabled": True, "moe": {"expert_masked": False}})
    assert KIND_BALANCING in again.patched_functions
    assert bl.restore() == [f"{modeling_mixtral.__name__}.{bl.FUNCTION}"]
    assert modeling_mixtral.load_balancing_loss_func is ORIGINALS[modeling_mixtral.__name__]


def test_switch_off_leaves_the_family_function():
    from transformers.models.mixtral import modeling_mixtral

    report = inject(_tiny_mixtral(), {"enabled": True, "moe": {"sync_free_balancing_loss": False}})
    assert KIND_BALANCING not in report.patched_functions
    assert ("modeling_mixtral.load_balancing_loss_func", "moe.sync_free_balancing_loss is false") in \
        report.not_patched
    assert modeling_mixtral.load_balancing_loss_func is ORIGINALS[modeling_mixtral.__name__]


def test_a_function_that_computes_something_else_is_not_replaced(monkeypatch):
    from transformers.models.mixtral import modeling_mixtral

    def other(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return 2 * ORIGINALS[modeling_mixtral.__name__](gate_logits, num_experts, top_k, attention_mask)

    def renamed(logits, experts=None, k=2, mask=None):
        return ORIGINALS[modeling_mixtral.__name__](logits, experts, k, mask)

    for function, says in ((other, "computes"), (renamed, "signature (logits, experts, k, mask)")):
        monkeypatch.setattr(modeling_mixtral, bl.FUNCTION, function)
        reason = bl.patch(modeling_mixtral.__name__)
        assert reason is not None and "not the standard Switch load-balancing loss" in reason and says in reason
        assert modeling_mixtral.load_balancing_loss_func is function


def test_config_key_is_a_strict_bool():
    from ds_loongforge.config import LoongForgeConfigError, parse_config

    with pytest.raises(LoongForgeConfigError, match="moe.sync_free_balancing_loss = 'no'"):
        parse_config({"loongforge": {"moe": {"sync_free_balancing_loss": "no"}}})


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_no_host_sync_on_cuda(masked):
    """The reason it exists: not one host wait in a call on CUDA router logits (bf16, Mixtral's e2e shape)."""
    from ds_loongforge.diagnostics import HostSyncRecorder

    logits = tuple(torch.randn(4 * 2048, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(8))
    mask = torch.ones(4, 2048, dtype=torch.long, device="cuda") if masked else None
    bl.load_balancing_loss(logits, 8, 2, mask)  # warm-up (first-call allocations)
    torch.cuda.synchronize()
    with HostSyncRecorder() as syncs:
        loss = bl.load_balancing_loss(logits, 8, 2, mask)
        loss.backward()
    assert syncs.summary()["count"] == 0, syncs.summary()["sites"]
    expected = ORIGINALS[FAMILY_MODULES[0]](tuple(t.detach().cpu() for t in logits), 8, 2,
                                            None if mask is None else mask.cpu())
    torch.testing.assert_close(loss.detach().cpu(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("module_name", FAMILY_MODULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,k", [(8, 2), (64, 8)])
@pytest.mark.parametrize("masked", [False, True])
def test_equals_the_family_function_on_cuda(module_name, dtype, experts, k, masked):
    """On CUDA the choices are counted by ops.moe_dispatch.topk_counts: torch.topk's own choices, so the gradients
    stay the family function's bits on the same device, bf16 ties included (Mixtral's e2e shape)."""
    torch.manual_seed(experts + k)
    logits = tuple(torch.randn(4 * 2048, experts, device="cuda", dtype=torch.float64).to(dtype).requires_grad_()
                   for _ in range(8))
    mask = None
    if masked:
        mask = torch.ones(4, 2048, dtype=torch.long, device="cuda")
        mask[1, 1000:] = 0
    theirs = ORIGINALS[module_name](logits, experts, k, mask)
    grads_theirs = torch.autograd.grad(theirs, logits)
    ours = bl.load_balancing_loss(logits, experts, k, mask)
    grads_ours = torch.autograd.grad(ours, logits)
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=0)
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
