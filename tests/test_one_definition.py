"""One speedup and one acceptance length (issue 68 item 3).

Every report that calls a number "speedup" (the summary, ``--compare``, the paper tables, their JSON) shows one
statistic, mean throughput over the mean ``ar`` throughput (Table 1's), and the geometric mean of the per-prompt
ratios is ``paired_speedup``; the README says the same. The acceptance length (committed tokens per drafting
iteration, the prefill's left out: Spec-Bench's #MAT) is one function, :func:`dtbench.harness.measurement.metrics.
acceptance_length`, whose value the summary, ``--spec-bench``'s #MAT and the batch cost model agree on; the paper's
L-bar (T / iterations, prefill counted) stays ``tokens_per_iteration``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import reportdb
from click.testing import CliRunner

from dtbench.cli.main import cli
from dtbench.harness.measurement.metrics import acceptance_length
from dtbench.harness.store.db import Sample
from dtbench.reports.pricing.costmodel_batch import b1_frame, b1_parameters
from dtbench.reports.views.specbench import mean_accepted_tokens

TIER = "fast"
T = 64
ITERATIONS = [17, 21, 13, 33, 9, 25]  # per prompt after warmup: acceptance differs by prompt


def _steps(iterations: int) -> list[int]:
    """A sample's committed tokens per step: the prefill's one token, then T - 1 spread over the other steps."""
    rest = iterations - 1
    base, extra = divmod(T - 1, rest)
    return [1] + [base + (1 if i < extra else 0) for i in range(rest)]


@pytest.fixture()
def db(tmp_path):
    path = tmp_path / "one.db"
    sessions = reportdb.connect(path)
    with sessions() as s:
        run = reportdb.add_run(s, "one")
        ar = reportdb.add_cell(s, run, "ar", "ar")
        reportdb.add_samples(s, ar, [1.0] + [10.0] * 6, warmup=1)
        lin = reportdb.add_cell(s, run, "linear", "linear", params={"k": 4})
        samples = reportdb.add_samples(s, lin, [1.0, 5.0, 5.0, 5.0, 5.0, 5.0, 40.0], warmup=1)
        for sample, iters in zip(samples, [20, *ITERATIONS]):
            sample.iterations, sample.step_tokens = iters, _steps(iters)
            sample.tokens_per_iteration = T / iters
        s.commit()
    return path, sessions


def _json(*args) -> dict:
    out = CliRunner().invoke(cli, ["report", *map(str, args), "--format", "json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.output[out.output.index("{") :])


def test_every_report_calls_one_statistic_speedup(db):
    path, _ = db
    mean_ratio = (25 + 40) / 6 / 10.0  # mean throughput / mean ar throughput
    geo = math.exp((5 * math.log(0.5) + math.log(4.0)) / 6)
    assert abs(mean_ratio - geo) > 0.3  # prompts differ in speed: the two statistics differ
    summary = {c["label"]: c for c in _json("--db", path)["cells"]}
    (compared,) = _json("--db", path, "--compare")["cells"]
    tables = _json("--db", path, "--tables")["table1_main"]["rows"]
    table1 = {r["method"]: r for r in tables}
    assert summary["linear"]["speedup"] == pytest.approx(mean_ratio)
    assert compared["speedup"] == pytest.approx(mean_ratio) and compared["paired_speedup"] == pytest.approx(geo)
    assert table1["linear"]["wikitext-2.speedup"] == pytest.approx(mean_ratio)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert "is one statistic: a cell's\nmean throughput over the mean throughput of its `ar` cell" in readme


def test_one_acceptance_length_in_the_summary_spec_bench_and_the_cost_model(db):
    path, sessions = db
    n = len(ITERATIONS)
    tau = (n * T - n) / (sum(ITERATIONS) - n)  # committed tokens per drafting iteration, pooled, prefill apart
    assert acceptance_length(n * T, sum(ITERATIONS), n) == pytest.approx(tau)
    cells = {c["label"]: c for c in _json("--db", path)["cells"]}
    assert cells["linear"]["acceptance_length"] == pytest.approx(tau)
    assert cells["ar"]["acceptance_length"] == pytest.approx(1.0)
    # the paper's L-bar keeps its own name and definition: T / iterations, the prefill's iteration counted
    assert cells["linear"]["tokens_per_iteration"] == pytest.approx(sum(T / i for i in ITERATIONS) / n)
    with sessions() as s:
        samples = s.query(Sample).join(Sample.cell).filter_by(label="linear").all()
        frame = b1_frame(samples)
        frame["step_tokens"] = [x.step_tokens for x in samples]
    measured = frame[~frame["warmup"]]
    assert mean_accepted_tokens(measured) == pytest.approx(tau)  # --spec-bench's #MAT
    params = b1_parameters(frame)
    assert params is not None and params.L_dec == pytest.approx(tau)  # the batch cost model's
    assert math.isnan(acceptance_length(T, 1))  # no iteration after the prefill: none
