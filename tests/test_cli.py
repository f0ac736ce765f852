"""The CLI end to end (click's CliRunner): run, report, validate, decoders, and every kind of bad input."""

from __future__ import annotations

import json

import pytest
import yaml
from kit import invoke, one_line_error, write_suite
from sqlalchemy import func, select

from dtbench.harness import registry
from dtbench.harness.store import db

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

TINY = {
    "name": "tiny",
    "seed": 0,
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "draft": {"model": "smollm2-135m", "dtype": "bfloat16"},
    "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
    "generation_lengths": [6],
    "decoders": [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}],
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("run")
    dbfile = tmp / "results.db"
    result = invoke("run", write_suite(tmp, TINY), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress")
    assert result.exit_code == 0, result.output
    return dbfile, result


@pytest.mark.slow
def test_run_prints_report_and_stores_samples(tiny_run):
    dbfile, result = tiny_run
    assert "wikitext-2 · L_max=16 · T=6" in result.stdout
    assert "yes 2/2" in result.stdout  # linear is lossless on both prompts (the warmup one counts too)
    sessions = db.connect(str(dbfile), create=False)
    with sessions() as s:
        assert s.scalar(select(func.count(db.Sample.id))) == 4  # 2 prompts x (ar, linear)
        run = s.scalars(select(db.Run)).one()
        assert run.status == "completed"
        assert run.environment["torch"] and run.environment["transformers"] and run.environment["device"] == "cpu"
        (source,) = run.environment["datasets"]  # the provenance load_documents returned, one per dataset entry
        assert source["name"] == "wikitext-2" and source["source"] == "local" and source["skip"] == 0
        assert source["files"][0].endswith("wiki.test.raw") and len(source["sha256"]) == 64
        assert {c.status for c in run.cells} == {"done"}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["markdown", "csv", "json", "table"])
def test_report_formats(tiny_run, fmt):
    dbfile, _ = tiny_run
    result = invoke("report", "--db", str(dbfile), "--format", fmt)
    assert result.exit_code == 0, result.output
    out = result.stdout
    if fmt == "json":
        cells = json.loads(out)["cells"]
        assert {c["label"] for c in cells} == {"ar", "linear"}
        lin = next(c for c in cells if c["label"] == "linear")
        assert lin["lossless"] == "yes" and lin["throughput_mean"] > 0 and lin["speedup"] > 0
    elif fmt == "csv":
        assert out.splitlines()[0].startswith("dataset,prompt_cap,gen_length,label")
        assert len(out.strip().splitlines()) == 3
    else:
        assert "linear" in out and "Throughput" in out


def test_validate_ok(tmp_path):
    result = invoke("validate", write_suite(tmp_path, TINY))
    assert result.exit_code == 0 and "ok" in result.stdout and "2 cells" in result.stdout


def test_decoders_lists_builtins():
    result = invoke("decoders")
    assert result.exit_code == 0
    for name in ("ar", "linear"):
        assert name in result.stdout
    assert "dtbench" in result.stdout


@pytest.mark.parametrize(
    "text, needles",
    [
        ("name: x\ndatasets: [\n  {name: wikitext-2\n", ["malformed YAML", "suite.yaml:"]),
        (yaml.safe_dump({**TINY, "colour": "red"}), ["colour", "unknown key", "suite.yaml:"]),
        (yaml.safe_dump({**TINY, "generation_lengths": [0]}), ["generation_lengths"]),
        (
            yaml.safe_dump({**TINY, "decoders": [{"name": "linaer"}]}),
            ["unknown decoder 'linaer'", "did you mean 'linear'"],
        ),
        (yaml.safe_dump({**TINY, "decoders": [{"name": "linear", "params": {"k": 0}}]}), ["'linear'", "params.k"]),
        (
            yaml.safe_dump({**TINY, "decoders": [{"name": "linear", "params": {"kk": 3}}]}),
            ["params.kk", "unknown parameter"],
        ),
        (yaml.safe_dump({**TINY, "datasets": [{"name": "wikitext-3"}]}), ["unknown dataset 'wikitext-3'"]),
        (yaml.safe_dump({**TINY, "draft": None}), ["needs a draft model"]),
        ("- just\n- a list\n", ["must be a YAML mapping"]),
    ],
)
def test_bad_suites_fail_in_one_line(tmp_path, text, needles):
    for command in ("validate", "run"):
        one_line_error(
            invoke(command, write_suite(tmp_path, text), "--db", str(tmp_path / "r.db"))
            if command == "run"
            else invoke(command, write_suite(tmp_path, text)),
            *needles,
        )


def test_yaml_error_names_the_line(tmp_path):
    text = "name: x\nseed: 0\ndatasets:\n  - {name: wikitext-2, prompts: -3}\n"
    one_line_error(invoke("validate", write_suite(tmp_path, text)), "suite.yaml:4", "datasets.0")


def test_missing_suite_file(tmp_path):
    one_line_error(invoke("validate", str(tmp_path / "nope.yaml")), "cannot read suite")


def test_missing_dataset_files(tmp_path):
    result = invoke("run", write_suite(tmp_path, TINY), "--db", str(tmp_path / "r.db"), "--data-dir", str(tmp_path))
    one_line_error(result, "wiki.test.raw", "not found")


def test_unknown_model_offline(tmp_path, data_dir, monkeypatch):
    # What a machine without the hub sees, without waiting for network time-outs.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    suite = {**TINY, "target": {"model": "no-such-org/no-such-model"}, "draft": {"model": "no-such-org/no-such-model"}}
    result = invoke("run", write_suite(tmp_path, suite), "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir))
    one_line_error(result, "no-such-org/no-such-model")


@pytest.mark.slow
def test_vocabulary_mismatch(tmp_path, data_dir, smollm2):
    """A draft whose embedding table differs from the target's is refused before any run is written."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, _, tok = smollm2
    folder = tmp_path / "tiny-draft"
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)  # same tokenizer, so the mismatch is the model's vocabulary
    suite = {**TINY, "draft": {"model": str(folder), "dtype": "float32"}}
    dbfile = tmp_path / "r.db"
    result = invoke("run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir))
    one_line_error(result, "tiny-draft': its input embedding has 1000 rows", "49152")
    with db.connect(str(dbfile))() as s:
        assert s.scalar(select(func.count(db.Run.id))) == 0


def test_unwritable_database(tmp_path):
    result = invoke("run", write_suite(tmp_path, TINY), "--db", "/proc/nonexistent/dir/results.db")
    one_line_error(result, "cannot open database")


def test_report_without_database(tmp_path):
    one_line_error(invoke("report", "--db", str(tmp_path / "none.db")), "no results database")


def test_report_unknown_run(tiny_run):
    dbfile, _ = tiny_run
    one_line_error(invoke("report", "--db", str(dbfile), "--run", "999"), "no run 999")


class _Boom:
    """Stands in for an entry point whose decoder raises mid-run, or is interrupted (Ctrl-C) on prompt 1."""

    def __init__(self, exc_type):
        from dtbench.decoders.ar import Autoregressive

        class Exploding(Autoregressive):
            def generate(self, input_ids, max_new_tokens):
                yield from super().generate(input_ids, 2)
                raise exc_type("boom at the third token")

        self.cls = Exploding

    def load(self):
        return self.cls


def _with_fake_decoder(monkeypatch, name, exc_type):
    real = registry.discover

    def discover():
        found = dict(real())
        found[name] = registry.DecoderEntry(name, "fake-dist", "0", _Boom(exc_type))
        return found

    monkeypatch.setattr(registry, "discover", discover)


@pytest.mark.slow
def test_failing_decoder_fails_its_cell_only(tmp_path, data_dir, monkeypatch):
    _with_fake_decoder(monkeypatch, "boom", RuntimeError)
    # isolation: none: the fake decoder is this process's monkeypatched registry, which no child process sees
    suite = {
        **TINY,
        "isolation": "none",
        "decoders": [{"name": "ar"}, {"name": "boom"}, {"name": "linear", "params": {"k": 2}}],
    }
    dbfile = tmp_path / "r.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 4, result.output  # a cell failed: the report prints, then the documented exit code
    assert "boom failed: prompt 0: RuntimeError: boom at the third token" in result.stdout
    with db.connect(str(dbfile))() as s:
        cells = {c.label: c for c in s.scalars(select(db.Cell))}
        assert cells["boom"].status == "failed" and len(cells["boom"].samples) == 0
        assert cells["linear"].status == "done" and len(cells["linear"].samples) == 2
        assert s.scalars(select(db.Run)).one().status == "completed"


@pytest.mark.slow
def test_interrupt_keeps_samples_and_resume_completes(tmp_path, data_dir, monkeypatch):
    _with_fake_decoder(monkeypatch, "stopper", KeyboardInterrupt)
    # isolation: none: a monkeypatched registry's decoder, and its KeyboardInterrupt is this process's Ctrl-C
    suite = {**TINY, "isolation": "none", "decoders": [{"name": "ar"}, {"name": "stopper"}]}
    path = write_suite(tmp_path, suite)
    dbfile = tmp_path / "r.db"
    result = invoke("run", path, "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress")
    assert result.exit_code == 130 and "interrupted" in result.stderr and "--resume-run 1" in result.stderr
    with db.connect(str(dbfile))() as s:
        run = s.scalars(select(db.Run)).one()
        assert run.status == "interrupted"
        assert s.scalar(select(func.count(db.Sample.id))) == 1  # ar on prompt 0, measured before Ctrl-C
    # Resume with a decoder that no longer interrupts: nothing is measured twice.
    monkeypatch.undo()
    from dtbench.decoders.ar import Autoregressive

    real = registry.discover
    monkeypatch.setattr(
        registry,
        "discover",
        lambda: {
            **real(),
            "stopper": registry.DecoderEntry(
                "stopper", "fake-dist", "0", type("EP", (), {"load": staticmethod(lambda: Autoregressive)})()
            ),
        },
    )
    # A run measured under other versions is not continued: its samples would not be comparable.
    with db.connect(str(dbfile))() as s:
        run = s.scalars(select(db.Run)).one()
        real_env = dict(run.environment)
        run.environment = {**real_env, "torch": "0.0.1"}
        s.commit()
    one_line_error(
        invoke("run", "--resume", path, "--db", str(dbfile), "--data-dir", str(data_dir)),
        "torch = '0.0.1'",
        "start a new run",
    )
    with db.connect(str(dbfile))() as s:
        s.scalars(select(db.Run)).one().environment = real_env
        s.commit()
    result = invoke("run", "--resume", path, "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress")
    assert result.exit_code == 0, result.output
    with db.connect(str(dbfile))() as s:
        run = s.scalars(select(db.Run)).one()
        assert run.status == "completed"
        counts = s.execute(
            select(db.Sample.cell_id, db.Sample.prompt_index, func.count()).group_by(
                db.Sample.cell_id, db.Sample.prompt_index
            )
        ).all()
        assert len(counts) == 4 and all(n == 1 for *_, n in counts)
