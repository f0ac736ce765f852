"""`harness`, `decoders` and `reports` install only inside the `dtbench` namespace, from a wheel and editable."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_folders(tmp_path):
    for sub in ("harness", "decoders", "reports", "cli", "gpucheck"):
        spec = importlib.util.find_spec(f"dtbench.{sub}")
        assert spec is not None and Path(spec.origin).parent == ROOT / sub
    spec = importlib.util.find_spec("dtbench.api")
    assert spec is not None and Path(spec.origin) == ROOT / "dtbench" / "api.py"

    # The install adds no top-level `harness`: a fresh interpreter started elsewhere (the checkout's folder, which
    # `python -m pytest` puts on sys.path, is not on its path) does not find one in this checkout, wherever the
    # checkout lives and whatever its folder is called.
    code = "import importlib.util; s = importlib.util.find_spec('harness'); print(s.origin if s and s.origin else '')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    origin = out.stdout.strip()
    assert not origin or ROOT not in Path(origin).resolve().parents, origin


def _head() -> str:
    from dtbench.harness.store import schema

    return schema.head()


def test_wheel_installs_and_imports(tmp_path):
    # Built from a copy: setuptools writes build/ and dtbench.egg-info beside the sources, and a stale egg-info in
    # the checkout would shadow the editable install's entry points for every later test.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "dtbench", "harness", "decoders", "reports", "cli", "gpucheck"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, src / name)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # the package layout is declared completely: setuptools has nothing to warn about (issue 18, first contact)
    assert "absent from the `packages` configuration" not in out.stderr, out.stderr[-2000:]
    wheel = next(tmp_path.glob("dtbench-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for sub in ("harness", "decoders", "reports", "cli", "gpucheck"):
        assert f"dtbench/{sub}/__init__.py" in names
        assert not any(n.startswith(f"{sub}/") for n in names), f"{sub} installed as a top-level package"
    assert any(n.endswith("entry_points.txt") for n in names)
    # the torch-free core, the plugin API with its type marker (PEP 561), the tree package
    assert {
        "dtbench/__init__.py",
        "dtbench/core.py",
        "dtbench/api.py",
        "dtbench/py.typed",
        "dtbench/decoders/tree/__init__.py",
        "dtbench/decoders/tree/structure.py",
        "dtbench/gpucheck/paper.json",  # the GPU check's paper tables: package data
    } <= set(names)
    # The Alembic migrations ship as package data: without them no database can be created or upgraded.
    migrations = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "harness" / "store" / "migrations").rglob("*")
        if p.is_file() and p.suffix in (".py", ".mako")
    }
    assert migrations >= {
        "harness/store/migrations/env.py",
        "harness/store/migrations/baseline.py",
        "harness/store/migrations/versions/0001_initial.py",
    }
    for rel in migrations:
        assert f"dtbench/{rel}" in names, f"{rel} missing from the wheel"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # A fresh interpreter that sees only the unpacked wheel (plus dependencies), not the source tree.
    code = (
        "import sys; sys.path = [p for p in sys.path if p not in ('', '.', {!r})]; sys.path.insert(0, {!r});"
        "import dtbench.cli.main, dtbench.decoders.ar, dtbench.reports.views.summary, dtbench.harness.execution.runner as r;"
        "assert {!r} in r.__file__, r.__file__;"
        # the installed migrations create a database at the newest revision
        "from dtbench.harness.store import db, schema; assert {!r} in schema.MIGRATIONS.as_posix();"
        "db.connect({!r}); assert schema.ensure_current({!r})[0] == schema.head() == {!r}"
    ).format(
        str(ROOT), str(site), str(site), str(site), str(tmp_path / "w.db"), f"sqlite:///{tmp_path / 'w.db'}", _head()
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code.replace("import sys;", "import sys, site; site.main();")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
