"""DevicePrefetcher: the next batch's host-to-device copy runs on a side stream while the current step computes.

    for batch in DevicePrefetcher(loader, engine.device):
        engine.backward(engine(**batch).loss)
        engine.step()

A batch is a tensor or any nesting of dicts (Mapping), lists and tuples (namedtuples kept) of tensors and other
values; non-tensor leaves pass through. On CUDA, each ``__next__`` hands over the batch whose copy was started
one call earlier and starts the copy of the one after it: host tensors are pinned when they are not already
(``pin_memory=True``; a DataLoader with ``pin_memory=True`` hands over pinned ones, which are used as they are),
copied with ``non_blocking=True`` on a dedicated stream, and the handed-over tensors are made safe for the
caller's stream: that stream waits on the copy's event (no host synchronization) and each copied tensor is
``record_stream``-ed on it, so the caching allocator does not reuse its memory while the caller's kernels may
still read it. Tensors already on the device are not copied. On the CPU batches pass through unchanged (the same
tensor objects: there is no copy to overlap); any other device gets a plain ``.to(device)``.

Position: the prefetcher reads the source at most one batch ahead of what it has handed over, on every device,
and only from the first ``__next__`` on (constructing it reads nothing). After ``k`` batches were handed over the
source has produced ``k + pending`` of them (``pending`` is 1 while a batch is in flight, 0 before the first
``__next__`` and at the end), so a resumable position (e.g. launch/train.py's) is ``yielded``, or the source's
own count minus ``pending``. It keeps no other state; one prefetcher is one pass over ``iterable``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any, Callable

import torch

_END = object()


class DevicePrefetcher:
    """Iterator over ``iterable``'s batches placed on ``device``, the next one's copy in flight (module doc)."""

    def __init__(self, iterable: Iterable, device: torch.device | str | int, *, pin_memory: bool = True):
        if isinstance(device, int):
            device = torch.device("cuda", device)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"DevicePrefetcher: device {self.device} asked for, but CUDA is not available; pass "
                                 "device='cpu' (or the engine's device)")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._stream = torch.cuda.Stream(self.device)
        self.pin_memory = pin_memory
        self._iterable = iterable
        self._iterator = None
        self._next: Any = None  # (batch, copy-done event or None), _END after the source ran out
        self._yielded = 0

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __len__(self) -> int:
        return len(self._iterable)

    @property
    def pending(self) -> int:
        """Batches read from the source and not handed over yet: 0 or 1."""
        return 0 if self._next is None or self._next is _END else 1

    @property
    def yielded(self) -> int:
        """Batches handed over so far."""
        return self._yielded

    def __next__(self):
        if self._iterator is None:
            self._iterator = iter(self._iterable)
            self._preload()
        if self._next is _END:
            raise StopIteration
        batch, ready = self._next
        self._next = None
        if ready is not None:
            copied, event = ready
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for tensor in copied:
                tensor.record_stream(stream)
        self._preload()
        self._yielded += 1
        return batch

    def _preload(self) -> None:
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._next = _END
            return
        if self.device.type == "cpu":
            self._next = (batch, None)
        elif self.device.type != "cuda":
            self._next = (_map_tensors(batch, lambda t: t.to(self.device)), None)
        else:
            copied: list[torch.Tensor] = []
            with torch.cuda.stream(self._stream):
                moved = _map_tensors(batch, lambda t: self._copy(t, copied))
                event = torch.cuda.Event()
                event.record(self._stream)
            self._next = (moved, (copied, event))

    def _copy(self, tensor: torch.Tensor, copied: list[torch.Tensor]) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor
        if tensor.device.type == "cpu" and self.pin_memory and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        out = tensor.to(self.device, non_blocking=True)
        copied.append(out)
        return out


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor leaf replaced by ``fn(leaf)``; containers keep their type where they can."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, MutableMapping):
        out = copy.copy(obj)  # keeps dict subclasses (BatchEncoding, defaultdict) and their attributes
        for key, value in obj.items():
            out[key] = _map_tensors(value, fn)
        return out
    if isinstance(obj, Mapping):
        return {key: _map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(value, fn) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(value, fn) for value in obj)
    return obj
