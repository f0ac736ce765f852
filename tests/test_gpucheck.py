"""The offline GPU check (issue 31) on the CPU: the kit's builder and checker, tools/gpu-check.sh's refusals, each
step of the gpucheck package (gpucheck/, dtbench.gpucheck) at small shapes, and the JSON's schema (tools/gpu-check.schema.json)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
import torch

from dtbench import gpucheck
from dtbench.cli import offline

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

REPO = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((REPO / "tools" / "gpu-check.schema.json").read_text())
CPU = torch.device("cpu")


# the check's child processes start with one intra-op thread too: OMP_NUM_THREADS=1, set for every test process by
# tests/conftest.py (two threads spin-waiting beside the other worker made the smoke step's calibration 149 s of 165 s)
pytestmark = pytest.mark.usefixtures("one_thread")


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A wheel file holding only METADATA (what the kit's walk and check read)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


# --- the kit ---------------------------------------------------------------------------------------------------------


def test_node_list_parses_and_holds_the_node_torch():
    node = offline.node_packages()
    assert node["torch"] == "2.11.0" and node["transformers"] == "5.17.0"
    assert "sqlalchemy" not in node and "pydantic" not in node  # what the kit must bring


def test_the_kit_carries_pytest_and_hypothesis_although_the_node_has_them(tmp_path, monkeypatch):
    """Issue 38: the tests step runs the property suite with the pytest and hypothesis the tests passed with here."""
    assert offline.KIT_CARRY == ("pytest", "hypothesis")
    monkeypatch.setattr(offline, "project_requirements", lambda extras=(): [])
    node = {"pytest": "9.0.0", "hypothesis": "6.140.0", "iniconfig": None, "pluggy": None}
    assert offline.verify_kit(tmp_path, "3.12", node) == [
        "the tests step needs pytest: neither the node nor the kit has it",
        "the tests step needs hypothesis: neither the node nor the kit has it",
    ]
    fake_wheel(tmp_path, "pytest", "9.0.2", ["iniconfig", "pluggy"])
    fake_wheel(tmp_path, "hypothesis", "6.151.0", [])
    assert offline.verify_kit(tmp_path, "3.12", node) == []


def test_verify_kit_finds_missing_duplicate_and_mismatched_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(offline, "KIT_CARRY", ())
    monkeypatch.setattr(offline, "project_requirements", lambda extras=(): ["sqlalchemy>=2.0", "rich>=13"])
    node = {"rich": None, "typing-extensions": None}
    fake_wheel(tmp_path, "sqlalchemy", "2.1.9", ["greenlet>=1; platform_machine == 'x86_64'", "typing-extensions"])
    assert offline.verify_kit(tmp_path, "3.12", node) == [
        'sqlalchemy needs greenlet>=1; platform_machine == "x86_64": neither the node nor the kit has it'
    ]
    fake_wheel(tmp_path, "greenlet", "0.4", [])
    assert offline.verify_kit(tmp_path, "3.12", node) == [
        'sqlalchemy needs greenlet>=1; platform_machine == "x86_64": the kit has greenlet-0.4-py3-none-any.whl'
    ]
    fake_wheel(tmp_path, "greenlet", "3.5.6", [])
    problems = offline.verify_kit(tmp_path, "3.12", node)
    assert problems and problems[0].startswith("greenlet: 2 wheels")
    (tmp_path / "greenlet-0.4-py3-none-any.whl").unlink()
    assert offline.verify_kit(tmp_path, "3.12", node) == []
    # a marker false on the node (another Python) needs nothing
    fake_wheel(tmp_path, "alembic", "1.20.1", ["tomli; python_version < '3.11'"])
    assert offline.verify_kit(tmp_path, "3.12", node) == []


def test_build_kit_walks_requirements_and_skips_the_node_and_torch(tmp_path, monkeypatch):
    """The walk downloads each package once (pip stands in: it copies fake wheels), follows Requires-Dist with the
    node's markers, and never brings the node's packages, torch's stack or amdsmi."""
    index = tmp_path / "index"
    index.mkdir()
    fake_wheel(index, "zeus", "0.16.0", ["numpy", "amdsmi", "tyro", "pydantic"])
    fake_wheel(index, "tyro", "1.0.17", ["docstring-parser>=0.16", "torch; extra == 'dev'"])
    fake_wheel(index, "docstring_parser", "0.18.0", [])
    fake_wheel(index, "pydantic", "2.14.4", ["pydantic-core==2.50.5"])
    fake_wheel(index, "pydantic_core", "2.50.5", ["typing-extensions"])
    calls = []

    def fake_run(cmds):
        for cmd in cmds:
            spec = cmd[-1]
            calls.append(spec)
            name = offline.canonical(spec.split("=")[0].split(">")[0].split("<")[0]).replace("-", "_")
            src = next(
                p for p in index.glob("*.whl") if offline.canonical(p.name.split("-")[0]) == offline.canonical(name)
            )
            (Path(cmd[cmd.index("--dest") + 1]) / src.name).write_bytes(src.read_bytes())

    monkeypatch.setattr(offline, "_run", fake_run)
    monkeypatch.setattr(offline, "KIT_CARRY", ())  # the carried test wheels: the test above
    monkeypatch.setattr(offline, "project_requirements", lambda extras=(): ["zeus>=0.16,<0.17", "torch>=2.4", "numpy"])
    dest = tmp_path / "kit"
    chosen = offline.build_kit(dest, "3.12", ["manylinux_2_28_x86_64"], {"numpy": "2.5.2", "typing-extensions": None})
    assert set(chosen) == {"zeus", "tyro", "docstring-parser", "pydantic", "pydantic-core"}
    assert len(calls) == 5 and not any(c.startswith(("torch", "amdsmi", "numpy")) for c in calls)
    assert offline.verify_kit(dest, "3.12", {"numpy": "2.5.2", "typing-extensions": None}) == []
    offline.build_kit(dest, "3.12", ["manylinux_2_28_x86_64"], {"numpy": "2.5.2", "typing-extensions": None})
    assert len(calls) == 5  # the second walk reuses every wheel


def test_kit_summary_counts_the_repository_and_the_budget(tmp_path):
    fake_wheel(tmp_path, "mako", "1.4.3", [])
    s = offline.kit_summary(tmp_path, budget_mib=48)
    assert (
        s["repository_bytes"] > 100_000 and s["kit_bytes"] == (tmp_path / "mako-1.4.3-py3-none-any.whl").stat().st_size
    )
    assert s["fits"] and s["total_bytes"] == s["repository_bytes"] + s["kit_bytes"]
    assert not offline.kit_summary(tmp_path, budget_mib=0.01)["fits"]


def test_node_side_lists_the_node_packages_dtbench_needs_pinned_where_known(tmp_path):
    reqs = offline.node_side("3.12", offline.node_packages(), tmp_path)
    assert "transformers==5.17.0" in reqs and "pytest" in reqs and "click" in reqs
    assert not any(r.startswith(("torch", "sqlalchemy")) for r in reqs)


@pytest.mark.parametrize(
    "args, code, needle",
    [
        ([], 2, "usage"),
        (["--small"], 2, "usage"),
        (["OUT"], 3, "no wheels in"),
        # issue 67: the arguments are checked before the kit is installed (here: before "no wheels")
        (["OUT", "--steps", "lossless,nope"], 2, "--steps: unknown step 'nope'"),
        (["OUT", "--budget", "soon"], 2, "--budget: 'soon' is not a number of seconds"),
        (["OUT", "--devcie", "cpu"], 2, "unknown option '--devcie'"),
    ],
)
def test_gpu_check_sh_refuses_in_one_line(tmp_path, args, code, needle):
    env = {"PATH": "/usr/bin:/bin", "GPUKIT": str(tmp_path / "empty"), "PYTHON": sys.executable}
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "gpu-check.sh"), *args], capture_output=True, text=True, env=env
    )
    assert proc.returncode == code
    assert needle in (proc.stdout + proc.stderr) and len((proc.stdout + proc.stderr).strip().splitlines()) == 1


# --- the steps ---------------------------------------------------------------------------------------------------


def test_tree_node_bounds_follow_leaf_pruning():
    assert gpucheck.tree_node_bounds(8, 3, 0.1) == (8, 3 + 9 + 27 + 30 * 5)
    assert gpucheck.tree_node_bounds(3, 2, 0.5) == (3, 2 + 4 + 4)
    assert gpucheck.level_sizes(10, 4) == [3, 3, 2, 2] and gpucheck.level_sizes(2, 4) == [1, 1]


class _Linear:
    """Curves with cost a + b n (seconds), the draft 10x cheaper: predictions computable by hand."""

    def cost(self, role, n, past, flags=0):
        scale = 1.0 if role == "target" else 0.1
        return scale * (0.01 + 0.0001 * n)

    def roles(self):
        return {"target", "draft"}


def test_predict_by_hand():
    row = gpucheck.PAPER[0]  # linear K = 8 on WikiText-2: 220 iterations
    p = gpucheck.predict(_Linear(), row)
    ar = (0.01 + 0.0001 * 800) + 1500 * 0.0101
    method = (0.01 + 0.08) + 0.1 * (0.01 + 0.08) + 220 * (8 * 0.1 * 0.0101 + (0.01 + 0.0009))
    assert p["ar_s"] == pytest.approx(ar) and p["method_s"] == pytest.approx(method)
    assert p["speedup"] == pytest.approx(ar / method)
    tree = gpucheck.PAPER[2]
    few, many = gpucheck.predict(_Linear(), tree, 8), gpucheck.predict(_Linear(), tree, 189)
    assert few["speedup"] > many["speedup"]  # more nodes cost more per iteration at the same iterations


def _log(lines):
    return lines.append


@pytest.mark.full  # a whole check step in child processes (tens of seconds to minutes)
def test_lossless_step_passes_and_fails_a_corrupt_decoder(tmp_path, monkeypatch):
    monkeypatch.setattr(gpucheck.common, "ONLY", {"ar", "linear", "dynatree"})
    lines: list[str] = []
    res = gpucheck.step_lossless(CPU, True, tmp_path, _log(lines))
    assert res["ok"] and {r["decoder"] for r in res["rows"]} == {"ar", "linear", "dynatree"}
    assert {r["rule"] for r in res["rows"]} == {"exact", "tie_aware"} and len(lines) == len(res["rows"])

    from dtbench.harness.measurement import measure as measure_mod

    real = measure_mod.measure

    def corrupt(decoder, prompt, T, device, **kw):  # linear's 5th token replaced by a far-off one
        m = real(decoder, prompt, T, device, **kw)
        if type(decoder).__name__.startswith("Linear"):
            m.tokens[4] = (m.tokens[4] + 37) % 96
        return m

    monkeypatch.setattr(measure_mod, "measure", corrupt)
    res = gpucheck.step_lossless(CPU, True, tmp_path, _log([]))
    bad = [r for r in res["rows"] if not r["ok"]]
    assert not res["ok"] and {r["decoder"] for r in bad} == {"linear"}
    assert all(r["first_divergence"] == 4 for r in bad)
    assert any(r["rule"] == "tie_aware" and r["errors"] >= 1 for r in bad)


@pytest.fixture(scope="module")
def small_pair():
    return (
        gpucheck.neox(gpucheck.SMALL_TARGET, torch.float32, CPU, seed=0),
        gpucheck.neox(gpucheck.SMALL_DRAFT, torch.float32, CPU, seed=1),
    )


def test_timing_step_on_cpu(small_pair):
    res = gpucheck.step_timing(CPU, small_pair[0], _log([]))
    assert res["ok"] and res["forward_events_vs_wall"]["rows"] and res["memory"]["rss_bytes"] >= 64 * 2**20
    assert res["energy"]["status"] in ("measured", "unavailable", "too_short") and res["energy"]["tokens"] == 64


def test_overhead_step_is_differential(tmp_path, small_pair, monkeypatch):
    """(extra wall - extra forward seconds) / extra iterations, medians of the repeats: checked on fake measurements
    with known times, then once on the real small models (structure only: CPU timings under load are noise)."""
    from types import SimpleNamespace

    from dtbench.harness.measurement import measure as measure_mod

    def fake(decoder, prompt, T, device, **kw):  # 1 s prefill + 0.5 s forwards; each iteration 2 s wall, 1.5 s fwd
        iters = T // 2
        return SimpleNamespace(
            step_times=[1.0 + 2.0 * iters],
            forward_s={"target": 0.5 + 1.5 * iters, "draft": None},
            steps=[None] * (1 + iters),
        )

    monkeypatch.setattr(gpucheck.common, "ONLY", {"ar"})
    monkeypatch.setattr(measure_mod, "measure", fake)
    row = gpucheck.step_overhead(CPU, *small_pair, True, tmp_path, _log([]))["rows"][0]
    assert row["iterations"] == 12 and row["overhead_s_per_iter"] == pytest.approx(0.5)
    assert row["forward_s_per_iter"] == pytest.approx(1.5) and row["tokens_per_iter"] == pytest.approx(2.0)
    monkeypatch.undo()
    monkeypatch.setattr(gpucheck.common, "ONLY", {"ar", "linear"})
    res = gpucheck.step_overhead(CPU, *small_pair, True, tmp_path, _log([]))
    assert res["ok"] and [r["decoder"] for r in res["rows"]] == ["ar", "linear"]
    assert all(r["iterations"] > 0 and r["overhead_s_per_iter"] >= 0 for r in res["rows"])


@pytest.mark.full  # a whole check step in child processes (tens of seconds to minutes)
def test_whole_check_writes_json_matching_the_schema(tmp_path, monkeypatch):
    """The command end to end (small shapes, two decoders, the tests step on test_equivalence only: the whole list is
    `make gpu-check-dry`'s), then the schema; the schema rejects a broken file."""
    from click.testing import CliRunner

    monkeypatch.setattr(gpucheck.proptests, "TEST_MODULES", ("tests/test_equivalence.py",))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        gpucheck.main, ["--out", str(out), "--device", "cpu", "--small", "--decoders", "ar,linear"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "gpu-check.json").read_text())
    jsonschema.validate(data, SCHEMA)
    assert data["ok"] and set(data["steps"]) == set(gpucheck.STEPS)
    assert len(data["summary"]["speedups"]) == len(gpucheck.PAPER)
    compiled = data["steps"]["compiled"]  # issue 37: eager vs compiled at the small shapes, the compile time apart
    assert compiled["graphs"] > 0 and compiled["compile_s"] > 0 and [f["n"] for f in compiled["forwards"]] == [1, 9, 16]
    assert set(data["summary"]["compiled"]["ar_tokens_per_s"]) == {"eager", "compiled"}
    assert {(r["decoder"], r["mode"]) for r in compiled["overhead"]} == {
        (d, m) for d, _ in gpucheck.COMPILED_DECODERS for m in ("eager", "compiled")
    }
    fused = [r for r in compiled["overhead"] if r["params"].get("fused_draft")]  # issue 46 item 2, compiled only
    assert [(r["decoder"], r["mode"], r["ok"]) for r in fused] == [("linear", "compiled", True)]
    assert "linear fused_draft compiled" in data["summary"]["compiled"]["overhead_ms_per_iter"]
    tests = data["steps"]["tests"]  # issue 38: the property suite's CPU parametrization, a few examples each
    assert tests["selection"] == "cpu" and tests["failed"] == 0 and tests["passed"] >= 4
    assert any("test_ar_equals_hf_generate" in t for t in tests["hypothesis"]) and tests["examples_total"] > 0
    smoke = data["steps"]["smoke"]  # issue 38: suites/gpu-smoke.yaml at tiny shapes through dtbench run
    assert (
        smoke["run_exit_code"] == 0 and {c["status"] for c in smoke["cells"]} == {"done"} and len(smoke["cells"]) == 6
    )
    assert (out / "gpu-check.log").read_text().count("\n") > 5
    broken = {**data, "steps": {**data["steps"], "lossless": {"rows": []}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


@pytest.mark.full  # a whole check step in child processes (tens of seconds to minutes)
def test_a_crashing_decoder_fails_its_rows_and_the_check_goes_on(tmp_path, monkeypatch):
    """A segfault in a decoder (as hf_assisted gave on an H200) kills a child process, not the check: its row is
    'crashed (signal 11)' with the faulthandler's traceback, its other rows are not retried, the next decoder runs."""
    from click.testing import CliRunner

    monkeypatch.setenv(gpucheck.CRASH_ENV, "linear")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        gpucheck.main,
        ["--out", str(out), "--device", "cpu", "--small", "--steps", "lossless", "--decoders", "ar,linear,ngram"],
    )
    assert result.exit_code == 1
    data = json.loads((out / "gpu-check.json").read_text())
    jsonschema.validate(data, SCHEMA)
    rows = {}  # the first row of each (dtype, decoder): linear declares several settings (check_settings)
    for r in data["steps"]["lossless"]["rows"]:
        rows.setdefault((r["dtype"], r["decoder"]), r)
    assert rows[("float32", "linear")]["error"] == "crashed (signal 11)"
    assert "Segmentation fault" in rows[("float32", "linear")]["crash_trace"]
    assert rows[("bfloat16", "linear")]["error"].startswith("not run: this decoder crashed")
    assert all(rows[(d, n)]["ok"] for d in ("float32", "bfloat16") for n in ("ar", "ngram"))
    assert set(data["summary"]["lossless"]["failed"]) == {"llama float32 linear", "llama bfloat16 linear"}


def test_bad_arguments_are_one_line(tmp_path):
    from click.testing import CliRunner

    r = CliRunner().invoke(gpucheck.main, ["--out", str(tmp_path), "--steps", "nosuch"])
    assert r.exit_code == 2 and "unknown step 'nosuch'" in r.output
    # issue 67: the hint lists every built-in lossless decoder, not only `ar` (it was filtered by the request)
    r = CliRunner().invoke(gpucheck.main, ["--out", str(tmp_path), "--decoders", "nope", "--plan"])
    assert r.exit_code == 2 and "unknown decoder nope" in r.output
    assert "linear" in r.output and "dynatree" in r.output and "ar" in r.output


def test_every_builtin_lossless_decoder_is_checked():
    from dtbench.harness import registry

    names = {n for n, _ in gpucheck.lossless_decoders()}
    builtin = {
        n
        for n, e in registry.discover().items()
        if e.distribution == "dtbench" and registry.get(n).lossless and not registry.get(n).requests
    }
    assert names == builtin  # `server` (a requests decoder) needs an engine: tests/test_server_engine.py


def test_hypothesis_statistics_and_junit_are_parsed(tmp_path):
    """The tests step's counts: hypothesis's statistics section (its 6.1xx wording) and a JUnit file with a failure
    that carries a falsifying example."""
    text = (
        "============================ Hypothesis Statistics =============================\n"
        "tests/test_equivalence.py::test_ar_equals_hf_generate[cuda-float32]:\n\n"
        "  - during reuse phase (0.00 seconds):\n    - 1 passing, 0 failing, and 0 invalid test cases\n"
        "  - during generate phase (0.16 seconds):\n    - Typical runtimes: ~ 70-89 ms\n"
        "    - 4 passing, 1 failing, and 2 invalid test cases\n\n  - Stopped because settings.max_examples=5\n"
    )
    stats = gpucheck.parse_hypothesis_statistics(text)
    assert stats == {
        "tests/test_equivalence.py::test_ar_equals_hf_generate[cuda-float32]": {
            "passing": 5,
            "failing": 1,
            "invalid": 2,
        }
    }
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_equivalence" name="test_a[cpu]"/>'
        '<testcase classname="tests.test_equivalence" name="test_b[cuda-float16]"><failure message="assert 1 == 2">'
        "Falsifying example: test_b(\n    on=('cuda', torch.float16, 'tie_aware'),\n    prompt=[3],\n)\nAssertionError"
        '</failure></testcase><testcase classname="t" name="test_c"><skipped message="no CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    res = gpucheck.parse_junit(junit)
    assert (res["passed"], res["failed"], res["skipped"]) == (1, 1, 1)
    assert res["failures"][0]["test"] == "tests.test_equivalence::test_b[cuda-float16]"
    assert "prompt=[3]" in res["failures"][0]["falsifying_example"]


def test_the_tests_step_runs_every_device_parametrized_module():
    """Every test module parametrized over the device (``models.DEVICES``, or the conformance kit's ``devices=``) is in the tests step's list, and only
    those: a module parametrized later is run on the node without editing the check by hand being forgotten."""
    parametrized = {
        f"tests/{p.name}"
        for p in sorted((REPO / "tests").glob("test_*.py"))
        if re.search(
            r'^@pytest\.mark\.parametrize\("on", DEVICES\)|^@parametrize_with_checks\(.*devices=',
            p.read_text(encoding="utf-8"),
            re.M,
        )
    }
    assert set(gpucheck.TEST_MODULES) == parametrized


@pytest.mark.full  # a whole check step in child processes (tens of seconds to minutes)
def test_a_budget_runs_the_most_valuable_steps_that_fit_and_lists_the_rest(tmp_path):
    """--budget (issue 46 item 7): steps in value order, a step whose planned seconds do not fit is skipped and
    listed with why; the check's verdict is over the steps it ran; --plan prints the lease's plan and exits."""
    from click.testing import CliRunner

    from dtbench.gpucheck import budget as gpu_budget

    run, skipped = gpu_budget.plan_steps(["timing", "lossless", "tests"], "cpu", 80.0)
    assert run == ["tests", "lossless"] and set(skipped) == {"timing"}  # tests 45 + lossless 33 fit; timing 11 not
    assert gpu_budget.plan_steps(["timing", "lossless"], "cpu", None) == (["timing", "lossless"], {})
    out = tmp_path / "out"
    result = CliRunner().invoke(
        gpucheck.main,
        ["--out", str(out), "--device", "cpu", "--small", "--steps", "timing,lossless", "--decoders", "ar"]
        + ["--budget", "40", "--spent", "5"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "gpu-check.json").read_text())
    jsonschema.validate(data, SCHEMA)
    assert set(data["steps"]) == {"lossless"} and data["ok"] and data["budget_s"] == 40
    assert data["skipped_steps"] == {"timing": "planned 11 s, 2 s of the 40 s budget left"}
    plan = CliRunner().invoke(gpucheck.main, ["--out", str(out), "--plan"])
    assert plan.exit_code == 0 and "against a 9.0-minute budget" in plan.output and "compiled" in plan.output


def test_a_tests_step_stopped_at_its_limit_keeps_what_finished():
    """pytest -v lines of a child killed at the time limit (it writes no JUnit XML): counts and failed ids survive."""
    text = (
        "tests/test_conformance.py::test_builtin[ar-state-cuda] PASSED [  1%]\n"
        "tests/test_conformance.py::test_builtin[ar-batch_rows-cuda] FAILED [  2%]\n"
        "tests/test_conformance.py::test_builtin[eagle-batch_rows-cuda] SKIPPED (declares batching = False) [  3%]\n"
    )
    res = gpucheck.proptests.parse_verbose(text)
    assert (res["passed"], res["failed"], res["skipped"]) == (1, 1, 1)
    assert res["failures"][0]["test"] == "tests/test_conformance.py::test_builtin[ar-batch_rows-cuda]"


def test_budget_decoders_and_plan_arguments_are_checked_in_one_line():
    """Issue 59 item 5: a NaN or infinite --budget, an unknown --decoders name are usage errors (exit 2, one line, before
    any step); --plan plans the --device and --steps asked for."""
    from click.testing import CliRunner

    from dtbench.gpucheck.command import main

    def run(*args):
        return CliRunner().invoke(main, ["--out", "unused", *args])

    for bad in ("nan", "inf"):
        res = run("--budget", bad, "--plan")
        assert res.exit_code == 2 and "not a finite number" in res.output, res.output
    res = run("--decoders", "ar,no_such_decoder", "--plan")
    assert res.exit_code == 2 and "unknown decoder no_such_decoder" in res.output
    res = run("--plan", "--device", "cpu", "--steps", "lossless,timing")
    assert res.exit_code == 0 and res.output.startswith("plan on cpu")
    steps = [line.split()[0] for line in res.output.splitlines()[1:-1]]
    assert steps == ["lossless", "timing"], res.output
