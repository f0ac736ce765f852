"""Architecture rules checked statically (issue 49 item 2): one forward timer.

Model forwards are timed by :class:`dtbench.harness.forwards.ForwardTimer` (the measurement's ForwardCounter, the
calibration and the GPU check all use it: CUDA events on a GPU, the one clock otherwise), so no other module reads
the clock itself: ``time.perf_counter``, :func:`dtbench.decoders.base.clock`, ``now`` of
:mod:`dtbench.harness.forwards` / :mod:`dtbench.harness.measure`, or a ``clock()`` handed in as an argument.
The modules that do read it are listed with why; none of them times a single model forward with it.
"""

from __future__ import annotations

import ast
from pathlib import Path

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("harness", "decoders", "cli", "gpucheck", "reports", "dtbench")

# (module, name) pairs that read the clock, called or passed on
CLOCKS = {
    ("time", "perf_counter"),
    ("time", "perf_counter_ns"),
    ("dtbench.decoders.base", "clock"),
    ("dtbench.harness.forwards", "now"),
    ("dtbench.harness.measure", "now"),
}

ALLOWED = {
    # the forward timer itself: ForwardTimer, ForwardCounter and now()
    "harness/forwards.py",
    # defines the one clock (base.clock) and commit_clock, the stamp of a push-based decoder's Step
    "decoders/base.py",
    # the measurement loop's per-Step timestamps and a sample's wall time; its forwards are timed by ForwardCounter
    "harness/measure.py",
    # the compile time of a whole precompile (many forwards: a section, reported apart from any forward's time)
    "harness/cells.py",
    "decoders/static_kv.py",
    # request timestamps of an HTTP client (the model runs in another process)
    "harness/serving/client.py",
    # the seconds a whole lossless check took (its cost, shown beside it)
    "harness/lossless.py",
    # the copy benchmark of the memory bandwidth: a tensor copy, no model forward
    "harness/roofline.py",
    # the probe of an energy counter's update interval: no model forward
    "harness/energy.py",
    # the time a datastore takes to build: no model forward
    "decoders/datastore.py",
    # the seconds of whole doctor steps (a pytest child, a `dtbench run` child)
    "cli/doctor.py",
    # the GPU check's log stamps and each whole step's seconds (steps run in child processes)
    "gpucheck/command.py",
    # the seconds a whole conformance check took (dtbench check's table; no timing is judged)
    "harness/conformance_checks.py",
}


def clock_reads(source: str) -> list[int]:
    """Line numbers where ``source`` reads the clock: a name or attribute bound to one of :data:`CLOCKS` (through
    ``import m [as a]`` / ``from m import name [as a]``), used at all, or a call of a plain name ``clock``."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> module
    names: set[str] = set()  # local names bound to a clock
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if (node.module, a.name) in CLOCKS:
                    names.add(a.asname or a.name)
                else:
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (modules.get(node.value.id), node.attr) in CLOCKS:
                lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "clock":
            lines.append(node.lineno)
    return sorted(set(lines))


def readers() -> dict[str, list[int]]:
    """{module path: lines} of every module under :data:`FOLDERS` that reads the clock."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found = clock_reads(path.read_text(encoding="utf-8"))
            if found:
                out[str(path.relative_to(ROOT))] = found
    return out


def test_only_the_forward_timer_and_the_listed_modules_read_the_clock():
    found = readers()
    others = {m: lines for m, lines in found.items() if m not in ALLOWED}
    assert not others, f"time forwards with dtbench.harness.forwards.ForwardTimer, not the clock: {others}"
    assert ALLOWED <= set(found), f"no longer read the clock (remove from ALLOWED): {ALLOWED - set(found)}"


def test_the_check_catches_a_clock_around_a_forward_in_the_calibration():
    calibrate = (ROOT / "harness" / "calibrate.py").read_text(encoding="utf-8")
    assert clock_reads(calibrate) == []
    for added in (
        "import time\ndef f(m, x):\n    t0 = time.perf_counter()\n    m(x)\n    return time.perf_counter() - t0\n",
        "from time import perf_counter as pc\ndef f(m, x):\n    t0 = pc()\n    m(x)\n    return pc() - t0\n",
        "from dtbench.harness import measure\ndef f(m, x):\n    t0 = measure.now()\n    m(x)\n",
        "from dtbench.decoders import base as b\ndef f(m, x):\n    t0 = b.clock()\n    m(x)\n",
        "def f(m, x, clock):\n    t0 = clock()\n    m(x)\n    return clock() - t0\n",
    ):
        assert clock_reads(calibrate + "\n" + added), added
