"""ds_loongforge.profiler: phase shares and throughput of a real DeepSpeed engine on CPU (one gloo process),
the config-started profiler with periodic reports, region() on and off, wrappers removed by stop(), and the
profiler section of the config."""

import json
import logging
import os
import time

import pytest
import torch
from torch import nn

import deepspeed  # noqa: F401  (an install requirement: a missing one must fail, not skip)

from ds_loongforge import profiler
from ds_loongforge.config import LoongForgeConfigError, parse_config
from tests._dist import spawn_with_deadline

SHARE_TOLERANCE = 1e-6


@pytest.fixture(autouse=True)
def _profiler_off():
    """Every test starts and ends with the profiler off (a failed test must not leave it on for the next)."""
    assert not profiler.is_active()
    yield
    if profiler.is_active():
        profiler.stop()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32))

    def forward(self, x, target):
        return (self.body(x) - target).pow(2).mean()


def _ds_config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 0}, **extra}


def _train(engine, micro_batches: int, data_sleep_s: float):
    for _ in range(micro_batches):
        time.sleep(data_sleep_s)  # the loop fetching its next batch
        x, target = torch.randn(64, 32), torch.randn(64, 32)
        profiler.record_tokens(x.shape[0])
        engine.backward(engine(x, target))
        engine.step()


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _deepspeed_worker(rank, world, port, out_path):
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    import deepspeed

    import ds_loongforge

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    result = {}

    # 1. explicit start on an engine built by stock deepspeed.initialize
    model = _Net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=_ds_config())
    result["wrapped_before_start"] = sorted(n for n in ("forward", "backward", "step") if n in engine.__dict__)
    profiler.start(engine)
    result["wrapped_while_active"] = sorted(n for n in ("forward", "backward", "step") if n in engine.__dict__)
    _train(engine, 6, data_sleep_s=0.01)
    report = profiler.stop()
    result["report"] = report.as_dict()
    result["formatted"] = report.format()
    result["stats"] = profiler.get_training_stats()
    result["wrapped_after_stop"] = sorted(n for n in ("forward", "backward", "step") if n in engine.__dict__)
    result["forward_is_class_method"] = engine.forward.__func__ is type(engine).forward
    _train(engine, 1, data_sleep_s=0)  # still trains after stop()

    # 2. started by the config block, gradient accumulation 2, a report logged every 2 optimizer steps
    handler = _ListHandler()
    logging.getLogger("ds_loongforge").addHandler(handler)
    model = _Net()
    config = _ds_config(gradient_accumulation_steps=2,
                        loongforge={"enabled": True, "profiler": {"enabled": True, "report_every": 2}})
    engine, *_ = ds_loongforge.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=config)
    result["hook_started"] = profiler.is_active()
    _train(engine, 8, data_sleep_s=0.002)
    result["hook_report"] = profiler.stop().as_dict()
    result["hook_stats"] = profiler.get_training_stats()
    result["log"] = handler.messages
    with open(out_path, "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiler") / "result.json"
    spawn_with_deadline(_deepspeed_worker, 1, str(out), timeout_s=300)
    return json.loads(out.read_text())


def test_deepspeed_engine_phases_and_shares(deepspeed_run):
    report = deepspeed_run["report"]
    assert report["steps"] == 6 and report["device"] == "cpu"
    shares, per_step = report["shares"], report["ms_per_step"]
    assert set(shares) == {"forward", "backward", "all_to_all", "optimizer", "data", "idle"}
    assert sum(shares.values()) == pytest.approx(1.0, abs=SHARE_TOLERANCE)
    for phase in ("forward", "backward", "optimizer"):
        assert per_step[phase] > 0, (phase, per_step)
    assert per_step["all_to_all"] == 0  # no expert parallelism in this model
    # five data gaps (step end -> next forward) of >= 10 ms sleep each, over six steps
    assert report["total_ms"]["data"] >= 5 * 10
    assert report["window_ms"] == pytest.approx(sum(report["total_ms"].values()), rel=1e-6)
    assert "forward" in deepspeed_run["formatted"] and "6 steps" in deepspeed_run["formatted"]


def test_deepspeed_training_stats(deepspeed_run):
    stats, report = deepspeed_run["stats"], deepspeed_run["report"]
    assert stats["steps"] == 6 and stats["tokens"] == 6 * 64
    assert stats["tokens_per_s"] == pytest.approx(stats["tokens"] / (report["window_ms"] / 1e3), rel=1e-6)
    assert 0 < stats["step_time_median_ms"] <= report["window_ms"]
    assert stats["gpu_utilization_pct"] is None and "no CUDA device" in stats["gpu_utilization_note"]


def test_wrappers_only_while_active(deepspeed_run):
    assert deepspeed_run["wrapped_before_start"] == []
    assert deepspeed_run["wrapped_while_active"] == ["backward", "forward", "step"]
    assert deepspeed_run["wrapped_after_stop"] == []
    assert deepspeed_run["forward_is_class_method"]


def test_config_started_profiler_counts_optimizer_steps_and_reports(deepspeed_run):
    assert deepspeed_run["hook_started"]
    report = deepspeed_run["hook_report"]
    assert report["steps"] == 4  # 8 micro-batches, gradient accumulation 2
    assert sum(report["shares"].values()) == pytest.approx(1.0, abs=SHARE_TOLERANCE)
    assert deepspeed_run["hook_stats"]["tokens"] == 8 * 64
    log = deepspeed_run["log"]
    assert any("[LoongForge] profiler: on (a report every 2 steps)" in m for m in log), log
    reports = [m for m in log if m.startswith("[LoongForge] profile of steps")]
    assert [m.splitlines()[0] for m in reports] == ["[LoongForge] profile of steps 1-2",
                                                    "[LoongForge] profile of steps 3-4"]
    assert all("2 steps" in m and "backward" in m for m in reports)


class _FakeEngine(nn.Module):
    """forward / backward / step of known durations; global_steps advances like DeepSpeed's."""

    def __init__(self):
        super().__init__()
        self.global_steps = 0

    def forward(self, x):
        time.sleep(0.010)
        return x

    def backward(self, loss):
        time.sleep(0.020)

    def step(self):
        time.sleep(0.005)
        self.global_steps += 1


def test_phase_durations_data_and_idle_on_known_sleeps():
    engine = _FakeEngine()
    profiler.start(engine, tokens_per_step=100)
    for _ in range(4):
        time.sleep(0.015)  # data
        out = engine(1)
        time.sleep(0.008)  # loop work between forward and backward: idle
        engine.backward(out)
        engine.step()
    report = profiler.stop()
    per_step = report.ms_per_step
    assert report.steps == 4 and sum(report.shares.values()) == pytest.approx(1.0, abs=SHARE_TOLERANCE)
    # sleeps last at least as long as asked; a loaded machine can stretch them, hence loose upper bounds
    assert 10 <= per_step["forward"] < 40 and 20 <= per_step["backward"] < 60 and 5 <= per_step["optimizer"] < 30
    assert 0.75 * 15 <= per_step["data"] < 45  # three data gaps inside the window over four steps
    assert 8 <= per_step["idle"] < 30
    # on the CPU the device clock is the host's: each phase's host time is its time
    host = report.host_ms_per_step
    for phase in ("forward", "backward", "optimizer", "data"):
        assert host[phase] == pytest.approx(per_step[phase], abs=1.0), (phase, host, per_step)
    assert "host ms/step" in report.format()
    stats = profiler.get_training_stats()
    assert stats["tokens"] == 400 and stats["steps"] == 4
    assert stats["step_time_median_ms"] >= 10 + 8 + 20 + 5


def test_region_is_a_shared_noop_when_inactive():
    assert profiler.region("all_to_all") is profiler.region("all_to_all")
    with profiler.region("all_to_all"):
        pass
    profiler.record_tokens(5)  # ignored while off
    engine = _FakeEngine()
    assert "forward" not in engine.__dict__  # nothing installed without start()


def test_region_records_time_when_active_and_is_exclusive():
    profiler.start(device="cpu")
    with profiler.region("forward"):
        time.sleep(0.010)
        with profiler.region("all_to_all"):
            time.sleep(0.020)
    with profiler.region("all_to_all"):
        time.sleep(0.005)
    report = profiler.stop()
    assert report.steps == 0 and report.ms_per_step == {}
    assert report.total_ms["all_to_all"] >= 25
    assert 10 <= report.total_ms["forward"] < report.total_ms["all_to_all"]  # the nested 20 ms not counted twice
    assert report.host_ms_per_step == {}  # no step completed: no per-step figures
    assert sum(report.shares.values()) == pytest.approx(1.0, abs=SHARE_TOLERANCE)
    assert profiler.region("all_to_all") is profiler.region("x")  # off again


def test_region_in_moe_exchange_is_timed(monkeypatch):
    """ExpertMaskedMoE's exchange launches and waits, forward and backward, sit inside region("all_to_all")."""
    from ds_loongforge.modules import moe

    class SlowWork:
        def wait(self):
            time.sleep(0.005)

    def slow_all_to_all_single(out, x, *args, **kwargs):
        time.sleep(0.010)
        out.copy_(x)
        return SlowWork()

    monkeypatch.setattr(moe.dist, "all_to_all_single", slow_all_to_all_single)
    x = torch.randn(3, 4, requires_grad=True)
    profiler.start(device="cpu")
    with profiler.region("forward"):
        y = moe.all_to_all_wait(*moe.all_to_all_start(x, torch.empty(3, 4), [3], [3], None))
    with profiler.region("backward"):
        y.sum().backward()
    report = profiler.stop()
    # two launches of >= 10 ms and two waits of >= 5 ms; forward and backward keep only their own time
    assert report.total_ms["all_to_all"] >= 30
    assert report.total_ms["forward"] < 10 and report.total_ms["backward"] < 10
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones(3, 4))


def test_errors_name_the_value_and_the_fix():
    with pytest.raises(RuntimeError, match=r"not active; call profiler.start\(engine\) first"):
        profiler.stop()
    with pytest.raises(ValueError, match=r"tokens_per_step must be an integer >= 1 or None, got 0"):
        profiler.start(tokens_per_step=0)
    with pytest.raises(ValueError, match=r"report_every=3 counts engine.step calls; pass the engine"):
        profiler.start(report_every=3)
    with pytest.raises(ValueError, match=r"engine must be a DeepSpeed engine.*Linear has no \['backward', 'step'\]"):
        profiler.start(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"n must be a host int .* got Tensor"):
        profiler.record_tokens(torch.tensor(3))
    with pytest.raises(ValueError, match=r"n must be >= 0, got -1"):
        profiler.record_tokens(-1)
    profiler.start(device="cpu")
    with pytest.raises(RuntimeError, match=r"already active; call profiler.stop\(\)"):
        profiler.start(device="cpu")
    with profiler.region("forward"):
        with pytest.raises(RuntimeError, match=r"inside the profiled phase\(s\) \['forward'\]"):
            profiler.stop()
    profiler.stop()


def test_profiler_config_section():
    cfg = parse_config({"loongforge": {"enabled": True}})
    assert cfg.profiler.enabled is False and cfg.profiler.report_every == 0
    cfg = parse_config({"loongforge": {"profiler": {"enabled": True, "report_every": 50}}})
    assert cfg.profiler.enabled and cfg.profiler.report_every == 50
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.profiler\.every = 100: unknown key; .*report_every"):
        parse_config({"loongforge": {"profiler": {"enabled": True, "every": 100}}})
    with pytest.raises(LoongForgeConfigError, match=r"report_every=5 reports nothing while enabled is false"):
        parse_config({"loongforge": {"profiler": {"report_every": 5}}})  # a report asked for, never made
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.profiler\.report_every = -1"):
        parse_config({"loongforge": {"profiler": {"report_every": -1}}})


def test_stop_restores_an_instance_attribute_the_engine_already_had():
    engine = _FakeEngine()
    custom_step = engine.step
    engine.step = custom_step  # e.g. another tool's wrapper, set on the instance before start()
    profiler.start(engine)
    assert engine.step is not custom_step and engine.__dict__["step"].__wrapped__ is custom_step
    profiler.stop()
    assert engine.__dict__["step"] is custom_step and "forward" not in engine.__dict__


class _CudaEngine(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2048, 2048, device="cuda")
        self.opt = torch.optim.SGD(self.lin.parameters(), lr=1e-3)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.global_steps = 0

    def forward(self, x):
        return self.lin(x).square().mean()

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()
        self.global_steps += 1


@pytest.mark.gpu
def test_cuda_events_are_read_without_a_synchronize_per_step(monkeypatch):
    engine = _CudaEngine()
    x = torch.randn(4096, 2048, device="cuda")
    waits = []
    real_event_sync = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: waits.append("device"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: waits.append("event") or real_event_sync(self))
    profiler.start(engine, tokens_per_step=4096)
    for _ in range(8):
        engine.backward(engine(x))
        engine.step()
    assert waits == []  # the loop never waited for the device
    report = profiler.stop()
    assert report.device.startswith("cuda") and report.steps == 8
    assert sum(report.shares.values()) == pytest.approx(1.0, abs=SHARE_TOLERANCE)
    for phase in ("forward", "backward", "optimizer"):
        assert report.ms_per_step[phase] > 0, report.format()
    stats = profiler.get_training_stats()
    assert stats["tokens"] == 8 * 4096 and stats["tokens_per_s"] > 0
    assert stats["gpu_utilization_pct"] is not None or "NVML unavailable" in stats["gpu_utilization_note"]


class _HostOrDeviceBoundEngine(_CudaEngine):
    """forward sleeps 30 ms on the host with nothing queued (bound by the host); backward queues ~30 ms of GPU
    work and returns at once (bound by the device); step waits for the device, so each step starts idle."""

    def __init__(self):
        super().__init__()
        # cycles at the SM clock (MHz), read once: torch.cuda.clock_rate() asks NVML, which took 9 ms per call on
        # the H200, host time that would land in the phase meant to have almost none
        self.cycles_30ms = int(30e-3 * torch.cuda.clock_rate() * 1e6)

    def forward(self, x):
        time.sleep(0.030)
        return x

    def backward(self, loss):
        torch.cuda._sleep(self.cycles_30ms)

    def step(self):
        torch.cuda.synchronize()
        self.global_steps += 1


@pytest.mark.gpu
def test_host_and_device_times_tell_a_launch_bound_phase_from_a_device_bound_one():
    engine = _HostOrDeviceBoundEngine()
    x = torch.zeros((), device="cuda")
    # one untimed step first: the first torch.cuda._sleep loads its kernel's module on the host (lazy loading),
    # which put ~35 ms of host time into the first backward on the H200 (mean 8.8 ms over 4 steps)
    engine.backward(engine(x))
    engine.step()
    profiler.start(engine)
    for _ in range(4):
        engine.backward(engine(x))
        engine.step()
    report = profiler.stop()
    device, host = report.ms_per_step, report.host_ms_per_step
    assert host["forward"] >= 30 and device["forward"] <= host["forward"] + 1, report.format()
    assert host["backward"] < 5 < 15 < device["backward"], report.format()
    assert host["optimizer"] > 15 > device["optimizer"], report.format()  # the wait is the host's


def test_region_only_session_keeps_a_bounded_backlog():
    profiler.start(device="cpu")
    for _ in range(profiler.FOLD_AT_PENDING + 100):
        with profiler.region("all_to_all"):
            pass
    assert len(profiler._session.pending) <= profiler.FOLD_AT_PENDING
    report = profiler.stop()
    assert report.total_ms["all_to_all"] > 0 and sum(report.shares.values()) == pytest.approx(1.0, abs=SHARE_TOLERANCE)


def test_training_stats_inside_the_first_region_are_an_empty_window():
    """Asked for while the first phase is still open (nothing closed yet): zero steps over an empty window, not a
    TypeError from the window's missing end."""
    profiler.start(device="cpu")
    with profiler.region("forward"):
        stats = profiler.get_training_stats()
    assert stats["steps"] == 0 and stats["window_s"] == 0.0 and stats["tokens_per_s"] is None
    profiler.stop()
