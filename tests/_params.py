"""Parameter sets shared by the op and module tests."""

import pytest
import torch

# the CPU kernel always; the CUDA kernel under the gpu marker (device machine)
IMPLS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]


def device_of(impl: str) -> str:
    """The device an impl's tensors live on: cuda for the CUDA kernel, the CPU for the CPU kernel and the reference."""
    return "cuda" if impl == "cuda" else "cpu"


def assert_checks(results):
    failed = [r.describe() for r in results if not r.passed]
    assert not failed, "\n".join(failed)
