"""Shared fixtures: the local data folder, a temporary database, the embedded SmolLM2 model (loaded once), a
throwaway PostgreSQL server and the `db_url` fixture that runs a database test on SQLite and on PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Inductor's first compile in a process imports setuptools (torch.utils.cpp_extension). After tests/test_plugin.py's
# `pip install --force-reinstall` of the example plugin, a first import of setuptools in this process fails
# (`_distutils_hack`: "distutils/core.py" is the stdlib's), so a compiled test that a worker runs after it would fail
# in the compiler. Imported once here, before any test, it is already loaded when inductor asks.
import setuptools  # noqa: F401, E402

DATA_DIR = Path(os.environ.get("DTBENCH_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "wikitext-2-raw" / "wiki.test.raw").is_file():
        pytest.fail(f"real text not found at {DATA_DIR}: set DTBENCH_DATA_DIR to the shared data folder")
    return DATA_DIR


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP spin-waiting makes
    them many times slower; modules of tiny-model tests use this (``pytestmark``), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2():
    """(fp32 target, bf16 draft, tokenizer) of the embedded SmolLM2-135M."""
    import copy

    import torch

    from dtbench.harness import models
    from dtbench.harness.suite import ModelSpec

    spec = ModelSpec(model="smollm2-135m", dtype="float32")
    target = models.load_model(spec, torch.device("cpu")).model
    draft = copy.deepcopy(target).to(torch.bfloat16)
    return target, draft, models.load_tokenizer(spec)


@pytest.fixture(scope="session")
def pg_server():
    """A PostgreSQL server for the test session (see tests/pg.py); skips with the reason when none can be had."""
    import pg

    reason = pg.unavailable()
    if reason:
        pytest.skip(reason)
    server = pg.Server().start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """The URL of a new, empty results database: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'results.db'}"
    return request.getfixturevalue("pg_server").new_database()
