"""A sample's measured values survive the round trip through the database (SQLite and PostgreSQL); JSON, UTC
timestamps, 64-bit byte counts and the unique constraints behave the same on both; the metrics follow their
definitions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
import torch
from models import model_zoo
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.harness.data.prompt import Prompt
from dtbench.harness.measurement.measure import measure
from dtbench.harness.measurement.observation import sample_row
from dtbench.harness.store import db
from dtbench.harness.values import first_divergence

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


@pytest.fixture()
def sessions(db_url):
    return db.connect(db_url)


def _store(sessions, rows):
    with sessions() as s:
        run = db.Run(suite_name="t", suite_text="", suite_hash="0", environment={})
        cell = db.Cell(
            run=run,
            dataset="d",
            l_max=8,
            gen_length=20,
            decoder="linear",
            label="linear",
            decoder_version="1",
            decoder_distribution="dtbench",
            params={"k": 3},
            target_model="tiny",
        )
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
    # Definitions (docs/measurement.md), checked against the raw per-step record.
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


def _sample(cell, prompt_index=0, **over):
    row = dict(
        prompt_index=prompt_index,
        document="d",
        warmup=False,
        prompt_tokens=8,
        new_tokens=4,
        total_s=1.0,
        ttft_s=0.1,
        tpot_s=0.3,
        throughput=4.0,
        iterations=4,
        tokens_per_iteration=1.0,
        drafted=0,
        accepted=0,
        draft_depth=0,
        target_forwards=4,
        step_tokens=[1, 1, 1, 1],
        step_stats={},
        step_times_s=[1.0],
        output_hash="h",
        output_tokens=[1, 2, 3, 4],
    )
    row.update(over)
    return db.Sample(cell=cell, **row)


def test_json_timestamps_bytes_and_unique_constraints_behave_the_same(sessions):
    stats = {"drafted": [3, 3], "accepted": [2, 0], "depth": [3, 3], "zé": [0.1 + 0.2, 1e-300]}
    env = {"z": 1, "a": {"nested": [1, 2.5, None, True, "ü"]}, "m": None}
    berlin = timezone(timedelta(hours=1))
    started = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=berlin)
    with sessions() as s:
        run = db.Run(
            suite_name="t",
            suite_text="",
            suite_hash="0",
            environment=env,
            started_at=started,
            heartbeat_at=datetime(2026, 1, 2, 2, 0, 0),
        )  # naive: taken as UTC
        cell = db.Cell(
            run=run,
            dataset="d",
            l_max=8,
            gen_length=4,
            decoder="ar",
            label="ar",
            decoder_version="1",
            decoder_distribution="dtbench",
            params={"k": 3},
            target_model="m",
        )
        s.add(
            _sample(
                cell,
                step_stats=stats,
                peak_allocated_bytes=80 * 2**30,
                peak_nvml_bytes=2**40,
                target_forwards=None,
                draft_forwards=7,
                acceptance_incl_bonus=1.25,
                nvml_scope="process",
            )
        )
        s.commit()
        run_id, cell_id = run.id, cell.id
    with sessions() as s:
        run = s.get(db.Run, run_id)
        assert run.environment == env and list(run.environment) == ["z", "a", "m"]  # key order kept (JSON, not JSONB)
        assert run.started_at == datetime(2026, 1, 2, 2, 4, 5, 678901)  # naive UTC on every backend
        assert run.heartbeat_at == datetime(2026, 1, 2, 2, 0, 0) and run.started_at.tzinfo is None
        sample = s.scalars(select(db.Sample).where(db.Sample.cell_id == cell_id)).one()
        assert sample.step_stats == stats and sample.step_stats["zé"][0] == 0.1 + 0.2
        assert sample.peak_allocated_bytes == 80 * 2**30 and sample.peak_nvml_bytes == 2**40  # BIGINT
        assert sample.target_forwards is None and sample.draft_forwards == 7 and sample.nvml_scope == "process"
        assert sample.created_at.tzinfo is None and abs(
            datetime.now(UTC).replace(tzinfo=None) - sample.created_at
        ) < timedelta(minutes=5)
    with sessions() as s:  # (cell, prompt_index) is unique
        s.add(_sample(s.get(db.Cell, cell_id), prompt_index=0))
        with pytest.raises(IntegrityError):
            s.commit()
    with sessions() as s:  # (run, dataset, cap, T, label) is unique
        s.add(
            db.Cell(
                run_id=run_id,
                dataset="d",
                l_max=8,
                gen_length=4,
                decoder="ar",
                label="ar",
                decoder_version="1",
                decoder_distribution="dtbench",
                params={},
                target_model="m",
            )
        )
        with pytest.raises(IntegrityError):
            s.commit()
    with sessions() as s:  # deleting a run cascades to its cells and samples
        s.delete(s.get(db.Run, run_id))
        s.commit()
        assert s.scalars(select(db.Sample)).all() == [] and s.scalars(select(db.Cell)).all() == []


def test_the_sample_record_is_the_samples_table():
    """One declaration of a sample's columns (harness/measurement/sample.py): the table holds exactly its fields, and the types
    agree on nullability (a field with a default of None is a nullable column)."""
    import dataclasses

    from dtbench.harness.measurement.sample import COLUMNS, SampleRecord
    from dtbench.harness.store.db import Sample

    table = {c.name: c for c in Sample.__table__.columns}
    assert set(table) - {"id", "cell_id", "created_at"} == set(COLUMNS)
    for f in dataclasses.fields(SampleRecord):
        assert table[f.name].nullable == (f.default is None), f.name


def test_a_row_with_an_unknown_or_missing_column_is_refused():
    import pytest

    from dtbench.harness.measurement.sample import SampleRecord

    with pytest.raises(ValueError, match="not sample columns: bogus"):
        SampleRecord.from_row({"bogus": 1})
    with pytest.raises(ValueError, match="prompt_index"):
        SampleRecord.from_row({"document": "d"})


def test_a_reference_without_times_has_none():
    """Issue 58 item 6: ``Reference``'s ``total_s`` defaulted to a ``dataclasses.Field`` object (a NamedTuple is no
    dataclass), so a reference built without its wall time carried that object into ``timeout_s: auto``."""
    from dtbench.harness.execution.deadline import cpu_timeout
    from dtbench.harness.measurement.sample import Reference

    ref = Reference([[1, 2, 3]])
    assert ref.total_s is None and ref.cpu_s is None
    assert cpu_timeout("auto", ref.total_s, ref.cpu_s) == (1800.0, None)  # unknown reference time: 1800 s
    assert Reference([[1]], 4.2, 8.0).total_s == 4.2
