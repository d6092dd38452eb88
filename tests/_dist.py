"""Helpers of the multi-process (gloo, CPU) tests."""

import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_with_deadline(fn, world: int, *args, timeout_s: float = 150) -> None:
    """mp.spawn(fn, (world, port, *args)) with a deadline: a hung collective fails the test instead of
    blocking CI."""
    context = mp.spawn(fn, args=(world, free_port()) + args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{fn.__name__} with {world} processes did not finish within {timeout_s} s")
