"""One pricing model (issue 58 item 1): the cost model, ``--predict-on``, the batch table's replay and the schedule
price the same stored run on the same curves through :class:`dtbench.reports.pricing.pricing.Pricer`, so they name the same
S(K), best K and tree budget, and price a sample the same."""

from __future__ import annotations

import re

import pytest

from dtbench.harness.calibration import curves_file
from dtbench.harness.calibration.curves import FED_LAST, FED_MASK, auto_budget, load_curves
from dtbench.harness.store.db import Calibration
from dtbench.reports.pricing.costmodel import cost_table
from dtbench.reports.pricing.costmodel_batch import batch_table
from dtbench.reports.pricing.predict import predict_table
from dtbench.reports.pricing.pricing import Pricer, position_acceptance
from dtbench.reports.pricing.schedule import schedule_rows
from tests import reportdb

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

L_MAX, T = 16, 12
PAST = L_MAX + T // 2  # the cache at mid-generation, where every report prices its best K and budget
MS = 1e-3
# target: causal and tree curves flat to 4 tokens; the tree curve's end segment nearly flat (18 -> 19 ms), so
# extrapolating beyond its largest calibrated n (32) stays within 2x one AR step (20 ms) up to n = 48
CAUSAL = {1: 10, 2: 10, 3: 10, 4: 10, 8: 14, 16: 22}
TREE = {1: 10, 2: 10, 4: 10, 8: 12, 16: 18, 32: 19}
BATCHED = {1: 15, 2: 15, 4: 16, 8: 20, 16: 30, 32: 40}  # B = 2, tree mask
# a chain of K = 2 drafts: the first always accepted, the second in 3 of 4 iterations (p = [1, 0.75]); cheap
# drafts and a flat verification would pick a K beyond 2 if p were extended with its last value
CHAIN = ([0, 2, 2, 2, 2], [0, 2, 2, 2, 1])  # (drafted, accepted) per iteration, the prefill first
TREE_STEPS = ([0, 6, 6, 6], [0, 3, 4, 1])
AR_STEPS = ([0] * T, [0] * T)


def _calibration(session, run) -> None:
    def row(role, n, ms, cache_len=L_MAX, tree=False, last=False, rows=1):
        session.add(
            Calibration(
                run_id=run.id,
                batch="b" * 32,
                suite_name="t",
                suite_hash="h",
                role=role,
                model="m",
                dtype="float32",
                device="cpu",
                device_name="test cpu",
                prompt_len=L_MAX,
                cache_len=cache_len,
                n=n,
                tree_mask=tree,
                last_only=last,
                rows=rows,
                median_s=ms * MS,
                iqr_s=0.0,
                repeats=1,
            )
        )

    for n, ms in CAUSAL.items():
        row("target", n, ms)
    for n, ms in TREE.items():
        row("target", n, ms, tree=True)
    for n, ms in BATCHED.items():
        row("target", n, ms, tree=True, rows=2)
    row("target", L_MAX, 30, cache_len=0)
    row("target", L_MAX, 50, cache_len=0, rows=2)
    row("draft", 1, 1, last=True)
    row("draft", 1, 1)
    row("draft", L_MAX, 3, cache_len=0)
    session.flush()


def _steps(drafted: list[int], accepted: list[int], tree: bool) -> dict:
    """Per-step records of one sample as the runner stores them: the prefill, then per iteration one verification of
    the pending token and the drafts, and one draft step per drafted token (no draft prefill recorded)."""
    target, draft, done = [[[L_MAX, 0, 0]]], [[]], 1
    for d, a in zip(drafted[1:], accepted[1:]):
        target.append([[1 + d, L_MAX + done, FED_MASK if tree else 0]])
        draft.append([[1, L_MAX + done + j, FED_LAST] for j in range(d)])
        done += 1 + a
    assert done == T
    return {"drafted": drafted, "accepted": accepted, "depth": drafted, "target_fed": target, "draft_fed": draft}


def _cell(session, run, curves, label, decoder, steps, batch=1) -> None:
    """A cell of 3 identical samples after one warmup, measured as priced: its timed forwards are their calibrated
    prices and nothing runs outside them (a machine that runs exactly as calibrated)."""
    cell = reportdb.add_cell(session, run, label, decoder, l_max=L_MAX, T=T, draft="d" if decoder != "ar" else None)
    cell.batch_size = batch
    stats = _steps(*steps, tree=decoder == "dynatree")
    priced = Pricer(curves).sample(stats, decoder != "ar")
    stats["forward_s"] = {"target": priced.target_s, "draft": priced.draft_s}
    for s in reportdb.add_samples(session, cell, [T / priced.predicted_s] * 4, warmup=1):
        s.step_stats, s.iterations, s.drafted = stats, len(steps[0]), sum(steps[0])
    session.flush()


@pytest.fixture
def run(tmp_path):
    sessions = reportdb.connect(tmp_path / "r.db")
    with sessions() as session:
        run = reportdb.add_run(session)
        _calibration(session, run)
        curves = load_curves(session, run)
        for batch in (2, 1):  # add_cell flushes at B = 1: the B = 2 cells first, then moved to B = 2
            _cell(session, run, curves, "ar", "ar", AR_STEPS, batch)
            _cell(session, run, curves, "linear", "linear", CHAIN, batch)
            _cell(session, run, curves, "dynatree", "dynatree", TREE_STEPS, batch)
        session.commit()
        yield session, run, curves


def _note(notes: list[str], label: str) -> str:
    return next(n for n in notes if n.startswith(f"{label} ("))


def test_cost_model_batch_table_and_schedule_name_one_best_k_and_one_budget(run):
    session, run, curves = run
    pricer = Pricer(curves)
    p = position_acceptance(CHAIN[1], CHAIN[0])
    assert p == pytest.approx([1.0, 0.75])
    best = pricer.best_k(p, PAST)
    assert best is not None and best[0] <= len(p)  # K up to the deepest drafted position: p is never extended
    budget = pricer.budget(PAST)
    assert budget == auto_budget(curves, PAST, 2.0) == 31  # the largest calibrated tree (32) within 2 x 10 ms

    cost = cost_table(session, run, curves).set_index("label")
    assert cost.loc["linear", "predicted_best_k"] == best[0]
    assert cost.loc["linear", "predicted_best_speedup"] == pytest.approx(best[1])
    assert cost.loc["dynatree", "predicted_best_n_max"] == budget

    sched = schedule_rows(session, run, curves).set_index(["label", "batch_size"])
    assert sched.loc[("linear", 1), "top_k"] == best[0]
    assert sched.loc[("linear", 1), "predicted_speedup"] == pytest.approx(best[1])
    assert sched.loc[("linear", 2), "top_k"] == pricer.best_k(p, PAST, 2)[0]

    table, notes = batch_table(session, run, curves)
    ks = dict(re.findall(r"B=(\d+): K=(\d+)", _note(notes, "linear")))
    assert ks == {"1": str(best[0]), "2": str(pricer.best_k(p, PAST, 2)[0])}
    budgets = dict(re.findall(r"B=(\d+): (\d+)", _note(notes, "dynatree").split("N_max per B")[1]))
    assert budgets == {"1": str(budget), "2": str(pricer.budget(PAST, 2))}


@pytest.mark.fast
def test_cost_model_predict_on_and_the_replay_price_a_sample_alike(run):
    session, run, curves = run
    cost = cost_table(session, run, curves).set_index("label")
    table, _ = batch_table(session, run, curves)
    replayed = table[table["batch_size"] == 1].set_index("label")["predicted_speedup"]
    for label in ("linear", "dynatree"):  # B = 1: the replay prices the forwards the cost model prices
        assert replayed[label] == pytest.approx(cost.loc[label, "predicted_speedup"])
    portable = curves_file.PortableCurves(curves, "cpu", "test cpu", "eager", {}, overhead_s={"*": 2 * MS})
    plain = curves_file.PortableCurves(curves, "cpu", "test cpu", "eager", {})
    on_device = predict_table(session, run, plain)[0].set_index("label")
    with_overhead = predict_table(session, run, portable)[0].set_index("label")
    for label, steps in (("ar", AR_STEPS), ("linear", CHAIN), ("dynatree", TREE_STEPS)):
        assert on_device.loc[label, "predicted_s"] == pytest.approx(cost.loc[label, "predicted_s"])
        iterations = len(steps[0])
        assert with_overhead.loc[label, "predicted_s"] == pytest.approx(
            cost.loc[label, "predicted_s"] + iterations * 2 * MS
        )
