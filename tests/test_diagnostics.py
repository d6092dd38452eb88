"""ds_loongforge.diagnostics on synthetic profiler events and allocation traces (the GPU runs are in
tests/launch/test_train.py::test_kernel_profile_and_memory_snapshot_on_cuda)."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from ds_loongforge import diagnostics as d
from ds_loongforge.diagnostics import HostSyncRecorder


def _event(name, start, end, device=DeviceType.CUDA, annotation=False, parent=None, id=0):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           is_user_annotation=annotation, cpu_parent=parent, id=id)


class _Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


@pytest.mark.parametrize("name,category", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("void rmsnorm_bwd_kernel<__nv_bfloat16, 4>", "loongforge"),
    ("void adamw_kernel<float, __nv_bfloat16>", "loongforge"),
    ("void at::native::elementwise_kernel<128, 2, ...>", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::reduce_kernel<512, 1, ...>", "reduction"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
    ("some_unknown_kernel", "other"),
    ("void at::native::elementwise_kernel<128, 4, gpu_kernel_impl_nocast<...lambda()#1...>>", "elementwise"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>", "optimizer"),
])
def test_kernel_category(name, category):
    assert d.kernel_category(name) == category


def test_kernel_timeline_busy_gaps_categories_and_ranges():
    cpu_op = _event("aten::linear", 0, 100, device=DeviceType.CPU)
    events = [
        cpu_op,
        _event("forward", 0, 50, annotation=True),
        _event("backward", 50, 100, annotation=True),
        _event("nvjet_sm90_gemm", 0, 20),          # forward gemm
        _event("elementwise_kernel", 15, 25),      # overlaps the gemm by 5 us (another stream)
        _event("nvjet_sm90_gemm", 40, 48),         # 15 us gap before it, in the forward
        _event("reduce_kernel", 60, 70),           # 12 us gap, backward
        _event("nvjet_sm90_gemm", 72, 100),
    ]
    t = d.kernel_timeline(_Prof(events), iters=2, top=10, gap_threshold_us=5)
    assert t["kernels_per_iter"] == 2.5
    # busy = union of [0,25], [40,48], [60,70], [72,100] = 25 + 8 + 10 + 28 = 71 us over 2 iterations
    assert t["busy_ms_per_iter"] == pytest.approx(71 / 2 / 1e3, abs=1e-3)
    assert t["span_ms_per_iter"] == pytest.approx(100 / 2 / 1e3, abs=1e-3)
    # gaps over 5 us: 25->40 (15) and 48->60 (12); 70->72 (2) is under the threshold
    assert [g["gap_us"] for g in t["top_gaps_us"]] == [15.0, 12.0]
    assert t["top_gaps_us"][0]["cpu_ops_during"] == ["aten::linear"]
    assert t["gap_ms_per_iter_over_threshold"] == pytest.approx(27 / 2 / 1e3, abs=1e-3)
    assert t["category_ms_per_iter"]["gemm"] == pytest.approx((20 + 8 + 28) / 2 / 1e3, abs=1e-3)
    forward, backward = t["range_category_ms_per_iter"]["forward"], t["range_category_ms_per_iter"]["backward"]
    assert forward["gemm"] == pytest.approx(28 / 2 / 1e3, abs=1e-3)
    assert forward["elementwise"] == pytest.approx(10 / 2 / 1e3, abs=1e-3)
    assert backward == {"total": pytest.approx(38 / 2 / 1e3, abs=1e-3), "gemm": pytest.approx(0.014, abs=1e-3),
                        "reduction": pytest.approx(0.005, abs=1e-3)}
    assert t["top_kernels"][0]["name"] == "nvjet_sm90_gemm" and t["top_kernels"][0]["calls_per_iter"] == 1.5
    assert "forward" in d.format_kernel_timeline(t)


def test_kernel_timeline_host_ranges():
    """The host's time in each annotated range and how far it ran ahead of the GPU: over 2 iterations the host
    issues the forward 10 us (then 30 us) before the GPU starts it and the step 20 us (then 50 us) before."""
    cpu = DeviceType.CPU
    events = [
        _event("forward", 0, 40, device=cpu), _event("forward", 100, 120, device=cpu),
        _event("step", 40, 44, device=cpu), _event("step", 120, 126, device=cpu),
        _event("forward", 10, 60, annotation=True), _event("forward", 130, 170, annotation=True),
        _event("step", 60, 80, annotation=True), _event("step", 170, 190, annotation=True),
        _event("nvjet_sm90_gemm", 10, 60), _event("adamw_kernel", 60, 80),
        _event("nvjet_sm90_gemm", 130, 170), _event("adamw_kernel", 170, 190),
    ]
    host = d.kernel_timeline(_Prof(events), iters=2)["host_ranges"]
    assert host["forward"] == {"host_ms_per_iter": pytest.approx(0.030), "host_lead_ms": pytest.approx(0.020)}
    assert host["step"] == {"host_ms_per_iter": pytest.approx(0.005), "host_lead_ms": pytest.approx(0.035)}
    t = d.kernel_timeline(_Prof(events), iters=2)
    assert "lead" in d.format_kernel_timeline(t)


def test_annotate_modules_puts_each_forward_in_its_range():
    """Every forward of the annotated modules is one profiler range of its group's name (nested in the caller's
    ranges), also when one module runs twice; removing the handles takes the ranges off."""
    from torch import nn

    attn, mlp = nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.Sequential(attn, mlp, attn)
    handles = d.annotate_modules({"attention": [attn], "moe": [mlp]})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("forward"):
            y = model(torch.randn(2, 4))
    names = [e.name for e in prof.events()]
    assert names.count("attention") == 2 and names.count("moe") == 1 and names.count("forward") == 1
    linear = [e for e in prof.events() if e.name == "aten::linear"]
    assert len(linear) == 3 and all(e.cpu_parent is not None and e.cpu_parent.name in ("attention", "moe")
                                    for e in linear)
    for h in handles:
        h.remove()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert model(torch.randn(2, 4)).shape == y.shape
    assert not {"attention", "moe"} & {e.name for e in prof.events()}


def test_kernel_timeline_without_kernels():
    assert d.kernel_timeline(_Prof([_event("aten::add", 0, 1, device=DeviceType.CPU)]))["kernels_per_iter"] == 0


def _frames(*pairs):
    return [{"filename": f, "line": line, "name": n} for f, line, n in pairs]


def test_memory_at_peak_replays_to_the_peak_and_groups_by_first_line_outside_torch():
    # an environment under a directory named torch (the H200 image's /opt/torch/.venv): its transformers
    # frames are outside torch, only the torch package's own files (and C++ frames) are torch's
    model = ("/opt/torch/.venv/lib/python3.12/site-packages/transformers/models/mixtral/modeling_mixtral.py", 120,
             "forward")
    loss = ("/repo/launch/train.py", 321, "lm_loss")
    linear = ("/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", 125, "forward")
    cpp = ("/pytorch/aten/src/ATen/native/cuda/Blas.cpp", 200, "addmm_out_cuda_impl")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(cpp, linear, model)},
        {"action": "alloc", "addr": 2, "size": 300, "frames": _frames(loss)},
        {"action": "alloc", "addr": 3, "size": 50, "frames": _frames(linear, model)},
        {"action": "free_requested", "addr": 2, "size": 300},
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "free_requested", "addr": 99, "size": 70},   # a block from before the recording
        {"action": "alloc", "addr": 4, "size": 200, "frames": _frames(loss)},
    ]
    mib = 2**20
    for event in trace:
        event["size"] *= mib
    m = d.memory_at_peak({"device_traces": [trace]}, baseline_bytes=1000 * mib)
    # running sums (MiB): 100, 400, 450 (peak), 150, 80, 280
    assert m["peak_above_baseline_gib"] == pytest.approx(450 / 1024, abs=1e-4)
    assert m["peak_gib"] == pytest.approx(1450 / 1024, abs=1e-4)
    assert m["baseline_freed_before_end_gib"] == pytest.approx(70 / 1024, abs=1e-4)
    where = {e["where"]: (e["gib"] * 1024, e["blocks"]) for e in m["live_at_peak"]}
    assert where == {"repo/launch/train.py:321 lm_loss": (pytest.approx(300, abs=0.1), 1),
                     "models/mixtral/modeling_mixtral.py:120 forward <- forward": (pytest.approx(150, abs=0.1), 2)}
    assert "lm_loss" in d.format_memory_at_peak(m)


def test_memory_at_peak_of_an_empty_trace():
    m = d.memory_at_peak({"device_traces": []}, baseline_bytes=2**30)
    assert m["peak_gib"] == 1.0 and m["live_at_peak"] == []


def _emulated_sync():
    # the text torch's CUDA sync debug mode warns with (a CPU build cannot raise the real one)
    warnings.warn("called a synchronizing CUDA operation")


def test_host_sync_recorder_counts_by_call_site_and_passes_other_warnings_through():
    with warnings.catch_warnings(record=True) as passed:
        warnings.simplefilter("always")
        with HostSyncRecorder() as syncs:
            for _ in range(3):
                _emulated_sync()  # one site, three times: every occurrence counts, not once per location
            _emulated_sync()
            warnings.warn("an unrelated warning")
    summary = syncs.summary()
    assert summary["count"] == 4 and summary["cuda"] == torch.cuda.is_available()
    (first, second) = summary["sites"]
    assert first["count"] == 3 and second["count"] == 1
    # innermost frame outside torch first: the helper, then its caller in this test
    assert first["where"].split(" <- ")[0].split(":")[0].endswith("tests/test_diagnostics.py") and " _emulated_sync <- " in first["where"]
    assert first["where"] != second["where"]
    assert [str(w.message) for w in passed] == ["an unrelated warning"]
    # the recorder restored the warning machinery: a sync warning now goes to the usual handlers
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        _emulated_sync()
    assert len(after) == 1 and syncs.summary()["count"] == 4


def test_host_sync_recorder_counts_explicit_synchronize_calls(monkeypatch):
    """torch.cuda.synchronize / Stream.synchronize / Event.synchronize inside the block are counted at their call
    sites (DeepSpeed's synchronized throughput timer is one); the originals are back after the block."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    fake, event_sync, stream_sync = torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize
    with HostSyncRecorder() as syncs:
        assert torch.cuda.Event.synchronize is not event_sync  # wrapped inside the block
        torch.cuda.synchronize(0)
    assert calls == [0] and torch.cuda.synchronize is fake
    ((site,),) = [[s["where"] for s in syncs.summary()["sites"]]]
    assert syncs.summary()["count"] == 1 and "test_host_sync_recorder_counts_explicit_synchronize_calls" in site
    assert torch.cuda.Event.synchronize is event_sync and torch.cuda.Stream.synchronize is stream_sync


def _x(name, cat, ts, dur, tid=1, correlation=None):
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": {}}
    if correlation is not None:
        e["args"]["correlation"] = correlation
    return e


def test_trace_gaps_says_whether_the_host_launched_late_and_what_it_did():
    trace = {"traceEvents": [
        _x("backward", "user_annotation", 0, 5000, tid=1),
        _x("evaluate_function: MulBackward0", "cpu_op", 900, 2200, tid=2),
        _x("aten::mul", "cpu_op", 3000, 90, tid=2),
        _x("cudaLaunchKernel", "cuda_runtime", 10, 5, tid=1, correlation=1),
        _x("cudaFree", "cuda_runtime", 1200, 1500, tid=2),            # the host waits in the driver
        _x("cudaLaunchKernel", "cuda_runtime", 3050, 5, tid=2, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 3060, 5, tid=2, correlation=3),
        _x("fill_kernel", "kernel", 100, 900, tid=7, correlation=1),   # ends at 1000
        _x("mul_kernel", "kernel", 3100, 50, tid=7, correlation=2),    # 2100 us idle before it
        _x("wait_kernel", "kernel", 3400, 10, tid=8, correlation=3),   # 250 us idle, launched before it
        {"ph": "i", "name": "marker", "ts": 5},                        # not a duration event: skipped
    ]}
    gaps = d.trace_gaps(trace, top=5, threshold_us=100, host_min_us=50)
    assert [g["gap_us"] for g in gaps] == [2100.0, 250.0]
    late, early = gaps
    assert (late["after"], late["before"]) == ("fill_kernel", "mul_kernel")
    assert late["launch_after_gap_start_us"] == 2050.0  # launched 2050 us after the GPU went idle
    assert late["launch_stack"] == ["evaluate_function: MulBackward0", "aten::mul"]
    names = [h["name"] for h in late["host"]]
    assert names == ["backward", "evaluate_function: MulBackward0", "cudaFree", "aten::mul"]
    assert late["host"][2] == {"tid": 2, "name": "cudaFree", "start_us": 200.0, "dur_us": 1500.0}
    assert early["launch_after_gap_start_us"] == -90.0  # launched before the gap: a device-side wait
    text = d.format_trace_gaps(gaps)
    assert "2100.0 us idle after fill_kernel before mul_kernel" in text and "cudaFree" in text
    assert d.trace_gaps({"traceEvents": []}) == []


def test_kernel_timeline_leaves_out_work_launched_before_the_window():
    """With the host ahead, a profile that starts mid-run records the GPU finishing the step before: kernels
    whose launch call is not in the profile are not counted. The CPU op's id may equal a correlation id: only
    CUDA API calls count as launches."""
    events = [
        _event("aten::mm", 0, 5, device=DeviceType.CPU, id=1),            # a host op, not a launch
        _event("cudaLaunchKernel", 10, 12, device=DeviceType.CPU, id=2),
        _event("cuLaunchKernelEx", 20, 22, device=DeviceType.CPU, id=3),
        _event("adamw_kernel", 0, 30, id=1),                              # launched before the window
        _event("nvjet_sm90_gemm", 30, 60, id=2),
        _event("_triton_rope", 60, 70, id=3),
    ]
    t = d.kernel_timeline(_Prof(events), iters=1)
    assert t["kernels_launched_before_window"] == 1 and t["kernels_per_iter"] == 2
    assert t["busy_ms_per_iter"] == pytest.approx(0.040) and "loongforge" not in t["category_ms_per_iter"]
    assert t["span_ms_per_iter"] == pytest.approx(0.040)  # from the tail's end (30 us) to the last end
    # a side stream's copy launched in the window runs beside the tail: busy counts it, the span starts at the
    # tail's end, and the time the main stream spends on the tail is no gap
    events += [_event("cudaMemcpyAsync", 1, 2, device=DeviceType.CPU, id=4), _event("Memcpy HtoD", 5, 8, id=4),
               _event("cudaLaunchKernel", 12, 13, device=DeviceType.CPU, id=5), _event("reduce_kernel", 90, 100, id=5)]
    t = d.kernel_timeline(_Prof(events), iters=1, gap_threshold_us=5)
    assert t["busy_ms_per_iter"] == pytest.approx(0.053) and t["span_ms_per_iter"] == pytest.approx(0.070)
    assert [g["gap_us"] for g in t["top_gaps_us"]] == [20]  # 70 -> 90 only
    # no launch recorded at all (no CUDA API events): every kernel counts
    untracked = d.kernel_timeline(_Prof([e for e in events if not e.name.startswith("cu")]), iters=1)
    assert untracked["kernels_launched_before_window"] is None and untracked["kernels_per_iter"] == 5


def test_trace_gaps_count_work_launched_before_the_recording_as_busy():
    """The tail of the step before the recording (its launch not in the trace) kept the GPU busy: no gap there;
    the idle time after it is reported, with the next activity launched before it (a device-side order)."""
    trace = {"traceEvents": [
        _x("tail_of_the_step_before", "kernel", 0, 400, correlation=9),
        _x("cudaMemcpyAsync", "cuda_runtime", 10, 5, correlation=1),
        _x("cudaLaunchKernel", "cuda_runtime", 360, 5, correlation=2),
        _x("side_stream_copy", "gpu_memcpy", 20, 10, correlation=1),
        _x("second", "kernel", 460, 10, correlation=2),
    ]}
    gaps = d.trace_gaps(trace, threshold_us=50)
    assert [(g["after"], g["before"], g["gap_us"], g["launch_after_gap_start_us"]) for g in gaps] == [
        ("tail_of_the_step_before", "second", 60.0, -40.0)]
