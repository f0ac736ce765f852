"""Issue 34 items 3 and 4: the built-in ``humaneval`` dataset (code as a workload) and ``label:`` on dataset entries
(one dataset listed twice under different labels runs side by side and is reported under each label)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from kit import invoke, one_line_error, tiny_pair, write_suite

from dtbench.harness.data import datasets as data
from dtbench.harness.suites.suite import DatasetSpec

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

HUMANEVAL_SHA256 = "1d49078ba3e2b196b9344535bef34a43021f038fad9561d6ee7c53450609a6a2"  # ../shared/data/README.md
REPO = Path(__file__).resolve().parents[1]


def test_humaneval_documents_provenance_and_defaults(data_dir):
    spec = DatasetSpec(name="humaneval", prompts=3, warmup=0, L_max=400)
    docs = data.load_documents(spec, str(data_dir))
    assert len(docs) == 164 and docs[0][0] == "HumanEval/0"
    assert docs[0][1].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert docs.provenance["sha256"] == HUMANEVAL_SHA256 and docs.provenance["source"] == "local"
    assert data.stops_at_eos(None, spec) is True and data.stops_at_eos(False, spec) is False
    assert not data.is_chat(spec)  # a completion prompt: no chat template by default
    assert data.dataset(spec).hub.hub_id == "openai/openai_humaneval"


def test_humaneval_bad_file_is_one_line(tmp_path):
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "humaneval" / "HumanEval.jsonl").write_text('{"task_id": "x"}\n')
    with pytest.raises(data.DtbenchError, match="line 1 has no string 'prompt'"):
        data.load_documents(DatasetSpec(name="humaneval"), str(tmp_path))


def test_code_cpu_suite_validates(data_dir):
    result = invoke("validate", str(REPO / "suites" / "code-cpu.yaml"), "--data-dir", str(data_dir))
    assert result.exit_code == 0, result.output


def _suite(target: Path, draft: Path, datasets: list[dict], decoders=None) -> dict:
    return {
        "name": "labels",
        "seed": 0,
        "device": "cpu",
        "target": {"model": str(target), "dtype": "float64"},
        "draft": {"model": str(draft), "dtype": "float64"},
        "chat_template": "none",
        "datasets": datasets,
        "generation_lengths": [6],
        "decoders": decoders or [{"name": "ar"}, {"name": "linear", "params": {"k": 3}}],
        "isolation": "none",  # in this process, as tests/kit.py's suites: a child per run is a start and a load
    }


def test_one_dataset_twice_needs_labels(tmp_path):
    target, draft = tiny_pair(tmp_path)
    twice = [
        {"name": "wikitext-2", "prompts": 1, "warmup": 0, "L_max": 32},
        {"name": "wikitext-2", "prompts": 1, "warmup": 0, "L_max": 32},
    ]
    one_line_error(invoke("validate", write_suite(tmp_path, _suite(target, draft, twice))), "listed twice", "label")
    same = [dict(twice[0], label="a"), dict(twice[1], label="a")]
    one_line_error(invoke("validate", write_suite(tmp_path, _suite(target, draft, same))), "label 'a'", "listed twice")


@pytest.mark.full  # end-to-end runs
def test_spec_bench_twice_and_humaneval_run_side_by_side(tmp_path, data_dir):
    """Spec-Bench's own questions (one group) beside a user's question file, both `spec-bench`, under two labels,
    and HumanEval: every label has its own cells, prompts and provenance, and reports show the labels."""
    target, draft = tiny_pair(tmp_path)
    mine = tmp_path / "mine.jsonl"
    mine.write_text(
        "".join(
            json.dumps(q) + "\n"
            for q in [
                {"question_id": "m1", "category": "poetry", "turns": ["Write a haiku about rain."]},
                {"question_id": "m2", "category": "poetry", "turns": ["Write a couplet about the sea."]},
            ]
        )
    )
    datasets = [
        {
            "name": "spec-bench",
            "label": "spec-bench (qa)",
            "categories": ["qa"],
            "prompts": 2,
            "warmup": 1,
            "L_max": 200,
        },
        {"name": "spec-bench", "label": "mine", "path": str(mine), "prompts": 2, "warmup": 1, "L_max": 200},
        {"name": "humaneval", "label": "code", "prompts": 2, "warmup": 1, "L_max": 400},
    ]
    decoders = [
        {"name": "ar"},
        {"name": "linear", "params": {"k": 3}},
        {"name": "linear", "label": "linear (mine)", "params": {"k": 2}, "datasets": ["mine"]},
    ]
    path = write_suite(tmp_path, _suite(target, draft, datasets, decoders))
    db = tmp_path / "r.db"
    result = invoke("run", path, "--db", f"sqlite:///{db}", "--data-dir", str(data_dir), "--no-progress", "--no-report")
    assert result.exit_code == 0, result.output
    con = sqlite3.connect(db)
    cells = con.execute(
        "select dataset, label, count(*) from cells join samples on samples.cell_id = cells.id "
        "group by cells.id order by cells.id"
    ).fetchall()
    assert {(d, lbl) for d, lbl, _ in cells} == {
        ("spec-bench (qa)", "ar"),
        ("spec-bench (qa)", "linear"),
        ("mine", "ar"),
        ("mine", "linear"),
        ("mine", "linear (mine)"),
        ("code", "ar"),
        ("code", "linear"),
    }
    assert all(n == 2 for _, _, n in cells)
    env = json.loads(con.execute("select environment from runs").fetchone()[0])
    by_label = {s.get("label"): s for s in env["datasets"]}
    assert by_label["code"]["sha256"] == HUMANEVAL_SHA256 and by_label["code"]["name"] == "humaneval"
    assert by_label["mine"]["name"] == by_label["spec-bench (qa)"]["name"] == "spec-bench"
    assert env["stop_at_eos"] == {"spec-bench (qa)": True, "mine": True, "code": True}
    # the two spec-bench entries drew different questions: their prompts differ
    prompts = dict(
        con.execute(
            "select cells.dataset, group_concat(samples.prompt_tokens) from samples join cells on "
            "samples.cell_id = cells.id where cells.label = 'ar' group by cells.dataset"
        )
    )
    assert prompts["mine"] != prompts["spec-bench (qa)"]
    report = invoke("report", "--db", f"sqlite:///{db}", "--format", "json")
    assert report.exit_code == 0, report.output
    shown = {c["dataset"] for c in json.loads(report.stdout)["cells"]}  # stderr: the tuning line
    assert shown == {"spec-bench (qa)", "mine", "code"}
    by_group = invoke("report", "--db", f"sqlite:///{db}", "--by", "group", "--format", "markdown")
    assert by_group.exit_code == 0 and "mine · poetry" in by_group.output and "spec-bench (qa) · qa" in by_group.output
