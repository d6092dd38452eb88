"""The grouped GEMM (ops.grouped_gemm): the output and both gradients against fp64 on edge group sizes (empty
groups, one group holding every row, rows not a multiple of any tile), every tile configuration, within 2x of
torch's own bf16 error; the configuration choice; where the kernel is not used; and input errors.

Legend: P rows, E groups, I in features, O out features."""

import os

import pytest
import torch
import torch.nn.functional as F

from ds_loongforge.ops.grouped_gemm import (CONFIG_TILES, choose_config, grouped_linear, grouped_linear_kernel,
                                            grouped_linear_reference)
from ds_loongforge.ops.numerics import max_error, tolerance

GROUPS = [  # rows per group
    pytest.param([5, 0, 130, 1], id="empty_group"),              # an expert with no tokens: zero weight gradient
    pytest.param([0, 0, 300, 0], id="one_group_holds_all"),      # every row on one expert
    pytest.param([129, 255, 257, 2], id="ragged"),               # no size a multiple of a tile
    pytest.param([2048 + d for d in (-31, 17, 40, -26)], id="e2e_like"),  # the e2e mixtral per-expert rows
    pytest.param([3] * 64, id="e64_small"),                      # 64 experts, 3 rows each
    pytest.param([0, 0], id="no_rows"),                          # a rank that received nothing
]
FEATURES = [pytest.param(256, 512, id="i256_o512"), pytest.param(2048, 136, id="i2048_o136")]


def _operands(sizes, in_features, out_features, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = sum(sizes)
    x = torch.randn(rows, in_features, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(len(sizes), out_features, in_features, generator=g) / in_features ** 0.5).to(device, dtype)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    return x, w, offs


def test_reference_is_one_gemm_per_group():
    x, w, offs = _operands([3, 0, 5], 8, 16, "cpu", torch.float64)
    y = grouped_linear_reference(x, w, offs)
    assert torch.equal(y[:3], x[:3] @ w[0].t()) and torch.equal(y[3:], x[3:] @ w[2].t())


@pytest.mark.parametrize("rows,groups,n,wgrad", [(16384, 8, 2048, False), (16384, 8, 8192, False),
                                                 (4096, 8, 2048, True), (65536, 64, 1024, False)])
def test_choose_config_picks_a_valid_configuration(rows, groups, n, wgrad):
    config = choose_config(rows, groups, n, wgrad, 132)
    assert 0 <= config < len(CONFIG_TILES)


def test_kernel_is_not_used_off_hopper_bf16_or_when_torch_is_asked_for(monkeypatch):
    x, w, _ = _operands([2, 2], 8, 8, "cpu")
    assert grouped_linear_kernel(x, w) is None                      # CPU tensors
    assert grouped_linear_kernel(x.float(), w.float()) is None      # fp32
    with pytest.raises(ValueError, match="impl='cuda' needs bf16 CUDA tensors"):
        grouped_linear_kernel(x, w, "cuda")
    monkeypatch.setenv("LOONGFORGE_GROUPED_GEMM", "torch")
    assert grouped_linear_kernel(x, w, "cuda") is None


def test_pinned_configurations_must_be_three(monkeypatch):
    from ds_loongforge.ops import grouped_gemm

    monkeypatch.setenv("LOONGFORGE_GROUPED_GEMM_CONFIGS", "0,1")
    with pytest.raises(ValueError, match="give three configurations"):
        grouped_gemm._pinned(0)
    monkeypatch.setenv("LOONGFORGE_GROUPED_GEMM_CONFIGS", "2,1,0")
    assert [grouped_gemm._pinned(s) for s in range(3)] == [2, 1, 0]


def _torch_grouped(x, w, offs):
    return F.grouped_mm(x, w.transpose(1, 2), offs=offs)


def _grads(fn, x, w, offs, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w, offs)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, 0, 1, 2])
@pytest.mark.parametrize("in_features,out_features", FEATURES)
@pytest.mark.parametrize("sizes", GROUPS)
def test_output_and_gradients_match_fp64_within_2x_torch(sizes, in_features, out_features, config, monkeypatch):
    if config is not None:
        monkeypatch.setenv("LOONGFORGE_GROUPED_GEMM_CONFIGS", f"{config},{config},{config}")
    x, w, offs = _operands(sizes, in_features, out_features, "cuda", seed=len(sizes) + in_features)
    dy = torch.randn(x.shape[0], out_features, device="cuda", dtype=torch.bfloat16)
    ref = _grads(grouped_linear_reference, x.double(), w.double(), offs, dy.double())
    ours = _grads(grouped_linear, x, w, offs, dy)
    if x.shape[0]:
        theirs = _grads(_torch_grouped, x, w, offs, dy)
    for name, got, want, i in zip(("y", "dx", "dw"), ours, ref, range(3)):
        assert got.shape == want.shape and got.dtype == torch.bfloat16, name
        if not x.shape[0]:
            assert not got.abs().any(), name  # no rows: an all-zero weight gradient, an empty y and dx
            continue
        torch_error = max_error(theirs[i], want)
        err = max_error(got, want)
        assert err <= tolerance(torch_error, want, torch.bfloat16), (name, err, torch_error)
    empty = [e for e, n in enumerate(sizes) if n == 0]
    if empty:
        assert not ours[2][empty].abs().any()  # an expert with no rows: zeros, not garbage, not None


@pytest.mark.gpu
def test_the_moe_layer_on_the_kernel_equals_the_layer_on_torch_grouped_mm(monkeypatch):
    from ds_loongforge.modules.moe import ExpertMaskedMoE

    torch.manual_seed(0)
    layer = ExpertMaskedMoE(256, 512, 8, 2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)

    def run():
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        out = layer(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        return [out.detach(), xi.grad] + [p.grad for p in layer.parameters()]

    ours = run()
    monkeypatch.setenv("LOONGFORGE_GROUPED_GEMM", "torch")
    theirs = run()
    for a, b in zip(ours, theirs):
        scale = float(b.float().abs().max()) or 1.0
        # two bf16 GEMM implementations: a few bf16 ulps apart, never more
        assert max_error(a, b) <= 4 * torch.finfo(torch.bfloat16).eps * scale


@pytest.mark.gpu
def test_bad_inputs_name_the_value_and_the_fix():
    x, w, offs = _operands([4, 4], 64, 64, "cuda")
    kernel = grouped_linear_kernel(x, w, "cuda")
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        kernel.rows(x.float(), w, offs, True, 0)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        kernel.rows(x.t().contiguous().t(), w, offs, True, 0)
    with pytest.raises(RuntimeError, match="one end per group"):
        kernel.rows(x, w, offs[:1], True, 0)
    with pytest.raises(RuntimeError, match="int32"):
        kernel.rows(x, w, offs.long(), True, 0)
    with pytest.raises(RuntimeError, match="config must be 0..2"):
        kernel.rows(x, w, offs, True, 3)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        x2, w2, _ = _operands([4, 4], 12, 64, "cuda")
        kernel.rows(x2, w2, offs, True, 0)
    with pytest.raises(ValueError, match="offs_E must be int32"):
        grouped_linear(x, w, offs.long(), kernel)
    assert os.environ.get("LOONGFORGE_GROUPED_GEMM") is None
