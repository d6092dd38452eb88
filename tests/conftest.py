"""Shared test setup. GPU tests carry the `gpu` marker and run on the device machine
(benchmarks/run_gpu.sh); on a machine without CUDA they are skipped with that reason."""

import glob
import os
import time

import pytest
import torch


def pytest_configure(config):
    """The environment's ninja first on PATH for the whole run, as an activated environment has it: DeepSpeed
    JIT-builds ops of its own in some tests (its CPU all-reduce, its FusedAdam), and a system ninja of another
    release would rebuild them whenever a run from an activated environment came between (the README's
    "Install" section; ours pin it in op_builder.builder.environment_ninja)."""
    from ds_loongforge.op_builder.builder import path_with_environment_ninja

    path = path_with_environment_ninja(os.environ.get("PATH"))
    if path is not None:
        os.environ["PATH"] = path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device: run on the GPU machine via benchmarks/run_gpu.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random data per test, reproducible from the printed seed when a test fails: LF_TEST_SEED=<seed> runs
    with that seed."""
    seed = int(os.environ.get("LF_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})  # {request.node.nodeid}")
    yield


@pytest.fixture(autouse=True)
def _strict_ops_as_found():
    """inject and deepspeed.initialize apply a block's ``strict_ops`` to the whole process (``set_strict_ops``):
    each test leaves the setting as it found it, so a GPU config's ``strict_ops: true`` in one test cannot turn a
    later test's build-failure fallback into an error."""
    from ds_loongforge.ops import _dispatch

    saved = _dispatch._strict_override
    yield
    _dispatch.set_strict_ops(saved)


@pytest.fixture(autouse=True, scope="session")
def _release_deepspeed_shm_buffers():
    """DeepSpeed's CPU all-reduce leaves one /dev/shm buffer per rank of every launcher-style run (69 MB each;
    ds_loongforge.initialize unlinks its engines' own, see deepspeed_hook._release_cpu_allreduce_buffers). The tests
    that call deepspeed.initialize directly leave theirs: removed at the end of the session, those created since it
    began that no live process maps and that are older than a few seconds (a long-lived machine filled its memory
    with them)."""
    from ds_loongforge.integrations.deepspeed_hook import SHM_BUFFER

    start = time.time()
    yield
    pattern = SHM_BUFFER.format(uid=os.getuid(), addr="*", port="*", rank="*")
    now = time.time()  # a buffer seconds old may be another run's, between its creation and its mapping
    left = [path for path in glob.glob(pattern) if start - 1 <= os.stat(path).st_mtime < now - 5]
    if not left:
        return
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split()[-1] for line in f if "deepspeed_allreduce_buffer_" in line)
        except OSError:  # a process that ended, or another user's
            continue
    for path in left:
        if path not in mapped:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
