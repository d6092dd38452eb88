"""DevicePrefetcher: order, content and container types, one batch ahead of the caller, CPU passthrough
(CPU, milliseconds); the side-stream copy into pinned memory on the GPU (gpu marker)."""

from collections import OrderedDict, namedtuple

import pytest
import torch

from ds_loongforge.data import DevicePrefetcher

Pair = namedtuple("Pair", ["ids", "mask"])


class CountingSource:
    """An iterable whose iterator counts how many batches it has produced."""

    def __init__(self, batches):
        self.batches, self.produced = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.produced += 1
            yield batch


def nested_batches(n):
    return [{"input_ids": torch.randint(0, 100, (2, 8)),
             "extras": [torch.randn(3), (torch.arange(i + 1), "tag", i)],
             "pair": Pair(torch.full((2,), i), torch.ones(2, dtype=torch.bool)),
             "ordered": OrderedDict(a=torch.tensor([i]), b=None)}
            for i in range(n)]


def assert_same_structure_and_values(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu())
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same_structure_and_values(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_structure_and_values(g, w)
    else:
        assert got == want


def test_order_content_and_container_types_kept_for_nested_batches():
    batches = nested_batches(5)
    got = list(DevicePrefetcher(batches, "cpu"))
    assert len(got) == 5
    for g, w in zip(got, batches):
        assert_same_structure_and_values(g, w)


@pytest.mark.parametrize("n", [0, 1, 4])  # empty source, a single batch (no next to prefetch), several
def test_reads_exactly_one_batch_ahead_and_stops(n):
    source = CountingSource(nested_batches(n))
    prefetcher = DevicePrefetcher(source, "cpu")
    assert source.produced == 0 and prefetcher.pending == 0 and len(prefetcher) == n  # construction reads nothing
    for k in range(1, n + 1):
        next(prefetcher)
        assert prefetcher.yielded == k
        assert source.produced == min(k + 1, n)
        assert prefetcher.pending == (1 if k < n else 0)
        assert source.produced == prefetcher.yielded + prefetcher.pending
    with pytest.raises(StopIteration):
        next(prefetcher)
    with pytest.raises(StopIteration):  # stays exhausted
        next(prefetcher)
    assert source.produced == n and prefetcher.yielded == n and prefetcher.pending == 0


def test_source_error_propagates():
    def broken():
        yield {"x": torch.zeros(1)}
        raise KeyError("bad sample 7")

    prefetcher = DevicePrefetcher(broken(), "cpu")
    with pytest.raises(KeyError, match="bad sample 7"):  # raised while prefetching the second batch
        next(prefetcher)


def test_cpu_passthrough_hands_over_the_same_objects():
    batches = nested_batches(3)
    for got, want in zip(DevicePrefetcher(batches, torch.device("cpu")), batches):
        assert got is want
        assert got["input_ids"] is want["input_ids"] and got["extras"][1][0] is want["extras"][1][0]


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device cuda:0 asked for, but CUDA is not available; pass device='cpu'"):
        DevicePrefetcher([], "cuda:0")


@pytest.mark.gpu
def test_gpu_copies_on_a_side_stream_from_pinned_memory(monkeypatch):
    pinned_calls = []
    real_pin = torch.Tensor.pin_memory

    def counting_pin(self, *args, **kwargs):
        pinned_calls.append(self.shape)
        return real_pin(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", counting_pin)
    already_pinned = real_pin(torch.randn(4, 4))
    on_device = torch.randn(2, device="cuda")
    batches = [{"ids": torch.randint(0, 100, (64, 512)), "w": already_pinned, "dev": on_device,
                "nested": [torch.randn(1000, 7), i]} for i in range(3)]
    source = CountingSource(batches)
    prefetcher = DevicePrefetcher(source, "cuda")
    got = []
    for batch in prefetcher:
        assert batch["ids"].is_cuda and batch["nested"][0].is_cuda and batch["w"].is_cuda
        assert batch["dev"] is on_device  # already on the device: not copied
        assert source.produced == prefetcher.yielded + prefetcher.pending
        got.append({"ids": batch["ids"] * 1, "w": batch["w"] + 0, "nested": batch["nested"][0].clone()})
    torch.cuda.synchronize()
    # two unpinned host tensors per batch were pinned; the pinned one was used as it is
    assert pinned_calls == [torch.Size([64, 512]), torch.Size([1000, 7])] * 3
    for g, w in zip(got, batches):
        assert torch.equal(g["ids"].cpu(), w["ids"]) and torch.equal(g["w"].cpu(), w["w"])
        assert torch.equal(g["nested"].cpu(), w["nested"][0])
    assert prefetcher._stream != torch.cuda.current_stream()
