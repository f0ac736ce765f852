"""Issue 49 item 3: one Registry[T] for decoders, datasets, report formats, serving engines and executors, with one
policy (built-ins are pyproject's entry points; a built-in name refused to a plugin; two plugins claiming one name
ambiguous; DTBENCH_DISABLE_PLUGINS honoured; the loaded object type-checked), and ``dtbench plugins`` listing it."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from kit import install_plugin, invoke, write_suite

from dtbench.decoders.engines import REGISTRY as ENGINES
from dtbench.decoders.engines import engine_for
from dtbench.harness import registry as decoders
from dtbench.harness.data.datasets import REGISTRY as DATASETS
from dtbench.harness.errors import DtbenchError
from dtbench.harness.execution import executors
from dtbench.harness.execution.runner import make_executor
from dtbench.registry import BUILTIN_DISTRIBUTION
from dtbench.reports.rendering.output import FORMAT_REGISTRY

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

ALL = {
    "dtbench.decoders": decoders.DECODERS,
    "dtbench.datasets": DATASETS,
    "dtbench.formats": FORMAT_REGISTRY,
    "dtbench.engines": ENGINES,
    "dtbench.executors": executors.REGISTRY,
}
SUITE = {
    "name": "s",
    "seed": 0,
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "datasets": [{"name": "wikitext-2", "prompts": 1, "warmup": 0, "L_max": 16}],
    "generation_lengths": [4],
    "decoders": [{"name": "ar"}],
}


def test_every_builtin_is_a_pyproject_entry_point_and_loads_to_what_its_registry_expects():
    for group, reg in ALL.items():
        declared = {ep.name for ep in entry_points(group=group) if ep.dist and ep.dist.name == BUILTIN_DISTRIBUTION}
        found = reg.scan()
        assert declared and set(found.entries) >= declared, group
        for name in declared:
            reg.get(name, found)  # loads and type-checks
    assert set(ALL["dtbench.executors"].names()) >= {"local", "ray"}


def test_the_registry_module_imports_no_torch():
    code = "import sys, dtbench.registry; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture()
def problems(monkeypatch, tmp_path):
    """(a) a decoder plugin whose module raises ImportError, (b) a report-format plugin reusing the built-in `csv`."""
    site = tmp_path / "site"
    install_plugin(
        monkeypatch,
        site,
        "dtbench-broken",
        {"broken": "dtbench_broken:Broken"},
        "raise ImportError('no gpu lib here')\n",
    )
    install_plugin(
        monkeypatch,
        site,
        "dtbench-fakecsv",
        {"csv": "dtbench_fakecsv:render"},
        "def render(doc):\n    return 'x'\n",
        group="dtbench.formats",
    )


def test_plugins_lists_a_broken_and_a_refused_plugin_in_one_line_each(problems):
    res = invoke("plugins")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    broken = [ln for ln in lines if "decoder 'broken' from distribution dtbench-broken 0.1 failed to load" in ln]
    assert broken == [
        "  decoder 'broken' from distribution dtbench-broken 0.1 failed to load: ImportError: no gpu lib here"
    ]
    refused = [ln for ln in lines if "report format 'csv' from distribution dtbench-fakecsv 0.1 refused" in ln]
    assert len(refused) == 1 and "'csv' is a built-in name of dtbench" in refused[0]
    assert "problems: 2" in lines
    assert any(ln.split()[:2] == ["dtbench.decoders", "ar"] and ln.split()[-1] == "ok" for ln in lines)
    assert any(ln.split()[:2] == ["dtbench.formats", "csv"] and ln.split()[-1] == "refused" for ln in lines)
    body = json.loads(invoke("plugins", "--format", "json").stdout)
    assert len(body["problems"]) == 2
    formats = next(r for r in body["registries"] if r["group"] == "dtbench.formats")
    csvs = {e["distribution"]: e["status"] for e in formats["entries"] if e["name"] == "csv"}
    assert csvs == {"dtbench": "ok", "dtbench-fakecsv": "refused"}
    assert FORMAT_REGISTRY.get("csv").__module__ == "dtbench.reports.rendering.output"  # the built-in still answers


def test_validate_with_a_builtin_still_works_beside_broken_plugins(problems, tmp_path):
    res = invoke("validate", write_suite(tmp_path, SUITE))
    assert res.exit_code == 0, res.output
    assert ": ok — suite 's'" in res.stdout


@pytest.mark.slow
def test_run_with_a_builtin_still_works_beside_broken_plugins(problems, tmp_path, data_dir):
    path = write_suite(tmp_path, SUITE)
    res = invoke("run", path, "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress")
    assert res.exit_code == 0, res.output


def test_two_plugins_claiming_one_name_are_ambiguous_in_every_registry(monkeypatch, tmp_path):
    site = tmp_path / "site"
    source = "from dtbench.harness.execution.executors import LocalExecutor\n\nclass Mine(LocalExecutor):\n    name = 'mine'\n"
    for dist in ("dtbench-one", "dtbench-two"):
        install_plugin(
            monkeypatch, site, dist, {"mine": f"{dist.replace('-', '_')}:Mine"}, source, group="dtbench.executors"
        )
    with pytest.raises(DtbenchError, match="executor 'mine' is registered by dtbench-one 0.1 and dtbench-two 0.1"):
        make_executor("mine")
    res = invoke("plugins")
    assert res.exit_code == 0 and "executor 'mine' is registered by dtbench-one 0.1 and dtbench-two 0.1" in res.stdout


def test_a_plugin_executor_is_a_run_choice_and_type_checked(monkeypatch, tmp_path):
    site = tmp_path / "site"
    source = "from dtbench.harness.execution.executors import LocalExecutor\n\nclass Mine(LocalExecutor):\n    name = 'mine'\n"
    install_plugin(monkeypatch, site, "dtbench-mine", {"mine": "dtbench_mine:Mine"}, source, group="dtbench.executors")
    install_plugin(
        monkeypatch,
        site,
        "dtbench-notone",
        {"notone": "dtbench_notone:Nope"},
        "class Nope:\n    pass\n",
        group="dtbench.executors",
    )
    assert type(make_executor("mine")).__name__ == "Mine"
    with pytest.raises(
        DtbenchError, match="executor 'notone' from distribution dtbench-notone 0.1 is .*not a subclass of Executor"
    ):
        make_executor("notone")
    res = invoke("run", write_suite(tmp_path, SUITE), "--executor", "nope")  # click's usage error: exit 2
    assert res.exit_code == 2 and "'nope' is not one of 'local', 'ray', 'mine'" in res.stderr
    assert "Traceback" not in res.output


def test_disable_plugins_keeps_the_builtins_in_every_registry(monkeypatch, tmp_path, problems):
    site = tmp_path / "site"
    install_plugin(
        monkeypatch,
        site,
        "dtbench-eng",
        {"my-engine": "dtbench_eng:E"},
        "from dtbench.api import OpenAICompatible\n\nclass E(OpenAICompatible):\n    pass\n",
        group="dtbench.engines",
    )
    assert "my-engine" in ENGINES.names() and engine_for("my-engine").schedules is False
    monkeypatch.setenv("DTBENCH_DISABLE_PLUGINS", "1")
    for group, reg in ALL.items():
        found = reg.scan()
        assert all(e.builtin for e in found.entries.values()) and not found.refused and not found.ambiguous, group
    res = invoke("plugins")
    assert res.exit_code == 0 and "problems: none" in res.stdout and "plugin" not in res.stdout.split("problems")[0]


# --- issue 58 item 6: in-process registrations in the one registry; each group read once per process ------------


def test_a_format_registered_in_process_is_in_the_one_registry_and_listed(monkeypatch, tmp_path, request):
    """Before: ``@renderer`` wrote a second dict beside the registry, which ``dtbench plugins`` never saw."""
    from dtbench.reports.rendering import output

    monkeypatch.setattr(output, "RENDERERS", dict(output.RENDERERS))
    request.addfinalizer(lambda: FORMAT_REGISTRY.unregister("shout"))

    @output.renderer("shout")
    def shout(doc):
        return "LOUD"

    entry = FORMAT_REGISTRY.scan().entries["shout"]
    assert entry.in_process and entry.label == f"in-process {__name__}" and FORMAT_REGISTRY.get("shout") is shout
    assert output.rendered("shout", []) == "LOUD"
    res = invoke("plugins")
    assert res.exit_code == 0 and "problems: none" in res.stdout, res.output
    rows = [ln.split() for ln in res.stdout.splitlines() if ln.split()[:2] == ["dtbench.formats", "shout"]]
    assert rows == [["dtbench.formats", "shout", "in-process", __name__, "in-process", "ok"]]
    body = json.loads(invoke("plugins", "--format", "json").stdout)
    formats = next(r for r in body["registries"] if r["group"] == "dtbench.formats")
    assert [(e["distribution"], e["status"]) for e in formats["entries"] if e["name"] == "shout"] == [
        ("in-process", "ok")
    ]
    with pytest.raises(DtbenchError, match="^report format 'json' is a built-in name of dtbench"):
        FORMAT_REGISTRY.register("json", shout)
    with pytest.raises(DtbenchError, match="^report format 'cls' is <class 'int'>, not a renderer function"):
        FORMAT_REGISTRY.register("cls", int)
    install_plugin(
        monkeypatch,
        tmp_path / "site",
        "dtbench-shout",
        {"shout": "dtbench_shout:render"},
        "def render(d):\n    return 'x'\n",
        group="dtbench.formats",
    )
    ambiguous = f"report format 'shout' is registered by dtbench-shout 0.1 and in-process {__name__}"
    assert ambiguous in invoke("plugins").stdout
    FORMAT_REGISTRY.unregister("shout")
    assert FORMAT_REGISTRY.get("shout").__module__ == "dtbench_shout"  # the plugin's alone again


def test_each_entry_point_group_is_read_once_per_process(monkeypatch, tmp_path):
    """Before: validating a two-decoder suite read the entry points 22 times (a two-cell run 35 times, 13 ms each);
    now each group once, again only when ``sys.path`` changes or :meth:`Registry.refresh` is called."""
    import dtbench.registry as registry_module

    reads: list[str] = []
    real = registry_module.entry_points

    def counting(group: str):
        reads.append(group)
        return real(group=group)

    monkeypatch.setattr(registry_module, "entry_points", counting)
    monkeypatch.syspath_prepend(str(tmp_path / "empty"))  # a changed path: every group is read again
    decoders_ = [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}, {"name": "dynatree"}]
    suite = {**SUITE, "draft": {"model": "smollm2-135m", "dtype": "bfloat16"}, "decoders": decoders_}
    res = invoke("validate", write_suite(tmp_path, suite))
    assert res.exit_code == 0, res.output
    assert sorted(reads) == sorted(set(reads)) and set(reads) <= set(ALL)
    assert invoke("validate", write_suite(tmp_path, suite)).exit_code == 0
    assert len(reads) == len(set(reads))  # the second command in this process reads nothing
    monkeypatch.syspath_prepend(str(tmp_path))  # a folder on the path may hold a new distribution: read again
    decoders.DECODERS.scan()
    assert reads.count("dtbench.decoders") == 2
    decoders.DECODERS.refresh()
    decoders.DECODERS.scan()
    assert reads.count("dtbench.decoders") == 3


def test_a_distribution_installed_into_a_folder_already_on_the_path_is_seen(monkeypatch, tmp_path):
    """CI (stop 60): a session fixture ``pip install``-ed the example plugin into site-packages after another test
    of the same worker had scanned the group; the kept scan (keyed on ``sys.path`` alone) hid it. The key holds the
    path folders' modification times, so the next scan reads the group again."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    assert "late_decoder" not in decoders.discover()
    path_before = list(sys.path)
    (root / "late_plugin.py").write_text("from dtbench.decoders.ar import Autoregressive as Late\n")
    info = root / "late_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dtbench.decoders]\nlate_decoder = late_plugin:Late\n")
    assert sys.path == path_before  # the same path: only a folder on it changed, as pip install changes one
    entry = decoders.discover()["late_decoder"]
    assert entry.distribution == "late-plugin"
