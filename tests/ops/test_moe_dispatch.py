"""Fused MoE dispatch (permute / unpermute): the routing indices, values and every gradient against fp64 on
edge shapes, bitwise determinism of the backward, row-strided and misaligned rows, and input errors.

Legend: T tokens, H hidden, K experts per token, E experts, P = T*K pairs."""

import re

import pytest
import torch

from ds_loongforge.ops import (expert_routing, moe_permute, moe_permute_reference, moe_unpermute,
                               moe_unpermute_reference, routing_indices, routing_indices_reference)
from ds_loongforge.ops.moe_dispatch import _BUILDERS, MAX_KERNEL_EXPERTS
from ds_loongforge.ops.numerics import moe_permute_checks, moe_unpermute_checks, random_routing, routing_checks
from tests._params import DTYPES, IMPLS, assert_checks, device_of

# the reference too: its fp32 accumulation with one rounding is part of the op's contract
IMPLS_AND_REFERENCE = [pytest.param("reference", id="reference"), *IMPLS]
ROUNDINGS = ["stock", "once"]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

SHAPES = [  # (T, H, K, E); random_routing leaves the last quarter of the experts without tokens
    pytest.param(0, 64, 2, 4, id="no_tokens"),            # an expert-parallel rank nothing was routed to
    pytest.param(1, 1, 1, 1, id="one_element"),           # T=1, H=1, K=1, one expert
    pytest.param(1, 2880, 8, 64, id="one_token_k8"),      # one token on 8 experts, 56+ experts empty
    pytest.param(37, 3, 2, 4, id="h3"),                   # odd H: the scalar path
    pytest.param(37, 64, 8, 4, id="k8_on_3_experts"),     # K above the used experts: a token repeats an expert
    pytest.param(37, 2880, 1, 64, id="h2880_k1"),         # GPT-OSS hidden size, top-1
    pytest.param(1000, 64, 2, 64, id="t1000_h64"),        # narrow rows share a block
    pytest.param(1000, 3, 8, 1, id="one_expert"),         # every pair on expert 0: order is the identity
    pytest.param(1000, 2880, 2, 4, id="t1000_h2880"),     # the largest case here, P = 2000 rows
    pytest.param(16, 7168, 8, 64, id="h7168"),            # DeepSeek-V3 hidden size
    pytest.param(300, 64, 3, 8, id="k3"),                 # K = 3: past the pipelined gather's K <= 2
    pytest.param(40, 136, 16, 32, id="k16"),              # K above the scatter's pair chunk of 8
]


def _routing(tokens, k, experts, device):
    ids_TK, weights_TK = random_routing(tokens, k, experts, device)
    order_P, slot_TK, _ = routing_indices(ids_TK, experts)
    return order_P, slot_TK, weights_TK


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,k,experts", [(0, 2, 4), (1, 1, 1), (37, 2, 64), (1000, 8, 4), (5, 3, 2)])
def test_routing_indices_are_a_stable_expert_major_order(device, tokens, k, experts):
    ids_TK, _ = random_routing(tokens, k, experts, device)
    order_P, slot_TK, tokens_per_expert_E = routing_indices(ids_TK, experts)
    ids_P = ids_TK.reshape(-1)
    assert order_P.dtype == slot_TK.dtype == tokens_per_expert_E.dtype == torch.int64
    assert slot_TK.shape == (tokens, k) and tokens_per_expert_E.shape == (experts,)
    assert torch.equal(tokens_per_expert_E, torch.bincount(ids_P, minlength=experts))
    sorted_ids = ids_P[order_P]
    assert torch.all(sorted_ids[1:] >= sorted_ids[:-1]), "expert-major"
    same_expert = sorted_ids[1:] == sorted_ids[:-1]
    assert torch.all(order_P[1:][same_expert] > order_P[:-1][same_expert]), "token order within an expert"
    assert torch.equal(order_P[slot_TK.reshape(-1)], torch.arange(tokens * k, device=device)), "slot = order^-1"


ROUTING_SHAPES = [  # (T, K, E): the counting sort's blocks hold 1024 pairs and its warps 32
    pytest.param(0, 2, 4, id="no_pairs"),
    pytest.param(1, 1, 1, id="one_pair"),
    pytest.param(33, 1, 8, id="one_warp_and_one_lane"),
    pytest.param(1024, 1, 64, id="one_full_block"),
    pytest.param(3001, 8, 64, id="24_blocks_ragged_tail"),
    pytest.param(2050, 2, 1, id="one_expert_across_blocks"),
    pytest.param(700, 8, 3000, id="3000_experts_18006_counters"),
    pytest.param(257, 4, MAX_KERNEL_EXPERTS, id="the_most_experts_on_cuda"),
    # 1024 and 2052 count blocks: 66560 and 12312 (expert, block) counters to scan
    pytest.param(131072, 8, 64, id="1M_pairs_1024_blocks_64_experts"),
    pytest.param(300001, 7, 5, id="2.1M_pairs_ragged_5_experts"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens,k,experts", ROUTING_SHAPES)
def test_routing_kernel_equals_the_stable_sort(impl, tokens, k, experts):
    device = device_of(impl)
    for check in routing_checks(tokens, k, experts, device, impl):
        assert check.passed, check.describe()
    ids_TK, _ = random_routing(tokens, k, experts, device)
    got, ref = expert_routing(ids_TK, experts, impl=impl), routing_indices_reference(ids_TK, experts)
    for name, a, b in zip(got._fields, got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.offsets_E.dtype == torch.int32 and torch.equal(got.offsets_E.long(), got.tokens_per_expert_E.cumsum(0))


@pytest.mark.parametrize("impl", IMPLS)
def test_routing_kernel_takes_int32_and_strided_ids(impl):
    device = device_of(impl)
    ids = torch.randint(0, 16, (300, 6), device=device)[:, ::2]  # [300, 3], row stride 6
    ref = routing_indices_reference(ids, 16)
    for variant in (ids, ids.int()):
        got = expert_routing(variant, 16, impl=impl)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.gpu
def test_routing_kernel_above_its_expert_limit_takes_the_reference():
    ids = torch.randint(0, MAX_KERNEL_EXPERTS + 1, (64, 2), device="cuda")
    got, ref = expert_routing(ids, MAX_KERNEL_EXPERTS + 1), routing_indices_reference(ids, MAX_KERNEL_EXPERTS + 1)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    with pytest.raises(RuntimeError, match=r"num_experts = 8193 is above the CUDA kernel's 8192"):
        expert_routing(ids, MAX_KERNEL_EXPERTS + 1, impl="cuda")


@pytest.mark.gpu
def test_routing_kernel_puts_out_of_range_ids_after_every_expert():
    """On CUDA ids are not range-checked (that would sync): a bad id must still get a row of its own, after the
    valid pairs, and be counted nowhere, so the permute writes no row twice and the valid experts are intact."""
    ids = torch.tensor([[1, 5], [-1, 0], [2, 1], [4, 3]], device="cuda")  # E = 4: 5, -1 and 4 are out of range
    got = expert_routing(ids, 4, impl="cuda")
    assert got.tokens_per_expert_E.tolist() == [1, 2, 1, 1] and got.offsets_E.tolist() == [1, 3, 4, 5]
    assert sorted(got.slot_TK.reshape(-1).tolist()) == list(range(8))
    assert got.order_P[:5].tolist() == [3, 0, 5, 4, 7]  # expert-major, pair order within an expert
    assert sorted(got.order_P[5:].tolist()) == [1, 2, 6]


def test_routing_indices_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\), got ids from 0 to 4"):
        routing_indices(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\), got ids from -1 to 2"):
        routing_indices(torch.tensor([[-1, 2]]), 4)
    with pytest.raises(ValueError, match="integer expert ids, got dtype torch.float32"):
        routing_indices(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match=r"must be \[tokens, k\], got shape \(4,\)"):
        routing_indices(torch.zeros(4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_experts must be >= 1, got 0"):
        routing_indices(torch.zeros(2, 2, dtype=torch.int64), 0)
    kernel = _BUILDERS["cpu"]().load()  # the binding's own checks, for callers that skip the Python op
    with pytest.raises(RuntimeError, match=r"ids_TK\[1, 0\] = 7 is outside \[0, num_experts\) = \[0, 4\)"):
        kernel.routing_indices(torch.tensor([[0, 1], [7, 2]]), 4)
    with pytest.raises(RuntimeError, match="ids_TK must be contiguous"):
        kernel.routing_indices(torch.zeros(4, 4, dtype=torch.int64)[:, ::2], 4)


@pytest.mark.parametrize("impl", IMPLS_AND_REFERENCE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,k,experts", SHAPES)
def test_moe_permute_matches_fp64(impl, dtype, tokens, hidden, k, experts):
    assert_checks(moe_permute_checks(tokens, hidden, k, experts, dtype, device_of(impl), impl))


@pytest.mark.parametrize("impl", IMPLS_AND_REFERENCE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,k,experts", SHAPES)
def test_moe_unpermute_matches_fp64(impl, dtype, tokens, hidden, k, experts):
    assert_checks(moe_unpermute_checks(tokens, hidden, k, experts, dtype, device_of(impl), impl))


@pytest.mark.parametrize("impl", IMPLS_AND_REFERENCE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,k,experts", [(0, 64, 2, 4), (1, 1, 1, 1), (37, 3, 2, 4), (37, 64, 8, 4),
                                                     (1000, 2880, 2, 4), (16, 7168, 8, 64), (9, 64, 12, 16)])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_moe_unpermute_with_residual_matches_fp64(impl, dtype, tokens, hidden, k, experts, rounding):
    """The decoder layer's residual added in the same pass ("once": one rounding; "stock": after the sum's), its
    gradient the output's; K = 12 runs past the kernel's loads in flight."""
    assert_checks(moe_unpermute_checks(tokens, hidden, k, experts, dtype, device_of(impl), impl, residual=True,
                                       rounding=rounding))


@pytest.mark.parametrize("impl", IMPLS)
def test_unpermute_residual_gradient_is_the_output_gradient(impl):
    _, slot_TK, weights_TK = _routing(20, 2, 8, impl)
    y_PH = torch.randn(40, 64, device=impl, requires_grad=True)
    r_TH = torch.randn(20, 64, device=impl, requires_grad=True)
    dout_TH = torch.randn(20, 64, device=impl)
    out = moe_unpermute(y_PH, slot_TK, weights_TK, impl=impl, residual_TH=r_TH)
    torch.testing.assert_close(out, r_TH + moe_unpermute(y_PH, slot_TK, weights_TK, impl=impl))
    dy, dr = torch.autograd.grad(out, (y_PH, r_TH), dout_TH)
    assert torch.equal(dr, dout_TH)
    (dy_plain,) = torch.autograd.grad(moe_unpermute(y_PH, slot_TK, weights_TK, impl=impl), y_PH, dout_TH)
    assert torch.equal(dy, dy_plain)
    for bad, match in ((r_TH[:19], r"residual_TH must be \[tokens, hidden\] = \[20, 64\] .* got \(19, 64\)"),
                       (r_TH.double(), "in y's dtype torch.float32 .* torch.float64")):
        with pytest.raises(ValueError, match=match):
            moe_unpermute(y_PH, slot_TK, weights_TK, impl=impl, residual_TH=bad)
    kernel = _BUILDERS[impl]().load()
    with pytest.raises(RuntimeError, match=r"residual_TH \(hidden 32, Float\) must match y_PH \(hidden 64, Float\)"):
        kernel.unpermute_forward(y_PH.detach(), slot_TK, weights_TK, torch.randn(20, 32, device=impl))


@pytest.mark.parametrize("impl", IMPLS_AND_REFERENCE)
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_moe_unpermute_weights_in_activation_dtype(impl, dtype, rounding, residual):
    assert_checks(moe_unpermute_checks(53, 320, 4, 16, dtype, device_of(impl), impl, weights_dtype=dtype,
                                       residual=residual, rounding=rounding))


def transformers_combine(y_PH, slot_TK, weights_TK, residual_TH=None):
    """transformers' MoE combine as its grouped_mm experts compute it (integrations/moe.py: the weighted rows in
    the weights' promoted dtype, summed over k, cast to the activations' dtype), then a decoder layer's
    ``residual + hidden_states``."""
    out = (y_PH[slot_TK] * weights_TK.unsqueeze(-1)).sum(dim=1).to(y_PH.dtype)
    return out if residual_TH is None else residual_TH + out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("weights_dtype", ["fp32", "activation"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("k", [1, 2])
def test_stock_rounding_is_transformers_combine(device, dtype, weights_dtype, residual, k):
    """rounding="stock" computes transformers' bits: fp32 weights (Mixtral) give fp32 products, 16-bit weights
    (Qwen2/3-MoE, OLMoE) products rounded to 16 bits, the sum rounded before the residual is added. Bit for bit
    at k <= 2, where the sum of k terms has one order; "once" differs from it."""
    tokens, hidden, experts = 301, 520, 8
    _, slot_TK, weights_TK = _routing(tokens, k, experts, device)
    weights_TK = weights_TK if weights_dtype == "fp32" else weights_TK.to(dtype)
    y_PH = torch.randn(tokens * k, hidden, dtype=dtype, device=device)
    r_TH = 4.0 * torch.randn(tokens, hidden, dtype=dtype, device=device) if residual else None
    expected = transformers_combine(y_PH, slot_TK, weights_TK, r_TH)
    for impl in ("reference", device):
        out = moe_unpermute(y_PH, slot_TK, weights_TK, impl=impl, residual_TH=r_TH)
        assert torch.equal(out, expected), (impl, float((out != expected).float().mean()))
    if k == 2 and (residual or weights_dtype == "activation"):  # (k = 1: random_routing's weight is 1, exact)
        once = moe_unpermute(y_PH, slot_TK, weights_TK, impl=device, residual_TH=r_TH, rounding="once")
        assert not torch.equal(once, expected)


def in_order_combine(y_PH, slot_TK, weights_TK, residual_TH=None):
    """The stock combine's contract beyond k = 2: transformers' products, added j = 0..K-1 in fp32 one at a time."""
    products_TKH = (y_PH[slot_TK] * weights_TK.unsqueeze(-1)).float()
    acc_TH = products_TKH[:, 0]
    for j in range(1, products_TKH.shape[1]):
        acc_TH = acc_TH + products_TKH[:, j]
    out = acc_TH.to(y_PH.dtype)
    return out if residual_TH is None else residual_TH + out


# torch's CPU sum over a middle dimension adds K < 16 rows in order in the columns its blocks of four vectors
# cover (multi_row_sum); the last H mod (4 x vector width) columns go through row_sum, which keeps four
# interleaved partial sums (a0+a4, a1+a5, ...) and so adds K > 4 terms in another order. Real hidden sizes are
# multiples of 64 (four AVX-512 vectors), where every column is in order.
TORCH_IN_ORDER_COLUMNS = 64


@pytest.mark.parametrize("hidden", [128, 136], ids=["h128", "h136"])
@pytest.mark.parametrize("k", [3, 4, 8])
def test_stock_rounding_sums_k_terms_in_order_cpu(k, hidden):
    """Beyond k = 2 the sum's order matters: the kernels add j = 0..K-1 in order in fp32, bit for bit (fp32
    weights and 16-bit ones). That is transformers' combine bit for bit wherever torch's CPU sum adds in order
    (every column at H = 128, and at K <= 4); in the tail columns of H = 136 its order differs at K = 8, and the
    two results are one bf16 ulp apart at most (1 element in about 35000 at one seed in 31)."""
    tokens = 257
    _, slot_TK, weights_TK = _routing(tokens, k, 16, "cpu")
    y_PH = torch.randn(tokens * k, hidden, dtype=torch.bfloat16)
    r_TH = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    in_order = hidden - hidden % TORCH_IN_ORDER_COLUMNS if k > 4 else hidden
    for w in (weights_TK, weights_TK.bfloat16()):
        out = moe_unpermute(y_PH, slot_TK, w, impl="cpu", residual_TH=r_TH)
        assert torch.equal(out, in_order_combine(y_PH, slot_TK, w, r_TH))
        expected = transformers_combine(y_PH, slot_TK, w, r_TH)
        assert torch.equal(out[:, :in_order], expected[:, :in_order])
        plain = moe_unpermute(y_PH, slot_TK, w, impl="cpu")[:, in_order:]
        torch.testing.assert_close(plain, transformers_combine(y_PH, slot_TK, w)[:, in_order:],
                                   rtol=2.0 ** -7, atol=2.0 ** -133)  # one ulp, relative to the larger


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [3, 4, 8])
def test_stock_rounding_order_is_visible_under_cancellation(device, k):
    """Rows built so that the order decides the result: 2**25, then K-2 ones, then -2**25, weights 1. In order,
    each one is lost against 2**25 (an fp32 ulp of 4 there) and the sum is 0; any order that adds the ones
    together first keeps them (the exact sum is K-2)."""
    tokens, hidden = 5, 8
    slot_TK = torch.arange(tokens * k, device=device).reshape(tokens, k)
    y_TKH = torch.ones(tokens, k, hidden, dtype=torch.bfloat16, device=device)
    y_TKH[:, 0], y_TKH[:, -1] = 2.0 ** 25, -2.0 ** 25
    y_PH = y_TKH.reshape(tokens * k, hidden)
    for weights_TK in (torch.ones(tokens, k, device=device), torch.ones(tokens, k, device=device).bfloat16()):
        out = moe_unpermute(y_PH, slot_TK, weights_TK, impl=device)
        assert torch.equal(out, torch.zeros_like(out)), out[0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_forward_is_an_exact_copy(impl, dtype):
    order_P, slot_TK, _ = _routing(77, 4, 16, impl)
    x_TH = torch.randn(77, 136, device=impl, dtype=dtype)
    assert torch.equal(moe_permute(x_TH, order_P, slot_TK, impl=impl), x_TH[order_P // 4])


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_is_bitwise_deterministic(impl):
    order_P, slot_TK, weights_TK = _routing(300, 8, 64, impl)
    x_TH = torch.randn(300, 520, device=impl, dtype=torch.bfloat16, requires_grad=True)
    y_PH = torch.randn(2400, 520, device=impl, dtype=torch.bfloat16, requires_grad=True)
    weights_TK.requires_grad_()
    dx_PH, dout_TH = torch.randn_like(y_PH), torch.randn_like(x_TH)

    def grads():
        x_PH = moe_permute(x_TH, order_P, slot_TK, impl=impl)
        out_TH = moe_unpermute(y_PH, slot_TK, weights_TK, impl=impl)
        return torch.autograd.grad((x_PH, out_TH), (x_TH, y_PH, weights_TK), (dx_PH, dout_TH))

    for first, second in zip(grads(), grads()):
        assert torch.equal(first, second)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("view", ["row_strided", "misaligned"])
def test_non_contiguous_rows(impl, view):
    tokens, hidden, k = 50, 256, 2

    def rows(n):
        base = torch.randn(n, hidden + 16, dtype=torch.bfloat16, device=impl)
        t = base[:, :hidden] if view == "row_strided" else base[:, 1:hidden + 1]
        assert not t.is_contiguous() and t.stride(1) == 1
        return t

    assert_checks(moe_permute_checks(tokens, hidden, k, 8, torch.bfloat16, impl, impl, x=rows(tokens)))
    assert_checks(moe_unpermute_checks(tokens, hidden, k, 8, torch.bfloat16, impl, impl, y=rows(tokens * k)))


@pytest.mark.parametrize("impl", IMPLS)
def test_unpermute_without_weight_gradient(impl):
    # a frozen router: the backward then never reads y (and the forward does not keep it)
    _, slot_TK, weights_TK = _routing(40, 2, 8, impl)
    y_PH = torch.randn(80, 96, device=impl, requires_grad=True)
    dout_TH = torch.randn(40, 96, device=impl)
    (dy,) = torch.autograd.grad(moe_unpermute(y_PH, slot_TK, weights_TK, impl=impl), y_PH, dout_TH)
    (dy_ref,) = torch.autograd.grad(moe_unpermute_reference(y_PH, slot_TK, weights_TK), y_PH, dout_TH)
    torch.testing.assert_close(dy, dy_ref, rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS_AND_REFERENCE)
def test_bad_input_is_a_clear_error(impl):
    device = device_of(impl)
    order_P, slot_TK, weights_TK = _routing(6, 2, 4, device)
    x_TH = torch.randn(6, 8, device=device)
    y_PH = torch.randn(12, 8, device=device)
    with pytest.raises(ValueError, match=r"x_TH must be \[tokens, hidden\] with tokens = slot_TK.shape\[0\] = 6, "
                                         r"got shape \(5, 8\)"):
        moe_permute(x_TH[:5], order_P, slot_TK, impl=impl)
    with pytest.raises(ValueError, match=r"got shape \(1, 6, 8\)"):
        moe_permute(x_TH[None], order_P, slot_TK, impl=impl)
    with pytest.raises(ValueError, match=r"order_P must be an int64 \[T\*K\] = \[12\] tensor .* got torch.int64 of "
                                         r"shape \(11,\)"):
        moe_permute(x_TH, order_P[:11], slot_TK, impl=impl)
    with pytest.raises(ValueError, match="slot_TK must be an int64 .* got torch.int32"):
        moe_permute(x_TH, order_P, slot_TK.int(), impl=impl)
    with pytest.raises(ValueError, match=r"y_PH must be \[T\*K, hidden\] with T\*K = 12 .* got shape \(10, 8\)"):
        moe_unpermute(y_PH[:10], slot_TK, weights_TK, impl=impl)
    with pytest.raises(ValueError, match=r"weights_TK shape \(6, 1\) differs from slot_TK shape \(6, 2\)"):
        moe_unpermute(y_PH, slot_TK, weights_TK[:, :1], impl=impl)
    with pytest.raises(ValueError, match="weights_TK must be float32 or y's dtype torch.bfloat16, got torch.float64"):
        moe_unpermute(y_PH.bfloat16(), slot_TK, weights_TK.double(), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_checks_name_the_values(impl):
    # numbers and shapes in these messages are formatted by LF_CHECK: on the device image an extension that
    # streams an integer into a TORCH_CHECK message segfaults (benchmarks/results/check_msg_8e950be.log)
    kernel = _BUILDERS[impl]().load()
    _, slot_TK, weights_TK = _routing(6, 2, 4, impl)
    x_TH = torch.randn(6, 8, device=impl)
    y_PH = torch.randn(12, 8, device=impl)
    with pytest.raises(RuntimeError, match="slot_TK must have dtype Long, got Int"):
        kernel.permute_forward(x_TH, slot_TK.int())
    with pytest.raises(RuntimeError, match="slot_TK must be contiguous"):
        kernel.permute_forward(torch.randn(2, 8, device=impl), slot_TK.t())
    with pytest.raises(RuntimeError, match=r"x_TH has 5 rows \(tokens\) but slot_TK \[6, 2\] has 6"):
        kernel.permute_forward(x_TH[:5], slot_TK)
    with pytest.raises(RuntimeError, match=r"grad of x_PH has 11 rows but slot_TK \[6, 2\] holds T\*K = 12 pairs"):
        kernel.permute_backward(y_PH[:11], slot_TK)
    with pytest.raises(RuntimeError, match="x_TH must be float32, float16 or bfloat16, got Double"):
        kernel.permute_forward(x_TH.double(), slot_TK)
    with pytest.raises(RuntimeError, match="unit stride along the last dimension, got shape"):
        kernel.permute_forward(torch.randn(8, 6, device=impl).t(), slot_TK)
    with pytest.raises(RuntimeError, match="weights_TK must have dtype Float, got BFloat16"):
        kernel.unpermute_forward(y_PH, slot_TK, weights_TK.bfloat16())
    with pytest.raises(RuntimeError, match=r"weights_TK shape \[6, 1\] differs from slot_TK shape \[6, 2\]"):
        kernel.unpermute_forward(y_PH, slot_TK, weights_TK[:, :1].contiguous())
    with pytest.raises(RuntimeError, match=r"y_PH \(hidden 8, Float\) must match the grad of out_TH \(hidden 8, "
                                           r"BFloat16\)"):
        kernel.unpermute_backward(x_TH.bfloat16(), y_PH, slot_TK, weights_TK)
    with pytest.raises(RuntimeError, match=rf"moe_permute: slot_TK must be on {impl}, got a tensor on meta"):
        kernel.permute_forward(x_TH, slot_TK.to("meta"))


def test_cpu_kernels_check_that_slot_is_a_permutation():
    # the CUDA kernels trust routing_indices (a device-side check would cost a host sync)
    kernel = _BUILDERS["cpu"]().load()
    _, slot_TK, weights_TK = _routing(6, 2, 4, "cpu")
    x_TH, y_PH = torch.randn(6, 8), torch.randn(12, 8)
    bad = slot_TK.clone()
    bad[3, 1] = 12
    with pytest.raises(RuntimeError, match=r"slot_TK\[3, 1\] = 12 is outside \[0, T\*K\) = \[0, 12\)"):
        kernel.permute_forward(x_TH, bad)
    bad[3, 1] = -1
    with pytest.raises(RuntimeError, match=r"slot_TK\[3, 1\] = -1 is outside"):
        moe_unpermute(y_PH, bad, weights_TK, impl="cpu")
    bad = slot_TK.clone()
    bad[5, 0] = bad[0, 0]
    with pytest.raises(RuntimeError, match=rf"holds row {int(bad[0, 0])} twice .* must be a permutation"):
        kernel.permute_backward(y_PH, bad)


@pytest.mark.gpu
def test_more_tokens_than_one_grid_covers_cuda():
    # H=2048 bf16 puts one token in a 256-thread block and the grid stops at 64 blocks per SM: the token
    # loop of permute forward/backward, unpermute forward and the dweights-free backward covers the rest
    tokens = torch.cuda.get_device_properties(0).multi_processor_count * 64 + 1000
    assert_checks(moe_permute_checks(tokens, 2048, 2, 64, torch.bfloat16, "cuda", "cuda"))
    assert_checks(moe_unpermute_checks(tokens, 2048, 2, 64, torch.bfloat16, "cuda", "cuda"))


@pytest.mark.gpu
def test_cuda_matches_cpu():
    order_P, slot_TK, weights_TK = _routing(257, 8, 64, "cpu")
    x_TH = torch.randn(257, 2880, dtype=torch.bfloat16)
    y_PH = torch.randn(257 * 8, 2880, dtype=torch.bfloat16)
    on_cuda = [t.cuda() for t in (x_TH, y_PH, order_P, slot_TK, weights_TK)]
    x_c, y_c, order_c, slot_c, w_c = on_cuda
    assert torch.equal(moe_permute(x_c, order_c, slot_c, impl="cuda").cpu(),
                       moe_permute(x_TH, order_P, slot_TK, impl="cpu"))
    # the same fp32 sums in the same order: under "stock" each product and sum is rounded on its own on both (the
    # same bits); under "once" CUDA contracts them into multiply-adds
    for residual in (None, (x_c, x_TH)):
        r_c, r_TH = residual or (None, None)
        stock_c = moe_unpermute(y_c, slot_c, w_c, impl="cuda", residual_TH=r_c).cpu()
        assert torch.equal(stock_c, moe_unpermute(y_PH, slot_TK, weights_TK, impl="cpu", residual_TH=r_TH))
        once_c = moe_unpermute(y_c, slot_c, w_c, impl="cuda", residual_TH=r_c, rounding="once").cpu()
        torch.testing.assert_close(once_c, moe_unpermute(y_PH, slot_TK, weights_TK, impl="cpu", residual_TH=r_TH,
                                                         rounding="once"), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_auto_uses_the_kernel_and_fp64_uses_the_reference(impl):
    order_P, slot_TK, weights_TK = _routing(9, 2, 4, impl)
    x_TH = torch.randn(9, 16, device=impl, dtype=torch.float64, requires_grad=True)
    x_PH = moe_permute(x_TH, order_P, slot_TK)
    assert x_PH.dtype == torch.float64 and "MoEPermute" not in type(x_PH.grad_fn).__name__
    x_PH = moe_permute(x_TH.float(), order_P, slot_TK)
    assert "MoEPermute" in type(x_PH.grad_fn).__name__
    out_TH = moe_unpermute(x_PH, slot_TK, weights_TK)
    assert "MoEUnpermute" in type(out_TH.grad_fn).__name__
    torch.testing.assert_close(out_TH, moe_unpermute_reference(x_PH, slot_TK, weights_TK))
    torch.testing.assert_close(x_PH, moe_permute_reference(x_TH.float(), order_P, slot_TK))


# --- top-k choice counts (the balancing loss's) -------------------------------------------------------------------

def _torch_topk_counts(values_RE, k, weights_R=None):
    """What the balancing loss computed before the kernel: torch.topk's choices, their weights scattered."""
    rows, columns = values_RE.shape
    chosen = torch.topk(values_RE, k, dim=-1).indices.reshape(-1)
    w = torch.ones(rows, dtype=torch.int64, device=values_RE.device) if weights_R is None else \
        weights_R.repeat(rows // weights_R.numel())
    return torch.zeros(columns, dtype=torch.int64, device=values_RE.device).scatter_add_(0, chosen,
                                                                                         w.repeat_interleave(k))


def _tied_rows(rows, columns, dtype, device, gen):
    """Values on a coarse grid (many ties in every row), some NaN, +-0.0 and +-inf."""
    v = torch.randint(-4, 5, (rows, columns), generator=gen).double() / 4
    v.view(-1)[torch.randperm(v.numel(), generator=gen)[: max(1, v.numel() // 50)]] = float("nan")
    v.view(-1)[torch.randperm(v.numel(), generator=gen)[: max(1, v.numel() // 50)]] = -0.0
    v.view(-1)[torch.randperm(v.numel(), generator=gen)[: max(1, v.numel() // 97)]] = float("inf")
    v.view(-1)[torch.randperm(v.numel(), generator=gen)[: max(1, v.numel() // 89)]] = float("-inf")
    return v.to(dtype).to(device)


TOPK_COUNT_SHAPES = [(0, 8, 2), (1, 1, 1), (7, 5, 5), (1000, 8, 2), (4099, 64, 8), (300, 300, 7), (33, 4096, 3)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,columns,k", TOPK_COUNT_SHAPES)
def test_topk_counts_equal_the_stable_order_reference(impl, dtype, rows, columns, k):
    from ds_loongforge.ops.moe_dispatch import topk_counts, topk_counts_reference

    gen = torch.Generator().manual_seed(rows * 7 + columns * 3 + k)
    values = _tied_rows(rows, columns, dtype, device_of(impl), gen)
    # one weight per row (an attention mask: 0 and 1, here negative too), and one for every row
    per_row = torch.randint(-2, 4, (rows,), generator=gen).to(values.device)
    for w in (None, per_row if rows else None, torch.tensor([3], device=values.device)):
        got = topk_counts(values, k, w, impl=impl)
        assert got.dtype == torch.int64 and got.shape == (columns,) and got.device == values.device
        assert torch.equal(got.cpu(), topk_counts_reference(values.cpu(), k, None if w is None else w.cpu()))
    # every row counts k choices, each once
    if rows:
        assert int(topk_counts(values, k, impl=impl).sum()) == rows * k


@pytest.mark.parametrize("impl", IMPLS)
def test_topk_counts_equal_torch_topk_without_ties(impl):
    from ds_loongforge.ops.moe_dispatch import topk_counts

    gen = torch.Generator().manual_seed(1)
    values = torch.randn(5000, 64, generator=gen, dtype=torch.float64).float().to(device_of(impl))
    weights = torch.randint(0, 2, (1000,), generator=gen).to(values.device)
    for k in (1, 2, 8, 64):
        assert torch.equal(topk_counts(values, k, impl=impl), _torch_topk_counts(values, k))
        assert torch.equal(topk_counts(values, k, weights, impl=impl), _torch_topk_counts(values, k, weights))


def test_topk_order_of_special_values():
    """NaN above +inf, +0.0 above -0.0 (torch.topk's radix order), equal values to the lower column."""
    from ds_loongforge.ops.moe_dispatch import topk_counts_reference

    row = torch.tensor([[0.5, float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 0.5]])
    expected_order = [1, 4, 0, 6, 3, 2, 5]
    for k in range(1, 8):
        expected = torch.zeros(7, dtype=torch.int64)
        expected[expected_order[:k]] = 1
        assert torch.equal(topk_counts_reference(row, k), expected), k
        from ds_loongforge.ops.moe_dispatch import topk_counts

        assert torch.equal(topk_counts(row, k, impl="cpu"), expected), k


def test_topk_order_keys_of_fp64_keep_its_precision():
    """Values equal in fp32 but not in fp64 keep their fp64 order (the reference of fp64 inputs)."""
    from ds_loongforge.ops.moe_dispatch import topk_counts_reference, topk_order_keys

    v = torch.tensor([[1.0, 1.0 + 2.0**-40, -1.0 - 2.0**-40, -1.0, -0.0, 0.0, float("nan"), float("-inf")]],
                     dtype=torch.float64)
    order = torch.sort(topk_order_keys(v), dim=1, descending=True, stable=True).indices.tolist()[0]
    assert order == [6, 1, 0, 5, 4, 3, 2, 7]
    assert topk_counts_reference(v, 2).tolist() == [0, 1, 0, 0, 0, 0, 1, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,columns,k", [(65536, 8, 2), (65536, 64, 8), (4099, 5, 3), (300, 300, 7)])
def test_topk_counts_on_cuda_are_torch_topks_through_ties(dtype, rows, columns, k):
    """The balancing loss's contract on CUDA: the counts of torch.topk's own choices, ties and NaN included
    (bf16 softmax probabilities tie often)."""
    from ds_loongforge.ops.moe_dispatch import topk_counts

    gen = torch.Generator().manual_seed(rows + columns + k)
    values = _tied_rows(rows, columns, dtype, "cuda", gen)
    assert torch.equal(topk_counts(values, k, impl="cuda"), _torch_topk_counts(values, k))
    probs = torch.softmax(torch.randn(rows, columns, generator=gen).to(dtype).cuda(), dim=-1)  # bf16: ties
    weights = torch.randint(0, 2, (rows,), generator=gen).cuda()
    assert torch.equal(topk_counts(probs, k, weights, impl="cuda"), _torch_topk_counts(probs, k, weights))


@pytest.mark.parametrize("impl", IMPLS_AND_REFERENCE)
def test_topk_counts_bad_input_is_a_clear_error(impl):
    from ds_loongforge.ops.moe_dispatch import topk_counts

    device = device_of(impl)
    v = torch.randn(6, 4, device=device)
    with pytest.raises(ValueError, match=r"k = 5 must be between 1 and the number of columns \(4\)"):
        topk_counts(v, 5, impl=impl)
    with pytest.raises(ValueError, match=r"values_RE must be \[rows, columns\], got shape \(6, 4, 1\)"):
        topk_counts(v[..., None], 1, impl=impl)
    with pytest.raises(ValueError, match="weights_R has 4 entries, which must divide the 6 rows"):
        topk_counts(v, 2, torch.ones(4, dtype=torch.int64, device=device), impl=impl)
    with pytest.raises(ValueError, match="weights_R must be a 1-D int64 tensor, got torch.float32"):
        topk_counts(v, 2, torch.ones(6, device=device), impl=impl)
    if impl != "reference":
        with pytest.raises(RuntimeError, match="moe_topk_counts: values_RE must be float32, float16 or bfloat16"):
            topk_counts(v.double(), 2, impl=impl)


# expert_linear_backward: (counts, I, O); the per-expert backward GEMMs of the MoE layer
EXPERT_LINEAR_SHAPES = [
    pytest.param([0, 0, 0], 16, 8, id="no_rows"),                   # a rank nothing was routed to: dw zeros
    pytest.param([1], 1, 1, id="one_element"),
    pytest.param([5, 0, 3, 0], 24, 40, id="empty_experts"),
    pytest.param([37, 1, 90], 3, 5, id="odd_features"),             # rows of 6/10 bytes: no 16-byte alignment
    pytest.param([700, 13, 0, 291, 24], 128, 256, id="skewed"),
    pytest.param([2048], 64, 96, id="one_expert"),
    pytest.param([1500, 2500, 4096, 100], 256, 512, id="e2e_like"),  # row counts in several buckets
]


@pytest.mark.parametrize("impl", IMPLS_AND_REFERENCE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts,in_features,out_features", EXPERT_LINEAR_SHAPES)
def test_expert_linear_backward_matches_fp64(impl, dtype, counts, in_features, out_features):
    from ds_loongforge.ops.numerics import expert_linear_checks

    gen = torch.Generator(device=device_of(impl)).manual_seed(sum(counts) + in_features)
    assert_checks(expert_linear_checks(counts, in_features, out_features, dtype, device_of(impl), impl, gen))


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_linear_backward_gradients_are_grouped_mms_and_only_those_asked(impl):
    """The op's dx and dw are the gradients autograd gives the grouped GEMM it replaces (F.grouped_mm where this
    torch has it, else the per-expert product), dw in the weight's own layout; need_* False gives None."""
    from ds_loongforge.ops.moe_dispatch import expert_linear_backward

    device = device_of(impl)
    counts, I, O = [40, 0, 25, 7], 32, 48
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(sum(counts), I, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), O, I, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(sum(counts), O, device=device, dtype=dtype)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    if hasattr(torch.nn.functional, "grouped_mm"):
        y = torch.nn.functional.grouped_mm(x, w.transpose(1, 2), offs=offs)
    else:
        y = torch.cat([x[s:e] @ w[i].t() for i, (s, e) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
    want_dx, want_dw = torch.autograd.grad(y, (x, w), dy)
    dx, dw = expert_linear_backward(dy, x.detach(), w.detach(), counts, impl=impl)
    assert dw.shape == w.shape and dw.is_contiguous()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, want_dx, **tol)
    torch.testing.assert_close(dw, want_dw, **tol)
    assert torch.count_nonzero(dw[1]) == 0
    only_dw = expert_linear_backward(dy, x.detach(), w.detach(), counts, need_dx=False, impl=impl)
    only_dx = expert_linear_backward(dy, x.detach(), w.detach(), counts, need_dw=False, impl=impl)
    assert only_dw[0] is None and torch.equal(only_dw[1], dw)
    assert only_dx[1] is None and torch.equal(only_dx[0], dx)


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_linear_backward_is_bitwise_deterministic_and_row_bucket_only_picks_an_algorithm(impl):
    """Each row-count grouping gives the same bits call after call; a grouping chooses CUDA's algorithm and
    nothing else: the groupings agree within bf16's rounding on CUDA (each within the 2x rule of fp64: the GPU test
    below) and bit for bit on the CPU's ATen products."""
    from ds_loongforge.ops.moe_dispatch import expert_linear_backward

    device = device_of(impl)
    counts = [333, 0, 1024, 77]
    dy = torch.randn(sum(counts), 256, device=device).bfloat16()
    x = torch.randn(sum(counts), 128, device=device).bfloat16()
    w = torch.randn(4, 256, 128, device=device).bfloat16()
    default = expert_linear_backward(dy, x, w, counts, impl=impl)
    for row_bucket in ("blocks", "octave", 128, 64, 1, "exact"):
        first = expert_linear_backward(dy, x, w, counts, impl=impl, row_bucket=row_bucket)
        for _ in range(2):
            again = expert_linear_backward(dy, x, w, counts, impl=impl, row_bucket=row_bucket)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
        for a, b in zip(default, first):
            if device == "cpu":
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_expert_linear_backward_backends():
    from ds_loongforge.ops.moe_dispatch import expert_gemm_backend

    assert expert_gemm_backend("cpu") == "aten"
    assert expert_gemm_backend("cpu", impl="reference") is None


@pytest.mark.gpu
@pytest.mark.parametrize("row_bucket", ["blocks", "octave", 128, 64, "exact"])
def test_expert_linear_backward_cuda_runs_cublaslt_over_fresh_row_counts(row_bucket):
    """On the device: the op is built with cuBLASLt, and the algorithm cached for each row-count bucket gives the
    per-expert torch.mm results (within bf16's 2x rule) for 40 fresh skewed routings of the e2e mixtral shape's
    down projection (rows in many buckets, the bucket's upper end asked, smaller sizes run), plus unaligned rows,
    under every row-count grouping."""
    from ds_loongforge.ops.moe_dispatch import expert_gemm_backend
    from ds_loongforge.ops.numerics import expert_linear_checks, skewed_counts

    assert expert_gemm_backend("cuda") == "cublaslt"
    gen = torch.Generator().manual_seed(7)
    for draw in range(40):
        counts = skewed_counts(4096 + draw * 97, 8, gen, empty=draw % 3)
        assert_checks(expert_linear_checks(counts, 512, 256, torch.bfloat16, "cuda", "cuda", row_bucket=row_bucket))
    assert_checks(expert_linear_checks([17, 3, 1], 1000, 24, torch.bfloat16, "cuda", "cuda",  # 8-byte rows
                                       row_bucket=row_bucket))


@pytest.mark.parametrize("impl", IMPLS_AND_REFERENCE)
def test_expert_linear_backward_bad_input_is_a_clear_error(impl):
    from ds_loongforge.ops.moe_dispatch import expert_linear_backward

    device = device_of(impl)
    dy, x, w = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device), torch.randn(2, 8, 4, device=device)
    with pytest.raises(ValueError, match=r"counts must be 2 group sizes >= 0 summing to the 6 rows of x_PI, got \[3, 2\]"):
        expert_linear_backward(dy, x, w, [3, 2], impl=impl)
    with pytest.raises(ValueError, match=r"counts must be 2 group sizes .* got \[7, -1\]"):
        expert_linear_backward(dy, x, w, [7, -1], impl=impl)
    with pytest.raises(ValueError, match=r"shapes do not agree: dy_PO \(6, 8\), x_PI \(6, 4\), w_EOI \(2, 4, 8\)"):
        expert_linear_backward(dy, x, w.transpose(1, 2), [3, 3], impl=impl)
    with pytest.raises(ValueError, match="one dtype for all three, got dy_PO torch.float32, x_PI torch.float64"):
        expert_linear_backward(dy, x.double(), w, [3, 3], impl=impl)
    for bad in (0, -1, "tile", 2.5, True):
        with pytest.raises(ValueError, match=r"row_bucket must be one of \['blocks', 'exact', 'octave'\] or a "
                                             f"positive number of rows, got {re.escape(repr(bad))}"):
            expert_linear_backward(dy, x, w, [3, 3], impl=impl, row_bucket=bad)
    if impl != "reference":
        module = _BUILDERS[device]().load()
        with pytest.raises(RuntimeError, match="expert_linear_backward: the group sizes sum to 5 but x_PI has 6 rows"):
            module.expert_linear_backward(dy, x, w, [3, 2], True, True)
        with pytest.raises(RuntimeError, match="expert_linear_backward: x_PI must be float32, float16 or bfloat16"):
            module.expert_linear_backward(dy.double(), x.double(), w.double(), [3, 3], True, True)
        with pytest.raises(RuntimeError, match="expert_linear_backward: dy_PO must be contiguous"):
            module.expert_linear_backward(torch.randn(8, 6, device=device).t(), x, w, [3, 3], True, True)
        with pytest.raises(RuntimeError, match="row_bucket must be 0 .*, a positive row step, -1 .* or -2 .*, got -3"):
            module.expert_linear_backward(dy, x, w, [3, 3], True, True, -3)
