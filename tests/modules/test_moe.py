"""ExpertMaskedMoE (single process) against transformers' MixtralSparseMoeBlock loaded with the same
weights: outputs and every gradient; dropless routing; zero (not None) gradients for idle experts;
sampled routing; auxiliary losses; bad configurations."""

import math

import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from ds_loongforge.modules.moe import ExpertMaskedMoE
from ds_loongforge.ops.numerics import relative_l2_error
from tests._params import IMPLS, draw_without_router_near_tie

SHAPES = [
    pytest.param(16, 32, 4, 2, id="E4k2"),
    pytest.param(32, 16, 8, 2, id="E8k2"),        # Mixtral routing
    pytest.param(16, 8, 16, 4, id="E16k4"),       # fine-grained: most experts get few tokens
    pytest.param(24, 12, 6, 1, id="E6k1_odd"),    # I*2*4 B not a multiple of 16: per-expert loop path
]


def _pair(hidden, inter, experts, k, dtype, device):
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                        num_experts_per_tok=k, router_jitter_noise=0.0)
    hf = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 1.0 / math.sqrt(p.shape[-1]))
    hf = hf.to(device, dtype)
    ours = ExpertMaskedMoE(hidden, inter, experts, k, impl=device, device=device, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


# Router near-ties (tests/_params.MIN_ROUTER_GAP): with logits of std ~1 the gap's density at 0 is 1.3 (E4k2), 2.3
# (E8k2), 4.8 (E16k4) per token, so over 111 tokens a changed expert came in 7e-6 to 2e-5 of the runs per shape,
# 4.5e-5 per CI run over the four, before inputs were redrawn (0.5% of the draws at E16k4).
def _randn_without_router_near_tie(shape, gate_weight, k, **kwargs):
    """torch.randn(shape) whose rows' router logits have no top-k gap below MIN_ROUTER_GAP."""
    return draw_without_router_near_tie(
        lambda: torch.randn(shape, **kwargs),
        lambda x: [x.reshape(-1, shape[-1]).double().cpu() @ gate_weight.detach().double().cpu().t()], k)


def _run(module, x, dy):
    x = x.detach().requires_grad_()
    y = module(x)
    names = sorted(n for n, _ in module.named_parameters())
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(y, [x] + [params[n] for n in names], dy.to(y.dtype))
    return [y.detach()] + list(grads), ["y", "dx"] + names


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hidden,inter,experts,k", SHAPES)
def test_matches_mixtral_block_fp32(impl, hidden, inter, experts, k):
    hf, ours = _pair(hidden, inter, experts, k, torch.float32, impl)
    assert set(ours.state_dict()) == set(hf.state_dict())
    x = _randn_without_router_near_tie((3, 37, hidden), hf.gate.weight, k, device=impl)  # see MIN_ROUTER_GAP
    dy = torch.randn_like(x)
    got, names = _run(ours, x, dy)
    want, _ = _run(hf, x, dy)
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hidden,inter,experts,k", SHAPES[:3])
def test_bf16_within_twice_pytorch_error(impl, hidden, inter, experts, k):
    hf, ours = _pair(hidden, inter, experts, k, torch.bfloat16, impl)
    hf64, _ = _pair(hidden, inter, experts, k, torch.float64, "cpu")
    hf64.load_state_dict({n: t.double().cpu() for n, t in hf.state_dict().items()})
    # the 2x rule needs both precisions to route alike: redraw until bf16 rounding of the router logits
    # flips no top-k choice (a near-tie is rare, so a few draws suffice), ours included: an exact tie of bf16
    # logits goes to the lowest expert in our fused top-k, and to either in torch.topk
    for _ in range(50):
        x = torch.randn(2, 29, hidden, device=impl, dtype=torch.bfloat16)
        ids64 = torch.topk(x.double().cpu().view(-1, hidden) @ hf64.gate.weight.t(), k).indices.sort(-1).values
        ids16 = torch.topk((x.view(-1, hidden) @ hf.gate.weight.t()).float(), k).indices.cpu().sort(-1).values
        with torch.no_grad():
            ids_ours = ours.gate(x.view(-1, hidden))[3].cpu().sort(-1).values
        if torch.equal(ids64, ids16) and torch.equal(ids64, ids_ours):
            break
    else:
        raise AssertionError("50 draws all had a top-k near-tie; the router weights are degenerate")
    dy = torch.randn_like(x)
    got, names = _run(ours, x, dy)
    ref, _ = _run(hf64, x.double().cpu(), dy.double().cpu())
    eager, _ = _run(hf, x, dy)
    # relative L2 error: the layer's errors are dominated by roundings both sides share (router logits,
    # GEMM outputs), so the single worst element is chance; the norm of the error is not
    for name, a, r, e in zip(names, got, ref, eager):
        ours_err, torch_err = relative_l2_error(a.cpu(), r), relative_l2_error(e.cpu(), r)
        assert ours_err <= 2 * torch_err, f"{name}: {ours_err:.3e} > 2 x {torch_err:.3e}"


@pytest.mark.parametrize("impl", IMPLS)
def test_idle_experts_get_zero_gradients_not_none(impl):
    # bf16 on CUDA: torch's grouped GEMM path, whose weight gradient must write zeros for empty groups
    dtype = torch.bfloat16 if impl == "cuda" else torch.float32
    moe = ExpertMaskedMoE(16, 16, 6, 2, impl=impl, device=impl, dtype=dtype)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, :] = 5.0   # with x > 0 every token picks experts 0 and 1 (1 by index tie order)
        moe.gate.weight[1, :] = 4.0
    x = torch.rand(10, 16, device=impl, dtype=dtype) + 0.1
    moe(x).sum().backward()
    counts = moe.last_routing.tokens_per_expert_E
    assert counts.tolist() == [10, 10, 0, 0, 0, 0]
    for p in (moe.experts.gate_up_proj, moe.experts.down_proj):
        assert p.grad is not None
        assert torch.count_nonzero(p.grad[2:]) == 0
        assert torch.count_nonzero(p.grad[:2]) > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_residual_is_added_in_the_combine(impl):
    """forward(x, residual=r) == forward(x) + r (fp32 here: the sum's one rounding is within an ulp), r's gradient
    is the output's, and every other gradient is unchanged."""
    moe = ExpertMaskedMoE(16, 24, 6, 2, impl=impl, device=impl)
    x = torch.randn(2, 9, 16, device=impl, requires_grad=True)
    r = torch.randn(2, 9, 16, device=impl, requires_grad=True)
    dy = torch.randn(2, 9, 16, device=impl)
    fused = moe(x, residual=r)
    grads = torch.autograd.grad(fused, (x, r, *moe.parameters()), dy)
    plain = moe(x)
    torch.testing.assert_close(fused, plain + r, rtol=1e-6, atol=1e-6)
    assert torch.equal(grads[1], dy)
    for ours, ref in zip((grads[0], *grads[2:]), torch.autograd.grad(plain, (x, *moe.parameters()), dy)):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"residual \(2, 8, 16\) torch.float32 must have the input's shape"):
        moe(x, residual=r[:, :8])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_stock_rounding_is_the_family_experts_bitwise_cpu(family):
    """rounding="stock" on the CPU in bf16: given the same routing, the block's output, and its output plus a decoder
    layer's residual, are the bits of transformers' experts (Mixtral's fp32 routing weights; Qwen3-MoE's cast to
    bf16, which weights_in_input_dtype reproduces); "once" differs. The routing is our router's for both: its fp32
    softmax (std::exp) can differ from torch's (a vectorised exp) by an ulp, which moves a rare output by a unit.
    transformers' default experts ("grouped_mm", as from_pretrained and from_config choose them; a bare block's
    config has none): its "eager" loop rounds each fp32-weighted product to bf16 first."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    hidden, inter, experts, k = 64, 48, 8, 2
    if family == "mixtral":
        hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                                 num_experts_per_tok=k, router_jitter_noise=0.0,
                                                 experts_implementation="grouped_mm"))
    else:
        hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                                                   num_experts=experts, num_experts_per_tok=k, norm_topk_prob=True,
                                                   experts_implementation="grouped_mm"))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 1.0 / math.sqrt(p.shape[-1]))
    hf = hf.bfloat16()
    x = torch.randn(2, 33, hidden, dtype=torch.bfloat16)
    r = 4.0 * torch.randn_like(x)
    with torch.no_grad():
        for rounding in ("stock", "once"):
            ours = ExpertMaskedMoE(hidden, inter, experts, k, impl="cpu", dtype=torch.bfloat16, rounding=rounding,
                                   weights_in_input_dtype=family == "qwen3_moe")
            ours.load_state_dict(hf.state_dict())
            _, _, weights_TK, ids_TK = ours.gate(x.view(-1, hidden))
            if family == "qwen3_moe":
                weights_TK = weights_TK.to(x.dtype)  # as Qwen3MoeTopKRouter returns them
            want = hf.experts(x.view(-1, hidden), ids_TK, weights_TK).view_as(x)
            same = torch.equal(ours(x), want) and torch.equal(ours(x, residual=r), r + want)
            assert same == (rounding == "stock"), rounding


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_compute_loop_equals_grouped_mm(impl):
    moe = ExpertMaskedMoE(16, 32, 8, 2, impl=impl, device=impl)
    with torch.no_grad():
        moe.gate.weight[5:] = -10.0  # experts 5..7 idle
    x, dy = torch.randn(41, 16, device=impl), torch.randn(41, 16, device=impl)
    results = {}
    for mode in ("grouped_mm", "loop"):
        if mode == "grouped_mm" and impl == "cuda":
            continue  # torch's CUDA grouped GEMM is bf16-only; compared on the CPU
        moe.expert_compute = mode
        results[mode] = _run(moe, x, dy)[0]
    if len(results) == 2:
        for a, b in zip(results["grouped_mm"], results["loop"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    moe.expert_compute = "loop"
    empty = _run(moe, x[:0], dy[:0])[0]   # no tokens at all: zero (not None) expert gradients
    assert empty[0].shape == (0, 16) and all(g is not None and not g.any() for g in empty[1:])


@pytest.mark.parametrize("impl", IMPLS)
def test_per_expert_backward_equals_the_grouped_gemms(impl, monkeypatch):
    """Where experts are few and large the layer's expert backward is expert_linear_backward on host group sizes
    (copied behind the routing): every gradient equals the grouped GEMMs' (expert_compute="grouped_mm"), idle
    experts get zeros, and the per-expert op ran for both GEMMs of the layer."""
    import ds_loongforge.modules.moe as moe_module

    dtype = torch.bfloat16 if impl == "cuda" else torch.float32  # torch's CUDA grouped GEMM is bf16-only
    moe = ExpertMaskedMoE(32, 48, 8, 2, impl=impl, device=impl, dtype=dtype)
    with torch.no_grad():
        moe.gate.weight[6:] = -10.0  # experts 6, 7 idle: x > 0 gives them logits below -3
    x = torch.rand(300, 32, device=impl, dtype=dtype) + 0.1
    dy = torch.randn(300, 32, device=impl, dtype=dtype)
    calls = []
    real = moe_module.expert_linear_backward
    monkeypatch.setattr(moe_module, "expert_linear_backward", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    assert not moe_module.per_expert_backward_pays(x.repeat(2, 1), moe.experts.gate_up_proj, impl)  # 600 < 8 x 1024
    monkeypatch.setattr(moe_module, "PER_EXPERT_BACKWARD_MIN_ROWS_PER_EXPERT", 1)
    per_expert, names = _run(moe, x, dy)
    assert len(calls) == 2 and calls[0] == calls[1] == moe.last_routing.tokens_per_expert_E.tolist()
    assert calls[0][6:] == [0, 0]
    moe.expert_compute = "grouped_mm"
    grouped, _ = _run(moe, x, dy)
    assert len(calls) == 2, "grouped_mm keeps torch's own backward"
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for name, a, b in zip(names, per_expert, grouped):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")
    for name, g in zip(names, per_expert):
        if name.startswith("experts."):
            assert torch.count_nonzero(g[6:]) == 0 and torch.count_nonzero(g[:6]) > 0, name
            # in the weight's layout: a transposed gradient cost the parameter a strided copy (08b2d14, +11 ms)
            assert g.is_contiguous(), name
    monkeypatch.setattr(moe_module, "PER_EXPERT_BACKWARD_MAX_EXPERTS", 4)
    assert not moe_module.per_expert_backward_pays(x, moe.experts.gate_up_proj, impl)  # 8 experts > 4


def test_host_counts_are_the_counts_at_the_copy():
    from ds_loongforge.modules.moe import HostCounts

    counts = torch.tensor([3, 0, 5])
    host = HostCounts(counts)
    counts.add_(1)  # later writes to the routing's tensor do not reach the copy
    assert host.get() == [3, 0, 5]


def test_routing_stats_dropless():
    moe = ExpertMaskedMoE(16, 16, 8, 2, impl="cpu")
    moe(torch.randn(4, 25, 16))
    s = moe.last_routing.summary()
    assert s["tokens_dropped"] == 0
    assert int(moe.last_routing.tokens_per_expert_E.sum()) == 100 * 2
    assert s["pair_sparsity"] == pytest.approx(1 - 2 / 8)
    assert 1 <= s["experts_used"] <= 8 and s["max_load"] >= s["mean_load"] == pytest.approx(25.0)
    assert s["buffer_fill"] is None   # single process: no receive buffer


def test_routing_health_warns_where_the_masked_path_does_not_pay_off(caplog):
    from ds_loongforge.modules.moe import routing_health

    assert routing_health(64, 8) == [] and routing_health(8, 2) == []
    assert [m.split(" ")[0] for m in routing_health(4, 2)] == ["pair", "4"]   # sparsity 0.5, 4 experts
    assert len(routing_health(16, 8)) == 1                                     # sparsity 0.5 only
    with caplog.at_level("WARNING", logger="ds_loongforge"):
        ExpertMaskedMoE(8, 8, 6, 3)
        ExpertMaskedMoE(8, 8, 6, 3)   # the same shape warns once
    warned = [r.getMessage() for r in caplog.records if "E=6, k=3" in r.getMessage()]
    assert len(warned) == 2 and "sparsity 1 - k/E = 0.50" in warned[0] and "6 experts" in warned[1]


def test_sampled_router_frequencies_follow_softmax_and_eval_is_topk():
    moe = ExpertMaskedMoE(8, 16, 4, 1, router_mode="sampled", impl="cpu")
    x = torch.randn(1, 8).expand(20000, 8).contiguous()
    probs = torch.softmax(moe.gate.weight.detach() @ x[0], -1)
    moe.train()
    moe(x)
    freq = moe.last_routing.tokens_per_expert_E.double() / 20000
    sigma = torch.sqrt(probs.double() * (1 - probs.double()) / 20000)
    assert torch.all((freq - probs.double()).abs() < 6 * sigma + 1e-9), (freq, probs)
    moe.eval()
    moe(x)
    assert moe.last_routing.tokens_per_expert_E.tolist().count(20000) == 1   # top-1, deterministic


def test_sampled_router_draws_k_distinct_experts():
    moe = ExpertMaskedMoE(8, 16, 6, 3, router_mode="sampled", impl="cpu").train()
    _, _, _, ids = moe.gate(torch.randn(500, 8))
    assert torch.all(ids.sort(-1).values[:, 1:] != ids.sort(-1).values[:, :-1])


def test_aux_losses_match_their_formulas():
    moe = ExpertMaskedMoE(16, 16, 4, 2, aux_loss_coef=0.01, z_loss_coef=0.001, impl="cpu").train()
    # the expected counts take torch.topk of torch's softmax: inputs without a top-2 near-tie (MIN_ROUTER_GAP; a flip
    # moves the loss by ~1e-5, far past its tolerance, in ~6e-6 of the runs at 50 tokens of logits of std 0.58)
    x = _randn_without_router_near_tie((50, 16), moe.gate.weight, 2)
    moe(x)
    logits = x @ moe.gate.weight.t()
    probs = torch.softmax(logits, -1)
    ids = torch.topk(probs, 2).indices
    frac = torch.bincount(ids.reshape(-1), minlength=4).float() / 100
    expected = 0.01 * 4 * (frac * probs.mean(0)).sum() + 0.001 * torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(moe.aux_loss, expected, rtol=1e-5, atol=1e-7)
    (moe.aux_loss).backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    only_z = ExpertMaskedMoE(16, 16, 4, 2, z_loss_coef=0.001, impl="cpu").train()
    only_z.gate.weight.data.copy_(moe.gate.weight)
    only_z(x)
    torch.testing.assert_close(only_z.aux_loss, 0.001 * torch.logsumexp(logits, -1).pow(2).mean(), rtol=1e-5,
                               atol=1e-7)
    # both coefficients 0 (an injected model's default: the family's loss is the objective): no term at all
    none = ExpertMaskedMoE(16, 16, 4, 2, impl="cpu").train()
    none(x)
    assert none.aux_loss is None


def test_a_layer_with_an_aux_loss_copies_and_pickles_after_a_training_forward():
    """After a training forward ``aux_loss`` belongs to that forward's graph, which ``copy.deepcopy`` refuses: an
    injected model could not be copied after a step (stock's can). The copy and a pickled one get the value,
    detached; the layer keeps its graph's tensor, whose backward still reaches the router."""
    import copy
    import io

    moe = ExpertMaskedMoE(16, 16, 4, 2, aux_loss_coef=0.01, z_loss_coef=0.001, impl="cpu").train()
    x = torch.randn(20, 16)
    y = moe(x)
    twin = copy.deepcopy(moe)
    buffer = io.BytesIO()
    torch.save(moe, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (twin, loaded):
        assert other.aux_loss.grad_fn is None and torch.equal(other.aux_loss, moe.aux_loss.detach())
        assert torch.equal(other(x), y.detach())  # the copies compute what the layer does
    assert moe.aux_loss is not None and moe.aux_loss.grad_fn is not None
    moe.aux_loss.backward()
    assert moe.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"num_experts": 4, "top_k": 5}, r"top_k must be in \[1, num_experts=4\], got 5"),
    ({"num_experts": 4, "top_k": 0}, r"top_k must be in \[1, num_experts=4\], got 0"),
    ({"num_experts": 0, "top_k": 1}, "num_experts must be >= 1, got 0"),
    ({"num_experts": 4, "top_k": 2, "router_mode": "random"}, "router mode 'random' is not one of"),
    ({"num_experts": 4, "top_k": 2, "aux_loss_coef": -1.0}, "must be >= 0"),
    ({"num_experts": 4, "top_k": 2, "dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"num_experts": 4, "top_k": 2, "overlap_chunks": 0}, "overlap_chunks must be >= 1, got 0"),
    ({"num_experts": 4, "top_k": 2, "expert_compute": "triton"}, "expert_compute must be one of"),
])
def test_bad_configs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertMaskedMoE(8, 8, **kwargs)


def test_expert_gemm_rows_env_picks_the_grouping_and_rejects_bad_values(monkeypatch):
    from ds_loongforge.modules.moe import expert_gemm_row_bucket

    monkeypatch.delenv("LOONGFORGE_EXPERT_GEMM_ROWS", raising=False)
    assert expert_gemm_row_bucket() == "blocks"
    for value, want in (("octave", "octave"), ("exact", "exact"), ("64", 64)):
        monkeypatch.setenv("LOONGFORGE_EXPERT_GEMM_ROWS", value)
        assert expert_gemm_row_bucket() == want
    for bad in ("tile", "0", "-8", ""):
        monkeypatch.setenv("LOONGFORGE_EXPERT_GEMM_ROWS", bad)
        with pytest.raises(ValueError, match=f"LOONGFORGE_EXPERT_GEMM_ROWS must be one of .* got {bad!r}"):
            expert_gemm_row_bucket()


@pytest.mark.parametrize("impl", IMPLS)
def test_an_empty_batch_backs_up_through_sum(impl):
    """T = 0 (a micro-batch or a rank without tokens) and loss = y.sum(): autograd hands the backward an expanded
    [0, H] gradient (strides 0), which .contiguous() leaves as it is; the kernels took it for a strided row."""
    device = "cuda" if impl == "cuda" else "cpu"
    dtype = torch.bfloat16 if impl == "cuda" else torch.float32
    moe = ExpertMaskedMoE(16, 8, 4, 2, impl=impl).to(device, dtype)
    x = torch.zeros(0, 16, device=device, dtype=dtype, requires_grad=True)
    moe(x).sum().backward()
    assert x.grad.shape == (0, 16)
    assert all(p.grad is not None and not p.grad.any() for p in moe.parameters())


@pytest.mark.parametrize("impl", IMPLS)
def test_double_backward_through_the_kernels_is_an_error_and_the_reference_gives_it(impl):
    """create_graph=True (a gradient penalty) through the compiled kernels' backward would silently lose the
    MoE's terms of the second derivative: a clear error instead. The reference path is twice differentiable."""
    device = "cuda" if impl == "cuda" else "cpu"
    torch.manual_seed(1)
    moe = ExpertMaskedMoE(8, 6, 3, 2, impl=impl).to(device)
    x = torch.randn(5, 8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward .*impl='reference'"):
        gx, = torch.autograd.grad(moe(x).sum(), x, create_graph=True)
    reference = ExpertMaskedMoE(8, 6, 3, 2, impl="reference").to(device)
    reference.load_state_dict(moe.state_dict())
    gx, = torch.autograd.grad(reference(x).sum(), x, create_graph=True)
    gx.pow(2).sum().backward()
    grad = reference.experts.gate_up_proj.grad
    assert grad is not None and grad.abs().sum() > 0
    gx, = torch.autograd.grad(moe(x).sum(), x)  # without create_graph: the kernels
    assert torch.isfinite(gx).all()


def test_fp64_takes_the_per_expert_loop_not_grouped_mm():
    """torch's grouped GEMM takes fp32, bf16 and fp16: fp64 layers with 16-byte rows ran into its dtype error."""
    torch.manual_seed(0)
    moe = ExpertMaskedMoE(8, 4, 4, 2).double()  # impl "auto": fp64 runs the reference ops
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    y = moe(x)
    y.sum().backward()
    assert y.dtype == torch.float64 and x.grad.dtype == torch.float64
    with pytest.raises(ValueError, match="expert_compute='grouped_mm' is not supported for torch.float64"):
        ExpertMaskedMoE(8, 4, 4, 2, expert_compute="grouped_mm").double()(x)


@pytest.mark.parametrize("hidden, compute", [(16, "auto"), (6, "auto"), (16, "loop")])
def test_autocast_gives_the_inputs_dtype_on_every_expert_path(hidden, compute):
    """Under torch.autocast the per-expert loop's matmuls come out in bf16 while grouped_mm (not on autocast's
    lists) keeps fp32: the layer returns the input's dtype either way, as the family's block does, and a residual
    in that dtype joins the combine (it was refused as bf16 + fp32)."""
    torch.manual_seed(0)
    moe = ExpertMaskedMoE(hidden, 8, 4, 2, impl="cpu", expert_compute=compute)
    x, residual = torch.randn(10, hidden), torch.randn(10, hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
        y_res = moe(x, residual=residual)
    assert y.dtype == y_res.dtype == torch.float32
    torch.testing.assert_close(y_res, y + residual, rtol=1e-6, atol=1e-6)
