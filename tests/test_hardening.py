"""Issue 19: nothing runs that nobody asked for, nothing hangs, nothing leaks.

One test (at least) per item of the issue, each written against the behaviour the issue reported: remote code in
model folders, passwords in printed URLs, formulas and terminal escapes from labels, hangs (Ray connect, NaN
options, include fan-out, huge or deep suites, device files), wrong answers (alpha NaN, infinite timeouts, huge
seeds, huge run ids) and raw errors (read-only databases, an unreachable hub).
"""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
import yaml

from kit import invoke, one_line_error, write_suite

TINY = {
    "name": "tiny",
    "seed": 0,
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
    "generation_lengths": [4],
    "decoders": [{"name": "ar"}],
}


def _suite(**changes) -> dict:
    out = json.loads(json.dumps(TINY))
    out.update(changes)
    return out


# --- 1. a model folder's own code never runs unless the suite opts in ------------------------------------------


def _evil_folder(root, marker):
    """A local model folder whose config maps AutoConfig/AutoModelForCausalLM/AutoTokenizer to code in the folder;
    importing that code creates ``marker``."""
    from dtbench.harness import models
    from dtbench.harness.suite import ModelSpec

    folder = root / "evil-model"
    folder.mkdir()
    models.load_tokenizer(ModelSpec()).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil19", "max_position_embeddings": 128,
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil19'\n"
        "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return folder


@pytest.mark.parametrize("command", ["validate", "run"])
def test_remote_code_in_a_model_folder_never_runs(tmp_path, data_dir, command):
    from click.testing import CliRunner

    from dtbench.cli.main import cli

    marker = tmp_path / "marker"
    folder = _evil_folder(tmp_path, marker)
    suite = write_suite(tmp_path, _suite(target={"model": str(folder), "dtype": "float32"}))
    args = [command, suite] + (["--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress"]
                               if command == "run" else [])
    result = CliRunner().invoke(cli, args, input="y\ny\ny\ny\n", catch_exceptions=False)
    assert not marker.exists(), "the model folder's code ran"
    line = one_line_error(result, "trust_remote_code", "evil.py")
    assert str(folder) in line


def test_remote_code_opt_in_is_warned_and_recorded(tmp_path):
    marker = tmp_path / "marker"
    folder = _evil_folder(tmp_path, marker)
    suite = write_suite(tmp_path, _suite(target={"model": str(folder), "dtype": "float32", "trust_remote_code": True}))
    result = invoke("validate", suite)
    assert result.exit_code == 0, result.output
    assert "trust_remote_code" in result.stderr and "evil.py" in result.stderr
    assert not marker.exists()  # validate reads configs, never imports


def test_every_load_passes_trust_remote_code_false(monkeypatch):
    """models.py's loaders hand transformers an explicit trust_remote_code (False unless the spec opts in)."""
    import transformers

    from dtbench.harness import models
    from dtbench.harness.suite import ModelSpec

    seen = []

    def spy(name):
        def fake(*args, **kwargs):
            seen.append((name, kwargs.get("trust_remote_code", "absent")))
            raise OSError("stop here")
        return fake

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy("model"))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy("config"))
    spec = ModelSpec(model="some-org/some-model")
    import torch

    for call in (lambda: models.load_tokenizer(spec), lambda: models.load_model(spec, torch.device("cpu")),
                 lambda: models.check_context(spec, 10)):
        try:
            call()
        except Exception:
            pass
    assert [k for _, k in seen] == [False, False, False], seen


# --- 2. the database password is never printed nor stored -----------------------------------------------------


def test_run_prints_no_password(tmp_path, monkeypatch):
    """`run` ends with 'run N stored in URL': the URL's password is masked. (The database and the run are stubbed:
    no PostgreSQL server is needed to see what is printed.)"""
    from dtbench.harness import db, runner

    real_connect = db.connect
    urls = []
    monkeypatch.setattr(db, "connect", lambda url=None, **kw: urls.append(url) or real_connect(str(tmp_path / "r.db")))
    monkeypatch.setattr(runner, "run_suite", lambda *a, **kw: 1)
    url = "postgresql+psycopg://user:SECRET@dbhost/dtbench"
    result = invoke("run", write_suite(tmp_path, TINY), "--db", url, "--no-progress", "--no-report")
    assert result.exit_code == 0, result.output
    assert urls == [url]
    assert "SECRET" not in result.output
    assert "user:***@dbhost/dtbench" in result.stderr


# --- 3. formulas and terminal escapes from labels --------------------------------------------------------------

ESC_LABELS = ["red \x1b[31mlabel", "title \x1b]0;pwned\x07", "two\nlines", "bell\x07", "c1 \x9b31m"]


@pytest.mark.parametrize("label", ESC_LABELS)
def test_control_characters_in_labels_are_refused(tmp_path, label):
    suite = write_suite(tmp_path, _suite(decoders=[{"name": "ar", "label": label}]))
    line = one_line_error(invoke("validate", suite), "decoders.0.label", "control character")
    assert "\x1b" not in line and "\x07" not in line and "\x9b" not in line


@pytest.mark.parametrize("where", ["name", "dataset", "sweep"])
def test_control_characters_in_names_are_refused(tmp_path, where):
    bad = "x\x1b[2Jy"
    suite = {"name": _suite(name=bad), "dataset": _suite(datasets=[{"name": bad, "prompts": 2, "warmup": 1}]),
             "sweep": _suite(decoders=[{"name": "ar"}, {"name": "linear", "sweep": {"k": [bad]}}])}[where]
    line = one_line_error(invoke("validate", write_suite(tmp_path, suite)), "control character")
    assert "\x1b" not in line


def _hostile_db(tmp_path) -> str:
    import reportdb

    from dtbench.harness import db

    path = tmp_path / "hostile.db"
    sessions = db.connect(str(path))
    with sessions() as s:
        run = reportdb.add_run(s)
        ar = reportdb.add_cell(s, run, "ar")
        reportdb.add_samples(s, ar, [10.0] * 6, warmup=1)
        for label in ['=HYPERLINK("http://evil.example","click")', "+1+1", "@SUM(A1)", "-2+3", "red \x1b[31mx",
                      "title \x1b]0;pwned\x07", "two\nlines | pipe", "markup [/oops]"]:
            cell = reportdb.add_cell(s, run, label, "linear")
            reportdb.add_samples(s, cell, [12.0] * 6, warmup=1)
        s.commit()
    return str(path)


def test_csv_neutralises_formulas(tmp_path):
    import csv
    import io

    path = _hostile_db(tmp_path)
    for extra in ([], ["--compare"]):
        result = invoke("report", "--db", path, "--format", "csv", *extra)
        assert result.exit_code == 0, result.output
        rows = list(csv.DictReader(io.StringIO(result.stdout)))
        labels = {r["label"] for r in rows}
        assert "'=HYPERLINK(\"http://evil.example\",\"click\")" in labels, labels
        assert {"'+1+1", "'@SUM(A1)", "'-2+3"} <= labels, labels
        assert not any(v.startswith(("=", "+", "@")) for r in rows for v in r.values() if v), rows
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
        numbers = [float(r["throughput_mean"]) for r in rows if r.get("throughput_mean")] if not extra else []
        assert all(n > 0 for n in numbers)  # numbers stay numbers


@pytest.mark.parametrize("fmt", ["markdown", "table"])
def test_markdown_and_terminal_escape_labels(tmp_path, fmt):
    path = _hostile_db(tmp_path)
    for extra in ([], ["--compare"]):
        result = invoke("report", "--db", path, "--format", fmt, *extra)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout, repr(result.stdout)
        if fmt == "markdown":
            rows = [line for line in result.stdout.splitlines() if line.startswith("|")]
            width = {len(re.split(r"(?<!\\)\|", line)) for line in rows}
            assert len(width) == 1, rows  # every row has the header's number of cells: no row split or widened
            assert any("two<br>lines \\| pipe" in line for line in rows), rows
        else:
            assert "markup [/oops]" in result.stdout
