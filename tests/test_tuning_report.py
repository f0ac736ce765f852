"""reports/pricing/tuning.py: the line naming the fastest DynaTree setting of a tuning run (database only)."""

from __future__ import annotations

from click.testing import CliRunner
from reportdb import add_cell, add_run, add_samples

from dtbench.cli.main import cli
from dtbench.decoders.dynatree import DynaTreeParams
from dtbench.harness.store import db
from dtbench.reports.pricing.tuning import best_setting, tuning_line
from dtbench.reports.views.summary import samples_frame, summarize

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


def tuning_db(path, settings, ars=({},)):
    """A run with AR at 10 tokens/s (one cell per options dict of ``ars``: greedy at T=64 by default) and one
    DynaTree cell per (label, params, throughputs[, cell options])."""
    sessions = db.connect(str(path))
    with sessions() as s:
        run = add_run(s, "dynatree-tuning")
        for i, options in enumerate(ars):
            add_samples(s, add_cell(s, run, f"AR {i}", "ar", **options), [10.0, 10.0, 10.0], warmup=1)
        for label, params, thr, *options in settings:
            full = DynaTreeParams(**params).model_dump(mode="json")
            add_samples(
                s, add_cell(s, run, label, "dynatree", params=full, **(options[0] if options else {})), thr, warmup=1
            )
        s.commit()
        rid = run.id
    return sessions, rid


def test_best_setting_and_its_changed_params(tmp_path):
    sessions, rid = tuning_db(
        tmp_path / "t.db",
        [
            ("DynaTree defaults", {}, [1.0, 12.0, 12.0]),
            ("rho_stop (rho_stop=0.05)", {"rho_stop": 0.05}, [50.0, 15.0, 13.0]),  # the warmup sample is ignored
            ("W (window=16)", {"window": 16}, [1.0, 11.0, 11.0]),
        ],
    )
    with sessions() as s:
        best = best_setting(summarize(samples_frame(s, rid)))
    assert (
        best["decoder"] == "dynatree"
        and best["label"] == "rho_stop (rho_stop=0.05)"
        and best["changed"] == {"rho_stop": 0.05}
    )
    assert abs(best["speedup"] - 1.4) < 1e-9 and abs(best["defaults_speedup"] - 1.2) < 1e-9
    assert best["runner_up"][0] == "DynaTree defaults" and best["cells"] == 3 and best["n"] == 2
    line = tuning_line(best)
    assert "best setting 'rho_stop (rho_stop=0.05)'" in line and "1.40x" in line and "rho_stop=0.05" in line


def test_report_prints_the_line_only_for_runs_comparing_dynatree_settings(tmp_path):
    sessions, _ = tuning_db(
        tmp_path / "t.db",
        [("DynaTree defaults", {}, [1.0, 12.0, 12.0]), ("B_mid (b_mid=3)", {"b_mid": 3}, [1.0, 9.0, 9.0])],
    )
    out = CliRunner().invoke(cli, ["report", "--db", str(tmp_path / "t.db")], catch_exceptions=False)
    assert out.exit_code == 0 and "dynatree tuning: best setting 'DynaTree defaults'" in out.output
    assert "params changed from the defaults: none (the defaults)" in out.output
    single, _ = tuning_db(tmp_path / "one.db", [("DynaTree", {}, [1.0, 12.0, 12.0])])
    out = CliRunner().invoke(cli, ["report", "--db", str(tmp_path / "one.db")], catch_exceptions=False)
    assert out.exit_code == 0 and "tuning: best setting" not in out.output


def test_only_settings_side_by_side_are_compared(tmp_path):
    """The same params decoded three ways (suites/sampling.yaml's shape) or on two workloads are not settings to
    choose between; two params on one workload are, whatever else the run holds."""
    t07, t10 = {"temperature": 0.7}, {"temperature": 1.0}
    sessions, rid = tuning_db(
        tmp_path / "modes.db",
        [
            ("DynaTree (greedy)", {}, [1.0, 12.0, 12.0]),
            ("DynaTree (T=0.7)", {}, [1.0, 20.0, 20.0], {"sampling": t07}),
            ("DynaTree (T=1.0)", {}, [1.0, 9.0, 9.0], {"sampling": t10}),
            ("DynaTree (T=32)", {}, [1.0, 30.0, 30.0], {"T": 32}),
        ],
        ars=({}, {"sampling": t07}, {"sampling": t10}, {"T": 32}),
    )
    with sessions() as s:
        summary = summarize(samples_frame(s, rid))
    assert summary["speedup"].notna().all()  # every cell has its baseline: only the comparison rule leaves them out
    assert best_setting(summary) is None
    sessions, rid = tuning_db(
        tmp_path / "both.db",
        [
            ("DynaTree (T=0.7)", {}, [1.0, 50.0, 50.0], {"sampling": t07}),
            ("defaults", {}, [1.0, 12.0, 12.0]),
            ("W=16", {"window": 16}, [1.0, 13.0, 13.0]),
        ],
        ars=({}, {"sampling": t07}),
    )
    with sessions() as s:
        best = best_setting(summarize(samples_frame(s, rid)))
    assert best["label"] == "W=16" and best["runner_up"][0] == "defaults" and best["cells"] == 2
