"""Architecture rules checked statically (issue 49 item 2, issue 58 item 5): one forward timer, one clock name, one
stop rule.

Model forwards are timed by :class:`dtbench.harness.measurement.forwards.ForwardTimer` (the measurement's ForwardCounter, the
calibration and the GPU check all use it: CUDA events on a GPU, the one clock otherwise), so no other module reads
a clock itself: ``time.perf_counter``, ``time.monotonic``, ``time.process_time``, ``time.time`` (and their ``_ns``
forms), :func:`dtbench.decoders.base.clock` (the one clock's one name), or a ``clock()`` handed in as an argument.
The modules that do read one are listed with why; none of them times a single model forward with it. Repeated timing
("repeat until enough samples") is one session of the forward timer (:meth:`ForwardTimer.session` with a
``StopRule``), never a loop of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("harness", "decoders", "cli", "gpucheck", "reports", "dtbench")

# (module, name) pairs that read the clock, called or passed on
CLOCKS = {
    *(("time", name) for name in ("perf_counter", "monotonic", "process_time", "time")),
    *(("time", f"{name}_ns") for name in ("perf_counter", "monotonic", "process_time", "time")),
    ("dtbench.decoders.base", "clock"),
}

ALLOWED = {
    # the forward timer itself: ForwardTimer (and its session), ForwardCounter
    "harness/measurement/forwards.py",
    # defines the one clock (base.clock) and commit_clock, the stamp of a push-based decoder's Step
    "decoders/base.py",
    # the measurement loop's per-Step timestamps, a sample's wall time and CPU seconds; its forwards are timed by
    # ForwardCounter
    "harness/measurement/measure.py",
    # a sample's time limit: wall and CPU seconds since it began, watched from a thread
    "harness/execution/deadline.py",
    # a child process's kill deadline (a whole cell)
    "harness/execution/isolation.py",
    # the machine-load probe's timestamps and this process's age (CPU share), no model forward
    "harness/measurement/load.py",
    # the Ray connection's time limit
    "harness/execution/ray_connect.py",
    # the SQLite lock's retry deadline
    "harness/store/schema.py",
    # a server's start-up deadline (the model runs in another process)
    "harness/serving/process.py",
    # the compile time of a whole precompile (many forwards: a section, reported apart from any forward's time)
    "harness/measurement/hardware.py",
    "decoders/static_kv.py",
    # request timestamps of an HTTP client (the model runs in another process), a failed request's among them
    "harness/serving/client.py",
    "harness/serving/failures.py",
    # the seconds a whole lossless check took (its cost, shown beside it)
    "harness/measurement/lossless.py",
    # the copy benchmark of the memory bandwidth: a tensor copy, no model forward
    "harness/calibration/roofline.py",
    # the probe of an energy counter's update interval: no model forward
    "harness/measurement/energy.py",
    # the time a datastore takes to build: no model forward
    "decoders/datastore.py",
    # the seconds of whole doctor steps (a pytest child, a `dtbench run` child)
    "cli/doctor.py",
    # the GPU check's log stamps and each whole step's seconds (steps run in child processes)
    "gpucheck/command.py",
    # the seconds a whole conformance check took (dtbench check's table; no timing is judged)
    "dtbench/testing/checks.py",
    # the conformance kit's per-check deadlines in the parent (issue 65) and a killed check's seconds
    "dtbench/testing/process.py",
    "dtbench/testing/__init__.py",
    # a plugin's import time limit in its probe child (issue 67 item 5): no model forward
    "harness/execution/plugin_probe.py",
    # the kit's search deadline (a budget of whole examples, issue 66), and a served engine's check budget (the model
    # runs in another process)
    "dtbench/testing/common.py",
    "harness/serving/kit.py",
    "cli/check_server.py",
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
    assert not others, f"time forwards with dtbench.harness.measurement.forwards.ForwardTimer, not the clock: {others}"
    assert ALLOWED <= set(found), f"no longer read the clock (remove from ALLOWED): {ALLOWED - set(found)}"


def test_the_check_catches_a_clock_around_a_forward_in_the_calibration():
    calibrate = (ROOT / "harness" / "calibration" / "calibrate.py").read_text(encoding="utf-8")
    assert clock_reads(calibrate) == []
    for added in (
        "import time\ndef f(m, x):\n    t0 = time.perf_counter()\n    m(x)\n    return time.perf_counter() - t0\n",
        "from time import perf_counter as pc\ndef f(m, x):\n    t0 = pc()\n    m(x)\n    return pc() - t0\n",
        "import time\ndef f(m, x):\n    t0 = time.monotonic()\n    m(x)\n    return time.monotonic() - t0\n",
        "from time import process_time\ndef f(m, x):\n    t0 = process_time()\n    m(x)\n",
        "import time as t\ndef f(m, x):\n    t0 = t.time()\n    m(x)\n",
        "from dtbench.decoders import base as b\ndef f(m, x):\n    t0 = b.clock()\n    m(x)\n",
        "def f(m, x, clock):\n    t0 = clock()\n    m(x)\n    return clock() - t0\n",
    ):
        assert clock_reads(calibrate + "\n" + added), added


# --- one clock name, one stop rule (issue 58 item 5) ----------------------------------------------------------------


def clock_aliases(source: str) -> list[str]:
    """Names of the module-level functions of ``source`` that are only another name for a clock: no parameters and a
    body (after a docstring) of ``return <a clock read>`` (:func:`clock_reads`)."""
    tree = ast.parse(source)
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.args.args or node.args.posonlyargs or node.args.kwonlyargs:
            continue
        body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
        if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
            if clock_reads("\n".join([*imports, ast.unparse(body[0].value)])):  # the returned value, not the imports
                out.append(node.name)
    return out


def timed_in_loops(source: str) -> list[int]:
    """Lines where ``source`` calls a timer's ``.time(...)`` (not the ``time`` module's) inside a loop or a
    comprehension: a "repeat until enough samples" rule of its own."""
    loops = (ast.For, ast.While, ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
    lines = set()
    for loop in ast.walk(ast.parse(source)):
        if isinstance(loop, loops):
            for node in ast.walk(loop):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "time"
                    and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "time")
                ):
                    lines.add(node.lineno)
    return sorted(lines)


def sources() -> dict[str, str]:
    """{module path: source} of every module under :data:`FOLDERS`."""
    return {
        str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def test_the_clock_has_one_name():
    """Before: ``dtbench.decoders.base.clock``, ``dtbench.harness.measurement.forwards.now`` and ``dtbench.harness.measurement.measure.now``
    (re-exported) were one clock under three names."""
    found = {path: names for path, text in sources().items() if (names := clock_aliases(text))}
    assert found == {"decoders/base.py": ["clock"]}
    assert clock_aliases("from dtbench.decoders import base\ndef now():\n    'x'\n    return base.clock()\n") == ["now"]


def test_repeated_forward_timing_is_one_session_of_the_forward_timer():
    """Before: the calibration's points and visits, the GPU check's compiled forwards and the kernel profile each
    looped over ``ForwardTimer.time`` with a stop rule of their own. The GPU check's timing step compares each
    forward's CUDA events with its own wall time (no statistic), so its loop stays."""
    found = {path for path, text in sources().items() if timed_in_loops(text)}
    assert found == {"harness/measurement/forwards.py", "gpucheck/timing.py"}
    assert timed_in_loops("def f(timer, g):\n    return [timer.time(g) for _ in range(3)]\n") == [2]
    assert timed_in_loops("import time\nwhile True:\n    time.time()\n") == []


# reading a calibration's costs, or an expected committed length, is the Pricer's (issue 68 item 1): a module of
# reports/ or gpucheck/ that calls one of these itself re-derives a cost or a speedup beside the one pricing model
PRICING = "reports/pricing/pricing.py"
COST_CALLS = {"cost", "batched_cost", "batched_prefill", "target_cost", "expected_tokens", "tree_budget"}


def cost_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every call in ``source`` of a function or method named in :data:`COST_CALLS` that is not a
    Pricer's method (``pricer.target_cost`` / ``Pricer(c).target_cost`` are the one model; ``curves.cost`` is not)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in COST_CALLS:
            out.append((node.lineno, func.id))
        elif isinstance(func, ast.Attribute) and func.attr in COST_CALLS:
            owner = func.value
            pricer = (isinstance(owner, ast.Name) and "pricer" in owner.id.lower()) or (
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "Pricer"
            )
            if not pricer:
                out.append((node.lineno, func.attr))
    return out


def test_every_cost_and_speedup_is_priced_by_the_one_pricer():
    """Issue 68 item 1: no module of reports/ or gpucheck/ but the pricing model reads a calibration's cost or
    computes E(K) itself; each goes through :class:`dtbench.reports.pricing.pricing.Pricer`."""
    found = {}
    for folder in ("reports", "gpucheck"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel != PRICING and (calls := cost_calls(path.read_text(encoding="utf-8"))):
                found[rel] = calls
    assert found == {}


def test_the_cost_rule_finds_a_re_derived_formula():
    """The rule above is not vacuous: a chain speedup written out beside the Pricer is found, a Pricer's is not."""
    written = (
        "def s(curves, k, d):\n    return curves.cost('target', 1, 0) / (curves.cost('target', k + 1, 0) + k * d)\n"
    )
    assert cost_calls(written) == [(2, "cost"), (2, "cost")]
    assert cost_calls("def s(c, k):\n    return Pricer(c).target_cost(1, 0) + pricer.verify_cost(k, 0, 1, 'x')\n") == []
    assert cost_calls("from x import expected_tokens\ne = expected_tokens([0.5], 1)\n") == [(2, "expected_tokens")]
