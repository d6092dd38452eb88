"""Fused RMSNorm: output and every gradient against fp64, over shapes that hit each kernel path.

Tolerance: at most 2x the error of PyTorch's own computation in the same dtype (HF LlamaRMSNorm in
eager), floored at the dtype's rounding level (ds_loongforge.ops.numerics.tolerance).
"""

import pytest
import torch

from ds_loongforge.ops import fused_rmsnorm, rmsnorm_reference
from ds_loongforge.ops.numerics import rmsnorm_checks
from tests._params import DTYPES, IMPLS, assert_checks

SHAPES = [
    pytest.param(1, 4096, id="1row"),               # a single row: one block, no grid-stride loop
    pytest.param(37, 1, id="hidden1"),              # hidden of one element
    pytest.param(129, 8, id="hidden8"),             # one 16-byte vector per row: many rows per block (bf16)
    pytest.param(513, 64, id="hidden64"),           # sub-warp rows (8 threads per row in bf16)
    pytest.param(300, 2880, id="hidden2880"),       # gpt-oss size: 192 threads/row, 12 idle in the last warp
    pytest.param(257, 4096, id="hidden4096"),       # Llama/Mixtral size
    pytest.param(64, 5120, id="hidden5120"),
    pytest.param(33, 7168, id="hidden7168"),        # DeepSeek-V3 size
    pytest.param(17, 16384, id="hidden16384"),      # largest register-cached row in bf16
    pytest.param(9, 4097, id="odd4097"),            # odd hidden: scalar streaming path
    pytest.param(5, 40960, id="huge40960"),         # beyond the register path: vector streaming path
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rounding", ["stock", "once"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_rmsnorm_matches_fp64(impl, dtype, rows, hidden, rounding):
    assert_checks(rmsnorm_checks(rows, hidden, dtype, impl, impl, rounding=rounding))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rounding", ["stock", "once"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(3, 64), (200, 2880), (65, 4096), (4, 4097), (3, 40960)])
def test_rmsnorm_fused_residual_matches_fp64(impl, dtype, rows, hidden, rounding):
    assert_checks(rmsnorm_checks(rows, hidden, dtype, impl, impl, residual=True, rounding=rounding))


def _rmsnorm_and_grads(fn, x, w, dy):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xs, ws)
    return (y.detach(), *torch.autograd.grad(y, (xs, ws), dy))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
@pytest.mark.parametrize("hidden", [4096, 4097])  # the register path and the streaming (scalar) path
def test_rmsnorm_stock_rounding_is_transformers(impl, dtype, weight_dtype, hidden):
    """rounding="stock" (the default) computes transformers' eager RMSNorm, ``weight * (x * rstd).to(dtype)``,
    and its autograd's roundings: y and dx equal the eager expression's bits except where an fp32 sum taken in
    another order moves a value across a rounding boundary (on the CPU: 1e-5 of y, 1e-4 of dx, 5e-4 of a 16-bit
    dw's elements, all within a few units of the dtype), where "once" differs in a quarter to half of them."""
    from ds_loongforge.ops.numerics import hf_rmsnorm_eager

    weight_dtype = dtype if weight_dtype == "same" else weight_dtype
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(257, hidden, generator=gen).to(dtype).to(impl)
    w = (1.0 + 0.5 * torch.randn(hidden, generator=gen)).to(weight_dtype).to(impl)
    dy = torch.randn(257, hidden, generator=gen).to(dtype).to(impl)
    # with an fp32 weight transformers returns fp32; the op returns x's dtype, i.e. that value rounded once more
    eager = _rmsnorm_and_grads(lambda a, b: hf_rmsnorm_eager(a, b, 1e-6).to(dtype), x, w, dy)
    stock = _rmsnorm_and_grads(lambda a, b: fused_rmsnorm(a, b, 1e-6, impl=impl), x, w, dy)
    once = _rmsnorm_and_grads(lambda a, b: fused_rmsnorm(a, b, 1e-6, impl=impl, rounding="once"), x, w, dy)

    def differing(a, b):
        return float((a != b).float().mean())

    for name, ours, theirs, other in zip(("y", "dx"), stock, eager, once):
        assert differing(ours, theirs) <= 1e-3, (name, differing(ours, theirs))
        assert differing(other, theirs) >= 0.1, (name, differing(other, theirs))  # the comparison can fail
        torch.testing.assert_close(ours, theirs, rtol=2 * torch.finfo(dtype).eps, atol=1e-2)
    if weight_dtype == dtype:  # an fp32 dw is a differently ordered fp32 sum either way
        assert differing(stock[2], eager[2]) <= 1e-2, differing(stock[2], eager[2])
        assert differing(once[2], eager[2]) >= 0.1, differing(once[2], eager[2])


def test_rmsnorm_rounding_is_checked():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"rounding='fp32' is not one of \('stock', 'once'\)"):
        fused_rmsnorm(x, w, rounding="fp32")
    with pytest.raises(ValueError, match="rounding='Stock'"):
        rmsnorm_reference(x, w, rounding="Stock")


@pytest.mark.parametrize("impl", IMPLS)
def test_rmsnorm_fp32_roundings_agree(impl):
    """fp32 activations have nothing to round: both roundings give the same bits."""
    x = torch.randn(33, 4096, device=impl, requires_grad=True)
    w = torch.randn(4096, device=impl, requires_grad=True)
    dy = torch.randn_like(x)
    a = _rmsnorm_and_grads(lambda p, q: fused_rmsnorm(p, q, impl=impl), x.detach(), w.detach(), dy)
    b = _rmsnorm_and_grads(lambda p, q: fused_rmsnorm(p, q, impl=impl, rounding="once"), x.detach(), w.detach(), dy)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(3, 64), (200, 2880), (65, 4096), (4, 4097), (3, 40960)])
def test_rmsnorm_keep_input_matches_fp64(impl, dtype, rows, hidden):
    """keep_input (a decoder layer's input norm): dx is the norm's gradient plus the one through the returned x."""
    assert_checks(rmsnorm_checks(rows, hidden, dtype, impl, impl, keep_input=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_rmsnorm_keep_input_returns_x_and_adds_its_gradient_in_the_kernel(impl):
    x = torch.randn(6, 64, device=impl, requires_grad=True)
    w = torch.randn(64, device=impl, requires_grad=True)
    y, kept = fused_rmsnorm(x, w, keep_input=True, impl=impl)
    assert torch.equal(kept, x) and kept.data_ptr() == x.data_ptr()  # x itself, no copy
    assert kept.grad_fn is y.grad_fn  # its gradient comes back to the norm's backward, not to an autograd add
    dy, dk = torch.randn_like(y), torch.randn_like(y)
    dx, = torch.autograd.grad((y, kept), (x,), (dy, dk))
    dx_norm, = torch.autograd.grad(fused_rmsnorm(x, w, impl=impl), (x,), dy)
    torch.testing.assert_close(dx, dx_norm + dk)
    with pytest.raises(ValueError, match="keep_input=True returns"):
        fused_rmsnorm(x, w, residual=x, keep_input=True, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_fp32_weight_with_half_input(impl, dtype):
    assert_checks(rmsnorm_checks(65, 4096, dtype, impl, impl, weight_dtype=torch.float32))
    assert_checks(rmsnorm_checks(3, 4097, dtype, impl, impl, weight_dtype=torch.float32, residual=True))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                 (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_rmsnorm_16bit_weight_of_another_dtype(impl, dtype, weight_dtype):
    """A bf16 model's norm fed fp32 activations (inputs_embeds of its own, a norm kept in 16 bits): the kernels
    refused the weight ("weight dtype must equal the input dtype or be float32") where transformers and the
    reference promote. The weight goes in as fp32 (exact), the output is x's dtype as with an fp32 weight, and dw
    comes back in the weight's dtype."""
    assert_checks(rmsnorm_checks(65, 4096, dtype, impl, impl, weight_dtype=weight_dtype))
    assert_checks(rmsnorm_checks(3, 4097, dtype, impl, impl, weight_dtype=weight_dtype, residual=True))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", ["row_strided", "misaligned", "transposed"])
def test_rmsnorm_non_contiguous_input(impl, dtype, view):
    rows, hidden = 70, 1024
    base = torch.randn(rows, hidden + 16, dtype=dtype, device=impl)
    if view == "row_strided":           # rows further apart than hidden: kernel reads with a row stride
        x = base[:, :hidden]
    elif view == "misaligned":          # row starts off 16-byte boundaries: scalar path
        x = base[:, 1:hidden + 1]
    else:                               # last dimension not unit-stride: copied to rows
        x = torch.randn(hidden, rows, dtype=dtype, device=impl).t()
    assert not x.is_contiguous()
    assert_checks(rmsnorm_checks(rows, hidden, dtype, impl, impl, x=x))


@pytest.mark.parametrize("impl", IMPLS)
def test_rmsnorm_3d_input_and_eps(impl):
    x = torch.randn(2, 5, 96, device=impl)
    w = torch.randn(96, device=impl)
    for eps in (0.0, 1e-6, 1.0):
        y = fused_rmsnorm(x, w, eps, impl=impl)
        assert y.shape == x.shape
        torch.testing.assert_close(y, rmsnorm_reference(x, w, eps), rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_million_rows_cuda(dtype):
    # 2^20 + 3 rows: the forward grid is capped, so every block loops over many row groups
    assert_checks(rmsnorm_checks((1 << 20) + 3, 64, dtype, "cuda", "cuda"))


@pytest.mark.gpu
def test_rmsnorm_cuda_is_deterministic():
    x = torch.randn(4099, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    first = torch.autograd.grad(fused_rmsnorm(x, w, impl="cuda"), (x, w), dy)
    second = torch.autograd.grad(fused_rmsnorm(x, w, impl="cuda"), (x, w), dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_cuda_equals_cpu_kernel(dtype):
    x = torch.randn(33, 2880, dtype=dtype)
    w = torch.randn(2880, dtype=dtype)
    y_cpu = fused_rmsnorm(x, w, impl="cpu")
    y_cuda = fused_rmsnorm(x.cuda(), w.cuda(), impl="cuda").cpu()
    # Same fp32 formula; only the summation order of the row's sum of squares differs. Two orders of a
    # 2880-term fp32 sum differ by up to ~log2(2880) ulp in the worst case (3 ulp seen on the H200, seed
    # 402699454), which reaches y relatively; a 16-bit output absorbs that and is at most one of its own
    # rounding steps apart.
    rtol = 16 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(y_cuda, y_cpu, rtol=rtol, atol=torch.finfo(dtype).eps * 4)


@pytest.mark.parametrize("impl", IMPLS)
def test_rmsnorm_rejects_bad_input(impl):
    x = torch.randn(4, 64, device=impl)
    with pytest.raises(ValueError, match="weight shape"):
        fused_rmsnorm(x, torch.ones(65, device=impl), impl=impl)
    with pytest.raises(ValueError, match="residual shape"):
        fused_rmsnorm(x, torch.ones(64, device=impl), residual=torch.randn(4, 63, device=impl), impl=impl)
    with pytest.raises(ValueError, match="eps"):
        fused_rmsnorm(x, torch.ones(64, device=impl), eps=-1.0, impl=impl)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16, got Double"):
        fused_rmsnorm(x.double(), torch.ones(64, device=impl, dtype=torch.float64), impl=impl)
    with pytest.raises(RuntimeError, match="weight dtype"):  # a 16-bit weight of the other kind is cast (below)
        fused_rmsnorm(x, torch.ones(64, device=impl, dtype=torch.float64), impl=impl)
    with pytest.raises(ValueError, match="x must be a floating tensor .* got torch.int64"):
        fused_rmsnorm(x.long(), torch.ones(64, device=impl), impl=impl)
    with pytest.raises(ValueError, match=r"hidden >= 1, got shape \(4, 0\)"):
        fused_rmsnorm(x[:, :0], torch.ones(0, device=impl), impl=impl)
    with pytest.raises(ValueError, match=r"hidden >= 1, got shape \(\)"):
        fused_rmsnorm(x[0, 0], torch.ones((), device=impl), impl=impl)


def test_rmsnorm_residual_on_another_device_is_an_error():
    """The kernel reads the residual's pointer under x's device: a residual elsewhere is refused up front, as
    torch's x + residual refuses it (the CUDA kernel read another GPU's memory: an illegal address, or peer reads)."""
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="residual is on meta but x on cpu"):
        fused_rmsnorm(x, torch.ones(64), residual=torch.empty(4, 64, device="meta"), impl="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (the device machine lends one; a multi-GPU kind runs it)")
def test_rmsnorm_cuda_tensors_on_another_device_are_refused():
    from ds_loongforge.op_builder import FusedRMSNormBuilder

    kernel = FusedRMSNormBuilder().load()
    x = torch.randn(8, 4096, device="cuda:0", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda:0", dtype=torch.bfloat16)
    other = torch.randn(8, 4096, device="cuda:1", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual is on cuda:1 but x on cuda:0"):
        fused_rmsnorm(x, w, residual=other, impl="cuda")
    with pytest.raises(RuntimeError, match="residual is on cuda:1 but the input on cuda:0"):
        kernel.forward(x, other, w, 1e-6, True)
    y, _, rstd = kernel.forward(x, None, w, 1e-6, True)
    with pytest.raises(RuntimeError, match="dy is on cuda:1 but the input on cuda:0"):
        kernel.backward(other, x, rstd, w, None, True)
    with pytest.raises(RuntimeError, match="dresidual is on cuda:1 but the input on cuda:0"):
        kernel.backward(torch.ones_like(y), x, rstd, w, other, True)
    torch.cuda.synchronize(0)  # nothing was launched that read cuda:1's memory


@pytest.mark.parametrize("impl", IMPLS)
def test_double_backward_through_the_kernel_is_an_error(impl):
    """The kernel's backward builds no graph: create_graph=True would lose the norm's second-order terms."""
    x = torch.randn(4, 64, device=impl, requires_grad=True)
    w = torch.rand(64, device=impl, requires_grad=True)
    with pytest.raises(RuntimeError, match="fused_rmsnorm: double backward"):
        torch.autograd.grad(fused_rmsnorm(x, w, impl=impl).pow(2).sum(), x, create_graph=True)
    gx, = torch.autograd.grad(fused_rmsnorm(x, w, impl="reference").pow(2).sum(), x, create_graph=True)
    gx.sum().backward()
    assert w.grad is not None


@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_checks_name_the_values(impl):
    # straight into the compiled kernel (the Python op checks first): numbers and shapes in its messages
    # are formatted by LF_CHECK, which the device image needs (an extension streaming an integer crashed)
    from ds_loongforge.op_builder import FusedRMSNormBuilder, FusedRMSNormCPUBuilder

    kernel = (FusedRMSNormBuilder if impl == "cuda" else FusedRMSNormCPUBuilder)().load()
    x = torch.randn(4, 64, device=impl)
    with pytest.raises(RuntimeError, match="weight has 65 elements but the input rows have 64"):
        kernel.forward(x, None, torch.ones(65, device=impl), 1e-6, True)
    with pytest.raises(RuntimeError, match=r"residual shape \[4, 32\] differs from input shape \[4, 64\]"):
        kernel.forward(x, torch.randn(4, 32, device=impl), torch.ones(64, device=impl), 1e-6, True)
    with pytest.raises(RuntimeError, match="eps must be >= 0, got -0.5"):
        kernel.forward(x, None, torch.ones(64, device=impl), -0.5, True)
    with pytest.raises(RuntimeError, match=r"got shape \[64, 4\] and strides \[1, 64\]"):
        kernel.forward(x.t(), None, torch.ones(4, device=impl), 1e-6, True)


def test_rmsnorm_empty_input():
    x = torch.randn(0, 64, requires_grad=True)
    w = torch.ones(64, requires_grad=True)
    y = fused_rmsnorm(x, w, impl="cpu")
    assert y.shape == (0, 64)
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64))


@pytest.mark.parametrize("impl", IMPLS)
def test_outputs_may_be_modified_in_place(impl):
    """The outputs are no views made inside the autograd Function (autograd refuses in-place ops on those: OLMoE's
    attention clamps its q/k norms' outputs in place); the gradient then equals the reference's."""
    x = torch.randn(2, 3, 64, device=impl)
    w = torch.rand(64, device=impl)
    residual = torch.randn(2, 3, 64, device=impl)
    grads = []
    for which in (impl, "reference"):
        xs, ws, rs = (t.clone().requires_grad_() for t in (x, w, residual))
        y, h = fused_rmsnorm(xs, ws, residual=rs, impl=which)
        y.clamp_(-0.5, 0.5)
        (y.sum() + h.pow(2).sum()).backward()
        grads.append((xs.grad, ws.grad, rs.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_strided_weight_is_read_as_the_reference_reads_it(impl):
    x = torch.randn(5, 9, device=impl, requires_grad=True)
    base = torch.rand(18, device=impl, requires_grad=True)
    y = fused_rmsnorm(x, base[::2], impl=impl)
    y.sum().backward()
    want_x, want_base = x.grad.clone(), base.grad.clone()
    x.grad = base.grad = None
    fused_rmsnorm(x, base[::2], impl="reference").sum().backward()
    torch.testing.assert_close(want_x, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(want_base, base.grad, rtol=1e-5, atol=1e-6)
    assert not base.grad[1::2].any()
