"""The GPU smoke suite (issue 38 item 4) at tiny shapes on a CPU: `dtbench run` end to end over random-weight models
named by shape and the built-in `random-tokens` dataset, no download, no tokenizer; reports label it a smoke test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kit import invoke
from sqlalchemy import select

from dtbench.harness.errors import DtbenchError
from dtbench.harness.models import loading as models
from dtbench.harness.store import db
from dtbench.harness.suites.suite import ModelSpec

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

SUITE = Path(__file__).resolve().parents[1] / "suites" / "gpu-smoke.yaml"


def tiny_smoke(tmp_path: Path) -> Path:
    """suites/gpu-smoke.yaml at tiny shapes, float32 on the CPU (everything else as the GPU suite has it)."""
    suite = yaml.safe_load(SUITE.read_text(encoding="utf-8"))
    suite.update(
        device="cpu",
        target={"model": "random:tiny:0", "dtype": "float32"},
        draft={"model": "random:tiny-draft:1", "dtype": "float32"},
        generation_lengths=[12],
    )
    suite["datasets"][0].update(prompts=2, L_max=24, params={"vocab": 512, "documents": 4, "length": 64})
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(suite), encoding="utf-8")
    return path


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_random_models_by_shape_are_seeded_and_tokenizer_free():
    a = models.load_model(ModelSpec(model="random:tiny:3"), models.resolve_device("cpu")).model
    b = models.load_model(ModelSpec(model="random:tiny:3"), models.resolve_device("cpu")).model
    c = models.load_model(ModelSpec(model="random:tiny"), models.resolve_device("cpu")).model
    assert a.config.hidden_size == 128 and a.config.vocab_size == 512
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not all((p == q).all() for p, q in zip(a.parameters(), c.parameters(), strict=True))
    tok = models.load_tokenizer(ModelSpec(model="random:tiny"))
    assert len(tok) == 512 and tok.encode("5 7 511") == [5, 7, 511] and tok.decode([5, 7]) == "5 7"
    with pytest.raises(DtbenchError, match="token ids below 512"):
        tok.encode("hello world")
    with pytest.raises(DtbenchError, match="unknown random shape 'pythia-1b'"):
        models.load_tokenizer(ModelSpec(model="random:pythia-1b"))


def test_the_smoke_suite_runs_end_to_end_and_says_it_is_a_smoke_test(tmp_path):
    dbfile = tmp_path / "smoke.db"
    result = invoke("run", str(tiny_smoke(tmp_path)), "--db", str(dbfile), "--no-progress")
    assert result.exit_code == 0, result.output
    with db.connect(str(dbfile))() as s:
        cells = {c.label: c for c in s.scalars(select(db.Cell))}
        run = s.scalars(select(db.Run)).one()
        assert run.environment["datasets"][0]["smoke_test"] is True
        assert {c.dataset for c in cells.values()} == {"random-tokens (smoke test)"}
        assert set(cells) == {
            "AR",
            "Linear Spec (K=8)",
            "Fixed Tree (D=8, B=3, tau=0.1)",
            "DynaTree",
            "HF generate",
            "HF assisted",
        }
        for cell in cells.values():
            assert cell.status == "done" and len(cell.samples) == 2, cell.label
            assert all(x.lossless is not False for x in cell.samples), cell.label
            assert all(len(x.output_tokens) == 12 for x in cell.samples)
    for fmt in ("table", "markdown", "csv", "json", "html"):
        shown = invoke("report", "--db", str(dbfile), "--format", fmt)
        assert shown.exit_code == 0, (fmt, shown.output)
        assert "smoke test" in shown.output, fmt
    tables = invoke("report", "--db", str(dbfile), "--tables")
    assert tables.exit_code == 0, tables.output
    assert json.loads(invoke("report", "--db", str(dbfile), "--format", "json").stdout)["cells"]
