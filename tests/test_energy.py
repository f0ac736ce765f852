"""Energy per sample (issue 24) with Zeus's monitor replaced by a fake: cumulative counters read at a window's
begin and end as ZeusMonitor reads them, a counter that wraps around, windows shorter than the counter's update
period, no counter at all (this CPU has no RAPL); the samples columns, the runner and the reports.
"""

from __future__ import annotations

import io
import types

import pytest
import torch
from kit import invoke, suite_dict, tiny_pair, write_suite
from models import model_zoo
from rich.console import Console
from sqlalchemy import select

from dtbench.harness.data.prompt import Prompt
from dtbench.harness.execution.runner import run_suite
from dtbench.harness.measurement import energy
from dtbench.harness.measurement.energy import (
    COUNTER_RESET,
    MEASURED,
    TOO_SHORT,
    UNAVAILABLE,
    Counter,
    EnergyTracker,
    Meter,
)
from dtbench.harness.measurement.measure import measure
from dtbench.harness.measurement.metrics import BY_NAME
from dtbench.harness.measurement.observation import sample_row
from dtbench.harness.store import db
from dtbench.harness.suites.suitefile import load_suite

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


class FakeZeusMonitor:
    """ZeusMonitor's window API over raw cumulative counters (joules) the test sets, on a clock the test sets.

    ``wrap``: {(field, index): range in J} — the raw counter restarts at 0 past its range, as RAPL's energy_uj
    does when Zeus's wraparound poller missed it. ``gpus``: NVML's counter in millijoules, as Zeus exposes it.
    """

    def __init__(self, gpu_indices=None, cpu_indices=None, **kwargs):
        self.raw = {("gpu_energy", 0): 0.0, ("cpu_energy", 0): 0.0, ("dram_energy", 0): 0.0}
        self.wrap: dict = {}
        self.now = 0.0
        self.gpu_indices = gpu_indices if gpu_indices is not None else [0]
        self.cpu_indices = cpu_indices if cpu_indices is not None else [0]
        self.windows: dict = {}
        self.gpus = types.SimpleNamespace(
            supports_get_total_energy_consumption=lambda i: True,
            get_total_energy_consumption=lambda i: self.read("gpu_energy", i) * 1000,
        )
        self.cpus = types.SimpleNamespace(supports_get_dram_energy_consumption=lambda i: True)

    def read(self, field, index):
        value = self.raw[(field, index)]
        span = self.wrap.get((field, index))
        return value % span if span else value

    def advance(self, seconds: float, **joules) -> None:
        self.now += seconds
        for key, j in joules.items():
            field, index = key.rsplit("_", 1)
            self.raw[(f"{field}_energy", int(index))] += j

    def _state(self):
        return {k: self.read(*k) for k in self.raw}

    def begin_window(self, key, sync_execution=True):
        assert key not in self.windows and sync_execution is False  # the runner synchronizes, not Zeus
        self.windows[key] = (self.now, self._state())

    def end_window(self, key, sync_execution=True):
        start, before = self.windows.pop(key)
        after = self._state()
        delta = {k: after[k] - before[k] for k in after}
        pick = lambda field, idx: {i: delta[(f"{field}_energy", i)] for i in idx}  # noqa: E731
        return types.SimpleNamespace(
            time=self.now - start,
            gpu_energy=pick("gpu", self.gpu_indices),
            cpu_energy=pick("cpu", self.cpu_indices) or None,
            dram_energy=pick("dram", self.cpu_indices) or None,
        )


def window(meter: Meter, seconds: float, **joules):
    key = meter.begin()
    meter.monitor.advance(seconds, **joules)
    return meter.end(key)


def gpu_meter(period=0.02):
    return Meter(FakeZeusMonitor(cpu_indices=[]), [Counter("gpu_energy", 0)], "nvml:gpu0", period)


def test_measured_energy_is_the_counter_increase():
    r = window(gpu_meter(), 0.5, gpu_0=123.5)
    assert (r.energy_j, r.status, r.source, r.window_s) == (123.5, MEASURED, "nvml:gpu0", 0.5)


def test_a_window_shorter_than_the_update_period_is_marked_not_zero():
    meter = gpu_meter(period=0.02)
    short = window(meter, 0.01, gpu_0=0.0)
    assert (short.energy_j, short.status) == (None, TOO_SHORT)
    short_with_tick = window(meter, 0.015, gpu_0=3.0)  # a tick inside a too-short window is not the sample's energy
    assert (short_with_tick.energy_j, short_with_tick.status) == (None, TOO_SHORT)
    no_tick = window(meter, 0.05, gpu_0=0.0)  # long enough, yet the counter did not move: not a 0 J sample
    assert (no_tick.energy_j, no_tick.status) == (None, TOO_SHORT)


def test_rapl_wraparound_is_corrected_by_the_counters_range():
    monitor = FakeZeusMonitor(gpu_indices=[])
    monitor.wrap = {("cpu_energy", 0): 1000.0}  # a 1 kJ counter
    meter = Meter(
        monitor,
        [Counter("cpu_energy", 0, wrap_j=1000.0), Counter("dram_energy", 0)],
        "rapl:package+dram",
        energy.RAPL_UPDATE_PERIOD_S,
    )
    monitor.advance(1.0, cpu_0=990.0)  # the raw counter stands 10 J below its range
    r = window(meter, 2.0, cpu_0=25.0, dram_0=4.0)  # it wraps: raw 990 -> 15
    assert monitor.read("cpu_energy", 0) == pytest.approx(15.0)
    assert r.status == MEASURED and r.energy_j == pytest.approx(29.0)  # 25 J package + 4 J DRAM, never negative


def test_a_counter_that_goes_back_without_a_known_range_is_a_reset():
    meter = gpu_meter()
    meter.monitor.advance(1.0, gpu_0=500.0)
    key = meter.begin()
    meter.monitor.advance(1.0)
    meter.monitor.raw[("gpu_energy", 0)] = 3.0  # the driver was reloaded: NVML's counter restarts
    r = meter.end(key)
    assert (r.energy_j, r.status) == (None, COUNTER_RESET)


def test_a_failing_monitor_is_unavailable_not_an_error():
    meter = gpu_meter()
    key = meter.begin()

    def boom(*a, **k):
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    meter.monitor.end_window = boom
    r = meter.end(key)
    assert (r.energy_j, r.status) == (None, UNAVAILABLE) and "RuntimeError" in r.source


def test_update_period_probe():
    clock = {"t": 0.0}

    def sleep(s):
        clock["t"] += s

    read = lambda: int(clock["t"] / 0.02)  # noqa: E731  (a counter ticking every 20 ms)
    period = energy.probe_update_period(read, 0.3, clock=lambda: clock["t"], sleep=sleep)
    assert period == pytest.approx(0.02, abs=0.0015)
    assert energy.probe_update_period(lambda: 7, 0.05, clock=lambda: clock["t"], sleep=sleep) is None


def test_cuda_meter_through_zeus_probes_the_nvml_period(monkeypatch):
    made = {}

    def factory(**kwargs):
        made["kwargs"] = kwargs
        made["monitor"] = FakeZeusMonitor(**kwargs)
        return made["monitor"]

    monkeypatch.setattr(energy, "_zeus_installed", lambda: True)
    monkeypatch.setattr(energy, "_zeus_monitor", factory)
    monkeypatch.setattr(energy, "probe_update_period", lambda read, budget: 0.03 if read() == 0 else None)
    meter = energy.make_meter(torch.device("cuda", 0))
    assert made["kwargs"] == {"gpu_indices": [0], "cpu_indices": []}
    assert isinstance(meter, Meter) and meter.source == "nvml:gpu0" and meter.update_period_s == 0.03
    made["monitor"].gpus.supports_get_total_energy_consumption = lambda i: False
    monkeypatch.setattr(energy, "_zeus_monitor", lambda **kw: made["monitor"])
    assert "older than Volta" in energy.make_meter(torch.device("cuda", 0))


def test_no_counter_here_is_unavailable_and_zeus_is_not_even_started(monkeypatch):
    monkeypatch.setattr(energy, "_zeus_installed", lambda: True)
    monkeypatch.setattr(energy, "_rapl_readable", lambda: False)
    monkeypatch.setattr(energy, "_zeus_monitor", lambda **kw: pytest.fail("Zeus started without a counter"))
    assert energy.make_meter(CPU) == "no readable RAPL energy counter on this CPU"
    monkeypatch.setattr(energy, "_zeus_installed", lambda: False)
    assert "pip install 'dtbench[energy]'" in energy.make_meter(CPU)


def test_this_machine_reports_unavailable():
    """This CPU has no RAPL interface (and Zeus may not be installed): every sample is 'unavailable', never 0."""
    with EnergyTracker(CPU) as tracker:
        pass
    assert tracker.reading.status == UNAVAILABLE and tracker.reading.energy_j is None and tracker.reading.source


@pytest.fixture
def fake_rapl(monkeypatch):
    """Every CPU sample metered by a fake RAPL package counter drawing 40 W of (real) wall time."""
    import time

    monitor = FakeZeusMonitor(gpu_indices=[])
    original = (monitor.begin_window, monitor.end_window)

    def begin(key, sync_execution=True):
        monitor.now = time.perf_counter()
        original[0](key, sync_execution)

    def end(key, sync_execution=True):
        now = time.perf_counter()
        monitor.advance(now - monitor.now, cpu_0=40.0 * (now - monitor.now))
        return original[1](key, sync_execution)

    monitor.begin_window, monitor.end_window = begin, end
    meter = Meter(monitor, [Counter("cpu_energy", 0)], "rapl:package", energy.RAPL_UPDATE_PERIOD_S)
    monkeypatch.setattr(energy, "meter_for", lambda device: meter)
    return meter


def test_measure_stores_the_energy_columns(fake_rapl):
    from dtbench.decoders.ar import ARParams, Autoregressive

    target, _ = model_zoo()["self"]
    prompt = list(range(3, 12))
    m = measure(Autoregressive(target, None, ARParams()), prompt, 8, CPU)
    row = sample_row(m, Prompt(0, "doc", tuple(prompt)), False, None)
    assert row["energy_status"] == MEASURED and row["energy_source"] == "rapl:package"
    assert row["energy_j"] == pytest.approx(40.0 * m.energy.window_s) and row["energy_j"] > 0
    assert BY_NAME["j_per_token"].values(_frame(row)).iloc[0] == pytest.approx(row["energy_j"] / 8)
    assert BY_NAME["tokens_per_j"].values(_frame(row)).iloc[0] == pytest.approx(8 / row["energy_j"])
    unmeasured = {**row, "energy_j": None, "energy_status": TOO_SHORT}
    assert BY_NAME["j_per_token"].values(_frame(unmeasured)).isna().all()


def _frame(row):
    import pandas as pd

    return pd.DataFrame([row])


def _run(tmp_path, data_dir, name: str) -> tuple[str, int]:
    pair = tiny_pair(tmp_path / "models")
    parsed, text = load_suite(
        write_suite(tmp_path, suite_dict(*pair, [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}]), name)
    )
    url = str(tmp_path / f"{name}.db")
    run_id = run_suite(
        parsed, text, db.connect(url), data_dir=str(data_dir), console=Console(file=io.StringIO()), progress=False
    )
    return url, run_id


def test_runner_and_reports_with_energy(fake_rapl, tmp_path, data_dir):
    url, _ = _run(tmp_path, data_dir, "energy")
    with db.connect(url)() as s:
        samples = s.scalars(select(db.Sample)).all()
    assert len(samples) == 4 and all(x.energy_status == MEASURED and x.energy_j > 0 for x in samples)
    md = invoke("report", "--db", url, "--format", "markdown")
    assert md.exit_code == 0, md.output
    assert "| J/token | tok/J |" in md.stdout
    csv = invoke("report", "--db", url, "--format", "csv")
    assert "j_per_token" in csv.stdout.splitlines()[0] and "tokens_per_j" in csv.stdout.splitlines()[0]


def test_runner_without_a_counter_stores_unavailable_and_reports_hide_energy(tmp_path, data_dir):
    url, _ = _run(tmp_path, data_dir, "none")
    with db.connect(url)() as s:
        samples = s.scalars(select(db.Sample)).all()
    assert samples and all(x.energy_status == UNAVAILABLE and x.energy_j is None and x.energy_source for x in samples)
    md = invoke("report", "--db", url, "--format", "markdown")
    assert md.exit_code == 0 and "J/token" not in md.stdout and "Throughput" in md.stdout
    csv = invoke("report", "--db", url, "--format", "csv")
    assert "j_per_token" in csv.stdout.splitlines()[0]  # the columns exist, empty


def test_too_short_samples_get_a_note(tmp_path, data_dir, monkeypatch):
    monitor = FakeZeusMonitor(gpu_indices=[])
    meter = Meter(monitor, [Counter("cpu_energy", 0)], "rapl:package", update_period_s=3600.0)
    monkeypatch.setattr(energy, "meter_for", lambda device: meter)
    url, _ = _run(tmp_path, data_dir, "short")
    md = invoke("report", "--db", url, "--format", "markdown")
    assert "linear: no energy for 1 of 1 samples: shorter than the energy counter's update period" in md.stdout
    with db.connect(url)() as s:
        assert {x.energy_status for x in s.scalars(select(db.Sample))} == {TOO_SHORT}
