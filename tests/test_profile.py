"""Acceptance profiles (issue 34 item 1): a chain and a tree decoder's profile on a fixed run against numbers computed
by hand, the JSON against its schema, and a planted inconsistency failing ``dtbench report --profile``."""

from __future__ import annotations

import json

import jsonschema
import pytest

from dtbench.reports.pricing import pricing
from dtbench.reports.views import profile, profile_report
from tests import reportdb
from tests.kit import invoke

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

# Per request after warmup: (accepted per step, drafted depth per step); the first step is the prefill (depth 0).
CHAIN = [  # linear, K = 3; the last request's last step was truncated to depth 1 (the end of the generation)
    ([0, 3, 1, 0], [0, 3, 3, 3]),
    ([0, 2, 3], [0, 3, 3]),
    ([0, 0, 0], [0, 3, 3]),
    ([0, 3, 3, 1], [0, 3, 3, 3]),
    ([0, 1, 1], [0, 3, 1]),
]
TREE = [  # dynatree: the tree's depth varies per step
    ([0, 2, 0], [0, 4, 2]),
    ([0, 4], [0, 4]),
    ([0, 1, 1], [0, 1, 3]),
    ([0, 2], [0, 2]),
    ([0, 0, 3], [0, 3, 5]),
]


def _store(session, run, label, decoder, steps, warmup=([0, 3], [0, 3])):
    cell = reportdb.add_cell(session, run, label, decoder)
    samples = reportdb.add_samples(session, cell, [100.0] * (len(steps) + 1), warmup=1)
    for sample, (accepted, depth) in zip(samples, [warmup, *steps]):
        drafting = [a for a, d in zip(accepted, depth) if d > 0]
        sample.step_stats = {"accepted": accepted, "depth": depth, "drafted": depth}
        sample.accepted = sum(accepted)
        sample.mean_path_length = sum(drafting) / len(drafting)
    session.flush()
    return cell


@pytest.fixture
def fixed_run(tmp_path):
    path = tmp_path / "r.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        reportdb.add_samples(session, reportdb.add_cell(session, run, "ar"), [50.0] * 6, warmup=1)
        _store(session, run, "linear", "linear", CHAIN)
        _store(session, run, "dynatree", "dynatree", TREE)
        session.commit()
        rid = run.id
    return path, rid


def _profiles(path, rid):
    with reportdb.connect(path)() as session:
        return profile_report.run_profiles(session, rid)


def test_chain_profile_matches_hand_computed(fixed_run):
    profiles, none = _profiles(*fixed_run)
    assert none == ["ar"]
    p = next(x for x in profiles if x.cell["label"] == "linear")
    # 12 drafting steps; accepted 3,1,0 | 2,3 | 0,0 | 3,3,1 | 1,1 (the last at depth 1); 18 accepted in all
    assert (p.requests, p.steps) == (5, 12)
    pos = p.positions
    assert [x["at_risk"] for x in pos] == [12, 8, 5]
    assert [x["conditional"] for x in pos] == pytest.approx([9 / 12, 5 / 8, 4 / 5])
    assert [x["cumulative"] for x in pos] == pytest.approx([9 / 12, 5 / 12, 4 / 12])
    assert p.histogram == {1: 3, 2: 4, 3: 1, 4: 4}
    assert p.means["per_step_excl_bonus"] == pytest.approx(18 / 12)
    assert p.means["per_step_incl_bonus"] == pytest.approx(1 + 18 / 12)
    per_request = [4 / 3, 5 / 2, 0, 7 / 3, 1]
    assert p.means["per_request_excl_bonus"] == pytest.approx(sum(per_request) / 5)
    assert p.means["per_request_incl_bonus"] == pytest.approx(1 + sum(per_request) / 5)
    for x in pos:  # 5 requests: a bootstrap CI around each rate
        assert 0 <= x["conditional_lo"] <= x["conditional"] <= x["conditional_hi"] <= 1
        assert 0 <= x["cumulative_lo"] <= x["cumulative"] <= x["cumulative_hi"] <= 1
    assert p.passed and {c["name"] for c in p.checks} == {"mean_consistency", "accepted_total", "mean_path_length"}
    # the cost model's p_j is the same conditional (one function), pooled over the cell's steps
    accepted = [a for acc, _ in CHAIN for a in acc]
    depth = [d for _, dep in CHAIN for d in dep]
    assert pricing.position_acceptance(accepted, depth) == pytest.approx([9 / 12, 5 / 8, 4 / 5])
    js = profile.specdec_json(p)
    assert js["conditional_accept_rates"] == pytest.approx([0.75, 5 / 9, 4 / 5], abs=1e-6)  # specdec's convention
    assert js["acceptance_length_histogram"] == {"1": 3, "2": 4, "3": 1, "4": 4}
    assert (js["verification_method"], js["accept_length_model"], js["num_speculative_tokens"]) == (
        "longest_prefix",
        "chain_analytic",
        3,
    )


def test_tree_profile_matches_hand_computed(fixed_run):
    profiles, _ = _profiles(*fixed_run)
    p = next(x for x in profiles if x.cell["label"] == "dynatree")
    # 8 drafting steps (accepted, depth): (2,4) (0,2) | (4,4) | (1,1) (1,3) | (2,2) | (0,3) (3,5); 13 accepted
    assert (p.requests, p.steps) == (5, 8)
    pos = p.positions
    assert [x["at_risk"] for x in pos] == [8, 5, 3, 2, 0]
    assert [x["conditional"] for x in pos] == pytest.approx([6 / 8, 4 / 5, 2 / 3, 1 / 2, None])
    assert pos[4]["conditional_lo"] is None  # nobody at risk: no rate, no interval
    assert [x["cumulative"] for x in pos] == pytest.approx([6 / 8, 4 / 8, 2 / 8, 1 / 8, 0])
    assert p.histogram == {1: 2, 2: 2, 3: 2, 4: 1, 5: 1}
    assert p.means["per_step_incl_bonus"] == pytest.approx(1 + 13 / 8)
    assert p.means["per_request_excl_bonus"] == pytest.approx((1 + 4 + 1 + 2 + 1.5) / 5)
    assert p.passed
    # the cost model's extrapolation carries position 4's rate to the untried position 5
    accepted = [a for acc, _ in TREE for a in acc]
    depth = [d for _, dep in TREE for d in dep]
    assert pricing.position_acceptance(accepted, depth) == pytest.approx([6 / 8, 4 / 5, 2 / 3, 1 / 2, 1 / 2])
    js = profile.specdec_json(p)
    assert (js["verification_method"], js["accept_length_model"]) == ("tree", "measured_per_k")


def test_no_interval_below_five_requests():
    requests = [profile.Request(a, d) for a, d in CHAIN[:4]]
    p = profile.build_profile(requests, {"label": "x", "family": "chain"})
    assert p is not None and all(x["conditional_lo"] is None and x["cumulative_hi"] is None for x in p.positions)


def test_cli_prints_and_writes_schema_valid_json(fixed_run, tmp_path):
    path, rid = fixed_run
    out = tmp_path / "profile.json"
    for fmt in ("table", "markdown", "csv", "json", "html"):
        result = invoke("report", "--db", str(path), "--profile", "--profile-json", str(out), "--format", fmt)
        assert result.exit_code == 0, result.output
    assert "1.500 excl. bonus" in invoke("report", "--db", str(path), "--profile", "--profile-json", str(out)).output
    rows = json.loads(
        invoke("report", "--db", str(path), "--profile", "--format", "json", "--profile-json", str(out)).stdout
    )
    assert rows["run"] == rid and {r["label"] for r in rows["positions"]} == {"linear", "dynatree"}
    payload = json.loads(out.read_text())
    schema = profile.load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert len(payload["profiles"]) == 2
    for prof in payload["profiles"]:
        jsonschema.validate(prof, schema)
        assert prof["validation"]["mean_consistency"]["passed"]
    broken = dict(payload["profiles"][0], marginal_accept_rates=[1.5])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_planted_inconsistency_fails_loudly(fixed_run, tmp_path):
    path, _ = fixed_run
    with reportdb.connect(path)() as session:
        from dtbench.harness.store.db import Cell, Sample

        cell = session.query(Cell).filter_by(label="dynatree").one()
        sample = session.query(Sample).filter_by(cell_id=cell.id, warmup=False).first()
        sample.accepted += 4  # the per-sample counter no longer matches its per-step lists
        session.commit()
    out = tmp_path / "p.json"
    result = invoke("report", "--db", str(path), "--profile", "--profile-json", str(out))
    assert result.exit_code == 2
    err = result.stderr.strip().splitlines()[-1]
    assert "dynatree disagrees with its samples' counters: accepted_total" in err
    assert "Traceback" not in result.output
    failed = json.loads(out.read_text())["profiles"][1]["dtbench"]["checks"]
    assert [c["passed"] for c in failed if c["name"] == "accepted_total"] == [False]


def test_profile_refuses_other_modes(fixed_run):
    path, _ = fixed_run
    result = invoke("report", "--db", str(path), "--profile", "--cost-model")
    assert result.exit_code == 2 and "--profile is a report of its own" in result.stderr
    result = invoke("report", "--db", str(path), "--profile-json", "x.json")
    assert result.exit_code == 2 and "give it with --profile" in result.stderr
