"""torch.compile of injected models: the kernels are torch.library custom ops under compile (their fake kernels give
the compiler the shapes), so a model of every family compiles into one graph as the stock model does, and the
compiled training step computes what the eager one does.

Before: every fused op's pybind call broke the graph (20 breaks in a 2-layer Llama, 30 in a Mixtral, where the
stock models have none), and so did the q/k/v fusion's version check and the routing's host-side id check."""

import copy

import pytest
import torch

from ds_loongforge.integrations import compile_mask
from ds_loongforge.integrations.inject import inject
from ds_loongforge.ops.swiglu import swiglu_dropout, swiglu_reference
from tests._dist import spawn_with_deadline
from tests.integrations.test_inject import ENABLED, FAMILIES, build, token_ids

# what runs otherwise under compile: the q/k/v fusion runs each Linear on its own (see modules/qkv.py: one GEMM's
# roundings instead of three), and on CUDA the fused RoPE leaves transformers' expression to the compiler (Liger's
# kernel rounds once where transformers' bf16 ops round each step; the first GPU run's losses differed there); so
# the eager model the compiled one is compared with bit for bit leaves both out
NO_QKV = {"loongforge": {"enabled": True, "fused_kernels": {"qkv": False, "rope": False}}}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def _models(family: str, dtype: torch.dtype, config=ENABLED, device="cpu"):
    stock = build(family)
    ids = token_ids(stock, (2, 12))
    stock = stock.to(device=device, dtype=dtype)
    model = copy.deepcopy(stock)
    inject(model, config)
    return stock, model, ids.to(device)


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _step(model, ids, compiled=None):
    model.zero_grad(set_to_none=True)
    loss = (model if compiled is None else compiled)(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _breaks(explanation) -> list[str]:
    """Each graph break's reason and where it happened (the message of a failed check)."""
    where = lambda b: (f" @ {b.user_stack[-1].filename}:{b.user_stack[-1].lineno}" if b.user_stack else "")  # noqa
    return [" | ".join(str(b.reason).splitlines()[:3]) + where(b) for b in explanation.break_reasons]


def _graph_text(explanation) -> str:
    return "\n".join(g.print_readable(print_output=False) for g in explanation.graphs)


def _sdpa_calls(model, ids, **inputs) -> list[dict]:
    """The SDPA calls of the compiled forward (dynamo's graphs; a training forward unless ``inputs`` are given):
    is_causal, whether a mask is passed, enable_gqa."""
    calls = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if "scaled_dot_product_attention" in str(node.target):
                calls.append({"is_causal": node.kwargs.get("is_causal", False),
                              "mask": node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                              is not None, "enable_gqa": node.kwargs.get("enable_gqa", False)})
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(input_ids=ids, **(inputs or {"labels": ids}))
    torch._dynamo.reset()
    return calls


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's notes on the lru_cache it traces through
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_compiles_into_one_graph_with_the_kernels_in_it(family):
    torch._dynamo.reset()
    stock, model, ids = _models(family, torch.bfloat16)
    stock_breaks = torch._dynamo.explain(lambda i: _loss(stock, i))(ids).graph_break_count
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda i: _loss(model, i))(ids)
    assert explanation.graph_break_count == stock_breaks == 0, _breaks(explanation)
    graph = _graph_text(explanation)
    expected = ["loongforge.rmsnorm_forward", "loongforge.rmsnorm_backward", "loongforge.cross_entropy_forward"]
    expected += ["loongforge.swiglu_forward", "loongforge.swiglu_backward"]
    if family in MOE_FAMILIES:
        expected += ["loongforge.moe_routing_indices", "loongforge.moe_permute_forward",
                     "loongforge.moe_permute_backward", "loongforge.moe_unpermute_forward",
                     "loongforge.moe_unpermute_backward"]
    if family in ("mixtral", "qwen3_moe", "olmoe"):  # softmax routers; qwen2_moe's takes no renormalisation kernel
        expected += ["loongforge.moe_router_topk_forward", "loongforge.moe_router_topk_backward"]
    missing = [op for op in expected if op not in graph]
    assert not missing, f"{family}: {missing} not in the compiled graph"
    # no dropout: the seed is a plain int, so the graph holds no CPU tensor that would keep inductor from CUDA graphs
    assert "swiglu_forward_drawn_seed" not in graph


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_training_step_equals_the_eager_one_bit_for_bit(family):
    """aot_eager runs the traced graph op by op: the custom ops must give the eager kernels' bits, forward and
    backward, and every parameter its gradient (bf16, where roundings show)."""
    torch._dynamo.reset()
    _, model, ids = _models(family, torch.bfloat16, NO_QKV)
    loss, grads = _step(model, ids)
    compiled_loss, compiled_grads = _step(model, ids, torch.compile(model, backend="aot_eager"))
    assert torch.equal(compiled_loss, loss)
    assert compiled_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(compiled_grads[name], grad), name


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_inductor_training_step_matches_eager(family):
    """The default backend (inductor's C++ code for the stock ops around ours), fp32, and a second sequence length
    (a recompile with dynamic shapes, through the fake kernels). An fp32 MoE layer takes its per-expert loop under
    compile (torch's grouped GEMM traces bf16 only), which breaks the graph where it reads its group sizes."""
    torch._dynamo.reset()
    _, model, ids = _models(family, torch.float32)
    compiled = torch.compile(model)
    for length in (12, 9):
        batch = ids[:, :length]
        loss, grads = _step(model, batch)
        compiled_loss, compiled_grads = _step(model, batch, compiled)
        torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-6)
        assert compiled_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_swiglu_dropout_draws_its_seed_in_the_graph():
    """p > 0 without a seed: the seed is drawn inside the graph (reading it on the host would break the graph)
    and reaches both kernels; with a seed the compiled op gives the eager op's bits."""
    torch._dynamo.reset()
    p = 0.25
    gate_up = torch.randn(64, 2 * 96, requires_grad=True)

    def f(x, seed=None):
        return swiglu_dropout(x, p=p, seed=seed)

    explanation = torch._dynamo.explain(f)(gate_up)
    assert explanation.graph_break_count == 0, _breaks(explanation)
    assert "loongforge.swiglu_forward_drawn_seed" in _graph_text(explanation)
    compiled = torch.compile(f, backend="aot_eager")
    gate, up = gate_up.detach().chunk(2, dim=-1)
    full = torch.nn.functional.silu(gate) * up / (1 - p)
    masks = []
    for _ in range(2):
        out = compiled(gate_up)
        keep = out != 0
        torch.testing.assert_close(out[keep], full[keep], rtol=1e-6, atol=1e-6)
        assert 0.15 < 1 - keep.float().mean().item() < 0.35  # 6144 draws of p = 0.25: ~0.0055 std
        gate_up.grad = None
        out.backward(torch.ones_like(out))
        # the backward regenerated the same mask: a dropped output sends no gradient to its gate or up
        dgate, dup = gate_up.grad.chunk(2, dim=-1)
        assert torch.all(dup[~keep] == 0) and torch.all(dgate[~keep] == 0)
        torch.testing.assert_close(dup[keep], (torch.nn.functional.silu(gate) / (1 - p))[keep])
        masks.append(keep)
    assert not torch.equal(masks[0], masks[1])  # a new seed each call
    seeded = torch.compile(lambda x: f(x, seed=1234), backend="aot_eager")(gate_up)
    assert torch.equal(seeded, swiglu_dropout(gate_up, p=p, seed=1234))
    reference = swiglu_reference(gate_up, p=p, seed=1234)  # the same Philox mask (values to fp32 rounding)
    assert torch.equal(seeded != 0, reference != 0)
    torch.testing.assert_close(seeded, reference)


@pytest.fixture
def refused_under_compile(monkeypatch):
    """transformers' causal-mask skip refused in every compiled graph, as transformers 5.17 refuses it (is_tracing)
    and 5.25 does on torch < 2.14 (dynamo traced torch.compiler.is_exporting() as True, pytorch#176499); eager
    unchanged. Without the process-wide patch (an earlier inject installed it) until the test injects."""
    import transformers.masking_utils as masking_utils

    compile_mask.restore()

    monkeypatch.setattr(masking_utils, "is_torchdynamo_exporting", lambda: torch.compiler.is_compiling())
    yield
    compile_mask.restore()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_attention_keeps_sdpas_causal_kernels(refused_under_compile):
    """With the skip refused, a compiled forward built the mask, repeated K/V and ran SDPA with the mask (13.2
    against 4.7 ms of attention in the e2e mixtral step on an H100, torch 2.11, transformers 5.17). The injected
    model's compiled forward runs SDPA as eager does, and the step is eager's bit for bit."""
    import transformers.masking_utils as masking_utils

    stock = build("mixtral")
    ids = token_ids(stock, (2, 12))
    stock_calls = _sdpa_calls(stock, ids)
    assert stock_calls and all(c["mask"] and not c["is_causal"] for c in stock_calls), stock_calls  # the refusal
    model = copy.deepcopy(stock)
    report = inject(model, NO_QKV)
    assert report.patched_functions.get(compile_mask.KIND) == ["masking_utils._ignore_causal_mask_sdpa"]
    assert compile_mask.patched() == ["transformers.masking_utils._ignore_causal_mask_sdpa"]
    calls = _sdpa_calls(model, ids)
    assert len(calls) == len(stock_calls)
    assert all(c["is_causal"] and not c["mask"] and c["enable_gqa"] for c in calls), calls  # 4 heads, 2 K/V heads
    loss, grads = _step(model, ids)
    compiled_loss, compiled_grads = _step(model, ids, torch.compile(model, backend="aot_eager"))
    torch._dynamo.reset()
    assert torch.equal(compiled_loss, loss)
    assert all(torch.equal(compiled_grads[name], grad) for name, grad in grads.items())
    # a padding mask (here: one padded position) still gets transformers' mask under compile
    padded = torch.ones_like(ids)
    padded[0, 0] = 0
    assert [c["mask"] for c in _sdpa_calls(model, ids, attention_mask=padded)] == [True] * len(calls)
    # eager and export still ask transformers: the function's own answers
    skip = masking_utils._ignore_causal_mask_sdpa
    assert skip(None, 12, 12, 0, 0, None) is True
    assert not skip(torch.tensor([[False] + [True] * 11]), 12, 12, 0, 0, None)  # padding: a mask
    from torch._export.utils import _compiling_state_context

    with _compiling_state_context():  # what torch.export sets while it traces
        compiled = torch.compile(lambda x: x + 1 if skip(None, 12, 12, 0, 0, None) else x, backend="eager",
                                 fullgraph=True)
        assert compiled(torch.zeros(())).item() == 0  # transformers' answer while exporting: build the mask
    torch._dynamo.reset()
    assert compile_mask.restore() == ["transformers.masking_utils._ignore_causal_mask_sdpa"]
    assert _sdpa_calls(model, ids) == stock_calls  # restored: the mask again


def test_compile_mask_patch_checks_what_it_replaces(monkeypatch):
    """A function with other parameters, or one that does not skip a plain causal mask in eager, is left alone with
    the reason."""
    import transformers.masking_utils as masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda padding_mask, q_length: True)
    assert "its parameters are ['padding_mask', 'q_length']" in compile_mask.patch()

    def never(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        return False

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", never)
    assert "does not skip a plain causal mask" in compile_mask.patch()
    assert masking_utils._ignore_causal_mask_sdpa is never


def _expert_parallel_worker(rank, world, port, out_dir):
    import warnings

    import torch.distributed as dist

    from ds_loongforge.modules.moe import ExpertMaskedMoE

    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)  # the same gate on every rank
        moe = ExpertMaskedMoE(16, 8, 8, 2, impl="cpu", ep_group=dist.group.WORLD).to(torch.bfloat16)
        x = torch.rand(10 + 7 * rank, 16, dtype=torch.bfloat16, requires_grad=True)
        params = [x] + list(moe.parameters())
        compiled = torch.compile(moe, backend="aot_eager")
        results = {}
        for name, layer in (("eager", moe), ("compiled", compiled), ("compiled again", compiled)):
            y = layer(x)
            results[name] = [y.detach()] + list(torch.autograd.grad(y.float().square().sum(), params))
        # later steps route other tokens (other split sizes, other receive-buffer states, the next call tag):
        # none of that may recompile the layer (it did at every call, until dynamo's recompile limit)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step in range(4):
                x_step = torch.randn(10 + 7 * rank, 16, dtype=torch.bfloat16, requires_grad=True)
                y = compiled(x_step)
                grads = torch.autograd.grad(y.float().square().sum(), [x_step] + list(moe.parameters()))
                y_eager = moe(x_step)
                eager_grads = torch.autograd.grad(y_eager.float().square().sum(), [x_step] + list(moe.parameters()))
                results[f"step {step}"] = (torch.equal(y, y_eager)
                                           and all(torch.equal(g, e) for g, e in zip(grads, eager_grads)))
        results["fill"] = moe.last_routing.buffer_fill
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_compiled_expert_parallel_layer_equals_eager(tmp_path):
    """ep_size 2 on two gloo ranks: the exchange runs eagerly between two graphs (its split sizes are host values),
    the compiled layer's outputs and every gradient are the eager layer's bits, and steps that route differently
    do not recompile."""
    spawn_with_deadline(_expert_parallel_worker, 2, str(tmp_path))
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("compiled", "compiled again"):
            for got, want in zip(results[name], results["eager"]):
                assert torch.equal(got, want), (rank, name)
        assert all(results[f"step {step}"] for step in range(4)), (rank, results)
        assert 0 < results["fill"] <= 1, results["fill"]  # the routing statistics still see the receive buffer


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_gpu_compiled_training_step(family):
    """On CUDA, bf16: one graph with the CUDA kernels in it, aot_eager bit for bit with eager, and inductor (Triton
    for the stock ops) within bf16 roundings of eager."""
    torch._dynamo.reset()
    _, model, ids = _models(family, torch.bfloat16, NO_QKV, device="cuda")
    explanation = torch._dynamo.explain(lambda i: _loss(model, i))(ids)
    assert explanation.graph_break_count == 0, _breaks(explanation)
    assert "loongforge.rmsnorm_forward" in _graph_text(explanation)
    # SDPA's causal kernels, no mask, K/V not repeated (on torch < 2.14 through compile_mask's patch)
    calls = _sdpa_calls(model, ids)
    assert calls and all(c["is_causal"] and not c["mask"] for c in calls), calls
    loss, grads = _step(model, ids)
    torch._dynamo.reset()
    compiled_loss, compiled_grads = _step(model, ids, torch.compile(model, backend="aot_eager"))
    assert torch.equal(compiled_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(compiled_grads[name], grad), name
    torch._dynamo.reset()
    inductor_loss, inductor_grads = _step(model, ids, torch.compile(model))
    torch.testing.assert_close(inductor_loss, loss, rtol=2e-2, atol=0)
    for name, grad in grads.items():
        scale = grad.float().abs().max().item() or 1.0
        assert (inductor_grads[name].float() - grad.float()).abs().max().item() <= 0.05 * scale, name
