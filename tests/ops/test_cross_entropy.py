"""Fused softmax cross-entropy over a chunk of logits (fp32/bf16/fp16): nll and the logits' gradient (fp32/bf16/fp16)
against fp64 within 2x PyTorch's own error, over vocabularies that hit the scalar and the vector paths; ignored rows,
zero scales, no gradient, a gradient written into a row slice of a bigger buffer, strided and misaligned logits,
huge logits, the fp64 path, the fallback to the reference, and the checks' messages; on CUDA the same plus a grid
of more rows than 65535 and the speed against the eager path."""

import warnings

import pytest
import torch

from ds_loongforge.op_builder import FusedCrossEntropyBuilder, FusedCrossEntropyCPUBuilder, OpBuildError
from ds_loongforge.ops import _dispatch
from ds_loongforge.ops.cross_entropy import cross_entropy_reference, softmax_cross_entropy_
from ds_loongforge.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from ds_loongforge.ops.numerics import cross_entropy_checks
from tests._params import DTYPES, IMPLS, assert_checks, device_of

GRAD_DTYPES = DTYPES + [pytest.param(None, id="no_grad")]
LOGITS_DTYPES = [pytest.param(d, id=f"logits_{str(d)[6:]}") for d in (torch.float32, torch.bfloat16, torch.float16)]

SHAPES = [
    pytest.param(1, 1, id="V1"),                # one class: softmax is 1, nll and gradient are exactly 0
    pytest.param(5, 3, id="V3"),                # fewer classes than a vector: scalar path
    pytest.param(257, 7, id="V7_257rows"),      # odd V, rows not a multiple of anything
    pytest.param(1, 32000, id="1row_llama"),    # one row; V % 4 == 0: vector path
    pytest.param(5, 32000, id="llama"),
    pytest.param(5, 32003, id="odd_vocab"),     # V % 4 != 0: rows misaligned, scalar path
    pytest.param(257, 32000, id="257rows"),
]


def make_row_args(rows, vocab, device, ignore_frac=0.3):
    valid_C = torch.rand(rows, device=device) >= ignore_frac
    target_C = torch.where(valid_C, torch.randint(0, vocab, (rows,), device=device), 0)
    scale_C = torch.where(valid_C, 0.5 + torch.rand(rows, device=device), 0.0)
    return target_C, valid_C, scale_C


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("logits_dtype", LOGITS_DTYPES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_matches_fp64_within_twice_pytorch(impl, logits_dtype, grad_dtype, rows, vocab):
    assert_checks(cross_entropy_checks(rows, vocab, grad_dtype, impl, impl, logits_dtype=logits_dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [32000, 32003])
def test_16bit_logits_are_upcast_as_the_unfused_float(impl, vocab):
    """bf16 logits give what the same values as fp32 logits give (the op upcasts on load, as logits.float() does):
    the same nll to fp32 summation order and the same bf16 gradient (a value may round to the neighbouring bf16
    across a tie)."""
    logits_bf16 = (2.0 * torch.randn(9, vocab, device=impl)).bfloat16()
    args = make_row_args(9, vocab, impl)
    g16, g32 = (torch.empty(9, vocab, dtype=torch.bfloat16, device=impl) for _ in range(2))
    nll16 = softmax_cross_entropy_(logits_bf16, *args, g16, impl=impl)
    nll32 = softmax_cross_entropy_(logits_bf16.float(), *args, g32, impl=impl)
    assert nll16.dtype == torch.float32
    torch.testing.assert_close(nll16, nll32, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g16.float(), g32.float(), rtol=2 ** -7, atol=1e-9)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [32000, 37])
def test_strided_and_misaligned_logits_rows(impl, vocab):
    # rows V + 4 apart, starting one float past a 16-byte boundary: the kernel must take the scalar path
    base = 2.0 * torch.randn(33, vocab + 4, device=impl)
    logits_CV = base[:, 1:vocab + 1]
    assert not logits_CV.is_contiguous()
    assert_checks(cross_entropy_checks(33, vocab, torch.bfloat16, impl, impl, logits_CV=logits_CV))
    # bf16 rows 2 bytes past a 16-byte boundary, 8 + 4 apart: not a whole vector of 8
    logits_bf16 = base.bfloat16()[:, 1:vocab + 1]
    assert_checks(cross_entropy_checks(33, vocab, torch.bfloat16, impl, impl, logits_CV=logits_bf16))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [32000, 7])
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_grad_into_a_row_slice_of_a_bigger_buffer(impl, vocab, grad_dtype):
    """The linear_cross_entropy use: a chunk's gradient lands in rows [start, start + C) of the [N, V] buffer;
    rows outside stay untouched and the slice gets exactly what a buffer of its own gets."""
    rows, start = 9, 3
    logits_CV = 2.0 * torch.randn(rows, vocab, device=impl)
    args = make_row_args(rows, vocab, impl)
    big_NV = torch.full((rows + 7, vocab), float("nan"), dtype=grad_dtype, device=impl)
    own_CV = torch.empty(rows, vocab, dtype=grad_dtype, device=impl)
    nll_slice = softmax_cross_entropy_(logits_CV, *args, big_NV[start:start + rows], impl=impl)
    nll_own = softmax_cross_entropy_(logits_CV, *args, own_CV, impl=impl)
    assert torch.equal(big_NV[start:start + rows], own_CV) and torch.equal(nll_slice, nll_own)
    assert big_NV[:start].isnan().all() and big_NV[start + rows:].isnan().all()


@pytest.mark.parametrize("impl", IMPLS + [pytest.param("reference", id="reference")])
@pytest.mark.parametrize("vocab", [32000, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_written_into_the_logits_themselves(impl, vocab, dtype):
    """grad_CV may be logits_CV itself (the gradient overwrites the logits, saving a [C, V] buffer): the same nll and
    gradient as into a buffer of its own."""
    device = device_of(impl)
    logits_CV = (2.0 * torch.randn(9, vocab, device=device)).to(dtype)
    args = make_row_args(9, vocab, device)
    own_CV = torch.empty_like(logits_CV)
    nll_own = softmax_cross_entropy_(logits_CV, *args, own_CV, impl=impl)
    nll_in_place = softmax_cross_entropy_(logits_CV, *args, logits_CV, impl=impl)
    assert torch.equal(nll_in_place, nll_own) and torch.equal(logits_CV, own_CV)


@pytest.mark.parametrize("impl", IMPLS)
def test_ignored_rows_zero_scale_and_no_grad(impl):
    rows, vocab = 6, 100
    logits_CV = torch.randn(rows, vocab, device=impl)
    target_C = torch.tensor([3, 0, 99, 0, 5, 7], device=impl)
    valid_C = torch.tensor([True, False, True, False, True, True], device=impl)
    scale_C = torch.tensor([0.5, 0.0, 2.0, 0.0, 0.0, 1.0], device=impl)  # row 4: valid with scale 0
    grad_CV = torch.full((rows, vocab), float("nan"), device=impl)
    nll_C = softmax_cross_entropy_(logits_CV, target_C, valid_C, scale_C, grad_CV, impl=impl)
    assert torch.equal(nll_C[~valid_C], torch.zeros(2, device=impl)) and (nll_C[valid_C] > 0).all()
    assert torch.equal(grad_CV[scale_C == 0], torch.zeros(3, vocab, device=impl))
    torch.testing.assert_close(grad_CV.sum(1), torch.zeros(rows, device=impl), atol=1e-6, rtol=0)  # softmax - onehot
    assert torch.equal(softmax_cross_entropy_(logits_CV, target_C, valid_C, scale_C, impl=impl), nll_C)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [32000, 31])
def test_huge_logits_do_not_overflow(impl, vocab):
    # exp(1000) overflows fp32 (and fp64): only subtracting the row's max keeps these finite
    logits_CV = 1000.0 + 3.0 * torch.randn(4, vocab, device=impl)
    logits_CV[1] -= 3000.0
    assert_checks(cross_entropy_checks(4, vocab, torch.float32, impl, impl, logits_CV=logits_CV, ignore_frac=0.0))
    # -inf classes (a masked vocabulary) add nothing and get a zero gradient
    logits_CV[:, ::2] = float("-inf")
    target_C, valid_C = torch.ones(4, dtype=torch.int64, device=impl), torch.ones(4, dtype=torch.bool, device=impl)
    ours_CV, ref_CV = torch.empty_like(logits_CV), torch.empty(logits_CV.shape, dtype=torch.float64, device=impl)
    nll_C = softmax_cross_entropy_(logits_CV, target_C, valid_C, torch.ones(4, device=impl), ours_CV, impl=impl)
    ref_C = cross_entropy_reference(logits_CV.double(), target_C, valid_C, torch.ones(4, device=impl).double(), ref_CV)
    assert torch.isfinite(nll_C).all() and not ours_CV[:, ::2].any()
    torch.testing.assert_close(nll_C.double(), ref_C, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours_CV.double(), ref_CV, rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_chunk(impl):
    nll_C = softmax_cross_entropy_(torch.randn(0, 10, device=impl), *make_row_args(0, 10, impl),
                                   torch.empty(0, 10, device=impl), impl=impl)
    assert nll_C.shape == (0,)


def test_fp64_runs_the_reference_exactly():
    logits_CV = torch.randn(17, 50, dtype=torch.float64)
    target_C, valid_C, scale_C = make_row_args(17, 50, "cpu")
    ours_CV, ref_CV = torch.empty_like(logits_CV), torch.empty_like(logits_CV)
    nll_C = softmax_cross_entropy_(logits_CV, target_C, valid_C, scale_C.double(), ours_CV, impl="cpu")
    assert nll_C.dtype == torch.float64
    assert torch.equal(nll_C, cross_entropy_reference(logits_CV, target_C, valid_C, scale_C.double(), ref_CV))
    assert torch.equal(ours_CV, ref_CV)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_name_the_value_and_fix(impl):
    x = torch.randn(4, 10, device=impl)
    target_C, valid_C, scale_C = make_row_args(4, 10, impl)
    with pytest.raises(ValueError, match=r"logits_CV is torch.int32; the op takes float32, bfloat16 or float16 .*"
                                         r"pass logits_CV.float\(\)"):
        softmax_cross_entropy_(x.int(), target_C, valid_C, scale_C, impl=impl)
    with pytest.raises(ValueError, match=r"scale_C must be a torch.float32 tensor .*got torch.bfloat16"):
        softmax_cross_entropy_(x.bfloat16(), target_C, valid_C, scale_C.bfloat16(), impl=impl)
    with pytest.raises(ValueError, match=r"unit stride along V, got strides \(1, 4\); pass logits_CV.contiguous"):
        softmax_cross_entropy_(x.t().contiguous().t(), target_C, valid_C, scale_C, impl=impl)
    with pytest.raises(ValueError, match=r"\[C, V\] tensor with V >= 1, got \(4, 0\)"):
        softmax_cross_entropy_(x[:, :0], target_C, valid_C, scale_C, impl=impl)
    with pytest.raises(ValueError, match=r"target_C must be a torch.int64 tensor of shape \(4,\).*got torch.int32"):
        softmax_cross_entropy_(x, target_C.int(), valid_C, scale_C, impl=impl)
    with pytest.raises(ValueError, match=r"scale_C must be a torch.float32 tensor of shape \(4,\).*got .* \(3,\)"):
        softmax_cross_entropy_(x, target_C, valid_C, scale_C[:3], impl=impl)
    with pytest.raises(ValueError, match=r"grad_CV must be None or a tensor of the logits' shape \(4, 10\).*\(4, 9\)"):
        softmax_cross_entropy_(x, target_C, valid_C, scale_C, torch.empty(4, 9, device=impl), impl=impl)
    with pytest.raises(ValueError, match=r"grad_CV must be None .*got torch.int32"):
        softmax_cross_entropy_(x, target_C, valid_C, scale_C, torch.empty(4, 10, dtype=torch.int32, device=impl),
                               impl=impl)
    with pytest.raises(ValueError, match="impl='gpu' is not one of"):
        softmax_cross_entropy_(x, target_C, valid_C, scale_C, impl="gpu")


@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_checks_name_the_values(impl):
    # straight into the compiled kernel: numbers in its messages are formatted by LF_CHECK (see lf_common.h)
    kernel = (FusedCrossEntropyBuilder if impl == "cuda" else FusedCrossEntropyCPUBuilder)().load()
    x = torch.randn(4, 10, device=impl)
    target_C, valid_C, scale_C = make_row_args(4, 10, impl)
    with pytest.raises(RuntimeError, match=r"unit stride along the last dimension, got shape \[10, 4\]"):
        kernel.forward(x.t(), target_C, valid_C, scale_C, None)
    with pytest.raises(RuntimeError, match="logits must be float32, float16 or bfloat16, got Double"):
        kernel.forward(x.double(), target_C, valid_C, scale_C, None)
    with pytest.raises(RuntimeError, match="scale must have dtype Float, got BFloat16"):
        kernel.forward(x.bfloat16(), target_C, valid_C, scale_C.bfloat16(), None)
    with pytest.raises(RuntimeError, match=r"target must be a contiguous \[C\] tensor with C = 4 .*got shape \[3\]"):
        kernel.forward(x, target_C[:3], valid_C, scale_C, None)
    with pytest.raises(RuntimeError, match=r"valid must have dtype Bool, got Long"):
        kernel.forward(x, target_C, valid_C.long(), scale_C, None)
    with pytest.raises(RuntimeError, match=r"grad must have the logits' shape \[4, 10\], got \[4, 11\]"):
        kernel.forward(x, target_C, valid_C, scale_C, torch.empty(4, 11, device=impl))
    with pytest.raises(RuntimeError, match=r"V must be in \[1, 2\^31\), got 0"):
        kernel.forward(x[:, :0], target_C, valid_C, scale_C, None)


def test_cpu_target_out_of_range_is_an_error():
    x = torch.randn(3, 10)
    with pytest.raises(RuntimeError, match="target 10 of row 1 is out of bounds for 10 classes"):
        softmax_cross_entropy_(x, torch.tensor([0, 10, 2]), torch.ones(3, dtype=torch.bool), torch.ones(3),
                               impl="cpu")


@pytest.fixture
def failing_cpu_cross_entropy(monkeypatch):
    def fail(self, verbose=False):
        raise OpBuildError(self.NAME, "simulated compiler failure", "install the simulated compiler")

    monkeypatch.setattr(FusedCrossEntropyCPUBuilder, "load", fail)
    monkeypatch.delenv("LOONGFORGE_STRICT_OPS", raising=False)
    _dispatch.forget_failures()
    yield
    _dispatch.forget_failures()


def test_linear_cross_entropy_falls_back_to_the_reference(failing_cpu_cross_entropy):
    h, w = torch.randn(40, 16), torch.randn(30, 16) / 4
    labels = torch.randint(0, 30, (40,))
    labels[::3] = -100
    with pytest.warns(RuntimeWarning, match="lf_cross_entropy_cpu.*simulated compiler failure"):
        loss = linear_cross_entropy(h, w, labels, chunk_rows=16)
    torch.testing.assert_close(loss, linear_cross_entropy_reference(h, w, labels), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_cross_entropy(h, w, labels, chunk_rows=16)  # warned once


# --- CUDA ----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_more_rows_than_one_grid_dimension():
    # a 1-D grid of one block per row: 65535 (the y/z limit) is no limit here
    assert_checks(cross_entropy_checks(65535 + 1000, 40, torch.bfloat16, "cuda", "cuda"))


# (vocab, logits dtype) -> the CUDA kernel that runs: a row of at most 8 16-byte vectors per thread (512 threads)
# stays in registers (one read), a longer one streams (two reads), a misaligned one takes the scalar path
CUDA_PATHS = [
    pytest.param(32000, torch.bfloat16, id="registers_bf16_llama"),
    pytest.param(1000, torch.float16, id="registers_fp16_small_block"),
    pytest.param(16384, torch.float32, id="registers_fp32_widest"),
    pytest.param(32000, torch.float32, id="streaming_fp32_llama"),
    pytest.param(152064, torch.bfloat16, id="streaming_bf16_qwen"),
    pytest.param(32776, torch.bfloat16, id="streaming_bf16_just_past_registers"),
    pytest.param(32003, torch.bfloat16, id="scalar_bf16_odd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,logits_dtype", CUDA_PATHS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, None], ids=["grad_bf16", "grad_fp32", "no_grad"])
def test_cuda_every_kernel_path_within_twice_pytorch(vocab, logits_dtype, grad_dtype):
    assert_checks(cross_entropy_checks(67, vocab, grad_dtype, "cuda", "cuda", logits_dtype=logits_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,logits_dtype", CUDA_PATHS + [pytest.param(40, torch.bfloat16, id="one_warp_bf16")])
def test_cuda_grad_written_into_the_logits_themselves(vocab, logits_dtype):
    """Every kernel path with grad_CV = logits_CV: thread 0 read the target's logit for the nll after the block's
    reduction, when other warps could already have stored the gradient into it; and the one-warp block had no barrier
    between the reads of the logits and the stores. The nll and the gradient must be those into a buffer of its own,
    bit for bit, with targets at the row's ends (written first and last by the backward pass over the row) and
    between."""
    rows = 512
    logits_CV = (2.0 * torch.randn(rows, vocab, device="cuda")).to(logits_dtype)
    valid_C = torch.ones(rows, dtype=torch.bool, device="cuda")
    picks = torch.tensor([0, vocab - 1, vocab // 2, vocab // 3], device="cuda")
    target_C = torch.where(torch.arange(rows, device="cuda") % 2 == 0, picks[torch.arange(rows, device="cuda") % 4],
                           torch.randint(0, vocab, (rows,), device="cuda"))
    scale_C = torch.full((rows,), 1.0 / rows, device="cuda")
    own_CV = torch.empty_like(logits_CV)
    nll_own = softmax_cross_entropy_(logits_CV, target_C, valid_C, scale_C, own_CV, impl="cuda")
    for _ in range(3):
        in_place_CV = logits_CV.clone()
        nll_in_place = softmax_cross_entropy_(in_place_CV, target_C, valid_C, scale_C, in_place_CV, impl="cuda")
        assert torch.equal(nll_in_place, nll_own)
        assert torch.equal(in_place_CV, own_CV)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,logits_dtype", CUDA_PATHS)
def test_cuda_agrees_with_the_cpu_kernel(vocab, logits_dtype):
    logits_CV = (2.0 * torch.randn(64, vocab)).to(logits_dtype)
    args = make_row_args(64, vocab, "cpu")
    cpu_CV, cuda_CV = torch.empty(64, vocab), torch.empty(64, vocab, device="cuda")
    nll_cpu = softmax_cross_entropy_(logits_CV, *args, cpu_CV, impl="cpu")
    nll_cuda = softmax_cross_entropy_(logits_CV.cuda(), *(a.cuda() for a in args), cuda_CV, impl="cuda")
    # the two sum exp() in different orders: ~1e-6 of the log-sum-exp at 32000 classes, a few times that at 152064
    rtol = 2e-6 if vocab <= 32768 else 1e-5
    torch.testing.assert_close(nll_cuda.cpu(), nll_cpu, rtol=rtol, atol=2e-6)
    torch.testing.assert_close(cuda_CV.cpu(), cpu_CV, rtol=rtol, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=["logits_fp32", "logits_bf16"])
def test_cuda_chunk_is_far_faster_than_eager(logits_dtype):
    """The linear_cross_entropy chunk (C = 2048, V = 32000, bf16 gradient): one read of the logits and one
    write of the gradient, against the eager path's ~0.6 ms on an H200 (printed: the time of each logits dtype)."""
    rows, vocab = 2048, 32000
    logits_CV = (2.0 * torch.randn(rows, vocab, device="cuda")).to(logits_dtype)
    args = make_row_args(rows, vocab, "cuda")
    grad_CV = torch.empty(rows, vocab, dtype=torch.bfloat16, device="cuda")

    def ms(fn, repeats=20):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats

    fused = ms(lambda: softmax_cross_entropy_(logits_CV, *args, grad_CV, impl="cuda"))
    eager = ms(lambda: cross_entropy_reference(logits_CV, *args, grad_CV))
    moved = rows * vocab * (logits_CV.element_size() + 2)
    print(f"C={rows} V={vocab} logits {logits_dtype}: fused {fused * 1e3:.1f} us ({moved / fused / 1e6:.0f} GB/s), "
          f"eager {eager * 1e3:.1f} us")
    assert fused < 0.4 * eager, (fused, eager)


# --- scale_by: the LM head backward's scaling by the loss's incoming gradient -----------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 7, 4099, 8192 * 3 + 5])
@pytest.mark.parametrize("scale", [1.0, 1 / 3, 2.0**16, -0.25])
def test_scale_by_is_the_fp32_product_rounded_once(impl, dtype, numel, scale):
    """The same bits as the reference (a float32 product, one rounding to x's dtype), in place and not, at an
    aligned and a misaligned start; within half an ulp of x's dtype (plus the fp32 product's rounding) of the exact
    product, inf where fp16 x 2^16 overflows."""
    from ds_loongforge.ops.cross_entropy import scale_by, scale_by_reference

    device = "cuda" if impl == "cuda" else "cpu"
    base = (torch.randn(numel + 1, dtype=torch.float64) * 3).to(dtype).to(device)
    s = torch.tensor(scale, dtype=torch.float32, device=device)
    for x in (base[:numel].clone(), base[1:]):  # base[1:] starts 2 or 4 bytes past a 16-byte boundary
        exact = x.double() * float(s)  # the product of two floats is exact in fp64
        got = scale_by(x, s, impl=impl)
        assert (got.data_ptr() != x.data_ptr() or numel == 0) and torch.equal(got, scale_by_reference(x, s))
        finite = torch.isfinite(exact.to(dtype))
        assert torch.equal(torch.isfinite(got), finite)
        ulp = torch.finfo(dtype).eps * exact[finite].abs() + torch.finfo(dtype).tiny
        assert bool(((got[finite].double() - exact[finite]).abs() <= ulp * (0.5 + 2.0**-23)).all())
        y = x.clone()
        assert scale_by(y, s, in_place=True, impl=impl).data_ptr() == y.data_ptr()
        assert torch.equal(y, got)


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_by_bad_input_is_a_clear_error(impl):
    from ds_loongforge.ops.cross_entropy import scale_by

    device = "cuda" if impl == "cuda" else "cpu"
    x = torch.randn(4, 6, device=device)
    with pytest.raises(RuntimeError, match="scale_by: x must be contiguous"):
        scale_by(x.t(), torch.tensor(2.0, device=device), impl=impl)
    with pytest.raises(RuntimeError, match="scale_by: scale must be a one-element float32 tensor"):
        scale_by(x, torch.tensor(2.0, dtype=torch.float64, device=device), impl=impl)
    with pytest.raises(RuntimeError, match="scale_by: x must be float32, bfloat16 or float16, got Double"):
        scale_by(x.double(), torch.tensor(2.0, device=device), impl=impl)


def test_scale_by_auto_takes_the_reference_where_the_kernel_does_not_fit():
    from ds_loongforge.ops.cross_entropy import scale_by, scale_by_reference

    x = torch.randn(4, 6, dtype=torch.float64)
    s = torch.tensor(1 / 3, dtype=torch.float64)
    assert torch.equal(scale_by(x, s), scale_by_reference(x, s))  # fp64 x and scale
    xt = torch.randn(6, 4).t()
    assert torch.equal(scale_by(xt, torch.tensor(0.5)), xt * 0.5)  # strided x


def test_checks_run_the_op_they_are_given():
    """numerics.cross_entropy_checks(op=...) checks that op (diagnose_cross_entropy passes another build's kernel):
    the reference passes, and an op whose nll is 1e-3 off does not."""
    logits_CV = 2.0 * torch.randn(9, 100)
    assert_checks(cross_entropy_checks(9, 100, torch.float32, "cpu", "cpu", logits_CV=logits_CV,
                                       op=cross_entropy_reference))

    def off(*args):
        return cross_entropy_reference(*args) + 1e-3

    nll, dlogits = cross_entropy_checks(9, 100, torch.float32, "cpu", "cpu", logits_CV=logits_CV, op=off)
    assert not nll.passed and dlogits.passed
