"""Issue 39 items 1 and 2: a server cell keeps its concurrency in flight over the whole dataset (steady load, its
ramp-up, steady part and drain told apart), and arrivals over the dataset (seeded gamma gaps, a rate sweep)."""

from __future__ import annotations

import json
import sqlite3
import statistics
from pathlib import Path

import pytest
from kit import invoke, write_suite

from dtbench.harness.serving import arrival_delays, load_profile

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

SUITE = {
    "name": "steady",
    "seed": 0,
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "datasets": [{"name": "wikitext-2", "prompts": 25, "warmup": 1, "L_max": 16}],
    "generation_lengths": [4],
}


@pytest.fixture
def fake_server():
    import fakeserver

    started = []

    def start(**options):
        server, url = fakeserver.serve(**options)
        started.append(server)
        return url

    yield start
    for server in started:
        server.shutdown()


def _rows(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute(
            "select c.label, c.batch_size, s.prompt_index, s.warmup, s.batch_group, s.step_stats from samples s "
            "join cells c on c.id = s.cell_id order by c.id, s.prompt_index"
        ).fetchall()


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_load_profile_tells_ramp_steady_and_drain_apart():
    # C = 2: two requests start at 0; the third starts when the first ends (1 s); the last send is at 1 s, the first
    # completion at or after it is 2 s: steady [0, 2], drain to 3 s
    p = load_profile([(0.0, 1.0), (0.0, 2.0), (1.0, 3.0)], 2, None)
    assert p["steady_window_s"] == [0.0, 2.0] and p["ramp_s"] == 0.0 and p["drain_s"] == 1.0
    assert p["steady"] == [True, True, False]
    assert p["mean_in_flight"] == pytest.approx((2 * 1 + 2 * 1 + 1 * 1) / 3)
    assert p["mean_in_flight_steady"] == pytest.approx(2.0)
    # with arrivals the steady part starts at the first completion
    q = load_profile([(0.0, 1.0), (0.5, 2.0), (1.5, 2.5)], 4, 1.0)
    assert q["steady_window_s"] == [1.0, 2.0] and q["ramp_s"] == 1.0 and q["drain_s"] == 0.5


def test_a_server_cell_keeps_its_concurrency_in_flight_over_the_dataset(tmp_path, data_dir, fake_server):
    url = fake_server(durations=(0.05, 0.2))  # requests that take 1x or 4x as long, alternating
    suite = write_suite(
        tmp_path, {**SUITE, "concurrency": [4], "decoders": [{"name": "server", "params": {"base_url": url}}]}
    )
    result = invoke("run", suite, "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress")
    assert result.exit_code == 0, result.output
    rows = _rows(tmp_path / "r.db")
    measured = [r for r in rows if not r[3]]
    assert len(measured) == 24
    loads = [json.loads(r[5])["server"] for r in measured]
    cell = loads[0]["cell_load"]
    assert all(s["cell_load"] == cell for s in loads)  # one unit: the whole cell's measured prompts
    assert cell["mean_in_flight"] >= 3.0, cell  # burst-then-drain groups of 4 keep about 1.5 in flight
    assert cell["mean_in_flight_steady"] == pytest.approx(4.0, abs=0.05)
    assert cell["ramp_s"] + cell["steady_s"] + cell["drain_s"] == pytest.approx(cell["wall_s"])
    assert 0 < sum(s["steady"] for s in loads) < 24 and cell["steady_throughput"] > 0
    assert [r[4] for r in measured] == [1 + 4 * (i // 4) for i in range(24)]  # paired in blocks of C
    report = invoke("report", "--db", str(tmp_path / "r.db"), "--engine")
    assert report.exit_code == 0, report.output
    assert "concurrency (steady)" in report.output and "Steady t/s" in report.output
    good = invoke("report", "--db", str(tmp_path / "r.db"), "--goodput", "e2el:100000", "--format", "json")
    assert good.exit_code == 0, good.output
    rps = json.loads(good.output)["cells"][0]["goodput_rps"]
    assert rps == pytest.approx(24 / cell["wall_s"])  # over the cell's wall time, not the overlapping blocks' sum


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_seeded_arrivals_have_the_right_mean_and_variation():
    for burstiness in (1.0, 0.25, 4.0):
        times = arrival_delays(20001, 5.0, seed=3, burstiness=burstiness)
        assert times == arrival_delays(20001, 5.0, seed=3, burstiness=burstiness) and times[0] == 0.0
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(1 / 5.0, rel=0.05)
        assert statistics.pstdev(gaps) / mean == pytest.approx(burstiness**-0.5, rel=0.05)
    assert arrival_delays(3, None, seed=3) == [0.0, 0.0, 0.0]


def test_a_list_of_rates_is_a_sweep_with_one_cell_per_rate(tmp_path, data_dir, fake_server):
    plain = {"base_url": fake_server()}
    spec = {"base_url": fake_server(), "speculative": True, "reference": plain, "request_rate": [50.0, 200.0]}
    suite = write_suite(
        tmp_path,
        {
            **SUITE,
            "datasets": [{**SUITE["datasets"][0], "prompts": 6}],
            "concurrency": [2],
            "decoders": [{"name": "server", "label": "spec", "params": spec}],
        },
    )
    result = invoke("run", suite, "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress")
    assert result.exit_code == 0, result.output
    rows = _rows(tmp_path / "r.db")
    labels = sorted({r[0] for r in rows})
    assert "spec (request_rate=50.0)" in labels and "spec (request_rate=200.0)" in labels
    rates = {r[0]: json.loads(r[5])["server"]["request_rate"] for r in rows}
    assert rates["spec (request_rate=50.0)"] == 50.0 and rates["spec (request_rate=200.0)"] == 200.0
    for label in labels:  # arrivals over the whole cell: one stream of offsets, not one per block of C
        arrivals = [json.loads(r[5])["server"]["arrival_s"] for r in rows if r[0] == label and not r[3]]
        assert len(arrivals) == 5 and arrivals[0] == 0.0 and all(b > a for a, b in zip(arrivals, arrivals[1:]))
    refs = [label for label in labels if not label.startswith("spec")]
    assert sorted(rates[label] for label in refs) == [50.0, 200.0]  # each rate's plain server at that rate
    bad = invoke(
        "validate",
        write_suite(
            tmp_path,
            {
                **SUITE,
                "decoders": [{"name": "server", "params": {"base_url": "http://127.0.0.1:1", "burstiness": 0.5}}],
            },
        ),
    )
    assert bad.exit_code == 2 and "needs a request_rate" in bad.output and "Traceback" not in bad.output


def test_load_kinds_are_named_apart_and_an_old_server_cell_reports_as_before():
    from dtbench.reports.views.engine import GROUPS, STATIC, STEADY, load_kind

    assert load_kind(4, [], False)["load_kind"] == STATIC
    old = load_kind(4, [{"concurrency": 4, "group_wall_s": 1.0}], True)  # a server cell measured before issue 39
    assert old["load_kind"] == GROUPS and old["steady_throughput"] != old["steady_throughput"]  # NaN: not measured
    unit = {"wall_s": 2.0, "ramp_s": 0.0, "steady_s": 1.5, "drain_s": 0.5, "mean_in_flight": 3.5}
    new = load_kind(4, [{"cell_load": {**unit, "throughput": 40.0, "steady_throughput": 50.0}}] * 3, True)
    assert new["load_kind"] == STEADY and new["cell_throughput"] == 40.0 and new["steady_throughput"] == 50.0
    assert new["mean_in_flight"] == 3.5 and new["drain_s"] == 0.5  # one unit, however many requests carry it


def test_a_request_the_server_closed_before_any_response_is_sent_once_more(tmp_path, data_dir, fake_server):
    """llama-server on a loaded machine closed a connection without a status line (its log: no task started, CI
    of stop 44): the request is sent once more, its clock restarted, and ``resent`` says so; the run completes."""
    url = fake_server(mode="drop")
    suite = write_suite(
        tmp_path,
        {
            **SUITE,
            "datasets": [{**SUITE["datasets"][0], "prompts": 3}],
            "decoders": [{"name": "server", "params": {"base_url": url}}],
        },
    )
    result = invoke("run", suite, "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress")
    assert result.exit_code == 0, result.output
    resent = [json.loads(r[5])["server"]["resent"] for r in _rows(tmp_path / "r.db")]
    assert resent == [1, 0, 0]  # the first request (the warmup prompt's) was dropped once


def test_a_server_that_keeps_closing_before_any_response_fails_its_cell(monkeypatch):
    import asyncio

    import fakeserver
    import httpx

    from dtbench.decoders.engines import engine_for
    from dtbench.harness.serving import ServerError, ServerParams
    from dtbench.harness.serving import client as served

    monkeypatch.setattr(served, "RESENDS", 0)
    server, url = fakeserver.serve(mode="drop")
    try:

        async def one():
            async with httpx.AsyncClient() as c:
                rec = served.RequestRecord(row=0)
                body = {"prompt": [1, 2], "max_tokens": 2, "stream": True}
                params = ServerParams(base_url=url)
                await served._request(
                    c, url + "/v1/completions", body, params, engine_for("llama.cpp"), rec, 0.0, lambda t: []
                )

        with pytest.raises(ServerError, match="closed the connection without a response to each of 1 sends"):
            asyncio.run(one())
    finally:
        server.shutdown()
