"""The run plan (harness/suites/plan.py) and suite includes: one grid, per-decoder restrictions, references spread to
wherever a dependent runs, and `include:` merging with errors that name the right file and line."""

from __future__ import annotations

import pytest
from kit import invoke, one_line_error

from dtbench.harness.errors import DtbenchError
from dtbench.harness.suites.grouping import CellKey
from dtbench.harness.suites.plan import plan_suite
from dtbench.harness.suites.suitefile import load_suite, parse_suite

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

SUITE = """
name: grid
device: cpu
target: {model: smollm2-135m}
draft: {model: smollm2-135m, dtype: bfloat16}
datasets:
  - {name: wikitext-2, prompts: 3, warmup: 1, L_max: [64, 128]}
  - {name: pg19, prompts: 2, warmup: 1, L_max: 64}
generation_lengths: [8, 16, 32]
decoders:
  - {name: linear, label: L, params: {k: 2}}
  - {name: linear, label: L-scaling, params: {k: 4}, generation_lengths: [16, 32], L_max: 64, datasets: [pg19]}
  - {name: streaming_spec, label: S, params: {sinks: 4, window: 32, k: 2}, generation_lengths: [32], datasets: [pg19]}
"""


def test_restrictions_and_reference_spreading():
    plan = plan_suite(parse_suite(SUITE))
    labels = [c.label for c in plan.decoders]
    # References first: the implicit ar, and the implicit streaming_ar reference of S.
    assert labels.index("ar") < labels.index("L") and labels.index("streaming_ar (sinks=4, window=32)") < labels.index(
        "S"
    )
    by = {c.label: c for c in plan.decoders}
    # a point is (dataset, L_max, T, batch size B); the suite's batch_sizes default to [1]
    assert by["L-scaling"].points == {CellKey("pg19", 64, 16, 1), CellKey("pg19", 64, 32, 1)}
    assert by["S"].points == {CellKey("pg19", 64, 32, 1)}
    assert by["streaming_ar (sinks=4, window=32)"].points == by["S"].points  # only where its dependent runs
    assert by["ar"].points == by["L"].points  # ar everywhere L runs (L is unrestricted): 3 caps x 3 T
    assert len(by["ar"].points) == 9
    cells = plan.cells()
    assert len(cells) == 9 + 9 + 2 + 1 + 1
    groups = plan.groups()
    assert len(groups) == 2 * 3 * 3 + 1 * 3 * 2  # wikitext: 2 caps x 3 T x 3 prompts; pg19: 3 T x 2 prompts
    # wikitext: 6 points x (ar, L) x 3 prompts; pg19 T=8: ar, L; T=16: + L-scaling; T=32: + streaming_ar, S
    assert plan.n_samples == sum(len(g.decoders) for g in groups) == 6 * 2 * 3 + 2 * (2 + 3 + 5)
    g = next(g for g in groups if g.dataset.name == "pg19" and g.gen_length == 32)
    assert [c.label for c in g.decoders][:2] == ["ar", "streaming_ar (sinks=4, window=32)"]
    assert g.warmup and not groups[1].warmup


@pytest.mark.parametrize(
    "entry, needle",
    [
        ("{name: linear, generation_lengths: [64]}", "generation_lengths [64] are not in the suite's"),
        ("{name: linear, L_max: 999}", "L_max [999] is not an L_max of any dataset"),
        ("{name: linear, datasets: [c4]}", "datasets names 'c4', which the suite does not have"),
        ("{name: linear, batch_sizes: [4]}", "batch_sizes [4] are not in the suite's batch_sizes"),
    ],
)
def test_restrictions_must_name_suite_values(tmp_path, entry, needle):
    text = SUITE.split("decoders:")[0] + f"decoders:\n  - {{name: ar}}\n  - {entry}\n"
    (tmp_path / "s.yaml").write_text(text)
    one_line_error(invoke("validate", str(tmp_path / "s.yaml")), "s.yaml:", "decoders.1:", needle)


def test_sweep_points_remember_their_group():
    text = SUITE.split("decoders:")[0] + "decoders:\n  - {name: linear, label: Lin, sweep: {k: [2, 4]}}\n"
    plan = plan_suite(parse_suite(text))
    lin = [c for c in plan.decoders if c.spec.name == "linear"]
    assert [(c.spec.sweep_group, c.spec.swept) for c in lin] == [("Lin", {"k": 2}), ("Lin", {"k": 4})]


def test_sweep_points_keep_every_other_field():
    # expand() copies the entry (model_copy): every field but label/params/sweep carries over, new fields included.
    text = SUITE.split("decoders:")[0] + (
        "decoders:\n  - {name: ar}\n  - {name: linear, label: Lin, sweep: {k: [2, 4]}, params: {k: 1}, optional: true,"
        " datasets: [pg19], generation_lengths: [16], L_max: 64, sampling: greedy}\n"
    )
    entry = parse_suite(text).decoders[1]
    points = entry.expand()
    assert [p.params for p in points] == [{"k": 2}, {"k": 4}]
    assert [p.label for p in points] == ["Lin (k=2)", "Lin (k=4)"]
    for p in points:
        assert p.sweep == {} and p.where == entry.where and entry.where.endswith("decoders.1")
        for field in set(type(entry).model_fields) - {"label", "params", "sweep"}:
            assert getattr(p, field) == getattr(entry, field), field
    assert entry.sweep_group is None and entry.swept == {}  # the entry itself is untouched


def test_include_merges_and_names_the_right_file(tmp_path):
    (tmp_path / "base.yaml").write_text(SUITE)
    (tmp_path / "child.yaml").write_text("include: base.yaml\nname: child\ngeneration_lengths: [8]\n")
    suite, text = load_suite(tmp_path / "child.yaml")
    assert suite.name == "child" and suite.generation_lengths == [8] and len(suite.datasets) == 2
    assert "# --- include:" in text and "streaming_spec" in text  # the stored text covers the included file
    (tmp_path / "child.yaml").write_text("include: base.yaml\nname: child\n\ngeneration_lengths: [0]\n")
    with pytest.raises(DtbenchError, match=r"child\.yaml:4: generation_lengths"):
        load_suite(tmp_path / "child.yaml")
    (tmp_path / "bad.yaml").write_text(SUITE.replace("prompts: 2,", "prompts: x,"))
    (tmp_path / "child.yaml").write_text("include: [bad.yaml]\nname: child\n")
    with pytest.raises(DtbenchError, match=r"bad\.yaml:8: datasets\.1\.prompts"):
        load_suite(tmp_path / "child.yaml")
    (tmp_path / "loop.yaml").write_text("include: loop.yaml\nname: l\n")
    with pytest.raises(DtbenchError, match="includes itself"):
        load_suite(tmp_path / "loop.yaml")
    (tmp_path / "child.yaml").write_text("include: nowhere.yaml\nname: child\n")
    with pytest.raises(DtbenchError, match="nowhere.yaml not found"):
        load_suite(tmp_path / "child.yaml")


def test_cells_store_their_sweep_point(tmp_path, data_dir):
    """Reports read sweep membership from the database (cells.sweep_group / swept), never from re-parsed text."""
    from kit import suite_dict, tiny_pair, write_suite
    from sqlalchemy import select

    from dtbench.harness.store import db

    pair = tiny_pair(tmp_path / "models")
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "linear", "label": "Lin", "sweep": {"k": [1, 2]}}])
    dbfile = tmp_path / "r.db"
    result = invoke(
        "run",
        write_suite(tmp_path, suite),
        "--db",
        str(dbfile),
        "--data-dir",
        str(data_dir),
        "--no-progress",
        "--no-report",
    )
    assert result.exit_code == 0, result.output
    with db.connect(str(dbfile))() as s:
        cells = {c.label: (c.sweep_group, c.swept, c.params) for c in s.scalars(select(db.Cell))}
    assert cells["ar"] == (None, None, {})
    # cells.params: the whole validated params, defaults included (linear's fused_draft since issue 46 item 2)
    assert cells["Lin (k=1)"] == ("Lin", {"k": 1}, {"k": 1, "fused_draft": False})
    assert cells["Lin (k=2)"] == ("Lin", {"k": 2}, {"k": 2, "fused_draft": False})


def test_references_decode_the_way_their_dependents_do():
    """A greedy decoder is checked against a greedy AR, a sampled one paired with the AR sampled alike; a missing
    one is added with the dependent's sampling (and a label that says so)."""
    text = (
        SUITE.split("decoders:")[0]
        + """sampling: {temperature: 0.7}
decoders:
  - {name: ar, label: AR greedy, sampling: greedy}
  - {name: ar, label: AR hot}
  - {name: linear, label: G, params: {k: 2}, sampling: greedy}
  - {name: linear, label: H, params: {k: 2}}
  - {name: linear, label: C, params: {k: 2}, sampling: {temperature: 1.0}}
"""
    )
    by = {c.label: c for c in plan_suite(parse_suite(text)).decoders}
    assert by["G"].reference_label == "AR greedy" and by["H"].reference_label == "AR hot"
    added = by[by["C"].reference_label]
    assert added.implicit and added.sampling.temperature == 1.0 and "T=1" in added.label
