"""Training-loop profiler: where a step's time goes, and the throughput.

    from ds_loongforge import profiler

    profiler.start(engine)                      # wraps this engine's forward / backward / step
    for batch in loader:
        profiler.record_tokens(batch["input_ids"].numel())
        engine.backward(engine(**batch).loss)
        engine.step()
    print(profiler.stop().format())             # restores the engine's own methods
    profiler.get_training_stats()               # tokens/s, steps, median step time, NVML GPU utilisation

``"loongforge": {"profiler": {"enabled": true}}`` starts it from the config (``report_every`` N logs the report
of each N optimizer steps through the ``ds_loongforge`` logger).

Phases. forward = ``engine.forward``, backward = ``engine.backward``, optimizer = ``engine.step``,
all_to_all = ``region("all_to_all")`` (ExpertMaskedMoE's expert-parallel exchanges: the split-size exchange,
every async launch and every wait, in forward and in backward), data = from the end of one ``engine.step`` to
the start of the next forward (the loop's host work between steps, mostly fetching the next batch). Times are
exclusive: a region inside a phase is subtracted from that phase (all_to_all from forward and backward), so
the phases never overlap. The window runs from the start of the first phase to the end of the latest one;
idle = window - sum of the phases, floored at 0: time in no phase (the loop's own work between engine
calls, such as a loss computed outside the model), during which the profiled stream had nothing queued by
the engine. The shares (phases and idle) sum to 1. ``steps`` counts optimizer steps (``engine.global_steps``
advanced), so with gradient accumulation one step covers several forward/backward calls.

Clocks. On CUDA every boundary is a ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream,
so durations are on the GPU's timeline: the all_to_all region around a wait is the time the compute stream
waited for the exchange, and data is the time the stream waited for the host to start the next forward.
Host. Every boundary also takes ``time.perf_counter()`` (no device call): ``host_ms_per_step`` is the time the
Python thread spent inside each phase, issuing its work. A phase whose host time exceeds its device time was
issued more slowly than the device ran it (the device waited for the host, a launch-bound phase); one whose
device time is longer ran with work queued ahead. Backward's host time is that of ``engine.backward`` returning
(autograd's device thread issues the kernels meanwhile). On the CPU both clocks are the host's.
Events are read only once complete: at each step end the completed ones are folded in with a non-blocking
``query()``; the host waits for events only in ``stop()``, ``get_training_stats()`` and every ``report_every``
steps. On any other device the boundaries are ``time.perf_counter()`` on the host.

Off (the default) nothing is wrapped, ``region()`` returns one shared no-op context manager and
``record_tokens`` only checks its argument: no event, no synchronize, no extra call in the training loop.
Engine calls made through ``loss.backward()`` instead of ``engine.backward`` are not seen (they count as idle).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import numbers
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("ds_loongforge")

PHASES = ("forward", "backward", "all_to_all", "optimizer", "data")
GPU_UTILIZATION_PERIOD_S = 0.5  # NVML averages over 1/6 s to 1 s; sampling faster only repeats a value
FOLD_AT_PENDING = 4096  # region-only sessions have no step end to fold at: bound the closed spans kept unread

_NULL_REGION = contextlib.nullcontext()
_MISSING = object()
_session: _Session | None = None       # the active profiling session
_last_session: _Session | None = None  # the stopped one, for get_training_stats() after stop()


@dataclass(frozen=True)
class ProfileReport:
    """Where the time of a profiled window went. ``total_ms``, ``shares`` and ``ms_per_step`` have one entry per
    phase seen (forward, backward, all_to_all, optimizer, data, any other region name) plus ``idle``;
    ``ms_per_step`` is empty when no optimizer step completed in the window."""

    steps: int
    window_ms: float
    device: str
    total_ms: dict[str, float]
    shares: dict[str, float]
    ms_per_step: dict[str, float]
    host_ms_per_step: dict[str, float] = dataclasses.field(default_factory=dict)  # the Python thread's time

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def format(self) -> str:
        lines = [f"LoongForge profile: {self.steps} steps, {self.window_ms / 1e3:.3f} s on {self.device}",
                 f"  {'phase':<12}{'share':>8}{'ms/step':>12}{'total ms':>12}{'host ms/step':>14}"]
        for name, total in self.total_ms.items():
            per_step = f"{self.ms_per_step[name]:.2f}" if name in self.ms_per_step else "-"
            host = f"{self.host_ms_per_step[name]:.2f}" if name in self.host_ms_per_step else "-"
            lines.append(f"  {name:<12}{self.shares[name]:>8.1%}{per_step:>12}{total:>12.1f}{host:>14}")
        return "\n".join(lines)


def start(engine=None, tokens_per_step: int | None = None, *, report_every: int = 0,
          device: torch.device | str | None = None) -> None:
    """Start profiling. With ``engine`` (a DeepSpeed engine), its ``forward``, ``backward`` and ``step`` are
    wrapped on that instance until :func:`stop`; without it only :func:`region` blocks are timed.
    ``tokens_per_step`` gives tokens/s when the loop does not call :func:`record_tokens`. ``report_every`` N > 0
    logs the report of every N optimizer steps. ``device`` picks the clock (default: the engine's device, else
    CUDA when available): CUDA events on a CUDA device, ``time.perf_counter`` otherwise."""
    global _session
    if _session is not None:
        raise RuntimeError("ds_loongforge.profiler is already active; call profiler.stop() before starting it "
                           "again")
    if tokens_per_step is not None and (not isinstance(tokens_per_step, int) or tokens_per_step < 1):
        raise ValueError(f"profiler.start: tokens_per_step must be an integer >= 1 or None, got {tokens_per_step!r}")
    if not isinstance(report_every, int) or report_every < 0:
        raise ValueError(f"profiler.start: report_every must be an integer >= 0 (0 = no periodic report), got "
                         f"{report_every!r}")
    if report_every and engine is None:
        raise ValueError(f"profiler.start: report_every={report_every} counts engine.step calls; pass the engine "
                         "or use report_every=0")
    if engine is not None:
        _check_engine(engine)
    if device is None:
        device = getattr(engine, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    clock = _CudaClock(device) if device.type == "cuda" else _HostClock(device)
    session = _Session(clock, engine, tokens_per_step, report_every)
    if engine is not None:
        session.install()
    _session = session


def stop() -> ProfileReport:
    """Stop profiling, restore the engine's methods and return the report of the whole window (the one place
    that waits for the device)."""
    global _session, _last_session
    session = _session
    if session is None:
        raise RuntimeError("profiler.stop(): the profiler is not active; call profiler.start(engine) first")
    if session.open:
        raise RuntimeError(f"profiler.stop() called inside the profiled phase(s) "
                           f"{[span.name for span in session.open]}; call it between training steps")
    _session = None
    _last_session = session
    session.uninstall()
    session.fold(block=True)
    return session.report(session.totals(), None)


def is_active() -> bool:
    return _session is not None


def record_tokens(n: int) -> None:
    """Count ``n`` tokens (a host integer, e.g. ``batch["input_ids"].numel()``) towards tokens/s; a no-op while
    the profiler is off."""
    if type(n) is not int and (isinstance(n, bool) or not isinstance(n, numbers.Integral)):
        raise TypeError(f"profiler.record_tokens: n must be a host int (e.g. batch['input_ids'].numel()), got "
                        f"{type(n).__name__}; reading a CUDA tensor's value would synchronize the device")
    if n < 0:
        raise ValueError(f"profiler.record_tokens: n must be >= 0, got {n}")
    session = _session
    if session is not None:
        session.tokens += int(n)
        session.tokens_recorded = True


def region(name: str):
    """Context manager timing its block as phase ``name`` while the profiler is active (nested in the phase that
    is open, which loses that time); when off, one shared no-op context manager."""
    session = _session
    if session is None:
        return _NULL_REGION
    return _Region(session, name)


def get_training_stats() -> dict[str, Any]:
    """Throughput of the active window (waits for the device once), or of the last one after :func:`stop`:
    ``steps``, ``window_s``, ``tokens`` (recorded, else ``tokens_per_step * steps``, else None),
    ``tokens_per_s``, ``step_time_median_ms``, ``gpu_utilization_pct`` (mean of NVML samples taken at step ends,
    at most one per 0.5 s) and ``gpu_utilization_note`` (the sample count, or why there is no value)."""
    session = _session or _last_session
    if session is None:
        raise RuntimeError("profiler.get_training_stats(): the profiler was never started; call "
                           "profiler.start(engine) first")
    if session is _session:
        session.fold(block=True)
    totals = session.totals()
    window_s = totals.window_ms / 1e3
    tokens = session.tokens if session.tokens_recorded else (
        session.tokens_per_step * totals.steps if session.tokens_per_step else None)
    samples = session.gpu_utilization
    return {"steps": totals.steps, "window_s": window_s, "tokens": tokens,
            "tokens_per_s": tokens / window_s if tokens is not None and window_s > 0 else None,
            "step_time_median_ms": statistics.median(session.step_ms) if session.step_ms else None,
            "gpu_utilization_pct": sum(samples) / len(samples) if samples else None,
            "gpu_utilization_note": (f"mean of {len(samples)} NVML samples" if samples
                                     else session.gpu_utilization_note)}


def _check_engine(engine) -> None:
    missing = [name for name in ("forward", "backward", "step") if not callable(getattr(engine, name, None))]
    if missing:
        raise ValueError(f"profiler.start: engine must be a DeepSpeed engine (forward, backward, step); "
                         f"{type(engine).__name__} has no {missing}")
    if hasattr(engine, "train_batch") and type(engine).__name__ == "PipelineEngine":
        raise ValueError("profiler.start: a DeepSpeed PipelineEngine runs forward, backward and step inside "
                         "train_batch(); profile it with region() blocks and start(engine=None)")


class _HostClock:
    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def ready(mark: float) -> bool:
        return True

    @staticmethod
    def wait(mark: float) -> None:
        return None

    @staticmethod
    def elapsed_ms(start: float, end: float) -> float:
        return (end - start) * 1e3


class _CudaClock:
    def __init__(self, device: torch.device):
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def ready(mark: torch.cuda.Event) -> bool:
        return mark.query()

    @staticmethod
    def wait(mark: torch.cuda.Event) -> None:
        mark.synchronize()

    @staticmethod
    def elapsed_ms(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)


class _Span:
    __slots__ = ("name", "start", "end", "parent", "host_start", "host_end")

    def __init__(self, name: str, start, parent: _Span | None, host_start: float):
        self.name, self.start, self.end, self.parent = name, start, None, parent
        self.host_start, self.host_end = host_start, None


class _Region:
    __slots__ = ("session", "name", "span")

    def __init__(self, session: _Session, name: str):
        self.session, self.name = session, name

    def __enter__(self):
        self.span = self.session.open_span(self.name)

    def __exit__(self, *exc):
        self.session.close_span(self.span)
        return False


@dataclass
class _Totals:
    """Cumulative figures since start(); a report covers the difference of two snapshots."""

    window_ms: float
    busy_ms: float
    phase_ms: dict[str, float]
    steps: int
    step_count: int  # entries of step_ms
    host_ms: dict[str, float] = dataclasses.field(default_factory=dict)


class _Session:
    def __init__(self, clock, engine, tokens_per_step: int | None, report_every: int):
        self.clock, self.engine = clock, engine
        self.tokens_per_step, self.report_every = tokens_per_step, report_every
        # one stack for all threads, not a thread-local: autograd runs CUDA backward (and its all_to_all
        # regions) on a device thread while the caller waits inside engine.backward
        self.open: list[_Span] = []
        self.pending: deque[_Span] = deque()  # closed, not yet read
        self.phase_ms: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.host_ms: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.busy_ms = 0.0                    # sum of the top-level spans
        self.first = None                     # start mark of the first span: the window's start
        self.last = None                      # end mark of the latest top-level span: the window's end
        self.last_step_end = None             # until the next forward claims it as the start of a data span
        self.last_step_host_end = 0.0
        self.previous_step_end = None
        self.pending_steps: deque = deque()   # (start, end) marks of optimizer steps not yet read
        self.step_ms: list[float] = []
        self.steps = 0
        self.tokens, self.tokens_recorded = 0, False
        self.gpu_utilization: list[float] = []
        self.gpu_utilization_note = (None if clock.device.type == "cuda"
                                     else f"no CUDA device (profiled on {clock.device.type})")
        self.next_gpu_sample = 0.0
        self.saved: dict[str, Any] = {}
        self.last_report: _Totals | None = None

    # ---- spans

    def open_span(self, name: str) -> _Span:
        span = _Span(name, self.clock.mark(), self.open[-1] if self.open else None, time.perf_counter())
        if self.first is None:
            self.first = span.start
        self.open.append(span)
        return span

    def close_span(self, span: _Span) -> None:
        span.end = self.clock.mark()
        span.host_end = time.perf_counter()
        top = self.open.pop()
        assert top is span, f"profiler spans closed out of order: {top.name} open, {span.name} closing"
        if span.parent is None:
            self.last = span.end
        self.pending.append(span)
        if len(self.pending) > FOLD_AT_PENDING:
            self.fold(block=False)

    def fold(self, block: bool) -> None:
        """Read the closed spans whose marks are complete (all of them, waiting, when ``block``)."""
        clock = self.clock
        if block:
            for span in self.pending:
                clock.wait(span.end)
        while self.pending and clock.ready(self.pending[0].end):
            span = self.pending.popleft()
            ms = clock.elapsed_ms(span.start, span.end)
            host_ms = (span.host_end - span.host_start) * 1e3
            self.phase_ms[span.name] = self.phase_ms.get(span.name, 0.0) + ms
            self.host_ms[span.name] = self.host_ms.get(span.name, 0.0) + host_ms
            if span.parent is None:
                self.busy_ms += ms
            else:
                self.phase_ms[span.parent.name] -= ms
                self.host_ms[span.parent.name] -= host_ms
        while self.pending_steps and (block or clock.ready(self.pending_steps[0][1])):
            begin, end = self.pending_steps.popleft()
            self.step_ms.append(clock.elapsed_ms(begin, end))

    def totals(self) -> _Totals:
        """Cumulative figures; call after ``fold(block=True)``."""
        # no closed phase yet (asked for inside the first one): an empty window
        window = self.clock.elapsed_ms(self.first, self.last) if self.first is not None and self.last is not None else 0.0
        return _Totals(window, self.busy_ms, dict(self.phase_ms), self.steps, len(self.step_ms), dict(self.host_ms))

    def report(self, now: _Totals, since: _Totals | None) -> ProfileReport:
        if since is None:
            since = _Totals(0.0, 0.0, {}, 0, 0)
        window = now.window_ms - since.window_ms
        busy = now.busy_ms - since.busy_ms
        total = {name: max(0.0, ms - since.phase_ms.get(name, 0.0)) for name, ms in now.phase_ms.items()}
        total["idle"] = max(0.0, window - busy)
        # the phases are sequential on one timeline, so busy <= window; the max() keeps the shares summing to 1
        # should events of several streams overlap
        denominator = max(window, busy)
        shares = {name: ms / denominator if denominator > 0 else 0.0 for name, ms in total.items()}
        steps = now.steps - since.steps
        per_step = {name: ms / steps for name, ms in total.items()} if steps else {}
        host = {name: max(0.0, ms - since.host_ms.get(name, 0.0)) / steps
                for name, ms in now.host_ms.items()} if steps else {}
        return ProfileReport(steps, window, str(self.clock.device), total, shares, per_step, host)

    # ---- engine wrappers

    def install(self) -> None:
        engine = self.engine
        for name, wrap in (("forward", self._wrap_forward), ("backward", self._wrap_backward),
                           ("step", self._wrap_step)):
            self.saved[name] = engine.__dict__.get(name, _MISSING)
            setattr(engine, name, wrap(getattr(engine, name)))

    def uninstall(self) -> None:
        for name, previous in self.saved.items():
            if previous is _MISSING:
                delattr(self.engine, name)
            else:
                setattr(self.engine, name, previous)
        self.saved.clear()

    def _wrap_forward(self, original):
        @functools.wraps(original)
        def forward(*args, **kwargs):
            span = self.open_span("forward")
            if self.last_step_end is not None and span.parent is None:
                data = _Span("data", self.last_step_end, None, self.last_step_host_end)
                data.end, data.host_end = span.start, span.host_start
                self.pending.append(data)
                self.last_step_end = None
            try:
                return original(*args, **kwargs)
            finally:
                self.close_span(span)
        return forward

    def _wrap_backward(self, original):
        @functools.wraps(original)
        def backward(*args, **kwargs):
            span = self.open_span("backward")
            try:
                return original(*args, **kwargs)
            finally:
                self.close_span(span)
        return backward

    def _wrap_step(self, original):
        engine = self.engine

        @functools.wraps(original)
        def step(*args, **kwargs):
            global_steps = getattr(engine, "global_steps", None)
            span = self.open_span("optimizer")
            try:
                result = original(*args, **kwargs)
            finally:
                self.close_span(span)
            if span.parent is None:
                self.last_step_end, self.last_step_host_end = span.end, span.host_end
            if global_steps is None or engine.global_steps != global_steps:
                self._end_of_step(span.end)
            return result
        return step

    def _end_of_step(self, mark) -> None:
        self.steps += 1
        self.pending_steps.append((self.first if self.previous_step_end is None else self.previous_step_end, mark))
        self.previous_step_end = mark
        self.fold(block=False)
        self._sample_gpu_utilization()
        if self.report_every and self.steps % self.report_every == 0:
            self.fold(block=True)
            now = self.totals()
            report = self.report(now, self.last_report)
            first_step = (self.last_report.steps if self.last_report else 0) + 1
            self.last_report = now
            logger.info("[LoongForge] profile of steps %d-%d\n%s", first_step, self.steps, report.format())

    def _sample_gpu_utilization(self) -> None:
        if self.gpu_utilization_note is not None or time.monotonic() < self.next_gpu_sample:
            return
        self.next_gpu_sample = time.monotonic() + GPU_UTILIZATION_PERIOD_S
        try:
            percent = torch.cuda.utilization(self.clock.device)
        except nvml_errors() as err:  # no pynvml / no NVML driver: reported as the reason, not retried
            self.gpu_utilization_note = f"NVML unavailable ({type(err).__name__}: {err}); install nvidia-ml-py"
            return
        self.gpu_utilization.append(float(percent))


def nvml_errors() -> tuple[type[BaseException], ...]:
    """What ``torch.cuda.utilization`` raises without a working NVML: ModuleNotFoundError without pynvml,
    RuntimeError without a driver, pynvml's NVMLError for the rest."""
    try:
        from pynvml import NVMLError
    except ImportError:
        return ImportError, RuntimeError
    return ImportError, RuntimeError, NVMLError


__all__ = ["PHASES", "ProfileReport", "start", "stop", "is_active", "record_tokens", "region",
           "get_training_stats"]
