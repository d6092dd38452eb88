"""Fused MoE router top-k (ops/moe_router.py): probabilities, choices, weights and the logits' gradient against
fp64 on fresh random data for every kernel dtype and edge shapes (one expert, k = E, k = 32, E = 1024, no tokens),
with and without renormalisation, each output's gradient alone and both; ties, NaN, determinism, the reference
fallback beyond the kernels' limits, and input errors.

Legend: T tokens, E experts, K experts per token."""

import pytest
import torch

from ds_loongforge.ops import router_topk, router_topk_reference
from ds_loongforge.ops.moe_router import MAX_KERNEL_EXPERTS, MAX_KERNEL_TOP_K
from ds_loongforge.ops.numerics import choice_errors, router_checks
from tests._params import DTYPES, IMPLS, assert_checks, device_of

SHAPES = [  # (T, E, K)
    pytest.param(0, 8, 2, id="no_tokens"),
    pytest.param(1, 1, 1, id="one_expert"),
    pytest.param(37, 8, 2, id="mixtral"),
    pytest.param(37, 64, 8, id="finegrained"),
    pytest.param(300, 100, 3, id="e100_ragged_lanes"),
    pytest.param(5, 33, 32, id="k32_e33"),
    pytest.param(7, 16, 16, id="k_equals_e"),
    pytest.param(9, 1024, 32, id="e1024_k32"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k", SHAPES)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no_renorm"])
@pytest.mark.parametrize("grads", ["weights", "probs", "both"])
def test_matches_fp64(impl, dtype, tokens, experts, k, renormalize, grads):
    gen = torch.Generator(device=device_of(impl)).manual_seed(tokens * 1000 + experts * 10 + k)
    assert_checks(router_checks(tokens, experts, k, dtype, device_of(impl), impl, renormalize, grads, gen))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtypes_and_shapes(impl, dtype):
    x = torch.randn(5, 12, device=device_of(impl), dtype=dtype, requires_grad=True)
    probs, weights, ids = router_topk(x, 3, impl=impl)
    assert probs.dtype == weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert probs.shape == (5, 12) and weights.shape == ids.shape == (5, 3)
    assert not ids.requires_grad and weights.requires_grad
    (grad,) = torch.autograd.grad(weights[:, 0].sum(), x)
    assert grad.dtype == dtype and grad.shape == x.shape


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_tie_of_distinct_logits_is_the_routers_to_break(impl):
    """2.0 and the next fp32 value above it both become -4.5 in x - 6.5 (an fp32 ulp of 4.8e-7 there), so their
    fp32 probabilities are equal although the fp64 ones are not: choice_errors (verify's and test_matches_fp64's
    ids check) accepts the router's lowest-expert-first order there and still counts a swapped or wrong choice."""
    above_two = float(torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)))
    logits = torch.tensor([[6.5, 2.0, above_two, -1.0]], device=device_of(impl))
    probs, _, ids = router_topk(logits, 3, impl=impl)
    exact = torch.softmax(logits.double(), dim=-1)
    assert exact[0, 2] > exact[0, 1]
    if impl == "cpu":  # std::exp of two equal fp32 arguments (the CUDA kernel's exp may tie or not)
        assert probs[0, 1] == probs[0, 2] and ids.tolist() == [[0, 1, 2]]
    assert choice_errors(ids, probs, exact) == 0
    assert choice_errors(ids[:, [0, 2, 1]], probs, exact) == (2 if probs[0, 1] == probs[0, 2] else 4)
    assert choice_errors(torch.tensor([[0, 1, 3]], device=ids.device), probs, exact) > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_take_the_lowest_expert_and_equal_weights(impl):
    x = torch.zeros(4, 8, device=device_of(impl), requires_grad=True)
    probs, weights, ids = router_topk(x, 3, True, impl=impl)
    assert torch.equal(ids.cpu(), torch.arange(3).expand(4, 3))
    torch.testing.assert_close(weights.cpu(), torch.full((4, 3), 1 / 3))
    torch.testing.assert_close(probs.cpu(), torch.full((4, 8), 1 / 8))
    # renormalised weights of a uniform softmax do not move with the logits: the gradient is 0
    (grad,) = torch.autograd.grad(weights.sum(), x)
    assert torch.all(grad == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_minus_inf_logits(impl):
    device = device_of(impl)
    x = torch.randn(3, 8, device=device)
    x[0, 5] = float("nan")
    x[1, :] = float("-inf")
    x[2, 3] = float("-inf")
    probs, weights, ids = router_topk(x, 2, True, impl=impl)
    assert torch.isnan(probs[0]).all() and torch.isnan(weights[0]).all()  # NaN spreads, as in torch's softmax
    assert torch.isnan(probs[1]).all() and torch.isnan(weights[1]).all()
    assert probs[2, 3] == 0 and 3 not in ids[2].tolist()
    for row in ids.cpu():  # k distinct experts even where every value is NaN
        assert len(set(row.tolist())) == 2 and all(0 <= e < 8 for e in row.tolist())


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl):
    device = device_of(impl)
    x = torch.randn(513, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    dw = torch.randn(513, 8, device=device)
    runs = []
    for _ in range(2):
        probs, weights, ids = router_topk(x, 8, True, impl=impl)
        (grad,) = torch.autograd.grad((weights * dw).sum() + probs.sum(), x)
        runs.append((probs, weights, ids, grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("experts,k,dtype", [(MAX_KERNEL_EXPERTS + 1, 2, torch.float32),
                                             (64, MAX_KERNEL_TOP_K + 1, torch.float32), (8, 2, torch.float64)])
def test_auto_takes_the_reference_beyond_the_kernels(experts, k, dtype):
    x = torch.randn(6, experts, dtype=dtype, requires_grad=True)
    got = router_topk(x, k, True)
    want = router_topk_reference(x, k, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[0].grad_fn is not None and "RouterTopK" not in type(got[0].grad_fn).__name__


def test_kernel_limits_are_clear_errors():
    with pytest.raises(RuntimeError, match="1024"):
        router_topk(torch.randn(2, MAX_KERNEL_EXPERTS + 1), 2, impl="cpu")
    with pytest.raises(RuntimeError, match="k = 33"):
        router_topk(torch.randn(2, 64), MAX_KERNEL_TOP_K + 1, impl="cpu")


@pytest.mark.parametrize("k", [0, 9])
def test_bad_k(k):
    with pytest.raises(ValueError, match=f"k = {k} must be between 1 and the number of experts \\(8\\)"):
        router_topk(torch.randn(4, 8), k)


def test_logits_must_be_2d():
    with pytest.raises(ValueError, match=r"must be \[tokens, experts\], got shape \(2, 4, 8\)"):
        router_topk(torch.randn(2, 4, 8), 2)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_the_layer_router_follows_the_layer_impl(impl):
    """ExpertMaskedMoE(impl=...) hands its impl to the router: 'reference' runs torch's ops, 'cpu' the kernel,
    and a router beyond the kernels' shapes on an explicit impl takes the reference instead of failing."""
    from ds_loongforge.modules import ExpertMaskedMoE

    layer = ExpertMaskedMoE(16, 24, 8, 2, impl=impl)
    _, probs, _, _ = layer.gate(torch.randn(5, 16, requires_grad=True))
    assert ("RouterTopK" in type(probs.grad_fn).__name__) == (impl == "cpu")
    wide = ExpertMaskedMoE(16, 24, MAX_KERNEL_EXPERTS + 8, 2, impl=impl)
    _, probs, weights, ids = wide.gate(torch.randn(5, 16))
    assert probs.shape == (5, MAX_KERNEL_EXPERTS + 8) and ids.shape == (5, 2)
