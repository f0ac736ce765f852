"""The test tiers (issue 57): every test module declares its tier, and the collection refuses one that does not."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

TIER = "fast"

TESTS = Path(__file__).resolve().parent


def declared_tier(path: Path) -> str | None:
    """The module's top-level ``TIER = "..."`` value, or None."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TIER" for t in node.targets):
            return getattr(node.value, "value", None)
    return None


def test_every_module_declares_its_tier():
    undeclared = {p.name: declared_tier(p) for p in TESTS.glob("test_*.py") if declared_tier(p) not in ("fast", "full")}
    assert not undeclared, f"declare TIER = 'fast' or 'full' in: {undeclared}"


def _pytest(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(folder)],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=120,
    )


def test_the_collection_refuses_an_unmarked_module(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_unmarked.py").write_text("def test_x():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_marked.py").write_text("TIER = 'fast'\n\n\ndef test_y():\n    assert 2 * 2 == 4\n")
    done = _pytest(tmp_path)
    assert done.returncode != 0
    assert "test modules without TIER" in done.stdout + done.stderr and "test_unmarked" in done.stdout + done.stderr
    (tmp_path / "test_unmarked.py").unlink()
    done = _pytest(tmp_path)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
