"""Helpers shared by the tests/test_hardening_*.py modules (issue 57 item 3 split tests/test_hardening.py by
subject): the tiny suite they change field by field, a hostile category string, a tokens file writer, a run into
``tmp_path/r.db`` and a database's SQL text. Not a test module (no ``test_`` prefix): nothing here is collected."""

from __future__ import annotations

import json

from kit import invoke

# The smallest suite on the embedded model: one dataset of 2 prompts (1 warmup), T = 4, AR only, measured in the test's
# own process (``isolation: none``, as tests/kit.py's suites are): a child per run cost its start, torch's import and
# SmolLM2's load, 8-9 s of a test's 10-11 s (issue 57). Tests of the process boundary itself pass
# ``isolation="process"``.
TINY = {
    "name": "tiny",
    "seed": 0,
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
    "generation_lengths": [4],
    "decoders": [{"name": "ar"}],
    "isolation": "none",
}

# A question category with a colour escape, a window-title escape and a bell (issue 33 item 1).
HOSTILE_CATEGORY = "\u001b[31mRED\u001b]0;pwn\u0007"


def tiny_suite(**changes) -> dict:
    """A deep copy of :data:`TINY` with the top-level ``changes`` applied."""
    out = json.loads(json.dumps(TINY))
    out.update(changes)
    return out


def npy_file(tmp_path, name: str, array) -> str:
    """``array`` written to ``tmp_path/name``: ``np.save`` for a ``.npy`` name (pickles allowed, so an object array
    is written as it is), else its values as space-separated text. Returns the path."""
    import numpy as np

    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, array, allow_pickle=True)
    else:
        path.write_text(" ".join(map(str, array)))
    return str(path)


def run_to_db(tmp_path, data_dir, suite: str):
    """``dtbench run SUITE`` into ``tmp_path/r.db`` with the local data folder, in this process (a CliRunner result)."""
    return invoke("run", suite, "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress")


def database_text(path) -> str:
    """The SQLite database at ``path`` as SQL text (``iterdump``): what a search of the stored file would find."""
    import sqlite3

    with sqlite3.connect(path) as con:
        return "\n".join(con.iterdump())
