"""The serving layer's boundary (issue 49 item 4).

- The serving layer is ``harness/serving/``, the ``server`` entry (``decoders/server.py``) and the engine adapters
  (``decoders/engines/``): no module outside it imports :mod:`dtbench.decoders.server` (a server cell's params are
  :mod:`dtbench.harness.serving.params`'s, defined beside the adapters).
- Reports tell a served cell by what is stored (``cells.measurer``), never by its params' names: no module of
  ``reports/`` reads a server's param names (``base_url``, ``launch``, a params' ``engine``) as a family test.
- Launch placeholders of an engine are its adapter's: no code of the harness, reports or CLI spells
  ``{llama_server}`` (docstrings may mention it).

Parsed with :mod:`ast`, so an import inside a function counts (:mod:`test_import_graph`'s reader).
"""

from __future__ import annotations

import ast

from test_import_graph import ROOT, imports, modules

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

SERVING_LAYER = ("dtbench.harness.serving", "dtbench.decoders.server", "dtbench.decoders.engines")
SERVER_NAMES = {"base_url", "launch"}  # params only a server has


def _in_serving_layer(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in SERVING_LAYER)


def outside_imports(edges: dict[str, set[str]]) -> list[str]:
    """``module -> dtbench.decoders.server`` for every module outside the serving layer that imports it."""
    return sorted(
        f"{m} -> dtbench.decoders.server"
        for m, targets in edges.items()
        if "dtbench.decoders.server" in targets and not _in_serving_layer(m)
    )


def _params_like(node: ast.AST) -> bool:
    """An expression that names params (``params``, ``c.params``, ``cell["params"]``, ``p``-style names aside)."""
    text = ast.unparse(node)
    return "params" in text


def server_name_tests(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` reads a server's param names: any ``"base_url"`` / ``"launch"`` string, and a params'
    ``"engine"`` key (``params["engine"]``, ``params.get("engine")``, ``"engine" in params``, a tuple of keys holding
    ``"engine"`` beside a server name). Each as ``file:line: code``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        hit = False
        if isinstance(node, ast.Constant) and node.value in SERVER_NAMES:
            hit = True
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            hit = node.slice.value == "engine" and _params_like(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            first = node.args[0] if node.args else None
            hit = isinstance(first, ast.Constant) and first.value == "engine" and _params_like(node.func.value)
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and node.left.value == "engine":
            hit = any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and _params_like(node.comparators[0])
        if hit:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_serving_layer_imports_the_server_entry():
    edges, _ = imports(modules())
    assert outside_imports(edges) == []


def test_the_import_check_sees_an_outside_import():
    edges = {
        "dtbench.harness.measurement.cells": {"dtbench.decoders.server"},
        "dtbench.harness.serving.client": {"dtbench.decoders.server"},
        "dtbench.decoders.engines.params": {"dtbench.decoders.base"},
    }
    assert outside_imports(edges) == ["dtbench.harness.measurement.cells -> dtbench.decoders.server"]


def test_reports_do_not_tell_a_server_by_its_param_names():
    found = []
    for path in sorted((ROOT / "reports").rglob("*.py")):
        found += server_name_tests(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


def test_the_name_check_sees_the_old_family_test():
    """The test reports used before issue 49 (reports/stats.py: SERVER_PARAMS), and its usual variants, are caught."""
    old = (
        "SERVER_PARAMS = ('engine', 'base_url', 'launch')\n"
        "def served(params):\n"
        "    return any(isinstance(params.get(k), (str, list)) for k in SERVER_PARAMS)\n"
    )
    assert len(server_name_tests(old)) == 2
    assert server_name_tests("x = cell.params.get('engine') is not None") != []
    assert server_name_tests("x = 'engine' in c.params") != []
    assert server_name_tests("x = row['params']['engine']") != []
    assert server_name_tests("meta = {'engine': name}") == []  # a report's own field named engine is fine


def code_strings(source: str) -> list[tuple[int, str]]:
    """(line, value) of every string constant of ``source`` that is not a docstring or other bare expression."""
    tree = ast.parse(source)
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in bare
    ]


def test_engine_placeholders_belong_to_their_adapter():
    """``{llama_server}`` is the llama.cpp adapter's (decoders/engines/llama_cpp.py); the harness resolves every
    engine's placeholders through the adapter (harness/serving/params.py: launch_argv)."""
    holders = sorted(
        f"{p.relative_to(ROOT)}:{line}"
        for folder in ("harness", "reports", "cli")
        for p in (ROOT / folder).rglob("*.py")
        for line, value in code_strings(p.read_text())
        if "{llama_server}" in value
    )
    assert holders == []
    assert "{llama_server}" in [v for _, v in code_strings((ROOT / "decoders/engines/llama_cpp.py").read_text())]


def test_the_server_entry_cannot_run_as_a_decoder():
    """A served entry declares; it has no generate (abstract), so nothing can instantiate it as a decoder."""
    import inspect

    from dtbench.decoders.server import Server
    from dtbench.harness.measurement.measurers import measurer_name

    assert inspect.isabstract(Server) and "generate" in Server.__abstractmethods__
    assert measurer_name(Server) == "served"
