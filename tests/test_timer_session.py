"""The stop rule inside one timer session (issue 58 item 5): :meth:`ForwardTimer.session` times calls until a
:class:`StopRule` says enough and returns one :class:`Latency`. The calibration's point-by-point and interleaved
rules, once loops of their own, are that session; on a fake clock they stop where the old loops stopped."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from dtbench.harness.calibration import calibrate
from dtbench.harness.measurement.forwards import ForwardTimer, Latency, StopRule

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


class Machine:
    """A fake clock that moves only when a forward runs, by that forward's seconds (taken in order)."""

    def __init__(self, seconds):
        self.t, self.seconds, self.calls, self.resets = 0.0, iter(seconds), 0, 0

    def now(self) -> float:
        return self.t

    def forward(self) -> None:
        self.t += next(self.seconds)
        self.calls += 1

    def reset(self) -> None:
        self.resets += 1


def old_time_point(m: Machine, settings: calibrate.Settings) -> tuple[float, float, int]:
    """calibrate.time_point's loop as it was before issue 58 item 5 (the reference)."""
    for _ in range(settings.warmup):
        m.forward()
        m.reset()
    times: list[float] = []
    begin = m.now()
    while True:
        t0 = m.now()
        m.forward()
        times.append(m.now() - t0)
        m.reset()
        elapsed = m.now() - begin
        if elapsed >= settings.max_time_s and len(times) >= 3:
            break
        if len(times) >= settings.min_repeats and elapsed >= settings.min_time_s:
            med, first = statistics.median(times), statistics.median(times[: max(1, len(times) // 2)])
            if med == 0 or abs(med - first) <= settings.rel_tol * med:
                break
    iqr = float(np.subtract(*np.percentile(times, [75, 25]))) if len(times) > 1 else 0.0
    return statistics.median(times), iqr, len(times)


def old_visit(m: Machine, settings: calibrate.Settings) -> int:
    """One visit of calibrate.measure_interleaved's loop before issue 58 item 5: its forwards."""
    passes = max(1, settings.passes)
    per_visit, least, budget = (
        -(-settings.min_repeats // passes),
        settings.min_time_s / passes,
        settings.max_time_s / passes,
    )
    begin, visit = m.now(), 0
    while visit == 0 or (visit < per_visit or m.now() - begin < least) and m.now() - begin < budget:
        m.forward()
        visit += 1
    return visit


def sequences():
    """Forward seconds: steady, noisy, drifting and slow (multiples of 1/1024 s: exact sums)."""
    rng = random.Random(58)
    yield [8 / 1024] * 400
    yield [rng.randint(4, 40) / 1024 for _ in range(400)]
    yield [(4 + i // 3) / 1024 for i in range(400)]
    yield [rng.choice([1, 300, 700]) / 1024 for _ in range(400)]


SETTINGS = [
    calibrate.Settings(),
    calibrate.Settings(min_repeats=3, min_time_s=0.0, max_time_s=0.05, warmup=1, rel_tol=0.5),
    calibrate.Settings(min_repeats=6, min_time_s=0.05, max_time_s=0.4, warmup=2, rel_tol=0.05, passes=3),
    calibrate.Settings(min_repeats=1, min_time_s=0.0, max_time_s=0.0, warmup=0, passes=2),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_point_rule_stops_where_the_old_loop_stopped(settings):
    for seconds in sequences():
        old, new = Machine(seconds), Machine(seconds)
        expected = old_time_point(old, settings)
        got = calibrate.time_point(new.forward, new.reset, "cpu", settings, clock=new.now)
        assert got == pytest.approx(expected) and got[2] == expected[2]
        assert (new.calls, new.resets) == (old.calls, old.resets)


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_visit_rule_stops_where_the_old_loop_stopped(settings):
    for seconds in sequences():
        old, new = Machine(seconds), Machine(seconds)
        for _ in range(5):  # five visits of one point, each its own session
            latency = ForwardTimer("cpu", new.now).session(new.forward, calibrate.visit_rule(settings))
            assert latency.repeats == old_visit(old, settings) >= 1


def test_a_session_warms_up_resets_and_returns_one_latency():
    m = Machine([1 / 64] * 20)
    latency = ForwardTimer("cpu", m.now).session(m.forward, StopRule(min_time_s=0.125), reset=m.reset, warmup=2)
    assert latency.times == (1 / 64,) * 8  # 8/64 s = min_time_s; the warmup's 2/64 s not counted
    assert (m.calls, m.resets) == (10, 10)
    assert ForwardTimer("cpu", m.now).session(m.forward, StopRule(min_repeats=3)).repeats == 3  # a fixed count


def test_the_stop_rule():
    rule = StopRule(min_repeats=4, min_time_s=1.0, max_time_s=5.0, rel_tol=0.1, floor=3)
    assert not rule.done([0.5, 0.5, 0.5], 1.5)  # too few
    assert not rule.done([0.2] * 4, 0.8)  # too short
    assert rule.done([0.3] * 4, 1.2)  # enough and stable
    assert not rule.done([0.1, 0.1, 0.5, 0.5, 0.5, 0.5], 2.2)  # the median moved 0.3 -> 0.5
    assert rule.done([2.0, 2.0, 2.0], 6.0) and not rule.done([3.0, 3.0], 6.0)  # the time limit, after `floor` calls


def test_latency_statistics():
    lat = Latency((0.4, 0.1, 0.3, 0.2))
    assert lat.repeats == 4 and lat.median == pytest.approx(0.25) and lat.mean == pytest.approx(0.25)
    assert lat.iqr == pytest.approx(float(np.percentile(lat.times, 75) - np.percentile(lat.times, 25)))
    assert lat.percentile(100) == 0.4 and Latency((0.1,)).iqr == 0.0
