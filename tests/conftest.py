"""Shared test setup. GPU tests carry the `gpu` marker and run on the device machine
(benchmarks/run_gpu.sh); on a machine without CUDA they are skipped with that reason."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device: run on the GPU machine via benchmarks/run_gpu.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random data per test, reproducible from the printed seed when a test fails."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})  # {request.node.nodeid}")
    yield
