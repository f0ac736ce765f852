"""The package's import graph (issue 18, item 4): no cycles, counting imports inside functions; no module imports
another module's private names (``from m import _x`` or ``m._x``).

Parsed with :mod:`ast` from the source files, so an import hidden in a function body counts like a top-level one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "decoders", "reports", "cli", "gpucheck")  # folder -> dtbench.<folder> (pyproject's package-dir)
CORE = ("core", "registry", "api")  # dtbench/<name>.py -> dtbench.<name>
MIGRATIONS = Path("harness", "store", "migrations")  # Alembic loads env.py and versions/ by path: data, not modules


def modules() -> dict[str, Path]:
    """dtbench module name -> source file (Alembic's migration scripts are data files, not modules; the migrations'
    baseline module is one)."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT)
            if rel == MIGRATIONS / "env.py" or MIGRATIONS / "versions" in rel.parents:
                continue
            parts = [pkg, *f.relative_to(ROOT / pkg).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["dtbench", *parts])] = f
    for name in CORE:
        out[f"dtbench.{name}"] = ROOT / "dtbench" / f"{name}.py"
    for f in sorted((ROOT / "dtbench" / "testing").glob("*.py")):  # the conformance kit's public home
        out["dtbench.testing" if f.stem == "__init__" else f"dtbench.testing.{f.stem}"] = f
    return out


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> dtbench modules it imports anywhere in its body, private names imported across modules)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[str] = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> dtbench module bound to it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        edges[name].add(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in mods:
                        edges[name].add(full)
                        aliases[a.asname or a.name] = full
                    elif node.module in mods:
                        edges[name].add(node.module)
                        if a.name.startswith("_"):
                            private.append(f"{name}: from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                private.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
        edges[name].discard(name)
    return edges, private


def with_packages(edges: dict[str, set[str]], mods: dict[str, Path]) -> dict[str, set[str]]:
    """``edges`` plus the imports Python makes implicitly: importing ``a.b.c`` first runs the packages ``a.b`` (its
    ``__init__``), so a module importing ``a.b.c`` depends on ``a.b`` too, unless it sits inside that package (a
    package's ``__init__`` importing its own submodules is no cycle). Issue 58 item 6: ``decoders/kv.py`` imported
    ``decoders/tree/structure.py`` inside a function, whose package ``__init__`` imports ``kv`` back."""
    out = {m: set(ts) for m, ts in edges.items()}
    for m, ts in edges.items():
        for t in ts:
            parts = t.split(".")
            for i in range(2, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg in mods and pkg != m and not m.startswith(pkg + "."):
                    out[m].add(pkg)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_cycles_through_function_imports():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_reads_imports_inside_functions(tmp_path):
    pkg = tmp_path / "harness"
    pkg.mkdir()
    (pkg / "one.py").write_text("def f():\n    from dtbench.harness import two\n    return two._hidden\n")
    (pkg / "two.py").write_text("from dtbench.harness.one import _x\n")
    mods = {"dtbench.harness.one": pkg / "one.py", "dtbench.harness.two": pkg / "two.py"}
    edges, private = imports(mods)
    assert edges["dtbench.harness.one"] == {"dtbench.harness.two"}
    assert cycles(edges) == [["dtbench.harness.one", "dtbench.harness.two"]]
    assert sorted(private) == [
        "dtbench.harness.one: dtbench.harness.two._hidden",
        "dtbench.harness.two: from dtbench.harness.one import _x",
    ]


def test_the_checker_sees_cycles_through_a_packages_init(tmp_path):
    """Issue 58 item 6: ``kv -> tree.structure`` (in a function) closes a cycle through ``tree/__init__``, which
    imports ``tree.draft``, which imports ``kv``; a package's ``__init__`` importing its own submodules does not."""
    (tmp_path / "tree").mkdir()
    files = {
        "kv.py": "def f():\n    from dtbench.decoders.tree.structure import kind\n",
        "tree/__init__.py": "from dtbench.decoders.tree.draft import x\nfrom dtbench.decoders.tree.structure import kind\n",
        "tree/draft.py": "from dtbench.decoders import kv\nfrom dtbench.decoders.tree.structure import kind\n",
        "tree/structure.py": "kind = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    mods = {
        "dtbench.decoders.kv": tmp_path / "kv.py",
        "dtbench.decoders.tree": tmp_path / "tree" / "__init__.py",
        "dtbench.decoders.tree.draft": tmp_path / "tree" / "draft.py",
        "dtbench.decoders.tree.structure": tmp_path / "tree" / "structure.py",
    }
    edges, _ = imports(mods)
    assert cycles(edges) == []  # the explicit edges alone miss it
    assert cycles(with_packages(edges, mods)) == [
        ["dtbench.decoders.kv", "dtbench.decoders.tree", "dtbench.decoders.tree.draft"]
    ]


def test_no_import_cycles():
    """No cycle, counting imports inside functions and the package ``__init__`` each import runs first."""
    mods = modules()
    edges, _ = imports(mods)
    assert len(edges) > 50
    assert cycles(with_packages(edges, mods)) == []


def test_the_kv_caches_import_nothing_from_the_tree_toolkit():
    """Issue 58 item 6: the caches read the mask kind from dtbench.decoders.modelinfo, at module level."""
    edges, _ = imports(modules())
    caches = ("dtbench.decoders.kv", "dtbench.decoders.static_kv", "dtbench.decoders.draft_region")
    assert [f"{m} -> {t}" for m in caches for t in edges[m] if t.startswith("dtbench.decoders.tree")] == []


def test_no_module_imports_another_modules_private_names():
    _, private = imports(modules())
    assert private == []


def test_harness_imports_nothing_from_reports_or_cli():
    edges, _ = imports(modules())
    bad = [
        f"{m} -> {t}"
        for m, ts in edges.items()
        if m.startswith("dtbench.harness.")
        for t in ts
        if t.startswith(("dtbench.reports", "dtbench.cli"))
    ]
    assert bad == []


def test_decoders_import_nothing_from_the_harness_reports_or_cli():
    """Decoders sit on the torch-free core only: a corpus is declared (dtbench.core.CorpusSpec) and injected by the
    harness, never loaded by a decoder."""
    edges, _ = imports(modules())
    bad = [
        f"{m} -> {t}"
        for m, ts in edges.items()
        if m.startswith("dtbench.decoders")
        for t in ts
        if t.startswith(("dtbench.harness", "dtbench.reports", "dtbench.cli", "dtbench.api"))
    ]
    assert bad == []


def test_the_core_imports_no_other_dtbench_module():
    edges, _ = imports(modules())
    assert edges["dtbench.core"] == set()


def test_reports_read_the_database_not_the_registry_or_calibration():
    """Reports read the database; the documented exceptions: the tuning line's decoder defaults (reports/pricing/tuning.py
    default_params) name installed decoders' params, and the schedule report states a schedule in an engine's terms,
    which its adapter knows (reports/pricing/schedule.py, dtbench.decoders.engines; issue 40)."""
    edges, _ = imports(modules())
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in edges.items()
        if m.startswith("dtbench.reports")
        for t in ts
        if t
        in (
            "dtbench.harness.registry",
            "dtbench.harness.calibration.calibrate",
            "dtbench.harness.calibration.calibrate_run",
            "dtbench.harness.suites.plan",
            "dtbench.harness.execution.worker",
            "dtbench.harness.measurement.cells",
            "dtbench.harness.measurement.hardware",
            "dtbench.harness.measurement.local_measurer",
            "dtbench.harness.models.loading",
        )
        or t.startswith("dtbench.decoders")
    )
    assert bad == [
        "dtbench.reports.pricing.schedule -> dtbench.decoders.engines",
        "dtbench.reports.pricing.tuning -> dtbench.harness.registry",
    ]


def test_serving_is_a_package_by_its_seams():
    """harness/serving (issue 40, issue 49): the traffic model and the params import no other part of it; the servers'
    processes only the params; the output check and the request record the processes' error (the check the params
    too); the client the rest but the measurer, which stands on the client. Engines are adapters in the decoder layer
    (dtbench.decoders.engines), which imports nothing of the server entry (the params live beside the adapters)."""
    edges, _ = imports(modules())
    serving = "dtbench.harness.serving"
    inside = {
        m: sorted(t for t in ts if t.startswith(serving + ".")) for m, ts in edges.items() if m.startswith(serving)
    }
    assert inside[f"{serving}.params"] == [] and inside[f"{serving}.traffic"] == []
    assert inside[f"{serving}.process"] == [f"{serving}.params"]
    assert inside[f"{serving}.check"] == [f"{serving}.params", f"{serving}.process"]
    assert inside[f"{serving}.record"] == [f"{serving}.process"]
    assert inside[f"{serving}.failures"] == [f"{serving}.process", f"{serving}.record"]  # issue 59 item 7
    assert inside[f"{serving}.client"] == [
        f"{serving}.check",
        f"{serving}.failures",
        f"{serving}.params",
        f"{serving}.process",
        f"{serving}.record",
        f"{serving}.traffic",
    ]
    assert inside[f"{serving}.measurer"] == [f"{serving}.client", f"{serving}.params", f"{serving}.process"]
    engines = [t for m, ts in edges.items() if m.startswith("dtbench.decoders.engines") for t in ts]
    assert "dtbench.decoders.server" not in engines and not any(t.startswith("dtbench.harness") for t in engines)


def test_store_is_a_package_by_its_seams():
    """harness/store (issue 40 item 3): the results database, apart from the serving engines. Database URLs and
    engines import no other part of it; the schema versions only those and the migrations' frozen baseline; the ORM
    models both; run rows the models. It stands on the harness's leaf modules, never on the serving package, the
    decoders (whose engines are serving engines), reports or the CLI; serving writes no rows itself."""
    mods = modules()
    edges, _ = imports(mods)
    store = "dtbench.harness.store"
    assert "dtbench.harness.engines" not in mods and "dtbench.harness.db" not in mods  # one name, one meaning
    assert {m for m in mods if m.startswith(store + ".")} == {
        f"{store}.db",
        f"{store}.engines",
        f"{store}.migrations.baseline",
        f"{store}.runs",
        f"{store}.schema",
    }
    inside = {m: sorted(t for t in ts if t.startswith(store + ".")) for m, ts in edges.items() if m.startswith(store)}
    assert inside[f"{store}.engines"] == [] and inside[f"{store}.migrations.baseline"] == []
    assert inside[f"{store}.schema"] == [f"{store}.engines", f"{store}.migrations.baseline"]
    assert inside[f"{store}.db"] == [f"{store}.engines", f"{store}.schema"]
    assert inside[f"{store}.runs"] == [f"{store}.db"]
    outside = sorted({t for m, ts in edges.items() if m.startswith(store) for t in ts if not t.startswith(store)})
    assert outside == [
        "dtbench.core",
        "dtbench.harness.errors",
        "dtbench.harness.safetext",
        "dtbench.harness.suites.bounds",
        "dtbench.harness.suites.suitefile",
    ]
    serving = "dtbench.harness.serving"
    assert not [f"{m} -> {t}" for m, ts in edges.items() if m.startswith(serving) for t in ts if t.startswith(store)]


def test_the_example_plugin_imports_only_the_public_api():
    src = ROOT / "examples" / "dtbench-prompt-lookup" / "src"
    used = set()
    for f in src.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtbench"):
                used.add(node.module)
            elif isinstance(node, ast.Import):
                used.update(a.name for a in node.names if a.name.startswith("dtbench"))
    assert used == {"dtbench.api"}


def test_the_api_declares_what_it_exports():
    import dtbench.api as api

    assert sorted(set(api.__all__)) == sorted(api.__all__)
    assert all(hasattr(api, name) for name in api.__all__)
    assert (ROOT / "dtbench" / "py.typed").is_file()


def _fresh_import(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return set(out.stdout.split())


def test_loading_a_suite_imports_no_torch(tmp_path):
    """The suite schema and loader (validate's first step) load without torch; checking decoder params may import
    it, reading and validating the suite's own schema does not."""
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\ndatasets: [{name: wikitext-2, prompts: 2, warmup: 0, L_max: 16}]\n"
        "generation_lengths: [4]\ndecoders: [{name: ar}]\n"
    )
    loaded = _fresh_import(f"from dtbench.harness.suites.suitefile import load_suite\nload_suite({str(suite)!r})")
    assert "dtbench.harness.suites.suite" in loaded and "torch" not in loaded
    assert "torch" not in _fresh_import("import dtbench.core")


def test_the_torch_check_can_fail():
    assert "torch" in _fresh_import("import dtbench.decoders.base")


def test_the_registry_imports_nothing_above_the_core():
    """Issue 68 item 5: ``dtbench/registry.py`` imports ``dtbench.core`` only and names no dtbench module to import at
    run time; the bound on plugins' imports is the guard the harness installs (plugin_probe.install), found here."""
    edges, _ = imports(modules())
    assert edges["dtbench.registry"] <= {"dtbench.core"}
    assert "import_module(" not in (ROOT / "dtbench" / "registry.py").read_text()
    code = (
        "import dtbench.registry as r; assert not r._GUARD, 'installed before the harness';"
        "import dtbench.harness; g = r._GUARD[0];"
        "from dtbench.harness.execution import plugin_probe as p; assert g.probe is p.bounded_import, g"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]  # every harness user gets the guard, the core alone none
