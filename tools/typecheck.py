"""Run mypy on the installed layout of dtbench (``make lint``, ``.ci/run``, the pre-commit hook).

The checkout keeps ``dtbench.harness`` in ``harness/``, ``dtbench.decoders`` in ``decoders/`` ... (pyproject's
``package-dir``); an editable install maps them with an import hook that mypy cannot follow. This script links the
folders into a ``dtbench/`` tree under ``.mypy_cache/`` (a fixed place, so mypy's incremental cache stays valid),
puts it on ``MYPYPATH`` and runs ``python -m mypy -p dtbench`` with pyproject.toml's ``[tool.mypy]``; file names in
mypy's messages are printed as the checkout's.

Usage: python tools/typecheck.py [extra mypy arguments]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("harness", "decoders", "reports", "cli", "gpucheck")  # dtbench.<name> lives in <name>/


def link_tree(base: Path) -> None:
    """``base/dtbench``: the checkout's dtbench/ files and the package folders, as symbolic links."""
    tree = base / "dtbench"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    for f in (ROOT / "dtbench").iterdir():
        if f.name != "__pycache__":
            (tree / f.name).symlink_to(f)
    for name in FOLDERS:
        (tree / name).symlink_to(ROOT / name, target_is_directory=True)


def main(argv: list[str]) -> int:
    base = ROOT / ".mypy_cache" / "layout"
    link_tree(base)
    env = {**os.environ, "MYPYPATH": str(base)}
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "dtbench", *argv]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    out = proc.stdout
    for name in FOLDERS:  # .mypy_cache/layout/dtbench/harness/x.py -> harness/x.py (the checkout's file)
        out = out.replace(f"{base}/dtbench/{name}/", f"{name}/").replace(
            f".mypy_cache/layout/dtbench/{name}/", f"{name}/"
        )
    sys.stdout.write(out.replace(f"{base}/dtbench/", "dtbench/").replace(".mypy_cache/layout/dtbench/", "dtbench/"))
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
