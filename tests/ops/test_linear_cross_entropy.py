"""Fused linear + cross-entropy: loss and the gradients of hidden and weight against fp64 (``F.cross_entropy`` on
float64 logits), within 2x the error of the unfused PyTorch path in the same dtype (logits in that dtype ->
.float() -> cross_entropy), with the default logits (the inputs' dtype, as that path) and with fp32 logits;
the default equal to the unfused path itself; ignored labels, chunking edge cases, reductions, validation; on
CUDA: bf16, no host sync, and the peak memory of a Mixtral-sized LM head."""

import pytest
import torch
import torch.nn.functional as F

from ds_loongforge.ops import linear_cross_entropy as lce_module
from ds_loongforge.ops.linear_cross_entropy import (default_chunk_rows, linear_cross_entropy,
                                                    linear_cross_entropy_reference)
from ds_loongforge.ops.numerics import CheckResult, max_error, tolerance
from tests._params import DTYPES, IMPLS, assert_checks

# (rows, hidden, vocab, chunk_rows)
SHAPES = [
    pytest.param(37, 16, 53, 8, id="ragged_chunks_odd_vocab"),   # N not a multiple of the chunk, V not of 8
    pytest.param(6, 8, 24, 1, id="chunk1"),
    pytest.param(1, 32, 77, None, id="one_row"),
    pytest.param(200, 64, 1000, None, id="default_chunk"),
    pytest.param(64, 32, 40, 64, id="chunk_eq_rows"),
]


def make_inputs(rows, hidden, vocab, dtype, device, ignore_frac=0.3, ignore_index=-100):
    h = torch.randn(rows, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) * (2.0 / hidden ** 0.5)).to(dtype)  # logits of a few units
    labels = torch.randint(0, vocab, (rows,), device=device)
    labels[torch.rand(rows, device=device) < ignore_frac] = ignore_index
    return h, w, labels


def run(fn, h, w, labels, cast, grad_scale=1.0, **kw):
    """loss, d hidden, d weight of fn on copies of h, w cast to ``cast``."""
    hs = h.detach().to(cast).requires_grad_()
    ws = w.detach().to(cast).requires_grad_()
    loss = fn(hs, ws, labels, **kw)
    dh, dw = torch.autograd.grad(loss * grad_scale, (hs, ws))
    return loss.detach(), dh, dw


def lce_checks(rows, hidden, vocab, dtype, device, chunk_rows=None, reduction="mean", ignore_index=-100,
               ignore_frac=0.3, logits_dtype=None):
    h, w, labels = make_inputs(rows, hidden, vocab, dtype, device, ignore_frac, ignore_index)
    kw = dict(ignore_index=ignore_index, reduction=reduction)
    ours = run(linear_cross_entropy, h, w, labels, dtype, chunk_rows=chunk_rows, logits_dtype=logits_dtype, **kw)
    ref = run(linear_cross_entropy_reference, h, w, labels, torch.float64, **kw)
    eager = run(linear_cross_entropy_reference, h, w, labels, dtype, **kw)
    label = (f"lce {device} {str(dtype)[6:]} logits={str(logits_dtype)[6:] if logits_dtype else 'default'} "
             f"N={rows} H={hidden} V={vocab} chunk={chunk_rows} {reduction}")
    results = []
    for name, o, r, e in zip(("loss", "dhidden", "dweight"), ours, ref, eager):
        assert o.dtype == (torch.float32 if name == "loss" else dtype), (name, o.dtype)
        results.append(CheckResult(f"{label} {name}", max_error(o, r), tolerance(max_error(e, r), r, dtype)))
    return results


@pytest.mark.parametrize("device", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,vocab,chunk_rows", SHAPES)
def test_matches_fp64_within_twice_pytorch(device, dtype, rows, hidden, vocab, chunk_rows):
    assert_checks(lce_checks(rows, hidden, vocab, dtype, device, chunk_rows))


@pytest.mark.parametrize("device", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_logits_within_twice_pytorch(device, dtype):
    assert_checks(lce_checks(37, 16, 53, dtype, device, chunk_rows=8, logits_dtype=torch.float32))
    assert_checks(lce_checks(200, 64, 1000, dtype, device, logits_dtype=torch.float32))


@pytest.mark.parametrize("device", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_default_logits_are_the_unfused_paths(device, dtype):
    """By default the logits GEMM rounds to the inputs' dtype and the op upcasts, as transformers' lm_head ->
    logits.float() -> cross_entropy does: the loss agrees with that path to fp32 summation order, and the gradients
    to their own rounding (one ulp of the dtype)."""
    h, w, labels = make_inputs(300, 64, 1000, dtype, device)
    ours = run(linear_cross_entropy, h, w, labels, dtype, chunk_rows=128)
    eager = run(linear_cross_entropy_reference, h, w, labels, dtype)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(ours[0], eager[0], rtol=2e-6, atol=0)
    for o, e in zip(ours[1:], eager[1:]):
        torch.testing.assert_close(o.float(), e.float(), rtol=eps, atol=eps * float(e.abs().max()))


def test_bad_logits_dtype_names_the_choices():
    h, w, labels = make_inputs(4, 8, 10, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"logits_dtype=torch.float16; use None .* or torch.float32"):
        linear_cross_entropy(h, w, labels, logits_dtype=torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_reduction(dtype):
    assert_checks(lce_checks(45, 16, 61, dtype, "cpu", chunk_rows=16, reduction="sum"))


@pytest.mark.parametrize("ignore_index", [7, -1, 0])  # a class id as ignore_index: those targets are ignored
def test_custom_ignore_index(ignore_index):
    assert_checks(lce_checks(40, 16, 30, torch.float32, "cpu", chunk_rows=9, ignore_index=ignore_index))


def test_fp32_is_tight_and_fp64_exact():
    h, w, labels = make_inputs(50, 24, 70, torch.float64, "cpu")
    ours = run(linear_cross_entropy, h, w, labels, torch.float64, chunk_rows=7)
    ref = run(linear_cross_entropy_reference, h, w, labels, torch.float64)
    for o, r in zip(ours, ref):
        assert o.dtype == torch.float64
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-14)
    ours32 = run(linear_cross_entropy, h, w, labels, torch.float32, chunk_rows=7)
    for o, r in zip(ours32, ref):
        torch.testing.assert_close(o.double(), r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_matches_torch(reduction):
    """mean: nan loss (0/0) and zero gradients; sum: 0 and zero gradients, as torch gives."""
    h, w, _ = make_inputs(9, 8, 13, torch.float32, "cpu")
    labels = torch.full((9,), -100)
    ours = run(linear_cross_entropy, h, w, labels, torch.float32, chunk_rows=4, reduction=reduction)
    ref = run(linear_cross_entropy_reference, h, w, labels, torch.float32, reduction=reduction)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(ours[0]) == (reduction == "mean")
    assert not ours[1].any() and not ours[2].any()


def test_gradient_scale_and_leading_dims():
    h, w, labels = make_inputs(2 * 11, 16, 29, torch.float32, "cpu")
    h3, labels2 = h.view(2, 11, 16), labels.view(2, 11)
    ours = run(linear_cross_entropy, h3, w, labels2, torch.float32, grad_scale=3.5, chunk_rows=5)
    ref = run(linear_cross_entropy_reference, h, w, labels, torch.float64, grad_scale=3.5)
    assert ours[1].shape == (2, 11, 16)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.double().reshape(r.shape), r, rtol=1e-5, atol=1e-6)


def test_only_some_inputs_require_grad():
    h, w, labels = make_inputs(20, 8, 17, torch.float32, "cpu")
    ref = run(linear_cross_entropy_reference, h, w, labels, torch.float64)
    ws = w.clone().requires_grad_()
    (dw,) = torch.autograd.grad(linear_cross_entropy(h, ws, labels, chunk_rows=6), (ws,))  # hidden without grad
    torch.testing.assert_close(dw.double(), ref[2], rtol=1e-5, atol=1e-6)
    hs = h.clone().requires_grad_()
    loss = linear_cross_entropy(hs, w, labels, chunk_rows=6)
    (dh,) = torch.autograd.grad(loss, (hs,))
    torch.testing.assert_close(dh.double(), ref[1], rtol=1e-5, atol=1e-6)
    assert loss.grad_fn is not None
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hs, w, labels).double(), ref[0], rtol=1e-5, atol=1e-6)
    assert linear_cross_entropy(h, w, labels).grad_fn is None


def test_autocast_matches_linear_under_autocast():
    """Under torch.autocast the GEMMs run in the autocast dtype, as nn.Linear's would; grads come back fp32."""
    h, w, labels = make_inputs(30, 16, 45, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = run(linear_cross_entropy, h, w, labels, torch.float32, chunk_rows=8)
        eager = run(lambda a, b, y: F.cross_entropy(F.linear(a, b).float(), y), h, w, labels, torch.float32)
    ref = run(linear_cross_entropy_reference, h, w, labels, torch.float64)
    for name, o, e, r in zip(("loss", "dh", "dw"), ours, eager, ref):
        assert o.dtype == torch.float32
        assert max_error(o, r) <= tolerance(max_error(e, r), r, torch.bfloat16), name


def test_default_chunk_rows():
    assert default_chunk_rows(32000) == 2048          # ~256 MiB of fp32 logits
    assert default_chunk_rows(32000, torch.bfloat16) == 4096
    assert default_chunk_rows(152064) == 256 * (((256 << 20) // (152064 * 4)) // 256)
    assert default_chunk_rows(10**9) == 1


def test_bad_inputs_name_the_value_and_fix():
    h, w, labels = make_inputs(4, 8, 10, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] with H = hidden.shape\[-1\] = 8, "
                                         r"got shape \(8, 10\)"):
        linear_cross_entropy(h, w.t(), labels)
    with pytest.raises(ValueError, match=r"labels has 3 elements .* hidden has 4 rows"):
        linear_cross_entropy(h, w, labels[:3])
    with pytest.raises(ValueError, match=r"labels must be int64 .* got torch.int32; pass labels.long\(\)"):
        linear_cross_entropy(h, w, labels.int())
    with pytest.raises(ValueError, match=r"hidden is torch.bfloat16 but weight is torch.float32"):
        linear_cross_entropy(h.bfloat16(), w, labels)
    with pytest.raises(ValueError, match=r"chunk_rows must be a positive int or None, got 0"):
        linear_cross_entropy(h, w, labels, chunk_rows=0)
    with pytest.raises(ValueError, match=r"reduction='none'"):
        linear_cross_entropy(h, w, labels, reduction="none")
    with pytest.raises(ValueError, match=r"hidden is torch.int64"):
        linear_cross_entropy(h.long(), w.long(), labels)
    with pytest.raises(ValueError, match="no rows"):
        linear_cross_entropy(h[:0], w, labels[:0])
    with pytest.raises(RuntimeError, match="out of bounds"):  # on CPU (a device-side assert on CUDA)
        linear_cross_entropy(h, w, torch.tensor([0, 1, 10, 2]))


# --- CUDA ----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_bf16_within_twice_pytorch_with_either_logits():
    assert_checks(lce_checks(4096, 1024, 32000, torch.bfloat16, "cuda"))
    assert_checks(lce_checks(4096, 1024, 32000, torch.bfloat16, "cuda", logits_dtype=torch.float32))
    assert lce_module._mm_out_dtype_ok is True, "torch.mm(..., out_dtype=torch.float32) should exist for CUDA"


@pytest.mark.gpu
def test_cuda_forward_backward_never_sync_the_host():
    h, w, labels = make_inputs(3000, 256, 5000, torch.bfloat16, "cuda")
    hs, ws = h.requires_grad_(), w.requires_grad_()
    for logits_dtype in (None, torch.float32):  # warm-up (fp32: the out_dtype probe)
        linear_cross_entropy(hs, ws, labels, chunk_rows=1024, logits_dtype=logits_dtype).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for reduction in ("mean", "sum"):
            for logits_dtype in (None, torch.float32):
                linear_cross_entropy(hs, ws, labels, chunk_rows=1024, reduction=reduction,
                                     logits_dtype=logits_dtype).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_peak_memory_well_below_unfused():
    """Mixtral's LM head at 8192 tokens in bf16: the unfused loss holds bf16 logits, their fp32 copy and the fp32
    log-softmax (and the fp32 logits gradient in backward); the fused one a bf16 gradient buffer and one chunk."""
    n, hidden, vocab = 8192, 2048, 32000
    h, w, labels = make_inputs(n, hidden, vocab, torch.bfloat16, "cuda")
    h.requires_grad_(), w.requires_grad_()

    def peak(fn):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(h, w, labels).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    peak(linear_cross_entropy)  # warm-up
    fused, unfused = peak(linear_cross_entropy), peak(linear_cross_entropy_reference)
    print(f"peak above inputs: fused {fused / 2**30:.2f} GiB, unfused {unfused / 2**30:.2f} GiB")
    assert fused < 0.5 * unfused, (fused, unfused)
    # what the fused path may hold: the bf16 logits gradient [N, V], a chunk's logits (256 MiB; + two chunks of
    # slack for the allocator), and the inputs' gradients (1.22 GiB measured on the H200 against 1.37 with fp32 logits)
    chunk = default_chunk_rows(vocab, torch.bfloat16) * vocab * 2
    bound = n * vocab * 2 + 3 * chunk + h.numel() * 2 + w.numel() * 2
    assert fused < bound, f"the fused path holds {fused / 2**30:.2f} GiB, more than {bound / 2**30:.2f} GiB"


@pytest.mark.parametrize("device", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.125, 65536.0, 1 / 3])  # plain, 1 / GAS, an fp16 loss scale, GAS = 3
@pytest.mark.parametrize("rows,vocab", [(48, 300), (300, 48)])  # h smaller than the product, and the reverse
def test_backward_scales_in_fp32_on_the_smaller_operand(device, dtype, scale, rows, vocab):
    """The incoming gradient scales h or the [V, H] product, whichever is smaller, multiplied in fp32: for a
    power-of-two scale the result is bitwise the product scaled exactly; 2^16 stays finite in fp16 (fp16 scales the
    product: h x 2^16 would overflow), and 1/3 is not rounded to the dtype first (bf16's 1/3 is 0.2% off)."""
    from ds_loongforge.ops.linear_cross_entropy import _weight_gradient

    grad = torch.randn(rows, vocab, device=device).to(dtype) * 1e-4  # x 2^16 still finite in fp16; h x 2^16 is not
    h = torch.randn(rows, 16, device=device).to(dtype) * 4
    h_before = h.clone()
    got = _weight_gradient(grad, h, torch.tensor(scale, device=device))
    assert torch.equal(h, h_before)  # the saved hidden states are not scaled in place
    unscaled = torch.mm(grad.t(), h).double()
    exact = unscaled * scale
    if scale in (1.0, 0.125, 65536.0):
        assert torch.equal(got, exact.to(dtype))
    else:  # the scale in fp32 on the operand scaled (the old mul_ rounded 1/3 to bf16's 0.3340 first)
        s32 = torch.tensor(scale, device=device)
        if dtype != torch.float16 and rows < vocab:
            want = torch.mm(grad.t(), (h.float() * s32).to(dtype))
        else:
            want = (torch.mm(grad.t(), h).float() * s32).to(dtype)
        assert torch.equal(got, want)
        if dtype == torch.bfloat16:
            assert not torch.equal(got, torch.mm(grad.t(), h) * torch.tensor(scale, dtype=dtype, device=device))


@pytest.mark.parametrize("device", IMPLS)
def test_fp16_small_probabilities_survive_a_loss_scale(device):
    """fp16 under a loss scale of 2^16 (DeepSpeed's fp16): vocab rows whose probabilities are ~1e-7 had an exactly
    zero weight gradient, because (softmax - onehot) / n_valid was stored in fp16 before backward brought the scale;
    the unfused path scales in fp32 first. The gradient buffer stays fp32 until then: equal to the unfused path's."""
    torch.manual_seed(0)
    n, hidden, vocab = 64, 16, 128
    h = torch.randn(n, hidden)
    h[:, 0] = 4.0
    w = torch.randn(vocab, hidden) * 0.5
    w[:8, 0] = -3.0  # rows 0..7: logits near -12 for every token
    labels = torch.randint(8, vocab, (n,))
    h, w, labels = h.half().to(device), w.half().to(device), labels.to(device)
    grads = {}
    for name, fn in (("fused", linear_cross_entropy), ("unfused", linear_cross_entropy_reference)):
        hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
        (fn(hs, ws, labels) * 2.0**16).backward()
        grads[name] = (hs.grad, ws.grad)
    assert grads["unfused"][1][:8].abs().sum() > 0
    assert (grads["fused"][1][:8] != 0).float().mean() > 0.9
    for got, want in zip(grads["fused"], grads["unfused"]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
