"""A sample's measured values survive the round trip through the database; the metrics follow their definitions."""

from __future__ import annotations

import pytest
import torch
from sqlalchemy import select

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.harness import db
from dtbench.harness.data import Prompt
from dtbench.harness.runner import first_divergence, measure, sample_row
from models import model_zoo


@pytest.fixture()
def sessions(tmp_path):
    return db.connect(str(tmp_path / "t.db"))


def _store(sessions, rows):
    with sessions() as s:
        run = db.Run(suite_name="t", suite_text="", suite_hash="0", environment={})
        cell = db.Cell(run=run, dataset="d", prompt_cap=8, gen_length=20, decoder="linear", label="linear",
                       decoder_version="1", decoder_distribution="dtbench", params={"k": 3}, target_model="tiny")
        s.add(cell)
        for row in rows:
            s.add(db.Sample(cell=cell, **row))
        s.commit()
        return cell.id


def test_sample_round_trip_and_metric_definitions(sessions):
    target, draft = model_zoo()["perturbed"]
    prompt = Prompt(index=0, document="doc", token_ids=tuple(range(10, 18)))
    ref = measure(Autoregressive(target, None, ARParams()), prompt.token_ids, 20, torch.device("cpu"))
    m = measure(LinearSpeculative(target, draft, LinearParams(k=3)), prompt.token_ids, 20, torch.device("cpu"))
    row = sample_row(m, prompt, warmup=False, reference=ref.tokens)
    cell_id = _store(sessions, [row])

    with sessions() as s:
        back = s.scalars(select(db.Sample).where(db.Sample.cell_id == cell_id)).one()
    for key, value in row.items():
        assert getattr(back, key) == value, key
    # Definitions (DESIGN.md "Metrics"), checked against the raw per-step record.
    assert back.new_tokens == 20 == len(back.output_tokens)
    assert sum(back.step_tokens) >= 20 and sum(back.step_tokens[:-1]) < 20
    assert back.iterations == len(back.step_tokens) == len(back.step_times_s)
    assert back.total_s == back.step_times_s[-1] and back.ttft_s == back.step_times_s[0]
    assert back.throughput == pytest.approx(20 / back.total_s)
    assert back.tpot_s == pytest.approx((back.total_s - back.ttft_s) / 19)
    assert back.tokens_per_iteration == pytest.approx(20 / back.iterations)
    assert back.accepted == sum(back.step_stats["accepted"])
    assert back.acceptance_rate == pytest.approx(back.accepted / back.draft_depth)
    assert back.lossless is True and back.first_divergence is None
    assert back.output_tokens == ref.tokens
    assert back.peak_rss_bytes and back.peak_rss_bytes > 10 * 2**20


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_divergent_output_is_recorded(sessions):
    target, _ = model_zoo()["self"]
    prompt = Prompt(index=3, document="doc", token_ids=(5, 6, 7))
    m = measure(Autoregressive(target, None, ARParams()), prompt.token_ids, 8, torch.device("cpu"))
    wrong = list(m.tokens)
    wrong[5] = (wrong[5] + 1) % 96
    row = sample_row(m, prompt, warmup=True, reference=wrong)
    assert row["lossless"] is False and row["first_divergence"] == 5 and row["warmup"] is True
    assert row["acceptance_rate"] is None and row["mean_path_length"] is None  # AR drafts nothing
