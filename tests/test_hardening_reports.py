"""What reports show (issues 19, 33 and 42): labels and categories from the database are data, never markup,
formulas or terminal escapes (CSV, Markdown, HTML, terminal tables, error lines, the decoders table); a run id no
database can hold is no such run; and the numbers reports rank are the right ones (a cell that failed its lossless
check is never the best setting, a server cell's speedup is against its plain server, profiles and batch tables
leave out what the cell table leaves out, each predicted speedup says which question it answers).

Split out of tests/test_hardening.py by subject (issue 57 item 3); each section names the issue item it tests.
Shared helpers: tests/hardening_kit.py.
"""

from __future__ import annotations

import json
import re

import pytest
from hardening_kit import HOSTILE_CATEGORY, TINY, run_to_db
from kit import invoke, one_line_error, write_suite

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)


# --- issue 19 item 3: formulas and terminal escapes from labels ----------------------------------------------------


def _hostile_db(tmp_path) -> str:
    import reportdb

    from dtbench.harness.store import db

    path = tmp_path / "hostile.db"
    sessions = db.connect(str(path))
    with sessions() as s:
        run = reportdb.add_run(s)
        ar = reportdb.add_cell(s, run, "ar")
        reportdb.add_samples(s, ar, [10.0] * 6, warmup=1)
        for label in [
            '=HYPERLINK("http://evil.example","click")',
            "+1+1",
            "@SUM(A1)",
            "-2+3",
            "red \x1b[31mx",
            "title \x1b]0;pwned\x07",
            "two\nlines | pipe",
            "markup [/oops]",
        ]:
            cell = reportdb.add_cell(s, run, label, "linear")
            reportdb.add_samples(s, cell, [12.0] * 6, warmup=1)
        s.commit()
    return str(path)


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_csv_neutralises_formulas(tmp_path):
    import csv
    import io

    path = _hostile_db(tmp_path)
    for extra in ([], ["--compare"]):
        result = invoke("report", "--db", path, "--format", "csv", *extra)
        assert result.exit_code == 0, result.output
        rows = list(csv.DictReader(io.StringIO(result.stdout)))
        labels = {r["label"] for r in rows}
        assert '\'=HYPERLINK("http://evil.example","click")' in labels, labels
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


# --- issue 19 item 13: a run id no database can hold is no such run ------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--run", "99999999999999999999999"],
        ["--compare", "1", "99999999999999999999999"],
        ["--run", str(1 << 63)],
        ["--cost-model", "--run", "99999999999999999999999"],
    ],
)
def test_huge_run_ids_are_no_such_run(tmp_path, args):
    path = _hostile_db(tmp_path)
    one_line_error(invoke("report", "--db", path, *args), "no run ")


# --- issue 33 item 1: every error line is escaped ------------------------------------------------------------------


def test_every_error_line_is_escaped(tmp_path, monkeypatch):
    """The CLI's one error line escapes whatever message reaches it (a DtbenchError or an internal error)."""
    from dtbench.harness.errors import DtbenchError
    from dtbench.harness.suites import suitefile

    for exc, prefix in (
        (DtbenchError("bad \x1b]0;title\x07 thing"), "error: "),
        (RuntimeError("bad \x1b[2J thing"), "internal error: "),
    ):
        monkeypatch.setattr(suitefile, "load_suite", lambda *a, _e=exc: (_ for _ in ()).throw(_e))
        result = invoke("validate", write_suite(tmp_path, TINY))
        assert result.stderr.startswith(prefix) and "\\x1b" in result.stderr, result.stderr
        assert "\x1b" not in result.stderr and "\x07" not in result.stderr


# --- issue 33 item 2: control characters in HTML, raw HTML in Markdown ---------------------------------------------


def _question_db(tmp_path, category: str) -> str:
    """A run of spec-bench samples (ar and linear, two questions) whose task group and category are ``category``."""
    import reportdb

    path = tmp_path / "q.db"
    with reportdb.connect(path)() as s:
        run = reportdb.add_run(s)
        for label in ("ar", "linear"):
            cell = reportdb.add_cell(s, run, label, dataset="spec-bench")
            for i, sample in enumerate(reportdb.add_samples(s, cell, [10.0, 12.0] if label == "ar" else [20.0, 24.0])):
                sample.task_group, sample.category, sample.turn, sample.question_id = category, category, 1, str(i)
        s.commit()
    return str(path)


@pytest.mark.parametrize("extra", [["--spec-bench"], ["--by", "category"], ["--by", "group"]])
def test_html_report_shows_control_characters_escaped(tmp_path, extra):
    path = _question_db(tmp_path, HOSTILE_CATEGORY + "\x00nul")
    result = invoke("report", "--db", path, "--format", "html", *extra)
    assert result.exit_code == 0, result.output
    assert "\\x1b[31mRED\\x1b]0;pwn\\x07\\x00nul" in result.stdout
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f]", result.stdout), repr(result.stdout[:300])


@pytest.mark.parametrize("extra", [["--spec-bench"], ["--by", "category"]])
def test_markdown_report_escapes_html(tmp_path, extra):
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    result = invoke("report", "--db", _question_db(tmp_path, hostile), "--format", "markdown", *extra)
    assert result.exit_code == 0, result.output
    assert "<script" not in result.stdout and "<img" not in result.stdout, result.stdout
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;" in result.stdout


def test_markdown_cell_and_html_text():
    from dtbench.harness.safetext import html_text, markdown_cell

    assert markdown_cell("a<b>&\n|c\x1b") == "a&lt;b&gt;&amp;<br>\\|c\\\\x1b"  # the escape's \\ escaped (issue 50)
    assert html_text("<th>\x00\x1b]0;t\x07") == "&lt;th&gt;\\x00\\x1b]0;t\\x07"


# --- issue 33, also seen: a cell that failed its lossless check is never a speedup to rank -------------------------


def _lossy_db(tmp_path) -> str:
    """AR at 10 t/s; linear k=2 and k=3 at 20 and 30 t/s (lossless); linear k=4 at 1000 t/s whose samples all
    diverged."""
    import reportdb

    path = tmp_path / "lossy.db"
    with reportdb.connect(path)() as s:
        run = reportdb.add_run(s)
        reportdb.add_samples(s, reportdb.add_cell(s, run, "ar"), [10.0] * 6, warmup=1)
        reportdb.add_samples(
            s, reportdb.add_cell(s, run, "linear (k=2)", "linear", params={"k": 2}), [20.0] * 6, warmup=1
        )
        reportdb.add_samples(
            s, reportdb.add_cell(s, run, "linear (k=3)", "linear", params={"k": 3}), [30.0] * 6, warmup=1
        )
        reportdb.add_samples(
            s,
            reportdb.add_cell(s, run, "linear (k=4)", "linear", params={"k": 4}),
            [1000.0] * 6,
            warmup=1,
            diverge={i: 3 for i in range(6)},
        )
        s.commit()
    return str(path)


def _row(markdown: str, label: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith(f"| {label} "))


def test_a_speedup_that_is_not_lossless_is_marked_and_never_best(tmp_path):
    path = _lossy_db(tmp_path)
    cells = invoke("report", "--db", path, "--format", "markdown")
    assert cells.exit_code == 0, cells.output
    assert "100.00× (not lossless)" in _row(cells.stdout, "linear (k=4)")
    assert "(not lossless)" not in _row(cells.stdout, "linear (k=2)")
    assert "best setting 'linear (k=3)'" in cells.stderr, cells.stderr  # never the 100x cell that diverged
    compared = invoke("report", "--db", path, "--compare", "--format", "markdown")
    assert compared.exit_code == 0, compared.output
    lossy = next(r for r in compared.stdout.splitlines() if "| linear (k=4) |" in r)
    assert "100.000× (not lossless)" in lossy, lossy
    assert "(not lossless)" not in next(r for r in compared.stdout.splitlines() if "| linear (k=2) |" in r)


def test_best_setting_skips_cells_that_failed_the_lossless_check(tmp_path):
    import reportdb

    from dtbench.reports.pricing.tuning import best_setting
    from dtbench.reports.views.summary import get_run, samples_frame, summarize

    with reportdb.connect(_lossy_db(tmp_path))() as s:
        summary = summarize(samples_frame(s, get_run(s, None).id))
    best = best_setting(summary)
    assert best is not None and best["label"] == "linear (k=3)" and best["runner_up"][0] == "linear (k=2)", best


def test_exact_rule_note_agrees_with_its_verdict():
    """'yes 2/2 (1 tie)' under the exact rule: the tie did not change the output, so the note must not say that the
    exact rule counts ties as divergences."""
    from dtbench.reports.views.notes import lossless_notes

    row = {
        "label": "linear",
        "lossless": "yes",
        "lossless_n": "2/2",
        "reference": "ar",
        "status": "done",
        "lossless_rule": "exact",
        "lossless_ties": 1,
        "lossless_tie_samples": 1,
        "lossless_checked_n": 2,
        "lossless_error_samples": 0,
        "target_dtype": "bfloat16",
        "lossless_max_tie_margin": 0.0625,
        "divergences": [],
        "lossless_expected": True,
    }
    note = " ".join(lossless_notes(row))
    assert "counts them as divergences" not in note
    assert "the exact rule fails a sample only where its output differs from the reference's" in note


# --- issue 33, also seen: a plugin's names in the decoders table ---------------------------------------------------


def test_a_plugins_names_are_escaped_in_the_decoders_table(tmp_path, monkeypatch):
    from kit import install_plugin

    install_plugin(
        monkeypatch,
        tmp_path / "site",
        "dtbench-evil",
        {"evil": "dtbench_evil:Evil"},
        """
        from pydantic import Field

        from dtbench.decoders.ar import Autoregressive
        from dtbench.decoders.base import DecoderParams


        class P(DecoderParams):
            mode: str = Field("\\x1b]0;pwn\\x07[red]x[/red]")


        class Evil(Autoregressive):
            Params = P
        """,
    )
    result = invoke("decoders")
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "\\x1b]0;pwn\\x07[red]x[/red]" in result.stdout.replace("\n", "").replace(" ", "")


# --- issue 42 item 6: one speedup for a server cell: against its reference server ----------------------------------


def test_a_server_speedup_is_against_its_plain_server_in_every_report(tmp_path):
    import reportdb

    path = tmp_path / "r.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        reportdb.add_served_pair(session, run)
        session.commit()
    result = invoke("report", "--db", str(path), "--format", "json")
    assert result.exit_code == 0, result.output
    rows = {r["label"]: r for r in json.loads(result.stdout)["cells"]}
    assert rows["spec"]["speedup"] == pytest.approx(0.4)  # 40 / 100, never 40 / 1 against ar in this process
    assert rows["plain"]["speedup"] is None  # a plain server against ar would be an engine-vs-harness comparison
    from dtbench.reports.views.compare import speedup_table
    from dtbench.reports.views.summary import samples_frame

    with reportdb.connect(path)() as session:
        table = speedup_table(samples_frame(session, run.id)).set_index("label")
    assert table.loc["spec", "speedup"] == pytest.approx(0.4)


# --- issue 42 item 7: a remainder group the cell table leaves out --------------------------------------------------


def _batched_run(path, remainder_accepted: list[int]):
    """A linear cell at B = 2: one warmup row, a full group of two rows (1 accepted of 2 at each step) and a
    remainder row (``remainder_accepted`` at depth 2)."""
    import reportdb

    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        cell = reportdb.add_cell(session, run, "linear", "linear")
        cell.batch_size = 2
        samples = reportdb.add_samples(session, cell, [100.0] * 4, warmup=1)
        for i, sample in enumerate(samples):
            accepted = remainder_accepted if i == 3 else [1, 1]
            sample.step_stats = {"accepted": accepted, "depth": [2] * len(accepted), "drafted": [2] * len(accepted)}
            sample.accepted = sum(accepted)
            sample.mean_path_length = sum(accepted) / len(accepted)
            sample.batch_group, sample.batch_rows = (0, 1) if i == 0 else ((1, 2) if i < 3 else (3, 1))
        session.commit()
        return run.id


def test_the_profile_leaves_out_the_remainder_the_cell_table_leaves_out(tmp_path):
    from dtbench.reports.views import profile_report as profile

    path = tmp_path / "r.db"
    rid = _batched_run(path, [2, 2, 2])
    import reportdb

    with reportdb.connect(path)() as session:
        (p,), _ = profile.run_profiles(session, rid)
    assert (p.requests, p.steps) == (2, 4)  # the full group's two rows, not the remainder row
    assert p.means["per_step_excl_bonus"] == pytest.approx(1.0)  # the remainder's 2.0 per step left out


# --- issue 42 item 11: report --profile writes nothing unless asked ------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "table"])
def test_profile_report_writes_no_file_unless_asked(tmp_path, monkeypatch, fmt):
    path = tmp_path / "r.db"
    rid = _batched_run(path, [2, 2])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = invoke("report", "--db", str(path), "--profile", "--format", fmt)
    assert result.exit_code == 0, result.output
    assert list(cwd.iterdir()) == [] and "wrote" not in result.stderr  # nothing written into the current folder
    if fmt == "json":
        assert json.loads(result.stdout)["run"] == rid
    asked = tmp_path / "p.json"
    result = invoke("report", "--db", str(path), "--profile", "--format", fmt, "--profile-json", str(asked))
    assert result.exit_code == 0 and json.loads(asked.read_text())["run"] == rid and f"wrote {asked}" in result.stderr


# --- issue 42 item 9: two predicted speedups of one cell: each table says which question it answers ----------------


def test_cost_model_tables_name_their_predicted_speedup(tmp_path, data_dir, monkeypatch):
    from kit import fast_calibration_settings, suite_dict, tiny_pair

    from dtbench.harness.calibration import calibrate_run
    from dtbench.reports.pricing import costmodel_batch

    monkeypatch.setattr(calibrate_run, "Settings", fast_calibration_settings())
    suite = suite_dict(
        *tiny_pair(tmp_path / "models"),
        [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}],
        batch_sizes=[1, 2],
        calibrate=True,
    )
    suite["datasets"][0].update(prompts=3, warmup=1)
    result = run_to_db(tmp_path, data_dir, write_suite(tmp_path, suite))
    assert result.exit_code == 0, result.output
    text = invoke("report", "--db", str(tmp_path / "r.db"), "--cost-model", "--format", "markdown").stdout
    cells, batch = text.split("speedup vs batch size, measured and predicted")
    assert costmodel_batch.PRED_FORWARDS in cells and costmodel_batch.PRED_STEADY not in cells
    assert costmodel_batch.PRED_STEADY in batch and costmodel_batch.PRED_FORWARDS not in batch
    assert "not the steady-state prediction of the batch table" in cells
    assert "| Speedup pred. |" not in text  # no unlabelled prediction beside a different one


# --- issue 42 item 7: a cell with only a remainder group -----------------------------------------------------------


def test_a_cell_with_only_a_remainder_says_so_not_all_warmup(tmp_path):
    """A run stored before the validate check: B = 4 with 1 warmup and 2 measured prompts (one remainder group)."""
    import reportdb

    path = tmp_path / "r.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        cell = reportdb.add_cell(session, run, "ar")
        cell.batch_size = 4
        for i, sample in enumerate(reportdb.add_samples(session, cell, [10.0] * 3, warmup=1)):
            sample.batch_group, sample.batch_rows = (0, 1) if i == 0 else (1, 2)
            sample.batch_total_s = sample.total_s
        session.commit()
    result = invoke("report", "--db", str(path), "--format", "markdown")
    assert result.exit_code == 0, result.output
    assert "no full batch of B=4 after warmup (2 measured prompts" in result.output
    assert "measured prompts are warmup" not in result.output
