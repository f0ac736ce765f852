"""`dtbench report --goodput` (issue 39 item 3): the share of requests meeting every latency target, per cell."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from kit import invoke, one_line_error, suite_dict, tiny_pair, write_suite

from dtbench.harness.errors import DtbenchError
from dtbench.reports.views.goodput import goodput_frame, meets, parse_slos, wilson

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


def test_targets_parse_in_milliseconds_and_bad_ones_are_one_line():
    assert parse_slos("ttft:200, tpot:50,e2el:5000") == {"ttft": 0.2, "tpot": 0.05, "e2el": 5.0}
    for bad, needle in [
        ("ttft=200", "is not NAME:MS"),
        ("itl:5", "is not NAME:MS"),
        ("ttft:-1", "positive number of milliseconds"),
        ("ttft:nan", "positive number of milliseconds"),
        ("ttft:1,ttft:2", "given twice"),
        (",", "at least one target"),
    ]:
        with pytest.raises(DtbenchError, match=needle):
            parse_slos(bad)


def test_a_request_counts_only_if_it_meets_every_target():
    samples = pd.DataFrame(
        {"ttft_s": [0.1, 0.1, 0.3, 0.1], "tpot_s": [0.01, 0.05, 0.01, None], "total_s": [1.0, 1.0, 1.0, 0.1]}
    )
    assert meets(samples, {"ttft": 0.2, "tpot": 0.02}).tolist() == [True, False, False, True]
    assert meets(samples, {"e2el": 0.5}).tolist() == [False, False, False, True]
    low, high = wilson(2, 4, 0.95)
    assert low < 0.5 < high and 0 < low and high < 1


def test_goodput_frame_by_hand():
    frame = pd.DataFrame(
        {
            "cell_id": [1, 1, 1, 1],
            "has_sample": True,
            "warmup": [True, False, False, False],
            "dataset": "d",
            "l_max": 8,
            "gen_length": 4,
            "batch_size": 1,
            "label": "ar",
            "decoder": "ar",
            "ttft_s": [9.0, 0.1, 0.1, 0.4],
            "tpot_s": [0.01, 0.01, 0.03, 0.01],
            "total_s": [9.0, 1.0, 2.0, 1.0],
            "new_tokens": [4, 4, 8, 4],
        }
    )
    row = goodput_frame(frame, {"ttft": 0.2, "tpot": 0.02}).iloc[0]
    assert row["n"] == 3 and row["good"] == 1 and row["goodput"] == pytest.approx(1 / 3)  # the warmup left out
    assert row["token_goodput"] == pytest.approx(4 / 16) and row["goodput_rps"] == pytest.approx(1 / 4.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


def test_goodput_of_a_run_with_batch_sizes(pair, tmp_path, data_dir):
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}], batch_sizes=[1, 2])
    suite["datasets"][0].update(prompts=5, warmup=1)
    dbfile = tmp_path / "g.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    loose = json.loads(invoke("report", "--db", str(dbfile), "--goodput", "e2el:600000", "--format", "json").stdout)
    assert loose["slo_ms"] == {"e2el": 600000.0}
    assert {(c["label"], c["batch_size"]) for c in loose["cells"]} == {(d, b) for d in ("ar", "linear") for b in (1, 2)}
    assert all(c["goodput"] == 1.0 and c["good"] == c["n"] == 4 for c in loose["cells"])  # every row of every batch
    strict = json.loads(invoke("report", "--db", str(dbfile), "--goodput", "ttft:0.001", "--format", "json").stdout)
    assert all(c["goodput"] == 0 and c["good"] == 0 and c["token_goodput"] == 0 for c in strict["cells"])
    table = invoke("report", "--db", str(dbfile), "--goodput", "ttft:1,tpot:1", "--format", "markdown")
    assert table.exit_code == 0 and "Goodput · run 1" in table.stdout and "Good req/s" in table.stdout
    one_line_error(invoke("report", "--db", str(dbfile), "--goodput", "ttft:x"), "positive number of milliseconds")
    one_line_error(invoke("report", "--db", str(dbfile), "--goodput", "ttft:5", "--engine"), "a report of its own")


# --- the schedule (issue 39 item 6) ---------------------------------------------------------------------------------


def test_schedule_ranges_and_engine_terms():
    from dtbench.reports.pricing.schedule import engine_config, ranges

    rows = pd.DataFrame({"batch_size": [1, 2, 4, 8, 16], "best_k": [4, 4, 2, 0, 0]})
    spans = ranges(rows)
    assert spans == [(1, 2, 4), (4, 4, 2), (8, 16, 0)]
    assert engine_config("trtllm", spans) == {"speculative_config": {"draft_len_schedule": {2: 4, 4: 2}}}
    assert engine_config("vllm", spans) == {
        "speculative_config": {"num_speculative_tokens": 4, "disable_by_batch_size": 8}
    }
    buckets = engine_config("sglang", spans)["per_batch_bucket"]
    assert buckets[0] == {"batch_sizes": "1-2", "speculative_num_steps": 4, "speculative_num_draft_tokens": 5}
    assert buckets[-1]["speculative_num_steps"] == 0


def test_schedule_of_a_calibrated_k_sweep_at_batch_sizes(monkeypatch, pair, tmp_path, data_dir):
    from kit import fast_calibration_settings

    from dtbench.harness.calibration import calibrate_run

    monkeypatch.setattr(calibrate_run, "Settings", fast_calibration_settings())
    decoders = [{"name": "ar"}, {"name": "linear", "label": "linear", "sweep": {"k": [1, 3]}}]
    suite = suite_dict(*pair, decoders, batch_sizes=[1, 2], calibrate=True)
    suite["datasets"][0].update(prompts=4, warmup=1)
    dbfile = tmp_path / "s.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    out = invoke("report", "--db", str(dbfile), "--schedule", "trtllm", "--format", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["engine"] == "trtllm" and {1} <= {r["batch_size"] for r in doc["rows"]} <= {1, 2}
    assert all(r["best_k"] >= 0 and r["predicted_speedup"] > 0 for r in doc["rows"])
    # where both K of the sweep have a measured speedup at B, the measured best is one of them (0: neither pays)
    assert all(r["measured_best_k"] in (None, 0, 1, 3) for r in doc["rows"])
    assert all("draft_len_schedule" in c["speculative_config"] for c in doc["configs"].values())
    text = invoke("report", "--db", str(dbfile), "--schedule", "vllm", "--format", "markdown")
    assert text.exit_code == 0 and ("disable_by_batch_size" in text.output or "do_not_speculate" in text.output)
    assert "num_speculative_tokens: 0" not in text.output and '"num_speculative_tokens": 0' not in text.output
    one_line_error(invoke("report", "--db", str(dbfile), "--schedule", "vllm", "--engine"), "a report of its own")


def test_a_proposers_own_cpu_time_is_priced_as_draft_cost():
    """Issue 39 item 5: seconds outside forwards per iteration beyond ar's are the proposer's, paid per row."""
    from dtbench.harness.suites.grouping import PointKey
    from dtbench.reports.pricing.costmodel_batch import B1Params, price_proposers

    g = PointKey("d", 128, 64)
    given = {
        (g, "ar"): B1Params(L=1.0, n=1.0, d=0.0, family="ar", outside=0.001),
        (g, "ngram"): B1Params(L=2.0, n=4.0, d=0.0, family="chain", outside=0.004),
        (g, "linear"): B1Params(L=2.0, n=5.0, d=0.01, draft_tokens_s=0.0025, family="chain", outside=0.0005),
        (g, "unknown"): B1Params(L=2.0, n=3.0, d=0.0, family="chain", outside=None),
    }
    params = price_proposers(given)
    assert params[(g, "ngram")].d == pytest.approx(0.003) and params[(g, "ngram")].proposer_s == pytest.approx(0.003)
    assert params[(g, "ngram")].draft_tokens_s == pytest.approx(0.001)  # over its 3 drafted tokens
    assert given[(g, "ngram")].d == 0.0  # frozen: the given parameters are not changed
    assert params[(g, "unknown")].d == 0.0  # its outside time unknown: nothing added
    assert params[(g, "linear")].d == pytest.approx(0.01)  # less outside time than ar: nothing added
    assert params[(g, "unknown")].proposer_s == 0.0 and params[(g, "ar")].d == 0.0
