"""Issue 58 items 3 and 4: one frozen key for a prompt group and a cell (:class:`~dtbench.harness.suites.grouping.GroupKey`,
:class:`~dtbench.harness.suites.grouping.CellKey`) used by the sink, the served measurer and Ray; a Ray actor gets the
driver's plan once and never plans the suite with its own registry; the local measurer's state is a typed value and
its ``finish`` returns columns; the runner names every cell's measurer (no store hook)."""

from __future__ import annotations

import dataclasses
import io
import sqlite3
import sys
from pathlib import Path

import pytest
import yaml
from kit import suite_dict, tiny_pair, write_suite
from rich.console import Console

from dtbench.harness import registry
from dtbench.harness.suites import plan as plan_module
from dtbench.harness.suites.grouping import CellKey, GroupKey
from dtbench.harness.suites.plan import plan_suite
from dtbench.harness.suites.suitefile import parse_suite

TIER = "full"  # tests/conftest.py: runs whole suites on tiny models in this process

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


def _plan(suite: dict):
    return plan_suite(parse_suite(yaml.safe_dump(suite)))


@pytest.mark.fast
def test_a_group_key_is_frozen_unique_and_names_the_dataset_entry_not_its_name(pair):
    """Two entries of one dataset (labels ``a`` and ``b``) are two points: their groups' keys differ by the entry's
    key; every group of the plan has its own key, a server's whole-cell unit apart from dtbench's own group at the
    same first prompt (``served``)."""
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "server", "params": {"base_url": "http://127.0.0.1:9"}}])
    entry = {**suite["datasets"][0], "prompts": 3}
    suite["datasets"] = [{**entry, "label": "a"}, {**entry, "label": "b"}]
    suite["concurrency"] = [1, 2]
    groups = _plan(suite).groups()
    keys = [g.key for g in groups]
    assert len(set(keys)) == len(keys)  # one key per unit of work
    assert {k.dataset for k in keys} == {"a", "b"}  # the entry's key, not the dataset's name (wikitext-2)
    first = groups[0].key
    assert first == GroupKey(CellKey("a", 16, 6, 1), 0, 0, True) and groups[0].cell == first.cell  # the server unit
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.prompt_index = 1  # type: ignore[misc]
    served = [k for k in keys if k.served]
    assert served and all(k.cell.batch_size in (1, 2) for k in served)
    assert {(k.cell, k.prompt_index) for k in served} & {(k.cell, k.prompt_index) for k in keys if not k.served}


def test_a_ray_actor_measures_the_drivers_plan_without_planning(pair, monkeypatch):
    """The actor's body (:class:`~dtbench.harness.execution.ray_executor.RayWorker`, here in this process) is given the
    driver's plan once (a pickled snapshot) and each task a group's key: it plans nothing and reads no registry.
    Before, it called ``plan_suite`` with its own registry (and without the driver's ``--data-dir``)."""
    from dtbench.harness.execution.ray_executor import RayWorker
    from dtbench.harness.execution.worker import PlanSnapshot, installed_versions

    suite = parse_suite(yaml.safe_dump(suite_dict(*pair, [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}])))
    plan = plan_suite(suite)
    plan.data_dir = "/the/drivers/data"
    data = PlanSnapshot.of(plan).dumps()
    calls: list[str] = []

    def refuse(what):
        def call(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"the actor called {what}")

        return call

    monkeypatch.setattr(plan_module, "plan_suite", refuse("plan_suite"))
    monkeypatch.setattr(registry, "scan", refuse("registry.scan"))
    monkeypatch.setattr(registry, "discover", refuse("registry.discover"))
    monkeypatch.setattr(registry, "get", refuse("registry.get"))
    monkeypatch.setattr(registry.DECODERS, "scan", refuse("DECODERS.scan"))
    actor = RayWorker(suite, data, "cpu", 1, None)
    info = actor.ready()
    assert not isinstance(info, str), info
    assert actor.worker is not None and actor.worker.plan.data_dir == "/the/drivers/data"  # the driver's plan
    assert info.decoders == installed_versions(plan) == [(p.label, p.version) for p in plan.decoders]
    group = plan.groups()[1]
    prompt = _prompt(actor.worker.tokenizer, group.prompt_index)
    outcomes = list(actor.run(group.key, prompt, {}, set()))
    assert [o.label for o in outcomes] == ["ar", "linear"] and all(o.rows for o in outcomes), outcomes
    assert outcomes[1].rows[0].lossless is True
    assert calls == []
    with pytest.raises(Exception, match="the driver's plan has no prompt group"):
        list(actor.run(dataclasses.replace(group.key, prompt_index=99), prompt, {}, set()))


def _prompt(tokenizer, index: int):
    from dtbench.harness.data.prompt import Prompt

    ids = tokenizer("The quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]
    return Prompt(index=index, document="doc", token_ids=tuple(ids))


@pytest.mark.fast
def test_a_missing_plugin_on_a_node_is_one_line():
    """A node without a plugin the driver's plan uses cannot load the plan: one line saying what to install."""
    from dtbench.harness.errors import DtbenchError
    from dtbench.harness.execution.worker import PlanSnapshot

    broken = b"cdtbench_absent_plugin\nStall\n."  # a pickle naming a class of a module this node lacks
    with pytest.raises(DtbenchError, match="cannot load the driver's plan: ModuleNotFoundError") as exc:
        PlanSnapshot.loads(broken)
    assert "\n" not in str(exc.value) and "install the same dtbench and plugins on every node" in str(exc.value)


def test_a_served_and_a_local_cell_store_the_same_key_fields(pair, tmp_path, data_dir, monkeypatch):
    """One suite, ``ar`` (local) beside a server (served: a fake OpenAI-compatible server the run launches) on two
    entries of one dataset (labels ``a`` and ``b``): every cell is stored with the entry's key, L_max, T and B of
    its groups' keys and the measurer the runner names, and samples of the same prompts and repeats; each entry's
    cell gets its own server. Before, the served measurer keyed its servers on the dataset's name, so entry ``b``
    reused the server launched for ``a`` (one log, not two)."""
    from dtbench.harness.execution.runner import run_suite
    from dtbench.harness.serving import LOG_DIR_ENV
    from dtbench.harness.store import db
    from dtbench.harness.suites.suitefile import load_suite

    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "logs"))
    fake = Path(__file__).resolve().parent / "fakeserver.py"
    launch = {"engine": "openai", "launch": [sys.executable, str(fake), "--port", "{port}"], "startup_timeout_s": 60}
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "server", "label": "srv", "params": launch}])
    entry = {**suite["datasets"][0], "prompts": 3}
    suite["datasets"] = [{**entry, "label": "a"}, {**entry, "label": "b"}]
    parsed, text = load_suite(write_suite(tmp_path, suite))
    dbfile = tmp_path / "r.db"
    out = io.StringIO()
    run_suite(parsed, text, db.connect(str(dbfile)), data_dir=str(data_dir), console=Console(file=out), progress=False)
    with sqlite3.connect(dbfile) as con:
        cells = con.execute(
            "select label, measurer, dataset, l_max, gen_length, batch_size, status from cells order by id"
        ).fetchall()
        samples = con.execute(
            "select c.dataset, c.label, s.prompt_index, s.repeat, s.warmup, s.step_stats from samples s "
            "join cells c on c.id = s.cell_id order by c.id, s.prompt_index"
        ).fetchall()
    assert [c[:3] for c in cells] == [
        ("ar", "local", "a"),
        ("srv", "served", "a"),
        ("ar", "local", "b"),
        ("srv", "served", "b"),
    ], out.getvalue()
    assert {c[3:] for c in cells} == {(16, 6, 1, "done")}
    keys = {g.key.cell for g in _plan(suite).groups()}
    assert keys == {CellKey.of_row(_Row(*c[2:6])) for c in cells} == {CellKey("a", 16, 6, 1), CellKey("b", 16, 6, 1)}
    for ds in ("a", "b"):
        by_label = {
            lab: [(i, r, w) for d, lab2, i, r, w, _ in samples if d == ds and lab2 == lab] for lab in ("ar", "srv")
        }
        assert by_label["ar"] == by_label["srv"] == [(0, 0, 1), (1, 0, 0), (2, 0, 0)]
    assert all('"compiled"' not in s[5] for s in samples)  # an eager local cell's rows: no compile statistics
    assert len(list((tmp_path / "logs").glob("*.log"))) == 2  # one launched server per cell (entries a and b)


@dataclasses.dataclass
class _Row:
    dataset: str
    l_max: int
    gen_length: int
    batch_size: int | None


@pytest.mark.fast
def test_the_local_measurers_finish_returns_its_columns_and_leaves_the_row_alone():
    """Its state is a typed value (``LocalState``) and ``finish`` returns the row's new ``step_stats`` (a compiled
    cell's recompiles) instead of writing them into the row it is given; the shared tail hands it the row read-only.
    Before, ``finish`` set ``row["step_stats"]["compiled"]`` in place from an untyped state dict."""
    from types import MappingProxyType, SimpleNamespace

    from dtbench.harness.measurement.local_measurer import LocalMeasurer, LocalState
    from dtbench.harness.measurement.measurers import Measured

    measurer = LocalMeasurer(None, None, "cpu", SimpleNamespace(lossless_check="exact"))  # type: ignore[arg-type]
    cp = SimpleNamespace(cls=SimpleNamespace(lossless=False, needs_draft=False), sampling=None)
    measured = Measured([SimpleNamespace()], state=LocalState([(1, 2, 3)], batched=False, recompiles=3))
    row = {"total_s": 1.0, "step_stats": {"forward_s": [0.5]}}
    out = measurer.finish(cp, measured, 0, MappingProxyType(row))  # type: ignore[arg-type]
    assert out == {"step_stats": {"forward_s": [0.5], "compiled": {"recompiles": 3}}}
    assert row == {"total_s": 1.0, "step_stats": {"forward_s": [0.5]}}  # untouched
    eager = Measured([SimpleNamespace()], state=LocalState([(1, 2, 3)], batched=False))
    assert measurer.finish(cp, eager, 0, MappingProxyType(row)) == {}  # type: ignore[arg-type]


def test_reports_key_groups_by_typed_keys_never_by_tuples():
    """Issue 68 item 4: the reports' group key is CellKey (its point a PointKey), never harness.measurement.metrics' 4-tuple
    ``group_key`` nor a key sliced by position."""
    import re
    from pathlib import Path

    from dtbench.harness.suites.grouping import CellKey, PointKey

    root = Path(__file__).resolve().parents[1]
    for path in (root / "reports").rglob("*.py"):
        text = path.read_text()
        assert "group_key(" not in text, path.name
        assert not re.search(r"\bkey\[:3\]|\bk\[:3\]|\)\[:3\]", text), path.name
    row = {"dataset": "wikitext-2", "l_max": 64, "gen_length": 32, "batch_size": float("nan")}
    key = CellKey.of_row(row)
    assert key == CellKey("wikitext-2", 64, 32, 1) and key.point == PointKey("wikitext-2", 64, 32)
    assert key.point.at(4) == CellKey("wikitext-2", 64, 32, 4)
    assert key.columns() == {"dataset": "wikitext-2", "l_max": 64, "gen_length": 32, "batch_size": 1}
