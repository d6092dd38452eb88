"""benchmarks/smi_summary.py on a synthetic nvidia-smi CSV and bench_e2e log: each variant's training window is
the longest high-power run inside its time span, start-up samples and other variants' samples left out; the energy
of a step from the window's power and the bench's median step time."""

from benchmarks.smi_summary import add_energy, summarize


def _csv(rows):
    head = "timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu\n"
    return head + "".join(f"2026/12/01 {t}, {mhz} MHz, {w:.2f} W, {c}\n" for t, mhz, w, c in rows)


def test_each_variant_gets_its_own_busy_window():
    rows = [("10:00:01.000", 1980, 125.0, 44), ("10:00:01.500", 1980, 610.0, 58), ("10:00:02.000", 1965, 620.0, 59),
            ("10:00:02.500", 1980, 130.0, 46),                                   # stock ends
            ("10:00:03.000", 1980, 126.0, 44), ("10:00:03.500", 1980, 450.0, 50),  # a short blip at start-up
            ("10:00:04.000", 1980, 126.0, 44), ("10:00:04.500", 1600, 694.0, 60), ("10:00:05.000", 1500, 690.0, 61),
            ("10:00:05.500", 1650, 695.0, 62), ("10:00:06.000", 1980, 135.0, 47),
            ("10:00:07.000", 1980, 125.0, 43)]                                   # after every variant
    log = ("[stock] DeepSpeed ... (from 10:00:01)\n[stock] ok in 1.5 s: 1 tokens/s (to 10:00:02)\n"
           "[loongforge] LoongForge ... (from 10:00:03)\n[loongforge] ok in 3 s: 2 tokens/s (to 10:00:06)\n"
           "[broken] x ... (from 10:00:07)\n[broken] failed: exit 1: boom (to 10:00:07)\n")
    by = {r["variant"]: r for r in summarize(_csv(rows), log)}
    assert by["stock"]["samples"] == 2 and by["stock"]["sm_mhz_median"] == 1972.5
    assert by["loongforge"]["samples"] == 3 and by["loongforge"]["sm_mhz_median"] == 1600
    assert by["loongforge"]["sm_mhz_min"] == 1500 and by["loongforge"]["power_w_median"] == 694.0
    assert by["loongforge"]["temp_c_max"] == 62
    assert by["broken"] == {"variant": "broken", "samples": 0}


def test_energy_per_step_is_median_power_times_median_step():
    rows = [{"variant": "stock", "samples": 3, "power_w_median": 600.0},
            {"variant": "loongforge", "samples": 2, "power_w_median": 700.0},
            {"variant": "broken", "samples": 0}]
    bench = {"results": [{"variant": "stock", "median_step_ms": 150.0, "tokens_per_s": 50000.0},
                         {"variant": "loongforge", "median_step_ms": 70.0, "tokens_per_s": None},
                         {"variant": "broken", "median_step_ms": None}]}
    by = {r["variant"]: r for r in add_energy(rows, bench)}
    assert by["stock"]["joules_per_step"] == 90.0 and by["stock"]["joules_per_ktoken"] == 12.0
    assert by["loongforge"]["joules_per_step"] == 49.0 and "joules_per_ktoken" not in by["loongforge"]
    assert "joules_per_step" not in by["broken"]
