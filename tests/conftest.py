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

# One intra-op thread in every process the tests start (xdist workers, `dtbench run` children, isolated cells, Ray
# actors, child pytests), set before torch is imported: two workers already fill the 2 cores, and a child left at
# torch's default (a thread per core) spin-waits in OpenMP while the other worker runs, which made tiny models'
# forwards 30-70x slower (tests/test_gpucheck.py's smoke step: 150 ms a forward instead of 2-3 ms). A test that needs
# threads sets them itself (``torch.set_num_threads``; a suite's ``threads:``).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# --- tiers (issue 57): the fast tier by default, the full tier with --tier full (make test-full, CI) ---------------
# Every test module declares ``TIER = "fast"`` or ``TIER = "full"`` (tests/test_tiers.py fails on one that does not).
# The fast tier leaves out full modules, tests marked ``full`` or ``slow`` (the embedded SmolLM2), tests using
# FULL_FIXTURES (end-to-end runs, services), the PostgreSQL half of ``db_url`` tests, and caps every hypothesis test at FAST_EXAMPLES examples (the ``dev`` profile); the full tier
# runs everything with each test's own example count (the ``ci`` profile).
TIERS = ("fast", "full")
TIER_CHOICES = (*TIERS, "rest")  # rest: what the fast tier leaves out (a full run prints the seconds of each)
FAST_EXAMPLES = 3
EXAMPLES_ENV = "DTBENCH_HYPOTHESIS_EXAMPLES"


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=TIER_CHOICES,
        default=os.environ.get("DTBENCH_TIER", "fast"),
        help="fast (default: no compiles, end-to-end runs or services; few hypothesis examples), full (everything), "
        "or rest (full minus fast)",
    )


def pytest_configure(config):
    from hypothesis import settings

    settings.register_profile("dev", max_examples=FAST_EXAMPLES, deadline=None)
    settings.register_profile("ci", deadline=None)
    fast = config.getoption("--tier") == "fast"
    settings.load_profile("dev" if fast else "ci")
    if fast:  # an explicit @settings(max_examples=examples(n)) reads the cap (tests/models.py, dtbench.testing)
        os.environ.setdefault(EXAMPLES_ENV, str(FAST_EXAMPLES))


# Fixtures that mean a full-tier test: the embedded SmolLM2, a PostgreSQL server, a Ray cluster, a tiny model pair
# saved for end-to-end `dtbench run`s, a module's own end-to-end run.
FULL_FIXTURES = frozenset({"smollm2", "pg_server", "cluster", "pair", "tiny_run"})


def in_full_tier_only(item) -> bool:
    """Whether the fast tier leaves ``item`` out (the rules above)."""
    if item.get_closest_marker("fast"):
        return False
    if getattr(item.module, "TIER", "fast") == "full" or FULL_FIXTURES.intersection(item.fixturenames):
        return True
    if item.get_closest_marker("full") or item.get_closest_marker("slow"):
        return True
    callspec = getattr(item, "callspec", None)  # the PostgreSQL half of db_url tests; compiled halves (compiles)
    return bool(callspec and (callspec.params.get("db_url") == "postgresql" or callspec.params.get("compiled") is True))


def pytest_collection_modifyitems(config, items):
    missing = sorted({item.module.__name__ for item in items if getattr(item.module, "TIER", None) not in TIERS})
    if missing:
        raise pytest.UsageError(f"test modules without TIER = 'fast' or 'full': {', '.join(missing)}")
    for item in items:  # which tier each test belongs to, for the per-tier totals of a full run (the summary below)
        item.user_properties.append(("tier", "rest" if in_full_tier_only(item) else "fast"))
    tier = config.getoption("--tier")
    if tier == "full":
        return
    kept = [item for item in items if in_full_tier_only(item) == (tier == "rest")]
    dropped = [item for item in items if in_full_tier_only(item) != (tier == "rest")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


# --- where the time goes (issue 57 item 4): seconds per module and per tier, summed over setup, call and teardown ---
# With two xdist workers and ``--dist loadfile`` a module runs on one worker, so the slowest module bounds the
# tier's wall time from below; CI's log shows the list beside ``--durations``. Each module's line counts the graphs
# inductor compiled in the test processes (cache misses: ~15-20 s each on 2 cores) and those its FX graph cache served
# (~3 s: dynamo's trace); child processes are not counted. Its CPU seconds (the worker's and its reaped children's, from
# setup to teardown) against its seconds show how much of them a test waits (a server, a deadline, a child's start)
# rather than computes; a child still running at teardown (a Ray cluster, a server) is not counted.
MODULE_SECONDS: dict[str, float] = {}
MODULE_CPU: dict[str, float] = {}
MODULE_GRAPHS: dict[str, list[int]] = {}
TIER_SECONDS: dict[str, float] = {}
TIER_TESTS: dict[str, int] = {}
SLOWEST_MODULES = 12


def inductor_graphs() -> tuple[int, int]:
    """(graphs inductor compiled, graphs its FX graph cache served) in this process so far; (0, 0) before torch's
    compiler is imported (importing it here would cost every test process seconds)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, 0
    counts = utils.counters["inductor"]
    return int(counts["fxgraph_cache_miss"]), int(counts["fxgraph_cache_hit"])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[GRAPHS_BEFORE] = inductor_graphs()
    item.stash[CPU_BEFORE] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    before = item.stash.get(GRAPHS_BEFORE, (0, 0))
    after = inductor_graphs()
    item.user_properties.append(("graphs", (after[0] - before[0], after[1] - before[1])))  # on the teardown report
    item.user_properties.append(("cpu", cpu_seconds() - item.stash.get(CPU_BEFORE, cpu_seconds())))


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its reaped children so far."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


GRAPHS_BEFORE = pytest.StashKey[tuple[int, int]]()
CPU_BEFORE = pytest.StashKey[float]()


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    seconds = float(getattr(report, "duration", 0.0) or 0.0)
    props = dict(report.user_properties)
    MODULE_SECONDS[module] = MODULE_SECONDS.get(module, 0.0) + seconds
    tier = props.get("tier", "?")
    TIER_SECONDS[tier] = TIER_SECONDS.get(tier, 0.0) + seconds
    if report.when == "teardown":
        TIER_TESTS[tier] = TIER_TESTS.get(tier, 0) + 1
        compiled, cached = props.get("graphs", (0, 0))
        counts = MODULE_GRAPHS.setdefault(module, [0, 0])
        counts[0], counts[1] = counts[0] + compiled, counts[1] + cached
        MODULE_CPU[module] = MODULE_CPU.get(module, 0.0) + float(props.get("cpu", 0.0))


def pytest_terminal_summary(terminalreporter):
    if not MODULE_SECONDS or hasattr(terminalreporter.config, "workerinput"):  # the controller reports, not workers
        return
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", "worker seconds per tier (setup + call + teardown, summed)")
    for tier in sorted(TIER_SECONDS):
        write(f"{TIER_SECONDS[tier]:8.1f}s  {tier} tier ({TIER_TESTS.get(tier, 0)} tests)")
    slowest = sorted(MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_MODULES]
    terminalreporter.write_sep(
        "=",
        f"slowest {len(slowest)} modules (seconds: setup + call + teardown, summed; CPU seconds of the process and "
        "its reaped children)",
    )
    for module, seconds in slowest:
        compiled, cached = MODULE_GRAPHS.get(module, (0, 0))
        graphs = f"  (inductor: {compiled} graphs compiled, {cached} from its cache)" if compiled or cached else ""
        write(f"{seconds:8.1f}s  cpu {MODULE_CPU.get(module, 0.0):7.1f}s  {module}{graphs}")
    write(f"{sum(MODULE_SECONDS.values()):8.1f}s  cpu {sum(MODULE_CPU.values()):7.1f}s  in all (worker seconds)")


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

    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

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
